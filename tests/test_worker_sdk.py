"""The worker SDK against the real in-process app: signed calls, typed errors, retries."""

from __future__ import annotations

import asyncio
import datetime as dt
import email.utils
import time
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from api_schemas.tasks import Lease, ResultIn
from api_schemas.verification import VerdictOut
from orchestrator.tasks.models import Assignment, Submission
from orchestrator.verification.jobs import drain
from orchestrator.worker.backends import ArithmeticBackend
from orchestrator.worker.errors import OrchestratorAPIError, ProviderKeyRequired, parse_retry_after
from orchestrator.worker.problems import arithmetic_tasks
from tests.conftest import Contributor, problem
from tests.tasks_helpers import pool_setup
from tests.worker_helpers import ECON, SPECS, faulty_client, new_client, requested

pytestmark = pytest.mark.usefixtures("no_audits")


async def test_register_join_claim_submit_round_trip_earns(app: Any, app_state: Any) -> None:
    async with pool_setup(app, app_state, economics=ECON) as s, new_client(app) as client:
        node = await client.register(SPECS, "1.2.3")
        assert node.id == client.node_id and node.provider_id == client.provider_id
        assert node.status == "waiting" and node.specs.gpu_model == "NVIDIA L4"
        again = await client.register({**SPECS, "ram_mb": 65536}, "1.2.4")  # idempotent, updates
        assert again.id == node.id and again.version == "1.2.4" and again.specs.ram_mb == 65536

        membership = await client.join(s.pool_id)
        assert membership.status.value == "active" and membership.node_id == client.node_id
        assert (await client.join(s.pool_id)).episode == membership.episode  # joining twice is fine
        beat = await client.heartbeat(metrics={"gpu_util": 0.5})
        assert beat.status == "healthy" and beat.next_heartbeat_in_s == 10

        assert (await s.enqueue(arithmetic_tasks(1, seed=3, n=2))).status_code == 201
        claim = await client.claim(s.pool_id, max_tasks=4)
        assert claim.reason is None and len(claim.leases) == 1
        lease = claim.leases[0]
        beat = await client.heartbeat(leases=[lease.assignment_id])
        assert beat.drop_leases == []
        # Each lease still held, with its deadline: here the claim's, not pushed back yet.
        assert [(x.assignment_id, x.lease_expires_at) for x in beat.lease_deadlines] == [
            (lease.assignment_id, lease.lease_expires_at)
        ]

        samples = await ArithmeticBackend().generate(lease.task, lease.seed, lease.policy)
        result = ResultIn(
            fencing_token=lease.fencing_token, policy_step=lease.policy.step, seed=lease.seed, samples=samples
        )
        out = await client.submit(lease, result)
        assert out.status == "pending" and out.assignment_id == lease.assignment_id
        assert (await client.submit(lease, result)).submission_id == out.submission_id

        assert await drain(app_state) == 1
        # A typed model from api_schemas, as the README says of every call's answer.
        [verdict] = await client.verdicts()
        assert isinstance(verdict, VerdictOut)
        assert verdict.submission_id == out.submission_id and verdict.outcome == "accepted"
        assert verdict.task_id == lease.task.task_id  # the node's own reference for the task
        assert await client.verdicts(node_only=True) == [verdict]
        balance = await client.balance()
        assert balance.provider_id == client.provider_id and balance.rewards_pending == 2 * 7

        claim = await client.claim(s.pool_id)
        assert claim.leases == [] and claim.reason == "no_tasks" and (claim.retry_after_s or 0) > 0
        await client.leave(s.pool_id)
        assert (await client.claim(s.pool_id)).reason == "not_a_member"
        assert (await client.me()).memberships[0].status == "left"


