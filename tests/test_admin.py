"""Operator authentication and the admin node registry."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from orchestrator.admin.models import ApiToken
from orchestrator.admin.tokens import revoke_token, rotate_token
from orchestrator.audit.models import AuditEntry
from orchestrator.pools.models import Pool
from tests.conftest import Contributor, make_token, new_contributor, postgres_only, problem
from tests.pools_helpers import active_pool, new_token
from tests.waits import until_waiting


async def test_admin_routes_need_a_valid_bearer_token(client: httpx.AsyncClient) -> None:
    problem(await client.get("/v1/admin/nodes"), 401, "token_missing")
    r = await client.get("/v1/admin/nodes", headers={"Authorization": "Bearer orch_not-a-real-token"})
    problem(r, 401, "token_invalid")
    assert r.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize("role", ["operator", "validator", "trainer"])
async def test_the_node_registry_is_admin_only(
    client: httpx.AsyncClient, app_state: Any, contributor: Contributor, role: str
) -> None:
    headers = {"Authorization": f"Bearer {await make_token(app_state, role)}"}
    problem(await client.get("/v1/admin/nodes", headers=headers), 403, "role_forbidden")
    problem(
        await client.get(f"/v1/admin/nodes/{contributor.node_id}", headers=headers), 403, "role_forbidden"
    )
    r = await client.post(f"/v1/admin/nodes/{contributor.node_id}/ban", json={"reason": "x"}, headers=headers)
    problem(r, 403, "role_forbidden")
    assert (await client.get("/v1/nodes/me", auth=contributor.node_auth)).json()["status"] == "waiting"


async def test_a_revoked_token_is_refused(client: httpx.AsyncClient, app_state: Any) -> None:
    token = await make_token(app_state, "admin")
    headers = {"Authorization": f"Bearer {token}"}
    assert (await client.get("/v1/admin/nodes", headers=headers)).status_code == 200
    async with app_state.sessionmaker() as session, session.begin():
        token_id = (await session.execute(select(ApiToken.id))).scalar_one()
        row, revoked = await revoke_token(session, token_id)
        assert row is not None and revoked
    problem(await client.get("/v1/admin/nodes", headers=headers), 401, "token_invalid")


async def test_tokens_are_stored_hashed(app_state: Any) -> None:
    token = await make_token(app_state, "operator")
    async with app_state.sessionmaker() as session:
        from sqlalchemy import select

        from orchestrator.admin.models import ApiToken

        stored = (await session.execute(select(ApiToken.token_hash))).scalar_one()
    assert token not in stored and len(stored) == 64


async def test_list_nodes_filters_and_paginates(
    client: httpx.AsyncClient, admin_headers: dict[str, str]
) -> None:
    shared = new_contributor()
    nodes = [new_contributor(shared.provider_key) for _ in range(5)]
    loner = new_contributor()
    for c in [*nodes, loner]:
        await c.register(client)
    for c in nodes[:2]:
        await c.beat(client)

    seen: list[str] = []
    cursor = None
    while True:
        params = {"limit": 2, "provider_id": shared.provider_id, **({"cursor": cursor} if cursor else {})}
        page = (await client.get("/v1/admin/nodes", params=params, headers=admin_headers)).json()
        seen += [n["id"] for n in page["items"]]
        assert len(page["items"]) <= 2
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == sorted(c.node_id for c in nodes)

    healthy = (
        await client.get("/v1/admin/nodes", params={"status": "healthy"}, headers=admin_headers)
    ).json()
    assert sorted(n["id"] for n in healthy["items"]) == sorted(c.node_id for c in nodes[:2])

    problem(
        await client.get("/v1/admin/nodes", params={"status": "sleepy"}, headers=admin_headers),
        400,
        "invalid_query",
    )
    problem(
        await client.get("/v1/admin/nodes", params={"cursor": "garbage"}, headers=admin_headers),
        400,
        "cursor_invalid",
    )


async def test_get_node_shows_status_history(
    client: httpx.AsyncClient, admin_headers: dict[str, str], contributor: Contributor
) -> None:
    await contributor.beat(client)
    r = await client.get(f"/v1/admin/nodes/{contributor.node_id}", headers=admin_headers)
    assert r.status_code == 200
    body = r.json()
    assert body["status"] == "healthy"
    assert body["status_history"][0]["to_status"] == "healthy"
    assert body["status_history"][0]["reason"] == "heartbeat received"
    missing = "A" * 43
    problem(await client.get(f"/v1/admin/nodes/{missing}", headers=admin_headers), 404, "node_not_found")


async def test_a_banned_node_is_refused_everywhere_until_unbanned(
    client: httpx.AsyncClient, admin_headers: dict[str, str], contributor: Contributor
) -> None:
    await contributor.beat(client)
    r = await client.post(
        f"/v1/admin/nodes/{contributor.node_id}/ban", json={"reason": "forged rewards"}, headers=admin_headers
    )
    assert r.status_code == 200
    assert r.json()["status"] == "banned" and r.json()["ban_reason"] == "forged rewards"

    problem(await contributor.beat(client), 403, "node_banned")
    problem(await client.get("/v1/nodes/me", auth=contributor.node_auth), 403, "node_banned")
    problem(
        await client.post("/v1/nodes", json=contributor.node_body(), auth=contributor.node_auth),
        403,
        "node_banned",
    )

    # Banning twice changes nothing.
    again = await client.post(
        f"/v1/admin/nodes/{contributor.node_id}/ban", json={"reason": "again"}, headers=admin_headers
    )
    assert again.json()["ban_reason"] == "forged rewards"

    r = await client.post(f"/v1/admin/nodes/{contributor.node_id}/unban", headers=admin_headers)
    assert r.json()["status"] == "waiting"
    assert (await contributor.beat(client)).json()["status"] == "healthy"
    detail = (await client.get(f"/v1/admin/nodes/{contributor.node_id}", headers=admin_headers)).json()
    assert [h["to_status"] for h in reversed(detail["status_history"])] == [
        "healthy",
        "banned",
        "waiting",
        "healthy",
    ]


async def test_a_ban_keeps_a_reason_of_the_longest_length_in_the_status_history(
    client: httpx.AsyncClient, admin_headers: dict[str, str], contributor: Contributor
) -> None:
    """A reason may be 500 characters; the history records it as 'banned: <reason>' (a column of
    200 characters answered 500 on PostgreSQL past 192)."""
    reason = "r" * 500
    r = await client.post(
        f"/v1/admin/nodes/{contributor.node_id}/ban", json={"reason": reason}, headers=admin_headers
    )
    assert r.status_code == 200, r.text
    assert r.json()["ban_reason"] == reason
    detail = (await client.get(f"/v1/admin/nodes/{contributor.node_id}", headers=admin_headers)).json()
    assert detail["status_history"][0]["reason"] == f"banned: {reason}"
    too_long = await client.post(
        f"/v1/admin/nodes/{contributor.node_id}/ban", json={"reason": reason + "r"}, headers=admin_headers
    )
    problem(too_long, 422, "validation_failed")


async def test_ban_needs_a_reason(
    client: httpx.AsyncClient, admin_headers: dict[str, str], contributor: Contributor
) -> None:
    r = await client.post(f"/v1/admin/nodes/{contributor.node_id}/ban", json={}, headers=admin_headers)
    problem(r, 422, "validation_failed")
    assert (await client.get("/v1/nodes/me", auth=contributor.node_auth)).status_code == 200


async def test_admins_create_list_and_revoke_tokens_over_the_api(
    app: Any, client: httpx.AsyncClient, app_state: Any, admin_headers: dict[str, str]
) -> None:
    from tests.tasks_helpers import pool_setup

    async with pool_setup(app, app_state) as s:
        r = await client.post(
            "/v1/admin/tokens",
            json={"role": "trainer", "name": "rl-run-7", "pool_ids": [s.pool_id]},
            headers=admin_headers,
        )
        assert r.status_code == 201, r.text
        created = r.json()
        trainer = {"Authorization": f"Bearer {created['token']}"}
        assert (created["role"], created["pool_ids"], created["expires_at"]) == ("trainer", [s.pool_id], None)
        assert (await client.get(f"/v1/admin/pools/{s.pool_id}/tasks", headers=trainer)).status_code == 200

        listed = (await client.get("/v1/admin/tokens", headers=admin_headers)).json()["items"]
        mine = next(t for t in listed if t["id"] == created["id"])
        assert "token" not in mine and mine["name"] == "rl-run-7" and mine["revoked_at"] is None
        assert created["token"] not in str(listed)

        for _ in range(2):  # revoking again changes nothing
            r = await client.post(f"/v1/admin/tokens/{created['id']}/revoke", headers=admin_headers)
            assert r.status_code == 200 and r.json()["revoked_at"] is not None
        problem(await client.get(f"/v1/admin/pools/{s.pool_id}/tasks", headers=trainer), 401, "token_invalid")
        audit = (await client.get("/v1/admin/audit", headers=admin_headers)).json()["items"]
        actions = [e["action"] for e in audit if e["target_id"] == created["id"]]
        assert sorted(actions) == ["token.create", "token.revoke"]
        assert created["token"] not in str(audit)
        # A token id that could not exist is the same 404 as one that does not (it was not_found).
        for token_id in ("tok_0000", "tok_nope", "tok_" + "0" * 600, "pool_0000"):
            problem(
                await client.post(f"/v1/admin/tokens/{token_id}/revoke", headers=admin_headers),
                404,
                "token_not_found",
            )


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ({"role": "trainer", "name": "t"}, "needs at least one pool"),
        ({"role": "validator", "name": "v", "pool_ids": ["pool_nope"]}, "no pool pool_nope"),
        ({"role": "operator", "name": "o", "pool_ids": ["pool_nope"]}, "only validator and trainer"),
    ],
)
async def test_a_token_scope_that_cannot_work_is_refused(
    client: httpx.AsyncClient, admin_headers: dict[str, str], body: dict[str, Any], why: str
) -> None:
    r = await client.post("/v1/admin/tokens", json=body, headers=admin_headers)
    assert why in problem(r, 422, "token_scope_invalid")["detail"]
    assert (
        len((await client.get("/v1/admin/tokens", headers=admin_headers)).json()["items"]) == 1
    )  # the admin's


async def test_only_admins_manage_tokens(client: httpx.AsyncClient, operator_headers: dict[str, str]) -> None:
    problem(await client.get("/v1/admin/tokens", headers=operator_headers), 403, "role_forbidden")
    r = await client.post("/v1/admin/tokens", json={"role": "admin", "name": "me"}, headers=operator_headers)
    problem(r, 403, "role_forbidden")


async def test_an_expired_token_is_refused(
    client: httpx.AsyncClient, app_state: Any, admin_headers: dict[str, str]
) -> None:
    r = await client.post(
        "/v1/admin/tokens", json={"role": "admin", "name": "short", "expires_in_s": 60}, headers=admin_headers
    )
    assert r.status_code == 201, r.text
    short = {"Authorization": f"Bearer {r.json()['token']}"}
    assert (await client.get("/v1/admin/nodes", headers=short)).status_code == 200
    app_state.clock.advance(61)
    r = await client.get("/v1/admin/nodes", headers=short)
    problem(r, 401, "token_expired")
    assert (await client.get("/v1/admin/nodes", headers=admin_headers)).status_code == 200


@postgres_only
async def test_two_revocations_of_one_token_at_once_are_audited_once(
    client: httpx.AsyncClient, app_state: Any, admin_headers: dict[str, str]
) -> None:
    """Both revocations read the token unrevoked and then wait for its row (here held by another
    transaction): the second must find it revoked, keep the first's time and not audit again."""
    r = await client.post("/v1/admin/tokens", json={"role": "admin", "name": "leaked"}, headers=admin_headers)
    assert r.status_code == 201, r.text
    token_id = r.json()["id"]
    url = f"/v1/admin/tokens/{token_id}/revoke"
    async with app_state.sessionmaker() as session, session.begin():
        await session.execute(select(ApiToken).where(ApiToken.id == token_id).with_for_update())
        revokes = [asyncio.create_task(client.post(url, headers=admin_headers)) for _ in range(2)]
        await until_waiting(app_state, 2, *revokes, on="row")
        assert not any(t.done() for t in revokes)
    responses = [await t for t in revokes]
    assert [r.status_code for r in responses] == [200, 200]
    assert responses[0].json()["revoked_at"] == responses[1].json()["revoked_at"]
    async with app_state.sessionmaker() as session:
        actions = (
            await session.scalars(select(AuditEntry.action).where(AuditEntry.target_id == token_id))
        ).all()
    assert sorted(actions) == ["token.create", "token.revoke"]


