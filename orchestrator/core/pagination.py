"""Cursors for keyset pagination, bound to the list that issued them.

A list's page ends with ``next_cursor``, the key of its last row; the next page reads after (or,
newest first, before) that key. A key alone is a position in *any* list ordered the same way, so
a cursor of one list passed to another (another pool's members, the nodes list's cursor to the
tokens list, an audit page filtered by one actor to the page of another) used to be taken as a
position there, and rows were skipped or served twice without an error. Each list therefore
names its scope, a :class:`CursorScope`: the list and every parameter that changes which rows
it holds (the pool, the filters, the caller where the list depends on who asks). The cursor
carries a digest of that scope, and a cursor whose digest is not this scope's is 400
``cursor_invalid``.

The digest is a plain hash, not a keyed one: it only says which list a cursor belongs to and is
no authority. Every request is checked against its own scope (the caller's role, the pool's
access) before its cursor is read, so a client that builds a cursor for a list can only use it
on a list it may read, at a position it could have paged to. A hash rather than the scope in the
clear keeps a cursor short whatever the filters hold (an actor filter alone may be 100
characters; a cursor is at most 200). The cursor stays opaque: clients pass back what they got.

Two lists keep cursors of their own: the trainer feed's (``encode_cursor``'s unscoped format,
which trainers keep for ever; the feed checks that one names an accepted verdict of its pool),
and the task and verdict lists', which are documented row ids in the clear (an integer query
parameter): :func:`require_listed` checks that such an id is a row of the list.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any, TypeVar

from sqlalchemy import ColumnElement, exists, select
from sqlalchemy.ext.asyncio import AsyncSession

from orchestrator.core.errors import BadRequest
from orchestrator.core.keys import b64u_decode, b64u_encode

# The largest id a BIGINT column holds: ids in paths, queries and cursors are bounded by it, so
# a larger number is refused as input (422, 400) instead of failing in the database (500).
ID_MAX = 2**63 - 1

_T = TypeVar("_T")

SCOPED_PREFIX = b"k2:"
UNSCOPED_PREFIX = b"k1:"
TAG_BYTES = 9  # 72 bits: two scopes share a digest by chance with odds of 2^-72
NOT_ISSUED = "the cursor is not one this API issued"
OTHER_LIST = (
    "the cursor is not one this list issued: it comes from another list, or from this list for "
    "another pool, caller or filters"
)


def _key(raw: bytes) -> str | None:
    """A cursor's key: text that is UTF-8 and holds no NUL (which PostgreSQL cannot compare)."""
    try:
        key = raw.decode("utf-8")
    except ValueError:  # UnicodeDecodeError
        return None
    return None if "\x00" in key else key


def _unwrap(cursor: str, prefix: bytes) -> bytes | None:
    try:
        raw = b64u_decode(cursor)
    except ValueError:
        return None
    return raw[len(prefix) :] if raw.startswith(prefix) else None


def _int(key: str) -> int | None:
    if not (key.isascii() and key.isdigit()) or int(key) > ID_MAX:
        return None
    return int(key)


class CursorScope:
    """The list a cursor belongs to: ``name`` says which list, ``params`` everything that changes
    which rows it holds (a pool id, a filter, None where a filter is not set, the caller)."""

    def __init__(self, name: str, **params: str | int | None) -> None:
        canonical = json.dumps([name, params], sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        digest = hashlib.sha256(b"orchestrator keyset cursor\x00" + canonical.encode("utf-8"))
        self.tag = digest.digest()[:TAG_BYTES]

    def encode(self, last_key: str | int) -> str:
        """The cursor to resume this list after (or before) the row with key ``last_key``."""
        return b64u_encode(SCOPED_PREFIX + self.tag + str(last_key).encode("utf-8"))

    def decode(self, cursor: str | None) -> str | None:
        """The key a cursor of this list wraps (None without one); 400 ``cursor_invalid`` for
        anything :meth:`encode` does not make, and for another scope's cursor."""
        if cursor is None:
            return None
        tag, key = _scoped(cursor)
        self._check(tag)
        return key

    def decode_int(self, cursor: str | None) -> int | None:
        """The id a cursor of a list ordered by id wraps."""
        if cursor is None:
            return None
        tag, key = _scoped(cursor)
        self._check(tag)
        if (number := _int(key)) is None:
            raise BadRequest(NOT_ISSUED, code="cursor_invalid")
        return number

    def _check(self, tag: bytes) -> None:
        if tag != self.tag:
            raise BadRequest(OTHER_LIST, code="cursor_invalid")


def _scoped(cursor: str) -> tuple[bytes, str]:
    """A scoped cursor's tag and key; 400 ``cursor_invalid`` for anything else."""
    body = _unwrap(cursor, SCOPED_PREFIX)
    key = _key(body[TAG_BYTES:]) if body is not None and len(body) > TAG_BYTES else None
    if body is None or key is None:
        raise BadRequest(NOT_ISSUED, code="cursor_invalid")
    return body[:TAG_BYTES], key


def encode_cursor(last_key: str) -> str:
    """The unscoped format, for the trainer feed alone (see the module doc); a list without a
    check of its own uses a :class:`CursorScope`."""
    return b64u_encode(UNSCOPED_PREFIX + last_key.encode("utf-8"))


def decode_cursor(cursor: str | None) -> str | None:
    """The key an ``encode_cursor`` cursor wraps; 400 ``cursor_invalid`` for anything it does not
    make, including bytes that are not UTF-8 and a NUL."""
    if cursor is None:
        return None
    body = _unwrap(cursor, UNSCOPED_PREFIX)
    key = _key(body) if body is not None else None
    if key is None:
        raise BadRequest(NOT_ISSUED, code="cursor_invalid")
    return key


async def require_listed(
    session: AsyncSession, key: int | None, id_column: Any, *scope: ColumnElement[bool], what: str
) -> None:
    """For a list whose cursor is a row id in the clear: 400 ``cursor_invalid`` unless ``key`` is
    the id of a row that ``scope`` (the list's conditions that never change for a row: its
    pool, node, provider) holds. Rows are never deleted, so an issued cursor stays valid; one
    of another list, or an id that names nothing, is not taken as a position."""
    if key is None:
        return
    if not await session.scalar(select(exists().where(id_column == key, *scope))):
        raise BadRequest(f"the cursor is not one this list issued: it names no {what}", code="cursor_invalid")


def within_bytes(sized: Iterable[tuple[_T, int | None]], max_bytes: int) -> list[_T]:
    """The leading items of ``sized`` (each with its size in bytes, read without its contents)
    whose sizes add up to at most ``max_bytes``, and the first whatever its size: a page of
    results' signed bodies, which their nodes make up to the body limit each, is read so."""
    taken: list[_T] = []
    total = 0
    for item, size in sized:
        total += int(size or 0)
        if taken and total > max_bytes:
            break
        taken.append(item)
    return taken
