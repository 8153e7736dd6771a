"""Tables for payouts: one row per withdrawal, settled off-chain and then marked paid, or rejected;
and payout runs, the sets of requested payouts an admin takes to settle together.

The money moved when the payout was requested (``rewards_claimable -> withdrawn``, the ledger
transfer named by ``transfer_id``); this row tracks the settlement of that money outside. A
rejected payout's money went back (``withdrawn -> rewards_claimable``, the transfer that
reverses ``transfer_id``).
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy import BigInteger, CheckConstraint, ForeignKey, Index, Integer, String, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from orchestrator.core.db import Base, UTCDateTime, utcnow

ID = BigInteger().with_variant(Integer, "sqlite")
KEY_ID = String(43)
TOKEN_ID = String(32)

STATUS_KNOWN = "status IN ('requested', 'paid', 'rejected')"
_UNPAID = "paid_at IS NULL AND paid_by IS NULL AND external_reference IS NULL"
_UNREJECTED = "rejected_at IS NULL AND rejected_by IS NULL AND rejection_reason IS NULL"
FIELDS_MATCH_STATUS = (
    f"(status = 'requested' AND {_UNPAID} AND {_UNREJECTED})"
    " OR (status = 'paid' AND paid_at IS NOT NULL AND paid_by IS NOT NULL"
    f" AND external_reference IS NOT NULL AND {_UNREJECTED})"
    " OR (status = 'rejected' AND rejected_at IS NOT NULL AND rejected_by IS NOT NULL"
    f" AND rejection_reason IS NOT NULL AND {_UNPAID})"
)


class Payout(Base):
    __tablename__ = "payouts"
    __table_args__ = (
        UniqueConstraint("provider_id", "idempotency_key"),
        CheckConstraint("amount > 0", name="amount_positive"),
        CheckConstraint(STATUS_KNOWN, name="status_known"),
        CheckConstraint(FIELDS_MATCH_STATUS, name="fields_match_status"),
        Index("ix_payouts_provider_id_id", "provider_id", "id"),
        Index("ix_payouts_status_id", "status", "id"),
        Index("ix_payouts_run_id_id", "run_id", "id"),
    )

    id: Mapped[int] = mapped_column(ID, primary_key=True, autoincrement=True)
    provider_id: Mapped[str] = mapped_column(KEY_ID, ForeignKey("providers.id", ondelete="RESTRICT"))
    amount: Mapped[int] = mapped_column(BigInteger)
    status: Mapped[str] = mapped_column(String(16), default="requested")
    idempotency_key: Mapped[str] = mapped_column(
        String(200), doc="The ledger transfer's idempotency key (withdrawal:<provider>:<client key>)"
    )
    transfer_id: Mapped[int] = mapped_column(
        ID, ForeignKey("ledger_transfers.id", ondelete="RESTRICT"), unique=True
    )
    external_reference: Mapped[str | None] = mapped_column(String(200))
    requested_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    paid_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime())
    paid_by: Mapped[str | None] = mapped_column(TOKEN_ID, doc="Token id of whoever marked it paid")
    rejected_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime())
    rejected_by: Mapped[str | None] = mapped_column(TOKEN_ID, doc="Token id of whoever rejected it")
    rejection_reason: Mapped[str | None] = mapped_column(String(500))
    run_id: Mapped[int | None] = mapped_column(
        ID,
        ForeignKey("payout_runs.id", ondelete="RESTRICT"),
        doc="The payout run that took it for settlement; a payout is in one run at most",
    )


class PayoutRun(Base):
    """Requested payouts taken together to be settled: a run takes only payouts no run holds, so
    two exports for settlement never list one payout twice."""

    __tablename__ = "payout_runs"
    __table_args__ = (
        CheckConstraint("max_payouts > 0", name="max_payouts_positive"),
        CheckConstraint("payouts > 0 AND amount > 0", name="not_empty"),
    )

    id: Mapped[int] = mapped_column(ID, primary_key=True, autoincrement=True)
    idempotency_key: Mapped[str] = mapped_column(String(100), unique=True)
    max_payouts: Mapped[int] = mapped_column(Integer, doc="The most payouts the run was asked to take")
    payouts: Mapped[int] = mapped_column(Integer, doc="How many payouts it took")
    amount: Mapped[int] = mapped_column(BigInteger, doc="Their total amount")
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    created_by: Mapped[str] = mapped_column(TOKEN_ID, doc="Token id of the admin who started it")
