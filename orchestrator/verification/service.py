"""The verification pipeline and the money its verdicts move.

Every submission gets a durable ``VerificationJob``. The verifier loop (in every process, in
small batches each committed on its own, jobs taken with SKIP LOCKED) runs the cheap checks and
the server's own reward function, then either decides at once or waits for more evidence:

* a fraud finding (seed mismatch, forged reward claim, failed canary, out-of-bounds claim)
  -> rejected as fraud: slash the pool's amount from the membership's locked stake, forfeit the
  node's rewards still in the hold window, add a strike; eject the node after the pool's strike
  limit and blacklist the provider after the provider limit (an appeal that brings the strikes
  below a limit again lifts that sanction). A canary with no right sample fails at once when
  it decodes greedily; sampled at a temperature, only as the pool's ``canary_miss_limit``-th
  miss of the node's last ``canary_window`` canaries, and otherwise it is a wrong answer
  (``canary_finding``);
* an invalid finding (wrong sample count, token overflow, bad finish reason, missing proof,
  wrong answer) -> rejected as invalid: no reward, no stake slashed, counted in the trust
  record; the pool's ``soft_invalid_penalty`` is forfeited from the node's rewards still in the
  hold window, oldest first, up to what is there;
* a replicated task, or an audit drawn for this node -> quorum: when every replica has
  reported, a strict majority of canonical answers decides (equivalent answers are one vote
  where the reward function compares them, ``vote_classes``); where the server cannot check
  answers itself the minority is fraud when the task decodes greedily (replicas must agree) and
  invalid when it samples at a temperature (an honest replica may answer otherwise), and an
  undecided vote adds a replica (BOINC semantics, up to a cap) before the task is called
  inconclusive;
* a pool that routes audits to trusted validators -> a ``ValidationJob`` (see validators.py);
  one that no validator decides within ``verifier.validator_wait_s`` is withdrawn and the
  result decided on its checks, as a skipped audit (``validators.expire_waits``);
* otherwise accepted: ``reward_per_sample`` x correct samples into ``rewards_pending``, released
  to ``rewards_claimable`` after the pool's hold window.

The audit probability falls as the node's run of verified valid results grows (1 / (1 + run);
a result accepted unchecked, which the server cannot check and did not audit, does not count)
but never below the pool's ``audit_rate_floor``; the draw uses the server's random source, which workers
cannot see.

Every transfer's idempotency key is derived from the submission and the kind of entry, and
each verdict row is unique per submission, so a verdict delivered twice moves money once.
Each forfeit of a reward on hold is recorded (``RewardForfeit``: which verdict, which hold,
how much), so that an appeal (``reverse_verdict``) gives back exactly what its verdict took.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import json
import random
import zlib
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import structlog
from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Insert,
    Select,
    SmallInteger,
    String,
    bindparam,
    cast,
    exists,
    false,
    func,
    insert,
    literal,
    literal_column,
    or_,
    select,
    update,
)
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession, async_sessionmaker
from sqlalchemy.orm import aliased
from sqlalchemy.orm.attributes import set_committed_value

from orchestrator.admin.tokens import Principal
from orchestrator.core import metrics
from orchestrator.core.db import UTCDateTime
from orchestrator.core.sql import insert_ignore, is_postgres
from orchestrator.core.ticks import Keyset
from orchestrator.identity.models import Node
from orchestrator.ledger import service as ledger
from orchestrator.ledger import succession
from orchestrator.ledger.heirs import heirs
from orchestrator.ledger.models import LedgerTransfer
from orchestrator.ledger.service import ProviderAccount, SystemAccount, provider_account, system_account
from orchestrator.pools.models import Pool, PoolMembership
from orchestrator.tasks.models import Assignment, Submission, Task, TaskReplica
from orchestrator.tasks.seeds import derive_seed
from orchestrator.verification import checks, rewards
from orchestrator.verification.models import (
    WRONG_ANSWER,
    NodeTrust,
    RewardForfeit,
    RewardHold,
    RolloutChange,
    ValidationJob,
    Verdict,
    VerificationJob,
    has_window,
)
from orchestrator.verification.rewards import RewardUnavailable
from orchestrator.verification.scoring import RewardFunctionFailed, Scorer, Unscorable

log = structlog.get_logger(__name__)
_T = TypeVar("_T")

ENDED = ("cancelled", "failed")  # task statuses that are never leased again
MAX_EXTRA_REPLICAS = 2  # an undecided quorum may add this many replicas before it is inconclusive
# On PostgreSQL the verifier's backlog is split by provider into PARTITIONS, each worked by one
# batch at a time (a transaction-scoped advisory lock on (VERIFIER_LOCK, partition)): a
# provider's results are still decided in the order they came in, while batches of different
# partitions, whose providers and system accounts differ, run side by side.
PARTITIONS = 16
VERIFIER_LOCK = 0x5646  # the advisory lock's first key ("VF")
SYSTEM_SHARD = "orchestrator.system_shard"  # session.info key: the batch's system accounts


def _system_account(session: AsyncSession, kind: SystemAccount) -> ledger.AccountRef:
    """The system account of ``kind`` that this transaction's verdicts use (its partition's)."""
    return system_account(kind, session.info.get(SYSTEM_SHARD, 0))


def partition_of(provider_id: str) -> int:
    """A provider's verifier partition (CRC-32: the same in every process and release)."""
    return zlib.crc32(provider_id.encode()) % PARTITIONS


@dataclass(frozen=True)
class Decision:
    outcome: str  # accepted | rejected
    category: str  # valid | invalid | fraud | inconclusive
    reason: str
    verifier: str
    details: dict[str, Any]
    paid_samples: int = 0


# ------------------------------------------------------------------ entry points


_INSERT_JOB = insert(VerificationJob.__table__)  # type: ignore[arg-type]


def job_for(submission_id: ColumnElement[int]) -> Insert:
    """The job of a submission whose id another part of the statement makes (the result path's
    one-statement write on PostgreSQL); binds ``b_task``, ``b_pool``, ``b_partition`` (the
    provider's, ``partition_of``) and ``b_now``."""
    now = bindparam("b_now", type_=UTCDateTime())
    columns = ["submission_id", "task_id", "pool_id", "stage", "audited", "verifier_partition"]
    return _INSERT_JOB.from_select(
        [*columns, "created_at", "updated_at"],
        select(
            submission_id,
            bindparam("b_task", type_=BigInteger()),
            bindparam("b_pool", type_=String()),
            literal_column("'checks'"),
            false(),
            bindparam("b_partition", type_=SmallInteger()),
            now,
            now,
        ),
    )


_ENQUEUE = job_for(bindparam("b_submission", type_=BigInteger()))


async def enqueue(
    conn: AsyncConnection,
    *,
    submission_id: int,
    task_id: int,
    pool_id: str,
    provider_id: str,
    now: dt.datetime,
) -> None:
    """Called in the result's transaction: the job exists if and only if the result does.
    One Core INSERT on the result's connection (the result path is hot and uses no ORM)."""
    params = {"b_submission": submission_id, "b_task": task_id, "b_pool": pool_id, "b_now": now}
    await conn.execute(_ENQUEUE, params | {"b_partition": partition_of(provider_id)})


@dataclass(frozen=True)
class Batch:
    picked: int  # jobs taken
    processed: int  # of them, checked without an error
    last_id: int  # the highest job id taken: the next batch starts after it


@dataclass(frozen=True)
class Scored:
    """What the server's reward function made of one result, computed before any lock."""

    result: dict[str, Any]
    per_sample: list[float | None]
    canonical: list[str]
    # Set when the reward function could not score the result within its limits.
    unscorable: checks.Finding | None = None


async def process_pending(
    session: AsyncSession,
    *,
    secret: bytes,
    rng: random.Random,
    now: dt.datetime,
    scorer: Scorer,
    limit: int = 20,
    after_id: int = 0,
    partition: int | None = None,
    prescored: Prescored | None = None,
    reward_retry_s: float = 0.0,
    reward_backoff: dict[int, tuple[dt.datetime, float]] | None = None,
) -> Batch:
    """Run the cheap checks of up to ``limit`` waiting jobs with ids above ``after_id``, in the
    caller's transaction (one small batch: its verdicts are visible when it commits).

    With ``partition`` (PostgreSQL) the batch first takes that partition's advisory lock
    without waiting (another verifier working it: an empty batch) and then its oldest jobs, and
    moves money through the partition's system accounts. Without (SQLite, one writer) the jobs
    are the oldest of all. The reward functions run before any other lock is taken; then the
    batch's locks are taken up front (``lock_for_verdicts``, and its replicated tasks, so that
    two verifiers never both leave a quorum for the other to decide). A result whose reward
    function is unavailable (``RewardUnavailable``) is left for a later batch until
    ``reward_retry_s`` after it arrived, tried again as ``reward_backoff`` (the process's, see
    ``Retry``) allows.

    With ``prescored`` (the verifier's batches) the batch is the prescored jobs still waiting,
    nothing is scored in the transaction, and the batch's ``last_id`` is the last job
    ``prescore`` read. A result that came in after ``prescore`` read the batch is left for the
    next: scored here, on SQLite, it held the one write lock for as long as its reward
    function ran. A quorum the batch decides takes its vote classes from ``prescore``'s
    (``Prescored.classes``) when its votes are those it compared."""
    stmt = _waiting(after_id, limit)
    last = after_id
    if prescored is not None:
        # Only the jobs scored before this transaction (those decided meanwhile, by another
        # process, drop out here): one that came in since waits for the next batch, scored
        # before that one's transaction, not in this one (SQLite's holds the one write lock).
        stmt = stmt.where(VerificationJob.id.in_(prescored.attempted))
        last = max(prescored.last_id, after_id)
    if partition is not None:
        lock = func.pg_try_advisory_xact_lock(VERIFIER_LOCK, partition)
        if not await session.scalar(select(lock)):
            return Batch(0, 0, after_id)
        stmt = stmt.where(VerificationJob.verifier_partition == partition).with_for_update()
        session.info[SYSTEM_SHARD] = partition
    elif is_postgres(session):  # the whole backlog at once: share it without waiting
        stmt = stmt.with_for_update(skip_locked=True)
    jobs = list((await session.execute(stmt)).scalars())
    if not jobs:
        return Batch(0, 0, last)
    # The session's identity map holds its rows weakly: ``loaded`` keeps the batch's rows in it
    # until the batch ends, so that the per-job ``session.get`` calls find them there.
    submissions, loaded = await _load(session, jobs)
    retry = Retry(now, reward_retry_s, {} if reward_backoff is None else reward_backoff)
    scored = prescored.scored if prescored is not None else await _score_all(session, jobs, scorer, retry)
    await lock_for_verdicts(session, submissions)
    loaded += await _lock_replicated_tasks(session, {j.task_id for j in jobs})
    # A rolled-back savepoint expires the rows it changed (a failed job, and the siblings its
    # quorum touched): their ids are read now, not from those rows after the loop.
    ids = [(job, job.id, job.submission_id) for job in jobs]
    known = prescored.classes if prescored is not None else {}
    done = 0
    for job, job_id, submission_id in ids:
        if job_id in scored and await _checks_in_savepoint(
            session, job, job_id, submission_id, scored[job_id], secret, rng, now, scorer, known
        ):
            done += 1
    return Batch(len(ids), done, max(ids[-1][1], last))


async def _checks_in_savepoint(
    session: AsyncSession,
    job: VerificationJob,
    job_id: int,
    submission_id: int,
    scored: Scored,
    secret: bytes,
    rng: random.Random,
    now: dt.datetime,
    scorer: Scorer,
    known: Mapping[VoteKey, VoteClasses],
) -> bool:
    """One result that cannot be processed must not hold up the others: each job in its own
    savepoint; a failure is logged and the job is tried again on a later tick."""
    try:
        async with session.begin_nested():
            await _run_checks(
                session, job, scored, secret=secret, rng=rng, now=now, scorer=scorer, known=known
            )
    except Exception:
        log.exception("verification_failed", job_id=job_id, submission_id=submission_id)
        return False
    return True


async def _load(session: AsyncSession, jobs: list[VerificationJob]) -> tuple[list[Submission], list[Any]]:
    """The batch's submissions, tasks, replicas and pools in four reads (into the session).
    Returns the submissions and every row read, for the caller to hold."""
    submissions = await _submissions(session, jobs)
    loaded: list[Any] = list(submissions)
    for model, ids in (
        (Task, {j.task_id for j in jobs}),
        (Pool, {j.pool_id for j in jobs}),
        (TaskReplica, {s.replica_id for s in submissions}),
    ):
        loaded += (await session.execute(select(model).where(model.id.in_(ids)))).scalars()
    return submissions, loaded


@dataclass(frozen=True)
class ScoreInput:
    """What scoring one job's result needs, read from the database."""

    job_id: int
    submission_id: int
    result: dict[str, Any]
    reward_function: str
    spec: dict[str, Any]
    received_at: dt.datetime
    # The task's replicas, as read: only a replicated task's results may complete a quorum
    # (``_classes_before``).
    replication: int = 1


@dataclass(frozen=True)
class Retry:
    """How long a result whose reward function raised ``RewardUnavailable`` is tried again:
    until ``reward_retry_s`` after it arrived, counted at ``now``; and when: ``backoff`` (the
    process's, by job id: when it may be scored again, and the wait that led there) spaces the
    tries of each result out, 1 s after the first, then twice as long each time up to
    ``RETRY_BACKOFF_MAX_S``, so that a service that is down is not called for every waiting
    result at every pass of the verifier."""

    now: dt.datetime
    reward_retry_s: float
    backoff: dict[int, tuple[dt.datetime, float]]

    def wanted(self, given: ScoreInput) -> bool:
        return (self.now - given.received_at).total_seconds() < self.reward_retry_s

    def due(self, given: ScoreInput) -> bool:
        """Whether the result may be scored now (not waiting out its backoff)."""
        waiting = self.backoff.get(given.job_id)
        return waiting is None or waiting[0] <= self.now

    def unavailable(self, given: ScoreInput) -> None:
        """Its reward function was unavailable again: its next try waits twice as long."""
        if len(self.backoff) >= RETRY_BACKOFF_KEYS:  # jobs decided by other processes meanwhile
            stale = self.now - dt.timedelta(seconds=2 * RETRY_BACKOFF_MAX_S)
            for job_id in [j for j, (at, _) in self.backoff.items() if at < stale]:
                del self.backoff[job_id]
        previous = self.backoff.get(given.job_id, (self.now, 0.0))[1]
        wait = min(RETRY_BACKOFF_MAX_S, max(1.0, 2 * previous))
        self.backoff[given.job_id] = (self.now + dt.timedelta(seconds=wait), wait)

    def scored(self, given: ScoreInput) -> None:
        self.backoff.pop(given.job_id, None)


#: The longest wait between two tries of a result whose reward function is unavailable.
RETRY_BACKOFF_MAX_S = 60.0
#: Results a process keeps a backoff for before it forgets those long past theirs.
RETRY_BACKOFF_KEYS = 10_000


async def score_input(session: AsyncSession, job: VerificationJob) -> ScoreInput:
    submission = await session.get(Submission, job.submission_id)
    task = await session.get(Task, job.task_id)
    pool = await session.get(Pool, job.pool_id)
    assert submission is not None
    assert task is not None
    assert pool is not None
    return ScoreInput(
        job.id,
        submission.id,
        json.loads(submission.body),
        pool.reward_function,
        task.verification or {},
        submission.received_at,
        task.replication,
    )


async def score_result(given: ScoreInput, scorer: Scorer, retry: Retry | None = None) -> Scored:
    """A result through its pool's reward function, in a scoring process (no database): a result
    it cannot score within the limits has no rewards and an ``inconclusive`` finding. One whose
    reward function is unavailable raises ``RewardUnavailable`` while ``retry`` wants it tried
    again; past that it is inconclusive too."""
    samples = given.result.get("samples", [])
    completions = [s.get("completion") for s in samples]
    n = len(completions)
    if not all(isinstance(text, str) for text in completions):
        # A sample sent as token ids alone is not graded as "" (the server has no tokenizer): no
        # reward is computed, and the checks find the result invalid (completion_missing).
        return Scored(given.result, [None] * n, [""] * n)
    try:
        per_sample, canonical = await scorer.score(given.reward_function, completions, given.spec)
    except Unscorable as exc:
        unscorable = checks.Finding("reward_unscorable", "inconclusive", str(exc))
        return Scored(given.result, [None] * n, [""] * n, unscorable)
    except RewardUnavailable as exc:
        if retry is not None and retry.wanted(given):
            raise
        # Down for longer than the operator allowed: the worker is not at fault either.
        log.error("reward_function_unavailable", job_id=given.job_id, detail=str(exc))
        finding = checks.Finding("reward_unavailable", "inconclusive", str(exc))
        return Scored(given.result, [None] * n, [""] * n, finding)
    except RewardFunctionFailed as exc:
        invalid: str | None = str(exc)
    else:
        invalid = _invalid_output(given.reward_function, per_sample, canonical)
    if invalid is not None:
        # The operator's reward function is at fault, not the worker: no reward, no penalty.
        log.error("reward_function_invalid", job_id=given.job_id, detail=invalid)
        finding = checks.Finding("reward_invalid", "inconclusive", invalid)
        return Scored(given.result, [None] * n, [""] * n, finding)
    return Scored(given.result, per_sample, canonical)


