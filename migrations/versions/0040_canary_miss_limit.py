"""Pools: a canary sampled at a temperature and missed is fraud only past canary_miss_limit misses
of the node's last canary_window canary results

Revision ID: 0040
Revises: 0039
Create Date: 2026-12-04 19:30:00.000000

A canary result with no right sample was fraud at once: at a temperature (1.0 by default) an
honest node running the right policy misses now and then a problem it usually solves, and over
many canaries every honest node was slashed, struck and in the end ejected. Such a miss is now
judged as any wrong answer unless it makes ``canary_miss_limit`` misses among the node's last
``canary_window`` canary results in the pool; existing pools get the defaults, 3 of 10. A
submission records the two as they were when it was received, as it records the pool's other
terms (NULL for the results stored before this revision: the pool's settings at the verdict).
The downgrade drops the columns (a result then waiting is judged by the old rule).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0040"
down_revision: str | None = "0039"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Plain ADD COLUMN (on SQLite too): a batch copy would rebuild tables that others refer to.
    op.add_column("pools", sa.Column("canary_miss_limit", sa.Integer(), server_default="3", nullable=False))
    op.add_column("pools", sa.Column("canary_window", sa.Integer(), server_default="10", nullable=False))
    op.add_column("submissions", sa.Column("canary_miss_limit", sa.Integer(), nullable=True))
    op.add_column("submissions", sa.Column("canary_window", sa.Integer(), nullable=True))


def downgrade() -> None:
    op.drop_column("submissions", "canary_window")
    op.drop_column("submissions", "canary_miss_limit")
    op.drop_column("pools", "canary_window")
    op.drop_column("pools", "canary_miss_limit")
