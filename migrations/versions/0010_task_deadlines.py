"""A partial index of open tasks with a deadline

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-30 08:10:00.000000

The lease reaper now fails open tasks whose ``deadline_at`` has passed. It reads them through
this index, which holds only open tasks that have a deadline.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

WHERE = sa.text("status = 'open' AND deadline_at IS NOT NULL")


def upgrade() -> None:
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.create_index(
            "ix_tasks_open_deadline",
            ["deadline_at"],
            unique=False,
            postgresql_where=WHERE,
            sqlite_where=WHERE,
        )


def downgrade() -> None:
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.drop_index("ix_tasks_open_deadline", postgresql_where=WHERE, sqlite_where=WHERE)
