"""Rules for policies, task batches, claims, leases and results.

The claim and result paths are hot; each runs a small fixed number of statements whatever the
batch size (batch INSERTs, executemany UPDATEs by primary key), and a claim locks *tasks*, not
replicas, with ``FOR UPDATE SKIP LOCKED`` on PostgreSQL. Locking the task means two replicas of
one task are never handed out by concurrent claims, so the placement rule (different provider,
different IP, never the same node twice) cannot be raced. On SQLite the single writer
serialises claims.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import secrets
from dataclasses import dataclass
from typing import Any

import structlog
from sqlalchemy import and_, exists, func, insert, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from api_schemas.tasks import (
    ClaimOut,
    Lease,
    LeasedTask,
    PolicyIn,
    PolicyRef,
    ResultIn,
    ResultOut,
    Sampling,
    TaskBatchIn,
)
from orchestrator.core.errors import Conflict, NotFound
from orchestrator.core.signing import SignedRequest
from orchestrator.core.sql import is_postgres
from orchestrator.identity.models import Node, NodeStatus
from orchestrator.pools.models import Pool, PoolMembership
from orchestrator.tasks.models import (
    Assignment,
    PolicyVersion,
    Submission,
    Task,
    TaskBatch,
    TaskReplica,
)
from orchestrator.tasks.seeds import derive_seed
from orchestrator.verification import service as verification

log = structlog.get_logger(__name__)

INSERT_CHUNK = 2000
RETRY_AFTER_S = {
    "no_tasks": 5,
    "node_unhealthy": 10,
    "not_a_member": 60,
    "pool_paused": 30,
    "pool_not_active": 60,
    "lease_cap_reached": 10,
    "no_policy": 30,
}


# ------------------------------------------------------------------------ policies


async def current_policy(session: AsyncSession, pool_id: str) -> PolicyVersion | None:
    return (
        await session.execute(
            select(PolicyVersion)
            .where(PolicyVersion.pool_id == pool_id)
            .order_by(PolicyVersion.step.desc())
            .limit(1)
        )
    ).scalar_one_or_none()


async def publish_policy(session: AsyncSession, pool: Pool, body: PolicyIn, actor: str) -> PolicyVersion:
    if pool.status == "completed":
        raise Conflict("the pool is completed", code="pool_completed")
    current = await current_policy(session, pool.id)
    if current is not None and body.step <= current.step:
        raise Conflict(
            f"step must be greater than the current step {current.step}",
            code="policy_step_not_increasing",
            extra={"current_step": current.step},
        )
    row = PolicyVersion(
        pool_id=pool.id,
        step=body.step,
        uri=body.uri,
        sha256=body.sha256,
        size_bytes=body.size,
        shards=[s.model_dump() for s in body.shards] if body.shards is not None else None,
        created_by=actor,
        created_at=dt.datetime.now(dt.UTC),
    )
    try:
        async with session.begin_nested():
            session.add(row)
            await session.flush()
    except IntegrityError as exc:
        raise Conflict(f"step {body.step} was already published", code="policy_step_not_increasing") from exc
    return row


# ------------------------------------------------------------------------ tasks


@dataclass(frozen=True)
class EnqueueResult:
    batch: TaskBatch
    first_task_id: int
    created: bool


async def enqueue(
    session: AsyncSession, pool: Pool, body: TaskBatchIn, *, secret: bytes, actor: str
) -> EnqueueResult:
    """Insert a batch of tasks and their replicas atomically; idempotent by ``batch_key``."""
    digest = hashlib.sha256(body.model_dump_json().encode()).hexdigest()
    existing = await _batch(session, pool.id, body.batch_key)
    if existing is not None:
        return await _same_batch(session, existing, digest)
    if pool.status == "completed":
        raise Conflict("the pool is completed", code="pool_completed")
    now = dt.datetime.now(dt.UTC)
    batch = TaskBatch(
        pool_id=pool.id,
        batch_key=body.batch_key,
        body_sha256=digest,
        task_count=len(body.tasks),
        created_by=actor,
        created_at=now,
    )
    try:
        async with session.begin_nested():
            session.add(batch)
            await session.flush()
    except IntegrityError:
        found = await _batch(session, pool.id, body.batch_key)
        if found is None:
            raise
        return await _same_batch(session, found, digest)

    rows: list[dict[str, Any]] = []
    for index, t in enumerate(body.tasks):
        replication = t.replication or pool.replication_factor
        rows.append(
            {
                "pool_id": pool.id,
                "batch_id": batch.id,
                "batch_index": index,
                "prompt": t.prompt,
                "problem_ref": t.problem_ref,
                "sampling": t.sampling.model_dump(),
                "verification": t.verification,
                "metadata_": t.metadata,
                "replication": replication,
                "min_quorum": replication,
                "priority": t.priority,
                "claim_rank": -t.priority,
                "deadline_at": t.deadline_at,
                "status": "open",
                "available_replicas": replication,
                "submitted_replicas": 0,
                "is_canary": t.canary,
                "created_at": now,
                "updated_at": now,
            }
        )
    ids: list[int] = []
    for start in range(0, len(rows), INSERT_CHUNK):
        chunk = rows[start : start + INSERT_CHUNK]
        result = await session.execute(insert(Task).returning(Task.id, sort_by_parameter_order=True), chunk)
        ids.extend(int(i) for i in result.scalars())
    replicas = [
        {
            "task_id": task_id,
            "replica_index": r,
            "seed": derive_seed(secret, task_id, r),
            "status": "available",
            "leases_issued": 0,
            "expirations": 0,
        }
        for task_id, row in zip(ids, rows, strict=True)
        for r in range(row["replication"])
    ]
    for start in range(0, len(replicas), INSERT_CHUNK):
        await session.execute(insert(TaskReplica), replicas[start : start + INSERT_CHUNK])
    return EnqueueResult(batch=batch, first_task_id=min(ids), created=True)


async def _batch(session: AsyncSession, pool_id: str, key: str) -> TaskBatch | None:
    return (
        await session.execute(
            select(TaskBatch).where(TaskBatch.pool_id == pool_id, TaskBatch.batch_key == key)
        )
    ).scalar_one_or_none()


async def _same_batch(session: AsyncSession, batch: TaskBatch, digest: str) -> EnqueueResult:
    if batch.body_sha256 != digest:
        raise Conflict(
            "this batch_key was already used for different tasks",
            code="batch_key_reused",
            extra={"batch_id": batch.id},
        )
    first = await session.scalar(select(func.min(Task.id)).where(Task.batch_id == batch.id))
    return EnqueueResult(batch=batch, first_task_id=int(first or 0), created=False)


async def cancel_task(session: AsyncSession, task: Task, reason: str) -> Task:
    """Idempotent. Live leases are cancelled (their heartbeats are told to drop them)."""
    if task.status in ("cancelled", "completed", "failed"):
        return task
    now = dt.datetime.now(dt.UTC)
    await session.execute(
        update(TaskReplica)
        .where(TaskReplica.task_id == task.id, TaskReplica.status.in_(("available", "leased")))
        .values(status="cancelled")
    )
    await session.execute(
        update(Assignment)
        .where(Assignment.task_id == task.id, Assignment.status == "active")
        .values(status="cancelled", ended_at=now)
    )
    task.status = "cancelled"
    task.available_replicas = 0
    task.failure_reason = reason
    task.updated_at = now
    await session.flush()
    await verification.settle_abandoned(session, task.id, now=now)
    return task


# ------------------------------------------------------------------------ claims


def _no_work(reason: str, detail: str) -> ClaimOut:
    return ClaimOut(leases=[], reason=reason, detail=detail, retry_after_s=RETRY_AFTER_S[reason])


async def claim(
    session: AsyncSession, node: Node, pool_id: str, max_tasks: int, *, now: dt.datetime
) -> ClaimOut:
    pool = await session.get(Pool, pool_id)
    if pool is None:
        raise NotFound("no pool with this id", code="pool_not_found")
    if pool.status == "paused":
        return _no_work("pool_paused", "the pool is paused")
    if pool.status != "active":
        return _no_work("pool_not_active", f"the pool is {pool.status}")
    member = await session.scalar(
        select(PoolMembership.status).where(
            PoolMembership.pool_id == pool_id, PoolMembership.node_id == node.id
        )
    )
    if member != "active":
        return _no_work("not_a_member", "this node is not an active member of the pool")
    if node.status != NodeStatus.healthy:
        return _no_work("node_unhealthy", f"the node is {node.status}; send a heartbeat first")
    policy = await current_policy(session, pool_id)
    if policy is None:
        return _no_work("no_policy", "no policy version has been published for this pool yet")
    held = int(
        await session.scalar(
            select(func.count())
            .select_from(Assignment)
            .where(
                Assignment.node_id == node.id, Assignment.pool_id == pool_id, Assignment.status == "active"
            )
        )
        or 0
    )
    room = min(max_tasks, pool.max_leases_per_node - held)
    if room <= 0:
        return _no_work("lease_cap_reached", f"the node already holds {held} leases in this pool")

    busy = exists().where(
        Assignment.task_id == Task.id,
        or_(
            Assignment.node_id == node.id,
            and_(
                Assignment.status.in_(("active", "submitted")),
                or_(Assignment.provider_id == node.provider_id, Assignment.ip_address == node.ip_address),
            ),
        ),
    )
    pick = (
        select(Task.id)
        .where(Task.pool_id == pool_id, Task.status == "open", Task.available_replicas > 0, ~busy)
        .order_by(Task.claim_rank, Task.id)
        .limit(room)
    )
    if is_postgres(session):
        pick = pick.with_for_update(of=Task, skip_locked=True)
    task_ids = list((await session.execute(pick)).scalars())
    if not task_ids:
        return _no_work("no_tasks", "no task this node may take is waiting")

    replica_rows = (
        await session.execute(
            select(
                TaskReplica.id,
                TaskReplica.task_id,
                TaskReplica.replica_index,
                TaskReplica.seed,
                TaskReplica.leases_issued,
            )
            .where(TaskReplica.task_id.in_(task_ids), TaskReplica.status == "available")
            .order_by(TaskReplica.task_id, TaskReplica.replica_index)
        )
    ).all()
    first: dict[int, Any] = {}
    for row in replica_rows:
        first.setdefault(row.task_id, row)
    tasks = {t.id: t for t in (await session.execute(select(Task).where(Task.id.in_(first)))).scalars()}

    expires = now + dt.timedelta(seconds=pool.lease_duration_s)
    assignments, replica_updates, leases = [], [], []
    for task_id in task_ids:
        replica = first.get(task_id)
        if replica is None:
            continue
        assignment_id = "asg_" + secrets.token_urlsafe(18)
        token = replica.leases_issued + 1
        assignments.append(
            {
                "id": assignment_id,
                "replica_id": replica.id,
                "task_id": task_id,
                "pool_id": pool_id,
                "node_id": node.id,
                "provider_id": node.provider_id,
                "ip_address": node.ip_address,
                "fencing_token": token,
                "policy_step": policy.step,
                "status": "active",
                "lease_expires_at": expires,
                "created_at": now,
            }
        )
        replica_updates.append(
            {
                "id": replica.id,
                "status": "leased",
                "leases_issued": token,
                "current_assignment_id": assignment_id,
            }
        )
        task = tasks[task_id]
        leases.append(
            Lease(
                assignment_id=assignment_id,
                fencing_token=token,
                seed=replica.seed,
                replica_index=replica.replica_index,
                policy=PolicyRef(step=policy.step, uri=policy.uri, sha256=policy.sha256),
                lease_expires_at=expires,
                task=LeasedTask(
                    task_id=task_id,
                    prompt=task.prompt,
                    problem_ref=task.problem_ref,
                    sampling=Sampling(**task.sampling),
                    metadata=task.metadata_,
                ),
            )
        )
    await session.execute(insert(Assignment), assignments)
    await session.execute(update(TaskReplica), replica_updates)
    await session.execute(
        update(Task)
        .where(Task.id.in_([a["task_id"] for a in assignments]))
        .values(available_replicas=Task.available_replicas - 1, updated_at=now)
    )
    return ClaimOut(leases=leases)


# ------------------------------------------------------------------------ leases


async def extend_leases(
    session: AsyncSession, node_id: str, lease_ids: list[str], *, now: dt.datetime
) -> list[str]:
    """Extend the node's live leases among ``lease_ids``; return the ids it must drop.

    A lease is written only when less than half of its duration is left, so a steady heartbeat
    costs one indexed read, and a write per lease only every half lease period.
    """
    if not lease_ids:
        return []
    rows = (
        await session.execute(
            select(Assignment.id, Assignment.lease_expires_at, Pool.lease_duration_s)
            .join(Pool, Pool.id == Assignment.pool_id)
            .where(
                Assignment.id.in_(lease_ids),
                Assignment.node_id == node_id,
                Assignment.status == "active",
                Assignment.lease_expires_at > now,
            )
        )
    ).all()
    live = {row.id for row in rows}
    by_duration: dict[int, list[str]] = {}
    for row in rows:
        if row.lease_expires_at - now < dt.timedelta(seconds=row.lease_duration_s / 2):
            by_duration.setdefault(row.lease_duration_s, []).append(row.id)
    for duration, ids in by_duration.items():
        await session.execute(
            update(Assignment)
            .where(Assignment.id.in_(ids), Assignment.status == "active")
            .values(lease_expires_at=now + dt.timedelta(seconds=duration))
        )
    return [lease_id for lease_id in dict.fromkeys(lease_ids) if lease_id not in live]


async def _own_assignment(session: AsyncSession, node_id: str, assignment_id: str) -> Assignment:
    assignment = (
        await session.execute(select(Assignment).where(Assignment.id == assignment_id).with_for_update())
    ).scalar_one_or_none()
    if assignment is None or assignment.node_id != node_id:
        raise NotFound("no assignment with this id for this node", code="assignment_not_found")
    return assignment


async def _give_back(session: AsyncSession, assignment: Assignment, now: dt.datetime) -> None:
    """End a live lease early and make its replica available again."""
    assignment.status = "released"
    assignment.ended_at = now
    await session.execute(
        update(TaskReplica)
        .where(TaskReplica.id == assignment.replica_id, TaskReplica.current_assignment_id == assignment.id)
        .values(status="available", current_assignment_id=None)
    )
    await session.execute(
        update(Task)
        .where(Task.id == assignment.task_id, Task.status == "open")
        .values(available_replicas=Task.available_replicas + 1, updated_at=now)
    )


async def release(session: AsyncSession, node_id: str, assignment_id: str, *, now: dt.datetime) -> Assignment:
    """The node gives a lease back (e.g. shutting down): the replica is reissued at once."""
    assignment = await _own_assignment(session, node_id, assignment_id)
    if assignment.status == "active":
        await _give_back(session, assignment, now)
        await session.flush()
    return assignment


async def release_member_leases(
    session: AsyncSession, pool_id: str, node_id: str, *, now: dt.datetime
) -> int:
    """A node left the pool (leave, ejection, blacklist, completion): give back its live leases
    there so their replicas are reissued at once. Returns how many."""
    active = list(
        (
            await session.execute(
                select(Assignment)
                .where(
                    Assignment.pool_id == pool_id,
                    Assignment.node_id == node_id,
                    Assignment.status == "active",
                )
                .with_for_update()
            )
        ).scalars()
    )
    for assignment in active:
        await _give_back(session, assignment, now)
    await session.flush()
    return len(active)


async def reap_expired(session: AsyncSession, *, now: dt.datetime, limit: int = 1000) -> tuple[int, int]:
    """Expire leases past their deadline; reissue their replicas, or fail the task after the
    pool's max attempts. Returns (expired, tasks failed). Reads only expired leases."""
    stmt = (
        select(Assignment)
        .where(Assignment.status == "active", Assignment.lease_expires_at <= now)
        .order_by(Assignment.lease_expires_at)
        .limit(limit)
    )
    if is_postgres(session):
        stmt = stmt.with_for_update(skip_locked=True)
    expired = list((await session.execute(stmt)).scalars())
    if not expired:
        return 0, 0
    pools = {
        p.id: p
        for p in (
            await session.execute(select(Pool).where(Pool.id.in_({a.pool_id for a in expired})))
        ).scalars()
    }
    replicas = {
        r.id: r
        for r in (
            await session.execute(
                select(TaskReplica)
                .where(TaskReplica.id.in_([a.replica_id for a in expired]))
                .with_for_update()
            )
        ).scalars()
    }
    failed_tasks: dict[int, str] = {}
    reopened: dict[int, int] = {}
    for assignment in expired:
        assignment.status = "expired"
        assignment.ended_at = now
        replica = replicas[assignment.replica_id]
        if replica.current_assignment_id != assignment.id:
            continue
        replica.expirations += 1
        replica.current_assignment_id = None
        if replica.expirations >= pools[assignment.pool_id].max_attempts:
            replica.status = "failed"
            failed_tasks[assignment.task_id] = (
                f"replica {replica.replica_index} expired {replica.expirations} times (max attempts)"
            )
        else:
            replica.status = "available"
            reopened[assignment.task_id] = reopened.get(assignment.task_id, 0) + 1
    for task_id, count in reopened.items():
        if task_id not in failed_tasks:
            await session.execute(
                update(Task)
                .where(Task.id == task_id, Task.status == "open")
                .values(available_replicas=Task.available_replicas + count, updated_at=now)
            )
    for task_id, reason in failed_tasks.items():
        task = await session.get(Task, task_id, with_for_update=True)
        if task is not None and task.status == "open":
            await cancel_task(session, task, reason)
            task.status = "failed"
    await session.flush()
    if failed_tasks:
        log.warning("tasks_failed", count=len(failed_tasks))
    return len(expired), len(failed_tasks)


