"""Tables for ReST^EM iterations and the problems (one task each) they sample."""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    ForeignKey,
    Index,
    Integer,
    String,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import Mapped, mapped_column

from orchestrator.core.db import Base, UTCDateTime, utcnow

ID = BigInteger().with_variant(Integer, "sqlite")
POOL_ID = String(40)

ITERATION_STATUSES = ("running", "complete", "expired")


class RestemIteration(Base):
    """One E-step: N samples per problem under one policy step, then at most K correct each."""

    __tablename__ = "restem_iterations"
    __table_args__ = (
        UniqueConstraint("pool_id", "name"),
        CheckConstraint("status IN ('running', 'complete', 'expired')", name="status_known"),
        CheckConstraint(
            "samples_per_problem >= 1 AND samples_per_problem <= 1024", name="samples_per_problem_range"
        ),
        CheckConstraint("keep_correct >= 1", name="keep_correct_positive"),
        # The barrier: at most one running iteration per pool, whatever races.
        Index(
            "ix_restem_iterations_one_running",
            "pool_id",
            unique=True,
            postgresql_where=text("status = 'running'"),
            sqlite_where=text("status = 'running'"),
        ),
        Index("ix_restem_iterations_pool_id_id", "pool_id", "id"),
    )

    id: Mapped[int] = mapped_column(ID, primary_key=True, autoincrement=True)
    pool_id: Mapped[str] = mapped_column(POOL_ID, ForeignKey("pools.id", ondelete="RESTRICT"))
    name: Mapped[str] = mapped_column(String(100))
    status: Mapped[str] = mapped_column(String(16), default="running")
    policy_step: Mapped[int] = mapped_column(BigInteger, doc="samples from any other step are excluded")
    samples_per_problem: Mapped[int] = mapped_column(Integer)
    keep_correct: Mapped[int] = mapped_column(Integer)
    sampling: Mapped[dict[str, Any]] = mapped_column(JSON)
    problem_count: Mapped[int] = mapped_column(Integer)
    batch_id: Mapped[int | None] = mapped_column(
        ID, ForeignKey("task_batches.id", ondelete="RESTRICT"), doc="the enqueued tasks"
    )
    body_sha256: Mapped[str] = mapped_column(String(64), doc="a retried create with the same body is a no-op")
    created_by: Mapped[str] = mapped_column(String(32))
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    deadline_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime())
    finished_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime())
    verdict_bound: Mapped[int | None] = mapped_column(
        BigInteger,
        doc="expired: the newest verdict id when it expired, every lower one committed; it counts "
        "no later verdict (NULL: expired before 0037)",
    )


class RestemProblem(Base):
    """A problem of an iteration and the one task (``sampling.n`` = N) that samples it."""

    __tablename__ = "restem_problems"
    __table_args__ = (
        UniqueConstraint("iteration_id", "problem_id"),
        UniqueConstraint("task_id"),
    )

    iteration_id: Mapped[int] = mapped_column(
        ID, ForeignKey("restem_iterations.id", ondelete="RESTRICT"), primary_key=True, autoincrement=False
    )
    problem_index: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    problem_id: Mapped[str] = mapped_column(String(200))
    task_id: Mapped[int] = mapped_column(ID, ForeignKey("tasks.id", ondelete="RESTRICT"))