def _invalid_output(name: str, per_sample: Sequence[object], canonical: Sequence[object]) -> str | None:
    """What is wrong with a reward function's output, if anything: each reward must be a
    number in [0, 1] (NaN is not) or None, and each canonical answer a string. A plugin's
    NaN or -1 would otherwise count its sample correct and pay it, and a string fail the job
    at every tick."""
    for i, reward in enumerate(per_sample):
        if reward is None:
            continue
        if not isinstance(reward, int | float) or not 0 <= reward <= 1:
            return (
                f"reward function {name!r} returned {reward!r:.40} for sample {i}; "
                "a reward is a number in [0, 1] or null"
            )
    for i, answer in enumerate(canonical):
        if not isinstance(answer, str):
            return (
                f"reward function {name!r} returned {answer!r:.40} as sample {i}'s canonical "
                "answer; it must be a string"
            )
    return None


async def score(session: AsyncSession, job: VerificationJob, scorer: Scorer) -> Scored:
    """One job's result through its pool's reward function (``score_result``)."""
    return await score_result(await score_input(session, job), scorer)


async def _inputs(session: AsyncSession, jobs: list[VerificationJob]) -> list[ScoreInput]:
    """The jobs' scoring inputs; a job whose rows cannot be read is logged and left for later."""
    inputs: list[ScoreInput] = []
    for job in jobs:
        try:
            inputs.append(await score_input(session, job))
        except Exception:
            log.exception("verification_failed", job_id=job.id, submission_id=job.submission_id)
    return inputs


async def _score_inputs(inputs: list[ScoreInput], scorer: Scorer, retry: Retry) -> dict[int, Scored]:
    """Every result through its pool's reward function at once: the scoring processes
    (``reward_processes``) take them in parallel, each within its own time limit (counted from
    when a process takes it). A job whose scoring failed otherwise (its reward function is not
    installed in this process, or is unavailable within ``retry``) is logged and left for a
    later tick; one whose reward function raised is judged inconclusive (``score_result``)."""
    inputs = [i for i in inputs if retry.due(i)]  # the others wait out their backoff
    outcomes = await asyncio.gather(*(score_result(i, scorer, retry) for i in inputs), return_exceptions=True)
    scored: dict[int, Scored] = {}
    for given, outcome in zip(inputs, outcomes, strict=True):
        if isinstance(outcome, RewardUnavailable):
            retry.unavailable(given)
            log.warning(
                "reward_function_unavailable",
                job_id=given.job_id,
                submission_id=given.submission_id,
                detail=str(outcome),
                retrying=True,
            )
        elif isinstance(outcome, Exception):
            log.error(
                "verification_failed",
                job_id=given.job_id,
                submission_id=given.submission_id,
                exc_info=outcome,
            )
        elif isinstance(outcome, BaseException):
            raise outcome
        else:
            retry.scored(given)
            scored[given.job_id] = outcome
    return scored


async def _score_all(
    session: AsyncSession, jobs: list[VerificationJob], scorer: Scorer, retry: Retry
) -> dict[int, Scored]:
    return await _score_inputs(await _inputs(session, jobs), scorer, retry)


@dataclass(frozen=True)
class Prescored:
    """A batch's results scored before its transaction (``prescore``): the jobs tried, and the
    scores of those whose reward function did not fail."""

    attempted: frozenset[int]
    scored: dict[int, Scored]
    # PostgreSQL: another verifier holds the partition (nothing read, or nothing scored).
    held: bool = False
    # The jobs were read, but their turn at the scorer came after the tick's budget ran out
    # (``turn``): nothing was scored and nothing is attempted.
    late: bool = False
    # How many jobs were read, and the highest id among them (``after_id`` if none): jobs read
    # but not attempted were decided by another verifier before this one took the partition.
    read: int = 0
    last_id: int = 0
    # The vote classes of the quorums the batch is expected to decide, compared before its
    # transaction (``_classes_before``), by their votes (``vote_key``).
    classes: Mapping[VoteKey, VoteClasses] = field(default_factory=dict)


#: PostgreSQL: a lane's claim on its partition once its turn at the scorer has come
#: (``jobs._Claim.take``): given the ids read, those still waiting for their checks, the
#: partition's lock taken; ``None`` if another verifier holds it.
Claim = Callable[[frozenset[int]], Awaitable[frozenset[int] | None]]


async def prescore(
    sessionmaker: async_sessionmaker[AsyncSession],
    scorer: Scorer,
    *,
    limit: int,
    after_id: int,
    now: dt.datetime,
    reward_retry_s: float = 0.0,
    reward_backoff: dict[int, tuple[dt.datetime, float]] | None = None,
    partition: int | None = None,
    turn: Callable[[int], AbstractAsyncContextManager[bool]] | None = None,
    claim: Claim | None = None,
    others: Mapping[int, Scored] | None = None,
) -> Prescored:
    """Score the next batch's results with no transaction open. SQLite: every SQLite transaction
    holds the database's one write lock (``BEGIN IMMEDIATE``), so a batch that scored inside its
    own would hold up every claim, result and heartbeat for as long as its reward functions ran
    (up to ``reward_timeout_s`` per result). The inputs are read in a short transaction first,
    in one statement (``_waiting_inputs``), not two a result.

    PostgreSQL (``partition``): the partition's next batch, read in a short transaction that
    tries the partition's lock (``held`` if another verifier has it: that one is working the
    partition). The lane then waits for its turn at the scorer (``turn``, ``jobs.ScorerTurns``,
    given the number of results: entered once the inputs are read, left once they are scored)
    holding no transaction, row, lock or connection, so that another verifier may work the
    partition meanwhile. Once the turn has come, ``claim`` takes the partition's lock (at
    session level, ``jobs._Claim``) and says which of the jobs read are still waiting: only
    those are scored, so that a batch another verifier scored and decided while this one
    waited is not scored again (``held``, nothing scored, if that verifier still holds the
    partition). The batch's transaction
    (``process_pending``) then decides only the jobs still waiting. A score's inputs (the
    result, the task's ``verification``, the pool's reward function) never change once the job
    exists. A turn that says not to go on (the tick's budget ran out meanwhile) scores nothing
    (``late``).

    Once scored, the votes of the quorums the batch is to decide are compared as well, still
    with no transaction open (``_classes_before``), so that the batch's transaction does not
    hold its locks while SymPy compares answers. ``others``: the results other batches of this
    process scored and have not yet committed (PostgreSQL's lanes), by job id, whose votes
    those quorums will count too."""
    async with sessionmaker() as session, session.begin():
        if partition is not None:
            lock = func.pg_try_advisory_xact_lock(VERIFIER_LOCK, partition)
            if not await session.scalar(select(lock)):
                return Prescored(frozenset(), {}, held=True, last_id=after_id)
        jobs, inputs = await _waiting_inputs(session, after_id, limit, partition)
    if not jobs:
        return Prescored(frozenset(), {}, last_id=after_id)
    read, last = len(jobs), jobs[-1]
    retry = Retry(now, reward_retry_s, {} if reward_backoff is None else reward_backoff)
    async with nullcontext(True) if turn is None else turn(len(inputs)) as go_on:
        if not go_on:
            return Prescored(frozenset(), {}, late=True, read=read, last_id=last)
        waiting = frozenset(jobs)
        if claim is not None:
            still = await claim(waiting)
            if still is None:
                return Prescored(frozenset(), {}, held=True, read=read, last_id=last)
            waiting = still
            inputs = [i for i in inputs if i.job_id in waiting]
        scored = await _score_inputs(inputs, scorer, retry)
        classes = await _classes_before(sessionmaker, scorer, inputs, scored, others or {})
    return Prescored(waiting, scored, read=read, last_id=last, classes=classes)


async def _classes_before(
    sessionmaker: async_sessionmaker[AsyncSession],
    scorer: Scorer,
    inputs: Sequence[ScoreInput],
    scored: Mapping[int, Scored],
    others: Mapping[int, Scored],
) -> dict[VoteKey, VoteClasses]:
    """The vote classes of the quorums ``scored``'s results are to complete, compared before
    the batch's transaction: for each result whose pool's reward function compares answers
    (``math``), which the server could not check and which its reward function scored, of a
    replicated task whose every replica has then reported and whose other results are all
    checked, the votes ``try_quorum`` will count once the batch's results are checked (the
    task's results that count, as read now, and the batch's, each its canonical answers). The
    transaction uses them only for these very votes (``vote_key``): one whose votes turn out
    otherwise (a result of the batch rejected by its checks, a sibling checked or decided
    meanwhile by another batch)
    compares them itself. A sibling still waiting for its checks counts as the batch's do when
    another batch of this process has scored it (``others``, taken before the siblings are
    read: one gone from it since has committed); any other leaves the quorum to its own batch.
    The siblings are read in a short transaction of their own; a failure here is logged and
    leaves the comparisons to the transaction."""
    reward_function = {i.job_id: i.reward_function for i in inputs}
    replicated = {i.job_id for i in inputs if i.replication > 1}
    compares: dict[str, bool] = {}

    def compares_answers(name: str) -> bool:
        if name not in compares:
            try:
                compares[name] = rewards.compares_answers(rewards.get(name))
            except KeyError:  # not installed in this process
                compares[name] = False
        return compares[name]

    voting = [
        job_id
        for job_id, s in scored.items()
        if job_id in replicated  # a task of one replica has no quorum: nothing to read
        and s.unscorable is None
        and not _checkable(s.per_sample)
        and compares_answers(reward_function[job_id])
    ]
    if not voting:
        return {}
    others = dict(others)  # before the read: a batch that leaves it has committed by then
    try:
        sibling = aliased(VerificationJob)
        of_tasks = select(sibling.task_id).where(sibling.id.in_(voting))
        async with sessionmaker() as session, session.begin():
            rows = (
                await session.execute(
                    select(
                        VerificationJob.id,
                        VerificationJob.task_id,
                        VerificationJob.stage,
                        VerificationJob.findings,
                        VerificationJob.canonical,
                        Task.replication,
                    )
                    .join(Task, Task.id == VerificationJob.task_id)
                    .where(VerificationJob.task_id.in_(of_tasks), Task.replication > 1)
                    .order_by(VerificationJob.id)
                )
            ).all()
    except Exception:
        log.exception("vote_comparison_failed", detail="the quorums' votes could not be read")
        return {}
    tasks: dict[int, list[Any]] = {}
    for row in rows:
        tasks.setdefault(row.task_id, []).append(row)
    wanted: dict[VoteKey, tuple[str, list[VerificationJob], Counter[str | None]]] = {}
    for siblings in tasks.values():
        if len(siblings) < siblings[0].replication:
            continue  # replicas still out: no quorum yet
        name = next((reward_function[r.id] for r in siblings if r.id in reward_function), None)
        valid: list[VerificationJob] = []
        for row in siblings:
            by = scored.get(row.id) or (others.get(row.id) if row.stage == "checks" else None)
            if by is not None:  # scored, to be checked: counts once checked, unless unscorable
                if by.unscorable is None:
                    valid.append(VerificationJob(canonical=json.dumps(by.canonical)))
                continue
            if row.stage == "checks":
                break  # a result no batch has scored yet: its own batch decides the quorum
            job = VerificationJob(stage=row.stage, findings=row.findings, canonical=row.canonical)
            if job.stage == "quorum" or _accepted_valid(job):
                valid.append(job)
        else:
            votes = Counter(vote_of(j.canonical) for j in valid)
            if name is not None and len(votes) > 1:
                wanted.setdefault(vote_key(name, votes), (name, valid, votes))
    keys = list(wanted)
    outcomes = await asyncio.gather(
        *(vote_classes(*wanted[k], scorer, locked=False) for k in keys), return_exceptions=True
    )
    classes: dict[VoteKey, VoteClasses] = {}
    for key, outcome in zip(keys, outcomes, strict=True):
        if isinstance(outcome, VoteClasses):
            classes[key] = outcome
        elif isinstance(outcome, Exception):  # left to the transaction
            log.error("vote_comparison_failed", reward_function=key[0], exc_info=outcome)
        else:
            raise outcome
    return classes


async def _waiting_inputs(
    session: AsyncSession, after_id: int, limit: int, partition: int | None
) -> tuple[list[int], list[ScoreInput]]:
    """The ids of the oldest jobs waiting for their checks after ``after_id`` (in
    ``partition``, if given), and their scoring inputs, in one statement. A job whose rows
    cannot be read or whose result cannot be parsed is logged and left for later (it has no
    input). Read before the batch's own transaction (``prescore``), these were five statements
    (the jobs, then ``_load``'s submissions, tasks, pools and replicas), the batch's
    transaction reading all but the scoring inputs again."""
    stmt = (
        select(
            VerificationJob.id,
            VerificationJob.submission_id,
            Submission.body,
            Submission.received_at,
            Pool.reward_function,
            Task.verification,
            Task.replication,
        )
        .select_from(VerificationJob)
        .outerjoin(Submission, Submission.id == VerificationJob.submission_id)
        .outerjoin(Task, Task.id == VerificationJob.task_id)
        .outerjoin(Pool, Pool.id == VerificationJob.pool_id)
        .where(VerificationJob.stage == "checks", VerificationJob.id > after_id)
        .order_by(VerificationJob.id)
        .limit(limit)
    )
    if partition is not None:
        stmt = stmt.where(VerificationJob.verifier_partition == partition)
    ids: list[int] = []
    inputs: list[ScoreInput] = []
    for job_id, submission_id, body, received_at, reward_function, spec, replication in await session.execute(
        stmt
    ):
        ids.append(job_id)
        try:
            if body is None or received_at is None or reward_function is None:
                raise LookupError("the job's result, task or pool is gone")
            inputs.append(
                ScoreInput(
                    job_id,
                    submission_id,
                    json.loads(body),
                    reward_function,
                    spec or {},
                    received_at,
                    replication or 1,
                )
            )
        except Exception:
            log.exception("verification_failed", job_id=job_id, submission_id=submission_id)
    return ids, inputs


def _waiting(after_id: int, limit: int) -> Select[VerificationJob]:
    """The oldest jobs waiting for their checks, after ``after_id``."""
    return (
        select(VerificationJob)
        .where(VerificationJob.stage == "checks", VerificationJob.id > after_id)
        .order_by(VerificationJob.id)
        .limit(limit)
    )


async def partitions_with_work(session: AsyncSession) -> list[int]:
    """The partitions that have results waiting for their checks, the one whose oldest result
    has waited longest first: one probe of the partition index each, whatever the backlog
    (PostgreSQL). Taken in this order, the verifier works the backlog oldest first, so a
    partition with more results coming in (more or busier providers) is not left behind while
    batches go to partitions holding a result or two."""
    part = func.generate_series(0, PARTITIONS - 1).column_valued("part")
    oldest = (
        select(func.min(VerificationJob.id))
        .where(VerificationJob.stage == "checks", VerificationJob.verifier_partition == part)
        .scalar_subquery()
    )
    query = select(part).where(oldest.isnot(None)).order_by(oldest)
    return [int(p) for p in (await session.execute(query)).scalars()]


