"""A retired provider's heir: who receives its money (``ledger.succession``).

Only a read, with no dependency on the ledger's services, so that the ledger's own maturity
paths (``ledger.service.release_due_unbondings``) can ask it too."""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from orchestrator.identity.models import Provider


async def heirs(session: AsyncSession, provider_ids: Iterable[str]) -> dict[str, str]:
    """The retired ones of ``provider_ids``, each with its heir: its successor, or, if that is
    retired too, its successor's heir. Columns, not entities: read afresh at every call."""
    asked = list(provider_ids)
    found: dict[str, str] = {}
    successor: dict[str, str] = {}
    wanted = set(asked)
    while wanted:
        rows = await session.execute(
            select(Provider.id, Provider.successor_id).where(
                Provider.id.in_(sorted(wanted)), Provider.retired_at.is_not(None)
            )
        )
        step = {p: s for p, s in rows.all() if s is not None}
        successor.update(step)
        wanted = {s for s in step.values() if s not in successor}
    for provider in successor:
        heir, seen = successor[provider], {provider}
        while heir in successor and heir not in seen:  # a retired provider is no successor: no cycle
            seen.add(heir)
            heir = successor[heir]
        found[provider] = heir
    return {p: found[p] for p in asked if p in found}
