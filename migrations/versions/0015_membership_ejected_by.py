"""Memberships record who ejected them: ban, operator or verifier

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-01 10:00:00.000000

An unban lifted the ejections whose reason started with ``node banned: `` and an ejection of an
ejected membership changed nothing. So an operator's free-text reason starting that way was
lifted by an unban, and an operator ejecting a node its ban had ejected recorded nothing: the
unban then let the node rejoin. ``pool_memberships.ejected_by`` (``ban``, ``operator``,
``verifier``) records who ejected a membership; an unban lifts only ``ban``.

Backfill, from what the earlier code did: an ejected membership whose reason starts with
``node banned: `` was ejected by a ban (as the earlier unban judged); one whose reason is the
verifier's ``<n> fraud strikes`` by the verifier; any other by an operator.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

CHECK = "ejected_by IN ('ban', 'operator', 'verifier')"

BACKFILL = """
UPDATE pool_memberships SET ejected_by = CASE
    WHEN substr(reason, 1, 13) = 'node banned: ' THEN 'ban'
    WHEN reason LIKE '% fraud strikes' THEN 'verifier'
    ELSE 'operator'
END
WHERE status = 'ejected'
"""


def upgrade() -> None:
    with op.batch_alter_table("pool_memberships", schema=None) as batch_op:
        batch_op.add_column(sa.Column("ejected_by", sa.String(length=16), nullable=True))
        batch_op.create_check_constraint("ejected_by_known", CHECK)
    op.get_bind().execute(sa.text(BACKFILL))


def downgrade() -> None:
    with op.batch_alter_table("pool_memberships", schema=None) as batch_op:
        batch_op.drop_constraint("ejected_by_known", type_="check")
        batch_op.drop_column("ejected_by")
