"""API tokens may expire

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-01 13:00:00.000000

A token lived until revoked, and nothing but an edit of the database revoked one. Tokens now
carry an optional ``expires_at`` (``orchestrator admin create-token --expires-in-days``, or
``expires_in_s`` through ``POST /v1/admin/tokens``); an expired token is refused (401
``token_expired``). Earlier tokens keep NULL: they do not expire.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from migrations.guards import refuse_downgrade_while
from orchestrator.core.db import UTCDateTime

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("api_tokens", sa.Column("expires_at", UTCDateTime(timezone=True), nullable=True))


def downgrade() -> None:
    refuse_downgrade_while(
        "SELECT count(*) FROM api_tokens WHERE expires_at IS NOT NULL AND revoked_at IS NULL",
        "tokens have an expiry and are not revoked, which revision 0016 cannot hold (an "
        "expired one would be accepted again, and none would ever expire): revoke them first; "
        "not downgrading",
    )
    op.drop_column("api_tokens", "expires_at")
