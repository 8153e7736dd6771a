"""Results are judged and paid by the pool's terms when they were received

Revision ID: 0022
Revises: 0021
Create Date: 2026-12-02 11:00:00.000000

The verifier read the pool's ``max_async_level``, ``require_proof`` and ``reward_per_sample`` when
it decided a result, not those in force when the result was received: an operator who lowered
the staleness bound or turned on proofs while results waited had results the server had
accepted judged invalid (and the soft penalty forfeited), and a changed reward rate paid results
at a rate that depended on the verifier's lag. A submission now records the three; NULL for the
results stored before this revision, which are judged by the pool's settings at the verdict, as
before. The downgrade drops the columns.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0022"
down_revision: str | None = "0021"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Plain ADD COLUMN (on SQLite too): a batch copy would rebuild a table that others refer to.
    op.add_column("submissions", sa.Column("max_async_level", sa.Integer(), nullable=True))
    op.add_column("submissions", sa.Column("require_proof", sa.Boolean(), nullable=True))
    op.add_column("submissions", sa.Column("reward_per_sample", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    op.drop_column("submissions", "reward_per_sample")
    op.drop_column("submissions", "require_proof")
    op.drop_column("submissions", "max_async_level")
