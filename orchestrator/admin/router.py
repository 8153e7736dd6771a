"""Admin API for the node registry (list, inspect, ban and unban nodes), providers (inspect,
retire) and API tokens."""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Query, Request, Response
from sqlalchemy import select

from api_schemas.admin import (
    BanIn,
    NodeDetailOut,
    ProviderDetailOut,
    RetireIn,
    RetirementOut,
    StatusChangeOut,
    TokenCreatedOut,
    TokenIn,
    TokenOut,
    TokenRotateIn,
)
from api_schemas.common import PROBLEM_RESPONSES, KeyId, Page
from api_schemas.identity import NodeOut
from orchestrator.admin import service, tokens
from orchestrator.admin.models import ApiToken
from orchestrator.admin.tokens import AdminOnly, Role
from orchestrator.audit.service import record
from orchestrator.core.errors import NotFound
from orchestrator.core.pagination import CursorScope
from orchestrator.core.routing import GuardedRoute
from orchestrator.core.state import Session, State
from orchestrator.identity import repository as repo
from orchestrator.identity import retirement
from orchestrator.identity.models import NODE_STATUSES, Node, Provider
from orchestrator.identity.service import node_out, nodes_page
from orchestrator.ledger.router import IdempotencyKey
from orchestrator.liveness.serving import leases_caught_up

router = APIRouter(prefix="/v1/admin", tags=["admin"], responses=PROBLEM_RESPONSES, route_class=GuardedRoute)

StatusFilter = Annotated[
    str | None, Query(pattern="^(" + "|".join(NODE_STATUSES) + ")$", description="Only nodes in this status")
]


@router.get("/nodes", response_model=Page[NodeOut], summary="List nodes (cursor pagination, by id)")
async def list_nodes(
    _: AdminOnly,
    session: Session,
    state: State,
    status: StatusFilter = None,
    provider_id: Annotated[KeyId | None, Query(description="Only this provider's nodes")] = None,
    cursor: Annotated[str | None, Query(max_length=200)] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 100,
) -> Page[NodeOut]:
    scope = CursorScope("admin.nodes", status=status, provider_id=provider_id)
    return await nodes_page(
        session, state, scope, status=status, provider_id=provider_id, cursor=cursor, limit=limit
    )


@router.get("/nodes/{node_id}", response_model=NodeDetailOut, summary="One node with its status history")
async def get_node(node_id: KeyId, _: AdminOnly, session: Session, state: State) -> NodeDetailOut:
    node = await service.node_or_404(session, node_id)
    return await _detail(session, state, node_id, node)


@router.post(
    "/nodes/{node_id}/ban",
    response_model=NodeDetailOut,
    summary=(
        "Ban a node: it is ejected from every pool it is a member of (leases released, stake "
        "unbonding) and every contributor endpoint then answers 403 node_banned"
    ),
    dependencies=[Depends(leases_caught_up)],
)
async def ban_node(
    node_id: KeyId, body: BanIn, principal: AdminOnly, session: Session, state: State
) -> NodeDetailOut:
    node = await service.ban(session, state, node_id, body.reason, principal=principal)
    return await _detail(session, state, node_id, node)


@router.post(
    "/nodes/{node_id}/unban",
    response_model=NodeDetailOut,
    summary="Lift a ban: healthy on its next heartbeat, free to rejoin the pools the ban ejected it from",
)
async def unban_node(node_id: KeyId, principal: AdminOnly, session: Session, state: State) -> NodeDetailOut:
    node = await service.unban(session, state, node_id, principal=principal)
    return await _detail(session, state, node_id, node)


async def _detail(session: Session, state: State, node_id: str, node: Node) -> NodeDetailOut:
    base = await node_out(state, node)
    history = await repo.status_history(session, node_id)
    return NodeDetailOut(
        **base.model_dump(),
        ip_address=node.ip_address,
        ban_reason=node.ban_reason,
        status_history=[
            StatusChangeOut(
                from_status=h.from_status, to_status=h.to_status, reason=h.reason, actor=h.actor, at=h.at
            )
            for h in history
        ],
    )


# ---------------------------------------------------------------- providers


async def _provider_or_404(session: Session, provider_id: str) -> Provider:
    provider = await repo.get_provider(session, provider_id)
    if provider is None:
        raise NotFound("no provider with this id", code="provider_not_found")
    return provider


@router.get(
    "/providers/{provider_id}",
    response_model=ProviderDetailOut,
    summary="One provider, with its retirement if an admin retired it",
)
async def get_provider(provider_id: KeyId, _: AdminOnly, session: Session) -> ProviderDetailOut:
    return ProviderDetailOut(**retirement.provider_detail(await _provider_or_404(session, provider_id)))


