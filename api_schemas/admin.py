"""Operator and admin API models."""

from __future__ import annotations

import datetime as dt
from typing import Literal

from pydantic import BaseModel, Field

from api_schemas.common import StrictModel, Text
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
