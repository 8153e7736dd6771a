"""Completing a pool cancels its open tasks (end_reason pool_completed)

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-02 10:00:00.000000

A completed pool's open tasks stayed open for ever: no node could lease them again (claims
answer ``pool_not_active``), yet they counted in ``orchestrator_tasks_claimable``, a result of a
replicated task waited for its sibling for ever, and a ReST^EM iteration on them stayed
``running``. Completion now cancels them with ``end_reason`` ``pool_completed``, which
``tasks.end_reason_known`` now allows.

The downgrade sets such tasks' ``end_reason`` to ``cancelled`` (``failure_reason`` still says
why in words), which 0020 allows.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0021"
down_revision: str | None = "0020"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Written out rather than imported from the models, so this revision stays as it is.
END_REASON_KNOWN = (
    "end_reason IN ('cancelled', 'max_attempts', 'deadline_passed', 'iteration_expired', 'max_failures', "
    "'pool_completed')"
)
OLD_END_REASON_KNOWN = (
    "end_reason IN ('cancelled', 'max_attempts', 'deadline_passed', 'iteration_expired', 'max_failures')"
)


def upgrade() -> None:
    # Batch mode: SQLite alters a CHECK constraint only by rebuilding the table.
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.drop_constraint("end_reason_known", type_="check")
        batch_op.create_check_constraint("end_reason_known", END_REASON_KNOWN)


def downgrade() -> None:
    op.execute("UPDATE tasks SET end_reason = 'cancelled' WHERE end_reason = 'pool_completed'")
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.drop_constraint("end_reason_known", type_="check")
        batch_op.create_check_constraint("end_reason_known", OLD_END_REASON_KNOWN)
