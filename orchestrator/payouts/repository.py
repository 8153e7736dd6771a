"""SQL for payouts."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from orchestrator.payouts.models import Payout, PayoutRun


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
    run_id: int | None = None,
) -> list[Payout]:
    stmt = select(Payout).order_by(Payout.id.desc()).limit(limit)
    if provider_id is not None:
        stmt = stmt.where(Payout.provider_id == provider_id)
    if run_id is not None:
        stmt = stmt.where(Payout.run_id == run_id)
    if status is not None:
        stmt = stmt.where(Payout.status == status)
    if before_id is not None:
        stmt = stmt.where(Payout.id < before_id)
    return list((await session.execute(stmt)).scalars())


async def last_id(session: AsyncSession) -> int:
    return int(await session.scalar(select(func.coalesce(func.max(Payout.id), 0))) or 0)


async def oldest_first_chunk(
    session: AsyncSession,
    *,
    status: str | None,
    after_id: int,
    upto_id: int,
    limit: int,
    run_id: int | None = None,
) -> list[Payout]:
    """Payouts with ``after_id < id <= upto_id`` (of run ``run_id``, if given), in id order: one
    chunk of an export."""
    stmt = select(Payout).where(Payout.id > after_id, Payout.id <= upto_id).order_by(Payout.id).limit(limit)
    if status is not None:
        stmt = stmt.where(Payout.status == status)
    if run_id is not None:
        stmt = stmt.where(Payout.run_id == run_id)
    return list((await session.execute(stmt)).scalars())


async def run(session: AsyncSession, run_id: int) -> PayoutRun | None:
    return await session.get(PayoutRun, run_id)


async def run_by_key(session: AsyncSession, key: str) -> PayoutRun | None:
    return (
        await session.execute(select(PayoutRun).where(PayoutRun.idempotency_key == key))
    ).scalar_one_or_none()


async def take_for_run(session: AsyncSession, *, limit: int) -> list[Payout]:
    """The oldest requested payouts no run holds, locked; those another transaction has locked
    (a mark-paid, a reject, another run) are skipped, not waited for."""
    stmt = (
        select(Payout)
        .where(Payout.status == "requested", Payout.run_id.is_(None))
        .order_by(Payout.id)
        .limit(limit)
        .with_for_update(skip_locked=True)
    )
    return list((await session.execute(stmt)).scalars())


async def runs_by_status(session: AsyncSession, run_ids: list[int]) -> dict[int, dict[str, tuple[int, int]]]:
    """The runs' payouts by status, (count, total amount), in one query for a page of runs."""
    rows = await session.execute(
        select(Payout.run_id, Payout.status, func.count(), func.sum(Payout.amount))
        .where(Payout.run_id.in_(run_ids))
        .group_by(Payout.run_id, Payout.status)
    )
    found: dict[int, dict[str, tuple[int, int]]] = {run_id: {} for run_id in run_ids}
    for run_id, status, n, total in rows:
        if run_id is not None:  # the IN above leaves out payouts without a run
            found[run_id][status] = (int(n), int(total))
    return found


async def runs_newest_first(session: AsyncSession, *, before_id: int | None, limit: int) -> list[PayoutRun]:
    stmt = select(PayoutRun).order_by(PayoutRun.id.desc()).limit(limit)
    if before_id is not None:
        stmt = stmt.where(PayoutRun.id < before_id)
    return list((await session.execute(stmt)).scalars())
