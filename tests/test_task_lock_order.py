"""Lock order between ending a task and a result in flight (PostgreSQL).

A result locks its lease and the lease's replica, then writes the task. Ending a task (an
operator's cancel, max attempts, a deadline, a ReST^EM iteration's expiry) writes every live
lease and replica of the task. It used to lock the task first and then wait for the replica
the result held, while the result waited for the task: a deadlock, which PostgreSQL breaks
after a second by failing one of them (the cancel or the result got a 503). Each test holds a
result's locks with the result path's own statements, at the point where it has read its lease
and is about to write, and checks that the other side waits and then finishes. Others hold one
failure report's locks while another is made, pace a pool's completion against a cancel, and
hold a cancel while another settles the same node's results.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import types
from typing import Any

import structlog
from sqlalchemy import select, text

from orchestrator.core.clock import FakeClock
from orchestrator.core.keys import generate_key, key_id_of
from orchestrator.liveness.service import sweep_once
from orchestrator.tasks import service
from orchestrator.tasks.jobs import reap_once
from orchestrator.tasks.models import Task
from orchestrator.verification.jobs import drain
from orchestrator.verification.models import NodeTrust, Verdict
from orchestrator.verification.service import partition_of
from tests.conftest import postgres_only
from tests.tasks_helpers import pool_setup, task
from tests.verification_helpers import FixedDraw, submit, verify_all
from tests.waits import HANG_S, until_waiting

pytestmark = postgres_only


async def _result_in_flight(
    app_state: Any, clock: FakeClock, lease: dict[str, Any], node_id: str, other: Any
) -> Any:
    """Take the result path's locks for ``lease`` (its locked read), start ``other``, wait until
    it waits for a lock, then make the result's write of the task and commit. Returns what
    ``other`` returned."""
    async with app_state.sessionmaker() as session, session.begin():
        conn = await session.connection()
        context = {"assignment_id": lease["assignment_id"], "node_id": node_id, "policy_step": 1}
        read = (await conn.execute(service._result_context(True), context)).first()
        assert read is not None
        ending = asyncio.ensure_future(other)
        await until_waiting(app_state, 1, ending)
        assert not ending.done(), "nothing waited for the result's locks"
        written = {"b_task": read.task_id, "b_now": clock.utcnow()}
        await asyncio.wait_for(conn.execute(service._TASK_SUBMITTED, written), timeout=HANG_S)
    return await asyncio.wait_for(ending, timeout=HANG_S)


async def test_a_cancel_waits_for_a_result_in_flight(app: Any, app_state: Any, clock: FakeClock) -> None:
    # Two replicas: with one result in, the task is still open, and the cancel ends it (a task
    # whose results are all in is left to their verdicts).
    async with pool_setup(app, app_state, workers=1) as s:
        task_id = (await s.enqueue([task(replication=2)])).json()["first_task_id"]
        w = s.workers[0]
        [lease] = (await w.claim(s.pool_id)).json()["leases"]
        cancel = s.admin.post(f"/v1/admin/pools/{s.pool_id}/tasks/{task_id}/cancel", headers=s.headers)
        r = await _result_in_flight(app_state, clock, lease, w.node_id, cancel)
        assert r.status_code == 200, r.text
        assert r.json()["status"] == "cancelled"
        assert (await w.beat([lease["assignment_id"]])).json()["drop_leases"] == [lease["assignment_id"]]


async def test_max_attempts_wait_for_a_sibling_replicas_result_in_flight(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    async with pool_setup(app, app_state, workers=2, lease_duration_s=60, max_attempts=1) as s:
        task_id = (await s.enqueue([task(replication=2)])).json()["first_task_id"]
        first, second = s.workers
        assert len((await first.claim(s.pool_id)).json()["leases"]) == 1
        clock.advance(31)
        await second.beat()
        [lease] = (await second.claim(s.pool_id)).json()["leases"]
        clock.advance(31)  # the first lease ran out (max attempts 1); the second has 29 s left
        report = await _result_in_flight(app_state, clock, lease, second.node_id, reap_once(app_state))
        assert (report.expired, report.failed_tasks) == (1, 1)
        detail = (await s.admin.get(f"/v1/admin/pools/{s.pool_id}/tasks/{task_id}", headers=s.headers)).json()
        assert (detail["status"], detail["end_reason"]) == ("failed", "max_attempts")


async def test_a_deadline_waits_for_a_result_in_flight(app: Any, app_state: Any, clock: FakeClock) -> None:
    """One replica's result read its lease just before the task's deadline; the reaper fails
    the task just after it."""
    async with pool_setup(app, app_state, workers=2) as s:
        deadline = (clock.utcnow() + dt.timedelta(seconds=60)).isoformat()
        task_id = (await s.enqueue([task(replication=2, deadline_at=deadline)])).json()["first_task_id"]
        first, second = s.workers
        [lease] = (await first.claim(s.pool_id)).json()["leases"]
        assert len((await second.claim(s.pool_id)).json()["leases"]) == 1
        clock.advance(61)
        report = await _result_in_flight(app_state, clock, lease, first.node_id, reap_once(app_state))
        assert report.past_deadline == 1
        detail = (await s.admin.get(f"/v1/admin/pools/{s.pool_id}/tasks/{task_id}", headers=s.headers)).json()
        assert (detail["status"], detail["end_reason"]) == ("failed", "deadline_passed")


async def test_a_failure_reported_while_another_commits_counts_both(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    """Two nodes of different providers report the task failed at once (max_failures 2). The
    second release waits for the first's locks and then counts both failures: counted against
    a snapshot without the first's, each would see one, and the task would stay open."""
    async with pool_setup(app, app_state, workers=2, max_failures=2) as s:
        task_id = (await s.enqueue([task(replication=2)])).json()["first_task_id"]
        first, second = s.workers
        [lease_1] = (await first.claim(s.pool_id)).json()["leases"]
        [lease_2] = (await second.claim(s.pool_id)).json()["leases"]

        async def release(node_id: str, lease: dict[str, Any]) -> None:
            async with app_state.sessionmaker() as session, session.begin():
                await service.release(
                    session, node_id, lease["assignment_id"], now=clock.utcnow(), error="engine crashed"
                )

        async with app_state.sessionmaker() as session, session.begin():
            await service.release(
                session, first.node_id, lease_1["assignment_id"], now=clock.utcnow(), error="engine crashed"
            )
            other = asyncio.ensure_future(release(second.node_id, lease_2))
            await until_waiting(app_state, 1, other)
            assert not other.done(), "the second failure report did not wait for the first"
        await asyncio.wait_for(other, timeout=HANG_S)
        detail = (await s.admin.get(f"/v1/admin/pools/{s.pool_id}/tasks/{task_id}", headers=s.headers)).json()
        assert (detail["status"], detail["end_reason"]) == ("failed", "max_failures")


