"""The verifier works in small batches, each committed on its own, and shares its backlog
between processes (SKIP LOCKED) without deciding or paying anything twice."""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
from collections import Counter
from typing import Any

import pytest
import structlog
from prometheus_client import REGISTRY
from sqlalchemy import func, select, text

from orchestrator.core.ticks import tick_runs
from orchestrator.ledger.models import LedgerTransfer
from orchestrator.settings import VerifierSettings
from orchestrator.tasks.models import Submission
from orchestrator.verification import jobs, service
from orchestrator.verification.jobs import VERIFIER, verify_batches, verify_once
from orchestrator.verification.models import Verdict, VerificationJob
from tests.conftest import postgres_only
from tests.tasks_helpers import PoolSetup, Worker, pool_setup, task
from tests.verification_helpers import balances, books_balance, submit
from tests.waits import sqlite_write_lock_held

ECON = {
    "min_stake_per_node": 1000,
    "reward_per_sample": 7,
    "reward_hold_s": 3600,
    "fraud_slash_amount": 10,
    "strikes_before_ejection": 100,
    "strikes_before_provider_ban": 100,
}


pytestmark = pytest.mark.usefixtures("no_audits")


def batches_of(app_state: Any, size: int) -> None:
    app_state.settings.verifier = VerifierSettings(batch_size=size, tick_budget_s=60)


async def results(s: Any, per_worker: int, answers: list[str] | None = None) -> None:
    """``per_worker`` results from every worker, interleaved (job ids alternate between them)."""
    await s.enqueue([task() for _ in range(per_worker * len(s.workers))], key="backlog")
    for i in range(per_worker):
        for w in s.workers:
            lease = (await w.claim(s.pool_id)).json()["leases"][0]
            answer = (answers or ["4"])[i % len(answers or ["4"])]
            await submit(w, lease, [answer], **({"seed": 1} if answer == "fraud" else {}))


async def in_another_partition(s: PoolSetup, first: Worker) -> Worker:
    """A worker of a new provider whose verifier partition is not ``first``'s (1 provider in 16
    shares one): providers are added until one is."""
    while True:
        other = await s.add_worker()
        if service.partition_of(other.contributor.provider_id) != service.partition_of(
            first.contributor.provider_id
        ):
            return other
        s.workers.remove(other)


async def decided(app_state: Any) -> tuple[int, Counter[str]]:
    async with app_state.sessionmaker() as session:
        verdicts = int(await session.scalar(select(func.count()).select_from(Verdict)) or 0)
        stages = Counter((await session.execute(select(VerificationJob.stage))).scalars())
    return verdicts, stages


async def test_verdicts_are_committed_batch_by_batch(app: Any, app_state: Any, monkeypatch: Any) -> None:
    """With batches of 2, the first batch's verdicts are committed even though the second batch
    fails; the failed batch's jobs wait for the next tick, which decides them."""
    batches_of(app_state, 2)
    real_lock = service.lock_for_verdicts
    calls = 0

    async def failing_second_batch(session: Any, submissions: Any) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("the database went away")
        await real_lock(session, submissions)

    monkeypatch.setattr(service, "lock_for_verdicts", failing_second_batch)
    async with pool_setup(app, app_state, workers=1, max_leases_per_node=8) as s:
        await results(s, 5)
        with pytest.raises(RuntimeError, match="went away"):
            await verify_once(app_state)
        assert await decided(app_state) == (2, Counter(done=2, checks=3))

        monkeypatch.setattr(service, "lock_for_verdicts", real_lock)
        report = await verify_once(app_state)
        assert report.processed == 3
        assert await decided(app_state) == (5, Counter(done=5))


async def test_a_failing_housekeeping_does_not_stop_the_verdicts(
    app: Any, app_state: Any, monkeypatch: Any
) -> None:
    """The once-per-tick housekeeping failing (here its quorum-wait expiry, after the tick claim
    and the validator lease expiry), as it would every tick on one bad task, used to end the tick
    before its batches ran: no result was decided any more while the loop looked alive. It is
    logged as a failed tick of the verifier, its transaction rolls back as a whole (the claim
    too, so the loop's last-run age grows), and the waiting result gets its verdict all the same."""
    real_expire = service.expire_quorum_waits

    async def failing(*args: Any, **kwargs: Any) -> int:
        await real_expire(*args, **kwargs)
        raise RuntimeError("one bad task")

    monkeypatch.setattr(service, "expire_quorum_waits", failing)
    async with pool_setup(app, app_state, workers=1) as s:
        await results(s, 1)
        errors = {"loop": VERIFIER, "cause": "error"}
        before = REGISTRY.get_sample_value("orchestrator_loop_tick_failures_total", errors) or 0
        with structlog.testing.capture_logs() as logs:
            report = await verify_once(app_state)
        assert (report.ran, report.processed) == (False, 1)
        assert await decided(app_state) == (1, Counter(done=1))
        failed = [e for e in logs if e["event"] == "background_tick_failed"]
        assert [(e["loop"], e["log_level"], e.get("exc_info"), e["part"]) for e in failed] == [
            ("verifier", "error", True, "housekeeping")
        ]
        assert REGISTRY.get_sample_value("orchestrator_loop_tick_failures_total", errors) == before + 1
        async with app_state.sessionmaker() as session:
            assert await tick_runs(session, VERIFIER) == 0

        # The same tick, not taken by the failed attempt, is claimed by the next one.
        monkeypatch.setattr(service, "expire_quorum_waits", real_expire)
        assert (await verify_once(app_state)).ran