@postgres_only
@pytest.mark.parametrize("action", ["revoke", "rotate"])
async def test_two_admins_revoking_or_rotating_each_others_tokens_at_once_take_turns(
    client: httpx.AsyncClient, app_state: Any, action: str
) -> None:
    """Admin A acts on B's token as B acts on A's. Each request holds its own token (a share
    lock) in its transaction and then waits for the other's row: before, they deadlocked and
    PostgreSQL aborted one (503 ``transient_conflict``). Now each locks both tokens in id order
    first: one goes first and changes the other's token, and the second finds its own token dead
    (401), so one admin token always keeps working."""
    a, a_id = await new_token(app_state, "admin", "a")
    b, b_id = await new_token(app_state, "admin", "b")
    async with app_state.sessionmaker() as session, session.begin():
        # Both requests reach the tokens' rows while this holds them, and wait together.
        await session.execute(
            select(ApiToken).where(ApiToken.id.in_([a_id, b_id])).with_for_update(read=True)
        )
        requests = [
            asyncio.create_task(client.post(f"/v1/admin/tokens/{b_id}/{action}", headers=a)),
            asyncio.create_task(client.post(f"/v1/admin/tokens/{a_id}/{action}", headers=b)),
        ]
        await until_waiting(app_state, 2, *requests, on="row")
        assert not any(t.done() for t in requests)
    answers = [await t for t in requests]
    assert sorted(r.status_code for r in answers) == [200, 401], [r.text for r in answers]
    first = 0 if answers[0].status_code == 200 else 1
    problem(answers[1 - first], 401, "token_invalid")
    survivor = (a, b)[first]
    assert (await client.get("/v1/admin/nodes", headers=survivor)).status_code == 200
    problem(await client.get("/v1/admin/nodes", headers=(b, a)[first]), 401, "token_invalid")


