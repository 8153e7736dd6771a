"""A task that fails on the nodes of several providers ends failed (max_failures)

Revision ID: 0020
Revises: 0019
Create Date: 2026-11-30 22:00:00.000000

A node gave a lease back the same way whether it was stopping or the task had failed on it (its
backend crashed on the prompt, say), and a release is no attempt: a task that fails everywhere
went round every node of the pool, costing each its time, and never ended. A release may now say
what failed (``assignments.error``); once nodes of ``pools.max_failures`` different providers
(3 for existing pools) have said so, the task ends ``failed`` with ``end_reason``
``max_failures``, which ``tasks.end_reason_known`` now allows.

The downgrade sets such tasks' ``end_reason`` to NULL, which 0019 allows (``failure_reason``
still says why in words), then drops the columns.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0020"
down_revision: str | None = "0019"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Written out rather than imported from the models, so this revision stays as it is.
END_REASON_KNOWN = (
    "end_reason IN ('cancelled', 'max_attempts', 'deadline_passed', 'iteration_expired', 'max_failures')"
)
OLD_END_REASON_KNOWN = "end_reason IN ('cancelled', 'max_attempts', 'deadline_passed', 'iteration_expired')"


def upgrade() -> None:
    # Plain ADD COLUMN (on SQLite too): a batch copy would rebuild tables that others refer to.
    op.add_column("pools", sa.Column("max_failures", sa.Integer(), server_default="3", nullable=False))
    op.add_column("assignments", sa.Column("error", sa.String(length=1000), nullable=True))
    # Batch mode: SQLite alters a CHECK constraint only by rebuilding the table.
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.drop_constraint("end_reason_known", type_="check")
        batch_op.create_check_constraint("end_reason_known", END_REASON_KNOWN)


def downgrade() -> None:
    op.execute("UPDATE tasks SET end_reason = NULL WHERE end_reason = 'max_failures'")
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.drop_constraint("end_reason_known", type_="check")
        batch_op.create_check_constraint("end_reason_known", OLD_END_REASON_KNOWN)
    op.drop_column("assignments", "error")
    op.drop_column("pools", "max_failures")
