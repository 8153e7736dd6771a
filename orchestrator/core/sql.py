"""Small SQL helpers that differ by dialect."""

from __future__ import annotations

from typing import Any

from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import DeclarativeBase


def dialect_of(session: AsyncSession) -> str:
    bind = session.get_bind()
    return bind.dialect.name


def dialect_insert(dialect: str) -> Any:
    """The INSERT construct with ON CONFLICT of ``dialect`` (PostgreSQL's or SQLite's)."""
    return pg_insert if dialect == "postgresql" else sqlite_insert


async def insert_ignore(session: AsyncSession, model: type[DeclarativeBase], values: dict[str, Any]) -> bool:
    """INSERT ... ON CONFLICT DO NOTHING; True if a row was inserted."""
    stmt = dialect_insert(dialect_of(session))(model).values(**values).on_conflict_do_nothing()
    result = await session.execute(stmt)
    return bool(getattr(result, "rowcount", 0))


def is_postgres(session: AsyncSession) -> bool:
    return dialect_of(session) == "postgresql"
