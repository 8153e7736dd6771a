"""Nodes keep their last heartbeat's time once they are dead

Revision ID: 0019
Revises: 0018
Create Date: 2026-11-30 20:10:00.000000

A node's last heartbeat lived only in the hot store, whose entry expires some time after the
node is found dead: an operator looking at a dead node then saw no last heartbeat at all. The
sweeper now copies it into ``nodes.last_heartbeat_at`` when it marks the node dead, and the node
views fall back on it. Earlier dead nodes keep NULL.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from orchestrator.core.db import UTCDateTime

revision: str = "0019"
down_revision: str | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("nodes", sa.Column("last_heartbeat_at", UTCDateTime(timezone=True), nullable=True))


def downgrade() -> None:
    op.drop_column("nodes", "last_heartbeat_at")
