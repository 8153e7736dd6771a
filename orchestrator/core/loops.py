"""Background loops: run a tick at every interval boundary, once across all processes."""

from __future__ import annotations

import asyncio
import contextlib
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
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task
    return bool(pending)
