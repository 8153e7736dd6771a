"""ReST^EM iteration endpoints (operators, admins, the pool's trainers)."""

from __future__ import annotations

from typing import Annotated, cast

from fastapi import APIRouter, Depends, Path, Query, Request, Response
from fastapi.responses import StreamingResponse

from api_schemas.common import NO_NUL, PROBLEM_RESPONSES, Page
from api_schemas.restem import (
    IterationIn,
    IterationOut,
    IterationProgress,
    IterationReport,
    IterationStatus,
)
from orchestrator.admin.tokens import Principal, Role, TokenStreamingResponse, require_roles
from orchestrator.audit.service import record
from orchestrator.core.pagination import ID_MAX, CursorScope
from orchestrator.core.routing import GuardedRoute
from orchestrator.core.state import Session, State
from orchestrator.pools.models import Pool
from orchestrator.restem import service
from orchestrator.restem.models import RestemIteration
from orchestrator.tasks.access import pool_for

admin_router = APIRouter(
    prefix="/v1/admin", tags=["admin: rest-em"], responses=PROBLEM_RESPONSES, route_class=GuardedRoute
)

PoolId = Annotated[str, Path(min_length=1, max_length=40, pattern=NO_NUL)]
IterationId = Annotated[int, Path(ge=1, le=ID_MAX, description="Iteration id")]
# Trainers too: they enqueue tasks and publish policies already, and fine-tune on the dataset.
Runner = Annotated[Principal, require_roles(Role.admin, Role.operator, Role.trainer)]


async def _runner_pool(pool_id: PoolId, principal: Runner, session: Session) -> Pool:
    """Scope check first (before the body is validated): another token's pool is 404."""
    return await pool_for(session, principal, pool_id)


RunnerPool = Annotated[Pool, Depends(_runner_pool)]


async def _out(session: Session, it: RestemIteration) -> IterationOut:
    return _shown(it, await service.progress(session, it))


def _shown(it: RestemIteration, progress: IterationProgress) -> IterationOut:
    return IterationOut(
        id=it.id,
        pool_id=it.pool_id,
        name=it.name,
        status=cast(IterationStatus, it.status),
        policy_step=it.policy_step,
        samples_per_problem=it.samples_per_problem,
        keep_correct=it.keep_correct,
        sampling=service.sampling_of(it),
        batch_id=it.batch_id,
        created_at=it.created_at,
        deadline_at=it.deadline_at,
        finished_at=it.finished_at,
        progress=progress,
    )


@admin_router.post(
    "/pools/{pool_id}/restem/iterations",
    response_model=IterationOut,
    status_code=201,
    summary="Start a ReST^EM iteration: N samples per problem under the current policy",
    responses={200: {"model": IterationOut, "description": "The same name and body again: nothing new"}},
)
async def create_iteration(
    scoped: RunnerPool,
    body: IterationIn,
    principal: Runner,
    session: Session,
    state: State,
    response: Response,
) -> IterationOut:
    pool = await pool_for(session, principal, scoped.id, for_update=True)
    iteration, created = await service.create(
        session,
        pool,
        body,
        secret=state.settings.seed_key,
        actor=principal.token_id,
        now=state.clock.utcnow(),
    )
    if created:
        await record(
            session,
            principal,
            "restem.iteration.create",
            target_type="restem_iteration",
            target_id=str(iteration.id),
            pool_id=pool.id,
            after={
                "name": iteration.name,
                "problems": iteration.problem_count,
                "samples_per_problem": iteration.samples_per_problem,
                "keep_correct": iteration.keep_correct,
                "policy_step": iteration.policy_step,
                "batch_id": iteration.batch_id,
            },
        )
    else:
        response.status_code = 200
    return await _out(session, iteration)


@admin_router.get(
    "/pools/{pool_id}/restem/iterations",
    response_model=Page[IterationOut],
    summary="The pool's iterations, newest first",
)
async def list_iterations(
    pool: RunnerPool,
    session: Session,
    state: State,
    cursor: Annotated[str | None, Query(max_length=200, description="next_cursor of the last page")] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> Page[IterationOut]:
    scope = CursorScope("restem.iterations", pool_id=pool.id)
    rows = await service.newest_first(
        session, pool.id, before_id=scope.decode_int(cursor), limit=limit + 1, now=state.clock.utcnow()
    )
    more = len(rows) > limit
    rows = rows[:limit]
    progress = await service.progresses(session, rows)  # two statements for the page
    return Page[IterationOut](
        items=[_shown(it, progress[it.id]) for it in rows],
        next_cursor=scope.encode(rows[-1].id) if more else None,
    )


@admin_router.get(
    "/pools/{pool_id}/restem/iterations/{iteration_id}",
    response_model=IterationOut,
    summary="An iteration's status and progress",
)
async def get_iteration(
    pool: RunnerPool, iteration_id: IterationId, session: Session, state: State
) -> IterationOut:
    iteration = await service.get(session, pool.id, iteration_id, now=state.clock.utcnow())
    return await _out(session, iteration)


@admin_router.get(
    "/pools/{pool_id}/restem/iterations/{iteration_id}/report",
    response_model=IterationReport,
    summary="Per-problem solve rates (correct / verified samples) and totals",
)
async def iteration_report(
    pool: RunnerPool, iteration_id: IterationId, session: Session, state: State
) -> IterationReport:
    iteration = await service.get(session, pool.id, iteration_id, now=state.clock.utcnow())
    return await service.report(session, iteration)


@admin_router.get(
    "/pools/{pool_id}/restem/iterations/{iteration_id}/dataset",
    response_class=StreamingResponse,
    summary="The iteration's dataset: at most K correct samples per problem, as JSON Lines",
    responses={
        200: {
            "description": "One correct sample per line (iteration_id, problem_id, task_id, "
            "submission_id, sample_index, node_id, policy_step, prompt, problem_ref, metadata, "
            "completion, token_ids, finish_reason, prompt_tokens, completion_tokens, reward), "
            "problems in creation order; the same lines on every read.",
            "content": {"application/x-ndjson": {}},
        },
        409: {"description": "iteration_running: the dataset exists once the iteration has finished"},
    },
)
async def iteration_dataset(
    request: Request, pool: RunnerPool, iteration_id: IterationId, session: Session, state: State
) -> StreamingResponse:
    iteration = await service.get(session, pool.id, iteration_id, now=state.clock.utcnow())
    spec = service.dataset_spec_or_conflict(iteration, pool)
    return TokenStreamingResponse(
        request,
        service.dataset_lines(
            state.sessionmaker, spec, max_bytes=state.settings.limits.max_result_body_bytes
        ),
        media_type="application/x-ndjson",
        headers={
            "Content-Disposition": f'attachment; filename="restem-{pool.id}-{iteration.id}.jsonl"',
            "Cache-Control": "no-store",
        },
    )
