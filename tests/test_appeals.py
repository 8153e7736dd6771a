"""Appeals: reversing a verdict gives back exactly the money it moved, whatever happened since
(rewards released or forfeited by later verdicts, appeals in either order, a release racing
the appeal), and never takes money that belongs to another reward."""

from __future__ import annotations

import asyncio
import datetime as dt
import math
from typing import Any

import pytest
from sqlalchemy import func, select, text, update

from orchestrator.audit.models import AuditEntry
from orchestrator.core.clock import FakeClock
from orchestrator.ledger import service as ledger
from orchestrator.ledger.models import LedgerAccount, LedgerTransfer
from orchestrator.ledger.service import ProviderAccount, SystemAccount, provider_account, system_account
from orchestrator.payouts.service import request_withdrawal
from orchestrator.verification import service
from orchestrator.verification.jobs import RELEASE_INTERVAL_S, release_once
from orchestrator.verification.models import RewardForfeit, RewardHold, Verdict, VerificationJob
from tests.conftest import postgres_only, problem
from tests.tasks_helpers import pool_setup
from tests.test_queue_metrics import scrape, value
from tests.test_reward_holds import hold_statuses
from tests.test_verification import ECON, one_lease
from tests.verification_helpers import (
    answer_body,
    balances,
    books_balance,
    books_sound,
    pending_matches_holds,
    submit,
    track_record,
    verdicts,
    verify_all,
)
from tests.waits import until_blocked_by, until_waiting

pytestmark = pytest.mark.usefixtures("no_audits")


async def reverse(s: Any, verdict_id: int, reason: str = "appeal") -> Any:
    return await s.admin.post(
        f"/v1/admin/verdicts/{verdict_id}/reverse", json={"reason": reason}, headers=s.admin_headers
    )


async def system(app_state: Any) -> dict[str, int]:
    """The system's balance of each kind, over its shards."""
    async with app_state.sessionmaker() as session:
        rows = await session.execute(
            select(LedgerAccount.kind, func.sum(LedgerAccount.balance))
            .where(LedgerAccount.owner_type == "system")
            .group_by(LedgerAccount.kind)
        )
        return {kind: int(total) for kind, total in rows.all()}


async def pool_money(s: Any) -> tuple[int, int]:
    stats = (await s.admin.get(f"/v1/admin/pools/{s.pool_id}/stats", headers=s.headers)).json()
    return stats["rewards_credited"], stats["slashed"]


async def honest(s: Any, w: Any, app_state: Any) -> dict[str, Any]:
    await submit(w, await one_lease(s, w), ["4"])
    await verify_all(app_state)
    v = (await verdicts(s.admin, s.headers, s.pool_id))[-1]
    assert v["category"] == "valid" and v["reward_amount"] == 7
    return v


async def fraud(s: Any, w: Any, app_state: Any) -> dict[str, Any]:
    await submit(w, await one_lease(s, w), ["5"], claimed_reward=1.0)
    await verify_all(app_state)
    v = (await verdicts(s.admin, s.headers, s.pool_id))[-1]
    assert v["category"] == "fraud"
    return v


async def test_a_reversed_fraud_verdict_gives_back_the_forfeited_rewards_which_are_then_released(
    app: Any, app_state: Any, client: Any, clock: FakeClock
) -> None:
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000) as s:
        w = s.workers[0]
        await honest(s, w, app_state)
        f = await fraud(s, w, app_state)
        assert f["slashed_amount"] == 200 + 7
        assert await hold_statuses(app_state) == {w.node_id: ["forfeited"]}
        assert await pool_money(s) == (7, 207)
        assert (await reverse(s, f["id"])).status_code == 200
        assert await pool_money(s) == (7, 0)  # the pool's stats count verdicts not reversed
        b = await balances(client, w)
        assert (b["rewards_pending"], b["stake_locked"]) == (7, 1000)
        assert await hold_statuses(app_state) == {w.node_id: ["held"]}
        await pending_matches_holds(app_state)
        clock.advance(3601)
        assert await release_once(app_state) == 1
        b = await balances(client, w)
        assert (b["rewards_pending"], b["rewards_claimable"]) == (0, 7)
        assert (await system(app_state))["slashed"] == 0
        await books_balance(app_state)


async def test_reversing_a_reward_that_fraud_forfeited_takes_nothing_from_the_provider(
    app: Any, app_state: Any, client: Any, clock: FakeClock
) -> None:
    """A's reward was forfeited by a later fraud verdict; B's is on hold. Reversing A must not
    take A's amount again, out of B's; the forfeited amount goes from the slashed account back to
    the system's rewards, and a later appeal against the fraud verdict does not restore it."""
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000) as s:
        w = s.workers[0]
        a = await honest(s, w, app_state)
        f = await fraud(s, w, app_state)
        await honest(s, w, app_state)  # B
        assert await system(app_state) == {"deposits": -1000, "rewards": -14, "slashed": 207}
        assert (await reverse(s, a["id"])).status_code == 200
        b = await balances(client, w)
        assert (b["rewards_pending"], b["rewards_claimable"]) == (7, 0)
        assert await hold_statuses(app_state) == {w.node_id: ["reversed", "held"]}
        assert await system(app_state) == {"deposits": -1000, "rewards": -7, "slashed": 200}
        await books_balance(app_state)

        assert (await reverse(s, f["id"])).status_code == 200
        b = await balances(client, w)
        assert (b["rewards_pending"], b["stake_locked"]) == (7, 1000)  # A's reward is not restored
        assert await hold_statuses(app_state) == {w.node_id: ["reversed", "held"]}
        assert await system(app_state) == {"deposits": -1000, "rewards": -7, "slashed": 0}
        await pending_matches_holds(app_state)
        clock.advance(3601)
        assert await release_once(app_state) == 1
        b = await balances(client, w)
        assert (b["rewards_pending"], b["rewards_claimable"]) == (0, 7)
        await books_balance(app_state)


async def test_reversing_the_fraud_verdict_first_then_the_reward_takes_the_reward_back_once(
    app: Any, app_state: Any, client: Any
) -> None:
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000) as s:
        w = s.workers[0]
        a = await honest(s, w, app_state)
        f = await fraud(s, w, app_state)
        await honest(s, w, app_state)  # B
        assert (await reverse(s, f["id"])).status_code == 200
        assert (await balances(client, w))["rewards_pending"] == 14  # A's back on hold, and B's
        assert (await reverse(s, a["id"])).status_code == 200
        assert (await balances(client, w))["rewards_pending"] == 7  # B's
        assert await hold_statuses(app_state) == {w.node_id: ["reversed", "held"]}
        assert await system(app_state) == {"deposits": -1000, "rewards": -7, "slashed": 0}
        await books_sound(app_state)


async def test_a_released_reward_is_taken_back_from_claimable_and_a_withdrawn_one_cannot_be(
    app: Any, app_state: Any, client: Any, clock: FakeClock
) -> None:
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000) as s:
        w = s.workers[0]
        a = await honest(s, w, app_state)
        c = await honest(s, w, app_state)
        clock.advance(3601)
        assert await release_once(app_state) == 2
        assert (await reverse(s, a["id"])).status_code == 200
        b = await balances(client, w)
        assert (b["rewards_pending"], b["rewards_claimable"]) == (0, 7)  # C's

        async with app_state.sessionmaker() as session, session.begin():
            await request_withdrawal(session, w.contributor.provider_id, 7, "withdraw-c", now=clock.utcnow())
        problem(await reverse(s, c["id"]), 409, "reversal_impossible")
        b = await balances(client, w)
        assert (b["rewards_claimable"], b["withdrawn"]) == (0, 7)
        assert (await verdicts(s.admin, s.headers, s.pool_id))[-1]["reversed_at"] is None
        assert await hold_statuses(app_state) == {w.node_id: ["reversed", "released"]}
        await books_balance(app_state)


async def test_a_stake_slashed_before_the_node_left_and_joined_again_comes_back_free(
    app: Any, app_state: Any, client: Any
) -> None:
    """The slash took the stake of the membership's first episode; the node left and joined
    again (a second episode, with stake of its own) before the appeal. The stake given back was
    locked into the second episode on top of its own, so that this episode held more than any
    join locks: with the pool's largest stake (10^15), more than one transfer can move, and
    every end of the membership (a leave, an ejection, the pool's completion) failed with a 500
    and left the provider's stake locked for good. The first episode is over: its stake comes
    back free."""
    big = {**ECON, "min_stake_per_node": 10**15, "fraud_slash_amount": 10**15}
    async with pool_setup(app, app_state, workers=1, economics=big, stake=10**15) as s:
        w = s.workers[0]
        f = await fraud(s, w, app_state)
        assert f["slashed_amount"] == 10**15
        leave = f"/v1/pools/{s.pool_id}/leave"
        assert (await w.client.post(leave, json={}, auth=w.contributor.node_auth)).status_code == 200
        r = await s.admin.post(
            f"/v1/admin/providers/{w.contributor.provider_id}/deposits",
            json={"amount": 10**15},
            headers={**s.admin_headers, "Idempotency-Key": "second-stake"},
        )
        assert r.status_code == 201, r.text
        r = await w.client.post(f"/v1/pools/{s.pool_id}/join", json={}, auth=w.contributor.node_auth)
        assert (r.status_code, r.json()["episode"], r.json()["stake"]) == (201, 2, 10**15)
        assert (await reverse(s, f["id"])).status_code == 200
        b = await balances(client, w)
        assert (b["stake_free"], b["stake_locked"]) == (10**15, 10**15)
        r = await w.client.post(leave, json={}, auth=w.contributor.node_auth)
        assert r.status_code == 200, r.text
        b = await balances(client, w)
        assert (b["stake_free"], b["stake_locked"], b["stake_unbonding"]) == (10**15, 0, 10**15)
        await books_balance(app_state)


@postgres_only
async def test_an_appeal_waits_for_a_release_in_progress_and_reverses_what_it_released(
    app: Any, app_state: Any, client: Any, clock: FakeClock
) -> None:
    """A's reward is being released (not yet committed) when its appeal comes in. The appeal
    must wait for the release and then take A's reward back from claimable, not reverse only
    the reward and so take B's reward, still on hold, out of pending."""
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000) as s:
        w = s.workers[0]
        a = await honest(s, w, app_state)
        await honest(s, w, app_state)  # B, due a day later
        async with app_state.sessionmaker() as session, session.begin():
            await session.execute(
                update(RewardHold)
                .where(RewardHold.verdict_id != a["id"])
                .values(release_at=clock.utcnow() + dt.timedelta(days=1))
            )
        clock.advance(3601)  # A due, B not
        async with app_state.sessionmaker() as session:
            await session.begin()
            assert await service.release_due_rewards(session, now=clock.utcnow()) == 1
            appeal = asyncio.create_task(reverse(s, a["id"]))
            await until_waiting(app_state, 1, appeal, on="row")
            assert not appeal.done()  # waiting for the accounts the release holds
            await session.commit()
        r = await appeal
        assert r.status_code == 200, r.text
        b = await balances(client, w)
        assert (b["rewards_pending"], b["rewards_claimable"]) == (7, 0)
        assert await hold_statuses(app_state) == {w.node_id: ["reversed", "held"]}
        await books_sound(app_state)


