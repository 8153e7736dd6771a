"""Registration rate limits are counted in the hot store, so they hold across API processes."""

from __future__ import annotations

import os

import httpx
from asgi_lifespan import LifespanManager

from orchestrator.app import create_app
from orchestrator.core.clock import FakeClock
from orchestrator.core.hotstore import HotStore, RedisHotStore
from orchestrator.settings import LimitSettings, Settings
from tests.conftest import new_contributor, problem


async def test_registration_limit_per_ip_holds_across_two_instances(
    settings: Settings, clock: FakeClock, hot_store: HotStore
) -> None:
    limited = settings.model_copy(
        update={"limits": LimitSettings(registration_per_ip=3, registration_window_s=60)}
    )
    redis_url = os.environ.get("ORCH_TEST_REDIS_URL")
    second_store = RedisHotStore.from_url(redis_url, settings.redis.prefix) if redis_url else hot_store
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
    if second_store is not hot_store:
        await second_store.aclose()


async def test_registration_limit_per_key(settings: Settings, clock: FakeClock, hot_store: HotStore) -> None:
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
        assert (await client.post("/v1/providers", json={}, auth=c.provider_auth)).status_code == 200
        problem(await client.post("/v1/providers", json={}, auth=c.provider_auth), 429, "rate_limited")
        other = new_contributor()
        assert (await client.post("/v1/providers", json={}, auth=other.provider_auth)).status_code == 201


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
