"""A partial index of live leases by node and pool; autovacuum tuned for the queue tables

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-30 05:35:00.000000

A claim counts the node's live leases in its pool. Through ``ix_assignments_pool_id_node_id``
that read visited every lease the node ever held there (1,700 rows, 4.6 ms, after ten minutes of
load in the benchmark): claims slowed down as history grew. The partial index holds live leases
only.

On PostgreSQL, tasks, replicas and leases are queue tables: every claim and result turns rows
over, and the claim's index scan has to step over dead entries until they are vacuumed. The
default autovacuum threshold (20% of the table) lets hundreds of thousands of them pile up on a
large queue; vacuum them at 1% instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

QUEUE_TABLES = ("tasks", "task_replicas", "assignments", "verification_jobs")


def upgrade() -> None:
    with op.batch_alter_table("assignments", schema=None) as batch_op:
        batch_op.create_index(
            "ix_assignments_live_by_node",
            ["node_id", "pool_id"],
            unique=False,
            postgresql_where=sa.text("status = 'active'"),
            sqlite_where=sa.text("status = 'active'"),
        )
    if op.get_bind().dialect.name == "postgresql":
        for table in QUEUE_TABLES:
            op.execute(
                f"ALTER TABLE {table} SET (autovacuum_vacuum_scale_factor = 0.01, "
                "autovacuum_analyze_scale_factor = 0.02)"
            )


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        for table in QUEUE_TABLES:
            op.execute(
                f"ALTER TABLE {table} RESET (autovacuum_vacuum_scale_factor, autovacuum_analyze_scale_factor)"
            )
    with op.batch_alter_table("assignments", schema=None) as batch_op:
        batch_op.drop_index(
            "ix_assignments_live_by_node",
            postgresql_where=sa.text("status = 'active'"),
            sqlite_where=sa.text("status = 'active'"),
        )
