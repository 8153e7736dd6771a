"""SQL for pools, memberships, invites and blacklists."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence

from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from orchestrator.core.sql import insert_ignore
from orchestrator.identity.models import Node
from orchestrator.pools.models import BUDGET_SPENT, Pool, PoolInvite, PoolMembership, PoolProviderBlacklist
from orchestrator.verification.models import NodeTrust

LIVE = ("active", "pending")  # memberships that count against caps and hold stake

# ------------------------------------------------------------------ pools


async def get_pool(session: AsyncSession, pool_id: str, *, for_update: bool = False) -> Pool | None:
    stmt = select(Pool).where(Pool.id == pool_id)
    if for_update:
        # Serialises membership changes per pool, so caps hold under concurrent joins. NO KEY
        # UPDATE: foreign-key checks on the pool (a claim inserting a lease, an enqueue) are
        # not blocked, so a membership change may wait for a claim of one of its nodes (see
        # tasks.service.release_member_leases) without deadlocking with it.
        stmt = stmt.with_for_update(key_share=True)
        # Read again if the session holds it already: the lock waited for changes it must see.
        stmt = stmt.execution_options(populate_existing=True)
    return (await session.execute(stmt)).scalar_one_or_none()


async def list_pools(
    session: AsyncSession,
    *,
    owner_token_id: str | None,
    status: str | None,
    after: str | None,
    limit: int,
) -> list[Pool]:
    stmt = select(Pool).order_by(Pool.id).limit(limit)
    if owner_token_id is not None:
        stmt = stmt.where(Pool.owner_token_id == owner_token_id)
    if status is not None:
        stmt = stmt.where(Pool.status == status)
    if after is not None:
        stmt = stmt.where(Pool.id > after)
    return list((await session.execute(stmt)).scalars())


async def member_counts(session: AsyncSession, pool_ids: Sequence[str]) -> dict[str, dict[str, int]]:
    """Live (active, pending) member counts per pool."""
    if not pool_ids:
        return {}
    rows = (
        await session.execute(
            select(PoolMembership.pool_id, PoolMembership.status, func.count())
            .where(PoolMembership.pool_id.in_(pool_ids), PoolMembership.status.in_(LIVE))
            .group_by(PoolMembership.pool_id, PoolMembership.status)
        )
    ).all()
    counts: dict[str, dict[str, int]] = {pid: dict.fromkeys(LIVE, 0) for pid in pool_ids}
    for pool_id, status, count in rows:
        counts[pool_id][status] = int(count)
    return counts


async def rewards_credited(session: AsyncSession, pool_ids: Sequence[str]) -> dict[str, int]:
    """What each pool's verdicts that stand credited, summed over its nodes' track records (as
    many rows as nodes ever judged there, not one per verdict)."""
    if not pool_ids:
        return {}
    rows = (
        await session.execute(
            select(NodeTrust.pool_id, func.sum(NodeTrust.rewards_credited))
            .where(NodeTrust.pool_id.in_(pool_ids))
            .group_by(NodeTrust.pool_id)
        )
    ).all()
    credited = dict.fromkeys(pool_ids, 0)
    for pool_id, total in rows:
        credited[pool_id] = int(total or 0)
    return credited


async def active_pools_over_budget(session: AsyncSession) -> list[str]:
    """The active pools with a reward budget that their verdicts have credited, by id: one
    statement over the active pools with a budget and their nodes' track records."""
    spent = (
        select(func.coalesce(func.sum(NodeTrust.rewards_credited), 0))
        .where(NodeTrust.pool_id == Pool.id)
        .scalar_subquery()
    )
    stmt = (
        select(Pool.id)
        .where(Pool.status == "active", Pool.reward_budget.is_not(None), spent >= Pool.reward_budget)
        .order_by(Pool.id)
    )
    return list((await session.execute(stmt)).scalars())


async def count_paused_for_budget(session: AsyncSession) -> int:
    """Pools the system paused because they spent their reward budget (a metric's gauge)."""
    stmt = select(func.count()).where(Pool.status == "paused", Pool.status_reason == BUDGET_SPENT)
    return int(await session.scalar(stmt) or 0)


