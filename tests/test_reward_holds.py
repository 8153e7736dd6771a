"""Reward holds: the release loop, and what verdicts forfeit from rewards still on hold."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import insert, select, update

from orchestrator.core.clock import FakeClock
from orchestrator.ledger import service as ledger
from orchestrator.ledger.models import LedgerTransfer
from orchestrator.ledger.service import ProviderAccount, SystemAccount
from orchestrator.tasks.models import Assignment, Submission
from orchestrator.verification import jobs as verification_jobs
from orchestrator.verification import service as verification_service
from orchestrator.verification.jobs import release_once
from orchestrator.verification.models import RewardHold, Verdict
from tests.tasks_helpers import pool_setup
from tests.test_verification import ECON, one_lease
from tests.verification_helpers import (
    balances,
    books_balance,
    pending_matches_holds,
    submit,
    verdicts,
    verify_all,
)
from tests.waits import taking

pytestmark = pytest.mark.usefixtures("no_audits")


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


async def test_a_full_batch_of_holds_that_cannot_be_released_does_not_stop_the_tick(
    app: Any, app_state: Any, client: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tick went on while a batch released something. With a whole batch of holds that
    cannot be released at the head of the queue, it released none and stopped, tick after
    tick, and no reward behind them became claimable. Each batch now reads on from where the
    last one stopped."""
    monkeypatch.setattr(verification_jobs, "RELEASE_BATCH", 2)
    async with pool_setup(app, app_state, workers=3, economics=ECON, stake=1000) as s:
        *broken, fine = s.workers
        for w in s.workers:  # one at a time: the holds are queued in this order
            await submit(w, await one_lease(s, w), ["4"])
            await verify_all(app_state)
        async with app_state.sessionmaker() as session, session.begin():
            await session.execute(
                update(RewardHold).where(RewardHold.node_id.in_([w.node_id for w in broken])).values(amount=8)
            )
        clock.advance(3601)
        assert await release_once(app_state) == 1
        assert (await balances(client, fine))["rewards_claimable"] == 7
        assert await hold_statuses(app_state) == {
            **{w.node_id: ["held"] for w in broken},
            fine.node_id: ["released"],
        }
        await books_balance(app_state)


async def copy_the_hold(app_state: Any, copies: int) -> None:
    """``copies`` more rewards on hold like the one there is, each with its own lease, result
    and verdict (copied rows: deciding that many results would take minutes), paid into the
    provider's pending rewards as the verifier pays them."""
    async with app_state.sessionmaker() as session, session.begin():

        async def row(model: Any) -> dict[str, Any]:
            return dict((await session.execute(select(model.__table__))).mappings().one())

        lease, result, verdict, hold = [await row(m) for m in (Assignment, Submission, Verdict, RewardHold)]
        numbers = range(1, copies + 1)
        copied = {
            Assignment: [{**lease, "id": f"asg_copy{i:06d}"} for i in numbers],
            Submission: [
                {**result, "id": result["id"] + i, "assignment_id": f"asg_copy{i:06d}"} for i in numbers
            ],
            Verdict: [
                {**verdict, "id": verdict["id"] + i, "submission_id": result["id"] + i} for i in numbers
            ],
            RewardHold: [{**hold, "id": hold["id"] + i, "verdict_id": verdict["id"] + i} for i in numbers],
        }
        for model, rows in copied.items():
            await session.execute(insert(model.__table__), rows)
        await ledger.transfer(
            session,
            debit=ledger.system_account(SystemAccount.rewards),
            credit=ledger.provider_account(hold["provider_id"], ProviderAccount.rewards_pending),
            amount=hold["amount"] * copies,
            key="test:copied-holds",
            reason="reward",
            actor="verifier",
        )