async def test_release_gives_the_lease_back(app: Any, app_state: Any) -> None:
    async with pool_setup(app, app_state) as s, new_client(app) as a, new_client(app) as b:
        for c in (a, b):
            await c.register(SPECS, "1")
            await c.join(s.pool_id)
            await c.heartbeat()
        await s.enqueue(arithmetic_tasks(1, seed=1))
        [lease] = (await a.claim(s.pool_id)).leases
        assert (await b.claim(s.pool_id)).reason == "no_tasks"
        await a.release(lease.assignment_id)
        await a.release(lease.assignment_id)  # idempotent
        [again] = (await b.claim(s.pool_id)).leases
        assert await s.task_of(again.assignment_id) == await s.task_of(lease.assignment_id)
        assert again.fencing_token > lease.fencing_token


async def test_a_release_whose_error_is_not_unicode_text_gives_the_lease_back(
    app: Any, app_state: Any
) -> None:
    """A backend's error can hold a lone surrogate: Python reads a file name that is not UTF-8
    into one (an OSError's message). The release raised (its error could not be sent as UTF-8)
    and the lease was not given back, but held until it expired. It is sent with U+FFFD in its
    place, as a NUL is, and the lease is released with the error."""
    async with pool_setup(app, app_state) as s, new_client(app) as client:
        await client.register(SPECS, "1")
        await client.join(s.pool_id)
        await client.heartbeat()
        await s.enqueue(arithmetic_tasks(1, seed=1))
        [lease] = (await client.claim(s.pool_id)).leases
        name = b"/models/\xff.bin".decode("utf-8", "surrogateescape")
        await client.release(lease.assignment_id, error=f"FileNotFoundError: {name}\x00")
        async with app_state.sessionmaker() as session:
            row = await session.get(Assignment, lease.assignment_id)
        assert row is not None and row.status == "released"
        assert row.error == "FileNotFoundError: /models/\ufffd.bin\ufffd"


async def test_errors_are_typed_with_the_problem_code(app: Any, app_state: Any) -> None:
    econ = {"min_stake_per_node": 500}
    async with pool_setup(app, app_state, economics=econ) as s, new_client(app) as client:
        with pytest.raises(OrchestratorAPIError) as unknown:
            await client.me()
        assert (unknown.value.status, unknown.value.code) == (401, "unknown_key")

        await client.register(SPECS, "1")
        with pytest.raises(OrchestratorAPIError) as refused:
            await client.join(s.pool_id)
        err = refused.value
        assert (err.status, err.code) == (403, "stake_insufficient")
        assert err.body["reasons"][0]["required"] == 500 and "stake" in err.detail

        with pytest.raises(OrchestratorAPIError) as missing:
            await client.claim("pool_doesnotexist00")
        assert (missing.value.status, missing.value.code) == (404, "pool_not_found")

        with pytest.raises(OrchestratorAPIError) as gone:
            await client.release("asg_doesnotexist")
        assert (gone.value.status, gone.value.code) == (404, "assignment_not_found")


async def test_provider_calls_need_the_provider_key(app: Any, app_state: Any) -> None:
    async with new_client(app) as provider_side, new_client(app, provider=False) as node_only:
        await provider_side.register(SPECS, "1")
        with pytest.raises(ProviderKeyRequired):
            await node_only.balance()
        with pytest.raises(ProviderKeyRequired):
            await node_only.register(SPECS, "1")
        # A provider that keeps its key offline hands the node an attestation instead.
        from orchestrator.core.keys import attest_node

        assert provider_side._provider_key is not None
        node = await node_only.register(
            SPECS,
            "1",
            provider_id=provider_side.provider_id,
            attestation=attest_node(provider_side._provider_key, node_only.node_id),
        )
        assert node.provider_id == provider_side.provider_id == node_only.provider_id


async def test_a_retry_is_a_freshly_signed_request_not_a_replay(app: Any, app_state: Any) -> None:
    client, wire = faulty_client(app)
    async with client:
        await client.register(SPECS, "1")
        # The app handles the first beat (and remembers its nonce); its answer is lost.
        wire.fail("/v1/nodes/me/heartbeat", "forward+502", "503")
        beat = await client.heartbeat()
        assert beat.status == "healthy"
        attempts = wire.to("/v1/nodes/me/heartbeat")
        assert [a.status for a in attempts] == [200, 503, 200]
        assert len({a.nonce for a in attempts}) == 3


