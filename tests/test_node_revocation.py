"""A provider revokes a node key of its own (a machine stolen or compromised): the node is banned
for good and ejected from its pools, as an admin's ban ejects it, in one transaction."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError

from orchestrator.admin import service as admin_service
from orchestrator.admin.tokens import Principal, Role
from orchestrator.core.clock import FakeClock
from orchestrator.core.keys import generate_key, key_id_of
from orchestrator.identity import revocation
from orchestrator.identity.models import Node
from orchestrator.tasks.models import Assignment, Submission
from orchestrator.worker.client import WorkerClient
from tests.conftest import Contributor, new_contributor, postgres_only, problem
from tests.pools_helpers import active_pool, join
from tests.tasks_helpers import Worker, pool_setup, task
from tests.test_ban_ejects import assert_taken_out, audit, statuses, transfers
from tests.test_verification import one_lease
from tests.verification_helpers import balances, books_balance, submit, verdicts, verify_all
from tests.waits import until_waiting

pytestmark = pytest.mark.usefixtures("no_audits")

ECON = {
    "min_stake_per_node": 1000,
    "unbonding_period_s": 86_400,
    "reward_per_sample": 7,
    "reward_hold_s": 3600,
    "fraud_slash_amount": 200,
}
ADMIN = Principal(token_id="tok_test_admin", name="admin", role=Role.admin)


def revoke_url(node_id: str) -> str:
    return f"/v1/providers/me/nodes/{node_id}/revoke"


async def revoke(client: httpx.AsyncClient, c: Contributor, node_id: str, **body: Any) -> httpx.Response:
    """Signed by ``c``'s provider key, with ``body`` as the JSON body if any."""
    return await client.post(revoke_url(node_id), json=body or None, auth=c.provider_auth)


async def admin_view(s: Any, node_id: str) -> dict[str, Any]:
    r = await s.admin.get(f"/v1/admin/nodes/{node_id}", headers=s.admin_headers)
    assert r.status_code == 200, r.text
    return dict(r.json())


async def test_a_revoked_node_is_banned_ejected_and_its_leases_go_back_to_the_pool_at_once(
    app: Any, app_state: Any, client: Any, clock: FakeClock
) -> None:
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1500) as s:
        [stolen] = s.workers
        bystander = await s.add_worker(stake=1000)
        # A second pool that admits by approval: the stolen node's membership there is pending.
        other = await active_pool(
            s.admin, s.headers, admission="approval", economics={"min_stake_per_node": 500}
        )
        assert (await join(stolen.client, stolen.contributor, other["id"])).json()["status"] == "pending"
        await s.enqueue([task()], key="one")
        [lease] = (await stolen.claim(s.pool_id)).json()["leases"]
        seen = (await admin_view(s, stolen.node_id))["last_heartbeat_at"]
        assert seen is not None

        r = await revoke(client, stolen.contributor, stolen.node_id, reason="laptop stolen")
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["id"] == stolen.node_id and out["status"] == "banned"
        assert dt.datetime.fromisoformat(out["revoked_at"]) == clock.utcnow()
        assert out["ejected_from"] == sorted([s.pool_id, other["id"]])
        assert {m["pool_id"]: m["status"] for m in out["memberships"]} == {
            s.pool_id: "ejected",
            other["id"]: "ejected",
        }

        # Every request its key signs is refused as a banned node's.
        problem(await stolen.claim(s.pool_id), 403, "node_banned")
        problem(await stolen.submit(lease), 403, "node_banned")
        problem(await stolen.beat(), 403, "node_banned")
        problem(
            await stolen.client.get("/v1/nodes/me", auth=stolen.contributor.node_auth), 403, "node_banned"
        )
        problem(await join(stolen.client, stolen.contributor, s.pool_id), 403, "node_banned")
        # Its lease was released and its task reissued to another node at once; the active
        # membership's stake unbonds over the pool's period, the pending one's is back.
        await assert_taken_out(s, app_state, client, clock, stolen, bystander, lease)
        assert await statuses(s, s.pool_id) == {stolen.node_id: "ejected", bystander.node_id: "active"}

        # The hot store forgot the node; its views keep its last beat and show the revocation.
        assert await app_state.hot_store.last_beat(stolen.node_id) is None
        view = await admin_view(s, stolen.node_id)
        assert (view["status"], view["revoked_at"], view["last_heartbeat_at"]) == (
            "banned",
            out["revoked_at"],
            seen,
        )
        assert view["ban_reason"] == "revoked by its provider: laptop stolen"
        latest = view["status_history"][0]
        assert (latest["to_status"], latest["actor"]) == ("banned", stolen.contributor.provider_id)
        assert latest["reason"] == "revoked by its provider: laptop stolen"
        r = await s.admin.get(
            "/v1/admin/nodes",
            params={"provider_id": stolen.contributor.provider_id},
            headers=s.admin_headers,
        )
        assert [(n["id"], n["revoked_at"]) for n in r.json()["items"]] == [
            (stolen.node_id, out["revoked_at"])
        ]
        r = await s.admin.get(f"/v1/admin/nodes/{bystander.node_id}", headers=s.admin_headers)
        assert r.json()["revoked_at"] is None

        # Audited, with the provider as the actor, as are the ejections it made.
        [entry] = await audit(s, "node.revoke")
        assert (entry["actor"], entry["actor_role"]) == (stolen.contributor.provider_id, "provider")
        assert (entry["target_type"], entry["target_id"]) == ("node", stolen.node_id)
        assert entry["before"] == {"status": "healthy", "ban_reason": None}
        assert entry["after"]["ejected_from"] == out["ejected_from"]
        assert entry["after"]["reason"] == "laptop stolen"
        ejections = await audit(s, "membership.eject")
        assert sorted(e["pool_id"] for e in ejections) == out["ejected_from"]
        assert {(e["actor"], e["actor_role"]) for e in ejections} == {
            (stolen.contributor.provider_id, "provider")
        }
        r = await s.admin.get(
            "/v1/admin/audit", params={"actor": stolen.contributor.provider_id}, headers=s.admin_headers
        )
        assert {e["action"] for e in r.json()["items"]} == {"node.revoke", "membership.eject"}
    await books_balance(app_state)