async def test_a_tick_stops_taking_batches_when_its_budget_is_spent(app: Any, app_state: Any) -> None:
    batches_of(app_state, 2)
    async with pool_setup(app, app_state, workers=1, max_leases_per_node=8) as s:
        await results(s, 5)
        assert await verify_batches(app_state, budget_s=0) == 2  # one batch, then out of time
        assert await verify_batches(app_state, budget_s=math.inf) == 3
        assert await decided(app_state) == (5, Counter(done=5))


async def test_a_tick_its_budget_stops_while_results_wait_says_there_is_more(
    app: Any, app_state: Any, clock: Any, monkeypatch: Any
) -> None:
    """The loop starts the next tick at once after one that says ``more`` (``core.loops``): a tick
    that waited for the next second left the verifier idle between ticks while a backlog waited."""
    app_state.settings.verifier = VerifierSettings(batch_size=2, tick_budget_s=1.5)
    real = service.process_pending

    async def taking_a_second(*args: Any, **kwargs: Any) -> Any:
        batch = await real(*args, **kwargs)
        clock.advance(1)  # each batch takes a second
        return batch

    monkeypatch.setattr(service, "process_pending", taking_a_second)
    async with pool_setup(app, app_state, workers=1, max_leases_per_node=8) as s:
        await results(s, 5)
        first = await verify_once(app_state)
        assert (first.processed, first.more) == (4, True)  # two batches, then out of time
        last = await verify_once(app_state)
        assert (last.processed, last.more) == (1, False)  # the backlog is done
        assert await decided(app_state) == (5, Counter(done=5))
        idle = await verify_once(app_state)
        assert (idle.processed, idle.more) == (0, False)


async def test_prescoring_reads_a_batch_in_the_same_few_statements_whatever_its_size(
    app: Any, app_state: Any
) -> None:
    """SQLite scores a batch before its transaction (``service.prescore``): its rows were read two
    statements a result, 40 for a batch of 20, each a round trip to SQLite's thread."""
    from orchestrator.verification.scoring import scorer_for
    from tests.test_hot_paths import sql_log

    scorer = scorer_for(app_state.settings.verifier)
    async with pool_setup(app, app_state, workers=1, max_leases_per_node=8) as s:
        await results(s, 6)
        counts = []
        for size in (2, 6):
            async with sql_log(app_state) as statements:
                scored = await service.prescore(
                    app_state.sessionmaker, scorer, limit=size, after_id=0, now=app_state.clock.utcnow()
                )
            assert len(scored.scored) == size
            counts.append(len(statements))
        assert counts[0] == counts[1], counts


async def test_a_batchs_scoring_inputs_are_read_in_one_statement(app: Any, app_state: Any) -> None:
    """A batch's results are scored before its transaction, their inputs read in a short one of
    their own (``service.prescore``; on PostgreSQL after a try of the partition's lock): five
    statements (the jobs, their submissions, tasks, pools and replicas), of which the batch's
    transaction reads the first four again. They are one now."""
    async with pool_setup(app, app_state, workers=1, max_leases_per_node=8) as s:
        await results(s, 3)
        scored, statements = await _prescored_logged(app_state, s)
        assert (scored.read, len(scored.scored)) == (3, 3)
        assert len([st for st in statements if "advisory" not in st]) == 1, statements


async def _prescored_logged(app_state: Any, s: Any) -> tuple[Any, list[str]]:
    """``service.prescore`` of the first worker's results (in its provider's partition on
    PostgreSQL), and the statements it sent."""
    from orchestrator.verification.scoring import scorer_for
    from tests.test_hot_paths import sql_log

    partition = None
    if app_state.engine.dialect.name == "postgresql":
        partition = service.partition_of(s.workers[0].contributor.provider_id)
    async with sql_log(app_state) as statements:
        scored = await service.prescore(
            app_state.sessionmaker,
            scorer_for(app_state.settings.verifier),
            limit=10,
            after_id=0,
            now=app_state.clock.utcnow(),
            partition=partition,
        )
    return scored, statements


