"""Rules for policies, task batches, claims, leases and results.

The claim and result paths are hot; each runs a small fixed number of statements whatever the
batch size (batch INSERTs, executemany UPDATEs by primary key), and a claim locks *tasks*, not
replicas, with ``FOR UPDATE SKIP LOCKED`` on PostgreSQL. Locking the task means two replicas of
one task are never handed out by concurrent claims, so the placement rule (different provider,
different IP, never the same node twice) cannot be raced. On SQLite the single writer
serialises claims.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import structlog
from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Row,
    ScalarSelect,
    Select,
    TextualSelect,
    and_,
    bindparam,
    case,
    func,
    insert,
    select,
    text,
    update,
)
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

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
from orchestrator.core.db import UTCDateTime
from orchestrator.core.digest import body_digests
from orchestrator.core.errors import Conflict, NotFound, ServiceUnavailable, UnprocessableEntity
from orchestrator.core.signing import SignedRequest
from orchestrator.core.sql import is_postgres
from orchestrator.identity.auth import unknown_node
from orchestrator.identity.models import Node, NodeStatus
from orchestrator.identity.service import banned_node_of
from orchestrator.ledger.service import MAX_AMOUNT
from orchestrator.pools.models import Pool, PoolMembership
from orchestrator.tasks.models import (
    ASSIGNMENT_ID,
    Assignment,
    PolicyVersion,
    Submission,
    Task,
    TaskBatch,
    TaskReplica,
)
from orchestrator.tasks.refs import task_ref
from orchestrator.tasks.seeds import derive_seed
from orchestrator.verification import service as verification
from orchestrator.verification.models import VerificationJob

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
# ``not_a_member`` for a membership pending approval: the operator may approve it at any moment,
# and its node should start within seconds of that, not after a minute. As often as an idle
# member's ``no_tasks``: the bundled worker claims that often while pending, and reads its
# record (to notice a rejection) once a minute.
PENDING_RETRY_AFTER_S = 5
# A node that reports FAILURE_STREAK leases in a row failed on it in a pool (releases with an
# error, no result of its own in between) is refused claims there (``node_failing``) for
# FAILURE_COOLDOWN_S, doubled with each further failure, up to FAILURE_COOLDOWN_MAX_S: a broken
# backend fails at once and would claim again at once, taking far more than its share of the
# queue and, with the nodes of max_failures - 1 other providers like it, ending good tasks.
FAILURE_STREAK = 3
FAILURE_COOLDOWN_S = 60
FAILURE_COOLDOWN_MAX_S = 3600


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


async def publish_policy(
    session: AsyncSession, pool: Pool, body: PolicyIn, actor: str
) -> tuple[PolicyVersion, bool]:
    """The version published (caller holds the pool), and whether this call published it: the
    same step with the same checkpoint again (a retry after a lost answer) returns the version
    as it was; the same step with another checkpoint, or a step not above the current one, is
    409 ``policy_step_not_increasing``."""
    shards = [s.model_dump() for s in body.shards] if body.shards is not None else None
    current = await current_policy(session, pool.id)
    if current is not None and body.step <= current.step:
        # A retry: the same step with the same checkpoint is the version as published.
        published = (
            current
            if current.step == body.step
            else await session.scalar(
                select(PolicyVersion).where(PolicyVersion.pool_id == pool.id, PolicyVersion.step == body.step)
            )
        )
        if published is not None:
            if (published.uri, published.sha256, published.size_bytes, published.shards) == (
                body.uri,
                body.sha256,
                body.size,
                shards,
            ):
                return published, False
            raise Conflict(
                f"step {body.step} was already published with another checkpoint",
                code="policy_step_not_increasing",
                extra={"current_step": current.step},
            )
    if pool.status == "completed":
        raise Conflict("the pool is completed", code="pool_completed")
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
        shards=shards,
        created_by=actor,
        created_at=dt.datetime.now(dt.UTC),
    )
    try:
        async with session.begin_nested():
            session.add(row)
            await session.flush()
    except IntegrityError as exc:
        raise Conflict(f"step {body.step} was already published", code="policy_step_not_increasing") from exc
    return row, True


# ------------------------------------------------------------------------ tasks


@dataclass(frozen=True)
class EnqueueResult:
    batch: TaskBatch
    first_task_id: int
    created: bool


async def enqueue(
    session: AsyncSession, pool: Pool, body: TaskBatchIn, *, secret: bytes, actor: str, now: dt.datetime
) -> EnqueueResult:
    """Insert a batch of tasks and their replicas atomically; idempotent by ``batch_key``."""
    digests = body_digests(body)
    digest = digests[0]
    existing = await _batch(session, pool.id, body.batch_key)
    if existing is not None:
        return await _same_batch(session, existing, digests)
    if is_postgres(session):
        # The pool as it is now, and kept so until this commits (FOR SHARE: enqueues do not wait
        # for each other): a completion (which cancels the open tasks) or a settings change
        # waits for it, or it for them and then reads their result. Read without a lock, the
        # pool could be completed between that read and this batch's commit, leaving tasks open
        # in a completed pool. (SQLite's transactions are serialised from their start.)
        await session.refresh(pool, with_for_update={"read": True})
    if pool.status == "completed":
        raise Conflict("the pool is completed", code="pool_completed")
    _rewards_fit(pool, body)
    _replicas_fit(pool, body)
    past = [i for i, t in enumerate(body.tasks) if t.deadline_at is not None and t.deadline_at <= now]
    if past:
        raise UnprocessableEntity(
            f"the deadline_at of {len(past)} task(s) is already past; such a task could never be leased",
            code="deadline_passed",
            extra={"task_indexes": past[:100]},
        )
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
        return await _same_batch(session, found, digests)

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


def _rewards_fit(pool: Pool, body: TaskBatchIn) -> None:
    """A result's reward (``reward_per_sample`` x its correct samples) is paid in one transfer,
    which the ledger caps at ``MAX_AMOUNT``: a task whose full reward would exceed it could never
    be decided. The pool settings bound ``reward_per_sample`` so that no task does; a pool
    stored before that bound may still have a larger one, and its tasks are checked here."""
    over = [i for i, t in enumerate(body.tasks) if pool.reward_per_sample * t.sampling.n > MAX_AMOUNT]
    if over:
        raise Conflict(
            f"the pool's reward_per_sample ({pool.reward_per_sample}) times the samples (n) of "
            f"{len(over)} task(s) exceeds the largest amount the ledger moves at once ({MAX_AMOUNT}); "
            "lower the pool's reward_per_sample or the tasks' n",
            code="reward_exceeds_ledger_limit",
            extra={"task_indexes": over[:100], "max_amount": MAX_AMOUNT},
        )


def _replicas_fit(pool: Pool, body: TaskBatchIn) -> None:
    """A task's replicas go to different nodes, so a pool capped at ``max_nodes`` leases at most
    that many of one task (its ``replication_factor`` is held to the cap by the pool settings);
    a task asking for more would stay open for ever."""
    cap = pool.max_nodes
    if cap is None:
        return
    over = [i for i, t in enumerate(body.tasks) if (t.replication or pool.replication_factor) > cap]
    if over:
        raise Conflict(
            f"{len(over)} task(s) ask for more replicas than the pool admits nodes (caps.max_nodes "
            f"{cap}); replicas go to different nodes, so such a task could never be done",
            code="replication_exceeds_max_nodes",
            extra={"task_indexes": over[:100], "max_nodes": cap},
        )


async def open_tasks_above(session: AsyncSession, pool_id: str, replication: int) -> tuple[int, int]:
    """How many of the pool's open tasks have more than ``replication`` replicas, and the most
    replicas any of them has (0, 0 when none has)."""
    count, highest = (
        await session.execute(
            select(func.count(), func.coalesce(func.max(Task.replication), 0)).where(
                Task.pool_id == pool_id, Task.status == "open", Task.replication > replication
            )
        )
    ).one()
    return int(count), int(highest)


async def _batch(session: AsyncSession, pool_id: str, key: str) -> TaskBatch | None:
    return (
        await session.execute(
            select(TaskBatch).where(TaskBatch.pool_id == pool_id, TaskBatch.batch_key == key)
        )
    ).scalar_one_or_none()


async def _same_batch(session: AsyncSession, batch: TaskBatch, digests: tuple[str, str]) -> EnqueueResult:
    if batch.body_sha256 not in digests:
        raise Conflict(
            "this batch_key was already used for different tasks",
            code="batch_key_reused",
            extra={"batch_id": batch.id},
        )
    first = await session.scalar(select(func.min(Task.id)).where(Task.batch_id == batch.id))
    return EnqueueResult(batch=batch, first_task_id=int(first or 0), created=False)


# Lock order between a task and its live leases. A result, the reaper's expiry and a release
# lock a lease, then its replica, then write the task. Ending a task (a cancel, its deadline,
# max attempts, a ReST^EM iteration's expiry) writes every live lease and replica of the task,
# so it locks them first, in that order, and only then the task: holding the task while it
# waited for a lease that a result holds, as that result waited for the task, was a deadlock,
# which PostgreSQL breaks after a second by failing one of the two (a 503). Claims do not take
# part: they lock the task and then write a replica no lease holds.
_LOCK_LIVE_LEASES = text(
    """
    SELECT a.id FROM assignments a JOIN task_replicas r ON r.id = a.replica_id
     WHERE a.task_id = ANY(CAST(:task_ids AS bigint[])) AND a.status = 'active'
     ORDER BY a.id FOR UPDATE OF a, r
    """
)


async def lock_live_leases(session: AsyncSession, task_ids: Sequence[int]) -> None:
    """Before locking tasks to end them: lock their live leases and those leases' replicas (on
    PostgreSQL; SQLite's single writer has no lock order)."""
    if task_ids and is_postgres(session):
        await session.execute(_LOCK_LIVE_LEASES, {"task_ids": list(task_ids)})