async def test_revoking_a_revoked_node_answers_its_record_and_changes_nothing(
    app: Any, app_state: Any, client: Any
) -> None:
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000) as s:
        [w] = s.workers
        first = await revoke(client, w.contributor, w.node_id)  # no body: no reason
        assert first.status_code == 200, first.text
        assert first.json()["ejected_from"] == [s.pool_id]
        moved = await transfers(app_state)
        history = (await admin_view(s, w.node_id))["status_history"]

        for body in ({}, {"reason": "again"}):
            again = await revoke(client, w.contributor, w.node_id, **body)
            assert again.status_code == 200, again.text
            assert again.json() == first.json()
        assert await transfers(app_state) == moved
        assert (await admin_view(s, w.node_id))["status_history"] == history
        assert len(await audit(s, "node.revoke")) == 1
        assert len(await audit(s, "membership.eject")) == 1
        assert (await admin_view(s, w.node_id))["ban_reason"] == "revoked by its provider"


async def test_another_providers_node_is_not_found_as_an_unknown_one_is(
    app: Any, app_state: Any, client: Any
) -> None:
    async with pool_setup(app, app_state, workers=1) as s:
        [w] = s.workers
        thief = new_contributor()
        await thief.register(client)
        theirs = problem(await revoke(client, thief, w.node_id), 404, "node_not_found")
        unknown = problem(await revoke(client, thief, key_id_of(generate_key())), 404, "node_not_found")
        assert theirs["detail"] == unknown["detail"]
        # Even the provider's own node key (no provider) cannot: it is not a provider key.
        r = await client.post(revoke_url(w.node_id), auth=w.contributor.node_auth)
        problem(r, 401, "unknown_key")
        # A path that cannot be a node id is the same 404.
        problem(await revoke(client, w.contributor, "not-a-key"), 404, "node_not_found")

        assert (await admin_view(s, w.node_id))["status"] == "healthy"
        assert await statuses(s, s.pool_id) == {w.node_id: "active"}
        assert await audit(s, "node.revoke") == []
        assert (await w.claim(s.pool_id)).status_code == 200


@pytest.mark.parametrize(
    "body",
    [
        {"reason": ""},
        {"reason": "x" * 501},
        {"reason": "nul\x00"},
        {"reason": 5},
        {"why": "stolen"},
        [],
    ],
    ids=["empty", "too-long", "nul", "number", "unknown-field", "not-an-object"],
)
async def test_a_body_that_does_not_validate_is_refused_and_changes_nothing(
    app: Any, app_state: Any, client: Any, body: Any
) -> None:
    async with pool_setup(app, app_state, workers=1) as s:
        [w] = s.workers
        r = await client.post(revoke_url(w.node_id), json=body, auth=w.contributor.provider_auth)
        problem(r, 422, "validation_failed")
        view = await admin_view(s, w.node_id)
        assert (view["status"], view["revoked_at"]) == ("healthy", None)
        assert await audit(s, "node.revoke") == []
        assert (await w.claim(s.pool_id)).status_code == 200