@postgres_only
async def test_two_appeals_of_one_verdict_at_once_reverse_it_and_are_audited_once(
    app: Any, app_state: Any, client: Any
) -> None:
    """Both appeals read the verdict unreversed and then queue for its lock: the second finds
    it reversed and changes nothing, so the audit log says it was reversed once."""
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000) as s:
        w = s.workers[0]
        v = await honest(s, w, app_state)
        async with app_state.sessionmaker() as session, session.begin():
            await session.execute(select(Verdict).where(Verdict.id == v["id"]).with_for_update())
            appeals = [asyncio.create_task(reverse(s, v["id"])) for _ in range(2)]
            await until_waiting(app_state, 2, *appeals, on="row")
            assert not any(a.done() for a in appeals)  # both wait for the verdict
        assert [(await a).status_code for a in appeals] == [200, 200]
        assert (await balances(client, w))["rewards_pending"] == 0
        async with app_state.sessionmaker() as session:
            actions = (
                await session.scalars(select(AuditEntry.action).where(AuditEntry.target_type == "verdict"))
            ).all()
        assert actions == ["verdict.reverse"]
        await books_balance(app_state)


async def wrong(s: Any, w: Any, app_state: Any) -> dict[str, Any]:
    await submit(w, await one_lease(s, w), ["5"])
    await verify_all(app_state)
    v = (await verdicts(s.admin, s.headers, s.pool_id))[-1]
    assert (v["category"], v["reason"]) == ("invalid", "wrong_answer")
    return v


def record(valid: int, invalid: int, fraud: int, consecutive_valid: int) -> dict[str, int]:
    return {
        "valid": valid,
        "invalid": invalid,
        "fraud": fraud,
        "strikes": fraud,
        "consecutive_valid": consecutive_valid,
    }


async def test_a_reversed_rejection_no_longer_counts_in_the_track_record_and_its_run_is_whole_again(
    app: Any, app_state: Any
) -> None:
    """An invalid or fraud verdict reversed on appeal was wrong: it leaves the node's counters, and
    the run of valid results it broke counts as one again, as if it had never been decided (the
    run lowers the node's audit rate). Before, the invalid one was still counted for good and
    neither gave the run back."""
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000) as s:
        w = s.workers[0]
        await honest(s, w, app_state)
        await honest(s, w, app_state)
        bad = await wrong(s, w, app_state)
        await honest(s, w, app_state)
        f = await fraud(s, w, app_state)
        await honest(s, w, app_state)
        assert await track_record(s, w) == record(4, 1, 1, 1)
        assert (await reverse(s, f["id"])).status_code == 200
        assert await track_record(s, w) == record(4, 1, 0, 2)
        assert (await reverse(s, bad["id"])).status_code == 200
        assert await track_record(s, w) == record(4, 0, 0, 4)
        assert (await reverse(s, bad["id"])).status_code == 200  # once
        assert await track_record(s, w) == record(4, 0, 0, 4)


async def test_the_run_given_back_on_appeal_is_in_the_order_verdicts_were_written_not_their_dates(
    app: Any, app_state: Any
) -> None:
    """The run of valid results an appeal counts again (``_standing_run``) is the one ``decide``
    counted: in the order the node's verdicts were written (their ids: each is written under the
    node's membership lock), not by ``decided_at``, the clock of a verifier batch when it began,
    before it waited for that lock (a batch that began earlier may write later). Here the
    rejection I written between V1 and V2 is dated 5 s before V1: I still broke V1's run, and
    reversing the older rejection X leaves a run of 1 (V2), as before it. By ``decided_at`` the
    appeal would have made it 2 (V1 and V2), a run ``decide`` never counted."""
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000) as s:
        w = s.workers[0]
        x = await wrong(s, w, app_state)
        v1 = await honest(s, w, app_state)
        i = await wrong(s, w, app_state)
        await honest(s, w, app_state)
        assert await track_record(s, w) == record(2, 2, 0, 1)
        await result_decided_ago(app_state, x["id"], 3600)
        gap = await decided_at(app_state, i["id"]) - await decided_at(app_state, v1["id"])
        await result_decided_ago(app_state, i["id"], math.ceil(gap.total_seconds()) + 5)
        assert await decided_at(app_state, x["id"]) < await decided_at(app_state, i["id"])
        assert await decided_at(app_state, i["id"]) < await decided_at(app_state, v1["id"])
        assert (await reverse(s, x["id"])).status_code == 200
        assert await track_record(s, w) == record(2, 1, 0, 1)


async def test_a_reversed_valid_verdict_no_longer_counts_in_the_track_record(
    app: Any, app_state: Any
) -> None:
    """A valid verdict reversed on appeal leaves the node's count of valid results, and the run it
    was in is one shorter (the run before the node's latest rejection is gone already)."""
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000) as s:
        w = s.workers[0]
        old = await honest(s, w, app_state)
        await wrong(s, w, app_state)
        first = await honest(s, w, app_state)
        await honest(s, w, app_state)
        assert await track_record(s, w) == record(3, 1, 0, 2)
        assert (await reverse(s, first["id"])).status_code == 200
        assert await track_record(s, w) == record(2, 1, 0, 1)
        assert (await reverse(s, old["id"])).status_code == 200
        assert await track_record(s, w) == record(1, 1, 0, 1)


async def test_a_reversed_inconclusive_verdict_no_longer_counts_in_the_track_record(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    """An inconclusive verdict counts with the invalid ones and breaks the run; reversed, it does
    neither."""
    async with pool_setup(app, app_state, workers=2, economics=ECON, stake=1000) as s:
        w, other = s.workers
        await honest(s, w, app_state)
        r = await s.enqueue([{"prompt": "Name a colour.", "sampling": {"max_tokens": 8}, "replication": 2}])
        task_id = r.json()["first_task_id"]
        lease = (await w.claim(s.pool_id)).json()["leases"][0]
        assert (await other.claim(s.pool_id)).json()["leases"]  # then never answers
        await submit(w, lease, ["red"])
        cancel = await s.admin.post(f"/v1/admin/pools/{s.pool_id}/tasks/{task_id}/cancel", headers=s.headers)
        assert cancel.json()["status"] == "cancelled"
        clock.advance(app_state.settings.verifier.quorum_wait_s + 60)
        await verify_all(app_state)
        v = (await verdicts(s.admin, s.headers, s.pool_id))[-1]
        assert (v["category"], v["reason"]) == ("inconclusive", "task_abandoned")
        assert await track_record(s, w) == record(1, 1, 0, 0)
        r = await reverse(s, v["id"])
        assert r.status_code == 200
        assert await track_record(s, w) == record(1, 0, 0, 1)
        # Nothing was judged against the node and nobody judged its answer right: not paid.
        assert r.json()["reward_paid_on_appeal"] == 0
        assert await pool_money(s) == (7, 0)


async def test_the_pools_slashed_total_leaves_out_a_forfeit_given_back_by_the_rewards_appeal(
    app: Any, app_state: Any
) -> None:
    """A fraud verdict forfeited A's held reward; A's appeal sends that forfeit from the slashed
    account back to the system's rewards. The pool's stats counted it as slashed still (207, of
    which only 200 was), while no longer counting A's reward as credited."""
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000) as s:
        w = s.workers[0]
        a = await honest(s, w, app_state)
        f = await fraud(s, w, app_state)
        assert await pool_money(s) == (7, 207)
        assert (await reverse(s, a["id"])).status_code == 200
        assert await pool_money(s) == (0, 200)
        assert (await system(app_state))["slashed"] == 200
        assert (await reverse(s, f["id"])).status_code == 200
        assert await pool_money(s) == (0, 0)
        assert (await system(app_state))["slashed"] == 0


# ------------------------------------------------------------------ sanctions lifted by appeals


async def forged(s: Any, w: Any, leases: int = 1) -> None:
    """``leases`` results of ``w`` not run with the assigned seed (fraud), submitted but not
    yet verified (all of them before the first verdict can eject the node)."""
    for lease in [await one_lease(s, w) for _ in range(leases)]:
        await submit(w, lease, ["4"], seed=1)


async def frauds_of(s: Any, w: Any) -> list[dict[str, Any]]:
    """The node's fraud verdicts (by node: the verifier may decide providers in either order)."""
    found = [v for v in await verdicts(s.admin, s.headers, s.pool_id) if v["node_id"] == w.node_id]
    assert found and all(v["category"] == "fraud" for v in found), found
    return found


async def status_in_pool(s: Any, w: Any) -> str:
    me = (await w.client.get("/v1/nodes/me", auth=w.contributor.node_auth)).json()
    [status] = [m["status"] for m in me["memberships"] if m["pool_id"] == s.pool_id]
    return str(status)


async def join(s: Any, w: Any) -> Any:
    return await w.client.post(f"/v1/pools/{s.pool_id}/join", json={}, auth=w.contributor.node_auth)


async def audit_of(s: Any, action: str) -> list[dict[str, Any]]:
    r = await s.admin.get("/v1/admin/audit", params={"limit": 200}, headers=s.admin_headers)
    assert r.status_code == 200, r.text
    return [e for e in r.json()["items"] if e["action"] == action]


EJECT_AT_1 = {**ECON, "strikes_before_ejection": 1, "strikes_before_provider_ban": 5}


async def test_an_appeal_that_brings_the_strikes_below_the_limit_lifts_the_verifiers_ejection(
    app: Any, app_state: Any
) -> None:
    """The verifier ejected the node at its strike limit; the appeal of that fraud verdict takes
    the strike back, so the ejection goes too: the membership is ``left`` (audited
    ``membership.reinstate`` by the appeal's admin) and the node may join again, with new stake.
    Before, the verifier's ejection stayed for ever."""
    async with pool_setup(app, app_state, workers=1, economics=EJECT_AT_1, stake=2000) as s:
        w = s.workers[0]
        await forged(s, w)
        await verify_all(app_state)
        [f] = await frauds_of(s, w)
        assert await status_in_pool(s, w) == "ejected"
        problem(await join(s, w), 403, "node_ejected")

        r = await reverse(s, f["id"], "seed bug on our side")
        assert r.status_code == 200, r.text
        assert (r.json()["membership_status"], r.json()["provider_blacklisted"]) == ("left", False)
        assert await status_in_pool(s, w) == "left"
        assert await track_record(s, w) == {
            "valid": 0,
            "invalid": 0,
            "fraud": 0,
            "strikes": 0,
            "consecutive_valid": 0,
        }
        [reinstated] = await audit_of(s, "membership.reinstate")
        assert (reinstated["target_id"], reinstated["pool_id"]) == (w.node_id, s.pool_id)
        assert reinstated["actor_role"] == "admin" and reinstated["actor"] != "system"
        assert reinstated["before"] == {"status": "ejected"}
        assert reinstated["after"]["status"] == "left"
        assert f"fraud verdict {f['id']} reversed on appeal" in reinstated["after"]["reason"]

        r = await join(s, w)
        assert r.status_code == 201 and r.json()["status"] == "active", r.text
        assert r.json()["episode"] == 2
        again = await reverse(s, f["id"])  # changes nothing, shows the state as it is
        assert again.status_code == 200 and again.json()["membership_status"] == "active"
        assert len(await audit_of(s, "membership.reinstate")) == 1
    await books_balance(app_state)


