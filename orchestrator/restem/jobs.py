"""The ReST^EM barrier loop: complete or expire running iterations without waiting for a read.

Optional (reads and creates move iterations lazily); it makes an expired iteration's open
tasks stop being leased at its deadline rather than at the next read.
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog

from orchestrator.core.state import AppState
from orchestrator.core.ticks import claim_tick
from orchestrator.restem import service

log = structlog.get_logger(__name__)

RESTEM_BARRIER = "restem_barrier"
INTERVAL_S = 5.0


@dataclass(frozen=True)
class AdvanceReport:
    tick: int
    ran: bool
    completed: int = 0
    expired: int = 0


async def advance_once(state: AppState) -> AdvanceReport:
    now = state.clock.now()
    tick = int(now // INTERVAL_S)
    async with state.sessionmaker() as session, session.begin():
        if not await claim_tick(
            session, RESTEM_BARRIER, tick, state.instance_id, interval_s=INTERVAL_S, clock=state.clock
        ):
            return AdvanceReport(tick=tick, ran=False)
        changed = await service.advance(session, now=state.clock.utcnow(), skip_locked=True)
    completed = sum(1 for it in changed if it.status == "complete")
    return AdvanceReport(tick=tick, ran=True, completed=completed, expired=len(changed) - completed)
