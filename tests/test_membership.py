"""Joining and leaving pools: refusals, invites, approval, ejection, blacklists, caps and stake."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from orchestrator.core.clock import FakeClock
from orchestrator.ledger.jobs import release_once
from orchestrator.pools import service as pools_service
from orchestrator.pools.models import PoolInvite
from tests.conftest import Contributor, postgres_only, problem
from tests.pools_helpers import (
    active_pool,
    balance,
    client_from,
    create_pool,
    deposit,
    invite,
    join,
    leave,
    lifecycle,
    reason_codes,
    registered,
)

DAY = 86_400
NO_STAKE = {"stake_free": 0, "stake_locked": 0, "stake_unbonding": 0}


def stake(b: dict[str, int]) -> dict[str, int]:
    return {k: b[k] for k in ("stake_free", "stake_locked", "stake_unbonding")}


async def members(
    client: httpx.AsyncClient, headers: dict[str, str], pool_id: str, **params: Any
) -> dict[str, str]:
    r = await client.get(f"/v1/admin/pools/{pool_id}/members", params=params, headers=headers)
    assert r.status_code == 200, r.text
    return {m["node_id"]: m["status"] for m in r.json()["items"]}


# ------------------------------------------------------------------ joining and leaving


async def test_a_node_joins_an_open_pool_and_sees_the_membership(
    client: httpx.AsyncClient, operator_headers: dict[str, str], contributor: Contributor
) -> None:
    pool = await active_pool(client, operator_headers)
    r = await join(client, contributor, pool["id"])
    assert r.status_code == 201, r.text
    m = r.json()
    assert m["pool_id"] == pool["id"] and m["node_id"] == contributor.node_id
    assert m["provider_id"] == contributor.provider_id
    assert (m["status"], m["episode"], m["stake"]) == ("active", 1, 0)
    assert m["activated_at"] is not None and m["ended_at"] is None

    me = (await client.get("/v1/nodes/me", auth=contributor.node_auth)).json()
    assert me["memberships"] == [{"pool_id": pool["id"], "status": "active"}]
    assert await members(client, operator_headers, pool["id"]) == {contributor.node_id: "active"}
    listed = (await client.get("/v1/pools")).json()["items"]
    assert listed[0]["members"] == 1


async def test_joining_twice_is_idempotent_and_locks_stake_once(
    client: httpx.AsyncClient,
    operator_headers: dict[str, str],
    admin_headers: dict[str, str],
    contributor: Contributor,
) -> None:
    pool = await active_pool(client, operator_headers, economics={"min_stake_per_node": 100})
    await deposit(client, admin_headers, contributor.provider_id, 500)
    first = await join(client, contributor, pool["id"])
    assert first.status_code == 201
    again = await join(client, contributor, pool["id"])
    assert again.status_code == 200
    assert again.json() == first.json()
    assert stake(await balance(client, contributor)) == {
        "stake_free": 400,
        "stake_locked": 100,
        "stake_unbonding": 0,
    }


async def test_a_join_needs_the_nodes_signature(
    client: httpx.AsyncClient, operator_headers: dict[str, str]
) -> None:
    pool = await active_pool(client, operator_headers)
    problem(await client.post(f"/v1/pools/{pool['id']}/join", json={}), 401, "signature_missing")


async def test_a_banned_node_cannot_join(
    client: httpx.AsyncClient,
    operator_headers: dict[str, str],
    admin_headers: dict[str, str],
    contributor: Contributor,
) -> None:
    pool = await active_pool(client, operator_headers)
    r = await client.post(
        f"/v1/admin/nodes/{contributor.node_id}/ban", json={"reason": "x"}, headers=admin_headers
    )
    assert r.status_code == 200
    body = problem(await join(client, contributor, pool["id"]), 403, "node_banned")
    assert await members(client, operator_headers, pool["id"]) == {}
    # Its 403 is a plain problem, without the reasons of a refused join: the schema says so
    # (it documented every 403 of a join as a JoinRefusal, reasons required).
    assert "reasons" not in body
    spec = (await client.get("/openapi.json")).json()
    documented = spec["paths"]["/v1/pools/{pool_id}/join"]["post"]["responses"]["403"]
    branches = documented["content"]["application/problem+json"]["schema"].get("anyOf", [])
    schemas = spec["components"]["schemas"]
    required = [schemas[b["$ref"].rsplit("/", 1)[-1]]["required"] for b in branches]
    assert any("reasons" not in r for r in required) and any("reasons" in r for r in required)


async def test_joining_a_missing_pool_is_not_found(
    client: httpx.AsyncClient, contributor: Contributor
) -> None:
    problem(await join(client, contributor, "pool_0000000000000000"), 404, "pool_not_found")
    problem(await leave(client, contributor, "pool_0000000000000000"), 404, "pool_not_found")


async def test_unknown_fields_in_the_join_body_are_refused(
    client: httpx.AsyncClient, operator_headers: dict[str, str], contributor: Contributor
) -> None:
    pool = await active_pool(client, operator_headers)
    problem(await join(client, contributor, pool["id"], invite="abc"), 422, "validation_failed")
    assert await members(client, operator_headers, pool["id"]) == {}


async def test_leaving_an_active_membership_starts_unbonding_for_the_pools_period(
    client: httpx.AsyncClient,
    app_state: Any,
    clock: FakeClock,
    operator_headers: dict[str, str],
    admin_headers: dict[str, str],
    contributor: Contributor,
) -> None:
    pool = await active_pool(
        client, operator_headers, economics={"min_stake_per_node": 100, "unbonding_period_s": DAY}
    )
    await deposit(client, admin_headers, contributor.provider_id, 150)
    assert (await join(client, contributor, pool["id"])).status_code == 201
    r = await leave(client, contributor, pool["id"])
    assert r.status_code == 200
    assert r.json()["status"] == "left" and r.json()["ended_at"] is not None
    assert stake(await balance(client, contributor)) == {
        "stake_free": 50,
        "stake_locked": 0,
        "stake_unbonding": 100,
    }
    again = await leave(client, contributor, pool["id"])  # idempotent
    assert again.status_code == 200 and again.json() == r.json()
    assert (await client.get("/v1/nodes/me", auth=contributor.node_auth)).json()["memberships"] == [
        {"pool_id": pool["id"], "status": "left"}
    ]

    async def admin_balance() -> dict[str, int]:
        r = await client.get(f"/v1/admin/providers/{contributor.provider_id}/balance", headers=admin_headers)
        return stake(r.json())

    clock.advance(DAY - 60)
    await release_once(app_state)
    assert await admin_balance() == {"stake_free": 50, "stake_locked": 0, "stake_unbonding": 100}
    clock.advance(120)
    assert (await release_once(app_state)).released == 1
    assert await admin_balance() == {"stake_free": 150, "stake_locked": 0, "stake_unbonding": 0}


async def test_withdrawing_a_pending_join_returns_the_stake_at_once(
    client: httpx.AsyncClient,
    operator_headers: dict[str, str],
    admin_headers: dict[str, str],
    contributor: Contributor,
) -> None:
    pool = await active_pool(
        client, operator_headers, admission="approval", economics={"min_stake_per_node": 100}
    )
    await deposit(client, admin_headers, contributor.provider_id, 100)
    assert (await join(client, contributor, pool["id"])).json()["status"] == "pending"
    assert stake(await balance(client, contributor)) == {**NO_STAKE, "stake_locked": 100}
    r = await leave(client, contributor, pool["id"])
    assert r.json()["status"] == "left"
    assert stake(await balance(client, contributor)) == {**NO_STAKE, "stake_free": 100}


async def test_leaving_a_pool_never_joined_is_refused(
    client: httpx.AsyncClient, operator_headers: dict[str, str], contributor: Contributor
) -> None:
    pool = await active_pool(client, operator_headers)
    problem(await leave(client, contributor, pool["id"]), 403, "not_a_member")


async def test_a_node_that_left_can_rejoin_as_a_new_episode(
    client: httpx.AsyncClient,
    operator_headers: dict[str, str],
    admin_headers: dict[str, str],
    contributor: Contributor,
) -> None:
    pool = await active_pool(client, operator_headers, economics={"min_stake_per_node": 100})
    await deposit(client, admin_headers, contributor.provider_id, 200)
    await join(client, contributor, pool["id"])
    await leave(client, contributor, pool["id"])
    r = await join(client, contributor, pool["id"])
    assert r.status_code == 201
    assert (r.json()["status"], r.json()["episode"], r.json()["ended_at"]) == ("active", 2, None)
    # The second episode locked stake again (its ledger key differs from the first's).
    assert stake(await balance(client, contributor)) == {
        "stake_free": 0,
        "stake_locked": 100,
        "stake_unbonding": 100,
    }


async def test_a_pool_without_minimum_stake_moves_no_money(
    client: httpx.AsyncClient,
    operator_headers: dict[str, str],
    admin_headers: dict[str, str],
    contributor: Contributor,
) -> None:
    pool = await active_pool(client, operator_headers)
    await deposit(client, admin_headers, contributor.provider_id, 10)
    await join(client, contributor, pool["id"])
    await leave(client, contributor, pool["id"])
    assert stake(await balance(client, contributor)) == {**NO_STAKE, "stake_free": 10}


async def test_stake_locked_is_what_the_join_locked_even_if_the_minimum_changes(
    client: httpx.AsyncClient,
    operator_headers: dict[str, str],
    admin_headers: dict[str, str],
    contributor: Contributor,
) -> None:
    pool = await active_pool(client, operator_headers, economics={"min_stake_per_node": 100})
    await deposit(client, admin_headers, contributor.provider_id, 100)
    await join(client, contributor, pool["id"])
    r = await client.patch(
        f"/v1/admin/pools/{pool['id']}",
        json={"economics": {"min_stake_per_node": 300}},
        headers=operator_headers,
    )
    assert r.status_code == 200
    await leave(client, contributor, pool["id"])
    assert stake(await balance(client, contributor)) == {**NO_STAKE, "stake_unbonding": 100}


# ------------------------------------------------------------------ refusals


@pytest.mark.parametrize("state", ["pending", "paused", "completed"])
async def test_a_pool_that_is_not_active_refuses_joins(
    client: httpx.AsyncClient, operator_headers: dict[str, str], contributor: Contributor, state: str
) -> None:
    pool = await create_pool(client, operator_headers)
    steps = {"pending": [], "paused": ["activate", "pause"], "completed": ["activate", "pause", "complete"]}
    for action in steps[state]:
        await lifecycle(client, operator_headers, pool["id"], action)
    body = problem(await join(client, contributor, pool["id"]), 403, "pool_not_active")
    assert body["reasons"] == [{"code": "pool_not_active", "detail": f"the pool is {state}, not active"}]
    assert (await client.get("/v1/nodes/me", auth=contributor.node_auth)).json()["memberships"] == []


async def test_hardware_requirements_are_met_by_any_alternative(
    client: httpx.AsyncClient, operator_headers: dict[str, str]
) -> None:
    pool = await active_pool(
        client,
        operator_headers,
        requirements={
            "any_of": [
                {"gpu_models": ["nvidia h100 80gb hbm3"], "min_gpu_count": 2},
                {"gpu_models": None, "min_gpu_memory_mb": 80000, "min_ram_mb": 65536},
            ]
        },
    )
    # One H100 (81559 MiB), 128 GiB RAM: fails the first alternative (count), meets the second.
    fits = await registered(client)
    assert (await join(client, fits, pool["id"])).status_code == 201

    small = await registered(client, gpu_model="NVIDIA GeForce RTX 4090", gpu_memory_mb=24564, ram_mb=32768)
    body = problem(await join(client, small, pool["id"]), 403, "requirements_unmet")
    [reason] = body["reasons"]
    assert reason["alternatives"] == [
        {
            "alternative": 1,
            "failed": [
                {
                    "rule": "gpu_models",
                    "required": ["nvidia h100 80gb hbm3"],
                    "actual": "NVIDIA GeForce RTX 4090",
                },
                {"rule": "min_gpu_count", "required": 2, "actual": 1},
            ],
        },
        {
            "alternative": 2,
            "failed": [
                {"rule": "min_gpu_memory_mb", "required": 80000, "actual": 24564},
                {"rule": "min_ram_mb", "required": 65536, "actual": 32768},
            ],
        },
    ]
    assert "min_gpu_count" in reason["detail"] and "min_ram_mb" in reason["detail"]

    cpu_only = await registered(client, gpu_model=None, gpu_count=0, gpu_memory_mb=0)
    cpu_reasons = problem(await join(client, cpu_only, pool["id"]), 403, "requirements_unmet")["reasons"]
    assert cpu_reasons[0]["alternatives"][0]["failed"][0] == {
        "rule": "gpu_models",
        "required": ["nvidia h100 80gb hbm3"],
        "actual": None,
    }
    assert "the node has no GPU; the pool wants one of 'nvidia h100 80gb hbm3'" in cpu_reasons[0]["detail"]


async def test_insufficient_free_stake_refuses_the_join_and_locks_nothing(
    client: httpx.AsyncClient,
    operator_headers: dict[str, str],
    admin_headers: dict[str, str],
    contributor: Contributor,
) -> None:
    pool = await active_pool(client, operator_headers, economics={"min_stake_per_node": 100})
    await deposit(client, admin_headers, contributor.provider_id, 99)
    body = problem(await join(client, contributor, pool["id"]), 403, "stake_insufficient")
    assert body["reasons"][0]["required"] == 100
    assert "99" in body["reasons"][0]["detail"]
    assert stake(await balance(client, contributor)) == {**NO_STAKE, "stake_free": 99}
    await deposit(client, admin_headers, contributor.provider_id, 1)
    assert (await join(client, contributor, pool["id"])).status_code == 201
    assert stake(await balance(client, contributor)) == {**NO_STAKE, "stake_locked": 100}


async def test_a_full_pool_refuses_joins_until_a_member_leaves(
    client: httpx.AsyncClient, operator_headers: dict[str, str]
) -> None:
    pool = await active_pool(client, operator_headers, caps={"max_nodes": 2})
    a, b, c = [await registered(client) for _ in range(3)]
    assert (await join(client, a, pool["id"])).status_code == 201
    assert (await join(client, b, pool["id"])).status_code == 201
    body = problem(await join(client, c, pool["id"]), 403, "pool_full")
    assert "2 of 2" in body["detail"]
    await leave(client, a, pool["id"])
    assert (await join(client, c, pool["id"])).status_code == 201


async def test_pending_joins_count_against_the_caps(
    client: httpx.AsyncClient, operator_headers: dict[str, str]
) -> None:
    pool = await active_pool(client, operator_headers, admission="approval", caps={"max_nodes": 1})
    a, b = await registered(client), await registered(client)
    assert (await join(client, a, pool["id"])).json()["status"] == "pending"
    problem(await join(client, b, pool["id"]), 403, "pool_full")


async def test_the_per_provider_cap_counts_a_providers_nodes(
    client: httpx.AsyncClient, app: Any, operator_headers: dict[str, str]
) -> None:
    pool = await active_pool(client, operator_headers, caps={"max_nodes_per_provider": 2})
    first = await registered(client)
    siblings = []
    for _ in range(2):  # each from its own address, so only the provider links them
        async with client_from(app) as elsewhere:
            siblings.append(await registered(elsewhere, first.provider_key))
    stranger = await registered(client)
    assert (await join(client, first, pool["id"])).status_code == 201
    assert (await join(client, siblings[0], pool["id"])).status_code == 201
    problem(await join(client, siblings[1], pool["id"]), 403, "provider_cap")
    assert (await join(client, stranger, pool["id"])).status_code == 201


async def test_the_per_ip_cap_counts_nodes_registered_from_one_address(
    client: httpx.AsyncClient, app: Any, operator_headers: dict[str, str]
) -> None:
    pool = await active_pool(client, operator_headers, caps={"max_nodes_per_ip": 2})
    async with client_from(app, "203.0.113.7") as same_ip, client_from(app, "203.0.113.8") as other_ip:
        crowd = [await registered(same_ip) for _ in range(3)]  # three providers, one address
        elsewhere = await registered(other_ip)
    assert (await join(client, crowd[0], pool["id"])).status_code == 201
    assert (await join(client, crowd[1], pool["id"])).status_code == 201
    body = problem(await join(client, crowd[2], pool["id"]), 403, "ip_cap")
    assert len(body["reasons"]) == 1
    assert (await join(client, elsewhere, pool["id"])).status_code == 201


async def test_a_member_that_registers_again_from_another_address_stays_within_the_per_ip_cap(
    client: httpx.AsyncClient, app: Any, operator_headers: dict[str, str], admin_headers: dict[str, str]
) -> None:
    """The per-IP cap was checked only at the join: a node could join from one address and then
    register again from another, so a few addresses held any number of nodes in the pool."""
    capped = await active_pool(client, operator_headers, caps={"max_nodes_per_ip": 1})
    uncapped = await active_pool(client, operator_headers)
    async with client_from(app, "203.0.113.7") as home, client_from(app, "198.51.100.9") as away:
        settled, mover = await registered(home), await registered(away)
        for node in (settled, mover):
            assert (await join(client, node, capped["id"])).status_code == 201
        assert (await join(client, mover, uncapped["id"])).status_code == 201

        # Moving to the address whose one allowed node is already in the capped pool: refused,
        # and nothing changes (the node keeps its address, its specs, its memberships).
        moved = mover.node_body()
        moved["version"] = "moved"
        body = problem(await home.post("/v1/nodes", json=moved, auth=mover.node_auth), 409, "ip_cap")
        assert body["pools"] == [{"pool_id": capped["id"], "nodes_from_address": 1, "max_nodes_per_ip": 1}]
        me = (await away.get("/v1/nodes/me", auth=mover.node_auth)).json()
        assert me["version"] == mover.node_body()["version"]
        assert sorted(m["pool_id"] for m in me["memberships"] if m["status"] == "active") == sorted(
            [capped["id"], uncapped["id"]]
        )
        node = await client.get(f"/v1/admin/nodes/{mover.node_id}", headers=admin_headers)
        assert node.json()["ip_address"] == "198.51.100.9"
        r = await away.post("/v1/nodes", json=mover.node_body(), auth=mover.node_auth)
        assert r.status_code == 200 and r.json()["version"] != "moved", r.text
        assert (
            await home.post("/v1/nodes", json=settled.node_body(), auth=settled.node_auth)
        ).status_code == 200

        # Once the settled node has left, the move is within the cap.
        await leave(client, settled, capped["id"])
        r = await home.post("/v1/nodes", json=moved, auth=mover.node_auth)
        assert r.status_code == 200 and r.json()["version"] == "moved", r.text
        problem(await join(home, settled, capped["id"]), 403, "ip_cap")


async def test_a_join_refused_for_several_reasons_names_them_all(
    client: httpx.AsyncClient,
    operator_headers: dict[str, str],
    admin_headers: dict[str, str],
) -> None:
    pool = await active_pool(
        client,
        operator_headers,
        admission="invite",
        requirements={"any_of": [{"gpu_models": ["AMD Instinct MI300X"]}]},
        caps={"max_nodes": 1, "max_nodes_per_provider": 1, "max_nodes_per_ip": 1},
        economics={"min_stake_per_node": 100},
    )
    first = await registered(client, gpu_model="AMD Instinct MI300X", gpu_memory_mb=196608)
    await deposit(client, admin_headers, first.provider_id, 100)
    code = await invite(client, operator_headers, pool["id"])
    assert (await join(client, first, pool["id"], invite_code=code)).status_code == 201
    sibling = await registered(client, first.provider_key)  # same provider and IP, an H100, no stake left
    await lifecycle(client, operator_headers, pool["id"], "pause")

    r = await join(client, sibling, pool["id"])
    body = problem(r, 403, "pool_not_active")
    assert reason_codes(r) == [
        "pool_not_active",
        "requirements_unmet",
        "invite_required",
        "pool_full",
        "provider_cap",
        "ip_cap",
        "stake_insufficient",
    ]
    for reason in body["reasons"]:
        assert reason["detail"] and reason["detail"] in body["detail"]

    with_bad_code = await join(client, sibling, pool["id"], invite_code="not-a-real-code")
    assert "invite_invalid" in reason_codes(with_bad_code) and "invite_required" not in reason_codes(
        with_bad_code
    )
    assert await members(client, operator_headers, pool["id"]) == {first.node_id: "active"}


async def test_an_ejected_node_of_a_blacklisted_provider_hears_every_reason(
    client: httpx.AsyncClient, operator_headers: dict[str, str]
) -> None:
    pool = await active_pool(client, operator_headers)
    outcast, occupant = await registered(client), await registered(client)  # one IP, two providers
    await join(client, outcast, pool["id"])
    await join(client, occupant, pool["id"])
    r = await client.post(
        f"/v1/admin/pools/{pool['id']}/members/{outcast.node_id}/eject",
        json={"reason": "x"},
        headers=operator_headers,
    )
    assert r.status_code == 200
    r = await client.patch(
        f"/v1/admin/pools/{pool['id']}",
        json={
            "admission": "invite",
            "requirements": {"any_of": [{"min_gpu_count": 8}]},
            "caps": {"max_nodes": 1, "max_nodes_per_ip": 1},
            "economics": {"min_stake_per_node": 5},
        },
        headers=operator_headers,
    )
    assert r.status_code == 200, r.text
    r = await client.post(
        f"/v1/admin/pools/{pool['id']}/blacklist",
        json={"provider_id": outcast.provider_id, "reason": "sybil"},
        headers=operator_headers,
    )
    assert r.status_code == 201 and r.json()["removed_nodes"] == []
    await lifecycle(client, operator_headers, pool["id"], "pause")

    assert reason_codes(await join(client, outcast, pool["id"])) == [
        "pool_not_active",
        "node_ejected",
        "provider_blacklisted",
        "requirements_unmet",
        "invite_required",
        "pool_full",
        "ip_cap",
        "stake_insufficient",
    ]


# ------------------------------------------------------------------ invites


async def test_an_invite_admits_one_node_once(
    client: httpx.AsyncClient, operator_headers: dict[str, str]
) -> None:
    pool = await active_pool(client, operator_headers, admission="invite")
    a, b = await registered(client), await registered(client)
    problem(await join(client, a, pool["id"]), 403, "invite_required")
    code = await invite(client, operator_headers, pool["id"])
    r = await join(client, a, pool["id"], invite_code=code)
    assert r.status_code == 201 and r.json()["status"] == "active"
    body = problem(await join(client, b, pool["id"], invite_code=code), 403, "invite_invalid")
    assert "already used" in body["reasons"][0]["detail"]
    # Joining again with the used code is the idempotent repeat of a's join, not a second use.
    assert (await join(client, a, pool["id"], invite_code=code)).status_code == 200


async def test_an_expired_invite_is_refused(
    client: httpx.AsyncClient, operator_headers: dict[str, str], clock: FakeClock, contributor: Contributor
) -> None:
    pool = await active_pool(client, operator_headers, admission="invite")
    code = await invite(client, operator_headers, pool["id"], expires_in_s=60)
    clock.advance(61)
    body = problem(await join(client, contributor, pool["id"], invite_code=code), 403, "invite_invalid")
    assert "expired" in body["reasons"][0]["detail"]


async def test_an_invite_for_another_pool_is_refused(
    client: httpx.AsyncClient, operator_headers: dict[str, str], contributor: Contributor
) -> None:
    pool = await active_pool(client, operator_headers, admission="invite")
    other = await active_pool(client, operator_headers, admission="invite", name="other")
    code = await invite(client, operator_headers, other["id"])
    body = problem(await join(client, contributor, pool["id"], invite_code=code), 403, "invite_invalid")
    assert "another pool" in body["reasons"][0]["detail"]
    # The refused attempt did not spend the code.
    assert (await join(client, contributor, other["id"], invite_code=code)).status_code == 201


async def test_invite_codes_are_stored_only_as_hashes(
    client: httpx.AsyncClient, app_state: Any, operator_headers: dict[str, str]
) -> None:
    pool = await create_pool(client, operator_headers, admission="invite")
    r = await client.post(
        f"/v1/admin/pools/{pool['id']}/invites", json={"expires_in_s": 120}, headers=operator_headers
    )
    assert r.status_code == 201
    out = r.json()
    assert out["id"].startswith("inv_") and out["pool_id"] == pool["id"] and len(out["code"]) >= 24
    async with app_state.sessionmaker() as session:
        row = (await session.execute(select(PoolInvite))).scalar_one()
    assert row.code_hash == hashlib.sha256(out["code"].encode()).hexdigest()
    assert out["code"] not in (row.code_hash, row.id)
    problem(
        await client.post(
            f"/v1/admin/pools/{pool['id']}/invites", json={"expires_in_s": 10}, headers=operator_headers
        ),
        422,
        "validation_failed",
    )


# ------------------------------------------------------------------ approval


async def test_an_approval_pool_queues_joins_until_an_operator_approves(
    client: httpx.AsyncClient,
    operator_headers: dict[str, str],
    admin_headers: dict[str, str],
    contributor: Contributor,
) -> None:
    pool = await active_pool(
        client, operator_headers, admission="approval", economics={"min_stake_per_node": 40}
    )
    await deposit(client, admin_headers, contributor.provider_id, 40)
    r = await join(client, contributor, pool["id"])
    assert r.status_code == 201
    assert (r.json()["status"], r.json()["activated_at"]) == ("pending", None)
    assert stake(await balance(client, contributor)) == {**NO_STAKE, "stake_locked": 40}
    assert await members(client, operator_headers, pool["id"], status="pending") == {
        contributor.node_id: "pending"
    }

    url = f"/v1/admin/pools/{pool['id']}/members/{contributor.node_id}"
    approved = await client.post(f"{url}/approve", headers=operator_headers)
    assert approved.status_code == 200
    assert approved.json()["status"] == "active" and approved.json()["activated_at"] is not None
    assert (await client.post(f"{url}/approve", headers=operator_headers)).json() == approved.json()
    assert (await join(client, contributor, pool["id"])).json()["status"] == "active"
    assert stake(await balance(client, contributor)) == {**NO_STAKE, "stake_locked": 40}
    problem(await client.post(f"{url}/reject", headers=operator_headers), 409, "membership_not_pending")


async def test_a_rejected_join_gets_its_stake_back_at_once(
    client: httpx.AsyncClient,
    operator_headers: dict[str, str],
    admin_headers: dict[str, str],
    contributor: Contributor,
) -> None:
    pool = await active_pool(
        client, operator_headers, admission="approval", economics={"min_stake_per_node": 40}
    )
    await deposit(client, admin_headers, contributor.provider_id, 50)
    await join(client, contributor, pool["id"])
    url = f"/v1/admin/pools/{pool['id']}/members/{contributor.node_id}"
    r = await client.post(f"{url}/reject", json={"reason": "unknown lab"}, headers=operator_headers)
    assert r.status_code == 200
    assert (r.json()["status"], r.json()["reason"]) == ("rejected", "unknown lab")
    assert stake(await balance(client, contributor)) == {**NO_STAKE, "stake_free": 50}
    assert (await client.post(f"{url}/reject", headers=operator_headers)).json()["status"] == "rejected"
    assert stake(await balance(client, contributor)) == {**NO_STAKE, "stake_free": 50}
    problem(await client.post(f"{url}/approve", headers=operator_headers), 409, "membership_not_pending")
    # A rejected node may ask again (a new episode, pending again).
    again = await join(client, contributor, pool["id"])
    assert (again.status_code, again.json()["status"], again.json()["episode"]) == (201, "pending", 2)


async def test_approving_a_node_without_a_membership_is_not_found(
    client: httpx.AsyncClient, operator_headers: dict[str, str], contributor: Contributor
) -> None:
    pool = await active_pool(client, operator_headers, admission="approval")
    url = f"/v1/admin/pools/{pool['id']}/members/{contributor.node_id}"
    problem(await client.post(f"{url}/approve", headers=operator_headers), 404, "member_not_found")
    problem(
        await client.post(f"{url}/eject", json={"reason": "x"}, headers=operator_headers),
        404,
        "member_not_found",
    )


async def test_members_are_listed_by_status_with_pagination(
    client: httpx.AsyncClient, operator_headers: dict[str, str]
) -> None:
    pool = await active_pool(client, operator_headers)
    nodes = [await registered(client) for _ in range(5)]
    for c in nodes:
        await join(client, c, pool["id"])
    await leave(client, nodes[0], pool["id"])
    seen: list[str] = []
    cursor = None
    while True:
        params = {"limit": 2, "status": "active", **({"cursor": cursor} if cursor else {})}
        page = (
            await client.get(f"/v1/admin/pools/{pool['id']}/members", params=params, headers=operator_headers)
        ).json()
        seen += [m["node_id"] for m in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == [c.node_id for c in nodes[1:]]
    assert await members(client, operator_headers, pool["id"], status="left") == {nodes[0].node_id: "left"}
    problem(
        await client.get(
            f"/v1/admin/pools/{pool['id']}/members", params={"status": "gone"}, headers=operator_headers
        ),
        400,
        "invalid_query",
    )


# ------------------------------------------------------------------ ejection and blacklisting


@pytest.fixture
def released(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """The (pool, node) of every release of a member's leases, recorded instead of made."""
    calls: list[tuple[str, str]] = []

    async def record_release(session: Any, pool_id: str, node_id: str, *, now: Any) -> int:
        calls.append((pool_id, node_id))
        return 0

    monkeypatch.setattr(pools_service, "release_member_leases", record_release)
    return calls


