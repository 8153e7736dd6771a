"""Reward forfeits: which verdict took how much from which reward hold

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-30 14:00:00.000000

A fraud verdict forfeited the node's held rewards with one transfer and marked the holds
``forfeited``, recording nowhere which verdict did so. Reversing that verdict gave the money back
to ``rewards_pending`` but left the holds ``forfeited``, so the release loop never moved it; and
reversing a rewarded verdict whose hold was forfeited took its reward from pending a second time.
``reward_forfeits`` records each verdict's forfeit of each hold (a soft-invalid penalty may take
part of one, hence ``reward_holds.forfeited_amount``).

Backfill, from what the earlier code did: a fraud verdict forfeited every hold of the node in
the pool still ``held`` when it was decided, and the verdicts of one node are decided one after
the other, so a ``forfeited`` hold was forfeited by the node's first fraud verdict after its own
verdict (by id), into the account its ``slash-pending`` transfer credited. Such a hold whose fraud
verdict was reversed already had its money given back to pending: it is ``held`` again (its
forfeit ``restored``), and the release loop releases it.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import orchestrator.core.db
from migrations.guards import refuse_downgrade_while

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

BACKFILL = """
INSERT INTO reward_forfeits (verdict_id, hold_id, amount, slashed_account_id, status, created_at)
SELECT f.id, h.id, h.amount, t.credit_account_id,
       CASE WHEN f.reversed_at IS NULL THEN 'forfeited' ELSE 'restored' END,
       f.decided_at
FROM reward_holds h
JOIN verdicts f ON f.id = (
    SELECT min(f2.id) FROM verdicts f2
    WHERE f2.pool_id = h.pool_id AND f2.node_id = h.node_id
      AND f2.category = 'fraud' AND f2.id > h.verdict_id
)
JOIN ledger_transfers t
  ON t.idempotency_key = :prefix || CAST(f.submission_id AS VARCHAR) || :suffix
WHERE h.status = 'forfeited'
"""


def upgrade() -> None:
    with op.batch_alter_table("reward_holds", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("forfeited_amount", sa.BigInteger(), nullable=False, server_default="0")
        )
    op.create_table(
        "reward_forfeits",
        sa.Column("id", ID, autoincrement=True, nullable=False),
        sa.Column("verdict_id", ID, nullable=False),
        sa.Column("hold_id", ID, nullable=False),
        sa.Column("amount", sa.BigInteger(), nullable=False),
        sa.Column("slashed_account_id", ID, nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("created_at", orchestrator.core.db.UTCDateTime(timezone=True), nullable=False),
        sa.CheckConstraint("amount > 0", name=op.f("ck_reward_forfeits_amount_positive")),
        sa.CheckConstraint(
            "status IN ('forfeited', 'restored', 'returned')", name=op.f("ck_reward_forfeits_status_known")
        ),
        sa.ForeignKeyConstraint(
            ["hold_id"],
            ["reward_holds.id"],
            name=op.f("fk_reward_forfeits_hold_id_reward_holds"),
            ondelete="RESTRICT",
        ),
        sa.ForeignKeyConstraint(
            ["slashed_account_id"],
            ["ledger_accounts.id"],
            name=op.f("fk_reward_forfeits_slashed_account_id_ledger_accounts"),
            ondelete="RESTRICT",
        ),
        sa.ForeignKeyConstraint(
            ["verdict_id"],
            ["verdicts.id"],
            name=op.f("fk_reward_forfeits_verdict_id_verdicts"),
            ondelete="RESTRICT",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_reward_forfeits")),
        sa.UniqueConstraint("verdict_id", "hold_id", name=op.f("uq_reward_forfeits_verdict_id_hold_id")),
    )
    with op.batch_alter_table("reward_forfeits", schema=None) as batch_op:
        batch_op.create_index("ix_reward_forfeits_hold_id", ["hold_id"], unique=False)

    conn = op.get_bind()
    conn.execute(sa.text(BACKFILL), {"prefix": "submission:", "suffix": ":slash-pending"})
    conn.execute(sa.text("UPDATE reward_holds SET forfeited_amount = amount WHERE status = 'forfeited'"))
    conn.execute(
        sa.text(
            "UPDATE reward_holds SET status = 'held', forfeited_amount = 0 "
            "WHERE id IN (SELECT hold_id FROM reward_forfeits WHERE status = 'restored')"
        )
    )


# Forfeits in force that 0012 cannot record: a soft-invalid penalty's (0012 knows no partial
# forfeit, and the backfill above rebuilds only fraud verdicts'), one of part of a hold, or one
# by a fraud verdict other than the node's first after the hold's verdict (that one was
# reversed and a later one forfeited the hold again): the backfill would give the forfeit to
# the first, reversed, and the hold, ``held`` again, would be paid out as well as slashed.
UNREPRESENTABLE = """
SELECT count(*) FROM reward_forfeits f
JOIN reward_holds h ON h.id = f.hold_id
JOIN verdicts v ON v.id = f.verdict_id
WHERE f.status = 'forfeited' AND (
    v.category <> 'fraud' OR f.amount <> h.amount
    OR f.verdict_id <> (
        SELECT min(f2.id) FROM verdicts f2
        WHERE f2.pool_id = h.pool_id AND f2.node_id = h.node_id
          AND f2.category = 'fraud' AND f2.id > h.verdict_id
    )
)
"""


def downgrade() -> None:
    refuse_downgrade_while(
        UNREPRESENTABLE,
        "reward forfeits in force took part of a hold, were a soft-invalid penalty, or were a "
        "later fraud verdict's after an appeal reversed the first, which revision 0012 cannot "
        "record (the release would pay the forfeited part as well, and an appeal would give "
        "nothing back): not downgrading",
    )
    with op.batch_alter_table("reward_forfeits", schema=None) as batch_op:
        batch_op.drop_index("ix_reward_forfeits_hold_id")
    op.drop_table("reward_forfeits")
    with op.batch_alter_table("reward_holds", schema=None) as batch_op:
        batch_op.drop_column("forfeited_amount")
