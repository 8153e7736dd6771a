"""API tokens for operators, admins, validators and trainers (stored hashed)."""

from __future__ import annotations

import datetime as dt

from sqlalchemy import JSON, CheckConstraint, String
from sqlalchemy.orm import Mapped, mapped_column

from orchestrator.core.db import Base, UTCDateTime, utcnow


class ApiToken(Base):
    __tablename__ = "api_tokens"
    __table_args__ = (
        CheckConstraint("role IN ('admin', 'operator', 'validator', 'trainer')", name="role_known"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(100))
    role: Mapped[str] = mapped_column(String(16))
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    pool_ids: Mapped[list[str] | None] = mapped_column(
        JSON, doc="validator and trainer tokens: the pools they may act on"
    )
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    revoked_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime())
    expires_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime(), doc="null: never")