@postgres_only
async def test_a_request_whose_token_is_revoked_while_it_waits_changes_nothing(
    client: httpx.AsyncClient, app_state: Any, admin_headers: dict[str, str]
) -> None:
    """The request's token check (before its body, outside its transaction) passes while the
    revocation is not yet committed; the request then reads the token again in its transaction,
    waits for the revocation and is refused: nothing is changed by a revoked token."""
    leaked, leaked_id = await new_token(app_state, "operator", "leaked")
    pool = await active_pool(client, leaked)
    url = f"/v1/admin/pools/{pool['id']}"
    async with app_state.sessionmaker() as session, session.begin():
        _, revoked = await revoke_token(session, leaked_id)
        assert revoked
        patch = asyncio.create_task(client.patch(url, json={"name": "hijacked"}, headers=leaked))
        await until_waiting(app_state, 1, patch, on="row")
        assert not patch.done()
    problem(await patch, 401, "token_invalid")
    assert (await client.get(url, headers=admin_headers)).json()["name"] == pool["name"]


@postgres_only
async def test_a_revocation_waits_for_the_requests_already_in_their_transactions(
    client: httpx.AsyncClient, app_state: Any, admin_headers: dict[str, str]
) -> None:
    """A request in its transaction (here waiting for its pool) holds its token: the revocation
    waits for it, so what the request did is committed before the token is revoked, never after,
    and the next request is refused."""
    leaked, leaked_id = await new_token(app_state, "operator", "leaked")
    pool = await active_pool(client, leaked)
    url = f"/v1/admin/pools/{pool['id']}"
    async with app_state.sessionmaker() as session, session.begin():
        await session.execute(select(Pool).where(Pool.id == pool["id"]).with_for_update())
        patch = asyncio.create_task(client.patch(url, json={"name": "renamed"}, headers=leaked))
        await until_waiting(app_state, 1, patch, on="row")
        revoke = asyncio.create_task(
            client.post(f"/v1/admin/tokens/{leaked_id}/revoke", headers=admin_headers)
        )
        await until_waiting(app_state, 2, patch, revoke, on="row")
        assert not revoke.done()
    assert (await patch).status_code == 200
    assert (await revoke).status_code == 200
    async with app_state.sessionmaker() as session:
        order = (
            await session.scalars(
                select(AuditEntry.action)
                .where(AuditEntry.action.in_(["pool.update", "token.revoke"]))
                .order_by(AuditEntry.id)
            )
        ).all()
    assert order == ["pool.update", "token.revoke"]
    problem(await client.get(url, headers=leaked), 401, "token_invalid")


