"""Pool endpoints: public listing, node membership (signed), operator administration."""

from __future__ import annotations

import math
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Query, Response

from api_schemas.common import NO_NUL, PROBLEM_RESPONSES, KeyId, Page, Problem
from api_schemas.pools import (
    BlacklistIn,
    BlacklistOut,
    InviteIn,
    InviteOut,
    JoinIn,
    MemberOut,
    MembershipOut,
    MembershipStatus,
    PoolCreate,
    PoolOut,
    PoolPatch,
    PoolStatus,
    PublicPoolOut,
    ReasonIn,
    RefusalReason,
    RejectIn,
)
from orchestrator.admin.tokens import Principal, Role, require_roles
from orchestrator.core.errors import UnprocessableEntity
from orchestrator.core.pagination import CursorScope
from orchestrator.core.routing import GuardedRoute
from orchestrator.core.state import AppState, Session, State
from orchestrator.identity.auth import CurrentNode
from orchestrator.liveness.serving import leases_caught_up
from orchestrator.pools import service

router = APIRouter(prefix="/v1", tags=["pools"], responses=PROBLEM_RESPONSES, route_class=GuardedRoute)
admin_router = APIRouter(
    prefix="/v1/admin", tags=["admin: pools"], responses=PROBLEM_RESPONSES, route_class=GuardedRoute
)

OperatorOrAdmin = Annotated[Principal, require_roles(Role.admin, Role.operator)]
PoolId = Annotated[
    str, Path(min_length=1, max_length=40, pattern=NO_NUL, description="Pool id ('pool_' + 16 hex)")
]
Cursor = Annotated[str | None, Query(max_length=200, description="next_cursor of the previous page")]
Limit = Annotated[int, Query(ge=1, le=500, description="Page size")]


class JoinRefusal(Problem):
    """403 for a refused join: ``code`` is the first unmet rule, ``reasons`` lists them all."""

    reasons: list[RefusalReason]


JOIN_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"model": MembershipOut, "description": "Already a member (active or pending); nothing changed"},
    403: {
        "model": JoinRefusal | Problem,
        "content": {"application/problem+json": {}},
        "description": "Refused: every unmet rule is listed in `reasons`; a banned node's join is a "
        "plain problem (node_banned), without them",
    },
    404: {"model": Problem, "content": {"application/problem+json": {}}, "description": "pool_not_found"},
}


async def administered_pool(pool_id: PoolId, principal: OperatorOrAdmin, session: Session) -> str:
    """The scope check of every /v1/admin/pools/{pool_id}/... route, run as a dependency so it
    comes before anything else, body validation included: a caller that may not administer the
    pool learns nothing about it (404 pool_not_found, as for a missing pool). The services check
    again when they lock the pool."""
    await service.pool_for(session, principal, pool_id)
    return pool_id


ScopedPoolId = Annotated[str, Depends(administered_pool)]


# ------------------------------------------------------------------ public and node routes


@router.get(
    "/pools",
    response_model=Page[PublicPoolOut],
    summary="Active pools with their requirements and reward terms (public)",
)
async def list_public_pools(
    session: Session, cursor: Cursor = None, limit: Limit = 100
) -> Page[PublicPoolOut]:
    scope = CursorScope("pools.public")
    pools = await service.list_public_pools(session, after=scope.decode(cursor), limit=limit + 1)
    more = len(pools) > limit
    pools = pools[:limit]
    return Page[PublicPoolOut](
        items=await service.public_pool_views(session, pools),
        next_cursor=scope.encode(pools[-1].id) if more else None,
    )


@router.post(
    "/pools/{pool_id}/join",
    response_model=MembershipOut,
    status_code=201,
    summary="Join a pool, or ask to (signed by the node; idempotent)",
    responses=JOIN_RESPONSES,
)
async def join_pool(
    pool_id: PoolId,
    node: CurrentNode,
    session: Session,
    state: State,
    response: Response,
    body: JoinIn | None = None,
) -> MembershipOut:
    membership, created = await service.join(
        session, pool_id, node, body.invite_code if body else None, now=state.clock.utcnow()
    )
    if not created:
        response.status_code = 200
    return service.membership_out(membership)


@router.post(
    "/pools/{pool_id}/leave",
    response_model=MembershipOut,
    summary="Leave a pool or withdraw a pending join (signed by the node; idempotent)",
    dependencies=[Depends(leases_caught_up)],
)
async def leave_pool(pool_id: PoolId, node: CurrentNode, session: Session, state: State) -> MembershipOut:
    membership = await service.leave(session, pool_id, node, now=state.clock.utcnow())
    return service.membership_out(membership)


