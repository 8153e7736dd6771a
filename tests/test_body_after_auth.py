"""A request is authenticated before its JSON body is decoded (``orchestrator.core.routing``).

FastAPI decodes a body before it runs any dependency: a 10 MiB result body of three million
empty lists, from anyone, held the event loop for about 2.9 s before its 401. Here a body that
is not even JSON shows which came first: a 422 json_invalid would mean it was decoded."""

from __future__ import annotations

import asyncio
import datetime as dt
import gc
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi.routing import APIRoute

from orchestrator.admin.tokens import Role, create_token
from orchestrator.app import create_app
from orchestrator.core.clock import FakeClock
from orchestrator.core.routing import GuardedRoute, loads
from orchestrator.core.signing import sign_headers
from tests.conftest import Contributor, asgi_post, new_contributor, problem
from tests.tasks_helpers import client_for, pool_setup, result_body, task
from tests.waits import HANG_S

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


async def _post_slowly(
    client: httpx.AsyncClient, path: str, body: bytes, headers: dict[str, str], meanwhile: Any
) -> httpx.Response:
    """POST ``body`` in two parts, running ``meanwhile()`` once the first part was sent and
    before the rest is: once the app asks for the rest (it reads the body as it needs it), so
    it has had the head and the first part."""
    first_sent, rest = asyncio.Event(), asyncio.Event()

    async def stream() -> AsyncIterator[bytes]:
        yield body[:5]
        first_sent.set()
        await rest.wait()
        yield body[5:]

    posting = asyncio.create_task(client.post(path, content=stream(), headers=headers))
    await asyncio.wait_for(first_sent.wait(), timeout=HANG_S)
    await meanwhile()
    rest.set()
    return await asyncio.wait_for(posting, timeout=HANG_S)


async def test_a_bearer_token_revoked_or_expired_while_its_body_arrives_is_refused(
    client: httpx.AsyncClient, app_state: Any, clock: FakeClock, admin_headers: dict[str, str]
) -> None:
    """The token was checked as soon as the head arrived, before the body: a leaked token revoked
    while a slow client still sent the body was honoured (201, the pool made), where before the
    check ran once the body was in (401). It is checked on the whole request again."""
    body = json.dumps({"name": "made after the revoke"}).encode()
    async with app_state.sessionmaker() as session, session.begin():
        leaked, row = await create_token(session, role=Role.operator, name="leaked")
        expiring, _ = await create_token(
            session,
            role=Role.operator,
            name="expiring",
            expires_at=clock.utcnow() + dt.timedelta(seconds=60),
        )
    headers = {"content-type": "application/json", "Authorization": f"Bearer {leaked}"}

    async def revoke() -> None:
        r = await client.post(f"/v1/admin/tokens/{row.id}/revoke", headers=admin_headers)
        assert r.status_code == 200, r.text

    problem(await _post_slowly(client, "/v1/admin/pools", body, headers, revoke), 401, "token_invalid")

    async def expire() -> None:
        clock.advance(120)

    headers = {**headers, "Authorization": f"Bearer {expiring}"}
    problem(await _post_slowly(client, "/v1/admin/pools", body, headers, expire), 401, "token_expired")
    r = await client.get("/v1/admin/pools", headers=admin_headers)
    assert r.status_code == 200 and r.json()["items"] == [], r.text


async def test_a_client_that_hangs_up_before_its_body_is_in_is_not_a_server_error(
    app: Any, contributor: Contributor
) -> None:
    """The signature check read the body itself, ahead of FastAPI, which answers a client gone
    mid-body with a 400: the disconnect escaped the app as an unhandled error (logged with its
    traceback, a 500), for every signed route."""
    body = b'{"leases": []}'
    url = "http://testserver/v1/nodes/me/heartbeat"
    signed = sign_headers(contributor.node_key, method="POST", url=url, body=body)
    messages: list[dict[str, Any]] = [{"type": "http.request", "body": body[:3], "more_body": True}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    headers = {**signed, "content-type": "application/json"}
    scope = asgi_post("/v1/nodes/me/heartbeat", headers, client=("10.9.9.9", 40000))
    await app(scope, receive, send)
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [400]


async def test_a_large_result_for_an_assignment_id_with_a_nul_is_404_not_500(
    app: Any, app_state: Any
) -> None:
    """The holder check read the path's assignment id before FastAPI validated it: on PostgreSQL
    an id holding a NUL (which it cannot store) failed the query, a 500 internal_error."""
    big_not_json = b'{"samples": [' + b"[]," * 400_000  # 1.2 MB, above the general limit
    async with pool_setup(app, app_state, workers=1) as s:
        (node,) = s.workers
        for assignment_id in ("%00", "a%00b", "a" * 41):
            r = await node.client.post(
                f"/v1/assignments/{assignment_id}/result",
                content=big_not_json,
                headers={"content-type": "application/json"},
                auth=node.contributor.node_auth,
            )
            problem(r, 404, "assignment_not_found")
