"""Heartbeats and the sweeper.

A heartbeat writes only to the hot store (a sorted set of last beats per liveness stage
and a per-node hash with a TTL); SQL is written only when the node's status changes.
The sweeper moves, atomically in the hot store, the nodes whose last beat is older than
the thresholds from the ``healthy`` set to the ``unhealthy`` set and from there out, so a
tick reads only the nodes that changed, never the nodes that keep beating.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import structlog
from sqlalchemy.ext.asyncio import AsyncSession

from api_schemas.identity import HeartbeatIn, HeartbeatOut
from orchestrator.core import metrics
from orchestrator.core.hotstore import HEALTHY, UNHEALTHY
from orchestrator.core.state import AppState
from orchestrator.core.ticks import claim_tick
from orchestrator.identity import repository as repo
from orchestrator.identity.auth import NodeRef
from orchestrator.identity.models import NodeStatus
from orchestrator.tasks.service import extend_leases

log = structlog.get_logger(__name__)

SWEEPER = "liveness_sweeper"
SWEEP_BATCH = 5000
REVIVABLE = (NodeStatus.waiting.value, NodeStatus.unhealthy.value, NodeStatus.dead.value)


async def heartbeat(state: AppState, node: NodeRef, body: HeartbeatIn) -> HeartbeatOut:
    """A steady heartbeat of a healthy node with no leases touches only the hot store; a
    transaction is opened only to revive the node or to extend leases."""
    hb = state.settings.heartbeat
    now = state.clock.now()
    fields = {name: repr(value) for name, value in body.metrics.items()}
    await state.hot_store.record_beat(node.id, now, fields, ttl_s=math.ceil(hb.dead_after_s * 2))
    metrics.HEARTBEATS.inc()
    status = node.status
    drop: list[str] = []
    if status in REVIVABLE or body.leases:
        async with state.sessionmaker() as session, session.begin():
            if status in REVIVABLE and await _revive(session, node.id, status):
                status = NodeStatus.healthy.value
            if body.leases:
                drop = await extend_leases(session, node.id, body.leases, now=state.clock.utcnow())
    return HeartbeatOut(status=status, next_heartbeat_in_s=hb.interval_s, drop_leases=drop)


async def _revive(session: AsyncSession, node_id: str, status: str) -> bool:
    moved = await repo.transition(
        session,
        [node_id],
        from_statuses=[status],
        to_status=NodeStatus.healthy.value,
        reason="heartbeat received",
        actor="node",
    )
    if moved:
        log.info("node_status_changed", node_id=node_id, to="healthy")
    return bool(moved)


@dataclass(frozen=True)
class SweepReport:
    tick: int
    ran: bool
    to_unhealthy: int = 0
    to_dead: int = 0


async def sweep_once(state: AppState) -> SweepReport:
    """One tick of the sweeper; a no-op if another process already ran this tick."""
    hb = state.settings.heartbeat
    now = state.clock.now()
    tick = int(now // hb.sweep_interval_s)
    async with state.sessionmaker() as session, session.begin():
        if not await claim_tick(session, SWEEPER, tick, state.instance_id):
            return SweepReport(tick=tick, ran=False)
        stale = await state.hot_store.move_stale(HEALTHY, UNHEALTHY, now - hb.unhealthy_after_s, SWEEP_BATCH)
        gone = await state.hot_store.move_stale(UNHEALTHY, None, now - hb.dead_after_s, SWEEP_BATCH)
        unhealthy = await repo.transition(
            session,
            stale,
            from_statuses=[NodeStatus.healthy.value],
            to_status=NodeStatus.unhealthy.value,
            reason=f"no heartbeat for {hb.unhealthy_after_missed} intervals",
            actor="sweeper",
        )
        dead = await repo.transition(
            session,
            gone,
            from_statuses=[NodeStatus.healthy.value, NodeStatus.unhealthy.value],
            to_status=NodeStatus.dead.value,
            reason=f"no heartbeat for {hb.dead_after_missed} intervals",
            actor="sweeper",
        )
    if unhealthy or dead:
        log.info("liveness_sweep", tick=tick, to_unhealthy=len(unhealthy), to_dead=len(dead))
    return SweepReport(tick=tick, ran=True, to_unhealthy=len(unhealthy), to_dead=len(dead))