async def test_one_tick_releases_a_backlog_of_more_than_a_thousand_holds(
    app: Any, app_state: Any, client: Any, clock: FakeClock
) -> None:
    """One transaction of at most 1,000 holds per 30 s tick released at most 33 rewards a
    second, fewer than one verifier pays: under load claimable rewards fell ever further behind
    their hold. The tick now goes on, batch after batch, until nothing more is due (within its
    30 s budget, on the app's clock, on which the batches here take no time: the test does not
    depend on how fast the machine works them)."""
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000) as s:
        w = s.workers[0]
        await submit(w, await one_lease(s, w), ["4"])
        await verify_all(app_state)
        await copy_the_hold(app_state, 1050)
        clock.advance(3601)
        assert await release_once(app_state) == 1051
        b = await balances(client, w)
        assert (b["rewards_pending"], b["rewards_claimable"]) == (0, 7 * 1051)
        assert set(*(await hold_statuses(app_state)).values()) == {"released"}
        clock.advance(31)
        assert await release_once(app_state) == 0
        await pending_matches_holds(app_state)
        await books_balance(app_state)


async def test_a_tick_that_spends_its_budget_stops_and_the_next_tick_releases_the_rest(
    app: Any, app_state: Any, client: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tick takes no new batch once its interval (30 s) has gone by, so that ticks do not pile
    up behind a slow one; what it left is due still and the next tick releases it. Here each
    batch of two takes 20 s on the app's clock: the tick stops after its second batch."""
    monkeypatch.setattr(verification_jobs, "RELEASE_BATCH", 2)
    taking(monkeypatch, verification_service, "release_due_rewards", clock, 20)
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000) as s:
        w = s.workers[0]
        await submit(w, await one_lease(s, w), ["4"])
        await verify_all(app_state)
        await copy_the_hold(app_state, 4)
        clock.advance(3601)
        assert await release_once(app_state) == 4
        b = await balances(client, w)
        assert (b["rewards_pending"], b["rewards_claimable"]) == (7, 7 * 4)
        assert await release_once(app_state) == 1  # the next tick: the clock has moved 40 s
        b = await balances(client, w)
        assert (b["rewards_pending"], b["rewards_claimable"]) == (0, 7 * 5)
        assert set(*(await hold_statuses(app_state)).values()) == {"released"}
        await pending_matches_holds(app_state)
        await books_balance(app_state)


# ------------------------------------------------------------------ soft-invalid penalty

PENALTY = {**ECON, "soft_invalid_penalty": 3}


async def honest(s: Any, w: Any, app_state: Any) -> dict[str, Any]:
    await submit(w, await one_lease(s, w), ["4"])
    await verify_all(app_state)
    return (await verdicts(s.admin, s.headers, s.pool_id))[-1]


async def wrong(s: Any, w: Any, app_state: Any) -> dict[str, Any]:
    """An honest wrong answer: invalid, not fraud."""
    await submit(w, await one_lease(s, w), ["5"], claimed_reward=0.0)
    await verify_all(app_state)
    v = (await verdicts(s.admin, s.headers, s.pool_id))[-1]
    assert (v["category"], v["reason"]) == ("invalid", "wrong_answer")
    return v


async def reverse(s: Any, verdict_id: int) -> None:
    r = await s.admin.post(
        f"/v1/admin/verdicts/{verdict_id}/reverse", json={"reason": "appeal"}, headers=s.admin_headers
    )
    assert r.status_code == 200, r.text


async def test_an_invalid_result_forfeits_the_soft_penalty_from_rewards_on_hold(
    app: Any, app_state: Any, client: Any, clock: FakeClock
) -> None:
    async with pool_setup(app, app_state, workers=1, economics=PENALTY, stake=1000) as s:
        w = s.workers[0]
        await honest(s, w, app_state)
        v = await wrong(s, w, app_state)
        assert (v["reward_amount"], v["slashed_amount"]) == (0, 3)
        b = await balances(client, w)
        assert (b["rewards_pending"], b["stake_locked"]) == (4, 1000)  # no stake is slashed
        await pending_matches_holds(app_state)
        clock.advance(3601)
        assert await release_once(app_state) == 1  # the rest of the reward, when due
        b = await balances(client, w)
        assert (b["rewards_pending"], b["rewards_claimable"]) == (0, 4)
        await books_balance(app_state)


