"""What downgrades share: refusing data the older schema cannot hold."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op


def refuse_downgrade_while(count_sql: str, what: str) -> None:
    """Stop the downgrade (``RuntimeError``: the run is one transaction, rolled back whole) while
    ``count_sql`` counts rows; the message is that count, then ``what``: which rows, why the
    older revision cannot hold them, and ": not downgrading"."""
    count = op.get_bind().execute(sa.text(count_sql)).scalar_one()
    if count:
        raise RuntimeError(f"{count} {what}")