_LOCK_MEMBER_LIVE_LEASES = text(
    """
    SELECT a.id FROM assignments a JOIN task_replicas r ON r.id = a.replica_id
     WHERE a.pool_id = :pool_id AND a.node_id = ANY(CAST(:node_ids AS varchar[])) AND a.status = 'active'
     ORDER BY a.id FOR UPDATE OF a, r
    """
)
_LOCK_NODES = text(
    "SELECT id FROM nodes WHERE id = ANY(CAST(:ids AS varchar[])) ORDER BY id FOR NO KEY UPDATE"
)


async def lock_member_live_leases(session: AsyncSession, pool_id: str, node_ids: Sequence[str]) -> None:
    """Before several memberships of a pool end (a completion, a blacklisting): lock their nodes
    (``node_ids``, in id order: a claim, a reviving beat and a leave lock a node before its
    leases), then the nodes' live leases in the pool and their replicas, in id order
    (``lock_live_leases``' order), before each membership gives its node's leases back. Taken
    node by node, the leases deadlocked with a cancel of a task whose leases' ids came in the
    other order (PostgreSQL; SQLite's single writer has no lock order)."""
    if node_ids and is_postgres(session):
        await session.execute(_LOCK_NODES, {"ids": sorted(node_ids)})
        await session.execute(_LOCK_MEMBER_LIVE_LEASES, {"pool_id": pool_id, "node_ids": sorted(node_ids)})


async def cancel_task(
    session: AsyncSession, task: Task, reason: str, *, end_reason: str = "cancelled"
) -> Task:
    """Idempotent. Live leases are cancelled (their heartbeats are told to drop them). ``reason``
    is text for people, ``end_reason`` one of ``models.END_REASONS`` for machines. The caller
    locked the task's live leases (``lock_live_leases``) before the task.

    A task whose results are all in (``submitted``) is left as it is, as when its pool
    completes: the results are judged and paid all the same (the nodes did the work in time),
    so a ``cancelled`` task would have been accepted, paid and fed to the trainer."""
    if task.status in ("cancelled", "completed", "failed", "submitted"):
        return task
    now = dt.datetime.now(dt.UTC)
    await _withdraw(session, [task.id], now=now)
    task.status = "cancelled"
    task.available_replicas = 0
    task.failure_reason = reason
    task.end_reason = end_reason
    task.updated_at = now
    await session.flush()
    await verification.settle_abandoned(session, task.id, now=now)
    return task


async def _withdraw(
    session: AsyncSession, task_ids: Sequence[int] | ScalarSelect[int], *, now: dt.datetime
) -> None:
    """The tasks end: their replicas not yet answered and their live leases are cancelled (the
    nodes' heartbeats are told to drop those leases). The caller writes the tasks."""
    await session.execute(
        update(TaskReplica)
        .where(TaskReplica.task_id.in_(task_ids), TaskReplica.status.in_(("available", "leased")))
        .values(status="cancelled")
    )
    await session.execute(
        update(Assignment)
        .where(Assignment.task_id.in_(task_ids), Assignment.status == "active")
        .values(status="cancelled", ended_at=now)
    )


async def fail_task(session: AsyncSession, task: Task, reason: str, *, end_reason: str) -> None:
    """An open task that can no longer be done (max attempts, deadline) ends ``failed``: its
    live leases are cancelled and waiting results settled, as for a cancellation."""
    if task.status != "open":
        return
    await cancel_task(session, task, reason, end_reason=end_reason)
    task.status = "failed"


async def end_pool_tasks(session: AsyncSession, pool_id: str, *, now: dt.datetime) -> int:
    """The pool was completed: no node will ever lease its tasks again, so every open one is
    cancelled (``end_reason`` ``pool_completed``), as an operator's cancel would have it: its
    replicas and any live lease are cancelled, and results waiting for a sibling replica are
    settled (inconclusive). Tasks whose every replica is in (``submitted``) are left to the
    verifier. Set-based, so that a pool with many queued tasks completes in a few statements.
    Lock order as for any ending: the live leases and their replicas, then the tasks. Returns
    how many tasks were cancelled."""
    still_open = (Task.pool_id == pool_id, Task.status == "open")
    ids = list((await session.execute(select(Task.id).where(*still_open).order_by(Task.id))).scalars())
    if not ids:
        return 0
    await lock_live_leases(session, ids)
    if is_postgres(session):
        locked = select(Task.id).where(*still_open).order_by(Task.id).with_for_update()
        ids = list((await session.execute(locked)).scalars())
    await _withdraw(session, select(Task.id).where(*still_open).scalar_subquery(), now=now)
    await session.execute(
        update(Task)
        .where(*still_open)
        .values(
            status="cancelled",
            available_replicas=0,
            failure_reason="the pool was completed",
            end_reason="pool_completed",
            updated_at=now,
        )
        .execution_options(synchronize_session=False)
    )
    cancelled = set(ids)
    waiting = await session.execute(
        select(VerificationJob.task_id)
        .where(VerificationJob.pool_id == pool_id, VerificationJob.stage == "quorum")
        .distinct()
    )
    for task_id in sorted(set(waiting.scalars()) & cancelled):
        await verification.settle_abandoned(session, task_id, now=now)
    await session.flush()
    return len(ids)


# ------------------------------------------------------------------------ claims


def _no_work(reason: str, detail: str, *, retry_after_s: int | None = None) -> ClaimOut:
    wait = RETRY_AFTER_S[reason] if retry_after_s is None else retry_after_s
    return ClaimOut(leases=[], reason=reason, detail=detail, retry_after_s=wait)


@dataclass(frozen=True)
class ClaimContext:
    """Everything a claim decides on, read in one statement."""

    node_provider_id: str
    node_ip: str | None
    node_status: str
    pool_status: str | None
    max_leases_per_node: int
    lease_duration_s: int
    retake_expired_after_s: int | None
    member_status: str | None
    failing_until: dt.datetime | None
    policy_step: int | None
    policy_uri: str | None
    policy_sha256: str | None
    held: int


# On PostgreSQL a claim first locks the signer's node row (FOR NO KEY UPDATE: foreign-key checks
# elsewhere are not blocked), so one node's concurrent claims queue up and its lease cap holds
# exactly. It is a statement of its own: the context read after it then takes a fresh snapshot
# that sees the leases the previous claim committed. (SQLite's single writer does the same.)
_LOCK_SIGNER = text("SELECT 1 FROM nodes WHERE id = :node_id FOR NO KEY UPDATE")

