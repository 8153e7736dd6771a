"""serving_marks: when the API processes could last take heartbeats, for the sweeper

Revision ID: 0030
Revises: 0029
Create Date: 2026-12-01 23:55:00.000000

An outage longer than the dead threshold (the database or Redis down, every API process down)
marked every node dead at the first sweep after it: the nodes' last beats only grew older while
no beat could be taken. API processes now mark every few seconds that they can take beats, and
the sweeper counts a node's silence only from the start of the current run of marks.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0030"
down_revision: str | None = "0029"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "serving_marks",
        sa.Column("name", sa.String(length=32), nullable=False),
        sa.Column("at", sa.Double(), nullable=False),
        sa.Column("since", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_serving_marks")),
    )


def downgrade() -> None:
    op.drop_table("serving_marks")
