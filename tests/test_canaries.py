"""Canary tasks: a miss sampled at a temperature is an honest failure until the node misses too
many of its recent canaries; a greedy canary's miss is fraud at once."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from sqlalchemy import select

from orchestrator.verification import service
from orchestrator.verification.models import Verdict
from orchestrator.verification.scoring import scorer_for
from tests.conftest import postgres_only
from tests.tasks_helpers import pool_setup, task
from tests.verification_helpers import balances, submit, track_record, verdicts, verify_all
from tests.waits import HANG_S, until_waiting

pytestmark = pytest.mark.usefixtures("no_audits")

ECON = {
    "min_stake_per_node": 1000,
    "reward_per_sample": 7,
    "reward_hold_s": 3600,
    "soft_invalid_penalty": 2,
    "fraud_slash_amount": 200,
    "strikes_before_ejection": 3,
    "strikes_before_provider_ban": 5,
}
# The schema's defaults: temperature 1.0, no top-k (as most pools sample).
SAMPLED = {"max_tokens": 256}


def canary(sampling: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    return task(canary=True, sampling=sampling or SAMPLED, **extra)


async def answer(s: Any, worker: Any, outcomes: str, *, key: str) -> None:
    """The worker answers one task per letter of ``outcomes``, in order: ``H`` a canary right
    (a hit), ``M`` a canary wrong (a miss), ``o`` an ordinary task right; then the verifier
    decides them, in the order they came in."""
    tasks = [canary() if c in "HM" else task(sampling=SAMPLED) for c in outcomes]
    r = await s.enqueue(tasks, key=key)
    assert r.status_code == 201, r.text
    leases = (await worker.claim(s.pool_id, max_tasks=len(tasks))).json()["leases"]
    assert len(leases) == len(tasks)
    by_task = {await s.task_of(lease): lease for lease in leases}
    for t, c in zip(sorted(by_task), outcomes, strict=True):
        await submit(worker, by_task[t], ["5" if c == "M" else "4"])
    await verify_all(s.app.state.orch)


async def judged(s: Any) -> list[tuple[str, str]]:
    """Every verdict of the pool, oldest first: (category, reason)."""
    return [(v["category"], v["reason"]) for v in await verdicts(s.admin, s.headers, s.pool_id)]


async def test_an_honest_node_missing_one_sampled_canary_is_unpaid_but_not_slashed(
    app: Any, app_state: Any, client: Any
) -> None:
    """At temperature 1.0 an honest node running the right policy misses now and then a problem
    it usually solves: its one miss is judged as any wrong answer (not paid, the pool's soft
    penalty), not fraud. It was slashed, struck and, by the third, ejected. The verdict does not
    tell the node that the task was a canary: it reads as a wrong answer on any task."""
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000, max_leases_per_node=16) as s:
        [w] = s.workers
        await answer(s, w, "oM", key="a")
        await s.enqueue([task(sampling=SAMPLED)], key="ordinary")
        [lease] = (await w.claim(s.pool_id)).json()["leases"]
        await submit(w, lease, ["5"])  # an ordinary wrong answer, to compare with
        await verify_all(app_state)
        paid, miss, wrong = await verdicts(s.admin, s.headers, s.pool_id)
        assert (miss["outcome"], miss["category"], miss["reason"]) == ("rejected", "invalid", "wrong_answer")
        assert miss["slashed_amount"] == 2  # the soft penalty, from the reward on hold (7)
        shown = ("outcome", "category", "reason", "verifier", "reward_amount", "slashed_amount")
        assert {k: miss[k] for k in shown} == {k: wrong[k] for k in shown}
        assert miss["details"].keys() == wrong["details"].keys() and miss["details"]["findings"] == []
        b = await balances(client, w)
        assert (b["stake_locked"], b["rewards_pending"]) == (1000, 7 - 2 - 2)
        assert (await track_record(s, w))["strikes"] == 0
        assert paid["category"] == "valid"


async def test_the_misses_that_reach_the_pools_limit_within_its_window_are_fraud(
    app: Any, app_state: Any, client: Any
) -> None:
    """With the defaults (3 misses of the node's last 10 canaries), the first two misses are
    honest failures and the third is fraud: slashed, struck, its rewards on hold forfeited."""
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000, max_leases_per_node=16) as s:
        [w] = s.workers
        await answer(s, w, "MHoMoH", key="a")
        assert (await balances(client, w))["stake_locked"] == 1000
        await answer(s, w, "M", key="b")
        assert await judged(s) == [
            ("invalid", "wrong_answer"),
            ("valid", "verified"),
            ("valid", "verified"),
            ("invalid", "wrong_answer"),
            ("valid", "verified"),
            ("valid", "verified"),
            ("fraud", "canary_failed"),
        ]
        fraud = (await verdicts(s.admin, s.headers, s.pool_id))[-1]
        assert "3 of the node's last 5 canary results" in fraud["details"]["findings"][0]["detail"]
        held = 4 * 7 - 2  # four rewards, less the second miss's soft penalty (nothing was held at the first)
        assert fraud["slashed_amount"] == 200 + held
        b = await balances(client, w)
        assert (b["stake_locked"], b["rewards_pending"]) == (800, 0)
        assert (await track_record(s, w))["strikes"] == 1


async def test_misses_older_than_the_window_do_not_count(app: Any, app_state: Any) -> None:
    """Only the node's last ``canary_window`` canary results count (ordinary tasks in between
    do not push a miss out of it): 2 misses of 3 is fraud, a miss three canaries back is not."""
    policy = {"canary_miss_limit": 2, "canary_window": 3, "max_leases_per_node": 16}
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000, **policy) as s:
        [w] = s.workers
        await answer(s, w, "MHHM", key="a")  # the first miss is out of the fourth's window
        assert [c for c, _ in await judged(s)] == ["invalid", "valid", "valid", "invalid"]
        await answer(s, w, "oooM", key="b")  # H, M, M: fraud
        assert (await judged(s))[-4:] == [("valid", "verified")] * 3 + [("fraud", "canary_failed")]


async def test_canary_misses_count_per_node_and_pool(app: Any, app_state: Any) -> None:
    """One node's misses are not another's, nor are a node's misses in another pool."""
    policy = {"canary_miss_limit": 2, "canary_window": 10, "max_leases_per_node": 16}
    free = {**ECON, "min_stake_per_node": 0, "fraud_slash_amount": 0}
    async with (
        pool_setup(app, app_state, workers=2, economics=ECON, stake=1000, **policy) as s,
        pool_setup(app, app_state, economics=free, **policy) as other,
    ):
        a, b = s.workers
        r = await a.client.post(f"/v1/pools/{other.pool_id}/join", json={}, auth=a.contributor.node_auth)
        assert r.status_code in (200, 201), r.text
        await answer(other, a, "M", key="a-elsewhere")
        await answer(s, b, "M", key="b")
        await answer(s, a, "M", key="a")
        assert [c for c, _ in await judged(s)] == ["invalid", "invalid"]
        assert [c for c, _ in await judged(other)] == ["invalid"]