async def test_a_rotated_token_keeps_its_pools_and_its_old_secret_is_refused(
    client: httpx.AsyncClient, app_state: Any, admin_headers: dict[str, str]
) -> None:
    """An operator's secret leaks: revoking the token would orphan its pools (an operator acts on
    the pools its token created). A rotation gives the same token a new secret instead."""
    leaked, token_id = await new_token(app_state, "operator", "lab operator")
    pool = await active_pool(client, leaked)
    r = await client.post(f"/v1/admin/tokens/{token_id}/rotate", headers=admin_headers)
    assert r.status_code == 200, r.text
    rotated = r.json()
    assert (rotated["id"], rotated["role"], rotated["name"]) == (token_id, "operator", "lab operator")
    fresh = {"Authorization": f"Bearer {rotated['token']}"}
    problem(await client.get(f"/v1/admin/pools/{pool['id']}", headers=leaked), 401, "token_invalid")
    r = await client.patch(f"/v1/admin/pools/{pool['id']}", json={"name": "still mine"}, headers=fresh)
    assert r.status_code == 200, r.text
    audit = (await client.get("/v1/admin/audit", headers=admin_headers)).json()["items"]
    assert [e["action"] for e in audit if e["target_id"] == token_id] == ["token.rotate"]
    assert rotated["token"] not in str(audit)
    problem(
        await client.post("/v1/admin/tokens/tok_0000/rotate", headers=admin_headers), 404, "token_not_found"
    )