# One read for the node (the signer), the pool, the membership, the current policy and the
# node's live leases there. Scalar subqueries keep it to one row on both dialects. A lease past
# its deadline that the reaper has not ended yet is not counted: its results are refused
# (``lease_expired``), so it no longer holds a place under the node's cap.
_CLAIM_CONTEXT = (
    text(
        """
    SELECT n.provider_id, n.ip_address, n.status AS node_status,
           p.status AS pool_status, p.max_leases_per_node, p.lease_duration_s,
           p.retake_expired_after_s, m.status AS member_status, m.failing_until,
           pv.step, pv.uri, pv.sha256,
           (SELECT count(*) FROM assignments a
             WHERE a.pool_id = :pool_id AND a.node_id = n.id AND a.status = 'active'
               AND a.lease_expires_at > :now) AS held
      FROM nodes n
      LEFT JOIN pools p ON p.id = :pool_id
      LEFT JOIN pool_memberships m ON m.pool_id = :pool_id AND m.node_id = n.id
      LEFT JOIN policy_versions pv ON pv.pool_id = p.id
       AND pv.step = (SELECT max(step) FROM policy_versions WHERE pool_id = :pool_id)
     WHERE n.id = :node_id
    """
    )
    .bindparams(bindparam("now", type_=UTCDateTime()))
    .columns(failing_until=UTCDateTime())
)


# The tasks of the pool this node may take: open, with a replica to lease, not past their
# deadline, none of its replicas live or submitted with this node's provider or IP, and none
# ever with this node, but for a lease it gave back without an error (a worker stopped, say)
# whose replica is available again: the claim hands it that very replica, with the same seed,
# so taking it back shops for nothing, and a small pool's tasks are not stranded by a worker's
# restart. A failure is never taken back, nor an expired lease (an attempt), unless the pool
# sets ``retake_expired_after_s``: then that long after the expiry (``:retake_before``). The
# replica is joined (a primary-key lookup, made only for this node's own earlier leases of the
# task), not read in a subquery: with a subquery PostgreSQL hashed the whole queue or the node's
# history instead of walking the queue in claim order and stopping at ``room`` tasks (2-20 ms a
# claim).
_MAY_TAKE = """
       t.pool_id = :pool_id AND t.status = 'open' AND t.available_replicas > 0
   AND (t.deadline_at IS NULL OR t.deadline_at > :now)
   AND NOT EXISTS (
     SELECT 1 FROM assignments a
       LEFT JOIN task_replicas r0 ON r0.id = a.replica_id AND a.node_id = :node_id
      WHERE a.task_id = t.id
        AND ((a.node_id = :node_id
              AND ({never_again} OR a.error IS NOT NULL OR r0.status <> 'available'))
             OR (a.status IN ('active', 'submitted')
                 AND (a.provider_id = :provider_id OR {ip_match}))))
"""
# Which of its own ended leases of a task keep a node from it, by whether the pool lets it
# retake an expired one.
_NEVER_AGAIN = {
    False: "a.status <> 'released'",
    True: "(a.status <> 'released' AND (a.status <> 'expired' OR a.ended_at > :retake_before))",
}
# Each picked task joined to its payload and a replica: the one this node gave back, if it
# held one (``_MAY_TAKE`` made sure it is available), else the lowest available. Best rank first.
_REPLICAS_OF = """
    SELECT r.id AS replica_id, r.task_id, r.seed, r.leases_issued,
           t.prompt, t.problem_ref, t.sampling, t.metadata, t.claim_rank
      FROM {tasks}
      JOIN task_replicas r ON r.task_id = t.id AND r.status = 'available'
       AND r.id = COALESCE(
             (SELECT a.replica_id FROM assignments a
               WHERE a.task_id = t.id AND a.node_id = :node_id LIMIT 1),
             (SELECT r2.id FROM task_replicas r2
               WHERE r2.task_id = t.id AND r2.status = 'available'
               ORDER BY r2.replica_index LIMIT 1))
     {where}
     ORDER BY t.claim_rank, t.id
"""
# SQLite (one writer at a time): the pick is one statement.
_PICK_ONE_WRITER = """
    WITH picked AS (
      SELECT t.id FROM tasks t WHERE {may_take} ORDER BY t.claim_rank, t.id LIMIT :room
    ) {replicas}
"""
# PostgreSQL: two statements. The first locks the best tasks the node may take (SKIP LOCKED:
# concurrent claims take different tasks). It cannot also choose the replicas: a task locked
# after a concurrent claim committed is re-checked on its own new row only, while its replicas,
# assignments and the placement rule are still read from the statement's older snapshot, so the
# replica the other claim just leased would look available. The second statement, run while the
# locks are held, reads with a snapshot that has every claim of those tasks that committed and
# re-applies the rules to them before choosing each task's replica.
_PICK_LOCK = """
    SELECT t.id FROM tasks t WHERE {may_take}
     ORDER BY t.claim_rank, t.id LIMIT :room FOR UPDATE OF t SKIP LOCKED
"""
# The locked tasks are read by primary key in a materialised CTE, and the rules re-applied to
# them after: with the rules in the same WHERE as ``t.id = ANY(...)``, the planner could walk
# the pool's whole claimable index instead (2 ms at 8,000 open tasks).
_PICK_LOCKED = """
    WITH locked AS MATERIALIZED (SELECT * FROM tasks WHERE id = ANY(CAST(:task_ids AS bigint[])))
    {replicas}
"""
_PICK_COLUMNS = {"sampling": JSON(), "metadata": JSON()}


@lru_cache(maxsize=16)
def _pick_statement(kind: str, ip_known: bool, retake_expired: bool) -> TextualSelect:
    """``kind``: ``one_writer`` (SQLite), ``lock`` or ``locked`` (PostgreSQL's two steps)."""
    # A node with no recorded IP counts as sharing the "unknown" IP with every other such node.
    ip_match = "a.ip_address = :ip_address" if ip_known else "a.ip_address IS NULL"
    may_take = _MAY_TAKE.format(ip_match=ip_match, never_again=_NEVER_AGAIN[retake_expired])
    if kind == "one_writer":
        replicas = _REPLICAS_OF.format(tasks="picked JOIN tasks t ON t.id = picked.id", where="")
        sql = _PICK_ONE_WRITER.format(may_take=may_take, replicas=replicas)
    elif kind == "lock":
        sql = _PICK_LOCK.format(may_take=may_take)
    else:
        replicas = _REPLICAS_OF.format(tasks="locked t", where=f"WHERE {may_take}")
        sql = _PICK_LOCKED.format(replicas=replicas)
    stmt = text(sql).bindparams(bindparam("now", type_=UTCDateTime()))
    if retake_expired:
        stmt = stmt.bindparams(bindparam("retake_before", type_=UTCDateTime()))
    if kind == "lock":
        return stmt.columns(id=BigInteger())
    return stmt.columns(**_PICK_COLUMNS)


# The hot paths' writes are built once: SQLAlchemy then reuses their cache keys and compiled
# SQL instead of constructing and hashing a new statement on every request.
_ASSIGNMENTS, _REPLICAS, _TASKS = Assignment.__table__.c, TaskReplica.__table__.c, Task.__table__.c
_INSERT_ASSIGNMENTS = insert(Assignment.__table__)  # type: ignore[arg-type]
_LEASE_REPLICA = (
    update(TaskReplica.__table__)  # type: ignore[arg-type]
    .where(_REPLICAS.id == bindparam("b_id"))
    .values(status="leased", leases_issued=bindparam("b_token"), current_assignment_id=bindparam("b_asg"))
)
_TASKS_LEASED = (
    update(Task.__table__)  # type: ignore[arg-type]
    .where(_TASKS.id.in_(bindparam("b_ids", expanding=True)))
    .values(available_replicas=_TASKS.available_replicas - 1, updated_at=bindparam("b_now"))
)
# The same three writes as one PostgreSQL statement (one round trip): the leases as arrays,
# unnested once, then the INSERT and the two UPDATEs as data-modifying CTEs.
_LEASE_ALL = text(
    """
    WITH v AS (
      SELECT * FROM unnest(CAST(:b_ids AS varchar[]), CAST(:b_replicas AS bigint[]),
                           CAST(:b_tasks AS bigint[]), CAST(:b_tokens AS integer[]))
               AS v(id, replica_id, task_id, token)
    ), leases AS (
      INSERT INTO assignments (id, replica_id, task_id, pool_id, node_id, provider_id, ip_address,
                               fencing_token, policy_step, status, lease_expires_at, created_at)
      SELECT v.id, v.replica_id, v.task_id, :b_pool, :b_node, :b_provider, CAST(:b_ip AS varchar),
             v.token, :b_step, 'active', :b_expires, :b_now
        FROM v
    ), replicas AS (
      UPDATE task_replicas r
         SET status = 'leased', leases_issued = v.token, current_assignment_id = v.id
        FROM v WHERE r.id = v.replica_id AND r.status = 'available' AND r.leases_issued = v.token - 1
      RETURNING r.id
    ), counts AS (
      UPDATE tasks SET available_replicas = available_replicas - 1, updated_at = :b_now
       WHERE id IN (SELECT task_id FROM v)
    )
    SELECT count(*) FROM replicas
    """
).bindparams(
    bindparam("b_step", type_=BigInteger()),
    bindparam("b_expires", type_=UTCDateTime()),
    bindparam("b_now", type_=UTCDateTime()),
)


