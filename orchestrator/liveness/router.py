"""POST /v1/nodes/me/heartbeat."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from api_schemas.common import PROBLEM_RESPONSES
from api_schemas.identity import HeartbeatIn, HeartbeatOut
from orchestrator.core.routing import GuardedRoute
from orchestrator.core.state import State
from orchestrator.identity.auth import SignedNode
from orchestrator.liveness import service
from orchestrator.liveness.serving import leases_caught_up

router = APIRouter(prefix="/v1", tags=["contributors"], responses=PROBLEM_RESPONSES, route_class=GuardedRoute)


@router.post(
    "/nodes/me/heartbeat",
    dependencies=[Depends(leases_caught_up)],
    response_model=HeartbeatOut,
    summary="Report liveness (hot store only; no SQL write unless the status changes)",
)
async def heartbeat(node: SignedNode, state: State, body: HeartbeatIn | None = None) -> HeartbeatOut:
    # No body is a beat with nothing to report, as a join, leave or release may have none.
    return await service.heartbeat(state, node, body if body is not None else HeartbeatIn())
