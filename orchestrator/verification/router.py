"""Verdict queries, appeals, pool statistics and the validator API."""

from __future__ import annotations

from typing import Annotated

import anyio
from fastapi import APIRouter, Depends, Path, Query
from sqlalchemy import ColumnElement, func, select

from api_schemas.common import NO_NUL, PROBLEM_RESPONSES, KeyId, Page
from api_schemas.verification import (
    PenaltyPart,
    PlacementOut,
    PoolStatsOut,
    ReversalOut,
    ReverseIn,
    ValidationClaimIn,
    ValidationClaimOut,
    ValidationExtendIn,
    ValidationJobOut,
    ValidationLeaseOut,
    ValidatorVerdictIn,
    ValidatorVerdictOut,
    VerdictOut,
)
from orchestrator.admin.tokens import AdminOnly, Principal, Role, require_roles
from orchestrator.audit.service import record
from orchestrator.core.errors import NotFound
from orchestrator.core.pagination import ID_MAX, require_listed
from orchestrator.core.routing import GuardedRoute
from orchestrator.core.state import Session, State
from orchestrator.identity import repository as identity_repo
from orchestrator.identity.auth import CurrentProvider, SignedNode
from orchestrator.pools import repository as pools_repo
from orchestrator.pools.models import Pool
from orchestrator.pools.service import budget_remaining
from orchestrator.tasks import service as tasks_service
from orchestrator.tasks.access import pool_for
from orchestrator.tasks.models import Task
from orchestrator.tasks.refs import task_ref
from orchestrator.verification import service, validators
from orchestrator.verification.models import Verdict, withdrawn_by
from orchestrator.verification.scoring import scorer_for

router = APIRouter(prefix="/v1", tags=["verification"], responses=PROBLEM_RESPONSES, route_class=GuardedRoute)
admin_router = APIRouter(
    prefix="/v1/admin", tags=["admin: verification"], responses=PROBLEM_RESPONSES, route_class=GuardedRoute
)
validation_router = APIRouter(
    prefix="/v1/validation", tags=["validators"], responses=PROBLEM_RESPONSES, route_class=GuardedRoute
)

Validator = Annotated[Principal, require_roles(Role.validator, Role.admin)]
Operator = Annotated[Principal, require_roles(Role.admin, Role.operator)]
Reader = Annotated[Principal, require_roles(Role.admin, Role.operator, Role.trainer)]
Cursor = Annotated[int | None, Query(ge=0, le=ID_MAX, description="Last verdict id of the previous page")]
VerdictId = Annotated[int, Path(ge=1, le=ID_MAX, description="Verdict id")]
JobId = Annotated[int, Path(ge=1, le=ID_MAX, description="Validation job id")]
Limit = Annotated[int, Query(ge=1, le=500)]


def verdict_out(v: Verdict, ref_key: bytes | None = None, withdrawn: int | None = None) -> VerdictOut:
    """A verdict; with ``ref_key``, as its node and provider see it: the task by the node's
    reference (``refs.task_ref``), as the node's lease named it, not by its id. ``withdrawn``:
    the fraud verdict that withdraws it (``models.withdrawn_by``)."""
    return VerdictOut(
        id=v.id,
        submission_id=v.submission_id,
        task_id=v.task_id if ref_key is None else task_ref(ref_key, v.node_id, v.task_id),
        pool_id=v.pool_id,
        node_id=v.node_id,
        provider_id=v.provider_id,
        outcome=v.outcome,
        category=v.category,
        reason=v.reason,
        verifier=v.verifier,
        details=v.details,
        server_reward=v.server_reward,
        reward_amount=v.reward_amount,
        reward_paid_on_appeal=v.reward_paid_on_appeal,
        reward_forfeited_by=v.reward_forfeited_by,
        slashed_amount=v.slashed_amount,
        decided_at=v.decided_at,
        reversed_at=v.reversed_at,
        reversal_reason=v.reversal_reason,
        withdrawn_by=withdrawn,
    )


async def _page(
    session: Session,
    where: list[ColumnElement[bool]],
    cursor: int | None,
    limit: int,
    *,
    ref_key: bytes | None = None,
) -> Page[VerdictOut]:
    """A page of verdicts newest first. ``where`` holds only conditions that never change for a
    verdict (its pool, node, provider), so the cursor must be one of the listed verdicts. With
    ``ref_key`` (for nodes and providers), tasks are named by the node's references."""
    await require_listed(session, cursor, Verdict.id, *where, what="verdict of this list")
    stmt = select(Verdict, withdrawn_by()).where(*where).order_by(Verdict.id.desc()).limit(limit + 1)
    if cursor is not None:
        stmt = stmt.where(Verdict.id < cursor)
    rows = (await session.execute(stmt)).all()
    more = len(rows) > limit
    rows = rows[:limit]
    return Page[VerdictOut](
        items=[verdict_out(v, ref_key, withdrawn) for v, withdrawn in rows],
        next_cursor=str(rows[-1].Verdict.id) if more else None,
    )


