"""Pools: create, read, list, update, lifecycle, validation and the public listing."""

from __future__ import annotations

import datetime as dt
from typing import Any

import httpx
import pytest
from sqlalchemy import update

from orchestrator.core.clock import FakeClock
from orchestrator.pools.models import Pool
from tests.conftest import problem
from tests.pools_helpers import H100, active_pool, create_pool, invite, lifecycle, new_token

FULL_SETTINGS: dict[str, Any] = {
    "name": "gsm8k rollouts",
    "description": "PRIME-RL generation for step 1200",
    "admission": "approval",
    "requirements": {
        "any_of": [
            {
                "gpu_models": [H100, "NVIDIA A100-SXM4-80GB"],
                "min_gpu_count": 1,
                "min_gpu_memory_mb": 80000,
                "min_ram_mb": 0,
            },
            {"gpu_models": None, "min_gpu_count": 8, "min_gpu_memory_mb": 24000, "min_ram_mb": 262144},
        ]
    },
    "caps": {"max_nodes": 100, "max_nodes_per_provider": 8, "max_nodes_per_ip": 2},
    "economics": {
        "min_stake_per_node": 1000,
        "reward_per_sample": 7,
        "reward_hold_s": 7200,
        "reward_budget": 1_000_000,
        "soft_invalid_penalty": 3,
        "fraud_slash_amount": 500,
        "strikes_before_ejection": 2,
        "strikes_before_provider_ban": 5,
        "unbonding_period_s": 86400,
    },
    "policy": {
        "lease_duration_s": 300,
        "max_lease_s": 7200,
        "max_attempts": 4,
        "max_failures": 5,
        "retake_expired_after_s": 900,
        "replication_factor": 2,
        "audit_rate_floor": 0.1,
        "max_async_level": 1,
        "max_leases_per_node": 2,
        "reward_function": "math",
        "require_proof": True,
        "audit_method": "validator",
        "canary_miss_limit": 4,
        "canary_window": 20,
    },
}


async def test_an_operator_creates_a_pending_pool_that_it_owns(
    client: httpx.AsyncClient, app_state: Any
) -> None:
    headers, token_id = await new_token(app_state, "operator")
    r = await client.post("/v1/admin/pools", json=FULL_SETTINGS, headers=headers)
    assert r.status_code == 201, r.text
    pool = r.json()
    assert pool["id"].startswith("pool_") and len(pool["id"]) == 21
    assert pool["status"] == "pending"
    assert pool["owner_token_id"] == token_id
    assert pool["members"] == pool["active_members"] == pool["pending_members"] == 0
    for key in ("name", "description", "admission", "requirements", "caps", "economics", "policy"):
        assert pool[key] == FULL_SETTINGS[key], key

    fetched = await client.get(f"/v1/admin/pools/{pool['id']}", headers=headers)
    assert fetched.status_code == 200
    assert fetched.json() == pool


async def test_unspecified_settings_take_their_defaults(
    client: httpx.AsyncClient, operator_headers: dict[str, str]
) -> None:
    pool = await create_pool(client, operator_headers, name="minimal")
    assert pool["admission"] == "open"
    assert pool["requirements"] == {"any_of": []}
    assert pool["caps"] == {"max_nodes": None, "max_nodes_per_provider": None, "max_nodes_per_ip": None}
    assert pool["economics"]["min_stake_per_node"] == 0
    assert pool["economics"]["unbonding_period_s"] == 7 * 86400
    assert pool["policy"]["max_async_level"] == 2
    assert pool["policy"]["replication_factor"] == 1
    assert pool["policy"]["retake_expired_after_s"] is None  # an expired lease is never taken back
    # A canary missed at a temperature is fraud as the 3rd miss of the node's last 10 canaries.
    assert (pool["policy"]["canary_miss_limit"], pool["policy"]["canary_window"]) == (3, 10)


