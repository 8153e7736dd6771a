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


async def _seed_ended_tasks(url: str) -> None:
    """Tasks that ended before revision 0012, each with the failure_reason its path wrote then."""
    from orchestrator.admin.models import ApiToken
    from orchestrator.pools.models import Pool
    from orchestrator.tasks.models import Task, TaskBatch

    engine = create_async_engine(url)
    pool = {
        "id": "pool-mig",
        "name": "mig",
        "status": "active",
        "owner_token_id": "tok-mig",
        "admission": "open",
        "requirements": {},
        "min_stake_per_node": 0,
        "reward_per_sample": 1,
        "reward_hold_s": 0,
        "soft_invalid_penalty": 0,
        "fraud_slash_amount": 0,
        "strikes_before_ejection": 3,
        "strikes_before_provider_ban": 3,
        "unbonding_period_s": 0,
        "lease_duration_s": 60,
        "max_attempts": 3,
        "replication_factor": 1,
        "audit_rate_floor": 0.0,
        "max_async_level": 2,
        "max_leases_per_node": 4,
    }
    ended = [
        ("failed", "deadline passed at 2026-11-30T10:00:00+00:00"),
        ("failed", "replica 0 expired 3 times (max attempts)"),
        ("cancelled", "ReST^EM iteration 7 expired"),
        ("cancelled", "cancelled by tok-mig"),
        ("open", None),
    ]
    try:
        async with engine.begin() as conn:
            await conn.execute(
                ApiToken.__table__.insert(),
                [{"id": "tok-mig", "name": "m", "role": "admin", "token_hash": "0" * 64}],
            )
            await conn.execute(Pool.__table__.insert(), [pool])
            await conn.execute(
                TaskBatch.__table__.insert(),
                [
                    {
                        "id": 1,
                        "pool_id": "pool-mig",
                        "batch_key": "b",
                        "body_sha256": "0" * 64,
                        "task_count": 5,
                        "created_by": "t",
                    }
                ],
            )
            await conn.execute(
                Task.__table__.insert(),
                [
                    {
                        "id": i + 1,
                        "pool_id": "pool-mig",
                        "batch_id": 1,
                        "batch_index": i,
                        "prompt": "p",
                        "sampling": {},
                        "replication": 1,
                        "min_quorum": 1,
                        "claim_rank": 0,
                        "status": status,
                        "available_replicas": 0,
                        "failure_reason": reason,
                    }
                    for i, (status, reason) in enumerate(ended)
                ],
            )
    finally:
        await engine.dispose()


async def _end_reasons(url: str) -> list[tuple[int, str | None]]:
    engine = create_async_engine(url)
    try:
        async with engine.connect() as conn:
            return [
                tuple(r) for r in await conn.execute(text("SELECT id, end_reason FROM tasks ORDER BY id"))
            ]
    finally:
        await engine.dispose()


def test_0012_gives_tasks_that_already_ended_their_end_reason(scratch_url: str) -> None:
    upgrade(scratch_url)
    asyncio.run(_seed_ended_tasks(scratch_url))
    downgrade(scratch_url, "0011")  # the rows as they were before 0012: text only
    upgrade(scratch_url)
    assert asyncio.run(_end_reasons(scratch_url)) == [
        (1, "deadline_passed"),
        (2, "max_attempts"),
        (3, "iteration_expired"),
        (4, "cancelled"),
        (5, None),
    ]
