"""Background loops of verification: run the checks, release held rewards, expire validator leases.

The verifier runs in every process that runs background loops: each tick takes waiting results
in small batches, each committed on its own (on PostgreSQL several partitions' batches at once:
``VERIFIER_LANES``), for up to a time budget (a tick that runs out of
it while still deciding results is followed by the next at once, on SQLite after a short pause
for the requests waiting for the write lock: ``core.loops.pause_after_more``). Only the tick's
housekeeping is once per tick across processes (``core.ticks.claim_tick``): the process that
claims the tick also withdraws the validator jobs past their wait, in a transaction of its own
right after."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass

import structlog
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession, async_sessionmaker

from orchestrator.core.clock import Clock
from orchestrator.core.loops import tick_failed
from orchestrator.core.state import AppState
from orchestrator.core.ticks import Keyset, claim_tick, tick_in_batches
from orchestrator.ledger import succession
from orchestrator.verification import service, validators
from orchestrator.verification.models import VerificationJob
from orchestrator.verification.scoring import Scorer, scorer_for

log = structlog.get_logger(__name__)

VERIFIER = "verifier"
REWARD_RELEASE = "reward_release"
VERIFY_INTERVAL_S = 1.0
# How long a partition where a batch left a result undecided is worked after the others.
FAILING_PARTITION_LAST_S = 60.0
#: Partitions a tick works at once (PostgreSQL), each batch on a connection of its own. Inside
#: ``orchestrator serve`` every statement of a batch waits its turn on the event loop behind the
#: steps of the requests in flight: with one batch at a time, eight workers' claims and results
#: got some ten steps for each of the verifier's, and the verdicts fell ten times behind the
#: results (benchmarks/RESULTS.md, "The verifier inside orchestrator serve"). At most a third
#: of the process's database connections (``ORCH_DB__POOL_SIZE`` + ``ORCH_DB__MAX_OVERFLOW``).
VERIFIER_LANES = 8
RELEASE_INTERVAL_S = 30.0
#: Holds released per transaction. A tick goes on with further batches while they release
#: something, for up to its interval: one batch of 1,000 per tick released at most 33 rewards
#: a second, fewer than one verifier decides, so claimable rewards fell ever further behind
#: their hold; and one long transaction kept every verifier batch that pays those providers
#: waiting on their accounts (10 s and more).
RELEASE_BATCH = 200
#: Validator jobs past their wait withdrawn (and their results decided) per tick, oldest first:
#: a backlog left by a long validator outage is worked off over a few ticks, each transaction
#: holding the verdicts' accounts for one short batch only.
VALIDATOR_WAIT_BATCH = 100


@dataclass(frozen=True)
class VerifyReport:
    tick: int
    ran: bool  # this process claimed the tick and did its housekeeping (committed)
    processed: int = 0
    validator_leases_expired: int = 0
    quorum_waits_expired: int = 0
    validator_waits_expired: int = 0
    # The tick's budget ran out while it was still deciding results: the loop starts the next
    # tick at once (SQLite: after ``core.loops.SQLITE_MORE_PAUSE_S``) instead of at the next
    # second (``core.loops.run_periodically``).
    more: bool = False


class ScorerTurns:
    """Which of a tick's lanes may have a batch scored at once (PostgreSQL), counted in results:
    as many results at once as there are scoring processes (``reward_processes``), a batch
    taking as many as it has results (all of them, if it has more: it is scored alone). A lane
    reads its batch's inputs in a short transaction of its own, then waits for its turn holding
    no transaction, row, lock or connection (``service.prescore``), takes its partition's lock
    once the turn has come (``_Claim``), and gives the turn back once the batch is scored; only
    then does the batch's transaction begin. Turns are given in the order asked for (a batch
    that does not fit yet is not passed by smaller ones behind it).

    Before, every lane took its partition's lock and its batch and then queued for the one
    scoring process: 8 transactions open at once, and a tick ran past its budget by up to 8
    batches' scoring. Turns were then counted in full batches (``reward_processes //
    batch_size``, at least one), so batches smaller than ``batch_size`` (a partition with a few
    results waiting, as most are when the verifier keeps up) were scored one at a time while
    the other processes idled. A turn that comes after ``deadline`` says to stop (except the
    tick's first, which always goes on): the lane takes no batch, the next tick goes on from
    there."""

    def __init__(self, capacity: int, clock: Clock, deadline: float) -> None:
        self.capacity = max(1, capacity)
        self._free = self.capacity
        self._waiting: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()
        self._clock = clock
        self._deadline = deadline
        self._given = 0

    @contextlib.asynccontextmanager
    async def turn(self, results: int) -> AsyncIterator[bool]:
        """A turn for a batch of ``results`` results (at least one's room, at most all)."""
        n = min(self.capacity, max(1, results))
        if self._waiting or self._free < n:
            asked = (n, asyncio.get_running_loop().create_future())
            self._waiting.append(asked)
            try:
                await asked[1]
            except BaseException:
                if asked[1].done() and not asked[1].cancelled():  # given as it was cancelled
                    self._give_back(n)
                else:
                    with contextlib.suppress(ValueError):
                        self._waiting.remove(asked)
                    self._give_back(0)  # those behind it may fit now
                raise
        else:
            self._free -= n
        try:
            go_on = not self._given or self._clock.monotonic() < self._deadline
            self._given += 1
            yield go_on
        finally:
            self._give_back(n)

    def _give_back(self, n: int) -> None:
        self._free += n
        while self._waiting:
            wanted, given = self._waiting[0]
            if given.done():  # cancelled while it waited
                self._waiting.popleft()
                continue
            if wanted > self._free:
                return
            self._waiting.popleft()
            self._free -= wanted
            given.set_result(None)


async def verify_once(state: AppState) -> VerifyReport:
    """One tick: the once-per-tick housekeeping (expired validator leases back to open, replicas
    nobody took within ``verifier.quorum_wait_s`` withdrawn; then validator jobs nobody holds
    that waited past ``verifier.validator_wait_s`` withdrawn) if this process claims the tick;
    then, in every process, waiting results in small batches.

    A failed housekeeping does not keep the batches from running: one that fails every tick
    (one bad task) would otherwise stop every verdict while the loop looks alive. It is logged
    as any failed tick (``core.loops``), and its transaction, tick claim included, rolls back,
    so ``orchestrator_loop_last_run_age_seconds{loop="verifier"}`` grows and the next tick
    tries it again. The validator waits are a transaction of their own, after the claim's has
    committed (two rounds of ``lock_for_verdicts`` in one transaction, the quorum's and theirs,
    could deadlock with a verdict that takes the same locks in one round): a failed one is
    logged, rolled back and tried again by the next tick, and shows as results waiting past
    the wait in ``orchestrator_validation_oldest_waiting_seconds``."""
    tick = int(state.clock.now() // VERIFY_INTERVAL_S)
    try:
        ran, expired, waits = await _housekeeping(state, tick)
    except Exception as exc:
        tick_failed(VERIFIER, exc, part="housekeeping")
        ran, expired, waits = False, 0, 0
    validator_waits = 0
    if ran:
        try:
            validator_waits = await _validator_waits(state)
        except Exception as exc:
            tick_failed(VERIFIER, exc, part="validator_waits")
    processed, cut_short = await _verify_batches(state, budget_s=state.settings.verifier.tick_budget_s)
    return VerifyReport(
        tick=tick,
        ran=ran,
        processed=processed,
        more=cut_short and processed > 0,
        validator_leases_expired=expired,
        quorum_waits_expired=waits,
        validator_waits_expired=validator_waits,
    )


async def _housekeeping(state: AppState, tick: int) -> tuple[bool, int, int]:
    now = state.clock.utcnow()
    async with state.sessionmaker() as session, session.begin():
        if not await claim_tick(
            session, VERIFIER, tick, state.instance_id, interval_s=VERIFY_INTERVAL_S, clock=state.clock
        ):
            return False, 0, 0
        expired = await validators.expire_leases(session, now=now)
        secret = state.settings.seed_key
        waits = await service.expire_quorum_waits(
            session,
            now=now,
            wait_s=state.settings.verifier.quorum_wait_s,
            secret=secret,
            scorer=scorer_for(state.settings.verifier),
        )
        return True, expired, waits


async def _validator_waits(state: AppState) -> int:
    async with state.sessionmaker() as session, session.begin():
        return await validators.expire_waits(
            session,
            now=state.clock.utcnow(),
            wait_s=state.settings.verifier.validator_wait_s,
            limit=VALIDATOR_WAIT_BATCH,
        )


async def verify_batches(state: AppState, *, budget_s: float) -> int:
    """Verify waiting results, ``settings.verifier.batch_size`` per transaction, each batch
    committed before the next is taken, until none is left or ``budget_s`` has passed on
    ``state.clock.monotonic()``. Needs no tick claim. On PostgreSQL the backlog is worked
    partition by partition (by provider, see ``service.PARTITIONS``), the one whose oldest result
    has waited longest first, up to ``VERIFIER_LANES`` partitions at once in each process and one
    batch per partition at a time across processes, so processes share the backlog, each
    provider's results are decided in order and no partition falls behind the others. A call
    the budget stops is taken up by the next where it stopped (per
    partition, in this process), so results that cannot be decided yet do not hold up those
    behind them. A job that failed is not retried within the call (the next batch starts after
    it). Returns how many jobs were processed."""
    return (await _verify_batches(state, budget_s=budget_s))[0]


async def _verify_batches(state: AppState, *, budget_s: float) -> tuple[int, bool]:
    """``verify_batches``, and whether it stopped at its budget (not for want of results)."""
    size = state.settings.verifier.batch_size
    scorer = scorer_for(state.settings.verifier)
    retry_s = state.settings.verifier.reward_retry_s
    deadline = state.clock.monotonic() + budget_s
    partitions: list[int | None] = [None]  # SQLite: one writer, one backlog
    if state.engine.dialect.name == "postgresql":
        async with state.sessionmaker() as session:
            # Oldest first; verifiers working at once each take the next partition whose
            # advisory lock is free (a held one is passed over at once). A partition where a
            # batch of this process left a result undecided lately goes last: a result that
            # fails at every try stays its partition's oldest, which would otherwise come first
            # in every tick and, with one batch a tick, keep the others waiting for ever.
            oldest_first = await service.partitions_with_work(session)
        now = state.clock.monotonic()
        failing = {p for p, at in state.verifier_failed_at.items() if now - at < FAILING_PARTITION_LAST_S}
        partitions = [
            *(p for p in oldest_first if p not in failing),
            *(p for p in oldest_first if p in failing),
        ]
    # Partitions are worked by up to VERIFIER_LANES batches at once, each lane taking the next
    # partition in that order; a partition is begun only before the deadline (the first always).
    todo = iter(partitions)
    # The lanes' results scored and not yet committed, by job id: a lane's quorum counts the
    # votes of a task's other replicas, which other lanes (their providers' partitions) check.
    scored: dict[int, service.Scored] = {}
    # The quorums' vote classes the lanes compared before their transactions, by their votes:
    # the lane whose transaction decides a quorum (the last to commit) need not be the one that
    # compared its votes, and the classes depend on nothing else (``service.vote_key``).
    classes: dict[service.VoteKey, service.VoteClasses] = {}
    begun = 0
    cut = False
    turns = None
    if partitions != [None]:  # SQLite scores its one lane's batch before the transaction
        turns = ScorerTurns(scorer.processes, state.clock, deadline)

    async def lane() -> int:
        nonlocal begun, cut
        done = 0
        for partition in todo:
            if begun and state.clock.monotonic() >= deadline:
                cut = True
                return done
            begun += 1
            n, stopped = await _verify_partition(
                state,
                partition,
                scorer=scorer,
                size=size,
                retry_s=retry_s,
                deadline=deadline,
                turns=turns,
                scored=scored,
                classes=classes,
            )
            done += n
            cut = cut or stopped
        return done

    # At most a third of the process's connections, so that its requests still get theirs.
    db = state.settings.db
    lanes = 1 if partitions == [None] else min(VERIFIER_LANES, len(partitions))
    lanes = max(1, min(lanes, (db.pool_size + db.max_overflow) // 3))
    # Every lane ends (at the deadline at the latest) before a failure is raised: none goes on
    # beside the next tick.
    # The first failure is raised (logged as the tick's); any other lane's is logged here, or
    # it would be lost.
    outcomes = await asyncio.gather(*(lane() for _ in range(lanes)), return_exceptions=True)
    failures = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
    for failure in failures[1:]:
        log.error("verifier_lane_failed", error=type(failure).__name__, exc_info=failure)
    if failures:
        raise failures[0]
    return sum(n for n in outcomes if isinstance(n, int)), cut


async def _verify_partition(
    state: AppState,
    partition: int | None,
    *,
    scorer: Scorer,
    size: int,
    retry_s: float,
    deadline: float,
    turns: ScorerTurns | None = None,
    scored: dict[int, service.Scored] | None = None,
    classes: dict[service.VoteKey, service.VoteClasses] | None = None,
) -> tuple[int, bool]:
    """One partition's batches (``None``: SQLite's one backlog) until it is done or the
    deadline passes; returns how many jobs were processed and whether the deadline stopped it.
    Each batch takes its turn at the scorer from ``turns`` (PostgreSQL's lanes).

    PostgreSQL: a partition another verifier is working (its lock held) is left to it at once.
    A batch holds the partition's lock from when its turn at the scorer comes until its
    transaction has committed, at session level on a connection of its own (``_Claim``), its
    transaction on that connection: while the batch is scored there is no transaction open,
    but another process finds the partition taken. While a lane waits for its turn it holds
    nothing: another process may work the partition meanwhile, and the lane then scores only
    the jobs read that are still waiting (``service.prescore``). A batch's scores are in
    ``scored`` (the tick's lanes') from when it is scored until its transaction has ended, so
    that another lane's batch holding a replica of the same task compares the quorum's votes
    before its transaction too; the vote classes a batch compared are in ``classes`` (the tick's
    lanes'), which every batch's transaction looks its quorums' votes up in. With the lock taken only by
    each transaction, every process working the backlog found the partition free while a batch
    was scored (the partitions in the same order, oldest first) and scored the same batch
    again; with the lock held by a lane for as long as it worked the partition, a lane waiting
    for its turn kept every other process off a partition nobody was working."""
    secret = state.settings.seed_key
    total = 0
    # Where this process's last call stopped for its budget: results it cannot decide yet
    # (a reward function that is down, a job that fails) stay the oldest, and a call that
    # started at the oldest at every tick spent its budget on them, again and again, and
    # never reached the results behind them. From there to the newest, then from the oldest
    # up to there: every waiting result is tried once a pass, however long the pass.
    start = state.verifier_resume.pop(partition, 0)
    after, wrapped = start, start == 0
    while True:
        async with _Claim(state, partition) as claim:
            # Scored with no transaction open: SQLite's would hold the one write lock,
            # PostgreSQL's its partition's lock and job rows, while waiting for the scorer.
            prescored = await service.prescore(
                state.sessionmaker,
                scorer,
                limit=size,
                after_id=after,
                now=state.clock.utcnow(),
                reward_retry_s=retry_s,
                reward_backoff=state.reward_backoff,
                partition=partition,
                turn=None if turns is None else turns.turn,
                claim=None if partition is None else claim.take,
                others=scored,
            )
            if prescored.late:  # the budget ran out while it waited for the scorer: on from here
                state.verifier_resume[partition] = after
                return total, True
            if prescored.held:  # another verifier is working this partition
                break
            if not prescored.read:
                if wrapped:
                    break
                after, wrapped = 0, True
                continue
            batch = service.Batch(0, 0, prescored.last_id)  # all decided by another verifier
            if prescored.attempted:
                if scored is not None:
                    scored.update(prescored.scored)
                if classes is not None:
                    classes.update(prescored.classes)
                    prescored = dataclasses.replace(prescored, classes=classes)
                try:
                    async with claim.sessionmaker() as session, session.begin():
                        batch = await service.process_pending(
                            session,
                            secret=secret,
                            rng=state.rng,
                            now=state.clock.utcnow(),
                            scorer=scorer,
                            limit=size,
                            after_id=after,
                            partition=partition,
                            prescored=prescored,
                            reward_retry_s=retry_s,
                            reward_backoff=state.reward_backoff,
                        )
                finally:
                    if scored is not None:
                        for job_id in prescored.scored:
                            scored.pop(job_id, None)
        total += batch.processed
        after = batch.last_id
        if partition is not None and batch.processed < batch.picked:
            state.verifier_failed_at[partition] = state.clock.monotonic()
        # At the newest: this partition is done, or another verifier is working it.
        end = prescored.read < size
        done = wrapped and (end or 0 < start <= after)  # the pass is back where it started
        if not done and state.clock.monotonic() >= deadline:
            state.verifier_resume[partition] = 0 if end else after
            return total, True
        if done:
            break
        if end:
            after, wrapped = 0, True
    return total, False


class _Claim:
    """A batch's hold on its partition (PostgreSQL), taken once its turn at the scorer has come
    (``take``) and given back when the batch is done: the partition's verifier lock at session
    level on a connection of the batch's, and sessions on that connection (``sessionmaker``;
    their transactions' own try of the lock then succeeds). No transaction stays open in
    between. A batch that fails or is cancelled closes the connection instead (its session, and
    the lock with it, ends), so a lock is never left in the pool. SQLite (no partition): the
    process's sessions, nothing taken."""

    def __init__(self, state: AppState, partition: int | None) -> None:
        self._state = state
        self._key = (service.VERIFIER_LOCK, partition)
        self._conn: AsyncConnection | None = None
        self.sessionmaker = state.sessionmaker

    async def take(self, job_ids: frozenset[int]) -> frozenset[int] | None:
        """The partition's lock, and which of ``job_ids`` still wait for their checks (read
        after the lock is taken: a batch another verifier decided has committed by then);
        ``None`` if another verifier holds the lock."""
        conn = self._conn = await self._state.engine.connect()
        if not await conn.scalar(select(func.pg_try_advisory_lock(*self._key))):
            await conn.commit()
            await self._close()
            return None
        waiting = select(VerificationJob.id).where(
            VerificationJob.id.in_(job_ids), VerificationJob.stage == "checks"
        )
        still = frozenset((await conn.execute(waiting)).scalars())
        await conn.commit()
        self.sessionmaker = async_sessionmaker(**{**self._state.sessionmaker.kw, "bind": conn})
        return still

    async def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.close()

    async def __aenter__(self) -> _Claim:
        return self

    async def __aexit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if self._conn is None:
            return
        if exc is not None:  # cut short anywhere (the lock given back or not): the session ends
            await self._conn.invalidate()
            await self._close()
            return
        try:
            await self._conn.scalar(select(func.pg_advisory_unlock(*self._key)))
            await self._conn.commit()
        except BaseException:
            await self._conn.invalidate()
            raise
        finally:
            await self._close()


async def drain(state: AppState, *, max_rounds: int = 100) -> int:
    """Verify until nothing waits (tests, the demo): passes over the backlog without a time
    budget, again while a pass got something done (a failed job is retried by the next)."""
    total = 0
    for _ in range(max_rounds):
        n = await verify_batches(state, budget_s=math.inf)
        total += n
        if n == 0:
            break
    return total


async def release_once(state: AppState) -> int:
    """One tick of the reward release: due holds in transactions of ``RELEASE_BATCH``, the
    first with the tick's claim, each reading on from where the last one stopped (a hold that
    cannot be released is logged and tried again by the next tick), until a batch comes back
    short or the tick's interval has passed; then, in a transaction of its own, what retired
    providers were credited since by paths that do not forward it themselves (an appeal's
    restoration, say) goes on to their heirs (``ledger.succession.sweep``). Returns how many
    rewards were released."""
    tick = int(state.clock.now() // RELEASE_INTERVAL_S)
    keyset = Keyset()

    async def batch(session: AsyncSession) -> int:
        return await service.release_due_rewards(
            session, now=state.clock.utcnow(), limit=RELEASE_BATCH, keyset=keyset
        )

    batches = await tick_in_batches(
        state.sessionmaker,
        REWARD_RELEASE,
        tick,
        state.instance_id,
        batch,
        more=lambda _: keyset.read >= RELEASE_BATCH,
        budget_s=RELEASE_INTERVAL_S,
        clock=state.clock,
    )
    released = sum(batches or ())
    if released:
        log.info("rewards_released", count=released)
    if batches is not None:  # once per tick: what retired providers were credited otherwise
        try:
            async with state.sessionmaker() as session, session.begin():
                await succession.sweep(session)
        except Exception as exc:
            tick_failed(REWARD_RELEASE, exc, part="succession_sweep")
    return released