BAD_SETTINGS = {
    "unknown top-level field": {"colour": "blue"},
    "unknown nested field": {"economics": {"min_stake": 5}},
    "empty name": {"name": ""},
    "unknown admission": {"admission": "lottery"},
    "negative stake": {"economics": {"min_stake_per_node": -1}},
    "fractional amount": {"economics": {"reward_per_sample": 1.5}},
    "amount beyond the ledger's range": {"economics": {"reward_per_sample": 10**16}},
    # 1024 samples of it would be paid in one transfer above the ledger's largest (10^15).
    "reward per sample beyond a result's range": {"economics": {"reward_per_sample": 10**15 // 1024 + 1}},
    "slash above the stake": {"economics": {"min_stake_per_node": 10, "fraud_slash_amount": 11}},
    "ban before ejection": {"economics": {"strikes_before_ejection": 5, "strikes_before_provider_ban": 4}},
    "zero strikes": {"economics": {"strikes_before_ejection": 0}},
    "negative unbonding": {"economics": {"unbonding_period_s": -1}},
    "zero max nodes": {"caps": {"max_nodes": 0}},
    "zero per-IP cap": {"caps": {"max_nodes_per_ip": 0}},
    "more replicas than nodes": {"caps": {"max_nodes": 2}, "policy": {"replication_factor": 3}},
    "audit floor above 1": {"policy": {"audit_rate_floor": 1.01}},
    "negative staleness bound": {"policy": {"max_async_level": -1}},
    "lease too short": {"policy": {"lease_duration_s": 1}},
    # Shorter than three heartbeat intervals (10 s): it could run out between two beats.
    "lease shorter than three beats": {"policy": {"lease_duration_s": 29}},
    "zero leases per node": {"policy": {"max_leases_per_node": 0}},
    "negative retake delay": {"policy": {"retake_expired_after_s": -1}},
    "zero canary misses": {"policy": {"canary_miss_limit": 0}},
    "canary window beyond its maximum": {"policy": {"canary_window": 101}},
    "more canary misses than the window": {"policy": {"canary_miss_limit": 11, "canary_window": 10}},
    "canary limit above the default window": {"policy": {"canary_miss_limit": 11}},
    "empty GPU model list": {"requirements": {"any_of": [{"gpu_models": []}]}},
    "repeated GPU model": {"requirements": {"any_of": [{"gpu_models": [H100, H100.lower()]}]}},
    "negative GPU count": {"requirements": {"any_of": [{"min_gpu_count": -1}]}},
    "unknown requirement rule": {"requirements": {"any_of": [{"min_vram": 1}]}},
    "too many alternatives": {"requirements": {"any_of": [{}] * 17}},
}


@pytest.mark.parametrize("bad", BAD_SETTINGS.values(), ids=BAD_SETTINGS.keys())
async def test_invalid_pool_settings_are_refused(
    client: httpx.AsyncClient, admin_headers: dict[str, str], bad: dict[str, Any]
) -> None:
    r = await client.post("/v1/admin/pools", json={"name": "p", **bad}, headers=admin_headers)
    body = problem(r, 422, "validation_failed")
    assert body["errors"]
    listed = await client.get("/v1/admin/pools", headers=admin_headers)
    assert listed.json()["items"] == []


async def test_patch_changes_only_the_fields_sent(
    client: httpx.AsyncClient, operator_headers: dict[str, str], clock: FakeClock
) -> None:
    pool = await create_pool(client, operator_headers, **FULL_SETTINGS)
    clock.advance(5)
    r = await client.patch(
        f"/v1/admin/pools/{pool['id']}",
        json={
            "name": "renamed",
            "caps": {"max_nodes_per_ip": None},
            "economics": {"reward_per_sample": 9},
            "requirements": {"any_of": []},
            "policy": {"retake_expired_after_s": None},
        },
        headers=operator_headers,
    )
    assert r.status_code == 200, r.text
    updated = r.json()
    assert updated["name"] == "renamed"
    assert updated["caps"] == {**FULL_SETTINGS["caps"], "max_nodes_per_ip": None}
    assert updated["economics"] == {**FULL_SETTINGS["economics"], "reward_per_sample": 9}
    assert updated["requirements"] == {"any_of": []}
    assert updated["policy"] == {**FULL_SETTINGS["policy"], "retake_expired_after_s": None}
    assert updated["description"] == FULL_SETTINGS["description"]
    assert dt.datetime.fromisoformat(updated["updated_at"]) > dt.datetime.fromisoformat(pool["updated_at"])
    again = await client.get(f"/v1/admin/pools/{pool['id']}", headers=operator_headers)
    assert again.json() == updated


@pytest.mark.parametrize(
    "patch",
    [
        {"economics": {"fraud_slash_amount": 1001}},  # above the current min stake (1000)
        {"economics": {"min_stake_per_node": 100}},  # now below the current slash amount (500)
        {"policy": {"replication_factor": 16}, "caps": {"max_nodes": 3}},
        {"name": None},
        {"economics": {"min_stake_per_node": None}},
        {"caps": None},
        {"policy": {"max_async_level": 65}},
        {"economics": {"reward_per_sample": 10**15 // 1024 + 1}},
        {"policy": {"lease_duration_s": 29}},
        {"owner_token_id": "tok_0000000000000000"},
        {"status": "active"},
        {"policy": {"canary_window": 3}},  # below the current canary_miss_limit (4)
        {"policy": {"canary_miss_limit": 21}},  # above the current canary_window (20)
        {"policy": {"canary_miss_limit": None}},
    ],
    ids=[
        "slash-above-stake",
        "stake-below-slash",
        "replicas-above-cap",
        "null-name",
        "null-stake",
        "null-group",
        "out-of-range",
        "reward-beyond-a-result",
        "lease-shorter-than-three-beats",
        "owner-not-settable",
        "status-not-settable",
        "canary-window-below-limit",
        "canary-limit-above-window",
        "null-canary-limit",
    ],
)
async def test_patch_validates_the_merged_settings_and_changes_nothing_when_refused(
    client: httpx.AsyncClient, operator_headers: dict[str, str], patch: dict[str, Any]
) -> None:
    pool = await create_pool(client, operator_headers, **FULL_SETTINGS)
    r = await client.patch(f"/v1/admin/pools/{pool['id']}", json=patch, headers=operator_headers)
    problem(r, 422, "validation_failed")
    after = await client.get(f"/v1/admin/pools/{pool['id']}", headers=operator_headers)
    assert after.json() == pool


async def test_the_canary_rule_is_set_with_the_pool_and_changed_by_patch(
    client: httpx.AsyncClient, operator_headers: dict[str, str]
) -> None:
    """The canary miss limit and window are set on create and by PATCH, together or one at a
    time, and the merged pair is checked: a limit above its window is refused with the reason,
    and nothing changes."""
    pool = await create_pool(
        client, operator_headers, name="c", policy={"canary_miss_limit": 2, "canary_window": 5}
    )
    assert (pool["policy"]["canary_miss_limit"], pool["policy"]["canary_window"]) == (2, 5)
    url = f"/v1/admin/pools/{pool['id']}"
    r = await client.patch(url, json={"policy": {"canary_window": 1}}, headers=operator_headers)
    body = problem(r, 422, "validation_failed")
    [error] = body["errors"]
    assert error["loc"][:2] == ["body", "policy"]
    assert "canary_miss_limit (2) must be at most canary_window (1)" in error["msg"]
    assert (await client.get(url, headers=operator_headers)).json() == pool
    r = await client.patch(
        url, json={"policy": {"canary_miss_limit": 5, "canary_window": 50}}, headers=operator_headers
    )
    assert r.status_code == 200, r.text
    assert (r.json()["policy"]["canary_miss_limit"], r.json()["policy"]["canary_window"]) == (5, 50)
    r = await client.patch(url, json={"policy": {"canary_window": 101}}, headers=operator_headers)
    [error] = problem(r, 422, "validation_failed")["errors"]
    assert error["loc"] == ["body", "policy", "canary_window"] and "100" in error["msg"]


def _offers_null(spec: dict[str, Any]) -> bool:
    return spec.get("type") == "null" or any(_offers_null(branch) for branch in spec.get("anyOf", []))


async def test_patch_schemas_offer_null_exactly_where_a_null_is_taken(
    client: httpx.AsyncClient, operator_headers: dict[str, str]
) -> None:
    """A field PATCH sets to null (a cap, the description, ...) offers null in the OpenAPI
    schema; the others (the name, a whole group, a stake ...) refuse it with a 422, so their
    schema does not offer it (it did, for every field: a client following it got 422s)."""
    schemas = (await client.get("/openapi.json")).json()["components"]["schemas"]
    pool = await create_pool(client, operator_headers, **FULL_SETTINGS)
    cases: list[tuple[dict[str, Any], bool]] = [
        ({name: None}, _offers_null(spec)) for name, spec in schemas["PoolPatch"]["properties"].items()
    ]
    for group, model in (("caps", "CapsPatch"), ("economics", "EconomicsPatch"), ("policy", "PolicyPatch")):
        cases += [
            ({group: {name: None}}, _offers_null(spec)) for name, spec in schemas[model]["properties"].items()
        ]
    # description, three caps, reward_budget, retake_expired_after_s
    assert sum(offered for _, offered in cases) == 6
    for patch, offered in cases:
        r = await client.patch(f"/v1/admin/pools/{pool['id']}", json=patch, headers=operator_headers)
        if offered:
            assert r.status_code == 200, (patch, r.text)
        else:
            problem(r, 422, "validation_failed")


async def test_lifecycle_runs_pending_active_paused_active_paused_completed(
    client: httpx.AsyncClient, operator_headers: dict[str, str]
) -> None:
    pool = await create_pool(client, operator_headers)
    seen = [pool["status"]]
    for action in ("activate", "pause", "resume", "pause", "complete"):
        seen.append((await lifecycle(client, operator_headers, pool["id"], action))["status"])
    assert seen == ["pending", "active", "paused", "active", "paused", "completed"]
    final = (await client.get(f"/v1/admin/pools/{pool['id']}", headers=operator_headers)).json()
    assert final["status"] == "completed"
    assert final["status_changed_at"] >= pool["status_changed_at"]


PATH_TO = {
    "pending": [],
    "active": ["activate"],
    "paused": ["activate", "pause"],
    "completed": ["activate", "pause", "complete"],
}
LEGAL = {("pending", "activate"): "active", ("active", "pause"): "paused", ("paused", "resume"): "active"}
LEGAL[("paused", "complete")] = "completed"
NO_OPS = {("active", "activate"), ("active", "resume"), ("paused", "pause"), ("completed", "complete")}
CASES = [(state, action) for state in PATH_TO for action in ("activate", "pause", "resume", "complete")]


@pytest.mark.parametrize(("state", "action"), CASES, ids=[f"{s}-{a}" for s, a in CASES])
async def test_every_lifecycle_action_from_every_state(
    client: httpx.AsyncClient, operator_headers: dict[str, str], state: str, action: str
) -> None:
    pool = await create_pool(client, operator_headers)
    for step in PATH_TO[state]:
        await lifecycle(client, operator_headers, pool["id"], step)
    r = await client.post(f"/v1/admin/pools/{pool['id']}/{action}", headers=operator_headers)
    now = (await client.get(f"/v1/admin/pools/{pool['id']}", headers=operator_headers)).json()["status"]
    if (state, action) in LEGAL:
        assert r.status_code == 200, r.text
        assert r.json()["status"] == now == LEGAL[(state, action)]
    elif (state, action) in NO_OPS:
        assert r.status_code == 200, r.text
        assert r.json()["status"] == now == state
    else:
        body = problem(r, 409, "pool_transition_invalid")
        assert body["pool_status"] == now == state
        assert action not in body["allowed_actions"]


async def test_a_completed_pool_is_read_only(
    client: httpx.AsyncClient, operator_headers: dict[str, str], contributor: Any
) -> None:
    pool = await create_pool(client, operator_headers)
    for action in ("activate", "pause", "complete"):
        await lifecycle(client, operator_headers, pool["id"], action)
    pid = pool["id"]
    problem(
        await client.patch(f"/v1/admin/pools/{pid}", json={"name": "x"}, headers=operator_headers),
        409,
        "pool_completed",
    )
    problem(
        await client.post(f"/v1/admin/pools/{pid}/invites", json={}, headers=operator_headers),
        409,
        "pool_completed",
    )
    problem(
        await client.post(
            f"/v1/admin/pools/{pid}/blacklist",
            json={"provider_id": contributor.provider_id, "reason": "x"},
            headers=operator_headers,
        ),
        409,
        "pool_completed",
    )
    assert (await client.get(f"/v1/admin/pools/{pid}", headers=operator_headers)).json()["name"] == "rollouts"


async def test_operators_list_their_own_pools_and_admins_list_all(
    client: httpx.AsyncClient, app_state: Any, admin_headers: dict[str, str]
) -> None:
    alice, _ = await new_token(app_state, "operator", "alice")
    bob, _ = await new_token(app_state, "operator", "bob")
    alices = {(await create_pool(client, alice, name=f"a{i}"))["id"] for i in range(5)}
    bobs = {(await create_pool(client, bob, name="b"))["id"]}
    await lifecycle(client, alice, sorted(alices)[0], "activate")

    async def all_pages(headers: dict[str, str], **params: Any) -> list[str]:
        ids: list[str] = []
        cursor = None
        while True:
            q = {"limit": 2, **params, **({"cursor": cursor} if cursor else {})}
            page = (await client.get("/v1/admin/pools", params=q, headers=headers)).json()
            assert len(page["items"]) <= 2
            ids += [p["id"] for p in page["items"]]
            cursor = page["next_cursor"]
            if cursor is None:
                return ids

    assert await all_pages(alice) == sorted(alices)
    assert await all_pages(bob) == sorted(bobs)
    assert await all_pages(admin_headers) == sorted(alices | bobs)
    assert await all_pages(alice, status="active") == [sorted(alices)[0]]
    problem(
        await client.get("/v1/admin/pools", params={"cursor": "nonsense"}, headers=alice),
        400,
        "cursor_invalid",
    )


async def test_a_missing_pool_is_not_found(client: httpx.AsyncClient, admin_headers: dict[str, str]) -> None:
    problem(
        await client.get("/v1/admin/pools/pool_0000000000000000", headers=admin_headers),
        404,
        "pool_not_found",
    )
    problem(
        await client.post("/v1/admin/pools/pool_0000000000000000/activate", headers=admin_headers),
        404,
        "pool_not_found",
    )


async def test_admin_may_administer_an_operators_pool(
    client: httpx.AsyncClient, operator_headers: dict[str, str], admin_headers: dict[str, str]
) -> None:
    pool = await create_pool(client, operator_headers)
    assert (await lifecycle(client, admin_headers, pool["id"], "activate"))["status"] == "active"
    r = await client.patch(f"/v1/admin/pools/{pool['id']}", json={"name": "by admin"}, headers=admin_headers)
    assert r.json()["name"] == "by admin"
    assert r.json()["owner_token_id"] == pool["owner_token_id"]


@pytest.mark.parametrize("role", ["validator", "trainer"])
async def test_validators_and_trainers_cannot_run_pools(
    client: httpx.AsyncClient, app_state: Any, role: str
) -> None:
    headers, _ = await new_token(app_state, role)
    problem(await client.post("/v1/admin/pools", json={"name": "p"}, headers=headers), 403, "role_forbidden")
    problem(await client.get("/v1/admin/pools", headers=headers), 403, "role_forbidden")


async def test_public_listing_shows_active_pools_and_their_terms_without_operator_data(
    client: httpx.AsyncClient, operator_headers: dict[str, str]
) -> None:
    listed = await active_pool(client, operator_headers, **{**FULL_SETTINGS, "admission": "invite"})
    code = await invite(client, operator_headers, listed["id"])
    await create_pool(client, operator_headers, name="still pending")
    paused = await active_pool(client, operator_headers, name="paused")
    await lifecycle(client, operator_headers, paused["id"], "pause")

    r = await client.get("/v1/pools")  # no credentials at all
    assert r.status_code == 200
    items = r.json()["items"]
    assert [p["id"] for p in items] == [listed["id"]]
    public = items[0]
    assert public["requirements"] == FULL_SETTINGS["requirements"]
    assert public["economics"]["reward_per_sample"] == 7
    assert public["economics"]["min_stake_per_node"] == 1000
    assert public["admission"] == "invite"
    assert public["members"] == 0
    assert "owner_token_id" not in public
    assert listed["owner_token_id"] not in r.text
    assert code not in r.text
    assert not {"active_members", "pending_members", "updated_at"} & public.keys()
    # How workers are audited, and how many canary misses they may make, stay with the operator.
    hidden = {"audit_rate_floor", "audit_method", "canary_miss_limit", "canary_window"}
    assert public["policy"] == {k: v for k, v in FULL_SETTINGS["policy"].items() if k not in hidden}


async def test_public_listing_paginates(client: httpx.AsyncClient, operator_headers: dict[str, str]) -> None:
    ids = sorted([(await active_pool(client, operator_headers, name=f"p{i}"))["id"] for i in range(3)])
    first = (await client.get("/v1/pools", params={"limit": 2})).json()
    second = (await client.get("/v1/pools", params={"limit": 2, "cursor": first["next_cursor"]})).json()
    assert [p["id"] for p in first["items"] + second["items"]] == ids
    assert second["next_cursor"] is None


def _undocumented(schema: dict[str, Any], name: str) -> list[str]:
    return [
        f"{name}.{prop}" for prop, spec in schema.get("properties", {}).items() if not spec.get("description")
    ]


async def test_every_pool_field_is_documented_in_the_openapi_schema(client: httpx.AsyncClient) -> None:
    schemas = (await client.get("/openapi.json")).json()["components"]["schemas"]
    names = [
        "PoolCreate",
        "PoolPatch",
        "PoolOut",
        "PublicPoolOut",
        "HardwareRule",
        "Requirements",
        "Caps",
        "CapsPatch",
        "Economics",
        "EconomicsPatch",
        "Policy",
        "PublicPolicy",
        "PolicyPatch",
        "JoinIn",
        "MembershipOut",
        "InviteIn",
        "InviteOut",
        "BlacklistIn",
        "BlacklistOut",
        "ReasonIn",
        "RejectIn",
        "RefusalReason",
        "AuditEntryOut",
    ]
    assert set(names) <= schemas.keys(), set(names) - schemas.keys()
    missing = [m for n in names for m in _undocumented(schemas[n], n)]
    assert missing == []


async def test_a_pool_stored_before_the_reward_bound_is_still_listed_paused_and_fixed(
    client: httpx.AsyncClient, app_state: Any, operator_headers: dict[str, str]
) -> None:
    """reward_per_sample is capped at 10^15 / 1024 since 76e6f0f; a pool stored before may pay
    more (enqueue refuses its too-large tasks, 409 reward_exceeds_ledger_limit, and says to lower
    it). Reading it back must not fail: the public listing (with the other pools on its page),
    the admin view, a pause, and the PATCH that lowers it; a PATCH that leaves it too large is
    refused naming it."""
    pool = await active_pool(client, operator_headers)
    other = await active_pool(client, operator_headers, name="unrelated")
    async with app_state.sessionmaker() as session, session.begin():
        await session.execute(update(Pool).where(Pool.id == pool["id"]).values(reward_per_sample=10**15 // 2))
    listing = await client.get("/v1/pools")
    assert listing.status_code == 200, listing.text
    assert {p["id"] for p in listing.json()["items"]} == {pool["id"], other["id"]}
    url = f"/v1/admin/pools/{pool['id']}"
    view = await client.get(url, headers=operator_headers)
    assert view.status_code == 200 and view.json()["economics"]["reward_per_sample"] == 10**15 // 2
    paused = await client.post(f"{url}/pause", headers=operator_headers)
    assert paused.status_code == 200 and paused.json()["status"] == "paused", paused.text
    renamed = problem(
        await client.patch(url, json={"name": "renamed"}, headers=operator_headers), 422, "validation_failed"
    )
    assert renamed["errors"][0]["loc"] == ["body", "economics", "reward_per_sample"]
    fixed = await client.patch(url, json={"economics": {"reward_per_sample": 5}}, headers=operator_headers)
    assert fixed.status_code == 200, fixed.text
    assert fixed.json()["economics"]["reward_per_sample"] == 5
