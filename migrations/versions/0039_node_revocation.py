"""nodes: a provider revokes a node's key (revoked_at)

Revision ID: 0039
Revises: 0038
Create Date: 2026-12-04 09:00:00.000000

A provider whose machine was stolen or compromised could not stop its node key: only an admin's
ban did, and until one came the thief could claim tasks and submit fraud that slashed the
provider's stake. ``POST /v1/providers/me/nodes/{node_id}/revoke`` now bans the node for good
(ejected from its pools, as a ban ejects it) and records when in ``nodes.revoked_at``: an admin
cannot unban a revoked node, and its key cannot register again. NULL: not revoked. The check
``revoked_is_banned`` keeps a revoked node banned.

The downgrade refuses while a node is revoked: revision 0038 would see a plain ban, which an
unban lifts, handing the key back to whoever holds it.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from migrations.guards import refuse_downgrade_while
from orchestrator.core.db import UTCDateTime

revision: str = "0039"
down_revision: str | None = "0038"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

CHECK = "revoked_at IS NULL OR status = 'banned'"


def upgrade() -> None:
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.add_column(sa.Column("revoked_at", UTCDateTime(timezone=True), nullable=True))
        batch_op.create_check_constraint("revoked_is_banned", CHECK)


def downgrade() -> None:
    refuse_downgrade_while(
        "SELECT count(*) FROM nodes WHERE revoked_at IS NOT NULL",
        "nodes were revoked by their providers, which revision 0038 cannot record (it would see "
        "plain bans, which an unban lifts, handing the keys back to whoever holds them): not "
        "downgrading",
    )
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.drop_constraint("revoked_is_banned", type_="check")
        batch_op.drop_column("revoked_at")
