"""Database engine, sessions and the declarative base.

PostgreSQL (asyncpg) in production; SQLite (aiosqlite) as the embedded default. On SQLite
every transaction starts with ``BEGIN IMMEDIATE``: the database has one writer at a time,
and taking the write lock up front means a read-then-write transaction can never fail
half-way with ``SQLITE_BUSY`` when it upgrades. WAL mode keeps readers going meanwhile.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import structlog
from sqlalchemy import DateTime, MetaData, event
from sqlalchemy.engine import Engine
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase
from sqlalchemy.types import TypeDecorator

from orchestrator.settings import DatabaseSettings

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

log = structlog.get_logger(__name__)


class UTCDateTime(TypeDecorator[dt.datetime]):
    """Timezone-aware UTC datetimes on every backend (SQLite stores naive values)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: dt.datetime | None, dialect: Any) -> dt.datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTCDateTime column")
        return value.astimezone(dt.UTC)

    def process_result_value(self, value: dt.datetime | None, dialect: Any) -> dt.datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=dt.UTC)
        return value.astimezone(dt.UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


def _sqlite_pragmas(engine: AsyncEngine) -> None:
    sync_engine: Engine = engine.sync_engine

    @event.listens_for(sync_engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Let SQLAlchemy's "begin" event below own transaction start.
        dbapi_conn.isolation_level = None
        cursor = dbapi_conn.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA busy_timeout=30000")
        # FULL: each commit's WAL frames are fsync'd before COMMIT returns, so before the answer
        # that reports it (README, "Transactions"). NORMAL, in WAL mode, syncs only at
        # checkpoints: an OS crash or power loss could undo the last commits, answered 2xx: a
        # result acknowledged, a withdrawal, a payout run and its marks paid (the next run would
        # take those payouts again, for a second settlement). About half a millisecond a commit.
        cursor.execute("PRAGMA synchronous=FULL")
        cursor.close()

    @event.listens_for(sync_engine, "begin")
    def _on_begin(conn: Any) -> None:
        # A connection marked ``sqlite_deferred`` (the readiness probe) reads without the lock.
        deferred = conn.get_execution_options().get("sqlite_deferred")
        conn.exec_driver_sql("BEGIN" if deferred else "BEGIN IMMEDIATE")


def make_engine(settings: DatabaseSettings) -> AsyncEngine:
    # hide_parameters: a failed statement's error (logged with its traceback) and the echo log
    # show the SQL without its values, which hold answer keys, signed bodies and signatures.
    if settings.is_sqlite:
        engine = create_async_engine(
            settings.url,
            echo=settings.echo,
            hide_parameters=True,
            connect_args={"timeout": 30},
        )
        _sqlite_pragmas(engine)
        return engine
    return create_async_engine(
        settings.url,
        echo=settings.echo,
        hide_parameters=True,
        pool_size=settings.pool_size,
        max_overflow=settings.max_overflow,
        # No pre-ping by default: it costs three round trips per checkout. A connection that
        # died meanwhile fails one request, and SQLAlchemy then discards the whole pool.
        pool_pre_ping=settings.pool_pre_ping,
        pool_recycle=settings.pool_recycle_s or -1,
    )


def autocommit(engine: AsyncEngine) -> AsyncEngine:
    """The engine for single read statements outside any transaction (same pool).

    On PostgreSQL this saves the BEGIN and ROLLBACK round trips around one SELECT. SQLite keeps
    the plain engine: its transactions start with BEGIN IMMEDIATE (see above) and are cheap.
    """
    if engine.dialect.name == "sqlite":
        return engine
    return engine.execution_options(isolation_level="AUTOCOMMIT")


def make_sessionmaker(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return async_sessionmaker(engine, expire_on_commit=False, autoflush=False)


_AFTER_COMMIT = "orchestrator.after_commit"


def after_commit(session: AsyncSession, action: Callable[[], Awaitable[None]]) -> None:
    """Run ``action`` once the request's transaction (``state.get_session``) has committed, and
    never if it rolls back: for effects outside the database, such as the hot store, that must
    not run ahead of the change they follow.

    Best effort: an action that fails is logged (``run_after_commit``), and one is skipped when
    the request is cancelled (a stopping server's, ``cli.SHUTDOWN_GRACE_S``) while its commit is
    awaited: the COMMIT then completes in the database, but the session only sees the
    cancellation, so no one can tell that it has committed; or cut short if the cancellation
    lands in the action's own await (a Redis call). (Nothing can cancel it between the commit
    and ``run_after_commit``: there is no suspension point there.) Shielding the commit
    with its actions would hold a stopping process for as long as a commit can hang. So an
    action must be one the system repairs without it: the one there is, the hot store's
    ``forget_node`` of a banned node, is (``admin.service.take_out``)."""
    session.info.setdefault(_AFTER_COMMIT, []).append(action)


async def run_after_commit(session: AsyncSession) -> None:
    """The actions ``after_commit`` queued, in order. The commit stands whatever they do: a
    failure is logged, not raised."""
    for action in session.info.pop(_AFTER_COMMIT, []):
        try:
            await action()
        except Exception:
            log.warning(
                "after_commit_failed", action=getattr(action, "__qualname__", repr(action)), exc_info=True
            )


async def session_scope(sessionmaker: async_sessionmaker[AsyncSession]) -> AsyncIterator[AsyncSession]:
    """One session, one transaction: committed on success, rolled back on any error."""
    async with sessionmaker() as session, session.begin():
        yield session


def one_of(column: str, values: Iterable[str]) -> str:
    """The SQL of a check that ``column`` holds one of ``values`` (constant identifiers)."""
    return f"{column} IN (" + ", ".join(f"'{v}'" for v in values) + ")"


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)
