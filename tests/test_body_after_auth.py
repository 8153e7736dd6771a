"""A request is authenticated before its JSON body is decoded (``orchestrator.core.routing``).

FastAPI decodes a body before it runs any dependency: a 10 MiB result body of three million
empty lists, from anyone, held the event loop for about 2.9 s before its 401. Here a body that
is not even JSON shows which came first: a 422 json_invalid would mean it was decoded."""

from __future__ import annotations

import gc
import json
from typing import Any

import httpx
import pytest
from fastapi.routing import APIRoute

from orchestrator.app import create_app
from orchestrator.core.routing import GuardedRoute, loads
from orchestrator.core.signing import sign_headers
from tests.conftest import Contributor, new_contributor, problem
from tests.tasks_helpers import client_for, pool_setup, result_body, task

NOT_JSON = b'{"samples": [' + b"[]," * 1000


async def test_a_body_is_not_decoded_before_its_signature_is_checked(
    client: httpx.AsyncClient, contributor: Contributor
) -> None:
    headers = {"content-type": "application/json"}
    for path in (
        "/v1/assignments/a1/result",
        "/v1/assignments/claim",
        "/v1/nodes/me/heartbeat",
        "/v1/nodes",
        "/v1/providers",
        "/v1/providers/me/withdrawals",
    ):
        r = await client.post(path, content=NOT_JSON, headers=headers)
        problem(r, 401, "signature_missing")
    # Signed, but the body is not the one signed: refused on its digest, still undecoded.
    signed = sign_headers(
        contributor.node_key, method="POST", url="http://testserver/v1/nodes/me/heartbeat", body=b"{}"
    )
    r = await client.post("/v1/nodes/me/heartbeat", content=NOT_JSON, headers={**headers, **signed})
    problem(r, 401, "digest_mismatch")
    # Correctly signed, the same bytes are a 422 as before: decoded once the signature held.
    r = await client.post(
        "/v1/nodes/me/heartbeat", content=NOT_JSON, headers=headers, auth=contributor.node_auth
    )
    assert problem(r, 422, "validation_failed")["errors"][0]["type"] == "json_invalid"


async def test_a_body_is_not_decoded_before_its_bearer_token_is_checked(
    client: httpx.AsyncClient, operator_headers: dict[str, str]
) -> None:
    headers = {"content-type": "application/json"}
    r = await client.post("/v1/admin/pools", json={"name": "p"}, headers=operator_headers)
    assert r.status_code == 201, r.text
    pool_id = r.json()["id"]
    for path in (
        f"/v1/admin/pools/{pool_id}/tasks",
        f"/v1/admin/pools/{pool_id}/restem/iterations",
        "/v1/admin/pools",
    ):
        problem(await client.post(path, content=NOT_JSON, headers=headers), 401, "token_missing")
        bad = {**headers, "Authorization": "Bearer orch_not-a-token"}
        problem(await client.post(path, content=NOT_JSON, headers=bad), 401, "token_invalid")
    r = await client.post(
        f"/v1/admin/pools/{pool_id}/tasks", content=NOT_JSON, headers={**headers, **operator_headers}
    )
    assert problem(r, 422, "validation_failed")["errors"][0]["type"] == "json_invalid"


async def test_a_large_result_is_decoded_only_for_the_node_that_holds_the_lease(
    app: Any, app_state: Any
) -> None:
    """Above the general body limit (1 MiB) only the lease's holder gets its body decoded: a
    registered node without the lease is 404 and an unregistered key 401, as for any result."""
    big_not_json = b'{"samples": [' + b"[]," * 400_000  # 1.2 MB
    async with pool_setup(app, app_state, workers=2) as s:
        holder, other = s.workers
        assert (await s.enqueue([task()])).status_code == 201
        lease = (await holder.claim(s.pool_id)).json()["leases"][0]
        path = f"/v1/assignments/{lease['assignment_id']}/result"
        headers = {"content-type": "application/json"}

        r = await other.client.post(
            path, content=big_not_json, headers=headers, auth=other.contributor.node_auth
        )
        problem(r, 404, "assignment_not_found")
        stranger = new_contributor()
        async with client_for(app) as c:
            r = await c.post(path, content=big_not_json, headers=headers, auth=stranger.node_auth)
            problem(r, 401, "unknown_key")
            r = await c.post(
                "/v1/assignments/nope/result", content=big_not_json, headers=headers, auth=stranger.node_auth
            )
            problem(r, 401, "unknown_key")
        # The holder's own large body is decoded: bad JSON is a 422, a large answer is taken.
        r = await holder.client.post(
            path, content=big_not_json, headers=headers, auth=holder.contributor.node_auth
        )
        assert problem(r, 422, "validation_failed")["errors"][0]["type"] == "json_invalid"
        body = result_body(lease)
        body["samples"][0]["completion"] = "x" * 1_500_000 + "\n4"
        r = await holder.submit(lease, samples=body["samples"])
        assert r.status_code == 201, r.text
        assert len(r.request.content) > app_state.settings.limits.max_body_bytes
        # Below the limit nothing extra is read: a stranger's small result is refused as before.
        r = await other.client.post(path, json=result_body(lease), auth=other.contributor.node_auth)
        problem(r, 404, "assignment_not_found")


@pytest.mark.parametrize("enabled", [True, False])
def test_json_is_decoded_without_garbage_collection_and_the_collector_is_left_as_it_was(
    enabled: bool,
) -> None:
    body = b"[" + b",".join([b"[]"] * 200_000) + b"]"
    collections: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collections.append(info["generation"])

    was = gc.isenabled()
    gc.callbacks.append(count)
    try:
        if not enabled:
            gc.disable()
        decoded = loads(body)
        assert gc.isenabled() is enabled
    finally:
        gc.callbacks.remove(count)
        if was:
            gc.enable()
    assert len(decoded) == 200_000
    assert collections == []
    with pytest.raises(json.JSONDecodeError):
        loads(b"[1,")


def test_every_route_of_the_app_authenticates_before_it_decodes(settings: Any) -> None:
    """A router made without ``route_class=GuardedRoute`` would decode its bodies first."""
    app = create_app(settings)
    routes: list[Any] = []
    pending = list(app.routes)
    while pending:  # FastAPI keeps an included router whole, as one entry of app.routes
        route = pending.pop()
        included = getattr(route, "original_router", None)
        pending.extend(included.routes if included is not None else [])
        routes += [route] if isinstance(route, APIRoute) else []
    assert len(routes) > 60
    assert [r.path for r in routes if not isinstance(r, GuardedRoute)] == []