# ------------------------------------------------------------------ operator routes


@admin_router.post(
    "/pools",
    response_model=PoolOut,
    status_code=201,
    summary="Create a pool (status pending); the calling token owns it",
)
async def create_pool(
    body: PoolCreate, principal: OperatorOrAdmin, session: Session, state: State
) -> PoolOut:
    _check_lease_duration(state, body.policy.lease_duration_s)
    pool = await service.create_pool(session, principal, body, now=state.clock.utcnow())
    return await service.pool_view(session, pool)


def _check_lease_duration(state: AppState, seconds: int | None) -> None:
    """A lease shorter than a few heartbeat intervals can run out between two beats of a
    healthy node (heartbeats extend leases; the interval is the server's, told to workers)."""
    least = math.ceil(3 * state.settings.heartbeat.interval_s)
    if seconds is not None and seconds < least:
        raise UnprocessableEntity(
            f"policy.lease_duration_s must be at least {least} s, three heartbeat intervals "
            f"(ORCH_HEARTBEAT__INTERVAL_S = {state.settings.heartbeat.interval_s:g} s): a shorter "
            "lease can run out between two heartbeats of a node working on it",
            extra={"errors": [{"loc": ["body", "policy", "lease_duration_s"], "msg": "too short"}]},
        )


@admin_router.get(
    "/pools",
    response_model=Page[PoolOut],
    summary="Pools the caller administers (an admin: all), by id with cursor pagination",
)
async def list_pools(
    principal: OperatorOrAdmin,
    session: Session,
    status: Annotated[PoolStatus | None, Query(description="Only pools in this status")] = None,
    cursor: Cursor = None,
    limit: Limit = 100,
) -> Page[PoolOut]:
    # An operator lists the pools it owns: the caller is part of the scope.
    viewer = None if principal.role == Role.admin else principal.token_id
    scope = CursorScope("admin.pools", viewer=viewer, status=status.value if status else None)
    pools = await service.list_pools(
        session,
        principal,
        status=status.value if status else None,
        after=scope.decode(cursor),
        limit=limit + 1,
    )
    more = len(pools) > limit
    pools = pools[:limit]
    return Page[PoolOut](
        items=await service.pool_views(session, pools),
        next_cursor=scope.encode(pools[-1].id) if more else None,
    )


@admin_router.get("/pools/{pool_id}", response_model=PoolOut, summary="One pool")
async def get_pool(pool_id: ScopedPoolId, principal: OperatorOrAdmin, session: Session) -> PoolOut:
    return await service.pool_view(session, await service.pool_for(session, principal, pool_id))


@admin_router.patch(
    "/pools/{pool_id}",
    response_model=PoolOut,
    summary="Change a pool's settings (409 pool_completed once completed)",
)
async def update_pool(
    pool_id: ScopedPoolId, body: PoolPatch, principal: OperatorOrAdmin, session: Session, state: State
) -> PoolOut:
    _check_lease_duration(state, body.policy.lease_duration_s if body.policy else None)
    pool = await service.update_pool(session, principal, pool_id, body, now=state.clock.utcnow())
    return await service.pool_view(session, pool)


async def _lifecycle(
    action: str, pool_id: str, principal: Principal, session: Session, state: State
) -> PoolOut:
    pool = await service.change_status(session, principal, pool_id, action, now=state.clock.utcnow())
    return await service.pool_view(session, pool)


@admin_router.post("/pools/{pool_id}/activate", response_model=PoolOut, summary="pending -> active")
async def activate_pool(
    pool_id: ScopedPoolId, principal: OperatorOrAdmin, session: Session, state: State
) -> PoolOut:
    return await _lifecycle("activate", pool_id, principal, session, state)


@admin_router.post(
    "/pools/{pool_id}/pause", response_model=PoolOut, summary="active -> paused (no joins; members stay)"
)
async def pause_pool(
    pool_id: ScopedPoolId, principal: OperatorOrAdmin, session: Session, state: State
) -> PoolOut:
    return await _lifecycle("pause", pool_id, principal, session, state)


@admin_router.post("/pools/{pool_id}/resume", response_model=PoolOut, summary="paused -> active")
async def resume_pool(
    pool_id: ScopedPoolId, principal: OperatorOrAdmin, session: Session, state: State
) -> PoolOut:
    return await _lifecycle("resume", pool_id, principal, session, state)