async def test_an_admin_cannot_unban_a_revoked_node(app: Any, app_state: Any, client: Any) -> None:
    async with pool_setup(app, app_state, workers=1) as s:
        [w] = s.workers
        assert (await revoke(client, w.contributor, w.node_id)).status_code == 200
        r = await s.admin.post(f"/v1/admin/nodes/{w.node_id}/unban", headers=s.admin_headers)
        body = problem(r, 409, "node_revoked")
        assert "register a new node key" in body["detail"]
        assert (await admin_view(s, w.node_id))["status"] == "banned"
        assert await statuses(s, s.pool_id) == {w.node_id: "ejected"}
        assert await audit(s, "node.unban") == []
        problem(await w.beat(), 403, "node_banned")
        # A ban of it changes nothing either (it is banned).
        r = await s.admin.post(
            f"/v1/admin/nodes/{w.node_id}/ban", json={"reason": "x"}, headers=s.admin_headers
        )
        assert r.status_code == 200 and r.json()["revoked_at"] is not None
        assert await audit(s, "node.ban") == []


async def test_the_database_keeps_a_revoked_node_banned(app: Any, app_state: Any, client: Any) -> None:
    async with pool_setup(app, app_state, workers=1) as s:
        [w] = s.workers
        assert (await revoke(client, w.contributor, w.node_id)).status_code == 200
        with pytest.raises(IntegrityError):
            async with app_state.sessionmaker() as session, session.begin():
                await session.execute(update(Node).where(Node.id == w.node_id).values(status="waiting"))


async def test_a_revoked_key_cannot_register_again_whatever_the_attestation(
    app: Any, app_state: Any, client: Any
) -> None:
    async with pool_setup(app, app_state, workers=1) as s:
        [w] = s.workers
        c = w.contributor
        assert (await revoke(client, c, c.node_id)).status_code == 200
        other = new_contributor()
        await other.register(client)
        thief = Contributor(provider_key=other.provider_key, node_key=c.node_key)
        for body in (
            c.node_body(),  # its own provider's attestation, as the worker sends it
            c.node_body(version="9.9.9", attestation="A" * 86),  # one that does not verify
            thief.node_body(),  # attested by another provider
            c.node_body(provider_id=key_id_of(generate_key())),  # a provider never registered
        ):
            r = await w.client.post("/v1/nodes", json=body, auth=c.node_auth)
            assert "new node key" in problem(r, 403, "node_key_revoked")["detail"]
        view = await admin_view(s, c.node_id)
        assert (view["status"], view["provider_id"], view["version"]) == ("banned", c.provider_id, "0.1.0")

        # The provider goes on with a new node key on the machine.
        fresh = Contributor(provider_key=c.provider_key, node_key=generate_key())
        r = await w.client.post("/v1/nodes", json=fresh.node_body(), auth=fresh.node_auth)
        assert r.status_code == 201 and r.json()["revoked_at"] is None, r.text


async def test_revoking_a_node_an_admin_banned_makes_the_ban_final(
    app: Any, app_state: Any, client: Any
) -> None:
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000) as s:
        [w] = s.workers
        r = await s.admin.post(
            f"/v1/admin/nodes/{w.node_id}/ban", json={"reason": "odd results"}, headers=s.admin_headers
        )
        assert r.status_code == 200, r.text
        moved = await transfers(app_state)

        r = await revoke(client, w.contributor, w.node_id, reason="compromised")
        assert r.status_code == 200, r.text
        assert (r.json()["status"], r.json()["ejected_from"]) == ("banned", [])
        assert r.json()["revoked_at"] is not None
        assert await transfers(app_state) == moved  # the ban's ejections stay as they were
        assert await statuses(s, s.pool_id) == {w.node_id: "ejected"}
        assert len(await audit(s, "membership.eject")) == 1
        view = await admin_view(s, w.node_id)
        assert view["ban_reason"] == "odd results"
        latest = view["status_history"][0]
        assert (latest["from_status"], latest["to_status"], latest["reason"], latest["actor"]) == (
            "banned",
            "banned",
            "revoked by its provider: compromised",
            w.contributor.provider_id,
        )
        [entry] = await audit(s, "node.revoke")
        assert entry["before"] == {"status": "banned", "ban_reason": "odd results"}
        assert entry["after"]["ejected_from"] == []
        problem(
            await s.admin.post(f"/v1/admin/nodes/{w.node_id}/unban", headers=s.admin_headers),
            409,
            "node_revoked",
        )
        # Revoking it again answers the same.
        assert (await revoke(client, w.contributor, w.node_id)).json() == r.json()