# ------------------------------------------------------------------ memberships


async def get_membership(
    session: AsyncSession, pool_id: str, node_id: str, *, for_update: bool = False
) -> PoolMembership | None:
    stmt = select(PoolMembership).where(PoolMembership.pool_id == pool_id, PoolMembership.node_id == node_id)
    if for_update:
        stmt = stmt.with_for_update()
    return (await session.execute(stmt)).scalar_one_or_none()


async def list_members(
    session: AsyncSession, pool_id: str, *, status: str | None, after: int | None, limit: int
) -> list[PoolMembership]:
    stmt = select(PoolMembership).where(PoolMembership.pool_id == pool_id).order_by(PoolMembership.id)
    if status is not None:
        stmt = stmt.where(PoolMembership.status == status)
    if after is not None:
        stmt = stmt.where(PoolMembership.id > after)
    return list((await session.execute(stmt.limit(limit))).scalars())


async def track_records(session: AsyncSession, pool_id: str, node_ids: Sequence[str]) -> dict[str, NodeTrust]:
    """The nodes' track records in the pool, by node (a node never judged there has none)."""
    if not node_ids:
        return {}
    stmt = select(NodeTrust).where(NodeTrust.pool_id == pool_id, NodeTrust.node_id.in_(set(node_ids)))
    return {t.node_id: t for t in (await session.execute(stmt)).scalars()}


async def live_members(
    session: AsyncSession, pool_id: str, *, provider_id: str | None = None
) -> list[PoolMembership]:
    """Active and pending memberships of a pool (optionally one provider's), locked for update.

    Ordered by provider: a bulk change then takes the providers' ledger account locks in the
    same order in every transaction, so two of them cannot deadlock on each other."""
    stmt = (
        select(PoolMembership)
        .where(PoolMembership.pool_id == pool_id, PoolMembership.status.in_(LIVE))
        .order_by(PoolMembership.provider_id, PoolMembership.id)
        .with_for_update()
    )
    if provider_id is not None:
        stmt = stmt.where(PoolMembership.provider_id == provider_id)
    return list((await session.execute(stmt)).scalars())


async def live_pool_ids_of_node(session: AsyncSession, node_id: str) -> list[str]:
    """The pools ``node_id`` is a live member of, by id (read without a lock)."""
    rows = await session.execute(
        select(PoolMembership.pool_id)
        .where(PoolMembership.node_id == node_id, PoolMembership.status.in_(LIVE))
        .order_by(PoolMembership.pool_id)
    )
    return list(rows.scalars())


async def ejections_for_update(
    session: AsyncSession, node_id: str, *, ejected_by: str
) -> list[PoolMembership]:
    """``node_id``'s memberships ejected by ``ejected_by`` (ban, operator, verifier), locked."""
    stmt = (
        select(PoolMembership)
        .where(
            PoolMembership.node_id == node_id,
            PoolMembership.status == "ejected",
            PoolMembership.ejected_by == ejected_by,
        )
        .order_by(PoolMembership.id)
        .with_for_update()
    )
    return list((await session.execute(stmt)).scalars())


async def memberships_for_update(
    session: AsyncSession, node_id: str, pool_ids: Sequence[str]
) -> dict[str, PoolMembership]:
    """``node_id``'s memberships of ``pool_ids``, locked (by id) and re-read, by pool."""
    if not pool_ids:
        return {}
    stmt = (
        select(PoolMembership)
        .where(PoolMembership.node_id == node_id, PoolMembership.pool_id.in_(pool_ids))
        .order_by(PoolMembership.id)
        .with_for_update()
        .execution_options(populate_existing=True)
    )
    return {m.pool_id: m for m in (await session.execute(stmt)).scalars()}


async def memberships_of_node(session: AsyncSession, node_id: str) -> list[tuple[str, str]]:
    rows = await session.execute(
        select(PoolMembership.pool_id, PoolMembership.status)
        .where(PoolMembership.node_id == node_id)
        .order_by(PoolMembership.pool_id)
    )
    return [(pool_id, status) for pool_id, status in rows.all()]