@admin_router.post(
    "/pools/{pool_id}/complete",
    response_model=PoolOut,
    summary="paused -> completed (final; every member leaves, its stake unbonds; open tasks are cancelled)",
    dependencies=[Depends(leases_caught_up)],
)
async def complete_pool(
    pool_id: ScopedPoolId, principal: OperatorOrAdmin, session: Session, state: State
) -> PoolOut:
    return await _lifecycle("complete", pool_id, principal, session, state)


@admin_router.get(
    "/pools/{pool_id}/members",
    response_model=Page[MemberOut],
    summary="A pool's memberships, in join order, with cursor pagination and each node's track record",
)
async def list_members(
    pool_id: ScopedPoolId,
    principal: OperatorOrAdmin,
    session: Session,
    status: Annotated[MembershipStatus | None, Query(description="Only memberships in this status")] = None,
    cursor: Cursor = None,
    limit: Limit = 100,
) -> Page[MemberOut]:
    scope = CursorScope("admin.pools.members", pool_id=pool_id, status=status.value if status else None)
    members = await service.list_members(
        session,
        principal,
        pool_id,
        status=status.value if status else None,
        after=scope.decode_int(cursor),
        limit=limit + 1,
    )
    more = len(members) > limit
    members = members[:limit]
    return Page[MemberOut](
        items=await service.members_out(session, members),
        next_cursor=scope.encode(members[-1].id) if more else None,
    )


@admin_router.post(
    "/pools/{pool_id}/members/{node_id}/approve",
    response_model=MembershipOut,
    summary="Approve a pending join (idempotent)",
)
async def approve_member(
    pool_id: ScopedPoolId, node_id: KeyId, principal: OperatorOrAdmin, session: Session, state: State
) -> MembershipOut:
    m = await service.approve(session, principal, pool_id, node_id, now=state.clock.utcnow())
    return service.membership_out(m)


@admin_router.post(
    "/pools/{pool_id}/members/{node_id}/reject",
    response_model=MembershipOut,
    summary="Reject a pending join; its stake is unlocked at once (idempotent)",
)
async def reject_member(
    pool_id: ScopedPoolId,
    node_id: KeyId,
    principal: OperatorOrAdmin,
    session: Session,
    state: State,
    body: RejectIn | None = None,
) -> MembershipOut:
    m = await service.reject(
        session, principal, pool_id, node_id, body.reason if body else None, now=state.clock.utcnow()
    )
    return service.membership_out(m)


@admin_router.post(
    "/pools/{pool_id}/members/{node_id}/eject",
    response_model=MembershipOut,
    summary="Eject a node: it leaves, its stake unbonds, its leases are released; it cannot rejoin",
    dependencies=[Depends(leases_caught_up)],
)
async def eject_member(
    pool_id: ScopedPoolId,
    node_id: KeyId,
    body: ReasonIn,
    principal: OperatorOrAdmin,
    session: Session,
    state: State,
) -> MembershipOut:
    m = await service.eject(session, principal, pool_id, node_id, body.reason, now=state.clock.utcnow())
    return service.membership_out(m)


@admin_router.post(
    "/pools/{pool_id}/invites",
    response_model=InviteOut,
    status_code=201,
    summary="Create a single-use, expiring invite code (shown once)",
)
async def create_invite(
    pool_id: ScopedPoolId,
    principal: OperatorOrAdmin,
    session: Session,
    state: State,
    body: InviteIn | None = None,
) -> InviteOut:
    invite, code = await service.create_invite(
        session, principal, pool_id, (body or InviteIn()).expires_in_s, now=state.clock.utcnow()
    )
    return InviteOut(id=invite.id, pool_id=invite.pool_id, code=code, expires_at=invite.expires_at)


@admin_router.post(
    "/pools/{pool_id}/blacklist",
    response_model=BlacklistOut,
    status_code=201,
    summary="Blacklist a provider from the pool: its nodes leave and cannot rejoin",
    responses={200: {"model": BlacklistOut, "description": "Already blacklisted; nothing changed"}},
    dependencies=[Depends(leases_caught_up)],
)
async def blacklist_provider(
    pool_id: ScopedPoolId,
    body: BlacklistIn,
    principal: OperatorOrAdmin,
    session: Session,
    state: State,
    response: Response,
) -> BlacklistOut:
    entry, removed, created = await service.blacklist_provider(
        session, principal, pool_id, body.provider_id, body.reason, now=state.clock.utcnow()
    )
    if not created:
        response.status_code = 200
    return BlacklistOut(
        pool_id=entry.pool_id,
        provider_id=entry.provider_id,
        reason=entry.reason,
        created_at=entry.created_at,
        removed_nodes=removed,
    )
