"""Contributor endpoints for providers and nodes (all signed, PROTOCOL.md)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from api_schemas.common import PROBLEM_RESPONSES
from api_schemas.identity import NodeOut, NodeRegister, ProviderOut, ProviderRegister
from orchestrator.core.routing import GuardedRoute
from orchestrator.core.state import Session, State
from orchestrator.identity import service
from orchestrator.identity.auth import CurrentNode, RegisteringNode, RegisteringProvider, client_ip

router = APIRouter(prefix="/v1", tags=["contributors"], responses=PROBLEM_RESPONSES, route_class=GuardedRoute)


@router.post(
    "/providers",
    response_model=ProviderOut,
    status_code=201,
    summary="Register a provider (idempotent; signed by the provider key)",
    responses={200: {"model": ProviderOut, "description": "Already registered"}},
)
async def register_provider(
    body: ProviderRegister,
    signed: RegisteringProvider,
    request: Request,
    response: Response,
    session: Session,
) -> ProviderOut:
    # A new key has counted toward its address's and its own registrations (``auth.registering``).
    provider, created = await service.register_provider(
        session, signed.keyid, body.display_name, client_ip(request)
    )
    if not created:
        response.status_code = 200
    return service.provider_out(provider)


@router.post(
    "/nodes",
    response_model=NodeOut,
    status_code=201,
    summary="Register a node (idempotent; signed by the node key, attested by its provider)",
    responses={200: {"model": NodeOut, "description": "Already registered; specs and version updated"}},
)
async def register_node(
    body: NodeRegister,
    signed: RegisteringNode,
    request: Request,
    response: Response,
    session: Session,
    state: State,
) -> NodeOut:
    node, created = await service.register_node(session, signed.keyid, body, client_ip(request))
    if not created:
        response.status_code = 200
    return await service.node_out(state, node)


@router.get("/nodes/me", response_model=NodeOut, summary="The signing node's own record")
async def get_me(node: CurrentNode, state: State) -> NodeOut:
    return await service.node_out(state, node)
