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
name a result twice, never a result that was lost. A run killed while it wrote a batch leaves
part of it at the end of the archive (its bodies still stored): the next run on the same file
cuts that off before it appends (``Archive``), so the file reads whole again. The digest
(``body_sha256``), the signature and its covered lines stay in the database, so an archived body
can be checked against them.

Results not yet decided are never pruned (the verifier and the validators read their bodies);
a verdict needs no body once decided, nor does an appeal. What a pruned result no longer gives:
the trainer feed and its export leave it out (as they leave out a reversed verdict), a ReST^EM
dataset leaves out its samples, and the admin's view of a task's submissions gives no body and
checks the evidence as ``evidence_pruned`` (check the archived body instead).
"""

from __future__ import annotations

import base64
import datetime as dt
import fcntl
import gzip
import os
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import orjson
import structlog
from sqlalchemy import Row, func, select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from orchestrator.core.sql import is_postgres
from orchestrator.tasks.models import Submission
from orchestrator.verification.models import Verdict

log = structlog.get_logger(__name__)

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


# Every archive line begins so (``archive_line``: orjson keeps the keys' order).
_LINE_START = b'{"submission_id":'
_GZIP_MAGIC = b"\x1f\x8b\x08"
_CHUNK = 1 << 20


class NotAnArchive(ValueError):
    """An existing file that is not an evidence archive (nor one a killed run left torn)."""


class ArchiveBusy(RuntimeError):
    """Another run is writing to this archive."""


def _starts(data: bytes, start: bytes) -> bool:
    """``data`` begins with ``start``, or is a beginning of it (a write cut short)."""
    return start.startswith(data[: len(start)])


def _whole_plain(f: IO[bytes], size: int) -> int:
    if not _starts(f.read(len(_LINE_START)), _LINE_START):
        raise NotAnArchive("it does not begin with an evidence line")
    end, pos = 0, size
    while pos > 0:  # the last newline, read backwards
        step = min(_CHUNK, pos)
        pos -= step
        f.seek(pos)
        at = f.read(step).rfind(b"\n")
        if at >= 0:
            end = pos + at + 1
            break
    f.seek(end)
    if not _starts(f.read(len(_LINE_START)), _LINE_START):
        raise NotAnArchive(
            f"its last {size - end} bytes, from byte {end}, are not the start of an evidence line"
        )
    return end


def _whole_gzip(f: IO[bytes]) -> int:
    start = offset = 0  # the offset of the member being read; how far the file was read
    member, head, pending = zlib.decompressobj(wbits=31), b"", b""
    while chunk := pending or f.read(_CHUNK):
        if not offset and not _starts(chunk, _GZIP_MAGIC):
            raise NotAnArchive("it is not gzip'd")
        try:
            out = member.decompress(chunk)
        except zlib.error as exc:
            raise NotAnArchive(f"the gzip member at byte {start} is damaged ({exc})") from exc
        head += out[: len(_LINE_START) - len(head)]
        if not _starts(head, _LINE_START):
            raise NotAnArchive(f"the gzip member at byte {start} does not hold evidence lines")
        pending = b""
        if not member.eof:
            offset += len(chunk)
            continue
        if head != _LINE_START:
            raise NotAnArchive(f"the gzip member at byte {start} does not hold evidence lines")
        pending = member.unused_data
        offset += len(chunk) - len(pending)
        start = offset
        member, head = zlib.decompressobj(wbits=31), b""
    return start


def whole_length(path: Path) -> tuple[int, int]:
    """Of an existing archive: the length up to the end of its last whole batch, and its size
    (more if a run was killed while it wrote a batch: a torn gzip member or line at the end).
    ``NotAnArchive`` for a file that does not read as an archive up to there, or whose torn end
    does not begin as a batch does: nothing is cut from it."""
    with path.open("rb") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(0)
        return (_whole_gzip(f) if path.suffix == ".gz" else _whole_plain(f, size)), size


def torn_submission_ids(path: Path, end: int) -> list[int]:
    """The results named by the whole lines in an archive's torn end (from byte ``end``, as
    ``whole_length`` gives it). A torn gzip member of this version is one batch whose
    transaction never committed, but one written before each batch had its own member (a
    single stream for the run) holds every batch of the killed run, emptied ones too: the
    caller checks these before anything is cut. A plain file's torn end is part of one line."""
    ids: list[int] = []
    if path.suffix != ".gz":
        return ids
    member, buffer = zlib.decompressobj(wbits=31), b""
    with path.open("rb") as f:
        f.seek(end)
        while (chunk := f.read(_CHUNK)) and not member.eof:
            try:
                buffer += member.decompress(chunk)
            except zlib.error:  # the torn end's damage: what came before it is all there is
                break
            *whole, buffer = buffer.split(b"\n")
            ids += (orjson.loads(line)["submission_id"] for line in whole)
    return ids


