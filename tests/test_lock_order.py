"""Lock order in the ledger: transactions that make several transfers never deadlock each other.

Reward release and the verifier both move money for many providers in one transaction. Before
they locked the accounts up front in one global order, a release that took provider A's
accounts and then B's could meet a verifier batch that had paid B and then wanted A.
"""

from __future__ import annotations

import asyncio
from typing import Any

import structlog
from sqlalchemy import func, select

from orchestrator.ledger.models import LedgerTransfer
from orchestrator.verification import service
from orchestrator.verification.jobs import drain
from orchestrator.verification.models import Verdict
from tests.conftest import postgres_only
from tests.tasks_helpers import pool_setup, task
from tests.verification_helpers import FixedDraw, balances, books_balance, submit

ECON = {"min_stake_per_node": 100, "reward_per_sample": 7, "reward_hold_s": 0}
WORKERS = 6
ROUNDS = 12


async def _submit_round(s: Any, workers: list[Any], round_no: int) -> None:
    """One correct result per worker, submitted in ``workers`` order (so verified in that order)."""
    await s.enqueue([task() for _ in workers], key=f"round-{round_no}")
    leases = [(await w.claim(s.pool_id)).json()["leases"][0] for w in workers]
    for w, lease in zip(workers, leases, strict=True):
        await submit(w, lease, ["4"])


async def release(app_state: Any) -> int:
    """The reward-release tick's work, without its once-per-tick claim (the clock stands still:
    rewards held 0 s are due at once)."""
    async with app_state.sessionmaker() as session, session.begin():
        return await service.release_due_rewards(session, now=app_state.clock.utcnow())


@postgres_only
async def test_reward_release_and_verdicts_never_deadlock(app: Any, app_state: Any, client: Any) -> None:
    """Each round verifies results in the reverse of the order in which the previous round's
    rewards (held 0 s) are released, while the release runs concurrently: the two transactions
    lock the same providers' ``rewards_pending`` accounts in opposite orders unless they take
    their locks up front in one global order."""
    app_state.rng = FixedDraw(1.0)
    async with pool_setup(app, app_state, workers=WORKERS, economics=ECON, stake=100) as s:
        failures: list[str] = []
        with structlog.testing.capture_logs() as logs:
            for round_no in range(ROUNDS):
                order = s.workers if round_no % 2 == 0 else list(reversed(s.workers))
                await _submit_round(s, order, round_no)
                verified, released = await asyncio.gather(
                    drain(app_state), release(app_state), return_exceptions=True
                )
                for outcome in (verified, released):
                    if isinstance(outcome, BaseException):
                        failures.append(repr(outcome))
        failures += [repr(e) for e in logs if e["log_level"] in ("error", "critical")]
        assert failures == [], failures

        await drain(app_state)
        await release(app_state)
        for w in s.workers:
            b = await balances(client, w)
            assert (b["rewards_pending"], b["rewards_claimable"]) == (0, 7 * ROUNDS), b
        async with app_state.sessionmaker() as session:
            assert await session.scalar(select(func.count()).select_from(Verdict)) == WORKERS * ROUNDS
            rewards = await session.scalar(
                select(func.count()).select_from(LedgerTransfer).where(LedgerTransfer.reason == "reward")
            )
            assert rewards == WORKERS * ROUNDS
    await books_balance(app_state)
