"""The lease reaper, once per tick: expired leases are ended and their replicas reissued, and
open tasks past their deadline fail.

Each batch is a transaction of its own, of at most ``REAP_BATCH`` leases and as many tasks. A
backlog larger than a batch (a mass death of nodes: their leases all run out at the sweeper's
tick) is drained by further batches in the same tick, for up to ``INTERVAL_S`` of work, instead
of one batch every ``INTERVAL_S``. Claims and results get the database between batches (on
SQLite, its write lock).
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog
from sqlalchemy.ext.asyncio import AsyncSession

from orchestrator.core.state import AppState
from orchestrator.core.ticks import tick_in_batches
from orchestrator.liveness.serving import read_serving
from orchestrator.tasks.service import fail_past_deadline, reap_expired

log = structlog.get_logger(__name__)

LEASE_REAPER = "lease_reaper"
INTERVAL_S = 5.0
REAP_BATCH = 1000


@dataclass(frozen=True)
class ReapReport:
    tick: int
    ran: bool
    expired: int = 0
    failed_tasks: int = 0
    past_deadline: int = 0
    batches: int = 0


async def reap_once(state: AppState) -> ReapReport:
    tick = int(state.clock.now() // INTERVAL_S)

    async def batch(session: AsyncSession) -> tuple[int, int, int]:
        utcnow = state.clock.utcnow()
        # While no API process can take beats or results, a lease running out is the outage's
        # doing: the first mark after it gives the live leases its length back.
        serving = await read_serving(state, session, state.clock.now(), LEASE_REAPER, INTERVAL_S)
        expired, failed = (
            (0, 0)
            if serving is not None and serving.down
            else await reap_expired(session, now=utcnow, limit=REAP_BATCH)
        )
        return expired, failed, await fail_past_deadline(session, now=utcnow, limit=REAP_BATCH)

    batches = await tick_in_batches(
        state.sessionmaker,
        LEASE_REAPER,
        tick,
        state.instance_id,
        batch,
        more=lambda done: max(done[0], done[2]) >= REAP_BATCH,
        budget_s=INTERVAL_S,
        clock=state.clock,
    )
    if batches is None:
        return ReapReport(tick=tick, ran=False)
    expired, failed, past_deadline = (sum(column) for column in zip(*batches, strict=True))
    if expired:
        log.info("leases_expired", count=expired, failed_tasks=failed, batches=len(batches))
    return ReapReport(tick, True, expired, failed, past_deadline, len(batches))
