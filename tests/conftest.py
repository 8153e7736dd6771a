"""Test fixtures: a real database and hot store per run, a fresh app per test.

Backends come from the environment, so the same suite runs twice in CI:

* ``ORCH_TEST_DATABASE_URL``: unset -> a SQLite file in a temporary directory;
  ``postgresql+asyncpg://...`` -> that database (its ``public`` schema is rebuilt), or under
  pytest-xdist one database per worker process beside it (``<name>_gw0``, ...).
* ``ORCH_TEST_REDIS_URL``: unset -> the in-process hot store; ``redis://...`` -> Redis,
  every test under its own key prefix.

An unreachable backend that was asked for fails the run; nothing is skipped silently.
Tests commit for real (concurrency tests need separate connections), and every table is
emptied after each test.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg  # type: ignore[import-untyped]
import httpx
import pytest
import redis.asyncio as aioredis
from asgi_lifespan import LifespanManager
from nacl.signing import SigningKey
from sqlalchemy import make_url, text
from sqlalchemy.ext.asyncio import create_async_engine

from orchestrator.all_models import Base
from orchestrator.app import create_app
from orchestrator.core.clock import FakeClock
from orchestrator.core.hotstore import NONCES_SINCE_KEY, HotStore, MemoryHotStore, RedisHotStore
from orchestrator.core.keys import attest_node, generate_key, key_id_of
from orchestrator.core.migrate import upgrade
from orchestrator.core.signing import SignatureAuth
from orchestrator.settings import (
    DatabaseSettings,
    HeartbeatSettings,
    RedisSettings,
    ServerSettings,
    Settings,
)

DATABASE_URL = os.environ.get("ORCH_TEST_DATABASE_URL")
REDIS_URL = os.environ.get("ORCH_TEST_REDIS_URL")
IS_POSTGRES = bool(DATABASE_URL and DATABASE_URL.startswith("postgresql"))

postgres_only = pytest.mark.postgres_only


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if IS_POSTGRES:
        return
    skip = pytest.mark.skip(
        reason="needs PostgreSQL (set ORCH_TEST_DATABASE_URL); runs in the PostgreSQL CI pass"
    )
    for item in items:
        if "postgres_only" in item.keywords:
            item.add_marker(skip)


async def _ping_postgres(url: str) -> None:
    conn = await asyncpg.connect(
        make_url(url).set(drivername="postgresql").render_as_string(False), timeout=10
    )
    await conn.close()


def pytest_sessionstart(session: pytest.Session) -> None:
    """An unreachable backend that was asked for ends the run at once, with the reason: checked
    here, in the main process, because under pytest-xdist a worker's ``pytest.exit`` shows only
    as a crashed worker (an INTERNALERROR without the message)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if DATABASE_URL and IS_POSTGRES:
        try:
            asyncio.run(_ping_postgres(DATABASE_URL))
        except Exception as exc:
            pytest.exit(f"ORCH_TEST_DATABASE_URL={DATABASE_URL} is unreachable: {exc!r}", returncode=3)
    if REDIS_URL:
        try:
            asyncio.run(_check_redis(REDIS_URL))
        except Exception as exc:
            pytest.exit(f"ORCH_TEST_REDIS_URL={REDIS_URL} is unreachable: {exc!r}", returncode=3)


def pytest_report_header(config: pytest.Config) -> str:
    return f"orchestrator backends: database={DATABASE_URL or 'sqlite (temp file)'}, hot store={REDIS_URL or 'in-process'}"


def _worker_database(url: str) -> str:
    """Under pytest-xdist each worker process gets a database of its own, ``<name>_gw<N>``
    beside the one named (created on first use), so that the workers' runs never see each
    other's rows; a plain run uses the database named."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker:
        return url
    base = make_url(url)
    return base.set(database=f"{base.database}_{worker}").render_as_string(hide_password=False)


async def _create_database(url: str) -> None:
    """Create ``url``'s database if it is missing, connected to the database it derives from."""
    target = make_url(url)
    origin = target.set(database=make_url(DATABASE_URL or "").database, drivername="postgresql")
    conn = await asyncpg.connect(origin.render_as_string(hide_password=False))
    try:
        if not await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", target.database):
            with contextlib.suppress(asyncpg.DuplicateDatabaseError):
                await conn.execute(f'CREATE DATABASE "{target.database}"')
    finally:
        await conn.close()