async def test_an_ejection_that_the_remaining_strikes_still_reach_stays(app: Any, app_state: Any) -> None:
    """Two fraud strikes past a limit of 1: the appeal of one leaves one strike, still at the
    limit, so the node stays ejected; the appeal of the other lifts the ejection."""
    async with pool_setup(app, app_state, workers=1, economics=EJECT_AT_1, stake=2000) as s:
        w = s.workers[0]
        await forged(s, w, leases=2)
        await verify_all(app_state)
        first, second = await frauds_of(s, w)
        assert (await track_record(s, w))["strikes"] == 2

        r = await reverse(s, second["id"])
        assert r.status_code == 200 and r.json()["membership_status"] == "ejected", r.text
        assert await status_in_pool(s, w) == "ejected"
        problem(await join(s, w), 403, "node_ejected")
        assert await audit_of(s, "membership.reinstate") == []

        r = await reverse(s, first["id"])
        assert r.status_code == 200 and r.json()["membership_status"] == "left", r.text
        r = await join(s, w)
        assert r.status_code == 201 and r.json()["status"] == "active", r.text
    await books_balance(app_state)


async def test_an_appeal_does_not_lift_an_operators_ejection(app: Any, app_state: Any) -> None:
    """Node A was ejected by its operator before the verdict on its forged result, node B (of
    another provider) by the verifier at its strike limit. Both verdicts are reversed: B may
    join again, A stays ejected (the appeal undoes the verifier's sanctions, not the operator's)."""
    async with pool_setup(app, app_state, workers=2, economics=EJECT_AT_1, stake=2000) as s:
        a, b = s.workers
        await forged(s, a)
        await forged(s, b)
        r = await s.admin.post(
            f"/v1/admin/pools/{s.pool_id}/members/{a.node_id}/eject",
            json={"reason": "cheat"},
            headers=s.headers,
        )
        assert r.status_code == 200, r.text
        await verify_all(app_state)
        [fa], [fb] = await frauds_of(s, a), await frauds_of(s, b)
        assert (await status_in_pool(s, a), await status_in_pool(s, b)) == ("ejected", "ejected")

        r = await reverse(s, fa["id"])
        assert r.status_code == 200 and r.json()["membership_status"] == "ejected", r.text
        r = await reverse(s, fb["id"])
        assert r.status_code == 200 and r.json()["membership_status"] == "left", r.text
        assert (await track_record(s, a))["strikes"] == 0
        assert await status_in_pool(s, a) == "ejected"
        problem(await join(s, a), 403, "node_ejected")
        r = await join(s, b)
        assert r.status_code == 201 and r.json()["status"] == "active", r.text
        assert [e["target_id"] for e in await audit_of(s, "membership.reinstate")] == [b.node_id]
    await books_balance(app_state)


async def test_an_appeal_does_not_reinstate_a_node_its_provider_revoked(app: Any, app_state: Any) -> None:
    """The verifier ejected the node, then its provider revoked the key (the machine was stolen).
    The appeal of the fraud verdict gives back the strike and the stake, but the membership stays
    ejected: the node is banned for good and may never join again, so calling it reinstated
    (``left``, audited ``membership.reinstate``) was untrue."""
    async with pool_setup(app, app_state, workers=1, economics=EJECT_AT_1, stake=2000) as s:
        w = s.workers[0]
        await forged(s, w)
        await verify_all(app_state)
        [f] = await frauds_of(s, w)
        r = await w.client.post(
            f"/v1/providers/me/nodes/{w.node_id}/revoke",
            json={"reason": "stolen"},
            auth=w.contributor.provider_auth,
        )
        assert r.status_code == 200, r.text

        r = await reverse(s, f["id"], "seed bug on our side")
        assert r.status_code == 200 and r.json()["membership_status"] == "ejected", r.text
        assert (await track_record(s, w))["strikes"] == 0
        assert await audit_of(s, "membership.reinstate") == []
        r = await s.admin.get(f"/v1/admin/pools/{s.pool_id}/members", headers=s.headers)
        assert r.status_code == 200, r.text
        [member] = [m for m in r.json()["items"] if m["node_id"] == w.node_id]
        assert member["status"] == "ejected"
    await books_balance(app_state)


async def test_an_appeal_lifts_the_verifiers_provider_ban_but_not_an_operators_blacklist(
    app: Any, app_state: Any
) -> None:
    """Provider P's two nodes have one fraud strike each, which reaches the pool's provider limit
    of 2: the verifier blacklists P, which ends both memberships (``left``, not ejected). The
    appeal of one strike brings P below the limit: the blacklisting is removed (audited
    ``pool.unblacklist_provider``) and both nodes may join again. Provider Q was blacklisted by
    its operator before the verdict on its node's forged result: that appeal leaves it as it is."""
    econ = {**ECON, "strikes_before_ejection": 2, "strikes_before_provider_ban": 2}
    async with pool_setup(app, app_state, workers=2, economics=econ, stake=2000) as s:
        p1, q = s.workers
        p2 = await s.add_worker(provider_key=p1.contributor.provider_key, stake=2000)
        for w in (p1, p2, q):
            await forged(s, w)
        r = await s.admin.post(
            f"/v1/admin/pools/{s.pool_id}/blacklist",
            json={"provider_id": q.contributor.provider_id, "reason": "sybil"},
            headers=s.headers,
        )
        assert r.status_code == 201, r.text
        await verify_all(app_state)
        [f1], [fq] = await frauds_of(s, p1), await frauds_of(s, q)
        assert len(await frauds_of(s, p2)) == 1
        for w in (p1, p2, q):
            assert await status_in_pool(s, w) == "left"
            problem(await join(s, w), 403, "provider_blacklisted")

        r = await reverse(s, f1["id"])
        assert r.status_code == 200, r.text
        assert (r.json()["membership_status"], r.json()["provider_blacklisted"]) == ("left", False)
        r = await reverse(s, fq["id"])
        assert r.status_code == 200, r.text
        assert (r.json()["membership_status"], r.json()["provider_blacklisted"]) == ("left", True)

        [lifted] = await audit_of(s, "pool.unblacklist_provider")
        assert (lifted["target_id"], lifted["pool_id"]) == (p1.contributor.provider_id, s.pool_id)
        assert lifted["actor_role"] == "admin" and lifted["actor"] != "system"
        assert lifted["before"]["blacklisted"] is True and lifted["before"]["created_by"] == "system"
        assert lifted["after"] == {
            "blacklisted": False,
            "reason": f"fraud verdict {f1['id']} reversed on appeal",
        }
        for w in (p1, p2):
            r = await join(s, w)
            assert r.status_code == 201 and r.json()["status"] == "active", r.text
        body = problem(await join(s, q), 403, "provider_blacklisted")
        assert [reason["code"] for reason in body["reasons"]] == ["provider_blacklisted"]
    await books_balance(app_state)


async def test_an_operators_blacklisting_of_a_provider_the_verifier_banned_is_theirs_and_stays(
    app: Any, app_state: Any
) -> None:
    """The operator blacklists a provider the verifier banned already: the entry was left the
    verifier's ("already blacklisted"), so the appeal of one strike lifted the operator's ban
    too. The operator's blacklisting takes the entry over (its reason theirs, audited)."""
    econ = {**ECON, "strikes_before_ejection": 2, "strikes_before_provider_ban": 2}
    async with pool_setup(app, app_state, workers=1, economics=econ, stake=2000) as s:
        [p1] = s.workers
        p2 = await s.add_worker(provider_key=p1.contributor.provider_key, stake=2000)
        for w in (p1, p2):
            await forged(s, w)
        await verify_all(app_state)
        provider = p1.contributor.provider_id
        r = await s.admin.post(
            f"/v1/admin/pools/{s.pool_id}/blacklist",
            json={"provider_id": provider, "reason": "sybil ring"},
            headers=s.headers,
        )
        assert r.status_code == 200, r.text  # it was blacklisted already, by the verifier
        assert r.json()["reason"] == "sybil ring"
        [taken] = [e for e in await audit_of(s, "pool.blacklist_provider") if e["actor"] != "system"]
        assert taken["before"]["created_by"] == "system" and taken["after"]["reason"] == "sybil ring"

        [f1] = await frauds_of(s, p1)
        r = await reverse(s, f1["id"])
        assert r.status_code == 200, r.text
        assert r.json()["provider_blacklisted"] is True
        assert await audit_of(s, "pool.unblacklist_provider") == []
        for w in (p1, p2):
            problem(await join(s, w), 403, "provider_blacklisted")
        # Blacklisting it again changes nothing more.
        again = await s.admin.post(
            f"/v1/admin/pools/{s.pool_id}/blacklist",
            json={"provider_id": provider, "reason": "other"},
            headers=s.headers,
        )
        assert again.status_code == 200 and again.json()["reason"] == "sybil ring", again.text
    await books_balance(app_state)


async def test_an_operators_ejection_of_a_node_the_verifier_ejected_is_theirs_and_stays(
    app: Any, app_state: Any
) -> None:
    """The operator ejects a node the verifier ejected already: that changed nothing, so the
    appeal of the strike lifted the operator's ejection with the verifier's. The operator's
    ejection now makes it theirs (audited), and it stays final."""
    async with pool_setup(app, app_state, workers=1, economics=EJECT_AT_1, stake=2000) as s:
        w = s.workers[0]
        await forged(s, w)
        await verify_all(app_state)
        [f] = await frauds_of(s, w)
        assert await status_in_pool(s, w) == "ejected"
        r = await s.admin.post(
            f"/v1/admin/pools/{s.pool_id}/members/{w.node_id}/eject",
            json={"reason": "caught on our dashboards too"},
            headers=s.headers,
        )
        assert r.status_code == 200 and r.json()["status"] == "ejected", r.text
        taken = [e for e in await audit_of(s, "membership.eject") if e["actor"] != "system"]
        assert [e["after"]["reason"] for e in taken] == ["caught on our dashboards too"]

        r = await reverse(s, f["id"])
        assert r.status_code == 200 and r.json()["membership_status"] == "ejected", r.text
        assert await audit_of(s, "membership.reinstate") == []
        problem(await join(s, w), 403, "node_ejected")
    await books_balance(app_state)


# ------------------------------------------------------------------ rejections reversed are paid


async def provider_balance(w: Any) -> dict[str, int]:
    """The provider's balances as it reads them itself (signed: the clock must not have moved)."""
    r = await w.client.get("/v1/providers/me/balance", auth=w.contributor.provider_auth)
    assert r.status_code == 200, r.text
    return dict(r.json())


async def rejected_right(s: Any, w: Any, app_state: Any, category: str) -> dict[str, Any]:
    """A result of three samples, two of them right (the answer is 4), rejected all the same:
    as fraud for an echoed seed that is not the lease's, or as invalid for a finish reason the
    checks do not take (a sample cut at its length before max_tokens). An acceptance of it would
    have paid its 2 right samples, 14."""
    lease = await one_lease(s, w, n=3)
    wrong: dict[str, Any] = {"seed": lease["seed"] + 1}
    if category == "invalid":
        samples = answer_body(lease, ["4", "5", "4"])["samples"]
        samples[1]["finish_reason"] = "length"  # with fewer tokens than max_tokens
        wrong = {"samples": samples}
    await submit(w, lease, ["4", "5", "4"], **wrong)
    await verify_all(app_state)
    v = (await verdicts(s.admin, s.headers, s.pool_id))[-1]
    assert (v["outcome"], v["category"], v["reward_amount"]) == ("rejected", category, 0)
    return v


