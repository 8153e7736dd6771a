"""Task endpoints: node claims, results and releases (signed); policies and tasks (tokens)."""

from __future__ import annotations

import base64
import dataclasses
import datetime as dt
from functools import partial
from typing import Annotated

import anyio
from fastapi import APIRouter, Depends, Path, Query, Request, Response
from sqlalchemy import func, select

from api_schemas.common import NO_NUL, PROBLEM_RESPONSES, RETRY_AFTER_HEADER, Page
from api_schemas.tasks import (
    LIVE_LEASES_MAX,
    AssignmentOut,
    ClaimIn,
    ClaimOut,
    EvidenceCheckOut,
    EvidenceOut,
    LeasesOut,
    LeaseStatsOut,
    NodeAssignmentOut,
    PolicyIn,
    PolicyOut,
    ReleaseIn,
    ReplicaOut,
    ResultIn,
    ResultOut,
    Sampling,
    ShardOut,
    SubmissionOut,
    TaskBatchIn,
    TaskBatchOut,
    TaskDetailOut,
    TaskOut,
    TaskSubmissionsOut,
)
from orchestrator.admin.tokens import Principal, Role, require_roles
from orchestrator.audit.service import record
from orchestrator.core import metrics
from orchestrator.core.errors import NotFound
from orchestrator.core.pagination import ID_MAX, require_listed
from orchestrator.core.routing import GuardedRoute, before_body
from orchestrator.core.signing import SignedRequest
from orchestrator.core.state import Session, State, app_state
from orchestrator.identity.auth import CurrentNode, Signed, node_signature
from orchestrator.liveness.serving import leases_caught_up
from orchestrator.pools.models import Pool, PoolMembership
from orchestrator.tasks import evidence, service
from orchestrator.tasks.access import pool_for
from orchestrator.tasks.models import Assignment, PolicyVersion, Submission, Task, TaskReplica

router = APIRouter(prefix="/v1", tags=["tasks"], responses=PROBLEM_RESPONSES, route_class=GuardedRoute)
admin_router = APIRouter(
    prefix="/v1/admin", tags=["admin: tasks"], responses=PROBLEM_RESPONSES, route_class=GuardedRoute
)

PoolId = Annotated[str, Path(min_length=1, max_length=40, pattern=NO_NUL)]
TaskId = Annotated[int, Path(ge=1, le=ID_MAX, description="Task id")]
TaskCursor = Annotated[int | None, Query(ge=0, le=ID_MAX, description="Last task id of the previous page")]
Publisher = Annotated[Principal, require_roles(Role.admin, Role.operator, Role.trainer)]
Operator = Annotated[Principal, require_roles(Role.admin, Role.operator)]


async def _publisher_pool(pool_id: PoolId, principal: Publisher, session: Session) -> Pool:
    """Scope check as a dependency, so it runs before body validation: a caller that may not
    act on the pool learns nothing about it, not even what a valid body would be."""
    return await pool_for(session, principal, pool_id)


async def _operator_pool(pool_id: PoolId, principal: Operator, session: Session) -> Pool:
    return await pool_for(session, principal, pool_id)


PublisherPool = Annotated[Pool, Depends(_publisher_pool)]

# Leases a task's detail lists: its latest, oldest first.
TASK_LEASES_SHOWN = 1000
OperatorPool = Annotated[Pool, Depends(_operator_pool)]


def policy_out(p: PolicyVersion) -> PolicyOut:
    return PolicyOut(
        pool_id=p.pool_id,
        step=p.step,
        uri=p.uri,
        sha256=p.sha256,
        size=p.size_bytes,
        shards=[ShardOut(**s) for s in p.shards] if p.shards is not None else None,
        created_at=p.created_at,
    )


def task_out(t: Task) -> TaskOut:
    return TaskOut(
        id=t.id,
        pool_id=t.pool_id,
        batch_id=t.batch_id,
        status=t.status,
        prompt=t.prompt,
        problem_ref=t.problem_ref,
        sampling=Sampling(**t.sampling),
        verification=t.verification,
        metadata=t.metadata_,
        replication=t.replication,
        priority=t.priority,
        deadline_at=t.deadline_at,
        canary=t.is_canary,
        failure_reason=t.failure_reason,
        end_reason=t.end_reason,
        created_at=t.created_at,
    )


