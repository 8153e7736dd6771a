"""verdicts: the end of an accepted verdict's hold window (hold_until), and an index of fraud

Revision ID: 0034
Revises: 0033
Create Date: 2026-12-02 12:00:00.000000

A fraud verdict forfeits every reward of its node still in the hold window, but the rollouts
those rewards paid for stayed in the trainer feed, its export and ReST^EM datasets. Now a fraud
verdict withdraws them too: an accepted verdict is left out of those while an unreversed fraud
verdict against its node in its pool was decided after it and before its ``hold_until``. That
is read, not written, so an appeal of the fraud verdict brings them back.

``hold_until`` is backfilled from each rewarded verdict's hold (``reward_holds.release_at``);
an accepted verdict that earned nothing keeps NULL, which nothing withdraws. The partial index
``ix_verdicts_fraud`` finds a node's fraud verdicts.

The downgrade drops both.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import orchestrator.core.db
from migrations.guards import refuse_downgrade_while

revision: str = "0034"
down_revision: str | None = "0033"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("verdicts", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("hold_until", orchestrator.core.db.UTCDateTime(timezone=True), nullable=True)
        )
        batch_op.create_index(
            "ix_verdicts_fraud",
            ["node_id", "id"],
            unique=False,
            postgresql_where=sa.text("category = 'fraud'"),
            sqlite_where=sa.text("category = 'fraud'"),
        )
    op.execute(
        "UPDATE verdicts SET hold_until = "
        "(SELECT release_at FROM reward_holds WHERE reward_holds.verdict_id = verdicts.id) "
        "WHERE outcome = 'accepted'"
    )


# Accepted verdicts with no reward hold (hold_until is rebuilt from holds only) that a standing
# fraud verdict withdraws now (verification.models.withdrawn_by).
WITHDRAWN_UNREWARDED = """
SELECT count(*) FROM verdicts v
WHERE v.outcome = 'accepted' AND v.hold_until IS NOT NULL
  AND NOT EXISTS (SELECT 1 FROM reward_holds h WHERE h.verdict_id = v.id)
  AND EXISTS (
      SELECT 1 FROM verdicts f
      WHERE f.node_id = v.node_id AND f.pool_id = v.pool_id AND f.category = 'fraud'
        AND f.reversed_at IS NULL AND f.id > v.id AND f.decided_at < v.hold_until
  )
"""


def downgrade() -> None:
    refuse_downgrade_while(
        WITHDRAWN_UNREWARDED,
        "accepted verdicts without a reward hold are withdrawn by a fraud verdict, which "
        "revision 0033 cannot record (and the upgrade rebuilds hold_until from reward holds only): "
        "the feed would serve their rollouts again; not downgrading",
    )
    with op.batch_alter_table("verdicts", schema=None) as batch_op:
        batch_op.drop_index("ix_verdicts_fraud")
        batch_op.drop_column("hold_until")