def _lease(
    row: Row[Any], assignment_id: str, token: int, policy: PolicyRef, expires: dt.datetime, *, ref: int
) -> Lease:
    """A lease as a claim gives it: ``row`` has the replica's seed and the task's payload (never
    its verification spec, nor which replica of the task it is); ``ref`` is the node's
    reference for the task (``refs.task_ref``), shown in place of the task's id, which would tell
    an audit replica's old task from fresh ones."""
    return Lease(
        assignment_id=assignment_id,
        fencing_token=token,
        seed=row.seed,
        policy=policy,
        lease_expires_at=expires,
        task=LeasedTask(
            task_id=ref,
            prompt=row.prompt,
            problem_ref=row.problem_ref,
            sampling=Sampling(**row.sampling),
            metadata=row.metadata,
        ),
    )


async def claim(
    session: AsyncSession,
    signed_keyid: str,
    pool_id: str,
    max_tasks: int,
    *,
    now: dt.datetime,
    ref_key: bytes,
) -> ClaimOut:
    """Lease up to ``max_tasks`` replicas: one read (after locking the signer's row on
    PostgreSQL), one locked pick, three batch writes, whatever ``max_tasks`` is. The leases name
    their tasks by the node's references, keyed with ``ref_key`` (the seed secret)."""
    conn = await session.connection()
    postgres = is_postgres(session)
    if postgres:
        await conn.execute(_LOCK_SIGNER, {"node_id": signed_keyid})
    keys = {"pool_id": pool_id, "node_id": signed_keyid, "now": now}
    row = (await conn.execute(_CLAIM_CONTEXT, keys)).first()
    if row is None:
        raise unknown_node()
    ctx = ClaimContext(*row)
    if ctx.node_status == NodeStatus.banned:
        raise await banned_node_of(conn, signed_keyid)
    if ctx.pool_status is None:
        raise NotFound("no pool with this id", code="pool_not_found")
    if ctx.pool_status == "paused":
        return _no_work("pool_paused", "the pool is paused")
    if ctx.pool_status != "active":
        return _no_work("pool_not_active", f"the pool is {ctx.pool_status}")
    if ctx.member_status == "pending":
        detail = "this node's join of the pool waits for the pool's operator to approve it"
        return _no_work("not_a_member", detail, retry_after_s=PENDING_RETRY_AFTER_S)
    if ctx.member_status != "active":
        return _no_work("not_a_member", "this node is not an active member of the pool")
    if ctx.node_status != NodeStatus.healthy:
        return _no_work("node_unhealthy", f"the node is {ctx.node_status}; send a heartbeat first")
    if ctx.failing_until is not None and ctx.failing_until > now:
        wait = math.ceil((ctx.failing_until - now).total_seconds())
        detail = (
            f"the node gave back its last {FAILURE_STREAK} or more leases here as failed; "
            f"it may claim again in {wait} s"
        )
        return _no_work("node_failing", detail, retry_after_s=wait)
    if ctx.policy_step is None or ctx.policy_uri is None or ctx.policy_sha256 is None:
        return _no_work("no_policy", "no policy version has been published for this pool yet")
    room = min(max_tasks, ctx.max_leases_per_node - int(ctx.held))
    if room <= 0:
        return _no_work("lease_cap_reached", f"the node already holds {ctx.held} leases in this pool")

    ip_known = ctx.node_ip is not None
    params: dict[str, Any] = {
        "pool_id": pool_id,
        "node_id": signed_keyid,
        "provider_id": ctx.node_provider_id,
        "now": now,
    }
    if ip_known:
        params["ip_address"] = ctx.node_ip
    retake = ctx.retake_expired_after_s is not None
    if ctx.retake_expired_after_s is not None:
        params["retake_before"] = now - dt.timedelta(seconds=ctx.retake_expired_after_s)
    picked: Sequence[Row[Any]] = []
    if postgres:
        # When every task the first step locked fails the second step's check (each was taken
        # by a claim that committed after the first step's snapshot), look once more, with a
        # fresh snapshot: "no_tasks" means that none is waiting.
        for _ in range(2):
            locked = await conn.execute(_pick_statement("lock", ip_known, retake), {**params, "room": room})
            task_ids = list(locked.scalars())
            if not task_ids:
                break
            locked_params = {**params, "task_ids": task_ids}
            picked = (await conn.execute(_pick_statement("locked", ip_known, retake), locked_params)).all()
            if picked:
                break
    else:
        pick = _pick_statement("one_writer", ip_known, retake)
        picked = (await conn.execute(pick, {**params, "room": room})).all()
    if not picked:
        return _no_work("no_tasks", "no task this node may take is waiting")

    expires = now + dt.timedelta(seconds=ctx.lease_duration_s)
    policy = PolicyRef(step=ctx.policy_step, uri=ctx.policy_uri, sha256=ctx.policy_sha256)
    assignments, replica_updates, leases = [], [], []
    for r in picked:
        assignment_id = "asg_" + secrets.token_urlsafe(18)
        token = r.leases_issued + 1
        assignments.append(
            {
                "id": assignment_id,
                "replica_id": r.replica_id,
                "task_id": r.task_id,
                "pool_id": pool_id,
                "node_id": signed_keyid,
                "provider_id": ctx.node_provider_id,
                "ip_address": ctx.node_ip,
                "fencing_token": token,
                "policy_step": ctx.policy_step,
                "status": "active",
                "lease_expires_at": expires,
                "created_at": now,
                "ended_at": None,
            }
        )
        replica_updates.append({"b_id": r.replica_id, "b_token": token, "b_asg": assignment_id})
        ref = task_ref(ref_key, signed_keyid, r.task_id)
        leases.append(_lease(r, assignment_id, token, policy, expires, ref=ref))
    if postgres:
        leased = await conn.scalar(
            _LEASE_ALL,
            {
                "b_ids": [a["id"] for a in assignments],
                "b_replicas": [a["replica_id"] for a in assignments],
                "b_tasks": [a["task_id"] for a in assignments],
                "b_tokens": [a["fencing_token"] for a in assignments],
                "b_pool": pool_id,
                "b_node": signed_keyid,
                "b_provider": ctx.node_provider_id,
                "b_ip": ctx.node_ip,
                "b_step": ctx.policy_step,
                "b_expires": expires,
                "b_now": now,
            },
        )
        if leased != len(assignments):  # the pick guarantees it; never record a double lease
            log.error("claim_replica_taken", node_id=signed_keyid, picked=len(assignments), leased=leased)
            raise ServiceUnavailable(
                "a replica this claim picked was leased by a concurrent claim; nothing was "
                "recorded. Send the same request again.",
                code="transient_conflict",
                headers={"Retry-After": "1"},
            )
    else:
        await conn.execute(_INSERT_ASSIGNMENTS, assignments)
        await conn.execute(_LEASE_REPLICA, replica_updates)
        await conn.execute(_TASKS_LEASED, {"b_ids": [a["task_id"] for a in assignments], "b_now": now})
    return ClaimOut(leases=leases)


# ------------------------------------------------------------------------ leases

# A node's live leases, as its claims answered them: the policy each was leased under (its
# step's uri and digest), the replica's seed and the task's payload, never its verification.
_LIVE_LEASES = (
    text(
        """
    SELECT a.id, a.fencing_token, a.lease_expires_at, a.policy_step, pv.uri, pv.sha256,
           r.seed, t.id AS task_id, t.prompt, t.problem_ref, t.sampling, t.metadata
      FROM assignments a
      JOIN task_replicas r ON r.id = a.replica_id
      JOIN tasks t ON t.id = a.task_id
      JOIN policy_versions pv ON pv.pool_id = a.pool_id AND pv.step = a.policy_step
     WHERE a.node_id = :node_id AND a.status = 'active' AND a.lease_expires_at > :now
       AND (CAST(:pool_id AS varchar) IS NULL OR a.pool_id = :pool_id)
     ORDER BY a.created_at, t.claim_rank, t.id
     LIMIT :limit
    """
    )
    .bindparams(bindparam("now", type_=UTCDateTime()))
    .columns(lease_expires_at=UTCDateTime(), **_PICK_COLUMNS)
)


