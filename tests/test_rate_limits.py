"""Rate limits are counted in the hot store, so they hold across API processes: registrations per
address and per key, and every signed request per key."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import structlog
import structlog.testing
from asgi_lifespan import LifespanManager
from sqlalchemy import func, select

from orchestrator.app import create_app
from orchestrator.core.clock import FakeClock
from orchestrator.core.hotstore import HotStore, Quota, RedisHotStore
from orchestrator.core.keys import attest_node, generate_key
from orchestrator.core.nonces import SpentNonce
from orchestrator.core.signing import sign_headers
from orchestrator.settings import LimitSettings, Settings
from tests.conftest import new_contributor, problem
from tests.tasks_helpers import pool_setup, task


@pytest.fixture
async def second_store(settings: Settings, hot_store: HotStore) -> AsyncIterator[HotStore]:
    """The hot store as a second API process has it: with Redis, a connection pool of its own to
    the same server; else the one in-process store."""
    redis_url = os.environ.get("ORCH_TEST_REDIS_URL")
    if not redis_url:
        yield hot_store
        return
    store = RedisHotStore.from_url(redis_url, settings.redis.prefix)
    try:
        yield store
    finally:
        await store.aclose()


async def test_registration_limit_per_ip_holds_across_two_instances(
    settings: Settings, clock: FakeClock, hot_store: HotStore, second_store: HotStore
) -> None:
    limited = settings.model_copy(
        update={"limits": LimitSettings(registration_per_ip=3, registration_window_s=60)}
    )
    apps = [
        create_app(limited, clock=clock, hot_store=hot_store),
        create_app(limited, clock=clock, hot_store=second_store),
    ]
    clock.advance(60 - clock.now() % 60 + 1)  # start of a window
    async with LifespanManager(apps[0]), LifespanManager(apps[1]):
        clients = [
            httpx.AsyncClient(transport=httpx.ASGITransport(app=a), base_url="http://testserver")
            for a in apps
        ]
        statuses = []
        for i in range(3):
            c = new_contributor()
            r = await clients[i % 2].post("/v1/providers", json={}, auth=c.provider_auth)
            statuses.append(r.status_code)
        assert statuses == [201, 201, 201]
        refused = await clients[1].post("/v1/providers", json={}, auth=new_contributor().provider_auth)
        problem(refused, 429, "rate_limited")
        assert 1 <= int(refused.headers["retry-after"]) <= 60
        clock.advance(60)
        again = await clients[0].post("/v1/providers", json={}, auth=new_contributor().provider_auth)
        assert again.status_code == 201
        for c in clients:
            await c.aclose()


async def test_registration_limit_per_key_counts_attempts_to_register_a_new_key_only(
    settings: Settings, clock: FakeClock, hot_store: HotStore
) -> None:
    """Every machine of a provider registers the provider's key when its worker starts: that is
    idempotent and not a registration to limit (a farm of machines starting at once was refused
    429). Attempts to register a key that is not registered yet, failed ones included, are."""
    limited = settings.model_copy(
        update={"limits": LimitSettings(registration_per_key=2, registration_window_s=60)}
    )
    app = create_app(limited, clock=clock, hot_store=hot_store)
    clock.advance(60 - clock.now() % 60 + 1)
    c = new_contributor()
    async with (
        LifespanManager(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as client,
    ):
        assert (await client.post("/v1/providers", json={}, auth=c.provider_auth)).status_code == 201
        for _ in range(5):
            assert (await client.post("/v1/providers", json={}, auth=c.provider_auth)).status_code == 200
        forged = c.node_body(attestation=attest_node(generate_key(), c.node_id))
        for _ in range(2):
            problem(await client.post("/v1/nodes", json=forged, auth=c.node_auth), 403, "attestation_invalid")
        problem(await client.post("/v1/nodes", json=forged, auth=c.node_auth), 429, "rate_limited")
        other = new_contributor(c.provider_key)
        assert (
            await client.post("/v1/nodes", json=other.node_body(), auth=other.node_auth)
        ).status_code == 201
        for _ in range(3):
            r = await client.post("/v1/nodes", json=other.node_body(), auth=other.node_auth)
            assert r.status_code == 200


async def test_registration_limit_per_ip_counts_an_ipv6_64_as_one_address(
    settings: Settings, clock: FakeClock, hot_store: HotStore
) -> None:
    """One host is routinely given a whole IPv6 /64 (the per-IP pool rules count it as one
    address): rotating addresses inside it must not reset the registration limit."""
    limited = settings.model_copy(
        update={"limits": LimitSettings(registration_per_ip=2, registration_window_s=60)}
    )
    app = create_app(limited, clock=clock, hot_store=hot_store)
    clock.advance(60 - clock.now() % 60 + 1)

    async def register_from(address: str) -> httpx.Response:
        transport = httpx.ASGITransport(app=app, client=(address, 40000))
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as c:
            return await c.post("/v1/providers", json={}, auth=new_contributor().provider_auth)

    async with LifespanManager(app):
        statuses = [(await register_from(f"2001:db8:1:2::{i + 1:x}")).status_code for i in range(2)]
        assert statuses == [201, 201]
        problem(await register_from("2001:db8:1:2:ffff:ffff:ffff:ffff"), 429, "rate_limited")
        assert (await register_from("2001:db8:1:3::1")).status_code == 201  # another /64
        # An IPv4-mapped IPv6 address is its IPv4 address.
        assert (await register_from("192.0.2.7")).status_code == 201
        assert (await register_from("::ffff:192.0.2.7")).status_code == 201
        problem(await register_from("192.0.2.7"), 429, "rate_limited")


@asynccontextmanager
async def app_with(
    settings: Settings, clock: FakeClock, hot_store: HotStore, **limits: Any
) -> AsyncIterator[Any]:
    # INFO: the request lines are logged (and captured where a test asks).
    changed = settings.model_copy(update={"limits": LimitSettings(**limits), "log_level": "INFO"})
    app = create_app(changed, clock=clock, hot_store=hot_store)
    async with LifespanManager(app):
        yield app


def next_window(clock: FakeClock, window_s: int) -> None:
    clock.advance(window_s - clock.now() % window_s + 0.5)


async def test_signed_requests_are_limited_per_key_and_a_refused_claim_leases_nothing(
    settings: Settings, clock: FakeClock, hot_store: HotStore
) -> None:
    """A worker that ignores Retry-After and loops on claims makes a database transaction of
    each: past its key's limit it is refused before any, with the window's remaining wait."""
    async with (
        app_with(settings, clock, hot_store, signed_per_key=5, signed_window_s=10) as app,
        pool_setup(app, app.state.orch, workers=2, max_leases_per_node=10) as s,
    ):
        await s.enqueue([task(f"q{i}") for i in range(10)])
        greedy, other = s.workers
        next_window(clock, 10)
        for _ in range(5):
            r = await greedy.claim(s.pool_id)
            assert r.status_code == 200 and len(r.json()["leases"]) == 1
        with structlog.testing.capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
            refused = problem(await greedy.claim(s.pool_id), 429, "rate_limited")
        assert "5 signed requests in 10 s" in refused["detail"]
        # The operator's log line of the refusal names the key that is over its limit.
        [line] = [x for x in logs if x["event"] == "request"]
        assert (line["status"], line["keyid"]) == (429, greedy.node_id)
        r = await greedy.claim(s.pool_id)
        assert r.status_code == 429 and 1 <= int(r.headers["retry-after"]) <= 10
        # Another key is counted on its own.
        assert len((await other.claim(s.pool_id)).json()["leases"]) == 1
        clock.advance(10)
        leases = await greedy.client.get("/v1/nodes/me/leases", auth=greedy.contributor.node_auth)
        assert leases.status_code == 200
        assert len(leases.json()["leases"]) == 5  # the refused claims leased nothing


async def test_a_replayed_request_does_not_spend_its_signers_limit(
    settings: Settings, clock: FakeClock, hot_store: HotStore
) -> None:
    """Whoever captures a signed request can send it again within the signature window; the
    nonce refuses it, and it must not count, or replays could lock the node out."""
    async with (
        app_with(settings, clock, hot_store, signed_per_key=3, signed_window_s=60) as app,
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as client,
    ):
        c = new_contributor()
        await c.register(client)
        next_window(clock, 60)
        url = "http://testserver/v1/nodes/me"
        captured = sign_headers(c.node_key, method="GET", url=url)
        assert (await client.get("/v1/nodes/me", headers=captured)).status_code == 200
        for _ in range(5):
            problem(await client.get("/v1/nodes/me", headers=captured), 401, "nonce_replayed")
        for _ in range(2):
            assert (await client.get("/v1/nodes/me", auth=c.node_auth)).status_code == 200
        problem(await client.get("/v1/nodes/me", auth=c.node_auth), 429, "rate_limited")


async def test_the_signed_request_limit_holds_across_two_instances_and_zero_turns_it_off(
    settings: Settings, clock: FakeClock, hot_store: HotStore, second_store: HotStore
) -> None:
    c = new_contributor()
    async with (
        app_with(settings, clock, hot_store, signed_per_key=4, signed_window_s=60) as first,
        app_with(settings, clock, second_store, signed_per_key=4, signed_window_s=60) as second,
        app_with(settings, clock, hot_store, signed_per_key=0) as unlimited,
    ):
        clients = [
            httpx.AsyncClient(transport=httpx.ASGITransport(app=a), base_url="http://testserver")
            for a in (first, second, unlimited)
        ]
        await c.register(clients[0])
        next_window(clock, 60)
        statuses = [
            (await clients[i % 2].get("/v1/nodes/me", auth=c.node_auth)).status_code for i in range(5)
        ]
        assert statuses == [200, 200, 200, 200, 429]
        for _ in range(10):
            assert (await clients[2].get("/v1/nodes/me", auth=c.node_auth)).status_code == 200
        for client in clients:
            await client.aclose()


async def test_a_providers_machines_share_its_key_within_a_budget_of_their_own(
    settings: Settings, clock: FakeClock, hot_store: HotStore
) -> None:
    """Every machine of a provider signs with its key (each worker reads the balance and the
    verdicts with it): a node key's limit would lock out a provider of some hundred machines,
    and with it every worker's start. Provider-signed requests have their own budget."""
    async with (
        app_with(
            settings, clock, hot_store, signed_per_key=3, signed_per_provider_key=12, signed_window_s=60
        ) as app,
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as client,
    ):
        next_window(clock, 60)
        provider = generate_key()
        machines = [new_contributor(provider) for _ in range(4)]
        for machine in machines:  # 4 provider registrations, 1 node registration each
            await machine.register(client)
        for machine in machines:  # 8 reads: past a node key's 3, within the provider's 12
            for path in ("/v1/providers/me/balance", "/v1/providers/me/verdicts"):
                assert (await client.get(path, auth=machine.provider_auth)).status_code == 200
        refused = problem(
            await client.get("/v1/providers/me/balance", auth=machines[0].provider_auth), 429, "rate_limited"
        )
        assert "ORCH_LIMITS__SIGNED_PER_PROVIDER_KEY" in refused["detail"]
        # Each node key has its own budget, untouched by the provider's.
        for _ in range(2):
            assert (await client.get("/v1/nodes/me", auth=machines[0].node_auth)).status_code == 200
        refused = problem(await client.get("/v1/nodes/me", auth=machines[0].node_auth), 429, "rate_limited")
        assert "ORCH_LIMITS__SIGNED_PER_KEY" in refused["detail"]


