"""Once-per-tick execution of background loops across any number of processes.

A loop's tick ``n`` is ``floor(now / interval)``. Before doing a tick's work, a process
claims it with a conditional UPDATE on the loop's row in ``background_ticks``; the row
lock (PostgreSQL) or the single-writer lock (SQLite) makes exactly one claimant win, and
the claim commits together with the tick's work.
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy import BigInteger, String, select, update
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Mapped, mapped_column

from orchestrator.core.db import Base, UTCDateTime, utcnow
from orchestrator.core.sql import insert_ignore


class BackgroundTick(Base):
    __tablename__ = "background_ticks"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    last_tick: Mapped[int] = mapped_column(BigInteger, default=-1)
    runs: Mapped[int] = mapped_column(BigInteger, default=0)
    last_run_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime())
    last_runner: Mapped[str | None] = mapped_column(String(100))


async def claim_tick(session: AsyncSession, name: str, tick: int, runner: str) -> bool:
    """True if this caller owns tick ``tick`` of loop ``name`` (call inside a transaction)."""
    await insert_ignore(session, BackgroundTick, {"name": name, "last_tick": -1, "runs": 0})
    result = await session.execute(
        update(BackgroundTick)
        .where(BackgroundTick.name == name, BackgroundTick.last_tick < tick)
        .values(
            last_tick=tick,
            runs=BackgroundTick.runs + 1,
            last_run_at=utcnow(),
            last_runner=runner,
        )
        .returning(BackgroundTick.name)
    )
    return result.scalar_one_or_none() is not None


async def tick_runs(session: AsyncSession, name: str) -> int:
    runs = await session.scalar(select(BackgroundTick.runs).where(BackgroundTick.name == name))
    return int(runs or 0)
