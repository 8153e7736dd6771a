"""SQL for payouts."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from orchestrator.payouts.models import Payout


async def get(session: AsyncSession, payout_id: int, *, for_update: bool = False) -> Payout | None:
    stmt = select(Payout).where(Payout.id == payout_id)
    if for_update:
        stmt = stmt.with_for_update()
    return (await session.execute(stmt)).scalar_one_or_none()


async def by_transfer(session: AsyncSession, transfer_id: int) -> Payout | None:
    return (
        await session.execute(select(Payout).where(Payout.transfer_id == transfer_id))
    ).scalar_one_or_none()


async def newest_first(
    session: AsyncSession,
    *,
    provider_id: str | None,
    status: str | None,
    before_id: int | None,
    limit: int,
) -> list[Payout]:
    stmt = select(Payout).order_by(Payout.id.desc()).limit(limit)
    if provider_id is not None:
        stmt = stmt.where(Payout.provider_id == provider_id)
    if status is not None:
        stmt = stmt.where(Payout.status == status)
    if before_id is not None:
        stmt = stmt.where(Payout.id < before_id)
    return list((await session.execute(stmt)).scalars())


async def last_id(session: AsyncSession) -> int:
    return int(await session.scalar(select(func.coalesce(func.max(Payout.id), 0))) or 0)


async def oldest_first_chunk(
    session: AsyncSession, *, status: str | None, after_id: int, upto_id: int, limit: int
) -> list[Payout]:
    """Payouts with ``after_id < id <= upto_id``, in id order: one chunk of an export."""
    stmt = select(Payout).where(Payout.id > after_id, Payout.id <= upto_id).order_by(Payout.id).limit(limit)
    if status is not None:
        stmt = stmt.where(Payout.status == status)
    return list((await session.execute(stmt)).scalars())
