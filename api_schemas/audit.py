"""The audit log of operator and admin actions."""

from __future__ import annotations

import datetime as dt
from typing import Any

from pydantic import BaseModel, Field


class AuditEntryOut(BaseModel):
    id: int = Field(description="Increasing entry id; pages run from newest to oldest")
    actor: str = Field(
        description="Token id of whoever acted (or 'system', the verifier; or 'cli', the "
        "orchestrator admin commands; or a provider's id, for a provider acting with its own key: "
        "a revocation of one of its nodes)"
    )
    actor_role: str = Field(
        description="The actor's role at the time: admin, operator, ...; provider for a provider"
    )
    action: str = Field(description="What was done, e.g. pool.create, membership.eject, node.ban")
    target_type: str = Field(description="Kind of thing acted on: pool, node, provider, invite")
    target_id: str = Field(description="Id of the thing acted on")
    pool_id: str | None = Field(description="The pool the action concerns, if any")
    before: dict[str, Any] | None = Field(description="The changed state before the action")
    after: dict[str, Any] | None = Field(description="The changed state after the action")
    request_id: str | None = Field(description="X-Request-ID of the request that did it")
    at: dt.datetime = Field(description="When")