async def placement(session: AsyncSession, pool_id: str) -> dict[str, int]:
    """What the pool's healthy active members can take of a task: its replicas go to distinct
    providers and distinct addresses, so at most as many as the fewer of those; an open task
    with more replicas waits for members to join (or come back) before its others are leased."""
    members, providers, addresses = (
        await session.execute(
            select(
                func.count(),
                func.count(func.distinct(PoolMembership.provider_id)),
                func.count(func.distinct(Node.ip_address)),
            )
            .select_from(PoolMembership)
            .join(Node, Node.id == PoolMembership.node_id)
            .where(
                PoolMembership.pool_id == pool_id,
                PoolMembership.status == "active",
                Node.status == NodeStatus.healthy.value,
            )
        )
    ).one()
    bound = min(providers, addresses)
    waiting = await session.scalar(
        select(func.count())
        .select_from(Task)
        .where(Task.pool_id == pool_id, Task.status == "open", Task.replication > bound)
    )
    return {
        "healthy_members": int(members),
        "providers": int(providers),
        "addresses": int(addresses),
        "open_tasks_beyond_members": int(waiting or 0),
    }


async def live_leases(
    session: AsyncSession,
    node_id: str,
    pool_id: str | None,
    *,
    now: dt.datetime,
    limit: int,
    ref_key: bytes,
) -> list[Lease]:
    """The node's leases still live (active and within their deadline), oldest first (one
    claim's in the order it gave them): what a worker that lost a claim's answer, or
    restarted, holds without knowing it. Their tasks are named as the claims named them."""
    params = {"node_id": node_id, "pool_id": pool_id, "now": now, "limit": limit}
    rows = (await session.execute(_LIVE_LEASES, params)).all()
    return [
        _lease(
            r,
            r.id,
            r.fencing_token,
            PolicyRef(step=r.policy_step, uri=r.uri, sha256=r.sha256),
            r.lease_expires_at,
            ref=task_ref(ref_key, node_id, r.task_id),
        )
        for r in rows
    ]


