"""Digests of request bodies for idempotency keys: of what a body says, not how it is spelled."""

from __future__ import annotations

import datetime as dt
import enum
import hashlib
import json
from typing import Any

from pydantic import BaseModel

__all__ = ["body_digests"]


def _plain(value: Any) -> Any:
    if isinstance(value, dt.datetime):
        return value.astimezone(dt.UTC).isoformat()
    if isinstance(value, enum.Enum):
        return value.value
    raise TypeError(f"no canonical form for {type(value).__name__}")


def body_digests(body: BaseModel) -> tuple[str, str]:
    """The SHA-256 of ``body``'s content (keys sorted, times in UTC), which a new record keeps,
    and of its JSON as validated (the digest kept before: a retry of a request stored then
    matches it). A retry whose JSON keys come in another order, or whose times carry another
    UTC offset, says the same and matches the first."""
    canonical = json.dumps(
        body.model_dump(), sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=_plain
    )
    return (
        hashlib.sha256(canonical.encode()).hexdigest(),
        hashlib.sha256(body.model_dump_json().encode()).hexdigest(),
    )
