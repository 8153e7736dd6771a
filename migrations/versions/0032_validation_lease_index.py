"""validation_jobs: index the leased jobs by deadline (ix_validation_jobs_leased_expiry)

Revision ID: 0032
Revises: 0031
Create Date: 2026-12-02 00:30:00.000000

The verifier's housekeeping, every second, reopens the validation leases that ran out: it read
every row of validation_jobs to find the leased ones, a scan that grew with the history of
decided jobs. A partial index on the leased jobs' deadline makes it read only those.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0032"
down_revision: str | None = "0031"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

LEASED = sa.text("status = 'leased'")


def upgrade() -> None:
    op.create_index(
        "ix_validation_jobs_leased_expiry",
        "validation_jobs",
        ["lease_expires_at"],
        unique=False,
        postgresql_where=LEASED,
        sqlite_where=LEASED,
    )


def downgrade() -> None:
    op.drop_index(
        "ix_validation_jobs_leased_expiry",
        table_name="validation_jobs",
        postgresql_where=LEASED,
        sqlite_where=LEASED,
    )
