"""Tables for pools, memberships, invites and provider blacklists.

Amounts are integers in the ledger's smallest unit. A pool's settings are columns (so later
issues can query them), except the hardware requirements, which are one JSON document
(``{"any_of": [{gpu_models, min_gpu_count, min_gpu_memory_mb, min_ram_mb}, ...]}``).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    false,
)
from sqlalchemy.orm import Mapped, mapped_column

from orchestrator.core.db import Base, UTCDateTime, one_of, utcnow

ID = BigInteger().with_variant(Integer, "sqlite")
# Why the system put a pool in its status (``Pool.status_reason``): its rewards reached its budget.
BUDGET_SPENT = "budget_spent"
STATUS_REASONS = (BUDGET_SPENT,)
KEY_ID = String(43)
POOL_ID = String(40)
TOKEN_ID = String(32)


class Pool(Base):
    __tablename__ = "pools"
    __table_args__ = (
        CheckConstraint("status IN ('pending', 'active', 'paused', 'completed')", name="status_known"),
        CheckConstraint("admission IN ('open', 'approval', 'invite')", name="admission_known"),
        CheckConstraint("min_stake_per_node >= 0", name="min_stake_not_negative"),
        CheckConstraint("reward_budget >= 1", name="reward_budget_positive"),
        CheckConstraint(one_of("status_reason", STATUS_REASONS), name="status_reason_known"),
        Index("ix_pools_owner_token_id_id", "owner_token_id", "id"),
        Index("ix_pools_status_id", "status", "id"),
    )

    id: Mapped[str] = mapped_column(POOL_ID, primary_key=True)
    name: Mapped[str] = mapped_column(String(100))
    description: Mapped[str | None] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(16))
    owner_token_id: Mapped[str] = mapped_column(TOKEN_ID, ForeignKey("api_tokens.id", ondelete="RESTRICT"))
    admission: Mapped[str] = mapped_column(String(16))
    requirements: Mapped[dict[str, Any]] = mapped_column(JSON)
    # caps (null: no cap)
    max_nodes: Mapped[int | None] = mapped_column(Integer)
    max_nodes_per_provider: Mapped[int | None] = mapped_column(Integer)
    max_nodes_per_ip: Mapped[int | None] = mapped_column(Integer)
    # economics
    min_stake_per_node: Mapped[int] = mapped_column(BigInteger)
    reward_per_sample: Mapped[int] = mapped_column(BigInteger)
    reward_hold_s: Mapped[int] = mapped_column(Integer)
    # null: no budget (migration 0042). What is spent is the sum of ``NodeTrust.rewards_credited``.
    reward_budget: Mapped[int | None] = mapped_column(BigInteger)
    soft_invalid_penalty: Mapped[int] = mapped_column(BigInteger)
    fraud_slash_amount: Mapped[int] = mapped_column(BigInteger)
    strikes_before_ejection: Mapped[int] = mapped_column(Integer)
    strikes_before_provider_ban: Mapped[int] = mapped_column(Integer)
    unbonding_period_s: Mapped[int] = mapped_column(Integer)
    # policy
    lease_duration_s: Mapped[int] = mapped_column(Integer)
    # The server default is migration 0029's, which added the column to existing pools.
    max_lease_s: Mapped[int] = mapped_column(Integer, default=86400, server_default="86400")
    max_attempts: Mapped[int] = mapped_column(Integer)
    # The server default is migration 0020's, which added the column to existing pools.
    max_failures: Mapped[int] = mapped_column(Integer, default=3, server_default="3")
    # null: a node never leases again a replica whose lease expired on it (migration 0024).
    retake_expired_after_s: Mapped[int | None] = mapped_column(Integer)
    replication_factor: Mapped[int] = mapped_column(Integer)
    audit_rate_floor: Mapped[float] = mapped_column(Float)
    max_async_level: Mapped[int] = mapped_column(Integer)
    max_leases_per_node: Mapped[int] = mapped_column(Integer)
    # The server defaults are migration 0006's, which added these columns to existing pools.
    reward_function: Mapped[str] = mapped_column(
        String(64), default="exact_match", server_default="exact_match"
    )
    require_proof: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    audit_method: Mapped[str] = mapped_column(String(16), default="replicate", server_default="replicate")
    # A canary sampled at a temperature, missed, is fraud only as the canary_miss_limit-th miss of
    # the node's last canary_window canary results here (verification.service.canary_finding).
    # The server defaults are migration 0040's, which added the columns to existing pools.
    canary_miss_limit: Mapped[int] = mapped_column(Integer, default=3, server_default="3")
    canary_window: Mapped[int] = mapped_column(Integer, default=10, server_default="10")

    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    status_changed_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    #: Why the system changed the status (``budget_spent``); null for an operator's change.
    status_reason: Mapped[str | None] = mapped_column(String(32))


# Who ejected a membership (``PoolMembership.ejected_by``).
EJECTED_BY = ("ban", "operator", "verifier")


class PoolMembership(Base):
    """One row per (pool, node); a node that joins again after leaving starts a new ``episode``."""

    __tablename__ = "pool_memberships"
    __table_args__ = (
        UniqueConstraint("pool_id", "node_id"),
        CheckConstraint(
            "status IN ('pending', 'active', 'left', 'ejected', 'rejected')", name="status_known"
        ),
        CheckConstraint("stake >= 0", name="stake_not_negative"),
        CheckConstraint(one_of("ejected_by", EJECTED_BY), name="ejected_by_known"),
        Index("ix_pool_memberships_pool_id_status_provider_id", "pool_id", "status", "provider_id"),
        Index("ix_pool_memberships_node_id", "node_id"),
    )

    id: Mapped[int] = mapped_column(ID, primary_key=True, autoincrement=True)
    pool_id: Mapped[str] = mapped_column(POOL_ID, ForeignKey("pools.id", ondelete="RESTRICT"))
    node_id: Mapped[str] = mapped_column(KEY_ID, ForeignKey("nodes.id", ondelete="RESTRICT"))
    provider_id: Mapped[str] = mapped_column(KEY_ID, ForeignKey("providers.id", ondelete="RESTRICT"))
    status: Mapped[str] = mapped_column(String(16))
    episode: Mapped[int] = mapped_column(Integer, default=1)
    stake: Mapped[int] = mapped_column(BigInteger, default=0, doc="locked by this episode's join")
    reason: Mapped[str | None] = mapped_column(Text)
    #: Who ejected it (an ``ejected`` membership only): ``ban`` (an admin's ban of the node,
    #: lifted by the unban), ``operator`` or ``verifier`` (final).
    ejected_by: Mapped[str | None] = mapped_column(String(16))
    invite_id: Mapped[str | None] = mapped_column(
        String(32), ForeignKey("pool_invites.id", ondelete="RESTRICT")
    )
    joined_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    activated_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime())
    ended_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime())
    # A node whose leases keep failing on it (releases with an error, no result in between) is
    # kept from claiming in this pool for a while (``tasks.service.FAILURE_STREAK``).
    failure_streak: Mapped[int] = mapped_column(
        Integer, default=0, server_default="0", doc="failing releases since the node's last result"
    )
    failures_since: Mapped[dt.datetime | None] = mapped_column(
        UTCDateTime(), doc="when the streak's first failure was reported"
    )
    failing_until: Mapped[dt.datetime | None] = mapped_column(
        UTCDateTime(), doc="no claims in this pool until then (node_failing)"
    )
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)


class PoolInvite(Base):
    """A single-use, expiring invite code; only the code's SHA-256 is stored."""

    __tablename__ = "pool_invites"
    __table_args__ = (Index("ix_pool_invites_pool_id", "pool_id"),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    pool_id: Mapped[str] = mapped_column(POOL_ID, ForeignKey("pools.id", ondelete="RESTRICT"))
    code_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_by: Mapped[str] = mapped_column(TOKEN_ID)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    expires_at: Mapped[dt.datetime] = mapped_column(UTCDateTime())
    used_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime())
    used_by_node_id: Mapped[str | None] = mapped_column(KEY_ID)


class PoolProviderBlacklist(Base):
    """A provider shut out of a pool: its nodes were removed and none may join."""

    __tablename__ = "pool_provider_blacklist"

    pool_id: Mapped[str] = mapped_column(
        POOL_ID, ForeignKey("pools.id", ondelete="RESTRICT"), primary_key=True
    )
    provider_id: Mapped[str] = mapped_column(
        KEY_ID, ForeignKey("providers.id", ondelete="RESTRICT"), primary_key=True
    )
    reason: Mapped[str] = mapped_column(Text)
    created_by: Mapped[str] = mapped_column(TOKEN_ID)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
