"""verdicts: what the appeal of a rejection paid (reward_paid_on_appeal)

Revision ID: 0041
Revises: 0040
Create Date: 2026-12-04 19:30:00.000000

An appeal of a fraud or invalid verdict gave the stake and the forfeited rewards back but never
paid the reward the result was due: an honest node wrongly judged kept its stake and lost its
pay. The appeal now pays what an acceptance would have (the rate recorded with the result x the
samples the checks found right or could not score), held like any reward, and records the
amount in ``verdicts.reward_paid_on_appeal`` (0: nothing paid on appeal; every verdict before
this revision). The downgrade refuses while an appeal has paid something: revision 0040 could
not record it, and an upgrade again would count it as 0 (the pool's stats and the reward
budget's running total, 0042, would forget it though the ledger paid it).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from migrations.guards import refuse_downgrade_while

revision: str = "0041"
down_revision: str | None = "0040"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Plain ADD COLUMN (on SQLite too): a batch copy would rebuild a table that others refer to.
    op.add_column(
        "verdicts",
        sa.Column("reward_paid_on_appeal", sa.BigInteger(), nullable=False, server_default="0"),
    )


def downgrade() -> None:
    refuse_downgrade_while(
        "SELECT count(*) FROM verdicts WHERE reward_paid_on_appeal > 0",
        "verdicts were reversed on appeal with a reward paid, which revision 0040 cannot record "
        "(an upgrade again would count those payments as 0 in the pools' stats and reward "
        "budgets, though the ledger paid them): not downgrading",
    )
    op.drop_column("verdicts", "reward_paid_on_appeal")
