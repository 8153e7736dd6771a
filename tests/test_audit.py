"""The audit log: every operator action recorded with its transaction, scoped and paginated."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from orchestrator.audit.models import AuditEntry
from tests.conftest import Contributor, problem
from tests.pools_helpers import (
    active_pool,
    create_pool,
    deposit,
    invite,
    join,
    lifecycle,
    new_token,
    registered,
)


async def audit(client: httpx.AsyncClient, headers: dict[str, str], **params: Any) -> list[dict[str, Any]]:
    """Every entry visible to ``headers`` (all pages), newest first."""
    entries: list[dict[str, Any]] = []
    cursor = None
    while True:
        q = {**params, **({"cursor": cursor} if cursor else {})}
        r = await client.get("/v1/admin/audit", params=q, headers=headers)
        assert r.status_code == 200, r.text
        entries += r.json()["items"]
        cursor = r.json()["next_cursor"]
        if cursor is None:
            return entries


async def test_every_operator_action_on_a_pool_is_audited_with_actor_change_and_request_id(
    client: httpx.AsyncClient, app_state: Any, admin_headers: dict[str, str]
) -> None:
    op, op_id = await new_token(app_state, "operator", "op")
    rid = {"X-Request-ID": "req-create"}
    r = await client.post(
        "/v1/admin/pools", json={"name": "p", "admission": "approval"}, headers={**op, **rid}
    )
    pool_id = r.json()["id"]
    base = f"/v1/admin/pools/{pool_id}"
    assert (
        await client.patch(base, json={"economics": {"reward_per_sample": 4}}, headers=op)
    ).status_code == 200
    await lifecycle(client, op, pool_id, "activate")
    code = await invite(client, op, pool_id)
    keep, drop, bad = await registered(client), await registered(client), await registered(client)
    for c in (keep, drop, bad):
        assert (await join(client, c, pool_id)).status_code == 201
    assert (await client.post(f"{base}/members/{keep.node_id}/approve", headers=op)).status_code == 200
    r = await client.post(f"{base}/members/{drop.node_id}/reject", json={"reason": "no"}, headers=op)
    assert r.status_code == 200
    r = await client.post(f"{base}/members/{keep.node_id}/eject", json={"reason": "cheat"}, headers=op)
    assert r.status_code == 200
    r = await client.post(
        f"{base}/blacklist", json={"provider_id": bad.provider_id, "reason": "sybil"}, headers=op
    )
    assert r.status_code == 201
    await lifecycle(client, op, pool_id, "pause")
    await lifecycle(client, op, pool_id, "resume")
    await lifecycle(client, op, pool_id, "pause")
    await lifecycle(client, op, pool_id, "complete")

    entries = await audit(client, op, pool_id=pool_id)
    assert [(e["action"], e["target_type"]) for e in reversed(entries)] == [
        ("pool.create", "pool"),
        ("pool.update", "pool"),
        ("pool.activate", "pool"),
        ("invite.create", "invite"),
        ("membership.approve", "node"),
        ("membership.reject", "node"),
        ("membership.eject", "node"),
        ("pool.blacklist_provider", "provider"),
        ("pool.pause", "pool"),
        ("pool.resume", "pool"),
        ("pool.pause", "pool"),
        ("pool.complete", "pool"),
    ]
    assert all(
        e["actor"] == op_id and e["actor_role"] == "operator" and e["pool_id"] == pool_id for e in entries
    )
    assert all(e["at"] and e["request_id"] for e in entries)
    by_action = {e["action"]: e for e in entries}
    assert by_action["pool.create"]["request_id"] == "req-create"
    assert by_action["pool.create"]["after"]["admission"] == "approval"
    assert by_action["pool.update"]["before"] == {"economics.reward_per_sample": 0}
    assert by_action["pool.update"]["after"] == {"economics.reward_per_sample": 4}
    assert by_action["pool.activate"]["before"] == {"status": "pending"}
    assert by_action["pool.activate"]["after"] == {"status": "active"}
    assert code not in str(by_action["invite.create"])  # the code itself is never logged
    assert by_action["membership.approve"]["target_id"] == keep.node_id
    assert by_action["membership.approve"]["before"] == {"status": "pending"}
    assert by_action["membership.reject"]["after"] == {"status": "rejected", "episode": 1, "reason": "no"}
    assert by_action["membership.eject"]["before"] == {"status": "active"}
    assert by_action["membership.eject"]["after"]["reason"] == "cheat"
    blacklist = by_action["pool.blacklist_provider"]
    assert blacklist["target_id"] == bad.provider_id
    assert blacklist["after"] == {"blacklisted": True, "reason": "sybil", "removed_nodes": [bad.node_id]}
    assert by_action["pool.complete"]["before"] == {"status": "paused"}


async def test_refused_and_repeated_actions_leave_no_entry(
    client: httpx.AsyncClient, app_state: Any, operator_headers: dict[str, str], contributor: Contributor
) -> None:
    pool = await create_pool(client, operator_headers)
    problem(
        await client.post(f"/v1/admin/pools/{pool['id']}/pause", headers=operator_headers),
        409,
        "pool_transition_invalid",
    )
    problem(
        await client.patch(
            f"/v1/admin/pools/{pool['id']}", json={"caps": {"max_nodes": 0}}, headers=operator_headers
        ),
        422,
        "validation_failed",
    )
    await lifecycle(client, operator_headers, pool["id"], "activate")
    await lifecycle(client, operator_headers, pool["id"], "activate")  # already active: no change
    r = await client.patch(
        f"/v1/admin/pools/{pool['id']}", json={"name": pool["name"]}, headers=operator_headers
    )
    assert r.status_code == 200  # nothing changed
    await join(client, contributor, pool["id"])
    url = f"/v1/admin/pools/{pool['id']}/members/{contributor.node_id}/eject"
    for _ in range(2):
        assert (await client.post(url, json={"reason": "x"}, headers=operator_headers)).status_code == 200
    actions = [e["action"] for e in await audit(client, operator_headers, pool_id=pool["id"])]
    assert actions == ["membership.eject", "pool.activate", "pool.create"]
    async with app_state.sessionmaker() as session:
        assert await session.scalar(select(func.count()).select_from(AuditEntry)) == 3


async def test_an_operator_sees_its_pools_entries_and_its_own_actions_only(
    client: httpx.AsyncClient, app_state: Any, admin_headers: dict[str, str]
) -> None:
    alice, alice_id = await new_token(app_state, "operator", "alice")
    bob, bob_id = await new_token(app_state, "operator", "bob")
    a_pool = await active_pool(client, alice)
    b_pool = await active_pool(client, bob)
    node = await registered(client)
    await join(client, node, a_pool["id"])
    # An admin acts on alice's pool (alice sees it), deposits and bans (pool-less: alice does not).
    r = await client.post(
        f"/v1/admin/pools/{a_pool['id']}/members/{node.node_id}/eject",
        json={"reason": "x"},
        headers=admin_headers,
    )
    assert r.status_code == 200
    await deposit(client, admin_headers, node.provider_id, 5)
    await client.post(f"/v1/admin/nodes/{node.node_id}/ban", json={"reason": "x"}, headers=admin_headers)

    seen_by_alice = await audit(client, alice)
    assert {e["pool_id"] for e in seen_by_alice} == {a_pool["id"]}
    assert [e["action"] for e in seen_by_alice] == ["membership.eject", "pool.activate", "pool.create"]
    assert seen_by_alice[0]["actor_role"] == "admin"
    seen_by_bob = await audit(client, bob)
    assert {e["pool_id"] for e in seen_by_bob} == {b_pool["id"]} and {e["actor"] for e in seen_by_bob} == {
        bob_id
    }
    assert await audit(client, bob, pool_id=a_pool["id"]) == []
    assert await audit(client, bob, actor=alice_id) == []

    everything = await audit(client, admin_headers)
    assert {e["action"] for e in everything} >= {"node.ban", "ledger.deposit", "membership.eject"}
    assert len(everything) == len(seen_by_alice) + len(seen_by_bob) + 2
    assert {e["actor"] for e in await audit(client, admin_headers, actor=alice_id)} == {alice_id}
    by_pool = await audit(client, admin_headers, pool_id=a_pool["id"])
    assert [e["id"] for e in by_pool] == [e["id"] for e in seen_by_alice]


async def test_the_audit_log_pages_from_newest_to_oldest(
    client: httpx.AsyncClient, operator_headers: dict[str, str]
) -> None:
    pools = [await create_pool(client, operator_headers, name=f"p{i}") for i in range(5)]
    ids: list[int] = []
    cursor = None
    while True:
        params: dict[str, Any] = {"limit": 2, **({"cursor": cursor} if cursor else {})}
        page = (await client.get("/v1/admin/audit", params=params, headers=operator_headers)).json()
        assert len(page["items"]) <= 2
        ids += [e["id"] for e in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert len(ids) == 5 and ids == sorted(ids, reverse=True)
    newest = (await client.get("/v1/admin/audit", params={"limit": 1}, headers=operator_headers)).json()
    assert newest["items"][0]["target_id"] == pools[-1]["id"]


async def test_bad_audit_queries_are_refused(client: httpx.AsyncClient, app_state: Any) -> None:
    operator, _ = await new_token(app_state, "operator")
    problem(
        await client.get("/v1/admin/audit", params={"cursor": "garbage"}, headers=operator),
        400,
        "cursor_invalid",
    )
    problem(await client.get("/v1/admin/audit", params={"limit": 0}, headers=operator), 400, "invalid_query")
    problem(await client.get("/v1/admin/audit"), 401, "token_missing")


@pytest.mark.parametrize("role", ["validator", "trainer"])
async def test_validators_and_trainers_cannot_read_the_audit_log(
    client: httpx.AsyncClient, app_state: Any, role: str
) -> None:
    headers, _ = await new_token(app_state, role)
    problem(await client.get("/v1/admin/audit", headers=headers), 403, "role_forbidden")


async def test_the_audit_log_cannot_be_edited_over_http(
    client: httpx.AsyncClient, admin_headers: dict[str, str]
) -> None:
    await create_pool(client, admin_headers)
    for method in ("POST", "PUT", "PATCH", "DELETE"):
        problem(
            await client.request(method, "/v1/admin/audit", headers=admin_headers), 405, "method_not_allowed"
        )
    assert len(await audit(client, admin_headers)) == 1
