"""The trainer feed: accepted, unreversed verdicts of a pool in verdict id order.

One item is one accepted result (a task replica's group of samples, kept together because
GRPO-style trainers normalise rewards within a group), with the server's reward per sample.
Rejected, still unverified and reversed verdicts never appear, nor accepted ones that a fraud
verdict against their node withdrew (decided within their hold window: ``Verdict``); a verdict
reversed or withdrawn after it was served is simply absent when the same range is read again,
and a withdrawn one is back if the fraud verdict is reversed on appeal. For a trainer that
already took such a rollout, the change notices (``changes``, ``RolloutChange``) say so.

**Order without holes.** The cursor is the last verdict id served, so a verdict that commits
*after* a reader passed its id would be skipped for ever. On SQLite every transaction takes
the write lock up front, so ids commit in order. On PostgreSQL two verdict transactions (the
verifier's tick and a validator's post) can commit out of id order, so a read first takes
``LOCK TABLE verdicts IN SHARE MODE``: it waits for every transaction that has written a
verdict to finish, reads the newest verdict id, and gives the lock back at once (it is taken in
a savepoint, rolled back). Every verdict up to that id has committed and any later one gets a
larger id, so what the read serves (ids up to the bound) is a prefix of the final id order.
The wait is bounded (``lock_timeout``); past it the read answers 503 ``feed_busy`` with
``Retry-After``. The export fixes its upper bound the same way, then reads below it in short
transactions, and the change notices are read behind their own table's lock.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator, Sequence
from typing import Any, NamedTuple

import anyio
import orjson
from sqlalchemy import Row, exists, func, select, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from api_schemas.feed import (
    FeedTask,
    Rollout,
    RolloutChangeOut,
    RolloutChangePage,
    RolloutPage,
    RolloutSample,
    VerifiedBy,
)
from api_schemas.tasks import Sampling
from orchestrator.core.errors import BadRequest, ServiceUnavailable
from orchestrator.core.pagination import ID_MAX, decode_cursor, encode_cursor, within_bytes
from orchestrator.core.sql import is_postgres
from orchestrator.tasks.models import Submission, Task
from orchestrator.verification.models import RolloutChange, Verdict, withdrawn_by

CURSOR_PREFIX = "rollouts:"
CHANGES_PREFIX = "changes:"
EXPORT_CHUNK = 200
LOCK_TIMEOUT_MS = 5000
RETRY_AFTER_S = 2
LOCK_NOT_AVAILABLE = "55P03"


# ------------------------------------------------------------------ cursors


def encode(verdict_id: int, prefix: str = CURSOR_PREFIX) -> str:
    return encode_cursor(f"{prefix}{verdict_id}")


def decode(cursor: str | None, prefix: str = CURSOR_PREFIX) -> int:
    """The id a cursor stands for (0: the beginning of the feed): a verdict id, or with
    ``CHANGES_PREFIX`` a change notice's."""
    raw = decode_cursor(cursor)
    if raw is None:
        return 0
    number = raw.removeprefix(prefix)
    if not raw.startswith(prefix) or not (number.isascii() and number.isdigit()) or int(number) > ID_MAX:
        raise BadRequest("the cursor is not one this feed issued", code="cursor_invalid")
    return int(number)


async def resume_point(session: AsyncSession, pool_id: str, cursor: str | None) -> int:
    """The verdict id to read after: 0 without a cursor, else the one the cursor names, which
    must be an accepted verdict of this pool (reversed since or not): the only ids the feed
    issues. Another pool's cursor would otherwise be read as a position in this feed (skipping
    its rollouts below it), and a made-up one past the newest verdict would answer empty pages.
    Verdicts are never deleted and their pool and outcome never change, so an issued cursor
    stays valid."""
    after_id = decode(cursor)
    if cursor is None:
        return after_id
    issued = await session.scalar(
        select(
            exists().where(Verdict.id == after_id, Verdict.pool_id == pool_id, Verdict.outcome == "accepted")
        )
    )
    if not issued:
        raise BadRequest("the cursor is not one this pool's feed issued", code="cursor_invalid")
    return after_id


# ------------------------------------------------------------------ JSON