@pytest.mark.parametrize("category", ["fraud", "invalid"])
async def test_a_rejection_reversed_on_appeal_pays_the_reward_its_result_was_due_once(
    app: Any, app_state: Any, client: Any, clock: FakeClock, category: str
) -> None:
    """A right answer wrongly rejected: the appeal gives the stake back (fraud) and pays what an
    acceptance would have: 7 for each right sample (2 of 3), into pending, held for the pool's
    reward_hold_s and then claimable, as an accepted result's reward. Before, the node got its
    stake back but never its pay. Reversing it again pays nothing more."""
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000) as s:
        w = s.workers[0]
        v = await rejected_right(s, w, app_state, category)
        b = await provider_balance(w)
        assert (b["rewards_pending"], b["stake_locked"]) == (0, 800 if category == "fraud" else 1000)
        before = await scrape(client)
        r = await reverse(s, v["id"])
        assert r.status_code == 200, r.text
        assert r.json()["reward_paid_on_appeal"] == 14
        assert r.json()["reward_amount"] == 0  # what the verdict credited when it was decided
        b = await provider_balance(w)
        assert (b["rewards_pending"], b["rewards_claimable"], b["stake_locked"]) == (14, 0, 1000)
        assert (await verdicts(s.admin, s.headers, s.pool_id))[-1]["reward_paid_on_appeal"] == 14
        assert await pool_money(s) == (14, 0)
        assert await hold_statuses(app_state) == {w.node_id: ["held"]}
        await books_sound(app_state)

        again = await reverse(s, v["id"], "appeal again")
        assert again.status_code == 200 and again.json()["reward_paid_on_appeal"] == 14
        b = await provider_balance(w)
        assert (b["rewards_pending"], b["stake_locked"]) == (14, 1000)
        paid = "orchestrator_rewards_paid_on_appeal_total"
        assert value(await scrape(client), paid) - value(before, paid) == 14
        async with app_state.sessionmaker() as session:
            actions = (
                await session.scalars(select(AuditEntry.after).where(AuditEntry.action == "verdict.reverse"))
            ).all()
        assert actions == [{"reversed": True, "reason": "appeal", "reward_paid_on_appeal": 14}]

        clock.advance(3590)
        assert await release_once(app_state) == 0  # held to the end of the result's window, 3600 s
        clock.advance(RELEASE_INTERVAL_S)  # the release's next tick
        assert await release_once(app_state) == 1
        b = await balances(client, w)
        assert (b["rewards_pending"], b["rewards_claimable"]) == (0, 14)
        assert await system(app_state) == {"deposits": -1000, "rewards": -14, "slashed": 0}
        await books_balance(app_state)


async def test_a_reward_paid_on_appeal_is_held_and_forfeited_by_a_later_fraud_verdict_as_any(
    app: Any, app_state: Any, client: Any
) -> None:
    """The reward an appeal pays is on hold as an accepted result's: a fraud verdict against the
    node within its window forfeits it, and that verdict's own appeal gives it back."""
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000) as s:
        w = s.workers[0]
        v = await rejected_right(s, w, app_state, "invalid")
        assert (await reverse(s, v["id"])).status_code == 200
        f = await fraud(s, w, app_state)
        assert f["slashed_amount"] == 200 + 14
        assert await hold_statuses(app_state) == {w.node_id: ["forfeited"]}
        assert (await balances(client, w))["rewards_pending"] == 0
        assert (await reverse(s, f["id"])).status_code == 200
        b = await balances(client, w)
        assert (b["rewards_pending"], b["stake_locked"]) == (14, 1000)
        await books_sound(app_state)


async def test_an_appeal_pays_by_the_rate_the_result_was_received_under_after_the_node_left(
    app: Any, app_state: Any, client: Any
) -> None:
    """The rate is the one recorded with the result (the operator raised it since), and a node
    that left the pool is paid into its provider's pending rewards, as any reward after leaving."""
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000) as s:
        w = s.workers[0]
        v = await rejected_right(s, w, app_state, "fraud")
        r = await s.admin.patch(
            f"/v1/admin/pools/{s.pool_id}", json={"economics": {"reward_per_sample": 100}}, headers=s.headers
        )
        assert r.status_code == 200, r.text
        leave = f"/v1/pools/{s.pool_id}/leave"
        assert (await w.client.post(leave, json={}, auth=w.contributor.node_auth)).status_code == 200
        r = await reverse(s, v["id"])
        assert r.status_code == 200, r.text
        assert (r.json()["reward_paid_on_appeal"], r.json()["membership_status"]) == (14, "left")
        b = await provider_balance(w)
        assert (b["rewards_pending"], b["stake_locked"]) == (14, 0)
        assert b["stake_unbonding"] + b["stake_free"] == 1000
        await books_sound(app_state)


async def test_an_appeal_pays_only_what_the_recorded_scores_say_was_right(app: Any, app_state: Any) -> None:
    """A wrong answer (no sample right, as the checks recorded it: the appeal does not score it
    again) is paid nothing on appeal: its appeal changes the track record only."""
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000) as s:
        w = s.workers[0]
        bad = await wrong(s, w, app_state)
        r = await reverse(s, bad["id"])
        assert r.status_code == 200 and r.json()["reward_paid_on_appeal"] == 0
        assert (await provider_balance(w))["rewards_pending"] == 0
        assert await pool_money(s) == (0, 0)


async def test_an_appeal_pays_nothing_for_samples_sent_without_their_text(app: Any, app_state: Any) -> None:
    """A result sent as token ids alone is judged invalid (completion_missing) without being
    scored: nothing knows whether its samples were right. Its appeal pays nothing, as an
    inconclusive verdict's; before, the unscored samples counted as paid (a sample with no
    reward is paid), so the appeal paid every one of them, the check the verdict made skipped."""
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000) as s:
        w = s.workers[0]
        lease = await one_lease(s, w, n=3)
        sample = {"token_ids": [19], "finish_reason": "stop", "prompt_tokens": 10, "completion_tokens": 1}
        await submit(w, lease, ["4", "5", "6"], samples=[sample] * 3)
        await verify_all(app_state)
        [v] = await verdicts(s.admin, s.headers, s.pool_id)
        assert (v["category"], v["reason"]) == ("invalid", "completion_missing")
        r = await reverse(s, v["id"], "the worker SDK sent ids only")
        assert r.status_code == 200, r.text
        assert r.json()["reward_paid_on_appeal"] == 0
        assert (await provider_balance(w))["rewards_pending"] == 0
        assert await pool_money(s) == (0, 0)
        await books_balance(app_state)


@postgres_only
async def test_two_appeals_of_one_rejection_at_once_pay_its_reward_once(
    app: Any, app_state: Any, client: Any
) -> None:
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000) as s:
        w = s.workers[0]
        v = await rejected_right(s, w, app_state, "fraud")
        async with app_state.sessionmaker() as session, session.begin():
            await session.execute(select(Verdict).where(Verdict.id == v["id"]).with_for_update())
            appeals = [asyncio.create_task(reverse(s, v["id"])) for _ in range(2)]
            await until_waiting(app_state, 2, *appeals, on="row")
        answers = [await a for a in appeals]
        assert [a.status_code for a in answers] == [200, 200]
        assert [a.json()["reward_paid_on_appeal"] for a in answers] == [14, 14]
        b = await provider_balance(w)
        assert (b["rewards_pending"], b["stake_locked"]) == (14, 1000)
        assert await hold_statuses(app_state) == {w.node_id: ["held"]}
        await books_sound(app_state)


# ------------------------------------------------------------------ what is paid on appeal follows the result's window


async def result_decided_ago(app_state: Any, verdict_id: int, seconds: int) -> None:
    """Date the verdict back, as if it had been decided ``seconds`` ago (the tests cannot move
    the server's clock far: the workers' signatures would fall outside its window)."""
    async with app_state.sessionmaker() as session, session.begin():
        verdict = await session.get(Verdict, verdict_id)
        assert verdict is not None
        verdict.decided_at -= dt.timedelta(seconds=seconds)


async def appeal_audit(app_state: Any) -> list[Any]:
    async with app_state.sessionmaker() as session:
        return list(
            (
                await session.scalars(
                    select(AuditEntry.after)
                    .where(AuditEntry.action == "verdict.reverse")
                    .order_by(AuditEntry.id)
                )
            ).all()
        )


@pytest.mark.parametrize("category", ["fraud", "invalid"])
async def test_an_appeal_pays_what_a_fraud_verdict_within_the_results_own_window_forfeits_to_it(
    app: Any, app_state: Any, client: Any, category: str
) -> None:
    """R is rejected (wrongly) at t0; a fraud verdict F against the node follows within R's hold
    window; then R's appeal. Had R been accepted at t0, F would have forfeited its reward: the
    appeal pays it and F forfeits it at once, in the ledger as F's forfeit of any reward on hold
    (F's appeal gives it back). Before, the payment was held from the appeal, after F, and the
    node kept a reward the rules forfeit."""
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000) as s:
        w = s.workers[0]
        v = await rejected_right(s, w, app_state, category)
        f = await fraud(s, w, app_state)
        assert f["slashed_amount"] == 200  # nothing of R's on hold yet
        r = await reverse(s, v["id"], "the checks were wrong")
        assert r.status_code == 200, r.text
        b = await balances(client, w)
        assert (b["rewards_pending"], b["rewards_claimable"]) == (0, 0)
        body = r.json()
        assert (body["reward_paid_on_appeal"], body["reward_forfeited_by"]) == (14, f["id"])
        assert await hold_statuses(app_state) == {w.node_id: ["forfeited"]}
        assert (await appeal_audit(app_state))[-1]["reward_forfeited_by"] == f["id"]
        assert await pool_money(s) == (14, 200 + 14)  # as F's slash of R's reward had R been accepted
        listed = {x["id"]: x for x in await verdicts(s.admin, s.headers, s.pool_id)}
        assert listed[v["id"]]["reward_forfeited_by"] == f["id"]
        async with app_state.sessionmaker() as session:
            reasons = (
                await session.scalars(
                    select(LedgerTransfer.reason).where(
                        LedgerTransfer.reference_type == "verdict",
                        LedgerTransfer.reference_id == str(f["id"]),
                    )
                )
            ).all()
        assert sorted(reasons) == ["slash_pending_rewards", "slash_stake"]
        await books_sound(app_state)

        # F was wrong too: its appeal gives the forfeited payment back, as any forfeit of F's.
        r = await reverse(s, f["id"])
        assert r.status_code == 200, r.text
        b = await balances(client, w)
        assert (b["rewards_pending"], b["stake_locked"]) == (14, 1000)
        assert await hold_statuses(app_state) == {w.node_id: ["held"]}
        assert await pool_money(s) == (14, 0)
        await books_sound(app_state)


async def decided_at(app_state: Any, verdict_id: int) -> dt.datetime:
    async with app_state.sessionmaker() as session:
        verdict = await session.get(Verdict, verdict_id)
        assert verdict is not None
        return verdict.decided_at


