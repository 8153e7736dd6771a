"""Tables for providers, nodes and the node status history."""

from __future__ import annotations

import datetime as dt
import enum

from sqlalchemy import BigInteger, CheckConstraint, ForeignKey, Index, Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from orchestrator.core.db import Base, UTCDateTime, utcnow

KEY_ID = String(43)


class NodeStatus(enum.StrEnum):
    waiting = "waiting"  # registered or unbanned, waiting for a heartbeat
    healthy = "healthy"
    unhealthy = "unhealthy"
    dead = "dead"
    banned = "banned"


NODE_STATUSES = tuple(s.value for s in NodeStatus)


RETIREMENT_COMPLETE = (
    "(retired_at IS NULL AND successor_id IS NULL AND retirement_reason IS NULL"
    " AND retirement_key IS NULL AND retired_by IS NULL)"
    " OR (retired_at IS NOT NULL AND successor_id IS NOT NULL AND retirement_reason IS NOT NULL"
    " AND retirement_key IS NOT NULL AND retired_by IS NOT NULL)"
)


class Provider(Base):
    __tablename__ = "providers"
    __table_args__ = (
        # A retirement (``identity.retirement``) records all four, once; a provider never
        # succeeds itself.
        CheckConstraint(RETIREMENT_COMPLETE, name="retirement_complete"),
        CheckConstraint("successor_id IS NULL OR successor_id <> id", name="successor_not_self"),
    )

    id: Mapped[str] = mapped_column(KEY_ID, primary_key=True)
    display_name: Mapped[str | None] = mapped_column(String(100))
    registered_ip: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    #: When an admin retired the provider (its key lost or stolen): every request the key signs
    #: is refused 403 ``provider_retired``, and its money goes to ``successor_id``, now and as it
    #: matures (``ledger.succession``). NULL: not retired.
    retired_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime())
    successor_id: Mapped[str | None] = mapped_column(KEY_ID, ForeignKey("providers.id", ondelete="RESTRICT"))
    retirement_reason: Mapped[str | None] = mapped_column(String(500))
    #: The admin's ``Idempotency-Key``: the same call again is answered as the first was.
    retirement_key: Mapped[str | None] = mapped_column(String(100))
    #: The admin token that retired it.
    retired_by: Mapped[str | None] = mapped_column(String(32))


class Node(Base):
    __tablename__ = "nodes"
    __table_args__ = (
        CheckConstraint(
            "status IN ('waiting', 'healthy', 'unhealthy', 'dead', 'banned')", name="status_known"
        ),
        # A revocation is final: the node stays banned (no unban), whatever code comes later.
        CheckConstraint("revoked_at IS NULL OR status = 'banned'", name="revoked_is_banned"),
        Index("ix_nodes_status_id", "status", "id"),
        Index("ix_nodes_provider_id_id", "provider_id", "id"),
    )

    id: Mapped[str] = mapped_column(KEY_ID, primary_key=True)
    provider_id: Mapped[str] = mapped_column(KEY_ID, ForeignKey("providers.id", ondelete="RESTRICT"))
    attestation: Mapped[str] = mapped_column(String(86))
    gpu_model: Mapped[str | None] = mapped_column(String(100))
    gpu_count: Mapped[int] = mapped_column(Integer)
    gpu_memory_mb: Mapped[int] = mapped_column(Integer)
    cpu_cores: Mapped[int] = mapped_column(Integer)
    ram_mb: Mapped[int] = mapped_column(Integer)
    version: Mapped[str] = mapped_column(String(64))
    ip_address: Mapped[str | None] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16), default=NodeStatus.waiting.value)
    status_changed_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    ban_reason: Mapped[str | None] = mapped_column(Text)
    #: When the node's provider revoked its key (``identity.revocation``): the node is banned for
    #: good, and the key can never register again. NULL: not revoked.
    revoked_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime())
    #: Copied from the hot store when the sweeper marks the node dead (the hot store's entry
    #: expires later); the live value of a node under watch is the hot store's.
    last_heartbeat_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime())
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow, onupdate=utcnow)


class NodeStatusChange(Base):
    """Every status a node has had, with why; append-only."""

    __tablename__ = "node_status_history"
    __table_args__ = (Index("ix_node_status_history_node_id_id", "node_id", "id"),)

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    node_id: Mapped[str] = mapped_column(KEY_ID, ForeignKey("nodes.id", ondelete="CASCADE"))
    from_status: Mapped[str | None] = mapped_column(String(16))
    to_status: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str] = mapped_column(Text)
    actor: Mapped[str] = mapped_column(String(100))
    at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