# ---------------------------------------------------------------- nodes (signed)


@router.post(
    "/assignments/claim",
    dependencies=[Depends(leases_caught_up)],
    response_model=ClaimOut,
    summary="Lease up to max_tasks replicas; an empty list says why and when to retry",
    responses={
        200: {
            "headers": {
                "Retry-After": {
                    **RETRY_AFTER_HEADER,
                    "description": "With no lease: when to claim again (also retry_after_s)",
                }
            }
        }
    },
)
async def claim(
    body: ClaimIn, signed: Signed, session: Session, state: State, response: Response
) -> ClaimOut:
    # The signer is loaded (401 unknown_key, 403 node_banned) with the claim's own first read.
    out = await service.claim(
        session,
        signed.keyid,
        body.pool_id,
        body.max_tasks,
        now=state.clock.utcnow(),
        ref_key=state.settings.seed_key,
    )
    if out.retry_after_s is not None:
        response.headers["Retry-After"] = str(out.retry_after_s)
    # Counted once the claim commits: a commit that fails (503, sent again) counted it twice.
    metrics.on_commit(session, partial(_count_claim, out.reason or "leased", len(out.leases)))
    return out


def _count_claim(outcome: str, leases: int) -> None:
    metrics.CLAIMS.labels(outcome).inc()
    metrics.LEASES_GRANTED.inc(leases)


async def _large_result_holder(request: Request) -> None:
    signed = await node_signature(request)
    state = app_state(request)
    if len(signed.body) <= state.settings.limits.max_body_bytes:
        return  # as cheap to decode as any body: the result's own first read checks the signer
    async with state.reader.connect() as conn:
        await service.refuse_foreign_result(conn, signed.keyid, str(request.path_params["assignment_id"]))


@before_body(_large_result_holder)
async def result_signature(signed: Signed) -> SignedRequest:
    """The result's signature. A body larger than the general limit (``limits.max_body_bytes``)
    is decoded only once the signer is known to be the node that holds the lease: anyone else's
    is refused before it costs the event loop its decoding."""
    return signed


@router.post(
    "/assignments/{assignment_id}/result",
    dependencies=[Depends(leases_caught_up)],
    response_model=ResultOut,
    status_code=201,
    summary="Submit a lease's signed result (idempotent: the same body returns the first answer)",
    responses={200: {"model": ResultOut, "description": "The same result again"}},
)
async def submit_result(
    assignment_id: Annotated[str, Path(max_length=40, pattern=NO_NUL)],
    body: ResultIn,
    signed: Annotated[SignedRequest, Depends(result_signature)],
    session: Session,
    state: State,
    response: Response,
) -> ResultOut:
    # The signer is checked (401 unknown_key, 403 node_banned) with the result's own first read.
    # Received at the time its signature's created and expires were checked: the evidence is
    # re-checked at received_at, and a later time (after the nonce's round trip) could put a
    # valid signature at the edge of its window outside it.
    received = dt.datetime.fromtimestamp(signed.verified_at, dt.UTC)
    result = await service.submit_result(
        session, signed, assignment_id, body, now=received, ref_key=state.settings.seed_key
    )
    if not result.created:
        response.status_code = 200
    # Counted once the result commits: a commit that fails (503) and the worker's retry counted one
    # recorded result twice as accepted.
    metrics.on_commit(session, metrics.RESULTS.labels("accepted" if result.created else "replayed").inc)
    return result.out


@router.post(
    "/assignments/{assignment_id}/release",
    dependencies=[Depends(leases_caught_up)],
    response_model=NodeAssignmentOut,
    summary="Give a lease back so the replica is reissued at once; with an error, the task failed here",
)
async def release(
    assignment_id: Annotated[str, Path(max_length=40, pattern=NO_NUL)],
    node: CurrentNode,
    session: Session,
    state: State,
    body: ReleaseIn | None = None,
) -> NodeAssignmentOut:
    error = body.error if body is not None else None
    a = await service.release(session, node.id, assignment_id, now=state.clock.utcnow(), error=error)
    return _node_assignment_out(a)


