"""Pools: policy.max_lease_s, how long a lease may last from its claim however heartbeats extend it

Revision ID: 0029
Revises: 0028
Create Date: 2026-12-01 08:10:00.000000

A node could keep a lease for ever by listing it in its heartbeats and never answering: the
replica was never reissued. Existing pools get a day, or their lease duration if that is longer.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0029"
down_revision: str | None = "0028"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("pools", sa.Column("max_lease_s", sa.Integer(), server_default="86400", nullable=False))
    op.execute("UPDATE pools SET max_lease_s = lease_duration_s WHERE lease_duration_s > max_lease_s")


def downgrade() -> None:
    with op.batch_alter_table("pools", schema=None) as batch_op:
        batch_op.drop_column("max_lease_s")