async def test_a_request_refused_for_the_limit_can_be_sent_again_as_it_was_after_retry_after(
    settings: Settings, clock: FakeClock, hot_store: HotStore
) -> None:
    """A 429 did nothing, so it spends nothing: the same signed request (an HTTP client's retry
    sends it byte for byte), sent again after Retry-After and still within its signature window,
    is served. Its nonce was spent by the refusal, in the hot store and in the embedded
    default's ``spent_nonces`` too, so the retry was refused as a replay. Once served, it is a
    replay like any other."""
    async with (
        app_with(settings, clock, hot_store, signed_per_key=1, signed_window_s=10) as app,
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as client,
    ):
        state = app.state.orch
        c = new_contributor()
        await c.register(client)
        next_window(clock, 10)
        assert (await client.get("/v1/nodes/me", auth=c.node_auth)).status_code == 200
        nonces = await _spent_rows(state)
        retried = sign_headers(c.node_key, method="GET", url="http://testserver/v1/nodes/me")
        for _ in range(2):
            refused = await client.get("/v1/nodes/me", headers=retried)
            problem(refused, 429, "rate_limited")
        assert await _spent_rows(state) == nonces  # the refusals left no nonce behind
        clock.advance(int(refused.headers["retry-after"]))
        assert (await client.get("/v1/nodes/me", headers=retried)).status_code == 200
        if state.spent_nonces is not None:
            assert await _spent_rows(state) == nonces + 1
        clock.advance(10)  # a window with room: the nonce, not the limit, refuses it now
        problem(await client.get("/v1/nodes/me", headers=retried), 401, "nonce_replayed")