async def _lock_replicated_tasks(session: AsyncSession, task_ids: set[int]) -> list[Task]:
    """Lock (and re-read) the batch's tasks that have several replicas, after the accounts.

    Two verifiers each checking one replica of a task must not each see the other's result
    still waiting for its checks and both leave the quorum undecided: with the task locked the
    second waits for the first to commit and decides on the task and results it committed.
    (The system accounts in ``lock_for_verdicts`` serialise verifier batches as well; this
    does not depend on it, and refreshes the task rows read before the lock.)

    Their live leases are locked first, in id order, as every ending of a task locks them
    (``tasks.service.lock_live_leases``): a fraud verdict's ejection gives back the node's
    leases, and a result of that node in flight on one of these tasks holds its lease while it
    waits for the task. Locking the task first deadlocked with it."""
    from orchestrator.tasks.service import lock_live_leases

    if is_postgres(session):  # SQLite's single writer has no lock order
        replicated = select(Task.id).where(Task.id.in_(task_ids), Task.replication > 1).order_by(Task.id)
        await lock_live_leases(session, list((await session.execute(replicated)).scalars()))
    stmt = (
        select(Task)
        .where(Task.id.in_(task_ids), Task.replication > 1)
        .order_by(Task.id)
        .with_for_update()
        .execution_options(populate_existing=True)
    )
    return list((await session.execute(stmt)).scalars())


async def _submissions(session: AsyncSession, jobs: list[VerificationJob]) -> list[Submission]:
    if not jobs:
        return []
    stmt = select(Submission).where(Submission.id.in_([j.submission_id for j in jobs]))
    return list((await session.execute(stmt)).scalars())


async def lock_for_verdicts(session: AsyncSession, submissions: list[Submission]) -> None:
    """Take up front, in the global lock order, what verdicts on ``submissions`` may lock: their
    pools (shared), the memberships of the providers concerned in those pools (by provider,
    then id, as pools lock them), then every ledger account the verdicts may move money
    between (rewards, slashes, ejections and blacklistings end memberships). The providers
    concerned are those of every result for the same tasks, since a quorum decides them
    together. A transaction deciding several verdicts calls this once, before the first."""
    if not submissions:
        return
    # First the pools, shared (batches do not wait for each other; a join, leave or ejection,
    # which locks its pool for update, waits): a provider ban a verdict decides ends the
    # provider's memberships in the pool, and a sibling node's join must not commit meanwhile
    # a membership the ban did not see.
    await session.execute(
        select(Pool.id)
        .where(Pool.id.in_({s.pool_id for s in submissions}))
        .order_by(Pool.id)
        .with_for_update(read=True)
    )
    task_ids = {s.task_id for s in submissions}
    providers = set(
        (
            await session.execute(
                select(Submission.provider_id).where(Submission.task_id.in_(task_ids)).distinct()
            )
        ).scalars()
    ) | {s.provider_id for s in submissions}
    # A retired provider's ban reaches its heir (``_punish``): the heir's memberships and
    # accounts are locked with the rest. A retirement that begins meanwhile waits for the pools
    # locked above; one committed already is seen here.
    providers |= set((await heirs(session, providers)).values())
    await session.execute(
        select(PoolMembership)
        .where(
            PoolMembership.pool_id.in_({s.pool_id for s in submissions}),
            PoolMembership.provider_id.in_(providers),
        )
        .order_by(PoolMembership.provider_id, PoolMembership.id)
        .with_for_update()
        .execution_options(populate_existing=True)
    )
    refs = [_system_account(session, SystemAccount.rewards), _system_account(session, SystemAccount.slashed)]
    for provider_id in providers:
        refs += [provider_account(provider_id, ProviderAccount.rewards_pending)]
        refs += ledger.stake_accounts(provider_id)
    await ledger.lock_accounts(session, refs)


# ------------------------------------------------------------------ checks


async def _run_checks(
    session: AsyncSession,
    job: VerificationJob,
    scored: Scored,
    *,
    secret: bytes,
    rng: random.Random,
    now: dt.datetime,
    scorer: Scorer,
    known: Mapping[VoteKey, VoteClasses] | None = None,
) -> None:
    submission = await session.get(Submission, job.submission_id)
    task = await session.get(Task, job.task_id)
    pool = await session.get(Pool, job.pool_id)
    replica = await session.get(TaskReplica, submission.replica_id) if submission else None
    assert submission is not None
    assert task is not None
    assert pool is not None
    assert replica is not None
    result, per_sample, canonical = scored.result, scored.per_sample, scored.canonical
    checkable = _checkable(per_sample)
    server_reward = sum(r for r in per_sample if r is not None) / len(per_sample) if checkable else None
    # A sample is paid when its reward is above 0, or when it has none (nothing to check it
    # against): a result a plugin scored only in part pays its unscored samples, not its wrong ones.
    correct = sum(1 for r in per_sample if r is None or r > 0)

    expect = checks.Expectations(
        seed=replica.seed,  # as recorded when the replica was made, whatever the secret is now
        n=int(task.sampling.get("n", 1)),
        max_tokens=int(task.sampling["max_tokens"]),
        current_step=submission.policy_current_step,
        # The terms in force when the result was received (a result stored before they were
        # recorded: the pool's now).
        max_async_level=_or(submission.max_async_level, pool.max_async_level),
        require_proof=_or(submission.require_proof, pool.require_proof),
    )
    findings = checks.sanity(result, expect)
    if scored.unscorable is not None:
        findings.append(scored.unscorable)
    forged = checks.forged_claim(result.get("claimed_reward"), server_reward)
    if forged is not None:
        findings.append(forged)
    # No sample right (honest sampling, n > 1 at a temperature, misses some samples of a problem
    # the policy solves: one wrong sample of several was fraud for an honest node), and even
    # then a miss at a temperature is fraud only as one too many (canary_finding).
    if task.is_canary and checkable and correct == 0:
        canary = await canary_finding(session, submission, task, pool)
        if canary is not None:
            findings.append(canary)

    job.server_reward = server_reward
    job.correct_samples = correct
    job.canonical = json.dumps(canonical)
    job.findings = [f.__dict__ for f in findings]
    job.updated_at = now

    details: dict[str, Any] = {
        "findings": job.findings,
        "server_reward": server_reward,
        "per_sample_rewards": per_sample,
    }
    # The worst finding decides: fraud, then invalid, then inconclusive (the server could not
    # score the result: no reward, no penalty).
    worst = next(
        ((c, f) for c in ("fraud", "invalid", "inconclusive") for f in findings if f.category == c), None
    )
    if worst is not None:
        category, finding = worst
        await decide(
            session, job, submission, Decision("rejected", category, finding.code, "checks", details), now=now
        )
        if task.replication > 1:  # siblings waiting for a quorum now know this result does not count
            await try_quorum(session, task, pool, secret=secret, now=now, scorer=scorer, known=known)
        return
    # A vote between replicas is only needed where the server cannot check answers itself:
    # replicas sample with different seeds, so checkable answers are judged one by one.
    if task.replication > 1 and not checkable:
        job.stage = "quorum"
        await session.flush()
        await try_quorum(session, task, pool, secret=secret, now=now, scorer=scorer, known=known)
        return
    trust = await _trust(session, pool.id, submission.node_id, submission.provider_id)
    audit_by_replica = pool.audit_method == "replicate" and not checkable
    if (pool.audit_method == "validator" or audit_by_replica) and rng.random() < audit_probability(
        trust.consecutive_valid, pool.audit_rate_floor
    ):
        job.audited = True
        if pool.audit_method == "validator":
            job.stage = "validator"
            session.add(
                ValidationJob(
                    submission_id=submission.id,
                    pool_id=pool.id,
                    status="open",
                    fencing_token=0,
                    per_sample_rewards=per_sample,
                    created_at=now,
                )
            )
            await session.flush()
            return
        if task.status not in ENDED and await _can_repeat(session, pool.id, submission):
            job.stage = "quorum"
            task.min_quorum = max(task.min_quorum, 2)
            await _add_replica(session, task, secret=secret, now=now)
            return
        # Nobody could take the replica (the task was cancelled or failed and is never leased
        # again, or the placement rule wants another provider and address that the pool lacks),
        # so it would wait forever, and this result with it. Decided on its checks instead.
        job.audited = False
        details["audit_skipped"] = (
            f"the task is {task.status}"
            if task.status in ENDED
            else "no healthy member of another provider and address can repeat it"
        )
    decision = by_reward(checkable, correct, details, "reward")
    await decide(session, job, submission, decision, now=now, trust=trust)


async def canary_finding(
    session: AsyncSession, submission: Submission, task: Task, pool: Pool
) -> checks.Finding | None:
    """A canary result with no right sample: fraud (``canary_failed``) when the task decodes
    greedily (the right policy gives the one answer it gives, and a canary is a problem it
    solves), or when this miss makes the pool's ``canary_miss_limit`` misses among the node's
    last ``canary_window`` canary results in the pool (as they were when the result came in).
    Otherwise None: sampled at a temperature, an honest node misses now and then a problem it
    usually solves, and the result is judged as any wrong answer (invalid, ``wrong_answer``),
    which does not tell the node the task was a canary.

    The earlier results counted are the node's canary verdicts in the pool that stand (one
    reversed on appeal is not counted) and that the server scored; a miss is one with no right
    sample, whatever the verdict said of it. The caller holds the node's membership
    (``lock_for_verdicts``), as every transaction deciding a verdict for the node does, so two
    of its misses decided at once are counted one after the other (SQLite: one writer)."""
    if greedy(task.sampling):
        return checks.Finding("canary_failed", "fraud", "no right answer on a canary task decoded greedily")
    limit = _or(submission.canary_miss_limit, pool.canary_miss_limit)
    window = _or(submission.canary_window, pool.canary_window)
    earlier = (
        select(VerificationJob.correct_samples.label("correct"))
        .join(Verdict, Verdict.submission_id == VerificationJob.submission_id)
        .join(Task, Task.id == Verdict.task_id)
        .where(
            Verdict.node_id == submission.node_id,
            Verdict.pool_id == submission.pool_id,
            Verdict.reversed_at.is_(None),
            Task.is_canary.is_(True),
            VerificationJob.server_reward.is_not(None),
        )
        .order_by(Verdict.id.desc())
        .limit(window - 1)
        .subquery()
    )
    seen, missed = (
        await session.execute(
            select(func.count(), func.count().filter(earlier.c.correct == 0)).select_from(earlier)
        )
    ).one()
    misses = missed + 1
    if misses < limit:
        return None
    return checks.Finding(
        "canary_failed",
        "fraud",
        f"no right answer on a canary task: {misses} of the node's last {seen + 1} canary results "
        f"in this pool had none (the pool's limit: {limit} of {window})",
    )


def _or(recorded: _T | None, current: _T) -> _T:
    """A term recorded with a submission, or the pool's current one for a submission stored
    before terms were recorded (migration 0022; the penalties and the hold, 0036; the canary
    rule, 0040)."""
    return current if recorded is None else recorded


async def _can_repeat(session: AsyncSession, pool_id: str, submission: Submission) -> bool:
    """Whether an audit replica of this submission's task could be placed now: an active,
    healthy member of the pool of another provider at another address than the submission's
    lease (a node with no recorded address shares the unknown one, as in the claim's placement
    rule: NULL is not distinct from NULL)."""
    lease_ip = select(Assignment.ip_address).where(Assignment.id == submission.assignment_id)
    stmt = (
        select(PoolMembership.id)
        .join(Node, Node.id == PoolMembership.node_id)
        .where(
            PoolMembership.pool_id == pool_id,
            PoolMembership.status == "active",
            Node.status == "healthy",
            PoolMembership.provider_id != submission.provider_id,
            Node.ip_address.is_distinct_from(lease_ip.scalar_subquery()),
        )
        .limit(1)
    )
    return (await session.execute(stmt)).first() is not None


def audit_probability(consecutive_valid: int, floor: float) -> float:
    """BOINC-style adaptive replication: 1 for an unknown node, falling as 1/(1+n), floored."""
    return max(floor, 1.0 / (1 + consecutive_valid))


def by_reward(checkable: bool, correct: int, details: dict[str, Any], verifier: str) -> Decision:
    if checkable and correct == 0:
        return Decision("rejected", "invalid", WRONG_ANSWER, verifier, details)
    return Decision("accepted", "valid", "verified", verifier, details, paid_samples=correct)


async def _add_replica(session: AsyncSession, task: Task, *, secret: bytes, now: dt.datetime) -> None:
    index = task.replication
    session.add(
        TaskReplica(
            task_id=task.id,
            replica_index=index,
            seed=derive_seed(secret, task.id, index),
            status="available",
            leases_issued=0,
            expirations=0,
        )
    )
    task.replication += 1
    task.available_replicas += 1
    if task.status == "submitted":
        task.status = "open"
    task.updated_at = now
    await session.flush()


# ------------------------------------------------------------------ quorum


async def try_quorum(
    session: AsyncSession,
    task: Task,
    pool: Pool,
    *,
    secret: bytes,
    now: dt.datetime,
    scorer: Scorer,
    timeout_note: str | None = None,
    known: Mapping[VoteKey, VoteClasses] | None = None,
) -> None:
    """Decide the task's waiting results once every replica has reported. With
    ``timeout_note`` (the missing replicas were withdrawn) an undecided vote asks for no further
    replica: the results are inconclusive, ``quorum_timeout``. Votes are counted by class
    (``vote_classes``): where the pool's reward function compares answers (``math``), the
    equivalent answers' votes are one class. The classes are taken from ``known`` (compared
    before the transaction, ``prescore``) when it holds these very votes (``vote_key``: the
    classes depend on nothing else); otherwise (a sibling checked or decided meanwhile, the
    housekeeping's ``expire_quorum_waits``) they are compared now, in ``scorer``'s processes,
    within ``vote_compare_s`` (the caller holds the task's and accounts' locks)."""
    jobs = list(
        (
            await session.execute(
                select(VerificationJob).where(VerificationJob.task_id == task.id).order_by(VerificationJob.id)
            )
        ).scalars()
    )
    if any(j.stage == "checks" for j in jobs):
        return  # results not yet checked: the last one checked decides
    if len(jobs) < task.replication:
        if task.status in ENDED:  # cancelled or failed: the replicas still out never report
            await settle_abandoned(session, task.id, now=now)
        return  # replicas still out
    waiting = [j for j in jobs if j.stage == "quorum"]
    if not waiting:
        return
    valid = [j for j in jobs if j.stage == "quorum" or _accepted_valid(j)]
    votes = Counter(vote_of(j.canonical) for j in valid)
    classes = (known or {}).get(vote_key(pool.reward_function, votes))
    if classes is None:
        classes = await vote_classes(pool.reward_function, valid, votes, scorer, locked=True)
    tally = Counter(classes.of[vote_of(j.canonical)] for j in valid)
    answer, count = tally.most_common(1)[0] if tally else (None, 0)
    if count >= 2 and count * 2 > task.min_quorum:
        for job in waiting:
            submission = await session.get(Submission, job.submission_id)
            assert submission is not None
            details = {
                "findings": job.findings,
                "server_reward": job.server_reward,
                "votes": dict(votes),
                **classes.details(),
                "quorum": len(valid),
                **({"quorum_timeout": timeout_note} if timeout_note else {}),
            }
            checkable = job.server_reward is not None
            if classes.of[vote_of(job.canonical)] == answer:
                decision = by_reward(checkable, job.correct_samples or 0, details, "quorum")
            elif checkable:
                # The server checks answers itself: disagreeing is an honest mistake, not fraud.
                decision = by_reward(checkable, job.correct_samples or 0, details, "quorum")
            elif greedy(task.sampling):
                # Replicas decoding greedily must agree: a different answer is made up.
                decision = Decision("rejected", "fraud", "quorum_minority", "quorum", details)
            else:
                # Sampled at a temperature, with its own seed, an honest replica may rightly
                # answer otherwise: outvoted, it is not paid, but nothing proves it cheated.
                decision = Decision("rejected", "invalid", "quorum_minority", "quorum", details)
            await decide(session, job, submission, decision, now=now)
        return
    if (
        timeout_note is None
        and task.status not in ENDED
        and pool.status != "completed"  # no node will ever lease a replica there
        and task.replication < task.min_quorum + MAX_EXTRA_REPLICAS
    ):
        # The tie-break's wait starts now (``expire_quorum_waits`` counts from the newest waiting
        # result): asked for by a sibling that failed its checks, and so is not waiting, it was
        # withdrawn at the next tick when the waiting result was older than the wait.
        for job in waiting:
            job.updated_at = now
        await _add_replica(session, task, secret=secret, now=now)
        return
    reason = "no_quorum" if timeout_note is None else "quorum_timeout"
    for job in waiting:
        submission = await session.get(Submission, job.submission_id)
        assert submission is not None
        undecided: dict[str, Any] = {"votes": dict(votes), **classes.details(), "quorum": len(valid)}
        if timeout_note:
            undecided["quorum_timeout"] = timeout_note
        await decide(
            session,
            job,
            submission,
            Decision("rejected", "inconclusive", reason, "quorum", undecided),
            now=now,
        )


