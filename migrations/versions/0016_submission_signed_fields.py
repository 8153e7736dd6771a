"""Submissions keep every header field their signature covers

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-01 12:00:00.000000

PROTOCOL.md lets a signature cover more header fields than ``content-digest`` (``content-type``,
say); the evidence kept only ``Content-Digest``, so such a result's signature could not be
verified again from what was stored. ``submissions.signed_fields`` holds each covered header
line, ``[name, value]``, as received. Earlier rows keep NULL: their check reads
``content_digest`` as before (a row whose signature covered other fields cannot be repaired).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("submissions", sa.Column("signed_fields", sa.JSON(), nullable=True))


def downgrade() -> None:
    # A plain DROP COLUMN, on SQLite too (3.35+): a batch copy of ``submissions`` would drop the
    # table that verification jobs and verdicts reference.
    op.drop_column("submissions", "signed_fields")