async def test_the_penalty_takes_the_oldest_rewards_first_and_at_most_what_is_on_hold(
    app: Any, app_state: Any, client: Any
) -> None:
    async with pool_setup(
        app, app_state, workers=2, economics={**ECON, "soft_invalid_penalty": 10}, stake=1000
    ) as s:
        w, other = s.workers
        assert (await wrong(s, w, app_state))["slashed_amount"] == 0  # nothing on hold, nothing taken
        await honest(s, w, app_state)
        await honest(s, w, app_state)
        await honest(s, other, app_state)
        assert (await wrong(s, w, app_state))["slashed_amount"] == 10
        assert (await balances(client, w))["rewards_pending"] == 4
        assert (await balances(client, other))["rewards_pending"] == 7  # another node's rewards
        assert await hold_statuses(app_state) == {w.node_id: ["forfeited", "held"], other.node_id: ["held"]}
        assert (await wrong(s, w, app_state))["slashed_amount"] == 4  # what was left
        assert (await balances(client, w))["rewards_pending"] == 0
        await pending_matches_holds(app_state)
        await books_balance(app_state)


async def test_reversing_an_invalid_verdict_gives_its_penalty_back(
    app: Any, app_state: Any, client: Any, clock: FakeClock
) -> None:
    async with pool_setup(app, app_state, workers=1, economics=PENALTY, stake=1000) as s:
        w = s.workers[0]
        await honest(s, w, app_state)  # A: 7 on hold
        first = await wrong(s, w, app_state)  # takes 3 of A's
        await honest(s, w, app_state)  # B: 7 on hold
        second = await wrong(s, w, app_state)  # takes 3 more of A's: A has 1 left
        assert (await balances(client, w))["rewards_pending"] == 8
        await reverse(s, second["id"])  # A still on hold: back to pending
        assert (await balances(client, w))["rewards_pending"] == 11
        await pending_matches_holds(app_state)
        clock.advance(3601)
        assert await release_once(app_state) == 2
        b = await balances(client, w)
        assert (b["rewards_pending"], b["rewards_claimable"]) == (0, 11)
        await reverse(s, first["id"])  # A released meanwhile: straight to claimable
        b = await balances(client, w)
        assert (b["rewards_pending"], b["rewards_claimable"]) == (0, 14)
        await pending_matches_holds(app_state)
        await books_balance(app_state)


async def test_fraud_after_a_penalty_forfeits_the_rest_and_each_appeal_gives_back_its_own_part(
    app: Any, app_state: Any, client: Any, clock: FakeClock
) -> None:
    async with pool_setup(app, app_state, workers=1, economics=PENALTY, stake=1000) as s:
        w = s.workers[0]
        await honest(s, w, app_state)
        penalty = await wrong(s, w, app_state)
        await submit(w, await one_lease(s, w), ["5"], claimed_reward=1.0)
        await verify_all(app_state)
        fraud = (await verdicts(s.admin, s.headers, s.pool_id))[-1]
        assert (fraud["category"], fraud["slashed_amount"]) == ("fraud", 200 + 4)
        assert await hold_statuses(app_state) == {w.node_id: ["forfeited"]}
        await reverse(s, penalty["id"])
        assert (await balances(client, w))["rewards_pending"] == 3  # the penalty's part only
        assert await hold_statuses(app_state) == {w.node_id: ["held"]}
        await reverse(s, fraud["id"])
        assert (await balances(client, w))["rewards_pending"] == 7
        clock.advance(3601)
        assert await release_once(app_state) == 1
        assert (await balances(client, w))["rewards_claimable"] == 7
        await books_balance(app_state)


