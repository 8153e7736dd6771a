"""Object-level authorization on the admin API (OWASP API1, API5), for every route there is.

The routes are enumerated from the app itself, so a new /v1/admin route is checked as soon as
it exists: a caller that does not own the pool (another operator, a validator, a trainer, a
node with a valid signature) gets 401, 403 or 404 and never any of the owner's data, and
changes nothing. An admin, then, gets past authorization on every route with the same
parameters, which shows the refusals were about the caller and not about a bad request.
"""

from __future__ import annotations

import json
from typing import Any

import httpx

from orchestrator.core.signing import SignatureAuth
from tests.conftest import Contributor
from tests.pools_helpers import active_pool, deposit, join, new_token, registered

# Routes where a caller without rights to the owner's pool may still succeed, on its own
# data: creating its own pool, listing its own pools, reading its own audit entries.
OWN_DATA_ROUTES = {("POST", "/v1/admin/pools"), ("GET", "/v1/admin/pools"), ("GET", "/v1/admin/audit")}

# A valid request for each admin route that takes a body or required headers, so refusals are
# about authorization rather than validation. "{name}" is replaced by the fixture's value.
SAMPLE_BODIES: dict[tuple[str, str], dict[str, Any]] = {
    ("POST", "/v1/admin/pools"): {"name": "intruder"},
    ("PATCH", "/v1/admin/pools/{pool_id}"): {"name": "hijacked", "caps": {"max_nodes": 1}},
    ("POST", "/v1/admin/pools/{pool_id}/members/{node_id}/reject"): {"reason": "mine now"},
    ("POST", "/v1/admin/pools/{pool_id}/members/{node_id}/eject"): {"reason": "mine now"},
    ("POST", "/v1/admin/pools/{pool_id}/invites"): {"expires_in_s": 3600},
    ("POST", "/v1/admin/pools/{pool_id}/blacklist"): {"provider_id": "{provider_id}", "reason": "mine now"},
    ("POST", "/v1/admin/nodes/{node_id}/ban"): {"reason": "mine now"},
    ("POST", "/v1/admin/tokens"): {"role": "admin", "name": "intruder"},
    ("POST", "/v1/admin/providers/{provider_id}/deposits"): {"amount": 1},
    ("POST", "/v1/admin/verdicts/{verdict_id}/reverse"): {"reason": "mine now"},
    ("POST", "/v1/admin/payouts/{payout_id}/mark-paid"): {"external_reference": "mine now"},
    ("POST", "/v1/admin/payouts/{payout_id}/reject"): {"reason": "mine now"},
    ("POST", "/v1/admin/pools/{pool_id}/restem/iterations"): {
        "name": "intruder",
        "policy_step": 1,
        "problems": [{"problem_id": "q", "prompt": "p", "verification": {"answer": "4"}}],
    },
    ("POST", "/v1/admin/pools/{pool_id}/policies"): {
        "step": 99,
        "uri": "s3://x",
        "sha256": "a" * 64,
        "size": 1,
    },
    ("POST", "/v1/admin/pools/{pool_id}/tasks"): {
        "batch_key": "intruder",
        "tasks": [{"prompt": "p", "sampling": {"max_tokens": 8}}],
    },
}
SAMPLE_HEADERS: dict[tuple[str, str], dict[str, str]] = {
    ("POST", "/v1/admin/providers/{provider_id}/deposits"): {"Idempotency-Key": "scoping-test-0001"},
    ("POST", "/v1/admin/payouts/runs"): {"Idempotency-Key": "scoping-test-0002"},
}


def admin_routes(app: Any) -> list[tuple[str, str]]:
    """Every (method, path) the app serves under /v1/admin, read from its routing table.

    FastAPI >= 0.16x keeps included routers nested in ``app.routes``; ``iter_route_contexts``
    flattens them (older versions list the routes directly)."""
    try:
        from fastapi.routing import iter_route_contexts
    except ImportError:  # pragma: no cover - older FastAPI: app.routes is already flat
        candidates: Any = app.routes
    else:
        candidates = iter_route_contexts(app.routes)
    routes = []
    for route in candidates:
        path = getattr(route, "path", None) or ""
        if not path.startswith("/v1/admin"):
            continue
        methods = getattr(route, "methods", None)
        assert methods, f"{path}: a route without methods (mount, websocket?); teach this test about it"
        routes += [(m, path) for m in sorted(set(methods) - {"HEAD", "OPTIONS"})]
    return routes


async def test_the_route_enumeration_sees_every_documented_admin_operation(
    client: httpx.AsyncClient, app: Any
) -> None:
    documented = {
        (method.upper(), path)
        for path, operations in (await client.get("/openapi.json")).json()["paths"].items()
        if path.startswith("/v1/admin")
        for method in operations
    }
    assert documented
    assert documented <= set(admin_routes(app))


