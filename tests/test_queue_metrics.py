"""``/metrics`` shows the work queue an operator watches: claimable tasks, live leases, the
verifier's backlog by stage and how long its oldest result has waited, what claims and results
answered, and how long ago each background loop last ran."""

from __future__ import annotations

import contextlib
import datetime as dt
import math
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import update

from orchestrator import background
from orchestrator.core import metrics
from orchestrator.core.clock import FakeClock
from orchestrator.core.db import utcnow
from orchestrator.core.ticks import BackgroundTick
from orchestrator.tasks import jobs as task_jobs
from orchestrator.verification import jobs as verification_jobs
from orchestrator.verification import service
from tests.conftest import make_token
from tests.tasks_helpers import pool_setup, task
from tests.verification_helpers import FixedDraw, submit, verdicts, verify_all


async def scrape(client: httpx.AsyncClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    r = await client.get("/metrics")
    assert r.status_code == 200
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def value(m: dict[Any, float], name: str, **labels: str) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


async def test_the_queue_and_the_verifiers_backlog_are_on_metrics(
    app: Any, app_state: Any, client: httpx.AsyncClient, clock: FakeClock
) -> None:
    async with pool_setup(app, app_state, workers=1, max_leases_per_node=2) as s:
        w = s.workers[0]
        await s.enqueue([task(f"What is {i}+{i}?") for i in range(3)])
        before = await scrape(client)
        assert value(before, "orchestrator_tasks_claimable") == 3
        assert value(before, "orchestrator_leases_active") == 0
        assert value(before, "orchestrator_verification_jobs", stage="checks") == 0
        assert value(before, "orchestrator_verification_oldest_waiting_seconds") == 0

        leases = (await w.claim(s.pool_id, max_tasks=2)).json()["leases"]
        assert len(leases) == 2
        capped = (await w.claim(s.pool_id)).json()
        assert capped["reason"] == "lease_cap_reached"
        m = await scrape(client)
        assert value(m, "orchestrator_tasks_claimable") == 1
        assert value(m, "orchestrator_leases_active") == 2
        assert (
            value(m, "orchestrator_claims_total", outcome="leased")
            - value(before, "orchestrator_claims_total", outcome="leased")
            == 1
        )
        assert (
            value(m, "orchestrator_claims_total", outcome="lease_cap_reached")
            - value(before, "orchestrator_claims_total", outcome="lease_cap_reached")
            == 1
        )
        assert (
            value(m, "orchestrator_leases_granted_total") - value(before, "orchestrator_leases_granted_total")
            == 2
        )

        # Two results reach the verifier's queue, and wait there 42 s.
        for lease in leases:
            await submit(w, lease, ["wrong"])
        clock.advance(42)
        m = await scrape(client)
        assert value(m, "orchestrator_leases_active") == 0
        assert value(m, "orchestrator_verification_jobs", stage="checks") == 2
        assert value(m, "orchestrator_verification_oldest_waiting_seconds") == 42
        assert (
            value(m, "orchestrator_results_total", outcome="accepted")
            - value(before, "orchestrator_results_total", outcome="accepted")
            == 2
        )

        # The verifier decides them: the backlog and its age go back to zero.
        await verify_all(app_state)
        m = await scrape(client)
        assert value(m, "orchestrator_verification_jobs", stage="checks") == 0
        assert value(m, "orchestrator_verification_oldest_waiting_seconds") == 0


async def test_a_replayed_result_counts_as_replayed(
    app: Any, app_state: Any, client: httpx.AsyncClient
) -> None:
    async with pool_setup(app, app_state, workers=1) as s:
        w = s.workers[0]
        await s.enqueue([task()])
        lease = (await w.claim(s.pool_id)).json()["leases"][0]
        before = await scrape(client)
        assert (await w.submit(lease)).status_code == 201
        assert (await w.submit(lease)).status_code == 200  # the same body again
        m = await scrape(client)
        for outcome in ("accepted", "replayed"):
            grew = value(m, "orchestrator_results_total", outcome=outcome) - value(
                before, "orchestrator_results_total", outcome=outcome
            )
            assert grew == 1, outcome


async def test_each_background_loop_shows_how_long_ago_it_last_ran(
    app_state: Any, client: httpx.AsyncClient
) -> None:
    """The test app runs no loop, like an API replica beside `orchestrator background`: until a
    process runs them, every loop reads +Inf, which an alert on the age catches."""
    m = await scrape(client)
    for name in background.TICK_NAMES:
        assert value(m, "orchestrator_loop_last_run_age_seconds", loop=name) == math.inf, name

    await task_jobs.reap_once(app_state)  # one tick of the lease reaper, as a loop would run it
    m = await scrape(client)
    assert 0 <= value(m, "orchestrator_loop_last_run_age_seconds", loop=task_jobs.LEASE_REAPER) < 5
    assert value(m, "orchestrator_loop_last_run_age_seconds", loop=verification_jobs.VERIFIER) == math.inf

    # The loops stop (the background process is gone): the age grows with the wall clock.
    async with app_state.sessionmaker() as session, session.begin():
        await session.execute(
            update(BackgroundTick)
            .where(BackgroundTick.name == task_jobs.LEASE_REAPER)
            .values(last_run_at=utcnow() - dt.timedelta(hours=1))
        )
    m = await scrape(client)
    assert 3600 <= value(m, "orchestrator_loop_last_run_age_seconds", loop=task_jobs.LEASE_REAPER) < 3605

    # A run recorded a day ahead (a clock that ran ahead): not an age of 0, which hid it.
    async with app_state.sessionmaker() as session, session.begin():
        await session.execute(
            update(BackgroundTick)
            .where(BackgroundTick.name == task_jobs.LEASE_REAPER)
            .values(last_run_at=utcnow() + dt.timedelta(days=1))
        )
    m = await scrape(client)
    assert 86395 <= value(m, "orchestrator_loop_last_run_age_seconds", loop=task_jobs.LEASE_REAPER) <= 86400


async def test_a_result_waiting_for_a_validator_shows_its_age_until_one_decides_it(
    app: Any, app_state: Any, client: httpx.AsyncClient, clock: FakeClock
) -> None:
    """Nothing but a validator decides a result routed to validators: with none running it
    waited unpaid, and only a count showed it, not how long."""
    app_state.rng = FixedDraw(0.0)  # audit everything
    async with pool_setup(app, app_state, workers=1, audit_method="validator", audit_rate_floor=1.0) as s:
        w = s.workers[0]
        await s.enqueue([task()])
        await submit(w, (await w.claim(s.pool_id)).json()["leases"][0], ["4"])
        assert value(await scrape(client), "orchestrator_validation_oldest_waiting_seconds") == 0
        await verify_all(app_state)  # the cheap checks pass it on to the validators
        clock.advance(3000)
        m = await scrape(client)
        assert value(m, "orchestrator_verification_jobs", stage="validator") == 1
        assert value(m, "orchestrator_validation_oldest_waiting_seconds") == 3000
        assert value(m, "orchestrator_verification_oldest_waiting_seconds") == 0

        token = await make_token(app_state, "admin", name="toploc")
        headers = {"Authorization": f"Bearer {token}"}
        job = (await s.admin.post("/v1/validation/claim", json={}, headers=headers)).json()["jobs"][0]
        verdict = {"fencing_token": job["fencing_token"], "outcome": "valid", "reason": "toploc_ok"}
        r = await s.admin.post(f"/v1/validation/jobs/{job['job_id']}/verdict", json=verdict, headers=headers)
        assert r.status_code == 200, r.text
        assert value(await scrape(client), "orchestrator_validation_oldest_waiting_seconds") == 0


async def test_verdicts_and_their_money_are_counted_once_each_when_they_commit(
    app: Any, app_state: Any, client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch whose transaction fails after its verdicts were written (at its commit, say)
    rolls back and is decided again: each verdict is counted once, as its money moved once."""
    real = service.process_pending
    failed: list[int] = []

    async def fail_once(session: Any, **kwargs: Any) -> Any:
        batch = await real(session, **kwargs)
        if not failed:
            failed.append(batch.processed)
            raise RuntimeError("the batch's commit failed")
        return batch

    monkeypatch.setattr(service, "process_pending", fail_once)
    economics = {"reward_per_sample": 7}
    async with pool_setup(app, app_state, workers=1, max_leases_per_node=3, economics=economics) as s:
        w = s.workers[0]
        await s.enqueue([task(), task(), task()])  # each expects 4
        leases = (await w.claim(s.pool_id, max_tasks=3)).json()["leases"]
        for lease, answer in zip(leases, ("4", "4", "wrong"), strict=True):
            await submit(w, lease, [answer])
        before = await scrape(client)
        with pytest.raises(RuntimeError):
            await verify_all(app_state)
        assert await verdicts(s.admin, s.headers, s.pool_id) == []
        await verify_all(app_state)
        after = await scrape(client)
        decided = await verdicts(s.admin, s.headers, s.pool_id)
    assert failed == [3] and len(decided) == 3

    def grew(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    counted = "orchestrator_verdicts_total"
    assert grew(counted, outcome="accepted", category="valid", verifier="reward") == 2
    assert grew(counted, outcome="rejected", category="invalid", verifier="reward") == 1
    assert grew("orchestrator_rewards_credited_total") == sum(v["reward_amount"] for v in decided) == 14


async def test_a_count_waits_for_the_outermost_commit_and_goes_with_a_rollback(app_state: Any) -> None:
    counted: list[str] = []

    def count(name: str) -> Callable[[], None]:
        return lambda: counted.append(name)

    async with app_state.sessionmaker() as session:
        async with session.begin():
            metrics.on_commit(session, count("outer"))
            async with session.begin_nested():
                metrics.on_commit(session, count("released"))
            with contextlib.suppress(RuntimeError):
                async with session.begin_nested():
                    metrics.on_commit(session, count("rolled back savepoint"))
                    raise RuntimeError
            assert counted == []  # a released savepoint is not yet a commit
        assert counted == ["outer", "released"]
        with contextlib.suppress(RuntimeError):
            async with session.begin():
                metrics.on_commit(session, count("rolled back"))
                async with session.begin_nested():
                    metrics.on_commit(session, count("inside it"))
                raise RuntimeError
        async with session.begin():
            pass
    assert counted == ["outer", "released"]


async def test_an_appeal_is_counted_by_what_the_verdict_was_once_it_commits(
    app: Any, app_state: Any, client: httpx.AsyncClient
) -> None:
    async with pool_setup(app, app_state, workers=1, max_leases_per_node=2) as s:
        w = s.workers[0]
        await s.enqueue([task(), task()])
        for lease, answer in zip(
            (await w.claim(s.pool_id, max_tasks=2)).json()["leases"], ("4", "5"), strict=True
        ):
            await submit(w, lease, [answer])
        await verify_all(app_state)
        decided = {v["category"]: v["id"] for v in await verdicts(s.admin, s.headers, s.pool_id)}
        before = await scrape(client)
        for _ in range(2):  # the second appeal of the same verdict changes nothing
            r = await s.admin.post(
                f"/v1/admin/verdicts/{decided['invalid']}/reverse",
                json={"reason": "appeal"},
                headers=s.admin_headers,
            )
            assert r.status_code == 200, r.text
        after = await scrape(client)
    counted = "orchestrator_verdicts_reversed_total"
    grew = value(after, counted, outcome="rejected", category="invalid") - value(
        before, counted, outcome="rejected", category="invalid"
    )
    assert grew == 1
    assert value(after, counted, outcome="accepted", category="valid") == value(
        before, counted, outcome="accepted", category="valid"
    )
