"""Verifier partitions: each verification job records its provider's partition

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-30 10:40:00.000000

On PostgreSQL the verifier's backlog is split by provider into 16 partitions, each worked by one
batch at a time across processes (``verification.service.PARTITIONS``). A job records its
provider's partition when the result is written; a partial index per partition, in id order,
makes a batch's pick a short range scan whatever the backlog. Jobs still waiting for their
checks are given their partition here (CRC-32 of the provider id, as ``partition_of``); the
others are never picked again and keep 0.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

WHERE = sa.text("stage = 'checks'")
PARTITIONS = 16  # as verification.service.PARTITIONS when this revision was written


def upgrade() -> None:
    with op.batch_alter_table("verification_jobs", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("verifier_partition", sa.SmallInteger(), server_default="0", nullable=False)
        )
        batch_op.create_index(
            "ix_verification_jobs_partition_pending",
            ["verifier_partition", "id"],
            unique=False,
            postgresql_where=WHERE,
            sqlite_where=WHERE,
        )
    conn = op.get_bind()
    waiting = conn.execute(
        sa.text(
            "SELECT j.id, s.provider_id FROM verification_jobs j "
            "JOIN submissions s ON s.id = j.submission_id WHERE j.stage = 'checks'"
        )
    ).all()
    update = sa.text("UPDATE verification_jobs SET verifier_partition = :p WHERE id = :id")
    rows = [{"id": job_id, "p": zlib.crc32(provider.encode()) % PARTITIONS} for job_id, provider in waiting]
    for start in range(0, len(rows), 1000):
        conn.execute(update, rows[start : start + 1000])


def downgrade() -> None:
    with op.batch_alter_table("verification_jobs", schema=None) as batch_op:
        batch_op.drop_index(
            "ix_verification_jobs_partition_pending", postgresql_where=WHERE, sqlite_where=WHERE
        )
        batch_op.drop_column("verifier_partition")
