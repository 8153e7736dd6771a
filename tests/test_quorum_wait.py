"""Replicas nobody takes: after ``verifier.quorum_wait_s`` they are withdrawn and the results
that waited for them are decided, so neither the results nor their nodes' trust wait for ever on
a node that left, fell unhealthy or never polls, or on a provider the pool does not have."""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

import pytest
from prometheus_client import REGISTRY

from orchestrator.core.clock import FakeClock
from orchestrator.verification.jobs import verify_once
from orchestrator.verification.scoring import scorer_for
from tests.tasks_helpers import pool_setup
from tests.verification_helpers import FixedDraw, balances, submit, verdicts, verify_all

WAIT_S = 10
ECON = {"min_stake_per_node": 0, "reward_per_sample": 7, "reward_hold_s": 0}
TASK = {"prompt": "Name the capital of France.", "sampling": {"max_tokens": 64}}


@pytest.fixture(autouse=True)
def _audit_everything(app_state: Any) -> None:
    app_state.rng = FixedDraw(0.0)  # every result is drawn for an audit
    app_state.settings.verifier.quorum_wait_s = WAIT_S


async def _task_detail(s: Any) -> dict[str, Any]:
    [item] = (await s.admin.get(f"/v1/admin/pools/{s.pool_id}/tasks", headers=s.headers)).json()["items"]
    r = await s.admin.get(f"/v1/admin/pools/{s.pool_id}/tasks/{item['id']}", headers=s.headers)
    assert r.status_code == 200, r.text
    return dict(r.json())


async def _tick(app_state: Any, clock: FakeClock, seconds: float) -> Any:
    clock.advance(seconds)
    return await verify_once(app_state)


async def _answer(app_state: Any, s: Any, workers: list[Any], answers: list[str]) -> None:
    """Each worker claims a replica and answers it; then the verifier runs."""
    for worker, answer in zip(workers, answers, strict=True):
        lease = (await worker.claim(s.pool_id)).json()["leases"][0]
        await submit(worker, lease, [answer])
    await verify_all(app_state)


