"""ReST^EM iterations: tasks under one policy, the barrier, completion and expiry, the dataset."""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import hashlib
import json
import math
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncSession

from orchestrator.admin.tokens import Role, create_token
from orchestrator.core.clock import FakeClock
from orchestrator.restem import service as restem_service
from orchestrator.restem.jobs import advance_once
from orchestrator.tasks import retention
from orchestrator.tasks.jobs import reap_once
from tests.conftest import asgi_stream, postgres_only, problem
from tests.tasks_helpers import PoolSetup, Worker, pool_setup, task
from tests.test_verification import ECON
from tests.verification_helpers import FixedDraw, accept_in_transaction, submit, verify_all
from tests.waits import HANG_S, until_waiting

QUESTIONS = {"p1": ("What is 2+2?", "4"), "p2": ("What is 3+3?", "6"), "p3": ("What is 5+5?", "10")}


pytestmark = pytest.mark.usefixtures("no_audits")


def iteration_body(
    name: str = "it-1", problems: tuple[str, ...] = ("p1", "p2"), **extra: Any
) -> dict[str, Any]:
    return {
        "name": name,
        "problems": [
            {"problem_id": pid, "prompt": QUESTIONS[pid][0], "verification": {"answer": QUESTIONS[pid][1]}}
            for pid in problems
        ],
        "samples_per_problem": 4,
        "keep_correct": 2,
        "policy_step": 1,
        **extra,
    }


def base(s: PoolSetup) -> str:
    return f"/v1/admin/pools/{s.pool_id}/restem/iterations"


async def create(s: PoolSetup, status: int = 201, headers: dict[str, str] | None = None, **body: Any) -> Any:
    r = await s.admin.post(base(s), json=iteration_body(**body), headers=headers or s.headers)
    assert r.status_code == status, r.text
    return r.json()


async def get(s: PoolSetup, iteration_id: int) -> dict[str, Any]:
    r = await s.admin.get(f"{base(s)}/{iteration_id}", headers=s.headers)
    assert r.status_code == 200, r.text
    return dict(r.json())


async def report(s: PoolSetup, iteration_id: int) -> dict[str, Any]:
    r = await s.admin.get(f"{base(s)}/{iteration_id}/report", headers=s.headers)
    assert r.status_code == 200, r.text
    return dict(r.json())


async def dataset(s: PoolSetup, iteration_id: int) -> str:
    r = await s.admin.get(f"{base(s)}/{iteration_id}/dataset", headers=s.headers)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/x-ndjson")
    return r.text


async def claim_all(worker: Worker, pool_id: str, count: int) -> dict[str, dict[str, Any]]:
    """Leases by problem id."""
    r = await worker.claim(pool_id, max_tasks=count)
    assert r.status_code == 200, r.text
    leases = r.json()["leases"]
    assert len(leases) == count, r.json()
    return {lease["task"]["metadata"]["restem"]["problem_id"]: lease for lease in leases}


async def test_an_iteration_enqueues_one_task_of_n_samples_per_problem(app: Any, app_state: Any) -> None:
    async with pool_setup(app, app_state, workers=1) as s:
        it = await create(s, problems=("p1", "p2", "p3"))
        assert it["status"] == "running" and it["policy_step"] == 1
        assert (it["samples_per_problem"], it["keep_correct"]) == (4, 2)
        assert it["sampling"] == {"temperature": 0.7, "top_p": 1.0, "top_k": 40, "max_tokens": 1024}
        assert it["progress"] == {
            "problems": 3,
            "problems_done": 0,
            "samples_requested": 12,
            "results_received": 0,
            "results_verified": 0,
        }
        r = await s.admin.get(f"/v1/admin/pools/{s.pool_id}/tasks", headers=s.headers)
        tasks = r.json()["items"]
        assert [t["prompt"] for t in tasks] == [QUESTIONS[p][0] for p in ("p1", "p2", "p3")]
        assert all(t["batch_id"] == it["batch_id"] and t["replication"] == 1 for t in tasks)
        assert {
            (t["sampling"]["n"], t["sampling"]["temperature"], t["sampling"]["top_k"]) for t in tasks
        } == {(4, 0.7, 40)}
        assert tasks[1]["verification"] == {"answer": "6"}
        assert tasks[1]["metadata"] == {"restem": {"iteration_id": it["id"], "problem_id": "p2"}}

        # What a worker gets: the iteration's sampling, no answer.
        lease = (await claim_all(s.workers[0], s.pool_id, 3))["p3"]
        assert lease["task"]["sampling"]["n"] == 4 and lease["task"]["sampling"]["temperature"] == 0.7
        assert "verification" not in lease["task"]


async def test_sampling_parameters_can_be_chosen(app: Any, app_state: Any) -> None:
    async with pool_setup(app, app_state, workers=1) as s:
        sampling = {"temperature": 1.0, "top_k": -1, "top_p": 0.95, "max_tokens": 2048}
        it = await create(s, samples_per_problem=64, sampling=sampling)
        assert it["sampling"] == sampling and it["progress"]["samples_requested"] == 128
        lease = next(iter((await claim_all(s.workers[0], s.pool_id, 2)).values()))
        assert lease["task"]["sampling"] == {**sampling, "n": 64}


async def test_a_running_iteration_blocks_the_next_one(app: Any, app_state: Any) -> None:
    async with pool_setup(app, app_state) as s:
        first = await create(s)
        body = problem(
            await s.admin.post(base(s), json=iteration_body(name="it-2"), headers=s.headers),
            409,
            "iteration_running",
        )
        assert body["iteration_id"] == first["id"]
        # The same request again is a no-op that returns the iteration; another body under its name is not.
        again = await create(s, status=200)
        assert again["id"] == first["id"]
        r = await s.admin.post(base(s), json=iteration_body(keep_correct=5), headers=s.headers)
        problem(r, 409, "iteration_name_taken")
        r = await s.admin.get(f"/v1/admin/pools/{s.pool_id}/tasks", headers=s.headers)
        assert len(r.json()["items"]) == 2  # nothing enqueued twice
        # Publishing a new policy is not blocked by the barrier.
        assert (await s.publish(2)).status_code == 201


