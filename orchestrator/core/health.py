"""/healthz (the process is up), /readyz (database and hot store reachable), /metrics."""

from __future__ import annotations

import asyncio
import datetime as dt
import math

import structlog
from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from sqlalchemy import Integer, text

from orchestrator import background
from orchestrator.core import metrics
from orchestrator.core.db import UTCDateTime, utcnow
from orchestrator.core.errors import database_unavailable
from orchestrator.core.routing import GuardedRoute
from orchestrator.core.state import State
from orchestrator.identity import repository as identity_repo
from orchestrator.identity.models import NODE_STATUSES
from orchestrator.pools import repository as pools_repo

log = structlog.get_logger(__name__)

router = APIRouter(tags=["operations"], route_class=GuardedRoute)


@router.get("/healthz", summary="Liveness: the process answers")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


async def _check_db(state: State) -> None:
    # A deferred transaction on SQLite, which takes no lock: the engine's own BEGIN IMMEDIATE
    # made the probe wait behind any writer for the 30 s busy timeout, and then say the database
    # was unavailable while it was serving.
    async with state.engine.connect() as conn:
        await conn.execution_options(sqlite_deferred=True)
        await conn.execute(text("SELECT 1"))


@router.get(
    "/readyz",
    summary="Readiness: database and hot store reachable (503 otherwise)",
    responses={503: {"description": "A dependency is down", "content": {"application/problem+json": {}}}},
)
async def readyz(state: State) -> JSONResponse:
    checks: dict[str, str] = {}
    for name, probe in (("database", _check_db(state)), ("hot_store", state.hot_store.ping())):
        try:
            # False: the in-process hot store, full, refuses every new signed request.
            answered = await asyncio.wait_for(probe, timeout=3)
            checks[name] = "unavailable: full" if answered is False else "ok"
        except Exception as exc:
            checks[name] = f"unavailable: {type(exc).__name__}"
    ready = all(v == "ok" for v in checks.values())
    body: dict[str, object] = {"status": "ready" if ready else "not_ready", "checks": checks}
    if not ready:
        body.update(
            type="/problems/not_ready",
            title="Service unavailable",
            status=503,
            code="not_ready",
            detail="; ".join(f"{k}: {v}" for k, v in checks.items() if v != "ok"),
        )
        return JSONResponse(body, status_code=503, media_type="application/problem+json")
    return JSONResponse(body)


# The work queue at scrape time. Each count's condition is a partial index's predicate, so it
# visits only the rows it counts (ix_tasks_claimable, ix_assignments_active_expiry,
# ix_verification_jobs_pending, ix_verification_jobs_waiting), however long the history grows.
_QUEUE = text(
    """
    SELECT (SELECT count(*) FROM tasks WHERE status = 'open' AND available_replicas > 0) AS claimable,
           (SELECT count(*) FROM assignments WHERE status = 'active') AS leases,
           (SELECT created_at FROM verification_jobs WHERE stage = 'checks' ORDER BY id LIMIT 1) AS oldest,
           (SELECT min(created_at) FROM verification_jobs WHERE stage = 'validator') AS oldest_validator
    """
).columns(claimable=Integer(), leases=Integer(), oldest=UTCDateTime(), oldest_validator=UTCDateTime())
_WAITING_JOBS = text("SELECT stage, count(*) FROM verification_jobs WHERE stage <> 'done' GROUP BY stage")
_LOOP_RUNS = text("SELECT name, last_run_at FROM background_ticks").columns(last_run_at=UTCDateTime())
WAITING_STAGES = ("checks", "quorum", "validator")


# How long a scrape waits for the database's gauges before it serves the process's own metrics
# without them.
DB_GAUGES_TIMEOUT_S = 3.0


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def prometheus_metrics(state: State) -> Response:
    try:
        await asyncio.wait_for(asyncio.shield(_gauges_read(state)), timeout=DB_GAUGES_TIMEOUT_S)
    except Exception as exc:
        # The request counters need no database: a scrape that failed with it (503) took them
        # away for the whole outage, and the 5xx alert had no data in the very outage that makes
        # every request a 503. The database's gauges keep their last values meanwhile.
        if not (isinstance(exc, asyncio.TimeoutError) or database_unavailable(exc)):
            raise
        metrics.DB_GAUGES_READ.set(0)
        log.warning("metrics_database_unavailable", error=type(exc).__name__)
    payload, content_type = metrics.render()
    return Response(payload, media_type=content_type)


def _gauges_read(state: State) -> asyncio.Future[None]:
    """The read of the database's gauges under way in this process, else a new one. /metrics
    is public: a scrape that comes while a read is under way waits for that one (begun since it
    asked, or a moment before) instead of starting its own, so a flood of scrapes costs one read
    at a time, not one each. A read outlives a scrape that stopped waiting for it (its 3 s
    bound), and the next scrape waits for it in turn."""
    running = state.gauges_read
    if running is None or running.done():
        running = state.gauges_read = asyncio.ensure_future(_read_db_gauges(state))
        # Its failure is each waiting scrape's to handle; with none left waiting, it is dropped.
        running.add_done_callback(lambda done: done.cancelled() or done.exception())
    return running


async def _read_db_gauges(state: State) -> None:
    """Set the gauges read from the database at scrape time (nodes, pools paused for their
    budget, the queue, the loops). On SQLite in a deferred transaction, which takes no lock:
    behind a writer the engine's BEGIN IMMEDIATE waited for its 30 s busy timeout, which the 3 s
    bound cannot cut short."""
    async with state.sessionmaker() as session:
        await session.connection(execution_options={"sqlite_deferred": True})
        counts = await identity_repo.count_by_status(session)
        paused_for_budget = await pools_repo.count_paused_for_budget(session)
        claimable, leases, oldest, oldest_validator = (await session.execute(_QUEUE)).one()
        waiting = {str(stage): int(n) for stage, n in (await session.execute(_WAITING_JOBS)).all()}
        last_runs: dict[str, dt.datetime | None] = {
            str(name): last for name, last in (await session.execute(_LOOP_RUNS)).all()
        }
    metrics.DB_GAUGES_READ.set(1)
    for status in NODE_STATUSES:
        metrics.NODES.labels(status).set(counts.get(status, 0))
    metrics.TASKS_CLAIMABLE.set(claimable)
    metrics.POOLS_PAUSED_FOR_BUDGET.set(paused_for_budget)
    metrics.LEASES_ACTIVE.set(leases)
    for stage in WAITING_STAGES:
        metrics.VERIFICATION_JOBS.labels(stage).set(waiting.get(stage, 0))
    for gauge, since in ((metrics.VERIFICATION_LAG, oldest), (metrics.VALIDATION_LAG, oldest_validator)):
        gauge.set(max(0.0, (state.clock.utcnow() - since).total_seconds()) if since is not None else 0.0)
    # The wall clock, as claim_tick writes last_run_at with it.
    now = utcnow()
    # The loops this version runs only: a row a removed or renamed loop left behind is not one.
    # A run recorded in the future (a clock that ran ahead) counts by how far ahead it is: as 0
    # it hid a loop that was stopped until the clocks caught up with it.
    for name in background.TICK_NAMES:
        last = last_runs.get(name)
        metrics.LOOP_LAST_RUN_AGE.labels(name).set(
            math.inf if last is None else abs((now - last).total_seconds())
        )
