"""Tasks record why they ended failed or cancelled in a machine-readable column

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-30 13:50:00.000000

``tasks.end_reason`` is one of ``cancelled`` (an operator's cancel), ``max_attempts`` (a replica
expired as often as the pool allows), ``deadline_passed`` (the task's deadline) and
``iteration_expired`` (its ReST^EM iteration ended). Before, only the text of ``failure_reason``
said so, and ReST^EM recognised a task failed at its deadline by that text's prefix. Tasks that
already ended are given theirs from the text each path wrote.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

CHECK = "end_reason IN ('cancelled', 'max_attempts', 'deadline_passed', 'iteration_expired')"

# (end_reason, status, pattern of the failure_reason that the code before this revision wrote)
BACKFILL = (
    ("deadline_passed", "failed", "deadline passed at %"),
    ("max_attempts", "failed", "replica % expired % times (max attempts)"),
    ("iteration_expired", "cancelled", "ReST^EM iteration % expired"),
    ("cancelled", "cancelled", "cancelled by %"),
)


def upgrade() -> None:
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.add_column(sa.Column("end_reason", sa.String(length=32), nullable=True))
        batch_op.create_check_constraint("end_reason_known", CHECK)
    update = sa.text(
        "UPDATE tasks SET end_reason = :reason "
        "WHERE end_reason IS NULL AND status = :status AND failure_reason LIKE :pattern"
    )
    conn = op.get_bind()
    for reason, status, pattern in BACKFILL:
        conn.execute(update, {"reason": reason, "status": status, "pattern": pattern})


def downgrade() -> None:
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.drop_constraint("end_reason_known", type_="check")
        batch_op.drop_column("end_reason")
