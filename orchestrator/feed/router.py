"""GET /v1/pools/{pool_id}/rollouts and its streaming export (trainer tokens)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Query, Request
from fastapi.responses import StreamingResponse

from api_schemas.common import NO_NUL, PROBLEM_RESPONSES
from api_schemas.feed import RolloutChangePage, RolloutPage
from orchestrator.admin.tokens import Principal, Role, TokenStreamingResponse, require_roles
from orchestrator.core.routing import GuardedRoute
from orchestrator.core.state import Session, State
from orchestrator.feed import service
from orchestrator.pools.models import Pool
from orchestrator.tasks.access import pool_for

router = APIRouter(prefix="/v1", tags=["trainer feed"], responses=PROBLEM_RESPONSES, route_class=GuardedRoute)

PoolId = Annotated[str, Path(min_length=1, max_length=40, pattern=NO_NUL)]
Reader = Annotated[Principal, require_roles(Role.admin, Role.operator, Role.trainer)]
After = Annotated[
    str | None,
    Query(
        max_length=200, description="A cursor from a previous page or line; omit to start at the beginning"
    ),
]


async def _reader_pool(pool_id: PoolId, principal: Reader, session: Session) -> Pool:
    """admin: any pool; operator: its own; trainer: the pools its token is scoped to; else 404."""
    return await pool_for(session, principal, pool_id)


ReaderPool = Annotated[Pool, Depends(_reader_pool)]


# Besides the 503s of every route (PROBLEM_RESPONSES), the feed's own.
FEED_BUSY = {
    **PROBLEM_RESPONSES[503],
    "description": "feed_busy: verdicts are being written. " + PROBLEM_RESPONSES[503]["description"],
}


@router.get(
    "/pools/{pool_id}/rollouts",
    response_model=RolloutPage,
    summary="Accepted rollouts in acceptance order, after a cursor",
    description="Only accepted, unreversed verdicts that no fraud verdict against their node "
    "withdrew; rewards are the server's. A verdict reversed or withdrawn after it was served is "
    "absent when the same range is read again. Poll with `next_cursor`.",
    responses={503: FEED_BUSY},
)
async def rollouts(
    pool: ReaderPool,
    session: Session,
    state: State,
    after: After = None,
    limit: Annotated[
        int,
        Query(
            ge=1,
            le=500,
            description="Rollouts per page at most; fewer (with has_more) once their signed results "
            "add up to ORCH_LIMITS__MAX_RESULT_BODY_BYTES",
        ),
    ] = 100,
) -> RolloutPage:
    max_bytes = state.settings.limits.max_result_body_bytes
    return await service.page(session, pool.id, after=after, limit=limit, max_bytes=max_bytes)


@router.get(
    "/pools/{pool_id}/rollouts/changes",
    response_model=RolloutChangePage,
    summary="Notices of rollouts reversed, withdrawn or restored, in commit order, after a cursor",
    description="A notice for each rollout whose verdict was reversed on appeal, that a fraud "
    "verdict against its node withdrew, or that stands again because that fraud verdict was "
    "reversed, in the order the changes committed. Each says whether the rollout stands as the "
    "page is read (`stands`), and carries the rollout when it does. A trainer reading the feed "
    "forward polls this with its own `next_cursor` to unlearn or take back rollouts it has "
    "passed.",
    responses={503: FEED_BUSY},
)
async def changes(
    pool: ReaderPool,
    session: Session,
    state: State,
    after: After = None,
    limit: Annotated[
        int,
        Query(
            ge=1,
            le=500,
            description="Notices per page at most; fewer (with has_more) once their rollouts' signed "
            "results add up to ORCH_LIMITS__MAX_RESULT_BODY_BYTES",
        ),
    ] = 100,
) -> RolloutChangePage:
    max_bytes = state.settings.limits.max_result_body_bytes
    return await service.changes(session, pool.id, after=after, limit=limit, max_bytes=max_bytes)


@router.get(
    "/pools/{pool_id}/rollouts/export",
    response_class=StreamingResponse,
    summary="The same feed as JSON Lines, streamed",
    responses={
        200: {
            "description": "One rollout per line, exactly as the paged feed's items (each with its "
            "own `cursor`), covering the accepted rollouts that existed when the export started.",
            "content": {"application/x-ndjson": {}},
        },
        503: FEED_BUSY,
    },
)
async def export(
    request: Request, pool: ReaderPool, session: Session, state: State, after: After = None
) -> StreamingResponse:
    after_id = await service.resume_point(session, pool.id, after)
    upto_id = await service.export_bound(session, pool.id)
    lines = service.export_lines(
        state.sessionmaker,
        pool.id,
        after_id=after_id,
        upto_id=upto_id,
        max_bytes=state.settings.limits.max_result_body_bytes,
    )
    return TokenStreamingResponse(
        request,
        lines,
        media_type="application/x-ndjson",
        headers={
            "Content-Disposition": f'attachment; filename="rollouts-{pool.id}.jsonl"',
            "Cache-Control": "no-store",
        },
    )
