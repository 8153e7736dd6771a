"""Audit entries: who did what to which target, with the state before and after."""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import JSON, BigInteger, Index, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from orchestrator.core.db import Base, UTCDateTime, utcnow


class AuditEntry(Base):
    __tablename__ = "audit_log"
    __table_args__ = (
        Index("ix_audit_log_pool_id_id", "pool_id", "id"),
        Index("ix_audit_log_actor_id", "actor", "id"),
    )

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    actor: Mapped[str] = mapped_column(
        String(100), doc="token id, 'system' (the verifier), 'cli' (orchestrator admin) or a provider id"
    )
    actor_role: Mapped[str] = mapped_column(String(16))
    action: Mapped[str] = mapped_column(String(64), doc="e.g. pool.create, node.ban, ledger.deposit")
    target_type: Mapped[str] = mapped_column(String(32))
    target_id: Mapped[str] = mapped_column(String(100))
    pool_id: Mapped[str | None] = mapped_column(String(40))
    before: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    after: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    request_id: Mapped[str | None] = mapped_column(String(64))
    at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
