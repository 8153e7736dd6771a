"""A node whose leases keep failing on it is kept from claiming for a while (node_failing)

Revision ID: 0023
Revises: 0022
Create Date: 2026-11-30 23:00:00.000000

Since 0020 a release may report that the task failed on the node, and such reports from the
nodes of ``max_failures`` providers end the task. A broken node (its backend fails on every
prompt) fails at once and claims again at once, so it took far more than its share of the
queue and, with two more like it, could end good tasks. A membership now counts its node's
failing releases since its last result (``failure_streak``, from ``failures_since``); from the
third in a row the node is refused claims in the pool until ``failing_until`` (``node_failing``),
a minute doubling with each further failure, up to an hour. Existing memberships start at 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from orchestrator.core.db import UTCDateTime

revision: str = "0023"
down_revision: str | None = "0022"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Plain ADD COLUMN (on SQLite too): a batch copy would rebuild a table that others refer to.
    op.add_column(
        "pool_memberships", sa.Column("failure_streak", sa.Integer(), server_default="0", nullable=False)
    )
    op.add_column("pool_memberships", sa.Column("failures_since", UTCDateTime(timezone=True), nullable=True))
    op.add_column("pool_memberships", sa.Column("failing_until", UTCDateTime(timezone=True), nullable=True))


def downgrade() -> None:
    op.drop_column("pool_memberships", "failing_until")
    op.drop_column("pool_memberships", "failures_since")
    op.drop_column("pool_memberships", "failure_streak")
