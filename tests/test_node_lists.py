"""The node lists (``GET /v1/admin/nodes``, ``GET /v1/providers/me/nodes``): each node as its own
view gives it, read with a fixed number of hot-store calls and SQL statements per page."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse

from api_schemas.common import Page
from api_schemas.identity import NodeOut
from orchestrator.core.clock import FakeClock
from orchestrator.identity import repository as identity_repo
from orchestrator.identity.service import node_out
from orchestrator.liveness.service import sweep_once
from tests.conftest import Contributor
from tests.pools_helpers import active_pool, join, leave, registered
from tests.test_hot_paths import sql_log

# The hot store's reads of last beats, one node's or a batch's (whichever the store has).
BEAT_READS = ("last_beat", "last_beats")


@contextmanager
def beat_reads(store: Any) -> Iterator[list[str]]:
    """The calls the block makes to the hot store's last-beat reads (the real store, counted)."""
    calls: list[str] = []
    originals = {name: getattr(store, name) for name in BEAT_READS if hasattr(store, name)}

    def counting(name: str, method: Any) -> Any:
        async def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return await method(*args, **kwargs)

        return call

    for name, method in originals.items():
        setattr(store, name, counting(name, method))
    try:
        yield calls
    finally:
        for name in originals:
            delattr(store, name)  # the class's method again


@dataclass
class Fleet:
    provider: Contributor  # owns every node below
    nodes: dict[str, Contributor]  # by role: what each node's state is
    pools: dict[str, str]  # by name


async def _fleet(
    client: httpx.AsyncClient, app_state: Any, clock: FakeClock, headers: dict[str, str]
) -> Fleet:
    """Nodes of one provider in every state a list shows differently: one never seen, one
    healthy in two pools (active in one, pending in the other), one that left a pool, one dead
    whose hot-store entry is gone (its last beat is SQL's), one banned out of a pool, one
    revoked; and a node of another provider."""
    first = await registered(client)
    names = ["waiting", "healthy", "left", "dead", "banned", "revoked"]
    nodes = {"waiting": first}
    for name in names[1:]:
        nodes[name] = await registered(client, first.provider_key)
    await registered(client)  # another provider's: not in the provider's list
    open_pool = (await active_pool(client, headers, name="open"))["id"]
    approval = (await active_pool(client, headers, name="approval", admission="approval"))["id"]
    for name in names[1:]:
        assert (await nodes[name].beat(client)).status_code == 200
    assert (await join(client, nodes["healthy"], open_pool)).status_code == 201
    assert (await join(client, nodes["healthy"], approval)).json()["status"] == "pending"
    assert (await join(client, nodes["left"], open_pool)).status_code == 201
    assert (await leave(client, nodes["left"], open_pool)).status_code == 200
    assert (await join(client, nodes["banned"], open_pool)).status_code == 201
    assert (await join(client, nodes["dead"], approval)).status_code == 201
    # The dead node goes silent while the others beat; the sweeper marks it dead and keeps its
    # last beat in SQL, then the hot store forgets it (as when its entry expires).
    for _ in range(10):
        clock.advance(10)
        for name in ("healthy", "left", "banned", "revoked"):
            await nodes[name].beat(client)
        await sweep_once(app_state)
    await app_state.hot_store.forget_node(nodes["dead"].node_id)
    r = await client.post(
        f"/v1/admin/nodes/{nodes['banned'].node_id}/ban", json={"reason": "forged"}, headers=headers
    )
    assert r.status_code == 200, r.text
    r = await client.post(
        f"/v1/providers/me/nodes/{nodes['revoked'].node_id}/revoke", auth=first.provider_auth
    )
    assert r.status_code == 200, r.text
    return Fleet(provider=first, nodes=nodes, pools={"open": open_pool, "approval": approval})


async def _one_by_one(app_state: Any, node_ids: list[str], next_cursor: str | None) -> bytes:
    """The page as each node's own view (``node_out``, one node at a time) renders it."""
    async with app_state.sessionmaker() as session:
        items = []
        for node_id in node_ids:
            node = await identity_repo.get_node(session, node_id)
            assert node is not None
            items.append(await node_out(app_state, node))
        page = Page[NodeOut](items=items, next_cursor=next_cursor)
    return bytes(JSONResponse(jsonable_encoder(page)).body)


