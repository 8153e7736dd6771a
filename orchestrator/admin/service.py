"""Admin rules for nodes: bans and unbans, recorded in the status history and the audit log.

A ban also ejects the node from its pools (``pools.service.eject_node``); an unban lifts those
ejections, and only those (``pools.service.lift_ban_ejections``). A provider's revocation of its
node (``identity.revocation``) bans it the same way (``take_out``), for good: an unban of a
revoked node is refused (409 ``node_revoked``)."""

from __future__ import annotations

import datetime as dt
from functools import partial

from sqlalchemy.ext.asyncio import AsyncSession

from orchestrator.admin.tokens import Principal
from orchestrator.audit.service import Actor, record
from orchestrator.core.db import after_commit
from orchestrator.core.errors import Conflict, NotFound
from orchestrator.core.state import AppState
from orchestrator.identity import repository as repo
from orchestrator.identity.models import NODE_STATUSES, Node, NodeStatus
from orchestrator.pools import service as pools_service


async def lock_provider_of(session: AsyncSession, node_id: str) -> None:
    """Hold the node's provider's row ``FOR SHARE`` (nothing if the node is unknown), before the
    node's: a retirement of the provider takes its pools before its nodes, so a ban that held
    the node while it waited for one of the node's pools deadlocked with it (PostgreSQL aborted
    one of them). Providers' rows come first in the lock order (docs/architecture.md); a ban
    waits for a retirement in flight holding nothing, and then finds the node revoked."""
    node = await repo.get_node(session, node_id)
    if node is not None:
        await repo.get_provider(session, node.provider_id, for_share=True)


async def node_or_404(session: AsyncSession, node_id: str, *, for_update: bool = False) -> Node:
    node = await repo.get_node(session, node_id, for_update=for_update)
    if node is None:
        raise NotFound("no node with this id", code="node_not_found")
    return node


async def take_out(
    session: AsyncSession,
    state: AppState,
    node: Node,
    actor: Actor,
    *,
    ban_reason: str,
    history_reason: str,
    ejection_reason: str,
    now: dt.datetime,
) -> list[str] | None:
    """Ban the node (locked by the caller, first) and eject it from every pool it is a live
    member of, as an operator ejection would (its leases released and their replicas reissued
    at once, its stake unbonding), all in this transaction; the hot store forgets the node once
    it commits. What a ban and a revocation (``identity.revocation``) share. Returns the pools
    it was ejected from, or None if the node was banned already (nothing changes)."""
    not_banned = [s for s in NODE_STATUSES if s != NodeStatus.banned]
    moved = await repo.transition(
        session,
        [node.id],
        from_statuses=not_banned,
        to_status=NodeStatus.banned.value,
        reason=history_reason,
        actor=actor.actor_id,
    )
    if not moved:
        return None
    node.ban_reason = ban_reason
    # The last beat is kept, as the sweeper keeps a dead node's: the hot store forgets the
    # node once the ban commits, and the admin view of the banned node said it never beat.
    last = await state.hot_store.last_beat(node.id)
    if last is not None:
        node.last_heartbeat_at = dt.datetime.fromtimestamp(last, dt.UTC)
    await session.flush()
    ejected = await pools_service.eject_node(session, actor, node.id, ejection_reason, now=now)
    # Once the ban has committed: a ban rolled back must leave the node watched. Skipped (a
    # request cancelled as its commit was awaited, ``db.after_commit``), the banned node stays in
    # the liveness stages until the sweeper finds it silent and drops it (its transitions are from
    # healthy and unhealthy only), and its views show the beat the ban kept above.
    after_commit(session, partial(state.hot_store.forget_node, node.id))
    return ejected


async def ban(
    session: AsyncSession, state: AppState, node_id: str, reason: str, *, principal: Principal
) -> Node:
    """Ban the node and eject it from every pool it is a live member of (``take_out``).
    Idempotent: banning a banned node changes nothing.

    The node's provider's row is held ``FOR SHARE`` before the node (``lock_provider_of``)."""
    await lock_provider_of(session, node_id)
    node = await node_or_404(session, node_id, for_update=True)
    before = {"status": node.status}
    ejected = await take_out(
        session,
        state,
        node,
        principal,
        ban_reason=reason,
        history_reason=f"banned: {reason}",
        ejection_reason=f"{pools_service.BAN_EJECTION_PREFIX}{reason}",
        now=state.clock.utcnow(),
    )
    if ejected is not None:
        await record(
            session,
            principal,
            "node.ban",
            target_type="node",
            target_id=node_id,
            before=before,
            after={"status": NodeStatus.banned.value, "reason": reason, "ejected_from": ejected},
        )
    await session.refresh(node)
    return node


async def unban(session: AsyncSession, state: AppState, node_id: str, *, principal: Principal) -> Node:
    """The node waits for a heartbeat again, and may rejoin the pools its ban ejected it from
    (their stake stays unbonding; a rejoin bonds anew). Idempotent."""
    node = await node_or_404(session, node_id, for_update=True)
    if node.revoked_at is not None:
        raise Conflict(
            "this node's provider revoked its key, for good: the node cannot be unbanned; the "
            "provider must register a new node key (`orchestrator keys generate`)",
            code="node_revoked",
            extra={"revoked_at": node.revoked_at.isoformat()},
        )
    before = {"status": node.status, "reason": node.ban_reason}
    moved = await repo.transition(
        session,
        [node_id],
        from_statuses=[NodeStatus.banned.value],
        to_status=NodeStatus.waiting.value,
        reason="unbanned",
        actor=principal.token_id,
    )
    if moved:
        node.ban_reason = None
        await session.flush()
        rejoinable = await pools_service.lift_ban_ejections(
            session, principal, node_id, now=state.clock.utcnow()
        )
        await record(
            session,
            principal,
            "node.unban",
            target_type="node",
            target_id=node_id,
            before=before,
            after={"status": NodeStatus.waiting.value, "may_rejoin": rejoinable},
        )
    await session.refresh(node)
    return node