async def test_two_failure_reports_of_one_task_sent_at_once_do_not_deadlock(app: Any, app_state: Any) -> None:
    """A task that crashes every engine: both nodes give its replicas back failed at the same
    moment. Each release locked its own lease, then its sibling's: each waited for the other,
    and PostgreSQL failed one of them (503 deadlock_detected). Now both take the task's live
    leases in id order. Three tasks, three rounds: the interleaving is not left to one try."""
    async with pool_setup(app, app_state, workers=2, max_failures=2, max_leases_per_node=3) as s:
        await s.enqueue([task(f"broken {i}", replication=2) for i in range(3)])
        first, second = s.workers
        leases_1 = (await first.claim(s.pool_id, max_tasks=3)).json()["leases"]
        leases_2 = (await second.claim(s.pool_id, max_tasks=3)).json()["leases"]
        by_task_2 = {await s.task_of(lease): lease for lease in leases_2}
        for lease_1 in leases_1:
            task_id = await s.task_of(lease_1)
            r1, r2 = await asyncio.gather(
                first.release(lease_1, error="engine crashed"),
                second.release(by_task_2[task_id], error="engine crashed"),
            )
            assert (r1.status_code, r2.status_code) == (200, 200), (r1.text, r2.text)
            url = f"/v1/admin/pools/{s.pool_id}/tasks/{task_id}"
            detail = (await s.admin.get(url, headers=s.headers)).json()
            assert (detail["status"], detail["end_reason"]) == ("failed", "max_failures")


