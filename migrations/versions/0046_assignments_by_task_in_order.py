"""assignments: index a task's leases in the order they were made (task_id, created_at, id)

Revision ID: 0046
Revises: 0045
Create Date: 2026-12-05 04:00:00.000000

A task's detail lists its latest 1,000 leases (``tasks.router.TASK_LEASES_SHOWN``), newest by
``created_at`` then ``id``. With only ``ix_assignments_task_id`` the database read every lease the
task ever had and sorted them for that (a node may give a lease back and take it again some 15
times a second: a million a day on one task), some 80 ms a read at half a million and growing.
``ix_assignments_task_id_created_at`` serves the order from the end and stops at the limit; it
replaces ``ix_assignments_task_id`` (its first column serves every lookup by task the old one
did), so a new lease still updates as many indexes as before. It is made before the old one is
dropped, so a lookup by task always has one.

The downgrade puts the single-column index back.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0046"
down_revision: str | None = "0045"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index(
        "ix_assignments_task_id_created_at", "assignments", ["task_id", "created_at", "id"], unique=False
    )
    op.drop_index("ix_assignments_task_id", table_name="assignments")


def downgrade() -> None:
    op.create_index("ix_assignments_task_id", "assignments", ["task_id"], unique=False)
    op.drop_index("ix_assignments_task_id_created_at", table_name="assignments")
