"""Background loops: run a tick at every interval boundary, once across all processes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
from collections.abc import Awaitable, Callable, Sequence

import structlog

from orchestrator.core import metrics
from orchestrator.core.errors import HOT_STORE_UNAVAILABLE, database_unavailable
from orchestrator.core.state import AppState

log = structlog.get_logger(__name__)


async def run_periodically(
    state: AppState,
    name: str,
    interval_s: float,
    tick: Callable[[AppState], Awaitable[object]],
    stop: asyncio.Event,
    *,
    more_pause_s: float = 0.0,
) -> None:
    """Call ``tick(state)`` at each multiple of ``interval_s`` until ``stop`` is set.

    ``tick`` claims its own tick number (``core.ticks.claim_tick``); an error is logged and the
    loop goes on, so one bad tick never stops liveness or payouts. A tick that returns a result
    whose ``more`` is True (the verifier's, stopped by its time budget with work left) is
    followed by the next after ``more_pause_s``, not at the next multiple: a backlog is worked
    without waiting for the next second. On SQLite (``more_pause_s`` from ``pause_after_more``)
    that pause is what lets the claims, results and beats queued behind the one write lock in:
    SQLite's busy handler retries a waiting transaction only every 100 ms, so a loop that ticked
    back to back took the lock again before they woke and held them for seconds.
    """
    while not stop.is_set():
        more = False
        try:
            more = getattr(await tick(state), "more", False) is True
        except Exception as exc:
            tick_failed(name, exc)
        if more:
            if more_pause_s <= 0:
                await asyncio.sleep(0)  # let the stop, and everything else, in between
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=more_pause_s)
            continue
        delay = interval_s - (state.clock.now() % interval_s) + 0.05
        try:
            await asyncio.wait_for(stop.wait(), timeout=delay)
        except TimeoutError:
            pass


#: SQLite: the pause after a tick that says ``more`` (``run_periodically``), four times the busy
#: handler's longest sleep between retries (100 ms), so that the transactions waiting for the
#: write lock all get it while the verifier holds none. With 0.2 s, on 2 cores, workers' claims
#: and results still waited 1.5-2x as long at p99 as when the loop slept till the next second;
#: with 0.4 s as long, and the verifier still decides about a quarter more (benchmarks/RESULTS.md).
SQLITE_MORE_PAUSE_S = 0.4


def pause_after_more(state: AppState) -> float:
    """The pause after a tick that says ``more``: none on PostgreSQL (row locks, no one write
    lock to share), ``SQLITE_MORE_PAUSE_S`` on SQLite."""
    return SQLITE_MORE_PAUSE_S if state.settings.db.is_sqlite else 0.0


def tick_failed(loop: str, exc: Exception, **fields: str) -> None:
    """Log a failed tick (or part of one) and count it by cause
    (``orchestrator_loop_tick_failures_total``). An outage is one line a tick, not the same
    traceback each time; any other failure keeps its traceback."""
    if _unreachable(exc):
        log.warning("background_tick_unavailable", loop=loop, error=f"{type(exc).__name__}: {exc}", **fields)
        metrics.LOOP_TICK_FAILURES.labels(loop, "unavailable").inc()
    else:
        log.exception("background_tick_failed", loop=loop, **fields)  # called in the except block
        metrics.LOOP_TICK_FAILURES.labels(loop, "error").inc()


def _unreachable(exc: BaseException) -> bool:
    """Whether the tick failed because Redis or the database could not be reached (or Redis
    refused to write)."""
    return isinstance(exc, HOT_STORE_UNAVAILABLE) or database_unavailable(exc)


#: How long a stopping process lets a tick under way finish before it cancels it.
STOP_GRACE_S = 5.0


async def stop_loops(
    tasks: Sequence[asyncio.Task[None]], stop: asyncio.Event, *, grace_s: float = STOP_GRACE_S
) -> bool:
    """Set ``stop`` and wait for the loops: a tick under way gets ``grace_s`` to finish, then
    it is cancelled, so a stop is prompt whatever the tick waits for (a verifier batch scoring
    results one after the other, each up to ``reward_timeout_s``, took minutes). A cancelled
    tick loses nothing: its transaction rolls back, and a result it was scoring waits for the
    next verifier. Returns whether a tick was cancelled."""
    stop.set()
    pending: set[asyncio.Task[None]] = set()
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=grace_s)
    for task in pending:
        log.warning("background_tick_cancelled", loop=task.get_name(), grace_s=grace_s)
        task.cancel()
    stuck: set[asyncio.Task[None]] = set()
    if pending:
        _, stuck = await asyncio.wait(pending, timeout=CANCEL_WAIT_S)
    for task in stuck:
        # Its rollback waits behind a statement that cannot be interrupted (see CANCEL_WAIT_S):
        # left to end with the process.
        log.warning("background_tick_stuck", loop=task.get_name(), waited_s=CANCEL_WAIT_S)
    for task in tasks:
        if task not in stuck:
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return bool(pending)


#: How long ``stop_loops`` waits for a cancelled tick to end (its rollback takes milliseconds),
#: and how long a stopping process lets what is still under way after its cleanup run
#: (``exit_within``). What outlasts them waits for the database's write lock, which another
#: process holds (the ``sqlite3`` shell in a transaction, an ``orchestrator admin`` command on
#: the same file): SQLite's busy handler, in the connection's thread, waits up to the busy timeout
#: (30 s) and neither a cancel nor ``sqlite3.Connection.interrupt()`` ends that wait; the
#: cancelled tick's (or request's) rollback is queued behind it, and the process waited for
#: each, 20-35 s after SIGTERM.
CANCEL_WAIT_S = 1.0


def exit_within(seconds: float = CANCEL_WAIT_S) -> threading.Timer:
    """End this process ``seconds`` from now if it is still running (a daemon timer, so a process
    that exits meanwhile does not wait for it). For a process whose cleanup is done: what is
    left waits for another process's write lock (``CANCEL_WAIT_S``) and holds nothing; ending
    the process then is what a SIGKILL does, which SQLite's and PostgreSQL's commits are
    atomic against. Not for the tests' in-process apps."""

    def _exit() -> None:
        log.warning("exit_forced", waited_s=seconds, reason="tasks still waiting after the stop")
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(1)

    timer = threading.Timer(seconds, _exit)
    timer.daemon = True
    timer.start()
    return timer