async def test_an_ejected_node_leaves_its_stake_unbonds_and_it_cannot_rejoin(
    client: httpx.AsyncClient,
    operator_headers: dict[str, str],
    admin_headers: dict[str, str],
    contributor: Contributor,
    released: list[tuple[str, str]],
) -> None:
    pool = await active_pool(client, operator_headers, economics={"min_stake_per_node": 100})
    await deposit(client, admin_headers, contributor.provider_id, 100)
    await join(client, contributor, pool["id"])

    url = f"/v1/admin/pools/{pool['id']}/members/{contributor.node_id}/eject"
    problem(await client.post(url, json={}, headers=operator_headers), 422, "validation_failed")
    r = await client.post(url, json={"reason": "forged rewards"}, headers=operator_headers)
    assert r.status_code == 200
    assert (r.json()["status"], r.json()["reason"]) == ("ejected", "forged rewards")
    assert released == [(pool["id"], contributor.node_id)]
    assert stake(await balance(client, contributor)) == {**NO_STAKE, "stake_unbonding": 100}

    refused = await join(client, contributor, pool["id"])
    problem(refused, 403, "node_ejected")
    assert reason_codes(refused) == ["node_ejected", "stake_insufficient"]  # its stake is unbonding
    assert (await client.post(url, json={"reason": "again"}, headers=operator_headers)).json()[
        "reason"
    ] == "forged rewards"
    assert (await leave(client, contributor, pool["id"])).json()["status"] == "ejected"
    assert stake(await balance(client, contributor)) == {**NO_STAKE, "stake_unbonding": 100}


