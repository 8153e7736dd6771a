"""Contributor endpoints for providers and nodes (all signed, PROTOCOL.md)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from api_schemas.common import PROBLEM_RESPONSES
from api_schemas.identity import NodeOut, NodeRegister, ProviderOut, ProviderRegister
from orchestrator.core import ratelimit
from orchestrator.core.routing import GuardedRoute
from orchestrator.core.state import Session, State
from orchestrator.identity import repository as repo
from orchestrator.identity import service
from orchestrator.identity.auth import CurrentNode, ProviderSigned, Signed, client_ip

router = APIRouter(prefix="/v1", tags=["contributors"], responses=PROBLEM_RESPONSES, route_class=GuardedRoute)


async def _limit_registration(state: State, request: Request, keyid: str, *, registered: bool) -> None:
    """Per address (an IPv6 /64 counts as one, as for the pools' per-IP rules) and per key,
    for keys not registered yet (attempts that fail included). Registering a key again is
    idempotent and counts only toward its signed-request limit: every machine of a provider
    registers the provider's key when its worker starts."""
    if registered:
        return
    limits = state.settings.limits
    await ratelimit.enforce(
        state,
        f"ip:register:{service.network_of(client_ip(request))}",
        limit=limits.registration_per_ip,
        window_s=limits.registration_window_s,
    )
    await ratelimit.enforce(
        state,
        f"key:register:{keyid}",
        limit=limits.registration_per_key,
        window_s=limits.registration_window_s,
    )


@router.post(
    "/providers",
    response_model=ProviderOut,
    status_code=201,
    summary="Register a provider (idempotent; signed by the provider key)",
    responses={200: {"model": ProviderOut, "description": "Already registered"}},
)
async def register_provider(
    body: ProviderRegister,
    signed: ProviderSigned,
    request: Request,
    response: Response,
    session: Session,
    state: State,
) -> ProviderOut:
    registered = await repo.get_provider(session, signed.keyid) is not None
    await _limit_registration(state, request, signed.keyid, registered=registered)
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
    body: NodeRegister, signed: Signed, request: Request, response: Response, session: Session, state: State
) -> NodeOut:
    registered = await repo.get_node(session, signed.keyid) is not None
    await _limit_registration(state, request, signed.keyid, registered=registered)
    node, created = await service.register_node(session, signed.keyid, body, client_ip(request))
    if not created:
        response.status_code = 200
    return await service.node_out(state, node)


@router.get("/nodes/me", response_model=NodeOut, summary="The signing node's own record")
async def get_me(node: CurrentNode, state: State) -> NodeOut:
    return await service.node_out(state, node)