@router.get(
    "/nodes/me/leases",
    response_model=LeasesOut,
    summary="The signing node's live leases: what a lost claim answer or a restart left it",
    dependencies=[Depends(leases_caught_up)],
)
async def my_leases(
    node: CurrentNode,
    session: Session,
    state: State,
    pool_id: Annotated[
        str | None, Query(min_length=1, max_length=40, pattern=NO_NUL, description="Only this pool's")
    ] = None,
) -> LeasesOut:
    leases = await service.live_leases(
        session,
        node.id,
        pool_id,
        now=state.clock.utcnow(),
        limit=LIVE_LEASES_MAX,
        ref_key=state.settings.seed_key,
    )
    return LeasesOut(leases=leases)


@router.get(
    "/pools/{pool_id}/policy", response_model=PolicyOut, summary="The pool's current policy (members only)"
)
async def member_policy(pool_id: PoolId, node: CurrentNode, session: Session) -> PolicyOut:
    member = await session.scalar(
        select(PoolMembership.status).where(
            PoolMembership.pool_id == pool_id, PoolMembership.node_id == node.id
        )
    )
    if member != "active":
        raise NotFound("no pool with this id that this node is a member of", code="pool_not_found")
    current = await service.current_policy(session, pool_id)
    if current is None:
        raise NotFound("no policy has been published for this pool yet", code="no_policy")
    return policy_out(current)


def _node_assignment_out(a: Assignment) -> NodeAssignmentOut:
    """What the node is told of its lease: not which replica it is (an audit's would show)."""
    return NodeAssignmentOut(
        id=a.id,
        node_id=a.node_id,
        status=a.status,
        fencing_token=a.fencing_token,
        policy_step=a.policy_step,
        lease_expires_at=a.lease_expires_at,
        created_at=a.created_at,
        ended_at=a.ended_at,
        error=a.error,
    )


# ---------------------------------------------------------------- operators and trainers


@admin_router.post(
    "/pools/{pool_id}/policies",
    response_model=PolicyOut,
    status_code=201,
    summary="Publish a policy version (step must increase; the same version again is 200)",
    responses={200: {"model": PolicyOut, "description": "The same step and checkpoint again"}},
)
async def publish_policy(
    scoped: PublisherPool, body: PolicyIn, principal: Publisher, session: Session, response: Response
) -> PolicyOut:
    pool = await pool_for(session, principal, scoped.id, for_update=True)
    row, created = await service.publish_policy(session, pool, body, principal.token_id)
    if not created:
        response.status_code = 200
        return policy_out(row)
    await record(
        session,
        principal,
        "policy.publish",
        target_type="policy",
        target_id=str(row.step),
        pool_id=pool.id,
        after={"step": row.step, "uri": row.uri, "sha256": row.sha256},
    )
    return policy_out(row)


@admin_router.get(
    "/pools/{pool_id}/policies",
    response_model=list[PolicyOut],
    summary="Published policy versions, newest first (at most 100)",
)
async def list_policies(pool: PublisherPool, session: Session) -> list[PolicyOut]:
    rows = (
        await session.execute(
            select(PolicyVersion)
            .where(PolicyVersion.pool_id == pool.id)
            .order_by(PolicyVersion.step.desc())
            .limit(100)
        )
    ).scalars()
    return [policy_out(r) for r in rows]


@admin_router.post(
    "/pools/{pool_id}/tasks",
    response_model=TaskBatchOut,
    status_code=201,
    summary="Enqueue up to 10,000 tasks atomically (idempotent by batch_key)",
    responses={200: {"model": TaskBatchOut, "description": "The same batch again"}},
)
async def enqueue(
    pool: PublisherPool,
    body: TaskBatchIn,
    principal: Publisher,
    session: Session,
    state: State,
    response: Response,
) -> TaskBatchOut:
    result = await service.enqueue(
        session,
        pool,
        body,
        secret=state.settings.seed_key,
        actor=principal.token_id,
        now=state.clock.utcnow(),
    )
    if result.created:
        await record(
            session,
            principal,
            "tasks.enqueue",
            target_type="task_batch",
            target_id=str(result.batch.id),
            pool_id=pool.id,
            after={"batch_key": body.batch_key, "tasks": len(body.tasks)},
        )
    else:
        response.status_code = 200
    b = result.batch
    return TaskBatchOut(
        batch_id=b.id,
        batch_key=b.batch_key,
        pool_id=b.pool_id,
        task_count=b.task_count,
        first_task_id=result.first_task_id,
        created_at=b.created_at,
    )


