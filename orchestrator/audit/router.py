"""GET /v1/admin/audit: the audit log, filtered by pool and actor, with cursor pagination.

An admin sees every entry. An operator sees the entries of the pools it owns (whoever acted
on them, an admin included) plus its own actions, and nothing else: a filter on a pool it
does not own simply matches nothing.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from sqlalchemy import or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from api_schemas.audit import AuditEntryOut
from api_schemas.common import NO_NUL, PROBLEM_RESPONSES, Page
from orchestrator.admin.tokens import Principal, Role, require_roles
from orchestrator.audit.models import AuditEntry
from orchestrator.core.pagination import CursorScope
from orchestrator.core.routing import GuardedRoute
from orchestrator.core.state import Session
from orchestrator.pools.models import Pool

router = APIRouter(
    prefix="/v1/admin", tags=["admin: audit"], responses=PROBLEM_RESPONSES, route_class=GuardedRoute
)

OperatorOrAdmin = Annotated[Principal, require_roles(Role.admin, Role.operator)]


async def _entries(
    session: AsyncSession,
    principal: Principal,
    *,
    pool_id: str | None,
    actor: str | None,
    before_id: int | None,
    limit: int,
) -> list[AuditEntry]:
    stmt = select(AuditEntry).order_by(AuditEntry.id.desc()).limit(limit)
    if principal.role != Role.admin:
        owned = select(Pool.id).where(Pool.owner_token_id == principal.token_id)
        stmt = stmt.where(or_(AuditEntry.pool_id.in_(owned), AuditEntry.actor == principal.token_id))
    if pool_id is not None:
        stmt = stmt.where(AuditEntry.pool_id == pool_id)
    if actor is not None:
        stmt = stmt.where(AuditEntry.actor == actor)
    if before_id is not None:
        stmt = stmt.where(AuditEntry.id < before_id)
    return list((await session.execute(stmt)).scalars())


def _entry_out(e: AuditEntry) -> AuditEntryOut:
    return AuditEntryOut(
        id=e.id,
        actor=e.actor,
        actor_role=e.actor_role,
        action=e.action,
        target_type=e.target_type,
        target_id=e.target_id,
        pool_id=e.pool_id,
        before=e.before,
        after=e.after,
        request_id=e.request_id,
        at=e.at,
    )


@router.get(
    "/audit",
    response_model=Page[AuditEntryOut],
    summary="The audit log, newest first (operators: their pools and their own actions)",
)
async def list_audit(
    principal: OperatorOrAdmin,
    session: Session,
    pool_id: Annotated[
        str | None, Query(max_length=40, pattern=NO_NUL, description="Only entries about this pool")
    ] = None,
    actor: Annotated[
        str | None,
        Query(max_length=100, pattern=NO_NUL, description="Only entries by this token id (or provider id)"),
    ] = None,
    cursor: Annotated[
        str | None, Query(max_length=200, description="next_cursor of the previous page")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=500, description="Page size")] = 100,
) -> Page[AuditEntryOut]:
    # An operator's log is its own (its pools, its actions): the caller is part of the scope.
    viewer = None if principal.role == Role.admin else principal.token_id
    scope = CursorScope("admin.audit", viewer=viewer, pool_id=pool_id, actor=actor)
    entries = await _entries(
        session,
        principal,
        pool_id=pool_id,
        actor=actor,
        before_id=scope.decode_int(cursor),
        limit=limit + 1,
    )
    more = len(entries) > limit
    entries = entries[:limit]
    return Page[AuditEntryOut](
        items=[_entry_out(e) for e in entries],
        next_cursor=scope.encode(entries[-1].id) if more else None,
    )
