"""The reward budget loop: pause the active pools whose verdicts have credited their budget.

Once per tick across processes, in a transaction of its own: one statement finds the active
pools with a ``reward_budget`` whose nodes' track records (``NodeTrust.rewards_credited``, which
the verifier keeps in the same row update as the rest of a verdict's count) add up to it, and
``pools.service.pause_spent_pools`` pauses them. Nothing is added to the claim or result paths:
a paused pool's claims already answer ``pool_paused``. A pool is paused within about one
``INTERVAL_S`` of the verdict that reached its budget; the verdicts of that interval, and every
lease out when it is paused, are still paid (README: "Reward budget").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import structlog

from orchestrator.core.state import AppState
from orchestrator.core.ticks import claim_tick
from orchestrator.pools import service

log = structlog.get_logger(__name__)

REWARD_BUDGET = "reward_budget"
INTERVAL_S = 1.0


@dataclass(frozen=True)
class BudgetReport:
    tick: int
    ran: bool
    paused: list[str] = field(default_factory=list)


async def check_budgets_once(state: AppState) -> BudgetReport:
    tick = int(state.clock.now() // INTERVAL_S)
    async with state.sessionmaker() as session, session.begin():
        if not await claim_tick(
            session, REWARD_BUDGET, tick, state.instance_id, interval_s=INTERVAL_S, clock=state.clock
        ):
            return BudgetReport(tick=tick, ran=False)
        paused = await service.pause_spent_pools(session, now=state.clock.utcnow())
    for pool_id in paused:
        log.info("pool_paused_budget_spent", pool_id=pool_id)
    return BudgetReport(tick=tick, ran=True, paused=paused)