def load_body(raw: bytes) -> dict[str, Any]:
    """A stored signed body. orjson reads almost all of them; what it refuses, the result route
    accepted all the same (Python's parser read the request: an integer past 64 bits, say), so
    the standard parser reads those rather than the feed failing on them for ever."""
    try:
        parsed: dict[str, Any] = orjson.loads(raw)
    except orjson.JSONDecodeError:
        parsed = json.loads(raw)
    return parsed


def dumps_line(obj: Any) -> bytes:
    """One JSON Lines line. orjson refuses integers past 64 bits, which a task's metadata (or an
    old signed body) may hold and the paged feed serves: the standard encoder writes those."""
    try:
        return orjson.dumps(obj) + b"\n"
    except TypeError:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode() + b"\n"


# ------------------------------------------------------------------ rewards


def sample_rewards(details: dict[str, Any] | None, server_reward: float | None, n: int) -> list[float | None]:
    """Per-sample rewards from the verdict's details; the verdict's mean where they are missing
    (a quorum decision keeps only the mean)."""
    per_sample = (details or {}).get("per_sample_rewards")
    if isinstance(per_sample, list) and len(per_sample) == n:
        return [
            float(r) if isinstance(r, int | float) and math.isfinite(r) else server_reward for r in per_sample
        ]
    return [server_reward] * n


# ------------------------------------------------------------------ reads


async def settled_bound(session: AsyncSession, table: type[Verdict | RolloutChange] = Verdict) -> int | None:
    """On PostgreSQL, the newest verdict id once no transaction is still writing verdicts (see
    the module doc): every verdict at or below it has committed, and any later one gets a larger
    id. The lock is taken in a savepoint and given back with it, as soon as the bound is known,
    so verdicts are not held up while the page is built. None on SQLite (ids commit in order).
    With ``RolloutChange``: the same for change notices."""
    if not is_postgres(session):
        return None
    savepoint = await session.begin_nested()
    try:
        await session.execute(text(f"SET LOCAL lock_timeout = {LOCK_TIMEOUT_MS}"))
        await session.execute(text(f"LOCK TABLE {table.__tablename__} IN SHARE MODE"))
        upto = await session.scalar(select(func.max(table.id)))
    except DBAPIError as exc:
        code = getattr(exc.orig, "sqlstate", None) or getattr(exc.orig, "pgcode", None)
        if code != LOCK_NOT_AVAILABLE:
            raise
        raise ServiceUnavailable(
            "verification is writing verdicts; retry shortly",
            code="feed_busy",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        ) from exc
    finally:
        await savepoint.rollback()  # releases the lock (and the lock_timeout) taken in it
    return int(upto or 0)


def _accepted(pool_id: str) -> Any:
    return (
        Verdict.pool_id == pool_id,
        Verdict.outcome == "accepted",
        Verdict.reversed_at.is_(None),
    )


# What ``rollout`` builds a rollout from.
_ROLLOUT_COLUMNS = (
    Verdict.id,
    Verdict.submission_id,
    Verdict.node_id,
    Verdict.server_reward,
    Verdict.verifier,
    Verdict.details,
    Verdict.decided_at,
    Submission.policy_step,
    Submission.body,
    Task.id.label("task_id"),
    Task.prompt,
    Task.problem_ref,
    Task.sampling,
    Task.metadata_,
    Task.is_canary,
)


class _Batch(NamedTuple):
    rows: Sequence[Row[Any]]
    more: bool  # rollouts are left after this batch (past its limit or its byte budget)
    last_id: int  # the last verdict id the batch took (a row of it may have dropped out since)


async def _rows(
    session: AsyncSession, pool_id: str, *, after_id: int, upto_id: int | None, limit: int, max_bytes: int
) -> _Batch:
    """Up to ``limit`` rollouts after ``after_id``, in order, while their signed bodies add up to
    at most ``max_bytes`` (the first whatever its size): a body is up to
    ``limits.max_result_body_bytes``, the node's choice, and is read and parsed whole. Their
    sizes are read first, without the bodies."""
    where = [
        *_accepted(pool_id),
        Verdict.id > after_id,
        # A result whose evidence was pruned (tasks.retention) has no samples to serve.
        Submission.evidence_pruned_at.is_(None),
        # Nor one a fraud verdict against its node withdrew (Verdict), while that verdict stands.
        withdrawn_by().is_(None),
    ]
    if upto_id is not None:
        where.append(Verdict.id <= upto_id)
    sizes = (
        await session.execute(
            select(Verdict.id, func.length(Submission.body))
            .join(Submission, Submission.id == Verdict.submission_id)
            .where(*where)
            .order_by(Verdict.id)
            .limit(limit + 1)
        )
    ).all()
    ids: list[int] = within_bytes(sizes[:limit], max_bytes)
    if not ids:
        return _Batch([], False, after_id)
    rows = (
        await session.execute(
            select(*_ROLLOUT_COLUMNS)
            .join(Submission, Submission.id == Verdict.submission_id)
            .join(Task, Task.id == Verdict.task_id)
            # The same conditions again: a result pruned or a verdict reversed meanwhile (another
            # transaction, committed between the two statements) is left out, as if before.
            .where(Verdict.id.in_(ids), *where)
            .order_by(Verdict.id)
        )
    ).all()
    return _Batch(rows, len(ids) < len(sizes), ids[-1])


