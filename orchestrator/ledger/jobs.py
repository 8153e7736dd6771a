"""The stake release job: unbonded stake becomes free after the pool's unbonding period."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

import structlog
from sqlalchemy.ext.asyncio import AsyncSession

from orchestrator.core.state import AppState
from orchestrator.core.ticks import Keyset, tick_in_batches
from orchestrator.ledger.service import release_due_unbondings

log = structlog.get_logger(__name__)

STAKE_RELEASE = "stake_release"
INTERVAL_S = 30.0
#: Unbondings released per transaction (each locks its provider's two stake accounts).
RELEASE_BATCH = 200


@dataclass(frozen=True)
class ReleaseReport:
    tick: int
    ran: bool
    released: int = 0


async def release_once(state: AppState) -> ReleaseReport:
    """One tick of the stake release: due unbondings in transactions of ``RELEASE_BATCH``, the
    first with the tick's claim, each reading on from where the last one stopped, for as long as
    batches come back full (up to the tick's interval). One transaction of 500 a tick released
    at most 16 unbondings a second: after a large pool completed, the last of its members waited
    hours past their unbonding period."""
    tick = int(state.clock.now() // INTERVAL_S)
    keyset = Keyset()

    async def batch(session: AsyncSession) -> int:
        due_at = dt.datetime.fromtimestamp(state.clock.now(), dt.UTC)
        return await release_due_unbondings(session, due_at, limit=RELEASE_BATCH, keyset=keyset)

    batches = await tick_in_batches(
        state.sessionmaker,
        STAKE_RELEASE,
        tick,
        state.instance_id,
        batch,
        more=lambda _: keyset.read >= RELEASE_BATCH,
        budget_s=INTERVAL_S,
        clock=state.clock,
    )
    if batches is None:
        return ReleaseReport(tick=tick, ran=False)
    released = sum(batches)
    if released:
        log.info("stake_released", count=released, batches=len(batches))
    return ReleaseReport(tick=tick, ran=True, released=released)
