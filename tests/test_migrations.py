"""Alembic: the migration chain is reversible and matches the models, on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect, text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import create_async_engine

from orchestrator.all_models import Base
from orchestrator.core.migrate import downgrade, upgrade
from tests.conftest import DATABASE_URL, IS_POSTGRES


async def _admin(url: str, sql: str) -> None:
    engine = create_async_engine(url, isolation_level="AUTOCOMMIT")
    try:
        async with engine.connect() as conn:
            await conn.execute(text(sql))
    finally:
        await engine.dispose()


@pytest.fixture
def scratch_url(tmp_path: Path) -> Iterator[str]:
    """An empty database of the backend under test, dropped afterwards."""
    if not IS_POSTGRES:
        yield f"sqlite+aiosqlite:///{tmp_path / 'migrations.db'}"
        return
    assert DATABASE_URL is not None
    name = f"orch_mig_{uuid.uuid4().hex[:8]}"
    base = make_url(DATABASE_URL)
    asyncio.run(_admin(base.render_as_string(hide_password=False), f'CREATE DATABASE "{name}"'))
    try:
        yield base.set(database=name).render_as_string(hide_password=False)
    finally:
        asyncio.run(
            _admin(base.render_as_string(hide_password=False), f'DROP DATABASE "{name}" WITH (FORCE)')
        )


async def _inspect(url: str) -> tuple[set[str], list[Any]]:
    engine = create_async_engine(url)
    try:
        async with engine.connect() as conn:

            def read(sync_conn: Any) -> tuple[set[str], list[Any]]:
                tables = set(inspect(sync_conn).get_table_names())
                ctx = MigrationContext.configure(sync_conn, opts={"compare_type": True})
                return tables, compare_metadata(ctx, Base.metadata)

            return await conn.run_sync(read)
    finally:
        await engine.dispose()


def test_upgrade_downgrade_upgrade_round_trip(scratch_url: str) -> None:
    upgrade(scratch_url)
    tables, _ = asyncio.run(_inspect(scratch_url))
    assert {t.name for t in Base.metadata.sorted_tables} <= tables

    downgrade(scratch_url, "base")
    tables, _ = asyncio.run(_inspect(scratch_url))
    assert tables <= {"alembic_version"}

    upgrade(scratch_url)
    tables, _ = asyncio.run(_inspect(scratch_url))
    assert {t.name for t in Base.metadata.sorted_tables} <= tables


def test_models_and_migrations_do_not_drift(scratch_url: str) -> None:
    upgrade(scratch_url)
    _, diff = asyncio.run(_inspect(scratch_url))
    assert diff == [], f"autogenerate would emit: {diff}"
