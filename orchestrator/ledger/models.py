"""Ledger tables: accounts with maintained balances, append-only transfers, unbondings.

Amounts are integers in the smallest unit (no floats anywhere near money).
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import Mapped, mapped_column

from orchestrator.core.db import Base, UTCDateTime, utcnow

ID = BigInteger().with_variant(Integer, "sqlite")


class LedgerAccount(Base):
    __tablename__ = "ledger_accounts"
    __table_args__ = (
        UniqueConstraint("owner_type", "owner_id", "kind"),
        CheckConstraint("allow_negative OR balance >= 0", name="no_negative_balance"),
        CheckConstraint("owner_type IN ('provider', 'pool', 'system')", name="owner_type_known"),
    )

    id: Mapped[int] = mapped_column(ID, primary_key=True, autoincrement=True)
    owner_type: Mapped[str] = mapped_column(String(16))
    owner_id: Mapped[str] = mapped_column(String(64))
    kind: Mapped[str] = mapped_column(String(32))
    balance: Mapped[int] = mapped_column(BigInteger, default=0)
    allow_negative: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)


class LedgerTransfer(Base):
    """One movement of ``amount`` from ``debit`` to ``credit``. Never updated or deleted;
    corrections are new transfers that name the one they reverse."""

    __tablename__ = "ledger_transfers"
    __table_args__ = (
        CheckConstraint("amount > 0", name="amount_positive"),
        CheckConstraint("debit_account_id <> credit_account_id", name="distinct_accounts"),
        Index("ix_ledger_transfers_debit_account_id_id", "debit_account_id", "id"),
        Index("ix_ledger_transfers_credit_account_id_id", "credit_account_id", "id"),
        Index("ix_ledger_transfers_reference", "reference_type", "reference_id"),
    )

    id: Mapped[int] = mapped_column(ID, primary_key=True, autoincrement=True)
    idempotency_key: Mapped[str] = mapped_column(String(200), unique=True)
    debit_account_id: Mapped[int] = mapped_column(ID, ForeignKey("ledger_accounts.id", ondelete="RESTRICT"))
    credit_account_id: Mapped[int] = mapped_column(ID, ForeignKey("ledger_accounts.id", ondelete="RESTRICT"))
    amount: Mapped[int] = mapped_column(BigInteger)
    reason: Mapped[str] = mapped_column(String(64))
    memo: Mapped[str | None] = mapped_column(Text)
    reference_type: Mapped[str | None] = mapped_column(String(32))
    reference_id: Mapped[str | None] = mapped_column(String(100))
    reverses_transfer_id: Mapped[int | None] = mapped_column(
        ID, ForeignKey("ledger_transfers.id", ondelete="RESTRICT"), unique=True
    )
    actor: Mapped[str] = mapped_column(String(100))
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)


class StakeUnbonding(Base):
    """Stake on its way from ``stake_unbonding`` back to ``stake_free`` at ``release_at``."""

    __tablename__ = "stake_unbondings"
    __table_args__ = (
        CheckConstraint("amount > 0", name="amount_positive"),
        Index("ix_stake_unbondings_released_release_at", "released", "release_at"),
    )

    id: Mapped[int] = mapped_column(ID, primary_key=True, autoincrement=True)
    provider_id: Mapped[str] = mapped_column(String(43), ForeignKey("providers.id", ondelete="RESTRICT"))
    amount: Mapped[int] = mapped_column(BigInteger)
    release_at: Mapped[dt.datetime] = mapped_column(UTCDateTime())
    released: Mapped[bool] = mapped_column(Boolean, default=False)
    start_transfer_id: Mapped[int] = mapped_column(
        ID, ForeignKey("ledger_transfers.id", ondelete="RESTRICT"), unique=True
    )
    release_transfer_id: Mapped[int | None] = mapped_column(
        ID, ForeignKey("ledger_transfers.id", ondelete="RESTRICT"), unique=True
    )
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