async def _spent_rows(state: Any) -> int:
    """Rows of ``spent_nonces`` (the embedded default's; a shared hot store writes none)."""
    async with state.sessionmaker() as session:
        return int(await session.scalar(select(func.count()).select_from(SpentNonce)) or 0)


async def test_a_request_refused_for_the_limit_and_sent_again_twice_at_once_is_served_once(
    settings: Settings, clock: FakeClock, hot_store: HotStore, second_store: HotStore
) -> None:
    """The refusal leaves the nonce unspent, but not for a second serving: the same signed request
    sent again twice at once after Retry-After, to two API processes (one Redis with its own
    connections; the in-process store: one process), is served once and refused once as a replay
    (the nonce is checked, counted and spent in one step), and only the served one is counted."""
    limited = settings.model_copy(update={"limits": LimitSettings(signed_per_key=2, signed_window_s=10)})
    apps = [
        create_app(limited, clock=clock, hot_store=hot_store),
        create_app(limited, clock=clock, hot_store=second_store),
    ]
    async with LifespanManager(apps[0]), LifespanManager(apps[1]):
        clients = [
            httpx.AsyncClient(transport=httpx.ASGITransport(app=a), base_url="http://testserver")
            for a in apps
        ]
        c = new_contributor()
        await c.register(clients[0])
        next_window(clock, 10)
        for _ in range(2):
            assert (await clients[0].get("/v1/nodes/me", auth=c.node_auth)).status_code == 200
        retried = sign_headers(c.node_key, method="GET", url="http://testserver/v1/nodes/me")
        problem(await clients[1].get("/v1/nodes/me", headers=retried), 429, "rate_limited")
        next_window(clock, 10)
        answers = await asyncio.gather(*(client.get("/v1/nodes/me", headers=retried) for client in clients))
        assert sorted(r.status_code for r in answers) == [200, 401]
        problem(next(r for r in answers if r.status_code == 401), 401, "nonce_replayed")
        # The window's second request is still there for a fresh one; then it is over.
        assert (await clients[0].get("/v1/nodes/me", auth=c.node_auth)).status_code == 200
        problem(await clients[1].get("/v1/nodes/me", auth=c.node_auth), 429, "rate_limited")
        for client in clients:
            await client.aclose()


