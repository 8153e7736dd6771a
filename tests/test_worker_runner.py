"""``run_worker`` end to end against the in-process app: it works leases, earns, stops cleanly."""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import email.utils
import json
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import structlog
from sqlalchemy import select

from api_schemas.tasks import LeasedTask, PolicyRef, Sample
from orchestrator.core.clock import FakeClock
from orchestrator.core.keys import generate_key, key_id_of
from orchestrator.tasks.models import Submission
from orchestrator.verification.jobs import drain
from orchestrator.worker.backends import ArithmeticBackend, BackendError, Generation, registry
from orchestrator.worker.client import WorkerClient
from orchestrator.worker.problems import arithmetic_tasks
from orchestrator.worker.runner import WorkerConfig, WorkerStats, _Worker, run_worker
from tests.tasks_helpers import pool_setup, task
from tests.waits import HANG_S, until
from tests.worker_helpers import BASE_URL, ECON, SPECS, FaultyTransport, app_transport, requested

pytestmark = pytest.mark.usefixtures("no_audits")


@dataclass
class Run:
    """A worker running in the background, with every progress report it made."""

    task: asyncio.Task[WorkerStats]
    stop: asyncio.Event
    reports: list[WorkerStats] = field(default_factory=list)

    @property
    def latest(self) -> WorkerStats:
        return self.reports[-1] if self.reports else WorkerStats()

    async def until(self, condition: Callable[[WorkerStats], bool], within: float = 20.0) -> WorkerStats:
        deadline = time.monotonic() + within
        while not condition(self.latest):
            if self.task.done():
                self.task.result()  # raise what killed it
                raise AssertionError(f"worker ended early: {self.latest}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting; last report {self.latest}")
            await asyncio.sleep(0.01)
        return self.latest

    async def finish(self, within: float = 20.0) -> WorkerStats:
        self.stop.set()
        return await asyncio.wait_for(self.task, within)


def start(app: Any, pool_id: str, transport: Any = None, **overrides: Any) -> Run:
    settings: dict[str, Any] = {
        "node_key": generate_key(),
        "provider_key": generate_key(),
        "specs": SPECS,
        "stats_interval_s": 0.05,
        "earnings_interval_s": 0.05,
    }
    config = WorkerConfig(server=BASE_URL, pool_id=pool_id, **(settings | overrides))
    stop = asyncio.Event()
    reports: list[WorkerStats] = []
    task = asyncio.create_task(
        run_worker(config, stop=stop, transport=transport or app_transport(app), progress=reports.append)
    )
    return Run(task, stop, reports)


class GatedBackend(ArithmeticBackend):
    """The arithmetic policy, but each generation waits until the gate opens."""

    name = "gated"

    def __init__(self, gate: asyncio.Event) -> None:
        super().__init__()
        self.gate = gate
        self.started = 0

    async def generate(self, task: LeasedTask, seed: int, policy: PolicyRef) -> list[Sample]:
        self.started += 1
        await self.gate.wait()
        return await super().generate(task, seed, policy)


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> asyncio.Event:
    """Registers the ``gated`` backend; the returned event opens its gate."""
    event = asyncio.Event()

    def factory(options: Mapping[str, str]) -> GatedBackend:
        return GatedBackend(event)

    monkeypatch.setitem(registry.BUILT_IN, "gated", factory)
    return event


async def test_a_worker_completes_tasks_and_earns_once_verified(app: Any, app_state: Any) -> None:
    async with pool_setup(app, app_state, economics=ECON) as s:
        await s.enqueue(arithmetic_tasks(6, seed=21, n=2))
        run = start(app, s.pool_id, concurrency=3)
        await run.until(lambda st: st.submitted == 6)
        assert await drain(app_state) == 6
        await run.until(lambda st: st.accepted == 6 and st.earnings == 6 * 2 * 7)
        stats = await run.finish()
        assert (stats.state, stats.claimed, stats.tasks_done, stats.submitted) == ("stopped", 6, 6, 6)
        assert (stats.accepted, stats.rejected, stats.errors, stats.released) == (6, 0, 0, 0)
        assert stats.earnings == 84 and stats.in_flight == 0 and stats.awaiting_verdict == 0
        assert max(r.in_flight for r in run.reports) > 1  # it really ran leases concurrently
        tasks = (await s.admin.get(f"/v1/admin/pools/{s.pool_id}/tasks", headers=s.headers)).json()
        assert {t["status"] for t in tasks["items"]} == {"completed"}


class ProvingBackend(ArithmeticBackend):
    """The arithmetic policy, with a proof of each generation and its own reward claim, as a
    TOPLOC backend would send them."""

    name = "proving"

    async def generate(self, task: LeasedTask, seed: int, policy: PolicyRef) -> Generation:
        samples = await super().generate(task, seed, policy)
        return Generation(
            samples, proof=b"\x00toploc\xff" + seed.to_bytes(8, "big", signed=True), claimed_reward=1.0
        )


