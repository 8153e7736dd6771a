"""ReST^EM iterations: the E-step as a barrier over one policy step.

An iteration enqueues one task per problem with ``sampling.n`` = N (one lease makes all N
samples: the prompt is prefilled once and its KV cache shared, there is one signed result and
one verification job per problem instead of N, and the verdict's per-sample rewards still say
which samples are right). Tasks carry ``metadata.restem = {iteration_id, problem_id}`` and the
``restem_problems`` table links them for queries.

The iteration is ``running`` until every problem's task is finished (each of its results has a
verdict; a task that failed or was cancelled is finished too), then ``complete``; if its
deadline passes first it is ``expired`` and its still-open tasks are cancelled. While one runs,
no other iteration starts in the pool (409 ``iteration_running``; a partial unique index makes
it hold under races). The status moves lazily, whenever an iteration is read or created, and
through ``advance``, which the verifier (or ``restem.jobs.advance_once``) may call.

Counting a result's samples:

* generated with another policy step than the iteration's -> ``off_policy`` (excluded);
* accepted, or rejected only because no sample was right (``wrong_answer``) -> ``verified``:
  the server checked every sample, so they count in the solve rate; but an accepted sample
  without a server reward (the problem's verification spec gave the reward function nothing
  to check against) -> ``unchecked`` (excluded: neither right nor wrong);
* rejected for any other reason, reversed, withdrawn by a fraud verdict against its node
  (``verification.models.Verdict``), or (expired iterations) decided after the deadline or
  written after the iteration expired (its ``verdict_bound``) -> ``discarded``; no verdict yet
  -> pending (expired iterations: discarded, since that verdict will be written after it).

A problem is done when its task is finished and each of its results has a verdict that counts:
of an expired iteration, one within its cutoff, so that a verdict written late, which completes
the task, does not move ``problems_done`` (nor ``results_verified``) after the expiry.

A sample is correct when its server reward is 1 (ReST^EM's binary reward). The dataset keeps,
per problem, the K correct samples with the smallest SHA-256 of
``"{iteration_id}:{submission_id}:{sample_index}"``: the same samples on every read, and no
preference for fast or early workers. A verdict reversed or withdrawn later drops out and the
next sample in that order takes its place.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import secrets
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import anyio
import structlog
from sqlalchemy import ColumnElement, Row, Select, and_, exists, func, insert, or_, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from api_schemas.restem import (
    IterationIn,
    IterationProgress,
    IterationReport,
    IterationStatus,
    ProblemReport,
    ReportTotals,
    RestemSampling,
)
from api_schemas.tasks import Sampling, TaskBatchIn, TaskIn
from orchestrator.core.digest import body_digests
from orchestrator.core.errors import Conflict, NotFound, UnprocessableEntity
from orchestrator.core.pagination import within_bytes
from orchestrator.core.sql import is_postgres
from orchestrator.feed.service import dumps_line, load_body, sample_rewards, settled_bound
from orchestrator.pools.models import Pool
from orchestrator.restem.models import RestemIteration, RestemProblem
from orchestrator.tasks import service as tasks_service
from orchestrator.tasks.models import Submission, Task
from orchestrator.verification import rewards
from orchestrator.verification.models import WRONG_ANSWER, Verdict, withdrawn_by

log = structlog.get_logger(__name__)

FINISHED_TASK = ("completed", "failed", "cancelled")
DATASET_CHUNK = 100  # problems per dataset transaction
CORRECT = 1.0 - 1e-9


# ------------------------------------------------------------------ create


async def _by_name(session: AsyncSession, pool_id: str, name: str) -> RestemIteration | None:
    return (
        await session.execute(
            select(RestemIteration).where(RestemIteration.pool_id == pool_id, RestemIteration.name == name)
        )
    ).scalar_one_or_none()


async def _running(session: AsyncSession, pool_id: str) -> RestemIteration | None:
    return (
        await session.execute(
            select(RestemIteration).where(
                RestemIteration.pool_id == pool_id, RestemIteration.status == "running"
            )
        )
    ).scalar_one_or_none()


def _running_conflict(running_id: int) -> Conflict:
    return Conflict(
        f"iteration {running_id} is still running in this pool; wait for it to complete or expire",
        code="iteration_running",
        extra={"iteration_id": running_id},
    )


async def create(
    session: AsyncSession, pool: Pool, body: IterationIn, *, secret: bytes, actor: str, now: dt.datetime
) -> tuple[RestemIteration, bool]:
    """Create the iteration and enqueue its tasks; the same name and body again is a no-op."""
    digests = body_digests(body)  # content first (what a new iteration keeps), then as spelled
    existing = await _by_name(session, pool.id, body.name)
    if existing is not None:
        if existing.body_sha256 not in digests:
            raise Conflict(
                "an iteration with this name already exists with another body",
                code="iteration_name_taken",
                extra={"iteration_id": existing.id},
            )
        await advance(session, now=now, iteration_ids=[existing.id])
        return existing, False
    await advance(session, now=now, pool_id=pool.id)
    running = await _running(session, pool.id)
    if running is not None:
        raise _running_conflict(running.id)
    policy = await tasks_service.current_policy(session, pool.id)
    if policy is None:
        raise NotFound("no policy has been published for this pool yet", code="no_policy")
    if body.policy_step != policy.step:
        raise Conflict(
            f"policy_step {body.policy_step} is not the pool's current policy step {policy.step}",
            code="policy_not_current",
            extra={"current_step": policy.step},
        )
    if body.deadline_at is not None and body.deadline_at <= now:
        raise UnprocessableEntity("deadline_at is already past", code="deadline_passed")

    iteration = RestemIteration(
        pool_id=pool.id,
        name=body.name,
        status="running",
        policy_step=body.policy_step,
        samples_per_problem=body.samples_per_problem,
        keep_correct=body.keep_correct,
        sampling=body.sampling.model_dump(),
        problem_count=len(body.problems),
        body_sha256=digests[0],
        created_by=actor,
        created_at=now,
        deadline_at=body.deadline_at,
    )
    try:
        async with session.begin_nested():
            session.add(iteration)
            await session.flush()
    except IntegrityError as exc:  # a concurrent create won the name or the barrier
        raise Conflict(
            "another iteration was created in this pool at the same time",
            code="iteration_running",
        ) from exc

    sampling = Sampling(**body.sampling.model_dump(), n=body.samples_per_problem)
    batch = TaskBatchIn(
        batch_key=f"restem:{iteration.id}:{secrets.token_hex(6)}",
        tasks=[
            TaskIn(
                prompt=p.prompt,
                problem_ref=p.problem_ref,
                sampling=sampling,
                verification=p.verification,
                metadata={
                    **(p.metadata or {}),
                    "restem": {"iteration_id": iteration.id, "problem_id": p.problem_id},
                },
                replication=body.replication,
                deadline_at=body.deadline_at,
            )
            for p in body.problems
        ],
    )
    result = await tasks_service.enqueue(session, pool, batch, secret=secret, actor=actor, now=now)
    task_ids = {
        row.batch_index: row.id
        for row in (
            await session.execute(select(Task.id, Task.batch_index).where(Task.batch_id == result.batch.id))
        ).all()
    }
    await session.execute(
        insert(RestemProblem),
        [
            {
                "iteration_id": iteration.id,
                "problem_index": i,
                "problem_id": p.problem_id,
                "task_id": task_ids[i],
            }
            for i, p in enumerate(body.problems)
        ],
    )
    iteration.batch_id = result.batch.id
    await session.flush()
    return iteration, True


# ------------------------------------------------------------------ the barrier


async def advance(
    session: AsyncSession,
    *,
    now: dt.datetime,
    pool_id: str | None = None,
    iteration_ids: list[int] | None = None,
    skip_locked: bool = False,
) -> list[RestemIteration]:
    """Complete or expire running iterations whose time has come; returns those that changed.

    Safe to call from anywhere in a transaction (a read, the verifier after a verdict, a loop).
    """
    stmt = (
        select(RestemIteration)
        .where(RestemIteration.status == "running")
        .order_by(RestemIteration.id)
        .execution_options(populate_existing=True)  # a concurrent advance may have moved it
    )
    if pool_id is not None:
        stmt = stmt.where(RestemIteration.pool_id == pool_id)
    if iteration_ids is not None:
        stmt = stmt.where(RestemIteration.id.in_(iteration_ids))
    if is_postgres(session):
        stmt = stmt.with_for_update(skip_locked=skip_locked)
    changed = []
    for iteration in (await session.execute(stmt)).scalars():
        if await _settle(session, iteration, now):
            changed.append(iteration)
    if changed:
        await session.flush()
    return changed


async def _settle(session: AsyncSession, iteration: RestemIteration, now: dt.datetime) -> bool:
    # A task the lease reaper failed at its deadline (the iteration's) counts as unfinished: the
    # iteration expired there, whichever loop noticed first. So does a task with a result still
    # waiting for its verdict, even if the task was cancelled meanwhile: the verdict still comes
    # (from the checks or a validator), and a complete iteration's dataset must not change.
    undecided = exists().where(
        Submission.task_id == Task.id, ~exists().where(Verdict.submission_id == Submission.id)
    )
    unfinished = int(
        await session.scalar(
            select(func.count())
            .select_from(RestemProblem)
            .join(Task, Task.id == RestemProblem.task_id)
            .where(
                RestemProblem.iteration_id == iteration.id,
                or_(
                    Task.status.not_in(FINISHED_TASK),
                    and_(
                        Task.status == "failed",
                        Task.end_reason == "deadline_passed",
                    ),
                    undecided,
                ),
            )
        )
        or 0
    )
    deadline = iteration.deadline_at
    if unfinished:
        if deadline is None or deadline > now:
            return False
        await _expire(session, iteration, deadline)
        return True
    last = await session.scalar(
        select(func.max(Verdict.decided_at))
        .select_from(RestemProblem)
        .join(Submission, Submission.task_id == RestemProblem.task_id)
        .join(Verdict, Verdict.submission_id == Submission.id)
        .where(RestemProblem.iteration_id == iteration.id)
    )
    if deadline is not None and last is not None and last > deadline:
        # Finished, but only after the deadline: it expired there.
        await _expire(session, iteration, deadline)
        return True
    iteration.status = "complete"
    iteration.finished_at = last or now
    log.info("restem_iteration_complete", iteration_id=iteration.id, pool_id=iteration.pool_id)
    return True


async def _expire(session: AsyncSession, iteration: RestemIteration, deadline: dt.datetime) -> None:
    # What it counts: verdicts decided by the deadline, and committed by now. On PostgreSQL a
    # verifier batch dates its verdicts when it starts and commits later, so the decision time
    # alone let a verdict committed after the expiry change the final dataset. The bound is the
    # feed's (every lower id committed; a later verdict gets a larger one), taken before the
    # tasks are locked below: a batch writing verdicts may be waiting for one of them.
    bound = await settled_bound(session)
    if bound is None:  # SQLite: one writer, ids commit in order
        bound = int(await session.scalar(select(func.max(Verdict.id))) or 0)
    iteration.status = "expired"
    iteration.finished_at = deadline
    iteration.verdict_bound = bound
    stmt = (
        select(Task)
        .join(RestemProblem, RestemProblem.task_id == Task.id)
        .where(RestemProblem.iteration_id == iteration.id, Task.status == "open")
        .order_by(Task.id)
    )
    if is_postgres(session):
        # Their live leases first (``tasks_service.lock_live_leases``), then the tasks: no claim
        # leases them meanwhile.
        open_ids = list((await session.execute(stmt.with_only_columns(Task.id))).scalars())
        await tasks_service.lock_live_leases(session, open_ids)
        stmt = stmt.with_for_update(of=Task)
    cancelled = 0
    for task in list((await session.execute(stmt)).scalars()):
        await tasks_service.cancel_task(
            session, task, f"ReST^EM iteration {iteration.id} expired", end_reason="iteration_expired"
        )
        cancelled += 1
    log.info(
        "restem_iteration_expired",
        iteration_id=iteration.id,
        pool_id=iteration.pool_id,
        tasks_cancelled=cancelled,
    )


# ------------------------------------------------------------------ reads


async def get(session: AsyncSession, pool_id: str, iteration_id: int, *, now: dt.datetime) -> RestemIteration:
    """The iteration, its status brought up to date; 404 if it is not in this pool."""
    iteration = await session.get(RestemIteration, iteration_id)
    if iteration is None or iteration.pool_id != pool_id:
        raise NotFound("no ReST^EM iteration with this id in this pool", code="iteration_not_found")
    if iteration.status == "running":
        await advance(session, now=now, iteration_ids=[iteration.id])
        if iteration.status == "running":
            await session.refresh(iteration)  # another request may have moved it meanwhile
    return iteration


async def newest_first(
    session: AsyncSession, pool_id: str, *, before_id: int | None, limit: int, now: dt.datetime
) -> list[RestemIteration]:
    await advance(session, now=now, pool_id=pool_id)
    stmt = (
        select(RestemIteration)
        .where(RestemIteration.pool_id == pool_id)
        .order_by(RestemIteration.id.desc())
        .limit(limit)
    )
    if before_id is not None:
        stmt = stmt.where(RestemIteration.id < before_id)
    return list((await session.execute(stmt)).scalars())


async def progress(session: AsyncSession, iteration: RestemIteration) -> IterationProgress:
    return (await progresses(session, [iteration]))[iteration.id]


async def progresses(
    session: AsyncSession, iterations: Sequence[RestemIteration]
) -> dict[int, IterationProgress]:
    """Each iteration's progress, by id: two statements however many iterations (a page).

    Counts of an expired iteration stand as they were when it expired: a verdict its cutoff
    leaves out (decided after the deadline, or written after the expiry) is not counted, nor does
    it make its problem done when it finishes the task late. Which iterations have a cutoff is
    read from the objects given (the status a page shows); its values from their rows, which
    do not change once expired."""
    if not iterations:
        return {}
    ids = [it.id for it in iterations]
    expired = [it.id for it in iterations if _cutoff(it) is not None]
    counts = _counted_verdict_of(expired)
    # Not settled: a result of the problem's task without a verdict that counts. (One level of
    # subquery, so that the cutoff's columns correlate with the problem's row.)
    unsettled = (
        select(Submission.id)
        .outerjoin(Verdict, and_(Verdict.submission_id == Submission.id, *counts))
        .where(Submission.task_id == Task.id, Verdict.id.is_(None))
        .exists()
    )
    problems = select(RestemProblem.iteration_id).select_from(RestemProblem)
    if expired:
        problems = problems.join(RestemIteration, RestemIteration.id == RestemProblem.iteration_id)
    done: dict[int, int] = dict(
        (
            await session.execute(
                problems.add_columns(func.count())
                .join(Task, Task.id == RestemProblem.task_id)
                .where(RestemProblem.iteration_id.in_(ids), Task.status.in_(FINISHED_TASK), ~unsettled)
                .group_by(RestemProblem.iteration_id)
            )
        ).all()
    )
    results = {
        iteration_id: (received, verified)
        for iteration_id, received, verified in (
            await session.execute(
                problems.add_columns(func.count(Submission.id), func.count(Verdict.id))
                .join(Submission, Submission.task_id == RestemProblem.task_id)
                .outerjoin(Verdict, and_(Verdict.submission_id == Submission.id, *counts))
                .where(RestemProblem.iteration_id.in_(ids))
                .group_by(RestemProblem.iteration_id)
            )
        )
    }
    out = {}
    for it in iterations:
        received, verified = results.get(it.id, (0, 0))
        out[it.id] = IterationProgress(
            problems=it.problem_count,
            problems_done=int(done.get(it.id, 0)),
            samples_requested=it.problem_count * it.samples_per_problem,
            results_received=int(received),
            results_verified=int(verified),
        )
    return out


def sampling_of(iteration: RestemIteration) -> RestemSampling:
    return RestemSampling(**iteration.sampling)


# ------------------------------------------------------------------ counting


@dataclass(frozen=True)
class Cutoff:
    """An expired iteration's: verdicts decided after ``decided_by`` (its deadline) or with an
    id above ``bound`` (written after it expired; None for one that expired before 0037) do not
    count."""

    decided_by: dt.datetime
    bound: int | None

    def excludes(self, verdict_id: int | None, decided_at: dt.datetime | None) -> bool:
        """Whether a result with this verdict (None: none yet) is left out."""
        if verdict_id is None or decided_at is None:
            return self.bound is not None  # its verdict, when it comes, is past the bound
        return decided_at > self.decided_by or (self.bound is not None and verdict_id > self.bound)


def _cutoff(iteration: RestemIteration) -> Cutoff | None:
    if iteration.status != "expired" or iteration.finished_at is None:
        return None
    return Cutoff(iteration.finished_at, iteration.verdict_bound)


def _counted_verdict_of(expired: list[int]) -> list[ColumnElement[bool]]:
    """The conditions on a ``Verdict`` row that count, in a query over several iterations'
    ``RestemProblem`` rows (joined to their ``RestemIteration`` when ``expired`` is not empty):
    every verdict of an iteration not in ``expired``; of one in it, those its ``Cutoff`` counts
    (decided by its deadline, and no later than its verdict bound when it has one)."""
    if not expired:
        return []
    return [
        or_(
            RestemProblem.iteration_id.not_in(expired),
            and_(
                Verdict.decided_at <= RestemIteration.finished_at,
                or_(RestemIteration.verdict_bound.is_(None), Verdict.id <= RestemIteration.verdict_bound),
            ),
        )
    ]


def _checked(details: dict[str, Any] | None, server_reward: float | None, n: int) -> int:
    """How many of an accepted result's n samples have a server reward. A verification spec that
    gives the reward function nothing to check against (no ``answer``, say) leaves them without
    one: accepted unchecked, neither right nor wrong."""
    per_sample = (details or {}).get("per_sample_rewards")
    if isinstance(per_sample, list) and len(per_sample) == n:
        return sum(1 for r in sample_rewards(details, server_reward, n) if r is not None)
    return n if server_reward is not None else 0


def _correct(details: dict[str, Any] | None, server_reward: float | None, n: int) -> int:
    per_sample = (details or {}).get("per_sample_rewards")
    if isinstance(per_sample, list) and len(per_sample) == n:
        return sum(1 for r in sample_rewards(details, server_reward, n) if r is not None and r >= CORRECT)
    if server_reward is None:
        return 0
    return round(server_reward * n)  # binary rewards: the mean times n is the count


@dataclass
class ProblemTally:
    problem_id: str
    task_id: int
    task_status: str
    verified: int = 0
    correct: int = 0
    off_policy: int = 0
    discarded: int = 0
    unchecked: int = 0
    pending: int = 0
    pruned_correct: int = 0  # correct, but their result's evidence was pruned: not in the dataset
    settled: bool = True  # every result has a verdict that counts (expired: by the cutoff)

    @property
    def done(self) -> bool:
        """Its task finished and every result judged (``progress``'s ``problems_done``)."""
        return self.settled and self.task_status in FINISHED_TASK


async def tally(session: AsyncSession, iteration: RestemIteration) -> list[ProblemTally]:
    """Per problem (in the order given at creation): samples by how they count."""
    rows = (
        await session.execute(
            select(
                RestemProblem.problem_index,
                RestemProblem.problem_id,
                RestemProblem.task_id,
                Task.status.label("task_status"),
                Submission.id.label("submission_id"),
                Submission.policy_step,
                Submission.sample_count,
                Submission.evidence_pruned_at,
                Verdict.id.label("verdict_id"),
                Verdict.outcome,
                Verdict.reason,
                Verdict.reversed_at,
                withdrawn_by().label("withdrawn_by"),
                Verdict.decided_at,
                Verdict.server_reward,
                Verdict.details,
            )
            .join(Task, Task.id == RestemProblem.task_id)
            .outerjoin(Submission, Submission.task_id == RestemProblem.task_id)
            .outerjoin(Verdict, Verdict.submission_id == Submission.id)
            .where(RestemProblem.iteration_id == iteration.id)
            .order_by(RestemProblem.problem_index, Submission.id)
        )
    ).all()
    cutoff = _cutoff(iteration)
    problems: dict[int, ProblemTally] = {}
    for r in rows:
        p = problems.setdefault(r.problem_index, ProblemTally(r.problem_id, r.task_id, r.task_status))
        if r.submission_id is None:
            continue
        late = cutoff is not None and cutoff.excludes(r.verdict_id, r.decided_at)
        if r.outcome is None or late:
            p.settled = False
        if r.outcome is None and not late:
            p.pending += 1
        elif r.policy_step != iteration.policy_step:
            p.off_policy += r.sample_count
        elif late or r.reversed_at is not None or r.withdrawn_by is not None:
            p.discarded += r.sample_count
        elif r.outcome == "accepted":
            checked = _checked(r.details, r.server_reward, r.sample_count)
            p.verified += checked
            p.unchecked += r.sample_count - checked
            correct = _correct(r.details, r.server_reward, r.sample_count)
            p.correct += correct
            if r.evidence_pruned_at is not None:
                p.pruned_correct += correct
        elif r.reason == WRONG_ANSWER:
            p.verified += r.sample_count
        else:
            p.discarded += r.sample_count
    return [problems[i] for i in sorted(problems)]


# ------------------------------------------------------------------ the dataset


def rank_key(iteration_id: int, submission_id: int, sample_index: int) -> str:
    """The dataset's order among a problem's correct samples: stable, and blind to who sent them."""
    return hashlib.sha256(f"{iteration_id}:{submission_id}:{sample_index}".encode()).hexdigest()


@dataclass(frozen=True)
class DatasetSpec:
    """What the dataset export needs of the iteration, read before streaming starts."""

    iteration_id: int
    pool_id: str
    policy_step: int
    keep_correct: int
    cutoff: Cutoff | None
    reward_function: str


def dataset_spec_or_conflict(iteration: RestemIteration, pool: Pool) -> DatasetSpec:
    """The dataset of a finished iteration; a running one has none yet (409 ``iteration_running``)."""
    if iteration.status == "running":
        raise Conflict(
            f"iteration {iteration.id} is still running; its dataset exists once it completes or expires",
            code="iteration_running",
            extra={"iteration_id": iteration.id},
        )
    return DatasetSpec(
        iteration_id=iteration.id,
        pool_id=iteration.pool_id,
        policy_step=iteration.policy_step,
        keep_correct=iteration.keep_correct,
        cutoff=_cutoff(iteration),
        reward_function=pool.reward_function,
    )


def _correct_flags(row: Row[Any], samples: list[dict[str, Any]], reward_function: str) -> list[bool]:
    n = len(samples)
    per_sample = (row.details or {}).get("per_sample_rewards")
    if isinstance(per_sample, list) and len(per_sample) == n:
        return [r is not None and r >= CORRECT for r in sample_rewards(row.details, row.server_reward, n)]
    if row.server_reward is None:
        return [False] * n
    if row.server_reward >= CORRECT:
        return [True] * n
    # A quorum verdict keeps only the mean: recompute which samples are right, with the pool's
    # own reward function (deterministic; the same one the verifier ran).
    fn = rewards.get(reward_function)
    spec = row.verification or {}
    return [(fn.reward(s.get("completion") or "", spec) or 0.0) >= CORRECT for s in samples]


# A dataset line with its rank among its problem's correct samples (``rank_key``).
Ranked = tuple[str, dict[str, Any]]


def _ranked_lines(spec: DatasetSpec, rows: Sequence[Any]) -> dict[int, list[Ranked]]:
    """The lines of the correct samples of ``rows`` (results), by task, each with its rank."""
    by_task: dict[int, list[Ranked]] = {}
    for row in rows:
        body = load_body(row.body)
        samples: list[dict[str, Any]] = body.get("samples") or []
        flags = _correct_flags(row, samples, spec.reward_function)
        for i, (sample, ok) in enumerate(zip(samples, flags, strict=True)):
            if not ok:
                continue
            line = {
                "iteration_id": spec.iteration_id,
                "problem_id": None,  # filled below
                "task_id": row.task_id,
                "submission_id": row.submission_id,
                "sample_index": i,
                "node_id": row.node_id,
                "policy_step": row.policy_step,
                "prompt": row.prompt,
                "problem_ref": row.problem_ref,
                "metadata": row.metadata_,
                "completion": sample.get("completion"),
                "token_ids": sample.get("token_ids"),
                "finish_reason": sample.get("finish_reason"),
                "prompt_tokens": sample.get("prompt_tokens"),
                "completion_tokens": sample.get("completion_tokens"),
                "reward": 1.0,
            }
            by_task.setdefault(row.task_id, []).append(
                (rank_key(spec.iteration_id, row.submission_id, i), line)
            )
    return by_task


def _best(spec: DatasetSpec, lines: Sequence[Ranked]) -> list[Ranked]:
    """The ``keep_correct`` best-ranked of a problem's lines."""
    return sorted(lines, key=lambda pair: pair[0])[: spec.keep_correct]


def _problem_lines(spec: DatasetSpec, problems: Sequence[Any], by_task: dict[int, list[Ranked]]) -> bytes:
    out = []
    for problem in problems:
        for _, line in _best(spec, by_task.get(problem.task_id, [])):
            line["problem_id"] = problem.problem_id
            out.append(dumps_line(line))
    return b"".join(out)


def _dataset_chunk(spec: DatasetSpec, problems: Sequence[Any], rows: Sequence[Any]) -> bytes:
    return _problem_lines(spec, problems, _ranked_lines(spec, rows))


def _dataset_results(spec: DatasetSpec, task_ids: list[int]) -> list[ColumnElement[bool]]:
    """The conditions on the results a dataset draws from, for the tasks ``task_ids``."""
    where = [
        Submission.task_id.in_(task_ids),
        Submission.policy_step == spec.policy_step,
        Verdict.outcome == "accepted",
        Verdict.reversed_at.is_(None),
        withdrawn_by().is_(None),  # by a fraud verdict against its node (Verdict)
        Submission.evidence_pruned_at.is_(None),  # its samples were archived (tasks.retention)
    ]
    if spec.cutoff is not None:
        where.append(Verdict.decided_at <= spec.cutoff.decided_by)
        if spec.cutoff.bound is not None:
            where.append(Verdict.id <= spec.cutoff.bound)
    return where


def _dataset_rows(spec: DatasetSpec, task_ids: list[int]) -> Select[Any]:
    """The results a dataset draws from for the tasks ``task_ids``, with their signed bodies."""
    return (
        select(
            Submission.id.label("submission_id"),
            Submission.task_id,
            Submission.node_id,
            Submission.policy_step,
            Submission.body,
            Verdict.server_reward,
            Verdict.details,
            Task.prompt,
            Task.problem_ref,
            Task.metadata_,
            Task.verification,
        )
        .join(Verdict, Verdict.submission_id == Submission.id)
        .join(Task, Task.id == Submission.task_id)
        .where(*_dataset_results(spec, task_ids))
        .order_by(Submission.id)
    )


async def _large_problem_lines(
    sessionmaker: async_sessionmaker[AsyncSession], spec: DatasetSpec, problem: Any, *, max_bytes: int
) -> bytes:
    """The lines of one problem whose results' signed bodies add up to more than ``max_bytes``:
    its results are read in id order, each read in its own short transaction while their
    bodies add up to at most ``max_bytes`` (the first whatever its size), keeping the
    ``keep_correct`` best-ranked lines so far (the same lines as one read of them all)."""
    kept: list[Ranked] = []
    after = 0
    while True:
        async with sessionmaker() as session, session.begin():
            sizes = (
                await session.execute(
                    select(Submission.id, func.length(Submission.body))
                    .join(Verdict, Verdict.submission_id == Submission.id)
                    .where(*_dataset_results(spec, [problem.task_id]), Submission.id > after)
                    .order_by(Submission.id)
                )
            ).all()
            ids: list[int] = within_bytes(sizes, max_bytes)
            if not ids:
                break
            rows = (
                await session.execute(_dataset_rows(spec, [problem.task_id]).where(Submission.id.in_(ids)))
            ).all()
        ranked = await anyio.to_thread.run_sync(_ranked_lines, spec, rows)
        kept = _best(spec, [*kept, *ranked.get(problem.task_id, [])])
        if len(ids) == len(sizes):
            break
        after = ids[-1]
    return await anyio.to_thread.run_sync(_problem_lines, spec, [problem], {problem.task_id: kept})


async def dataset_lines(
    sessionmaker: async_sessionmaker[AsyncSession],
    spec: DatasetSpec,
    *,
    max_bytes: int,
    chunk: int | None = None,
) -> AsyncIterator[bytes]:
    """The dataset as JSON Lines, problem by problem in creation order; each chunk of problems is
    read in its own short transaction: up to ``chunk`` problems, fewer once their results'
    signed bodies add up to ``max_bytes`` (the sizes are read first, without the bodies, which
    are the nodes' choice, up to ``limits.max_result_body_bytes`` each). A first problem whose
    results alone add up to more (one per replica) is read a few results at a time
    (``_large_problem_lines``)."""
    chunk = chunk or DATASET_CHUNK
    after = -1
    while True:
        async with sessionmaker() as session, session.begin():
            candidates = (
                await session.execute(
                    select(RestemProblem.problem_index, RestemProblem.problem_id, RestemProblem.task_id)
                    .where(
                        RestemProblem.iteration_id == spec.iteration_id, RestemProblem.problem_index > after
                    )
                    .order_by(RestemProblem.problem_index)
                    .limit(chunk)
                )
            ).all()
            if not candidates:
                return
            task_ids = [p.task_id for p in candidates]
            sizes = await session.execute(
                select(Submission.task_id, func.sum(func.length(Submission.body)))
                .join(Verdict, Verdict.submission_id == Submission.id)
                .where(*_dataset_results(spec, task_ids))
                .group_by(Submission.task_id)
            )
            size_of = {task_id: int(size or 0) for task_id, size in sizes}
            problems = within_bytes(((p, size_of.get(p.task_id, 0)) for p in candidates), max_bytes)
            alone = len(problems) == 1 and size_of.get(problems[0].task_id, 0) > max_bytes
            if not alone:
                stmt = _dataset_rows(spec, [p.task_id for p in problems])
                rows = (await session.execute(stmt)).all()
        if alone:
            # One problem whose results alone add up to more than max_bytes (a result per
            # replica, up to 16): read a few of them at a time.
            data = await _large_problem_lines(sessionmaker, spec, problems[0], max_bytes=max_bytes)
        else:
            data = await anyio.to_thread.run_sync(_dataset_chunk, spec, problems, rows)
        if data:
            yield data
        if len(candidates) < chunk and len(problems) == len(candidates):
            return
        after = problems[-1].problem_index


# ------------------------------------------------------------------ the report


def _rate(correct: int, verified: int) -> float | None:
    return correct / verified if verified else None


async def report(session: AsyncSession, iteration: RestemIteration) -> IterationReport:
    problems = await tally(session, iteration)
    k = iteration.keep_correct
    rows = [
        ProblemReport(
            problem_id=p.problem_id,
            task_id=p.task_id,
            task_status=p.task_status,
            verified_samples=p.verified,
            correct_samples=p.correct,
            solve_rate=_rate(p.correct, p.verified),
            kept_samples=min(p.correct - p.pruned_correct, k),
            pruned_correct_samples=p.pruned_correct,
            off_policy_samples=p.off_policy,
            discarded_samples=p.discarded,
            unchecked_samples=p.unchecked,
            pending_results=p.pending,
        )
        for p in problems
    ]
    rates = [r.solve_rate for r in rows if r.solve_rate is not None]
    verified = sum(p.verified for p in problems)
    correct = sum(p.correct for p in problems)
    totals = ReportTotals(
        problems=len(rows),
        problems_done=sum(1 for p in problems if p.done),
        problems_solved=sum(1 for p in problems if p.correct > 0),
        verified_samples=verified,
        correct_samples=correct,
        solve_rate=_rate(correct, verified),
        mean_problem_solve_rate=sum(rates) / len(rates) if rates else None,
        dataset_size=sum(r.kept_samples for r in rows),
        off_policy_samples=sum(p.off_policy for p in problems),
        discarded_samples=sum(p.discarded for p in problems),
        unchecked_samples=sum(p.unchecked for p in problems),
        pruned_correct_samples=sum(p.pruned_correct for p in problems),
        pending_results=sum(p.pending for p in problems),
    )
    return IterationReport(
        iteration_id=iteration.id,
        status=cast(IterationStatus, iteration.status),
        policy_step=iteration.policy_step,
        keep_correct=k,
        totals=totals,
        problems=rows,
    )