async def expire_quorum_waits(
    session: AsyncSession,
    *,
    now: dt.datetime,
    wait_s: float,
    secret: bytes,
    scorer: Scorer,
    limit: int = 100,
) -> int:
    """Results waiting for replicas that no node took within ``wait_s``: the replicas are
    withdrawn and the results decided on what is in. Returns how many results were decided.

    The verifier asks for an audit replica only when an eligible node exists (``_can_repeat``),
    and for a tie-break replica whenever a vote is undecided; either may then find no node (the
    eligible one left, fell unhealthy or never polls, or the pool has no further provider and
    address), and the results, with their nodes' trust, would wait for ever. The same holds for
    an operator's replicas once at least two results are in. So:

    * an audited result still alone is decided on its own checks (``audit_skipped``);
    * two or more results are put to the quorum rule without the missing ones: a strict
      majority of at least two decides as usual, otherwise they are inconclusive
      (``quorum_timeout``: no reward, no slash), with no further replica asked for.

    A single result of a replicated task that was not audited waits for its siblings (the task's
    deadline bounds that wait). A replica under lease is left to finish (its expiry brings it
    back here), and a task another transaction holds is skipped until the next tick (SKIP
    LOCKED: claims and results lock the task too). The wait is counted from the task's newest
    waiting result, so a tie-break replica gets a full wait of its own, and only while the pool
    is active (from its resume, after a pause: a paused pool grants no claims, and its audits
    would otherwise be skipped for want of a node that could not claim)."""
    cutoff = now - dt.timedelta(seconds=wait_s)
    job, other = aliased(VerificationJob), aliased(VerificationJob)
    replica = aliased(TaskReplica)
    task_ids = (
        await session.execute(
            select(job.task_id)
            .where(
                job.stage == "quorum",
                ~exists().where(
                    other.task_id == job.task_id, other.stage == "quorum", other.updated_at >= cutoff
                ),
                or_(job.audited.is_(True), exists().where(other.task_id == job.task_id, other.id != job.id)),
                # Nodes could claim the replica for the whole wait: the pool has been active
                # since before it began (a paused pool grants no claims; its resume starts it).
                exists().where(
                    Pool.id == job.pool_id, Pool.status == "active", Pool.status_changed_at < cutoff
                ),
                exists().where(replica.task_id == job.task_id, replica.status == "available"),
                ~exists().where(replica.task_id == job.task_id, replica.status == "leased"),
            )
            .order_by(job.id)
            .limit(limit)
        )
    ).scalars()
    candidates = list(dict.fromkeys(task_ids))
    if not candidates:
        return 0
    # The global lock order, as a verifier batch takes it: the memberships and accounts these
    # verdicts may touch, up front, and only then each task (a batch holding a task's accounts
    # and waiting for the task must not meet this transaction holding the task and waiting for
    # the accounts).
    waiting_submissions = list(
        (
            await session.execute(
                select(Submission)
                .join(VerificationJob, VerificationJob.submission_id == Submission.id)
                .where(VerificationJob.task_id.in_(candidates), VerificationJob.stage == "quorum")
            )
        ).scalars()
    )
    await lock_for_verdicts(session, waiting_submissions)
    decided = 0
    for task_id in candidates:
        decided += await _expire_wait(session, task_id, now=now, wait_s=wait_s, secret=secret, scorer=scorer)
    return decided


async def _expire_wait(
    session: AsyncSession, task_id: int, *, now: dt.datetime, wait_s: float, secret: bytes, scorer: Scorer
) -> int:
    task = (
        await session.execute(
            select(Task)
            .where(Task.id == task_id, Task.status == "open")
            .with_for_update(skip_locked=True)
            .execution_options(populate_existing=True)
        )
    ).scalar_one_or_none()
    if task is None:
        return 0  # being claimed or submitted right now, or no longer open: not this tick
    # With the task locked no claim can lease its replicas, so a plain read of them holds.
    unfinished = list(
        (
            await session.execute(
                select(TaskReplica).where(
                    TaskReplica.task_id == task_id, TaskReplica.status.in_(("available", "leased"))
                )
            )
        ).scalars()
    )
    if not unfinished or any(r.status == "leased" for r in unfinished):
        return 0  # the replicas are in, or a node is working on one: let it finish
    jobs = list(
        (
            await session.execute(
                select(VerificationJob).where(VerificationJob.task_id == task_id).order_by(VerificationJob.id)
            )
        ).scalars()
    )
    waiting = [j for j in jobs if j.stage == "quorum"]
    if not waiting or any(j.stage == "checks" for j in jobs):
        return 0  # decided meanwhile, or a result still being checked: the checks decide
    for r in unfinished:
        r.status = "cancelled"
    task.replication -= len(unfinished)
    task.available_replicas = 0
    task.status = "submitted"
    task.updated_at = now
    await session.flush()
    if len(jobs) == 1:
        what = "the audit replica"
    else:
        what = "the missing replica" if len(unfinished) == 1 else f"the {len(unfinished)} missing replicas"
    note = f"no node took {what} within {wait_s:g} s"
    if len(jobs) == 1:
        [only] = waiting
        submission = await session.get(Submission, only.submission_id)
        assert submission is not None
        only.audited = False
        details = {"findings": only.findings, "server_reward": only.server_reward, "audit_skipped": note}
        decision = by_reward(only.server_reward is not None, only.correct_samples or 0, details, "reward")
        await decide(session, only, submission, decision, now=now)
    else:
        pool = await session.get(Pool, task.pool_id)
        assert pool is not None
        await try_quorum(session, task, pool, secret=secret, now=now, scorer=scorer, timeout_note=note)
    log.info("quorum_wait_expired", task_id=task_id, replicas_withdrawn=len(unfinished), decided=len(waiting))
    return len(waiting)


async def settle_abandoned(session: AsyncSession, task_id: int, *, now: dt.datetime) -> int:
    """A task that was cancelled or failed while results waited for their quorum (or before
    their checks, which then call this through ``try_quorum``): the replicas still out never
    report. What is in is then judged as when nobody takes those replicas in time
    (``_expire_wait``): two or more results are put to the quorum rule without the missing ones
    (a strict majority of at least two decides, else they are inconclusive), and a lone audited
    result (its task's only one, waiting for the audit replica the verifier added) is decided on
    its checks without the audit (``audit_skipped``). For that the unanswered replicas are
    withdrawn and the waiting results go back to the verifier, which finds the task ended; they
    are not decided here, since their verdicts may move money and the caller holds the task,
    which the global lock order puts after the ledger accounts. A lone result that was not
    audited can never be compared: it is decided here as inconclusive (no reward, no slash).
    Returns how many results were decided here."""
    jobs = list(
        (await session.execute(select(VerificationJob).where(VerificationJob.task_id == task_id))).scalars()
    )
    waiting = [j for j in jobs if j.stage == "quorum"]
    if waiting and (len(jobs) > 1 or waiting[0].audited):
        await session.execute(
            update(Task).where(Task.id == task_id).values(replication=Task.submitted_replicas, updated_at=now)
        )
        for job in waiting:
            job.stage, job.audited, job.updated_at = "checks", False, now
        await session.flush()
        return 0
    for job in waiting:
        submission = await session.get(Submission, job.submission_id)
        assert submission is not None
        decision = Decision(
            "rejected",
            "inconclusive",
            "task_abandoned",
            "quorum",
            {"findings": job.findings, "server_reward": job.server_reward},
        )
        await decide(session, job, submission, decision, now=now)
    return len(waiting)


def greedy(sampling: dict[str, Any]) -> bool:
    """Whether a task's sampling is greedy decoding (temperature 0, or top-k 1), where replicas
    of one task give the same answers whatever their seeds. The defaults are the schema's."""
    return float(sampling.get("temperature", 1.0)) == 0 or int(sampling.get("top_k", -1)) == 1


# The longest answers a vote names as they are; a longer one is named by its SHA-256.
VOTE_MAX_CHARS = 200


def vote_of(canonical: str | None) -> str | None:
    """A result's vote: its canonical answers (their JSON) when short, else their SHA-256, so
    that the same answers make the same vote either way. Every waiting replica's verdict lists
    the votes: a completion of megabytes, made its canonical answer, was copied whole into the
    verdicts of every other replica of its task, which their workers read every few seconds."""
    if canonical is None or len(canonical) <= VOTE_MAX_CHARS:
        return canonical
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


@dataclass(frozen=True)
class VoteClasses:
    """Which votes count as one: ``of`` maps each vote to its class's representative vote."""

    of: dict[str | None, str | None]
    #: Why equivalent answers could not be told (the comparison ran out of its limits): the
    #: votes were then compared as text.
    unchecked: str | None = None

    def details(self) -> dict[str, Any]:
        """For a verdict's details: the classes of more than one vote (``equivalent``, each
        its representative first) and, if the comparison failed, why (``equivalence_unchecked``)."""
        members: dict[str | None, list[str | None]] = {}
        for vote, representative in self.of.items():
            members.setdefault(representative, []).append(vote)
        shown: dict[str, Any] = {}
        equivalent = [m for m in members.values() if len(m) > 1]
        if equivalent:
            shown["equivalent"] = equivalent
        if self.unchecked is not None:
            shown["equivalence_unchecked"] = self.unchecked
        return shown


async def vote_classes(
    reward_function: str,
    valid: Sequence[VerificationJob],
    votes: Counter[str | None],
    scorer: Scorer,
    *,
    locked: bool = True,
) -> VoteClasses:
    """The votes' classes. A reward function that compares answers (``rewards.compares_answers``:
    ``math``, where ``1/2``, ``0.5`` and ``\\frac{1}{2}`` are one answer) puts equivalent votes in one
    class; with any other each vote is its own, compared as text.

    The rule (``scoring.classes_of``), which depends neither on the order the results came in
    nor on their texts: two votes are one class when a chain of votes, each equivalent to the
    next (either read as an expected answer is by the reward function), joins them, since
    equivalence need not be transitive (``x=3`` and ``3``, ``3`` and ``(a)=3``, but not
    ``x=3`` and ``(a)=3``) and no vote may be outvoted by a class holding a vote it is
    equivalent to. A class's representative is its most common vote, ties by their text. The
    comparisons run in ``scorer``'s processes, within its time and memory limits (``locked``:
    the caller holds a transaction's locks, and the time limit is ``vote_compare_s``); past
    them (an answer SymPy cannot finish with) the votes are compared as text, as before, and
    the verdicts say so (``equivalence_unchecked``).

    The classes depend only on ``reward_function`` and ``votes`` with their counts
    (``vote_key``): the votes are compared most common first, ties by text, each by its
    canonical answers, which its vote names (the answers themselves, or their SHA-256); ``valid``
    only supplies those answers. So classes compared before a transaction (``prescore``) are
    those the transaction would compare for the same votes, but for comparisons cut for time,
    which the transaction's shorter limit would cut more often."""
    identity: dict[str | None, str | None] = {v: v for v in votes}
    if len(votes) < 2:
        return VoteClasses(identity)
    try:
        compares = rewards.compares_answers(rewards.get(reward_function))
    except KeyError:  # not installed in this process: its results were scored elsewhere
        compares = False
    if not compares:
        return VoteClasses(identity)
    canonical: dict[str | None, str] = {}
    for job in valid:
        if job.canonical is not None:
            canonical.setdefault(vote_of(job.canonical), job.canonical)
    order = sorted(votes, key=lambda v: (-votes[v], v or ""))
    if any(v not in canonical for v in order):
        return VoteClasses(identity)
    try:
        numbers, cut = await scorer.vote_classes(
            reward_function, [json.loads(canonical[v]) for v in order], locked=locked
        )
    except (Unscorable, RewardFunctionFailed) as exc:
        log.warning("vote_comparison_failed", reward_function=reward_function, detail=str(exc))
        return VoteClasses(identity, str(exc))
    representative: dict[int, str | None] = {}
    for vote, number in zip(order, numbers, strict=True):
        representative.setdefault(number, vote)
    unchecked = None
    if cut:
        unchecked = (
            f"{cut} comparison(s) of two answers took longer than their share of the time: made as text"
        )
        log.warning("vote_comparison_cut", reward_function=reward_function, comparisons=cut)
    of = {vote: representative[number] for vote, number in zip(order, numbers, strict=True)}
    return VoteClasses(of, unchecked)


def _accepted_valid(job: VerificationJob) -> bool:
    return job.stage == "done" and not job.findings and job.canonical is not None


#: A quorum's votes as far as its classes go (``vote_classes``): the reward function and each
#: vote with its count.
VoteKey = tuple[str, frozenset[tuple[str | None, int]]]


def vote_key(reward_function: str, votes: Counter[str | None]) -> VoteKey:
    """What a quorum's vote classes depend on (``vote_classes``): with the counts, since the
    votes are compared most common first and a class is named by its most common vote."""
    return reward_function, frozenset(votes.items())


def _checkable(per_sample: Sequence[float | None]) -> bool:
    """Whether the server checked a result's answers itself (every sample has a reward)."""
    return bool(per_sample) and all(r is not None for r in per_sample)


# ------------------------------------------------------------------ verdicts and money


async def decide(
    session: AsyncSession,
    job: VerificationJob,
    submission: Submission,
    decision: Decision,
    *,
    now: dt.datetime,
    trust: NodeTrust | None = None,
) -> Verdict:
    """Record the verdict and move its money, once per submission whatever the retries.
    ``trust``: the node's row if the caller already locked it in this transaction."""
    existing = (
        await session.execute(select(Verdict).where(Verdict.submission_id == submission.id))
    ).scalar_one_or_none()
    if existing is not None:
        return existing
    pool = await session.get(Pool, submission.pool_id)
    assert pool is not None
    verdict = Verdict(
        submission_id=submission.id,
        task_id=submission.task_id,
        pool_id=submission.pool_id,
        node_id=submission.node_id,
        provider_id=submission.provider_id,
        outcome=decision.outcome,
        category=decision.category,
        reason=decision.reason,
        verifier=decision.verifier,
        details=decision.details,
        server_reward=job.server_reward,
        paid_samples=decision.paid_samples,
        reward_amount=(
            _or(submission.reward_per_sample, pool.reward_per_sample) * decision.paid_samples
            if decision.category == "valid"
            else 0
        ),
        slashed_amount=0,
        decided_at=now,
        # Its hold window: a fraud verdict against the node before then withdraws it (Verdict).
        hold_until=(
            now + dt.timedelta(seconds=_or(submission.reward_hold_s, pool.reward_hold_s))
            if has_window(decision.outcome, decision.reason)
            else None
        ),
    )
    try:
        async with session.begin_nested():
            session.add(verdict)
            await session.flush()
    except IntegrityError:
        found = (
            await session.execute(select(Verdict).where(Verdict.submission_id == submission.id))
        ).scalar_one_or_none()
        if found is None:
            raise
        return found
    job.stage = "done"
    job.updated_at = now
    submission.status = decision.outcome
    if trust is None:
        trust = await _trust(session, pool.id, submission.node_id, submission.provider_id)
    trust.updated_at = now
    if decision.category == "valid":
        trust.valid += 1
        if _verified(decision, job):
            trust.consecutive_valid += 1
        # In the row's one UPDATE: what the pool's reward_budget counts (pools.service.spent).
        trust.rewards_credited += verdict.reward_amount
        await _reward(session, verdict, now=now)
    elif decision.category == "fraud":
        trust.fraud += 1
        trust.consecutive_valid = 0
        trust.strikes += 1
        slash = _or(submission.fraud_slash_amount, pool.fraud_slash_amount)
        await _punish(session, pool, verdict, trust, slash=slash, now=now)
        await notify_window(session, verdict, "withdrawn", now=now)
    else:
        trust.invalid += 1
        trust.consecutive_valid = 0
        if decision.category == "invalid":
            penalty = _or(submission.soft_invalid_penalty, pool.soft_invalid_penalty)
            await _penalise(session, verdict, penalty=penalty, now=now)
    await _maybe_complete(session, submission.task_id)
    await session.flush()
    metrics.on_commit(session, _counter(decision, verdict.reward_amount, verdict.slashed_amount))
    log.info(
        "verdict",
        submission_id=submission.id,
        node_id=submission.node_id,
        outcome=decision.outcome,
        category=decision.category,
        reason=decision.reason,
    )
    return verdict