async def test_a_backend_sends_its_proof_and_claimed_reward_with_the_result(
    app: Any, app_state: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a pool that requires proofs a result without one is invalid: a backend had no way to
    give the worker its proof (nor a claimed reward), so no node running the stock worker could
    earn anything there. A backend now returns a ``Generation`` with them."""
    monkeypatch.setitem(registry.BUILT_IN, "proving", lambda options: ProvingBackend())
    async with pool_setup(app, app_state, economics=ECON, require_proof=True) as s:
        await s.enqueue(arithmetic_tasks(2, seed=21))
        run = start(app, s.pool_id, backend="proving", concurrency=2)
        await run.until(lambda st: st.submitted == 2)
        assert await drain(app_state) == 2
        await run.until(lambda st: st.accepted == 2)
        stats = await run.finish()
        assert (stats.accepted, stats.rejected, stats.errors, stats.earnings) == (2, 0, 0, 14)
        async with app_state.sessionmaker() as session:
            sent = [json.loads(b) for b in (await session.execute(select(Submission.body))).scalars()]
        assert sorted(base64.b64decode(r["proof"])[:8] for r in sent) == [b"\x00toploc\xff"] * 2
        assert {r["claimed_reward"] for r in sent} == {1.0}


class OwnScaleBackend(ArithmeticBackend):
    """The arithmetic policy, claiming a reward on a scale of its own (a format penalty of -1)."""

    name = "own_scale"

    async def generate(self, task: LeasedTask, seed: int, policy: PolicyRef) -> Generation:
        return Generation(await super().generate(task, seed, policy), claimed_reward=-0.5)


async def test_a_claimed_reward_outside_0_1_is_the_backends_failure_not_sent_as_fraud(
    app: Any, app_state: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server judges a claimed reward outside [0, 1] fraud (claim_out_of_bounds: the stake
    slashed, the rewards on hold forfeited, a strike). A backend's claim on a scale of its own
    (a shaped reward with a format penalty below 0) was sent as it was, and the honest node
    slashed for right answers; it is the backend's failure, as samples that make no valid
    result are: the lease is released with the error, nothing sent."""
    monkeypatch.setitem(registry.BUILT_IN, "own_scale", lambda options: OwnScaleBackend())
    async with pool_setup(app, app_state, economics=ECON, stake=1000) as s:
        await s.enqueue(arithmetic_tasks(1, seed=22))
        run = start(app, s.pool_id, backend="own_scale", concurrency=1)
        await run.until(lambda st: st.released > 0 or st.submitted > 0)
        stats = await run.finish()
        await drain(app_state)
        r = await s.admin.get(f"/v1/admin/pools/{s.pool_id}/verdicts", headers=s.headers)
        assert r.status_code == 200, r.text
        assert [(v["category"], v["reason"]) for v in r.json()["items"]] == []
        assert (stats.submitted, stats.released) == (0, 1), stats


async def test_wrong_answers_are_rejected_and_earn_nothing(app: Any, app_state: Any) -> None:
    async with pool_setup(app, app_state, economics=ECON) as s:
        await s.enqueue(arithmetic_tasks(3, seed=4))
        run = start(app, s.pool_id, backend_options={"error_rate": "1"}, concurrency=2)
        await run.until(lambda st: st.submitted == 3)
        await drain(app_state)
        await run.until(lambda st: st.rejected == 3)
        stats = await run.finish()
        assert (stats.accepted, stats.rejected, stats.earnings) == (0, 3, 0)


async def test_max_tasks_ends_the_run_by_itself(app: Any, app_state: Any) -> None:
    async with pool_setup(app, app_state) as s:
        await s.enqueue(arithmetic_tasks(5, seed=8))
        run = start(app, s.pool_id, concurrency=2, max_tasks=2)
        stats = await asyncio.wait_for(run.task, 20)
        assert not run.stop.is_set()
        assert (stats.claimed, stats.tasks_done, stats.submitted, stats.state) == (2, 2, 2, "stopped")
        # No verifier ran: the summary says the two results wait for their verdicts, not that
        # none was accepted.
        assert (stats.accepted, stats.rejected, stats.awaiting_verdict) == (0, 0, 2)
        open_tasks = await s.admin.get(
            f"/v1/admin/pools/{s.pool_id}/tasks", params={"status": "open"}, headers=s.headers
        )
        assert len(open_tasks.json()["items"]) == 3


async def test_stop_releases_the_leases_it_cannot_finish_in_the_grace_period(
    app: Any, app_state: Any, gate: asyncio.Event
) -> None:
    async with pool_setup(app, app_state, workers=1) as s:
        await s.enqueue(arithmetic_tasks(2, seed=2))
        run = start(app, s.pool_id, backend="gated", concurrency=2, grace_s=0.2)
        await run.until(lambda st: st.in_flight == 2)
        started = time.monotonic()
        stats = await run.finish()
        assert time.monotonic() - started < 3
        assert (stats.released, stats.submitted, stats.in_flight, stats.state) == (2, 0, 0, "stopped")
        # Given back at once: another node leases both replicas right away.
        other = s.workers[0]
        assert len((await other.claim(s.pool_id, max_tasks=2)).json()["leases"]) == 2


async def test_stop_lets_running_leases_finish_within_the_grace_period(
    app: Any, app_state: Any, gate: asyncio.Event
) -> None:
    async with pool_setup(app, app_state) as s:
        await s.enqueue(arithmetic_tasks(3, seed=2))
        run = start(app, s.pool_id, backend="gated", concurrency=1, grace_s=10)
        await run.until(lambda st: st.in_flight == 1)
        run.stop.set()
        await run.until(lambda st: st.state == "stopping")
        gate.set()
        stats = await run.finish()
        assert (stats.claimed, stats.submitted, stats.released) == (1, 1, 0)  # no new claims after stop


async def test_leases_the_server_drops_are_abandoned(app: Any, app_state: Any, gate: asyncio.Event) -> None:
    app_state.settings.heartbeat.interval_s = 0.05  # beat fast, so the drop is heard at once
    async with pool_setup(app, app_state) as s:
        await s.enqueue(arithmetic_tasks(1, seed=2))
        run = start(app, s.pool_id, backend="gated", concurrency=1)
        await run.until(lambda st: st.in_flight == 1)
        [t] = (await s.admin.get(f"/v1/admin/pools/{s.pool_id}/tasks", headers=s.headers)).json()["items"]
        r = await s.admin.post(f"/v1/admin/pools/{s.pool_id}/tasks/{t['id']}/cancel", headers=s.headers)
        assert r.status_code == 200
        await run.until(lambda st: st.dropped == 1 and st.in_flight == 0)
        gate.set()
        stats = await run.finish()
        assert (stats.submitted, stats.released, stats.tasks_done) == (0, 0, 0)


async def test_a_result_past_the_tasks_deadline_is_dropped_not_an_error(
    app: Any, app_state: Any, gate: asyncio.Event
) -> None:
    async with pool_setup(app, app_state) as s:
        deadline = app_state.clock.utcnow() + dt.timedelta(seconds=60)
        await s.enqueue([{**t, "deadline_at": deadline.isoformat()} for t in arithmetic_tasks(1, seed=2)])
        run = start(app, s.pool_id, backend="gated", concurrency=1)
        await run.until(lambda st: st.in_flight == 1)
        app_state.clock.advance(61)  # the lease still runs; the task's deadline has passed
        gate.set()
        await run.until(lambda st: st.dropped == 1 and st.in_flight == 0)
        stats = await run.finish()
        assert (stats.submitted, stats.errors) == (0, 0)


@dataclass
class LongNoWork(FaultyTransport):
    """A claim without work is answered with a wait of an hour (``Retry-After: 3600``)."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await super().handle_async_request(request)
        if request.url.path == "/v1/assignments/claim" and response.status_code == 200:
            body = json.loads(await response.aread())
            if not body["leases"]:
                body["retry_after_s"] = 3600
                return httpx.Response(200, json=body, headers={"Retry-After": "3600"})
        return response


async def test_no_work_waits_for_retry_after_and_stop_ends_the_wait(app: Any, app_state: Any) -> None:
    """The worker waits as long as the server asks (an hour here) before it claims again, and a
    stop ends the wait: a worker that waited it out would not stop within the test's bound."""
    async with pool_setup(app, app_state) as s:
        wire = LongNoWork(app_transport(app))
        run = start(app, s.pool_id, transport=wire)
        await run.until(lambda st: st.idle_reason == "no_tasks")
        await asyncio.sleep(1.0)  # no second claim meanwhile
        assert len(wire.to("/v1/assignments/claim")) == 1
        stats = await run.finish(within=HANG_S)
        assert stats.claimed == 0 and stats.state == "stopped"
        assert len(wire.to("/v1/assignments/claim")) == 1


async def test_a_refused_join_ends_the_run_with_the_problem(app: Any, app_state: Any) -> None:
    from orchestrator.worker.errors import OrchestratorAPIError

    async with pool_setup(app, app_state, economics={"min_stake_per_node": 100}) as s:
        run = start(app, s.pool_id)
        with pytest.raises(OrchestratorAPIError) as exc:
            await asyncio.wait_for(run.task, 10)
        assert exc.value.code == "stake_insufficient"


@dataclass
class Throttled(httpx.AsyncBaseTransport):
    """Lets ``limit`` requests at a time through to ``inner``."""

    inner: httpx.AsyncBaseTransport
    limit: asyncio.Semaphore

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        async with self.limit:
            return await self.inner.handle_async_request(request)


async def test_concurrency_above_the_claim_limit_fills_every_slot(
    app: Any, app_state: Any, gate: asyncio.Event
) -> None:
    from api_schemas.tasks import CLAIM_MAX_TASKS

    count = CLAIM_MAX_TASKS + 5
    async with pool_setup(app, app_state, max_leases_per_node=200) as s:
        assert (await s.enqueue(arithmetic_tasks(count, seed=3))).status_code == 201
        # At most 20 requests at once reach the in-process app: more than 100 concurrent ones
        # would exhaust its Redis client's connection pool (100) in the PostgreSQL + Redis pass.
        wire = FaultyTransport(Throttled(app_transport(app), asyncio.Semaphore(20)))
        run = start(app, s.pool_id, transport=wire, backend="gated", concurrency=count)
        await run.until(lambda st: st.in_flight == count)
        # Each claim asks for no more than the server's limit per claim, and it claims again.
        asked = [json.loads(c.body)["max_tasks"] for c in wire.to("/v1/assignments/claim")]
        assert asked[:2] == [CLAIM_MAX_TASKS, 5] and max(asked) == CLAIM_MAX_TASKS
        gate.set()
        await run.until(lambda st: st.submitted == count)
        stats = await run.finish()
        assert (stats.claimed, stats.errors) == (count, 0)


class MalformedBackend:
    """Samples of the right count that do not make a valid result (a negative token count)."""

    name = "malformed"

    async def generate(self, task: LeasedTask, seed: int, policy: PolicyRef) -> list[Any]:
        bad = {"completion": "1", "finish_reason": "stop", "prompt_tokens": -1, "completion_tokens": 1}
        return [bad] * task.sampling.n


async def test_invalid_backend_output_counts_an_error_and_releases_the_lease(
    app: Any, app_state: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(registry.BUILT_IN, "malformed", lambda options: MalformedBackend())
    async with pool_setup(app, app_state, workers=1) as s:
        await s.enqueue(arithmetic_tasks(1, seed=2))
        run = start(app, s.pool_id, backend="malformed", concurrency=1, max_tasks=1)
        stats = await asyncio.wait_for(run.task, 10)
        assert (stats.claimed, stats.errors, stats.released, stats.submitted) == (1, 1, 1, 0)
        # Given back at once: another node leases the replica right away.
        other = s.workers[0]
        assert len((await other.claim(s.pool_id)).json()["leases"]) == 1


class CrashingBackend(ArithmeticBackend):
    name = "crashing"

    async def generate(self, task: LeasedTask, seed: int, policy: PolicyRef) -> list[Sample]:
        raise BackendError("the model crashed on this prompt")


async def test_a_backend_failure_is_reported_with_the_release_and_ends_a_poison_task(
    app: Any, app_state: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(registry.BUILT_IN, "crashing", lambda options: CrashingBackend())
    async with pool_setup(app, app_state, workers=1, max_failures=1) as s:
        task_id = (await s.enqueue(arithmetic_tasks(1, seed=2))).json()["first_task_id"]
        run = start(app, s.pool_id, backend="crashing", concurrency=1, max_tasks=1)
        stats = await asyncio.wait_for(run.task, 10)
        assert (stats.claimed, stats.errors, stats.released, stats.submitted) == (1, 1, 1, 0)
        detail = (await s.admin.get(f"/v1/admin/pools/{s.pool_id}/tasks/{task_id}", headers=s.headers)).json()
        assert (detail["status"], detail["end_reason"]) == ("failed", "max_failures")
        [assignment] = detail["assignments"]
        assert assignment["error"] == "BackendError: the model crashed on this prompt"
        assert (await s.workers[0].claim(s.pool_id)).json()["reason"] == "no_tasks"


async def test_the_leases_of_a_claim_whose_answer_was_lost_are_taken_up(app: Any, app_state: Any) -> None:
    """The server leased three replicas but the answer never arrived (a read timeout): the
    worker asks for its live leases and works them, instead of leaving them held on the server
    until they expire (up to the pool's lease cap, which then refused every claim)."""
    async with pool_setup(app, app_state, workers=1) as s:
        await s.enqueue(arithmetic_tasks(3, seed=2))
        wire = FaultyTransport(app_transport(app))
        wire.fail("/v1/assignments/claim", "forward+timeout")
        run = start(app, s.pool_id, transport=wire, concurrency=3, max_tasks=3)
        stats = await asyncio.wait_for(run.task, 20)
        assert (stats.claimed, stats.recovered, stats.submitted, stats.errors) == (3, 3, 3, 1)
        assert [x.status for x in wire.to("/v1/assignments/claim")] == [200]  # the lost one only
        assert (await s.workers[0].claim(s.pool_id)).json()["reason"] == "no_tasks"


@dataclass
class StaleLeasesTransport(FaultyTransport):
    """Answers the second ``GET /v1/nodes/me/leases`` (the look after a failed claim) as the
    server read it, but only once the lease it lists has been worked and its result accepted:
    a slow answer, overtaken by the worker's own submission."""

    gate: asyncio.Event = field(default_factory=asyncio.Event)
    accepted: asyncio.Event = field(default_factory=asyncio.Event)
    #: Returns once the worker has forgotten the finished lease.
    forgotten: Callable[[], Awaitable[Any]] | None = None
    looks: int = 0
    #: The leases the held answer lists.
    stale: list[str] = field(default_factory=list)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await super().handle_async_request(request)
        if request.url.path.endswith("/result") and response.status_code == 201:
            self.accepted.set()
        if request.url.path == "/v1/nodes/me/leases":
            self.looks += 1
            if self.looks == 2:
                self.stale = [lease["assignment_id"] for lease in response.json()["leases"]]
                self.gate.set()
                await self.accepted.wait()
                assert self.forgotten is not None
                await self.forgotten()
        return response


async def test_a_lease_finished_while_its_leases_were_read_is_not_worked_again(
    app: Any, app_state: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a failed claim the worker reads its live leases and works those it does not know.
    A lease it was working itself, whose result went in while that read was on its way back,
    looked unknown (no longer in flight) and was generated and submitted a second time: a whole
    generation wasted, counted twice in the stats (seen as one result more acknowledged than
    stored after an API process was killed), and refused as result_conflict for a backend that
    does not repeat itself."""
    async with pool_setup(app, app_state, workers=1) as s:
        await s.enqueue(arithmetic_tasks(1, seed=2))
        wire = StaleLeasesTransport(app_transport(app))
        monkeypatch.setitem(registry.BUILT_IN, "gated", lambda options: GatedBackend(wire.gate))
        wire.fail("/v1/assignments/claim", "pass", "forward+timeout")  # the first claim gets the task
        run = start(app, s.pool_id, transport=wire, backend="gated", concurrency=2)
        wire.forgotten = lambda: run.until(lambda st: st.submitted == 1 and st.in_flight == 0)
        while not wire.seen or wire.looks < 2 or not wire.gate.is_set():
            await asyncio.sleep(0.02)
            assert not run.task.done()
        await asyncio.sleep(0.5)  # what the stale answer would start
        run.stop.set()
        stats = await asyncio.wait_for(run.task, 10)
        results = [x for x in wire.seen if x.path.endswith("/result")]
        assert (stats.recovered, stats.submitted, len(results)) == (0, 1, 1), (stats, results)
        # The held answer did list the lease being worked (still live when read).
        assert wire.stale == [results[0].path.split("/")[3]]


async def test_a_restarted_worker_takes_up_the_leases_its_previous_run_left(app: Any, app_state: Any) -> None:
    """A run killed while it held leases left them on the server, filling the pool's lease cap:
    the next run with the same node key works them (as many as --concurrency; the rest are
    given back at once, to another node) instead of being refused every claim until they
    expire."""
    async with pool_setup(app, app_state, workers=1, max_leases_per_node=2) as s:
        await s.enqueue(arithmetic_tasks(3, seed=2))
        node_key, provider_key = generate_key(), generate_key()
        async with WorkerClient(BASE_URL, node_key, provider_key, transport=app_transport(app)) as killed:
            await killed.register(SPECS, "test")
            await killed.join(s.pool_id)
            await killed.heartbeat()
            assert len((await killed.claim(s.pool_id, max_tasks=2)).leases) == 2
        run = start(app, s.pool_id, node_key=node_key, provider_key=provider_key, concurrency=1, max_tasks=2)
        stats = await asyncio.wait_for(run.task, 20)
        # The one taken up, then one more: the one given back (free again) or the third.
        assert (stats.recovered, stats.released, stats.claimed, stats.submitted) == (1, 1, 2, 2)
        assert len((await s.workers[0].claim(s.pool_id)).json()["leases"]) == 1  # the one given back


async def test_a_claim_refused_as_node_unhealthy_beats_at_once_and_claims_again(
    app: Any, app_state: Any
) -> None:
    """After an outage the server may not have had a beat lately and refuse the claim
    (node_unhealthy, here with an hour's Retry-After): the worker beats at once and, healthy
    again, claims at once, instead of idling out the Retry-After."""
    async with pool_setup(app, app_state) as s:
        await s.enqueue(arithmetic_tasks(1, seed=2))
        wire = FaultyTransport(app_transport(app))
        wire.fail("/v1/assignments/claim", "node_unhealthy")
        run = start(app, s.pool_id, transport=wire, concurrency=1, max_tasks=1)
        stats = await asyncio.wait_for(run.task, 20)
        assert (stats.claimed, stats.submitted) == (1, 1)
        assert [x.status for x in wire.to("/v1/assignments/claim")] == [200, 200]
        assert len(wire.to("/v1/nodes/me/heartbeat")) >= 2  # the start's beat, then the claim's


async def test_a_stop_during_an_outage_does_not_wait_out_the_clients_retries(
    app: Any, app_state: Any
) -> None:
    """Stopped while the server is unreachable, the worker makes one last attempt at what it
    reads on the way out (verdicts, balance) and ends its heartbeats once its leases are
    settled, instead of retrying each of them for about fifteen seconds (48 s seen)."""
    async with pool_setup(app, app_state) as s:
        wire = FaultyTransport(app_transport(app))
        run = start(app, s.pool_id, transport=wire, concurrency=1)
        await run.until(lambda st: st.idle_reason == "no_tasks")
        wire.down = True
        stats = await run.finish(within=8)
        assert stats.state == "stopped"
        assert wire.to("/v1/providers/me/balance")[-1].status is None  # tried, the server down


async def test_a_failure_without_a_message_is_logged_by_its_name(app: Any, app_state: Any) -> None:
    """httpx's timeouts carry no message: a failed stats read (or heartbeat, or read of the
    live leases) logged ``error=`` and nothing else (seen under load), so the worker's log did
    not say what had failed."""
    async with pool_setup(app, app_state) as s:
        wire = FaultyTransport(app_transport(app))
        wire.fail("/v1/providers/me/balance", *(["timeout"] * 1000))
        with structlog.testing.capture_logs() as logs:
            run = start(app, s.pool_id, transport=wire, concurrency=1, max_retries=0)
            await run.until(
                lambda st: st.idle_reason == "no_tasks" and len(wire.to("/v1/providers/me/balance")) > 1
            )
            await run.finish()
        failed = [e for e in logs if e["event"] == "stats_refresh_failed"]
        assert failed
        assert all(e["error"] == "ReadTimeout" for e in failed), failed


async def test_a_refused_submission_releases_the_lease_at_once(
    app: Any, app_state: Any, gate: asyncio.Event
) -> None:
    async with pool_setup(app, app_state, workers=1, max_async_level=0) as s:
        await s.enqueue(arithmetic_tasks(1, seed=2))
        run = start(app, s.pool_id, backend="gated", concurrency=1, max_tasks=1)
        await run.until(lambda st: st.in_flight == 1)
        assert (await s.publish(2)).status_code == 201  # the lease's policy is now too stale
        gate.set()
        stats = await asyncio.wait_for(run.task, 10)
        assert (stats.tasks_done, stats.submitted, stats.errors, stats.released) == (1, 0, 1, 1)
        other = s.workers[0]
        assert len((await other.claim(s.pool_id)).json()["leases"]) == 1


class HangingBackend(ArithmeticBackend):
    """A backend that never answers (a wedged inference server)."""

    name = "hanging"

    async def generate(self, task: LeasedTask, seed: int, policy: PolicyRef) -> list[Sample]:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


async def test_a_generation_that_hangs_is_cut_off_and_its_lease_given_back_as_failed(
    app: Any, app_state: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The heartbeats extend a lease for as long as the worker runs: a hung generation held its
    lease, and the task, until someone restarted the worker (which then took it back)."""
    monkeypatch.setitem(registry.BUILT_IN, "hanging", lambda options: HangingBackend())
    async with pool_setup(app, app_state, workers=1) as s:
        task_id = (await s.enqueue(arithmetic_tasks(1, seed=2))).json()["first_task_id"]
        run = start(app, s.pool_id, backend="hanging", max_tasks=1, generate_timeout_s=0.2)
        stats = await asyncio.wait_for(run.task, 10)
        assert (stats.claimed, stats.submitted, stats.errors, stats.released) == (1, 0, 1, 1)
        view = await s.admin.get(f"/v1/admin/pools/{s.pool_id}/tasks/{task_id}", headers=s.headers)
        [assignment] = view.json()["assignments"]
        assert (
            assignment["error"]
            == "BackendError: the generation took longer than 0.2 s (--generate-timeout-s)"
        )
        assert len((await s.workers[0].claim(s.pool_id)).json()["leases"]) == 1  # another node's now


class VerboseBackend(ArithmeticBackend):
    """Three samples of 3.5 MB: each within a sample's limit, together past the server's 10 MB
    limit on a result body (413)."""

    name = "verbose"

    async def generate(self, task: LeasedTask, seed: int, policy: PolicyRef) -> list[Sample]:
        sample = Sample(
            completion="x" * 3_500_000, finish_reason="length", prompt_tokens=1, completion_tokens=1
        )
        return [sample] * task.sampling.n


async def test_a_result_refused_for_what_it_is_is_given_back_as_a_failure(
    app: Any, app_state: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same lease taken back would give the same result, refused again: the release says
    why, so the task counts a failure and the node does not take it back (a stale policy is
    not such a refusal: taken back, the task comes with the current one)."""
    monkeypatch.setitem(registry.BUILT_IN, "verbose", lambda options: VerboseBackend())
    async with pool_setup(app, app_state, workers=1) as s:
        task_id = (await s.enqueue([task("long", n=3)])).json()["first_task_id"]
        run = start(app, s.pool_id, backend="verbose", concurrency=1, max_tasks=1)
        stats = await asyncio.wait_for(run.task, 20)
        assert (stats.claimed, stats.submitted, stats.errors, stats.released) == (1, 0, 1, 1)
        view = await s.admin.get(f"/v1/admin/pools/{s.pool_id}/tasks/{task_id}", headers=s.headers)
        [assignment] = view.json()["assignments"]
        assert (assignment["status"], assignment["error"]) == (
            "released",
            "result refused: 413 payload_too_large",
        )
        other = s.workers[0]
        assert len((await other.claim(s.pool_id)).json()["leases"]) == 1


async def test_stop_ends_a_claim_waiting_for_retry_after_at_once(app: Any, app_state: Any) -> None:
    async with pool_setup(app, app_state) as s:
        wire = FaultyTransport(app_transport(app))
        wire.fail("/v1/assignments/claim", *(["429:300"] * 6))  # the client would wait 5 x 300 s
        run = start(app, s.pool_id, transport=wire)
        await requested(wire, "/v1/assignments/claim")
        # A worker that waited out the first Retry-After would take 300 s; HANG_S is far less.
        stats = await run.finish(within=HANG_S)
        assert len(wire.to("/v1/assignments/claim")) == 1  # no attempt after the stop
        assert (stats.state, stats.claimed) == ("stopped", 0)


@dataclass
class HeldClaims(httpx.AsyncBaseTransport):
    """Claims reach the app only once ``gate`` is set (a slow server); other requests pass."""

    inner: httpx.AsyncBaseTransport
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/assignments/claim":
            self.arrived.set()
            await self.gate.wait()
        return await self.inner.handle_async_request(request)


async def test_stop_gives_a_claim_with_the_server_the_grace_period_then_abandons_it(
    app: Any, app_state: Any
) -> None:
    async with pool_setup(app, app_state) as s:
        await s.enqueue(arithmetic_tasks(1, seed=2))
        wire = HeldClaims(app_transport(app))
        run = start(app, s.pool_id, transport=wire, grace_s=0.2)
        await asyncio.wait_for(wire.arrived.wait(), HANG_S)
        started = time.monotonic()
        # The claim is never answered: a worker that waited for it would never stop.
        stats = await run.finish(within=HANG_S)
        assert time.monotonic() - started >= 0.2  # it had its grace
        assert (stats.state, stats.claimed, stats.errors) == ("stopped", 0, 0)


async def test_a_claim_answered_within_the_grace_period_after_stop_is_given_back(
    app: Any, app_state: Any
) -> None:
    async with pool_setup(app, app_state, workers=1) as s:
        await s.enqueue(arithmetic_tasks(2, seed=2))
        wire = HeldClaims(app_transport(app))
        # A grace far longer than the test's bound: a worker that waited it out fails the test.
        run = start(app, s.pool_id, transport=wire, concurrency=2, grace_s=10 * HANG_S)
        await asyncio.wait_for(wire.arrived.wait(), HANG_S)
        run.stop.set()
        await asyncio.sleep(0.1)
        wire.gate.set()  # the server answers the claim after the stop: both leases come back
        stats = await run.finish(within=HANG_S)
        assert (stats.claimed, stats.released, stats.submitted) == (2, 2, 0)
        other = s.workers[0]
        assert len((await other.claim(s.pool_id, max_tasks=2)).json()["leases"]) == 2


@dataclass
class ResultsDown(httpx.AsyncBaseTransport):
    """Forwards to ``inner``; while ``down`` is set, every result submission fails to connect
    (the server is not running), and the attempts are counted."""

    inner: httpx.AsyncBaseTransport
    down: bool = False
    refused: int = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self.down and request.url.path.endswith("/result"):
            self.refused += 1
            raise httpx.ConnectError("connection refused (injected)", request=request)
        return await self.inner.handle_async_request(request)


async def test_a_result_is_submitted_after_an_outage_longer_than_the_clients_retries(
    app: Any, app_state: Any, gate: asyncio.Event, monkeypatch: pytest.MonkeyPatch
) -> None:
    from orchestrator.worker.client import WorkerClient

    monkeypatch.setattr(WorkerClient, "backoff_base_s", 0.001)
    async with pool_setup(app, app_state, workers=1) as s:
        await s.enqueue(arithmetic_tasks(1, seed=2))
        wire = ResultsDown(app_transport(app))
        # The client tries a request twice (max_retries=1): the old worker then gave the result
        # up (submit_failed), and the lease stayed held on the server until it expired.
        run = start(
            app,
            s.pool_id,
            transport=wire,
            backend="gated",
            max_tasks=1,
            max_retries=1,
            max_error_backoff_s=0.01,
        )
        await run.until(lambda st: st.in_flight == 1)
        wire.down = True
        gate.set()
        for _ in range(2000):
            if wire.refused >= 6 or run.task.done():
                break
            await asyncio.sleep(0.01)
        assert wire.refused >= 6, f"the submission was given up after {wire.refused} attempts: {run.latest}"
        wire.down = False  # the server is back
        stats = await asyncio.wait_for(run.task, 20)
        assert (stats.tasks_done, stats.submitted, stats.errors, stats.released) == (1, 1, 0, 0)
        # Recorded: the replica is not leased again.
        other = s.workers[0]
        assert (await other.claim(s.pool_id)).json()["leases"] == []


async def test_a_stop_during_an_outage_gives_a_submission_the_grace_period_only(
    app: Any, app_state: Any, gate: asyncio.Event, monkeypatch: pytest.MonkeyPatch
) -> None:
    from orchestrator.worker.client import WorkerClient

    monkeypatch.setattr(WorkerClient, "backoff_base_s", 0.001)
    async with pool_setup(app, app_state) as s:
        await s.enqueue(arithmetic_tasks(1, seed=2))
        wire = ResultsDown(app_transport(app), down=True)
        run = start(app, s.pool_id, transport=wire, backend="gated", max_error_backoff_s=0.01, grace_s=0.3)
        await run.until(lambda st: st.in_flight == 1)
        gate.set()
        for _ in range(500):
            if wire.refused >= 3:
                break
            await asyncio.sleep(0.01)
        stats = await run.finish(within=10)
        assert (stats.tasks_done, stats.submitted, stats.errors, stats.state) == (1, 0, 1, "stopped")


@dataclass
class ResultsAnswered(httpx.AsyncBaseTransport):
    """Forwards to ``inner``; while ``status`` is set, every result submission is answered with
    that status (a server restarting, a proxy with none behind it, a server bug), unrecorded."""

    inner: httpx.AsyncBaseTransport
    status: int | None = None
    refused: int = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self.status is not None and request.url.path.endswith("/result"):
            self.refused += 1
            code = {429: "rate_limited", 500: "internal_error", 503: "not_ready"}[self.status]
            body = {"type": f"/problems/{code}", "title": code, "status": self.status, "code": code}
            headers = {"content-type": "application/problem+json", "Retry-After": "1"}
            return httpx.Response(self.status, json=body, headers=headers)
        return await self.inner.handle_async_request(request)


@pytest.mark.parametrize("status", [429, 503, 500])
async def test_a_result_the_server_did_not_take_is_not_given_back_as_a_failure(
    app: Any, app_state: Any, gate: asyncio.Event, monkeypatch: pytest.MonkeyPatch, status: int
) -> None:
    """A result unanswered for its content (429 or 503 until a stop's grace period ended, a 500)
    says nothing of the task or the node: given back as a failure, it would count towards the
    task's max_failures and the node's failing streak (a server outage failing tasks)."""
    monkeypatch.setattr(WorkerClient, "backoff_base_s", 0.001)
    async with pool_setup(app, app_state, max_failures=1) as s:
        task_id = (await s.enqueue([task("unanswered")])).json()["first_task_id"]
        wire = ResultsAnswered(app_transport(app), status=status)
        run = start(
            app,
            s.pool_id,
            transport=wire,
            backend="gated",
            max_retries=1,
            max_error_backoff_s=0.01,
            grace_s=0.3,
        )
        await run.until(lambda st: st.in_flight == 1)
        gate.set()
        for _ in range(500):
            if wire.refused >= 2:
                break
            await asyncio.sleep(0.01)
        stats = await run.finish(within=10)
        # The node may take back a lease it gave back without an error, and before the stop
        # it can have done so (and been refused again): every lease is given back, none failed.
        assert stats.submitted == 0 and stats.released >= 1
        view = await s.admin.get(f"/v1/admin/pools/{s.pool_id}/tasks/{task_id}", headers=s.headers)
        assignments = view.json()["assignments"]
        assert len(assignments) == stats.released
        assert {(a["status"], a["error"]) for a in assignments} == {("released", None)}
        assert view.json()["status"] == "open"  # not failed (max_failures=1)


async def test_a_claim_refused_for_the_lease_cap_is_made_again_as_soon_as_a_lease_ends(
    app: Any, app_state: Any, gate: asyncio.Event, monkeypatch: pytest.MonkeyPatch
) -> None:
    from orchestrator.tasks import service as tasks_service

    # A Retry-After the old worker waited out in full, though its own leases hold the cap.
    monkeypatch.setitem(tasks_service.RETRY_AFTER_S, "lease_cap_reached", 3600)
    async with pool_setup(app, app_state, max_leases_per_node=1) as s:
        await s.enqueue(arithmetic_tasks(3, seed=5))
        run = start(app, s.pool_id, backend="gated", concurrency=2)
        await run.until(lambda st: st.idle_reason == "lease_cap_reached" and st.in_flight == 1)
        gate.set()
        await run.until(lambda st: st.submitted == 3)
        stats = await run.finish()
        assert (stats.claimed, stats.submitted, stats.errors) == (3, 3, 0)


@dataclass
class HeldCapAnswer(FaultyTransport):
    """Runs ``hold`` once, before a claim's ``lease_cap_reached`` answer reaches the worker."""

    hold: Callable[[], Awaitable[None]] | None = None

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await super().handle_async_request(request)
        if self.hold is not None and b"lease_cap_reached" in response.content:
            hold, self.hold = self.hold, None
            await hold()
        return response


async def test_a_lease_that_ends_while_a_claim_refused_for_the_cap_is_away_makes_room_at_once(
    app: Any, app_state: Any, gate: asyncio.Event, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The refusal was made while the lease held the cap, and it arrives once the lease has
    ended: the worker, holding nothing, used to sleep out the whole Retry-After (a flaky test
    found it)."""
    from orchestrator.tasks import service as tasks_service

    monkeypatch.setitem(tasks_service.RETRY_AFTER_S, "lease_cap_reached", 3600)
    async with pool_setup(app, app_state, max_leases_per_node=1) as s:
        await s.enqueue(arithmetic_tasks(2, seed=5))
        wire = HeldCapAnswer(app_transport(app))
        run = start(app, s.pool_id, transport=wire, backend="gated", concurrency=2)

        async def lease_ends() -> None:
            gate.set()
            await run.until(lambda st: st.submitted == 1 and st.in_flight == 0)

        wire.hold = lease_ends
        await run.until(lambda st: st.submitted == 2, within=10)
        stats = await run.finish()
        assert (stats.claimed, stats.submitted, stats.errors) == (2, 2, 0)
        assert wire.hold is None  # the refusal did arrive after the lease ended


async def test_a_machine_finds_its_verdicts_among_its_providers_other_machines(
    app: Any, app_state: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker read its provider's newest few hundred verdicts and looked for its own among
    them: once the provider's other machines had made that many since, it never saw its own
    verdicts (accepted stayed 0, and "awaiting verdict" for ever). It now asks for its node's
    only."""
    from orchestrator.tasks import service as tasks_service

    monkeypatch.setitem(tasks_service.RETRY_AFTER_S, "no_tasks", 3600)  # A takes no more tasks
    provider = generate_key()
    async with pool_setup(app, app_state, max_leases_per_node=200) as s:
        await s.enqueue(arithmetic_tasks(1, seed=3), key="a")
        wire = FaultyTransport(app_transport(app))
        wire.fail("/v1/nodes/me/verdicts", *(["503"] * 100_000))  # no reads for now
        run = start(app, s.pool_id, transport=wire, provider_key=provider, max_retries=0)
        await run.until(lambda st: st.submitted == 1 and st.idle_reason == "no_tasks")
        assert await drain(app_state) == 1
        # Another machine of the provider answers 150 tasks afterwards (wrong answers: 150 newer
        # verdicts, rejections, no fraud).
        other = await s.add_worker(provider_key=provider)
        await s.enqueue([task(f"q{i}") for i in range(150)], key="b")
        leases = (await other.claim(s.pool_id, max_tasks=100)).json()["leases"]
        leases += (await other.claim(s.pool_id, max_tasks=100)).json()["leases"]
        assert len(leases) == 150
        for lease in leases:
            assert (await other.submit(lease, claimed_reward=None)).status_code == 201
        assert await drain(app_state) == 150
        wire.faults["/v1/nodes/me/verdicts"].clear()
        await run.until(lambda st: st.accepted == 1, within=10)
        stats = await run.finish()
        assert (stats.submitted, stats.accepted, stats.rejected, stats.awaiting_verdict) == (1, 1, 0, 0)


async def test_results_awaiting_a_verdict_are_counted_while_verdicts_cannot_be_read(
    app: Any, app_state: Any
) -> None:
    async with pool_setup(app, app_state) as s:
        await s.enqueue(arithmetic_tasks(2, seed=8))
        wire = FaultyTransport(app_transport(app))
        wire.fail("/v1/nodes/me/verdicts", *(["503"] * 1000))
        run = start(app, s.pool_id, transport=wire, concurrency=2, max_tasks=2, max_retries=0)
        stats = await asyncio.wait_for(run.task, 20)
        # No verdict could be read: both results are still awaiting theirs (the old worker
        # said 0, from its last successful read, made before it had submitted anything).
        assert (stats.submitted, stats.accepted, stats.rejected, stats.awaiting_verdict) == (2, 0, 0, 2)


async def test_a_worker_reads_its_verdicts_with_its_node_key_and_the_balance_rarely(
    app: Any, app_state: Any
) -> None:
    """Every machine of a provider signs provider reads with the provider's key, whose request
    budget (``ORCH_LIMITS__SIGNED_PER_PROVIDER_KEY``) they share with the provider's
    registrations. The worker read the balance and the verdicts with it every 5 s: some 700
    machines used that budget up. Verdicts are now read with the node key, and the balance
    every ``earnings_interval_s`` (30 s by default) and once at the end."""
    async with pool_setup(app, app_state, economics=ECON) as s:
        await s.enqueue(arithmetic_tasks(3, seed=5))
        wire = FaultyTransport(app_transport(app))
        run = start(app, s.pool_id, transport=wire, concurrency=3, earnings_interval_s=3600)
        await run.until(lambda st: st.submitted == 3)
        assert await drain(app_state) == 3
        await run.until(lambda st: st.accepted == 3)
        stats = await run.finish()
        assert (stats.accepted, stats.awaiting_verdict, stats.earnings) == (3, 0, 3 * 7)
        assert len(wire.to("/v1/nodes/me/verdicts")) >= 1
        assert wire.to("/v1/providers/me/verdicts") == []
        assert len(wire.to("/v1/providers/me/balance")) == 2  # the first refresh, the last


async def test_a_worker_without_the_provider_key_shows_its_verdicts(app: Any, app_state: Any) -> None:
    node_key, provider_key = generate_key(), generate_key()
    async with pool_setup(app, app_state, economics=ECON) as s:
        async with WorkerClient(BASE_URL, node_key, provider_key, transport=app_transport(app)) as provider:
            await provider.register(SPECS, "1")  # the provider registers the machine beforehand
        await s.enqueue(arithmetic_tasks(2, seed=6))
        run = start(app, s.pool_id, node_key=node_key, provider_key=None, concurrency=2)
        await run.until(lambda st: st.submitted == 2)
        assert await drain(app_state) == 2
        await run.until(lambda st: st.accepted == 2)
        stats = await run.finish()
        assert (stats.accepted, stats.awaiting_verdict, stats.earnings) == (2, 0, None)


async def test_a_stop_while_the_live_leases_are_read_ends_the_run_at_once(app: Any, app_state: Any) -> None:
    """The worker reads its live leases at the start and after every failed claim, so during
    outages; a stop while that read waits out a Retry-After ends the run at once (it waited
    up to 5 x 300 s, the signal ignored and the grace counted late)."""
    async with pool_setup(app, app_state) as s:
        await s.enqueue(arithmetic_tasks(1, seed=2))
        wire = FaultyTransport(app_transport(app))
        wire.fail("/v1/nodes/me/leases", "429:300")
        run = start(app, s.pool_id, transport=wire, concurrency=1)
        await requested(wire, "/v1/nodes/me/leases")
        run.stop.set()
        stats = await asyncio.wait_for(run.task, 10)
        assert stats.state == "stopped"
        assert len(wire.to("/v1/nodes/me/leases")) == 1  # no attempt after the stop


async def test_a_stop_while_the_claim_loop_beats_for_node_unhealthy_ends_the_run_at_once(
    app: Any, app_state: Any
) -> None:
    """After a claim refused node_unhealthy the claim loop beats at once; that beat, waiting out
    a Retry-After, ended only once the held leases were settled, which waits for the claim loop
    itself: a stop was not seen for up to 5 x 300 s."""
    async with pool_setup(app, app_state) as s:
        wire = FaultyTransport(app_transport(app))
        wire.fail("/v1/assignments/claim", "node_unhealthy")
        wire.fail("/v1/nodes/me/heartbeat", "pass", "429:300")  # the start's beat, then the claim loop's
        run = start(app, s.pool_id, transport=wire, concurrency=1)
        await until(lambda: len(wire.to("/v1/nodes/me/heartbeat")) >= 2, "the claim loop's beat")
        assert [x.status for x in wire.to("/v1/nodes/me/heartbeat")] == [200, 429]
        run.stop.set()
        stats = await asyncio.wait_for(run.task, 10)
        assert stats.state == "stopped"


@pytest.mark.parametrize("failures", [1, 10, 1024, 5000])
def test_the_error_backoff_stays_bounded_through_an_outage_of_any_length(failures: int) -> None:
    """0.5 * 2**failures was computed before the cap: from the 1024th failure in a row (some 8
    hours of refused connections) it overflowed a float, which killed the claim loop (the worker
    exited with a traceback) or a result's submission (its lease left to expire)."""
    config = WorkerConfig(server=BASE_URL, pool_id="p", node_key_path=Path("node.key"))
    worker = _Worker.__new__(_Worker)
    worker.config = config
    assert 0 <= worker._backoff(failures) <= config.max_error_backoff_s


async def test_a_stop_while_the_start_waits_out_a_retry_ends_the_run_at_once(
    app: Any, app_state: Any
) -> None:
    """The registration (or the join, or the first beat) waited out its Retry-After, up to 5 x
    300 s, with the stop ignored; then the run failed with the server's error (exit 1). Nothing
    is held yet: the run ends at once, stopped."""
    async with pool_setup(app, app_state) as s:
        wire = FaultyTransport(app_transport(app))
        wire.fail("/v1/pools/" + s.pool_id + "/join", "429:300")
        run = start(app, s.pool_id, transport=wire, concurrency=1)
        await requested(wire, "/v1/pools/" + s.pool_id + "/join")
        run.stop.set()
        stats = await asyncio.wait_for(run.task, 10)
        assert stats.state == "stopped" and stats.claimed == 0
        assert len(wire.to("/v1/pools/" + s.pool_id + "/join")) == 1  # no attempt after the stop


async def test_a_long_running_worker_keeps_nothing_per_decided_result(
    app: Any, app_state: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker kept every submission id it ever made, with its verdict, for the stats: a
    worker that runs for weeks grew by every result it made, and each verdict read (every 5 s)
    went over all of them. Once a result's verdict is counted it is forgotten."""
    from orchestrator.worker import runner

    workers: list[Any] = []

    class Recorded(runner._Worker):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            workers.append(self)

    monkeypatch.setattr(runner, "_Worker", Recorded)
    n = 40
    async with pool_setup(app, app_state, economics=ECON, max_leases_per_node=10) as s:
        await s.enqueue(arithmetic_tasks(n, seed=31))
        run = start(app, s.pool_id, concurrency=10, backend_options={"error_rate": "0.2"})
        await run.until(lambda st: st.submitted == n)
        assert await drain(app_state) == n
        stats = await run.until(lambda st: st.accepted + st.rejected == n)
        assert stats.awaiting_verdict == 0 and stats.rejected > 0
        stats = await run.finish()
        assert (stats.submitted, stats.accepted + stats.rejected, stats.awaiting_verdict) == (n, n, 0)
        (worker,) = workers
        kept = {k: len(v) for k, v in vars(worker).items() if isinstance(v, (set, dict, list))}
        assert max(kept.values()) < 10, kept  # nothing per result: at most the leases in flight


def recorded_workers(monkeypatch: pytest.MonkeyPatch) -> list[_Worker]:
    """The ``_Worker`` of every run started from now on, to look inside."""
    from orchestrator.worker import runner

    workers: list[_Worker] = []

    class Recorded(runner._Worker):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            workers.append(self)

    monkeypatch.setattr(runner, "_Worker", Recorded)
    return workers


async def cancel_open_tasks(s: Any) -> None:
    tasks = (await s.admin.get(f"/v1/admin/pools/{s.pool_id}/tasks", headers=s.headers)).json()["items"]
    for t in tasks:
        if t["status"] != "cancelled":
            r = await s.admin.post(f"/v1/admin/pools/{s.pool_id}/tasks/{t['id']}/cancel", headers=s.headers)
            assert r.status_code == 200, r.text


async def test_a_long_running_worker_forgets_the_leases_the_server_took_back(
    app: Any, app_state: Any, gate: asyncio.Event, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker kept the id of every lease a heartbeat's drop_leases named, for the whole run:
    one more per lease the server took back, for weeks. It needs one only while the lease's
    work is still ending."""
    app_state.settings.heartbeat.interval_s = 0.05  # beat fast, so each drop is heard at once
    workers = recorded_workers(monkeypatch)
    async with pool_setup(app, app_state) as s:
        await s.enqueue(arithmetic_tasks(1, seed=0), key="batch-0")
        run = start(app, s.pool_id, backend="gated", concurrency=1)
        for dropped in range(4):
            await run.until(lambda st, n=dropped: st.in_flight == 1 and st.dropped == n)
            await cancel_open_tasks(s)
            if dropped < 3:  # the next, for the slot the dropped lease frees
                await s.enqueue(arithmetic_tasks(1, seed=dropped + 1), key=f"batch-{dropped + 1}")
        await run.until(lambda st: st.dropped == 4 and st.in_flight == 0)
        (worker,) = workers
        assert worker.dropped == set()  # it kept all 4
        stats = await run.finish()
        assert (stats.dropped, stats.submitted, stats.released, stats.errors) == (4, 0, 0, 0)


class SlowToStop(ArithmeticBackend):
    """A generation that, cancelled, takes its time to end (an HTTP request being closed, say),
    until it is cancelled again."""

    name = "slow-to-stop"

    def __init__(self) -> None:
        super().__init__()
        self.cancelled = asyncio.Event()

    async def generate(self, task: LeasedTask, seed: int, policy: PolicyRef) -> list[Sample]:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            await asyncio.Event().wait()  # ends when cancelled once more
        raise AssertionError("unreachable")


async def test_a_lease_the_server_took_back_is_not_given_back_at_the_stop_while_its_work_ends(
    app: Any, app_state: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop gives back the leases still being worked, but not one the server already took back
    whose work is still ending (it is no longer the node's to give). Such a lease is counted as
    dropped once, and no beat names it again: each beat named it, the server dropped it again,
    and the worker counted it once more."""
    app_state.settings.heartbeat.interval_s = 0.05
    backend = SlowToStop()
    monkeypatch.setitem(registry.BUILT_IN, "slow-to-stop", lambda options: backend)
    workers = recorded_workers(monkeypatch)
    async with pool_setup(app, app_state) as s:
        await s.enqueue(arithmetic_tasks(1, seed=3))
        run = start(app, s.pool_id, backend="slow-to-stop", concurrency=1, grace_s=0.1)
        await run.until(lambda st: st.in_flight == 1)
        await cancel_open_tasks(s)
        await asyncio.wait_for(backend.cancelled.wait(), 10)
        (worker,) = workers
        assert worker.dropped == set(worker.running)  # still ending: remembered
        stats = await run.finish()
        assert (stats.dropped, stats.released, stats.errors, stats.in_flight) == (1, 0, 0, 0)
        assert worker.dropped == set()


# ------------------------------------------------------------------ ending on its own


@dataclass
class QuickNoWork(FaultyTransport):
    """A claim without work is answered without a wait: the worker claims again after its
    ``idle_wait_s``, not the server's 5 to 60 s."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await super().handle_async_request(request)
        if request.url.path == "/v1/assignments/claim" and response.status_code == 200:
            body = json.loads(await response.aread())
            if not body["leases"]:
                body["retry_after_s"] = None
                return httpx.Response(200, json=body)
        return response


def start_quick(app: Any, pool_id: str, **overrides: Any) -> tuple[Run, QuickNoWork]:
    wire = QuickNoWork(app_transport(app))
    return start(app, pool_id, transport=wire, idle_wait_s=0.02, **overrides), wire


async def ended(run: Run) -> Any:
    """What the run raised: it must end on its own (a hang is bounded by HANG_S)."""
    from orchestrator.worker.errors import WorkerEnded

    with pytest.raises(WorkerEnded) as exc:
        await asyncio.wait_for(asyncio.shield(run.task), HANG_S)
    return exc.value


async def test_a_paused_pool_keeps_the_worker_waiting_and_a_completed_one_ends_it(
    app: Any, app_state: Any
) -> None:
    """A paused pool may resume: the worker waits. Completing it ends every membership: the
    worker gives back nothing it holds (nothing), ends, and says so with its stats."""
    async with pool_setup(app, app_state) as s:
        run, wire = start_quick(app, s.pool_id)
        await run.until(lambda st: st.idle_reason == "no_tasks")
        url = f"/v1/admin/pools/{s.pool_id}"
        assert (await s.admin.post(f"{url}/pause", headers=s.headers)).status_code == 200
        await run.until(lambda st: st.idle_reason == "pool_paused")
        paused_at = len(wire.to("/v1/assignments/claim"))
        await until(lambda: len(wire.to("/v1/assignments/claim")) >= paused_at + 5, "enough claims or reads")
        assert not run.task.done() and run.latest.idle_reason == "pool_paused"
        assert (await s.admin.post(f"{url}/complete", headers=s.headers)).status_code == 200
        end = await ended(run)
        assert end.reason == "pool_completed"
        assert f"the pool {s.pool_id} is over (the pool is completed)" in end.detail
        assert end.stats.state == "stopped" and end.stats.idle_reason == "pool_not_active"
        assert run.latest.state == "stopped"


@pytest.mark.parametrize("how", ["left", "ejected"])
async def test_a_worker_whose_membership_ended_stops_saying_why(
    app: Any, app_state: Any, gate: asyncio.Event, how: str
) -> None:
    """After `worker leave` (or an operator's ejection) the claims answer not_a_member: the
    worker reads its membership, sees it ended, settles the lease it held (the server took it
    back: dropped) and ends, rather than ask every 60 s for ever."""
    node_key = generate_key()
    async with pool_setup(app, app_state) as s:
        await s.enqueue(arithmetic_tasks(1, seed=31))
        run, _ = start_quick(app, s.pool_id, node_key=node_key, backend="gated", concurrency=2)
        await run.until(lambda st: st.in_flight == 1 and st.idle_reason == "no_tasks")
        if how == "left":
            async with WorkerClient(BASE_URL, node_key, transport=app_transport(app)) as node:
                assert (await node.leave(s.pool_id)).status.value == "left"
        else:
            r = await s.admin.post(
                f"/v1/admin/pools/{s.pool_id}/members/{run.latest.node_id}/eject",
                json={"reason": "misbehaving"},
                headers=s.headers,
            )
            assert r.status_code == 200, r.text
        await run.until(lambda st: st.idle_reason == "not_a_member")
        gate.set()  # the lease's work ends; its result is refused, the lease gone
        end = await ended(run)
        assert end.reason == "membership_ended"
        assert (f"the node {how} the pool" if how == "left" else "was ejected from the pool") in end.detail
        assert end.stats.in_flight == 0 and end.stats.submitted == 0


async def test_a_pending_membership_keeps_the_worker_waiting_for_the_operator(
    app: Any, app_state: Any
) -> None:
    async with pool_setup(app, app_state) as s:
        url = f"/v1/admin/pools/{s.pool_id}"
        r = await s.admin.patch(url, json={"admission": "approval"}, headers=s.headers)
        assert r.status_code == 200, r.text
        await s.enqueue(arithmetic_tasks(1, seed=32))
        run, wire = start_quick(app, s.pool_id, pending_read_interval_s=0)
        await run.until(lambda st: st.idle_reason == "not_a_member")
        # It read its membership, pending, and went on asking.
        await until(lambda: len(wire.to("/v1/nodes/me")) >= 5, "enough claims or reads")
        assert not run.task.done()
        r = await s.admin.post(f"{url}/members/{run.latest.node_id}/approve", headers=s.headers)
        assert r.status_code == 200, r.text
        await run.until(lambda st: st.submitted == 1)
        assert (await run.finish()).state == "stopped"


@dataclass
class ClaimAnswers(FaultyTransport):
    """Keeps every claim's answer: its no-work reason and Retry-After, or its leases."""

    answers: list[tuple[str | None, str | None]] = field(default_factory=list)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await super().handle_async_request(request)
        if request.url.path == "/v1/assignments/claim" and response.status_code == 200:
            body = json.loads(await response.aread())
            self.answers.append((body["reason"], response.headers.get("retry-after")))
        return response


async def test_a_pending_worker_reads_its_record_once_a_minute_not_after_every_claim(
    app: Any, app_state: Any
) -> None:
    """While pending, the claims (every 5 s) notice the approval; the record is read to notice
    a rejection, once per ``pending_read_interval_s`` (60 s), not after every claim: before, a
    pending worker sent a claim and a record read every 5 s, twice an idle member's requests."""
    async with pool_setup(app, app_state) as s:
        url = f"/v1/admin/pools/{s.pool_id}"
        r = await s.admin.patch(url, json={"admission": "approval"}, headers=s.headers)
        assert r.status_code == 200, r.text
        keys = {"node_key": generate_key(), "provider_key": generate_key()}
        run, wire = start_quick(app, s.pool_id, **keys)
        await run.until(lambda st: st.idle_reason == "not_a_member")
        await until(lambda: len(wire.to("/v1/assignments/claim")) >= 10, "ten claims")
        assert len(wire.to("/v1/nodes/me")) == 1, "one read of the pending record, then claims only"
        node_id = run.latest.node_id
        await run.finish()
        # A rejection is still noticed, at the next read (here with no interval between reads).
        run2, _ = start_quick(app, s.pool_id, pending_read_interval_s=0, **keys)
        await run2.until(lambda st: st.idle_reason == "not_a_member")
        r = await s.admin.post(f"{url}/members/{node_id}/reject", headers=s.headers)
        assert r.status_code == 200, r.text
        end = await ended(run2)
        assert end.reason == "membership_ended" and "rejected" in end.detail


async def test_an_approval_starts_a_pending_workers_work_within_seconds(app: Any, app_state: Any) -> None:
    """While its join waits for the operator's approval, the worker is told to claim again in
    5 s (it was told 60 s, and waited them out, so work started up to a minute after the
    approval), and after the approval its next claim takes the task. The waits are read from
    the claims' answers, not timed."""
    async with pool_setup(app, app_state) as s:
        url = f"/v1/admin/pools/{s.pool_id}"
        r = await s.admin.patch(url, json={"admission": "approval"}, headers=s.headers)
        assert r.status_code == 200, r.text
        await s.enqueue(arithmetic_tasks(1, seed=36))
        wire = ClaimAnswers(app_transport(app))
        run = start(app, s.pool_id, transport=wire)
        await run.until(lambda st: st.idle_reason == "not_a_member")
        assert wire.answers[0] == ("not_a_member", "5"), wire.answers
        r = await s.admin.post(f"{url}/members/{run.latest.node_id}/approve", headers=s.headers)
        assert r.status_code == 200, r.text
        await run.until(lambda st: st.submitted == 1, within=HANG_S)
        await run.finish()
        pending = [wait for reason, wait in wire.answers if reason == "not_a_member"]
        assert pending and set(pending) == {"5"}, wire.answers
        assert wire.answers[len(pending)] == (None, None), wire.answers  # then leased at once


async def test_a_retired_providers_worker_ends_saying_its_money_went_to_the_successor(
    app: Any, app_state: Any, gate: asyncio.Event
) -> None:
    """Its nodes are revoked (node_banned) and its key refused (provider_retired): the worker
    ends at once, even with every slot taken by a lease it could not submit, says the provider
    was retired, and shows no earnings (they are the successor's now)."""
    from tests.test_provider_retirement import registered_provider, retire

    provider_key = generate_key()
    provider_id = key_id_of(provider_key)
    async with pool_setup(app, app_state, economics=ECON) as s:
        await s.enqueue(arithmetic_tasks(1, seed=33))
        gate.set()
        run, _ = start_quick(app, s.pool_id, backend="gated", provider_key=provider_key)
        await run.until(lambda st: st.submitted == 1)
        assert await drain(app_state) == 1
        await run.until(lambda st: st.earnings == 7)
        gate.clear()
        await s.enqueue(arithmetic_tasks(1, seed=34), key="batch-2")
        await run.until(lambda st: st.in_flight == 1)  # its one slot, held at the gate
        heir = await registered_provider(s)
        assert (await retire(s, provider_id, heir.provider_id)).status_code == 201
        end = await ended(run)
        assert end.reason == "provider_retired"
        assert f"the provider {provider_id} was retired" in end.detail and "successor" in end.detail
        assert end.stats.earnings is None and run.latest.earnings is None
        assert end.stats.in_flight == 0 and end.stats.submitted == 1


@pytest.mark.parametrize("when", ["running", "at_start"])
async def test_a_retired_providers_worker_without_the_provider_key_ends_as_retired(
    app: Any, app_state: Any, gate: asyncio.Event, when: str
) -> None:
    """Without the provider key the worker has only its node's refusals to go by: they say the
    provider was retired (node_banned, provider_retired: true), so it ends as retired (the CLI
    exits 5), not as banned (exit 4), whether the retirement comes while it runs, every slot
    taken by a lease it cannot submit, or before it starts."""
    from tests.test_provider_retirement import registered_provider, retire

    node_key, provider_key = generate_key(), generate_key()
    provider_id = key_id_of(provider_key)
    async with pool_setup(app, app_state, economics=ECON) as s:
        async with WorkerClient(BASE_URL, node_key, provider_key, transport=app_transport(app)) as provider:
            await provider.register(SPECS, "1")  # the provider registers the machine beforehand
        heir = await registered_provider(s)
        if when == "at_start":
            assert (await retire(s, provider_id, heir.provider_id)).status_code == 201
            run, _ = start_quick(app, s.pool_id, node_key=node_key, provider_key=None)
        else:
            await s.enqueue(arithmetic_tasks(1, seed=35))
            run, _ = start_quick(app, s.pool_id, node_key=node_key, provider_key=None, backend="gated")
            await run.until(lambda st: st.in_flight == 1)  # its one slot, held at the gate
            assert (await retire(s, provider_id, heir.provider_id)).status_code == 201
        end = await ended(run)
        assert end.reason == "provider_retired", end.detail
        assert "was retired by an admin" in end.detail and "successor" in end.detail
        assert "its provider key can do nothing" in end.detail  # it was given none
        if when == "running":  # it read its provider from its record at the start
            assert f"the provider {provider_id} was retired" in end.detail
        assert end.stats.earnings is None and end.stats.in_flight == 0 and end.stats.submitted == 0


async def test_a_worker_whose_provider_was_blacklisted_from_the_pool_does_not_say_it_left(
    app: Any, app_state: Any
) -> None:
    """A blacklisting of the provider ends its nodes' memberships as `left`, as a `worker leave`
    does: the worker ends, but must not tell its user that the node left by `worker leave`
    and that running it again joins the pool again (the join is refused provider_blacklisted)."""
    provider_key = generate_key()
    async with pool_setup(app, app_state) as s:
        run, _ = start_quick(app, s.pool_id, provider_key=provider_key)
        await run.until(lambda st: st.idle_reason == "no_tasks")
        r = await s.admin.post(
            f"/v1/admin/pools/{s.pool_id}/blacklist",
            json={"provider_id": key_id_of(provider_key), "reason": "sybil"},
            headers=s.headers,
        )
        assert r.status_code in (200, 201), r.text
        end = await ended(run)
        assert end.reason == "membership_ended"
        # It cannot tell a blacklisting from a leave (both `left`): it says either may be why,
        # and that running it again joins the pool again only without a blacklisting.
        assert "blacklisted its provider there" in end.detail, end.detail
        assert "joins it again, unless its provider is blacklisted there" in end.detail, end.detail


class RealTimeClock(FakeClock):
    """The server's clock as a deployment's: it moves on its own, so leases run out in real time
    on the server as on the worker; ``ahead_s`` ahead of this machine's."""

    def __init__(self, ahead_s: float = 0.0) -> None:
        super().__init__()
        self.ahead_s = ahead_s

    def now(self) -> float:
        return time.time() + self.ahead_s

    def utcnow(self) -> dt.datetime:
        return dt.datetime.fromtimestamp(self.now(), dt.UTC)

    def monotonic(self) -> float:
        return time.monotonic()


@dataclass
class DatedTransport(FaultyTransport):
    """Each answer with the ``Date`` header of the server's clock, as uvicorn sends it."""

    clock: Any = None

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await super().handle_async_request(request)
        response.headers["Date"] = email.utils.format_datetime(self.clock.utcnow(), usegmt=True)
        return response


@pytest.mark.parametrize(
    "clock", [RealTimeClock(), RealTimeClock(ahead_s=200)], ids=["same_clock", "server_200s_ahead"]
)
async def test_a_lease_is_extended_before_its_deadline_whatever_the_servers_interval(
    app: Any, app_state: Any, gate: asyncio.Event, clock: RealTimeClock
) -> None:
    """The server says when its leases run out (``lease_deadlines``, and the claim's
    ``lease_expires_at``): the worker beats before they do, by half the time left, not only
    every ``next_heartbeat_in_s``. Beating every minute, it lost a 10 s lease to the server
    before its result was in (refused ``lease_expired``, counted dropped). The deadlines are
    judged by the server's clock, as its ``Date`` header shows it: this machine's may be minutes
    off (the signatures allow 5), and 200 s behind it the leases seemed to have minutes left."""
    app_state.settings.heartbeat.interval_s = 3  # leases of 10 s are allowed
    async with pool_setup(app, app_state, lease_duration_s=10) as s:
        app_state.settings.heartbeat.interval_s = 60  # a beat a minute: longer than a lease
        await s.enqueue(arithmetic_tasks(1, seed=2))
        wire = DatedTransport(app_transport(app), clock=clock) if clock.ahead_s else None
        run = start(app, s.pool_id, transport=wire, backend="gated", concurrency=1)
        await run.until(lambda st: st.in_flight == 1)
        await asyncio.sleep(12)  # longer than the lease lasts without a beat
        gate.set()
        stats = await run.until(lambda st: st.tasks_done == 1)
        assert (stats.submitted, stats.dropped, stats.errors) == (1, 0, 0), stats
        await run.finish()


@pytest.mark.parametrize("clock", [RealTimeClock()])
async def test_a_lease_past_its_pools_max_lease_is_dropped_at_its_deadline_not_at_the_next_beat(
    app: Any, app_state: Any, gate: asyncio.Event
) -> None:
    """No beat extends a lease past its pool's ``max_lease_s`` from its claim: the server gives
    its deadline at each beat, and the worker beats right after it, so the lease is dropped and
    its work stopped within about a second of it, not at the next beat of the server's interval
    (a minute here; the work went on until then, holding the slot)."""
    app_state.settings.heartbeat.interval_s = 3  # leases of 10 s are allowed
    async with pool_setup(app, app_state, lease_duration_s=10, max_lease_s=10) as s:
        app_state.settings.heartbeat.interval_s = 60  # a beat a minute
        await s.enqueue(arithmetic_tasks(1, seed=2))
        run = start(app, s.pool_id, backend="gated", concurrency=1)
        await run.until(lambda st: st.in_flight == 1)
        began = time.monotonic()
        await run.until(lambda st: st.dropped == 1 and st.in_flight == 0, within=20)
        assert time.monotonic() - began < 13
        gate.set()
        stats = await run.finish()
        assert (stats.submitted, stats.released, stats.dropped, stats.errors) == (0, 0, 1, 0), stats


class OneSlowBackend(ArithmeticBackend):
    """The arithmetic policy: the first generation waits until the gate opens, every other one
    takes ``quick_s``; so one lease stays in flight while the others end and are claimed again
    every fraction of a second."""

    name = "one_slow"

    def __init__(self, gate: asyncio.Event, quick_s: float) -> None:
        super().__init__()
        self.gate = gate
        self.quick_s = quick_s
        self.started = 0

    async def generate(self, task: LeasedTask, seed: int, policy: PolicyRef) -> list[Sample]:
        self.started += 1
        await (self.gate.wait() if self.started == 1 else asyncio.sleep(self.quick_s))
        return await super().generate(task, seed, policy)


@pytest.mark.parametrize("clock", [RealTimeClock()])
async def test_leases_taken_more_than_once_a_second_do_not_put_off_the_beat_a_lease_needs(
    app: Any, app_state: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each claim's leases wake the heartbeat loop to work its next beat out again. That must
    only ever bring the beat forward: worked out afresh from each wake's time, a beat due by a
    lease's deadline (a second or half the time left, from then) was put off at every claim,
    and with claims coming more than once a second (the other slots' work is quick) it never
    came: the slow lease ran out on the server (refused lease_expired, counted dropped)."""
    gate = asyncio.Event()
    monkeypatch.setitem(registry.BUILT_IN, "one_slow", lambda options: OneSlowBackend(gate, quick_s=0.2))
    app_state.settings.heartbeat.interval_s = 3  # leases of 10 s are allowed
    async with pool_setup(app, app_state, lease_duration_s=10) as s:
        app_state.settings.heartbeat.interval_s = 60  # a beat a minute: longer than a lease
        await s.enqueue(arithmetic_tasks(120, seed=3))
        run = start(app, s.pool_id, backend="one_slow", concurrency=2)
        await run.until(lambda st: st.in_flight == 2)
        await asyncio.sleep(12)  # longer than the slow lease lasts without a beat
        assert run.latest.claimed > 20, run.latest  # the quick slot claimed all along
        gate.set()
        await asyncio.sleep(2)  # its result is in (or refused)
        stats = await run.finish()
        assert (stats.dropped, stats.errors) == (0, 0), stats


@pytest.mark.parametrize("clock", [RealTimeClock()])
async def test_a_beat_refused_with_a_long_retry_after_is_tried_again_before_the_lease_runs_out(
    app: Any, app_state: Any, gate: asyncio.Event
) -> None:
    """A beat refused 429 with ``Retry-After: 60`` while a lease has a few seconds left: the
    client waited the minute out before trying again, the lease ran out on the server meanwhile
    and its result was refused (``lease_expired``, counted dropped). The beat is now tried once
    more about a second before the lease's deadline (once: no more than that against the
    server's wish), which extends it."""
    app_state.settings.heartbeat.interval_s = 3  # leases of 10 s are allowed
    async with pool_setup(app, app_state, lease_duration_s=10) as s:
        app_state.settings.heartbeat.interval_s = 60  # a beat a minute: the lease's beat comes by it
        await s.enqueue(arithmetic_tasks(1, seed=2))
        wire = FaultyTransport(app_transport(app))
        beats = "/v1/nodes/me/heartbeat"
        run = start(app, s.pool_id, transport=wire, backend="gated", concurrency=1)
        await run.until(lambda st: st.in_flight == 1)
        wire.fail(beats, "429:60")  # the lease's beat (about 5 s before its deadline) is refused
        await asyncio.sleep(11)  # past the lease's deadline (10 s from its claim)
        refused = [b for b in wire.to(beats) if b.status == 429]
        assert len(refused) == 1, wire.to(beats)
        gate.set()
        stats = await run.until(lambda st: st.tasks_done == 1)
        assert (stats.submitted, stats.dropped) == (1, 0), stats
        # Tried once more, not hammered: the refused beat and the early one, then the
        # server's minute (the next beats come by the extended lease's deadline, 10 s on).
        after = wire.to(beats)[wire.to(beats).index(refused[0]) :]
        assert [b.status for b in after[:2]] == [429, 200], after
        await run.finish()
