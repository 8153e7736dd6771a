"""Seeds of replicas never leased are brought below 2^53

Revision ID: 0027
Revises: 0026
Create Date: 2026-12-01 05:10:00.000000

Seeds took 63 bits, and a worker whose JSON parser reads numbers as doubles (JavaScript's
JSON.parse) echoed them rounded: every result it sent was judged fraud (``seed_mismatch``).
New replicas get seeds below 2^53 (``tasks.seeds.SEED_BITS``). A replica never leased has shown
its seed to no one, so its seed is cut to its top 53 bits here, still the HMAC's and still
unpredictable; a replica leased before keeps the seed its leases gave. Downgrading keeps the
new seeds (any seed below 2^63 is valid before this revision).
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0027"
down_revision: str | None = "0026"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.execute(
        "UPDATE task_replicas SET seed = seed / 1024 WHERE seed >= 9007199254740992 AND leases_issued = 0"
    )


def downgrade() -> None:
    pass