async def test_max_attempts_and_a_failure_report_of_the_same_task_do_not_deadlock(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    """The reaper expires a task's last attempt (max attempts 1) while the node holding the
    task's other replica reports it failed. The reaper locked the expired lease, then (to fail
    the task) its live siblings; the failure report locks the task's live leases in id order.
    With the sibling's id below the expired lease's, each held what the other wanted next, and
    PostgreSQL failed one of them (the report got 503). Now the reaper too takes the live
    leases of its tasks in id order before anything else.

    The interleaving is made, not hoped for: a third transaction holds the expired lease's
    replica, so that the reaper stops there with whatever it has taken; the failure report then
    starts, and the replica is let go once both wait. Eight tasks, so that one of them has its
    ids in the order that deadlocked (ids are random: all eight the other way is 1 in 256)."""
    async with pool_setup(
        app, app_state, workers=2, lease_duration_s=60, max_attempts=1, max_leases_per_node=8
    ) as s:
        await s.enqueue([task(f"broken {i}", replication=2) for i in range(8)])
        first, second = s.workers
        expiring = (await first.claim(s.pool_id, max_tasks=8)).json()["leases"]
        clock.advance(31)
        await second.beat()
        live = (await second.claim(s.pool_id, max_tasks=8)).json()["leases"]
        clock.advance(31)  # the first node's leases ran out; the second's have 29 s left
        by_task = {await s.task_of(lease): lease for lease in expiring}
        pairs = [(by_task[await s.task_of(lease)], lease) for lease in live]
        async with app_state.sessionmaker() as session:  # in the database's order of ids
            before = text("SELECT CAST(:sibling AS varchar) < CAST(:expired AS varchar)")
            order = [
                await session.scalar(before, {"sibling": lv["assignment_id"], "expired": e["assignment_id"]})
                for e, lv in pairs
            ]
        expired, sibling = pairs[order.index(True)]
        task_id = await s.task_of(expired)
        async with app_state.sessionmaker() as holder, holder.begin():
            await holder.execute(
                text(
                    "SELECT r.id FROM task_replicas r JOIN assignments a ON a.replica_id = r.id"
                    " WHERE a.id = :id FOR UPDATE OF r"
                ),
                {"id": expired["assignment_id"]},
            )
            reaping = asyncio.ensure_future(reap_once(app_state))
            await until_waiting(app_state, 1, reaping)
            report = asyncio.ensure_future(second.release(sibling, error="engine crashed"))
            await until_waiting(app_state, 2, reaping, report)
            assert not reaping.done() and not report.done()
        reaped = await asyncio.wait_for(reaping, timeout=HANG_S)
        released = await asyncio.wait_for(report, timeout=HANG_S)
        assert released.status_code == 200, released.text
        assert (reaped.expired, reaped.failed_tasks) == (8, 8)
        detail = (await s.admin.get(f"/v1/admin/pools/{s.pool_id}/tasks/{task_id}", headers=s.headers)).json()
        assert (detail["status"], detail["end_reason"]) == ("failed", "max_attempts")


COLOUR = {"prompt": "Name a colour.", "sampling": {"max_tokens": 8}}  # nothing to check: a quorum


async def test_two_cancels_settling_one_nodes_first_results_both_succeed(app: Any, app_state: Any) -> None:
    """Node A's first two results in the pool wait for their quorum (two replicated tasks whose
    answers the server cannot check; node B holds both siblings). The operator cancels both
    tasks at once: each cancel decides A's lone waiting result ``task_abandoned`` and so creates
    A's track record (``verification.service._trust``). With a plain INSERT the second waited on
    the first's uncommitted row and then failed with a unique violation: a 500, nothing
    cancelled. Now it is INSERT ... ON CONFLICT DO NOTHING, then a locked read."""
    async with pool_setup(app, app_state, workers=2, replication_factor=2) as s:
        first_id = (await s.enqueue([dict(COLOUR), dict(COLOUR)])).json()["first_task_id"]
        a, b = s.workers
        leases = (await a.claim(s.pool_id, max_tasks=2)).json()["leases"]
        assert len(leases) == 2
        assert len((await b.claim(s.pool_id, max_tasks=2)).json()["leases"]) == 2  # never answers
        for lease in leases:
            await submit(a, lease, ["red"])
        await verify_all(app_state)  # both wait for their siblings: no verdict, no track record
        task_ids = [await s.task_of(lease) for lease in leases]
        assert sorted(task_ids) == [first_id, first_id + 1]

        # The first cancel, as the route makes it, held open until the second waits on it.
        async with app_state.sessionmaker() as session, session.begin():
            await service.lock_live_leases(session, [task_ids[0]])
            task = await session.get(Task, task_ids[0], with_for_update=True)
            assert task is not None
            await service.cancel_task(session, task, "cancelled by the test")
            second = asyncio.ensure_future(
                s.admin.post(f"/v1/admin/pools/{s.pool_id}/tasks/{task_ids[1]}/cancel", headers=s.headers)
            )
            await until_waiting(app_state, 1, second)
        r = await asyncio.wait_for(second, timeout=HANG_S)
        assert r.status_code == 200, r.text
        assert r.json()["status"] == "cancelled"
        async with app_state.sessionmaker() as session:
            reasons = (await session.execute(select(Verdict.reason))).scalars().all()
            trust = await session.get(NodeTrust, (s.pool_id, a.node_id))
        assert sorted(reasons) == ["task_abandoned", "task_abandoned"]
        assert trust is not None and trust.invalid == 2


async def test_a_fraud_ejection_and_the_nodes_result_in_flight_do_not_deadlock(
    app: Any, app_state: Any, clock: Any
) -> None:
    """One verifier batch holds a replicated task (``_lock_replicated_tasks``, taken before any
    verdict) and then ejects a node for fraud, which locks that node's live leases
    (``release_member_leases``). The node meanwhile sends its result for its replica of that very
    task: the result holds its lease and replica and waits for the task. Lease -> task on one
    side, task -> lease on the other was a deadlock that PostgreSQL broke by failing one side
    (the verdict's savepoint, or the result's 503). The batch now locks the tasks' live leases
    first, in id order, as every ending of a task does."""
    app_state.rng = FixedDraw(1.0)
    econ = {"strikes_before_ejection": 1, "strikes_before_provider_ban": 10}
    # Two providers of one verifier partition (one in 16 of any two; a large pool has many):
    # their results are checked in one batch.
    a_key = generate_key()
    n_key = generate_key()
    while partition_of(key_id_of(n_key)) != partition_of(key_id_of(a_key)):
        n_key = generate_key()
    async with pool_setup(app, app_state, economics=econ) as s:
        a = await s.add_worker(provider_key=a_key)
        n = await s.add_worker(provider_key=n_key)
        greedy = {"temperature": 0, "max_tokens": 256}  # a miss is fraud at once
        await s.enqueue([task(canary=True, sampling=greedy), task(replication=2)])
        canary, shared = (await n.claim(s.pool_id, max_tasks=2)).json()["leases"]
        [a_lease] = (await a.claim(s.pool_id)).json()["leases"]
        await submit(a, a_lease, ["4"])  # A's result on the replicated task: in the same batch
        await submit(n, canary, ["5"])  # N fails the canary: fraud, one strike, ejected
        failures: list[str] = []
        with structlog.testing.capture_logs() as logs:
            async with app_state.sessionmaker() as session, session.begin():
                conn = await session.connection()
                context = {"assignment_id": shared["assignment_id"], "node_id": n.node_id, "policy_step": 1}
                read = (await conn.execute(service._result_context(True), context)).first()
                assert read is not None
                verifier = asyncio.ensure_future(drain(app_state))
                await until_waiting(app_state, 1, verifier)
                assert not verifier.done(), "the verifier did not wait for the result's lease"
                try:
                    await asyncio.wait_for(
                        conn.execute(
                            service._TASK_SUBMITTED, {"b_task": read.task_id, "b_now": clock.utcnow()}
                        ),
                        timeout=HANG_S,
                    )
                except Exception as exc:  # the deadlock, if PostgreSQL failed this side
                    failures.append(repr(exc))
                    raise
            await asyncio.wait_for(verifier, timeout=HANG_S)
        failures += [
            f"{e['event']} {e.get('submission_id')}: {e.get('exc_info')!r}"[:300]
            for e in logs
            if e["log_level"] == "error"
        ]
        async with app_state.sessionmaker() as session:
            fraud = (
                (await session.execute(select(Verdict.reason).where(Verdict.node_id == n.node_id)))
                .scalars()
                .all()
            )
        assert failures == [] and fraud == ["canary_failed"], (failures, fraud)


async def test_a_pool_completion_and_a_task_cancel_do_not_deadlock(
    app: Any, app_state: Any, monkeypatch: Any
) -> None:
    """Completing a pool gives back its members' leases node by node (``release_member_leases``,
    in ``live_members`` order: by provider), each node's leases locked as it comes, and only then
    cancels the open tasks. A cancel of one task locks that task's live leases in lease id order
    (``lock_live_leases``). With node X's lease of a task first in the completion's order but
    second by id, and node Y's the other way round, each held one lease the other needed (503
    for one side). The completion now locks all of the pool's live leases in id order first."""
    ids = iter(f"{i:04d}" for i in range(1, 100))
    # The leases' ids in claim order (asg_0001, ...), for the test to know which sorts first.
    monkeypatch.setattr(service, "secrets", types.SimpleNamespace(token_urlsafe=lambda _n: next(ids)))
    async with pool_setup(app, app_state, workers=2) as s:
        x, y = sorted(s.workers, key=lambda w: w.contributor.provider_id)  # completion order: X, Y
        task_id = (await s.enqueue([task(replication=2)])).json()["first_task_id"]
        [y_lease] = (await y.claim(s.pool_id)).json()["leases"]  # asg_0001: the cancel's first
        [x_lease] = (await x.claim(s.pool_id)).json()["leases"]  # asg_0002: the completion's first
        assert y_lease["assignment_id"] < x_lease["assignment_id"]
        r = await s.admin.post(f"/v1/admin/pools/{s.pool_id}/pause", headers=s.headers)
        assert r.status_code == 200, r.text

        real = service.release_member_leases
        first_done, go_on = asyncio.Event(), asyncio.Event()

        async def paced(session: Any, pool_id: str, node_id: str, *, now: Any) -> int:
            given_back = await real(session, pool_id, node_id, now=now)
            if node_id == x.node_id:  # X's leases are held: let the cancel start
                first_done.set()
                await go_on.wait()
            return given_back

        monkeypatch.setattr(service, "release_member_leases", paced)
        complete = asyncio.ensure_future(
            s.admin.post(f"/v1/admin/pools/{s.pool_id}/complete", headers=s.headers)
        )
        await asyncio.wait_for(first_done.wait(), timeout=HANG_S)
        cancel = asyncio.ensure_future(
            s.admin.post(f"/v1/admin/pools/{s.pool_id}/tasks/{task_id}/cancel", headers=s.headers)
        )
        await until_waiting(app_state, 1, cancel)  # the cancel holds Y's lease, waits for X's
        go_on.set()
        done, cancelled = await asyncio.wait_for(asyncio.gather(complete, cancel), timeout=HANG_S)
        assert (done.status_code, cancelled.status_code) == (200, 200), (done.text, cancelled.text)


async def test_reaper_and_a_leave_of_a_node_with_two_leases_do_not_deadlock(
    app: Any, app_state: Any, clock: FakeClock, monkeypatch: Any
) -> None:
    """The reaper locks every live lease of its expired leases' tasks, in id order, and waits
    for them. A leave gave back the node's leases in the pool with one SELECT ... FOR UPDATE and
    no ORDER BY, so in the order of the rows (claim order). Node N's two leases, of two tasks
    that each have an expired lease, claimed in the order opposite to their ids: the leave held
    N's first and waited for N's second, which the reaper took first and held while it waited
    for the leave's (503 for the leave). The leave now locks them in id order too."""
    ids = iter(f"{i:04d}" for i in range(99, 0, -1))  # a later claim has a lower id
    monkeypatch.setattr(service, "secrets", types.SimpleNamespace(token_urlsafe=lambda _n: next(ids)))
    async with pool_setup(app, app_state, lease_duration_s=60, max_leases_per_node=4) as s:
        m = await s.add_worker()
        n = await s.add_worker()
        p = await s.add_worker()
        await s.enqueue([task("one", replication=2), task("two", replication=3)])
        assert len((await m.claim(s.pool_id, max_tasks=2)).json()["leases"]) == 2  # 0099, 0098
        clock.advance(31)
        for w in (n, p):
            assert (await w.beat()).status_code == 200
        [n_first] = (await n.claim(s.pool_id)).json()["leases"]  # 0097, task one
        [p_lease] = (await p.claim(s.pool_id)).json()["leases"]  # 0096, task two
        [n_second] = (await n.claim(s.pool_id)).json()["leases"]  # 0095, task two
        assert n_second["assignment_id"] < p_lease["assignment_id"] < n_first["assignment_id"]
        clock.advance(31)  # M's leases ran out; N's and P's have 29 s left
        for w in (n, p):
            assert (await w.beat()).status_code == 200

        failures: list[str] = []
        with structlog.testing.capture_logs() as logs:
            async with app_state.sessionmaker() as holder, holder.begin():
                # P's lease, between N's two in id order: the reaper takes N's second, then waits.
                await holder.execute(
                    text("SELECT id FROM assignments WHERE id = :id FOR UPDATE"),
                    {"id": p_lease["assignment_id"]},
                )
                reaping = asyncio.ensure_future(reap_once(app_state))
                await until_waiting(app_state, 1, reaping)
                leaving = asyncio.ensure_future(
                    n.client.post(f"/v1/pools/{s.pool_id}/leave", auth=n.contributor.node_auth)
                )
                await until_waiting(app_state, 2, reaping, leaving)
            try:
                reaped = await asyncio.wait_for(reaping, timeout=HANG_S)
            except Exception as exc:
                failures.append(f"reaper: {exc!r}"[:300])
                reaped = None
            left = await asyncio.wait_for(leaving, timeout=HANG_S)
        if left.status_code != 200:
            failures.append(f"leave: {left.status_code} {left.text[:200]}")
        failures += [f"{e['event']}: {e.get('exc_info')!r}"[:300] for e in logs if e["log_level"] == "error"]
        if reaped is not None and not reaped.ran:
            failures.append("reaper tick did not run")
        assert failures == [], failures


async def test_a_pool_completion_and_a_reviving_beat_of_a_member_do_not_deadlock(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    """A completion locks all of the pool's live leases first; it took, member by member, the
    node's row only after them (``release_member_leases``: to wait for its claims in flight). A
    beat of an unhealthy node revives it (the node's row) and then extends the leases it lists.
    Node, then lease on one side; lease, then node on the other (503 for the beat). The
    completion now locks the members' nodes before the leases."""
    async with pool_setup(app, app_state, workers=1, lease_duration_s=60) as s:
        [n] = s.workers
        await s.enqueue([task()])
        [lease] = (await n.claim(s.pool_id)).json()["leases"]
        clock.advance(31)
        assert (await sweep_once(app_state)).to_unhealthy == 1  # silent for 31 s; 29 s of lease left
        r = await s.admin.post(f"/v1/admin/pools/{s.pool_id}/pause", headers=s.headers)
        assert r.status_code == 200, r.text
        async with app_state.sessionmaker() as holder, holder.begin():
            await holder.execute(
                text("SELECT id FROM assignments WHERE id = :id FOR UPDATE"), {"id": lease["assignment_id"]}
            )
            complete = asyncio.ensure_future(
                s.admin.post(f"/v1/admin/pools/{s.pool_id}/complete", headers=s.headers)
            )
            await until_waiting(app_state, 1, complete)
            beat = asyncio.ensure_future(n.beat([lease["assignment_id"]]))
            await until_waiting(app_state, 2, complete, beat)
            assert not complete.done() and not beat.done()
        done, beaten = await asyncio.wait_for(asyncio.gather(complete, beat), timeout=HANG_S)
        assert (done.status_code, beaten.status_code) == (200, 200), (done.text[:300], beaten.text[:300])