async def test_results_submitted_before_the_revocation_are_judged_as_usual(
    app: Any, app_state: Any, client: Any
) -> None:
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000) as s:
        [w] = s.workers
        await submit(w, await one_lease(s, w), ["4"])  # honest
        await submit(w, await one_lease(s, w), ["5"], claimed_reward=1.0)  # forged
        assert (await revoke(client, w.contributor, w.node_id)).status_code == 200
        assert (await balances(client, w))["stake_unbonding"] == 1000

        await verify_all(app_state)
        vs = sorted(await verdicts(s.admin, s.headers, s.pool_id), key=lambda v: v["id"])
        assert [(v["category"], v["slashed_amount"]) for v in vs] == [("valid", 0), ("fraud", 200 + 7)]
        # The provider's stake answers for the forged one, from the stake unbonding.
        b = await balances(client, w)
        assert (b["stake_unbonding"], b["rewards_pending"]) == (800, 0)
        async with app_state.sessionmaker() as session:
            assert await session.scalar(select(func.count()).select_from(Submission)) == 2
    await books_balance(app_state)


async def test_the_sdk_revokes_a_node_with_the_provider_key_alone(app: Any, app_state: Any) -> None:
    async with pool_setup(app, app_state, workers=1) as s:
        [w] = s.workers
        transport = httpx.ASGITransport(app=app, client=("203.0.113.9", 40000))
        async with WorkerClient(
            "http://testserver", None, w.contributor.provider_key, transport=transport
        ) as provider:
            out = await provider.revoke_node(w.node_id, reason="sold the machine")
            assert (out.id, out.status, out.ejected_from) == (w.node_id, "banned", [s.pool_id])
            assert out.revoked_at is not None
            assert await provider.revoke_node(w.node_id) == out
        [entry] = await audit(s, "node.revoke")
        assert entry["after"]["reason"] == "sold the machine"


async def test_a_revocation_and_its_ejections_commit_together(
    app: Any, app_state: Any, client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from orchestrator.pools import service as pools_service

    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000) as s:
        [w] = s.workers

        async def broken(*args: Any, **kwargs: Any) -> int:
            raise RuntimeError("lease release failed")

        monkeypatch.setattr(pools_service, "release_member_leases", broken)
        with pytest.raises(RuntimeError):
            await revoke(client, w.contributor, w.node_id)
        view = await admin_view(s, w.node_id)
        assert (view["status"], view["revoked_at"]) == ("healthy", None)
        assert await statuses(s, s.pool_id) == {w.node_id: "active"}
        assert await app_state.hot_store.last_beat(w.node_id) is not None
        assert await audit(s, "node.revoke") == []


# ------------------------------------------------------------------ races (PostgreSQL's row locks)


async def _revoking(app_state: Any, w: Worker) -> Any:
    """A session whose open transaction has revoked ``w``'s node (not committed)."""
    session = app_state.sessionmaker()
    await session.begin()
    await revocation.revoke_node(session, app_state, w.contributor.provider_id, w.node_id, "stolen")
    return session


@postgres_only
async def test_a_claim_racing_a_revocation_of_its_node_waits_and_is_refused(app: Any, app_state: Any) -> None:
    async with pool_setup(app, app_state, workers=1) as s:
        [w] = s.workers
        await s.enqueue([task()], key="one")
        session = await _revoking(app_state, w)
        try:
            claiming = asyncio.create_task(w.claim(s.pool_id))
            await until_waiting(app_state, 1, claiming, on="row")
            assert not claiming.done()
            await session.commit()
        finally:
            await session.close()
        problem(await claiming, 403, "node_banned")
        async with app_state.sessionmaker() as check:
            assert await check.scalar(select(func.count()).select_from(Assignment)) == 0


