"""A task's optional ``deadline_at``: past it the task is no longer leased, a result for it is
refused (409 ``deadline_passed``), and the reaper fails it, cancelling its live leases."""

from __future__ import annotations

import datetime as dt
from typing import Any

from orchestrator.core.clock import FakeClock
from orchestrator.tasks.jobs import reap_once
from tests.conftest import problem
from tests.tasks_helpers import pool_setup, task


def at(clock: FakeClock, seconds: float) -> str:
    return (clock.utcnow() + dt.timedelta(seconds=seconds)).isoformat()


async def task_view(s: Any, task_id: int) -> dict[str, Any]:
    r = await s.admin.get(f"/v1/admin/pools/{s.pool_id}/tasks/{task_id}", headers=s.headers)
    assert r.status_code == 200, r.text
    return dict(r.json())


async def test_a_task_past_its_deadline_is_not_leased(app: Any, app_state: Any, clock: FakeClock) -> None:
    async with pool_setup(app, app_state, workers=1) as s:
        # The urgent task ranks first, but its deadline will have passed.
        await s.enqueue(
            [task("urgent", priority=10, deadline_at=at(clock, 60)), task("whenever"), task("later")]
        )
        clock.advance(61)
        w = s.workers[0]
        leases = (await w.claim(s.pool_id, max_tasks=3)).json()["leases"]
        assert sorted(x["task"]["prompt"] for x in leases) == ["later", "whenever"]


async def test_a_result_after_the_deadline_is_refused_and_the_reaper_fails_the_task(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    async with pool_setup(app, app_state, workers=2) as s:
        deadline = clock.utcnow() + dt.timedelta(seconds=60)
        await s.enqueue([task("timely", deadline_at=deadline.isoformat()), task("no deadline")])
        first, second = s.workers
        lease = (await first.claim(s.pool_id)).json()["leases"][0]
        other = (await second.claim(s.pool_id)).json()["leases"][0]
        assert (lease["task"]["prompt"], other["task"]["prompt"]) == ("timely", "no deadline")
        clock.advance(61)  # within the leases' 600 s, past the task's deadline

        r = await first.submit(lease)
        problem(r, 409, "deadline_passed")
        assert dt.datetime.fromisoformat(r.json()["deadline_at"]) == deadline

        report = await reap_once(app_state)
        assert report.ran and report.past_deadline == 1
        view = await task_view(s, await s.task_of(lease))
        assert view["status"] == "failed" and "deadline passed" in view["failure_reason"]
        assert view["end_reason"] == "deadline_passed"
        # Once the reaper has failed the task (cancelling the lease), a result is refused for
        # the same reason, not as if an operator had cancelled the task.
        problem(await first.submit(lease), 409, "deadline_passed")
        # The lease is cancelled: the next heartbeat tells the node to drop it.
        beat = await first.beat([lease["assignment_id"]])
        assert beat.status_code == 200 and beat.json()["drop_leases"] == [lease["assignment_id"]]
        # The task without a deadline is untouched and its result is recorded.
        assert (await second.submit(other)).status_code == 201
        assert (await task_view(s, await s.task_of(other)))["status"] == "submitted"
        # The reaper does it once.
        clock.advance(10)
        assert (await reap_once(app_state)).past_deadline == 0


async def test_a_deadline_without_a_utc_offset_is_refused(app: Any, app_state: Any) -> None:
    """A deadline without an offset names no instant: 422, and the batch is not enqueued."""
    async with pool_setup(app, app_state) as s:
        r = await s.enqueue([task("whenever"), task("naive", deadline_at="2030-01-01T00:00:00")])
        body = problem(r, 422, "validation_failed")
        assert body["errors"][0]["loc"] == ["body", "tasks", 1, "deadline_at"]
        listing = (await s.admin.get(f"/v1/admin/pools/{s.pool_id}/tasks", headers=s.headers)).json()
        assert listing["items"] == []


async def test_a_deadline_outside_the_years_utc_can_name_is_refused(app: Any, app_state: Any) -> None:
    """9999-12-31T23:59:59-12:00 is in the year 10000 in UTC (and 0001-01-01T00:00:00+14:00 in
    the year 0), which no time can hold: such a deadline answered 500; it is bad input."""
    async with pool_setup(app, app_state) as s:
        for deadline in ("9999-12-31T23:59:59-12:00", "0001-01-01T00:00:00+14:00"):
            r = await s.enqueue([task("whenever"), task("never", deadline_at=deadline)])
            body = problem(r, 422, "validation_failed")
            assert body["errors"][0]["loc"] == ["body", "tasks", 1, "deadline_at"]
        listing = (await s.admin.get(f"/v1/admin/pools/{s.pool_id}/tasks", headers=s.headers)).json()
        assert listing["items"] == []
        r = await s.enqueue([task("late", deadline_at="9999-12-31T23:59:59+00:00")])
        assert r.status_code == 201, r.text


async def test_a_deadline_already_past_is_refused_but_a_replay_is_not(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    """A task whose deadline has passed could never be leased: the batch is refused (422
    deadline_passed, naming the tasks) rather than accepted and failed by the reaper. A batch
    accepted in time and sent again once its deadline passed is still the same batch (200)."""
    async with pool_setup(app, app_state) as s:
        r = await s.enqueue(
            [task("timely", deadline_at=at(clock, 60)), task("late", deadline_at=at(clock, 0))]
        )
        assert problem(r, 422, "deadline_passed")["task_indexes"] == [1]
        listing = (await s.admin.get(f"/v1/admin/pools/{s.pool_id}/tasks", headers=s.headers)).json()
        assert listing["items"] == []

        tasks = [task("timely", deadline_at=at(clock, 60))]
        first = await s.enqueue(tasks, key="in-time")
        assert first.status_code == 201
        clock.advance(61)
        again = await s.enqueue(tasks, key="in-time")
        assert again.status_code == 200 and again.json()["batch_id"] == first.json()["batch_id"]
