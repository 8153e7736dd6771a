"""providers: an admin retires a provider whose key is lost or stolen, naming a successor

Revision ID: 0043
Revises: 0042
Create Date: 2026-12-04 19:30:00.000000

A provider's id is its Ed25519 public key, so the key cannot be rotated in place: a provider
that lost its key stranded its stake and rewards for good, and a thief holding the key could
withdraw its claimable rewards and register nodes. ``POST /v1/admin/providers/{id}/retire``
now retires it (``identity.retirement``): ``retired_at`` when, ``successor_id`` the provider
that receives its money (now and as it matures), ``retirement_reason`` why and
``retirement_key`` the admin's ``Idempotency-Key`` (a retry with it is answered as the first
call was), ``retired_by`` the admin's token. All five are set, or none (``retirement_complete``); a provider cannot succeed
itself (``successor_not_self``). NULL: not retired.

The downgrade refuses while a provider is retired: revision 0042 would see a plain provider,
whose key (lost, or in a thief's hands) would be accepted again, and whose matured rewards
and stake would no longer go to its successor.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from migrations.guards import refuse_downgrade_while
from orchestrator.core.db import UTCDateTime

revision: str = "0043"
down_revision: str | None = "0042"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COMPLETE = (
    "(retired_at IS NULL AND successor_id IS NULL AND retirement_reason IS NULL"
    " AND retirement_key IS NULL AND retired_by IS NULL)"
    " OR (retired_at IS NOT NULL AND successor_id IS NOT NULL AND retirement_reason IS NOT NULL"
    " AND retirement_key IS NOT NULL AND retired_by IS NOT NULL)"
)
NOT_SELF = "successor_id IS NULL OR successor_id <> id"


def upgrade() -> None:
    with op.batch_alter_table("providers", schema=None) as batch_op:
        batch_op.add_column(sa.Column("retired_at", UTCDateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column("successor_id", sa.String(length=43), nullable=True))
        batch_op.add_column(sa.Column("retirement_reason", sa.String(length=500), nullable=True))
        batch_op.add_column(sa.Column("retirement_key", sa.String(length=100), nullable=True))
        batch_op.add_column(sa.Column("retired_by", sa.String(length=32), nullable=True))
        batch_op.create_foreign_key(
            batch_op.f("fk_providers_successor_id_providers"),
            "providers",
            ["successor_id"],
            ["id"],
            ondelete="RESTRICT",
        )
        batch_op.create_check_constraint("retirement_complete", COMPLETE)
        batch_op.create_check_constraint("successor_not_self", NOT_SELF)


def downgrade() -> None:
    refuse_downgrade_while(
        "SELECT count(*) FROM providers WHERE retired_at IS NOT NULL",
        "providers are retired, which revision 0042 cannot record (it would accept their keys "
        "again, lost or stolen, and the rewards and stake they still have maturing would no "
        "longer go to their successors): not downgrading",
    )
    with op.batch_alter_table("providers", schema=None) as batch_op:
        batch_op.drop_constraint("successor_not_self", type_="check")
        batch_op.drop_constraint("retirement_complete", type_="check")
        batch_op.drop_constraint(batch_op.f("fk_providers_successor_id_providers"), type_="foreignkey")
        batch_op.drop_column("retired_by")
        batch_op.drop_column("retirement_key")
        batch_op.drop_column("retirement_reason")
        batch_op.drop_column("successor_id")
        batch_op.drop_column("retired_at")