async def _reset_postgres(url: str) -> None:
    if url != DATABASE_URL:
        await _create_database(url)
    engine = create_async_engine(url)
    try:
        async with engine.begin() as conn:
            await conn.execute(text("DROP SCHEMA IF EXISTS public CASCADE"))
            await conn.execute(text("CREATE SCHEMA public"))
    finally:
        await engine.dispose()


async def _check_redis(url: str) -> None:
    client = aioredis.Redis.from_url(url, socket_connect_timeout=3)
    try:
        await client.ping()
    finally:
        await client.aclose()


@pytest.fixture(scope="session")
def database_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    if DATABASE_URL:
        url = _worker_database(DATABASE_URL)
        try:
            asyncio.run(_reset_postgres(url))
        except Exception as exc:  # fail loudly: the run asked for this database
            pytest.exit(f"ORCH_TEST_DATABASE_URL={DATABASE_URL} is unreachable: {exc!r}", returncode=3)
    else:
        url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('db') / 'test.db'}"
    if REDIS_URL:
        try:
            asyncio.run(_check_redis(REDIS_URL))
        except Exception as exc:
            pytest.exit(f"ORCH_TEST_REDIS_URL={REDIS_URL} is unreachable: {exc!r}", returncode=3)
    upgrade(url)
    return url


async def _empty_tables(url: str) -> None:
    tables = [t.name for t in reversed(Base.metadata.sorted_tables)]
    if url.startswith("postgresql"):
        await _empty_postgres(url, tables)
        return
    engine = create_async_engine(url)
    try:
        async with engine.begin() as conn:
            for name in tables:
                await conn.execute(text(f"DELETE FROM {name}"))
    finally:
        await engine.dispose()


async def _empty_postgres(url: str, tables: list[str]) -> None:
    """DELETE every table and restart every sequence, as one script in one
    transaction: 0.03 s a test, where ``TRUNCATE ... RESTART IDENTITY CASCADE`` took 0.19 s
    (it rewrites each table's files), a sixth of the PostgreSQL pass."""
    conn = await asyncpg.connect(make_url(url).set(drivername="postgresql").render_as_string(False))
    try:
        sequences = await conn.fetch(
            "SELECT quote_ident(sequencename) AS name FROM pg_sequences WHERE schemaname = 'public'"
        )
        script = "".join(f"DELETE FROM {name};" for name in tables) + "".join(
            f"ALTER SEQUENCE {row['name']} RESTART;" for row in sequences
        )
        # Triggers off (the foreign keys' and audit_log's append-only guard): every row goes.
        await conn.execute(f"BEGIN;SET LOCAL session_replication_role = replica;{script}COMMIT;")
    finally:
        await conn.close()


async def _drop_prefix(url: str, prefix: str) -> None:
    client = aioredis.Redis.from_url(url)
    try:
        keys = [k async for k in client.scan_iter(match=prefix + "*", count=1000)]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()


@pytest.fixture
def redis_prefix() -> str:
    return f"test:{uuid.uuid4().hex[:12]}:"


async def _max_connections(url: str) -> int:
    conn = await asyncpg.connect(
        make_url(url).set(drivername="postgresql").render_as_string(False), timeout=10
    )
    try:
        return int(await conn.fetchval("SHOW max_connections"))
    finally:
        await conn.close()