async def extend_leases(
    session: AsyncSession, node_id: str, lease_ids: list[str], *, now: dt.datetime, keep_s: float
) -> tuple[list[str], list[tuple[str, dt.datetime]]]:
    """Extend the node's live leases among ``lease_ids``; return the ids it must drop, and each
    one it keeps with its deadline after this (both in the order named, each id once).

    A lease is written only when less than half of its duration is left, so a steady heartbeat
    costs one indexed read, and a write per lease only every half lease period; and whenever
    less than ``keep_s`` is left (the liveness sweeper's unhealthy threshold), so that a node
    that is still healthy, having missed fewer beats than that, never loses a lease it lists
    (a short lease is then written at each beat). No lease is extended past its pool's
    ``max_lease_s`` from its claim: a node that beats and never answers loses the lease then,
    as if it had stopped beating, and the replica is reissued.
    """
    if not lease_ids:
        return [], []
    rows = (
        await session.execute(
            select(
                Assignment.id,
                Assignment.lease_expires_at,
                Assignment.created_at,
                Pool.lease_duration_s,
                Pool.max_lease_s,
            )
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
    # What the read found, then what the UPDATEs wrote: no statement of their own.
    deadline_of = {row.id: row.lease_expires_at for row in rows}
    by_deadline: dict[dt.datetime, list[str]] = {}
    for row in rows:
        if row.lease_expires_at - now >= dt.timedelta(seconds=max(row.lease_duration_s / 2, keep_s)):
            continue
        deadline = min(
            now + dt.timedelta(seconds=row.lease_duration_s),
            row.created_at + dt.timedelta(seconds=row.max_lease_s),
        )
        if deadline > row.lease_expires_at:
            by_deadline.setdefault(deadline, []).append(row.id)
    if is_postgres(session) and sum(len(ids) for ids in by_deadline.values()) > 1:
        # The leases to write, locked in id order first, as every locker of several leases takes
        # them (the reaper, an ending): each UPDATE locks its rows in the order it finds them.
        to_write = sorted(lease_id for ids in by_deadline.values() for lease_id in ids)
        await session.execute(
            select(Assignment.id).where(Assignment.id.in_(to_write)).order_by(Assignment.id).with_for_update()
        )
    for deadline, ids in by_deadline.items():
        extended = await session.execute(
            update(Assignment)
            .where(Assignment.id.in_(ids), Assignment.status == "active")
            .values(lease_expires_at=deadline)
            .returning(Assignment.id)
            .execution_options(synchronize_session=False)
        )
        # On PostgreSQL the read above took no lock: a lease the reaper (or a release) ended
        # meanwhile is skipped by the UPDATE, which waited for it, and must be dropped too.
        written = set(extended.scalars())
        live -= set(ids) - written
        deadline_of.update(dict.fromkeys(written, deadline))
    named = dict.fromkeys(lease_ids)
    return [i for i in named if i not in live], [(i, deadline_of[i]) for i in named if i in live]


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
    reopened = await session.execute(
        update(TaskReplica)
        .where(TaskReplica.id == assignment.replica_id, TaskReplica.current_assignment_id == assignment.id)
        .values(status="available", current_assignment_id=None)
    )
    if not reopened.rowcount:  # type: ignore[attr-defined]  # the replica is no longer this lease's
        return
    await session.execute(
        update(Task)
        .where(Task.id == assignment.task_id, Task.status == "open")
        .values(available_replicas=Task.available_replicas + 1, updated_at=now)
    )


async def release(
    session: AsyncSession, node_id: str, assignment_id: str, *, now: dt.datetime, error: str | None = None
) -> Assignment:
    """The node gives a lease back (e.g. shutting down): the replica is reissued at once. A
    lease already past its deadline is over: it expires, as the reaper would have it (an
    attempt of the replica), rather than pass for a release given back in time.

    With ``error`` the task failed on the node: it is kept on the lease, and once nodes of the
    pool's ``max_failures`` different providers have said so, the task ends ``failed``
    (``max_failures``) instead of going round every node of the pool. Releasing again changes
    nothing.

    A failure also counts towards the node's streak in the pool (``FAILURE_STREAK``), which may
    keep it from claiming there for a while (``node_failing``)."""
    membership = None
    if error is not None:
        # The node's membership of the lease's pool before the lease: the lock order of an
        # ejection or a leave, which lock the membership and then the node's leases.
        owned = (
            await session.execute(
                select(Assignment.pool_id, Assignment.task_id).where(
                    Assignment.id == assignment_id, Assignment.node_id == node_id
                )
            )
        ).first()
        if owned is not None:
            membership = await session.scalar(
                select(PoolMembership)
                .where(PoolMembership.pool_id == owned.pool_id, PoolMembership.node_id == node_id)
                .with_for_update()
            )
            # Then the task's live leases, this one among them, in id order (``lock_live_leases``:
            # the task may be failed below, which writes them). Locking this lease first and its
            # siblings after deadlocked two failure reports of one task sent at once.
            await lock_live_leases(session, [owned.task_id])
    assignment = await _own_assignment(session, node_id, assignment_id)
    if assignment.status != "active":
        return assignment
    if error is not None:
        assignment.error = error
    if assignment.lease_expires_at <= now:
        await _expire(session, [assignment], now=now)
    else:
        await _give_back(session, assignment, now)
    await session.flush()
    if error is not None:
        await _fail_if_failing_everywhere(session, assignment.task_id)
        if membership is not None:
            await _count_failure(session, membership, now)
    return assignment


async def _count_failure(session: AsyncSession, membership: PoolMembership, now: dt.datetime) -> None:
    """One more failing release by the membership's node: a streak since its last result (in
    any pool) grows; from ``FAILURE_STREAK`` on, the node may not claim in the pool until
    ``failing_until``."""
    last_result = await session.scalar(
        select(Submission.received_at)
        .where(Submission.node_id == membership.node_id)
        .order_by(Submission.id.desc())
        .limit(1)
    )
    since = membership.failures_since
    if membership.failure_streak == 0 or since is None or (last_result is not None and last_result > since):
        membership.failure_streak, membership.failures_since = 1, now
    else:
        membership.failure_streak += 1
    beyond = membership.failure_streak - FAILURE_STREAK
    if beyond >= 0:
        cooldown = min(FAILURE_COOLDOWN_S * 2 ** min(beyond, 16), FAILURE_COOLDOWN_MAX_S)
        membership.failing_until = now + dt.timedelta(seconds=cooldown)
        log.warning(
            "node_failing",
            node_id=membership.node_id,
            pool_id=membership.pool_id,
            streak=membership.failure_streak,
            cooldown_s=cooldown,
        )
    await session.flush()


# The addresses as the leases recorded them at their claims; a node with no recorded address
# shares the unknown one, as in the placement rule.
_FAILED_PROVIDERS = text(
    """
    SELECT count(DISTINCT a.provider_id), count(DISTINCT COALESCE(a.ip_address, '')), p.max_failures
      FROM assignments a JOIN pools p ON p.id = a.pool_id
     WHERE a.task_id = :task_id AND a.error IS NOT NULL
     GROUP BY p.max_failures
    """
)


async def _fail_if_failing_everywhere(session: AsyncSession, task_id: int) -> None:
    """The task fails (``max_failures``) once it failed on the nodes of as many providers, at as
    many addresses, as the pool allows. Providers and addresses, not nodes, as the placement
    rule counts them: one provider's nodes, or the providers of one machine (a provider key
    costs nothing), cannot end a task on their own unless the pool allows a single failure."""
    providers, addresses, allowed = (await session.execute(_FAILED_PROVIDERS, {"task_id": task_id})).one()
    if min(providers, addresses) < allowed:
        return
    task = await session.get(Task, task_id, with_for_update=True, populate_existing=True)
    if task is not None and task.status == "open":
        await fail_task(
            session,
            task,
            f"failed on the nodes of {providers} providers"
            + (f" at {addresses} addresses" if addresses < providers else "")
            + " (max failures)",
            end_reason="max_failures",
        )
        await session.flush()
        log.warning("task_failed_everywhere", task_id=task_id, providers=providers, addresses=addresses)


async def release_member_leases(
    session: AsyncSession, pool_id: str, node_id: str, *, now: dt.datetime
) -> int:
    """A node left the pool (leave, ejection, blacklist, completion): give back its live leases
    there so their replicas are reissued at once (those past their deadline expire, as the
    reaper would have them). Returns how many were given back.

    Called after the membership row was updated. On PostgreSQL it first takes the node's row
    lock, as every claim does before reading the membership: a claim that read the membership
    as active before this change commits is waited for, and its leases are seen and given back
    here; a later claim waits for this change to commit and then reads the membership ended.
    (The pool row is locked FOR NO KEY UPDATE by membership changes, so a waiting claim's
    foreign-key check on it is not blocked: no deadlock.)"""
    if is_postgres(session):
        await session.execute(_LOCK_SIGNER, {"node_id": node_id})
    active = list(
        (
            await session.execute(
                select(Assignment)
                .where(
                    Assignment.pool_id == pool_id,
                    Assignment.node_id == node_id,
                    Assignment.status == "active",
                )
                .order_by(Assignment.id)  # id order, as every locker of several leases
                .with_for_update()
            )
        ).scalars()
    )
    given_back = 0
    overdue = []
    for assignment in active:
        if assignment.lease_expires_at > now:
            await _give_back(session, assignment, now)
            given_back += 1
        else:
            overdue.append(assignment)
    if overdue:
        # A lease already past its deadline is over: it expires now (an attempt, as for any lease
        # that ran out), rather than be given back in time. Left live for the reaper, it came
        # back to life at the return from an outage (the first mark gives the leases it finds
        # live the outage's length back), held by a node no longer in the pool.
        await _expire(session, overdue, now=now)
    await session.flush()
    return given_back


async def end_leases_of_dead(
    session: AsyncSession, node_ids: Sequence[str], *, now: dt.datetime, grace_s: float
) -> int:
    """The sweeper found these nodes dead: their live leases run out ``grace_s`` from now, so
    the reaper then expires them (an attempt each) and reissues their replicas, instead of their
    being held for what is left of the lease duration. The grace lets a node whose beat crossed
    the sweeper's commit (it saw itself still healthy, so it did not revive) keep its leases:
    its next beat revives it and extends them. Returns how many."""
    if not node_ids:
        return 0
    until = now + dt.timedelta(seconds=grace_s)
    due = (
        Assignment.node_id.in_(node_ids),
        Assignment.status == "active",
        Assignment.lease_expires_at > until,
    )
    if is_postgres(session):
        # Locked in id order first, as every locker of several leases takes them (the reaper,
        # an ending): the UPDATE locks its rows in the order it finds them.
        await session.execute(select(Assignment.id).where(*due).order_by(Assignment.id).with_for_update())
    result = await session.execute(
        update(Assignment)
        .where(*due)
        .values(lease_expires_at=until)
        .execution_options(synchronize_session=False)
    )
    return int(result.rowcount)  # type: ignore[attr-defined]


async def extend_leases_over_outage(
    session: AsyncSession, *, began: dt.datetime, length: dt.timedelta, taken_by: dt.datetime
) -> int:
    """Push back the deadline of every live lease that had not run out when an outage of
    ``length`` began (``liveness.serving``) and was taken by ``taken_by``: its node could neither
    beat nor answer meanwhile. ``began`` is the last mark before it, and the outage itself began
    up to ``taken_by`` later, so a lease taken in between lived through all of it but the part
    before its claim: a lease taken before ``began`` gets ``length``, one taken after it as much
    less as it was taken later. The rows are locked (PostgreSQL; on SQLite the write lock) so a
    concurrent beat's extension is not overwritten. Returns the leases extended."""
    stmt = (
        select(Assignment.id, Assignment.lease_expires_at, Assignment.created_at)
        .where(
            Assignment.status == "active",
            Assignment.lease_expires_at > began,
            Assignment.created_at <= taken_by,
        )
        .order_by(Assignment.id)
    )
    if is_postgres(session):
        stmt = stmt.with_for_update()
    live = (await session.execute(stmt)).all()
    ended = began + length
    rows = [
        {"id": ident, "lease_expires_at": deadline + (ended - max(began, taken))}
        for ident, deadline, taken in live
    ]
    if rows:
        await session.execute(update(Assignment), rows)  # bulk UPDATE by primary key
    return len(rows)


async def reap_expired(session: AsyncSession, *, now: dt.datetime, limit: int = 1000) -> tuple[int, int]:
    """Expire leases past their deadline; reissue their replicas, or fail the task after the
    pool's max attempts. Returns (expired, tasks failed). Reads only expired leases.

    On PostgreSQL the live leases of their tasks, the expired ones among them, are locked
    first, in id order (``lock_live_leases``), as a failure report and every end of a task lock
    them: failing a task writes its siblings. Locking the expired leases first and the siblings
    after deadlocked with a failure report of a sibling whose id came first."""
    due = (Assignment.status == "active", Assignment.lease_expires_at <= now)
    stmt = select(Assignment).where(*due).order_by(Assignment.lease_expires_at).limit(limit)
    if is_postgres(session):
        picked = select(Assignment.id, Assignment.task_id).where(*due).order_by(Assignment.lease_expires_at)
        candidates = (await session.execute(picked.limit(limit))).all()
        await lock_live_leases(session, sorted({task_id for _, task_id in candidates}))
        # Those still due once locked: a result, release or beat may have ended or extended one.
        stmt = stmt.where(Assignment.id.in_([ident for ident, _ in candidates])).execution_options(
            populate_existing=True
        )
    expired = list((await session.execute(stmt)).scalars())
    if not expired:
        return 0, 0
    failed = await _expire(session, expired, now=now)
    return len(expired), failed


async def _expire(session: AsyncSession, expired: list[Assignment], *, now: dt.datetime) -> int:
    """End these live (and locked) leases as expired: reissue their replicas, or fail the task
    once a replica has expired the pool's max attempts. Returns the tasks failed."""
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
    if failed_tasks:
        # Written before ``fail_task``'s bulk updates of the same leases and replicas, so that
        # they see (and are not overwritten by) these changes.
        await session.flush()
    await lock_live_leases(session, sorted(failed_tasks))  # the siblings', before the tasks
    for task_id, reason in failed_tasks.items():
        task = await session.get(Task, task_id, with_for_update=True)
        if task is not None and task.status == "open":
            await fail_task(session, task, reason, end_reason="max_attempts")
    await session.flush()
    if failed_tasks:
        log.warning("tasks_failed", count=len(failed_tasks))
    return len(failed_tasks)


async def fail_past_deadline(session: AsyncSession, *, now: dt.datetime, limit: int = 1000) -> int:
    """Open tasks whose deadline has passed fail (``deadline passed``), as after max attempts:
    their live leases are cancelled (heartbeats tell the nodes to drop them) and results waiting
    for their siblings are settled. Reads only open tasks with a deadline (partial index)."""
    past = (Task.status == "open", Task.deadline_at.is_not(None), Task.deadline_at <= now)
    stmt = select(Task).where(*past).order_by(Task.deadline_at).limit(limit)
    if is_postgres(session):
        # The live leases first (see ``lock_live_leases``), then the tasks still due, skipping
        # any another transaction holds.
        picked = select(Task.id).where(*past).order_by(Task.deadline_at).limit(limit)
        due_ids = list((await session.execute(picked)).scalars())
        await lock_live_leases(session, due_ids)
        stmt = stmt.where(Task.id.in_(due_ids)).with_for_update(skip_locked=True)
    due = list((await session.execute(stmt)).scalars())
    for task in due:
        assert task.deadline_at is not None
        await fail_task(
            session, task, f"deadline passed at {task.deadline_at.isoformat()}", end_reason="deadline_passed"
        )
    await session.flush()
    if due:
        log.warning("tasks_past_deadline", count=len(due))
    return len(due)


# ------------------------------------------------------------------------ results


@dataclass(frozen=True)
class SubmitResult:
    out: ResultOut
    created: bool


@dataclass(frozen=True)
class ResultContext:
    """The lease, its replica, any earlier submission, the pool's policy window and the
    signer, read (and on PostgreSQL locked) in one statement."""

    node_id: str
    status: str
    lease_expires_at: dt.datetime
    fencing_token: int
    replica_id: int
    task_id: int
    pool_id: str
    replica_assignment_id: str | None
    signer_provider_id: str | None
    signer_status: str | None
    previous_id: int | None
    previous_sha256: str | None
    previous_response: dict[str, Any] | None
    max_async_level: int
    current_step: int | None
    deadline_at: dt.datetime | None
    step_published: bool
    require_proof: bool
    reward_per_sample: int
    fraud_slash_amount: int
    soft_invalid_penalty: int
    reward_hold_s: int
    canary_miss_limit: int
    canary_window: int


_RESULT_CONTEXT = """
    SELECT a.node_id, a.status, a.lease_expires_at, a.fencing_token, a.replica_id, a.task_id,
           a.pool_id, r.current_assignment_id,
           (SELECT n.provider_id FROM nodes n WHERE n.id = :node_id) AS signer_provider_id,
           (SELECT n.status FROM nodes n WHERE n.id = :node_id) AS signer_status,
           s.id, s.body_sha256, s.response, p.max_async_level,
           (SELECT max(step) FROM policy_versions WHERE pool_id = a.pool_id) AS current_step,
           (SELECT t.deadline_at FROM tasks t WHERE t.id = a.task_id) AS deadline_at,
           EXISTS (SELECT 1 FROM policy_versions
                    WHERE pool_id = a.pool_id AND step = :policy_step) AS step_published,
           p.require_proof, p.reward_per_sample, p.fraud_slash_amount, p.soft_invalid_penalty,
           p.reward_hold_s, p.canary_miss_limit, p.canary_window
      FROM assignments a
      JOIN task_replicas r ON r.id = a.replica_id
      JOIN pools p ON p.id = a.pool_id
      LEFT JOIN submissions s ON s.assignment_id = a.id
     WHERE a.id = :assignment_id
     {lock}
"""


@lru_cache(maxsize=2)
def _result_context(postgres: bool) -> TextualSelect:
    lock = "FOR UPDATE OF a, r" if postgres else ""
    return (
        text(_RESULT_CONTEXT.format(lock=lock))
        .bindparams(bindparam("policy_step", type_=BigInteger()))
        .columns(
            lease_expires_at=UTCDateTime(),
            response=JSON(),
            deadline_at=UTCDateTime(),
            step_published=Boolean(),
            require_proof=Boolean(),
        )
    )


_NODE_STATUS = text("SELECT status FROM nodes WHERE id = :node_id")
_SUBMISSION_OF = text(
    "SELECT id, body_sha256, response FROM submissions WHERE assignment_id = :assignment_id"
).columns(response=JSON())
# A result's writes: the submission (with the exact signed bytes), its verification job, and the
# lease, the replica and the task marked submitted. Their bind names are distinct, and none is
# a column's name (SQLAlchemy would add a parameter named like a column to an UPDATE's SET), so
# one parameter dict serves all of them: on PostgreSQL they run as one statement (data-modifying
# CTEs, one round trip); on SQLite one after another.
# Every column but the id and those written later (NULL for a new result), bound as ``s_<column>``.
_WRITTEN_LATER = frozenset({Submission.evidence_pruned_at.key})
_SUBMISSION_COLUMNS = tuple(
    c.name for c in Submission.__table__.c if not c.primary_key and c.name not in _WRITTEN_LATER
)
_INSERT_SUBMISSION = (
    insert(Submission.__table__)  # type: ignore[arg-type]
    .values({name: bindparam(f"s_{name}") for name in _SUBMISSION_COLUMNS})
    .returning(Submission.__table__.c.id)
)
_ASSIGNMENT_SUBMITTED = (
    update(Assignment.__table__)  # type: ignore[arg-type]
    .where(_ASSIGNMENTS.id == bindparam("b_lease"))
    .values(status="submitted", ended_at=bindparam("b_now"))
)
_REPLICA_SUBMITTED = (
    update(TaskReplica.__table__)  # type: ignore[arg-type]
    .where(_REPLICAS.id == bindparam("b_replica"))
    .values(status="submitted")
)
_TASK_SUBMITTED = (
    update(Task.__table__)  # type: ignore[arg-type]
    .where(_TASKS.id == bindparam("b_task"))
    .values(
        submitted_replicas=_TASKS.submitted_replicas + 1,
        updated_at=bindparam("b_now"),
        # The right-hand sides see the row as it was: the last replica in closes the task.
        status=case(
            (
                and_(_TASKS.status == "open", _TASKS.submitted_replicas + 1 >= _TASKS.replication),
                "submitted",
            ),
            else_=_TASKS.status,
        ),
    )
)
_SUBMITTED_ROWS = (_ASSIGNMENT_SUBMITTED, _REPLICA_SUBMITTED, _TASK_SUBMITTED)


def _record_result_statement() -> Select[tuple[int]]:
    submission = _INSERT_SUBMISSION.cte("submission")
    job = verification.job_for(submission.c.id).cte("job")
    return select(submission.c.id).add_cte(
        job, *(stmt.cte(f"w{i}") for i, stmt in enumerate(_SUBMITTED_ROWS))
    )


_RECORD_RESULT = _record_result_statement()


async def _refuse_signer(conn: AsyncConnection, node_id: str) -> None:
    """The signer must be a registered node that is not banned (401 / 403 otherwise)."""
    status = (await conn.execute(_NODE_STATUS, {"node_id": node_id})).scalar_one_or_none()
    if status is None:
        raise unknown_node()
    if status == NodeStatus.banned:
        raise await banned_node_of(conn, node_id)


_HOLDER_OF = text("SELECT node_id FROM assignments WHERE id = :assignment_id")


async def refuse_foreign_result(conn: AsyncConnection, node_id: str, assignment_id: str) -> None:
    """Before a large result body is decoded: the signer must be a registered node that is not
    banned and the lease must be its own, with the same answers as ``submit_result`` (401
    unknown_key, 403 node_banned, 404 assignment_not_found). Two primary-key reads."""
    await _refuse_signer(conn, node_id)
    # Read before FastAPI validates the path: an id the path refuses (a NUL, which PostgreSQL
    # cannot take, or longer than any id) is the same 404 without a query.
    holder = None
    if len(assignment_id) <= (ASSIGNMENT_ID.length or 0) and "\x00" not in assignment_id:
        holder = (await conn.execute(_HOLDER_OF, {"assignment_id": assignment_id})).scalar_one_or_none()
    if holder != node_id:
        raise NotFound("no assignment with this id for this node", code="assignment_not_found")


#: A body sent again can say what the stored one says only if the stored one is at most this
#: many times its size: respelling the same JSON (whitespace, indentation, unicode escapes)
#: changes the size by a few times at most. A smaller one is a conflict, the stored body unread.
SAME_RESULT_SIZE_RATIO = 8
_SUBMISSION_BODY = text(
    "SELECT CASE WHEN length(body) <= :most THEN body END FROM submissions WHERE id = :id"
)


async def _says_the_same(conn: AsyncConnection, submission_id: int, body: ResultIn, size: int) -> bool:
    """Whether the recorded result says what ``body`` (``size`` bytes) says, spelled otherwise
    (its JSON keys in another order, other whitespace, 1 for 1.0): a client sending its result
    again after a lost answer may serialize it afresh. Compared as the admin API's idempotency
    keys are (``body_digests``); read only when the bytes differ, and only when the stored body
    is at most ``SAME_RESULT_SIZE_RATIO`` times ``size`` (else a node's small bodies sent to an
    assignment of a large result made the server read and parse that result for each). A body
    whose evidence was pruned, or that no longer validates, cannot be compared and is another
    result."""
    most = SAME_RESULT_SIZE_RATIO * size
    stored = (await conn.execute(_SUBMISSION_BODY, {"id": submission_id, "most": most})).scalar_one_or_none()
    if not stored:
        return False
    try:
        previous = ResultIn.model_validate_json(stored)
    except ValueError:
        return False
    return body_digests(previous)[0] == body_digests(body)[0]


async def submit_result(
    session: AsyncSession,
    signed: SignedRequest,
    assignment_id: str,
    body: ResultIn,
    *,
    now: dt.datetime,
    ref_key: bytes,
) -> SubmitResult:
    """Record a signed result: one locked read, then five writes (the submission with its
    evidence, its verification job, the lease, the replica and the task), which PostgreSQL runs
    as one statement. The answer names the task by the node's reference (keyed with ``ref_key``),
    as its lease did."""
    conn = await session.connection()
    node_id = signed.keyid
    postgres = is_postgres(session)
    row = (
        await conn.execute(
            _result_context(postgres),
            {"assignment_id": assignment_id, "node_id": node_id, "policy_step": body.policy_step},
        )
    ).first()
    if row is None:
        await _refuse_signer(conn, node_id)
        raise NotFound("no assignment with this id for this node", code="assignment_not_found")
    ctx = ResultContext(*row)
    if ctx.signer_status is None:
        raise unknown_node()
    if ctx.signer_status == NodeStatus.banned:
        raise await banned_node_of(conn, node_id)
    if ctx.node_id != node_id:
        raise NotFound("no assignment with this id for this node", code="assignment_not_found")
    digest = hashlib.sha256(signed.body).hexdigest()
    if ctx.previous_id is None and ctx.status == "submitted" and postgres:
        # A copy of this result committed while this request waited for the lease's lock: the
        # lock re-read the lease's new row, but the join read the submissions of the older
        # snapshot. A statement of its own reads it (the same request sent twice at once).
        previous = (await conn.execute(_SUBMISSION_OF, {"assignment_id": assignment_id})).first()
        if previous is not None:
            ctx = dataclasses.replace(
                ctx,
                previous_id=previous.id,
                previous_sha256=previous.body_sha256,
                previous_response=previous.response,
            )
    if ctx.previous_id is not None:
        if ctx.previous_sha256 != digest and not await _says_the_same(
            conn, ctx.previous_id, body, len(signed.body)
        ):
            raise Conflict(
                "a different result was already recorded for this assignment",
                code="result_conflict",
                extra={"submission_id": ctx.previous_id},
            )
        # The reference again, not the stored answer's task id: an answer stored before the
        # references were given kept the task's real id.
        ref = task_ref(ref_key, node_id, ctx.task_id)
        replay = ResultOut.model_validate(
            {**(ctx.previous_response or {}), "submission_id": ctx.previous_id, "task_id": ref}
        )
        return SubmitResult(replay, created=False)
    # The deadline first: the reaper fails a task past it by cancelling its leases.
    if ctx.deadline_at is not None and ctx.deadline_at <= now:
        raise Conflict(
            "the task's deadline has passed; the result is not recorded",
            code="deadline_passed",
            extra={"deadline_at": ctx.deadline_at.isoformat()},
        )
    if ctx.status == "cancelled":
        # The lease was withdrawn because its task ended: an operator's cancel, or max attempts
        # reached by a sibling replica (the task then ``failed``). Say which.
        ended = (await conn.execute(select(Task.status, Task.end_reason).where(Task.id == ctx.task_id))).one()
        detail = (
            "the task was cancelled"
            if ended.status == "cancelled"
            else f"the task {ended.status} ({ended.end_reason})"
        )
        raise Conflict(
            detail + "; the result is not recorded",
            code="task_cancelled",
            extra={"task_status": ended.status, "end_reason": ended.end_reason},
        )
    if (
        ctx.status != "active"
        or ctx.lease_expires_at <= now
        or body.fencing_token != ctx.fencing_token
        or ctx.replica_assignment_id != assignment_id
    ):
        raise Conflict(
            "this lease has expired or was reissued; the result is not recorded", code="lease_expired"
        )
    current = ctx.current_step
    assert current is not None  # a lease is only ever issued under a published policy
    if body.policy_step > current:
        raise Conflict(
            f"policy step {body.policy_step} was never published (current {current})",
            code="policy_unknown",
        )
    if body.policy_step < current - ctx.max_async_level:
        raise Conflict(
            f"policy step {body.policy_step} is more than {ctx.max_async_level} steps behind "
            f"the current {current}",
            code="policy_stale",
            extra={"current_step": current, "max_async_level": ctx.max_async_level},
        )
    if not ctx.step_published:
        raise Conflict(
            f"policy step {body.policy_step} was never published in this pool (current {current})",
            code="policy_unknown",
        )
    # What the node is told; kept for replays (the submission id is the row's own id).
    # The task by the node's reference, as its lease named it (refs.task_ref).
    ref = task_ref(ref_key, node_id, ctx.task_id)
    told = {"assignment_id": assignment_id, "task_id": ref, "status": "pending", "received_at": now}
    submission = {
        "assignment_id": assignment_id,
        "task_id": ctx.task_id,
        "replica_id": ctx.replica_id,
        "pool_id": ctx.pool_id,
        "node_id": node_id,
        "provider_id": ctx.signer_provider_id,
        "policy_step": body.policy_step,
        "policy_current_step": current,
        # The terms it is judged and paid by, whatever the pool's settings are at its verdict.
        "max_async_level": ctx.max_async_level,
        "require_proof": ctx.require_proof,
        "reward_per_sample": ctx.reward_per_sample,
        "fraud_slash_amount": ctx.fraud_slash_amount,
        "soft_invalid_penalty": ctx.soft_invalid_penalty,
        "reward_hold_s": ctx.reward_hold_s,
        "canary_miss_limit": ctx.canary_miss_limit,
        "canary_window": ctx.canary_window,
        "seed_echoed": body.seed,
        "claimed_reward": body.claimed_reward,
        "sample_count": len(body.samples),
        "status": "pending",
        "body_sha256": digest,
        "body": signed.body,
        "method": signed.method,
        "target_uri": signed.target_uri,
        "signature_input": signed.signature_input,
        "signature": signed.signature,
        "signature_window_s": signed.window_s or None,
        "content_digest": signed.content_digest,
        "signed_fields": [list(line) for line in signed.signed_fields],
        "response": {**told, "received_at": now.isoformat()},
        "received_at": now,
    }
    params: dict[str, Any] = {f"s_{name}": value for name, value in submission.items()}
    params |= {"b_lease": assignment_id, "b_replica": ctx.replica_id, "b_task": ctx.task_id}
    params |= {"b_pool": ctx.pool_id, "b_now": now}
    provider_id = ctx.signer_provider_id or ""
    if is_postgres(session):
        params["b_partition"] = verification.partition_of(provider_id)
        submission_id = (await conn.execute(_RECORD_RESULT, params)).scalar_one()
    else:
        submission_id = (await conn.execute(_INSERT_SUBMISSION, params)).scalar_one()
        await verification.enqueue(
            conn,
            submission_id=submission_id,
            task_id=ctx.task_id,
            pool_id=ctx.pool_id,
            provider_id=provider_id,
            now=now,
        )
        for stmt in _SUBMITTED_ROWS:
            await conn.execute(stmt, params)
    out = ResultOut(submission_id=submission_id, **told)
    return SubmitResult(out, created=True)
