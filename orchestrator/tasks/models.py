"""Tables for policy versions, task batches, tasks, replicas, assignments (leases) and
submissions (signed results kept as evidence)."""

from __future__ import annotations

import datetime as dt
from typing import Any, get_args

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import Mapped, mapped_column

from api_schemas.tasks import EndReason
from orchestrator.core.db import Base, UTCDateTime, one_of, utcnow

ID = BigInteger().with_variant(Integer, "sqlite")
KEY_ID = String(43)
POOL_ID = String(40)
ASSIGNMENT_ID = String(40)

TASK_STATUSES = ("open", "submitted", "completed", "failed", "cancelled")
REPLICA_STATUSES = ("available", "leased", "submitted", "failed", "cancelled")
ASSIGNMENT_STATUSES = ("active", "submitted", "expired", "released", "cancelled")


class PolicyVersion(Base):
    """A published policy checkpoint; the pool's current policy is its highest step."""

    __tablename__ = "policy_versions"
    __table_args__ = (
        UniqueConstraint("pool_id", "step"),
        CheckConstraint("step >= 0", name="step_not_negative"),
    )

    id: Mapped[int] = mapped_column(ID, primary_key=True, autoincrement=True)
    pool_id: Mapped[str] = mapped_column(POOL_ID, ForeignKey("pools.id", ondelete="RESTRICT"))
    step: Mapped[int] = mapped_column(BigInteger)
    uri: Mapped[str] = mapped_column(String(2048))
    sha256: Mapped[str] = mapped_column(String(64))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    shards: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON)
    created_by: Mapped[str] = mapped_column(String(32))
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)


class TaskBatch(Base):
    """One enqueue request; its client key makes the request idempotent."""

    __tablename__ = "task_batches"
    __table_args__ = (UniqueConstraint("pool_id", "batch_key"),)

    id: Mapped[int] = mapped_column(ID, primary_key=True, autoincrement=True)
    pool_id: Mapped[str] = mapped_column(POOL_ID, ForeignKey("pools.id", ondelete="RESTRICT"))
    batch_key: Mapped[str] = mapped_column(String(100))
    body_sha256: Mapped[str] = mapped_column(String(64))
    task_count: Mapped[int] = mapped_column(Integer)
    created_by: Mapped[str] = mapped_column(String(32))
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)


# Why a task ended ``failed`` or ``cancelled``, for machines (``failure_reason`` says it for people):
# an operator's cancel, a replica out of attempts, the task's deadline, its ReST^EM iteration's end,
# the task failing on the nodes of as many providers as the pool's ``max_failures``, or its pool's
# completion while it was still open.
END_REASONS: tuple[str, ...] = get_args(EndReason)


class Task(Base):
    __tablename__ = "tasks"
    __table_args__ = (
        CheckConstraint(
            "status IN ('open', 'submitted', 'completed', 'failed', 'cancelled')", name="status_known"
        ),
        CheckConstraint("available_replicas >= 0", name="available_not_negative"),
        CheckConstraint("replication >= 1", name="replication_positive"),
        CheckConstraint(one_of("end_reason", END_REASONS), name="end_reason_known"),
        # The claim path: open tasks with a replica to lease, best priority first, then oldest.
        Index(
            "ix_tasks_claimable",
            "pool_id",
            "claim_rank",
            "id",
            postgresql_where=text("status = 'open' AND available_replicas > 0"),
            sqlite_where=text("status = 'open' AND available_replicas > 0"),
        ),
        Index("ix_tasks_pool_id_id", "pool_id", "id"),
        Index("ix_tasks_batch_id", "batch_id"),
        # The reaper's read of open tasks past their deadline.
        Index(
            "ix_tasks_open_deadline",
            "deadline_at",
            postgresql_where=text("status = 'open' AND deadline_at IS NOT NULL"),
            sqlite_where=text("status = 'open' AND deadline_at IS NOT NULL"),
        ),
    )

    id: Mapped[int] = mapped_column(ID, primary_key=True, autoincrement=True)
    pool_id: Mapped[str] = mapped_column(POOL_ID, ForeignKey("pools.id", ondelete="RESTRICT"))
    batch_id: Mapped[int] = mapped_column(ID, ForeignKey("task_batches.id", ondelete="RESTRICT"))
    batch_index: Mapped[int] = mapped_column(Integer)
    prompt: Mapped[str | None] = mapped_column(Text)
    problem_ref: Mapped[str | None] = mapped_column(String(500))
    sampling: Mapped[dict[str, Any]] = mapped_column(JSON)
    verification: Mapped[dict[str, Any] | None] = mapped_column(JSON, doc="never shown to workers")
    metadata_: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSON)
    replication: Mapped[int] = mapped_column(Integer)
    min_quorum: Mapped[int] = mapped_column(
        Integer, doc="results that must agree-by-majority (BOINC min_quorum)"
    )
    priority: Mapped[int] = mapped_column(Integer, default=0)
    claim_rank: Mapped[int] = mapped_column(
        Integer, doc="-priority, so one ascending index serves the claim order"
    )
    deadline_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime())
    status: Mapped[str] = mapped_column(String(16), default="open")
    available_replicas: Mapped[int] = mapped_column(Integer)
    submitted_replicas: Mapped[int] = mapped_column(Integer, default=0)
    is_canary: Mapped[bool] = mapped_column(Boolean, default=False)
    failure_reason: Mapped[str | None] = mapped_column(Text, doc="for people; end_reason is for machines")
    end_reason: Mapped[str | None] = mapped_column(
        String(32), doc="why a task ended failed or cancelled: one of END_REASONS"
    )
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)


