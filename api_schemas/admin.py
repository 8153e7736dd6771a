"""Operator and admin API models."""

from __future__ import annotations

import datetime as dt
from typing import Literal

from pydantic import BaseModel, Field

from api_schemas.common import KeyId, StrictModel, Text
from api_schemas.identity import NodeOut


class StatusChangeOut(BaseModel):
    from_status: str | None
    to_status: str
    reason: str
    actor: str
    at: dt.datetime


class NodeDetailOut(NodeOut):
    ip_address: str | None = Field(
        description="The address the node last registered from, as the per-IP rules compare it: "
        "IPv4 as it is, an IPv4-mapped IPv6 address as IPv4, other IPv6 as its /64 network"
    )
    ban_reason: str | None
    status_history: list[StatusChangeOut] = Field(description="Newest first, at most 100")


class BanIn(StrictModel):
    reason: Text = Field(min_length=1, max_length=500, description="Why; kept in the status history")


class TokenIn(StrictModel):
    role: Literal["admin", "operator", "validator", "trainer"]
    name: Text = Field(min_length=1, max_length=100, description="Who or what the token is for")
    pool_ids: list[Text] = Field(
        default_factory=list,
        max_length=100,
        description="Validator and trainer tokens: the pools they may act on (at least one, existing)",
    )
    expires_in_s: int | None = Field(
        default=None, ge=60, le=10 * 365 * 86_400, description="Lifetime; null: until revoked"
    )


class TokenRotateIn(StrictModel):
    expires_in_s: int | None = Field(
        default=None,
        ge=60,
        le=10 * 365 * 86_400,
        description="A new lifetime from now; null: until revoked. Left out: the expiry stays as it "
        "was (an expired token needs one)",
    )


class TokenOut(BaseModel):
    id: str
    name: str
    role: str
    pool_ids: list[str]
    created_at: dt.datetime
    expires_at: dt.datetime | None
    revoked_at: dt.datetime | None


class TokenCreatedOut(TokenOut):
    token: str = Field(description="The bearer token, shown only in this answer (only its hash is kept)")


class RetireIn(StrictModel):
    successor_id: KeyId = Field(
        description="The registered provider (not retired, not this one) that receives the retired "
        "provider's money, now and as it matures"
    )
    reason: Text = Field(min_length=1, max_length=500, description="Why (the key lost, stolen); audited")


class ProviderDetailOut(BaseModel):
    id: str
    display_name: str | None
    registered_ip: str | None
    created_at: dt.datetime
    retired_at: dt.datetime | None = Field(
        description="When an admin retired it (its key lost or stolen); null: not retired"
    )
    successor_id: str | None = Field(description="Who receives its money, now and as it matures")
    retirement_reason: str | None
    retired_by: str | None = Field(description="The admin token that retired it")


class RetirementOut(BaseModel):
    provider: ProviderDetailOut
    revoked_nodes: dict[str, list[str]] = Field(
        description="The provider's nodes this retirement revoked, each with the pools it was ejected from"
    )
    moved: dict[str, int] = Field(
        description="What moved to the successor at once, by the retired provider's account "
        "(stake_free and stake_locked to the successor's stake_free, rewards_claimable to its "
        "rewards_claimable)"
    )
    maturing: dict[str, int] = Field(
        description="What was not free yet and reaches the successor as it matures: rewards_pending "
        "(as each hold is released), stake_unbonding (as each unbonding completes)"
    )
    payouts_requested: list[int] = Field(
        description="The provider's requested payouts, left for an admin to settle or reject (a "
        "rejected payout's amount goes to the successor)"
    )
    blacklists_copied: list[str] = Field(
        description="The pools that blacklist the retired provider and now blacklist the successor too"
    )
