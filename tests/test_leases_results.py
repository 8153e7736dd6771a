"""Leases (heartbeat extension, release, expiry and reissue, max attempts) and signed results
(fencing, idempotency, conflicts, staleness, evidence)."""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import hashlib
import itertools
import json
import math
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import httpx
import pytest
from sqlalchemy import event, func, select, text

from orchestrator.core.clock import FakeClock
from orchestrator.core.keys import generate_key
from orchestrator.core.signing import DEFAULT_COMPONENTS, MAX_TARGET_URI_LENGTH, SignatureAuth, sign_headers
from orchestrator.tasks import evidence
from orchestrator.tasks import jobs as task_jobs
from orchestrator.tasks import router as tasks_router
from orchestrator.tasks.jobs import reap_once
from orchestrator.tasks.models import Assignment, Submission, Task, TaskReplica
from orchestrator.verification.models import VerificationJob
from tests.conftest import postgres_only, problem
from tests.tasks_helpers import pool_setup, result_body, task
from tests.waits import taking, until, until_waiting


async def test_heartbeats_extend_leases_and_name_the_ones_to_drop(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    async with pool_setup(app, app_state, workers=1, lease_duration_s=100) as s:
        w = s.workers[0]
        await s.enqueue([task()])
        lease = (await w.claim(s.pool_id)).json()["leases"][0]
        for _ in range(6):  # 6 x 30 s > 100 s lease: alive only because the beats extend it
            clock.advance(30)
            r = await w.beat([lease["assignment_id"], "asg_not-mine"])
            assert r.json()["drop_leases"] == ["asg_not-mine"]
        assert (await reap_once(app_state)).expired == 0
        assert (await w.submit(lease)).status_code == 201


async def test_a_heartbeat_says_until_when_each_lease_it_names_is_held(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    """The answer named only the leases to drop: a client learnt a lease's new deadline only from
    GET /v1/nodes/me/leases. It now gives each named lease still held with its deadline after
    the beat (pushed back, or not yet, or capped at max_lease_s), and no other."""
    async with pool_setup(app, app_state, workers=2, lease_duration_s=60, max_lease_s=150) as s:
        me, other = s.workers
        await s.enqueue([task("a"), task("b"), task("c")])
        first, second = (await me.claim(s.pool_id, max_tasks=2)).json()["leases"]
        theirs = (await other.claim(s.pool_id)).json()["leases"][0]
        assert (await me.release(second)).status_code == 200

        async def held() -> list[dict[str, Any]]:
            r = await me.client.get("/v1/nodes/me/leases", auth=me.contributor.node_auth)
            return [{k: x[k] for k in ("assignment_id", "lease_expires_at")} for x in r.json()["leases"]]

        named = [first["assignment_id"], second["assignment_id"], theirs["assignment_id"], "asg_none"]
        clock.advance(10)  # 50 s of 60 left: not pushed back yet, and said as it is
        beat = (await me.beat([*named, first["assignment_id"]])).json()
        assert (
            beat["lease_deadlines"]
            == await held()
            == [{"assignment_id": first["assignment_id"], "lease_expires_at": first["lease_expires_at"]}]
        )
        assert beat["drop_leases"] == named[1:]
        deadlines = [first["lease_expires_at"]]
        for step in (35, 40, 40):  # 15 s, then 20 s left: pushed back to 60 s from now, then
            clock.advance(step)  # to 150 s from the claim, which comes first
            beat = (await me.beat(named)).json()
            assert beat["lease_deadlines"] == await held()
            assert beat["drop_leases"] == named[1:]
            deadlines.append(beat["lease_deadlines"][0]["lease_expires_at"])
        assert deadlines == sorted(set(deadlines))  # each beat pushed it back
        at = [dt.datetime.fromisoformat(x) for x in deadlines]
        assert at[-1] - at[0] == dt.timedelta(seconds=150 - 60)  # max_lease_s from the claim
        clock.advance(26)  # 151 s from the claim: gone
        beat = (await me.beat(named)).json()
        assert (beat["lease_deadlines"], beat["drop_leases"]) == ([], named)
        # A beat that names no lease lists none.
        assert (await me.beat()).json()["lease_deadlines"] == []


async def test_heartbeats_extend_a_lease_no_further_than_max_lease_s_from_its_claim(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    """A node that listed a lease in every heartbeat and never answered kept it for ever: the
    replica was never reissued. A lease now runs out at the pool's max_lease_s from its claim,
    whatever the beats, and its replica goes to another node."""
    async with pool_setup(app, app_state, workers=2, lease_duration_s=60, max_lease_s=150) as s:
        squatter, other = s.workers
        await s.enqueue([task()])
        lease = (await squatter.claim(s.pool_id)).json()["leases"][0]
        for _ in range(4):  # 4 x 35 s = 140 s: each beat extends it, up to 150 s from the claim
            clock.advance(35)
            assert (await squatter.beat([lease["assignment_id"]])).json()["drop_leases"] == []
            await other.beat()
        clock.advance(11)  # 151 s from the claim
        assert (await squatter.beat([lease["assignment_id"]])).json()["drop_leases"] == [
            lease["assignment_id"]
        ]
        await other.beat()
        assert (await reap_once(app_state)).expired == 1
        again = (await other.claim(s.pool_id)).json()["leases"]
        assert [await s.task_of(x) for x in again] == [await s.task_of(lease)]
        problem(await squatter.submit(lease), 409, "lease_expired")
        assert (await other.submit(again[0])).status_code == 201


async def test_max_lease_s_is_at_least_the_lease_duration(app: Any, app_state: Any) -> None:
    async with pool_setup(app, app_state, lease_duration_s=600) as s:
        url = f"/v1/admin/pools/{s.pool_id}"
        r = await s.admin.patch(url, json={"policy": {"max_lease_s": 599}}, headers=s.headers)
        problem(r, 422, "validation_failed")
        assert "max_lease_s (599) must be at least lease_duration_s (600)" in r.text
        r = await s.admin.patch(url, json={"policy": {"lease_duration_s": 2 * 86400}}, headers=s.headers)
        problem(r, 422, "validation_failed")
        pool = (await s.admin.get(url, headers=s.headers)).json()
        assert (pool["policy"]["lease_duration_s"], pool["policy"]["max_lease_s"]) == (600, 86400)
        body = {"policy": {"lease_duration_s": 2 * 86400, "max_lease_s": 3 * 86400}}
        r = await s.admin.patch(url, json=body, headers=s.headers)
        assert r.status_code == 200, r.text
        assert r.json()["policy"]["max_lease_s"] == 3 * 86400


async def test_an_expired_lease_is_reissued_and_the_old_holder_is_fenced_off(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    async with pool_setup(app, app_state, workers=2, lease_duration_s=60) as s:
        slow, fast = s.workers
        await s.enqueue([task()])
        old = (await slow.claim(s.pool_id)).json()["leases"][0]
        clock.advance(61)
        await fast.beat()
        report = await reap_once(app_state)
        assert report.ran and report.expired == 1
        new = (await fast.claim(s.pool_id)).json()["leases"][0]
        assert await s.task_of(new) == await s.task_of(old)
        assert new["fencing_token"] == old["fencing_token"] + 1
        assert new["seed"] == old["seed"]
        problem(await slow.submit(old), 409, "lease_expired")
        # Even with the new token, the old assignment cannot answer for the new lease.
        problem(await slow.submit(old, fencing_token=new["fencing_token"]), 409, "lease_expired")
        assert (await fast.submit(new)).status_code == 201
        beat = await slow.beat([old["assignment_id"]])
        assert beat.json()["drop_leases"] == [old["assignment_id"]]
        stats = (await s.admin.get(f"/v1/admin/pools/{s.pool_id}/lease-stats", headers=s.headers)).json()
        assert stats[0]["node_id"] == slow.node_id and stats[0]["expired"] == 1


async def test_a_lease_past_its_deadline_leaves_the_nodes_cap_before_the_reaper_ends_it(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    """A lease that ran out is refused its result at once, so it no longer holds a place under
    ``max_leases_per_node`` either: the node claims again without waiting for the reaper's tick
    (it was ``lease_cap_reached`` until then)."""
    async with pool_setup(app, app_state, workers=1, lease_duration_s=60, max_leases_per_node=1) as s:
        w = s.workers[0]
        await s.enqueue([task("a"), task("b")])
        [old] = (await w.claim(s.pool_id)).json()["leases"]
        assert (await w.claim(s.pool_id)).json()["reason"] == "lease_cap_reached"
        clock.advance(61)
        await w.beat()
        [new] = (await w.claim(s.pool_id)).json()["leases"]
        assert new["task"]["task_id"] != old["task"]["task_id"]
        problem(await w.submit(old), 409, "lease_expired")
        assert (await w.submit(new)).status_code == 201


async def test_a_task_fails_after_max_attempts_with_its_history(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    async with pool_setup(app, app_state, workers=3, lease_duration_s=60, max_attempts=2) as s:
        task_id = (await s.enqueue([task()])).json()["first_task_id"]
        for w in s.workers[:2]:
            for other in s.workers:
                await other.beat()
            assert len((await w.claim(s.pool_id)).json()["leases"]) == 1
            clock.advance(61)
            await reap_once(app_state)
        await s.workers[2].beat()
        assert (await s.workers[2].claim(s.pool_id)).json()["reason"] == "no_tasks"
        detail = (await s.admin.get(f"/v1/admin/pools/{s.pool_id}/tasks/{task_id}", headers=s.headers)).json()
        assert detail["status"] == "failed"
        assert "max attempts" in detail["failure_reason"]
        assert detail["end_reason"] == "max_attempts"
        assert [a["status"] for a in detail["assignments"]] == ["expired", "expired"]
        assert [a["node_id"] for a in detail["assignments"]] == [w.node_id for w in s.workers[:2]]


async def test_a_sibling_replicas_result_after_max_attempts_says_the_task_failed(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    """One replica's expiries fail the task and withdraw the other replica's live lease: that
    lease's result is refused saying the task failed (max attempts), not that it was cancelled."""
    async with pool_setup(app, app_state, workers=2, lease_duration_s=60, max_attempts=1) as s:
        task_id = (await s.enqueue([task(replication=2)])).json()["first_task_id"]
        first, second = s.workers
        await first.beat()
        assert len((await first.claim(s.pool_id)).json()["leases"]) == 1
        clock.advance(31)
        await second.beat()
        [lease] = (await second.claim(s.pool_id)).json()["leases"]
        clock.advance(31)  # the first lease ran out; the second has 29 s left
        await reap_once(app_state)
        detail = (await s.admin.get(f"/v1/admin/pools/{s.pool_id}/tasks/{task_id}", headers=s.headers)).json()
        assert (detail["status"], detail["end_reason"]) == ("failed", "max_attempts")
        body = problem(await second.submit(lease), 409, "task_cancelled")
        assert (body["task_status"], body["end_reason"]) == ("failed", "max_attempts")
        assert body["detail"] == "the task failed (max_attempts); the result is not recorded"


async def test_the_reaper_runs_once_per_tick(app: Any, app_state: Any, clock: FakeClock) -> None:

    async with pool_setup(app, app_state, workers=1, lease_duration_s=60) as s:
        await s.enqueue([task("a"), task("b")])
        await s.workers[0].claim(s.pool_id, max_tasks=2)
        clock.advance(70)
        reports = await asyncio.gather(reap_once(app_state), reap_once(app_state), reap_once(app_state))
        assert sum(r.ran for r in reports) == 1
        assert sum(r.expired for r in reports) == 2


async def test_the_reaper_drains_a_backlog_larger_than_a_batch_in_one_tick(
    app: Any, app_state: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Leases and tasks past their deadline beyond one batch are reaped in the same tick, a
    transaction per batch (one batch per 5 s tick before: 40,000 leases of dead nodes took
    200 s to be reissued). Within the tick's 5 s budget, on the app's clock, on which the
    batches take no time here."""
    monkeypatch.setattr(task_jobs, "REAP_BATCH", 2)
    async with pool_setup(app, app_state, workers=2, lease_duration_s=60, max_leases_per_node=8) as s:
        first, second = s.workers
        await s.enqueue([task(f"q{i}") for i in range(5)], key="leased")
        deadline = (clock.utcnow() + dt.timedelta(seconds=30)).isoformat()
        await s.enqueue([task(f"d{i}", deadline_at=deadline) for i in range(3)], key="due")
        assert len((await first.claim(s.pool_id, max_tasks=5)).json()["leases"]) == 5
        clock.advance(61)
        report = await reap_once(app_state)
        assert (report.expired, report.past_deadline, report.batches) == (5, 3, 3)
        await second.beat()
        leases = (await second.claim(s.pool_id, max_tasks=8)).json()["leases"]
        assert sorted(x["task"]["prompt"] for x in leases) == [f"q{i}" for i in range(5)]


async def test_a_reaper_tick_that_spends_its_budget_stops_and_the_next_goes_on(
    app: Any, app_state: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tick takes no new batch once its interval (5 s) has gone by; the next tick reaps what
    it left. Each batch of two takes 3 s on the app's clock here: two batches a tick."""
    monkeypatch.setattr(task_jobs, "REAP_BATCH", 2)
    taking(monkeypatch, task_jobs, "reap_expired", clock, 3)
    async with pool_setup(app, app_state, workers=2, lease_duration_s=60, max_leases_per_node=8) as s:
        first, second = s.workers
        await s.enqueue([task(f"q{i}") for i in range(5)], key="leased")
        assert len((await first.claim(s.pool_id, max_tasks=5)).json()["leases"]) == 5
        clock.advance(61)
        report = await reap_once(app_state)
        assert (report.ran, report.expired, report.batches) == (True, 4, 2)
        await second.beat()
        assert len((await second.claim(s.pool_id, max_tasks=8)).json()["leases"]) == 4
        report = await reap_once(app_state)  # the next tick: the clock has moved 6 s
        assert (report.ran, report.expired, report.batches) == (True, 1, 1)
        leases = (await second.claim(s.pool_id, max_tasks=8)).json()["leases"]
        assert len(leases) == 1


async def test_a_released_lease_is_reissued_at_once(app: Any, app_state: Any) -> None:
    async with pool_setup(app, app_state, workers=2) as s:
        await s.enqueue([task()])
        lease = (await s.workers[0].claim(s.pool_id)).json()["leases"][0]
        assert (await s.workers[1].claim(s.pool_id)).json()["reason"] == "no_tasks"
        r = await s.workers[0].client.post(
            f"/v1/assignments/{lease['assignment_id']}/release",
            json={},
            auth=s.workers[0].contributor.node_auth,
        )
        assert r.status_code == 200 and r.json()["status"] == "released"
        assert len((await s.workers[1].claim(s.pool_id)).json()["leases"]) == 1
        problem(await s.workers[0].submit(lease), 409, "lease_expired")


async def test_a_node_gets_back_the_replica_it_gave_back_with_the_same_seed(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    """A worker that stops gives its leases back; started again, it takes them back (with the
    same seed, so there is nothing to shop for). Before, a node never got back a task it had
    held: in a one-node pool a restart stranded the task for ever. An expired lease (an
    attempt) and a failure are still never taken back."""
    async with pool_setup(app, app_state, workers=1, lease_duration_s=60, max_failures=5) as s:
        w = s.workers[0]
        await s.enqueue([task("given back"), task("expired"), task("failed")])
        [lease] = (await w.claim(s.pool_id)).json()["leases"]
        assert lease["task"]["prompt"] == "given back"
        assert (await w.release(lease)).status_code == 200
        [again] = (await w.claim(s.pool_id)).json()["leases"]
        assert again["task"]["task_id"] == lease["task"]["task_id"]
        assert again["seed"] == lease["seed"] and again["fencing_token"] == lease["fencing_token"] + 1
        problem(await w.submit(lease), 409, "lease_expired")  # the old lease stays fenced off
        assert (await w.submit(again)).status_code == 201

        [expiring] = (await w.claim(s.pool_id)).json()["leases"]
        assert expiring["task"]["prompt"] == "expired"
        clock.advance(61)
        await w.beat()
        assert (await reap_once(app_state)).expired == 1
        [failing] = (await w.claim(s.pool_id)).json()["leases"]
        assert failing["task"]["prompt"] == "failed"
        assert (await w.release(failing, error="engine crashed")).status_code == 200
        r = await w.claim(s.pool_id)
        assert (r.json()["leases"], r.json()["reason"]) == ([], "no_tasks")
        other = await s.add_worker()
        taken = (await other.claim(s.pool_id, max_tasks=2)).json()["leases"]
        assert sorted(x["task"]["prompt"] for x in taken) == ["expired", "failed"]


async def test_a_pool_may_let_a_node_take_back_a_lease_that_expired_on_it(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    """In a one-node pool, a worker down for longer than the lease stranded the tasks it held:
    an expired lease was never taken back. With ``retake_expired_after_s`` the node gets the
    same replica again (same seed, next fencing token) that long after the expiry, and each
    expiry is still an attempt, so a node alone still cannot hold a task past max_attempts."""
    async with pool_setup(
        app, app_state, workers=1, lease_duration_s=60, max_attempts=2, retake_expired_after_s=60
    ) as s:
        w = s.workers[0]
        task_id = (await s.enqueue([task("stranded"), task("failed")])).json()["first_task_id"]
        [lease] = (await w.claim(s.pool_id)).json()["leases"]
        assert lease["task"]["prompt"] == "stranded"
        clock.advance(61)
        assert (await reap_once(app_state)).expired == 1
        [failing] = (await w.claim(s.pool_id)).json()["leases"]
        assert (await w.release(failing, error="engine crashed")).status_code == 200
        clock.advance(59)  # 59 s after the expiry: not yet
        await w.beat()
        r = await w.claim(s.pool_id)
        assert r.status_code == 200, r.text
        assert (r.json()["leases"], r.json()["reason"]) == ([], "no_tasks")
        clock.advance(2)
        await w.beat()
        [again] = (await w.claim(s.pool_id, max_tasks=2)).json()["leases"]  # not the failed one
        assert await s.task_of(again) == task_id
        assert again["seed"] == lease["seed"] and again["fencing_token"] == lease["fencing_token"] + 1
        problem(await w.submit(lease), 409, "lease_expired")

        clock.advance(61)  # the second expiry is the replica's second attempt: the task fails
        assert (await reap_once(app_state)).expired == 1
        clock.advance(61)  # (the test signs in real time: the clock moves < 300 s in all)
        await w.beat()
        assert (await w.claim(s.pool_id)).json()["reason"] == "no_tasks"
        detail = (await s.admin.get(f"/v1/admin/pools/{s.pool_id}/tasks/{task_id}", headers=s.headers)).json()
        assert (detail["status"], detail["end_reason"]) == ("failed", "max_attempts")
        assert [(a["node_id"], a["status"]) for a in detail["assignments"]] == [(w.node_id, "expired")] * 2


async def test_a_node_never_takes_another_replica_of_a_task_it_gave_back(app: Any, app_state: Any) -> None:
    """Taking back the replica it gave back is allowed because its seed is the same; another
    replica of the task has another seed, and a node that could take it could try seeds until
    one suited it."""
    async with pool_setup(app, app_state, workers=3, replication_factor=2) as s:
        a, b, c = s.workers
        await s.enqueue([task("first"), task("next")])
        [first] = (await a.claim(s.pool_id)).json()["leases"]
        [second] = (await c.claim(s.pool_id)).json()["leases"]
        assert first["task"]["prompt"] == second["task"]["prompt"] == "first"
        assert (await a.release(first)).status_code == 200
        [taken] = (await b.claim(s.pool_id)).json()["leases"]
        assert taken["seed"] == first["seed"]  # b has a's replica now
        assert (await c.release(second)).status_code == 200  # the other replica is free
        # a is passed over for that task, and gets the next one (not an empty claim).
        [instead] = (await a.claim(s.pool_id)).json()["leases"]
        assert instead["task"]["prompt"] == "next"
        [back] = (await c.claim(s.pool_id)).json()["leases"]
        assert back["task"]["prompt"] == "first" and back["seed"] == second["seed"]


async def test_a_task_that_fails_on_the_nodes_of_max_failures_providers_ends_failed(
    app: Any, app_state: Any
) -> None:
    """A poison task (one every backend fails on) no longer goes round every node of the pool:
    a release with an error counts once per provider, and at the pool's max_failures the task
    ends failed with its history (it was reissued to every node, each losing its time)."""
    async with pool_setup(app, app_state, max_failures=2) as s:
        shared = generate_key()
        a, a_twin, b, c = [
            await s.add_worker(provider_key=shared),
            await s.add_worker(provider_key=shared),
            await s.add_worker(),
            await s.add_worker(),
        ]
        task_id = (await s.enqueue([task()])).json()["first_task_id"]
        for node, error in ((a, "CUDA out of memory"), (a_twin, "CUDA out of memory again")):
            [lease] = (await node.claim(s.pool_id)).json()["leases"]
            r = await node.release(lease, error=error)
            assert r.status_code == 200 and (r.json()["status"], r.json()["error"]) == ("released", error)
        view = await s.admin.get(f"/v1/admin/pools/{s.pool_id}/tasks/{task_id}", headers=s.headers)
        assert view.json()["status"] == "open"  # two nodes, but one provider
        [lease] = (await b.claim(s.pool_id)).json()["leases"]
        assert (await b.release(lease, error="vLLM engine died")).status_code == 200
        detail = (await s.admin.get(f"/v1/admin/pools/{s.pool_id}/tasks/{task_id}", headers=s.headers)).json()
        assert (detail["status"], detail["end_reason"]) == ("failed", "max_failures")
        assert detail["failure_reason"] == "failed on the nodes of 2 providers (max failures)"
        assert sorted(x["error"] for x in detail["assignments"]) == [
            "CUDA out of memory",
            "CUDA out of memory again",
            "vLLM engine died",
        ]
        assert (await c.claim(s.pool_id)).json()["reason"] == "no_tasks"
        # Releasing again changes nothing.
        again = await b.release(lease, error="something else")
        assert again.status_code == 200 and again.json()["error"] == "vLLM engine died"
        stats = (await s.admin.get(f"/v1/admin/pools/{s.pool_id}/lease-stats", headers=s.headers)).json()
        assert {row["node_id"]: (row["released"], row["failed"]) for row in stats} == {
            a.node_id: (1, 1),
            a_twin.node_id: (1, 1),
            b.node_id: (1, 1),
        }


async def test_the_nodes_of_several_providers_at_one_address_count_as_one_failure(
    app: Any, app_state: Any
) -> None:
    """max_failures counts providers at distinct addresses, as the placement rule does: one
    machine holding several provider keys (registering a provider costs nothing) could
    otherwise end any task by claiming it with each and releasing it with an error."""
    async with pool_setup(app, app_state, max_failures=2) as s:
        a = await s.add_worker(ip="203.0.113.7")
        b = await s.add_worker(ip="203.0.113.7")  # another provider, the same machine
        c = await s.add_worker()
        assert a.contributor.provider_id != b.contributor.provider_id
        task_id = (await s.enqueue([task()])).json()["first_task_id"]
        for node in (a, b):
            [lease] = (await node.claim(s.pool_id)).json()["leases"]
            assert (await node.release(lease, error="CUDA out of memory")).status_code == 200
        view = await s.admin.get(f"/v1/admin/pools/{s.pool_id}/tasks/{task_id}", headers=s.headers)
        assert view.json()["status"] == "open"  # two providers, but one address
        [lease] = (await c.claim(s.pool_id)).json()["leases"]
        assert (await c.release(lease, error="vLLM engine died")).status_code == 200
        detail = (await s.admin.get(f"/v1/admin/pools/{s.pool_id}/tasks/{task_id}", headers=s.headers)).json()
        assert (detail["status"], detail["end_reason"]) == ("failed", "max_failures")
        assert detail["failure_reason"] == "failed on the nodes of 3 providers at 2 addresses (max failures)"


async def test_a_node_whose_leases_keep_failing_is_kept_from_claiming_for_a_while(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    """A broken backend fails at once and would claim again at once: three failing releases in
    a row (no result in between) keep the node out of the pool's claims for 60 s, doubled with
    each further failure; a result ends the streak."""
    async with pool_setup(app, app_state, workers=1, max_failures=10, lease_duration_s=3600) as s:
        w = s.workers[0]
        await s.enqueue([task(f"q{i}") for i in range(8)])

        async def fail_one() -> None:
            [lease] = (await w.claim(s.pool_id)).json()["leases"]
            assert (await w.release(lease, error="engine crashed")).status_code == 200

        async def member() -> dict[str, Any]:
            r = await s.admin.get(f"/v1/admin/pools/{s.pool_id}/members", headers=s.headers)
            [m] = [m for m in r.json()["items"] if m["node_id"] == w.node_id]
            return dict(m)

        for _ in range(3):
            await fail_one()
        r = await w.claim(s.pool_id)
        assert (r.json()["leases"], r.json()["reason"]) == ([], "node_failing")
        assert r.headers["retry-after"] == "60" and r.json()["retry_after_s"] == 60
        assert (await member())["failure_streak"] == 3
        clock.advance(61)
        await w.beat()
        await fail_one()  # the fourth in a row: 120 s
        assert (await w.claim(s.pool_id)).json()["retry_after_s"] == 120
        clock.advance(121)
        await w.beat()
        [lease] = (await w.claim(s.pool_id)).json()["leases"]
        assert (await w.submit(lease)).status_code == 201  # a result ends the streak
        await fail_one()
        assert (await member())["failure_streak"] == 1
        assert len((await w.claim(s.pool_id)).json()["leases"]) == 1


async def test_a_release_without_an_error_counts_nothing_against_the_task(app: Any, app_state: Any) -> None:
    async with pool_setup(app, app_state, workers=3, max_failures=1) as s:
        first, second, third = s.workers
        task_id = (await s.enqueue([task()])).json()["first_task_id"]
        [lease] = (await first.claim(s.pool_id)).json()["leases"]
        r = await first.release(lease)
        assert r.status_code == 200 and r.json()["error"] is None
        [lease] = (await second.claim(s.pool_id)).json()["leases"]
        no_body = await second.client.post(
            f"/v1/assignments/{lease['assignment_id']}/release", auth=second.contributor.node_auth
        )
        assert no_body.status_code == 200 and no_body.json()["status"] == "released"
        [lease] = (await third.claim(s.pool_id)).json()["leases"]
        assert (await third.submit(lease)).status_code == 201
        view = await s.admin.get(f"/v1/admin/pools/{s.pool_id}/tasks/{task_id}", headers=s.headers)
        assert view.json()["status"] == "submitted"


async def test_a_release_with_a_bad_error_is_refused_and_changes_nothing(app: Any, app_state: Any) -> None:
    async with pool_setup(app, app_state, workers=1, max_failures=1) as s:
        w = s.workers[0]
        await s.enqueue([task()])
        [lease] = (await w.claim(s.pool_id)).json()["leases"]
        for body in ({"error": ""}, {"error": "x" * 1001}, {"error": "nul \x00"}, {"error": 7}, {"why": "x"}):
            problem(await w.release(lease, **body), 422, "validation_failed")
        beat = await w.beat([lease["assignment_id"]])
        assert beat.json()["drop_leases"] == []  # still the node's
        assert (await w.submit(lease)).status_code == 201


async def test_a_node_reads_its_live_leases_as_its_claims_gave_them(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    async with pool_setup(app, app_state, workers=2, lease_duration_s=60, max_leases_per_node=4) as s:
        me, other = s.workers
        await s.enqueue([task(f"q{i}") for i in range(5)])
        claimed = (await me.claim(s.pool_id, max_tasks=3)).json()["leases"]
        assert len((await other.claim(s.pool_id)).json()["leases"]) == 1

        async def mine(query: str = "") -> Any:
            return await me.client.get(f"/v1/nodes/me/leases{query}", auth=me.contributor.node_auth)

        r = await mine()
        assert r.status_code == 200
        assert r.json()["leases"] == claimed  # the same payload, oldest first; not the other node's
        assert "verification" not in r.text and "expected_answer" not in r.text
        assert (await mine(f"?pool_id={s.pool_id}")).json()["leases"] == claimed
        assert (await mine("?pool_id=pool_elsewhere")).json()["leases"] == []
        # Neither a result's, nor a released one, nor one past its deadline.
        assert (await me.submit(claimed[0])).status_code == 201
        assert (await me.release(claimed[1])).status_code == 200
        assert [x["assignment_id"] for x in (await mine()).json()["leases"]] == [claimed[2]["assignment_id"]]
        clock.advance(61)
        assert (await mine()).json()["leases"] == []
        problem(await mine("?pool_id=%00"), 400, "invalid_query")
        problem(await me.client.get("/v1/nodes/me/leases"), 401, "signature_missing")


async def test_results_are_idempotent_and_a_different_body_conflicts(app: Any, app_state: Any) -> None:
    async with pool_setup(app, app_state, workers=1) as s:
        w = s.workers[0]
        await s.enqueue([task()])
        lease = (await w.claim(s.pool_id)).json()["leases"][0]
        first = await w.submit(lease)
        assert first.status_code == 201
        assert first.json()["status"] == "pending"
        again = await w.submit(lease)
        assert again.status_code == 200 and again.json() == first.json()
        problem(await w.submit(lease, claimed_reward=0.0), 409, "result_conflict")
        async with app_state.sessionmaker() as session:
            subs = list((await session.execute(select(Submission))).scalars())
        assert len(subs) == 1


async def send_spelled(w: Any, path: str, body: dict[str, Any], **dumps: Any) -> httpx.Response:
    """POST ``body`` to ``path``, signed by the worker's node, as ``json.dumps(**dumps)`` spells it."""
    return await w.client.post(
        path,
        content=json.dumps(body, **dumps).encode(),
        headers={"content-type": "application/json"},
        auth=w.contributor.node_auth,
    )


async def test_a_result_sent_again_spelled_otherwise_is_the_same_result(app: Any, app_state: Any) -> None:
    """PROTOCOL.md: a result is idempotent per assignment. A client that sends it again after a
    lost answer may serialize it afresh: its JSON keys in another order (a Rust HashMap's order
    changes from one process to the next), other whitespace, 1 for 1.0. That says the same, as
    the admin API's idempotency keys already hold (core/digest.py), and answers the first
    answer; it was 409 result_conflict, the raw bytes' SHA-256 being compared."""
    async with pool_setup(app, app_state, workers=1) as s:
        w = s.workers[0]
        await s.enqueue([task()])
        lease = (await w.claim(s.pool_id)).json()["leases"][0]
        first = await w.submit(lease, claimed_reward=1.0)
        assert first.status_code == 201, first.text
        path = f"/v1/assignments/{lease['assignment_id']}/result"
        send = partial(send_spelled, w, path)

        body = result_body(lease, claimed_reward=1)
        again = await send(dict(reversed(list(body.items()))), indent=2, sort_keys=True)
        assert again.status_code == 200, again.text
        assert again.json() == first.json()
        # What it says still counts: another answer is a conflict, however it is spelled.
        other = result_body(lease, claimed_reward=0.5)
        problem(await send(other, indent=2, sort_keys=True), 409, "result_conflict")
        async with app_state.sessionmaker() as session:
            [sub] = (await session.execute(select(Submission))).scalars()
        assert sub.body == first.request.content  # the evidence is the first request's bytes


async def test_a_small_body_sent_again_does_not_make_the_server_read_a_large_result(
    app: Any, app_state: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A result sent again with other bytes is compared by what it says, which reads and parses
    the stored body (up to max_result_body_bytes). A node whose first result was large must not
    make the server do that for every small body it sends to the same assignment: a 200-byte
    request then cost a 10 MB read and two parses, where a conflict used to cost a row read. A
    body that could say the same is at least an eighth of the stored one's size (respelling
    JSON, whitespace and escapes, does not shrink it more); a smaller one is a conflict unread."""
    from orchestrator.tasks import service as tasks_service

    parsed: list[int] = []
    validate = tasks_service.ResultIn.model_validate_json

    def spy(data: Any, *args: Any, **kwargs: Any) -> Any:
        parsed.append(len(data))
        return validate(data, *args, **kwargs)

    monkeypatch.setattr(tasks_service.ResultIn, "model_validate_json", spy)
    async with pool_setup(app, app_state, workers=1) as s:
        w = s.workers[0]
        await s.enqueue([task(n=1)])
        lease = (await w.claim(s.pool_id)).json()["leases"][0]
        big = result_body(lease)
        big["samples"][0]["completion"] = "x" * 400_000
        first = await w.submit(lease, samples=big["samples"])
        assert first.status_code == 201, first.text
        path = f"/v1/assignments/{lease['assignment_id']}/result"
        send = partial(send_spelled, w, path)

        problem(await send(result_body(lease)), 409, "result_conflict")
        assert parsed == []  # the stored 400 KB were not read
        # The same large result, spelled otherwise, is still compared, and the same.
        again = await send(big, indent=2, sort_keys=True)
        assert again.status_code == 200 and again.json() == first.json()
        assert parsed and max(parsed) > 400_000


async def test_only_the_lease_holder_can_submit(app: Any, app_state: Any) -> None:
    async with pool_setup(app, app_state, workers=2) as s:
        holder, thief = s.workers
        await s.enqueue([task()])
        lease = (await holder.claim(s.pool_id)).json()["leases"][0]
        problem(await thief.submit(lease), 404, "assignment_not_found")
        assert (await holder.submit(lease)).status_code == 201


async def test_stale_and_unknown_policies_are_refused(app: Any, app_state: Any) -> None:
    async with pool_setup(app, app_state, workers=1, step=10, max_async_level=2) as s:
        w = s.workers[0]
        await s.enqueue([task()])
        lease = (await w.claim(s.pool_id)).json()["leases"][0]
        for step in (11, 13):  # 12 is never published
            await s.publish(step)
        body = problem(await w.submit(lease, policy_step=10), 409, "policy_stale")
        assert body["current_step"] == 13
        problem(await w.submit(lease, policy_step=14), 409, "policy_unknown")
        problem(await w.submit(lease, policy_step=12), 409, "policy_unknown")
        assert (await w.submit(lease, policy_step=11)).status_code == 201


async def test_the_signed_request_is_kept_as_evidence(app: Any, app_state: Any) -> None:
    async with pool_setup(app, app_state, workers=1) as s:
        w = s.workers[0]
        await s.enqueue([task(n=2)])
        lease = (await w.claim(s.pool_id)).json()["leases"][0]
        r = await w.submit(lease, seed=12345)
        assert r.status_code == 201
        sent = r.request
        async with app_state.sessionmaker() as session:
            sub = (await session.execute(select(Submission))).scalar_one()
        assert sub.body == sent.content
        assert sub.signature == sent.headers["signature"]
        assert sub.signature_input == sent.headers["signature-input"]
        assert sub.content_digest == sent.headers["content-digest"]
        assert sub.target_uri == str(sent.url)
        assert sub.seed_echoed == 12345 and sub.sample_count == 2
        assert json.loads(sub.body)["samples"][0]["completion"] == "answer 0"
        # The evidence still verifies, whoever re-checks it later.
        from orchestrator.core.signing import verify_request

        checked = verify_request(
            method=sub.method,
            url=sub.target_uri,
            query="",
            headers=[
                ("signature-input", sub.signature_input),
                ("signature", sub.signature),
                ("content-digest", sub.content_digest or ""),
            ],
            body=sub.body,
            now=app_state.clock.now(),
            window_s=300,
        )
        assert checked.keyid == w.node_id


async def submissions_of(s: Any, task_id: int, **params: Any) -> list[dict[str, Any]]:
    url = f"/v1/admin/pools/{s.pool_id}/tasks/{task_id}/submissions"
    r = await s.admin.get(url, params=params, headers=s.headers)
    assert r.status_code == 200, r.text
    assert r.json()["task_id"] == task_id
    return list(r.json()["submissions"])


async def test_operators_recheck_a_results_evidence(app: Any, app_state: Any) -> None:
    async with pool_setup(app, app_state, workers=1) as s:
        w = s.workers[0]
        task_id = (await s.enqueue([task()])).json()["first_task_id"]
        lease = (await w.claim(s.pool_id)).json()["leases"][0]
        sent = (await w.submit(lease)).request
        (sub,) = await submissions_of(s, task_id)
        assert sub["check"] == {"valid": True, "keyid": w.node_id, "code": None, "detail": None}
        assert sub["assignment_id"] == lease["assignment_id"] and sub["node_id"] == w.node_id
        assert sub["evidence"]["body_base64"] is None  # bodies only on request: up to 10 MiB each
        assert sub["evidence"]["body_sha256"] == hashlib.sha256(sent.content).hexdigest()
        (sub,) = await submissions_of(s, task_id, include_body="true")
        assert base64.b64decode(sub["evidence"]["body_base64"]) == sent.content
        assert sub["evidence"]["signed_fields"] == [["content-digest", sent.headers["content-digest"]]]

        # Evidence altered after the fact no longer checks out, and says how.
        async with app_state.sessionmaker() as session, session.begin():
            row = (await session.execute(select(Submission))).scalar_one()
            row.body = row.body.replace(b"answer 0", b"answer 9")
        assert (await submissions_of(s, task_id))[0]["check"]["code"] == "body_altered"
        async with app_state.sessionmaker() as session, session.begin():
            row = (await session.execute(select(Submission))).scalar_one()
            row.body_sha256 = hashlib.sha256(row.body).hexdigest()
        assert (await submissions_of(s, task_id))[0]["check"]["code"] == "digest_mismatch"
        async with app_state.sessionmaker() as session, session.begin():
            row = (await session.execute(select(Submission))).scalar_one()
            row.body, row.body_sha256 = sent.content, hashlib.sha256(sent.content).hexdigest()
            row.target_uri = row.target_uri.replace("/result", "/release")
        assert (await submissions_of(s, task_id))[0]["check"]["code"] == "signature_invalid"

        problem(
            await s.admin.get(
                f"/v1/admin/pools/{s.pool_id}/tasks/{task_id + 1}/submissions", headers=s.headers
            ),
            404,
            "task_not_found",
        )


async def test_rechecking_a_tasks_evidence_does_not_hold_up_the_other_requests(
    app: Any, app_state: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every read of a task's results hashes each stored body and verifies its signature again
    (some 50 ms for a 10 MiB body, up to 16 replicas and their audits a task). That ran on the
    event loop: a trainer's or operator's read held up every other request of the process for
    its whole length, heartbeats and /healthz included. Here a recheck that takes its time (the
    large bodies' hashing) waits for /healthz to answer meanwhile; it now runs in a thread."""
    async with pool_setup(app, app_state, workers=1) as s:
        w = s.workers[0]
        task_id = (await s.enqueue([task()])).json()["first_task_id"]
        lease = (await w.claim(s.pool_id)).json()["leases"][0]
        await w.submit(lease)
        entered, answered = threading.Event(), threading.Event()
        answered_meanwhile: list[bool] = []
        real = evidence.recheck

        def slow(sub: Submission, *, window_s: int) -> evidence.EvidenceCheck:
            entered.set()
            answered_meanwhile.append(answered.wait(timeout=2))
            return real(sub, window_s=window_s)

        monkeypatch.setattr(evidence, "recheck", slow)
        reading = asyncio.ensure_future(submissions_of(s, task_id))
        await until(entered.is_set, "the recheck began")
        assert (await s.admin.get("/healthz")).status_code == 200
        answered.set()
        (sub,) = await reading
        assert sub["check"]["valid"], sub["check"]
        assert answered_meanwhile == [True]


async def test_evidence_keeps_every_signed_field(app: Any, app_state: Any) -> None:
    """PROTOCOL.md lets a signature cover more fields than content-digest (here content-type and
    a header of the client's own): the stored evidence must still verify on its own, later."""
    async with pool_setup(app, app_state, workers=1) as s:
        w = s.workers[0]
        task_id = (await s.enqueue([task()])).json()["first_task_id"]
        lease = (await w.claim(s.pool_id)).json()["leases"][0]
        auth = SignatureAuth(w.contributor.node_key, (*DEFAULT_COMPONENTS, "content-type", "x-run"))
        r = await w.client.post(
            f"/v1/assignments/{lease['assignment_id']}/result",
            json=result_body(lease),
            headers={"x-run": "run-7"},
            auth=auth,
        )
        assert r.status_code == 201, r.text
        (sub,) = await submissions_of(s, task_id)
        assert sub["check"]["valid"], sub["check"]
        assert dict(sub["evidence"]["signed_fields"]) == {
            "content-digest": r.request.headers["content-digest"],
            "content-type": "application/json",
            "x-run": "run-7",
        }


async def test_evidence_of_a_signature_that_covers_signature_input_verifies(app: Any, app_state: Any) -> None:
    """A signature may cover the Signature-Input field itself (RFC 9421 does not forbid it): the
    server accepts it, so its stored evidence must verify again too. Signature-Input was passed
    to the re-check twice (its own column and its covered line), made two dictionary members of
    one label, and the valid result read as ``signature_malformed``."""
    async with pool_setup(app, app_state, workers=1) as s:
        w = s.workers[0]
        task_id = (await s.enqueue([task()])).json()["first_task_id"]
        lease = (await w.claim(s.pool_id)).json()["leases"][0]
        key = w.contributor.node_key
        url = f"http://testserver/v1/assignments/{lease['assignment_id']}/result"
        body = json.dumps(result_body(lease)).encode()
        digest = "sha-256=:" + base64.b64encode(hashlib.sha256(body).digest()).decode() + ":"
        params = (
            '("@method" "@target-uri" "content-digest" "signature-input")'
            f';created={int(app_state.clock.now())};keyid="{w.node_id}";nonce="covers-its-input"'
        )
        signature_input = f"sig1={params}"
        base = "\n".join(
            [
                '"@method": POST',
                f'"@target-uri": {url}',
                f'"content-digest": {digest}',
                f'"signature-input": {signature_input}',
                f'"@signature-params": {params}',
            ]
        )
        signature = base64.b64encode(key.sign(base.encode()).signature).decode()
        headers = {
            "content-type": "application/json",
            "content-digest": digest,
            "signature-input": signature_input,
            "signature": f"sig1=:{signature}:",
        }
        r = await w.client.post(url, content=body, headers=headers)
        assert r.status_code == 201, r.text
        (sub,) = await submissions_of(s, task_id)
        assert sub["check"] == {"valid": True, "keyid": w.node_id, "code": None, "detail": None}
        assert dict(sub["evidence"]["signed_fields"])["signature-input"] == signature_input


async def test_evidence_of_a_result_a_proxy_signed_too_verifies(app: Any, app_state: Any) -> None:
    """A proxy on the way may add its own signature (RFC 9421, section 4.3), which the server
    ignores: the result is accepted, and its evidence, kept whole, verifies again as the node's."""
    async with pool_setup(app, app_state, workers=1) as s:
        w = s.workers[0]
        task_id = (await s.enqueue([task()])).json()["first_task_id"]
        lease = (await w.claim(s.pool_id)).json()["leases"][0]
        url = f"http://testserver/v1/assignments/{lease['assignment_id']}/result"
        body = json.dumps(result_body(lease)).encode()
        headers = sign_headers(w.contributor.node_key, method="POST", url=url, body=body)
        proxy_input = 'edge=("@method" "signature";key="pyhms");keyid="edge-1";alg="hmac-sha256"'
        proxy_signature = "edge=:" + base64.b64encode(bytes(32)).decode() + ":"
        r = await w.client.post(
            url,
            content=body,
            headers=[
                *headers.items(),
                ("signature-input", proxy_input),
                ("signature", proxy_signature),
                ("content-type", "application/json"),
            ],
        )
        assert r.status_code == 201, r.text
        (sub,) = await submissions_of(s, task_id)
        assert sub["check"] == {"valid": True, "keyid": w.node_id, "code": None, "detail": None}
        assert proxy_input in sub["evidence"]["signature_input"]


async def test_evidence_of_a_signature_at_the_edge_of_its_window_verifies(
    app: Any, app_state: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A result is recorded as received at the time its signature's created and expires were
    checked, and its evidence is re-checked at received_at: taken later (after the nonce's round
    trip), a signature accepted at the edge of its window (created window_s ago, or expires now)
    read as ``signature_stale`` / ``signature_expired`` on every later re-check."""
    window_s = app_state.settings.signature.window_s
    async with pool_setup(app, app_state, workers=1) as s:
        w = s.workers[0]
        task_id = (await s.enqueue([task()])).json()["first_task_id"]
        lease = (await w.claim(s.pool_id)).json()["leases"][0]
        clock.advance(math.ceil(clock.now()) - clock.now())  # a whole second: created can equal it
        verified_at = int(clock.now())
        url = f"http://testserver/v1/assignments/{lease['assignment_id']}/result"
        body = json.dumps(result_body(lease)).encode()
        headers = sign_headers(
            w.contributor.node_key,
            method="POST",
            url=url,
            body=body,
            created=verified_at - window_s,
            expires=verified_at,
        )
        # Server time moves on while the request is served (as a real clock does).
        ticking = (verified_at + i / 4 for i in itertools.count())
        monkeypatch.setattr(clock, "now", lambda: next(ticking))
        monkeypatch.setattr(clock, "utcnow", lambda: dt.datetime.fromtimestamp(next(ticking), dt.UTC))
        r = await w.client.post(url, content=body, headers={**headers, "content-type": "application/json"})
        assert r.status_code == 201, r.text
        monkeypatch.undo()
        (sub,) = await submissions_of(s, task_id)
        assert sub["check"] == {"valid": True, "keyid": w.node_id, "code": None, "detail": None}
        assert r.json()["received_at"] == dt.datetime.fromtimestamp(verified_at, dt.UTC).isoformat().replace(
            "+00:00", "Z"
        )


async def test_evidence_is_rechecked_with_the_window_its_signature_was_accepted_in(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    """The re-check read today's ``ORCH_SIGNATURE__WINDOW_S``: once an operator lowered it, a
    result signed 100 s before its receipt (valid then, in a 300 s window) read as
    ``signature_stale`` for good. A result keeps the window it was checked against."""
    async with pool_setup(app, app_state, workers=1) as s:
        w = s.workers[0]
        task_id = (await s.enqueue([task()])).json()["first_task_id"]
        lease = (await w.claim(s.pool_id)).json()["leases"][0]
        url = f"http://testserver/v1/assignments/{lease['assignment_id']}/result"
        body = json.dumps(result_body(lease)).encode()
        created = int(clock.now()) - 100
        headers = sign_headers(w.contributor.node_key, method="POST", url=url, body=body, created=created)
        r = await w.client.post(url, content=body, headers={**headers, "content-type": "application/json"})
        assert r.status_code == 201, r.text
        signature = app_state.settings.signature.model_copy(update={"window_s": 30})
        app_state.settings = app_state.settings.model_copy(update={"signature": signature})
        (sub,) = await submissions_of(s, task_id)
        assert sub["check"] == {"valid": True, "keyid": w.node_id, "code": None, "detail": None}


async def test_a_task_is_submitted_when_all_replicas_are(app: Any, app_state: Any) -> None:
    async with pool_setup(app, app_state, workers=2, replication_factor=2) as s:
        task_id = (await s.enqueue([task()])).json()["first_task_id"]
        leases = [(await w.claim(s.pool_id)).json()["leases"][0] for w in s.workers]
        assert (await s.workers[0].submit(leases[0])).status_code == 201
        detail = (await s.admin.get(f"/v1/admin/pools/{s.pool_id}/tasks/{task_id}", headers=s.headers)).json()
        assert detail["status"] == "open"
        assert (await s.workers[1].submit(leases[1])).status_code == 201
        detail = (await s.admin.get(f"/v1/admin/pools/{s.pool_id}/tasks/{task_id}", headers=s.headers)).json()
        assert detail["status"] == "submitted"
        assert [r["status"] for r in detail["replicas"]] == ["submitted", "submitted"]


async def test_results_are_validated(app: Any, app_state: Any) -> None:
    async with pool_setup(app, app_state, workers=1) as s:
        w = s.workers[0]
        await s.enqueue([task()])
        lease = (await w.claim(s.pool_id)).json()["leases"][0]
        for bad in (
            {"samples": []},
            {"proof": "not base64!"},
            {"claimed_reward": "high"},
            {"samples": [{"finish_reason": "stop"}]},
        ):
            r = await w.client.post(
                f"/v1/assignments/{lease['assignment_id']}/result",
                json={**result_body(lease), **bad},
                auth=w.contributor.node_auth,
            )
            problem(r, 422, "validation_failed")
        assert (await w.submit(lease)).status_code == 201


SAMPLE = {"completion": "42", "finish_reason": "stop", "prompt_tokens": 3, "completion_tokens": 2}


@asynccontextmanager
async def one_lease(app: Any, app_state: Any) -> AsyncIterator[tuple[Any, dict[str, Any]]]:
    """A worker and the lease it holds on a one-sample task, for results sent to it by hand."""
    async with pool_setup(app, app_state, workers=1) as s:
        w = s.workers[0]
        await s.enqueue([task(n=1)])
        yield w, (await w.claim(s.pool_id)).json()["leases"][0]


async def test_numbers_inside_a_results_lists_and_maps_are_json_numbers(app: Any, app_state: Any) -> None:
    """Token ids and logprob summaries were read leniently: a token id true or "5" was stored as
    1 or 5, and a logprob summary of "-0.5" as -0.5. Each is 422 naming the place now, and the
    result is not recorded: the lease takes the right answer afterwards."""
    async with one_lease(app, app_state) as (w, lease):
        sample = dict(SAMPLE)
        for bad, loc in (
            ({"token_ids": [5, True]}, ["token_ids", 1]),
            ({"token_ids": ["5"]}, ["token_ids", 0]),
            ({"token_ids": [5.0]}, ["token_ids", 0]),
            ({"logprob_summary": {"mean": "-0.5"}}, ["logprob_summary", "mean"]),
            ({"logprob_summary": {"mean": False}}, ["logprob_summary", "mean"]),
            # A name is a statistic's, not a place for a megabyte the feed would serve.
            ({"logprob_summary": {"m" * 65: -0.5}}, ["logprob_summary", "m" * 65, "[key]"]),
            ({"logprob_summary": {"": -0.5}}, ["logprob_summary", "", "[key]"]),
        ):
            r = await w.client.post(
                f"/v1/assignments/{lease['assignment_id']}/result",
                json=result_body(lease, samples=[{**sample, **bad}]),
                auth=w.contributor.node_auth,
            )
            body = problem(r, 422, "validation_failed")
            assert any(e["loc"][-len(loc) :] == loc for e in body["errors"]), (bad, body)
        good = [{**sample, "token_ids": [5, 7], "logprob_summary": {"mean": -0.5, "min": -2}}]
        r = await w.client.post(
            f"/v1/assignments/{lease['assignment_id']}/result",
            json=result_body(lease, samples=good),
            auth=w.contributor.node_auth,
        )
        assert r.status_code == 201, r.text


async def test_a_result_holding_text_that_is_not_unicode_is_refused(app: Any, app_state: Any) -> None:
    """JSON can spell a lone surrogate (\\ud800), which is no Unicode character: a string field
    holding one was refused, but a logprob summary's name was taken as it was, stored, and served
    by the trainer feed as bytes that are not UTF-8 (RFC 8259 section 8.1), which a strict JSON
    parser (orjson, serde_json) refuses: a node could leave a page of the pool's feed that such a
    trainer never reads past. Each is 422 naming the place now, and nothing is recorded: the
    lease takes the right answer afterwards."""
    async with one_lease(app, app_state) as (w, lease):
        sample = dict(SAMPLE)
        for bad, loc in (
            # The name's place is the name (as a replacement character) then "[key]".
            ({"logprob_summary": {"LONE": -0.5}}, ["logprob_summary", "[key]"]),
            ({"logprob_summary": {"mean": -0.5, "x LONE": -1.0}}, ["logprob_summary", "[key]"]),
            ({"completion": "4LONE2"}, ["completion", "completion"]),
        ):
            raw = json.dumps(result_body(lease, samples=[{**sample, **bad}])).replace("LONE", "\\ud800")
            r = await w.client.post(
                f"/v1/assignments/{lease['assignment_id']}/result",
                content=raw.encode(),
                headers={"Content-Type": "application/json"},
                auth=w.contributor.node_auth,
            )
            body = problem(r, 422, "validation_failed")
            assert any(loc[0] in e["loc"] and e["loc"][-1] == loc[-1] for e in body["errors"]), (bad, body)
        async with app_state.sessionmaker() as session:
            assert await session.scalar(select(func.count()).select_from(Submission)) == 0
        assert (await w.submit(lease)).status_code == 201


async def test_leaving_a_pool_gives_its_leases_back_at_once(app: Any, app_state: Any) -> None:
    async with pool_setup(app, app_state, workers=2) as s:
        quitter, other = s.workers
        await s.enqueue([task()])
        lease = (await quitter.claim(s.pool_id)).json()["leases"][0]
        assert (await other.claim(s.pool_id)).json()["reason"] == "no_tasks"
        r = await quitter.client.post(
            f"/v1/pools/{s.pool_id}/leave", json={}, auth=quitter.contributor.node_auth
        )
        assert r.status_code == 200
        assert (await quitter.beat([lease["assignment_id"]])).json()["drop_leases"] == [
            lease["assignment_id"]
        ]
        again = (await other.claim(s.pool_id)).json()["leases"]
        assert [await s.task_of(le) for le in again] == [await s.task_of(lease)]
        problem(await quitter.submit(lease), 409, "lease_expired")


async def test_concurrent_results_for_the_replicas_of_each_task_close_it_exactly_once(
    app: Any, app_state: Any
) -> None:
    """Three nodes submit the three replicas of 20 tasks all at once: every write lands once, and
    each task is closed by its last replica in (the submitted count read as the row is updated)."""
    async with pool_setup(app, app_state, workers=3, replication_factor=3, max_leases_per_node=20) as s:
        await s.enqueue([task(f"q{i}") for i in range(20)])
        leases = {w.node_id: (await w.claim(s.pool_id, max_tasks=20)).json()["leases"] for w in s.workers}
        assert all(len(mine) == 20 for mine in leases.values())
        responses = await asyncio.gather(*(w.submit(lease) for w in s.workers for lease in leases[w.node_id]))
        assert [r.status_code for r in responses] == [201] * 60
        async with app_state.sessionmaker() as session:
            tasks = list((await session.execute(select(Task))).scalars())
            assert [(t.status, t.submitted_replicas) for t in tasks] == [("submitted", 3)] * 20
            replicas = list((await session.execute(select(TaskReplica.status))).scalars())
            assert replicas == ["submitted"] * 60
            assert await session.scalar(select(func.count()).select_from(Submission)) == 60
            assert await session.scalar(select(func.count()).select_from(VerificationJob)) == 60
            live = await session.scalar(
                select(func.count()).select_from(Assignment).where(Assignment.status != "submitted")
            )
            assert live == 0


async def test_the_same_result_sent_twice_at_once_is_recorded_once_and_replayed(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    """The second copy waits for the first's lock; when the first commits it must be answered
    with the first's response, not told the lease expired (on PostgreSQL its join had read the
    submissions before the first committed)."""
    from api_schemas.tasks import ResultIn
    from orchestrator.core.errors import Conflict
    from orchestrator.core.signing import SignedRequest
    from orchestrator.tasks import service

    async with pool_setup(app, app_state, workers=1) as s:
        w = s.workers[0]
        await s.enqueue([task()])
        lease = (await w.claim(s.pool_id)).json()["leases"][0]
        raw = json.dumps(result_body(lease)).encode()
        body = ResultIn.model_validate_json(raw)
        target = f"http://testserver/v1/assignments/{lease['assignment_id']}/result"

        def signed(nonce: str) -> SignedRequest:
            return SignedRequest(
                keyid=w.node_id, nonce=nonce, created=0, covered=("@method", "@target-uri"), method="POST",
                target_uri=target, signature_input="sig=()", signature="sig=::", content_digest=None, body=raw,
            )  # fmt: skip

        first_written = asyncio.Event()

        async def second() -> Any:
            await first_written.wait()
            async with app_state.sessionmaker() as session, session.begin():
                try:
                    return await service.submit_result(
                        session,
                        signed("second-copy"),
                        lease["assignment_id"],
                        body,
                        now=clock.utcnow(),
                        ref_key=app_state.settings.seed_key,
                    )
                except Conflict as exc:
                    return exc

        sending_again = asyncio.create_task(second())
        async with app_state.sessionmaker() as session, session.begin():
            a = await service.submit_result(
                session,
                signed("first-copy"),
                lease["assignment_id"],
                body,
                now=clock.utcnow(),
                ref_key=app_state.settings.seed_key,
            )
            first_written.set()
            if app_state.engine.dialect.name == "postgresql":  # SQLite: one writer at a time anyway
                await until_waiting(app_state, 1, sending_again, on="row")  # not yet committed
        b = await sending_again
        assert not isinstance(b, Conflict), b.code
        assert (a.created, b.created) == (True, False)
        assert b.out.submission_id == a.out.submission_id
        async with app_state.sessionmaker() as session:
            assert await session.scalar(select(func.count()).select_from(Submission)) == 1


async def test_a_signed_url_longer_than_2048_characters_is_refused_before_anything_is_recorded(
    app: Any, app_state: Any
) -> None:
    # The URL is kept as evidence with the result, in a column of MAX_TARGET_URI_LENGTH.
    assert Submission.__table__.c.target_uri.type.length == MAX_TARGET_URI_LENGTH == 2048
    async with pool_setup(app, app_state, workers=1) as s:
        w = s.workers[0]
        await s.enqueue([task()])
        lease = (await w.claim(s.pool_id)).json()["leases"][0]
        path = f"/v1/assignments/{lease['assignment_id']}/result"
        fixed = len(f"http://testserver{path}?pad=")
        for pad, status in ((MAX_TARGET_URI_LENGTH - fixed + 1, 414), (MAX_TARGET_URI_LENGTH - fixed, 201)):
            url = f"{path}?pad={'x' * pad}"
            r = await w.client.post(url, json=result_body(lease), auth=w.contributor.node_auth)
            if status == 414:
                problem(r, 414, "uri_too_long")
                async with app_state.sessionmaker() as session:
                    assert (await session.execute(select(func.count()).select_from(Submission))).scalar() == 0
            else:
                assert r.status_code == 201, r.text
                async with app_state.sessionmaker() as session:
                    sub = (await session.execute(select(Submission))).scalar_one()
                assert len(sub.target_uri) == MAX_TARGET_URI_LENGTH


async def test_a_heartbeat_naming_a_lease_id_with_a_nul_is_refused_as_bad_input(
    app: Any, app_state: Any
) -> None:
    """PostgreSQL cannot compare text holding a NUL: such an id is a body that does not
    validate (422), not a 500; an id of no lease of the node's, however odd, is to be dropped."""
    async with pool_setup(app, app_state, workers=1) as s:
        w = s.workers[0]
        await s.enqueue([task()])
        lease = (await w.claim(s.pool_id)).json()["leases"][0]
        body = problem(await w.beat([lease["assignment_id"], "asg_\x00"]), 422, "validation_failed")
        assert body["errors"][0]["loc"] == ["body", "leases", 1]
        odd = "x" * 100
        assert (await w.beat([lease["assignment_id"], odd])).json()["drop_leases"] == [odd]


async def test_a_heartbeat_naming_a_lease_id_that_is_not_unicode_is_refused_as_bad_input(
    app: Any, app_state: Any
) -> None:
    """JSON can spell a lone surrogate (\\ud800), which UTF-8 cannot encode: a lease id holding
    one reached the database, which failed the heartbeat with a 500. It is a 422 naming the id
    now, and the lease is still extended by the next beat."""
    async with pool_setup(app, app_state, workers=1) as s:
        w = s.workers[0]
        await s.enqueue([task()])
        lease = (await w.claim(s.pool_id)).json()["leases"][0]
        raw = json.dumps({"leases": [lease["assignment_id"], "asg_LONE"]}).replace("LONE", "\\ud800")
        r = await w.client.post(
            "/v1/nodes/me/heartbeat",
            content=raw.encode(),
            headers={"Content-Type": "application/json"},
            auth=w.contributor.node_auth,
        )
        body = problem(r, 422, "validation_failed")
        assert body["errors"][0]["loc"] == ["body", "leases", 1], body
        assert "no lone surrogate" in body["detail"]
        r = await w.beat([lease["assignment_id"]])
        assert r.status_code == 200 and r.json()["drop_leases"] == [], r.text


async def test_releasing_a_lease_after_it_ran_out_counts_as_its_expiry(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    """A lease past its deadline that the reaper has not reached yet is over: giving it back
    then must not pass for a timely release (which is no attempt), or a node could hold leases
    to the end and hide it from lease-stats, and the task would never reach max attempts."""
    async with pool_setup(app, app_state, workers=2, lease_duration_s=60, max_attempts=2) as s:
        task_id = (await s.enqueue([task()])).json()["first_task_id"]
        for i, w in enumerate(s.workers):
            await w.beat()
            lease = (await w.claim(s.pool_id)).json()["leases"][0]
            clock.advance(61)
            r = await w.client.post(
                f"/v1/assignments/{lease['assignment_id']}/release", json={}, auth=w.contributor.node_auth
            )
            assert r.status_code == 200 and r.json()["status"] == "expired", r.text
            detail = (
                await s.admin.get(f"/v1/admin/pools/{s.pool_id}/tasks/{task_id}", headers=s.headers)
            ).json()
            assert detail["replicas"][0]["expirations"] == i + 1
        assert (detail["status"], detail["end_reason"]) == ("failed", "max_attempts")
        assert [a["status"] for a in detail["assignments"]] == ["expired", "expired"]
        stats = (await s.admin.get(f"/v1/admin/pools/{s.pool_id}/lease-stats", headers=s.headers)).json()
        assert {(row["expired"], row["released"]) for row in stats} == {(1, 0)}
        assert (await reap_once(app_state)).expired == 0


async def test_a_dead_nodes_leases_end_and_their_replicas_are_reissued(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    """The sweeper frees a dead node's leases (docs/architecture): they expire at the next
    reaper tick, as attempts, instead of being held for the rest of a long lease duration."""
    from orchestrator.liveness.service import sweep_once

    async with pool_setup(app, app_state, workers=2, lease_duration_s=3600) as s:
        task_id = (await s.enqueue([task()])).json()["first_task_id"]
        gone, alive = s.workers
        lease = (await gone.claim(s.pool_id)).json()["leases"][0]
        for _ in range(10):  # 100 s without a beat from `gone`: dead after 9 intervals
            clock.advance(10)
            await alive.beat()
            await sweep_once(app_state)
        assert (await gone.client.get("/v1/nodes/me", auth=gone.contributor.node_auth)).json()[
            "status"
        ] == "dead"
        assert (await reap_once(app_state)).expired == 0  # two beats' grace (the next test)
        clock.advance(20)
        await alive.beat()
        assert (await reap_once(app_state)).expired == 1
        new = (await alive.claim(s.pool_id)).json()["leases"]
        assert [await s.task_of(le) for le in new] == [task_id]
        # Back from the dead, the node is told to drop the lease, and its result is fenced off.
        assert (await gone.beat([lease["assignment_id"]])).json()["drop_leases"] == [lease["assignment_id"]]
        problem(await gone.submit(lease), 409, "lease_expired")
        detail = (await s.admin.get(f"/v1/admin/pools/{s.pool_id}/tasks/{task_id}", headers=s.headers)).json()
        assert detail["replicas"][0]["expirations"] == 1
        assert [a["status"] for a in detail["assignments"]] == ["expired", "active"]


async def test_a_node_marked_dead_that_beats_again_within_two_intervals_keeps_its_leases(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    """A beat that crosses the sweeper's commit sees the node still healthy, so it does not
    revive it, and the node is dead until its next beat. Its leases used to run out at once
    and the reaper's next tick took them; they now last two more intervals, so that next beat
    revives the node and keeps them, and its result is accepted."""
    from orchestrator.liveness.service import sweep_once

    async with pool_setup(app, app_state, workers=2, lease_duration_s=3600) as s:
        await s.enqueue([task()])
        late, alive = s.workers
        lease = (await late.claim(s.pool_id)).json()["leases"][0]
        for _ in range(9):  # dead after 9 silent intervals, at this loop's last sweep
            clock.advance(10)
            await alive.beat()
            report = await sweep_once(app_state)
        assert report.to_dead == 1
        assert (await late.client.get("/v1/nodes/me", auth=late.contributor.node_auth)).json()[
            "status"
        ] == "dead"
        clock.advance(5)
        await alive.beat()
        assert (await reap_once(app_state)).expired == 0
        clock.advance(5)  # the next beat, 10 s after the one the sweeper crossed
        r = await late.beat([lease["assignment_id"]])
        assert (r.json()["status"], r.json()["drop_leases"]) == ("healthy", [])
        clock.advance(15)  # past the grace: the beat extended the lease
        await alive.beat()
        await late.beat([lease["assignment_id"]])
        assert (await reap_once(app_state)).expired == 0
        assert (await late.submit(lease)).status_code == 201


async def test_a_healthy_node_that_misses_a_beat_keeps_its_short_lease(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    """A lease of three heartbeat intervals (the shortest allowed, so that a healthy node cannot
    lose it between two beats): a node that missed one beat is still healthy, and its next beat
    must still find the lease live. Written only once less than half was left, the lease had
    16 s left after the beat at 14 s, and ran out before the beat at 34 s."""
    async with pool_setup(app, app_state, workers=1, lease_duration_s=30) as s:
        w = s.workers[0]
        await s.enqueue([task()])
        lease = (await w.claim(s.pool_id)).json()["leases"][0]
        clock.advance(14)
        assert (await w.beat([lease["assignment_id"]])).json()["drop_leases"] == []
        clock.advance(20)  # the beat due at 24 s was lost
        beat = (await w.beat([lease["assignment_id"]])).json()
        assert (beat["status"], beat["drop_leases"]) == ("healthy", [])
        assert (await reap_once(app_state)).expired == 0
        assert (await w.submit(lease)).status_code == 201


async def test_a_policy_step_beyond_a_64_bit_integer_is_a_body_that_does_not_validate(
    app: Any, app_state: Any
) -> None:
    """Steps are stored as signed 64-bit integers: a larger one is 422 (it was a 500, the
    database driver failing to bind it), and the lease can still be answered."""
    async with pool_setup(app, app_state, workers=1) as s:
        w = s.workers[0]
        await s.enqueue([task()])
        lease = (await w.claim(s.pool_id)).json()["leases"][0]
        body = problem(await w.submit(lease, policy_step=2**63), 422, "validation_failed")
        assert body["errors"][0]["loc"] == ["body", "policy_step"]
        async with app_state.sessionmaker() as session:
            assert await session.scalar(select(func.count()).select_from(Submission)) == 0
        assert (await w.submit(lease)).status_code == 201


async def test_the_openapi_schema_gives_a_result_s_64_bit_bounds_exactly(client: httpx.AsyncClient) -> None:
    """FastAPI writes a schema's bounds as JSON floats: ``le=2**63 - 1`` was documented as
    9.223372036854776e18, which is 2^63, a value the server refuses (422). The bounds are
    exclusive of 2^63 now, which a float holds exactly."""

    def largest(spec: dict[str, Any]) -> int:
        if "exclusiveMaximum" in spec:
            bound = spec["exclusiveMaximum"]
            return int(bound) - 1 if int(bound) == bound else int(bound)
        return int(spec["maximum"])

    schemas = (await client.get("/openapi.json")).json()["components"]["schemas"]
    result, sample = schemas["ResultIn"]["properties"], schemas["Sample"]["properties"]
    token_id = next(b for b in sample["token_ids"]["anyOf"] if b.get("type") == "array")["items"]
    for spec in (result["policy_step"], result["seed"], token_id):
        assert largest(spec) == 2**63 - 1, spec
    for spec in (result["seed"], token_id):
        assert spec["minimum"] == -(2**63), spec


async def test_leaving_a_pool_with_a_lease_that_ran_out_counts_its_expiry(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    """As for a release: a lease past its deadline when its node leaves the pool is over, and
    it expires then (an attempt, seen in lease-stats): it is not one given back in time. (It
    was left live for the reaper, and the first mark after an outage brought it back to life.)"""
    async with pool_setup(app, app_state, workers=1, lease_duration_s=60) as s:
        w = s.workers[0]
        task_id = (await s.enqueue([task()])).json()["first_task_id"]
        await w.claim(s.pool_id)
        clock.advance(61)
        r = await w.client.post(f"/v1/pools/{s.pool_id}/leave", json={}, auth=w.contributor.node_auth)
        assert r.status_code == 200, r.text
        assert (await reap_once(app_state)).expired == 0  # nothing left for the reaper
        detail = (await s.admin.get(f"/v1/admin/pools/{s.pool_id}/tasks/{task_id}", headers=s.headers)).json()
        assert [a["status"] for a in detail["assignments"]] == ["expired"]
        assert detail["replicas"][0]["expirations"] == 1
        stats = (await s.admin.get(f"/v1/admin/pools/{s.pool_id}/lease-stats", headers=s.headers)).json()
        assert (stats[0]["expired"], stats[0]["released"]) == (1, 0)


@postgres_only
async def test_a_heartbeat_that_waited_for_the_reaper_is_told_to_drop_the_lease_it_expired(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    """The beat reads the lease as live, then its extension waits for the reaper (of another
    process, whose clock is a little ahead), which expires the lease and reissues the replica.
    The extension then changes nothing, and the answer must say so: drop it, not keep working
    on a lease whose result will be refused."""
    from orchestrator.tasks.service import reap_expired

    async with pool_setup(app, app_state, workers=1, lease_duration_s=60) as s:
        w = s.workers[0]
        await s.enqueue([task()])
        lease = (await w.claim(s.pool_id)).json()["leases"][0]
        clock.advance(59.5)  # half a second left: the beat extends it
        async with app_state.sessionmaker() as session, session.begin():
            expired, _ = await reap_expired(session, now=clock.utcnow() + dt.timedelta(seconds=1))
            assert expired == 1
            beat = asyncio.create_task(w.beat([lease["assignment_id"]]))
            await until_waiting(app_state, 1, beat, on="row")
            assert not beat.done()  # its UPDATE waits for the reaper's lock
        r = await beat
        assert r.json()["drop_leases"] == [lease["assignment_id"]]
        problem(await w.submit(lease), 409, "lease_expired")


async def test_a_tasks_detail_shows_its_latest_leases_not_every_one_a_node_made(
    app: Any, app_state: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node may give a lease back without an error and lease the same replica again, as often
    as its request budget allows (15 times a second): the task's detail listed every lease it
    ever had, so one node could grow it by a million rows a day and have the next trainer or
    operator who looks at the task load them all. It now lists the latest TASK_LEASES_SHOWN
    (1,000), oldest first; the replicas' leases_issued still count them all."""
    monkeypatch.setattr(tasks_router, "TASK_LEASES_SHOWN", 3, raising=False)
    async with pool_setup(app, app_state, workers=1) as s:
        w = s.workers[0]
        task_id = (await s.enqueue([task()])).json()["first_task_id"]
        ids = []
        for _ in range(5):
            clock.advance(1)
            lease = (await w.claim(s.pool_id)).json()["leases"][0]
            ids.append(lease["assignment_id"])
            assert (await w.release(lease)).status_code == 200
        r = await s.admin.get(f"/v1/admin/pools/{s.pool_id}/tasks/{task_id}", headers=s.headers)
        assert r.status_code == 200, r.text
        assert [a["id"] for a in r.json()["assignments"]] == ids[-3:]
        assert r.json()["replicas"][0]["leases_issued"] == 5


async def test_a_tasks_detail_reads_its_latest_leases_through_an_index_without_a_sort(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    """The detail's latest TASK_LEASES_SHOWN leases were read by task id alone and sorted by
    time: the database still read and sorted every lease the task ever had (a million a day, if
    a node churns it), some 80 ms a read at half a million and growing with the task. They are
    now read from an index in that order, the latest first, stopping at the limit."""
    captured: list[tuple[str, Any]] = []

    def record(conn: Any, cursor: Any, statement: str, parameters: Any, *args: Any) -> None:
        if "FROM assignments" in statement and "LIMIT" in statement.upper():
            captured.append((statement, parameters))

    async with pool_setup(app, app_state, workers=1) as s:
        w = s.workers[0]
        task_id = (await s.enqueue([task()])).json()["first_task_id"]
        for _ in range(3):
            clock.advance(1)
            lease = (await w.claim(s.pool_id)).json()["leases"][0]
            assert (await w.release(lease)).status_code == 200
        engine = app_state.engine.sync_engine
        event.listen(engine, "before_cursor_execute", record)
        try:
            r = await s.admin.get(f"/v1/admin/pools/{s.pool_id}/tasks/{task_id}", headers=s.headers)
        finally:
            event.remove(engine, "before_cursor_execute", record)
        assert r.status_code == 200, r.text
        [(statement, parameters)] = captured
        async with app_state.engine.connect() as conn:
            if conn.dialect.name == "postgresql":
                # Whether an index serves the order at all, whatever a few rows' statistics make
                # cheapest: a sort the plan cannot do without stays in it, only costed higher.
                for method in ("seqscan", "bitmapscan", "sort"):
                    await conn.execute(text(f"SET LOCAL enable_{method} = off"))
                rows = await conn.exec_driver_sql("EXPLAIN " + statement, parameters)
                plan = "\n".join(row[0] for row in rows)
                assert "Sort" not in plan, plan
            else:
                rows = await conn.exec_driver_sql("EXPLAIN QUERY PLAN " + statement, parameters)
                plan = "\n".join(str(row[-1]) for row in rows)
                assert "TEMP B-TREE" not in plan, plan
            await conn.rollback()
        assert "ix_assignments_task_id_created_at" in plan, plan