@pytest.mark.parametrize("fraud_id", ["lower", "higher"])
async def test_the_window_of_a_payment_is_by_when_verdicts_were_written_not_by_their_decided_at(
    app: Any, app_state: Any, client: Any, fraud_id: str
) -> None:
    """A verdict's ``decided_at`` is its batch's clock when the batch began, before it waited for
    the node's membership lock, under which every verdict that moves the node's money is written
    and takes its id: a batch that began earlier may write later. A fraud verdict F forfeits the
    holds that exist when it is written (test_feed_changes'
    test_a_rollout_is_withdrawn_exactly_when_the_fraud_verdict_forfeited_its_reward), so an
    acceptance of R would have lost its reward to F only if F was written after R. Constructed
    here with F written before R but dated 5 s after it, or written after R but dated 5 s before
    it. Before, the window went by ``decided_at``: the first F took all 14 of R's payment, and
    the second was left out (the node kept 14)."""
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000) as s:
        w = s.workers[0]
        if fraud_id == "lower":
            f = await fraud(s, w, app_state)
            v = await rejected_right(s, w, app_state, "invalid")
            await result_decided_ago(app_state, v["id"], 5)  # R dated before F
        else:
            v = await rejected_right(s, w, app_state, "invalid")
            f = await fraud(s, w, app_state)
            await result_decided_ago(app_state, f["id"], 5)  # F dated before R
        written_after = f["id"] > v["id"]
        assert written_after == (fraud_id == "higher")
        dated_after = await decided_at(app_state, f["id"]) > await decided_at(app_state, v["id"])
        assert dated_after != written_after
        r = await reverse(s, v["id"])
        assert r.status_code == 200, r.text
        b = await balances(client, w)
        if written_after:
            assert r.json()["reward_forfeited_by"] == f["id"]
            assert b["rewards_pending"] == 0, b
            assert await forfeits_of_payment(app_state, v["id"]) == [(f["id"], 14, "forfeited")]
        else:
            assert r.json()["reward_forfeited_by"] is None
            assert b["rewards_pending"] == 14, b
            assert await forfeits_of_payment(app_state, v["id"]) == []
        await books_sound(app_state)


async def test_a_payment_whose_results_window_passed_is_due_at_once_and_no_later_fraud_takes_it(
    app: Any, app_state: Any, client: Any
) -> None:
    """R's hold window ended before its appeal: had R been accepted, its reward would be
    claimable by now, and no fraud verdict decided after the window could take it. The appeal's
    payment is due at once (the release loop's next tick makes it claimable) and a fraud
    verdict after the appeal leaves it alone. Before, it was held a whole reward_hold_s from the
    appeal, and that fraud verdict forfeited it: an honest node lost more than under a right
    first verdict."""
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000) as s:
        w = s.workers[0]
        v = await rejected_right(s, w, app_state, "invalid")
        await result_decided_ago(app_state, v["id"], 3600 + 10)
        r = await reverse(s, v["id"])
        assert r.status_code == 200, r.text
        f = await fraud(s, w, app_state)
        assert f["slashed_amount"] == 200  # the stake only: R's reward was out of its window
        assert await hold_statuses(app_state) == {w.node_id: ["held"]}
        assert await release_once(app_state) == 1  # due: no wait for a window from the appeal
        b = await balances(client, w)
        assert (b["rewards_pending"], b["rewards_claimable"]) == (0, 14)
        assert await pool_money(s) == (14, 200)
        assert (r.json()["reward_paid_on_appeal"], r.json()["reward_forfeited_by"]) == (14, None)
        await books_sound(app_state)


async def test_a_payment_is_held_to_the_end_of_the_results_own_window_not_the_appeals(
    app: Any, app_state: Any, client: Any, clock: FakeClock
) -> None:
    """Appealed 3000 s after its rejection, R's payment is held for the 600 s left of R's
    window, as its reward would have been, not 3600 s from the appeal."""
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000) as s:
        w = s.workers[0]
        v = await rejected_right(s, w, app_state, "invalid")
        await result_decided_ago(app_state, v["id"], 3000)
        assert (await reverse(s, v["id"])).status_code == 200
        clock.advance(590)
        assert await release_once(app_state) == 0
        clock.advance(RELEASE_INTERVAL_S)
        assert await release_once(app_state) == 1
        b = await balances(client, w)
        assert (b["rewards_pending"], b["rewards_claimable"]) == (0, 14)
        await books_balance(app_state)


@pytest.mark.parametrize("first_reversed", ["after_the_second", "before_the_second"])
async def test_of_two_fraud_verdicts_in_the_window_the_one_that_would_have_held_the_reward_forfeits_it(
    app: Any, app_state: Any, client: Any, clock: FakeClock, first_reversed: str
) -> None:
    """F1 and F2, fraud verdicts in R's window; F1 reversed since. Had R been accepted, F1
    forfeited its reward; F2 took nothing if F1 still held it when F2 was decided (F1's appeal
    then gave it back: the node keeps it), and all of it if F1 had been reversed before. The
    appeal pays as that would have."""
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000) as s:
        w = s.workers[0]
        v = await rejected_right(s, w, app_state, "invalid")
        clock.advance(1)
        f1 = await fraud(s, w, app_state)
        clock.advance(1)
        if first_reversed == "before_the_second":
            assert (await reverse(s, f1["id"])).status_code == 200
            clock.advance(1)
        f2 = await fraud(s, w, app_state)
        clock.advance(1)
        if first_reversed == "after_the_second":
            assert (await reverse(s, f1["id"])).status_code == 200
        r = await reverse(s, v["id"])
        assert r.status_code == 200, r.text
        b = await balances(client, w)
        if first_reversed == "after_the_second":
            assert b["rewards_pending"] == 14
            assert await hold_statuses(app_state) == {w.node_id: ["held"]}
            assert r.json()["reward_forfeited_by"] is None
        else:
            assert b["rewards_pending"] == 0
            assert await hold_statuses(app_state) == {w.node_id: ["forfeited"]}
            assert r.json()["reward_forfeited_by"] == f2["id"]
        await books_sound(app_state)


async def _rejected_then_a_fraud_reversed(
    s: Any, w: Any, app_state: Any, clock: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    """R rejected (wrongly), a second later fraud F1, reversed on appeal 10 s after; R's and
    F1's verdicts."""
    v: dict[str, Any] = await rejected_right(s, w, app_state, "invalid")
    clock.advance(1)
    f1: dict[str, Any] = await fraud(s, w, app_state)
    clock.advance(10)
    assert (await reverse(s, f1["id"])).status_code == 200
    return v, f1


async def test_a_fraud_verdict_written_after_an_earlier_appeal_but_dated_before_it_takes_the_payment(
    app: Any, app_state: Any, client: Any, clock: FakeClock
) -> None:
    """R rejected (wrongly), then fraud verdict F1 in R's window, F1 reversed on appeal, then
    fraud verdict F2, written after that appeal but dated 1 s before it (its batch began first
    and waited for the node's lock). Had R been accepted, F1 forfeited its reward, F1's appeal
    gave it back, and F2, written after, forfeited it: R's appeal pays 14 and F2 takes it all.
    Before, the reversal had no place in the write order and its ``reversed_at`` placed it after
    every verdict dated no later, F2 too: F2 found F1 holding the reward and took nothing, and
    the node kept 14."""
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000) as s:
        w = s.workers[0]
        v, f1 = await _rejected_then_a_fraud_reversed(s, w, app_state, clock)
        clock.advance(1)
        f2 = await fraud(s, w, app_state)
        await result_decided_ago(app_state, f2["id"], 2)  # dated 1 s before F1's appeal
        async with app_state.sessionmaker() as session:
            appealed_at = await session.scalar(select(Verdict.reversed_at).where(Verdict.id == f1["id"]))
        assert appealed_at is not None and await decided_at(app_state, f2["id"]) < appealed_at
        assert v["id"] < f1["id"] < f2["id"]
        r = await reverse(s, v["id"])
        assert r.status_code == 200, r.text
        assert (r.json()["reward_paid_on_appeal"], r.json()["reward_forfeited_by"]) == (14, f2["id"])
        b = await balances(client, w)
        assert (b["rewards_pending"], b["rewards_claimable"]) == (0, 0), b
        assert await forfeits_of_payment(app_state, v["id"]) == [(f2["id"], 14, "forfeited")]
        assert await hold_statuses(app_state) == {w.node_id: ["forfeited"]}
        await books_sound(app_state)
        # F2 was wrong too: its appeal gives the payment back.
        assert (await reverse(s, f2["id"])).status_code == 200
        assert (await balances(client, w))["rewards_pending"] == 14
        await books_sound(app_state)


async def test_fraud_verdicts_in_the_window_take_the_payment_in_the_order_they_were_written(
    app: Any, app_state: Any, client: Any, clock: FakeClock
) -> None:
    """Fa and Fb, fraud verdicts in R's window, written in that order but Fb dated 5 s before
    Fa (its batch began first and waited for the node's lock); Fa reversed since. Had R been
    accepted, Fa forfeited its reward when it was written, Fb found nothing on hold, and Fa's
    appeal gave it back: the node keeps it. Before, the replay went by ``decided_at``: Fb took
    all 14 and held it."""
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000) as s:
        w = s.workers[0]
        v = await rejected_right(s, w, app_state, "invalid")
        clock.advance(10)
        fa = await fraud(s, w, app_state)
        fb = await fraud(s, w, app_state)
        await result_decided_ago(app_state, fb["id"], 5)  # Fb dated between R and Fa
        assert v["id"] < fa["id"] < fb["id"]
        assert await decided_at(app_state, v["id"]) < await decided_at(app_state, fb["id"])
        assert await decided_at(app_state, fb["id"]) < await decided_at(app_state, fa["id"])
        clock.advance(1)
        assert (await reverse(s, fa["id"])).status_code == 200
        r = await reverse(s, v["id"])
        assert r.status_code == 200, r.text
        b = await balances(client, w)
        assert b["rewards_pending"] == 14, b
        assert r.json()["reward_forfeited_by"] is None
        assert await forfeits_of_payment(app_state, v["id"]) == []
        assert await hold_statuses(app_state) == {w.node_id: ["held"]}
        await books_sound(app_state)


async def appeal_racing_the_verifier(s: Any, app_state: Any, w: Any, verdict_id: int, first: str) -> Any:
    """The appeal of ``verdict_id`` and a verifier pass wait for the node's provider's pending
    rewards account at once (a transaction holds it), the one named ``first`` queued first;
    the appeal's answer once both are done."""
    pending = provider_account(w.contributor.provider_id, ProviderAccount.rewards_pending)
    async with app_state.sessionmaker() as session:
        await session.begin()
        await ledger.lock_accounts(session, [pending])
        if first == "appeal":
            appeal = asyncio.create_task(reverse(s, verdict_id))
            await until_waiting(app_state, 1, appeal, on="row")
            verdict = asyncio.create_task(verify_all(app_state))
            await until_waiting(app_state, 2, appeal, verdict, on="row")
        else:
            verdict = asyncio.create_task(verify_all(app_state))
            await until_waiting(app_state, 1, verdict, on="row")
            appeal = asyncio.create_task(reverse(s, verdict_id))
            await until_waiting(app_state, 2, appeal, verdict, on="row")
        assert not appeal.done() and not verdict.done()
        await session.commit()
    r = await appeal
    await verdict
    return r