@router.get(
    "/providers/me/verdicts",
    response_model=Page[VerdictOut],
    summary="The signing provider's verdicts with reasons, newest first",
)
async def my_verdicts(
    provider: CurrentProvider,
    session: Session,
    state: State,
    cursor: Cursor = None,
    limit: Limit = 100,
    node_id: Annotated[
        KeyId | None,
        Query(description="Only this node's (a worker reads its own among its provider's machines')"),
    ] = None,
) -> Page[VerdictOut]:
    where: list[ColumnElement[bool]] = [Verdict.provider_id == provider.id]
    if node_id is not None:
        where.append(Verdict.node_id == node_id)
    return await _page(session, where, cursor, limit, ref_key=state.settings.seed_key)


@router.get(
    "/nodes/me/verdicts",
    response_model=Page[VerdictOut],
    summary="The signing node's verdicts with reasons, newest first",
    description="What a worker reads to learn how its own results were judged, signed with its "
    "node key: a provider's key (and its request budget) is not needed for it.",
)
async def my_node_verdicts(
    node: SignedNode, session: Session, state: State, cursor: Cursor = None, limit: Limit = 100
) -> Page[VerdictOut]:
    return await _page(session, [Verdict.node_id == node.id], cursor, limit, ref_key=state.settings.seed_key)


@admin_router.get(
    "/nodes/{node_id}/verdicts",
    response_model=Page[VerdictOut],
    summary="A node's verdict history, newest first",
)
async def node_verdicts(
    node_id: KeyId, _: AdminOnly, session: Session, cursor: Cursor = None, limit: Limit = 100
) -> Page[VerdictOut]:
    if await identity_repo.get_node(session, node_id) is None:
        raise NotFound("no node with this id", code="node_not_found")
    return await _page(session, [Verdict.node_id == node_id], cursor, limit)


@admin_router.get(
    "/providers/{provider_id}/verdicts",
    response_model=Page[VerdictOut],
    summary="A provider's verdict history, newest first",
)
async def provider_verdicts(
    provider_id: KeyId, _: AdminOnly, session: Session, cursor: Cursor = None, limit: Limit = 100
) -> Page[VerdictOut]:
    if await identity_repo.get_provider(session, provider_id) is None:
        raise NotFound("no provider with this id", code="provider_not_found")
    return await _page(session, [Verdict.provider_id == provider_id], cursor, limit)


async def _operator_pool(
    pool_id: Annotated[str, Path(max_length=40, pattern=NO_NUL)], principal: Operator, session: Session
) -> Pool:
    return await pool_for(session, principal, pool_id)


async def _reader_pool(
    pool_id: Annotated[str, Path(max_length=40, pattern=NO_NUL)], principal: Reader, session: Session
) -> Pool:
    return await pool_for(session, principal, pool_id)


@admin_router.get(
    "/pools/{pool_id}/verdicts",
    response_model=Page[VerdictOut],
    summary="A pool's verdicts, newest first",
    description="Readable by the pool's operator, an admin, and trainer tokens scoped to the pool "
    "(a trainer finds here the verdicts reversed after the feed served them: `reversed_at`).",
)
async def pool_verdicts(
    pool: Annotated[Pool, Depends(_reader_pool)],
    session: Session,
    cursor: Cursor = None,
    limit: Limit = 100,
) -> Page[VerdictOut]:
    return await _page(session, [Verdict.pool_id == pool.id], cursor, limit)


@admin_router.get(
    "/pools/{pool_id}/stats",
    response_model=PoolStatsOut,
    summary="Acceptance and fraud rates, tasks by status, and what the members can place",
)
async def pool_stats(pool: Annotated[Pool, Depends(_operator_pool)], session: Session) -> PoolStatsOut:
    stats = await service.pool_stats(session, pool.id)
    rows = (
        await session.execute(
            select(Task.status, func.count()).where(Task.pool_id == pool.id).group_by(Task.status)
        )
    ).all()
    return PoolStatsOut(
        pool_id=pool.id,
        reward_budget=pool.reward_budget,
        reward_budget_remaining=budget_remaining(pool.reward_budget, stats["rewards_credited"]),
        tasks_by_status={status: int(n) for status, n in rows},
        placement=PlacementOut(**await tasks_service.placement(session, pool.id)),
        **stats,
    )


