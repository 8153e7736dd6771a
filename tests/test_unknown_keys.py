"""A key costs nothing to make: requests signed with keys nobody registered are refused before
they write anything to the hot store (a nonce, a rate-limit counter), so a flood of them cannot
fill Redis. Registrations, the one request of a new key, count toward their address first."""

from __future__ import annotations

import json
import secrets
from typing import Any

import httpx
from asgi_lifespan import LifespanManager

from orchestrator.app import create_app
from orchestrator.core.clock import FakeClock
from orchestrator.core.hotstore import HotStore
from orchestrator.core.keys import generate_key, key_id_of
from orchestrator.core.signing import sign_headers
from orchestrator.settings import LimitSettings, Settings
from tests.conftest import new_contributor, problem, spend_nonce
from tests.test_hot_paths import sql_log

BASE = "http://testserver"
HB_BODY = json.dumps({"metrics": {}}).encode()
CLAIM_BODY = json.dumps({"pool_id": "pool_x", "max_tasks": 1}).encode()
# (method, path, body) of routes for registered nodes and providers only.
ROUTES = [
    ("GET", "/v1/nodes/me", b""),
    ("POST", "/v1/nodes/me/heartbeat", HB_BODY),
    ("POST", "/v1/assignments/claim", CLAIM_BODY),
    ("POST", "/v1/assignments/asg_x/result", b"{}"),
    ("GET", "/v1/nodes/me/leases", b""),
    ("GET", "/v1/providers/me/balance", b""),
]


async def send(
    client: httpx.AsyncClient, key: Any, method: str, path: str, body: bytes, nonce: str
) -> httpx.Response:
    headers = sign_headers(key, method=method, url=BASE + path, body=body, nonce=nonce)
    if body:
        headers["content-type"] = "application/json"
    return await client.request(method, path, content=body, headers=headers)


async def test_requests_of_unregistered_keys_are_refused_before_they_record_a_nonce(
    client: httpx.AsyncClient, hot_store: HotStore, settings: Settings
) -> None:
    ttl = settings.signature.effective_nonce_ttl_s
    for method, path, body in ROUTES:
        key, nonce = generate_key(), secrets.token_urlsafe(16)
        problem(await send(client, key, method, path, body, nonce), 401, "unknown_key")
        # Sent again: still unknown_key, not nonce_replayed: the first left no nonce behind.
        problem(await send(client, key, method, path, body, nonce), 401, "unknown_key")
        assert await spend_nonce(hot_store, key_id_of(key), nonce, ttl), (method, path)


async def test_a_key_refused_as_unknown_is_taken_once_registered(
    client: httpx.AsyncClient, hot_store: HotStore
) -> None:
    c = new_contributor()
    problem(await client.get("/v1/nodes/me", auth=c.node_auth), 401, "unknown_key")
    problem(await client.get("/v1/providers/me/balance", auth=c.provider_auth), 401, "unknown_key")
    await c.register(client)
    assert (await client.get("/v1/nodes/me", auth=c.node_auth)).status_code == 200
    assert (await client.get("/v1/providers/me/balance", auth=c.provider_auth)).status_code == 200
    # A registered key's nonces are kept as ever.
    nonce = secrets.token_urlsafe(16)
    assert (await send(client, c.node_key, "GET", "/v1/nodes/me", b"", nonce)).status_code == 200
    problem(await send(client, c.node_key, "GET", "/v1/nodes/me", b"", nonce), 401, "nonce_replayed")


async def test_a_registration_past_its_address_limit_records_no_nonce(
    settings: Settings, clock: FakeClock, hot_store: HotStore
) -> None:
    limited = settings.model_copy(
        update={"limits": LimitSettings(registration_per_ip=2, registration_window_s=60)}
    )
    app = create_app(limited, clock=clock, hot_store=hot_store)
    clock.advance(60 - clock.now() % 60 + 1)  # start of a window
    async with (
        LifespanManager(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE) as client,
    ):
        first, second = new_contributor(), new_contributor()
        await first.register(client)  # a provider and a node: the address's two
        assert (await client.post("/v1/providers", json={}, auth=second.provider_auth)).status_code == 429
        key, nonce = generate_key(), secrets.token_urlsafe(16)
        for _ in range(2):
            problem(await send(client, key, "POST", "/v1/providers", b"{}", nonce), 429, "rate_limited")
        assert await spend_nonce(hot_store, key_id_of(key), nonce, limited.signature.effective_nonce_ttl_s)
        # Registered keys register again (every worker start does) past the address's limit.
        assert (await client.post("/v1/providers", json={}, auth=first.provider_auth)).status_code == 200
        again = await client.post("/v1/nodes", json=first.node_body(), auth=first.node_auth)
        assert again.status_code == 200


async def test_an_address_past_its_limit_of_unseen_keys_is_refused_before_the_database_is_read(
    settings: Settings, clock: FakeClock, hot_store: HotStore
) -> None:
    """Each request of a key the process has not read as registered costs a database read: an
    address sending more of them than ``unseen_keys_per_ip`` in the window gets 429 instead.
    Keys the process knows pass, from that address too, and other addresses count apart."""
    limits = LimitSettings(unseen_keys_per_ip=5, unseen_keys_window_s=60)
    app = create_app(settings.model_copy(update={"limits": limits}), clock=clock, hot_store=hot_store)
    clock.advance(60 - clock.now() % 60 + 1)  # start of a window

    def client_from(address: str) -> httpx.AsyncClient:
        transport = httpx.ASGITransport(app=app, client=(address, 40000))
        return httpx.AsyncClient(transport=transport, base_url=BASE)

    async with (
        LifespanManager(app),
        client_from("203.0.113.7") as client,
        client_from("203.0.113.8") as other,
    ):
        known = new_contributor()
        await known.register(client)  # its provider key and its node key: two unseen
        assert (await client.get("/v1/nodes/me", auth=known.node_auth)).status_code == 200  # three
        for _ in range(2):  # four and five
            problem(
                await send(client, generate_key(), "GET", "/v1/nodes/me", b"", secrets.token_urlsafe(16)),
                401,
                "unknown_key",
            )
        async with sql_log(app.state.orch) as statements:
            refused = problem(
                await send(client, generate_key(), "GET", "/v1/nodes/me", b"", secrets.token_urlsafe(16)),
                429,
                "rate_limited",
            )
        assert statements == []
        assert "ORCH_LIMITS__UNSEEN_KEYS_PER_IP" in refused["detail"]
        late = new_contributor()
        problem(await client.post("/v1/providers", json={}, auth=late.provider_auth), 429, "rate_limited")
        # A key the process has read as registered costs no read: it passes.
        assert (await client.get("/v1/nodes/me", auth=known.node_auth)).status_code == 200
        problem(
            await send(other, generate_key(), "GET", "/v1/nodes/me", b"", secrets.token_urlsafe(16)),
            401,
            "unknown_key",
        )
        clock.advance(60)  # the next window
        await late.register(client)
