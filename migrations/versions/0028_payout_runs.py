"""Payout runs: requested payouts taken together for settlement, each payout in one run at most

Revision ID: 0028
Revises: 0027
Create Date: 2026-12-01 07:40:00.000000

The settlement export listed every requested payout each time: two exports before the payouts
were marked paid listed them twice, and a payout could be paid twice outside. A run takes the
requested payouts no run holds (``payouts.run_id``), and its export lists those alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from migrations.guards import refuse_downgrade_while
from orchestrator.core.db import UTCDateTime

revision: str = "0028"
down_revision: str | None = "0027"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "payout_runs",
        sa.Column("id", ID, autoincrement=True, nullable=False),
        sa.Column("idempotency_key", sa.String(length=100), nullable=False),
        sa.Column("max_payouts", sa.Integer(), nullable=False),
        sa.Column("payouts", sa.Integer(), nullable=False),
        sa.Column("amount", sa.BigInteger(), nullable=False),
        sa.Column("created_at", UTCDateTime(timezone=True), nullable=False),
        sa.Column("created_by", sa.String(length=32), nullable=False),
        sa.CheckConstraint("max_payouts > 0", name=op.f("ck_payout_runs_max_payouts_positive")),
        sa.CheckConstraint("payouts > 0 AND amount > 0", name=op.f("ck_payout_runs_not_empty")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_payout_runs")),
        sa.UniqueConstraint("idempotency_key", name=op.f("uq_payout_runs_idempotency_key")),
    )
    with op.batch_alter_table("payouts", schema=None) as batch_op:
        batch_op.add_column(sa.Column("run_id", ID, nullable=True))
        batch_op.create_foreign_key(
            batch_op.f("fk_payouts_run_id_payout_runs"),
            "payout_runs",
            ["run_id"],
            ["id"],
            ondelete="RESTRICT",
        )
        batch_op.create_index("ix_payouts_run_id_id", ["run_id", "id"], unique=False)


def downgrade() -> None:
    refuse_downgrade_while(
        "SELECT count(*) FROM payouts WHERE status = 'requested' AND run_id IS NOT NULL",
        "requested payouts are in a payout run, which revision 0027 cannot record (the "
        "next run would take them again and two settlement files would list them): not downgrading",
    )
    with op.batch_alter_table("payouts", schema=None) as batch_op:
        batch_op.drop_index("ix_payouts_run_id_id")
        batch_op.drop_constraint(batch_op.f("fk_payouts_run_id_payout_runs"), type_="foreignkey")
        batch_op.drop_column("run_id")
    op.drop_table("payout_runs")