async def notify_window(session: AsyncSession, fraud: Verdict, change: str, *, now: dt.datetime) -> None:
    """A ``RolloutChange`` notice (``withdrawn`` when the fraud verdict is written, ``restored``
    when it is reversed) for each unreversed accepted verdict of its window: its node's in its
    pool, decided before it and still in their hold window then (``withdrawn_by``). Those
    already withdrawn by another fraud verdict, or standing again because of one, get a notice
    all the same: a reader sees whether each stands when it reads, and a notice too many costs
    nothing, where one left out because of a racing appeal would leave a trainer wrong."""
    window = (
        select(
            Verdict.pool_id,
            Verdict.id,
            literal(change, String()),
            literal(fraud.id, BigInteger()),
            literal(now, UTCDateTime()),
        )
        .where(
            Verdict.node_id == fraud.node_id,
            Verdict.pool_id == fraud.pool_id,
            Verdict.outcome == "accepted",
            Verdict.reversed_at.is_(None),
            Verdict.id < fraud.id,
            Verdict.hold_until > fraud.decided_at,
        )
        .order_by(Verdict.id)
    )
    await session.execute(
        insert(RolloutChange).from_select(
            ["pool_id", "verdict_id", "change", "cause_verdict_id", "created_at"], window
        )
    )


def _counter(decision: Decision, credited: int, slashed: int) -> Callable[[], None]:
    def count() -> None:
        metrics.VERDICTS.labels(decision.outcome, decision.category, decision.verifier).inc()
        if decision.category == "valid" and credited > 0:
            metrics.REWARDS_CREDITED.inc(credited)
        if slashed > 0:
            metrics.SLASHED.inc(slashed)
        if "audit_skipped" in decision.details:
            metrics.AUDITS_SKIPPED.inc()

    return count


def _verified(decision: Decision, job: VerificationJob) -> bool:
    """Whether a valid verdict verified the result: the server checked its answers itself, or a
    quorum or a validator judged it. Only such results build the trust that lowers the node's
    audit rate (BOINC counts validated results): a result the server cannot check, accepted
    without an audit (not drawn, or skipped), was never checked, and a cheater's every such
    answer would otherwise make its next audit less likely. It neither builds trust nor breaks
    the run. (``_standing_run`` reads the same from a verdict's row: keep the two alike.)"""
    return decision.verifier in ("quorum", "validator") or job.server_reward is not None


async def _trust(session: AsyncSession, pool_id: str, node_id: str, provider_id: str) -> NodeTrust:
    """The node's track record in the pool, locked; created if missing. Created with INSERT ...
    ON CONFLICT DO NOTHING and then read: two transactions deciding a node's first verdicts at
    once (two cancels settling its waiting results) each inserted it, and the second failed on
    the primary key (a 500, nothing done)."""
    trust = await session.get(NodeTrust, (pool_id, node_id), with_for_update=True)
    if trust is None:
        await insert_ignore(
            session,
            NodeTrust,
            {
                "pool_id": pool_id,
                "node_id": node_id,
                "provider_id": provider_id,
                "consecutive_valid": 0,
                "valid": 0,
                "invalid": 0,
                "fraud": 0,
                "strikes": 0,
                "rewards_credited": 0,
                "updated_at": dt.datetime.now(dt.UTC),
            },
        )
        trust = await session.get(NodeTrust, (pool_id, node_id), with_for_update=True, populate_existing=True)
        assert trust is not None
    return trust


async def _reward(session: AsyncSession, verdict: Verdict, *, now: dt.datetime) -> None:
    amount = verdict.reward_amount  # set when the verdict was written
    if amount <= 0:
        return
    assert verdict.hold_until is not None  # a rewarded verdict is accepted
    await _credit_held(
        session,
        verdict,
        amount,
        debit=_system_account(session, SystemAccount.rewards),
        key=f"submission:{verdict.submission_id}:reward",
        actor="verifier",
        release_at=verdict.hold_until,
        now=now,
    )


async def _credit_held(
    session: AsyncSession,
    verdict: Verdict,
    amount: int,
    *,
    debit: ledger.AccountRef,
    key: str,
    actor: str,
    release_at: dt.datetime,
    now: dt.datetime,
    memo: str | None = None,
) -> RewardHold:
    """``amount`` from the system's ``debit`` rewards account to the provider's pending
    rewards, with the verdict's ``RewardHold`` that releases it at ``release_at`` (or that a
    fraud verdict within the window forfeits): an acceptance's reward, and an appeal's."""
    await ledger.transfer(
        session,
        debit=debit,
        credit=provider_account(verdict.provider_id, ProviderAccount.rewards_pending),
        amount=amount,
        key=key,
        reason="reward",
        actor=actor,
        memo=memo,
        reference=("verdict", str(verdict.id)),
    )
    hold = RewardHold(
        verdict_id=verdict.id,
        pool_id=verdict.pool_id,
        node_id=verdict.node_id,
        provider_id=verdict.provider_id,
        amount=amount,
        release_at=release_at,
        status="held",
        created_at=now,
    )
    session.add(hold)
    return hold


#: The key of a fraud slash's part taken from a live membership's earlier episodes' stake still
#: unbonding, for what its locked stake lacked (``_punish``); by ``submission_id``.
UNBONDING_SLASH_KEY = "submission:{submission_id}:slash-unbonding"


async def _punish(
    session: AsyncSession, pool: Pool, verdict: Verdict, trust: NodeTrust, *, slash: int, now: dt.datetime
) -> None:
    """``slash``: the pool's ``fraud_slash_amount`` when the result was received."""
    from orchestrator.pools import service as pools_service

    reference = ("verdict", str(verdict.id))
    membership = await _membership(session, pool.id, verdict.node_id)
    slashed = 0
    live = membership is not None and membership.status in ("active", "pending")
    slash_key = f"submission:{verdict.submission_id}:slash-stake"
    if membership is not None and live and slash > 0:
        # A live membership has its stake locked.
        if membership.stake > 0:
            amount = min(slash, membership.stake)
            await ledger.transfer(
                session,
                debit=provider_account(verdict.provider_id, ProviderAccount.stake_locked),
                credit=_system_account(session, SystemAccount.slashed),
                amount=amount,
                key=slash_key,
                reason="slash_stake",
                actor="verifier",
                reference=reference,
                memo=f"fraud: {verdict.reason}",
            )
            membership.stake -= amount
            slashed += amount
        if slashed < slash:
            # What the locked stake lacks (earlier slashes took it) comes from the stake of the
            # membership's earlier episodes still unbonding, latest first, slashable until due as
            # an ended membership's is: the amount is taken in full while the node's stake lasts.
            slashed += await ledger.slash_unbonding(
                session,
                pools_service.unbonding_keys(membership),
                slash - slashed,
                now=now,
                credit=_system_account(session, SystemAccount.slashed),
                key=UNBONDING_SLASH_KEY.format(submission_id=verdict.submission_id),
                actor="verifier",
                memo=f"fraud: {verdict.reason}",
                reference=reference,
            )
    elif membership is not None and not live and slash > 0:
        # An ended one (left, ejected, its pool completed) has its stake unbonding: slashable
        # until the unbonding period ends, so that leaving before the verdict escapes nothing.
        slashed += await ledger.slash_unbonding(
            session,
            pools_service.unbonding_keys(membership),
            slash,
            now=now,
            credit=_system_account(session, SystemAccount.slashed),
            key=slash_key,
            actor="verifier",
            memo=f"fraud: {verdict.reason}",
            reference=reference,
        )
    holds = await _held(session, verdict)
    slashed += await _forfeit(
        session,
        verdict,
        [(hold, hold.amount - hold.forfeited_amount) for hold in holds],  # every reward on hold
        reason="slash_pending_rewards",
        key=f"submission:{verdict.submission_id}:slash-pending",
        memo=f"fraud: {verdict.reason}",
        now=now,
    )
    verdict.slashed_amount = slashed
    if (
        membership is not None
        # Any membership but one already ejected for good: a live one; one that ended (the node
        # left, or was rejected, before the verdict: it must not join again and go on); or one
        # ejected by a ban, which an unban would lift. The verifier's ejection stands until an
        # appeal brings the strikes below the limit again (``_lift_sanctions``).
        and (membership.status != "ejected" or membership.ejected_by == "ban")
        and trust.strikes >= pool.strikes_before_ejection
    ):
        await pools_service.eject_for_fraud(
            session, pool, membership, reason=f"{trust.strikes} fraud strikes", now=now
        )
    provider_strikes = await _provider_strikes(session, pool.id, verdict.provider_id)
    if provider_strikes >= pool.strikes_before_provider_ban:
        await pools_service.blacklist_for_fraud(
            session,
            pool,
            verdict.provider_id,
            reason=f"{provider_strikes} fraud strikes across its nodes",
            now=now,
        )
        # Decided after the provider's retirement (a result its nodes sent before), the ban
        # blacklists its heir too (``blacklist_locked``), whose memberships and accounts
        # ``lock_for_verdicts`` locked.


async def _penalise(session: AsyncSession, verdict: Verdict, *, penalty: int, now: dt.datetime) -> None:
    """An invalid (soft) verdict forfeits ``penalty`` (the pool's ``soft_invalid_penalty`` when
    the result was received) from the node's rewards still on hold, oldest first (the part of a
    hold not taken stays held and is released when due), up to what is on hold."""
    left = penalty
    if left <= 0:
        return
    takes: list[tuple[RewardHold, int]] = []
    for hold in await _held(session, verdict):
        take = min(left, hold.amount - hold.forfeited_amount)
        takes.append((hold, take))
        left -= take
        if left == 0:
            break
    verdict.slashed_amount = await _forfeit(
        session,
        verdict,
        takes,
        reason="soft_invalid_penalty",
        key=f"submission:{verdict.submission_id}:soft-penalty",
        memo=f"invalid: {verdict.reason}",
        now=now,
    )


async def _held(session: AsyncSession, verdict: Verdict) -> list[RewardHold]:
    """The verdict's node's rewards still on hold in its pool (held, and in their hold window at
    the verdict's time: one past its ``release_at`` is not taken, even while the release job has
    yet to move it), oldest first (``release_at``, then the order their verdicts were decided in),
    locked after the accounts a forfeit moves money between.
    (The verifier's batches have locked those already;
    a verdict decided without them, such as one of a quorum wait that expired, takes them here,
    so that it never holds a hold while it waits for an account the reward release holds.)"""
    await ledger.lock_accounts(
        session,
        [
            provider_account(verdict.provider_id, ProviderAccount.rewards_pending),
            _system_account(session, SystemAccount.slashed),
        ],
    )
    rewarded = aliased(Verdict)
    return list(
        (
            await session.execute(
                select(RewardHold)
                .join(rewarded, rewarded.id == RewardHold.verdict_id)
                .where(
                    RewardHold.pool_id == verdict.pool_id,
                    RewardHold.node_id == verdict.node_id,
                    RewardHold.status == "held",
                    # Still in its hold window, as ``withdrawn_by`` counts it: a hold that is
                    # due is the release job's, whenever that runs.
                    RewardHold.release_at > verdict.decided_at,
                )
                # Holds that end together by their verdicts' ``decided_at``, then id, not by the
                # hold's id: an appeal's payment creates its hold when it pays, and is held as
                # the acceptance's reward would have been, created with the verdict.
                .order_by(RewardHold.release_at, rewarded.decided_at, rewarded.id)
                .with_for_update(of=RewardHold)
                .execution_options(populate_existing=True)
            )
        ).scalars()
    )


async def _forfeit(
    session: AsyncSession,
    verdict: Verdict,
    takes: list[tuple[RewardHold, int]],
    *,
    reason: str,
    key: str,
    memo: str,
    now: dt.datetime,
    actor: str = "verifier",
    slashed: ledger.AccountRef | None = None,
) -> int:
    """Forfeit ``amount`` of each ``(hold, amount)`` for ``verdict``: the sum moves from the
    provider's pending rewards to the slashed account (``slashed``; by default the one this
    transaction's verdicts use) in parts of at most the ledger's largest transfer (a node may
    have many rewards on hold), and each part is recorded as a ``RewardForfeit``, so that an
    appeal gives back exactly these. Returns the sum."""
    takes = [(hold, amount) for hold, amount in takes if amount > 0]
    total = sum(amount for _, amount in takes)
    if total <= 0:
        return 0
    moved = await ledger.transfer_in_parts(
        session,
        debit=provider_account(verdict.provider_id, ProviderAccount.rewards_pending),
        credit=slashed or _system_account(session, SystemAccount.slashed),
        amount=total,
        key=key,
        reason=reason,
        actor=actor,
        reference=("verdict", str(verdict.id)),
        memo=memo,
    )
    slashed_account_id = moved[0].transfer.credit_account_id
    for hold, amount in takes:
        session.add(
            RewardForfeit(
                verdict_id=verdict.id,
                hold_id=hold.id,
                amount=amount,
                slashed_account_id=slashed_account_id,
                status="forfeited",
                created_at=now,
            )
        )
        hold.forfeited_amount += amount
        if hold.forfeited_amount >= hold.amount:
            hold.status = "forfeited"
    return total


async def _maybe_complete(session: AsyncSession, task_id: int) -> None:
    """A task whose every replica has a verdict is completed (called after writing one of them:
    a task of one replica needs no count)."""
    task = await session.get(Task, task_id)
    if task is None or task.status not in ("open", "submitted"):
        return
    decided = 1
    if task.replication > 1:
        count = select(func.count()).select_from(Verdict).where(Verdict.task_id == task_id)
        decided = int(await session.scalar(count) or 0)
    if decided >= task.replication and task.submitted_replicas >= task.replication:
        task.status = "completed"


async def release_due_rewards(
    session: AsyncSession, *, now: dt.datetime, limit: int = 1000, keyset: Keyset | None = None
) -> int:
    """Rewards whose hold window has passed become claimable, up to ``limit`` of them (after
    ``keyset``'s place, which is moved on).

    Lock order as everywhere (accounts, then holds): the due holds are read without a lock,
    their providers' accounts locked up front, and only then the holds, which a fraud verdict
    may have forfeited meanwhile (it holds the same accounts while it does).

    Each hold is released in its own savepoint: one whose transfer fails (its provider's
    pending rewards hold less than it, say) is logged and left held, and the others are still
    released. Returns how many were released."""
    keyset = keyset or Keyset()
    candidates = (
        await session.execute(
            select(RewardHold.id, RewardHold.provider_id, RewardHold.release_at)
            .where(
                RewardHold.status == "held",
                RewardHold.release_at <= now,
                keyset.where(RewardHold.release_at, RewardHold.id),
            )
            .order_by(RewardHold.release_at, RewardHold.id)
            .limit(limit)
        )
    ).all()
    keyset.saw([(at, i) for i, _, at in candidates])
    if not candidates:
        return 0
    kinds = (ProviderAccount.rewards_pending, ProviderAccount.rewards_claimable)
    providers = sorted({p for _, p, _ in candidates})
    # A retired provider's rewards go on to its heir (``ledger.succession``), whose claimable
    # rewards are locked with the rest; a provider retired while this locked waits a tick.
    heir_of, unsettled = await succession.lock_with_heirs(
        session,
        [provider_account(p, k) for p in providers for k in kinds],
        providers,
        [ProviderAccount.rewards_claimable],
    )
    due = list(
        (
            await session.execute(
                select(RewardHold)
                .where(RewardHold.id.in_([i for i, _, _ in candidates]), RewardHold.status == "held")
                .order_by(RewardHold.release_at, RewardHold.id)
                .with_for_update()
                .execution_options(populate_existing=True)
            )
        ).scalars()
    )
    released = 0
    for hold, hold_id, provider_id in [(h, h.id, h.provider_id) for h in due]:
        if provider_id in unsettled:
            continue
        try:
            async with session.begin_nested():
                await _release(session, hold, heir_of.get(provider_id))
        except Exception:  # a rolled-back savepoint expires the hold: log with what was read
            log.exception("reward_release_failed", hold_id=hold_id, provider_id=provider_id)
            continue
        released += 1
    return released


async def _release(session: AsyncSession, hold: RewardHold, heir: str | None) -> None:
    """The provider's part of the hold (what no forfeit in force took) becomes claimable; a
    retired provider's then goes on to ``heir``'s claimable rewards."""
    amount = hold.amount - hold.forfeited_amount
    if amount > 0:
        claimable = provider_account(hold.provider_id, ProviderAccount.rewards_claimable)
        await ledger.transfer(
            session,
            debit=provider_account(hold.provider_id, ProviderAccount.rewards_pending),
            credit=claimable,
            amount=amount,
            key=f"reward-hold:{hold.id}:release",
            reason="reward_release",
            actor="system",
            reference=("verdict", str(hold.verdict_id)),
        )
        if heir is not None:
            await ledger.transfer(
                session,
                debit=claimable,
                credit=provider_account(heir, ProviderAccount.rewards_claimable),
                amount=amount,
                key=f"reward-hold:{hold.id}:succession",
                reason=succession.REASON,
                actor="system",
                reference=("verdict", str(hold.verdict_id)),
            )
    hold.status = "released"
    await session.flush()  # in the savepoint: a failure here rolls back the transfer with it


