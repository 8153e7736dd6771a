"""Spent nonces outlive an API process whose hot store is its own (the embedded default): a
signed request seen before a restart is still a replay after it (``core.nonces``)."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import httpx
from asgi_lifespan import LifespanManager
from sqlalchemy import func, select

from orchestrator.app import create_app
from orchestrator.core.clock import FakeClock
from orchestrator.core.nonces import NonceLedger, SpentNonce
from orchestrator.core.signing import sign_headers
from orchestrator.settings import RedisSettings, Settings
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
