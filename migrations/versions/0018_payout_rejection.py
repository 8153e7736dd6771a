"""Payouts can be rejected: their money goes back to claimable rewards

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-01 14:00:00.000000

A payout went ``requested -> paid`` only, so one an admin could not settle (a bad destination,
a sanctions hold, a provider asking to cancel) kept its money in ``withdrawn`` for ever.
``POST /v1/admin/payouts/{id}/reject`` now makes a requested payout ``rejected`` and moves its
amount back to ``rewards_claimable``; the payout keeps ``rejected_at``, ``rejected_by`` (the
admin's token id) and ``rejection_reason``. The check that a payout's fields match its status
(``paid_fields_match_status``) becomes ``fields_match_status``, which knows the new status.

No backfill: every existing payout is ``requested`` or ``paid``, whose new columns are NULL.
The downgrade refuses to run while any payout is rejected: 0017 cannot hold one, and turning it
back into a requested payout would ask for money to be paid that was given back already.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from migrations.guards import refuse_downgrade_while
from orchestrator.core.db import UTCDateTime

revision: str = "0018"
down_revision: str | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Written out rather than imported from the models, so this revision stays as it is.
STATUS_KNOWN = "status IN ('requested', 'paid', 'rejected')"
_UNPAID = "paid_at IS NULL AND paid_by IS NULL AND external_reference IS NULL"
_UNREJECTED = "rejected_at IS NULL AND rejected_by IS NULL AND rejection_reason IS NULL"
FIELDS_MATCH_STATUS = (
    f"(status = 'requested' AND {_UNPAID} AND {_UNREJECTED})"
    " OR (status = 'paid' AND paid_at IS NOT NULL AND paid_by IS NOT NULL"
    f" AND external_reference IS NOT NULL AND {_UNREJECTED})"
    " OR (status = 'rejected' AND rejected_at IS NOT NULL AND rejected_by IS NOT NULL"
    f" AND rejection_reason IS NOT NULL AND {_UNPAID})"
)

OLD_STATUS_KNOWN = "status IN ('requested', 'paid')"
OLD_PAID_FIELDS_MATCH_STATUS = (
    "(status = 'requested' AND paid_at IS NULL AND paid_by IS NULL AND external_reference IS NULL)"
    " OR (status = 'paid' AND paid_at IS NOT NULL AND paid_by IS NOT NULL"
    " AND external_reference IS NOT NULL)"
)


def upgrade() -> None:
    # Batch mode: SQLite alters a CHECK constraint only by rebuilding the table (PostgreSQL
    # runs the same operations as plain ALTER TABLE statements).
    with op.batch_alter_table("payouts", schema=None) as batch_op:
        batch_op.add_column(sa.Column("rejected_at", UTCDateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column("rejected_by", sa.String(length=32), nullable=True))
        batch_op.add_column(sa.Column("rejection_reason", sa.String(length=500), nullable=True))
        batch_op.drop_constraint("status_known", type_="check")
        batch_op.drop_constraint("paid_fields_match_status", type_="check")
        batch_op.create_check_constraint("status_known", STATUS_KNOWN)
        batch_op.create_check_constraint("fields_match_status", FIELDS_MATCH_STATUS)


def downgrade() -> None:
    refuse_downgrade_while(
        "SELECT count(*) FROM payouts WHERE status = 'rejected'",
        "payouts are rejected, which revision 0017 cannot hold (their money went back "
        "to claimable rewards; as requested payouts they would be paid again): not downgrading",
    )
    with op.batch_alter_table("payouts", schema=None) as batch_op:
        batch_op.drop_constraint("fields_match_status", type_="check")
        batch_op.drop_constraint("status_known", type_="check")
        batch_op.create_check_constraint("status_known", OLD_STATUS_KNOWN)
        batch_op.create_check_constraint("paid_fields_match_status", OLD_PAID_FIELDS_MATCH_STATUS)
        batch_op.drop_column("rejection_reason")
        batch_op.drop_column("rejected_by")
        batch_op.drop_column("rejected_at")
