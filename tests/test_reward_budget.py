"""A pool's reward budget: once its verdicts have credited it, the pool is paused (reason
``budget_spent``); work leased before that is still judged and paid, and the operator resumes it
after raising the budget."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from orchestrator.core.clock import FakeClock
from orchestrator.pools import jobs as pool_jobs
from tests.tasks_helpers import pool_setup, task
from tests.verification_helpers import books_balance, pending_matches_holds, submit, verdicts, verify_all

pytestmark = pytest.mark.usefixtures("no_audits")

ECON = {"reward_per_sample": 7, "reward_hold_s": 3600, "reward_budget": 14}


async def check_budgets(app_state: Any, clock: FakeClock) -> Any:
    """One tick of the budget loop (a tick of its own: the clock moves to the next)."""
    clock.advance(pool_jobs.INTERVAL_S)
    report = await pool_jobs.check_budgets_once(app_state)
    assert report.ran
    return report


async def pool_view(s: Any) -> dict[str, Any]:
    r = await s.admin.get(f"/v1/admin/pools/{s.pool_id}", headers=s.headers)
    assert r.status_code == 200, r.text
    return dict(r.json())


async def stats(s: Any) -> dict[str, Any]:
    r = await s.admin.get(f"/v1/admin/pools/{s.pool_id}/stats", headers=s.headers)
    assert r.status_code == 200, r.text
    return dict(r.json())


async def patch(s: Any, **economics: Any) -> Any:
    return await s.admin.patch(
        f"/v1/admin/pools/{s.pool_id}", json={"economics": economics}, headers=s.headers
    )


async def leases(s: Any, worker: Any, count: int) -> list[dict[str, Any]]:
    r = await s.enqueue([task() for _ in range(count)], key=f"batch-{count}")
    assert r.status_code == 201, r.text
    got = (await worker.claim(s.pool_id, max_tasks=count)).json()["leases"]
    assert len(got) == count
    return list(got)


def budget_gauge(text: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "orchestrator_pools_paused_for_budget":
                return float(sample.value)
    raise AssertionError("orchestrator_pools_paused_for_budget is not exported")


async def test_a_pool_that_spent_its_budget_is_paused_and_still_pays_the_work_leased_before(
    app: Any, app_state: Any, client: Any, clock: FakeClock
) -> None:
    async with pool_setup(app, app_state, workers=1, economics=ECON) as s:
        w = s.workers[0]
        first, second, third = await leases(s, w, 3)
        view = await pool_view(s)
        assert view["economics"]["reward_budget"] == 14
        assert (view["rewards_credited"], view["reward_budget_remaining"]) == (0, 14)
        assert view["status_reason"] is None

        await submit(w, first, ["4"])
        assert await verify_all(app_state) == 1
        assert (await check_budgets(app_state, clock)).paused == []
        assert (await pool_view(s))["status"] == "active"

        await submit(w, second, ["4"])
        assert await verify_all(app_state) == 1
        assert (await check_budgets(app_state, clock)).paused == [s.pool_id]
        view = await pool_view(s)
        assert (view["status"], view["status_reason"]) == ("paused", "budget_spent")
        assert (view["rewards_credited"], view["reward_budget_remaining"]) == (14, 0)

        # No more work for anyone...
        r = await w.claim(s.pool_id)
        assert (r.json()["leases"], r.json()["reason"]) == ([], "pool_paused")
        # ...but the lease taken before the pause is still judged and paid: 7 over the budget.
        await submit(w, third, ["4"])
        assert await verify_all(app_state) == 1
        assert [v["reward_amount"] for v in await verdicts(s.admin, s.headers, s.pool_id)] == [7, 7, 7]
        view = await pool_view(s)
        assert (view["rewards_credited"], view["reward_budget_remaining"]) == (21, 0)
        st = await stats(s)
        assert (st["rewards_credited"], st["reward_budget"], st["reward_budget_remaining"]) == (21, 14, 0)

        # The system's pause is in the audit log, with why.
        r = await s.admin.get("/v1/admin/audit", params={"pool_id": s.pool_id}, headers=s.admin_headers)
        [pause] = [e for e in r.json()["items"] if e["action"] == "pool.pause"]
        assert pause["actor"] == "system"
        assert pause["before"] == {"status": "active"}
        assert pause["after"] == {
            "status": "paused",
            "reason": "budget_spent",
            "rewards_credited": 14,
            "reward_budget": 14,
        }
        assert budget_gauge((await client.get("/metrics")).text) == 1

        # Resuming while the budget is spent is refused; raising it does not resume by itself.
        r = await s.admin.post(f"/v1/admin/pools/{s.pool_id}/resume", headers=s.headers)
        assert r.status_code == 409, r.text
        problem = r.json()
        assert problem["code"] == "budget_spent"
        assert (problem["rewards_credited"], problem["reward_budget"]) == (21, 14)
        assert "economics.reward_budget" in problem["detail"]
        assert (await pool_view(s))["status"] == "paused"

        assert (await patch(s, reward_budget=100)).status_code == 200
        await check_budgets(app_state, clock)
        view = await pool_view(s)
        assert (view["status"], view["status_reason"], view["reward_budget_remaining"]) == (
            "paused",
            "budget_spent",
            79,
        )
        r = await s.admin.post(f"/v1/admin/pools/{s.pool_id}/resume", headers=s.headers)
        assert r.status_code == 200, r.text
        assert (r.json()["status"], r.json()["status_reason"]) == ("active", None)
        assert budget_gauge((await client.get("/metrics")).text) == 0
        assert (await w.claim(s.pool_id)).json()["leases"] == []  # active again (no task left)
        assert (await check_budgets(app_state, clock)).paused == []


async def test_lowering_the_budget_below_what_is_spent_pauses_the_pool_at_the_next_check(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    async with pool_setup(app, app_state, workers=1, economics={"reward_per_sample": 7}) as s:
        w = s.workers[0]
        [lease] = await leases(s, w, 1)
        await submit(w, lease, ["4"])
        await verify_all(app_state)
        view = await pool_view(s)
        assert (view["economics"]["reward_budget"], view["reward_budget_remaining"]) == (None, None)
        assert view["rewards_credited"] == 7
        assert (await check_budgets(app_state, clock)).paused == []

        r = await patch(s, reward_budget=7)
        assert r.status_code == 200, r.text
        assert (r.json()["status"], r.json()["reward_budget_remaining"]) == ("active", 0)
        assert (await check_budgets(app_state, clock)).paused == [s.pool_id]
        assert (await pool_view(s))["status_reason"] == "budget_spent"

        # Back to no budget: the operator may resume.
        assert (await patch(s, reward_budget=None)).status_code == 200
        r = await s.admin.post(f"/v1/admin/pools/{s.pool_id}/resume", headers=s.headers)
        assert r.status_code == 200, r.text
        assert (await check_budgets(app_state, clock)).paused == []


async def test_an_operators_pause_has_no_reason_and_a_reversed_reward_is_no_longer_spent(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    async with pool_setup(
        app, app_state, workers=1, economics={"reward_per_sample": 7, "reward_budget": 7}
    ) as s:
        w = s.workers[0]
        [lease] = await leases(s, w, 1)
        r = await s.admin.post(f"/v1/admin/pools/{s.pool_id}/pause", headers=s.headers)
        assert (r.json()["status"], r.json()["status_reason"]) == ("paused", None)
        await submit(w, lease, ["4"])
        await verify_all(app_state)
        await check_budgets(app_state, clock)  # only active pools are checked
        assert (await pool_view(s))["status_reason"] is None
        r = await s.admin.post(f"/v1/admin/pools/{s.pool_id}/resume", headers=s.headers)
        assert (r.status_code, r.json()["code"]) == (409, "budget_spent")

        # An appeal takes the reward back: it is spent no more, as in the stats.
        [v] = await verdicts(s.admin, s.headers, s.pool_id)
        r = await s.admin.post(
            f"/v1/admin/verdicts/{v['id']}/reverse", json={"reason": "appeal"}, headers=s.admin_headers
        )
        assert r.status_code == 200, r.text
        view = await pool_view(s)
        assert (view["rewards_credited"], view["reward_budget_remaining"]) == (0, 7)
        assert (await stats(s))["rewards_credited"] == 0
        r = await s.admin.post(f"/v1/admin/pools/{s.pool_id}/resume", headers=s.headers)
        assert r.status_code == 200, r.text


async def test_what_an_appeal_of_a_rejection_pays_is_spent_too(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    """A wrong answer's appeal pays what an acceptance would have (here the whole budget): the
    view, the stats and the budget loop count it as spent, and the pool is paused for it."""
    async with pool_setup(
        app, app_state, workers=1, economics={"reward_per_sample": 7, "reward_budget": 7}
    ) as s:
        w = s.workers[0]
        [lease] = await leases(s, w, 1)
        await submit(w, lease, ["4"], seed=1)  # not the assigned seed: fraud
        await verify_all(app_state)
        [v] = await verdicts(s.admin, s.headers, s.pool_id)
        assert (v["category"], v["reward_amount"]) == ("fraud", 0)
        assert (await pool_view(s))["rewards_credited"] == 0

        r = await s.admin.post(
            f"/v1/admin/verdicts/{v['id']}/reverse", json={"reason": "our seed bug"}, headers=s.admin_headers
        )
        assert r.status_code == 200 and r.json()["reward_paid_on_appeal"] == 7, r.text
        view = await pool_view(s)
        assert (view["rewards_credited"], view["reward_budget_remaining"]) == (7, 0)
        assert (await stats(s))["rewards_credited"] == 7
        assert (await check_budgets(app_state, clock)).paused == [s.pool_id]
        assert ((await pool_view(s))["status"], (await pool_view(s))["status_reason"]) == (
            "paused",
            "budget_spent",
        )


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (0, "Input should be greater than or equal to 1"),
        (-5, "Input should be greater than or equal to 1"),
        (2**63, "Input should be less than or equal to 9223372036854775807"),
        (1.5, "Input should be a valid integer, got a number with a fractional part"),
        ("100", "Value error, must be a JSON number, not a string"),
        (True, "Value error, must be a JSON number, not true or false"),
    ],
)
async def test_a_bad_budget_is_refused_with_the_field_and_changes_nothing(
    app: Any, app_state: Any, value: Any, message: str
) -> None:
    async with pool_setup(app, app_state, economics={"reward_budget": 50}) as s:
        r = await s.admin.post(
            "/v1/admin/pools", json={"name": "p", "economics": {"reward_budget": value}}, headers=s.headers
        )
        assert r.status_code == 422, r.text
        assert r.json()["errors"][0]["loc"] == ["body", "economics", "reward_budget"]
        assert r.json()["errors"][0]["msg"] == message
        r = await patch(s, reward_budget=value)
        assert r.status_code == 422, r.text
        assert r.json()["errors"][0]["loc"] == ["body", "economics", "reward_budget"]
        assert r.json()["errors"][0]["msg"] == message
        assert (await pool_view(s))["economics"]["reward_budget"] == 50


async def test_a_pool_has_no_budget_unless_one_is_set(app: Any, app_state: Any) -> None:
    async with pool_setup(app, app_state) as s:
        view = await pool_view(s)
        assert (view["economics"]["reward_budget"], view["reward_budget_remaining"]) == (None, None)
        assert (view["rewards_credited"], view["status_reason"]) == (0, None)
        st = await stats(s)
        assert (st["reward_budget"], st["reward_budget_remaining"]) == (None, None)
        r = await patch(s, reward_budget=1000)
        assert r.status_code == 200, r.text
        assert r.json()["economics"]["reward_budget"] == 1000
        r = await s.admin.get(
            "/v1/admin/audit", params={"pool_id": s.pool_id, "limit": 1}, headers=s.admin_headers
        )
        [entry] = r.json()["items"]
        assert entry["action"] == "pool.update"
        assert (entry["before"], entry["after"]) == (
            {"economics.reward_budget": None},
            {"economics.reward_budget": 1000},
        )


async def test_a_reward_that_a_later_fraud_verdict_forfeits_stays_spent(app: Any, app_state: Any) -> None:
    """A forfeit moves the reward to the system's slashed account, not back to rewards: the
    budget counts it as the stats do."""
    econ = {"min_stake_per_node": 100, "reward_per_sample": 7, "fraud_slash_amount": 10, "reward_budget": 50}
    async with pool_setup(app, app_state, workers=1, economics=econ, stake=100) as s:
        w = s.workers[0]
        right, cheat = await leases(s, w, 2)
        await submit(w, right, ["4"])
        await verify_all(app_state)
        await submit(w, cheat, ["5"], claimed_reward=1.0)  # claims a reward it did not earn
        await verify_all(app_state)
        assert sorted(v["category"] for v in await verdicts(s.admin, s.headers, s.pool_id)) == [
            "fraud",
            "valid",
        ]
        st = await stats(s)
        assert (st["rewards_credited"], st["slashed"], st["reward_budget_remaining"]) == (7, 17, 43)
        view = await pool_view(s)
        assert (view["rewards_credited"], view["reward_budget_remaining"]) == (7, 43)


async def test_the_budgets_running_total_is_what_the_stats_count_through_appeals_and_forfeits(
    app: Any, app_state: Any
) -> None:
    """The pool view's rewards_credited (the nodes' running totals, which the budget loop sums)
    and the stats' (counted from the verdicts) agree after every step of a sequence that moves
    them both ways: a reward, a fraud verdict forfeiting it, that verdict's appeal, the reward's
    appeal (twice: the second changes nothing), a rejection's appeal that pays, and a fraud
    verdict forfeiting what that appeal paid."""
    from tests.test_appeals import fraud, honest, rejected_right, reverse

    econ = {
        "min_stake_per_node": 1000,
        "reward_per_sample": 7,
        "reward_hold_s": 3600,
        "fraud_slash_amount": 200,
        "reward_budget": 1000,
    }
    async with pool_setup(app, app_state, workers=1, economics=econ, stake=1000) as s:
        w = s.workers[0]

        async def agree(expected: int) -> None:
            view, st = await pool_view(s), await stats(s)
            assert (view["rewards_credited"], st["rewards_credited"]) == (expected, expected)
            assert view["reward_budget_remaining"] == st["reward_budget_remaining"] == 1000 - expected

        a = await honest(s, w, app_state)
        await agree(7)
        f = await fraud(s, w, app_state)  # forfeits a's 7: still spent
        await agree(7)
        assert (await reverse(s, f["id"])).status_code == 200
        await agree(7)
        assert (await reverse(s, a["id"])).status_code == 200
        await agree(0)
        assert (await reverse(s, a["id"])).status_code == 200
        await agree(0)
        v = await rejected_right(s, w, app_state, "invalid")
        assert (await reverse(s, v["id"])).json()["reward_paid_on_appeal"] == 14
        await agree(14)
        await fraud(s, w, app_state)  # forfeits what the appeal paid: still spent
        await agree(14)
        await books_balance(app_state)
        await pending_matches_holds(app_state)
