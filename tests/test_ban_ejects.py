"""An admin ban ejects the node from its pools, as an operator ejection does, in one transaction."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from sqlalchemy import event, func, select
from sqlalchemy.orm import Session

from orchestrator.core.clock import FakeClock
from orchestrator.identity.models import Node
from orchestrator.ledger.models import LedgerTransfer, StakeUnbonding
from orchestrator.pools import service as pools_service
from orchestrator.tasks.models import Assignment
from tests.conftest import postgres_only, problem
from tests.pools_helpers import active_pool, join
from tests.tasks_helpers import pool_setup, task
from tests.verification_helpers import balances, books_balance
from tests.waits import until_waiting

ECON = {"min_stake_per_node": 1000, "unbonding_period_s": 86_400}


async def statuses(s: Any, pool_id: str) -> dict[str, str]:
    r = await s.admin.get(f"/v1/admin/pools/{pool_id}/members", headers=s.admin_headers)
    assert r.status_code == 200, r.text
    return {m["node_id"]: m["status"] for m in r.json()["items"]}


async def audit(s: Any, action: str) -> list[dict[str, Any]]:
    r = await s.admin.get("/v1/admin/audit", params={"limit": 200}, headers=s.admin_headers)
    assert r.status_code == 200, r.text
    return [e for e in r.json()["items"] if e["action"] == action]


async def transfers(app_state: Any) -> int:
    async with app_state.sessionmaker() as session:
        return int(await session.scalar(select(func.count()).select_from(LedgerTransfer)) or 0)


async def assert_taken_out(
    s: Any, app_state: Any, client: Any, clock: FakeClock, node: Any, bystander: Any, lease: dict[str, Any]
) -> None:
    """What a ban (or a revocation) does to the node's lease and stake: the lease is released and
    its task reissued at once to ``bystander``; the active membership's stake (1000) unbonds over
    the pool's day, the pending join's (500) is back at once."""
    async with app_state.sessionmaker() as session:
        assignment = await session.get(Assignment, lease["assignment_id"])
        assert assignment is not None and assignment.status == "released"
        [unbonding] = list((await session.execute(select(StakeUnbonding))).scalars())
    again = (await bystander.claim(s.pool_id)).json()["leases"]
    assert [await s.task_of(x) for x in again] == [await s.task_of(lease)]
    b = await balances(client, node)
    assert (b["stake_locked"], b["stake_unbonding"], b["stake_free"]) == (0, 1000, 500)
    assert (unbonding.amount, unbonding.provider_id) == (1000, node.contributor.provider_id)
    assert unbonding.release_at == clock.utcnow() + dt.timedelta(seconds=86_400)


async def test_a_ban_ejects_the_node_from_its_pools_releases_its_leases_and_unbonds_its_stake(
    app: Any, app_state: Any, client: Any, clock: FakeClock
) -> None:
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1500) as s:
        banned = s.workers[0]
        bystander = await s.add_worker(stake=1000)
        # A second pool that admits by approval: the node's membership there is pending.
        other = await active_pool(
            s.admin, s.headers, admission="approval", economics={"min_stake_per_node": 500}
        )
        assert (await join(banned.client, banned.contributor, other["id"])).json()["status"] == "pending"
        await s.enqueue([task()], key="one")
        lease = (await banned.claim(s.pool_id)).json()["leases"][0]
        assert (await balances(client, banned))["stake_locked"] == 1500

        r = await s.admin.post(
            f"/v1/admin/nodes/{banned.node_id}/ban", json={"reason": "sybil farm"}, headers=s.admin_headers
        )
        assert r.status_code == 200, r.text
        assert r.json()["status"] == "banned"

        # Memberships ended as ejections; the bystander is untouched.
        assert await statuses(s, s.pool_id) == {banned.node_id: "ejected", bystander.node_id: "active"}
        assert await statuses(s, other["id"]) == {banned.node_id: "ejected"}
        await assert_taken_out(s, app_state, client, clock, banned, bystander, lease)
        # Audited as the ejections they are, by the admin who banned, and on the ban itself.
        [ban_entry] = await audit(s, "node.ban")
        assert ban_entry["after"]["ejected_from"] == sorted([s.pool_id, other["id"]])
        ejections = {e["pool_id"]: e for e in await audit(s, "membership.eject")}
        assert set(ejections) == {s.pool_id, other["id"]}
        for pool_id, before in ((s.pool_id, "active"), (other["id"], "pending")):
            e = ejections[pool_id]
            assert (e["actor"], e["target_id"]) == (ban_entry["actor"], banned.node_id)
            assert e["before"] == {"status": before}
            assert (e["after"]["status"], e["after"]["reason"]) == ("ejected", "node banned: sybil farm")

        # Banning again changes nothing.
        moved = await transfers(app_state)
        r = await s.admin.post(
            f"/v1/admin/nodes/{banned.node_id}/ban", json={"reason": "twice"}, headers=s.admin_headers
        )
        assert r.status_code == 200 and await transfers(app_state) == moved
        assert len(await audit(s, "membership.eject")) == 2
        refused = await banned.client.post(
            f"/v1/pools/{s.pool_id}/join", json={}, auth=banned.contributor.node_auth
        )
        problem(refused, 403, "node_banned")
    await books_balance(app_state)


async def test_a_ban_that_does_not_commit_leaves_the_node_watched(app: Any, app_state: Any) -> None:
    """The ban dropped the node from the hot store before its transaction committed: a ban that
    then failed (a lost connection at COMMIT) left the node healthy in the database and unseen
    by the sweeper, so it stayed healthy however long it was silent. The hot store now forgets
    the node only once the ban has committed."""
    async with pool_setup(app, app_state, workers=1) as s:
        node = s.workers[0]
        assert await app_state.hot_store.last_beat(node.node_id) is not None

        def fail_the_ban(session: Session) -> None:
            status = session.execute(select(Node.status).where(Node.id == node.node_id)).scalar()
            if status == "banned":
                raise OSError("connection lost at COMMIT")

        event.listen(Session, "before_commit", fail_the_ban)
        try:
            with pytest.raises(OSError):
                await s.admin.post(
                    f"/v1/admin/nodes/{node.node_id}/ban", json={"reason": "sybil"}, headers=s.admin_headers
                )
        finally:
            event.remove(Session, "before_commit", fail_the_ban)
        r = await s.admin.get(f"/v1/admin/nodes/{node.node_id}", headers=s.admin_headers)
        assert r.json()["status"] == "healthy"
        assert await app_state.hot_store.last_beat(node.node_id) is not None

        r = await s.admin.post(
            f"/v1/admin/nodes/{node.node_id}/ban", json={"reason": "sybil"}, headers=s.admin_headers
        )
        assert r.status_code == 200 and r.json()["status"] == "banned", r.text
        assert await app_state.hot_store.last_beat(node.node_id) is None


async def test_a_committed_ban_is_reported_as_done_when_the_hot_store_then_fails(
    app: Any, app_state: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ban has committed before the hot store is told: a hot store down at that moment is
    logged, and the answer is the ban (not a 503 for a ban that took effect)."""
    async with pool_setup(app, app_state, workers=1) as s:
        node = s.workers[0]

        async def down(node_id: str) -> None:
            raise ConnectionError("hot store down")

        monkeypatch.setattr(app_state.hot_store, "forget_node", down)
        r = await s.admin.post(
            f"/v1/admin/nodes/{node.node_id}/ban", json={"reason": "sybil"}, headers=s.admin_headers
        )
        assert r.status_code == 200 and r.json()["status"] == "banned", r.text
        r = await s.admin.get(f"/v1/admin/nodes/{node.node_id}", headers=s.admin_headers)
        assert r.json()["status"] == "banned"


