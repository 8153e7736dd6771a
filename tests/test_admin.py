"""Operator authentication and the admin node registry."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from orchestrator.admin.tokens import revoke_token
from tests.conftest import Contributor, make_token, new_contributor, problem


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
        from sqlalchemy import select

        from orchestrator.admin.models import ApiToken

        token_id = (await session.execute(select(ApiToken.id))).scalar_one()
        assert await revoke_token(session, token_id)
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


async def test_ban_needs_a_reason(
    client: httpx.AsyncClient, admin_headers: dict[str, str], contributor: Contributor
) -> None:
    r = await client.post(f"/v1/admin/nodes/{contributor.node_id}/ban", json={}, headers=admin_headers)
    problem(r, 422, "validation_failed")
    assert (await client.get("/v1/nodes/me", auth=contributor.node_auth)).status_code == 200
