"""spent_nonces: signature nonces spent with an in-process hot store, kept across restarts

Revision ID: 0038
Revises: 0037
Create Date: 2026-12-04 01:30:00.000000

An API process without Redis remembered spent nonces in memory only: the next process (a
crash, a deploy, a restart) accepted again, once, any signed request of the last signature
window. Such a process now also claims each nonce in this table (``core.nonces``), keyed by
the SHA-256 of key id and nonce, until its TTL. The downgrade drops the table: the nonces of
the last window are forgotten, as before this revision.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from orchestrator.core.db import UTCDateTime

revision: str = "0038"
down_revision: str | None = "0037"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "spent_nonces",
        sa.Column("digest", sa.LargeBinary(length=32), nullable=False),
        sa.Column("expires_at", UTCDateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("digest", name=op.f("pk_spent_nonces")),
    )
    with op.batch_alter_table("spent_nonces", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_spent_nonces_expires_at"), ["expires_at"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("spent_nonces", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_spent_nonces_expires_at"))
    op.drop_table("spent_nonces")