@postgres_only
@pytest.mark.parametrize("first", ["appeal", "fraud"])
async def test_an_appeal_racing_a_fraud_verdict_in_the_window_is_forfeited_once(
    app: Any, app_state: Any, client: Any, first: str
) -> None:
    """R's appeal and a fraud verdict against the node wait for the provider's accounts at once:
    whichever commits first, the payment is forfeited exactly once (by the verdict if the appeal
    paid first, by the appeal if the verdict was there first), never paid and never taken twice."""
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000) as s:
        w = s.workers[0]
        v = await rejected_right(s, w, app_state, "invalid")
        await submit(w, await one_lease(s, w), ["5"], claimed_reward=1.0)  # to be judged fraud
        r = await appeal_racing_the_verifier(s, app_state, w, v["id"], first)
        assert r.status_code == 200, r.text
        f = (await verdicts(s.admin, s.headers, s.pool_id))[-1]
        assert f["category"] == "fraud"
        b = await balances(client, w)
        assert (b["rewards_pending"], b["rewards_claimable"]) == (0, 0)
        assert await hold_statuses(app_state) == {w.node_id: ["forfeited"]}
        assert await system(app_state) == {"deposits": -1000, "rewards": -14, "slashed": 200 + 14}
        assert await pool_money(s) == (14, 200 + 14)
        async with app_state.sessionmaker() as session:
            forfeits = (await session.scalars(select(RewardForfeit.verdict_id))).all()
        assert forfeits == [f["id"]]
        await books_sound(app_state)


# ------------------------------------------------------------------ soft penalties of the result's window


async def forfeits_of_payment(app_state: Any, verdict_id: int) -> list[tuple[int, int, str]]:
    """(forfeiting verdict, amount, status) of each forfeit of what the appeal of ``verdict_id`` paid."""
    async with app_state.sessionmaker() as session:
        rows = await session.execute(
            select(RewardForfeit.verdict_id, RewardForfeit.amount, RewardForfeit.status)
            .join(RewardHold, RewardHold.id == RewardForfeit.hold_id)
            .where(RewardHold.verdict_id == verdict_id)
            .order_by(RewardForfeit.id)
        )
        return [(int(v), int(a), str(st)) for v, a, st in rows.all()]


@pytest.mark.parametrize("category", ["fraud", "invalid"])
async def test_a_soft_invalid_penalty_in_the_results_window_takes_from_what_its_appeal_pays(
    app: Any, app_state: Any, client: Any, category: str
) -> None:
    """R is rejected (wrongly) at t0; an invalid verdict I with a soft penalty of 5 follows in R's
    window, while the node has nothing on hold (its penalty takes nothing). Had R been accepted,
    I's penalty would have taken 5 of R's reward on hold: the appeal pays 14 of which 5 is
    forfeited to I at once, as I's own forfeit, which I's appeal gives back. Before, the appeal
    paid the whole 14."""
    econ = {**ECON, "soft_invalid_penalty": 5}
    async with pool_setup(app, app_state, workers=1, economics=econ, stake=1000) as s:
        w = s.workers[0]
        v = await rejected_right(s, w, app_state, category)
        i = await rejected_right(s, w, app_state, "invalid")
        assert i["slashed_amount"] == 0  # nothing on hold
        r = await reverse(s, v["id"])
        assert r.status_code == 200, r.text
        assert (r.json()["reward_paid_on_appeal"], r.json()["reward_forfeited_by"]) == (14, None)
        b = await balances(client, w)
        assert b["rewards_pending"] == 14 - 5, b
        assert await forfeits_of_payment(app_state, v["id"]) == [(i["id"], 5, "forfeited")]
        assert await hold_statuses(app_state) == {w.node_id: ["held"]}
        assert await pool_money(s) == (14, 5)
        async with app_state.sessionmaker() as session:
            reasons = (
                await session.scalars(
                    select(LedgerTransfer.reason).where(
                        LedgerTransfer.reference_type == "verdict",
                        LedgerTransfer.reference_id == str(i["id"]),
                    )
                )
            ).all()
        assert reasons == ["soft_invalid_penalty"]
        await books_sound(app_state)

        # I was wrong too: its appeal gives the 5 back, and pays I's own reward (14).
        r = await reverse(s, i["id"])
        assert r.status_code == 200, r.text
        b = await balances(client, w)
        assert b["rewards_pending"] == 14 + 14, b
        assert await forfeits_of_payment(app_state, v["id"]) == [(i["id"], 5, "restored")]
        assert await pool_money(s) == (28, 0)
        await books_sound(app_state)


@pytest.mark.parametrize("penalty", [5, 10])
async def test_a_penalty_takes_from_the_appeals_payment_as_from_the_oldest_reward_on_hold(
    app: Any, app_state: Any, client: Any, penalty: int
) -> None:
    """R is rejected (wrongly), an honest result H is accepted (7 on hold), then an invalid
    verdict I's penalty takes from H: all it asked (5 of 7), or 7 of 10. Had R been accepted,
    its reward would have been the oldest on hold and I would have taken its penalty from it,
    none of H's. The appeal of R pays 14, I takes its penalty of it and gives back what it took of
    H: the node ends with 21 less the penalty, as it would have, held as it would have been.
    (Before, I took only what it lacked, 0 or 3, and H's reward stayed forfeited; the same total,
    until H's verdict is reversed: see the test after the next.)"""
    econ = {**ECON, "soft_invalid_penalty": penalty}
    async with pool_setup(app, app_state, workers=1, economics=econ, stake=1000) as s:
        w = s.workers[0]
        v = await rejected_right(s, w, app_state, "invalid")
        h = await honest(s, w, app_state)
        i = await rejected_right(s, w, app_state, "invalid")
        assert i["slashed_amount"] == min(penalty, 7)
        r = await reverse(s, v["id"])
        assert r.status_code == 200, r.text
        b = await balances(client, w)
        assert b["rewards_pending"] == 7 + 14 - penalty, b
        assert await forfeits_of_payment(app_state, v["id"]) == [(i["id"], penalty, "forfeited")]
        assert await forfeits_of_payment(app_state, h["id"]) == [(i["id"], min(penalty, 7), "restored")]
        assert await hold_statuses(app_state) == {w.node_id: ["held", "held"]}
        assert await pool_money(s) == (7 + 14, penalty)
        await books_sound(app_state)


async def test_a_penalty_takes_what_it_lacked_from_the_older_of_two_appeals_payments(
    app: Any, app_state: Any, client: Any
) -> None:
    """R1 and R2 are rejected (wrongly), then I's penalty of 5 finds nothing on hold. Had both
    been accepted, I would have taken its 5 from R1's reward, the older. Appealed, R2 first, each
    pays 14: I takes its 5 from R2's payment, then R1's appeal takes it from R1's and gives back
    R2's: 5 in all, from the reward the rules take it from, whichever is appealed first. (Before,
    the first appealed paid it.)"""
    econ = {**ECON, "soft_invalid_penalty": 5}
    async with pool_setup(app, app_state, workers=1, economics=econ, stake=1000) as s:
        w = s.workers[0]
        v1 = await rejected_right(s, w, app_state, "invalid")
        v2 = await rejected_right(s, w, app_state, "invalid")
        i = await rejected_right(s, w, app_state, "invalid")
        r = await reverse(s, v2["id"])
        assert r.status_code == 200, r.text
        assert await forfeits_of_payment(app_state, v2["id"]) == [(i["id"], 5, "forfeited")]
        assert (await balances(client, w))["rewards_pending"] == 14 - 5
        r = await reverse(s, v1["id"])
        assert r.status_code == 200, r.text
        assert await forfeits_of_payment(app_state, v2["id"]) == [(i["id"], 5, "restored")]
        assert await forfeits_of_payment(app_state, v1["id"]) == [(i["id"], 5, "forfeited")]
        b = await balances(client, w)
        assert b["rewards_pending"] == 28 - 5, b
        assert await pool_money(s) == (28, 5)
        await books_sound(app_state)
        # I's appeal gives back the 5 it holds (R1's), once.
        assert (await reverse(s, i["id"])).status_code == 200
        assert (await balances(client, w))["rewards_pending"] == 28 + 14
        assert await pool_money(s) == (42, 0)
        await books_sound(app_state)


async def test_a_penalty_then_a_fraud_verdict_in_the_window_take_the_payment_in_their_order(
    app: Any, app_state: Any, client: Any
) -> None:
    """R rejected (wrongly), then I (penalty 5, nothing on hold), then a fraud verdict F, all in
    R's window. Had R been accepted, I would have taken 5 of its reward and F the other 9: the
    appeal's payment goes so, F named as reward_forfeited_by; F's appeal gives its 9 back, I's
    its 5. The appeal's answer and audit entry show I's part too (reward_penalised), restored
    once I's appeal gave it back; a verdict with nothing for penalties to take shows none.
    (Before, I's part showed only in the ledger and in reward_forfeits.)"""
    econ = {**ECON, "soft_invalid_penalty": 5}
    async with pool_setup(app, app_state, workers=1, economics=econ, stake=1000) as s:
        w = s.workers[0]
        v = await rejected_right(s, w, app_state, "invalid")
        i = await rejected_right(s, w, app_state, "invalid")
        f = await fraud(s, w, app_state)
        r = await reverse(s, v["id"])
        assert r.status_code == 200, r.text
        body = r.json()
        assert (body["reward_paid_on_appeal"], body["reward_forfeited_by"]) == (14, f["id"])
        assert body["reward_penalised"] == [{"verdict_id": i["id"], "amount": 5, "status": "forfeited"}]
        assert (await appeal_audit(app_state))[-1]["reward_penalised"] == [
            {"verdict_id": i["id"], "amount": 5}
        ]
        assert await forfeits_of_payment(app_state, v["id"]) == [
            (i["id"], 5, "forfeited"),
            (f["id"], 9, "forfeited"),
        ]
        assert await hold_statuses(app_state) == {w.node_id: ["forfeited"]}
        assert await pool_money(s) == (14, 5 + 200 + 9)
        await books_sound(app_state)
        r = await reverse(s, f["id"])
        assert r.status_code == 200, r.text
        assert r.json()["reward_penalised"] == []
        assert "reward_penalised" not in (await appeal_audit(app_state))[-1]
        assert (await balances(client, w))["rewards_pending"] == 9
        assert await pool_money(s) == (14, 5)
        r = await reverse(s, i["id"])
        assert r.status_code == 200, r.text
        # I's appeal: its 5 back, and I's own reward (its window holds no standing verdict).
        assert (await balances(client, w))["rewards_pending"] == 14 + 14
        assert await pool_money(s) == (28, 0)
        await books_sound(app_state)
        again = (await reverse(s, v["id"])).json()
        assert again["reward_penalised"] == [{"verdict_id": i["id"], "amount": 5, "status": "restored"}]


