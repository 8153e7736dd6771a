"""Recording audit entries (append-only: there is no update or delete path)."""

from __future__ import annotations

from typing import Any

import structlog
from sqlalchemy.ext.asyncio import AsyncSession

from orchestrator.admin.tokens import Principal
from orchestrator.audit.models import AuditEntry
from orchestrator.core.db import utcnow


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return str(value)


async def record(
    session: AsyncSession,
    principal: Principal,
    action: str,
    *,
    target_type: str,
    target_id: str,
    pool_id: str | None = None,
    before: dict[str, Any] | None = None,
    after: dict[str, Any] | None = None,
) -> AuditEntry:
    """Append one entry in the caller's transaction (so it commits with the action or not at all)."""
    request_id = structlog.contextvars.get_contextvars().get("request_id")
    entry = AuditEntry(
        actor=principal.token_id,
        actor_role=principal.role.value,
        action=action,
        target_type=target_type,
        target_id=target_id,
        pool_id=pool_id,
        before=_jsonable(before) if before is not None else None,
        after=_jsonable(after) if after is not None else None,
        request_id=request_id,
        at=utcnow(),
    )
    session.add(entry)
    await session.flush()
    return entry