async def test_an_unban_lifts_the_bans_ejections_and_no_others(app: Any, app_state: Any, client: Any) -> None:
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=3000) as s:
        node = s.workers[0]
        # An operator ejected the node from one pool before the ban: that stays final.
        earlier = await active_pool(s.admin, s.headers, economics={"min_stake_per_node": 500})
        assert (await join(node.client, node.contributor, earlier["id"])).status_code in (200, 201)
        r = await s.admin.post(
            f"/v1/admin/pools/{earlier['id']}/members/{node.node_id}/eject",
            json={"reason": "operator's call"},
            headers=s.headers,
        )
        assert r.status_code == 200, r.text

        r = await s.admin.post(
            f"/v1/admin/nodes/{node.node_id}/ban", json={"reason": "mistaken"}, headers=s.admin_headers
        )
        assert r.status_code == 200, r.text
        assert await statuses(s, s.pool_id) == {node.node_id: "ejected"}
        moved = await transfers(app_state)

        r = await s.admin.post(f"/v1/admin/nodes/{node.node_id}/unban", headers=s.admin_headers)
        assert r.status_code == 200 and r.json()["status"] == "waiting"
        assert await statuses(s, s.pool_id) == {node.node_id: "left"}
        assert await statuses(s, earlier["id"]) == {node.node_id: "ejected"}
        assert await transfers(app_state) == moved  # no money moves: the old stake keeps unbonding
        [unban] = await audit(s, "node.unban")
        assert unban["after"]["may_rejoin"] == [s.pool_id]
        [reinstated] = await audit(s, "membership.reinstate")
        assert (reinstated["pool_id"], reinstated["before"], reinstated["after"]["status"]) == (
            s.pool_id,
            {"status": "ejected"},
            "left",
        )
        # A second unban finds nothing more to lift.
        r = await s.admin.post(f"/v1/admin/nodes/{node.node_id}/unban", headers=s.admin_headers)
        assert r.status_code == 200 and len(await audit(s, "membership.reinstate")) == 1

        # Once healthy again, the node rejoins the pool its ban ejected it from, with new
        # stake; the pool its operator ejected it from still refuses it.
        assert (await node.beat()).status_code == 200
        rejoined = await join(node.client, node.contributor, s.pool_id)
        assert rejoined.status_code in (200, 201), rejoined.text
        assert rejoined.json()["status"] == "active"
        problem(await join(node.client, node.contributor, earlier["id"]), 403, "node_ejected")
    await books_balance(app_state)


