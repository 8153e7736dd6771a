"""Spent nonces outlive an API process whose hot store is its own (the embedded default): a
signed request seen before a restart is still a replay after it (``core.nonces``). A request
whose nonce could not be written there did nothing and spends nothing; a replay only the table
knows counts toward no limit."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from asgi_lifespan import LifespanManager
from sqlalchemy import event, func, select, text
from sqlalchemy.ext.asyncio import AsyncEngine

from orchestrator.app import create_app
from orchestrator.core.clock import FakeClock
from orchestrator.core.keys import attest_node, generate_key
from orchestrator.core.nonces import NonceLedger, SpentNonce
from orchestrator.core.signing import SignatureAuth, sign_headers
from orchestrator.settings import LimitSettings, RedisSettings, Settings
from tests.conftest import new_contributor, problem

BASE = "http://testserver"
HEARTBEAT = "/v1/nodes/me/heartbeat"


async def test_a_request_seen_before_a_restart_is_refused_as_a_replay_after_it(
    settings: Settings, clock: FakeClock
) -> None:
    """The same process refused it from memory; the next one (a crash, a deploy) accepted it
    again, once, for as long as its ``created`` was within the signature window."""
    embedded = settings.model_copy(update={"redis": RedisSettings(url=None, prefix=settings.redis.prefix)})
    assert embedded.redis_url is None
    contributor = new_contributor()
    body = json.dumps({"metrics": {"gpu_util": 0.5}}).encode()
    signed = [
        *sign_headers(contributor.node_key, method="POST", url=BASE + HEARTBEAT, body=body).items(),
        ("content-type", "application/json"),
    ]
    for process in ("first", "after a restart"):
        app = create_app(embedded, clock=clock)
        async with (
            LifespanManager(app) as manager,
            httpx.AsyncClient(transport=httpx.ASGITransport(app=manager.app), base_url=BASE) as client,
        ):
            if process == "first":
                await contributor.register(client)
                r = await client.post(HEARTBEAT, content=body, headers=signed)
                assert r.status_code == 200, r.text
                problem(await client.post(HEARTBEAT, content=body, headers=signed), 401, "nonce_replayed")
            else:
                clock.advance(5)  # a quick restart, well within the 300 s window
                problem(await client.post(HEARTBEAT, content=body, headers=signed), 401, "nonce_replayed")
                # A request signed afresh by the same node is served.
                fresh = sign_headers(contributor.node_key, method="POST", url=BASE + HEARTBEAT, body=body)
                r = await client.post(
                    HEARTBEAT, content=body, headers={**fresh, "content-type": "application/json"}
                )
                assert r.status_code == 200, r.text


async def _rows(app_state: Any) -> int:
    async with app_state.sessionmaker() as session:
        return int(await session.scalar(select(func.count()).select_from(SpentNonce)) or 0)


async def test_a_nonce_is_spent_until_its_ttl_and_expired_ones_are_pruned(app: Any, app_state: Any) -> None:
    ledger = NonceLedger(app_state.engine)
    at = dt.datetime(2026, 12, 4, 12, tzinfo=dt.UTC)
    assert await ledger.claim("key-a", "nonce-0001", 601, at)
    assert not await ledger.claim("key-a", "nonce-0001", 601, at + dt.timedelta(seconds=600))
    # The same nonce of another key, and another nonce of the same key, are their own.
    assert await ledger.claim("key-b", "nonce-0001", 601, at)
    assert await ledger.claim("key-a", "nonce-0002", 601, at)
    # Once its TTL is over, the nonce may be claimed again (its signature is long stale).
    assert await ledger.claim("key-a", "nonce-0001", 601, at + dt.timedelta(seconds=601))
    assert await _rows(app_state) == 3
    # A later claim (past the prune interval) deletes the rows whose TTL is over.
    ledger._pruned_at = float("-inf")
    assert await ledger.claim("key-c", "nonce-0001", 601, at + dt.timedelta(seconds=700))
    assert await _rows(app_state) == 2  # key-a's nonce-0001 (claimed again) and key-c's


ME = "/v1/nodes/me"


@asynccontextmanager
async def embedded_process(
    settings: Settings, clock: FakeClock, **limits: Any
) -> AsyncIterator[httpx.AsyncClient]:
    """An API process of the embedded default (its own in-process hot store), as a client
    (``client.state``: its ``AppState``). Its connections wait 0.2 s for a lock (SQLite's busy
    timeout, PostgreSQL's lock_timeout) instead of 30 s (or for ever), so a claim of a nonce that
    cannot take its lock fails as it does under a long writer."""
    embedded = settings.model_copy(
        update={
            "redis": RedisSettings(url=None, prefix=settings.redis.prefix),
            "limits": LimitSettings(**limits),
        }
    )
    app = create_app(embedded, clock=clock, serving_marks=False, close_scoring=False)
    async with (
        LifespanManager(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE) as client,
    ):
        _short_lock_waits(app.state.orch.engine)
        client.state = app.state.orch  # type: ignore[attr-defined]
        yield client


def _short_lock_waits(engine: AsyncEngine) -> None:
    sqlite = engine.dialect.name == "sqlite"

    def shorten(dbapi_conn: Any, _record: Any, _proxy: Any) -> None:
        cursor = dbapi_conn.cursor()
        cursor.execute("PRAGMA busy_timeout=200" if sqlite else "SET lock_timeout = '200ms'")
        cursor.close()

    event.listen(engine.sync_engine, "checkout", shorten)  # each connection, as it is taken


@asynccontextmanager
async def nonce_writes_held(engine: AsyncEngine) -> AsyncIterator[None]:
    """Another transaction holds what recording a nonce needs: SQLite's one write lock (as the
    verifier's tick or any long writer does), or ``spent_nonces`` in SHARE mode on PostgreSQL."""
    async with engine.connect() as holder:
        await holder.begin()  # on SQLite: BEGIN IMMEDIATE, the write lock
        if engine.dialect.name != "sqlite":
            await holder.execute(text("LOCK TABLE spent_nonces IN SHARE MODE"))
        try:
            yield
        finally:
            await holder.rollback()


async def test_a_request_refused_503_because_its_nonce_was_not_recorded_can_be_sent_again(
    settings: Settings, clock: FakeClock
) -> None:
    """The in-process store spent the nonce before its row in ``spent_nonces`` was written, in a
    transaction of its own before the request's: when that write failed (503 transient_conflict,
    the database locked past its wait), the request had done nothing, yet the same signed request
    sent again was refused 401 nonce_replayed by the process's memory. Now it is served, once:
    sent twice at once, one copy is served and the other refused as a replay, as it is after a
    restart; neither the 503 nor the replay counts toward the key's limit."""
    sent: dict[str, str] = {}
    async with embedded_process(settings, clock, signed_per_key=2, signed_window_s=10) as client:
        c = new_contributor()
        await c.register(client)
        assert (await client.get(ME, auth=c.node_auth)).status_code == 200  # the key is known
        state = client.state  # type: ignore[attr-defined]
        rows = await _rows(state)
        clock.advance(10 - clock.now() % 10 + 0.5)  # a window of the key's limit of its own
        sent = sign_headers(c.node_key, method="GET", url=BASE + ME)
        async with nonce_writes_held(state.engine):
            problem(await client.get(ME, headers=sent), 503, "transient_conflict")
        assert await _rows(state) == rows

        answers = await asyncio.gather(client.get(ME, headers=sent), client.get(ME, headers=sent))
        assert sorted(r.status_code for r in answers) == [200, 401], [r.text for r in answers]
        problem(next(r for r in answers if r.status_code == 401), 401, "nonce_replayed")
        assert await _rows(state) == rows + 1
        # The key's limit (2 in the window) counted the one served, and one more is served.
        assert (await client.get(ME, auth=c.node_auth)).status_code == 200
        problem(await client.get(ME, auth=c.node_auth), 429, "rate_limited")
    async with embedded_process(settings, clock) as client:
        problem(await client.get(ME, headers=sent), 401, "nonce_replayed")  # after a restart too


async def test_a_registration_replayed_after_a_restart_does_not_count_toward_the_keys_limit(
    settings: Settings, clock: FakeClock
) -> None:
    """The next process's memory has not seen the nonce; ``spent_nonces`` has, and refuses the
    replay, which then counts toward nothing there: the key registers with a good attestation.
    Before, the replay took the key's one registration of the window."""
    c = new_contributor()
    forged = json.dumps(c.node_body(attestation=attest_node(generate_key(), c.node_id))).encode()
    captured: dict[str, str] = {}
    async with embedded_process(settings, clock, registration_per_key=1) as client:
        assert (await client.post("/v1/providers", json={}, auth=c.provider_auth)).status_code == 201
        clock.advance(60 - clock.now() % 60 + 1)  # a window of the registration limit of its own
        captured = {
            **sign_headers(c.node_key, method="POST", url=BASE + "/v1/nodes", body=forged),
            "content-type": "application/json",
        }
        problem(await client.post("/v1/nodes", content=forged, headers=captured), 403, "attestation_invalid")
    async with embedded_process(settings, clock, registration_per_key=1) as client:
        problem(await client.post("/v1/nodes", content=forged, headers=captured), 401, "nonce_replayed")
        r = await client.post("/v1/nodes", json=c.node_body(), auth=SignatureAuth(c.node_key))
        assert r.status_code == 201, r.text
