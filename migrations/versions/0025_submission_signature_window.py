"""A result keeps the signature window it was checked against (submissions.signature_window_s)

Revision ID: 0025
Revises: 0024
Create Date: 2026-12-01 03:00:00.000000

A result's evidence is re-checked at its ``received_at``, and that check read today's
``ORCH_SIGNATURE__WINDOW_S``: once an operator lowered it, every result signed earlier than
the new window before its receipt (valid then) read as ``signature_stale``. Results now keep
the window they were checked against; NULL, for every existing one, keeps today's setting.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0025"
down_revision: str | None = "0024"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("submissions", sa.Column("signature_window_s", sa.Integer(), nullable=True))


def downgrade() -> None:
    op.drop_column("submissions", "signature_window_s")