async def test_a_replayed_registration_counts_toward_no_registration_limit(
    settings: Settings, clock: FakeClock, hot_store: HotStore
) -> None:
    """A registration's nonce is checked before it is counted toward its address's and its key's
    registration limits: whoever captured a node's registration (one refused, here for its
    attestation, so the key is still unregistered) and sends it again and again is refused
    nonce_replayed each time, and the node's key and its address can still register. Before, each
    replay counted toward both limits (a 429 once past them), and the node's own registration
    was then refused 429."""
    limited = settings.model_copy(
        update={
            "limits": LimitSettings(registration_per_ip=3, registration_per_key=2, registration_window_s=60)
        }
    )
    app = create_app(limited, clock=clock, hot_store=hot_store)
    async with (
        LifespanManager(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as client,
    ):
        clock.advance(60 - clock.now() % 60 + 1)  # start of a window
        c = new_contributor()
        assert (await client.post("/v1/providers", json={}, auth=c.provider_auth)).status_code == 201
        forged = json.dumps(c.node_body(attestation=attest_node(generate_key(), c.node_id))).encode()
        captured = {
            **sign_headers(c.node_key, method="POST", url="http://testserver/v1/nodes", body=forged),
            "content-type": "application/json",
        }
        problem(await client.post("/v1/nodes", content=forged, headers=captured), 403, "attestation_invalid")
        for _ in range(3):
            problem(await client.post("/v1/nodes", content=forged, headers=captured), 401, "nonce_replayed")
        # The key's second registration, the address's third: both within their limits.
        r = await client.post("/v1/nodes", json=c.node_body(), auth=c.node_auth)
        assert r.status_code == 201, r.text
        # Past the address's three, a fresh registration is refused as ever.
        problem(
            await client.post("/v1/providers", json={}, auth=new_contributor().provider_auth),
            429,
            "rate_limited",
        )


async def test_an_admission_undone_counts_nothing_and_leaves_its_nonce_as_it_says(
    hot_store: HotStore,
) -> None:
    """``unadmit`` (the embedded default's undo of a request whose ``spent_nonces`` row was not
    written) takes the request's count back from each quota and forgets its nonce unless it is
    spent elsewhere (a replay); a quota's limit is then where it was (Redis or in-process)."""
    now = 60 * 20_000 + 0.5  # the start of a window
    quotas = [Quota("ip:register:test", 2, 60), Quota("key:test-key", 1, 60)]
    admitted = await hot_store.admit("test-key", "nonce-0001", 601, quotas, now, int(now))
    assert admitted is not None and admitted.refused_by is None
    assert await hot_store.admit("test-key", "nonce-0001", 601, quotas, now, int(now)) is None
    await hot_store.unadmit("test-key", "nonce-0001", quotas, now, spent=False)
    # The nonce is new again, and the key's one request of the window is still there.
    admitted = await hot_store.admit("test-key", "nonce-0001", 601, quotas, now, int(now))
    assert admitted is not None and admitted.refused_by is None
    await hot_store.unadmit("test-key", "nonce-0001", quotas, now, spent=True)
    assert await hot_store.admit("test-key", "nonce-0001", 601, quotas, now, int(now)) is None  # still spent
    admitted = await hot_store.admit("test-key", "nonce-0002", 601, quotas, now, int(now))
    assert admitted is not None and admitted.refused_by is None
    # Past the key's limit now: the first quota counted it (its second), the key's refused it.
    refused = await hot_store.admit("test-key", "nonce-0003", 601, quotas, now, int(now))
    assert refused is not None and refused.refused_by == quotas[1] and refused.retry_after_s == 60
    refused = await hot_store.admit("test-key", "nonce-0004", 601, quotas, now, int(now))
    assert refused is not None and refused.refused_by == quotas[0]
