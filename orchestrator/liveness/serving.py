"""When the service could take heartbeats: the sweeper judges a node's silence only by then.

Every API process (``orchestrator serve``, whatever its ``background_loops``) writes, every
``MARK_INTERVAL_S``, once it has reached both the hot store (taking a write) and the database,
the time into one row of ``serving_marks``: ``at``, the last such mark of any process, and
``since``, when the current unbroken run of marks began (a mark later than ``STALL_S`` after the
one before it starts a new run). A node's silence then counts only from ``since``: the sweeper
treats a node last seen before ``since`` as last seen at ``since``, and moves no node at all
while the last mark is older than ``STALL_S`` (nothing could take a beat: the database or Redis
down or refusing writes, every API process down or blocked). So an outage, however long, marks
no node dead at the return; a node that does not beat again dies ``dead_after_s`` after it, as
the reconciler treats a node the hot store lost. The mark that starts a run also gives the
leases live when the outage began its length (``tasks.service.extend_leases_over_outage``; those
claimed after the last mark before it, the part after their claim), and the reaper expires none
while the last mark is stale: a lease outlives an outage of any length. The requests that judge
leases write a mark first when their process's own is stale (``caught_up``), so none answers by
the deadlines of before the outage in the seconds before the marks loop's next tick.

The processes' clocks must agree: beats and marks are timed by the API processes' clocks and
judged by the sweeper's. On PostgreSQL each mark and each sweep also compares its process's
clock with the database server's (``check_clock``), and says so (``clock_skew``, once a minute)
while they differ by more than ``CLOCK_SKEW_WARN_S``.

What no mark can see is an outage in front of the API processes (a load balancer down, a
partition between the workers and the service): the processes keep marking while no beat
reaches them.

Without a row (no API process of this version has run against the database: a fresh install,
or tests that drive the sweeper alone), or with one no process has written for ``ABANDONED_S``,
the sweeper judges silence as before.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

import structlog
from fastapi import Request
from sqlalchemy import Double, String, select, text, update
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Mapped, mapped_column

from orchestrator.core import metrics
from orchestrator.core.clock import CLOCK_SKEW_WARN_S, SystemClock
from orchestrator.core.db import Base
from orchestrator.core.sql import insert_ignore, is_postgres
from orchestrator.core.state import AppState, app_state
from orchestrator.tasks.service import extend_leases_over_outage

__all__ = [
    "CLOCK_SKEW_WARN_S",
    "MARK_INTERVAL_S",
    "STALL_S",
    "Serving",
    "ServingMark",
    "caught_up",
    "check_clock",
    "leases_caught_up",
    "mark_serving",
    "read_serving",
]

MARK_INTERVAL_S = 5.0
# Three missed marks: a mark delayed by a slow database or a busy event loop does not count as
# an outage; one that does only delays the sweeper (the safe side).
STALL_S = 3 * MARK_INTERVAL_S
MARK = "beats"
# Marks older than this are taken as abandoned (every API process gone, or of a version that
# writes none, while the loops run on): silence is then judged as without marks, so a row
# nobody writes any more never holds the sweeper and the reaper for ever. But only by a loop
# that has itself seen them missing for ``ABANDONED_CONFIRM_S``, in reads at most
# ``MISSING_READ_GAP_S`` apart with the hot store answering: after an outage of the database
# (or of everything) longer than an hour, the loops' first ticks at the return found marks as
# old before any API process was back to write one, and judged every node silent through the
# outage as stopped (all dead, their leases expired).
ABANDONED_S = 3600.0
ABANDONED_CONFIRM_S = 300.0
MISSING_READ_GAP_S = 60.0

# A sweeper whose clock runs ``STALL_S`` ahead of the API processes' sees every mark as stale and
# holds for ever: past ``CLOCK_SKEW_WARN_S`` from the database server's clock a process says so.
_DB_NOW = text("SELECT extract(epoch FROM clock_timestamp())")

log = structlog.get_logger(__name__)


class ServingMark(Base):
    __tablename__ = "serving_marks"

    name: Mapped[str] = mapped_column(String(32), primary_key=True)
    at: Mapped[float] = mapped_column(Double)
    since: Mapped[float] = mapped_column(Double)


async def mark_serving(state: AppState) -> bool:
    """Record that this process can take beats now; False (nothing written) if the hot store
    does not answer. A database that does not answer raises, as for any loop's tick."""
    if not await state.hot_store.ping():
        return False
    now = state.clock.now()
    query = select(ServingMark.at).where(ServingMark.name == MARK).with_for_update()
    async with state.sessionmaker() as session, session.begin():
        await check_clock(state, session)
        last = (await session.execute(query)).scalar_one_or_none()
        if last is None:  # the first mark ever, unless another process's is just ahead of it
            if await insert_ignore(session, ServingMark, {"name": MARK, "at": now, "since": now}):
                state.marked_at = now
                return True
            last = (await session.execute(query)).scalar_one()
        if now - last > STALL_S:
            # The first mark after an outage: the leases that were live when it began get its
            # length back, in the same transaction, so no lease runs out for want of beats that
            # could not be taken (the reaper held off meanwhile: ``tasks.jobs``).
            # The outage began within ``STALL_S`` of the last mark (the next one did not come):
            # leases taken in between lived through it too.
            extended = await extend_leases_over_outage(
                session,
                began=dt.datetime.fromtimestamp(last, dt.UTC),
                length=dt.timedelta(seconds=now - last),
                taken_by=dt.datetime.fromtimestamp(last + STALL_S, dt.UTC),
            )
            log.warning("serving_resumed", outage_s=round(now - last, 1), leases_extended=extended)
            values = {"at": now, "since": now}
        else:  # a process whose clock is slightly behind never moves ``at`` back
            values = {"at": max(last, now)}
        await session.execute(update(ServingMark).where(ServingMark.name == MARK).values(**values))
    state.marked_at = now
    return True