def _fill(value: Any, params: dict[str, str]) -> Any:
    return json.loads(json.dumps(value).replace("{provider_id}", params["provider_id"]))


async def _call(
    client: httpx.AsyncClient,
    method: str,
    path: str,
    params: dict[str, str],
    *,
    headers: dict[str, str] | None = None,
    auth: httpx.Auth | None = None,
) -> httpx.Response:
    url = path.format(**params)
    body = SAMPLE_BODIES.get((method, path))
    all_headers = {**SAMPLE_HEADERS.get((method, path), {}), **(headers or {})}
    return await client.request(
        method,
        url,
        json=_fill(body, params) if body is not None else None,
        headers=all_headers,
        auth=auth if auth is not None else httpx.USE_CLIENT_DEFAULT,
    )


def _leaks(response: httpx.Response, secrets: list[str]) -> list[str]:
    try:
        body = response.json()
    except ValueError:
        return [s for s in secrets if s in response.text]
    if isinstance(body, dict):
        body.pop("instance", None)  # the request's own path, which the caller already knows
    text = json.dumps(body)
    return [s for s in secrets if s in text]


async def _owner_view(
    client: httpx.AsyncClient, headers: dict[str, str], pool_id: str, node: Contributor
) -> Any:
    pool = (await client.get(f"/v1/admin/pools/{pool_id}", headers=headers)).json()
    members = (await client.get(f"/v1/admin/pools/{pool_id}/members", headers=headers)).json()
    audit = (await client.get("/v1/admin/audit", params={"pool_id": pool_id}, headers=headers)).json()
    me = (await client.get("/v1/nodes/me", auth=node.node_auth)).json()
    balance = (await client.get("/v1/providers/me/balance", auth=node.provider_auth)).json()
    return pool, members, audit, me["status"], me["memberships"], balance


async def test_no_admin_route_serves_or_changes_another_owners_pool(
    client: httpx.AsyncClient, app: Any, app_state: Any, admin_headers: dict[str, str]
) -> None:
    owner, owner_token_id = await new_token(app_state, "operator", "owner")
    pool = await active_pool(client, owner, admission="open", economics={"min_stake_per_node": 5})
    node = await registered(client)
    await deposit(client, admin_headers, node.provider_id, 10)
    assert (await join(client, node, pool["id"])).status_code == 201
    r = await client.post(
        f"/v1/admin/pools/{pool['id']}/tasks",
        headers=owner,
        json={"batch_key": "owned", "tasks": [{"prompt": "p", "sampling": {"max_tokens": 8}}]},
    )
    assert r.status_code == 201, r.text
    task_id = str(r.json()["first_task_id"])
    verdict_id, payout_id = await _verdict_and_payout(client, app_state, owner, pool["id"], node)
    r = await client.post("/v1/admin/payouts/runs", headers={**admin_headers, "Idempotency-Key": "run-1234"})
    assert r.status_code == 201, r.text
    run_id = str(r.json()["id"])
    r = await client.post(
        f"/v1/admin/pools/{pool['id']}/restem/iterations",
        headers=owner,
        json={
            "name": "owned",
            "policy_step": 1,
            "problems": [{"problem_id": "q", "prompt": "p", "verification": {"answer": "4"}}],
        },
    )
    assert r.status_code == 201, r.text
    iteration_id = str(r.json()["id"])
    params = {
        "pool_id": pool["id"],
        "node_id": node.node_id,
        "provider_id": node.provider_id,
        "task_id": task_id,
        "verdict_id": verdict_id,
        "payout_id": payout_id,
        "run_id": run_id,
        "iteration_id": iteration_id,
        "token_id": owner_token_id,
    }
    secrets = [pool["id"], owner_token_id, node.node_id, node.provider_id]
    before = await _owner_view(client, owner, pool["id"], node)

    intruder, _ = await new_token(app_state, "operator", "intruder")
    validator, _ = await new_token(app_state, "validator", "validator")
    trainer, _ = await new_token(app_state, "trainer", "trainer")
    outsider = await registered(client)
    callers: dict[str, dict[str, Any]] = {
        "another operator": {"headers": intruder},
        "a validator": {"headers": validator},
        "a trainer": {"headers": trainer},
        "a signed node": {"auth": SignatureAuth(outsider.node_key)},
        "the member node itself": {"auth": node.node_auth},
    }

    routes = admin_routes(app)
    failures: list[str] = []
    for method, path in routes:
        missing = {name for name in _path_params(path) if name not in params}
        if missing:
            failures.append(f"{method} {path}: no fixture value for {sorted(missing)}; add one to this test")
            continue
        for who, credentials in callers.items():
            r = await _call(client, method, path, params, **credentials)
            allowed = {401, 403, 404}
            if who == "another operator" and (method, path) in OWN_DATA_ROUTES:
                allowed |= {200, 201}
            if r.status_code not in allowed:
                hint = " (add a valid sample body to SAMPLE_BODIES?)" if r.status_code == 422 else ""
                failures.append(f"{method} {path} as {who}: {r.status_code}{hint} {r.text[:200]}")
            if leaked := _leaks(r, secrets):
                failures.append(f"{method} {path} as {who}: response contains {leaked}")
    assert failures == [], "\n".join(failures)

    after = await _owner_view(client, owner, pool["id"], node)
    assert after == before, "a refused caller changed the owner's pool, members, audit log, node or stake"

    # The same requests get past authorization for an admin (so the refusals above were about
    # who asked, not about a malformed request).
    for method, path in routes:
        r = await _call(client, method, path, params, headers=admin_headers)
        assert r.status_code not in {401, 403, 404}, (
            f"{method} {path} as admin: {r.status_code} {r.text[:300]}"
        )


