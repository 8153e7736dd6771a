"""submissions: when a result's signed body was pruned (evidence_pruned_at)

Revision ID: 0033
Revises: 0032
Create Date: 2026-12-02 08:00:00.000000

Every result keeps its exact signed body, up to 10 MiB each, for ever: a long run's database grew
without bound. ``orchestrator admin prune-evidence`` now writes the evidence of results decided
long enough ago to an archive file, then empties their stored bodies and records when
(``evidence_pruned_at``). The digest, the signature and its header lines stay, so an archived
body can still be checked against them. NULL: the body is stored.

The downgrade drops the column; pruned bodies stay empty (their archive holds them).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import orchestrator.core.db
from migrations.guards import refuse_downgrade_while

revision: str = "0033"
down_revision: str | None = "0032"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("submissions", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("evidence_pruned_at", orchestrator.core.db.UTCDateTime(timezone=True), nullable=True)
        )


def downgrade() -> None:
    refuse_downgrade_while(
        "SELECT count(*) FROM submissions WHERE evidence_pruned_at IS NOT NULL",
        "results have their evidence pruned, which revision 0032 cannot record (their "
        "empty bodies would be read as stored ones, and the feed, its export and ReST^EM fail on "
        "them): not downgrading",
    )
    with op.batch_alter_table("submissions", schema=None) as batch_op:
        batch_op.drop_column("evidence_pruned_at")
