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
from orchestrator.identity.models import Node, NodeStatus
from orchestrator.tasks.service import extend_leases

log = structlog.get_logger(__name__)

SWEEPER = "liveness_sweeper"
SWEEP_BATCH = 5000
REVIVABLE = (NodeStatus.waiting.value, NodeStatus.unhealthy.value, NodeStatus.dead.value)


async def heartbeat(session: AsyncSession, state: AppState, node: Node, body: HeartbeatIn) -> HeartbeatOut:
    hb = state.settings.heartbeat
    now = state.clock.now()
    fields = {name: repr(value) for name, value in body.metrics.items()}
    await state.hot_store.record_beat(node.id, now, fields, ttl_s=math.ceil(hb.dead_after_s * 2))
    metrics.HEARTBEATS.inc()
    status = node.status
    if status in REVIVABLE:
        moved = await repo.transition(
            session,
            [node.id],
            from_statuses=[status],
            to_status=NodeStatus.healthy.value,
            reason="heartbeat received",
            actor="node",
        )
        if moved:
            status = NodeStatus.healthy.value
            log.info("node_status_changed", node_id=node.id, to="healthy")
    drop = await extend_leases(session, node.id, body.leases, now=state.clock.utcnow()) if body.leases else []
    return HeartbeatOut(status=status, next_heartbeat_in_s=hb.interval_s, drop_leases=drop)


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