async def test_ejecting_a_pending_member_returns_its_stake_at_once(
    client: httpx.AsyncClient,
    operator_headers: dict[str, str],
    admin_headers: dict[str, str],
    contributor: Contributor,
) -> None:
    pool = await active_pool(
        client, operator_headers, admission="approval", economics={"min_stake_per_node": 100}
    )
    await deposit(client, admin_headers, contributor.provider_id, 100)
    await join(client, contributor, pool["id"])
    r = await client.post(
        f"/v1/admin/pools/{pool['id']}/members/{contributor.node_id}/eject",
        json={"reason": "sybil"},
        headers=operator_headers,
    )
    assert r.json()["status"] == "ejected"
    assert stake(await balance(client, contributor)) == {**NO_STAKE, "stake_free": 100}


async def test_every_way_out_of_a_pool_releases_the_nodes_leases_once(
    client: httpx.AsyncClient, operator_headers: dict[str, str], released: list[tuple[str, str]]
) -> None:
    pool = await active_pool(client, operator_headers)
    leaver, banned, stayer = await registered(client), await registered(client), await registered(client)
    for c in (leaver, banned, stayer):
        await join(client, c, pool["id"])

    await leave(client, leaver, pool["id"])
    await leave(client, leaver, pool["id"])  # a repeat changes nothing
    assert released == [(pool["id"], leaver.node_id)]
    r = await client.post(
        f"/v1/admin/pools/{pool['id']}/blacklist",
        json={"provider_id": banned.provider_id, "reason": "x"},
        headers=operator_headers,
    )
    assert r.status_code == 201
    assert released[1:] == [(pool["id"], banned.node_id)]
    await lifecycle(client, operator_headers, pool["id"], "pause")
    await lifecycle(client, operator_headers, pool["id"], "complete")
    assert released[2:] == [(pool["id"], stayer.node_id)]


