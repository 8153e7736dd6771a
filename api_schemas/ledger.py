"""Stake and reward balances, deposits."""

from __future__ import annotations

import datetime as dt

from pydantic import BaseModel, Field

from api_schemas.common import StrictModel, Text

AMOUNT_DOC = "Integer amount in the smallest unit (no fractions)"


class Balances(BaseModel):
    provider_id: str
    stake_free: int = Field(description="Stake available to lock")
    stake_locked: int = Field(description="Stake locked by pool memberships")
    stake_unbonding: int = Field(
        description="Stake released by a leave or ejection, waiting out the unbonding period "
        "(a fraud verdict can still slash it)"
    )
    rewards_pending: int = Field(description="Rewards inside the hold window (can still be slashed)")
    rewards_claimable: int = Field(description="Rewards that can be withdrawn")
    withdrawn: int = Field(
        description="Rewards withdrawn into payouts, requested or paid (a rejected payout's amount "
        "went back to rewards_claimable)"
    )


class DepositIn(StrictModel):
    amount: int = Field(gt=0, le=10**15, strict=True, description=AMOUNT_DOC)
    reference: Text | None = Field(
        default=None,
        min_length=1,
        max_length=200,
        description="External payment reference (kept as the memo)",
    )


class TransferOut(BaseModel):
    id: int
    reason: str
    amount: int
    memo: str | None
    created_at: dt.datetime


class DepositOut(BaseModel):
    transfer: TransferOut
    balances: Balances