async def test_retry_after_is_honoured(app: Any, app_state: Any) -> None:
    client, wire = faulty_client(app)
    async with client:
        await client.register(SPECS, "1")
        wire.fail("/v1/nodes/me", "429:1")
        started = time.monotonic()
        assert (await client.me()).id == client.node_id
        waited = time.monotonic() - started
        assert 1.0 <= waited < 5.0
        assert [a.status for a in wire.to("/v1/nodes/me")] == [429, 200]


def test_retry_after_dates_are_understood() -> None:
    now = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
    later = email.utils.format_datetime(now + dt.timedelta(seconds=42), usegmt=True)
    assert parse_retry_after(later, now=now) == 42.0
    assert parse_retry_after("7") == 7.0
    assert parse_retry_after("soon") is None


async def test_a_heartbeats_retry_comes_once_before_each_lease_deadline_its_wait_would_pass(
    app: Any, app_state: Any
) -> None:
    """A beat refused 429 with ``Retry-After: 60`` waited the minute out, letting the leases it
    names run out on the server. With their ``deadlines``, the wait is cut short to try again
    ``early_retry_lead_s`` before each (once each; deadlines within that of an early retry are
    its too, and early retries come at most that often); past them the server's wait stands."""
    client, wire = faulty_client(app)
    client.early_retry_lead_s = 0.5
    loop = asyncio.get_running_loop()
    sent: list[float] = []
    forward = wire.handle_async_request

    async def timed(request: httpx.Request) -> httpx.Response:
        sent.append(loop.time())
        return await forward(request)

    wire.handle_async_request = timed  # type: ignore[method-assign]
    async with client:
        await client.register(SPECS, "1")
        sent.clear()
        wire.fail("/v1/nodes/me/heartbeat", *["429:60"] * 6)
        stop = asyncio.Event()
        loop.call_later(3.5, stop.set)
        began = loop.time()
        deadlines = [began + 1.0, began + 1.2, began + 1.4, began + 3.0]
        with pytest.raises(OrchestratorAPIError) as exc:
            await client.heartbeat(deadlines=deadlines, stop=stop)
        assert exc.value.status == 429
        assert loop.time() - began < 4.5  # ended by the stop, in the server's minute
        at = [round(t - began, 1) for t in sent]
        # Tried; then 0.5 s before the first deadline; 0.5 s later (the soonest) for the second
        # (the third, within 0.5 s of that retry, is its too); 0.5 s before the last.
        assert len(at) == 4, at
        assert at[0] < 0.2 and 0.4 <= at[1] <= 0.7 and 0.9 <= at[2] <= 1.15 and 2.4 <= at[3] <= 2.7, at


async def test_retries_give_up_with_the_last_error(app: Any, app_state: Any) -> None:
    client, wire = faulty_client(app, max_retries=2)
    async with client:
        await client.register(SPECS, "1")
        wire.fail("/v1/nodes/me", "503", "503", "503", "503")
        with pytest.raises(OrchestratorAPIError) as exc:
            await client.me()
        assert (exc.value.status, exc.value.code) == (503, "not_ready")
        assert len(wire.to("/v1/nodes/me")) == 3  # one try and two retries


async def _one_result(client: Any, s: Any) -> tuple[Lease, ResultIn]:
    """Register, join and beat as ``client``'s node, enqueue one task, lease it and make its result."""
    await client.register(SPECS, "1")
    await client.join(s.pool_id)
    await client.heartbeat()
    await s.enqueue(arithmetic_tasks(1, seed=5))
    [lease] = (await client.claim(s.pool_id)).leases
    samples = await ArithmeticBackend().generate(lease.task, lease.seed, lease.policy)
    result = ResultIn(
        fencing_token=lease.fencing_token, policy_step=lease.policy.step, seed=lease.seed, samples=samples
    )
    return lease, result