class Archive:
    """The archive file of a run, gzip'd when its name ends in ``.gz``: a new file, or an
    existing archive, which the run appends to. ``write`` returns once the lines are on disk.

    Gzip'd, each write is a whole gzip member (header, data, trailer): a run killed between
    batches leaves a complete file that gunzip and ``gzip.decompress`` read whole. One stream
    for the run, finished only by ``close``, left every batch of a killed run in a file they
    refused as truncated ("unexpected end of file"). A write that fails part way (the disk
    full) is cut off again before the error goes on, so the file still ends after the last
    batch written whole: the batch's transaction rolls back and its bodies stay in the
    database.

    A run killed while it wrote (SIGKILL, a power cut) cannot cut its own write off: the file
    ends in part of a gzip member or of a line, and gunzip refuses the whole file. Its batch
    was not emptied (its transaction never committed), so the next run on the same file cuts
    that torn end off (``cut``: how many bytes; logged as ``evidence_archive_torn_end_cut``),
    back to the last whole gzip member (batch) or line, and archives the batch again after it
    (in a plain file, lines of the torn batch written whole stay: those results are named
    twice, as a run stopped between the write and the commit leaves them). An existing file that is
    not such an archive is refused (``NotAnArchive``) and left as it is; so is one another run
    is writing to (``ArchiveBusy``)."""

    def __init__(self, path: Path, *, checked: tuple[int, int] | None = None) -> None:
        """``checked``: the ``whole_length`` the caller checked the torn end at (its results not
        already emptied: ``torn_submission_ids``); a file found otherwise under the lock changed
        meanwhile and is refused (``ArchiveBusy``), untouched."""
        self.path = path
        self.lines = 0
        self.cut = 0
        self._gzip = path.suffix == ".gz"
        # Unbuffered: what a failed write left is all on disk, where the truncation reaches it.
        try:
            self._raw: IO[bytes] = path.open("xb", buffering=0)
            self.created = True
        except FileExistsError:
            self._raw = path.open("r+b", buffering=0)
            self.created = False
        try:
            try:
                fcntl.flock(self._raw.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError as exc:
                raise ArchiveBusy(f"{path} is being written by another run") from exc
            if self.created:
                _fsync_directory(path.parent)  # the new file's name lasts as its batches do
                self._end = 0
            else:
                self._end, size = whole_length(path)
                if checked is not None and (self._end, size) != checked:
                    raise ArchiveBusy(f"{path} changed since it was checked: another run wrote to it")
                if size > self._end:
                    os.ftruncate(self._raw.fileno(), self._end)
                    os.fsync(self._raw.fileno())
                    self.cut = size - self._end
                    log.warning(
                        "evidence_archive_torn_end_cut",
                        archive=str(path),
                        at_byte=self._end,
                        bytes_cut=self.cut,
                        detail="a run killed while it wrote a batch left it torn; that batch's "
                        "bodies were not emptied, and this run archives them again",
                    )
                self._raw.seek(self._end)
        except BaseException:
            self._raw.close()
            raise

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
        """Finish the file; a new one that received nothing is removed."""
        self._raw.flush()
        os.fsync(self._raw.fileno())
        self._raw.close()
        if not self.lines and self.created:
            self.path.unlink()


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