@pytest.fixture(scope="session")
def connection_budget(database_url: str) -> dict[str, int]:
    """The app's connection pool in tests: 20 + 40 overflow (the concurrency tests open 50 and
    60 at once), but on PostgreSQL never more than this process's share of ``max_connections``
    less 20 (the tests' own connections, and the servers test_scale_out starts, 3 x 15, come out
    of a process's share): two pytest-xdist processes each running such a test at once got
    'sorry, too many clients already' from a server of 100."""
    if not database_url.startswith("postgresql"):
        return {"pool_size": 20, "max_overflow": 40}
    processes = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    share = (asyncio.run(_max_connections(database_url)) - 20) // processes
    pool_size = max(1, min(20, share // 3))
    return {"pool_size": pool_size, "max_overflow": max(0, min(40, share - pool_size))}


@pytest.fixture
def settings(database_url: str, redis_prefix: str, connection_budget: dict[str, int]) -> Settings:
    return Settings(
        env="test",
        log_level="WARNING",
        db=DatabaseSettings(url=database_url, **connection_budget),
        redis=RedisSettings(url=REDIS_URL, prefix=redis_prefix),  # type: ignore[arg-type]
        heartbeat=HeartbeatSettings(
            interval_s=10, unhealthy_after_missed=3, dead_after_missed=9, sweep_interval_s=5
        ),
        server=ServerSettings(background_loops=False, migrate_on_start=False),
    )


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def hot_store(settings: Settings) -> AsyncIterator[HotStore]:
    """One hot store per test; shared by every app instance the test builds (like one Redis)."""
    store: HotStore
    if REDIS_URL:
        store = RedisHotStore.from_url(REDIS_URL, settings.redis.prefix)
        # A Redis that has held the deployment's nonces from the start, as one kept since before
        # its first request: requests signed before the test began (or before the clock was moved
        # back) are not refused as possibly replayed. A test that deletes the prefix's keys
        # deletes this marker with them, as a flush would.
        marker = aioredis.Redis.from_url(REDIS_URL)
        try:
            await marker.set(settings.redis.prefix + NONCES_SINCE_KEY, 0)
        finally:
            await marker.aclose()
    else:
        store = MemoryHotStore()
    yield store
    await store.aclose()
    if REDIS_URL:
        await _drop_prefix(REDIS_URL, settings.redis.prefix)


@pytest.fixture(autouse=True)
def _clean_database(database_url: str) -> Iterator[None]:
    yield
    asyncio.run(_empty_tables(database_url))


@pytest.fixture
async def app(settings: Settings, clock: FakeClock, hot_store: HotStore) -> AsyncIterator[Any]:
    # Tests drive the loops and the clock themselves; test_serving_marks writes the marks.
    application = create_app(
        settings, clock=clock, hot_store=hot_store, serving_marks=False, close_scoring=False
    )
    async with LifespanManager(application):
        yield application


@pytest.fixture
async def client(app: Any) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as c:
        yield c


@pytest.fixture
def app_state(app: Any) -> Any:
    return app.state.orch


# ------------------------------------------------------------------ contributors

GPU_SPECS = {
    "gpu_model": "NVIDIA H100 80GB HBM3",
    "gpu_count": 1,
    "gpu_memory_mb": 81559,
    "cpu_cores": 16,
    "ram_mb": 131072,
}


@dataclass
class Contributor:
    """A provider key and one node key, with signing helpers."""

    provider_key: SigningKey
    node_key: SigningKey

    @property
    def provider_id(self) -> str:
        return key_id_of(self.provider_key)

    @property
    def node_id(self) -> str:
        return key_id_of(self.node_key)

    @property
    def node_auth(self) -> SignatureAuth:
        return SignatureAuth(self.node_key)

    @property
    def provider_auth(self) -> SignatureAuth:
        return SignatureAuth(self.provider_key)

    def node_body(self, **overrides: Any) -> dict[str, Any]:
        return {
            "provider_id": self.provider_id,
            "attestation": attest_node(self.provider_key, self.node_id),
            "specs": dict(GPU_SPECS),
            "version": "0.1.0",
            **overrides,
        }

    async def register(self, client: httpx.AsyncClient) -> None:
        r = await client.post(
            "/v1/providers", json={"display_name": "test provider"}, auth=self.provider_auth
        )
        assert r.status_code in (200, 201), r.text
        r = await client.post("/v1/nodes", json=self.node_body(), auth=self.node_auth)
        assert r.status_code in (200, 201), r.text

    async def beat(self, client: httpx.AsyncClient, **body: Any) -> httpx.Response:
        return await client.post("/v1/nodes/me/heartbeat", json=body, auth=self.node_auth)


def new_contributor(provider_key: SigningKey | None = None) -> Contributor:
    return Contributor(provider_key=provider_key or generate_key(), node_key=generate_key())


@pytest.fixture
async def contributor(client: httpx.AsyncClient) -> Contributor:
    c = new_contributor()
    await c.register(client)
    return c


# ------------------------------------------------------------------ operators


async def make_token(app_state: Any, role: str, name: str = "test") -> str:
    from orchestrator.admin.tokens import Role, create_token

    async with app_state.sessionmaker() as session, session.begin():
        token, _ = await create_token(session, role=Role(role), name=name)
    return token


@pytest.fixture
def no_audits(app_state: Any) -> None:
    """The audit draw never fires (``pytestmark = pytest.mark.usefixtures("no_audits")``): results
    are decided on their own checks, unless a test draws otherwise."""
    from tests.verification_helpers import FixedDraw

    app_state.rng = FixedDraw(1.0)


@pytest.fixture
def gate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The ``gated`` reward function installed (as a plugin, where the scoring processes find it
    too), and the gate that holds the scoring of results whose spec names it
    (``tests.scoring_helpers``). Opened at the end, so that no scoring process stays held."""
    from orchestrator.verification import rewards, scoring
    from tests.scoring_helpers import Gate

    site = tmp_path / "gated-plugin"
    info = site / "gated_reward-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: gated-reward\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        f"[{rewards.ENTRY_POINT_GROUP}]\ngated = tests.scoring_helpers:Gated\n"
    )
    monkeypatch.syspath_prepend(str(site))
    rewards._plugins.cache_clear()
    scoring.close_pools()  # the next scoring processes start with the plugin on their path
    held = Gate(tmp_path / "gate")
    held.directory.mkdir()
    yield held
    held.open()
    scoring.close_pools()
    rewards._plugins.cache_clear()


@pytest.fixture
async def admin_headers(app_state: Any) -> dict[str, str]:
    return {"Authorization": f"Bearer {await make_token(app_state, 'admin')}"}


@pytest.fixture
async def operator_headers(app_state: Any) -> dict[str, str]:
    return {"Authorization": f"Bearer {await make_token(app_state, 'operator')}"}


async def spend_nonce(store: Any, keyid: str, nonce: str, ttl_s: int) -> bool:
    """Admit a request of ``keyid`` with ``nonce``, counting no quota, signed now: whether the
    nonce was new (it is spent now), as the signed routes' admission asks the hot store."""
    return await store.admit(keyid, nonce, ttl_s, [], time.time(), int(time.time())) is not None


def asgi_post(path: str, headers: dict[str, str], client: tuple[str, int]) -> dict[str, Any]:
    """The ASGI scope of a POST to ``path`` with ``headers`` (their names lower-cased) from
    ``client``, for the tests that drive the app's ASGI callable with their own receive/send."""
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(k.lower().encode(), v.encode()) for k, v in {"host": "testserver", **headers}.items()],
        "client": client,
        "server": ("testserver", 80),
        "state": {},
    }


