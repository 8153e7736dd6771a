"""Process-wide resources, made in the FastAPI lifespan and closed there."""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import random
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Annotated, cast

from fastapi import Depends, Request
from sqlalchemy import event
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from orchestrator.core.clock import Clock, SystemClock
from orchestrator.core.db import autocommit, make_engine, make_sessionmaker, run_after_commit
from orchestrator.core.hotstore import HotStore, make_hot_store
from orchestrator.core.nonces import NonceLedger
from orchestrator.settings import Settings


@dataclass
class AppState:
    settings: Settings
    engine: AsyncEngine
    sessionmaker: async_sessionmaker[AsyncSession]
    hot_store: HotStore
    clock: Clock
    # The audit draws' random source: unpredictable to workers (tests pass a seeded Random).
    rng: random.Random = field(default_factory=random.SystemRandom)
    instance_id: str = field(default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}")
    # Single reads outside a transaction (autocommit on PostgreSQL; the same pool as ``engine``).
    reader: AsyncEngine = field(init=False)
    # (kind, key id) of the signing keys this process has read as registered: a signed request of
    # an unregistered key is refused before it writes to the hot store (``identity.auth``).
    known_keys: set[tuple[str, str]] = field(default_factory=set)
    # The last value this process logged of a condition that lasts (``changed``).
    logged: dict[str, object] = field(default_factory=dict)
    # Whether this process writes the serving marks (an API process), when it last wrote one (on
    # ``clock``), and the lock of a request that writes one first (``liveness.serving.caught_up``).
    marking: bool = False
    marked_at: float | None = None
    mark_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Per loop, the first and the last time it read the serving marks as abandoned, in an
    # unbroken series of reads (``liveness.serving.read_serving``).
    marks_missing: dict[str, tuple[float, float]] = field(default_factory=dict)
    # The read of the database's gauges a /metrics scrape started and others wait for
    # (``core.health``): one at a time per process.
    gauges_read: asyncio.Future[None] | None = None
    # Per verifier partition, when (``clock.monotonic()``) one of this process's batches there last
    # left a result undecided (``verification.jobs.verify_batches``: that partition goes last).
    verifier_failed_at: dict[int, float] = field(default_factory=dict)
    # Per verifier partition (None: SQLite's one backlog), the job id after which this process's
    # next batches go on, where its last tick ran out of budget (``verification.jobs``).
    verifier_resume: dict[int | None, int] = field(default_factory=dict)
    # Per verification job whose reward function was unavailable, when (the clock's UTC) this
    # process may score it again, and the wait that led there (``verification.service.Retry``).
    reward_backoff: dict[int, tuple[dt.datetime, float]] = field(default_factory=dict)
    # Spent nonces in the database, when the hot store is this process's own (``core.nonces``).
    spent_nonces: NonceLedger | None = field(init=False)

    def __post_init__(self) -> None:
        self.reader = autocommit(self.engine)
        self.spent_nonces = None if self.hot_store.shared_across_processes else NonceLedger(self.engine)

    def changed(self, condition: str, value: object) -> bool:
        """Whether ``condition`` now has another ``value`` than when this process last asked,
        remembering it (a condition not asked of before is None, the normal case). A condition
        that lasts (the sweeper held, the serving marks abandoned) is so logged when it begins
        and when it ends, not on every tick it lasts."""
        if self.logged.get(condition) == value:
            return False
        self.logged[condition] = value
        return True


def open_state(
    settings: Settings, *, clock: Clock | None = None, hot_store: HotStore | None = None
) -> AppState:
    """A process's resources from its settings (the caller closes the engine and its own store)."""
    engine = make_engine(settings.db)
    return AppState(
        settings=settings,
        engine=engine,
        sessionmaker=make_sessionmaker(engine),
        hot_store=hot_store or make_hot_store(settings.redis_url, settings.redis),
        clock=clock or SystemClock(),
    )


def app_state(request: Request) -> AppState:
    return cast(AppState, request.app.state.orch)


async def get_state(request: Request) -> AppState:
    """The dependency (async: FastAPI runs a plain ``def`` dependency in a worker thread)."""
    return app_state(request)


State = Annotated[AppState, Depends(get_state)]


_TRANSACTION_CHECKS = "orchestrator.transaction_checks"
TransactionCheck = Callable[[Connection], None]


def check_in_transaction(request: Request, check: TransactionCheck, *, before_others: bool = False) -> None:
    """Have ``check(connection)`` run first in the request's transaction (``get_session``), once
    it begins (on the session's first statement): for what a guard read before it and a change
    committed since may have made untrue (a bearer token revoked while the request waited for a
    lock). Lazily: a handler may first do work in transactions of its own (on SQLite the
    request's transaction holds the database's one write lock from its start). Checks run in the
    order registered; ``before_others`` puts this one first (a handler that must take locks in an
    order of its own before the guards' locks: ``admin.tokens.lock_own_and_target``)."""
    checks = request.scope.setdefault(_TRANSACTION_CHECKS, [])
    if before_others:
        checks.insert(0, check)
    else:
        checks.append(check)


async def get_session(request: Request) -> AsyncIterator[AsyncSession]:
    """The request's one transaction: the checks ``check_in_transaction`` registered, then the
    handler's statements; committed after it, rolled back on error; then what the handler
    queued with ``db.after_commit``."""
    state = app_state(request)
    async with state.sessionmaker() as session:
        checks: list[TransactionCheck] = request.scope.get(_TRANSACTION_CHECKS, [])
        if checks:

            def run_checks(_session: object, _transaction: object, connection: Connection) -> None:
                for check in checks:
                    check(connection)

            event.listen(session.sync_session, "after_begin", run_checks, once=True)
        async with session.begin():
            yield session
        await run_after_commit(session)


# scope="function": commit before the response is sent, so a failed commit is never reported as success.
Session = Annotated[AsyncSession, Depends(get_session, scope="function")]
