"""verdicts: the fraud verdict that forfeited what an appeal paid (reward_forfeited_by)

Revision ID: 0044
Revises: 0043
Create Date: 2026-12-04 22:00:00.000000

An appeal of a wrong rejection pays the reward an acceptance would have paid (0041). It held
that payment for the pool's reward_hold_s from the appeal, so a fraud verdict against the node
decided within the result's own hold window (after its rejection, before the appeal), which
would have forfeited the reward had the result been accepted, forfeited nothing, and a fraud
verdict decided after that window but within the appeal's forfeited a reward that would have
been claimable by then. The payment is now held to the end of the result's own window and, if
a fraud verdict of that window stands, forfeited to it at once; ``verdicts.reward_forfeited_by``
records that verdict (NULL: the appeal paid nothing, or nothing forfeited it when it paid).
The pool's ``slashed`` total counts such a forfeit while that fraud verdict stands. The
downgrade refuses while one is recorded: revision 0043 could not say why the payment went to
``slashed``, and the pools' stats would forget it; so it does while a soft-invalid penalty of
the window took part of a payment at the appeal (a ledger transfer keyed by the appeal).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from migrations.guards import refuse_downgrade_while

revision: str = "0044"
down_revision: str | None = "0043"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Plain ADD COLUMN (on SQLite too): a batch copy would rebuild a table that others refer to.
    op.add_column(
        "verdicts",
        sa.Column("reward_forfeited_by", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=True),
    )


def downgrade() -> None:
    refuse_downgrade_while(
        "SELECT count(*) FROM verdicts WHERE reward_forfeited_by IS NOT NULL",
        "verdicts were reversed on appeal with a reward paid and forfeited at once by a fraud "
        "verdict of the result's hold window, which revision 0043 cannot record (the pools' "
        "slashed totals would forget those forfeits, though the ledger made them): not downgrading",
    )
    # Since, a soft-invalid penalty of the window takes from the payment what the rewards on hold
    # lacked of it (its own forfeit, keyed by the appeal: APPEAL_FORFEIT_KEY), which 0043's
    # slashed totals would forget too, though reward_forfeited_by stays NULL for it.
    refuse_downgrade_while(
        "SELECT count(*) FROM ledger_transfers WHERE reason = 'soft_invalid_penalty' "
        "AND idempotency_key LIKE 'verdict:%:reverse:reward:forfeit:%'",
        "forfeits by soft-invalid penalties of what appeals paid (taken at the appeal, for what the "
        "rewards on hold lacked), which revision 0043 cannot record (the pools' slashed totals would "
        "forget them, though the ledger made them): not downgrading",
    )
    op.drop_column("verdicts", "reward_forfeited_by")
