"""The lease reaper, once per tick: expired leases are ended and their replicas reissued, and
open tasks past their deadline fail."""

from __future__ import annotations

from dataclasses import dataclass

import structlog

from orchestrator.core.state import AppState
from orchestrator.core.ticks import claim_tick
from orchestrator.tasks.service import fail_past_deadline, reap_expired

log = structlog.get_logger(__name__)

LEASE_REAPER = "lease_reaper"
INTERVAL_S = 5.0


@dataclass(frozen=True)
class ReapReport:
    tick: int
    ran: bool
    expired: int = 0
    failed_tasks: int = 0
    past_deadline: int = 0


async def reap_once(state: AppState) -> ReapReport:
    now = state.clock.now()
    tick = int(now // INTERVAL_S)
    async with state.sessionmaker() as session, session.begin():
        if not await claim_tick(session, LEASE_REAPER, tick, state.instance_id):
            return ReapReport(tick=tick, ran=False)
        expired, failed = await reap_expired(session, now=state.clock.utcnow())
        past_deadline = await fail_past_deadline(session, now=state.clock.utcnow())
    if expired:
        log.info("leases_expired", count=expired, failed_tasks=failed)
    return ReapReport(tick=tick, ran=True, expired=expired, failed_tasks=failed, past_deadline=past_deadline)