async def test_a_lost_result_answer_is_retried_and_recorded_once(app: Any, app_state: Any) -> None:
    client, wire = faulty_client(app)
    async with pool_setup(app, app_state) as s, client:
        lease, result = await _one_result(client, s)
        path = f"/v1/assignments/{lease.assignment_id}/result"
        wire.fail(path, "forward+timeout", "forward+502")
        out = await client.submit(lease, result)
        attempts = wire.to(path)
        assert [a.status for a in attempts] == [201, 200, 200]
        assert len({a.body for a in attempts}) == 1 and len({a.nonce for a in attempts}) == 3
        async with app_state.sessionmaker() as session:
            assert await session.scalar(select(func.count()).select_from(Submission)) == 1
            assert await session.scalar(select(Submission.id)) == out.submission_id


async def test_a_claim_is_not_retried_once_it_may_have_reached_the_server(app: Any, app_state: Any) -> None:
    client, wire = faulty_client(app)
    async with pool_setup(app, app_state) as s, client:
        await client.register(SPECS, "1")
        await client.join(s.pool_id)
        await client.heartbeat()
        await s.enqueue(arithmetic_tasks(2, seed=9))
        wire.fail("/v1/assignments/claim", "forward+timeout")
        with pytest.raises(httpx.ReadTimeout):
            await client.claim(s.pool_id)
        assert [a.status for a in wire.to("/v1/assignments/claim")] == [200]  # sent once
        # The lost claim leased a task: only one is left.
        assert len((await client.claim(s.pool_id, max_tasks=2)).leases) == 1


async def test_a_claim_is_retried_when_it_never_did_anything(app: Any, app_state: Any) -> None:
    client, wire = faulty_client(app)
    async with pool_setup(app, app_state) as s, client:
        await client.register(SPECS, "1")
        await client.join(s.pool_id)
        await client.heartbeat()
        await s.enqueue(arithmetic_tasks(1, seed=9))
        wire.fail("/v1/assignments/claim", "connect", "503", "forward+502")
        # A connection error and a 503 are retried; a 502 after the app handled it is not.
        with pytest.raises(OrchestratorAPIError) as exc:
            await client.claim(s.pool_id)
        assert exc.value.status == 502 and exc.value.code == "http_502"
        assert [a.status for a in wire.to("/v1/assignments/claim")] == [None, 503, 200]


async def test_a_claims_stop_event_ends_its_retry_wait_with_the_last_error(app: Any, app_state: Any) -> None:
    client, wire = faulty_client(app)
    async with pool_setup(app, app_state) as s, client:
        await client.register(SPECS, "1")
        await client.join(s.pool_id)
        await client.heartbeat()
        wire.fail("/v1/assignments/claim", "429:300", "429:300")
        stop = asyncio.Event()
        claim = asyncio.create_task(client.claim(s.pool_id, stop=stop))
        await requested(wire, "/v1/assignments/claim")
        await asyncio.sleep(0.05)
        assert not claim.done()  # waiting the 300 s the server asked for
        started = time.monotonic()
        stop.set()
        with pytest.raises(OrchestratorAPIError) as exc:
            await asyncio.wait_for(claim, 2)
        assert time.monotonic() - started < 1
        assert (exc.value.status, exc.value.code) == (429, "rate_limited")
        assert len(wire.to("/v1/assignments/claim")) == 1  # no attempt after the stop


async def test_a_submissions_stop_event_ends_its_retries(app: Any, app_state: Any) -> None:
    client, wire = faulty_client(app)
    async with pool_setup(app, app_state) as s, client:
        lease, result = await _one_result(client, s)
        path = f"/v1/assignments/{lease.assignment_id}/result"
        wire.fail(path, "connect", "connect")
        stop = asyncio.Event()
        stop.set()
        with pytest.raises(httpx.ConnectError):
            await client.submit(lease, result, stop=stop)
        assert len(wire.to(path)) == 1  # one attempt, none after the stop
        assert (await client.submit(lease, result)).submission_id > 0  # retried without it
        assert len(wire.to(path)) == 3