async def test_an_iteration_retried_with_its_json_spelled_otherwise_is_the_same(
    app: Any, app_state: Any
) -> None:
    """The name compared a hash of the body's JSON as validated: the same iteration with a
    verification spec's keys in another order was refused (409 iteration_name_taken)."""
    async with pool_setup(app, app_state) as s:
        body = iteration_body()
        answer = QUESTIONS["p1"][1]
        body["problems"][0]["verification"] = {"answer": answer, "unit": "none"}
        first = await s.admin.post(base(s), json=body, headers=s.headers)
        assert first.status_code == 201, first.text
        body["problems"][0]["verification"] = {"unit": "none", "answer": answer}
        again = await s.admin.post(base(s), json=body, headers=s.headers)
        assert (again.status_code, again.json()["id"]) == (200, first.json()["id"])


async def test_an_iteration_deadline_or_step_out_of_range_is_refused(app: Any, app_state: Any) -> None:
    """A deadline whose UTC time falls outside years 1 to 9999 answered 500: it is a 422."""
    async with pool_setup(app, app_state) as s:
        for deadline in ("9999-12-31T23:59:59-12:00", "0001-01-01T00:00:00+14:00"):
            r = await s.admin.post(base(s), json=iteration_body(deadline_at=deadline), headers=s.headers)
            body = problem(r, 422, "validation_failed")
            assert body["errors"][0]["loc"] == ["body", "deadline_at"]
        # A step no policy can have (published steps are at most 10^12) is a bad body too.
        r = await s.admin.post(base(s), json=iteration_body(policy_step=2**64), headers=s.headers)
        assert problem(r, 422, "validation_failed")["errors"][0]["loc"] == ["body", "policy_step"]
        assert (await s.admin.get(base(s), headers=s.headers)).json()["items"] == []


async def test_an_iteration_needs_the_current_policy(app: Any, app_state: Any, clock: FakeClock) -> None:
    async with pool_setup(app, app_state) as s:
        assert (await s.publish(2)).status_code == 201
        body = problem(
            await s.admin.post(base(s), json=iteration_body(), headers=s.headers), 409, "policy_not_current"
        )
        assert body["current_step"] == 2
        past = (clock.utcnow() - dt.timedelta(seconds=1)).isoformat()
        r = await s.admin.post(
            base(s), json=iteration_body(policy_step=2, deadline_at=past), headers=s.headers
        )
        problem(r, 422, "deadline_passed")
        r = await s.admin.post(
            base(s), json=iteration_body(problems=("p1", "p1"), policy_step=2), headers=s.headers
        )
        problem(r, 422, "validation_failed")
    async with pool_setup(app, app_state, step=None) as s:
        problem(await s.admin.post(base(s), json=iteration_body(), headers=s.headers), 404, "no_policy")


async def test_the_iteration_completes_when_every_problem_is_verified(app: Any, app_state: Any) -> None:
    async with pool_setup(app, app_state, workers=1) as s:
        it = await create(s)
        w = s.workers[0]
        leases = await claim_all(w, s.pool_id, 2)
        await submit(w, leases["p1"], ["4", "4", "1", "2"])
        running = await get(s, it["id"])
        assert running["status"] == "running" and running["finished_at"] is None
        assert running["progress"]["results_received"] == 1
        problem(
            await s.admin.get(f"{base(s)}/{it['id']}/dataset", headers=s.headers), 409, "iteration_running"
        )

        await submit(w, leases["p2"], ["1", "2", "3", "5"])  # all wrong: rejected, but verified
        assert (await get(s, it["id"]))["status"] == "running"  # results in, verdicts not yet
        await verify_all(app_state)
        done = await get(s, it["id"])
        assert done["status"] == "complete" and done["finished_at"] is not None
        assert done["progress"]["problems_done"] == 2 and done["progress"]["results_verified"] == 2
        # The barrier is lifted.
        second = await create(s, name="it-2")
        assert second["status"] == "running"
        r = await s.admin.get(base(s), headers=s.headers)
        assert [(i["id"], i["status"]) for i in r.json()["items"]] == [
            (second["id"], "running"),
            (it["id"], "complete"),
        ]


