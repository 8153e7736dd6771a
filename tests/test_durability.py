"""A commit on the embedded database is on disk before the request that made it is answered."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import text

from orchestrator.core.db import make_engine
from orchestrator.settings import DatabaseSettings

FULL = 2  # PRAGMA synchronous: 0 OFF, 1 NORMAL, 2 FULL, 3 EXTRA


async def test_an_embedded_commit_is_fsyncd_before_it_is_answered(tmp_path: Path) -> None:
    # In WAL mode, synchronous=NORMAL syncs the WAL only at checkpoints: a commit answered 2xx
    # (a result, a withdrawal, a payout marked paid) could be undone by an OS crash or a power
    # loss. FULL syncs the WAL at every commit.
    engine = make_engine(DatabaseSettings(url=f"sqlite+aiosqlite:///{tmp_path / 'orchestrator.db'}"))
    try:
        async with engine.begin() as conn:
            assert (await conn.execute(text("PRAGMA journal_mode"))).scalar() == "wal"
            assert (await conn.execute(text("PRAGMA synchronous"))).scalar() == FULL
    finally:
        await engine.dispose()
