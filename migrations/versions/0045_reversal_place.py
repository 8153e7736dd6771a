"""verdicts: where each reversal comes in the node's write order (reversed_after)

Revision ID: 0045
Revises: 0044
Create Date: 2026-12-05 03:30:00.000000

An appeal of a wrong rejection replays the node's later verdicts and their reversals on what
it pays, in the order the node's money saw them: the decisions by id (every verdict that moves
the node's money is written under locks the appeal takes too, so ids follow that order). A
reversal had no place in that order of its own, so its ``reversed_at`` placed it after every
fraud or invalid verdict of the node's dated no later. A verdict's ``decided_at`` is its batch's
clock when it began, before it waited for the node's lock: a fraud verdict written after an
appeal but dated before it was replayed before that appeal, and took nothing that the appeal
had given back (the node kept a reward the rules forfeit). ``verdicts.reversed_after`` now
records, as the appeal reverses the verdict, the id of the node's latest verdict in the pool,
read under those locks: the reversal comes after it and before every later one.

Existing reversals cannot be placed better than their time placed them (nothing recorded which
verdicts were written before them), so they keep that place, now written down: the latest
fraud or invalid verdict of the node's in the pool dated no later than ``reversed_at``, or the
verdict itself if that is later (the rule the code followed, so the replays of appeals to come
treat them as before). NULL: not reversed.

The downgrade drops the column: revision 0044 places every reversal by its time again, which
moves no money already moved. It refuses while a reversal is placed elsewhere than its time
would place it (an upgrade after it would place that one by time again, wrongly).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from migrations.guards import refuse_downgrade_while

revision: str = "0045"
down_revision: str | None = "0044"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Where 0044 placed each reversal (``service._reversal_slots`` then): after the latest fraud or
# invalid verdict of the node's in the pool dated no later than the reversal, or its own verdict.
PLACE_BY_TIME = """
    SELECT max(o.id) FROM verdicts AS o
    WHERE o.node_id = verdicts.node_id AND o.pool_id = verdicts.pool_id
      AND (o.id = verdicts.id OR (o.category IN ('fraud', 'invalid') AND o.decided_at <= verdicts.reversed_at))
"""
# The reversals placed elsewhere than that.
PLACED_OTHERWISE = f"SELECT count(*) FROM verdicts WHERE reversed_after <> ({PLACE_BY_TIME})"  # noqa: S608 - constants
BACKFILL = f"UPDATE verdicts SET reversed_after = ({PLACE_BY_TIME}) WHERE reversed_at IS NOT NULL"  # noqa: S608 - constants


def upgrade() -> None:
    # Plain ADD COLUMN (on SQLite too): a batch copy would rebuild a table that others refer to.
    op.add_column(
        "verdicts",
        sa.Column("reversed_after", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=True),
    )
    op.execute(BACKFILL)


def downgrade() -> None:
    # A reversal this revision placed elsewhere than its time would (a decision written after it
    # but dated before it) would be placed by its time again after an upgrade: wrongly, for the
    # replays of appeals to come. One placed where its time places it loses nothing.
    refuse_downgrade_while(
        PLACED_OTHERWISE,
        "reversals are placed in their node's write order elsewhere than their time would place "
        "them, which revision 0044 cannot record (the appeals replayed after it would place them by "
        "time, and move the wrong money): not downgrading",
    )
    op.drop_column("verdicts", "reversed_after")
