"""Admin rules for nodes: bans and unbans, recorded in the status history and the audit log.

A ban also ejects the node from its pools (``pools.service.eject_node``); an unban lifts those
ejections, and only those (``pools.service.lift_ban_ejections``)."""

from __future__ import annotations

import datetime as dt
from functools import partial

from sqlalchemy.ext.asyncio import AsyncSession

from orchestrator.admin.tokens import Principal
from orchestrator.audit.service import record
from orchestrator.core.db import after_commit
from orchestrator.core.errors import NotFound
from orchestrator.core.state import AppState
from orchestrator.identity import repository as repo
from orchestrator.identity.models import NODE_STATUSES, Node, NodeStatus
from orchestrator.pools import service as pools_service


async def node_or_404(session: AsyncSession, node_id: str, *, for_update: bool = False) -> Node:
    node = await repo.get_node(session, node_id, for_update=for_update)
    if node is None:
        raise NotFound("no node with this id", code="node_not_found")
    return node


async def ban(
    session: AsyncSession, state: AppState, node_id: str, reason: str, *, principal: Principal
) -> Node:
    """Ban the node and eject it from every pool it is a live member of, as an operator
    ejection would (its leases released, its stake unbonding), all in this transaction.
    Idempotent: banning a banned node changes nothing."""
    node = await node_or_404(session, node_id, for_update=True)
    before = {"status": node.status}
    not_banned = [s for s in NODE_STATUSES if s != NodeStatus.banned]
    moved = await repo.transition(
        session,
        [node_id],
        from_statuses=not_banned,
        to_status=NodeStatus.banned.value,
        reason=f"banned: {reason}",
        actor=principal.token_id,
    )
    if moved:
        node.ban_reason = reason
        # The last beat is kept, as the sweeper keeps a dead node's: the hot store forgets the
        # node once the ban commits, and the admin view of the banned node said it never beat.
        last = await state.hot_store.last_beat(node_id)
        if last is not None:
            node.last_heartbeat_at = dt.datetime.fromtimestamp(last, dt.UTC)
        await session.flush()
        ejected = await pools_service.eject_node(
            session,
            principal,
            node_id,
            f"{pools_service.BAN_EJECTION_PREFIX}{reason}",
            now=state.clock.utcnow(),
        )
        await record(
            session,
            principal,
            "node.ban",
            target_type="node",
            target_id=node_id,
            before=before,
            after={"status": NodeStatus.banned.value, "reason": reason, "ejected_from": ejected},
        )
        # Once the ban has committed: a ban rolled back must leave the node watched.
        after_commit(session, partial(state.hot_store.forget_node, node_id))
    await session.refresh(node)
    return node


async def unban(session: AsyncSession, state: AppState, node_id: str, *, principal: Principal) -> Node:
    """The node waits for a heartbeat again, and may rejoin the pools its ban ejected it from
    (their stake stays unbonding; a rejoin bonds anew). Idempotent."""
    node = await node_or_404(session, node_id, for_update=True)
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