async def _moved_by_standing_verdicts(
    session: AsyncSession, pool_id: str, categories: Sequence[str], key_like: str
) -> int:
    """The sum of the ledger transfers whose idempotency key is like ``key_like`` and that name
    as their reference a verdict of the pool, of one of ``categories``, that stands."""
    forfeiter = aliased(Verdict)
    moved = await session.scalar(
        select(func.coalesce(func.sum(LedgerTransfer.amount), 0))
        .select_from(forfeiter)
        .join(
            LedgerTransfer,
            (LedgerTransfer.reference_type == "verdict")
            & (LedgerTransfer.reference_id == cast(forfeiter.id, String)),
        )
        .where(
            forfeiter.pool_id == pool_id,
            forfeiter.reversed_at.is_(None),
            forfeiter.category.in_(categories),
            LedgerTransfer.idempotency_key.like(key_like),
        )
    )
    return int(moved or 0)


async def pool_stats(session: AsyncSession, pool_id: str) -> dict[str, Any]:
    rows = (
        await session.execute(
            select(
                Verdict.category,
                func.count(),
                func.coalesce(func.sum(Verdict.reward_amount), 0),
                func.coalesce(func.sum(Verdict.slashed_amount), 0),
            )
            .where(Verdict.pool_id == pool_id, Verdict.reversed_at.is_(None))
            .group_by(Verdict.category)
        )
    ).all()
    # A verdict's slashed_amount is what it took when decided; a forfeit of it that a reward's
    # appeal sent back to the system since (``returned``) is slashed no more.
    returned = await session.scalar(
        select(func.coalesce(func.sum(RewardForfeit.amount), 0))
        .join(Verdict, Verdict.id == RewardForfeit.verdict_id)
        .where(Verdict.pool_id == pool_id, Verdict.reversed_at.is_(None), RewardForfeit.status == "returned")
    )
    # What appeals of rejections paid (their verdicts are reversed, so not in ``rows``).
    paid_on_appeal = await session.scalar(
        select(func.coalesce(func.sum(Verdict.reward_paid_on_appeal), 0)).where(
            Verdict.pool_id == pool_id, Verdict.reversed_at.is_not(None)
        )
    )
    # Of that, what verdicts of the result's window forfeited when the appeal paid it (a fraud
    # verdict's, a soft penalty's: their transfers keyed by the appeal, ``APPEAL_FORFEIT_KEY``;
    # not in that verdict's slashed_amount, its decision's, which counts what a verdict decided
    # after the appeal took of the payment), while that verdict stands.
    forfeited_on_appeal = await _moved_by_standing_verdicts(  # the key's either form
        session, pool_id, PAID_ON_APPEAL, "verdict:%:reverse:reward:forfeit%"
    )
    # And what an appeal gave back of a standing penalty's forfeit of a later reward, which the
    # penalty took from the appeal's payment instead (``APPEAL_GIVE_BACK_KEY``).
    given_back_on_appeal = await _moved_by_standing_verdicts(
        session, pool_id, ("invalid",), "verdict:%:reverse:reward:give-back:%"
    )
    counts = {c: int(n) for c, n, _, _ in rows}
    total = sum(counts.values())
    return {
        "verdicts": total,
        "by_category": counts,
        "acceptance_rate": counts.get("valid", 0) / total if total else None,
        "fraud_rate": counts.get("fraud", 0) / total if total else None,
        # A rejected verdict's reward_amount is 0 (set when it was written), so the sum is the valid
        # ones', and with it what their appeals paid.
        "rewards_credited": sum(int(credited) for _, _, credited, _ in rows) + int(paid_on_appeal or 0),
        "slashed": sum(int(slashed) for _, _, _, slashed in rows)
        - int(returned or 0)
        + forfeited_on_appeal
        - given_back_on_appeal,
    }


# ------------------------------------------------------------------ appeals


async def reverse_verdict(
    session: AsyncSession, verdict_id: int, *, reason: str, principal: Principal, now: dt.datetime
) -> tuple[Verdict, bool]:
    """Undo a verdict's money with compensating transfers that name the originals (never an
    edit), and its strike; returns (verdict, whether this call reversed it). Idempotent: a
    reversed verdict stays as it is (decided under the verdict's lock, so of two appeals at
    once exactly one reverses it).

    * A reward: decided by the state of its hold, read under lock. ``held``: the provider's part
      goes back from pending to the system; ``released``: the release is reversed first (the
      provider's part back from claimable, ``reversal_impossible`` if it was withdrawn); what
      other verdicts forfeited of it (``forfeited``: all of it) is in a slashed account and goes
      from there back to the system, not from the provider; the hold is ``reversed`` and its
      forfeits ``returned``, so that an appeal against the forfeiting verdict gives nothing back.
    * A fraud verdict: the slashed stake back (locked again if the membership's episode it was
      slashed from is still live, else free), a strike less; and, as for a soft-invalid
      penalty, its forfeits still in force are given back: to pending, the hold ``held`` again
      (released when due), or to claimable if the hold was released meanwhile.
    * A fraud or invalid verdict: the reward an acceptance would have paid, paid, held and
      forfeited (by fraud verdicts and soft-invalid penalties) as that acceptance's would have
      been, in the result's own hold window
      (``_pay_on_appeal``; ``reward_paid_on_appeal``, ``reward_forfeited_by``). Not an
      inconclusive one's.
    * Every verdict leaves the node's track record (``_uncount``), which drives its audit rate
      and ejection: its counter one less, and the run of verified valid results counted again
      without it.
    * A fraud verdict's sanctions that no longer stand (``_lift_sanctions``): the verifier's
      ejection of the node once its strikes in the pool are below ``strikes_before_ejection``,
      the verifier's blacklisting of the provider once its nodes' strikes in the pool are below
      ``strikes_before_provider_ban``. An operator's ejection or blacklisting, and a ban's
      ejection, stay.

    Lock order: the verdict, the membership, then every account the appeal may touch, the
    node's track record (after the accounts, as the verifier locks it), and only then the holds
    and forfeits, whose state decides what moves: a reward release or a verdict committing
    meanwhile holds those accounts, so it is either wholly before or wholly after. The
    sanctions are lifted last: the membership is locked already, the provider's blacklisting is
    locked after everything else (a verdict that would blacklist the provider again holds the
    provider's accounts, so it is wholly before or after the strikes counted here)."""
    from orchestrator.core.errors import Conflict, NotFound

    actor = principal.token_id

    # FOR NO KEY UPDATE, not FOR UPDATE: a verifier holding this provider's accounts may write a
    # notice naming this verdict (a fraud verdict withdrawing its window), whose foreign key
    # check takes a key-share lock on it. A FOR UPDATE here would make that check wait for this
    # appeal while the appeal waits for the verifier's accounts: a deadlock. Two appeals of the
    # verdict still wait for each other.
    verdict = await session.get(Verdict, verdict_id, with_for_update={"key_share": True})
    if verdict is None:
        raise NotFound("no verdict with this id", code="verdict_not_found")
    if verdict.reversed_at is not None:
        return verdict, False
    fraud = verdict.category == "fraud"
    membership = await _membership(session, verdict.pool_id, verdict.node_id) if fraud else None
    await _lock_for_appeal(session, verdict)
    # After the accounts, before the holds: the order in which the verifier locks them.
    trust = await session.get(NodeTrust, (verdict.pool_id, verdict.node_id), with_for_update=True)
    memo = f"appeal: {reason}"
    try:
        locked_back, unbonding_back = (
            await _reverse_stake_slash(session, verdict, actor=actor, memo=memo) if fraud else (0, 0)
        )
        await _give_back_forfeits(session, verdict, actor=actor, memo=memo)
        await _reverse_reward(session, verdict, actor=actor, memo=memo)
        await _pay_on_appeal(session, verdict, actor=actor, memo=memo, now=now)
    except ledger.InsufficientFunds as exc:
        raise Conflict(
            "the verdict's money has moved on (e.g. the reward was withdrawn); it cannot be reversed",
            code="reversal_impossible",
        ) from exc
    if fraud:
        await _restore_after_fraud(session, verdict, locked_back, unbonding_back, membership, actor=actor)
    verdict.reversed_at = now
    verdict.reversed_after = await _latest_written(session, verdict)
    verdict.reversal_reason = reason
    if verdict.outcome == "accepted":
        session.add(
            RolloutChange(pool_id=verdict.pool_id, verdict_id=verdict.id, change="reversed", created_at=now)
        )
    await session.flush()
    if trust is not None:
        await _uncount(session, trust, verdict, now=now)
    if fraud:
        await _lift_sanctions(session, verdict, trust, membership, principal=principal, now=now)
        await notify_window(session, verdict, "restored", now=now)
    reversed_ = metrics.VERDICTS_REVERSED.labels(verdict.outcome, verdict.category)
    metrics.on_commit(session, reversed_.inc)
    if verdict.reward_paid_on_appeal > 0:
        metrics.on_commit(session, partial(metrics.REWARDS_PAID_ON_APPEAL.inc, verdict.reward_paid_on_appeal))
    return verdict, True


async def _uncount(session: AsyncSession, trust: NodeTrust, verdict: Verdict, *, now: dt.datetime) -> None:
    """Take the reversed ``verdict`` out of the node's track record, as if it had never been
    decided: its counter (``invalid`` for an inconclusive one too, as ``decide`` counts it) and,
    for fraud, its strike, one less (never below 0); its reward off ``rewards_credited`` (so it
    no longer counts against the pool's budget); and the run of ``consecutive_valid``
    counted again from the node's verdicts in the pool that stand (see ``_standing_run``): an
    appeal of a valid verdict shortens the run it was in, one of the verdict that broke a run
    joins the runs on either side of it again."""
    # What the pool's budget counts: the verdict's reward no longer, what its appeal paid now.
    trust.rewards_credited += verdict.reward_paid_on_appeal - verdict.reward_amount
    if verdict.category == "valid":
        trust.valid = max(0, trust.valid - 1)
    elif verdict.category == "fraud":
        trust.fraud = max(0, trust.fraud - 1)
        trust.strikes = max(0, trust.strikes - 1)
    else:
        trust.invalid = max(0, trust.invalid - 1)
    trust.consecutive_valid = await _standing_run(session, verdict.pool_id, verdict.node_id)
    trust.updated_at = now
    await session.flush()


async def _provider_strikes(session: AsyncSession, pool_id: str, provider_id: str) -> int:
    """The fraud strikes of the provider's nodes in the pool: what its provider ban counts. The
    session is flushed first (autoflush is off): a strike just given or taken back on a
    ``NodeTrust`` in it counts."""
    await session.flush()
    total = await session.scalar(
        select(func.coalesce(func.sum(NodeTrust.strikes), 0)).where(
            NodeTrust.pool_id == pool_id, NodeTrust.provider_id == provider_id
        )
    )
    return int(total or 0)


async def _lift_sanctions(
    session: AsyncSession,
    verdict: Verdict,
    trust: NodeTrust | None,
    membership: PoolMembership | None,
    *,
    principal: Principal,
    now: dt.datetime,
) -> None:
    """After a fraud verdict's appeal took its strike back: the verifier's ejection of the node
    is lifted if the node's strikes in the pool are below the pool's ``strikes_before_ejection``
    (the membership becomes ``left``: the node may join again, with new stake), and the
    verifier's blacklisting of the provider is removed if its nodes' strikes in the pool are
    below ``strikes_before_provider_ban`` (its nodes the blacklisting removed are ``left``
    already, and may join again). An operator's ejection or blacklisting, and a ban's ejection,
    are not the verifier's and stay; so do sanctions still covered by the strikes that stand."""
    from orchestrator.pools import service as pools_service

    pool = await session.get(Pool, verdict.pool_id)
    assert pool is not None
    why = f"fraud verdict {verdict.id} reversed on appeal"
    strikes = trust.strikes if trust is not None else 0
    if membership is not None and strikes < pool.strikes_before_ejection:
        await pools_service.lift_fraud_ejection(session, principal, membership, reason=why, now=now)
    if await _provider_strikes(session, pool.id, verdict.provider_id) < pool.strikes_before_provider_ban:
        await pools_service.lift_fraud_blacklisting(
            session, principal, pool.id, verdict.provider_id, reason=why
        )


async def _standing_run(session: AsyncSession, pool_id: str, node_id: str) -> int:
    """The node's verified valid verdicts in the pool since its latest rejected one, leaving out
    reversed verdicts: what ``decide`` would have counted in ``consecutive_valid`` had they never
    been decided. A valid verdict that verified nothing (``_verified``: accepted unchecked and
    unaudited) neither adds to the run nor breaks it. Verdicts are never deleted, so every one
    that stands is counted; the run is by verdict id, where ``decide`` counted in the order it
    took the trust row, which differs only when a verdict written outside the verifier's tick
    (a housekeeping ``task_abandoned``) took it after a later id. Not by ``decided_at``: that is
    a batch's clock when it began, before it waited for the node's membership lock, under which
    the node's verdicts take their ids (``lock_for_verdicts``), so a batch that began earlier
    may write later."""
    standing = (Verdict.pool_id == pool_id, Verdict.node_id == node_id, Verdict.reversed_at.is_(None))
    last_break = select(func.max(Verdict.id)).where(*standing, Verdict.category != "valid").scalar_subquery()
    verified = or_(Verdict.verifier.in_(("quorum", "validator")), Verdict.server_reward.is_not(None))
    run = await session.scalar(
        select(func.count()).where(
            *standing,
            Verdict.category == "valid",
            verified,
            Verdict.id > func.coalesce(last_break, 0),
        )
    )
    return int(run or 0)


async def _lock_for_appeal(session: AsyncSession, verdict: Verdict) -> None:
    """Lock every account an appeal of ``verdict`` may move money between, in one statement:
    the provider's reward (and, for fraud, stake) accounts; the system ``rewards`` and
    ``slashed`` accounts its verdicts use (unsharded, and its verifier partition's); and any
    other account that the verdict's transfers and the forfeits it is party to name, and, for a
    rejection its appeal pays, the forfeits of the node's fraud and invalid verdicts written
    after it (``written_after``). The forfeits are read before the locks and again under them,
    where they cannot grow (a verdict of the node's, or another appeal's forfeit, is written
    holding the provider's ``rewards_pending``): one committed in between, say a quorum's
    verdict decided in another partition's verifier lane into that lane's slashed account, is
    found by the second read, and the locks taken since a savepoint are given back (PostgreSQL
    releases them when it is rolled back) and taken again with its account, all in id order.
    The set only grows, and there are few slashed accounts, so this ends."""
    provider = verdict.provider_id
    refs = [
        provider_account(provider, k)
        for k in (ProviderAccount.rewards_pending, ProviderAccount.rewards_claimable)
    ]
    if verdict.category == "fraud":
        refs += ledger.stake_accounts(provider)
    for shard in sorted({0, partition_of(provider)}):
        refs += [system_account(SystemAccount.rewards, shard), system_account(SystemAccount.slashed, shard)]
    transfers = (
        await session.execute(
            select(LedgerTransfer.debit_account_id, LedgerTransfer.credit_account_id).where(
                LedgerTransfer.reference_type == "verdict", LedgerTransfer.reference_id == str(verdict.id)
            )
        )
    ).all()
    hold_ids = select(RewardHold.id).where(RewardHold.verdict_id == verdict.id).scalar_subquery()
    # The slashed accounts of the forfeits of the node's fraud and invalid verdicts written
    # after it, which its payment's replay gives back from or adds to (``_give_back_on_appeal``):
    # one decided in another partition's verifier lane (a quorum's) used that lane's.
    window = select(Verdict.id).where(
        Verdict.node_id == verdict.node_id,
        Verdict.pool_id == verdict.pool_id,
        Verdict.category.in_(PAID_ON_APPEAL),
        written_after(verdict),
    )
    forfeits_query = (
        select(RewardForfeit.slashed_account_id)
        .where(
            or_(
                RewardForfeit.verdict_id == verdict.id,
                RewardForfeit.hold_id == hold_ids,
                RewardForfeit.verdict_id.in_(window)
                if verdict.outcome == "rejected" and verdict.category in PAID_ON_APPEAL
                else false(),
            )
        )
        .distinct()
    )
    forfeits = set((await session.execute(forfeits_query)).scalars())
    # A retired provider's heir received its released rewards (``_reverse_reward`` takes one back
    # from there): the heir's claimable rewards too, and a retirement that changed the heir while
    # this waited sends the appeal again (503 transient_conflict), as other requests.
    heir = await heirs(session, [provider])
    refs += [provider_account(h, ProviderAccount.rewards_claimable) for h in heir.values()]
    while True:
        savepoint = await session.begin_nested()
        await ledger.lock_accounts(session, refs, ids=[*(i for pair in transfers for i in pair), *forfeits])
        grown = set((await session.execute(forfeits_query)).scalars()) - forfeits
        if not grown:
            await savepoint.commit()
            break
        await savepoint.rollback()
        forfeits |= grown
    if await heirs(session, [provider]) != heir:
        raise succession.heir_changed()