async def _verdict_and_payout(
    client: httpx.AsyncClient, app_state: Any, owner: dict[str, str], pool_id: str, node: Contributor
) -> tuple[str, str]:
    """A verdict on a result in the owner's pool, and a payout of the member's provider."""
    from orchestrator.ledger import service as ledger
    from orchestrator.verification.jobs import drain

    await client.post(
        f"/v1/admin/pools/{pool_id}/policies",
        headers=owner,
        json={"step": 1, "uri": "s3://x", "sha256": "a" * 64, "size": 1},
    )
    assert (await client.post("/v1/nodes/me/heartbeat", json={}, auth=node.node_auth)).status_code == 200
    lease = (
        await client.post("/v1/assignments/claim", json={"pool_id": pool_id}, auth=node.node_auth)
    ).json()["leases"][0]
    body = {
        "fencing_token": lease["fencing_token"],
        "policy_step": 1,
        "seed": lease["seed"],
        "samples": [{"completion": "x", "finish_reason": "stop", "prompt_tokens": 1, "completion_tokens": 1}],
    }
    r = await client.post(f"/v1/assignments/{lease['assignment_id']}/result", json=body, auth=node.node_auth)
    assert r.status_code == 201, r.text
    from tests.verification_helpers import FixedDraw

    app_state.rng = FixedDraw(1.0)  # no audit: decide at once
    await drain(app_state)
    async with app_state.sessionmaker() as session, session.begin():
        from sqlalchemy import select

        from orchestrator.verification.models import Verdict

        verdict_id = (await session.execute(select(Verdict.id))).scalar_one()
        await ledger.transfer(
            session,
            debit=ledger.system_account(ledger.SystemAccount.rewards),
            credit=ledger.provider_account(node.provider_id, ledger.ProviderAccount.rewards_claimable),
            amount=5,
            key="scoping-claimable",
            reason="test",
            actor="test",
        )
    r = await client.post(
        "/v1/providers/me/withdrawals",
        json={"amount": 5},
        headers={"Idempotency-Key": "scoping-withdrawal"},
        auth=node.provider_auth,
    )
    assert r.status_code == 201, r.text
    return str(verdict_id), str(r.json()["payout"]["id"])


def _path_params(path: str) -> list[str]:
    return [part[1:-1] for part in path.split("/") if part.startswith("{") and part.endswith("}")]


async def test_an_operator_sees_a_foreign_pool_exactly_as_a_missing_one(
    client: httpx.AsyncClient, app_state: Any
) -> None:
    owner, _ = await new_token(app_state, "operator", "owner")
    intruder, _ = await new_token(app_state, "operator", "intruder")
    pool = await active_pool(client, owner)
    foreign = await client.get(f"/v1/admin/pools/{pool['id']}", headers=intruder)
    missing = await client.get("/v1/admin/pools/pool_ffffffffffffffff", headers=intruder)
    assert foreign.status_code == missing.status_code == 404
    strip = ("instance",)
    assert {k: v for k, v in foreign.json().items() if k not in strip} == {
        k: v for k, v in missing.json().items() if k not in strip
    }
    # Even a body that does not validate is answered with 404, not with validation details.
    r = await client.patch(f"/v1/admin/pools/{pool['id']}", json={"caps": "nonsense"}, headers=intruder)
    assert r.status_code == 404 and r.json()["code"] == "pool_not_found"
    listed = (await client.get("/v1/admin/pools", headers=intruder)).json()
    assert listed["items"] == []
