"""Once-per-tick execution of background loops across any number of processes.

A loop's tick ``n`` is ``floor(now / interval)``. Before doing a tick's work, a process
claims it with a conditional UPDATE on the loop's row in ``background_ticks``; the row
lock (PostgreSQL) or the single-writer lock (SQLite) makes exactly one claimant win, and
the claim commits together with the tick's work.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from sqlalchemy import BigInteger, ColumnElement, String, and_, or_, select, true, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.orm import Mapped, mapped_column

from orchestrator.core.clock import Clock
from orchestrator.core.db import Base, UTCDateTime, utcnow
from orchestrator.core.sql import insert_ignore

T = TypeVar("T")


class BackgroundTick(Base):
    __tablename__ = "background_ticks"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    last_tick: Mapped[int] = mapped_column(BigInteger, default=-1)
    runs: Mapped[int] = mapped_column(BigInteger, default=0)
    last_run_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime())
    last_runner: Mapped[str | None] = mapped_column(String(100))


# A recorded tick more than this far ahead of a claimant's own (and more than three of its
# intervals) is claimed over once no claim has moved it for as long: only a clock that ran
# ahead (a host set wrong, then corrected) or another interval (a longer one numbers ticks
# lower) leaves one, and it stopped the loop in every process until their clocks caught up with
# it (a day ahead: no lease expired for a day). A claimant whose own clock is behind sees every
# tick recorded ahead too, but those keep moving (the processes on time claim them), so it does
# not take over: it claimed over each of them, and every loop ran twice per interval.
FOREIGN_AHEAD_S = 60.0

# Per (runner, loop): the recorded tick's run count this process last saw ahead, and since when
# (monotonic) it has seen that count unchanged.
_SEEN_AHEAD: dict[tuple[str, str], tuple[int, float]] = {}


def foreign_after(interval_s: float) -> int:
    """How many ticks of ``interval_s`` ahead a recorded tick is claimed over (``claim_tick``)."""
    return math.ceil(max(FOREIGN_AHEAD_S, 3 * interval_s) / interval_s)


async def claim_tick(
    session: AsyncSession, name: str, tick: int, runner: str, *, interval_s: float, clock: Clock
) -> bool:
    """True if this caller owns tick ``tick`` (of ``interval_s`` seconds) of loop ``name`` (call
    inside a transaction): the recorded tick is lower, or too far ahead to be of this interval
    and a clock that agrees and has stayed so, unclaimed, for as long (``FOREIGN_AHEAD_S``). The
    usual claim is one UPDATE; the recorded tick is read only when it fails."""
    await insert_ignore(session, BackgroundTick, {"name": name, "last_tick": -1, "runs": 0})
    key = (runner, name)
    if await _claim(session, name, tick, runner, BackgroundTick.last_tick < tick):
        _SEEN_AHEAD.pop(key, None)
        return True
    recorded = (
        await session.execute(
            select(BackgroundTick.last_tick, BackgroundTick.runs).where(BackgroundTick.name == name)
        )
    ).one()
    if recorded.last_tick <= tick + foreign_after(interval_s):  # this tick's, or just ahead
        _SEEN_AHEAD.pop(key, None)
        return False
    now = clock.monotonic()
    seen = _SEEN_AHEAD.get(key)
    if seen is None or seen[0] != recorded.runs:
        _SEEN_AHEAD[key] = (recorded.runs, now)
        return False
    if now - seen[1] < max(FOREIGN_AHEAD_S, 3 * interval_s):
        return False
    _SEEN_AHEAD.pop(key, None)
    # Unless a claim moved it meanwhile.
    return await _claim(session, name, tick, runner, BackgroundTick.runs == recorded.runs)


async def _claim(
    session: AsyncSession, name: str, tick: int, runner: str, claimable: ColumnElement[bool]
) -> bool:
    result = await session.execute(
        update(BackgroundTick)
        .where(BackgroundTick.name == name, claimable)
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


async def tick_in_batches(
    sessionmaker: async_sessionmaker[AsyncSession],
    name: str,
    tick: int,
    runner: str,
    batch: Callable[[AsyncSession], Awaitable[T]],
    *,
    more: Callable[[T], bool],
    budget_s: float,
    clock: Clock,
) -> list[T] | None:
    """Tick ``tick`` of loop ``name`` as a series of transactions: the first claims the tick and
    runs ``batch``, each next one runs ``batch`` again while ``more`` says the last one left work
    behind, for up to ``budget_s`` (the loop's interval) on ``clock.monotonic()``: a batch
    begun within it is the last. Short transactions let other work at the rows between
    batches; a backlog still drains within one tick unless working it takes longer than the
    budget, and the next tick goes on with what is left. Returns every batch's result in
    order, or None if another process had the tick."""
    until = clock.monotonic() + budget_s
    results: list[T] = []
    while True:
        async with sessionmaker() as session, session.begin():
            claimed = results or await claim_tick(
                session, name, tick, runner, interval_s=budget_s, clock=clock
            )
            if not claimed:
                return None
            result = await batch(session)
        results.append(result)
        if not more(result) or clock.monotonic() >= until:
            return results


@dataclass
class Keyset:
    """How far a tick's batches have read a queue taken in (due time, id) order. Each batch reads
    after the last row the one before it read, so the rows a batch could not handle (logged, and
    left for the next tick) do not come back at the head of every later batch: with a full batch
    of them there, a tick ended without reaching the rows behind them, and so did every tick."""

    after: tuple[dt.datetime, Any] | None = None
    read: int = 0  # rows the last batch read

    def where(self, due: Any, ident: Any) -> ColumnElement[bool]:
        if self.after is None:
            return true()
        at, last = self.after
        return or_(due > at, and_(due == at, ident > last))

    def saw(self, rows: Sequence[tuple[dt.datetime, Any]]) -> None:
        """Record a batch's rows, in the order read."""
        self.read = len(rows)
        if rows:
            self.after = rows[-1]