@postgres_only
async def test_a_result_racing_a_revocation_of_its_node_waits_and_records_nothing(
    app: Any, app_state: Any
) -> None:
    async with pool_setup(app, app_state, workers=1) as s:
        [w] = s.workers
        await s.enqueue([task()], key="one")
        [lease] = (await w.claim(s.pool_id)).json()["leases"]
        session = await _revoking(app_state, w)  # it holds the lease, released
        try:
            submitting = asyncio.create_task(w.submit(lease))
            await until_waiting(app_state, 1, submitting, on="row")
            assert not submitting.done()
            await session.commit()
        finally:
            await session.close()
        r = await submitting
        assert 400 <= r.status_code < 500, r.text
        async with app_state.sessionmaker() as check:
            assert await check.scalar(select(func.count()).select_from(Submission)) == 0
            assignment = await check.get(Assignment, lease["assignment_id"])
            assert assignment is not None and assignment.status == "released"
        problem(await w.submit(lease), 403, "node_banned")


@postgres_only
async def test_a_ban_racing_a_revocation_waits_for_it_and_changes_nothing(app: Any, app_state: Any) -> None:
    async with pool_setup(app, app_state, workers=1) as s:
        [w] = s.workers
        session = await _revoking(app_state, w)
        try:
            banning = asyncio.create_task(
                s.admin.post(
                    f"/v1/admin/nodes/{w.node_id}/ban", json={"reason": "x"}, headers=s.admin_headers
                )
            )
            await until_waiting(app_state, 1, banning, on="row")
            assert not banning.done()
            await session.commit()
        finally:
            await session.close()
        r = await banning
        assert r.status_code == 200 and r.json()["revoked_at"] is not None, r.text
        assert await audit(s, "node.ban") == []
        assert [e["actor"] for e in await audit(s, "membership.eject")] == [w.contributor.provider_id]
        view = await admin_view(s, w.node_id)
        assert view["ban_reason"] == "revoked by its provider: stolen"


@postgres_only
async def test_a_revocation_racing_a_ban_waits_for_it_and_makes_it_final(app: Any, app_state: Any) -> None:
    async with pool_setup(app, app_state, workers=1) as s:
        [w] = s.workers
        session = app_state.sessionmaker()
        await session.begin()
        try:
            await admin_service.ban(session, app_state, w.node_id, "sybil", principal=ADMIN)
            revoking = asyncio.create_task(revoke(s.admin, w.contributor, w.node_id))
            await until_waiting(app_state, 1, revoking, on="row")
            assert not revoking.done()
            await session.commit()
        finally:
            await session.close()
        r = await revoking
        assert r.status_code == 200, r.text
        assert (r.json()["status"], r.json()["ejected_from"]) == ("banned", [])
        assert r.json()["revoked_at"] is not None
        assert [e["actor"] for e in await audit(s, "membership.eject")] == [ADMIN.token_id]
        problem(
            await s.admin.post(f"/v1/admin/nodes/{w.node_id}/unban", headers=s.admin_headers),
            409,
            "node_revoked",
        )


@postgres_only
async def test_an_unban_racing_a_revocation_waits_for_it_and_is_refused(app: Any, app_state: Any) -> None:
    async with pool_setup(app, app_state, workers=1) as s:
        [w] = s.workers
        await s.admin.post(f"/v1/admin/nodes/{w.node_id}/ban", json={"reason": "x"}, headers=s.admin_headers)
        session = await _revoking(app_state, w)
        try:
            unbanning = asyncio.create_task(
                s.admin.post(f"/v1/admin/nodes/{w.node_id}/unban", headers=s.admin_headers)
            )
            await until_waiting(app_state, 1, unbanning, on="row")
            assert not unbanning.done()
            await session.commit()
        finally:
            await session.close()
        problem(await unbanning, 409, "node_revoked")
        assert (await admin_view(s, w.node_id))["status"] == "banned"