@router.post(
    "/providers/{provider_id}/retire",
    response_model=RetirementOut,
    status_code=201,
    summary="Retire a provider whose key is lost or stolen; its money goes to a successor "
    "(idempotent by Idempotency-Key)",
    description="In one transaction: the provider is retired, so every request its key signs "
    "is refused 403 `provider_retired` (its registration included) and no node may register "
    "under it; every node of the provider is revoked as the provider's own revocation does "
    "(banned for good, ejected from its pools, leases reissued, stake unbonding); the successor "
    "is blacklisted in every pool that blacklists the provider; and what is free now (free "
    "stake, stake no membership locks any more, claimable rewards) moves to the successor. "
    "What is not free yet (rewards on hold, stake unbonding) reaches the successor as it "
    "matures; requested payouts are left for an admin to settle or reject (a rejected one's "
    "amount goes to the successor). Refused, changing nothing: 404 `provider_not_found`; 422 "
    "`successor_is_provider`, `successor_not_found` (not registered); 409 `successor_retired`, "
    "`provider_retired` (retired already, with another Idempotency-Key), "
    "`idempotency_key_reused` (this key with another successor or reason). Audited "
    "`provider.retire`.",
    responses={200: {"model": RetirementOut, "description": "A retry: the first answer, nothing changed"}},
    dependencies=[Depends(leases_caught_up)],
)
async def retire_provider(
    provider_id: KeyId,
    body: RetireIn,
    idempotency_key: IdempotencyKey,
    principal: AdminOnly,
    session: Session,
    state: State,
    response: Response,
) -> RetirementOut:
    done = await retirement.retire(
        session,
        state,
        provider_id,
        body.successor_id,
        body.reason,
        key=idempotency_key,
        principal=principal,
    )
    if not done.created:
        response.status_code = 200
    after = done.after
    return RetirementOut(
        provider=ProviderDetailOut(**retirement.provider_detail(done.provider)),
        revoked_nodes=after["revoked_nodes"],
        moved=after["moved"],
        maturing=after["maturing"],
        payouts_requested=after["payouts_requested"],
        blacklists_copied=after["blacklists_copied"],
    )


# ---------------------------------------------------------------- API tokens

TokenId = Annotated[str, Path(min_length=1, max_length=32, pattern=r"^tok_[0-9a-f]+$")]


def token_out(row: ApiToken) -> TokenOut:
    return TokenOut(
        id=row.id,
        name=row.name,
        role=row.role,
        pool_ids=list(row.pool_ids or ()),
        created_at=row.created_at,
        expires_at=row.expires_at,
        revoked_at=row.revoked_at,
    )


@router.get("/tokens", response_model=Page[TokenOut], summary="List API tokens (never their secrets), by id")
async def list_tokens(
    _: AdminOnly,
    session: Session,
    cursor: Annotated[str | None, Query(max_length=200)] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 100,
) -> Page[TokenOut]:
    scope = CursorScope("admin.tokens")
    stmt = select(ApiToken).order_by(ApiToken.id).limit(limit + 1)
    if (after := scope.decode(cursor)) is not None:
        stmt = stmt.where(ApiToken.id > after)
    rows = list((await session.execute(stmt)).scalars())
    more = len(rows) > limit
    rows = rows[:limit]
    return Page[TokenOut](
        items=[token_out(r) for r in rows], next_cursor=scope.encode(rows[-1].id) if more else None
    )


@router.post(
    "/tokens",
    response_model=TokenCreatedOut,
    status_code=201,
    summary="Create an API token; its secret is in this answer only",
)
async def create_token(
    body: TokenIn, principal: AdminOnly, session: Session, state: State
) -> TokenCreatedOut:
    role = Role(body.role)
    await tokens.check_scope(session, role, body.pool_ids)
    now = state.clock.utcnow()
    expires_at = now + dt.timedelta(seconds=body.expires_in_s) if body.expires_in_s is not None else None
    secret, row = await tokens.create_token(
        session, role=role, name=body.name, pool_ids=body.pool_ids, expires_at=expires_at, now=now
    )
    out = token_out(row)
    await record(
        session, principal, "token.create", target_type="token", target_id=row.id, after=out.model_dump()
    )
    return TokenCreatedOut(**out.model_dump(), token=secret)


@router.post(
    "/tokens/{token_id}/rotate",
    response_model=TokenCreatedOut,
    summary="Give an API token a new secret (in this answer only); the old one is refused at once",
)
async def rotate_token(
    request: Request,
    token_id: TokenId,
    principal: AdminOnly,
    session: Session,
    state: State,
    body: TokenRotateIn | None = None,
) -> TokenCreatedOut:
    tokens.lock_own_and_target(request, principal, token_id)
    now = state.clock.utcnow()
    expires_at: Any = tokens.KEEP_EXPIRY
    if body is not None and "expires_in_s" in body.model_fields_set:
        lifetime = body.expires_in_s
        expires_at = now + dt.timedelta(seconds=lifetime) if lifetime is not None else None
    rotated = await tokens.rotate_token(session, token_id, expires_at=expires_at, now=now)
    if rotated is None:
        raise NotFound("no token with this id", code="token_not_found")
    secret, row = rotated
    out = token_out(row)
    await record(
        session, principal, "token.rotate", target_type="token", target_id=row.id, after=out.model_dump()
    )
    return TokenCreatedOut(**out.model_dump(), token=secret)


@router.post("/tokens/{token_id}/revoke", response_model=TokenOut, summary="Revoke an API token, for good")
async def revoke_token(
    request: Request, token_id: TokenId, principal: AdminOnly, session: Session, state: State
) -> TokenOut:
    tokens.lock_own_and_target(request, principal, token_id)
    row, revoked_now = await tokens.revoke_token(session, token_id, now=state.clock.utcnow())
    if row is None:
        raise NotFound("no token with this id", code="token_not_found")
    out = token_out(row)
    if revoked_now:
        await record(
            session, principal, "token.revoke", target_type="token", target_id=row.id, after=out.model_dump()
        )
    return out
