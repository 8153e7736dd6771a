"""A provider revokes one of its node keys, for good: the machine was stolen or compromised.

Until then only an admin's ban stopped a node key, and whoever held it could claim tasks and
submit fraud that slashed the provider's stake. A revocation bans the node as a ban does
(``admin.service.take_out``: ejected from every pool, its leases released and their replicas
reissued at once, its stake unbonding, the hot store told to forget it once it commits), so
every request its key signs is refused 403 ``node_banned`` by the checks that refuse a banned
node's; and ``nodes.revoked_at`` makes it final: an admin cannot unban it (409 ``node_revoked``)
and the key cannot register again (403 ``node_key_revoked``, ``identity.service.register_node``).
Results the node submitted before are judged as usual, and the provider's stake answers for
them: nothing is undone.

Lock order as a ban's: the provider's row ``FOR SHARE`` (a retirement in flight, which takes the
pools before the nodes, is waited for), then the node's row (a ban, an unban, a registration, a claim of the
node and another revocation queue on it), then what the ejections lock (the pools, the
memberships, the stake accounts, the leases).
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy.ext.asyncio import AsyncSession

from orchestrator.admin import service as admin_service
from orchestrator.audit.service import Actor, ProviderActor, last_entry, record
from orchestrator.core.errors import NotFound
from orchestrator.core.state import AppState
from orchestrator.identity import repository as repo
from orchestrator.identity.models import Node, NodeStatus

REVOKED = "revoked by its provider"
ACTION = "node.revoke"


async def revoke_node(
    session: AsyncSession, state: AppState, provider_id: str, node_id: str, reason: str | None
) -> tuple[Node, list[str]]:
    """Revoke ``provider_id``'s node ``node_id``: the node and the pools the revocation ejected
    it from, by id. Another provider's node is the same 404 as an unknown one. Idempotent: a
    revoked node is answered as it is, with the same pools, and nothing changes. A node an
    admin had banned becomes revoked; its ban's ejections stay as they are (none is added)."""
    # The provider's row first (``FOR SHARE``), as a ban holds it (``admin.service.lock_provider_of``):
    # a retirement in flight takes the pools before the nodes.
    await repo.get_provider(session, provider_id, for_share=True)
    node = await repo.get_provider_node_for_update(session, provider_id, node_id)
    if node is None:
        raise NotFound("this provider has no node with this id", code="node_not_found")
    actor = ProviderActor(provider_id)
    if node.revoked_at is not None:
        # What the revocation did, as its audit entry (written in its transaction) recorded it.
        entry = await last_entry(session, actor, ACTION, target_type="node", target_id=node_id)
        return node, list((entry.after or {}).get("ejected_from", [])) if entry is not None else []
    now = state.clock.utcnow()
    said = f"{REVOKED}: {reason}" if reason else REVOKED
    ejected = await revoke_locked(session, state, node, actor, said=said, reason=reason, now=now)
    await session.refresh(node)
    return node, ejected


async def revoke_locked(
    session: AsyncSession,
    state: AppState,
    node: Node,
    actor: Actor,
    *,
    said: str,
    reason: str | None,
    now: dt.datetime,
) -> list[str]:
    """Revoke ``node`` (locked by the caller, first, and not revoked yet) for ``actor``: banned
    and ejected (``admin.service.take_out``), ``revoked_at`` set, audited ``node.revoke``.
    ``said`` is the ban reason and the history's. Returns the pools it was ejected from. What
    a provider's revocation and an admin's retirement of the provider
    (``identity.retirement``) share."""
    before = {"status": node.status, "ban_reason": node.ban_reason}
    ejected = await admin_service.take_out(
        session,
        state,
        node,
        actor,
        ban_reason=said,
        history_reason=said,
        ejection_reason=f"node {said}",
        now=now,
    )
    if ejected is None:  # an admin had banned it: the history says who made it final
        await repo.record_status_change(session, node, reason=said, actor=actor.actor_id, at=now)
        ejected = []
    node.revoked_at = now
    await session.flush()
    await record(
        session,
        actor,
        ACTION,
        target_type="node",
        target_id=node.id,
        before=before,
        after={
            "status": NodeStatus.banned.value,
            "revoked_at": now,
            "reason": reason,
            "ejected_from": ejected,
        },
    )
    return ejected
