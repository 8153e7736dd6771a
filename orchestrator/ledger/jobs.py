"""The stake release job: unbonded stake becomes free after the pool's unbonding period."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

import structlog

from orchestrator.core.state import AppState
from orchestrator.core.ticks import claim_tick
from orchestrator.ledger.service import release_due_unbondings

log = structlog.get_logger(__name__)

STAKE_RELEASE = "stake_release"
INTERVAL_S = 30.0


@dataclass(frozen=True)
class ReleaseReport:
    tick: int
    ran: bool
    released: int = 0


async def release_once(state: AppState) -> ReleaseReport:
    now = state.clock.now()
    tick = int(now // INTERVAL_S)
    async with state.sessionmaker() as session, session.begin():
        if not await claim_tick(session, STAKE_RELEASE, tick, state.instance_id):
            return ReleaseReport(tick=tick, ran=False)
        released = await release_due_unbondings(session, dt.datetime.fromtimestamp(now, dt.UTC))
    if released:
        log.info("stake_released", count=released)
    return ReleaseReport(tick=tick, ran=True, released=released)