async def test_a_revoked_token_is_not_rotated_and_an_expired_one_only_with_a_new_lifetime(
    client: httpx.AsyncClient, app_state: Any, admin_headers: dict[str, str]
) -> None:
    _, revoked_id = await new_token(app_state, "operator", "gone")
    assert (
        await client.post(f"/v1/admin/tokens/{revoked_id}/revoke", headers=admin_headers)
    ).status_code == 200
    problem(
        await client.post(f"/v1/admin/tokens/{revoked_id}/rotate", headers=admin_headers),
        409,
        "token_revoked",
    )

    r = await client.post(
        "/v1/admin/tokens",
        json={"role": "operator", "name": "short", "expires_in_s": 60},
        headers=admin_headers,
    )
    assert r.status_code == 201, r.text
    short_id = r.json()["id"]
    app_state.clock.advance(61)
    url = f"/v1/admin/tokens/{short_id}/rotate"
    problem(await client.post(url, headers=admin_headers), 409, "token_expired")
    problem(
        await client.post(url, json={"expires_in_s": 30}, headers=admin_headers), 422, "validation_failed"
    )
    r = await client.post(url, json={"expires_in_s": None}, headers=admin_headers)
    assert r.status_code == 200 and r.json()["expires_at"] is None, r.text
    assert (
        await client.get("/v1/admin/pools", headers={"Authorization": f"Bearer {r.json()['token']}"})
    ).status_code == 200
    r = await client.post(url, json={"expires_in_s": 3600}, headers=admin_headers)
    assert r.status_code == 200 and r.json()["expires_at"] is not None, r.text
    kept = r.json()["expires_at"]
    r = await client.post(url, headers=admin_headers)  # no body: the expiry stays
    assert r.status_code == 200 and r.json()["expires_at"] == kept, r.text


@postgres_only
async def test_a_request_with_the_old_secret_waiting_for_a_rotation_changes_nothing(
    client: httpx.AsyncClient, app_state: Any, admin_headers: dict[str, str]
) -> None:
    """The request's token check (before its body, outside its transaction) passes with the old
    secret while the rotation is not yet committed; the request then reads the token again in its
    transaction, waits for the rotation and is refused: the old secret changes nothing."""
    leaked, leaked_id = await new_token(app_state, "operator", "leaked")
    pool = await active_pool(client, leaked)
    url = f"/v1/admin/pools/{pool['id']}"
    async with app_state.sessionmaker() as session, session.begin():
        assert await rotate_token(session, leaked_id, now=app_state.clock.utcnow()) is not None
        patch = asyncio.create_task(client.patch(url, json={"name": "hijacked"}, headers=leaked))
        await until_waiting(app_state, 1, patch, on="row")
        assert not patch.done()
    problem(await patch, 401, "token_invalid")
    assert (await client.get(url, headers=admin_headers)).json()["name"] == pool["name"]