def verified_by(verifier: str, server_reward: float | None) -> VerifiedBy | None:
    """Who checked an accepted result (``verification.service._verified``): a quorum or a
    validator judged it, or the server scored it (verifier ``reward`` with a reward); an
    accepted result the server could not score and nobody audited was checked by nobody."""
    if verifier == "quorum":
        return "quorum"
    if verifier == "validator":
        return "validator"
    return "server" if server_reward is not None else None


def rollout(row: Row[Any]) -> Rollout:
    body = load_body(row.body)
    samples = body.get("samples") or []
    rewards = sample_rewards(row.details, row.server_reward, len(samples))
    return Rollout(
        cursor=encode(row.id),
        verdict_id=row.id,
        submission_id=row.submission_id,
        node_id=row.node_id,
        policy_step=row.policy_step,
        seed=body.get("seed"),
        reward=row.server_reward,
        verified_by=verified_by(row.verifier, row.server_reward),
        accepted_at=row.decided_at,
        task=FeedTask(
            task_id=row.task_id,
            prompt=row.prompt,
            problem_ref=row.problem_ref,
            sampling=Sampling(**row.sampling),
            metadata=row.metadata_,
            canary=row.is_canary,
        ),
        samples=[
            RolloutSample(
                index=i,
                completion=s.get("completion"),
                token_ids=s.get("token_ids"),
                finish_reason=s.get("finish_reason", ""),
                prompt_tokens=s.get("prompt_tokens", 0),
                completion_tokens=s.get("completion_tokens", 0),
                logprob_summary=s.get("logprob_summary"),
                reward=reward,
            )
            for i, (s, reward) in enumerate(zip(samples, rewards, strict=True))
        ],
    )


def _rollouts(rows: Sequence[Row[Any]]) -> list[Rollout]:
    return [rollout(r) for r in rows]


async def page(
    session: AsyncSession, pool_id: str, *, after: str | None, limit: int, max_bytes: int
) -> RolloutPage:
    """A page of up to ``limit`` rollouts, fewer (with ``has_more``) once their signed bodies
    add up to ``max_bytes``."""
    after_id = await resume_point(session, pool_id, after)
    upto_id = await settled_bound(session)
    batch = await _rows(
        session, pool_id, after_id=after_id, upto_id=upto_id, limit=limit, max_bytes=max_bytes
    )
    more = batch.more
    # Parsing signed bodies is CPU work: off the event loop.
    items = await anyio.to_thread.run_sync(_rollouts, batch.rows)
    if items:
        next_cursor: str | None = items[-1].cursor
    else:
        next_cursor = after if after is not None else None
    return RolloutPage(items=items, next_cursor=next_cursor, has_more=more)


async def export_bound(session: AsyncSession, pool_id: str) -> int:
    """The newest accepted verdict id now; the export stops there, so it always ends."""
    settled = await settled_bound(session)
    stmt = select(func.max(Verdict.id)).where(*_accepted(pool_id))
    if settled is not None:
        stmt = stmt.where(Verdict.id <= settled)
    upto = await session.scalar(stmt)
    return int(upto or 0)


def _lines(rows: Sequence[Row[Any]]) -> bytes:
    return b"".join(dumps_line(rollout(r).model_dump(mode="json")) for r in rows)


