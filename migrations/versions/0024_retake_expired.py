"""A pool may let a node lease again a replica whose lease expired on it (retake_expired_after_s)

Revision ID: 0024
Revises: 0023
Create Date: 2026-12-01 02:00:00.000000

A node never leased again a task whose lease had expired on it, so in a pool of one node a
worker down for longer than ``lease_duration_s`` stranded the tasks it held. The new nullable
``pools.retake_expired_after_s`` lets it take such a replica back that many seconds after the
expiry; NULL, the value of every existing pool, keeps the old rule.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0024"
down_revision: str | None = "0023"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("pools", sa.Column("retake_expired_after_s", sa.Integer(), nullable=True))


def downgrade() -> None:
    op.drop_column("pools", "retake_expired_after_s")
