"""Validation jobs nobody decides are withdrawn after a wait (status withdrawn)

Revision ID: 0031
Revises: 0030
Create Date: 2026-12-02 12:00:00.000000

A result that a pool sent to validators (``audit_method: validator``) waited for a validator's
verdict for ever: while no validator claimed the pool's jobs, nothing decided it, and it stayed
unpaid. The verifier's housekeeping now withdraws a job that waited past
``ORCH_VERIFIER__VALIDATOR_WAIT_S`` with no live lease and decides the result on the server's
own checks, as a skipped audit. Such a job is ``withdrawn`` (``status_known`` now allows it), so
that a validator's verdict posted later is told so and refused. The open jobs are indexed by
age (``ix_validation_jobs_open_since``) for that pick, and each job keeps the server's reward
per sample as its checks computed it (``per_sample_rewards``), which the verdict's details carry
to the trainer feed, as a validator's verdict does; a job made before this revision has none
(NULL), and its result is served with the mean reward for each sample.

The downgrade makes withdrawn jobs ``done`` (they are decided; ``result``, a validator's
verdict, stays NULL).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0031"
down_revision: str | None = "0030"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Written out rather than imported from the models, so this revision stays as it is.
STATUS_KNOWN = "status IN ('open', 'leased', 'done', 'withdrawn')"
OLD_STATUS_KNOWN = "status IN ('open', 'leased', 'done')"
OPEN = sa.text("status = 'open'")


def upgrade() -> None:
    # Batch mode: SQLite alters a CHECK constraint only by rebuilding the table.
    with op.batch_alter_table("validation_jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("per_sample_rewards", sa.JSON(), nullable=True))
        batch_op.drop_constraint("status_known", type_="check")
        batch_op.create_check_constraint("status_known", STATUS_KNOWN)
        batch_op.create_index(
            "ix_validation_jobs_open_since",
            ["created_at"],
            unique=False,
            postgresql_where=OPEN,
            sqlite_where=OPEN,
        )


def downgrade() -> None:
    op.execute("UPDATE validation_jobs SET status = 'done' WHERE status = 'withdrawn'")
    with op.batch_alter_table("validation_jobs", schema=None) as batch_op:
        batch_op.drop_index("ix_validation_jobs_open_since", postgresql_where=OPEN, sqlite_where=OPEN)
        batch_op.drop_constraint("status_known", type_="check")
        batch_op.create_check_constraint("status_known", OLD_STATUS_KNOWN)
        batch_op.drop_column("per_sample_rewards")