def test_the_cli_revokes_with_the_provider_key_and_refuses_bad_arguments_before_sending(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from typer.testing import CliRunner

    import orchestrator.cli
    from api_schemas.identity import NodeRevocationOut, NodeSpecs
    from orchestrator.cli import app

    runner = CliRunner()
    key = tmp_path / "provider.key"
    assert runner.invoke(app, ["keys", "generate", str(key)]).exit_code == 0
    node_id = "-" + key_id_of(generate_key())[1:]  # an id may begin with "-"
    calls: list[tuple[str, str | None]] = []

    class Provider:
        async def revoke_node(self, node: str, reason: str | None = None) -> NodeRevocationOut:
            calls.append((node, reason))
            at = dt.datetime(2026, 12, 4, tzinfo=dt.UTC)
            return NodeRevocationOut(
                id=node,
                provider_id=node,
                specs=NodeSpecs(gpu_count=0, gpu_memory_mb=0, cpu_cores=1, ram_mb=256),
                version="1",
                status="banned",
                status_changed_at=at,
                created_at=at,
                revoked_at=at,
                ejected_from=["pool_1"],
            )

    async def as_provider(server: str, provider_key: Any, call: Any) -> Any:
        return await call(Provider())

    monkeypatch.setattr(orchestrator.cli, "_as_provider", as_provider)
    base = ["provider", "revoke-node", "--provider-key", str(key), "--server", "http://127.0.0.1:9"]
    for extra, message in (
        (["--node-id", "not-a-node-id"], "not a node id"),
        (["--node-id", node_id, "--reason", ""], "must be 1 to 500 characters"),
        (["--node-id", node_id, "--reason", "x" * 501], "must be 1 to 500 characters"),
    ):
        result = runner.invoke(app, [*base, *extra], env={"COLUMNS": "200"})
        assert result.exit_code == 2, (extra, result.output)
        assert message in " ".join(result.output.split()), (extra, result.output)
    listing = ["provider", "nodes", "--provider-key", str(key), "--server", "http://127.0.0.1:9"]
    result = runner.invoke(app, [*listing, "--status", "lost"], env={"COLUMNS": "200"})
    assert result.exit_code == 2 and "must be one of waiting" in " ".join(result.output.split())
    assert calls == []

    result = runner.invoke(app, [*base, "--node-id", node_id, "--reason", "stolen"])
    assert result.exit_code == 0, result.output
    assert calls == [(node_id, "stolen")]
    out = json.loads(result.stdout)
    assert (out["id"], out["status"], out["ejected_from"]) == (node_id, "banned", ["pool_1"])


async def test_a_provider_lists_its_own_nodes_with_their_revocations(
    app: Any, app_state: Any, client: Any
) -> None:
    async with pool_setup(app, app_state, workers=1) as s:
        [w] = s.workers
        c = w.contributor
        siblings = [Contributor(provider_key=c.provider_key, node_key=generate_key()) for _ in range(2)]
        for sibling in siblings:
            r = await client.post("/v1/nodes", json=sibling.node_body(), auth=sibling.node_auth)
            assert r.status_code == 201, r.text
        stranger = new_contributor()
        await stranger.register(client)
        assert (await revoke(client, c, w.node_id, reason="stolen")).status_code == 200

        mine = sorted([w.node_id, *(x.node_id for x in siblings)])
        first = await client.get("/v1/providers/me/nodes", params={"limit": 2}, auth=c.provider_auth)
        assert first.status_code == 200, first.text
        rest = await client.get(
            "/v1/providers/me/nodes",
            params={"limit": 2, "cursor": first.json()["next_cursor"]},
            auth=c.provider_auth,
        )
        items = first.json()["items"] + rest.json()["items"]
        assert [n["id"] for n in items] == mine and rest.json()["next_cursor"] is None
        assert {n["id"]: n["revoked_at"] is not None for n in items} == {n: n == w.node_id for n in mine}
        banned = await client.get("/v1/providers/me/nodes", params={"status": "banned"}, auth=c.provider_auth)
        [node] = banned.json()["items"]
        assert (node["id"], node["memberships"]) == (w.node_id, [{"pool_id": s.pool_id, "status": "ejected"}])
        # Another provider sees its own node only, and a cursor of this list is not its own.
        theirs = await client.get("/v1/providers/me/nodes", auth=stranger.provider_auth)
        assert [n["id"] for n in theirs.json()["items"]] == [stranger.node_id]
        r = await client.get(
            "/v1/providers/me/nodes",
            params={"cursor": first.json()["next_cursor"]},
            auth=stranger.provider_auth,
        )
        problem(r, 400, "cursor_invalid")
        # A node key cannot list: this is the provider's view.
        problem(await client.get("/v1/providers/me/nodes", auth=siblings[0].node_auth), 401, "unknown_key")

        transport = httpx.ASGITransport(app=app, client=("203.0.113.10", 40000))
        async with WorkerClient("http://testserver", None, c.provider_key, transport=transport) as provider:
            listed = await provider.nodes(limit=2)
            assert [n.id for n in listed] == mine[:2]
            assert [n.id for n in await provider.nodes(status="banned")] == [w.node_id]
