"""The background loops (liveness sweeper and reconciler, reaper, verifier, releases, reward
budgets, ReST^EM barrier) and a process that runs only them.

Every API process runs them by default (``ORCH_SERVER__BACKGROUND_LOOPS=true``); each tick is
claimed once across processes, and the verifier shares its backlog with SKIP LOCKED. A larger
deployment turns them off on the API replicas and runs ``orchestrator background`` instead, so
that verification never waits behind request handling on an API process's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from wsgiref.simple_server import WSGIServer

import structlog

from orchestrator import __version__
from orchestrator.core import metrics
from orchestrator.core.alive import keep_alive
from orchestrator.core.loops import ExitGuard, await_stuck, pause_after_more, run_periodically, stop_loops
from orchestrator.core.state import AppState, open_state
from orchestrator.ledger import jobs as ledger_jobs
from orchestrator.liveness import service as liveness
from orchestrator.liveness import serving
from orchestrator.pools import jobs as pool_jobs
from orchestrator.restem import jobs as restem_jobs
from orchestrator.settings import Settings
from orchestrator.tasks import jobs as task_jobs
from orchestrator.verification import jobs as verification
from orchestrator.verification import scoring

log = structlog.get_logger(__name__)

Tick = Callable[[AppState], Awaitable[object]]


def loops(settings: Settings) -> list[tuple[str, float, Tick]]:
    """(name, interval in seconds, tick) of every background loop. The name is the loop's row in
    ``background_ticks`` (``core.ticks.claim_tick``) and its label in the metrics: /metrics reports
    how long ago each last completed a tick (+Inf for one that never did) and how many failed."""
    return [
        (liveness.SWEEPER, settings.heartbeat.sweep_interval_s, liveness.sweep_once),
        (liveness.RECONCILER, liveness.RECONCILE_INTERVAL_S, liveness.reconcile_once),
        (ledger_jobs.STAKE_RELEASE, ledger_jobs.INTERVAL_S, ledger_jobs.release_once),
        (task_jobs.LEASE_REAPER, task_jobs.INTERVAL_S, task_jobs.reap_once),
        (verification.VERIFIER, verification.VERIFY_INTERVAL_S, verification.verify_once),
        (verification.REWARD_RELEASE, verification.RELEASE_INTERVAL_S, verification.release_once),
        (pool_jobs.REWARD_BUDGET, pool_jobs.INTERVAL_S, pool_jobs.check_budgets_once),
        (restem_jobs.RESTEM_BARRIER, restem_jobs.INTERVAL_S, restem_jobs.advance_once),
    ]


TICK_NAMES = tuple(name for name, _, _ in loops(Settings.model_construct()))
SERVING_MARKS = "serving_marks"

# Every loop's failure counts exist from the start, at 0, so that a rate over them sees the
# first failure (a series that appears at 1 shows no increase).
for _name in (*TICK_NAMES, SERVING_MARKS):
    for _cause in metrics.TICK_FAILURE_CAUSES:
        metrics.LOOP_TICK_FAILURES.labels(_name, _cause)


def start(state: AppState, stop: asyncio.Event) -> list[asyncio.Task[None]]:
    pause = pause_after_more(state)
    return [
        asyncio.create_task(
            run_periodically(state, name, interval, tick, stop, more_pause_s=pause), name=name
        )
        for name, interval, tick in loops(state.settings)
    ]


def start_serving_marks(state: AppState, stop: asyncio.Event) -> asyncio.Task[None]:
    """The API process's mark that it can take beats (``liveness.serving``); not a loop of
    ``orchestrator background``, which takes none."""
    return asyncio.create_task(
        run_periodically(state, SERVING_MARKS, serving.MARK_INTERVAL_S, serving.mark_serving, stop),
        name=SERVING_MARKS,
    )


async def run(
    settings: Settings,
    stop: asyncio.Event | None = None,
    alive_file: Path | None = None,
    metrics_server: WSGIServer | None = None,
    exit_after_stop: bool = False,
) -> None:
    """Run the loops in this process until ``stop`` is set (or SIGINT/SIGTERM arrives); with
    ``alive_file``, keep that file fresh for a liveness probe (``orchestrator alive``); a
    ``metrics_server`` (``core.metrics.serve_background``) is shut down when the loops stop;
    ``exit_after_stop`` (the CLI) bounds the stop (``core.loops.ExitGuard``)."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    handled = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
            handled.append(sig)
    state = open_state(settings)
    engine, store = state.engine, state.hot_store
    tasks = start(state, stop)
    if alive_file is not None:
        tasks.append(asyncio.create_task(keep_alive(alive_file, stop), name="alive-file"))
    log.info("background_started", version=__version__, db=engine.dialect.name, loops=len(tasks))
    try:
        await stop.wait()
    finally:
        guard = ExitGuard() if exit_after_stop else None
        stopped = await stop_loops(tasks, stop)
        if stopped.cancelled:
            await asyncio.to_thread(scoring.close_pools)  # a cancelled verifier's busy scorer
        if metrics_server is not None:
            await asyncio.to_thread(metrics_server.shutdown)
            metrics_server.server_close()
        await store.aclose()
        await engine.dispose()
        for sig in handled:
            loop.remove_signal_handler(sig)
        log.info("background_stopped")
        if guard is not None:  # the CLI's process: what a cancelled tick left waiting ends with it
            guard.cleaned_up(stuck=bool(stopped.stuck))
        await await_stuck(stopped.stuck)