@pytest.mark.parametrize(
    "greedy",
    [{"temperature": 0}, {"top_k": 1}, {"temperature": 0.7, "top_k": 1}],
    ids=["temperature-0", "top-k-1", "top-k-1-at-a-temperature"],
)
async def test_a_greedy_canary_missed_is_fraud_at_once(
    app: Any, app_state: Any, client: Any, greedy: dict[str, Any]
) -> None:
    """Greedy decoding of the right policy gives the one answer it gives, and a canary is chosen
    because the policy solves it: a miss is fraud at the first, whatever the pool's limit."""
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000, max_leases_per_node=16) as s:
        [w] = s.workers
        await s.enqueue([canary({"max_tokens": 256, **greedy})], key="greedy")
        [lease] = (await w.claim(s.pool_id)).json()["leases"]
        await submit(w, lease, ["5"])
        await verify_all(app_state)
        assert await judged(s) == [("fraud", "canary_failed")]
        assert (await balances(client, w))["stake_locked"] == 800


async def test_a_miss_reversed_on_appeal_no_longer_counts(app: Any, app_state: Any) -> None:
    """The rule counts the node's canary verdicts that stand: a miss an appeal reversed is not
    one of its misses any more."""
    policy = {"canary_miss_limit": 2, "canary_window": 10, "max_leases_per_node": 16}
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000, **policy) as s:
        [w] = s.workers
        await answer(s, w, "M", key="a")
        [first] = await verdicts(s.admin, s.headers, s.pool_id)
        r = await s.admin.post(
            f"/v1/admin/verdicts/{first['id']}/reverse", json={"reason": "appeal"}, headers=s.admin_headers
        )
        assert r.status_code == 200, r.text
        await answer(s, w, "M", key="b")
        assert [c for c, _ in await judged(s)] == ["invalid", "invalid"]
        await answer(s, w, "M", key="c")  # the second miss that stands
        assert (await judged(s))[-1] == ("fraud", "canary_failed")


