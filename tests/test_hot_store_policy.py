"""A Redis hot store that may evict keys loses spent nonces unseen (README, Redis): the API
process says so at startup, against a real ``redis-server`` of the test's own (the shared one's
configuration is left alone)."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis
import structlog
from asgi_lifespan import LifespanManager

from orchestrator.app import create_app
from orchestrator.core.clock import FakeClock
from orchestrator.core.hotstore import MemoryHotStore, RedisHotStore, check_hot_store_clock
from orchestrator.settings import RedisSettings, Settings
from tests.process_helpers import free_port, stop

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not on PATH")


@contextmanager
def redis_server(tmp_path: Path, *args: str) -> Iterator[str]:
    """A throwaway ``redis-server`` on a free port of 127.0.0.1, no persistence, with ``args``;
    its URL, once it answers."""
    port = free_port()
    command = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    server = subprocess.Popen(
        [*command, "--appendonly", "no", "--dir", str(tmp_path), *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        client = redis.Redis(port=port)
        deadline = time.monotonic() + 30
        while True:
            assert server.poll() is None, "redis-server exited"
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not answer"
                time.sleep(0.05)
        client.close()
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        stop(server)


async def startup_warnings(settings: Settings, url: str) -> list[dict[str, Any]]:
    """The warnings an API process logs as it starts with its hot store at ``url``."""
    settings = settings.model_copy(update={"redis": RedisSettings(url=url, prefix="policy-test:")})  # type: ignore[arg-type]
    app = create_app(settings, clock=FakeClock(), serving_marks=False, close_scoring=False)
    with structlog.testing.capture_logs() as logs:
        async with LifespanManager(app):
            pass
    return [e for e in logs if e["log_level"] == "warning" and e["event"].startswith("hot_store_")]


@pytest.mark.parametrize(
    ("args", "seen"),
    [
        (["--maxmemory-policy", "allkeys-lru"], "allkeys-lru"),
        # CONFIG disabled, as on managed Redis: INFO memory says it.
        (["--maxmemory-policy", "volatile-lru", "--rename-command", "CONFIG", ""], "volatile-lru"),
    ],
)
async def test_a_redis_that_evicts_is_warned_of_once_at_startup(
    settings: Settings, tmp_path: Path, args: list[str], seen: str
) -> None:
    with redis_server(tmp_path, *args) as url:
        warnings = await startup_warnings(settings, url)
    assert [(w["event"], w["maxmemory_policy"]) for w in warnings] == [("hot_store_evicts", seen)]
    assert "noeviction" in warnings[0]["detail"] and "replayed" in warnings[0]["detail"]


async def test_a_noeviction_redis_starts_without_a_warning(settings: Settings, tmp_path: Path) -> None:
    with redis_server(tmp_path, "--maxmemory-policy", "noeviction", "--rename-command", "CONFIG", "") as url:
        assert await startup_warnings(settings, url) == []
    with redis_server(tmp_path, "--maxmemory-policy", "noeviction") as url:
        assert await startup_warnings(settings, url) == []


async def test_a_policy_that_cannot_be_read_is_said_once(settings: Settings, tmp_path: Path) -> None:
    args = [
        "--maxmemory-policy",
        "allkeys-lru",
        "--rename-command",
        "CONFIG",
        "",
        "--rename-command",
        "INFO",
        "",
    ]
    with redis_server(tmp_path, *args) as url:
        warnings = await startup_warnings(settings, url)
    assert [w["event"] for w in warnings] == ["hot_store_memory_policy_unknown"]
    assert "noeviction" in warnings[0]["detail"]


async def test_an_api_process_whose_clock_differs_from_redis_s_says_so_at_startup(tmp_path: Path) -> None:
    """The nonce-loss marker is dated by Redis's clock and compared with signatures dated by the
    signers' (docs/PROTOCOL.md): an API process whose clock differs from Redis's by more than
    5 s logs one hot_store_clock_skew warning as it starts (with offset_s: its clock less
    Redis's), as it does for the database's (clock_skew); a clock that agrees, nothing."""
    with redis_server(tmp_path) as url:
        store = RedisHotStore.from_url(url, "clock-test:")
        try:
            with structlog.testing.capture_logs() as logs:
                agrees = await check_hot_store_clock(store, now=time.time)
                ahead = await check_hot_store_clock(store, now=lambda: time.time() + 60)
        finally:
            await store.aclose()
    assert agrees is not None and abs(agrees) < 5
    assert ahead is not None and 55 < ahead < 65
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert [w["event"] for w in warnings] == ["hot_store_clock_skew"], logs
    assert 55 < warnings[0]["offset_s"] < 65 and "NTP" in warnings[0]["detail"]
    assert await check_hot_store_clock(MemoryHotStore(), now=time.time) is None  # one process, one clock