async def test_fraud_leaves_a_reward_whose_hold_window_has_passed_to_the_release_loop(
    app: Any, app_state: Any, client: Any, clock: FakeClock
) -> None:
    """A reward due before the fraud verdict (its ``reward_hold_s`` over) is the provider's,
    even while the release loop has yet to move it: the fraud takes only the stake, and the
    feed agrees that the rollout stands (it was decided outside the fraud's window)."""
    async with pool_setup(
        app, app_state, workers=1, economics={**ECON, "reward_hold_s": 60}, stake=1000
    ) as s:
        w = s.workers[0]
        earned = await honest(s, w, app_state)
        clock.advance(61)  # due; no release tick has run
        await submit(w, await one_lease(s, w), ["5"], claimed_reward=1.0)
        await verify_all(app_state)
        vs = {v["id"]: v for v in await verdicts(s.admin, s.headers, s.pool_id)}
        [fraud] = [v for v in vs.values() if v["category"] == "fraud"]
        assert fraud["slashed_amount"] == 200  # the stake only
        assert vs[earned["id"]]["withdrawn_by"] is None
        assert await hold_statuses(app_state) == {w.node_id: ["held"]}
        assert await release_once(app_state) == 1
        b = await balances(client, w)
        assert (b["rewards_pending"], b["rewards_claimable"]) == (0, 7)
        await books_balance(app_state)


async def test_reversing_a_partly_penalised_reward_takes_back_only_the_providers_part(
    app: Any, app_state: Any, client: Any
) -> None:
    async with pool_setup(app, app_state, workers=1, economics=PENALTY, stake=1000) as s:
        w = s.workers[0]
        a = await honest(s, w, app_state)
        penalty = await wrong(s, w, app_state)
        await honest(s, w, app_state)  # B
        await reverse(s, a["id"])
        assert (await balances(client, w))["rewards_pending"] == 7  # B's; A's 4 taken back
        await reverse(s, penalty["id"])  # the 3 went back to the system with A's reward
        assert (await balances(client, w))["rewards_pending"] == 7
        assert await hold_statuses(app_state) == {w.node_id: ["reversed", "held"]}
        await pending_matches_holds(app_state)
        await books_balance(app_state)


# ------------------------------------------------------------------ amounts beyond one transfer


async def test_fraud_forfeits_rewards_on_hold_beyond_the_largest_transfer_in_parts(
    app: Any, app_state: Any, client: Any, clock: FakeClock
) -> None:
    """Two results of 1024 samples at the largest reward per sample: 2 x 10^15 on hold, twice
    what one ledger transfer may move. A fraud verdict forfeits it all, its appeal gives it
    all back, and it is released."""
    econ = {**ECON, "reward_per_sample": 10**15 // 1024}
    async with pool_setup(app, app_state, workers=1, economics=econ, stake=1000) as s:
        w = s.workers[0]
        for _ in range(2):
            await submit(w, await one_lease(s, w, n=1024), ["4"] * 1024)
        await verify_all(app_state)
        assert (await balances(client, w))["rewards_pending"] == 2 * 10**15
        await submit(w, await one_lease(s, w), ["5"], claimed_reward=1.0)
        await verify_all(app_state)
        fraud = (await verdicts(s.admin, s.headers, s.pool_id))[-1]
        assert (fraud["category"], fraud["slashed_amount"]) == ("fraud", 200 + 2 * 10**15)
        assert (await balances(client, w))["rewards_pending"] == 0
        async with app_state.sessionmaker() as session:
            parts = (
                await session.execute(
                    select(LedgerTransfer.amount).where(LedgerTransfer.reason == "slash_pending_rewards")
                )
            ).scalars()
            assert sorted(parts) == [10**15, 10**15]
        await reverse(s, fraud["id"])
        assert (await balances(client, w))["rewards_pending"] == 2 * 10**15
        await pending_matches_holds(app_state)
        clock.advance(3601)
        assert await release_once(app_state) == 2
        assert (await balances(client, w))["rewards_claimable"] == 2 * 10**15
        await books_balance(app_state)