async def test_a_node_list_gives_each_node_as_its_own_view_does(
    client: httpx.AsyncClient, app_state: Any, clock: FakeClock, admin_headers: dict[str, str]
) -> None:
    fleet = await _fleet(client, app_state, clock, admin_headers)
    ids = {name: c.node_id for name, c in fleet.nodes.items()}
    mine = sorted(ids.values())

    r = await client.get("/v1/providers/me/nodes", auth=fleet.provider.provider_auth)
    assert r.status_code == 200, r.text
    assert r.content == await _one_by_one(app_state, mine, None)
    by_id = {n["id"]: n for n in r.json()["items"]}
    view = {name: by_id[node_id] for name, node_id in ids.items()}
    assert {name: v["status"] for name, v in view.items()} == {
        "waiting": "waiting",
        "healthy": "healthy",
        "left": "healthy",
        "dead": "dead",
        "banned": "banned",
        "revoked": "banned",
    }
    open_pool, approval = fleet.pools["open"], fleet.pools["approval"]
    healthy_pools = {open_pool: "active", approval: "pending"}
    assert view["healthy"]["memberships"] == [
        {"pool_id": p, "status": s} for p, s in sorted(healthy_pools.items())
    ]
    assert view["left"]["memberships"] == [{"pool_id": open_pool, "status": "left"}]
    assert view["banned"]["memberships"] == [{"pool_id": open_pool, "status": "ejected"}]
    assert view["dead"]["memberships"] == [{"pool_id": approval, "status": "pending"}]
    assert view["waiting"]["memberships"] == view["revoked"]["memberships"] == []
    assert view["waiting"]["last_heartbeat_at"] is None
    # The dead node's last beat is the one SQL kept, 100 s before the others' last.
    assert view["dead"]["last_heartbeat_at"] is not None
    assert view["dead"]["last_heartbeat_at"] < view["healthy"]["last_heartbeat_at"]
    assert view["revoked"]["revoked_at"] is not None and view["banned"]["revoked_at"] is None

    # The admin's list, whole and by pages, with filters: the same bytes as one by one.
    everyone = await client.get("/v1/admin/nodes", params={"limit": 500}, headers=admin_headers)
    all_ids = [n["id"] for n in everyone.json()["items"]]
    assert len(all_ids) == 7 and set(mine) < set(all_ids)
    assert everyone.content == await _one_by_one(app_state, all_ids, None)
    first = await client.get("/v1/admin/nodes", params={"limit": 3}, headers=admin_headers)
    assert first.content == await _one_by_one(app_state, all_ids[:3], first.json()["next_cursor"])
    banned = await client.get("/v1/admin/nodes", params={"status": "banned"}, headers=admin_headers)
    assert banned.content == await _one_by_one(app_state, sorted([ids["banned"], ids["revoked"]]), None)
    none = await client.get("/v1/admin/nodes", params={"status": "unhealthy"}, headers=admin_headers)
    assert json.loads(none.content) == {"items": [], "next_cursor": None}


async def test_a_node_list_reads_each_page_in_a_fixed_number_of_calls(
    client: httpx.AsyncClient, app_state: Any, clock: FakeClock, admin_headers: dict[str, str]
) -> None:
    """One read of the page's last beats from the hot store and one SQL statement for its
    memberships, whether the page has 2 nodes or 7: a full page of 500 made 500 of each."""
    fleet = await _fleet(client, app_state, clock, admin_headers)

    async def cost(limit: int, **request: Any) -> tuple[int, int]:
        path = "/v1/providers/me/nodes" if "auth" in request else "/v1/admin/nodes"
        with beat_reads(app_state.hot_store) as reads:
            async with sql_log(app_state) as statements:
                r = await client.get(path, params={"limit": limit}, **request)
        assert r.status_code == 200 and len(r.json()["items"]) == limit, r.text
        return len(reads), len([s for s in statements if "spent_nonces" not in s])

    admin = {"headers": admin_headers}
    signed = {"auth": fleet.provider.provider_auth}
    for request in (admin, signed):
        (reads_2, sql_2), (reads_6, sql_6) = await cost(2, **request), await cost(6, **request)
        assert (reads_2, reads_6, sql_6 - sql_2) == (1, 1, 0), (sql_2, sql_6)
