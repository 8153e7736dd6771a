"""A node's status history keeps a ban's whole reason (node_status_history.reason is text)

Revision ID: 0026
Revises: 0025
Create Date: 2026-12-01 04:30:00.000000

A ban is recorded in the node's status history as ``banned: <reason>``, and a ban's reason
may be 500 characters, but the column held 200: on PostgreSQL a ban with a reason past 192
characters failed with a 500 (SQLite does not enforce the length). The column is text now,
like ``nodes.ban_reason``. Downgrading cuts longer reasons to 200 characters.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0026"
down_revision: str | None = "0025"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("node_status_history", schema=None) as batch_op:
        batch_op.alter_column("reason", existing_type=sa.String(length=200), type_=sa.Text(), nullable=False)


def downgrade() -> None:
    op.execute("UPDATE node_status_history SET reason = substr(reason, 1, 200) WHERE length(reason) > 200")
    with op.batch_alter_table("node_status_history", schema=None) as batch_op:
        batch_op.alter_column("reason", existing_type=sa.Text(), type_=sa.String(length=200), nullable=False)
