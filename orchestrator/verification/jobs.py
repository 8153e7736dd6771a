"""Background loops of verification: run the checks, release held rewards, expire validator leases."""

from __future__ import annotations

from dataclasses import dataclass

import structlog

from orchestrator.core.state import AppState
from orchestrator.core.ticks import claim_tick
from orchestrator.verification import service, validators

log = structlog.get_logger(__name__)

VERIFIER = "verifier"
REWARD_RELEASE = "reward_release"
VERIFY_INTERVAL_S = 1.0
RELEASE_INTERVAL_S = 30.0


@dataclass(frozen=True)
class VerifyReport:
    tick: int
    ran: bool
    processed: int = 0
    validator_leases_expired: int = 0


async def verify_once(state: AppState, *, limit: int = 200) -> VerifyReport:
    """One tick: cheap checks for waiting results; expired validator leases back to open."""
    now = state.clock.now()
    tick = int(now // VERIFY_INTERVAL_S)
    secret = state.settings.seed_secret.get_secret_value().encode()
    async with state.sessionmaker() as session, session.begin():
        if not await claim_tick(session, VERIFIER, tick, state.instance_id):
            return VerifyReport(tick=tick, ran=False)
        processed = await service.process_pending(
            session, secret=secret, rng=state.rng, now=state.clock.utcnow(), limit=limit
        )
        expired = await validators.expire_leases(session, now=state.clock.utcnow())
    return VerifyReport(tick=tick, ran=True, processed=processed, validator_leases_expired=expired)


async def drain(state: AppState, *, max_rounds: int = 100) -> int:
    """Verify until nothing waits (tests, the demo); ignores the once-per-tick claim."""
    total = 0
    secret = state.settings.seed_secret.get_secret_value().encode()
    for _ in range(max_rounds):
        async with state.sessionmaker() as session, session.begin():
            n = await service.process_pending(session, secret=secret, rng=state.rng, now=state.clock.utcnow())
        total += n
        if n == 0:
            break
    return total


async def release_once(state: AppState) -> int:
    now = state.clock.now()
    tick = int(now // RELEASE_INTERVAL_S)
    async with state.sessionmaker() as session, session.begin():
        if not await claim_tick(session, REWARD_RELEASE, tick, state.instance_id):
            return 0
        released = await service.release_due_rewards(session, now=state.clock.utcnow())
    if released:
        log.info("rewards_released", count=released)
    return released