async def export_lines(
    sessionmaker: async_sessionmaker[AsyncSession],
    pool_id: str,
    *,
    after_id: int,
    upto_id: int,
    max_bytes: int,
    chunk_size: int | None = None,
) -> AsyncIterator[bytes]:
    """The feed as JSON Lines, a chunk at a time, each chunk read in its own short transaction
    (no connection or lock is held while the client reads; SQLite transactions are write locks),
    of up to ``chunk_size`` rollouts whose signed bodies add up to at most ``max_bytes``."""
    chunk_size = chunk_size or EXPORT_CHUNK
    while after_id < upto_id:
        async with sessionmaker() as session, session.begin():
            batch = await _rows(
                session, pool_id, after_id=after_id, upto_id=upto_id, limit=chunk_size, max_bytes=max_bytes
            )
        if batch.rows:
            yield await anyio.to_thread.run_sync(_lines, batch.rows)
        if not batch.more:
            return
        after_id = batch.last_id


# ------------------------------------------------------------------ change notices


async def _change_resume_point(session: AsyncSession, pool_id: str, cursor: str | None) -> int:
    """As ``resume_point``, for the change notices: a cursor names a notice of this pool."""
    after_id = decode(cursor, CHANGES_PREFIX)
    if cursor is None:
        return after_id
    issued = await session.scalar(
        select(exists().where(RolloutChange.id == after_id, RolloutChange.pool_id == pool_id))
    )
    if not issued:
        raise BadRequest("the cursor is not one this pool's change feed issued", code="cursor_invalid")
    return after_id


def _change(row: Row[Any]) -> RolloutChangeOut:
    stands = row.reversed_at is None and row.withdrawn is None
    return RolloutChangeOut(
        cursor=encode(row.change_id, CHANGES_PREFIX),
        change_id=row.change_id,
        change=row.change,
        cause_verdict_id=row.cause_verdict_id,
        changed_at=row.changed_at,
        verdict_id=row.id,
        submission_id=row.submission_id,
        task_id=row.task_id,
        node_id=row.node_id,
        stands=stands,
        rollout=rollout(row) if stands and row.evidence_pruned_at is None else None,
    )


def _changes(rows: Sequence[Row[Any]]) -> list[RolloutChangeOut]:
    return [_change(r) for r in rows]


async def changes(
    session: AsyncSession, pool_id: str, *, after: str | None, limit: int, max_bytes: int
) -> RolloutChangePage:
    """Change notices of a pool's rollouts in the order they committed (``RolloutChange``),
    after a cursor, each with whether its rollout stands as this page is read (and then the
    rollout, unless its evidence was pruned). Ordered without holes as the feed is: the
    notices' own table is locked for the bound. Fewer than ``limit`` (with ``has_more``) once
    their rollouts' signed bodies add up to ``max_bytes`` (the first whatever its size), as a
    feed page."""
    after_id = await _change_resume_point(session, pool_id, after)
    upto_id = await settled_bound(session, RolloutChange)
    where = [RolloutChange.pool_id == pool_id, RolloutChange.id > after_id]
    if upto_id is not None:
        where.append(RolloutChange.id <= upto_id)
    sizes = (
        await session.execute(
            select(RolloutChange.id, func.length(Submission.body))
            .join(Verdict, Verdict.id == RolloutChange.verdict_id)
            .join(Submission, Submission.id == Verdict.submission_id)
            .where(*where)
            .order_by(RolloutChange.id)
            .limit(limit + 1)
        )
    ).all()
    ids: list[int] = within_bytes(sizes, max_bytes)
    more = len(ids) < len(sizes) or len(ids) > limit
    ids = ids[:limit]
    stmt = (
        select(
            RolloutChange.id.label("change_id"),
            RolloutChange.change,
            RolloutChange.cause_verdict_id,
            RolloutChange.created_at.label("changed_at"),
            *_ROLLOUT_COLUMNS,
            Verdict.reversed_at,
            withdrawn_by().label("withdrawn"),
            Submission.evidence_pruned_at,
        )
        .join(Verdict, Verdict.id == RolloutChange.verdict_id)
        .join(Submission, Submission.id == Verdict.submission_id)
        .join(Task, Task.id == Verdict.task_id)
        .where(RolloutChange.id.in_(ids))
        .order_by(RolloutChange.id)
    )
    rows = (await session.execute(stmt)).all() if ids else []
    items = await anyio.to_thread.run_sync(_changes, rows)
    next_cursor = items[-1].cursor if items else after
    return RolloutChangePage(items=items, next_cursor=next_cursor, has_more=more)
