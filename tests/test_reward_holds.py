"""Reward holds: the release loop, and what verdicts forfeit from rewards still on hold."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import select, update

from orchestrator.core.clock import FakeClock
from orchestrator.verification.jobs import release_once
from orchestrator.verification.models import RewardHold
from tests.tasks_helpers import pool_setup
from tests.test_verification import ECON, one_lease
from tests.verification_helpers import FixedDraw, balances, books_balance, submit, verify_all


@pytest.fixture(autouse=True)
def _no_audits(app_state: Any) -> None:
    app_state.rng = FixedDraw(1.0)


async def hold_statuses(app_state: Any) -> dict[str, list[str]]:
    """Each node's holds' statuses, oldest first."""
    found: dict[str, list[str]] = {}
    async with app_state.sessionmaker() as session:
        for hold in (await session.execute(select(RewardHold).order_by(RewardHold.id))).scalars():
            found.setdefault(hold.node_id, []).append(hold.status)
    return found


async def test_a_hold_that_cannot_be_released_does_not_block_the_others(
    app: Any, app_state: Any, client: Any, clock: FakeClock
) -> None:
    async with pool_setup(app, app_state, workers=2, economics=ECON, stake=1000) as s:
        broken, fine = s.workers
        for w in (broken, fine):
            await submit(w, await one_lease(s, w), ["4"])
        await verify_all(app_state)
        # A hold its provider's pending rewards no longer cover (as an appeal before this
        # release could leave behind): its release transfer fails for want of funds.
        async with app_state.sessionmaker() as session, session.begin():
            await session.execute(
                update(RewardHold).where(RewardHold.node_id == broken.node_id).values(amount=8)
            )
        clock.advance(3601)
        assert await release_once(app_state) == 1
        assert (await balances(client, fine))["rewards_claimable"] == 7
        b = await balances(client, broken)
        assert (b["rewards_pending"], b["rewards_claimable"]) == (7, 0)
        assert await hold_statuses(app_state) == {broken.node_id: ["held"], fine.node_id: ["released"]}
        clock.advance(31)  # the next tick tries it again, and still releases nothing twice
        assert await release_once(app_state) == 0
        assert await hold_statuses(app_state) == {broken.node_id: ["held"], fine.node_id: ["released"]}
        await books_balance(app_state)
