"""The payout export for settlement: CSV or JSON Lines, streamed chunk by chunk from the database.

Each chunk is read in its own short transaction, so a slow download holds no connection and no
lock while the client reads (on SQLite every transaction takes the write lock). The export is
bounded by the newest payout id when it started, so new withdrawals cannot make it run on; a
payout marked paid or rejected while the export runs appears with whichever status its chunk saw.
The rejection columns and then the run come last, so a reader of the earlier columns by position
reads them as before.
"""

from __future__ import annotations

import csv
import datetime as dt
import io
from collections.abc import AsyncIterator
from typing import Any

import orjson
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from api_schemas.payouts import ExportFormat
from orchestrator.payouts import repository as repo
from orchestrator.payouts.models import Payout

COLUMNS = (
    "payout_id",
    "provider_id",
    "amount",
    "status",
    "requested_at",
    "paid_at",
    "external_reference",
    "rejected_at",
    "rejection_reason",
    "run_id",
)
CHUNK_SIZE = 500


MEDIA_TYPES = {ExportFormat.csv: "text/csv; charset=utf-8", ExportFormat.jsonl: "application/x-ndjson"}


def _timestamp(value: dt.datetime | None) -> str | None:
    if value is None:
        return None
    return value.astimezone(dt.UTC).isoformat().replace("+00:00", "Z")


def export_record(p: Payout) -> dict[str, Any]:
    return {
        "payout_id": p.id,
        "provider_id": p.provider_id,
        "amount": p.amount,
        "status": p.status,
        "requested_at": _timestamp(p.requested_at),
        "paid_at": _timestamp(p.paid_at),
        "external_reference": p.external_reference,
        "rejected_at": _timestamp(p.rejected_at),
        "rejection_reason": p.rejection_reason,
        "run_id": p.run_id,
    }


async def payout_chunks(
    sessionmaker: async_sessionmaker[AsyncSession],
    *,
    status: str | None,
    upto_id: int,
    chunk_size: int | None = None,
    run_id: int | None = None,
) -> AsyncIterator[list[Payout]]:
    """Payouts with ``id <= upto_id`` (and ``status`` and ``run_id``, if given) in id order, a
    chunk at a time."""
    limit = chunk_size or CHUNK_SIZE
    after_id = 0
    while True:
        async with sessionmaker() as session, session.begin():
            chunk = await repo.oldest_first_chunk(
                session, status=status, after_id=after_id, upto_id=upto_id, limit=limit, run_id=run_id
            )
        if chunk:
            yield chunk
        if len(chunk) < limit:
            return
        after_id = chunk[-1].id


async def render(fmt: ExportFormat, chunks: AsyncIterator[list[Payout]]) -> AsyncIterator[str]:
    """The export's text, one piece per chunk (CSV: a header row first; nulls are empty cells)."""
    if fmt is ExportFormat.csv:
        header = io.StringIO()
        csv.writer(header).writerow(COLUMNS)
        yield header.getvalue()
    async for chunk in chunks:
        if fmt is ExportFormat.csv:
            buffer = io.StringIO()
            writer = csv.writer(buffer)
            for p in chunk:
                record = export_record(p)
                writer.writerow(["" if record[c] is None else record[c] for c in COLUMNS])
            yield buffer.getvalue()
        else:
            yield b"".join(orjson.dumps(export_record(p)) + b"\n" for p in chunk).decode("utf-8")