async def test_a_ban_and_its_ejections_commit_together(
    app: Any, app_state: Any, client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """If ending a membership fails, the ban does not happen either."""
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000) as s:
        w = s.workers[0]

        async def broken(*args: Any, **kwargs: Any) -> int:
            raise RuntimeError("lease release failed")

        monkeypatch.setattr(pools_service, "release_member_leases", broken)
        with pytest.raises(RuntimeError):
            await s.admin.post(
                f"/v1/admin/nodes/{w.node_id}/ban", json={"reason": "x"}, headers=s.admin_headers
            )
        r = await s.admin.get(f"/v1/admin/nodes/{w.node_id}", headers=s.admin_headers)
        assert r.json()["status"] != "banned"
        assert await statuses(s, s.pool_id) == {w.node_id: "active"}
        assert (await balances(client, w))["stake_locked"] == 1000


async def ban(s: Any, node_id: str) -> None:
    r = await s.admin.post(f"/v1/admin/nodes/{node_id}/ban", json={"reason": "x"}, headers=s.admin_headers)
    assert r.status_code == 200, r.text


async def unban(s: Any, node_id: str) -> None:
    r = await s.admin.post(f"/v1/admin/nodes/{node_id}/unban", headers=s.admin_headers)
    assert r.status_code == 200, r.text


async def test_an_operator_ejection_whose_reason_reads_like_a_bans_stays_final(
    app: Any, app_state: Any
) -> None:
    async with pool_setup(app, app_state, workers=1) as s:
        node = s.workers[0]
        r = await s.admin.post(
            f"/v1/admin/pools/{s.pool_id}/members/{node.node_id}/eject",
            json={"reason": f"{pools_service.BAN_EJECTION_PREFIX}by me, for cheating"},
            headers=s.headers,
        )
        assert r.status_code == 200, r.text
        await ban(s, node.node_id)
        await unban(s, node.node_id)
        assert await statuses(s, s.pool_id) == {node.node_id: "ejected"}
        assert await audit(s, "membership.reinstate") == []
        assert (await node.beat()).status_code == 200
        problem(await join(node.client, node.contributor, s.pool_id), 403, "node_ejected")


async def test_an_operator_ejecting_a_node_its_ban_ejected_makes_the_ejection_final(
    app: Any, app_state: Any
) -> None:
    async with pool_setup(app, app_state, workers=1) as s:
        node = s.workers[0]
        await ban(s, node.node_id)
        r = await s.admin.post(
            f"/v1/admin/pools/{s.pool_id}/members/{node.node_id}/eject",
            json={"reason": "cheater, final"},
            headers=s.headers,
        )
        assert r.status_code == 200 and r.json()["status"] == "ejected", r.text
        [again, _] = await audit(s, "membership.eject")  # newest first: the operator's, the ban's
        assert (again["before"], again["after"]["reason"]) == ({"status": "ejected"}, "cheater, final")
        # A second operator ejection changes nothing more.
        r = await s.admin.post(
            f"/v1/admin/pools/{s.pool_id}/members/{node.node_id}/eject",
            json={"reason": "again"},
            headers=s.headers,
        )
        assert r.status_code == 200 and len(await audit(s, "membership.eject")) == 2
        await unban(s, node.node_id)
        assert await statuses(s, s.pool_id) == {node.node_id: "ejected"}
        assert (await node.beat()).status_code == 200
        problem(await join(node.client, node.contributor, s.pool_id), 403, "node_ejected")


async def test_the_verifier_ejecting_a_node_its_ban_ejected_makes_the_ejection_final(
    app: Any, app_state: Any
) -> None:
    from orchestrator.pools import repository as pools_repo

    async with pool_setup(app, app_state, workers=1) as s:
        node = s.workers[0]
        await ban(s, node.node_id)
        async with app_state.sessionmaker() as session, session.begin():
            pool = await pools_repo.get_pool(session, s.pool_id, for_update=True)
            [m] = (await pools_repo.memberships_for_update(session, node.node_id, [s.pool_id])).values()
            assert pool is not None
            await pools_service.eject_for_fraud(
                session, pool, m, reason="3 fraud strikes", now=app_state.clock.utcnow()
            )
        await unban(s, node.node_id)
        assert await statuses(s, s.pool_id) == {node.node_id: "ejected"}
        [verifiers, _] = await audit(s, "membership.eject")  # newest first: the verifier's, the ban's
        assert (verifiers["actor"], verifiers["before"]) == ("system", {"status": "ejected"})