@admin_router.post(
    "/verdicts/{verdict_id}/reverse",
    response_model=ReversalOut,
    summary="Appeal: undo a verdict's money and strike with compensating transfers, and the "
    "verifier's ejection or provider ban the strikes no longer reach",
)
async def reverse(
    verdict_id: VerdictId, body: ReverseIn, principal: AdminOnly, session: Session, state: State
) -> ReversalOut:
    verdict, reversed_now = await service.reverse_verdict(
        session, verdict_id, reason=body.reason, principal=principal, now=state.clock.utcnow()
    )
    penalised = await service.penalised_on_appeal(session, verdict)
    if reversed_now:
        await record(
            session,
            principal,
            "verdict.reverse",
            target_type="verdict",
            target_id=str(verdict.id),
            pool_id=verdict.pool_id,
            before={"outcome": verdict.outcome, "category": verdict.category},
            after={
                "reversed": True,
                "reason": body.reason,
                **(
                    {"reward_paid_on_appeal": verdict.reward_paid_on_appeal}
                    if verdict.reward_paid_on_appeal
                    else {}
                ),
                **(
                    {"reward_forfeited_by": verdict.reward_forfeited_by}
                    if verdict.reward_forfeited_by is not None
                    else {}
                ),
                **(
                    {"reward_penalised": [{"verdict_id": v, "amount": a} for v, a, _ in penalised]}
                    if penalised
                    else {}
                ),
            },
        )
    withdrawn = await session.scalar(select(withdrawn_by()).where(Verdict.id == verdict.id))
    membership = await pools_repo.get_membership(session, verdict.pool_id, verdict.node_id)
    blacklisted = await pools_repo.get_blacklisting(session, verdict.pool_id, verdict.provider_id)
    return ReversalOut(
        **verdict_out(verdict, withdrawn=withdrawn).model_dump(),
        reward_penalised=[PenaltyPart(verdict_id=v, amount=a, status=st) for v, a, st in penalised],
        membership_status=membership.status if membership is not None else None,
        provider_blacklisted=blacklisted is not None,
    )


@validation_router.post(
    "/claim",
    response_model=ValidationClaimOut,
    summary="Lease validation jobs (validator token, scoped to its pools)",
)
async def claim(
    body: ValidationClaimIn, principal: Validator, session: Session, state: State
) -> ValidationClaimOut:
    leased = await validators.claim(
        session,
        principal,
        body.pool_id,
        body.max_jobs,
        now=state.clock.utcnow(),
        wait_s=state.settings.verifier.validator_wait_s,
        lease_s=body.lease_s,
        max_bytes=state.settings.limits.max_result_body_bytes,
    )

    def jobs() -> list[ValidationJobOut]:
        out = []
        for job, submission, task, seed in leased:
            assert job.lease_expires_at is not None
            out.append(
                ValidationJobOut(
                    job_id=job.id,
                    fencing_token=job.fencing_token,
                    lease_expires_at=job.lease_expires_at,
                    pool_id=job.pool_id,
                    submission_id=submission.id,
                    node_id=submission.node_id,
                    task={
                        "task_id": task.id,
                        "prompt": task.prompt,
                        "problem_ref": task.problem_ref,
                        "sampling": task.sampling,
                        "verification": task.verification,
                    },
                    policy_step=submission.policy_step,
                    seed=seed,
                    result=validators.result_body(submission),
                )
            )
        return out

    # Parsing the signed bodies (up to the claim's byte budget) is CPU work: off the event loop.
    return ValidationClaimOut(jobs=await anyio.to_thread.run_sync(jobs))


@validation_router.post(
    "/jobs/{job_id}/extend",
    response_model=ValidationLeaseOut,
    summary="Extend a validation lease that is still live (the same fencing token)",
)
async def extend_lease(
    job_id: JobId, body: ValidationExtendIn, principal: Validator, session: Session, state: State
) -> ValidationLeaseOut:
    job = await validators.extend(
        session,
        principal,
        job_id,
        body.fencing_token,
        body.lease_s,
        now=state.clock.utcnow(),
        wait_s=state.settings.verifier.validator_wait_s,
    )
    assert job.lease_expires_at is not None
    return ValidationLeaseOut(
        job_id=job.id, fencing_token=job.fencing_token, lease_expires_at=job.lease_expires_at
    )


@validation_router.post(
    "/jobs/{job_id}/verdict",
    response_model=ValidatorVerdictOut,
    summary="Post a verdict with evidence (idempotent per job)",
)
async def post_verdict(
    job_id: JobId, body: ValidatorVerdictIn, principal: Validator, session: Session, state: State
) -> ValidatorVerdictOut:
    scorer = scorer_for(state.settings.verifier, "requests")
    prescored = None
    if state.engine.dialect.name == "sqlite":  # score before the write lock: see validators.prescore
        prescored = await validators.prescore(
            state.sessionmaker, principal, job_id, body.fencing_token, scorer, now=state.clock.utcnow()
        )
    job, verdict = await validators.post_verdict(
        session, principal, job_id, body, now=state.clock.utcnow(), scorer=scorer, prescored=prescored
    )
    return ValidatorVerdictOut(job_id=job.id, verdict=verdict_out(verdict))