async def test_blacklisting_a_provider_removes_its_nodes_and_keeps_them_out(
    client: httpx.AsyncClient,
    app: Any,
    operator_headers: dict[str, str],
    admin_headers: dict[str, str],
) -> None:
    pool = await active_pool(client, operator_headers, economics={"min_stake_per_node": 10})
    bad = await registered(client)
    bad_sibling = await registered(client, bad.provider_key)
    good = await registered(client)
    for c in (bad, good):
        await deposit(client, admin_headers, c.provider_id, 100)
    for c in (bad, bad_sibling, good):
        assert (await join(client, c, pool["id"])).status_code == 201
    assert stake(await balance(client, bad)) == {**NO_STAKE, "stake_free": 80, "stake_locked": 20}

    body = {"provider_id": bad.provider_id, "reason": "duplicate GPUs across nodes"}
    r = await client.post(f"/v1/admin/pools/{pool['id']}/blacklist", json=body, headers=operator_headers)
    assert r.status_code == 201, r.text
    assert sorted(r.json()["removed_nodes"]) == sorted([bad.node_id, bad_sibling.node_id])
    assert r.json()["reason"] == "duplicate GPUs across nodes"
    assert await members(client, operator_headers, pool["id"]) == {
        bad.node_id: "left",
        bad_sibling.node_id: "left",
        good.node_id: "active",
    }
    assert stake(await balance(client, bad)) == {**NO_STAKE, "stake_free": 80, "stake_unbonding": 20}
    problem(await join(client, bad, pool["id"]), 403, "provider_blacklisted")
    async with client_from(app) as elsewhere:
        newcomer = await registered(elsewhere, bad.provider_key)
    problem(await join(client, newcomer, pool["id"]), 403, "provider_blacklisted")

    repeat = await client.post(f"/v1/admin/pools/{pool['id']}/blacklist", json=body, headers=operator_headers)
    assert repeat.status_code == 200 and repeat.json()["removed_nodes"] == []
    missing = {"provider_id": "A" * 43, "reason": "x"}
    problem(
        await client.post(f"/v1/admin/pools/{pool['id']}/blacklist", json=missing, headers=operator_headers),
        404,
        "provider_not_found",
    )
    # Another pool is not affected.
    other = await active_pool(client, operator_headers, name="other")
    assert (await join(client, newcomer, other["id"])).status_code == 201