async def test_an_iteration_expires_at_its_deadline_and_stops_its_tasks(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    async with pool_setup(app, app_state, workers=1) as s:
        deadline = clock.utcnow() + dt.timedelta(seconds=60)
        it = await create(s, problems=("p1", "p2", "p3"), deadline_at=deadline.isoformat())
        w = s.workers[0]
        leases = await claim_all(w, s.pool_id, 2)  # p3 is never claimed
        await submit(w, leases["p1"], ["4", "4", "4", "1"])
        await verify_all(app_state)
        await submit(w, leases["p2"], ["6", "6", "6", "6"])  # verified only after the deadline

        clock.advance(59)
        assert (await get(s, it["id"]))["status"] == "running"
        clock.advance(2)
        await verify_all(app_state)
        expired = await get(s, it["id"])
        assert expired["status"] == "expired"
        assert expired["finished_at"].replace("Z", "+00:00") == deadline.isoformat()
        r = await s.admin.get(f"/v1/admin/pools/{s.pool_id}/tasks", headers=s.headers)
        assert [(t["status"], t["end_reason"]) for t in r.json()["items"]] == [
            ("completed", None),
            ("completed", None),
            ("cancelled", "iteration_expired"),
        ]
        assert (await w.claim(s.pool_id)).json()["reason"] == "no_tasks"

        rep = await report(s, it["id"])
        by_id = {p["problem_id"]: p for p in rep["problems"]}
        assert (by_id["p1"]["verified_samples"], by_id["p1"]["correct_samples"]) == (4, 3)
        assert (by_id["p2"]["verified_samples"], by_id["p2"]["discarded_samples"]) == (0, 4)
        assert (by_id["p3"]["verified_samples"], by_id["p3"]["task_status"]) == (0, "cancelled")
        lines = [json.loads(x) for x in (await dataset(s, it["id"])).splitlines()]
        assert [x["problem_id"] for x in lines] == ["p1", "p1"]  # nothing decided after the deadline
        assert (await create(s, name="it-2"))["status"] == "running"


async def test_an_iteration_expires_even_when_the_lease_reaper_fails_its_tasks_first(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    async with pool_setup(app, app_state, workers=1) as s:
        deadline = clock.utcnow() + dt.timedelta(seconds=60)
        it = await create(s, problems=("p1", "p2"), deadline_at=deadline.isoformat())
        w = s.workers[0]
        leases = await claim_all(w, s.pool_id, 1)  # p2 is never claimed
        await submit(w, leases["p1"], ["4", "4", "4", "4"])
        await verify_all(app_state)
        clock.advance(61)
        assert (await reap_once(app_state)).past_deadline == 1  # the reaper gets there first
        r = await s.admin.get(f"/v1/admin/pools/{s.pool_id}/tasks", headers=s.headers)
        assert [(t["status"], t["end_reason"]) for t in r.json()["items"]] == [
            ("completed", None),
            ("failed", "deadline_passed"),
        ]
        expired = await get(s, it["id"])
        assert expired["status"] == "expired"
        assert expired["finished_at"].replace("Z", "+00:00") == deadline.isoformat()


async def test_the_barrier_loop_expires_iterations_without_a_read(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    async with pool_setup(app, app_state, workers=1) as s:
        deadline = clock.utcnow() + dt.timedelta(seconds=30)
        it = await create(s, deadline_at=deadline.isoformat())
        clock.advance(10)
        assert (await advance_once(app_state)).expired == 0
        clock.advance(30)
        report_ = await advance_once(app_state)
        assert report_.ran and report_.expired == 1
        assert (await s.workers[0].claim(s.pool_id)).json()["reason"] == "no_tasks"
        assert (await get(s, it["id"]))["status"] == "expired"


async def test_a_dataset_stops_when_its_token_is_revoked_while_it_streams(
    app: Any, app_state: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trainer token revoked while it read an iteration's dataset read the rest of it; the
    dataset now breaks off, unfinished, at the next chunk."""
    monkeypatch.setattr(restem_service, "DATASET_CHUNK", 1)
    async with pool_setup(app, app_state, workers=1) as s:
        it = await create(s)
        w = s.workers[0]
        leases = await claim_all(w, s.pool_id, 2)
        await submit(w, leases["p1"], ["4", "4", "1", "2"])
        await submit(w, leases["p2"], ["6", "1", "2", "3"])
        await verify_all(app_state)
        assert (await get(s, it["id"]))["status"] == "complete"
        async with app_state.sessionmaker() as session, session.begin():
            secret, row = await create_token(session, role=Role.trainer, name="trainer", pool_ids=[s.pool_id])

        async def revoke() -> None:
            r = await s.admin.post(f"/v1/admin/tokens/{row.id}/revoke", headers=s.admin_headers)
            assert r.status_code == 200, r.text

        path = f"{base(s)}/{it['id']}/dataset"
        parts, completed = await asgi_stream(app, path, secret, revoke)
        assert [json.loads(x)["problem_id"] for x in b"".join(parts).splitlines()] == ["p1", "p1"]
        assert not completed


async def test_a_verdict_written_after_the_iteration_expired_does_not_change_its_dataset(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    """An expired iteration counted verdicts by their date alone, and a verifier batch dates its
    verdicts when it starts: a batch that started before the deadline and wrote its verdict
    after the iteration expired changed the final dataset and report."""
    async with pool_setup(app, app_state, workers=1) as s:
        deadline = clock.utcnow() + dt.timedelta(seconds=60)
        it = await create(s, problems=("p1",), deadline_at=deadline.isoformat())
        w = s.workers[0]
        submitted = await submit(w, (await claim_all(w, s.pool_id, 1))["p1"], ["4"] * 4)
        clock.advance(61)
        assert (await get(s, it["id"]))["status"] == "expired"

        async def counted() -> tuple[str, dict[str, Any]]:
            totals = (await report(s, it["id"]))["totals"]
            return await dataset(s, it["id"]), totals

        before = await counted()
        assert before[0] == "" and before[1]["pending_results"] == 0, before
        assert before[1]["discarded_samples"] == 4  # its verdict will come after the expiry
        batch_began = deadline - dt.timedelta(seconds=5)
        await accept_in_transaction(app_state, submitted["submission_id"], samples=4, now=batch_began)
        assert await counted() == before


async def test_an_expired_iterations_progress_and_totals_do_not_move_with_late_verdicts(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    """An expired iteration's problems_done counted tasks finished now: a result still waiting
    for its verdict at the expiry finished its task when the verdict came, and the counter (and
    results_verified) moved on an iteration whose report and dataset no longer count it."""
    async with pool_setup(app, app_state, workers=1) as s:
        deadline = clock.utcnow() + dt.timedelta(seconds=60)
        it = await create(s, problems=("p1", "p2", "p3"), deadline_at=deadline.isoformat())
        w = s.workers[0]
        leases = await claim_all(w, s.pool_id, 2)  # p3 is never claimed: cancelled at the expiry
        await submit(w, leases["p1"], ["4", "4", "4", "1"])
        await verify_all(app_state)
        await submit(w, leases["p2"], ["6", "6", "6", "6"])  # its verdict comes after the expiry
        clock.advance(61)

        expired = await get(s, it["id"])
        assert expired["status"] == "expired"
        progress = {"problems": 3, "problems_done": 2, "samples_requested": 12, "results_received": 2}
        assert expired["progress"] == {**progress, "results_verified": 1}
        first = await report(s, it["id"])
        assert first["totals"]["problems_done"] == 2

        await verify_all(app_state)  # p2's task completes now, past the deadline and the expiry
        later = await get(s, it["id"])
        assert later["progress"] == expired["progress"]
        again = await report(s, it["id"])
        assert again["totals"] == first["totals"]
        assert [p["task_status"] for p in again["problems"]] == ["completed", "completed", "cancelled"]


@postgres_only
async def test_an_iteration_expiring_while_a_verdict_is_written_counts_it_once_committed(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    """The expiry waits for the verdicts being written (the trainer feed's bound) and counts
    those decided by the deadline: the dataset is final from the first read."""
    async with pool_setup(app, app_state, workers=1) as s:
        deadline = clock.utcnow() + dt.timedelta(seconds=60)
        it = await create(s, problems=("p1",), keep_correct=10, deadline_at=deadline.isoformat())
        w = s.workers[0]
        submitted = await submit(w, (await claim_all(w, s.pool_id, 1))["p1"], ["4"] * 4)
        clock.advance(55)
        decided, release = asyncio.Event(), asyncio.Event()
        batch = asyncio.create_task(
            accept_in_transaction(app_state, submitted["submission_id"], decided, release, samples=4)
        )
        try:
            await asyncio.wait_for(decided.wait(), HANG_S)
            clock.advance(10)
            expiry = asyncio.create_task(advance_once(app_state))
            await until_waiting(app_state, 1, expiry, on="table")
            assert not expiry.done()
        finally:
            release.set()
            await asyncio.wait_for(batch, HANG_S)
        assert (await asyncio.wait_for(expiry, HANG_S)).expired == 1
        lines = (await dataset(s, it["id"])).splitlines()
        assert len(lines) == 4
        totals = (await report(s, it["id"]))["totals"]
        assert (totals["correct_samples"], totals["discarded_samples"]) == (4, 0), totals


def ranked(iteration_id: int, submission_id: int, indices: list[int]) -> list[int]:
    key = {i: hashlib.sha256(f"{iteration_id}:{submission_id}:{i}".encode()).hexdigest() for i in indices}
    return sorted(indices, key=key.__getitem__)


async def test_the_dataset_keeps_at_most_k_correct_per_problem_the_same_way_every_time(
    app: Any, app_state: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(restem_service, "DATASET_CHUNK", 2)  # problems read in two transactions
    async with pool_setup(app, app_state, workers=1) as s:
        it = await create(s, problems=("p1", "p2", "p3"))
        w = s.workers[0]
        leases = await claim_all(w, s.pool_id, 3)
        p1 = await submit(w, leases["p1"], ["4", "4", "1", "4"])
        p2 = await submit(w, leases["p2"], ["1", "2", "6", "3"])
        await submit(w, leases["p3"], ["1", "2", "3", "4"])
        await verify_all(app_state)

        text = await dataset(s, it["id"])
        assert text == await dataset(s, it["id"])  # deterministic
        lines = [json.loads(x) for x in text.splitlines()]
        assert [(x["problem_id"], x["submission_id"], x["sample_index"]) for x in lines] == [
            *[("p1", p1["submission_id"], i) for i in ranked(it["id"], p1["submission_id"], [0, 1, 3])[:2]],
            ("p2", p2["submission_id"], 2),
        ]
        first = lines[0]
        assert first["completion"] == "Let me think.\n4" and first["reward"] == 1.0
        assert first["prompt"] == "What is 2+2?" and first["policy_step"] == 1
        assert first["iteration_id"] == it["id"] and first["node_id"] == w.node_id

        rep = await report(s, it["id"])
        rates = {
            p["problem_id"]: (p["verified_samples"], p["correct_samples"], p["solve_rate"], p["kept_samples"])
            for p in rep["problems"]
        }
        assert rates == {"p1": (4, 3, 0.75, 2), "p2": (4, 1, 0.25, 1), "p3": (4, 0, 0.0, 0)}
        t = rep["totals"]
        assert (t["problems"], t["problems_done"], t["problems_solved"]) == (3, 3, 2)
        assert (t["verified_samples"], t["correct_samples"], t["dataset_size"]) == (12, 4, 3)
        assert t["solve_rate"] == pytest.approx(4 / 12)
        assert t["mean_problem_solve_rate"] == pytest.approx((0.75 + 0.25 + 0.0) / 3)


async def test_samples_from_another_policy_step_are_excluded_and_counted(app: Any, app_state: Any) -> None:
    async with pool_setup(app, app_state, workers=2) as s:
        it = await create(s)
        on_policy = (await claim_all(s.workers[0], s.pool_id, 1))["p1"]
        assert (await s.publish(2)).status_code == 201  # not blocked by the running iteration
        off_policy = (await claim_all(s.workers[1], s.pool_id, 1))["p2"]
        assert off_policy["policy"]["step"] == 2
        await submit(s.workers[0], on_policy, ["4", "4", "4", "4"])
        await submit(s.workers[1], off_policy, ["6", "6", "6", "6"])
        await verify_all(app_state)

        assert (await get(s, it["id"]))["status"] == "complete"
        rep = await report(s, it["id"])
        p1, p2 = rep["problems"]
        assert (p1["verified_samples"], p1["correct_samples"], p1["off_policy_samples"]) == (4, 4, 0)
        assert (p2["verified_samples"], p2["off_policy_samples"], p2["solve_rate"]) == (0, 4, None)
        assert rep["totals"]["off_policy_samples"] == 4
        lines = [json.loads(x) for x in (await dataset(s, it["id"])).splitlines()]
        assert {x["problem_id"] for x in lines} == {"p1"} and len(lines) == 2


async def test_a_validator_verdict_without_per_sample_rewards_still_picks_the_right_samples(
    app: Any, app_state: Any
) -> None:
    from orchestrator.admin.tokens import Role, create_token

    app_state.rng = FixedDraw(0.0)  # audit every result: a validator decides it
    async with pool_setup(app, app_state, workers=1, audit_method="validator", audit_rate_floor=1.0) as s:
        it = await create(s, problems=("p1",), samples_per_problem=3, keep_correct=10)
        first = (await claim_all(s.workers[0], s.pool_id, 1))["p1"]
        await submit(s.workers[0], first, ["5", "4", "6"])
        await verify_all(app_state)
        async with app_state.sessionmaker() as session, session.begin():
            token, _ = await create_token(session, role=Role.validator, name="v", pool_ids=[s.pool_id])
        headers = {"Authorization": f"Bearer {token}"}
        [job] = (await s.admin.post("/v1/validation/claim", json={}, headers=headers)).json()["jobs"]
        body = {"fencing_token": job["fencing_token"], "outcome": "valid", "reason": "toploc_ok"}
        r = await s.admin.post(f"/v1/validation/jobs/{job['job_id']}/verdict", json=body, headers=headers)
        assert r.status_code == 200, r.text

        assert (await get(s, it["id"]))["status"] == "complete"
        lines = [json.loads(x) for x in (await dataset(s, it["id"])).splitlines()]
        assert [(x["node_id"], x["sample_index"]) for x in lines] == [(s.workers[0].node_id, 1)]
        [p1] = (await report(s, it["id"]))["problems"]
        assert (p1["verified_samples"], p1["correct_samples"]) == (3, 1)


async def test_a_reversed_verdict_drops_out_of_the_dataset(app: Any, app_state: Any) -> None:
    async with pool_setup(app, app_state, workers=1) as s:
        it = await create(s, problems=("p1",), keep_correct=10)
        w = s.workers[0]
        lease = (await claim_all(w, s.pool_id, 1))["p1"]
        await submit(w, lease, ["4", "4", "4", "4"])
        await verify_all(app_state)
        assert len((await dataset(s, it["id"])).splitlines()) == 4
        verdicts = await s.admin.get(f"/v1/admin/pools/{s.pool_id}/verdicts", headers=s.headers)
        [v] = verdicts.json()["items"]
        r = await s.admin.post(
            f"/v1/admin/verdicts/{v['id']}/reverse", json={"reason": "appeal"}, headers=s.admin_headers
        )
        assert r.status_code == 200, r.text
        assert await dataset(s, it["id"]) == ""
        [p1] = (await report(s, it["id"]))["problems"]
        assert (p1["verified_samples"], p1["discarded_samples"]) == (0, 4)


async def test_a_fraud_verdict_against_the_node_withdraws_its_samples_until_appealed(
    app: Any, app_state: Any
) -> None:
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000) as s:
        it = await create(s, problems=("p1",), keep_correct=10)
        w = s.workers[0]
        await submit(w, (await claim_all(w, s.pool_id, 1))["p1"], ["4", "4", "4", "4"])
        await verify_all(app_state)
        assert len((await dataset(s, it["id"])).splitlines()) == 4
        assert (await s.enqueue([task(verification={"answer": "4"})], key="other")).status_code == 201
        [forged] = (await w.claim(s.pool_id)).json()["leases"]
        await submit(w, forged, ["5"], claimed_reward=1.0)  # fraud, on a task outside the iteration
        await verify_all(app_state)
        assert await dataset(s, it["id"]) == ""
        [p1] = (await report(s, it["id"]))["problems"]
        assert (p1["verified_samples"], p1["discarded_samples"]) == (0, 4)
        verdicts = (await s.admin.get(f"/v1/admin/pools/{s.pool_id}/verdicts", headers=s.headers)).json()
        fraud = verdicts["items"][0]
        assert fraud["category"] == "fraud"
        r = await s.admin.post(
            f"/v1/admin/verdicts/{fraud['id']}/reverse", json={"reason": "appeal"}, headers=s.admin_headers
        )
        assert r.status_code == 200, r.text
        assert len((await dataset(s, it["id"])).splitlines()) == 4
        [p1] = (await report(s, it["id"]))["problems"]
        assert (p1["verified_samples"], p1["discarded_samples"]) == (4, 0)


async def test_a_fraud_verdict_takes_the_nodes_wrong_answers_out_of_the_solve_rate_too(
    app: Any, app_state: Any
) -> None:
    """A fraud verdict withdrew only the node's accepted results: its results rejected as wrong
    answers in the same window still counted as verified attempts, so a cheater's wrong answers
    kept dragging the solve rate down."""
    async with pool_setup(app, app_state, workers=2, economics=ECON, stake=1000) as s:
        it = await create(s, problems=("p1", "p2"), keep_correct=10)
        cheat, honest = s.workers
        await submit(cheat, (await claim_all(cheat, s.pool_id, 1))["p1"], ["1", "2", "3", "5"])
        await submit(honest, (await claim_all(honest, s.pool_id, 1))["p2"], ["6", "6", "1", "6"])
        await verify_all(app_state)

        async def rates() -> dict[str, tuple[int, int, float | None, int]]:
            rep = await report(s, it["id"])
            t = rep["totals"]
            rates = {
                p["problem_id"]: (
                    p["verified_samples"],
                    p["correct_samples"],
                    p["solve_rate"],
                    p["discarded_samples"],
                )
                for p in rep["problems"]
            }
            return {
                **rates,
                "totals": (
                    t["verified_samples"],
                    t["correct_samples"],
                    t["solve_rate"],
                    t["discarded_samples"],
                ),
            }

        counted = {"p1": (4, 0, 0.0, 0), "p2": (4, 3, 0.75, 0), "totals": (8, 3, 3 / 8, 0)}
        assert await rates() == counted
        assert (await s.enqueue([task(verification={"answer": "4"})], key="other")).status_code == 201
        [forged] = (await cheat.claim(s.pool_id)).json()["leases"]
        await submit(cheat, forged, ["5"], claimed_reward=1.0)  # fraud, on a task outside the iteration
        await verify_all(app_state)

        withdrawn = {"p1": (0, 0, None, 4), "p2": (4, 3, 0.75, 0), "totals": (4, 3, 0.75, 4)}
        assert await rates() == withdrawn
        verdicts = (await s.admin.get(f"/v1/admin/pools/{s.pool_id}/verdicts", headers=s.headers)).json()
        fraud, *earlier = verdicts["items"]
        assert fraud["category"] == "fraud"
        by_reason = {(v["node_id"], v["reason"]): v["withdrawn_by"] for v in earlier}
        assert by_reason == {(cheat.node_id, "wrong_answer"): fraud["id"], (honest.node_id, "verified"): None}

        r = await s.admin.post(
            f"/v1/admin/verdicts/{fraud['id']}/reverse", json={"reason": "appeal"}, headers=s.admin_headers
        )
        assert r.status_code == 200, r.text
        assert await rates() == counted


async def test_the_report_counts_pruned_correct_samples_apart_and_its_dataset_size_stays_true(
    app: Any, app_state: Any, tmp_path: Path
) -> None:
    async with pool_setup(app, app_state, workers=1) as s:
        it = await create(s, keep_correct=3)
        w = s.workers[0]
        leases = await claim_all(w, s.pool_id, 2)
        await submit(w, leases["p1"], ["4", "4", "4", "5"])
        await verify_all(app_state)
        now = dt.datetime.now(dt.UTC)
        archive = retention.Archive(tmp_path / "evidence.jsonl")
        pruned = await retention.prune(
            app_state.sessionmaker, archive, cutoff=now + dt.timedelta(seconds=1), now=now
        )
        archive.close()
        assert pruned.submissions == 1
        await submit(w, leases["p2"], ["6", "6", "7", "7"])
        await verify_all(app_state)
        lines = [json.loads(line) for line in (await dataset(s, it["id"])).splitlines()]
        assert [x["problem_id"] for x in lines] == ["p2", "p2"]
        totals = (await report(s, it["id"]))["totals"]
        # p1's 3 correct samples still count in the solve rate, but are in the archive only.
        assert (totals["correct_samples"], totals["verified_samples"]) == (5, 8)
        assert (totals["pruned_correct_samples"], totals["dataset_size"]) == (3, len(lines))
        p1, p2 = (await report(s, it["id"]))["problems"]
        assert (p1["kept_samples"], p1["pruned_correct_samples"]) == (0, 3)
        assert (p2["kept_samples"], p2["pruned_correct_samples"]) == (2, 0)


async def test_iterations_are_scoped_to_the_pool(app: Any, app_state: Any) -> None:
    async with pool_setup(app, app_state) as s, pool_setup(app, app_state) as other:
        it = await create(s)
        async with app_state.sessionmaker() as session, session.begin():
            elsewhere, _ = await create_token(session, role=Role.trainer, name="t", pool_ids=[other.pool_id])
            here, _ = await create_token(session, role=Role.trainer, name="t", pool_ids=[s.pool_id])
        for headers in (other.headers, {"Authorization": f"Bearer {elsewhere}"}):
            for path in ("", f"/{it['id']}", f"/{it['id']}/report", f"/{it['id']}/dataset"):
                problem(await s.admin.get(base(s) + path, headers=headers), 404, "pool_not_found")
            r = await s.admin.post(base(s), json=iteration_body(name="x"), headers=headers)
            problem(r, 404, "pool_not_found")
        # An iteration id from another pool is not found through this one.
        problem(
            await other.admin.get(f"{base(other)}/{it['id']}", headers=other.headers),
            404,
            "iteration_not_found",
        )
        # The pool's trainer runs iterations too.
        trainer = {"Authorization": f"Bearer {here}"}
        r = await s.admin.get(f"{base(s)}/{it['id']}", headers=trainer)
        assert r.status_code == 200 and r.json()["id"] == it["id"]


async def test_an_iteration_is_not_complete_while_a_cancelled_tasks_result_waits_for_its_verdict(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    from tests.test_validators import GOOD, validator_headers

    app_state.rng = FixedDraw(0.0)  # the result goes to a validator
    async with pool_setup(app, app_state, workers=1, audit_method="validator", audit_rate_floor=1.0) as s:
        it = await create(s, problems=("p1",))
        w = s.workers[0]
        leases = await claim_all(w, s.pool_id, 1)
        await submit(w, leases["p1"], ["4", "4", "1", "2"])
        await verify_all(app_state)
        task_id = await s.task_of(leases["p1"])
        r = await s.admin.post(f"/v1/admin/pools/{s.pool_id}/tasks/{task_id}/cancel", headers=s.headers)
        assert r.status_code == 200, r.text
        # The result's verdict is still to come: the iteration is not final yet.
        assert (await get(s, it["id"]))["status"] == "running"
        v = await validator_headers(app_state, [s.pool_id])
        job = (await s.admin.post("/v1/validation/claim", json={}, headers=v)).json()["jobs"][0]
        body = {"fencing_token": job["fencing_token"], "outcome": "valid", "reason": "ok", "evidence": GOOD}
        r = await s.admin.post(f"/v1/validation/jobs/{job['job_id']}/verdict", json=body, headers=v)
        assert r.status_code == 200, r.text
        assert (await get(s, it["id"]))["status"] == "complete"
        assert len((await dataset(s, it["id"])).splitlines()) == 2  # the two correct samples


async def test_problems_with_nul_text_or_nan_json_are_refused(app: Any, app_state: Any) -> None:
    """As for tasks: a NUL character in text or NaN in JSON cannot be stored (PostgreSQL) and
    is a 422 naming the problem, with no iteration started."""
    async with pool_setup(app, app_state) as s:
        for i, bad in enumerate(({"prompt": "2+2\u0000?"}, {"metadata": {"x": math.nan}})):
            body = iteration_body(name=f"it-{i}")
            body["problems"][1] |= bad
            content = json.dumps(body).encode()  # NaN as the bare word, which Python parses
            r = await s.admin.post(
                base(s), content=content, headers={**s.headers, "Content-Type": "application/json"}
            )
            assert problem(r, 422, "validation_failed")["errors"][0]["loc"][:4] == [
                "body",
                "problems",
                1,
                next(iter(bad)),
            ]
        assert (await s.admin.get(base(s), headers=s.headers)).json()["items"] == []


async def test_the_dataset_serves_metadata_integers_past_64_bits(app: Any, app_state: Any) -> None:
    """Problem metadata may hold any JSON integer; orjson writes only 64-bit ones, and the
    dataset used to fail on such a problem."""
    async with pool_setup(app, app_state, workers=1) as s:
        body = iteration_body(problems=("p1",), keep_correct=10)
        body["problems"][0]["metadata"] = {"row": 2**64}
        r = await s.admin.post(base(s), json=body, headers=s.headers)
        assert r.status_code == 201, r.text
        it = r.json()
        lease = (await claim_all(s.workers[0], s.pool_id, 1))["p1"]
        await submit(s.workers[0], lease, ["4", "5", "4", "5"])
        await verify_all(app_state)
        lines = [json.loads(x) for x in (await dataset(s, it["id"])).splitlines()]
        assert [x["sample_index"] for x in lines] == sorted(
            [0, 2], key=lambda i: restem_service.rank_key(it["id"], lines[0]["submission_id"], i)
        )
        assert {x["metadata"]["row"] for x in lines} == {2**64}


async def test_samples_the_server_could_not_check_are_not_counted_as_verified(
    app: Any, app_state: Any
) -> None:
    """A problem whose verification spec gives the reward function nothing to check against (a
    typo: ``solution`` for ``answer``) has its results accepted unchecked. The report counted
    their samples as verified and none as correct: a solve rate of 0.0 for a problem every
    sample answered right, pulling the mean problem solve rate down from 0.75 to 0.375."""
    async with pool_setup(app, app_state, workers=1) as s:
        body = iteration_body()
        body["problems"][0]["verification"] = {"solution": "4"}
        r = await s.admin.post(base(s), json=body, headers=s.headers)
        assert r.status_code == 201, r.text
        it = r.json()
        w = s.workers[0]
        leases = await claim_all(w, s.pool_id, 2)
        await submit(w, leases["p1"], ["4", "4", "4", "4"])
        await submit(w, leases["p2"], ["6", "6", "6", "1"])
        await verify_all(app_state)
        assert (await get(s, it["id"]))["status"] == "complete"

        rep = await report(s, it["id"])
        p1, p2 = rep["problems"]
        assert (p1["verified_samples"], p1["correct_samples"], p1["solve_rate"]) == (0, 0, None)
        assert p1["unchecked_samples"] == 4 and p1["kept_samples"] == 0
        assert (p2["verified_samples"], p2["correct_samples"], p2["unchecked_samples"]) == (4, 3, 0)
        t = rep["totals"]
        assert (t["verified_samples"], t["correct_samples"], t["unchecked_samples"]) == (4, 3, 4)
        assert t["solve_rate"] == pytest.approx(3 / 4)
        assert t["mean_problem_solve_rate"] == pytest.approx(3 / 4)  # p1 has no rate, not 0.0
        lines = [json.loads(x) for x in (await dataset(s, it["id"])).splitlines()]
        assert {x["problem_id"] for x in lines} == {"p2"} and len(lines) == 2


async def old_progress(session: Any, iteration: Any) -> dict[str, int]:
    """An iteration's progress as it was computed before pages were counted together: two
    statements of its own, its cutoff (if expired) bound as values."""
    from sqlalchemy import and_, exists, func, select

    from orchestrator.restem.models import RestemProblem
    from orchestrator.tasks.models import Submission, Task
    from orchestrator.verification.models import Verdict

    cutoff = restem_service._cutoff(iteration)
    counts = []
    if cutoff is not None:
        counts.append(Verdict.decided_at <= cutoff.decided_by)
        if cutoff.bound is not None:
            counts.append(Verdict.id <= cutoff.bound)
    settled = ~exists().where(
        Submission.task_id == Task.id, ~exists().where(Verdict.submission_id == Submission.id, *counts)
    )
    done = await session.scalar(
        select(func.count())
        .select_from(RestemProblem)
        .join(Task, Task.id == RestemProblem.task_id)
        .where(
            RestemProblem.iteration_id == iteration.id,
            Task.status.in_(restem_service.FINISHED_TASK),
            settled,
        )
    )
    received, verified = (
        await session.execute(
            select(func.count(Submission.id), func.count(Verdict.id))
            .select_from(RestemProblem)
            .join(Submission, Submission.task_id == RestemProblem.task_id)
            .outerjoin(Verdict, and_(Verdict.submission_id == Submission.id, *counts))
            .where(RestemProblem.iteration_id == iteration.id)
        )
    ).one()
    return {
        "problems": iteration.problem_count,
        "problems_done": int(done or 0),
        "samples_requested": iteration.problem_count * iteration.samples_per_problem,
        "results_received": int(received),
        "results_verified": int(verified),
    }


async def listed(s: PoolSetup, limit: int) -> list[dict[str, Any]]:
    """Every iteration of the pool, newest first, through pages of ``limit``."""
    items: list[dict[str, Any]] = []
    cursor = None
    while True:
        params: dict[str, Any] = {"limit": limit, **({"cursor": cursor} if cursor else {})}
        r = await s.admin.get(base(s), params=params, headers=s.headers)
        assert r.status_code == 200, r.text
        items += r.json()["items"]
        cursor = r.json()["next_cursor"]
        if cursor is None:
            return items


async def test_a_page_of_iterations_counts_each_as_alone_whatever_its_cutoff(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    """A page counts its iterations' progress together; each stands as it would alone: an
    expired one's counts stop at its own deadline and verdict bound (or its deadline alone, when
    it expired before verdict bounds), a complete or running one counts every verdict."""
    from sqlalchemy import update

    from orchestrator.restem.models import RestemIteration

    async with pool_setup(app, app_state, workers=1, max_leases_per_node=10) as s:
        w = s.workers[0]

        def soon() -> str:
            return (clock.utcnow() + dt.timedelta(seconds=60)).isoformat()

        # 1: complete.
        complete = await create(s, name="complete")
        leases = await claim_all(w, s.pool_id, 2)
        await submit(w, leases["p1"], ["4", "4", "1", "2"])
        await submit(w, leases["p2"], ["1", "1", "1", "1"])
        await verify_all(app_state)
        # 2: expired; p2's verdict is decided after the deadline, p3 was never claimed.
        late_decided = await create(s, name="late-decided", problems=("p1", "p2", "p3"), deadline_at=soon())
        leases = await claim_all(w, s.pool_id, 2)
        await submit(w, leases["p1"], ["4", "4", "4", "1"])
        await verify_all(app_state)
        await submit(w, leases["p2"], ["6", "6", "6", "6"])
        clock.advance(61)
        # 3 and 4: expired; the verdict is dated before the deadline but written after the
        # expiry. 4 expired before verdict bounds (NULL): its deadline alone counts it.
        written_late = []
        for name in ("late-written", "unbounded"):
            deadline = clock.utcnow() + dt.timedelta(seconds=60)
            it = await create(s, name=name, problems=("p1",), deadline_at=deadline.isoformat())
            sent = await submit(w, (await claim_all(w, s.pool_id, 1))["p1"], ["4"] * 4)
            clock.advance(61)
            assert (await get(s, it["id"]))["status"] == "expired"
            await accept_in_transaction(
                app_state, sent["submission_id"], samples=4, now=deadline - dt.timedelta(seconds=5)
            )
            written_late.append(it)
        await verify_all(app_state)  # 2's p2, after its deadline and expiry
        async with app_state.sessionmaker() as session, session.begin():
            await session.execute(
                update(RestemIteration)
                .where(RestemIteration.id == written_late[1]["id"])
                .values(verdict_bound=None)
            )
        # 5: running; one result verified, one waiting.
        running = await create(s, name="running")
        leases = await claim_all(w, s.pool_id, 2)
        await submit(w, leases["p1"], ["4", "4", "4", "4"])
        await verify_all(app_state)
        await submit(w, leases["p2"], ["6", "1", "6", "1"])

        ids = [
            running["id"],
            written_late[1]["id"],
            written_late[0]["id"],
            late_decided["id"],
            complete["id"],
        ]
        page = await listed(s, 100)
        assert [(i["id"], i["status"]) for i in page] == list(
            zip(ids, ["running", "expired", "expired", "expired", "complete"], strict=True)
        )
        progress = [
            (p["problems_done"], p["results_received"], p["results_verified"])
            for p in (i["progress"] for i in page)
        ]
        assert progress == [(1, 2, 1), (1, 1, 1), (0, 1, 0), (2, 2, 1), (2, 2, 2)]
        # The same on pages of two, and one by one; and as each was counted alone before.
        assert await listed(s, 2) == page
        assert [await get(s, i) for i in ids] == page
        async with app_state.sessionmaker() as session:
            for item in page:
                iteration = await session.get(RestemIteration, item["id"])
                assert item["progress"] == await old_progress(session, iteration), item["name"]


async def test_a_page_of_iterations_runs_the_same_statements_for_one_iteration_or_many(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    """A page counted each iteration's progress with two statements of its own: 200 for a page
    of 100. Now the page's progress is two statements whatever its size."""
    from tests.test_hot_paths import sql_log

    async with pool_setup(app, app_state, workers=1) as s:
        for i in range(6):  # each expires at its deadline, the last one runs
            await create(
                s, name=f"it-{i}", deadline_at=(clock.utcnow() + dt.timedelta(seconds=2)).isoformat()
            )
            clock.advance(3 if i < 5 else 0)
        leases = await claim_all(s.workers[0], s.pool_id, 2)
        await submit(s.workers[0], leases["p1"], ["4", "4", "4", "4"])
        await verify_all(app_state)
        pages = {}
        for limit in (1, 6):
            async with sql_log(app_state) as statements:
                r = await s.admin.get(base(s), params={"limit": limit}, headers=s.headers)
            assert r.status_code == 200 and len(r.json()["items"]) == limit, r.text
            pages[limit] = statements
        assert len(pages[6]) == len(pages[1]), pages[6]
        assert [i["status"] for i in r.json()["items"]] == ["running"] + ["expired"] * 5


async def test_a_dataset_reads_at_most_one_results_worth_of_bodies_at_a_time(
    app: Any, app_state: Any
) -> None:
    """The dataset read its problems 100 at a time with every accepted result's signed body whole
    (each up to ORCH_LIMITS__MAX_RESULT_BODY_BYTES, the nodes' choice): a gigabyte and more held
    at once. Each part it streams now comes from results that add up to at most that limit (the
    first problem's whatever their size), and the dataset is the same."""
    limit = app_state.settings.limits.max_result_body_bytes
    proof = base64.b64encode(b"\x01" * (limit * 3 // 10)).decode()  # 40 % of the limit
    async with pool_setup(app, app_state, workers=1, max_leases_per_node=10) as s:
        it = await create(s, problems=("p1", "p2", "p3"))
        w = s.workers[0]
        leases = await claim_all(w, s.pool_id, 3)
        for pid, lease in leases.items():
            await submit(w, lease, [QUESTIONS[pid][1]] * 4, proof=proof)
        await verify_all(app_state)
        assert (await get(s, it["id"]))["status"] == "complete"
        async with app_state.sessionmaker() as session, session.begin():
            secret, _ = await create_token(session, role=Role.trainer, name="trainer", pool_ids=[s.pool_id])

        parts, completed = await asgi_stream(
            app, f"{base(s)}/{it['id']}/dataset", secret, lambda: asyncio.sleep(0)
        )
        assert completed
        by_part = [[json.loads(x)["problem_id"] for x in part.splitlines()] for part in parts]
        assert by_part == [["p1", "p1", "p2", "p2"], ["p3", "p3"]]  # a third result: 120 %


async def test_one_problems_results_are_read_at_most_one_results_worth_at_a_time(
    app: Any, app_state: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dataset chunk took its first problem whatever its results' size, and a problem has one
    accepted result per replica (replication up to 16), each up to
    ORCH_LIMITS__MAX_RESULT_BODY_BYTES: one read of 160 MiB of bodies and more, parsed at once.
    A problem whose results add up to more than that limit is now read a few results at a time
    (the first whatever its size), keeping its best keep_correct samples so far; its lines are
    the same."""
    limit = app_state.settings.limits.max_result_body_bytes
    proof = base64.b64encode(b"\x01" * (limit * 3 // 10)).decode()  # 40 % of the limit
    read: list[int] = []  # the signed bodies' bytes each statement that reads them loaded
    execute = AsyncSession.execute

    async def spy(self: AsyncSession, statement: Any, *args: Any, **kwargs: Any) -> Any:
        result = await execute(self, statement, *args, **kwargs)
        sql = str(statement)
        if "submissions.body" not in sql or "length(submissions.body)" in sql:
            return result
        frozen = result.freeze()
        read.append(sum(len(row.body) for row in frozen()))
        return frozen()

    async with pool_setup(app, app_state, workers=3, max_leases_per_node=10) as s:
        it = await create(s, problems=("p1",), replication=3)
        submission_ids = []
        for w in s.workers:
            lease = (await claim_all(w, s.pool_id, 1))["p1"]
            submission_ids.append((await submit(w, lease, ["4"] * 4, proof=proof))["submission_id"])
        await verify_all(app_state)
        assert (await get(s, it["id"]))["status"] == "complete"

        monkeypatch.setattr(AsyncSession, "execute", spy)
        lines = [json.loads(line) for line in (await dataset(s, it["id"])).splitlines()]
        assert read and max(read) <= limit, read  # 120 % in one read before
        best = sorted(
            (restem_service.rank_key(it["id"], sid, i), sid, i) for sid in submission_ids for i in range(4)
        )[:2]
        assert [(x["problem_id"], x["submission_id"], x["sample_index"]) for x in lines] == [
            ("p1", sid, i) for _, sid, i in best
        ]
