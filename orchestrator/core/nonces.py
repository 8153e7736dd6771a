"""Spent signature nonces kept in the database, for API processes whose hot store is their own.

The in-process hot store (the embedded default, no Redis) remembers spent nonces in memory:
the next process (after a crash, a deploy, a supervisor's restart) would have forgotten them,
and accept again, once, any signed request of the last signature window. So such a process
also claims each nonce here, in a table keyed by the SHA-256 of key id and nonce: a claim that
finds a live row is a replay. The memory store still refuses a replay within the process
without touching the database; Redis, shared and outliving any API process, needs neither
(with its persistence on: docs/PROTOCOL.md). The claim is its own short transaction, after the
memory store spent the nonce and before the request's transaction; when it raises,
``identity.auth`` has the memory store forget the nonce (``unadmit``): the request did nothing,
and a row that was written all the same still refuses it as a replay.

Rows outlive their nonce's TTL only until a later claim prunes them: at most one batch of
``PRUNE_BATCH`` expired rows per ``PRUNE_EVERY_S`` seconds, more than the in-process store
admits (its 500 000 live nonces over a 601 s TTL, some 830 a second).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import time

from sqlalchemy import LargeBinary, delete, select
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.orm import Mapped, mapped_column

from orchestrator.core.db import Base, UTCDateTime
from orchestrator.core.sql import dialect_insert

PRUNE_EVERY_S = 1.0
PRUNE_BATCH = 2000


class SpentNonce(Base):
    __tablename__ = "spent_nonces"

    digest: Mapped[bytes] = mapped_column(LargeBinary(32), primary_key=True)
    expires_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), index=True)


def nonce_digest(keyid: str, nonce: str) -> bytes:
    return hashlib.sha256(f"{keyid}\x00{nonce}".encode()).digest()


class NonceLedger:
    """Claims nonces in ``engine``'s ``spent_nonces``, one short transaction each."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self._insert = dialect_insert(engine.dialect.name)
        self._pruned_at = float("-inf")

    async def claim(self, keyid: str, nonce: str, ttl_s: int, now: dt.datetime) -> bool:
        """Whether the nonce was not yet spent (or only expired); it is spent from now on."""
        stmt = self._insert(SpentNonce).values(
            digest=nonce_digest(keyid, nonce), expires_at=now + dt.timedelta(seconds=ttl_s)
        )
        stmt = stmt.on_conflict_do_update(  # a row whose nonce expired is a new claim
            index_elements=[SpentNonce.digest],
            set_={"expires_at": stmt.excluded.expires_at},
            where=SpentNonce.expires_at <= now,
        )
        async with self._engine.begin() as conn:
            claimed = (await conn.execute(stmt)).rowcount == 1
            if (started := time.monotonic()) - self._pruned_at >= PRUNE_EVERY_S:
                self._pruned_at = started
                expired = select(SpentNonce.digest).where(SpentNonce.expires_at <= now).limit(PRUNE_BATCH)
                await conn.execute(delete(SpentNonce).where(SpentNonce.digest.in_(expired)))
        return claimed
