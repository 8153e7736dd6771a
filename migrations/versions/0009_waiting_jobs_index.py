"""A partial index of unfinished verification jobs, by stage

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-30 07:50:00.000000

``/metrics`` reports the verification jobs not yet done, by stage. Jobs are never deleted, so
without this index that count would read the whole table at every scrape; the partial index
holds only the unfinished ones.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

WHERE = sa.text("stage <> 'done'")


def upgrade() -> None:
    with op.batch_alter_table("verification_jobs", schema=None) as batch_op:
        batch_op.create_index(
            "ix_verification_jobs_waiting",
            ["stage"],
            unique=False,
            postgresql_where=WHERE,
            sqlite_where=WHERE,
        )


def downgrade() -> None:
    with op.batch_alter_table("verification_jobs", schema=None) as batch_op:
        batch_op.drop_index("ix_verification_jobs_waiting", postgresql_where=WHERE, sqlite_where=WHERE)
