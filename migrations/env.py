"""Alembic environment: async engine, batch mode on SQLite, type and server default comparison on."""

from __future__ import annotations

import asyncio
from typing import Any

from alembic import context
from sqlalchemy import event, text
from sqlalchemy.engine import Connection

from orchestrator.all_models import Base
from orchestrator.core.db import make_engine
from orchestrator.settings import DatabaseSettings, get_settings

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    return config.get_main_option("sqlalchemy.url") or get_settings().db.url


def _configure(connection: Connection | None = None, url: str | None = None) -> None:
    is_sqlite = (url or _url()).startswith("sqlite")
    context.configure(
        connection=connection,
        url=url,
        target_metadata=target_metadata,
        compare_type=True,
        compare_server_default=True,
        render_as_batch=is_sqlite,
        # SQLite's DDL is transactional too (each run is one BEGIN IMMEDIATE): a downgrade that a
        # revision refuses is rolled back whole, as on PostgreSQL.
        transactional_ddl=True,
        literal_binds=connection is None,
    )


def run_migrations_offline() -> None:
    _configure(url=_url())
    with context.begin_transaction():
        context.run_migrations()


#: The advisory lock's key ("MG") that serialises migrations on PostgreSQL.
MIGRATE_LOCK = 0x4D47


def _run_sync(connection: Connection) -> None:
    _configure(connection=connection)
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            # Processes migrating at once (several `serve` starting together, each upgrading
            # first) would each run the same DDL, and all but one failed on a duplicate; the
            # lock makes the later ones wait, then read the version the first one left.
            connection.execute(text("SELECT pg_advisory_xact_lock(:key, 0)"), {"key": MIGRATE_LOCK})
        context.run_migrations()
        if connection.dialect.name == "sqlite":
            broken = connection.exec_driver_sql("PRAGMA foreign_key_check").all()
            if broken:
                raise RuntimeError(
                    f"the migrations left rows whose foreign keys point nowhere: {broken[:10]}"
                )


def _foreign_keys_off(dbapi_conn: Any, _record: Any) -> None:
    # SQLite's recipe for altering a table (https://sqlite.org/lang_altertable.html): batch mode
    # rebuilds it (copy, DROP, rename), and with foreign keys enforced the DROP of a table that
    # other rows refer to fails. So they are off while migrating (the pragma is a no-op inside a
    # transaction: this runs on connect, before it), and foreign_key_check runs at the end.
    cursor = dbapi_conn.cursor()
    cursor.execute("PRAGMA foreign_keys=OFF")
    cursor.close()


async def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        await connection.run_sync(_run_sync)
        return
    engine = make_engine(DatabaseSettings(url=_url()))
    if engine.dialect.name == "sqlite":
        event.listen(engine.sync_engine, "connect", _foreign_keys_off)  # after make_engine's pragmas
    try:
        async with engine.connect() as conn:
            await conn.run_sync(_run_sync)
            await conn.commit()
    finally:
        await engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    asyncio.run(run_migrations_online())
