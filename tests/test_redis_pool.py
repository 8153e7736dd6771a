"""The Redis hot store's connection pool: a burst larger than the pool waits for a connection
instead of failing, and a request that cannot get one in time is a 503 the client may retry."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from asgi_lifespan import LifespanManager

from orchestrator.app import create_app
from orchestrator.core.clock import FakeClock
from orchestrator.core.hotstore import RedisHotStore
from orchestrator.settings import Settings
from tests.conftest import REDIS_URL, new_contributor, problem, spend_nonce
from tests.waits import HANG_S

pytestmark = pytest.mark.skipif(not REDIS_URL, reason="needs Redis (set ORCH_TEST_REDIS_URL)")


@pytest.fixture
async def small_store(settings: Settings) -> AsyncIterator[RedisHotStore]:
    assert REDIS_URL is not None
    store = RedisHotStore.from_url(REDIS_URL, settings.redis.prefix, max_connections=2, pool_timeout_s=0.3)
    yield store
    await store.aclose()


async def test_a_burst_larger_than_the_pool_waits_for_connections(small_store: RedisHotStore) -> None:
    # redis-py's default pool fails at once past its size; 60 claims through 2 connections
    # all complete, each nonce exactly once.
    claims = [spend_nonce(small_store, "key", f"nonce-{i:03d}", 60) for i in range(60)]
    assert await asyncio.gather(*claims) == [True] * 60
    assert await spend_nonce(small_store, "key", "nonce-007", 60) is False


async def test_a_request_that_gets_no_connection_in_time_is_503_with_retry_after(
    settings: Settings, clock: FakeClock, small_store: RedisHotStore
) -> None:
    application = create_app(settings, clock=clock, hot_store=small_store)
    async with (
        LifespanManager(application) as manager,
        httpx.AsyncClient(transport=httpx.ASGITransport(app=manager.app), base_url="http://testserver") as c,
    ):
        contributor = new_contributor()
        await contributor.register(c)
        # Both connections busy (blocking reads on lists nobody writes yet) past the pool timeout.
        redis: Any = small_store._r
        lists = [f"{settings.redis.prefix}blocked-{i}" for i in range(2)]
        blockers = [asyncio.create_task(redis.blpop([name], timeout=0)) for name in lists]
        assert REDIS_URL is not None
        watcher = aioredis.Redis.from_url(REDIS_URL)
        try:
            db = str(watcher.connection_pool.connection_kwargs.get("db", 0))

            async def blocked() -> int:
                clients = await watcher.client_list()
                return sum(1 for x in clients if x.get("cmd") == "blpop" and str(x.get("db")) == db)

            deadline = time.monotonic() + HANG_S
            while await blocked() < 2:  # both connections are taken by the reads
                assert time.monotonic() < deadline, "the blocking reads never started"
                await asyncio.sleep(0.01)
            r = await contributor.beat(c)
            problem(r, 503, "hot_store_unavailable")
            assert r.headers["Retry-After"] == "1"
        finally:
            for name in lists:
                await watcher.rpush(name, "done")
            await asyncio.gather(*blockers)
            await watcher.aclose()  # each read took its list's one item: nothing is left
        assert (await contributor.beat(c)).status_code == 200  # the same request again, later