# ------------------------------------------------------------------------ results


@dataclass(frozen=True)
class SubmitResult:
    out: ResultOut
    created: bool


async def submit_result(
    session: AsyncSession,
    node: Node,
    assignment_id: str,
    body: ResultIn,
    signed: SignedRequest,
    *,
    now: dt.datetime,
) -> SubmitResult:
    assignment = await _own_assignment(session, node.id, assignment_id)
    digest = hashlib.sha256(signed.body).hexdigest()
    previous = (
        await session.execute(select(Submission).where(Submission.assignment_id == assignment_id))
    ).scalar_one_or_none()
    if previous is not None:
        if previous.body_sha256 != digest:
            raise Conflict(
                "a different result was already recorded for this assignment",
                code="result_conflict",
                extra={"submission_id": previous.id},
            )
        return SubmitResult(ResultOut.model_validate(previous.response), created=False)
    if assignment.status == "cancelled":
        raise Conflict("the task was cancelled", code="task_cancelled")
    replica = await session.get(TaskReplica, assignment.replica_id, with_for_update=True)
    assert replica is not None
    if (
        assignment.status != "active"
        or assignment.lease_expires_at <= now
        or body.fencing_token != assignment.fencing_token
        or replica.current_assignment_id != assignment.id
    ):
        raise Conflict(
            "this lease has expired or was reissued; the result is not recorded", code="lease_expired"
        )
    pool = await session.get(Pool, assignment.pool_id)
    policy = await current_policy(session, assignment.pool_id)
    assert pool is not None
    assert policy is not None
    if body.policy_step > policy.step:
        raise Conflict(
            f"policy step {body.policy_step} was never published (current {policy.step})",
            code="policy_unknown",
        )
    if body.policy_step < policy.step - pool.max_async_level:
        raise Conflict(
            f"policy step {body.policy_step} is more than {pool.max_async_level} steps behind "
            f"the current {policy.step}",
            code="policy_stale",
            extra={"current_step": policy.step, "max_async_level": pool.max_async_level},
        )
    submission = Submission(
        assignment_id=assignment.id,
        task_id=assignment.task_id,
        replica_id=replica.id,
        pool_id=assignment.pool_id,
        node_id=node.id,
        provider_id=node.provider_id,
        policy_step=body.policy_step,
        policy_current_step=policy.step,
        seed_echoed=body.seed,
        claimed_reward=body.claimed_reward,
        sample_count=len(body.samples),
        status="pending",
        body_sha256=digest,
        body=signed.body,
        method=signed.method,
        target_uri=signed.target_uri,
        signature_input=signed.signature_input,
        signature=signed.signature,
        content_digest=signed.content_digest,
        response={},
        received_at=now,
    )
    session.add(submission)
    await session.flush()
    out = ResultOut(
        submission_id=submission.id,
        assignment_id=assignment.id,
        task_id=assignment.task_id,
        status="pending",
        received_at=now,
    )
    submission.response = out.model_dump(mode="json")
    await verification.enqueue(session, submission)
    assignment.status = "submitted"
    assignment.ended_at = now
    replica.status = "submitted"
    await session.execute(
        update(Task)
        .where(Task.id == assignment.task_id)
        .values(submitted_replicas=Task.submitted_replicas + 1, updated_at=now)
    )
    await session.execute(
        update(Task)
        .where(
            Task.id == assignment.task_id, Task.status == "open", Task.submitted_replicas >= Task.replication
        )
        .values(status="submitted")
    )
    await session.flush()
    return SubmitResult(out, created=True)