class TaskReplica(Base):
    """One of a task's ``replication`` independent samplings, with its own server-chosen seed."""

    __tablename__ = "task_replicas"
    __table_args__ = (
        UniqueConstraint("task_id", "replica_index"),
        CheckConstraint(
            "status IN ('available', 'leased', 'submitted', 'failed', 'cancelled')", name="status_known"
        ),
    )

    id: Mapped[int] = mapped_column(ID, primary_key=True, autoincrement=True)
    task_id: Mapped[int] = mapped_column(ID, ForeignKey("tasks.id", ondelete="RESTRICT"))
    replica_index: Mapped[int] = mapped_column(Integer)
    seed: Mapped[int] = mapped_column(BigInteger)
    status: Mapped[str] = mapped_column(String(16), default="available")
    leases_issued: Mapped[int] = mapped_column(
        Integer, default=0, doc="the fencing token of the latest lease"
    )
    expirations: Mapped[int] = mapped_column(Integer, default=0)
    current_assignment_id: Mapped[str | None] = mapped_column(ASSIGNMENT_ID)


class Assignment(Base):
    """A lease of one replica to one node, until ``lease_expires_at`` (extended by heartbeats)."""

    __tablename__ = "assignments"
    __table_args__ = (
        CheckConstraint(
            "status IN ('active', 'submitted', 'expired', 'released', 'cancelled')", name="status_known"
        ),
        # A task's leases, in the order they were made: its detail reads the latest few from the
        # end (a node may churn a task's leases by the million), and lookups by task use it too.
        Index("ix_assignments_task_id_created_at", "task_id", "created_at", "id"),
        Index("ix_assignments_pool_id_node_id", "pool_id", "node_id"),
        Index("ix_assignments_node_id_status", "node_id", "status"),
        # A claim counts the node's live leases in the pool: only live ones are indexed, so the
        # count does not grow with the node's history of submitted and expired leases.
        Index(
            "ix_assignments_live_by_node",
            "node_id",
            "pool_id",
            postgresql_where=text("status = 'active'"),
            sqlite_where=text("status = 'active'"),
        ),
        # The reaper reads only live leases, oldest deadline first.
        Index(
            "ix_assignments_active_expiry",
            "lease_expires_at",
            postgresql_where=text("status = 'active'"),
            sqlite_where=text("status = 'active'"),
        ),
    )

    id: Mapped[str] = mapped_column(ASSIGNMENT_ID, primary_key=True)
    replica_id: Mapped[int] = mapped_column(ID, ForeignKey("task_replicas.id", ondelete="RESTRICT"))
    task_id: Mapped[int] = mapped_column(ID, ForeignKey("tasks.id", ondelete="RESTRICT"))
    pool_id: Mapped[str] = mapped_column(POOL_ID, ForeignKey("pools.id", ondelete="RESTRICT"))
    node_id: Mapped[str] = mapped_column(KEY_ID, ForeignKey("nodes.id", ondelete="RESTRICT"))
    provider_id: Mapped[str] = mapped_column(KEY_ID)
    ip_address: Mapped[str | None] = mapped_column(String(64))
    fencing_token: Mapped[int] = mapped_column(Integer)
    policy_step: Mapped[int] = mapped_column(BigInteger, doc="the pool's policy when leased")
    status: Mapped[str] = mapped_column(String(16), default="active")
    lease_expires_at: Mapped[dt.datetime] = mapped_column(UTCDateTime())
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    ended_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime())
    error: Mapped[str | None] = mapped_column(
        String(1000), doc="what failed, when the node gave the lease back because the task failed on it"
    )