async def _reverse_stake_slash(
    session: AsyncSession, verdict: Verdict, *, actor: str, memo: str
) -> tuple[int, int]:
    """The fraud verdict's stake slashes, reversed: returns what they took from locked stake and
    what from stake unbonding (back there now), 0 and 0 if none. A slash of a live membership
    takes from its locked stake (keyed ``slash-stake``) and what that lacks from its earlier
    episodes' stake unbonding (``slash-unbonding``); an ended one's, from unbonding only
    (``slash-stake``)."""
    locked = unbonding = 0
    keys = ("submission:{submission_id}:slash-stake", UNBONDING_SLASH_KEY)
    for key in keys:
        slash = await ledger.by_key(session, key.format(submission_id=verdict.submission_id))
        if slash is None:
            continue
        await ledger.reverse(
            session, slash.id, key=f"verdict:{verdict.id}:reverse:{slash.id}", actor=actor, memo=memo
        )
        debit = await ledger.account_ref(session, slash.debit_account_id)
        if debit.kind == ProviderAccount.stake_unbonding.value:
            unbonding += slash.amount
        else:
            locked += slash.amount
    return locked, unbonding


async def _give_back_forfeits(session: AsyncSession, verdict: Verdict, *, actor: str, memo: str) -> None:
    """The verdict's forfeits still in force go back to the provider: to pending for a hold
    still on hold (a wholly forfeited one is ``held`` again), to claimable for one released
    meanwhile. A forfeit whose rewarded verdict was reversed since is ``returned`` already."""
    forfeits = list(
        (
            await session.execute(
                select(RewardForfeit)
                .where(RewardForfeit.verdict_id == verdict.id, RewardForfeit.status == "forfeited")
                .order_by(RewardForfeit.hold_id)
                .with_for_update()
                .execution_options(populate_existing=True)
            )
        ).scalars()
    )
    if not forfeits:
        return
    holds = await _holds_by_id(session, [f.hold_id for f in forfeits])
    back: dict[tuple[int, ProviderAccount], int] = {}
    for forfeit in forfeits:
        hold = holds[forfeit.hold_id]
        to = (
            ProviderAccount.rewards_claimable
            if hold.status == "released"
            else ProviderAccount.rewards_pending
        )
        hold.forfeited_amount -= forfeit.amount
        if hold.status == "forfeited":
            hold.status = "held"
        forfeit.status = "restored"
        back[(forfeit.slashed_account_id, to)] = (
            back.get((forfeit.slashed_account_id, to), 0) + forfeit.amount
        )
    for (slashed_account_id, to), amount in sorted(back.items()):
        await ledger.transfer_in_parts(
            session,
            debit=await ledger.account_ref(session, slashed_account_id),
            credit=provider_account(verdict.provider_id, to),
            amount=amount,
            key=f"verdict:{verdict.id}:reverse:restore:{slashed_account_id}:{to.value}",
            reason="forfeit_restore",
            actor=actor,
            memo=memo,
            reference=("verdict", str(verdict.id)),
        )


async def _reverse_reward(session: AsyncSession, verdict: Verdict, *, actor: str, memo: str) -> None:
    """Take a rewarded verdict's reward back to the system account that paid it, from where
    each part of it is now (see ``reverse_verdict``)."""
    reward = await ledger.by_key(session, f"submission:{verdict.submission_id}:reward")
    if reward is None:
        return
    hold = (
        await session.execute(
            select(RewardHold)
            .where(RewardHold.verdict_id == verdict.id)
            .with_for_update()
            .execution_options(populate_existing=True)
        )
    ).scalar_one_or_none()
    key = f"verdict:{verdict.id}:reverse"
    if hold is None:  # every reward has its hold; without one, the reward is all in pending
        await ledger.reverse(session, reward.id, key=f"{key}:{reward.id}", actor=actor, memo=memo)
        return
    provider = verdict.provider_id
    pending = provider_account(provider, ProviderAccount.rewards_pending)
    system_rewards = await ledger.account_ref(session, reward.debit_account_id)
    share = hold.amount - hold.forfeited_amount  # the provider's part; 0 if wholly forfeited
    if hold.status == "released" and share > 0:
        heir = (await heirs(session, [provider])).get(provider)  # read under the appeal's locks
        # A retired provider's claimable rewards hold, at rest, only what reached them since the
        # last sweep (a forfeit given back after the release, say), which is on its way to the
        # heir: the heir gives back what they lack.
        lacking = share
        if heir is not None:
            held_here = (await ledger.provider_balances(session, provider))[ProviderAccount.rewards_claimable]
            lacking = max(0, share - held_here)
        if heir is not None and lacking > 0:
            # A retired provider's released reward went on to its heir (at the release, or with
            # its claimable rewards at the retirement; down a chain of retirements to the last
            # heir): the heir gives back what it received, as the provider would have, and the
            # reversal goes on from the provider's claimable rewards as for any provider.
            await ledger.transfer(
                session,
                debit=provider_account(heir, ProviderAccount.rewards_claimable),
                credit=provider_account(provider, ProviderAccount.rewards_claimable),
                amount=lacking,
                key=f"{key}:succession",
                reason=f"reversal:{succession.REASON}",
                actor=actor,
                memo=memo,
                reference=("verdict", str(verdict.id)),
            )
        release = await ledger.by_key(session, f"reward-hold:{hold.id}:release")
        released = release.amount if release is not None else 0
        if release is not None:
            await ledger.reverse(session, release.id, key=f"{key}:{release.id}", actor=actor, memo=memo)
        if share > released:  # forfeits given back to claimable after the release
            await ledger.transfer(
                session,
                debit=provider_account(provider, ProviderAccount.rewards_claimable),
                credit=pending,
                amount=share - released,
                key=f"{key}:claimable",
                reason="reversal:forfeit_restore",
                actor=actor,
                memo=memo,
                reference=("verdict", str(verdict.id)),
            )
    if hold.status in ("held", "released") and share > 0:
        if share == reward.amount:
            await ledger.reverse(session, reward.id, key=f"{key}:{reward.id}", actor=actor, memo=memo)
        else:  # the rest of the reward was forfeited: only the provider's part is taken back
            await ledger.transfer(
                session,
                debit=pending,
                credit=system_rewards,
                amount=share,
                key=f"{key}:{reward.id}",
                reason=f"reversal:{reward.reason}",
                actor=actor,
                memo=memo,
                reference=("transfer", str(reward.id)),
                reverses=reward.id,
            )
    for forfeit in await _live_forfeits_of(session, hold.id):
        # Forfeited by another verdict: in a slashed account, not the provider's. It goes back
        # to the system account that paid the reward; that verdict's appeal gives nothing back.
        await ledger.transfer(
            session,
            debit=await ledger.account_ref(session, forfeit.slashed_account_id),
            credit=system_rewards,
            amount=forfeit.amount,
            key=f"{key}:forfeit:{forfeit.id}",
            reason="forfeit_return",
            actor=actor,
            memo=memo,
            reference=("verdict", str(verdict.id)),
        )
        forfeit.status = "returned"
    hold.forfeited_amount = 0
    hold.status = "reversed"


#: The key of a forfeit of what the appeal of ``verdict_id`` paid, taken at once by a verdict of
#: the result's window (``forfeiter``; ``_pay_on_appeal``). Before penalties took part in it, the
#: one fraud verdict's was ``verdict:{verdict_id}:reverse:reward:forfeit`` (a prefix of this).
APPEAL_FORFEIT_KEY = "verdict:{verdict_id}:reverse:reward:forfeit:{forfeiter}"

# A rejection whose appeal pays the reward an acceptance would have: the node was judged wrongly.
# An inconclusive verdict judged nothing against the node, and nobody judged its answers right.
PAID_ON_APPEAL = ("invalid", "fraud")


async def _pay_on_appeal(
    session: AsyncSession, verdict: Verdict, *, actor: str, memo: str, now: dt.datetime
) -> None:
    """A fraud or invalid verdict reversed on appeal pays what ``decide`` would have credited
    had it accepted the result: the rate recorded with the result (else the pool's now) x the
    samples its checks recorded as paid (``correct_samples``: right, or with no reward to check;
    none for a wrong answer), not scored again. A result the server did not score at all pays
    nothing (``_scored``), as an inconclusive verdict's appeal. Paid as an acceptance's reward (``_reward``)
    from the system ``rewards`` account to the provider's ``rewards_pending``, whatever became
    of the membership since, with a ``RewardHold`` of the verdict's (it has none: it was
    rejected) held as that acceptance's reward would have been: to the end of the result's own
    hold window, ``reward_hold_s`` (as recorded) after the verdict was decided, not after the
    appeal. So a window that has passed makes it due at once (the release loop's next tick makes
    it claimable; no later verdict takes it), and the node's verdicts written after it
    (``written_after``: by id, not ``decided_at``) and decided within the window (by time) that
    would have forfeited some of that reward (``_appeal_forfeits``: a fraud verdict all of it, a
    soft-invalid penalty what it would have taken of it, oldest first, giving back what it took
    of later rewards instead, ``_give_back_on_appeal``) forfeit it now, each as its own forfeit
    of a reward on hold (a ``RewardForfeit`` of its, which its appeal gives back;
    ``reward_forfeited_by`` names the fraud verdict); one written after the appeal within the
    window forfeits it as any held reward. The caller holds the verdict and the accounts
    (``_lock_for_appeal``), so a fraud or invalid
    verdict of the node's written meanwhile is wholly before this (read here) or wholly after
    (it finds the hold); the transfers' keys make them once."""
    if verdict.outcome != "rejected" or verdict.category not in PAID_ON_APPEAL:
        return
    submission = await session.get(Submission, verdict.submission_id)
    job = (
        await session.execute(
            select(VerificationJob).where(VerificationJob.submission_id == verdict.submission_id)
        )
    ).scalar_one_or_none()
    pool = await session.get(Pool, verdict.pool_id)
    assert submission is not None
    assert pool is not None
    samples = (job.correct_samples or 0) if job is not None and _scored(job) else 0
    amount = _or(submission.reward_per_sample, pool.reward_per_sample) * samples
    if amount <= 0:
        return
    window_end = verdict.decided_at + dt.timedelta(seconds=_or(submission.reward_hold_s, pool.reward_hold_s))
    hold = await _credit_held(
        session,
        verdict,
        amount,
        debit=system_account(SystemAccount.rewards),  # the unsharded one, which the appeal locked
        key=f"verdict:{verdict.id}:reverse:reward",
        actor=actor,
        memo=memo,
        release_at=window_end,
        now=now,
    )
    verdict.reward_paid_on_appeal = amount
    replayed = await _appeal_forfeits(session, verdict, pool, window_end, amount)
    await _give_back_on_appeal(session, verdict, replayed.give_back, actor=actor, memo=memo, now=now)
    if not replayed.takes:
        return
    await session.flush()  # the hold's id, for its forfeits
    forfeited = 0
    for forfeiter, take in replayed.takes:
        fraud = forfeiter.category == "fraud"
        forfeited += await _forfeit(
            session,
            forfeiter,
            [(hold, take)],
            reason="slash_pending_rewards" if fraud else "soft_invalid_penalty",
            key=APPEAL_FORFEIT_KEY.format(verdict_id=verdict.id, forfeiter=forfeiter.id),
            memo=f"{forfeiter.category}: {forfeiter.reason} (within the hold window of verdict {verdict.id}, "
            "paid on appeal)",
            now=now,
            actor=actor,
            slashed=system_account(SystemAccount.slashed),  # the unsharded one, which the appeal locked
        )
        if fraud and verdict.reward_forfeited_by is None:
            verdict.reward_forfeited_by = forfeiter.id
    metrics.on_commit(session, partial(metrics.SLASHED.inc, forfeited))


def written_after(verdict: Verdict) -> ColumnElement[bool]:
    """The node's verdicts written after ``verdict``: by id. Every verdict that moves the node's
    money is written only once its transaction holds the node's membership
    (``lock_for_verdicts``), wherever it was decided (the node's verifier lane, another
    provider's lane for a quorum's, a validator's post, an expired quorum wait), so the node's
    verdict ids follow the order the verdicts were written in, which is the order the money
    followed: a fraud verdict forfeits the holds that exist when it is written (``_punish``,
    ``_held``). Not by ``decided_at``: that is a batch's clock when it began, before it waited
    for that lock, so a batch that began earlier may write later."""
    return Verdict.id > verdict.id


async def _latest_written(session: AsyncSession, verdict: Verdict) -> int:
    """The id of the node's latest verdict in the pool: where an appeal reversing ``verdict``
    now comes in the order the node's money saw its verdicts (``written_after``), recorded as
    ``reversed_after`` (``_replay_order``). Read under the appeal's locks: the provider's
    ``rewards_pending`` account (``_lock_for_appeal``), which every transaction writing a
    verdict of the node's holds from before it writes the first (``lock_for_verdicts``), so
    each of the node's verdicts is written wholly before this read (and counted) or wholly after
    the appeal (with a greater id). Not by time: ``decided_at`` is read before a batch waits for
    those locks, so a decision dated before the appeal may be written after it."""
    latest = await session.scalar(
        select(func.max(Verdict.id)).where(
            Verdict.node_id == verdict.node_id, Verdict.pool_id == verdict.pool_id
        )
    )
    return max(int(latest or 0), verdict.id)


def _replay_order(decisions: list[Verdict]) -> list[tuple[bool, Verdict]]:
    """The decisions of ``decisions`` and their reversals as the node's money saw them:
    (reversal, verdict), the decisions in the order they were written (by id, ``written_after``),
    each reversal after the latest verdict of the node's written before it (``reversed_after``,
    ``_latest_written``; so before every decision written after it), reversals in the same place
    by ``reversed_at``, then id (the order of two reversals with no decision between them moves
    nothing). Reversals before revision 0045 keep the place their ``reversed_at`` gave them
    then (see ``Verdict.reversed_after``; ``_place_by_time`` for those still unplaced)."""
    events: list[tuple[tuple[int, int, dt.datetime, int], bool, Verdict]] = []
    for v in decisions:
        events.append(((v.id, 0, v.decided_at, v.id), False, v))
        if v.reversed_at is not None:
            assert v.reversed_after is not None  # set with reversed_at, else by _place_by_time
            events.append(((v.reversed_after, 1, v.reversed_at, v.id), True, v))
    return [(reversal, v) for _, reversal, v in sorted(events, key=lambda e: e[0])]


async def _place_by_time(session: AsyncSession, verdicts: list[Verdict]) -> None:
    """Give each reversal of ``verdicts`` that has no ``reversed_after`` the place its time gave
    it before revision 0045, as the migration's backfill did: after the latest fraud or invalid
    verdict of the node's in the pool dated no later than ``reversed_at``, or its own verdict if
    that is later. Such a reversal was written after the backfill by the release before 0045,
    which a rolling upgrade leaves serving for a while on the schema its migration job has
    already upgraded (README, Kubernetes). For this replay only (not written: the row is not
    this appeal's to lock), as that release itself replays it."""
    for v in {v.id: v for v in verdicts}.values():
        if v.reversed_at is None or v.reversed_after is not None:
            continue
        slot = await session.scalar(
            select(func.max(Verdict.id)).where(
                Verdict.node_id == v.node_id,
                Verdict.pool_id == v.pool_id,
                Verdict.category.in_(("fraud", "invalid")),
                Verdict.decided_at <= v.reversed_at,
            )
        )
        set_committed_value(v, "reversed_after", max(int(slot or 0), v.id))


