"""pools: an optional reward budget, paused for when spent (reward_budget, status_reason)

Revision ID: 0042
Revises: 0041
Create Date: 2026-12-05 09:00:00.000000

A pool paid ``reward_per_sample`` for every right sample without limit. ``pools.reward_budget``
(NULL: no budget, what every existing pool keeps) caps what its verdicts credit: the
``reward_budget`` loop pauses an active pool once they have credited it, recording why in
``pools.status_reason`` (``budget_spent``; NULL for a status an operator set).

What is spent is counted per node in ``node_trust.rewards_credited`` (the rewards of its
verdicts that stand), kept by the verifier in the row it already updates for each verdict, so
that the loop sums a pool's nodes and not all its verdicts. The upgrade counts it from the
verdicts not reversed, and what appeals of reversed rejections paid
(``reward_paid_on_appeal``, 0041), as ``GET /v1/admin/pools/{id}/stats`` counts
``rewards_credited``.

The downgrade drops the three columns: a pool paused for its budget stays paused, as if an
operator had paused it, and no longer has a budget.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0042"
down_revision: str | None = "0041"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("pools", schema=None) as batch_op:
        batch_op.add_column(sa.Column("reward_budget", sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column("status_reason", sa.String(length=32), nullable=True))
        batch_op.create_check_constraint("reward_budget_positive", "reward_budget >= 1")
        batch_op.create_check_constraint("status_reason_known", "status_reason IN ('budget_spent')")
    op.add_column(
        "node_trust", sa.Column("rewards_credited", sa.BigInteger(), server_default="0", nullable=False)
    )
    op.execute(
        """
        UPDATE node_trust SET rewards_credited = COALESCE((
            SELECT SUM(CASE WHEN v.reversed_at IS NULL THEN v.reward_amount
                            ELSE v.reward_paid_on_appeal END) FROM verdicts v
            WHERE v.pool_id = node_trust.pool_id AND v.node_id = node_trust.node_id
        ), 0)
        """
    )


def downgrade() -> None:
    with op.batch_alter_table("node_trust", schema=None) as batch_op:
        batch_op.drop_column("rewards_credited")
    with op.batch_alter_table("pools", schema=None) as batch_op:
        batch_op.drop_constraint("status_reason_known", type_="check")
        batch_op.drop_constraint("reward_budget_positive", type_="check")
        batch_op.drop_column("status_reason")
        batch_op.drop_column("reward_budget")