def _marked_lately(state: AppState) -> bool:
    return state.marked_at is not None and state.clock.now() - state.marked_at <= STALL_S


async def caught_up(state: AppState) -> None:
    """Before a request judges leases by their deadlines (a claim's lease cap, a result, a
    release, a beat's leases): in an API process whose own last mark is older than ``STALL_S``
    (the database or Redis was down, or it has just started), write a mark first. A request
    served at the return from an outage, before the marks loop's next tick, saw every lease
    that had run out meanwhile as expired: a result refused with ``lease_expired``, a beat told
    to drop a lease the mark then made live again, a claim past the lease cap. The first such
    request of the process writes it; the others wait for it. Free while the marks are fresh; a
    process that writes no marks (tests that drive them, ``serving_marks`` off) never does."""
    if not state.marking or _marked_lately(state):
        return
    async with state.mark_lock:
        if not _marked_lately(state):
            await mark_serving(state)


async def leases_caught_up(request: Request) -> None:
    """``caught_up`` as a route's dependency: the route lists it first, so it runs before any
    dependency opens the request's transaction (SQLite: the mark's own would wait for it)."""
    await caught_up(app_state(request))


@dataclass(frozen=True)
class Serving:
    """What the marks say at ``now``: ``down`` if none is recent, else serving since ``since``."""

    at: float
    since: float
    now: float

    @property
    def down(self) -> bool:
        return self.now - self.at > STALL_S

    def judges(self, silence_s: float) -> bool:
        """Whether a silence of ``silence_s`` can be told now: the service has been able to take
        beats for at least that long."""
        return not self.down and self.now - self.since >= silence_s


async def read_serving(
    state: AppState, session: AsyncSession, now: float, loop: str, interval_s: float
) -> Serving | None:
    """What the marks say at ``now`` to ``loop`` (which ticks every ``interval_s``); None
    without marks, or with marks so old that no API process marks any more (``ABANDONED_S``,
    once ``loop`` has seen them missing for ``ABANDONED_CONFIRM_S``: logged once per loop as
    this process first reads them so, and once as marks come again)."""
    query = select(ServingMark.at, ServingMark.since).where(ServingMark.name == MARK)
    row = (await session.execute(query)).first()
    if row is None:
        return None
    abandoned = now - row.at > ABANDONED_S and await _missing_long_enough(state, loop, now, interval_s)
    if state.changed(f"serving_marks_abandoned:{loop}", True if abandoned else None):
        if abandoned:
            log.error("serving_marks_abandoned", loop=loop, last_mark_age_s=round(now - row.at, 1))
        else:
            log.info("serving_marks_recent", loop=loop, last_mark_age_s=round(max(0.0, now - row.at), 1))
    if abandoned:
        return None
    return Serving(at=row.at, since=row.since, now=now)


async def _missing_long_enough(state: AppState, loop: str, now: float, interval_s: float) -> bool:
    """Whether ``loop`` has read the marks as abandoned in this process for
    ``ABANDONED_CONFIRM_S`` (at least three of its intervals), in reads at most
    ``MISSING_READ_GAP_S`` (or three intervals) apart with the hot store answering: a longer
    gap, which an outage of the database leaves, or a hot store down starts the count again."""
    seen = state.marks_missing.get(loop)
    gap = max(MISSING_READ_GAP_S, 3 * interval_s)
    first = seen[0] if seen is not None and now - seen[1] <= gap else now
    try:
        answering = await state.hot_store.ping()
    except Exception:  # Redis down raises: the count starts again, as for a False
        answering = False
    if not answering:
        first = now
    state.marks_missing[loop] = (first, now)
    return now - first >= max(ABANDONED_CONFIRM_S, 3 * interval_s)


async def check_clock(state: AppState, session: AsyncSession) -> float | None:
    """This process's clock less the database server's, in seconds (read in the middle of the
    query's round trip); a ``clock_skew`` warning once a minute while the difference is more
    than ``CLOCK_SKEW_WARN_S`` beyond what the round trip leaves uncertain, and
    ``clock_agrees`` once it is not. None on SQLite (one host) or with a clock of the tests'
    that is not the system's. Exported as ``orchestrator_clock_offset_seconds`` by the API
    processes (their marks) and by ``orchestrator background --metrics-port`` (its sweeps)."""
    if not is_postgres(session) or not isinstance(state.clock, SystemClock):
        return None
    before = state.clock.now()
    db_now = float((await session.execute(_DB_NOW)).scalar_one())
    after = state.clock.now()
    offset = (before + after) / 2 - db_now
    metrics.CLOCK_OFFSET.set(offset)
    skewed = abs(offset) - (after - before) / 2 > CLOCK_SKEW_WARN_S
    if state.changed("clock_skew", int(after // 60) if skewed else None):
        if skewed:
            log.warning(
                "clock_skew",
                offset_s=round(offset, 3),
                detail="this process's clock differs from the database server's: the hosts' clocks "
                "must agree (NTP) for liveness and leases to be judged right",
            )
        else:
            log.info("clock_agrees", offset_s=round(offset, 3))
    return offset
