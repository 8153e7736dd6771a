"""Withdrawals of claimable rewards, and the payouts admins settle off-chain."""

from __future__ import annotations

import datetime as dt
import enum

from pydantic import BaseModel, Field

from api_schemas.common import StrictModel, Text
from api_schemas.ledger import AMOUNT_DOC, Balances


class PayoutStatus(enum.StrEnum):
    requested = "requested"
    paid = "paid"
    rejected = "rejected"


class ExportFormat(enum.StrEnum):
    csv = "csv"
    jsonl = "jsonl"


class WithdrawalIn(StrictModel):
    amount: int = Field(
        gt=0, le=10**15, strict=True, description=AMOUNT_DOC + "; at most the claimable rewards"
    )


class PayoutOut(BaseModel):
    id: int = Field(description="Payout id; pages run from newest to oldest")
    provider_id: str = Field(description="The provider being paid")
    amount: int = Field(description=AMOUNT_DOC)
    status: PayoutStatus = Field(
        description="requested: withdrawn from the ledger, waiting for settlement; paid: settled; "
        "rejected: not settled, the amount went back to the provider's claimable rewards"
    )
    transfer_id: int = Field(description="The ledger transfer that moved claimable rewards to withdrawn")
    requested_at: dt.datetime = Field(description="When the withdrawal was requested")
    paid_at: dt.datetime | None = Field(description="When an admin marked it paid")
    external_reference: str | None = Field(
        description="The settlement's reference outside this service (e.g. a bank or chain transaction)"
    )
    rejected_at: dt.datetime | None = Field(description="When an admin rejected it")
    rejection_reason: str | None = Field(description="Why an admin rejected it")


class AdminPayoutOut(PayoutOut):
    paid_by: str | None = Field(description="Token id of the admin who marked it paid")
    rejected_by: str | None = Field(description="Token id of the admin who rejected it")
    run_id: int | None = Field(description="The payout run that took it for settlement, if one has")


class WithdrawalOut(BaseModel):
    payout: PayoutOut
    balances: Balances = Field(description="The provider's balances now (after the withdrawal)")


class MarkPaidIn(StrictModel):
    external_reference: str = Field(
        min_length=1,
        max_length=200,
        pattern=r"^[^\x00-\x1f\x7f]+$",
        description="Reference of the off-chain settlement (no control characters). Marking a paid "
        "payout again with the same reference changes nothing; another reference is refused (409).",
    )


class RejectPayoutIn(StrictModel):
    reason: Text = Field(
        min_length=1,
        max_length=500,
        description="Why the payout cannot be settled (kept on the payout, shown to the provider, "
        "audited). Rejecting a rejected payout again changes nothing and keeps the first reason.",
    )


class PayoutRunIn(StrictModel):
    max_payouts: int = Field(
        default=1000,
        ge=1,
        le=10_000,
        strict=True,
        description="Take at most this many requested payouts, oldest first (default 1,000); a run "
        "stops before its total would pass 2^63 - 1, and the rest wait for the next run",
    )


class RunStatusCount(BaseModel):
    payouts: int
    amount: int = Field(description=AMOUNT_DOC)


class PayoutRunOut(BaseModel):
    id: int = Field(description="Run id; export its payouts with GET /v1/admin/payouts/export?run_id=")
    max_payouts: int = Field(description="The most payouts the run was asked to take")
    payouts: int = Field(description="How many requested payouts it took (none that another run holds)")
    amount: int = Field(description="Their total amount")
    created_at: dt.datetime
    created_by: str = Field(description="Token id of the admin who started it")
    by_status: dict[PayoutStatus, RunStatusCount] = Field(
        description="Its payouts by their status now: how far its settlement has got"
    )