class Submission(Base):
    """A signed result, with the exact signed request kept as evidence for any later verdict."""

    __tablename__ = "submissions"
    __table_args__ = (
        Index("ix_submissions_task_id", "task_id"),
        Index("ix_submissions_node_id_id", "node_id", "id"),
    )

    id: Mapped[int] = mapped_column(ID, primary_key=True, autoincrement=True)
    assignment_id: Mapped[str] = mapped_column(
        ASSIGNMENT_ID, ForeignKey("assignments.id", ondelete="RESTRICT"), unique=True
    )
    task_id: Mapped[int] = mapped_column(ID, ForeignKey("tasks.id", ondelete="RESTRICT"))
    replica_id: Mapped[int] = mapped_column(ID, ForeignKey("task_replicas.id", ondelete="RESTRICT"))
    pool_id: Mapped[str] = mapped_column(POOL_ID)
    node_id: Mapped[str] = mapped_column(KEY_ID)
    provider_id: Mapped[str] = mapped_column(KEY_ID)
    policy_step: Mapped[int] = mapped_column(BigInteger)
    policy_current_step: Mapped[int] = mapped_column(BigInteger, doc="the pool's policy step when received")
    # The pool's terms when the result was received: the verifier judges and pays it by these, not
    # by settings an operator changed while it waited (NULL for results stored before 0022: the
    # pool's settings at the verdict, as then; the penalties and the hold: before 0036; the
    # canary rule: before 0040).
    max_async_level: Mapped[int | None] = mapped_column(
        Integer, doc="the pool's staleness bound when received"
    )
    require_proof: Mapped[bool | None] = mapped_column(Boolean, doc="whether the pool required a proof then")
    reward_per_sample: Mapped[int | None] = mapped_column(BigInteger, doc="the pool's reward rate then")
    fraud_slash_amount: Mapped[int | None] = mapped_column(BigInteger, doc="the pool's fraud slash then")
    soft_invalid_penalty: Mapped[int | None] = mapped_column(
        BigInteger, doc="the pool's penalty for an invalid result then"
    )
    reward_hold_s: Mapped[int | None] = mapped_column(Integer, doc="the pool's reward hold then")
    canary_miss_limit: Mapped[int | None] = mapped_column(
        Integer, doc="the pool's canary miss limit then (NULL before 0040: the pool's at the verdict)"
    )
    canary_window: Mapped[int | None] = mapped_column(Integer, doc="the pool's canary window then")
    seed_echoed: Mapped[int | None] = mapped_column(BigInteger)
    claimed_reward: Mapped[float | None] = mapped_column(Float)
    sample_count: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(
        String(16), default="pending", doc="pending verification, then a verdict"
    )
    body_sha256: Mapped[str] = mapped_column(String(64))
    body: Mapped[bytes] = mapped_column(LargeBinary, doc="the exact signed request body")
    method: Mapped[str] = mapped_column(String(8))
    target_uri: Mapped[str] = mapped_column(String(2048))
    signature_input: Mapped[str] = mapped_column(Text)
    signature: Mapped[str] = mapped_column(Text)
    signature_window_s: Mapped[int | None] = mapped_column(
        Integer, doc="the created window its signature was checked against (NULL before 0025: today's)"
    )
    content_digest: Mapped[str | None] = mapped_column(Text)
    signed_fields: Mapped[list[list[str]] | None] = mapped_column(
        JSON, doc="every header line the signature covers, [name, value], as received"
    )
    response: Mapped[dict[str, Any]] = mapped_column(
        JSON, doc="what the node was told, for idempotent replays"
    )
    received_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    evidence_pruned_at: Mapped[dt.datetime | None] = mapped_column(
        UTCDateTime(),
        doc="when ``orchestrator admin prune-evidence`` archived the body and emptied it here (NULL: stored)",
    )