async def test_a_penalty_after_the_appeal_takes_from_the_payment_first_as_from_the_older_reward(
    app: Any, app_state: Any, client: Any
) -> None:
    """R is rejected (wrongly) and H accepted at the same instant (their holds end together: R's
    decided first), R's appeal pays 14, then I's penalty of 5. Had R been accepted, its reward's
    hold would have come first, and I would have taken 5 of it, none of H's: so it does now, and
    reversing H leaves the node 9. Before, the oldest-first order broke the tie by the hold's id,
    which the appeal's hold takes when it pays: I took H's, and reversing H left the node 14."""
    econ = {**ECON, "soft_invalid_penalty": 5}
    async with pool_setup(app, app_state, workers=1, economics=econ, stake=1000) as s:
        w = s.workers[0]
        v = await rejected_right(s, w, app_state, "invalid")
        h = await honest(s, w, app_state)
        assert await decided_at(app_state, v["id"]) == await decided_at(app_state, h["id"])
        assert (await reverse(s, v["id"])).status_code == 200
        i = await rejected_right(s, w, app_state, "invalid")
        assert i["slashed_amount"] == 5
        assert await forfeits_of_payment(app_state, v["id"]) == [(i["id"], 5, "forfeited")]
        assert (await reverse(s, h["id"])).status_code == 200
        b = await balances(client, w)
        assert (b["rewards_pending"], b["rewards_claimable"]) == (9, 0), b
        await books_sound(app_state)


async def test_what_a_penalty_gives_back_of_a_released_reward_goes_to_claimable(
    app: Any, app_state: Any, client: Any, clock: FakeClock
) -> None:
    """R rejected (wrongly), H accepted, then I's penalty of 5 takes 5 of H; the window passes and
    H's 2 left is released. R's appeal pays 14 (due at once), I takes its 5 of it (R's reward
    would have been on hold first) and gives back what it took of H to claimable, where H's
    reward is now; reversing H then takes H's 7 from there: the node keeps 9 claimable, as it
    would have. Before, I took nothing of the payment and reversing H left the node 14."""
    econ = {**ECON, "soft_invalid_penalty": 5}
    async with pool_setup(app, app_state, workers=1, economics=econ, stake=1000) as s:
        w = s.workers[0]
        v = await rejected_right(s, w, app_state, "invalid")
        h = await honest(s, w, app_state)
        i = await rejected_right(s, w, app_state, "invalid")
        assert i["slashed_amount"] == 5
        for verdict in (v, h, i):
            await result_decided_ago(app_state, verdict["id"], 3600 + 10)
        async with app_state.sessionmaker() as session, session.begin():
            for hold in (await session.scalars(select(RewardHold))).all():
                hold.release_at -= dt.timedelta(seconds=3600 + 10)
        clock.advance(RELEASE_INTERVAL_S)
        assert await release_once(app_state) == 1  # H's 2
        r = await reverse(s, v["id"])
        assert r.status_code == 200, r.text
        assert await forfeits_of_payment(app_state, v["id"]) == [(i["id"], 5, "forfeited")]
        assert await forfeits_of_payment(app_state, h["id"]) == [(i["id"], 5, "restored")]
        b = await balances(client, w)
        assert (b["rewards_pending"], b["rewards_claimable"]) == (9, 7), b
        await books_sound(app_state)
        clock.advance(RELEASE_INTERVAL_S)
        assert await release_once(app_state) == 1  # the payment, due at once
        assert (await reverse(s, h["id"])).status_code == 200
        b = await balances(client, w)
        assert (b["rewards_pending"], b["rewards_claimable"]) == (0, 9), b
        assert await pool_money(s) == (14, 5)
        await books_balance(app_state)


@pytest.mark.parametrize("f_dated", ["after_i", "before_i"])
async def test_a_penalty_keeps_what_it_took_of_a_reward_a_later_fraud_verdict_would_have_forfeited(
    app: Any, app_state: Any, client: Any, clock: FakeClock, f_dated: str
) -> None:
    """R rejected (wrongly), H accepted, I's penalty of 5 takes 5 of H, then a fraud verdict F
    forfeits H's other 2. Had R been accepted, I would have taken its 5 of R's reward and F all
    the rest, H's 7 included: the node keeps nothing. The appeal's payment goes 5 to I and 9 to
    F, and I's 5 of H is not given back (F would have taken it): the node keeps 0, not 5.
    The same when F, written after I, is dated before it (its batch began first and waited for
    the node's lock): the money followed the write order. Before, that F was replayed before I:
    it took all 14 of the payment and I none."""
    econ = {**ECON, "soft_invalid_penalty": 5}
    async with pool_setup(app, app_state, workers=1, economics=econ, stake=1000) as s:
        w = s.workers[0]
        v = await rejected_right(s, w, app_state, "invalid")
        clock.advance(10)
        h = await honest(s, w, app_state)
        clock.advance(10)
        i = await rejected_right(s, w, app_state, "invalid")
        clock.advance(10)
        f = await fraud(s, w, app_state)
        if f_dated == "before_i":
            await result_decided_ago(app_state, f["id"], 15)  # between H and I
            assert await decided_at(app_state, f["id"]) < await decided_at(app_state, i["id"])
        r = await reverse(s, v["id"])
        assert r.status_code == 200, r.text
        assert await forfeits_of_payment(app_state, v["id"]) == [
            (i["id"], 5, "forfeited"),
            (f["id"], 9, "forfeited"),
        ]
        # I's 5 of H is F's now (F would have taken it): F's appeal gives it back.
        assert await forfeits_of_payment(app_state, h["id"]) == [
            (i["id"], 5, "restored"),
            (f["id"], 7, "forfeited"),
        ]
        b = await balances(client, w)
        assert (b["rewards_pending"], b["rewards_claimable"]) == (0, 0), b
        assert await pool_money(s) == (7 + 14, 5 + 5 + 200 + 2 + 9)
        await books_sound(app_state)


async def test_a_fraud_verdict_that_would_have_taken_what_a_penalty_keeps_gives_it_back_on_its_appeal(
    app: Any, app_state: Any, client: Any
) -> None:
    """As above (R rejected wrongly, H accepted, I's penalty of 5 takes 5 of H, F forfeits H's
    other 2, R's appeal pays 14: 5 to I, 9 to F), and then F was wrong too. Had R been accepted,
    I would have taken its 5 of R's reward and F everything else on hold, H's 7 included, which
    F's appeal would have given back with R's 9: the node keeps 16. The 5 of H that I keeps on
    R's appeal (F would have taken it) is F's now, which F's appeal gives back. Before, I kept
    it: I had taken 10 for a penalty of 5, and the node kept 11."""
    econ = {**ECON, "soft_invalid_penalty": 5}
    async with pool_setup(app, app_state, workers=1, economics=econ, stake=1000) as s:
        w = s.workers[0]
        v = await rejected_right(s, w, app_state, "invalid")
        h = await honest(s, w, app_state)
        i = await rejected_right(s, w, app_state, "invalid")
        f = await fraud(s, w, app_state)
        r = await reverse(s, v["id"])
        assert r.status_code == 200, r.text
        assert await forfeits_of_payment(app_state, h["id"]) == [
            (i["id"], 5, "restored"),
            (f["id"], 7, "forfeited"),
        ]
        b = await balances(client, w)
        assert (b["rewards_pending"], b["rewards_claimable"]) == (0, 0), b
        assert await pool_money(s) == (7 + 14, 5 + 200 + 7 + 9)
        await books_sound(app_state)

        r = await reverse(s, f["id"])
        assert r.status_code == 200, r.text
        b = await balances(client, w)
        assert (b["rewards_pending"], b["rewards_claimable"]) == (9 + 7, 0), b
        assert await pool_money(s) == (7 + 14, 5)
        await books_sound(app_state)


async def test_a_penaltys_part_that_a_reversed_fraud_verdict_held_past_a_later_one_goes_back_to_the_node(
    app: Any, app_state: Any, client: Any
) -> None:
    """R rejected (wrongly), H accepted, I's penalty of 5 takes 5 of H, a fraud verdict G takes
    H's other 2, a fraud verdict F finds nothing on hold, G's appeal gives H's 2 back; then R's
    appeal. Had R been accepted, I would have taken 5 of R's reward, G the rest and H's 7, F
    nothing, and G's appeal given those 16 back: the node keeps 16. R's appeal gives back I's 5
    of H, which only G (reversed) would have taken. Before, it was kept (F stands, and was
    decided within H's window): the node kept 11."""
    econ = {**ECON, "soft_invalid_penalty": 5}
    async with pool_setup(app, app_state, workers=1, economics=econ, stake=1000) as s:
        w = s.workers[0]
        v = await rejected_right(s, w, app_state, "invalid")
        h = await honest(s, w, app_state)
        i = await rejected_right(s, w, app_state, "invalid")
        g = await fraud(s, w, app_state)
        f = await fraud(s, w, app_state)
        assert (g["slashed_amount"], f["slashed_amount"]) == (200 + 2, 200)
        assert (await reverse(s, g["id"])).status_code == 200
        r = await reverse(s, v["id"])
        assert r.status_code == 200, r.text
        assert await forfeits_of_payment(app_state, v["id"]) == [(i["id"], 5, "forfeited")]
        assert await forfeits_of_payment(app_state, h["id"]) == [
            (i["id"], 5, "restored"),
            (g["id"], 2, "restored"),
        ]
        b = await balances(client, w)
        assert (b["rewards_pending"], b["rewards_claimable"]) == (7 + 9, 0), b
        assert await pool_money(s) == (7 + 14, 5 + 200)
        await books_sound(app_state)


async def _penalised_in_another_lane(s: Any, w: Any, app_state: Any, partition: int) -> dict[str, Any]:
    """R rejected (wrongly), H accepted (7), then a result I with one of its 3 samples cut by its
    length (the pool's soft-invalid penalty) sent and left undecided, its verification job in
    ``partition``'s verifier lane; R's verdict."""
    v: dict[str, Any] = await rejected_right(s, w, app_state, "invalid")
    await honest(s, w, app_state)
    lease = await one_lease(s, w, n=3)
    samples = answer_body(lease, ["4", "5", "4"])["samples"]
    samples[1]["finish_reason"] = "length"
    await submit(w, lease, ["4", "5", "4"], samples=samples)
    async with app_state.sessionmaker() as session, session.begin():
        await session.execute(update(VerificationJob).values(verifier_partition=partition))
    return v


@postgres_only
async def test_an_appeal_locks_up_front_the_slashed_account_of_a_penalty_it_gives_back_from(
    app: Any, app_state: Any, client: Any
) -> None:
    """R rejected (wrongly), H accepted (7), then I's penalty of 10 takes H's 7, I decided in
    another verifier partition's lane (a quorum's task is decided in the lane of the provider
    whose result completed it), into that partition's slashed account. R's appeal gives H's 7
    back from there. A verifier lane of that partition holds its slashed account and then asks
    for the provider's pending rewards, in the global order (by id). The appeal must take that
    slashed account with the rest, up front: before, it took it only at the give-back, while it
    held the provider's pending rewards, and the two deadlocked (PostgreSQL aborted one)."""
    econ = {**ECON, "soft_invalid_penalty": 10}
    async with pool_setup(app, app_state, workers=1, economics=econ, stake=1000) as s:
        w = s.workers[0]
        provider = w.contributor.provider_id
        other = next(p for p in range(1, service.PARTITIONS) if p != service.partition_of(provider))
        slashed_there = system_account(SystemAccount.slashed, other)
        async with app_state.sessionmaker() as session, session.begin():
            # The other partition's slashed account is older than the provider's reward accounts.
            await ledger.account_id(session, slashed_there)
        v = await _penalised_in_another_lane(s, w, app_state, other)
        await verify_all(app_state)
        i = (await verdicts(s.admin, s.headers, s.pool_id))[-1]
        assert (i["category"], i["slashed_amount"]) == ("invalid", 7)
        pending = provider_account(provider, ProviderAccount.rewards_pending)
        async with app_state.sessionmaker() as session:
            ids = await ledger.lock_accounts(session, [slashed_there, pending])
            assert ids[slashed_there] < ids[pending]
            await session.rollback()
            await session.begin()
            await ledger.lock_accounts(session, [slashed_there])  # a lane of that partition
            appeal = asyncio.create_task(reverse(s, v["id"]))
            await until_waiting(app_state, 1, appeal, on="row")
            await ledger.lock_accounts(session, [pending])
            await session.commit()
        r = await appeal
        assert r.status_code == 200, r.text
        b = await balances(client, w)
        assert b["rewards_pending"] == 7 + 4, b  # H's 7 given back; I took 10 of R's 14
        await books_sound(app_state)


