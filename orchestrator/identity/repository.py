"""SQL for providers, nodes and status history."""

from __future__ import annotations

import datetime as dt
import hashlib
from collections.abc import Mapping, Sequence

from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from orchestrator.core.db import utcnow
from orchestrator.core.sql import insert_ignore, is_postgres
from orchestrator.identity.models import Node, NodeStatusChange, Provider

# The first key of a signing key's advisory lock ("KY"; the verifiers' is "VF", VERIFIER_LOCK in
# verification/service.py; the instance lock's one-key form is another key space).
KEY_LOCK = 0x4B59


async def lock_key(session: AsyncSession, key_id: str) -> None:
    """Until the transaction ends, be the only one registering ``key_id`` as a provider or a
    node: a registration checks that the key is not the other kind and then inserts it, into
    the other table, so two at once each saw no other and both committed. The lock is
    transaction-scoped (``pg_advisory_xact_lock`` on KEY_LOCK and 32 bits of a hash of the key):
    the second waits for the first's commit, then reads what it wrote. Take it before any other
    lock, so a registration waiting for it holds nothing another one needs. On SQLite there is
    nothing to take: every transaction holds the one write lock from its start (core/db.py)."""
    if not is_postgres(session):
        return
    digest = hashlib.blake2b(key_id.encode(), digest_size=4).digest()
    await session.execute(
        select(func.pg_advisory_xact_lock(KEY_LOCK, int.from_bytes(digest, "big", signed=True)))
    )


async def get_provider(
    session: AsyncSession, provider_id: str, *, for_update: bool = False, for_share: bool = False
) -> Provider | None:
    """The provider; locked and read afresh if asked: a retirement takes the row ``for_update``
    (``FOR NO KEY UPDATE``: rows that refer to the provider are still written meanwhile), and a
    node's registration ``for_share`` (``FOR SHARE``) so that it waits for a retirement in
    flight and then sees it."""
    if not (for_update or for_share):
        return await session.get(Provider, provider_id)
    stmt = (
        select(Provider)
        .where(Provider.id == provider_id)
        .with_for_update(key_share=for_update, read=not for_update)
        .execution_options(populate_existing=True)
    )
    return (await session.execute(stmt)).scalar_one_or_none()


async def insert_provider(
    session: AsyncSession, provider_id: str, display_name: str | None, ip: str | None
) -> bool:
    return await insert_ignore(
        session,
        Provider,
        {"id": provider_id, "display_name": display_name, "registered_ip": ip, "created_at": utcnow()},
    )


async def get_node(session: AsyncSession, node_id: str, *, for_update: bool = False) -> Node | None:
    """The node; with ``for_update`` locked and read afresh (``populate_existing``: a node read
    earlier in the session, before a ban or revocation committed, would keep its old status)."""
    stmt = select(Node).where(Node.id == node_id)
    if for_update:
        stmt = stmt.with_for_update().execution_options(populate_existing=True)
    return (await session.execute(stmt)).scalar_one_or_none()


async def get_provider_node_for_update(session: AsyncSession, provider_id: str, node_id: str) -> Node | None:
    """``provider_id``'s node ``node_id``, locked and read afresh; None for another provider's
    (whose row is then left unlocked) or an unknown one."""
    stmt = (
        select(Node)
        .where(Node.id == node_id, Node.provider_id == provider_id)
        .with_for_update()
        .execution_options(populate_existing=True)
    )
    return (await session.execute(stmt)).scalar_one_or_none()


async def record_status_change(
    session: AsyncSession, node: Node, *, reason: str, actor: str, at: dt.datetime
) -> None:
    """A history entry for a locked node whose status stays what it is (a banned node revoked)."""
    session.add(
        NodeStatusChange(
            node_id=node.id, from_status=node.status, to_status=node.status, reason=reason, actor=actor, at=at
        )
    )
    await session.flush()


async def insert_node(session: AsyncSession, values: Mapping[str, object]) -> bool:
    now = utcnow()
    return await insert_ignore(
        session, Node, {**values, "status_changed_at": now, "created_at": now, "updated_at": now}
    )


async def transition(
    session: AsyncSession,
    node_ids: Sequence[str],
    *,
    from_statuses: Sequence[str],
    to_status: str,
    reason: str,
    actor: str,
) -> list[str]:
    """Move nodes currently in ``from_statuses`` to ``to_status``, recording history.

    Conditional, so concurrent callers never record one change twice. Returns the ids moved.
    """
    if not node_ids:
        return []
    current = (
        await session.execute(
            select(Node.id, Node.status)
            .where(Node.id.in_(node_ids), Node.status.in_(from_statuses))
            .order_by(Node.id)  # id order, as a pool's completion locks its members' nodes
            .with_for_update()
        )
    ).all()
    if not current:
        return []
    now = utcnow()
    moved = (
        (
            await session.execute(
                update(Node)
                .where(Node.id.in_([row.id for row in current]), Node.status.in_(from_statuses))
                .values(status=to_status, status_changed_at=now, updated_at=now)
                .returning(Node.id)
            )
        )
        .scalars()
        .all()
    )
    moved_set = set(moved)
    session.add_all(
        NodeStatusChange(
            node_id=row.id, from_status=row.status, to_status=to_status, reason=reason, actor=actor, at=now
        )
        for row in current
        if row.id in moved_set
    )
    await session.flush()
    return list(moved)


async def settled_node_ids(
    session: AsyncSession, status: str, *, changed_before: dt.datetime, after: str, limit: int
) -> list[str]:
    """Ids after ``after``, in order, of nodes in ``status`` since before ``changed_before``
    (a range of ``ix_nodes_status_id``)."""
    stmt = (
        select(Node.id)
        .where(Node.status == status, Node.id > after, Node.status_changed_at < changed_before)
        .order_by(Node.id)
        .limit(limit)
    )
    return list((await session.execute(stmt)).scalars())


async def status_history(session: AsyncSession, node_id: str, limit: int = 100) -> list[NodeStatusChange]:
    stmt = (
        select(NodeStatusChange)
        .where(NodeStatusChange.node_id == node_id)
        .order_by(NodeStatusChange.id.desc())
        .limit(limit)
    )
    return list((await session.execute(stmt)).scalars())


async def list_nodes(
    session: AsyncSession, *, status: str | None, provider_id: str | None, after: str | None, limit: int
) -> list[Node]:
    stmt = select(Node).order_by(Node.id).limit(limit)
    if status is not None:
        stmt = stmt.where(Node.status == status)
    if provider_id is not None:
        stmt = stmt.where(Node.provider_id == provider_id)
    if after is not None:
        stmt = stmt.where(Node.id > after)
    return list((await session.execute(stmt)).scalars())


async def count_by_status(session: AsyncSession) -> dict[str, int]:
    rows = (await session.execute(select(Node.status, func.count()).group_by(Node.status))).all()
    return {status: int(count) for status, count in rows}
