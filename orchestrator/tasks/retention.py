"""Pruning old evidence: the signed bodies of results decided long ago, archived, then emptied.

Every result keeps the exact request it came in (``tasks.evidence``), bodies of up to
``ORCH_LIMITS__MAX_RESULT_BODY_BYTES`` each, so a long run's database grows without bound.
``orchestrator admin prune-evidence`` takes the results whose verdict was decided more than N days
ago, in batches in submission id order, and for each batch:

1. writes each result's whole evidence (the body in base64, the method, URL, signature and the
   header lines it covers, when it was received, and its verdict) as one JSON line to the archive,
   flushed and fsync'd;
2. only then, in one transaction, empties the stored bodies and records ``evidence_pruned_at``
   (a result pruned meanwhile, by a run at the same time, is left as it is).

So nothing is emptied that is not in an archive first. A run stopped between the two steps leaves
lines in its archive for results still stored, which a later run archives again: an archive may
name a result twice, never a result that was lost. The digest (``body_sha256``), the signature
and its covered lines stay in the database, so an archived body can be checked against them.

Results not yet decided are never pruned (the verifier and the validators read their bodies);
a verdict needs no body once decided, nor does an appeal. What a pruned result no longer gives:
the trainer feed and its export leave it out (as they leave out a reversed verdict), a ReST^EM
dataset leaves out its samples, and the admin's view of a task's submissions gives no body and
checks the evidence as ``evidence_pruned`` (check the archived body instead).
"""

from __future__ import annotations

import base64
import datetime as dt
import gzip
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import orjson
from sqlalchemy import Row, func, select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from orchestrator.core.sql import is_postgres
from orchestrator.tasks.models import Submission
from orchestrator.verification.models import Verdict

BATCH = 50
MIN_AGE_DAYS = 1


@dataclass(frozen=True)
class PruneReport:
    submissions: int
    body_bytes: int


def _eligible(cutoff: dt.datetime, pool_id: str | None) -> list[Any]:
    where = [Submission.evidence_pruned_at.is_(None), Verdict.decided_at < cutoff]
    if pool_id is not None:
        where.append(Submission.pool_id == pool_id)
    return where


async def measure(session: AsyncSession, *, cutoff: dt.datetime, pool_id: str | None) -> PruneReport:
    """What a run would prune now: the count and the bytes of the bodies (a dry run)."""
    count, size = (
        await session.execute(
            select(func.count(), func.coalesce(func.sum(func.length(Submission.body)), 0))
            .select_from(Submission)
            .join(Verdict, Verdict.submission_id == Submission.id)
            .where(*_eligible(cutoff, pool_id))
        )
    ).one()
    return PruneReport(int(count), int(size))


async def _batch(
    session: AsyncSession, *, cutoff: dt.datetime, pool_id: str | None, after_id: int, limit: int
) -> Sequence[Any]:
    stmt = (
        select(
            Submission,
            Verdict.id.label("verdict_id"),
            Verdict.outcome,
            Verdict.category,
            Verdict.reason,
            Verdict.decided_at,
        )
        .join(Verdict, Verdict.submission_id == Submission.id)
        .where(*_eligible(cutoff, pool_id), Submission.id > after_id)
        .order_by(Submission.id)
        .limit(limit)
    )
    if is_postgres(session):
        # Another run at the same time takes other rows; it prunes these itself or a later run does.
        stmt = stmt.with_for_update(of=Submission, skip_locked=True)
    return (await session.execute(stmt)).all()


def archive_line(row: Row[Any]) -> bytes:
    sub: Submission = row.Submission
    return (
        orjson.dumps(
            {
                "submission_id": sub.id,
                "assignment_id": sub.assignment_id,
                "pool_id": sub.pool_id,
                "task_id": sub.task_id,
                "node_id": sub.node_id,
                "provider_id": sub.provider_id,
                "policy_step": sub.policy_step,
                "received_at": sub.received_at.isoformat(),
                "method": sub.method,
                "target_uri": sub.target_uri,
                "signature_input": sub.signature_input,
                "signature": sub.signature,
                "signature_window_s": sub.signature_window_s,
                "content_digest": sub.content_digest,
                "signed_fields": sub.signed_fields,
                "body_sha256": sub.body_sha256,
                "body_base64": base64.b64encode(sub.body).decode(),
                "verdict": {
                    "id": row.verdict_id,
                    "outcome": row.outcome,
                    "category": row.category,
                    "reason": row.reason,
                    "decided_at": row.decided_at.isoformat(),
                },
            }
        )
        + b"\n"
    )


class Archive:
    """An archive file made for one run (never an existing file: ``FileExistsError``), gzip'd
    when its name ends in ``.gz``. ``write`` returns once the lines are on disk.

    Gzip'd, each write is a whole gzip member (header, data, trailer): a run killed between
    batches leaves a complete file that gunzip and ``gzip.decompress`` read whole. One stream
    for the run, finished only by ``close``, left every batch of a killed run in a file they
    refused as truncated ("unexpected end of file"). A write that fails part way (the disk
    full) is cut off again before the error goes on, so the file still ends after the last
    batch written whole: the batch's transaction rolls back and its bodies stay in the
    database."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lines = 0
        # Unbuffered: what a failed write left is all on disk, where the truncation reaches it.
        self._raw: IO[bytes] = path.open("xb", buffering=0)
        self._gzip = path.suffix == ".gz"
        self._end = 0

    def write(self, lines: list[bytes]) -> None:
        data = memoryview(gzip.compress(b"".join(lines)) if self._gzip else b"".join(lines))
        try:
            while data:
                data = data[self._raw.write(data) :]
            os.fsync(self._raw.fileno())
        except BaseException:
            os.ftruncate(self._raw.fileno(), self._end)
            self._raw.seek(self._end)
            raise
        self._end = self._raw.tell()
        self.lines += len(lines)

    def close(self) -> None:
        """Finish the file; one that received nothing is removed."""
        self._raw.flush()
        os.fsync(self._raw.fileno())
        self._raw.close()
        if not self.lines:
            self.path.unlink()


async def prune(
    sessionmaker: async_sessionmaker[AsyncSession],
    archive: Archive,
    *,
    cutoff: dt.datetime,
    now: dt.datetime,
    pool_id: str | None = None,
    batch: int = BATCH,
    on_batch: Callable[[int, int], None] | None = None,
) -> PruneReport:
    """Archive, then empty, the bodies of the results decided before ``cutoff`` (of ``pool_id``
    only, if given), ``batch`` per transaction (module doc); ``on_batch(n, body_bytes)`` after
    each batch commits, with how many it pruned and their bodies' size (what a run that fails
    later has pruned)."""
    pruned = size = 0
    after = 0
    while True:
        async with sessionmaker() as session, session.begin():
            rows = await _batch(session, cutoff=cutoff, pool_id=pool_id, after_id=after, limit=batch)
            if not rows:
                return PruneReport(pruned, size)
            archive.write([archive_line(r) for r in rows])  # on disk before the bodies go
            ids = [r.Submission.id for r in rows]
            await session.execute(
                update(Submission)
                .where(Submission.id.in_(ids), Submission.evidence_pruned_at.is_(None))
                .values(body=b"", evidence_pruned_at=now)
                .execution_options(synchronize_session=False)
            )
            batch_size = sum(len(r.Submission.body) for r in rows)
            pruned += len(rows)
            size += batch_size
            after = ids[-1]
        if on_batch is not None:
            on_batch(len(rows), batch_size)