async def test_completing_a_pool_ends_every_membership_and_returns_stake(
    client: httpx.AsyncClient,
    operator_headers: dict[str, str],
    admin_headers: dict[str, str],
) -> None:
    pool = await active_pool(
        client, operator_headers, admission="approval", economics={"min_stake_per_node": 10}
    )
    active, waiting = await registered(client), await registered(client)
    for c in (active, waiting):
        await deposit(client, admin_headers, c.provider_id, 10)
        await join(client, c, pool["id"])
    await client.post(
        f"/v1/admin/pools/{pool['id']}/members/{active.node_id}/approve", headers=operator_headers
    )
    await lifecycle(client, operator_headers, pool["id"], "pause")
    done = await lifecycle(client, operator_headers, pool["id"], "complete")
    assert done["members"] == 0
    assert await members(client, operator_headers, pool["id"]) == {
        active.node_id: "left",
        waiting.node_id: "left",
    }
    assert stake(await balance(client, active)) == {**NO_STAKE, "stake_unbonding": 10}
    assert stake(await balance(client, waiting)) == {**NO_STAKE, "stake_free": 10}


# ------------------------------------------------------------------ concurrency (PostgreSQL)


@postgres_only
async def test_caps_hold_when_twenty_nodes_join_at_once(
    client: httpx.AsyncClient, operator_headers: dict[str, str]
) -> None:
    pool = await active_pool(client, operator_headers, caps={"max_nodes": 5})
    nodes = [await registered(client) for _ in range(20)]
    responses = await asyncio.gather(*(join(client, c, pool["id"]) for c in nodes))
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [201] * 5 + [403] * 15, [r.text for r in responses if r.status_code not in (201, 403)]
    assert {r.json()["code"] for r in responses if r.status_code == 403} == {"pool_full"}
    joined = {c.node_id for c, r in zip(nodes, responses, strict=True) if r.status_code == 201}
    assert set(await members(client, operator_headers, pool["id"])) == joined
    listed = (await client.get(f"/v1/admin/pools/{pool['id']}", headers=operator_headers)).json()
    assert listed["active_members"] == 5


@postgres_only
async def test_free_stake_is_never_locked_twice_by_concurrent_joins_across_pools(
    client: httpx.AsyncClient, operator_headers: dict[str, str], admin_headers: dict[str, str]
) -> None:
    pools = [
        await active_pool(client, operator_headers, name=f"p{i}", economics={"min_stake_per_node": 100})
        for i in range(3)
    ]
    first = await registered(client)
    nodes = [first] + [await registered(client, first.provider_key) for _ in range(3)]
    await deposit(client, admin_headers, first.provider_id, 500)  # enough for 5 of the 12 joins
    attempts = [(c, p["id"]) for c in nodes for p in pools]
    responses = await asyncio.gather(*(join(client, c, pid) for c, pid in attempts))
    admitted = [r for r in responses if r.status_code == 201]
    refused = [r for r in responses if r.status_code != 201]
    assert len(admitted) == 5
    assert {r.json()["code"] for r in refused} == {"stake_insufficient"}
    assert stake(await balance(client, first)) == {"stake_free": 0, "stake_locked": 500, "stake_unbonding": 0}