@dataclass
class _Replayed:
    """What the node's verdicts of a result's window hold of its appeal's payment
    (``_appeal_forfeits``): ``takes``, (verdict, amount) in the order they took it; and
    ``give_back``, (forfeit, amount, fraud): the parts of standing penalties' forfeits of rewards
    later in the hold order than the payment's that those penalties would not have taken, had
    the result been accepted, because they would have taken them from the payment instead; each
    with the standing fraud verdict that would then have forfeited that part (``None``: none
    would have, the node keeps it)."""

    takes: list[tuple[Verdict, int]]
    give_back: list[tuple[RewardForfeit, int, Verdict | None]]


async def _appeal_forfeits(
    session: AsyncSession, verdict: Verdict, pool: Pool, window_end: dt.datetime, amount: int
) -> _Replayed:
    """What the node's verdicts in the pool written after ``verdict`` (``written_after``: an
    acceptance in its place would have held the reward when they were written) and decided
    before ``window_end`` (the window as ``_held`` counts it, by time) would hold now of
    ``amount``, had the verdict accepted its result and held that reward to ``window_end``: their
    decisions and reversals replayed on it in the order the node's money saw them
    (``_replay_order``: decisions by id, each reversal placed among them). A fraud verdict takes
    all that is left of it (``_punish``). An invalid one I takes what ``_penalise`` would have
    taken of it, by the holds I took from: oldest first (by ``release_at``, then by the
    ``decided_at`` and id of the hold's verdict, as ``_held`` orders them: the payment's hold is
    placed where an acceptance would have created it), so I takes from the payment its penalty
    (recorded with its result, else the pool's now) less what I took of rewards before the
    payment in that order, up to what is left of it. What I took of rewards after it, beyond its
    penalty's shortfall, I would not have taken: where that forfeit is in force it is given back
    to the node (``give_back``), the latest in the order first; where its reward was reversed
    since, nothing moves (the node lost that reward either way). A part of a forfeit whose reward
    a fraud verdict written after I and decided within that reward's window would then have
    forfeited, goes to that verdict if it stands (its appeal gives it back, as it would have
    given back what it took of that reward), to the node if its appeal would have given it back
    already (``_fraud_holding``).
    So the node is left what an acceptance from the start would have left it. An appeal of a
    verdict gives back what it took, which a later decision may take again. Returns the
    verdicts that stand with what they hold, in the order they took it (none for a decision and
    an appeal placed together: the decision first, the node's way). Read under the
    accounts' locks, which a verdict's forfeits and an appeal of one hold too."""
    rows = list(
        (
            await session.execute(
                select(Verdict)
                .where(
                    Verdict.node_id == verdict.node_id,
                    Verdict.pool_id == verdict.pool_id,
                    Verdict.category.in_(("fraud", "invalid")),
                    written_after(verdict),
                    Verdict.decided_at < window_end,
                )
                .order_by(Verdict.id)
            )
        ).scalars()
    )
    if not rows:
        return _Replayed([], [])
    # Where a hold comes in the order ``_penalise`` takes from: its release, then its verdict's
    # decision (an acceptance creates its hold as it decides).
    Place = tuple[dt.datetime, dt.datetime, int]
    place: Place = (window_end, verdict.decided_at, verdict.id)
    penalties: dict[int, int | None] = {}
    forfeits: dict[int, list[tuple[RewardForfeit, RewardHold, Place]]] = {}
    frauds_after: list[Verdict] = []
    penalised = [v.id for v in rows if v.category == "invalid"]
    if penalised:
        recorded = await session.execute(
            select(Verdict.id, Submission.soft_invalid_penalty)
            .join(Submission, Submission.id == Verdict.submission_id)
            .where(Verdict.id.in_(penalised))
        )
        penalties = dict(recorded.all())
        rewarded = aliased(Verdict)
        found = await session.execute(
            select(RewardForfeit, RewardHold, rewarded.decided_at, rewarded.id)
            .join(RewardHold, RewardHold.id == RewardForfeit.hold_id)
            .join(rewarded, rewarded.id == RewardHold.verdict_id)
            .where(RewardForfeit.verdict_id.in_(penalised))
            .order_by(RewardForfeit.id)
        )
        for forfeit, hold, decided_at, rewarded_id in found.all():
            forfeits.setdefault(forfeit.verdict_id, []).append(
                (forfeit, hold, (hold.release_at, decided_at, rewarded_id))
            )
        # Reversed ones too: one that held a part until its appeal kept a later one from it.
        found_frauds = await session.execute(
            select(Verdict).where(
                Verdict.node_id == verdict.node_id,
                Verdict.pool_id == verdict.pool_id,
                Verdict.category == "fraud",
                written_after(verdict),
            )
        )
        frauds_after = list(found_frauds.scalars())
    await _place_by_time(session, rows + frauds_after)
    left = amount
    holding: dict[int, tuple[Verdict, int]] = {}
    give_back: list[tuple[RewardForfeit, int, Verdict | None]] = []
    for reversal, v in _replay_order(rows):
        if reversal:
            left += holding.pop(v.id, (v, 0))[1]
            continue
        if v.category == "fraud":
            take = left
        else:
            standing = v.reversed_at is None
            # What it took that stands as taken: a forfeit of a standing penalty that an appeal
            # gave back (``restored``) is taken no more; a reversed one's were all restored by it.
            taken = [
                (f, h, at) for f, h, at in forfeits.get(v.id, []) if not standing or f.status != "restored"
            ]
            penalty = _or(penalties.get(v.id), pool.soft_invalid_penalty)
            before = sum(f.amount for f, _, at in taken if at < place)
            take = min(left, max(0, penalty - before))
            # Beyond the shortfall: what it took of later rewards that it would not have.
            excess = take - max(0, penalty - sum(f.amount for f, _, _ in taken))
            for f, h, at in sorted(taken, key=lambda t: t[2], reverse=True):
                if excess <= 0 or not standing:
                    break
                if at < place:
                    continue
                part = min(f.amount, excess)
                excess -= part
                if f.status == "forfeited":
                    give_back.append((f, part, _fraud_holding(v, h, frauds_after)))
        if take > 0:
            holding[v.id] = (v, take)
            left -= take
    return _Replayed(list(holding.values()), give_back)


def _fraud_holding(penalty: Verdict, hold: RewardHold, frauds: list[Verdict]) -> Verdict | None:
    """The fraud verdict of ``frauds`` that would hold a part of ``hold`` now, had ``penalty``
    not taken it: the node's fraud verdicts written after the penalty (by id) and decided within
    the hold's window (by time), and their reversals, replayed on it in the order the node's
    money saw them (``_replay_order``): a fraud verdict takes it
    if the node holds it, an appeal of the one that holds it gives it back to the node.
    ``None``: the node."""
    after = [f for f in frauds if penalty.id < f.id and f.decided_at < hold.release_at]
    holder: Verdict | None = None
    for reversal, fraud in _replay_order(after):
        if not reversal and holder is None:
            holder = fraud
        elif reversal and holder is fraud:
            holder = None
    return holder


async def penalised_on_appeal(session: AsyncSession, verdict: Verdict) -> list[tuple[int, int, str]]:
    """(invalid verdict, amount, status) of each soft-invalid penalty's forfeit of what the
    appeal of ``verdict`` paid (its own ``RewardHold``, which only that payment gives a rejected
    verdict), oldest first; none if it paid nothing."""
    if verdict.category not in PAID_ON_APPEAL or verdict.reward_paid_on_appeal <= 0:
        return []
    forfeiter = aliased(Verdict)
    rows = await session.execute(
        select(RewardForfeit.verdict_id, RewardForfeit.amount, RewardForfeit.status)
        .join(RewardHold, RewardHold.id == RewardForfeit.hold_id)
        .join(forfeiter, forfeiter.id == RewardForfeit.verdict_id)
        .where(RewardHold.verdict_id == verdict.id, forfeiter.category == "invalid")
        .order_by(RewardForfeit.id)
    )
    return [(int(v), int(a), str(st)) for v, a, st in rows.all()]


#: The key of what the appeal of ``verdict_id`` gave back of a standing penalty's ``forfeit`` of
#: a later reward, which the penalty takes from the appeal's payment instead (``_appeal_forfeits``).
APPEAL_GIVE_BACK_KEY = "verdict:{verdict_id}:reverse:reward:give-back:{forfeit}"


async def _give_back_on_appeal(
    session: AsyncSession,
    verdict: Verdict,
    give_back: list[tuple[RewardForfeit, int, Verdict | None]],
    *,
    actor: str,
    memo: str,
    now: dt.datetime,
) -> None:
    """Give back ``amount`` of each ``(forfeit, amount)`` (``_appeal_forfeits``) to the provider:
    from the slashed account the forfeit went to, to pending for a reward still on hold (held
    again if it was wholly forfeited), to claimable for one released meanwhile. The forfeit is
    that much less (``restored`` when nothing is left of it), so that its verdict's appeal gives
    back only the rest. A part that a standing fraud verdict would have forfeited had the penalty
    not taken it is forfeited to that verdict at once, as its own forfeit of the hold (into the
    unsharded slashed account, key ``APPEAL_FORFEIT_KEY`` and ``:from:<forfeit id>``), which its
    appeal gives back."""
    if not give_back:
        return
    holds = await _holds_by_id(session, sorted({f.hold_id for f, _, _ in give_back}))
    locked = {
        f.id: f
        for f in (
            await session.execute(
                select(RewardForfeit)
                .where(RewardForfeit.id.in_([f.id for f, _, _ in give_back]))
                .order_by(RewardForfeit.id)
                .with_for_update()
                .execution_options(populate_existing=True)
            )
        ).scalars()
    }
    for given, part, fraud in give_back:
        forfeit = locked[given.id]
        hold = holds[forfeit.hold_id]
        to = (
            ProviderAccount.rewards_claimable
            if hold.status == "released"
            else ProviderAccount.rewards_pending
        )
        await ledger.transfer(
            session,
            debit=await ledger.account_ref(session, forfeit.slashed_account_id),
            credit=provider_account(hold.provider_id, to),
            amount=part,
            key=APPEAL_GIVE_BACK_KEY.format(verdict_id=verdict.id, forfeit=forfeit.id),
            reason="forfeit_restore",
            actor=actor,
            memo=f"{memo} (the penalty of verdict {forfeit.verdict_id} takes it from what the appeal of "
            f"verdict {verdict.id} paid)",
            reference=("verdict", str(forfeit.verdict_id)),
        )
        if part >= forfeit.amount:
            forfeit.status = "restored"
        else:
            forfeit.amount -= part
        if fraud is not None:
            await _hand_to_fraud(
                session, verdict, fraud, hold, part, to, source=forfeit, actor=actor, memo=memo, now=now
            )
            continue  # the hold's forfeited amount and status stay as they are
        hold.forfeited_amount -= part
        if hold.status == "forfeited":
            hold.status = "held"


async def _hand_to_fraud(
    session: AsyncSession,
    verdict: Verdict,
    fraud: Verdict,
    hold: RewardHold,
    amount: int,
    at: ProviderAccount,
    *,
    source: RewardForfeit,
    actor: str,
    memo: str,
    now: dt.datetime,
) -> None:
    """``amount`` of ``hold`` that the appeal of ``verdict`` took off ``source`` (a forfeit of
    another verdict's, or of ``verdict``'s own) and credited to the provider's ``at`` account,
    which the standing ``fraud`` verdict would have forfeited had ``source``'s verdict not taken
    it (``_fraud_holding``): forfeited to it now, as its own forfeit of the hold (added to the
    one it took of the hold's rest if any, into the same slashed account; else into the
    unsharded one, which the appeal locked), which its appeal gives back. The hold's forfeited
    amount and status stay as they were. Key ``APPEAL_FORFEIT_KEY`` and ``:from:<forfeit id>``."""
    held = (
        await session.execute(
            select(RewardForfeit)
            .where(RewardForfeit.verdict_id == fraud.id, RewardForfeit.hold_id == hold.id)
            .with_for_update()
            .execution_options(populate_existing=True)
        )
    ).scalar_one_or_none()
    into = (
        await ledger.account_ref(session, held.slashed_account_id)
        if held is not None
        else system_account(SystemAccount.slashed)
    )
    moved = await ledger.transfer(
        session,
        debit=provider_account(hold.provider_id, at),
        credit=into,
        amount=amount,
        key=APPEAL_FORFEIT_KEY.format(verdict_id=verdict.id, forfeiter=fraud.id) + f":from:{source.id}",
        reason="slash_pending_rewards",
        actor=actor,
        memo=f"fraud: {fraud.reason} (what verdict {source.verdict_id} took of this reward, which "
        f"verdict {fraud.id} would have forfeited; {memo})",
        reference=("verdict", str(fraud.id)),
    )
    if held is not None:
        held.amount += amount
    else:
        session.add(
            RewardForfeit(
                verdict_id=fraud.id,
                hold_id=hold.id,
                amount=amount,
                slashed_account_id=moved.transfer.credit_account_id,
                status="forfeited",
                created_at=now,
            )
        )


# Findings that mean the server never scored the result: its reward function failed
# (``reward_unscorable``, ``reward_invalid``, ``reward_unavailable``: category inconclusive), or a
# sample came without its text. Its samples then have no reward because nothing looked at them,
# not because there was nothing to check them against, and ``correct_samples`` counts them.
NOT_SCORED = "completion_missing"


def _scored(job: VerificationJob) -> bool:
    """Whether the server scored the job's result (see ``NOT_SCORED``), as its checks recorded."""
    return not any(
        f.get("category") == "inconclusive" or f.get("code") == NOT_SCORED for f in job.findings or []
    )


async def _holds_by_id(session: AsyncSession, ids: list[int]) -> dict[int, RewardHold]:
    stmt = (
        select(RewardHold)
        .where(RewardHold.id.in_(ids))
        .order_by(RewardHold.id)
        .with_for_update()
        .execution_options(populate_existing=True)
    )
    return {h.id: h for h in (await session.execute(stmt)).scalars()}


async def _live_forfeits_of(session: AsyncSession, hold_id: int) -> list[RewardForfeit]:
    stmt = (
        select(RewardForfeit)
        .where(RewardForfeit.hold_id == hold_id, RewardForfeit.status == "forfeited")
        .order_by(RewardForfeit.id)
        .with_for_update()
        .execution_options(populate_existing=True)
    )
    return list((await session.execute(stmt)).scalars())


async def _membership(session: AsyncSession, pool_id: str, node_id: str) -> PoolMembership | None:
    return (
        await session.execute(
            select(PoolMembership)
            .where(PoolMembership.pool_id == pool_id, PoolMembership.node_id == node_id)
            .with_for_update()
        )
    ).scalar_one_or_none()


async def _slashed_this_episode(session: AsyncSession, verdict: Verdict, membership: PoolMembership) -> bool:
    """Whether the verdict's stake slash took the stake of the membership's episode still live:
    one that locked its stake before the slash (a join waits for a verdict on its membership, so
    a later episode's lock has a higher transfer id). The stake of an earlier episode was to come
    back when that episode ended; locked into this one, on top of what it locked itself, it
    stayed locked until this one ended too, and could exceed the largest transfer (10^15), which
    then failed every end of the membership."""
    from orchestrator.pools import service as pools_service

    if membership.status not in ("active", "pending"):
        return False
    lock = await ledger.by_key(session, pools_service.lock_key(membership))
    slash = await ledger.by_key(session, f"submission:{verdict.submission_id}:slash-stake")
    return lock is not None and slash is not None and lock.id < slash.id


async def _restore_after_fraud(
    session: AsyncSession,
    verdict: Verdict,
    locked_back: int,
    unbonding_back: int,
    membership: PoolMembership | None,
    *,
    actor: str,
) -> None:
    """Where the stake the appeal gave back (``_reverse_stake_slash``) goes: what was slashed
    from unbonding is free at once, like a release; what was slashed from locked stake is locked
    again for the episode it was slashed from if that is still live, else free."""
    if unbonding_back > 0:
        await ledger.transfer(
            session,
            debit=provider_account(verdict.provider_id, ProviderAccount.stake_unbonding),
            credit=provider_account(verdict.provider_id, ProviderAccount.stake_free),
            amount=unbonding_back,
            key=f"verdict:{verdict.id}:reverse:release",
            reason="stake_release",
            actor=actor,
            reference=("verdict", str(verdict.id)),
        )
    if locked_back <= 0:
        return
    if membership is not None and await _slashed_this_episode(session, verdict, membership):
        membership.stake += locked_back  # locked again for the episode it was slashed from
    else:  # that episode is over (the membership ended, or ended and began again): the stake is free
        await ledger.unlock_stake(
            session,
            verdict.provider_id,
            locked_back,
            key=f"verdict:{verdict.id}:reverse:unlock",
            actor=actor,
            reference=("verdict", str(verdict.id)),
        )
