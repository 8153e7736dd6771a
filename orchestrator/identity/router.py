"""Contributor endpoints for providers and nodes (all signed, PROTOCOL.md)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request, Response

from api_schemas.common import PROBLEM_RESPONSES, KeyId, Page
from api_schemas.identity import (
    NodeOut,
    NodeRegister,
    NodeRevocationOut,
    NodeRevokeIn,
    ProviderOut,
    ProviderRegister,
)
from orchestrator.core.pagination import CursorScope
from orchestrator.core.routing import GuardedRoute
from orchestrator.core.state import Session, State
from orchestrator.identity import revocation, service
from orchestrator.identity.auth import (
    CurrentNode,
    CurrentProvider,
    RegisteringNode,
    RegisteringProvider,
    client_ip,
)
from orchestrator.identity.models import NODE_STATUSES
from orchestrator.liveness.serving import leases_caught_up

router = APIRouter(prefix="/v1", tags=["contributors"], responses=PROBLEM_RESPONSES, route_class=GuardedRoute)


@router.post(
    "/providers",
    response_model=ProviderOut,
    status_code=201,
    summary="Register a provider (idempotent; signed by the provider key)",
    responses={200: {"model": ProviderOut, "description": "Already registered"}},
)
async def register_provider(
    signed: RegisteringProvider,
    request: Request,
    response: Response,
    session: Session,
    body: ProviderRegister | None = None,
) -> ProviderOut:
    # A new key has counted toward its address's and its own registrations (``auth.registering``).
    # No body is {}: the contract names no field for a provider.
    display_name = body.display_name if body is not None else None
    provider, created = await service.register_provider(
        session, signed.keyid, display_name, client_ip(request)
    )
    if not created:
        response.status_code = 200
    return service.provider_out(provider)


@router.post(
    "/nodes",
    response_model=NodeOut,
    status_code=201,
    summary="Register a node (idempotent; signed by the node key, attested by its provider)",
    description="A key its provider revoked is refused, 403 `node_key_revoked`, whatever the "
    "attestation: the provider registers a new node key instead.",
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


@router.get(
    "/providers/me/nodes",
    response_model=Page[NodeOut],
    summary="The signing provider's nodes, by id (cursor pagination)",
    description="Signed by the provider key: every node registered under the provider, each "
    "as `GET /v1/nodes/me` gives it (status, `revoked_at`, memberships), so that a provider "
    "whose machine was stolen finds the node to revoke.",
)
async def my_nodes(
    provider: CurrentProvider,
    session: Session,
    state: State,
    status: Annotated[
        str | None,
        Query(pattern="^(" + "|".join(NODE_STATUSES) + ")$", description="Only nodes in this status"),
    ] = None,
    cursor: Annotated[
        str | None, Query(max_length=200, description="next_cursor of the previous page")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=500, description="Page size")] = 100,
) -> Page[NodeOut]:
    scope = CursorScope("providers.me.nodes", provider_id=provider.id, status=status)
    return await service.nodes_page(
        session, state, scope, status=status, provider_id=provider.id, cursor=cursor, limit=limit
    )


@router.post(
    "/providers/me/nodes/{node_id}/revoke",
    response_model=NodeRevocationOut,
    summary="Revoke one of the provider's node keys, for good (a machine stolen or compromised)",
    description="Signed by the provider key. In one transaction the node is banned, so every "
    "request its key signs is refused 403 `node_banned`; it is ejected from every pool it is a "
    "member of, as an admin's ban ejects it (its leases released and their replicas reissued at "
    "once, its stake unbonding); and `revoked_at` records when. It is final: an admin cannot "
    "unban a revoked node (409 `node_revoked`) and the key can never register again (403 "
    "`node_key_revoked`): register a new node key. Results the node submitted before are judged "
    "as usual, and the provider's stake answers for them. An optional body gives a `reason`. "
    "Another provider's node is 404 `node_not_found`, as an unknown one is. Idempotent: a "
    "revoked node is answered as it is (200, the same `ejected_from`) and nothing changes. "
    "Audited `node.revoke`, with the provider as the actor (`actor_role` `provider`).",
    dependencies=[Depends(leases_caught_up)],
)
async def revoke_node(
    node_id: KeyId,
    provider: CurrentProvider,
    session: Session,
    state: State,
    body: NodeRevokeIn | None = None,
) -> NodeRevocationOut:
    node, ejected = await revocation.revoke_node(
        session, state, provider.id, node_id, body.reason if body else None
    )
    out = await service.node_out(state, node)
    return NodeRevocationOut(**out.model_dump(), ejected_from=ejected)
