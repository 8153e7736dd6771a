"""Run Alembic programmatically (``orchestrator migrate``, ``serve``, tests)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, make_url
from sqlalchemy.ext.asyncio import create_async_engine

import migrations

MIGRATIONS_DIR = Path(migrations.__file__).parent


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str = "base") -> None:
    command.downgrade(alembic_config(url), revision)


def _scripts() -> ScriptDirectory:
    return ScriptDirectory.from_config(alembic_config("sqlite://"))


def head_revision() -> str:
    """The newest revision this version of the code knows."""
    head = _scripts().get_current_head()
    assert head is not None
    return head


def known_revision(revision: str) -> bool:
    """Whether this version of the code has the migration ``revision`` (a schema at a revision
    it does not know was made by a newer version)."""
    return revision in {script.revision for script in _scripts().walk_revisions()}


def current_revision(url: str) -> str | None:
    """The revision the database's schema is at; None for a database without the schema. A
    database that cannot be reached raises the driver's error. A SQLite file that does not
    exist holds no schema (and is not created). Runs its own event loop."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
        if not Path(parsed.database).exists():
            return None
    return asyncio.run(_read_revision(url))


def revision_of(sync_conn: Connection) -> str | None:
    """The revision of the schema on this connection: Alembic's own reading of alembic_version
    (None when the table is missing or empty)."""
    return MigrationContext.configure(sync_conn).get_current_revision()


async def _read_revision(url: str) -> str | None:
    engine = create_async_engine(url)
    try:
        async with engine.connect() as conn:
            return await conn.run_sync(revision_of)
    finally:
        await engine.dispose()