async def test_a_batch_of_unreplicated_math_results_reads_no_quorum_votes(app: Any, app_state: Any) -> None:
    """Once a batch is scored, ``prescore`` reads the other results of the replicated tasks its
    math results belong to and compares their votes (``_classes_before``). A math result the
    server cannot check (no expected answer) of a task of replication 1 has no quorum to
    decide, yet its batch read the siblings in a transaction of its own: a second statement,
    and on SQLite a second take of the one write lock, for every such batch."""
    async with pool_setup(app, app_state, workers=1, max_leases_per_node=8, reward_function="math") as s:
        await s.enqueue([{**task(), "verification": {}} for _ in range(3)], key="open")
        for _ in range(3):
            lease = (await s.workers[0].claim(s.pool_id)).json()["leases"][0]
            await submit(s.workers[0], lease, ["4"])
        scored, statements = await _prescored_logged(app_state, s)
        assert (scored.read, len(scored.scored)) == (3, 3)
        assert all(r is None for one in scored.scored.values() for r in one.per_sample)  # unchecked
        assert len([st for st in statements if "advisory" not in st]) == 1, statements  # was 2


async def test_a_result_that_arrives_while_a_batch_is_scored_waits_for_the_next_sqlite(
    app: Any, app_state: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite: a batch is scored before its transaction, which holds the database's one write
    lock. A result that arrived while the batch was scored (the batch not full) was taken by
    the batch's transaction as well and scored there, the write lock held for as long as its
    reward function ran: every claim, result and heartbeat waited. It is left for the next
    tick's batch, scored before that one's transaction."""
    if app_state.engine.dialect.name != "sqlite":
        pytest.skip("SQLite's one write lock")
    real = service._score_inputs
    under_the_write_lock: list[list[int]] = []
    late: list[Any] = []

    async def scoring(inputs: Any, *args: Any, **kwargs: Any) -> Any:
        if sqlite_write_lock_held(app_state):
            under_the_write_lock.append([i.job_id for i in inputs])
        if late:  # a result comes in while the first batch is scored
            worker, lease = late.pop()
            await submit(worker, lease, ["4"])
        return await real(inputs, *args, **kwargs)

    monkeypatch.setattr(service, "_score_inputs", scoring)
    async with pool_setup(app, app_state, workers=1, max_leases_per_node=8) as s:
        await s.enqueue([task(), task()], key="late")
        worker = s.workers[0]
        first = (await worker.claim(s.pool_id)).json()["leases"][0]
        second = (await worker.claim(s.pool_id)).json()["leases"][0]
        await submit(worker, first, ["4"])
        late.append((worker, second))
        first_tick = await verify_batches(app_state, budget_s=math.inf)
        assert under_the_write_lock == []  # was [[2]]: the late result, scored in the transaction
        assert first_tick == 1
        assert await verify_batches(app_state, budget_s=math.inf) == 1  # the next tick's
    assert await decided(app_state) == (2, Counter(done=2))


def poison(monkeypatch: Any, submission_id: int) -> None:
    """The verdict on this submission fails (as a bad result would), the others are decided."""
    real_decide = service.decide

    async def decide(session: Any, job: Any, submission: Any, *args: Any, **kwargs: Any) -> Any:
        if submission.id == submission_id:
            raise ValueError("a bad result")
        return await real_decide(session, job, submission, *args, **kwargs)

    monkeypatch.setattr(service, "decide", decide)


async def test_a_job_that_fails_does_not_hold_up_its_batch(
    app: Any, app_state: Any, monkeypatch: Any
) -> None:
    batches_of(app_state, 10)
    real_decide = service.decide
    async with pool_setup(app, app_state, workers=1, max_leases_per_node=8) as s:
        await results(s, 3)
        async with app_state.sessionmaker() as session:
            poisoned = (await session.execute(select(VerificationJob.submission_id).limit(1))).scalar_one()

        poison(monkeypatch, poisoned)
        assert await verify_batches(app_state, budget_s=math.inf) == 2
        assert await decided(app_state) == (2, Counter(done=2, checks=1))
        monkeypatch.setattr(service, "decide", real_decide)
        assert await verify_batches(app_state, budget_s=math.inf) == 1


async def test_a_batch_whose_last_job_fails_still_commits_the_others_verdicts(
    app: Any, app_state: Any, client: Any, monkeypatch: Any
) -> None:
    """The last job of the batch fails after its checks changed its row: the savepoint rolls it
    back, and the batch still commits the verdicts (and rewards) of the jobs before it."""
    batches_of(app_state, 10)
    real_decide = service.decide
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000, max_leases_per_node=8) as s:
        await results(s, 3)
        async with app_state.sessionmaker() as session:
            poisoned = (
                (
                    await session.execute(
                        select(VerificationJob.submission_id).order_by(VerificationJob.id.desc())
                    )
                )
                .scalars()
                .first()
            )

        poison(monkeypatch, poisoned)
        assert await verify_batches(app_state, budget_s=math.inf) == 2
        assert await decided(app_state) == (2, Counter(done=2, checks=1))
        assert (await balances(client, s.workers[0]))["rewards_pending"] == 14
        monkeypatch.setattr(service, "decide", real_decide)
        assert await verify_batches(app_state, budget_s=math.inf) == 1
        assert (await balances(client, s.workers[0]))["rewards_pending"] == 21
        await books_balance(app_state)


@postgres_only
async def test_two_verifiers_share_a_backlog_and_decide_and_pay_each_result_once(
    app: Any, app_state: Any, client: Any, monkeypatch: Any
) -> None:
    """Two verifier loops over one backlog of 120 results (correct, wrong and fraudulent, from
    eight providers), each working two partitions at once: every job is decided once, rewards
    and slashes are paid once, and each provider's results are decided in order (each fraud
    forfeits the rewards of the node's two earlier correct results, still on hold)."""
    batches_of(app_state, 4)
    # Two lanes each, so that the first does not hold every partition with work when the second
    # looks (eight providers fill at most eight of the sixteen).
    monkeypatch.setattr(jobs, "VERIFIER_LANES", 2)
    async with pool_setup(app, app_state, workers=8, economics=ECON, stake=1000, max_leases_per_node=16) as s:
        await results(s, 15, answers=["4", "4", "5", "fraud", "4"])
        counts = await asyncio.gather(*(verify_batches(app_state, budget_s=math.inf) for _ in range(2)))
        assert sum(counts) == 120 and min(counts) > 0, counts  # both took part

        async with app_state.sessionmaker() as session:
            rows = (await session.execute(select(Verdict.submission_id, Verdict.category))).all()
            reasons = Counter(
                r
                for (r,) in (await session.execute(select(LedgerTransfer.reason))).all()
                if r != "stake_lock"
            )
            system_debits = set(
                (
                    await session.execute(
                        select(LedgerTransfer.debit_account_id).where(LedgerTransfer.reason == "reward")
                    )
                ).scalars()
            )
        assert len(rows) == 120 and len({sid for sid, _ in rows}) == 120
        categories = Counter(c for _, c in rows)
        assert categories == Counter(valid=72, invalid=24, fraud=24)
        assert reasons == Counter(deposit=8, reward=72, slash_stake=24, slash_pending_rewards=24)
        assert await decided(app_state) == (120, Counter(done=120))
        # Rewards come from the system account of each provider's partition, not from one row.
        assert len(system_debits) > 1
        for w in s.workers:
            b = await balances(client, w)
            assert b["stake_locked"] == 1000 - 3 * 10
    await books_balance(app_state)


@postgres_only
async def test_two_verifiers_never_leave_a_quorum_undecided(app: Any, app_state: Any) -> None:
    """Replicated tasks whose answers the server cannot check wait for a quorum. With batches of
    one job, the two replicas of a task are checked by the two verifiers at the same time; each
    must not leave the decision to the other."""
    batches_of(app_state, 1)
    async with pool_setup(app, app_state, workers=2, replication_factor=2, max_leases_per_node=16) as s:
        tasks = [{"prompt": f"Name colour {i}.", "sampling": {"max_tokens": 8}} for i in range(12)]
        await s.enqueue(tasks, key="quorum")
        for _ in tasks:
            for w in s.workers:
                await submit(w, (await w.claim(s.pool_id)).json()["leases"][0], ["blue"])
        counts = await asyncio.gather(*(verify_batches(app_state, budget_s=math.inf) for _ in range(2)))
        assert sum(counts) == 24, counts
        verdicts, stages = await decided(app_state)
        assert stages == Counter(done=24) and verdicts == 24


@postgres_only
async def test_a_partition_another_verifier_works_is_left_to_it(app: Any, app_state: Any) -> None:
    """Verifiers split the backlog by provider partition: a partition another process is
    working (its advisory lock held) is left to it, without waiting, and the rest is decided."""
    batches_of(app_state, 10)
    async with pool_setup(app, app_state, workers=1, max_leases_per_node=8) as s:
        held = s.workers[0]
        held_partition = service.partition_of(held.contributor.provider_id)
        free = await in_another_partition(s, held)
        s.workers[:] = [held, free]
        await results(s, 3)
        async with app_state.sessionmaker() as session:  # each job records its provider's partition
            rows = await session.execute(
                select(VerificationJob.verifier_partition, Submission.provider_id).join(
                    Submission, Submission.id == VerificationJob.submission_id
                )
            )
            assert {(p, service.partition_of(provider)) for p, provider in rows.all()} == {
                (held_partition, held_partition),
                (service.partition_of(free.contributor.provider_id),) * 2,
            }
        async with app_state.engine.connect() as other:  # another verifier, mid-batch
            lock = text("SELECT pg_advisory_xact_lock(:k, :p)")
            await other.execute(lock, {"k": service.VERIFIER_LOCK, "p": held_partition})
            assert await asyncio.wait_for(verify_batches(app_state, budget_s=math.inf), 10) == 3
            async with app_state.sessionmaker() as session:
                nodes = Counter((await session.execute(select(Verdict.node_id))).scalars())
            assert nodes == Counter({free.node_id: 3})
        # That verifier is gone (its transaction ended): the rest is decided.
        assert await verify_batches(app_state, budget_s=math.inf) == 3
        assert await decided(app_state) == (6, Counter(done=6))


@postgres_only
async def test_a_tick_decides_the_oldest_results_first_whatever_their_partition(
    app: Any, app_state: Any
) -> None:
    """Each tick tried the partitions with work in a random order, so every partition got the
    same share of the batches whatever its backlog: the partition of two busy providers fell
    ever further behind (results waiting many minutes, OrchestratorVerifierFallingBehind
    firing) while the verifier spent most batches on partitions holding one or two new results.
    A tick now takes the partition whose oldest result has waited longest first."""
    batches_of(app_state, 5)
    async with pool_setup(app, app_state, workers=1, max_leases_per_node=16) as s:
        busy = s.workers[0]
        taken = {service.partition_of(busy.contributor.provider_id)}
        while len(s.workers) < 6:  # five more providers, each in a partition of its own
            w = await s.add_worker()
            if service.partition_of(w.contributor.provider_id) in taken:
                s.workers.remove(w)
            taken.add(service.partition_of(w.contributor.provider_id))
        await s.enqueue([task() for _ in range(15)], key="backlog")
        order = []  # submission ids, oldest first: ten of the busy provider's, then one each
        for w in [busy] * 10 + s.workers[1:]:
            lease = (await w.claim(s.pool_id)).json()["leases"][0]
            order.append((await submit(w, lease, ["4"]))["submission_id"])
        random.seed(7)  # the old random order, made repeatable
        for done in (5, 10):
            assert await verify_batches(app_state, budget_s=0) == 5  # one batch, then out of time
            async with app_state.sessionmaker() as session:
                decided_ids = set((await session.execute(select(Verdict.submission_id))).scalars())
            assert decided_ids == set(order[:done])
        assert await verify_batches(app_state, budget_s=math.inf) == 5
        assert await decided(app_state) == (15, Counter(done=15))


@postgres_only
async def test_a_partition_whose_oldest_result_keeps_failing_does_not_hold_up_the_others(
    app: Any, app_state: Any, monkeypatch: Any
) -> None:
    """Oldest first, a result that fails its checks at every try (it is tried again each tick)
    would put its partition first in every tick for ever: with one batch a tick (a verifier
    at its limit) no other partition would be worked. A partition in which a batch left a
    result undecided goes last for a minute."""
    batches_of(app_state, 5)
    async with pool_setup(app, app_state, workers=1, max_leases_per_node=16) as s:
        busy = s.workers[0]
        other = await in_another_partition(s, busy)
        await s.enqueue([task() for _ in range(5)], key="backlog")
        ids = []
        for w in [busy, busy, busy, other, other]:
            lease = (await w.claim(s.pool_id)).json()["leases"][0]
            ids.append((await submit(w, lease, ["4"]))["submission_id"])
        poison(monkeypatch, ids[0])  # the oldest result fails every time
        assert await verify_batches(app_state, budget_s=0) == 2  # the busy partition, oldest
        assert await verify_batches(app_state, budget_s=0) == 2  # then the other one
        async with app_state.sessionmaker() as session:
            decided_ids = set((await session.execute(select(Verdict.submission_id))).scalars())
        assert decided_ids == set(ids[1:])


@postgres_only
async def test_a_tick_decides_other_providers_results_while_one_partitions_batch_waits(
    app: Any, app_state: Any
) -> None:
    """A tick works several partitions at once (``VERIFIER_LANES``), as several verifier
    processes do. One batch at a time, the results of every provider waited behind the oldest
    partition's batch; inside ``orchestrator serve``, where that batch's every statement waits
    its turn behind the requests on the event loop, a backlog of results grew ten times faster
    than the verdicts. Here the oldest provider's batch waits for a lock (its membership, held
    by another transaction): the other provider's results are decided meanwhile, and the
    waiting batch goes on once the lock is released."""
    batches_of(app_state, 10)
    async with pool_setup(app, app_state, workers=1, max_leases_per_node=8) as s:
        held = s.workers[0]
        free = await in_another_partition(s, held)
        s.workers[:] = [held, free]
        await s.enqueue([task() for _ in range(6)], key="backlog")
        for w in [held] * 3 + [free] * 3:  # the held provider's results are the oldest
            await submit(w, (await w.claim(s.pool_id)).json()["leases"][0], ["4"])

        async def verdicts_of() -> Counter[str]:
            async with app_state.sessionmaker() as session:
                return Counter((await session.execute(select(Verdict.node_id))).scalars())

        async with app_state.engine.connect() as other:  # a transaction holding the membership
            await other.execute(
                text("SELECT 1 FROM pool_memberships WHERE node_id = :n FOR UPDATE"), {"n": held.node_id}
            )
            tick = asyncio.create_task(verify_batches(app_state, budget_s=math.inf))
            try:
                for _ in range(100):  # up to 10 s
                    if await verdicts_of() == Counter({free.node_id: 3}):
                        break
                    await asyncio.sleep(0.1)
                assert await verdicts_of() == Counter({free.node_id: 3})
                assert not tick.done()  # the held provider's batch still waits
            finally:
                await other.rollback()
                if not tick.done():
                    await asyncio.wait({tick}, timeout=10)
        assert tick.done() and tick.result() == 6
        assert await verdicts_of() == Counter({held.node_id: 3, free.node_id: 3})
        assert await decided(app_state) == (6, Counter(done=6))


@postgres_only
async def test_when_two_lanes_of_a_tick_fail_both_failures_are_reported(
    app: Any, app_state: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two partitions' batches fail in one tick: the first failure is raised (the loop logs it
    as the tick's), the other is logged as ``verifier_lane_failed``; before, it was dropped
    without a trace. Nothing was decided."""
    async with pool_setup(app, app_state, workers=1) as s:
        first = s.workers[0]
        second = await in_another_partition(s, first)
        await s.enqueue([task() for _ in range(2)], key="two")
        for w in (first, second):
            await submit(w, (await w.claim(s.pool_id)).json()["leases"][0], ["4"])

        async def failing(session: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"partition {kwargs['partition']} failed")

        monkeypatch.setattr(service, "process_pending", failing)
        with (
            structlog.testing.capture_logs() as logs,
            pytest.raises(RuntimeError, match="partition") as raised,
        ):
            await verify_batches(app_state, budget_s=math.inf)
        reported = [e for e in logs if e["event"] == "verifier_lane_failed"]
        assert len(reported) == 1 and reported[0]["error"] == "RuntimeError"
        assert str(reported[0]["exc_info"]) != str(raised.value)  # the other partition's
        assert await decided(app_state) == (0, Counter(checks=2))


async def three_partitions_with_work(s: PoolSetup, per_worker: int = 2) -> None:
    """``per_worker`` results from each of three providers, each in a partition of its own."""
    first = s.workers[0]
    second = await in_another_partition(s, first)
    while True:
        third = await in_another_partition(s, first)
        if service.partition_of(third.contributor.provider_id) != service.partition_of(
            second.contributor.provider_id
        ):
            break
        s.workers.remove(third)
    s.workers[:] = [first, second, third]
    await results(s, per_worker)


async def partition_locked(app_state: Any, job_id: int) -> bool:
    """Whether a transaction holds the verifier lock of the job's partition (a connection with
    no transaction open may hold it: its lane's, working the partition)."""
    async with app_state.engine.connect() as conn:
        held = await conn.scalar(
            text(
                "SELECT count(*) FROM pg_locks JOIN pg_stat_activity a USING (pid)"
                " WHERE locktype = 'advisory' AND granted AND a.xact_start IS NOT NULL"
                " AND classid = :key AND objsubid = 2"
                " AND objid = (SELECT verifier_partition FROM verification_jobs WHERE id = :job)"
                " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            ),
            {"key": service.VERIFIER_LOCK, "job": job_id},
        )
    return bool(held)


@postgres_only
async def test_lanes_wait_for_the_scorer_without_a_transaction(
    app: Any, app_state: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lane's batch is scored, and waits for the scorer, before its transaction begins, one
    lane's batch at a time with one scoring process. Before, every lane took its partition's
    lock and its batch and then queued for the scorer: three transactions open while one batch
    was scored, and a tick's budget overrun by every queued batch's scoring."""
    batches_of(app_state, 10)
    scoring, peak, locked = 0, 0, []
    real = service._score_inputs

    async def counted(inputs: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal scoring, peak
        scoring += 1
        peak = max(peak, scoring)
        try:
            locked.append(await partition_locked(app_state, inputs[0].job_id))
            for _ in range(25):  # the other lanes have their chance to queue beside it (at once, before)
                if scoring > 1:
                    break
                await asyncio.sleep(0.04)
            return await real(inputs, *args, **kwargs)
        finally:
            scoring -= 1

    monkeypatch.setattr(service, "_score_inputs", counted)
    async with pool_setup(app, app_state, workers=1, max_leases_per_node=8) as s:
        await three_partitions_with_work(s)
        assert await verify_batches(app_state, budget_s=math.inf) == 6
    assert locked == [False] * 3  # no transaction held a batch's partition while it was scored
    assert peak == 1  # batches being scored (or queued for it) at once: the scorer's one process
    assert await decided(app_state) == (6, Counter(done=6))
    await books_balance(app_state)


@postgres_only
async def test_small_batches_are_scored_side_by_side_up_to_the_scoring_processes(
    app: Any, app_state: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Turns at the scorer were counted in full batches (``reward_processes // batch_size``, at
    least one): with two scoring processes and batches of up to 10, three lanes' batches of one
    result each were scored one at a time while a process idled. They are counted in results:
    two of those batches are scored at once, never three."""
    app_state.settings.verifier = VerifierSettings(batch_size=10, tick_budget_s=60, reward_processes=2)
    scoring, peak = 0, 0
    real = service._score_inputs

    async def counted(inputs: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal scoring, peak
        scoring += 1
        peak = max(peak, scoring)
        try:
            for _ in range(25):  # the other lanes have their chance to be scored beside it
                if scoring > 2:
                    break
                await asyncio.sleep(0.04)
            return await real(inputs, *args, **kwargs)
        finally:
            scoring -= 1

    monkeypatch.setattr(service, "_score_inputs", counted)
    async with pool_setup(app, app_state, workers=1, max_leases_per_node=8) as s:
        await three_partitions_with_work(s, per_worker=1)
        assert await verify_batches(app_state, budget_s=math.inf) == 3
    assert peak == 2  # batches scored at once: one result each, two scoring processes
    assert await decided(app_state) == (3, Counter(done=3))


@postgres_only
async def test_a_tick_whose_budget_runs_out_while_a_batch_is_scored_takes_no_other(
    app: Any, app_state: Any, clock: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The budget runs out while the tick's first batch is scored: the lanes still waiting for
    the scorer take no batch (the next tick, started at once, does). Before, they had each
    taken theirs and queued for the scorer, and the tick ran on until every one was scored."""
    app_state.settings.verifier = VerifierSettings(batch_size=10, tick_budget_s=1)
    real = service._score_inputs
    calls = 0

    async def slow_first(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            for _ in range(10):  # the other lanes have their chance to start
                await asyncio.sleep(0.02)
            clock.advance(5)  # scoring the first batch took past the budget
        return await real(*args, **kwargs)

    monkeypatch.setattr(service, "_score_inputs", slow_first)
    async with pool_setup(app, app_state, workers=1, max_leases_per_node=8) as s:
        await three_partitions_with_work(s)
        first = await verify_once(app_state)
        assert (first.processed, first.more) == (2, True)  # one partition's batch, then out of time
        assert await decided(app_state) == (2, Counter(checks=4, done=2))
        second = await verify_once(app_state)
        assert (second.processed, second.more) == (4, False)
    assert await decided(app_state) == (6, Counter(done=6))
    await books_balance(app_state)


@postgres_only
async def test_two_verifiers_do_not_both_score_a_partitions_batch(
    app: Any, app_state: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second verifier that reaches a partition while the first is scoring its batch leaves
    the partition to it: a batch is scored once, not by every process working the backlog
    (two `orchestrator background` processes would otherwise each run every reward function,
    the same partitions in the same order, oldest first)."""
    batches_of(app_state, 10)
    real = service._score_inputs
    scored: Counter[int] = Counter()
    first_scoring, second_done = asyncio.Event(), asyncio.Event()

    async def first_waits_for_the_second(inputs: Any, *args: Any, **kwargs: Any) -> Any:
        first = not scored
        scored.update(i.job_id for i in inputs)
        if first:  # the first verifier is scoring its batch when the second comes
            first_scoring.set()
            await asyncio.wait_for(second_done.wait(), 10)
        return await real(inputs, *args, **kwargs)

    async def second() -> int:
        await asyncio.wait_for(first_scoring.wait(), 10)
        try:
            return await verify_batches(app_state, budget_s=math.inf)
        finally:
            second_done.set()

    monkeypatch.setattr(service, "_score_inputs", first_waits_for_the_second)
    async with pool_setup(app, app_state, workers=1, max_leases_per_node=8) as s:
        await results(s, 4)
        counts = await asyncio.gather(verify_batches(app_state, budget_s=math.inf), second())
    assert sorted(counts) == [0, 4]
    assert set(scored.values()) == {1}, scored  # each result through the reward function once
    assert await decided(app_state) == (4, Counter(done=4))


def queued_for_the_scorer(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Counts the lanes that have reached the scorer (entered ``ScorerTurns.turn``, waiting for
    their turn or holding it) under ``"turns"``."""
    real_turn = jobs.ScorerTurns.turn
    counts: Counter[str] = Counter()

    @contextlib.asynccontextmanager
    async def counted(self: Any, *args: Any) -> Any:
        counts["turns"] += 1
        async with real_turn(self, *args) as go_on:
            yield go_on

    monkeypatch.setattr(jobs.ScorerTurns, "turn", counted)
    return counts


@postgres_only
async def test_a_partition_whose_lane_waits_for_the_scorer_is_worked_by_another_verifier(
    app: Any, app_state: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With one scoring process, a tick's first lane scores its batch while its second waits
    for its turn. The waiting lane held its partition's lock (at session level, on an idle
    connection of its own), so a second verifier process passed that partition over though
    nothing was being done with it. The second verifier now decides that partition's results
    meanwhile, and the waiting lane, once its turn comes, scores none of them again."""
    batches_of(app_state, 10)
    real = service._score_inputs
    scored: Counter[int] = Counter()
    first_scoring, second_done = asyncio.Event(), asyncio.Event()
    queued = queued_for_the_scorer(monkeypatch)

    async def first_waits_for_the_second(inputs: Any, *args: Any, **kwargs: Any) -> Any:
        first = not scored
        scored.update(i.job_id for i in inputs)
        if first:  # the first verifier's first lane is scoring its batch
            first_scoring.set()
            await asyncio.wait_for(second_done.wait(), 10)
        return await real(inputs, *args, **kwargs)

    async def second() -> int:
        await asyncio.wait_for(first_scoring.wait(), 10)
        for _ in range(1000):  # the first verifier's other lane has read its batch: it waits
            if queued["turns"] >= 2:
                break
            await asyncio.sleep(0.01)
        try:
            return await verify_batches(app_state, budget_s=math.inf)
        finally:
            second_done.set()

    monkeypatch.setattr(service, "_score_inputs", first_waits_for_the_second)
    async with pool_setup(app, app_state, workers=1, max_leases_per_node=8) as s:
        first = s.workers[0]
        s.workers[:] = [first, await in_another_partition(s, first)]
        await results(s, 2)
        counts = await asyncio.gather(verify_batches(app_state, budget_s=math.inf), second())
    assert counts == [2, 2]  # the second verifier decided the waiting lane's partition
    assert sorted(scored.values()) == [1] * 4, scored  # each result through the reward function once
    assert await decided(app_state) == (4, Counter(done=4))
    await books_balance(app_state)


async def verifier_locks(app_state: Any) -> int:
    """How many verifier partition locks are held, by any connection."""
    async with app_state.engine.connect() as conn:
        return int(
            await conn.scalar(
                text(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
                    " AND classid = :key AND objsubid = 2"
                    " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
                ),
                {"key": service.VERIFIER_LOCK},
            )
            or 0
        )


@postgres_only
async def test_a_tick_cancelled_while_its_lanes_wait_for_the_scorer_leaves_no_partition_held(
    app: Any, app_state: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stopping process cancels its tick while one lane's batch is scored (holding its
    partition) and the others wait for their turn (holding none): every partition is free again
    (no lock left on a pooled connection, which would keep every other verifier off the
    partition), and the next tick decides everything."""
    batches_of(app_state, 10)
    real = service._score_inputs
    scoring = asyncio.Event()
    stuck = True

    async def hangs(*args: Any, **kwargs: Any) -> Any:
        if stuck:
            scoring.set()
            await asyncio.Event().wait()
        return await real(*args, **kwargs)

    monkeypatch.setattr(service, "_score_inputs", hangs)
    queued = queued_for_the_scorer(monkeypatch)
    async with pool_setup(app, app_state, workers=1, max_leases_per_node=8) as s:
        await three_partitions_with_work(s)
        tick = asyncio.create_task(verify_batches(app_state, budget_s=math.inf))
        await asyncio.wait_for(scoring.wait(), 10)

        for _ in range(1000):  # the other lanes have read their batches: they wait for their turn
            if queued["turns"] == 3:
                break
            await asyncio.sleep(0.01)
        assert await verifier_locks(app_state) == 1  # the scored batch's partition
        tick.cancel()
        with pytest.raises(asyncio.CancelledError):
            await tick
        assert await verifier_locks(app_state) == 0
        stuck = False
        assert await verify_batches(app_state, budget_s=math.inf) == 6
    assert await decided(app_state) == (6, Counter(done=6))


def test_verifier_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from orchestrator.settings import Settings

    assert (Settings().verifier.batch_size, Settings().verifier.tick_budget_s) == (20, 0.8)
    monkeypatch.setenv("ORCH_VERIFIER__BATCH_SIZE", "50")
    monkeypatch.setenv("ORCH_VERIFIER__TICK_BUDGET_S", "2.5")
    assert (Settings().verifier.batch_size, Settings().verifier.tick_budget_s) == (50, 2.5)