async def asgi_stream(
    app: Any, path: str, token: str, between: Callable[[], Awaitable[Any]], *, at_start: bool = False
) -> tuple[list[bytes], bool]:
    """GET ``path`` (with its query) with bearer ``token`` through the app's ASGI callable,
    running ``between()`` once the first part of the body has been sent (``at_start``: once the
    status is sent, before any of the body, the request's own transaction over): the parts sent, and
    whether the answer was finished (its last message sent; a server closes the connection of an
    unfinished one, and its client sees a broken download)."""
    parts: list[bytes] = []
    completed = False
    request_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal request_sent
        if not request_sent:
            request_sent = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await asyncio.Event().wait()  # the client stays connected
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        nonlocal completed
        if message["type"] != "http.response.body":
            assert message["status"] == 200, message
            if at_start:
                await between()
            return
        if message.get("body"):
            parts.append(message["body"])
            if len(parts) == 1:
                await between()
        if not message.get("more_body", False):
            completed = True

    path, _, query = path.partition("?")
    headers = {"authorization": f"Bearer {token}"}
    scope = {
        **asgi_post(path, headers, client=("192.0.2.9", 40000)),
        "method": "GET",
        "query_string": query.encode(),
    }
    await app(scope, receive, send)
    return parts, completed


def problem(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    """Assert an RFC 9457 problem with this status and code; return its body."""
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["content-type"].startswith("application/problem+json"), response.headers
    body = response.json()
    assert body["status"] == status and body["code"] == code, body
    assert body["type"].endswith("/" + code) and body["title"] and body["detail"]
    return body


ROOT = Path(__file__).resolve().parent.parent
