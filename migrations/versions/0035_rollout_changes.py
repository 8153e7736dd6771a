"""rollout_changes: notices that a rollout the feed served may no longer stand, or stands again

Revision ID: 0035
Revises: 0034
Create Date: 2026-12-02 15:00:00.000000

A trainer reading the feed forward never learnt that a rollout it had taken was reversed on
appeal or withdrawn by a fraud verdict, nor that a withdrawn one was brought back: the feed
only leaves a rollout out when the same range is read again. ``rollout_changes`` is a log of
such notices, read in order by ``GET /v1/pools/{id}/rollouts/changes``.

The backfill writes one notice for each accepted verdict whose standing has changed before:
``reversed`` if it was reversed, else ``withdrawn`` if an unreversed fraud verdict withdraws it
(that verdict is the cause), else ``restored`` if a fraud verdict, since reversed, had withdrawn
it (the newest such verdict is the cause). It is dated when that happened and written in
verdict id order. A reader learns whether each stands when it reads the notice, so the kind of a
backfilled notice is only a label.

The downgrade drops the table.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import orchestrator.core.db

revision: str = "0035"
down_revision: str | None = "0034"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

# Per accepted verdict v, the fraud verdicts f of its window (verification.models.withdrawn_by):
# the first unreversed one withdraws it, else the newest reversed one restored it.
BACKFILL = """
INSERT INTO rollout_changes (pool_id, verdict_id, change, cause_verdict_id, created_at)
SELECT c.pool_id, c.id,
       CASE WHEN c.reversed_at IS NOT NULL THEN 'reversed'
            WHEN c.withdrawing IS NOT NULL THEN 'withdrawn' ELSE 'restored' END,
       CASE WHEN c.reversed_at IS NULL THEN coalesce(c.withdrawing, c.restoring) END,
       coalesce(
           c.reversed_at,
           (SELECT f.decided_at FROM verdicts f WHERE f.id = c.withdrawing),
           (SELECT f.reversed_at FROM verdicts f WHERE f.id = c.restoring)
       )
FROM (
    SELECT v.id, v.pool_id, v.reversed_at,
           (SELECT min(f.id) FROM verdicts f
            WHERE f.node_id = v.node_id AND f.pool_id = v.pool_id AND f.category = 'fraud'
                  AND f.id > v.id AND f.decided_at < v.hold_until
                  AND f.reversed_at IS NULL) AS withdrawing,
           (SELECT max(f.id) FROM verdicts f
            WHERE f.node_id = v.node_id AND f.pool_id = v.pool_id AND f.category = 'fraud'
                  AND f.id > v.id AND f.decided_at < v.hold_until
                  AND f.reversed_at IS NOT NULL) AS restoring
    FROM verdicts v
    WHERE v.outcome = 'accepted'
) AS c
WHERE c.reversed_at IS NOT NULL OR c.withdrawing IS NOT NULL OR c.restoring IS NOT NULL
ORDER BY c.id
"""


def upgrade() -> None:
    op.create_table(
        "rollout_changes",
        sa.Column("id", ID, autoincrement=True, nullable=False),
        sa.Column("pool_id", sa.String(length=40), nullable=False),
        sa.Column("verdict_id", ID, nullable=False),
        sa.Column("change", sa.String(length=16), nullable=False),
        sa.Column("cause_verdict_id", ID, nullable=True),
        sa.Column("created_at", orchestrator.core.db.UTCDateTime(timezone=True), nullable=False),
        sa.CheckConstraint(
            "change IN ('reversed', 'withdrawn', 'restored')", name=op.f("ck_rollout_changes_change_known")
        ),
        sa.ForeignKeyConstraint(
            ["verdict_id"],
            ["verdicts.id"],
            name=op.f("fk_rollout_changes_verdict_id_verdicts"),
            ondelete="RESTRICT",
        ),
        sa.ForeignKeyConstraint(
            ["cause_verdict_id"],
            ["verdicts.id"],
            name=op.f("fk_rollout_changes_cause_verdict_id_verdicts"),
            ondelete="RESTRICT",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_rollout_changes")),
    )
    with op.batch_alter_table("rollout_changes", schema=None) as batch_op:
        batch_op.create_index("ix_rollout_changes_pool_id_id", ["pool_id", "id"], unique=False)
    op.execute(BACKFILL)


def downgrade() -> None:
    with op.batch_alter_table("rollout_changes", schema=None) as batch_op:
        batch_op.drop_index("ix_rollout_changes_pool_id_id")
    op.drop_table("rollout_changes")