async def memberships_of_nodes(
    session: AsyncSession, node_ids: Sequence[str]
) -> dict[str, list[tuple[str, str]]]:
    """``memberships_of_node`` of each of ``node_ids`` (a page of a node list), in one query;
    a node with none is absent."""
    out: dict[str, list[tuple[str, str]]] = {}
    if not node_ids:
        return out
    rows = await session.execute(
        select(PoolMembership.node_id, PoolMembership.pool_id, PoolMembership.status)
        .where(PoolMembership.node_id.in_(node_ids))
        .order_by(PoolMembership.node_id, PoolMembership.pool_id)
    )
    for node_id, pool_id, status in rows.all():
        out.setdefault(node_id, []).append((pool_id, status))
    return out


async def count_live(
    session: AsyncSession, pool_id: str, *, provider_id: str | None = None, ip_address: str | None = None
) -> int:
    """Active + pending memberships of the pool, optionally only one provider's or one IP's
    (the nodes' registered ``ip_address``)."""
    stmt = (
        select(func.count())
        .select_from(PoolMembership)
        .where(PoolMembership.pool_id == pool_id, PoolMembership.status.in_(LIVE))
    )
    if provider_id is not None:
        stmt = stmt.where(PoolMembership.provider_id == provider_id)
    if ip_address is not None:
        stmt = stmt.join(Node, Node.id == PoolMembership.node_id).where(Node.ip_address == ip_address)
    return int((await session.execute(stmt)).scalar_one())


async def live_pools_capping_ip(session: AsyncSession, node_id: str) -> list[Pool]:
    """The pools with ``max_nodes_per_ip`` that the node is a live member of, locked as a join
    locks its pool (in id order), so that the per-IP counts hold while its address changes."""
    stmt = (
        select(Pool)
        .join(PoolMembership, PoolMembership.pool_id == Pool.id)
        .where(
            PoolMembership.node_id == node_id,
            PoolMembership.status.in_(LIVE),
            Pool.max_nodes_per_ip.is_not(None),
        )
        .order_by(Pool.id)
        .with_for_update(of=Pool, key_share=True)
        .execution_options(populate_existing=True)
    )
    return list((await session.execute(stmt)).scalars())


# ------------------------------------------------------------------ invites


async def get_invite_by_hash(session: AsyncSession, code_hash: str) -> PoolInvite | None:
    # Not locked: joins are serialised by the pool row, and use_invite is conditional.
    stmt = select(PoolInvite).where(PoolInvite.code_hash == code_hash)
    return (await session.execute(stmt)).scalar_one_or_none()


async def use_invite(session: AsyncSession, invite_id: str, node_id: str, now: dt.datetime) -> bool:
    """Mark an invite used, once: False if it was used meanwhile."""
    result = await session.execute(
        update(PoolInvite)
        .where(PoolInvite.id == invite_id, PoolInvite.used_at.is_(None))
        .values(used_at=now, used_by_node_id=node_id)
        .returning(PoolInvite.id)
        .execution_options(synchronize_session=False)
    )
    return result.scalar_one_or_none() is not None


# ------------------------------------------------------------------ blacklist


async def get_blacklisting(
    session: AsyncSession, pool_id: str, provider_id: str, *, for_update: bool = False
) -> PoolProviderBlacklist | None:
    if for_update:  # locked and read again
        return await session.get(
            PoolProviderBlacklist, (pool_id, provider_id), with_for_update=True, populate_existing=True
        )
    return await session.get(PoolProviderBlacklist, (pool_id, provider_id))


async def insert_blacklisting(
    session: AsyncSession, *, pool_id: str, provider_id: str, reason: str, created_by: str, now: dt.datetime
) -> bool:
    return await insert_ignore(
        session,
        PoolProviderBlacklist,
        {
            "pool_id": pool_id,
            "provider_id": provider_id,
            "reason": reason,
            "created_by": created_by,
            "created_at": now,
        },
    )