@postgres_only
async def test_an_appeal_locks_the_slashed_account_of_a_penalty_written_while_it_waited_for_its_locks(
    app: Any, app_state: Any, client: Any
) -> None:
    """As the test above, but I is decided (in the other partition's lane) while R's appeal,
    having read the forfeits it gives back from, waits for its first account: the unsharded
    system rewards, which that lane does not use. The appeal reads them again under its locks
    and takes I's slashed account up front with the rest, in id order: a lane of that partition
    holding it and asking for the provider's pending rewards waits for the appeal, and gets
    them once the appeal gave them back to wait for that slashed account. Before, the appeal
    read them once, before its locks, and took that account only at the give-back, holding the
    pending rewards: the two deadlocked (PostgreSQL aborted one)."""
    econ = {**ECON, "soft_invalid_penalty": 10}
    async with pool_setup(app, app_state, workers=1, economics=econ, stake=1000) as s:
        w = s.workers[0]
        provider = w.contributor.provider_id
        other = next(p for p in range(1, service.PARTITIONS) if p != service.partition_of(provider))
        slashed_there = system_account(SystemAccount.slashed, other)
        first = system_account(SystemAccount.rewards)  # unsharded: no verifier lane but 0's uses it
        async with app_state.sessionmaker() as session, session.begin():
            # Both older than the provider's reward accounts and its partition's system accounts.
            await ledger.account_id(session, first)
            await ledger.account_id(session, slashed_there)
        v = await _penalised_in_another_lane(s, w, app_state, other)
        pending = provider_account(provider, ProviderAccount.rewards_pending)
        async with app_state.sessionmaker() as session:
            ids = await ledger.lock_accounts(session, [first, slashed_there, pending])
            assert ids[first] < ids[slashed_there] < ids[pending]
            await session.rollback()
        async with app_state.sessionmaker() as holder, app_state.sessionmaker() as lane:
            await holder.begin()
            await ledger.lock_accounts(holder, [first])
            appeal = asyncio.create_task(reverse(s, v["id"]))
            await until_waiting(app_state, 1, appeal, on="row")
            await verify_all(app_state)  # I, committed while the appeal waits
            i = (await verdicts(s.admin, s.headers, s.pool_id))[-1]
            assert (i["category"], i["slashed_amount"]) == ("invalid", 7)
            await lane.begin()
            await ledger.lock_accounts(lane, [slashed_there])  # a lane of that partition
            lane_pid = int(await lane.scalar(text("SELECT pg_backend_pid()")) or 0)
            await holder.commit()
            await until_blocked_by(app_state, lane_pid, appeal)  # the appeal asks for slashed_there
            await ledger.lock_accounts(lane, [pending])
            await lane.commit()
        r = await appeal
        assert r.status_code == 200, r.text
        b = await balances(client, w)
        assert b["rewards_pending"] == 7 + 4, b  # H's 7 given back; I took 10 of R's 14
        await books_sound(app_state)


@pytest.mark.parametrize("reward_reversed", ["before_the_appeal", "after_the_appeal"])
async def test_a_penalty_takes_from_the_payment_by_the_holds_it_took_from_not_by_its_total(
    app: Any, app_state: Any, client: Any, reward_reversed: str
) -> None:
    """R is rejected (wrongly), an honest result H accepted (7 on hold), then I's penalty of 10
    takes H's 7. Had R been accepted, its reward (older than H's) would have been on hold first:
    I would have taken 10 of its 14, none of H's. H's verdict is reversed (before or after R's
    appeal): the node keeps 4, as it would have. The appeal pays 14, I takes 10 of it and gives
    back the 7 it took of H where that stands. Before, I took of the payment only its penalty
    less its total (3), counting the 7 whose reward went back to the system: the node kept 11."""
    econ = {**ECON, "soft_invalid_penalty": 10}
    async with pool_setup(app, app_state, workers=1, economics=econ, stake=1000) as s:
        w = s.workers[0]
        v = await rejected_right(s, w, app_state, "invalid")
        h = await honest(s, w, app_state)
        i = await rejected_right(s, w, app_state, "invalid")
        assert i["slashed_amount"] == 7
        if reward_reversed == "before_the_appeal":
            assert (await reverse(s, h["id"])).status_code == 200
        r = await reverse(s, v["id"])
        assert r.status_code == 200, r.text
        assert await forfeits_of_payment(app_state, v["id"]) == [(i["id"], 10, "forfeited")]
        if reward_reversed == "after_the_appeal":
            b = await balances(client, w)
            assert b["rewards_pending"] == 7 + 4, b  # H's 7 given back, as if I had never taken it
            assert await hold_statuses(app_state) == {w.node_id: ["held", "held"]}
            await books_sound(app_state)
            assert (await reverse(s, h["id"])).status_code == 200
        b = await balances(client, w)
        assert (b["rewards_pending"], b["rewards_claimable"]) == (4, 0), b
        assert await pool_money(s) == (14, 10)
        await books_sound(app_state)
        # I was wrong too: its appeal gives back its 10, and pays I's own 14.
        assert (await reverse(s, i["id"])).status_code == 200
        assert (await balances(client, w))["rewards_pending"] == 14 + 14
        assert await pool_money(s) == (28, 0)
        await books_sound(app_state)


@postgres_only
@pytest.mark.parametrize("first", ["appeal", "verdict"])
async def test_an_appeal_racing_a_penalty_in_the_window_is_penalised_once(
    app: Any, app_state: Any, client: Any, first: str
) -> None:
    """R's appeal and an invalid verdict I (penalty 5, nothing else on hold) wait for the
    provider's accounts at once: whichever commits first, I takes 5 of the payment exactly once
    (at its decision if the appeal paid first, at the appeal if I was there first)."""
    econ = {**ECON, "soft_invalid_penalty": 5}
    async with pool_setup(app, app_state, workers=1, economics=econ, stake=1000) as s:
        w = s.workers[0]
        v = await rejected_right(s, w, app_state, "invalid")
        lease = await one_lease(s, w, n=3)
        samples = answer_body(lease, ["4", "5", "4"])["samples"]
        samples[1]["finish_reason"] = "length"  # to be judged invalid
        await submit(w, lease, ["4", "5", "4"], samples=samples)
        r = await appeal_racing_the_verifier(s, app_state, w, v["id"], first)
        assert r.status_code == 200, r.text
        i = (await verdicts(s.admin, s.headers, s.pool_id))[-1]
        assert i["category"] == "invalid" and i["id"] != v["id"]
        assert i["slashed_amount"] == (5 if first == "appeal" else 0)
        b = await balances(client, w)
        assert b["rewards_pending"] == 14 - 5, b
        assert await forfeits_of_payment(app_state, v["id"]) == [(i["id"], 5, "forfeited")]
        assert await pool_money(s) == (14, 5)
        await books_sound(app_state)


@postgres_only
@pytest.mark.parametrize("order", ["R1 R2", "R1 I", "I R1"])
async def test_appeals_racing_over_one_penalty_shortfall_take_it_once(
    app: Any, app_state: Any, client: Any, order: str
) -> None:
    """R1, R2 and I are rejected (wrongly) as invalid in turn, each with a penalty of 5 and nothing
    on hold (R1's 14 is in the window of R2's and I's penalties, R2's in I's). Two appeals wait
    for the provider's accounts at once: whichever commits first, the standing penalties take
    their 5 once in all, and an appealed one's part comes back: the node keeps 28 less the 5 of
    the one penalty left standing (R2's or I's; found by review of 504041e, held)."""
    econ = {**ECON, "soft_invalid_penalty": 5}
    async with pool_setup(app, app_state, workers=1, economics=econ, stake=1000) as s:
        w = s.workers[0]
        named = {
            "R1": await rejected_right(s, w, app_state, "invalid"),
            "R2": await rejected_right(s, w, app_state, "invalid"),
            "I": await rejected_right(s, w, app_state, "invalid"),
        }
        pending = provider_account(w.contributor.provider_id, ProviderAccount.rewards_pending)
        appeals = []
        async with app_state.sessionmaker() as session:
            await session.begin()
            await ledger.lock_accounts(session, [pending])
            for n, name in enumerate(order.split(), 1):
                appeals.append(asyncio.create_task(reverse(s, named[name]["id"])))
                await until_waiting(app_state, n, *appeals, on="row")
            await session.commit()
        for appeal in appeals:
            r = await appeal
            assert r.status_code == 200, r.text
        b = await balances(client, w)
        assert b["rewards_pending"] == 28 - 5, b
        assert await pool_money(s) == (28, 5)
        standing = await forfeits_of_payment(app_state, named["R1"]["id"])
        assert sum(a for _, a, st in standing if st == "forfeited") == 5, standing
        await books_sound(app_state)


async def test_a_reversal_an_older_release_wrote_during_a_rolling_upgrade_is_placed_by_its_time(
    app: Any, app_state: Any, client: Any, clock: FakeClock
) -> None:
    """The migration job runs before the rolling update (README, Kubernetes), so for a while
    pods of the release before 0045 serve appeals on its schema: their reversals set
    ``reversed_at`` and leave ``reversed_after`` NULL, which the backfill, run already, never
    fills. A later appeal replaying such a reversal placed it by nothing: an AssertionError,
    500 at every appeal of the node's rejections in the pool. It is placed as that release
    placed it, by its time (the backfill's rule): here after F1, before F2, so F2 takes the
    payment."""
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000) as s:
        w = s.workers[0]
        v, f1 = await _rejected_then_a_fraud_reversed(s, w, app_state, clock)
        async with app_state.sessionmaker() as session, session.begin():
            # As the release before 0045 writes a reversal.
            await session.execute(update(Verdict).where(Verdict.id == f1["id"]).values(reversed_after=None))
        clock.advance(1)
        f2 = await fraud(s, w, app_state)
        r = await reverse(s, v["id"])
        assert r.status_code == 200, r.text
        assert (r.json()["reward_paid_on_appeal"], r.json()["reward_forfeited_by"]) == (14, f2["id"])
        b = await balances(client, w)
        assert (b["rewards_pending"], b["rewards_claimable"]) == (0, 0), b
        assert await forfeits_of_payment(app_state, v["id"]) == [(f2["id"], 14, "forfeited")]
        await books_sound(app_state)