async def test_a_verdicts_node_filter_that_cannot_be_a_key_id_is_refused(
    client: httpx.AsyncClient, contributor: Contributor
) -> None:
    """``?node_id=`` (a worker's own verdicts among its provider's machines', checked by the
    runner's test) takes a key id; anything else is 400, not an empty page."""
    url = "/v1/providers/me/verdicts"
    r = await client.get(url, params={"node_id": contributor.node_id}, auth=contributor.provider_auth)
    assert r.status_code == 200 and r.json()["items"] == []
    bad = await client.get(url, params={"node_id": "not a key"}, auth=contributor.provider_auth)
    problem(bad, 400, "invalid_query")


async def test_a_provider_withdraws_and_lists_its_payouts_without_a_node_key(
    app: Any, app_state: Any
) -> None:
    """A provider keeps its key off the workers: its own client (no node key) reads the
    balance, withdraws and lists payouts. A withdrawal whose answer is lost (a 502 after the
    server handled it) is retried with the same ``Idempotency-Key``: one payout, paid once."""
    from orchestrator.core.keys import generate_key

    # As the README names them: the SDK's client and errors from the package itself.
    from orchestrator.worker import NodeKeyRequired, WorkerClient
    from tests.test_payouts import give_claimable
    from tests.worker_helpers import BASE_URL, FaultyTransport, app_transport

    provider_key = generate_key()
    async with WorkerClient(BASE_URL, generate_key(), provider_key, transport=app_transport(app)) as machine:
        await machine.register(SPECS, "1")  # registers the provider too
    wire = FaultyTransport(app_transport(app))
    async with WorkerClient(BASE_URL, None, provider_key, transport=wire) as provider:
        provider.backoff_base_s = 0.01
        assert provider.provider_id is not None
        await give_claimable(app_state, provider.provider_id, 100)
        assert (await provider.balance()).rewards_claimable == 100

        wire.fail("/v1/providers/me/withdrawals", "forward+502")
        out = await provider.withdraw(30, "payday-0001")
        assert (out.payout.amount, out.payout.status, out.balances.rewards_claimable) == (30, "requested", 70)
        assert len(wire.to("/v1/providers/me/withdrawals")) == 2  # the retry, answered 200
        again = await provider.withdraw(30, "payday-0001")  # a later run of the same command
        assert again.payout.id == out.payout.id and again.balances.rewards_claimable == 70
        with pytest.raises(OrchestratorAPIError) as reused:
            await provider.withdraw(40, "payday-0001")
        assert (reused.value.status, reused.value.code) == (409, "idempotency_key_reused")
        with pytest.raises(OrchestratorAPIError) as short:
            await provider.withdraw(71, "payday-0002")
        assert (short.value.status, short.value.code) == (409, "insufficient_funds")

        assert [p.id for p in await provider.payouts()] == [out.payout.id]
        assert await provider.payouts(status="paid") == []
        with pytest.raises(NodeKeyRequired):
            await provider.me()


def test_the_readme_names_every_call_of_the_sdk() -> None:
    """The README's Python SDK bullet lists WorkerClient's calls: a call added (or renamed)
    without the README saying so fails here."""
    import inspect
    import re
    from pathlib import Path

    from orchestrator.worker import WorkerClient

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    match = re.search(r"\* \*\*Python SDK\*\*: `[^`]+` with\n(.*?), which answer", readme, re.DOTALL)
    assert match, "README: the Python SDK bullet"
    named = set(re.findall(r"`(\w+)`", match.group(1)))
    calls = {
        name
        for name, member in inspect.getmembers(WorkerClient, inspect.iscoroutinefunction)
        if not name.startswith("_") and name != "aclose"
    }
    assert named == calls
