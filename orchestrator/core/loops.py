"""Background loops: run a tick at every interval boundary, once across all processes."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import json
import os
import select
import sys
import threading
from collections.abc import Awaitable, Callable, Collection, Sequence

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


@dataclasses.dataclass(frozen=True)
class LoopsStopped:
    """What ``stop_loops`` found: whether it cancelled a tick, and the cancelled ticks that had
    still not ended ``CANCEL_WAIT_S`` later (``await_stuck``)."""

    cancelled: bool
    stuck: frozenset[asyncio.Task[None]]


async def stop_loops(
    tasks: Sequence[asyncio.Task[None]], stop: asyncio.Event, *, grace_s: float = STOP_GRACE_S
) -> LoopsStopped:
    """Set ``stop`` and wait for the loops: a tick under way gets ``grace_s`` to finish, then
    it is cancelled, so a stop is prompt whatever the tick waits for (a verifier batch scoring
    results one after the other, each up to ``reward_timeout_s``, took minutes). A cancelled
    tick loses nothing: its transaction rolls back, and a result it was scoring waits for the
    next verifier. A cancelled tick still running ``CANCEL_WAIT_S`` later is stuck (see there):
    it is returned, for the caller to finish its own cleanup first and then ``await_stuck``."""
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
        # Its rollback waits behind a statement that cannot be interrupted (see CANCEL_WAIT_S).
        log.warning("background_tick_stuck", loop=task.get_name(), waited_s=CANCEL_WAIT_S)
    for task in tasks:
        if task not in stuck:
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return LoopsStopped(cancelled=bool(pending), stuck=frozenset(stuck))


async def await_stuck(stuck: Collection[asyncio.Task[None]]) -> None:
    """The last step of a stop, after the rest of its cleanup: wait for the ticks ``stop_loops``
    found stuck to end (their rollbacks wait for another process's write lock, at most SQLite's
    busy timeout), so that none is left pending when the event loop closes: asyncio warned "Task
    was destroyed but it is pending" for one left behind. A CLI process does not wait that long:
    its ``ExitGuard`` ends it ``CANCEL_WAIT_S`` after its cleanup, and exit status 0, meanwhile."""
    if not stuck:
        return
    log.warning("stop_awaiting_stuck_ticks", loops=sorted(task.get_name() for task in stuck))
    await asyncio.wait(stuck)
    for task in stuck:
        if not task.cancelled():
            task.exception()  # retrieved: run_periodically logs its ticks' own errors


#: How long a stopping process lets what is still under way after its cleanup run
#: (``ExitGuard``). What outlasts it waits for the database's write lock, which another
#: process holds (the ``sqlite3`` shell in a transaction, an ``orchestrator admin`` command on
#: the same file): SQLite's busy handler, in the connection's thread, waits up to the busy timeout
#: (30 s) and neither a cancel nor ``sqlite3.Connection.interrupt()`` ends that wait; the
#: cancelled tick's (or request's) rollback is queued behind it, and the process waited for
#: each, 20-35 s after SIGTERM. Also how long ``stop_loops`` waits for a cancelled tick to end
#: (its rollback takes milliseconds) before it calls it stuck.
CANCEL_WAIT_S = 1.0

#: The most a CLI process's stop may take from the start of its cleanup (``ExitGuard``): the
#: loops' grace, the wait for the ticks it cancels, and 9 s for the rest of the cleanup and the
#: interpreter's own exit (executor threads, atexit handlers), which take well under a second
#: when nothing is stuck. ``serve`` begins its cleanup after the requests' 5 s grace
#: (cli.SHUTDOWN_GRACE_S): 20 s after SIGTERM at most, within the Kubernetes manifests' 25 s
#: (and ``LAST_WORDS_S`` more if the ``exit_forced`` line cannot be written).
EXIT_BOUND_S = STOP_GRACE_S + CANCEL_WAIT_S + 9.0


class ExitGuard:
    """Ends a CLI process (``serve``, ``background``) whose stop does not end it. Armed when its
    cleanup starts: if the process still runs ``EXIT_BOUND_S`` later, it ends with ``exit_forced``;
    once the cleanup is done (``cleaned_up``) and a tick was stuck, it ends ``CANCEL_WAIT_S``
    later already, since what is left then only waits for another process's lock.

    The exit status says whether the service's own stop completed. 0 once the cleanup is done
    (loops stopped, scoring processes, hot store and database connections closed, instance lock
    released): what still runs then holds nothing (a rollback waiting for a lock has begun
    nothing, a reward function's thread only computes), and ending it is what a SIGKILL does,
    which SQLite's and PostgreSQL's commits are atomic against. 1 if the cleanup itself had not
    completed within the bound: something the stop needs hung (a database or Redis that stopped
    answering). Before, the process was ended with status 1 one second after its cleanup
    whatever was running, a slow but sound exit (an atexit handler, a thread finishing) too.
    Not for the tests' in-process apps."""

    def __init__(self, seconds: float = EXIT_BOUND_S) -> None:
        self._done = False
        self._timer: threading.Timer | None = None
        self._arm(seconds, "stop_bound")

    def _arm(self, seconds: float, reason: str) -> None:
        if self._timer is not None:
            self._timer.cancel()
        # A daemon timer: a process that exits meanwhile does not wait for it.
        self._timer = threading.Timer(seconds, self._exit, args=(seconds, reason))
        self._timer.daemon = True
        self._timer.start()

    def cleaned_up(self, stuck: bool) -> None:
        """The cleanup is done; ``stuck``: a tick is known to wait still (``stop_loops``)."""
        self._done = True
        if stuck:
            self._arm(CANCEL_WAIT_S, "ticks_stuck")

    def _exit(self, waited_s: float, reason: str) -> None:
        status = 0 if self._done else 1
        said = {"waited_s": waited_s, "reason": reason, "cleanup_done": self._done, "status": status}
        # The log line and the flushes can block for good: on a stdout that is a pipe nobody
        # reads any more (a log shipper that hung), or on the stream's lock, which a thread
        # blocked so holds. They get LAST_WORDS_S in a thread of their own, and the process ends
        # whether they are done or not (before, the guard itself hung there, and the process
        # with it). If they are not, the line goes to stderr only if that can take it at once.
        words = threading.Thread(target=_last_words, args=(said,), name="exit-forced-log", daemon=True)
        words.start()
        words.join(LAST_WORDS_S)
        if words.is_alive():
            now = dt.datetime.now(dt.UTC).isoformat()
            _say_if_writable(
                2, {"event": "exit_forced", "level": "warning", "timestamp": now, **said, "log_blocked": True}
            )
        os._exit(status)


#: How long a forced exit waits for its log line and the streams' flushes (``ExitGuard``).
LAST_WORDS_S = 1.0


def _last_words(said: dict[str, object]) -> None:
    log.warning("exit_forced", **said)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def _say_if_writable(fd: int, event: dict[str, object]) -> None:
    """Write ``event`` as one JSON line to ``fd`` only if that cannot block: the descriptor polls
    writable now and the line is shorter than PIPE_BUF (a pipe with room for PIPE_BUF bytes
    takes such a write whole, at once). The descriptor's flags are left alone: O_NONBLOCK
    would be set on a file description that the parent process may share (its terminal)."""
    line = (json.dumps(event, default=str) + "\n").encode()
    with contextlib.suppress(Exception):
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        if len(line) < select.PIPE_BUF and poller.poll(0):
            os.write(fd, line)
