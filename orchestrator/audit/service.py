"""Recording audit entries (append-only: there is no update or delete path), and who acted.

An entry names its actor by ``actor_id`` and ``actor_role``: a bearer token's ``Principal``
(the token id and role; the verifier's ``system`` and the command line's ``cli`` are principals
too), or a provider acting on its own nodes with its signing key (``ProviderActor``: its
provider id, role ``provider``). A provider is no token role: nothing here lets a bearer token
be one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import structlog
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from orchestrator.audit.models import AuditEntry
from orchestrator.core.db import utcnow

PROVIDER_ROLE = "provider"


class Actor(Protocol):
    """Whoever acted, as the audit log (and the ledger and status history) names them."""

    @property
    def actor_id(self) -> str: ...

    @property
    def actor_role(self) -> str: ...


@dataclass(frozen=True)
class ProviderActor:
    """A provider acting with its own signing key (a revocation of one of its nodes)."""

    provider_id: str

    @property
    def actor_id(self) -> str:
        return self.provider_id

    @property
    def actor_role(self) -> str:
        return PROVIDER_ROLE


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
    actor: Actor,
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
        actor=actor.actor_id,
        actor_role=actor.actor_role,
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


async def last_entry(
    session: AsyncSession, actor: Actor, action: str, *, target_type: str, target_id: str
) -> AuditEntry | None:
    """The newest entry of ``actor``'s ``action`` on the target (read through the actor's index:
    for what an action that happens once, such as a revocation, recorded when it happened)."""
    stmt = (
        select(AuditEntry)
        .where(
            AuditEntry.actor == actor.actor_id,
            AuditEntry.action == action,
            AuditEntry.target_type == target_type,
            AuditEntry.target_id == target_id,
        )
        .order_by(AuditEntry.id.desc())
        .limit(1)
    )
    return (await session.execute(stmt)).scalar_one_or_none()
