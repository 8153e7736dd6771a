"""Waiting for what a test needs to have happened, instead of sleeping and hoping it has.

A concurrency test lets one side take a lock and checks that the other side waits for it. A
sleep between them ("the request now waits for the row") assumes how fast the machine is: on a
loaded one the other side had not reached the lock yet, and the test failed or passed without
testing the race. ``until_waiting`` asks PostgreSQL instead: it returns once the sessions the
test expects are waiting for a lock, or as soon as one of the watched tasks is done (it did not
wait, which the test's own assertions then catch). ``HANG_S`` is only a bound on a hang.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import text

from orchestrator.core.clock import FakeClock

#: How long a test waits for something that happens at once unless the code under test waits
#: for what the test holds: a bound on a hang, not a measure of speed.
HANG_S = 60.0

#: pg_stat_activity.wait_event of a session waiting for a lock, by what it waits for.
LOCK_EVENTS = {
    "row": ("transactionid", "tuple"),
    "table": ("relation",),
    "advisory": ("advisory",),
}


async def sessions_waiting(app_state: Any, on: str | None = None) -> int:
    """How many sessions of the test's database wait for a lock (of kind ``on``, or any)."""
    sql = (
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE datname = current_database() AND wait_event_type = 'Lock'"
    )
    params: dict[str, Any] = {}
    if on is not None:
        sql += " AND wait_event = ANY(:events)"
        params["events"] = list(LOCK_EVENTS[on])
    # A transaction of its own each time: PostgreSQL reads pg_stat_activity once per
    # transaction, so polling in one would see the first look's state for ever.
    async with app_state.sessionmaker() as session:
        return int(await session.scalar(text(sql), params) or 0)


async def until_waiting(
    app_state: Any, count: int = 1, *watched: asyncio.Future[Any], on: str | None = None
) -> None:
    """Return once ``count`` sessions wait for a lock (of kind ``on``: "row", "table",
    "advisory"; any kind by default), or once one of ``watched`` is done."""
    until = time.monotonic() + HANG_S
    while await sessions_waiting(app_state, on) < count and not any(w.done() for w in watched):
        assert time.monotonic() < until, f"{count} session(s) never waited for a lock"
        await asyncio.sleep(0.02)


async def until_blocked_by(app_state: Any, pid: int, *watched: asyncio.Future[Any]) -> None:
    """Return once a session waits for a lock that the session with backend ``pid`` holds (or
    once one of ``watched`` is done): a session that waited for another lock first is past it."""
    sql = (
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE datname = current_database() AND CAST(:pid AS integer) = ANY(pg_blocking_pids(pid))"
    )
    until = time.monotonic() + HANG_S
    while not any(w.done() for w in watched):
        async with app_state.sessionmaker() as session:  # a fresh look each time, as above
            if int(await session.scalar(text(sql), {"pid": pid}) or 0) > 0:
                return
        assert time.monotonic() < until, f"no session ever waited for session {pid}"
        await asyncio.sleep(0.02)


async def until(condition: Callable[[], bool], what: str) -> None:
    """Return once ``condition()`` holds (checked every 10 ms; ``what`` names it on a hang)."""
    deadline = time.monotonic() + HANG_S
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        await asyncio.sleep(0.01)


def taking(
    monkeypatch: pytest.MonkeyPatch, owner: object, name: str, clock: FakeClock, seconds: float
) -> None:
    """Make ``owner.name`` (a coroutine function a loop's batch calls) take ``seconds`` on the
    app's clock: a tick whose budget is measured there runs out after as many batches as the
    test chooses, however fast the machine is."""
    real = getattr(owner, name)

    async def slow(*args: Any, **kwargs: Any) -> Any:
        done = await real(*args, **kwargs)
        clock.advance(seconds)
        return done

    monkeypatch.setattr(owner, name, slow)


def sqlite_write_lock_held(app_state: Any) -> bool:
    """Whether a transaction holds SQLite's one write lock (every claim and result waits for
    it), as another connection finds it without waiting."""
    import sqlite3

    from sqlalchemy.engine import make_url

    probe = sqlite3.connect(make_url(app_state.settings.db.url).database, timeout=0, isolation_level=None)
    try:
        probe.execute("BEGIN IMMEDIATE")
        probe.execute("ROLLBACK")
        return False
    except sqlite3.OperationalError:
        return True
    finally:
        probe.close()
