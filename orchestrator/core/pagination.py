"""Opaque cursors for keyset pagination."""

from __future__ import annotations

from orchestrator.core.errors import BadRequest
from orchestrator.core.keys import b64u_decode, b64u_encode

# The largest id a BIGINT column holds: ids in paths, queries and cursors are bounded by it, so
# a larger number is refused as input (422, 400) instead of failing in the database (500).
ID_MAX = 2**63 - 1


def encode_cursor(last_key: str) -> str:
    return b64u_encode(b"k1:" + last_key.encode("utf-8"))


def decode_cursor(cursor: str | None) -> str | None:
    """The key a cursor wraps; 400 ``cursor_invalid`` for anything ``encode_cursor`` does not
    make, including bytes that are not UTF-8 and a NUL (which PostgreSQL cannot compare)."""
    if cursor is None:
        return None
    try:
        raw = b64u_decode(cursor)
        key = raw[3:].decode("utf-8") if raw.startswith(b"k1:") else None
    except ValueError:  # UnicodeDecodeError included
        key = None
    if key is None or "\x00" in key:
        raise BadRequest("the cursor is not one this API issued", code="cursor_invalid")
    return key


def decode_int_cursor(cursor: str | None) -> int | None:
    """An opaque cursor that wraps an integer key (ids)."""
    raw = decode_cursor(cursor)
    if raw is None:
        return None
    if not (raw.isascii() and raw.isdigit()) or int(raw) > ID_MAX:
        raise BadRequest("the cursor is not one this API issued", code="cursor_invalid")
    return int(raw)
