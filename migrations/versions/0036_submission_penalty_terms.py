"""Results are penalised and held by the pool's terms when they were received, too

Revision ID: 0036
Revises: 0035
Create Date: 2026-12-03 13:00:00.000000

Revision 0022 recorded the staleness bound, the proof requirement and the reward rate with each
submission, but the verifier still read the pool's ``fraud_slash_amount``,
``soft_invalid_penalty`` and ``reward_hold_s`` when it decided: an operator who raised the
slash or the penalty while results waited punished them by terms they were not sent under, and
a longer hold kept their rewards pending longer than the pool said when they came in. A
submission now records these three as well; NULL for the results stored before this revision,
which are decided by the pool's settings at the verdict, as before. The downgrade drops the
columns.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0036"
down_revision: str | None = "0035"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Plain ADD COLUMN (on SQLite too): a batch copy would rebuild a table that others refer to.
    op.add_column("submissions", sa.Column("fraud_slash_amount", sa.BigInteger(), nullable=True))
    op.add_column("submissions", sa.Column("soft_invalid_penalty", sa.BigInteger(), nullable=True))
    op.add_column("submissions", sa.Column("reward_hold_s", sa.Integer(), nullable=True))


def downgrade() -> None:
    op.drop_column("submissions", "reward_hold_s")
    op.drop_column("submissions", "soft_invalid_penalty")
    op.drop_column("submissions", "fraud_slash_amount")
