"""External validators: trusted boxes (e.g. running TOPLOC prefill checks) lease validation jobs
like workers lease tasks, and post verdicts with their evidence.

Only results a pool routes to validators (``audit_method = validator``) appear here. A verdict
is idempotent per job; a lease past its deadline goes back to the queue, and a verdict carrying
a stale fencing token is refused. For TOPLOC evidence the server applies the published
thresholds itself (among the top 128 values: at least 90 exponent matches, mantissa error
mean < 10 and median < 8), so a ``valid`` that its own numbers contradict is refused.

A job waits for validators ``verifier.validator_wait_s`` from when the checks sent it
(``created_at``): a claim offers only jobs within their wait, a lease may be extended up to
``MAX_LEASE_S`` past it and no further, and once no validator holds a live lease on a job past
its wait, the verifier's housekeeping withdraws it (``expire_waits``) and decides the result on
the server's checks, as a skipped audit. So no result waits longer than the wait plus one
longest lease (and a tick) for its verdict; a verdict posted after is refused
(``validation_withdrawn``).
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import structlog
from sqlalchemy import Select, func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from api_schemas.verification import ValidatorVerdictIn
from orchestrator.admin.tokens import Principal, Role
from orchestrator.core.errors import Conflict, NotFound, UnprocessableEntity
from orchestrator.core.pagination import within_bytes
from orchestrator.core.sql import is_postgres
from orchestrator.pools.models import Pool
from orchestrator.tasks.models import Submission, Task, TaskReplica
from orchestrator.verification import service
from orchestrator.verification.models import ValidationJob, Verdict, VerificationJob
from orchestrator.verification.scoring import Scorer

LEASE_S = 300
#: The longest lease a claim or an extension may ask for (``ValidationClaimIn.lease_s``), and how
#: far past a job's wait an extension may take its lease.
MAX_LEASE_S = 3600
TOPLOC_MIN_EXPONENT_MATCHES = 90
TOPLOC_MAX_MANTISSA_MEAN = 10.0
TOPLOC_MAX_MANTISSA_MEDIAN = 8.0

log = structlog.get_logger(__name__)


def _pools_in_scope(principal: Principal, pool_id: str | None) -> list[str] | None:
    """None means every pool (admin)."""
    if principal.role == Role.admin:
        return [pool_id] if pool_id else None
    scope = sorted(principal.pool_ids)
    if pool_id is not None:
        return [pool_id] if pool_id in principal.pool_ids else []
    return scope


async def claim(
    session: AsyncSession,
    principal: Principal,
    pool_id: str | None,
    max_jobs: int,
    *,
    now: dt.datetime,
    wait_s: float,
    lease_s: int = LEASE_S,
    max_bytes: int,
) -> list[tuple[ValidationJob, Submission, Task, int]]:
    """Lease up to ``max_jobs`` open jobs for ``lease_s`` seconds, of those still within their
    ``wait_s`` (one past it is the housekeeping's to withdraw, at its next tick), in order while
    their results' bodies add up to at most ``max_bytes`` (the first one whatever its size): the
    bodies are the nodes' choice, up to ``limits.max_result_body_bytes`` each, and the claim
    answers them whole. A pool named that does not exist, or that the token is not scoped to, is
    404 ``pool_not_found`` (not an empty answer, which would look like a pool with nothing to
    check)."""
    pools = _pools_in_scope(principal, pool_id)
    if pool_id is not None and (pools == [] or await session.get(Pool, pool_id) is None):
        raise NotFound(f"no pool {pool_id} in this token's scope", code="pool_not_found")
    if pools == []:
        return []
    stmt = (
        select(ValidationJob, func.length(Submission.body))
        .join(Submission, Submission.id == ValidationJob.submission_id)
        .where(ValidationJob.status == "open", ValidationJob.created_at > _wait_cutoff(now, wait_s))
        .order_by(ValidationJob.id)
        .limit(max_jobs)
    )
    if pools is not None:
        stmt = stmt.where(ValidationJob.pool_id.in_(pools))
    if is_postgres(session):
        stmt = stmt.with_for_update(of=ValidationJob, skip_locked=True)
    # The rest stay open for the next claim.
    jobs = within_bytes([(job, size) for job, size in (await session.execute(stmt)).all()], max_bytes)
    out = []
    for job in jobs:
        job.status = "leased"
        job.fencing_token += 1
        job.validator_token_id = principal.token_id
        job.lease_expires_at = now + dt.timedelta(seconds=lease_s)
        submission = await session.get(Submission, job.submission_id)
        assert submission is not None
        task = await session.get(Task, submission.task_id)
        replica = await session.get(TaskReplica, submission.replica_id)
        assert task is not None
        assert replica is not None
        out.append((job, submission, task, replica.seed))
    await session.flush()
    return out


def _wait_cutoff(now: dt.datetime, wait_s: float) -> dt.datetime:
    """Jobs made at or before this have waited their ``wait_s``."""
    return now - dt.timedelta(seconds=wait_s)


def _in_scope(job: ValidationJob, principal: Principal) -> bool:
    return principal.role == Role.admin or job.pool_id in principal.pool_ids


def _holds(job: ValidationJob, principal: Principal, fencing_token: int, now: dt.datetime) -> bool:
    """Whether ``principal`` holds the job's live lease under ``fencing_token``."""
    return (
        job.status == "leased"
        and job.validator_token_id == principal.token_id
        and job.fencing_token == fencing_token
        and job.lease_expires_at is not None
        and job.lease_expires_at > now
    )


async def _locked_job(session: AsyncSession, principal: Principal, job_id: int) -> ValidationJob:
    """The job, locked; 404 for one that does not exist or is outside the token's scope."""
    job = (
        await session.execute(select(ValidationJob).where(ValidationJob.id == job_id).with_for_update())
    ).scalar_one_or_none()
    if job is None or not _in_scope(job, principal):
        raise NotFound("no validation job with this id", code="validation_job_not_found")
    return job


def _lease_expired() -> Conflict:
    return Conflict("this validation lease expired or belongs to another validator", code="lease_expired")


def _withdrawn() -> Conflict:
    return Conflict(
        "this validation job waited past the validator wait with no validator holding a live lease "
        "on it; it was withdrawn and its result decided on the server's checks (the audit was "
        "skipped), so no verdict is recorded for it now",
        code="validation_withdrawn",
    )


async def extend(
    session: AsyncSession,
    principal: Principal,
    job_id: int,
    fencing_token: int,
    lease_s: int,
    *,
    now: dt.datetime,
    wait_s: float,
) -> ValidationJob:
    """The holder's live lease now runs out ``lease_s`` from now (sooner too, if it asks): a
    check that takes longer than its claim's ``lease_s`` is not lost. But not more than
    ``MAX_LEASE_S`` past the job's wait (``wait_s`` from when it was made), where the lease
    runs out instead (the answer's ``lease_expires_at`` says when): extensions cannot keep a job
    from being decided for ever. A lease already run out, decided, or held by another validator
    or under another fencing token is 409 ``lease_expired``, as a verdict would be; a withdrawn
    job's is ``validation_withdrawn``."""
    job = await _locked_job(session, principal, job_id)
    if job.status == "withdrawn":
        raise _withdrawn()
    if not _holds(job, principal, fencing_token, now):
        raise _lease_expired()
    assert job.lease_expires_at is not None
    bound = job.created_at + dt.timedelta(seconds=wait_s + MAX_LEASE_S)
    # A lease already past the bound (the wait was shortened since) keeps what it has.
    job.lease_expires_at = min(now + dt.timedelta(seconds=lease_s), max(bound, job.lease_expires_at))
    await session.flush()
    return job


def _contradicted(body: ValidatorVerdictIn) -> str | None:
    e = body.evidence
    if body.outcome != "valid":
        return None
    if e.exponent_mismatches is not None and 128 - e.exponent_mismatches < TOPLOC_MIN_EXPONENT_MATCHES:
        return f"{128 - e.exponent_mismatches} exponent matches < {TOPLOC_MIN_EXPONENT_MATCHES}"
    if e.mantissa_error_mean is not None and e.mantissa_error_mean >= TOPLOC_MAX_MANTISSA_MEAN:
        return f"mantissa error mean {e.mantissa_error_mean} >= {TOPLOC_MAX_MANTISSA_MEAN}"
    if e.mantissa_error_median is not None and e.mantissa_error_median >= TOPLOC_MAX_MANTISSA_MEDIAN:
        return f"mantissa error median {e.mantissa_error_median} >= {TOPLOC_MAX_MANTISSA_MEDIAN}"
    return None


async def prescore(
    sessionmaker: async_sessionmaker[AsyncSession],
    principal: Principal,
    job_id: int,
    fencing_token: int,
    scorer: Scorer,
    *,
    now: dt.datetime,
) -> service.Scored | None:
    """SQLite: the result's server rewards, scored before the verdict's transaction opens. Every
    SQLite transaction holds the database's one write lock (``BEGIN IMMEDIATE``), so a verdict
    that scored inside its own held up every claim, result and heartbeat for as long as the
    reward function ran (up to ``reward_timeout_s``), as ``service.prescore`` avoids for the
    verifier. Only for the lease's holder; None where ``post_verdict`` will refuse the post or
    the job is decided (it scores nothing then)."""
    async with sessionmaker() as session, session.begin():
        job = await session.get(ValidationJob, job_id)
        if job is None or not _in_scope(job, principal) or not _holds(job, principal, fencing_token, now):
            return None
        if job.per_sample_rewards is not None:  # the checks' own: nothing to score again
            return None
        vjob = (
            await session.execute(
                select(VerificationJob).where(VerificationJob.submission_id == job.submission_id)
            )
        ).scalar_one()
        given = await service.score_input(session, vjob)
    return await service.score_result(given, scorer)


async def post_verdict(
    session: AsyncSession,
    principal: Principal,
    job_id: int,
    body: ValidatorVerdictIn,
    *,
    now: dt.datetime,
    scorer: Scorer,
    prescored: service.Scored | None = None,
) -> tuple[ValidationJob, Verdict]:
    job = await _locked_job(session, principal, job_id)
    posted = body.model_dump(mode="json")
    if job.status == "withdrawn":
        raise _withdrawn()
    if job.status == "done":
        verdict = (
            await session.execute(select(Verdict).where(Verdict.submission_id == job.submission_id))
        ).scalar_one()
        if job.result != posted:
            raise Conflict("a different verdict was already recorded for this job", code="verdict_conflict")
        return job, verdict
    if not _holds(job, principal, body.fencing_token, now):
        raise _lease_expired()
    if (why := _contradicted(body)) is not None:
        raise UnprocessableEntity(
            f"the evidence contradicts a valid verdict: {why}", code="evidence_contradicts"
        )
    vjob = (
        await session.execute(
            select(VerificationJob).where(VerificationJob.submission_id == job.submission_id)
        )
    ).scalar_one()
    submission = await session.get(Submission, job.submission_id)
    assert submission is not None
    # The server's reward per sample, as the checks computed it when they sent the result to
    # the validators (the verification job keeps only the mean): the feed serves it with each
    # sample. A job made before migration 0031 has none kept: it is scored again, before any
    # lock, as in a verifier batch (with a reward function since changed, it may then differ
    # from the mean).
    per_sample = job.per_sample_rewards
    if per_sample is None:
        scored = prescored if prescored is not None else await service.score(session, vjob, scorer)
        per_sample = scored.per_sample
    await service.lock_for_verdicts(session, [submission])  # a fraud verdict makes several transfers
    details = {
        "findings": vjob.findings,
        "server_reward": vjob.server_reward,
        "per_sample_rewards": per_sample,
        "validator": posted,
        "validator_token_id": principal.token_id,
    }
    if body.outcome == "valid":
        decision = service.by_reward(
            vjob.server_reward is not None, vjob.correct_samples or 0, details, "validator"
        )
    elif body.outcome == "invalid":
        decision = service.Decision("rejected", "invalid", body.reason, "validator", details)
    else:
        decision = service.Decision("rejected", "fraud", body.reason, "validator", details)
    verdict = await service.decide(session, vjob, submission, decision, now=now)
    job.status = "done"
    job.result = posted
    job.decided_at = now
    await session.flush()
    return job, verdict


def expired_leases(now: dt.datetime) -> Select[Any]:
    """The leased jobs whose lease ran out (``ix_validation_jobs_leased_expiry``)."""
    return select(ValidationJob).where(
        ValidationJob.status == "leased", ValidationJob.lease_expires_at <= now
    )


async def expire_leases(session: AsyncSession, *, now: dt.datetime) -> int:
    stmt = expired_leases(now)
    if is_postgres(session):
        stmt = stmt.with_for_update(skip_locked=True)
    jobs = list((await session.execute(stmt)).scalars())
    for job in jobs:
        job.status = "open"
        job.validator_token_id = None
        job.lease_expires_at = None
    await session.flush()
    return len(jobs)


async def expire_waits(session: AsyncSession, *, now: dt.datetime, wait_s: float, limit: int = 100) -> int:
    """Open jobs that have waited past ``wait_s``, up to ``limit``, oldest first: withdrawn from
    the validators, and their results decided on the server's own checks, as a skipped audit
    (``audit_skipped`` in the verdict's details, verifier ``reward``, paid and held as any
    result accepted on its checks). Returns how many were withdrawn.

    A job under lease is not open: its lease is honoured until it runs out (``expire_leases``
    then opens it, and the next pick takes it). On PostgreSQL the jobs are taken ``SKIP
    LOCKED``: one a validator's verdict, claim or extension holds right now is that request's,
    and a job it has meanwhile leased or decided is not open any more when the row is locked.
    The lock order is a verdict's: the jobs, then what their verdicts may lock
    (``service.lock_for_verdicts``)."""
    stmt = (
        select(ValidationJob)
        .where(ValidationJob.status == "open", ValidationJob.created_at <= _wait_cutoff(now, wait_s))
        .order_by(ValidationJob.created_at, ValidationJob.id)
        .limit(limit)
    )
    if is_postgres(session):
        stmt = stmt.with_for_update(skip_locked=True)
    jobs = list((await session.execute(stmt)).scalars())
    if not jobs:
        return 0
    submission_ids = [j.submission_id for j in jobs]
    found = await session.execute(select(Submission).where(Submission.id.in_(submission_ids)))
    submissions = {s.id: s for s in found.scalars()}
    vjobs = {
        v.submission_id: v
        for v in (
            await session.execute(
                select(VerificationJob).where(VerificationJob.submission_id.in_(submission_ids))
            )
        ).scalars()
    }
    await service.lock_for_verdicts(session, list(submissions.values()))
    note = f"no validator posted a verdict within {wait_s:g} s"
    # A rolled-back savepoint expires the rows it changed: the ids are read now.
    withdrawn = 0
    for job, job_id, submission_id in [(j, j.id, j.submission_id) for j in jobs]:
        try:
            async with session.begin_nested():
                await _withdraw(session, job, vjobs[submission_id], submissions[submission_id], note, now)
        except Exception:  # one that cannot be decided does not hold up the others
            log.exception("validator_wait_failed", job_id=job_id, submission_id=submission_id)
            continue
        withdrawn += 1
    log.info("validator_wait_expired", jobs=withdrawn, wait_s=wait_s)
    return withdrawn


async def _withdraw(
    session: AsyncSession,
    job: ValidationJob,
    vjob: VerificationJob,
    submission: Submission,
    note: str,
    now: dt.datetime,
) -> None:
    details: dict[str, Any] = {"findings": vjob.findings, "server_reward": vjob.server_reward}
    if job.per_sample_rewards is not None:
        details["per_sample_rewards"] = job.per_sample_rewards
    details["audit_skipped"] = note
    vjob.audited = False
    checkable = vjob.server_reward is not None
    decision = service.by_reward(checkable, vjob.correct_samples or 0, details, "reward")
    await service.decide(session, vjob, submission, decision, now=now)
    job.status = "withdrawn"
    job.decided_at = now
    await session.flush()


def result_body(submission: Submission) -> dict[str, object]:
    parsed: dict[str, object] = json.loads(submission.body)
    return parsed