@admin_router.get("/pools/{pool_id}/tasks", response_model=Page[TaskOut], summary="List tasks (by id)")
async def list_tasks(
    pool: PublisherPool,
    session: Session,
    status: Annotated[str | None, Query(pattern="^(open|submitted|completed|failed|cancelled)$")] = None,
    cursor: Annotated[
        int | None, Query(ge=0, le=ID_MAX, description="Last task id of the previous page")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 100,
) -> Page[TaskOut]:
    # The cursor is a task id of this pool (a task's status changes, so the status filter cannot
    # be checked against it).
    await require_listed(session, cursor, Task.id, Task.pool_id == pool.id, what="task of this pool")
    stmt = select(Task).where(Task.pool_id == pool.id).order_by(Task.id).limit(limit + 1)
    if status is not None:
        stmt = stmt.where(Task.status == status)
    if cursor is not None:
        stmt = stmt.where(Task.id > cursor)
    rows = list((await session.execute(stmt)).scalars())
    more = len(rows) > limit
    rows = rows[:limit]
    return Page[TaskOut](items=[task_out(t) for t in rows], next_cursor=str(rows[-1].id) if more else None)


async def _task(session: Session, pool: Pool, task_id: int, *, for_update: bool = False) -> Task:
    # Locked, it is read again: a read earlier in the session would keep its attributes.
    task = await session.get(Task, task_id, with_for_update=for_update, populate_existing=for_update)
    if task is None or task.pool_id != pool.id:
        raise NotFound("no task with this id in this pool", code="task_not_found")
    return task


@admin_router.get(
    "/pools/{pool_id}/tasks/{task_id}",
    response_model=TaskDetailOut,
    summary="One task with its replicas and its latest 1,000 leases (oldest first)",
)
async def get_task(pool: PublisherPool, task_id: TaskId, session: Session) -> TaskDetailOut:
    task = await _task(session, pool, task_id)
    replicas = list(
        (
            await session.execute(
                select(TaskReplica).where(TaskReplica.task_id == task_id).order_by(TaskReplica.replica_index)
            )
        ).scalars()
    )
    index = {r.id: r.replica_index for r in replicas}
    # The latest leases only: a node may give a lease back and lease the replica again as often
    # as its request budget allows, so "every lease" had no bound (replicas' leases_issued counts
    # them all).
    latest = (
        await session.execute(
            select(Assignment)
            .where(Assignment.task_id == task_id)
            .order_by(Assignment.created_at.desc(), Assignment.id.desc())
            .limit(TASK_LEASES_SHOWN)
        )
    ).scalars()
    assignments = reversed(list(latest))
    return TaskDetailOut(
        **task_out(task).model_dump(),
        replicas=[
            ReplicaOut(
                replica_index=r.replica_index,
                status=r.status,
                seed=r.seed,
                leases_issued=r.leases_issued,
                expirations=r.expirations,
            )
            for r in replicas
        ],
        assignments=[
            AssignmentOut(
                id=a.id,
                replica_index=index[a.replica_id],
                node_id=a.node_id,
                status=a.status,
                fencing_token=a.fencing_token,
                policy_step=a.policy_step,
                lease_expires_at=a.lease_expires_at,
                created_at=a.created_at,
                ended_at=a.ended_at,
                error=a.error,
            )
            for a in assignments
        ],
    )


@admin_router.get(
    "/pools/{pool_id}/tasks/{task_id}/submissions",
    response_model=TaskSubmissionsOut,
    summary="A task's signed results, each with its stored evidence verified again",
)
async def task_submissions(
    pool: PublisherPool,
    task_id: TaskId,
    session: Session,
    state: State,
    include_body: Annotated[
        bool, Query(description="Also return each signed body, in base64 (up to the result size limit each)")
    ] = False,
) -> TaskSubmissionsOut:
    await _task(session, pool, task_id)
    rows = (
        await session.execute(
            select(Submission, TaskReplica.replica_index)
            .join(TaskReplica, TaskReplica.id == Submission.replica_id)
            .where(Submission.task_id == task_id)
            .order_by(Submission.id)
        )
    ).all()
    window_s = state.settings.signature.window_s

    def submissions() -> list[SubmissionOut]:
        return [_submission_out(sub, index, window_s, include_body) for sub, index in rows]

    # Each result's body is hashed and its signature verified again (and, with include_body,
    # base64-encoded): some 50 ms for a 10 MiB body, up to 16 replicas and their audits and
    # tie-breaks a task. Off the event loop, which serves every other request of the process
    # meanwhile (heartbeats, claims, /healthz).
    return TaskSubmissionsOut(task_id=task_id, submissions=await anyio.to_thread.run_sync(submissions))


def _submission_out(sub: Submission, replica_index: int, window_s: int, include_body: bool) -> SubmissionOut:
    checked = evidence.recheck(sub, window_s=window_s)
    return SubmissionOut(
        id=sub.id,
        assignment_id=sub.assignment_id,
        replica_index=replica_index,
        node_id=sub.node_id,
        provider_id=sub.provider_id,
        policy_step=sub.policy_step,
        seed_echoed=sub.seed_echoed,
        claimed_reward=sub.claimed_reward,
        sample_count=sub.sample_count,
        status=sub.status,
        received_at=sub.received_at,
        evidence=EvidenceOut(
            method=sub.method,
            target_uri=sub.target_uri,
            signature_input=sub.signature_input,
            signature=sub.signature,
            signed_fields=evidence.covered_lines(sub),
            body_sha256=sub.body_sha256,
            body_base64=base64.b64encode(sub.body).decode()
            if include_body and sub.evidence_pruned_at is None
            else None,
            pruned_at=sub.evidence_pruned_at,
        ),
        check=EvidenceCheckOut(**dataclasses.asdict(checked)),
    )


@admin_router.post(
    "/pools/{pool_id}/tasks/{task_id}/cancel",
    response_model=TaskOut,
    summary="Cancel a task; its live leases are dropped",
)
async def cancel(pool: OperatorPool, task_id: TaskId, principal: Operator, session: Session) -> TaskOut:
    # Locked, as the reaper does before it fails a task: of two cancels at once, the second
    # finds the task cancelled, changes nothing and is not audited. Its live leases first, once
    # the task is known to be this pool's: another pool's task id is a 404 that waits on nothing.
    await _task(session, pool, task_id)
    await service.lock_live_leases(session, [task_id])
    task = await _task(session, pool, task_id, for_update=True)
    before = task.status
    task = await service.cancel_task(session, task, f"cancelled by {principal.token_id}")
    if before != task.status:
        await record(
            session,
            principal,
            "task.cancel",
            target_type="task",
            target_id=str(task.id),
            pool_id=pool.id,
            before={"status": before},
            after={"status": task.status},
        )
    return task_out(task)


@admin_router.get(
    "/pools/{pool_id}/lease-stats",
    response_model=list[LeaseStatsOut],
    summary="Nodes by expired leases (most first): who keeps squatting or failing",
)
async def lease_stats(
    pool: OperatorPool, session: Session, limit: Annotated[int, Query(ge=1, le=500)] = 100
) -> list[LeaseStatsOut]:
    expired = func.count().filter(Assignment.status == "expired")
    rows = (
        await session.execute(
            select(
                Assignment.node_id,
                func.count().label("claimed"),
                func.count().filter(Assignment.status == "submitted").label("submitted"),
                expired.label("expired"),
                func.count().filter(Assignment.status == "released").label("released"),
                func.count().filter(Assignment.error.is_not(None)).label("failed"),
                func.max(Assignment.ended_at).filter(Assignment.status == "expired").label("last_expired_at"),
            )
            .where(Assignment.pool_id == pool.id)
            .group_by(Assignment.node_id)
            .order_by(expired.desc(), Assignment.node_id)
            .limit(limit)
        )
    ).all()
    return [
        LeaseStatsOut(
            node_id=r.node_id,
            claimed=r.claimed,
            submitted=r.submitted,
            expired=r.expired,
            released=r.released,
            failed=r.failed,
            last_expired_at=r.last_expired_at,
        )
        for r in rows
    ]
