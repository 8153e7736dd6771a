"""restem_iterations.verdict_bound: the verdicts an expired iteration counts, by commit

Revision ID: 0037
Revises: 0036
Create Date: 2026-12-03 14:00:00.000000

An expired iteration counted the verdicts decided by its deadline, by their ``decided_at``. On
PostgreSQL a verifier batch takes its time when it starts and commits later: a verdict decided
before the deadline could commit after the iteration expired, and the expired (final)
iteration's dataset and report changed when it did. The iteration now records, when it
expires, the newest verdict id once no verdict is still being written (the trainer feed's
bound): it counts only verdicts at or below it. NULL for iterations that expired before this
revision, which count by ``decided_at`` alone, as before. The downgrade drops the column.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0037"
down_revision: str | None = "0036"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("restem_iterations", sa.Column("verdict_bound", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    op.drop_column("restem_iterations", "verdict_bound")