async def test_a_canary_result_failing_its_checks_with_no_right_sample_still_counts_as_a_miss(
    app: Any, app_state: Any
) -> None:
    """A canary result that fails a check of its own (more tokens than max_tokens) is judged on
    that; with no right sample it is still one of the node's misses: the server scored it."""
    policy = {"canary_miss_limit": 2, "canary_window": 10, "max_leases_per_node": 16}
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000, **policy) as s:
        [w] = s.workers
        await s.enqueue([canary()], key="overflow")
        [lease] = (await w.claim(s.pool_id)).json()["leases"]
        body_samples = {"completion_tokens": 10_000}
        r = await w.client.post(
            f"/v1/assignments/{lease['assignment_id']}/result",
            json={
                "fencing_token": lease["fencing_token"],
                "policy_step": lease["policy"]["step"],
                "seed": lease["seed"],
                "samples": [{"completion": "5", "finish_reason": "stop", "prompt_tokens": 1, **body_samples}],
            },
            auth=w.contributor.node_auth,
        )
        assert r.status_code == 201, r.text
        await verify_all(app_state)
        [(category, reason)] = await judged(s)
        assert category == "invalid" and reason != "wrong_answer"
        await answer(s, w, "M", key="b")  # a second miss: fraud
        assert (await judged(s))[-1] == ("fraud", "canary_failed")


@postgres_only
async def test_two_misses_decided_at_once_do_not_both_escape_the_rule(app: Any, app_state: Any) -> None:
    """Two verifier transactions deciding misses of one node at once: the second waits for the
    first (each locks the node's membership before its verdicts) and counts its miss, so with a
    limit of 2 one is an honest failure and the other fraud, not two honest failures."""
    policy = {"canary_miss_limit": 2, "canary_window": 10, "max_leases_per_node": 16}
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000, **policy) as s:
        [w] = s.workers
        await s.enqueue([canary(), canary()], key="two")
        leases = (await w.claim(s.pool_id, max_tasks=2)).json()["leases"]
        for lease in leases:
            await submit(w, lease, ["5"])
        scorer = scorer_for(app_state.settings.verifier)
        decided, release = asyncio.Event(), asyncio.Event()

        async def batch(hold: bool) -> service.Batch:
            async with app_state.sessionmaker() as session, session.begin():
                done = await service.process_pending(
                    session,
                    secret=app_state.settings.seed_key,
                    rng=app_state.rng,
                    now=app_state.clock.utcnow(),
                    scorer=scorer,
                    limit=1,
                )
                if hold:
                    decided.set()
                    await release.wait()
            return done

        first = asyncio.create_task(batch(hold=True))
        await asyncio.wait_for(decided.wait(), HANG_S)
        second = asyncio.create_task(batch(hold=False))
        await until_waiting(app_state, 1, second, on="row")
        assert not second.done(), "the second batch did not wait for the first"
        release.set()
        assert [(await first).processed, (await second).processed] == [1, 1]
        async with app_state.sessionmaker() as session:
            rows = (await session.execute(select(Verdict.category).order_by(Verdict.id))).scalars().all()
        assert rows == ["invalid", "fraud"]