async def test_an_audit_replica_nobody_takes_is_withdrawn_and_the_result_decided_alone(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    async with pool_setup(app, app_state, workers=2, economics=ECON) as s:
        first, sibling = s.workers
        await s.enqueue([TASK], key="audit")
        await _answer(app_state, s, [first], ["Paris"])
        assert await verdicts(s.admin, s.headers, s.pool_id) == []
        assert (await _task_detail(s))["replication"] == 2  # the audit replica, for the sibling

        # Within the wait nothing is decided: the sibling could still come.
        report = await _tick(app_state, clock, WAIT_S - 1)
        assert report.ran and report.quorum_waits_expired == 0
        assert await verdicts(s.admin, s.headers, s.pool_id) == []

        skipped = REGISTRY.get_sample_value("orchestrator_audits_skipped_total") or 0
        report = await _tick(app_state, clock, 2)
        assert report.quorum_waits_expired == 1
        # Counted for the operator: the audit that was drawn never happened.
        assert REGISTRY.get_sample_value("orchestrator_audits_skipped_total") == skipped + 1
        [verdict] = await verdicts(s.admin, s.headers, s.pool_id)
        assert (verdict["outcome"], verdict["category"], verdict["reason"]) == (
            "accepted",
            "valid",
            "verified",
        )
        assert verdict["details"]["audit_skipped"] == f"no node took the audit replica within {WAIT_S} s"
        assert verdict["reward_amount"] == 7
        detail = await _task_detail(s)
        assert (detail["status"], detail["replication"]) == ("completed", 1)

        # The withdrawn replica is gone for everyone, and a later tick decides nothing twice.
        r = (await sibling.claim(s.pool_id)).json()
        assert (r["leases"], r["reason"]) == ([], "no_tasks")
        assert (await _tick(app_state, clock, WAIT_S + 1)).quorum_waits_expired == 0
        assert len(await verdicts(s.admin, s.headers, s.pool_id)) == 1
        assert REGISTRY.get_sample_value("orchestrator_audits_skipped_total") == skipped + 1
        b = await balances(s.admin, first)
        assert b["rewards_pending"] + b["rewards_claimable"] == 7  # paid once


async def test_a_leased_audit_replica_is_left_to_finish(app: Any, app_state: Any, clock: FakeClock) -> None:
    async with pool_setup(app, app_state, workers=2) as s:
        first, sibling = s.workers
        await s.enqueue([TASK], key="audit")
        await _answer(app_state, s, [first], ["Paris"])
        audit = (await sibling.claim(s.pool_id)).json()["leases"][0]

        assert (await _tick(app_state, clock, WAIT_S + 1)).quorum_waits_expired == 0
        assert await verdicts(s.admin, s.headers, s.pool_id) == []

        skipped = REGISTRY.get_sample_value("orchestrator_audits_skipped_total") or 0
        await submit(sibling, audit, ["Paris"])
        await verify_all(app_state)
        vs = await verdicts(s.admin, s.headers, s.pool_id)
        assert [(v["category"], v["verifier"]) for v in vs] == [("valid", "quorum")] * 2
        assert all("audit_skipped" not in v["details"] for v in vs)
        assert (REGISTRY.get_sample_value("orchestrator_audits_skipped_total") or 0) == skipped


async def test_disagreeing_results_whose_tie_break_nobody_takes_are_inconclusive(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    """The audit's answer differs, a third replica is asked for, and no third provider exists:
    neither answer can be believed, so both are inconclusive, without reward or slash."""
    async with pool_setup(app, app_state, workers=2, economics=ECON) as s:
        first, sibling = s.workers
        await s.enqueue([TASK], key="audit")
        await _answer(app_state, s, [first], ["Paris"])
        await _tick(app_state, clock, WAIT_S - 1)  # the audit replica is taken late in its wait
        await _answer(app_state, s, [sibling], ["Lyon"])
        assert (await _task_detail(s))["replication"] == 3  # the tie-break replica

        # The tie-break replica gets its own full wait, counted from when it was asked for.
        assert (await _tick(app_state, clock, WAIT_S - 1)).quorum_waits_expired == 0
        assert await verdicts(s.admin, s.headers, s.pool_id) == []

        assert (await _tick(app_state, clock, 2)).quorum_waits_expired == 2
        vs = await verdicts(s.admin, s.headers, s.pool_id)
        assert [(v["outcome"], v["category"], v["reason"]) for v in vs] == [
            ("rejected", "inconclusive", "quorum_timeout")
        ] * 2
        assert vs[0]["details"]["votes"] == {'["paris"]': 1, '["lyon"]': 1}
        assert vs[0]["details"]["quorum_timeout"] == f"no node took the missing replica within {WAIT_S} s"
        assert all(v["reward_amount"] == 0 and v["slashed_amount"] == 0 for v in vs)
        detail = await _task_detail(s)
        assert (detail["status"], detail["replication"]) == ("completed", 2)


async def test_two_agreeing_results_are_decided_without_a_replica_nobody_takes(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    """An operator's third replica that no node takes: the two results in agree, a strict
    majority of the quorum of three, so they are accepted without it."""
    async with pool_setup(app, app_state, workers=3, replication_factor=3) as s:
        await s.enqueue([TASK], key="r3")
        await _answer(app_state, s, s.workers[:2], ["Paris", "Paris"])  # the third node never claims
        assert await verdicts(s.admin, s.headers, s.pool_id) == []
        assert (await _tick(app_state, clock, WAIT_S + 1)).quorum_waits_expired == 2
        vs = await verdicts(s.admin, s.headers, s.pool_id)
        assert [(v["category"], v["reason"], v["verifier"]) for v in vs] == [
            ("valid", "verified", "quorum")
        ] * 2
        assert vs[0]["details"]["quorum_timeout"] == f"no node took the missing replica within {WAIT_S} s"
        detail = await _task_detail(s)
        assert (detail["status"], detail["replication"]) == ("completed", 2)
        r = (await s.workers[2].claim(s.pool_id)).json()
        assert (r["leases"], r["reason"]) == ([], "no_tasks")


async def test_an_undecided_vote_whose_tie_break_nobody_takes_is_inconclusive(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    """Three different answers ask for a fourth replica; the pool has no fourth provider."""
    async with pool_setup(app, app_state, workers=3, replication_factor=3) as s:
        await s.enqueue([TASK], key="r3")
        await _answer(app_state, s, s.workers, ["Paris", "Lyon", "Nice"])
        assert (await _task_detail(s))["replication"] == 4
        assert (await _tick(app_state, clock, WAIT_S + 1)).quorum_waits_expired == 3
        vs = await verdicts(s.admin, s.headers, s.pool_id)
        assert [(v["category"], v["reason"]) for v in vs] == [("inconclusive", "quorum_timeout")] * 3
        assert (await _task_detail(s))["status"] == "completed"


async def test_a_math_quorum_decided_under_its_locks_compares_within_vote_compare_s(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    """A quorum decided when its missing replica is withdrawn compares its votes in the
    housekeeping's transaction, which holds the task's and the accounts' locks (SQLite: the one
    write lock, every claim and result waiting). Its comparisons get ``vote_compare_s`` (2 s)
    in all, not 80% of ``reward_timeout_s`` (10 s): an answer SymPy takes long over
    (``(x+y+z+w+1)^{16}``) held the transaction some 5 s. Cut comparisons count as different,
    the others still by equivalence: ``1/2``, ``0.5`` and ``\\frac{1}{2}`` outvote it."""
    async with pool_setup(app, app_state, workers=4, replication_factor=5, reward_function="math") as s:
        await s.enqueue([TASK], key="r5")
        answers = ["1/2", "0.5", "\\frac{1}{2}", "\\boxed{(x+y+z+w+1)^{16}}"]
        await _answer(app_state, s, s.workers, answers)
        assert await verdicts(s.admin, s.headers, s.pool_id) == []  # the fifth replica is out
        # The comparing process started (its start is not counted against the limit).
        await scorer_for(app_state.settings.verifier).vote_classes("math", [["1/3"], ["0.5"]])
        started = time.monotonic()
        assert (await _tick(app_state, clock, WAIT_S + 1)).quorum_waits_expired == 4
        assert time.monotonic() - started < 3.0  # was 4.7 s
        vs = {v["node_id"]: v for v in await verdicts(s.admin, s.headers, s.pool_id)}
        assert [vs[w.node_id]["category"] for w in s.workers] == ["valid"] * 3 + ["invalid"]
        details = vs[s.workers[3].node_id]["details"]
        assert details["equivalent"] == [['["0.5"]', '["1/2"]', '["\\\\frac{1}{2}"]']]
        assert "as text" in details["equivalence_unchecked"]


async def test_a_lone_result_of_a_replicated_task_waits_for_its_sibling(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    """Not audited and alone, a result cannot be compared with anything: it waits (the task's
    deadline is what bounds that wait), and the sibling's result, however late, decides."""
    async with pool_setup(app, app_state, workers=2, replication_factor=2) as s:
        await s.enqueue([TASK], key="r2")
        await _answer(app_state, s, s.workers[:1], ["Paris"])
        assert (await _tick(app_state, clock, WAIT_S + 1)).quorum_waits_expired == 0
        assert await verdicts(s.admin, s.headers, s.pool_id) == []
        await _answer(app_state, s, s.workers[1:], ["Paris"])
        vs = await verdicts(s.admin, s.headers, s.pool_id)
        assert [(v["category"], v["verifier"]) for v in vs] == [("valid", "quorum")] * 2


@pytest.mark.parametrize("ending", ["cancel", "complete_pool", "deadline"])
async def test_a_lone_audited_result_whose_task_ends_is_decided_on_its_checks(
    app: Any, app_state: Any, client: Any, clock: FakeClock, ending: str
) -> None:
    """A task's only result was in, and the verifier reopened the task for an audit replica;
    then the task ended (an operator's cancel, the pool's completion, its deadline). Nobody will
    ever answer the audit, so it is skipped and the result decided on its checks, as when nobody
    takes the replica in time: the node did the work in time and is paid. It was rejected
    ``task_abandoned`` (inconclusive), unpaid and counted against the node's trust."""
    from orchestrator.tasks.jobs import reap_once

    async with pool_setup(app, app_state, workers=2, economics=ECON) as s:
        first, _sibling = s.workers
        deadline = (clock.utcnow() + dt.timedelta(seconds=30)).isoformat()
        await s.enqueue([{**TASK, "deadline_at": deadline}], key="audit")
        await _answer(app_state, s, [first], ["Paris"])
        detail = await _task_detail(s)
        assert (detail["status"], detail["replication"]) == ("open", 2)  # the audit replica
        if ending == "cancel":
            url = f"/v1/admin/pools/{s.pool_id}/tasks/{detail['id']}/cancel"
            assert (await s.admin.post(url, headers=s.headers)).status_code == 200
        elif ending == "complete_pool":
            for action in ("pause", "complete"):
                r = await s.admin.post(f"/v1/admin/pools/{s.pool_id}/{action}", headers=s.headers)
                assert r.status_code == 200, r.text
        else:
            clock.advance(31)
            await reap_once(app_state)
        await verify_all(app_state)
        [verdict] = await verdicts(s.admin, s.headers, s.pool_id)
        assert (verdict["outcome"], verdict["category"], verdict["reason"]) == (
            "accepted",
            "valid",
            "verified",
        )
        assert "audit_skipped" in verdict["details"]
        assert verdict["reward_amount"] == 7
        b = await balances(client, first)
        assert b["rewards_pending"] + b["rewards_claimable"] == 7
        assert (await _task_detail(s))["replication"] == 1  # the audit replica withdrawn


@pytest.mark.parametrize("ending", ["cancel", "complete_pool"])
async def test_agreeing_results_of_a_task_that_ends_are_decided_by_the_quorum_rule(
    app: Any, app_state: Any, client: Any, ending: str
) -> None:
    """Two of a task's three replicas are in and agree, a strict majority of its quorum of
    three; then the task ends (an operator's cancel, the pool's completion) before the third
    comes. The results are put to the quorum rule on what is in, as when nobody takes the third
    replica in time, and accepted: they were rejected ``task_abandoned`` (inconclusive), unpaid
    and counted against both nodes' trust, although a pool's completion pays the results in."""
    async with pool_setup(app, app_state, workers=3, replication_factor=3, economics=ECON) as s:
        await s.enqueue([TASK], key="r3")
        await _answer(app_state, s, s.workers[:2], ["Paris", "Paris"])  # the third never answers
        assert await verdicts(s.admin, s.headers, s.pool_id) == []
        if ending == "cancel":
            url = f"/v1/admin/pools/{s.pool_id}/tasks/{(await _task_detail(s))['id']}/cancel"
            assert (await s.admin.post(url, headers=s.headers)).status_code == 200
        else:
            for action in ("pause", "complete"):
                r = await s.admin.post(f"/v1/admin/pools/{s.pool_id}/{action}", headers=s.headers)
                assert r.status_code == 200, r.text
        await verify_all(app_state)
        vs = await verdicts(s.admin, s.headers, s.pool_id)
        assert [(v["category"], v["reason"], v["verifier"], v["reward_amount"]) for v in vs] == [
            ("valid", "verified", "quorum", 7)
        ] * 2
        for worker in s.workers[:2]:
            b = await balances(client, worker)
            assert b["rewards_pending"] + b["rewards_claimable"] == 7


async def test_a_tie_break_asked_for_by_a_late_rejected_sibling_gets_a_full_wait(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    """The audit replica was leased past the wait (left to finish) and its answer failed its
    checks, so a tie-break replica is added. The wait counts from the newest waiting result,
    here the first, older than the wait: the tie-break was withdrawn at the next tick, before any
    node could take it, and the honest first result was inconclusive (quorum_timeout)."""
    async with pool_setup(app, app_state, workers=3, economics=ECON) as s:
        first, sibling, third = s.workers
        await s.enqueue([TASK], key="audit")
        await _answer(app_state, s, [first], ["Paris"])
        audit = (await sibling.claim(s.pool_id)).json()["leases"][0]
        await _tick(app_state, clock, WAIT_S + 5)  # leased: left to finish
        await submit(sibling, audit, ["Paris"], seed=12345)  # the wrong seed: refused by its checks
        await verify_all(app_state)
        assert (await _task_detail(s))["replication"] == 3  # the tie-break replica
        assert (await _tick(app_state, clock, 1)).quorum_waits_expired == 0
        lease = (await third.claim(s.pool_id)).json()["leases"][0]
        await submit(third, lease, ["Paris"])
        await verify_all(app_state)
        decided = {
            v["node_id"]: (v["category"], v["reason"]) for v in await verdicts(s.admin, s.headers, s.pool_id)
        }
        assert decided[first.node_id][0] == decided[third.node_id][0] == "valid", decided


async def test_the_wait_does_not_run_while_the_pool_is_paused(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    """A paused pool grants no claims, so no node can take an audit replica there: past the wait
    the audit was skipped and the unchecked answer paid (a cheater's garbage, submitted on a lease
    still out at the pause). The wait counts only while the pool is active, from its resume."""
    async with pool_setup(app, app_state, workers=3, economics=ECON) as s:
        first, sibling, third = s.workers
        await s.enqueue([TASK], key="audit")
        await _answer(app_state, s, [first], ["Lyon"])
        r = await s.admin.post(f"/v1/admin/pools/{s.pool_id}/pause", headers=s.headers)
        assert r.status_code == 200, r.text

        assert (await _tick(app_state, clock, 10 * WAIT_S)).quorum_waits_expired == 0
        assert await verdicts(s.admin, s.headers, s.pool_id) == []

        r = await s.admin.post(f"/v1/admin/pools/{s.pool_id}/resume", headers=s.headers)
        assert r.status_code == 200, r.text
        for worker in (sibling, third):
            assert (await worker.beat()).status_code == 200
        # A full wait from the resume: the replica is still offered.
        assert (await _tick(app_state, clock, WAIT_S - 1)).quorum_waits_expired == 0
        await _answer(app_state, s, [sibling], ["Paris"])
        await _answer(app_state, s, [third], ["Paris"])  # the tie-break
        vs = {v["node_id"]: v for v in await verdicts(s.admin, s.headers, s.pool_id)}
        assert (vs[first.node_id]["category"], vs[first.node_id]["reason"]) == ("invalid", "quorum_minority")
        assert vs[first.node_id]["reward_amount"] == 0
        assert [vs[w.node_id]["category"] for w in (sibling, third)] == ["valid", "valid"]