@postgres_only
async def test_a_join_racing_a_ban_of_its_node_is_refused_not_left_live(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    import asyncio

    from orchestrator.admin import service as admin_service
    from orchestrator.admin.tokens import Principal, Role

    async with pool_setup(app, app_state, workers=1) as s:
        w = s.workers[0]
        other = await active_pool(s.admin, s.headers, economics={"min_stake_per_node": 0})
        admin = Principal(token_id="tok_test_admin", name="admin", role=Role.admin)

        banned = asyncio.Event()

        async def join_meanwhile() -> Any:
            await banned.wait()
            return await w.client.post(f"/v1/pools/{other['id']}/join", json={}, auth=w.contributor.node_auth)

        joining = asyncio.create_task(join_meanwhile())
        async with app_state.sessionmaker() as session, session.begin():
            await admin_service.ban(session, app_state, w.node_id, "sybil", principal=admin)
            banned.set()  # the ban has ended the memberships it saw; not committed
            await until_waiting(app_state, 1, joining, on="row")
        problem(await joining, 403, "node_banned")
        assert w.node_id not in await statuses(s, other["id"])


@postgres_only
async def test_a_join_racing_the_verifiers_provider_ban_is_refused_not_left_live(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    """The verifier bans a provider from a pool (its strike limit) in a verdict's transaction,
    which ends the provider's live memberships there: a sibling node joining meanwhile waits
    for it and is refused, instead of becoming a live member the ban never saw."""
    import asyncio

    from orchestrator.pools.models import Pool
    from orchestrator.tasks.models import Submission
    from orchestrator.verification import service as verification
    from tests.conftest import new_contributor
    from tests.tasks_helpers import client_for
    from tests.verification_helpers import submit

    async with pool_setup(app, app_state, workers=1) as s:
        w = s.workers[0]
        await s.enqueue([task()], key="one")
        await submit(w, (await w.claim(s.pool_id)).json()["leases"][0], ["4"], seed=1)
        sibling = new_contributor(w.contributor.provider_key)
        async with client_for(app) as c:
            await sibling.register(c)

            banned = asyncio.Event()

            async def join_meanwhile() -> Any:
                await banned.wait()
                return await c.post(f"/v1/pools/{s.pool_id}/join", json={}, auth=sibling.node_auth)

            joining = asyncio.create_task(join_meanwhile())
            async with app_state.sessionmaker() as session, session.begin():
                submission = (await session.execute(select(Submission))).scalar_one()
                await verification.lock_for_verdicts(session, [submission])
                pool = await session.get(Pool, s.pool_id)
                assert pool is not None
                await pools_service.blacklist_for_fraud(
                    session, pool, w.contributor.provider_id, reason="strikes", now=clock.utcnow()
                )
                banned.set()  # the ban ended the memberships it saw; not committed
                await until_waiting(app_state, 1, joining, on="row")
            joined = await joining
        problem(joined, 403, "provider_blacklisted")
        assert await statuses(s, s.pool_id) == {w.node_id: "left"}


async def test_a_ban_keeps_the_nodes_last_heartbeat(app: Any, app_state: Any) -> None:
    """The ban's after-commit ``forget_node`` deleted the node's beat hash from the hot store
    without copying the last beat into ``nodes.last_heartbeat_at`` (as the sweeper does when it
    marks a node dead), so the admin view of a banned node, the one an operator investigates,
    said it never beat, even after an unban until the node beat again."""
    async with pool_setup(app, app_state, workers=1) as s:
        [w] = s.workers
        await w.beat()
        url = f"/v1/admin/nodes/{w.node_id}"
        seen = (await s.admin.get(url, headers=s.admin_headers)).json()["last_heartbeat_at"]
        assert seen is not None
        r = await s.admin.post(f"{url}/ban", json={"reason": "forged rewards"}, headers=s.admin_headers)
        assert r.status_code == 200 and r.json()["last_heartbeat_at"] == seen, r.text
        assert (await s.admin.get(url, headers=s.admin_headers)).json()["last_heartbeat_at"] == seen
        assert (await s.admin.post(f"{url}/unban", headers=s.admin_headers)).status_code == 200
        assert (await s.admin.get(url, headers=s.admin_headers)).json()["last_heartbeat_at"] == seen
