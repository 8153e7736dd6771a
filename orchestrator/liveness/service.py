"""Heartbeats and the sweeper.

A heartbeat writes only to the hot store (a sorted set of last beats per liveness stage
and a per-node hash with a TTL); SQL is written only when the node's status changes.
The sweeper moves, atomically in the hot store, the nodes whose last beat is older than
the thresholds from the ``healthy`` set to the ``unhealthy`` set and from there to ``dying``,
so a tick reads only the nodes that changed, never the nodes that keep beating. A node leaves
``dying`` only once its dead transition has committed: each tick marks dead whatever is still
there, so a tick whose transaction failed loses no node. The live leases of the nodes it marks
dead run out then (the reaper's next tick expires them and reissues their replicas).

The reconciler, much rarer, puts back under watch the nodes SQL says are healthy or unhealthy
but the hot store has lost (a restart of the in-process store, a Redis flush), as if last seen
at that moment: a node that beats again is healthy as ever, a node that does not dies after the
usual ``dead_after_s``.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Sequence
from dataclasses import dataclass

import structlog
from sqlalchemy import update
from sqlalchemy.ext.asyncio import AsyncSession

from api_schemas.identity import HeartbeatIn, HeartbeatOut, LeaseDeadline
from orchestrator.core import metrics
from orchestrator.core.hotstore import DYING, HEALTHY, UNHEALTHY, HotStore
from orchestrator.core.state import AppState
from orchestrator.core.ticks import claim_tick
from orchestrator.identity import repository as repo
from orchestrator.identity.auth import NodeRef
from orchestrator.identity.models import Node, NodeStatus
from orchestrator.liveness.serving import Serving, check_clock, read_serving
from orchestrator.tasks.service import end_leases_of_dead, extend_leases

log = structlog.get_logger(__name__)

SWEEPER = "liveness_sweeper"
SWEEP_BATCH = 5000
RECONCILER = "liveness_reconciler"
RECONCILE_INTERVAL_S = 60.0
RECONCILE_PAGE = 1000
# A dead node's leases run out this many heartbeat intervals after the sweeper marks it dead.
DEAD_LEASE_GRACE_BEATS = 2
REVIVABLE = (NodeStatus.waiting.value, NodeStatus.unhealthy.value, NodeStatus.dead.value)


# How long a node's last beat (and metrics) stays in the hot store: until the sweeper has
# copied it into SQL as it marks the node dead, even when that is long after the beat: after an
# outage the node is judged from the return (``serving``), so at twice the dead threshold (3
# minutes) the hash had expired, and a node that died through an outage kept no last beat.
BEAT_KEPT_S = 86400


def beat_ttl_s(dead_after_s: float) -> int:
    return max(BEAT_KEPT_S, math.ceil(dead_after_s * 2))


async def heartbeat(state: AppState, node: NodeRef, body: HeartbeatIn) -> HeartbeatOut:
    """A steady heartbeat of a healthy node with no leases touches only the hot store; a
    transaction is opened only to revive the node or to extend leases."""
    hb = state.settings.heartbeat
    now = state.clock.now()
    fields = {name: repr(value) for name, value in body.metrics.items()}
    await state.hot_store.record_beat(node.id, now, fields, ttl_s=beat_ttl_s(hb.dead_after_s))
    metrics.HEARTBEATS.inc()
    status = node.status
    drop: list[str] = []
    held: list[tuple[str, dt.datetime]] = []
    if status in REVIVABLE or body.leases:
        async with state.sessionmaker() as session, session.begin():
            if status in REVIVABLE and await _revive(session, node.id, status):
                status = NodeStatus.healthy.value
            if body.leases:
                drop, held = await extend_leases(
                    session, node.id, body.leases, now=state.clock.utcnow(), keep_s=hb.unhealthy_after_s
                )
    return HeartbeatOut(
        status=status,
        next_heartbeat_in_s=hb.interval_s,
        drop_leases=drop,
        lease_deadlines=[LeaseDeadline(assignment_id=i, lease_expires_at=at) for i, at in held],
    )


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


# How often a sweeper that holds for want of serving marks says so again.
HELD_REPEAT_S = 60.0


@dataclass(frozen=True)
class SweepReport:
    tick: int
    ran: bool
    to_unhealthy: int = 0
    to_dead: int = 0
    # Set when the service has not been able to take beats for long enough to judge every
    # silence (``serving``): ``not_serving`` (none judged) or ``resumed`` (judged only once
    # the service has been back for as long).
    held: str | None = None


async def _keep_last_beats(session: AsyncSession, store: HotStore, node_ids: Sequence[str]) -> None:
    """The last beat of each node just marked dead, into SQL: the hot store's entry expires
    (``beat_ttl_s``: a day, or twice the dead threshold if longer) and the node views then fall
    back on this. One read of the hot store for them all."""
    beats = await store.last_beats(node_ids)
    rows = [
        {"id": node_id, "last_heartbeat_at": dt.datetime.fromtimestamp(at, dt.UTC)}
        for node_id, at in zip(node_ids, beats, strict=True)
        if at is not None
    ]
    if rows:
        await session.execute(update(Node), rows)  # bulk UPDATE by primary key


async def sweep_once(state: AppState) -> SweepReport:
    """One tick of the sweeper; a no-op if another process already ran this tick."""
    hb = state.settings.heartbeat
    now = state.clock.now()
    tick = int(now // hb.sweep_interval_s)
    async with state.sessionmaker() as session, session.begin():
        # Measured at every attempt, the tick's or not: a process whose clock is behind never
        # claims a tick, and its offset (the skew alert's) stayed at 0.
        await check_clock(state, session)  # the sweeper's clock is the one that judges
        if not await claim_tick(
            session, SWEEPER, tick, state.instance_id, interval_s=hb.sweep_interval_s, clock=state.clock
        ):
            return SweepReport(tick=tick, ran=False)
        store = state.hot_store
        # Silence counts only while some API process could take beats (``serving``): after an
        # outage, a node last seen before it is judged as if seen at the return.
        serving = await read_serving(state, session, now, SWEEPER, hb.sweep_interval_s)
        held = _held(serving, hb.dead_after_s)
        stale: list[str] = []
        if serving is None or serving.judges(hb.unhealthy_after_s):
            stale = await store.move_stale(HEALTHY, UNHEALTHY, now - hb.unhealthy_after_s, SWEEP_BATCH)
        if serving is None or serving.judges(hb.dead_after_s):
            await store.move_stale(UNHEALTHY, DYING, now - hb.dead_after_s, SWEEP_BATCH)
        # This tick's and any that a tick whose transaction failed left behind.
        gone = await store.stage_members(DYING, SWEEP_BATCH)
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
        # Two beats' grace: a node whose beat crossed this commit beats again within it.
        ended = await end_leases_of_dead(
            session, dead, now=state.clock.utcnow(), grace_s=DEAD_LEASE_GRACE_BEATS * hb.interval_s
        )
        await _keep_last_beats(session, store, dead)
    # Only now that the dead transitions are committed (a node a concurrent beat revived was
    # removed from ``dying`` by that beat).
    await store.drop(DYING, gone)
    if unhealthy or dead:
        log.info(
            "liveness_sweep", tick=tick, to_unhealthy=len(unhealthy), to_dead=len(dead), leases_ended=ended
        )
    # Once as a hold begins (an outage; the return from one, which starts a new run of marks)
    # and once as it ends, in the process whose tick saw it. Only the outage is a warning, and
    # said again each minute it lasts (a sweeper whose clock runs ahead holds until it is set
    # right); the return was one already (``serving_resumed``), and a fresh install's first
    # start is one.
    hold: object = None
    if held is not None and serving is not None:
        hold = (held, serving.since, int(now // HELD_REPEAT_S) if serving.down else None)
    if state.changed("sweep_held", hold):
        if held is not None and serving is not None:
            (log.warning if serving.down else log.info)(
                "liveness_sweep_held",
                tick=tick,
                reason=held,
                last_mark_age_s=round(max(0.0, now - serving.at), 1),
                serving_for_s=None if serving.down else round(now - serving.since, 1),
                judged_in_full_in_s=(
                    None if serving.down else round(hb.dead_after_s - (now - serving.since), 1)
                ),
            )
        else:
            log.info("liveness_sweep_judging", tick=tick)
    return SweepReport(tick=tick, ran=True, to_unhealthy=len(unhealthy), to_dead=len(dead), held=held)


def _held(serving: Serving | None, dead_after_s: float) -> str | None:
    """Why this tick judges fewer nodes than their silence says, if it does."""
    if serving is None or serving.judges(dead_after_s):
        return None
    if serving.down:
        return "not_serving"  # no API process has marked lately: no beat could be taken
    return "resumed"


@dataclass(frozen=True)
class ReconcileReport:
    tick: int
    ran: bool
    watched: int = 0


async def reconcile_once(state: AppState) -> ReconcileReport:
    """One tick of the reconciler; a no-op if another process already ran this tick.

    Pages through the nodes SQL says are healthy or unhealthy since more than ``dead_after_s``
    and puts each one the hot store has in no liveness stage back in the stage of its status,
    as if last seen now (its last-heartbeat time, shown to operators, is not touched). The
    claim commits before the pages are read, so the scan holds no lock (on SQLite, the write
    lock); a tick that fails part way is done again by the next one.
    """
    hb = state.settings.heartbeat
    now = state.clock.now()
    tick = int(now // RECONCILE_INTERVAL_S)
    async with state.sessionmaker() as session, session.begin():
        if not await claim_tick(
            session, RECONCILER, tick, state.instance_id, interval_s=RECONCILE_INTERVAL_S, clock=state.clock
        ):
            return ReconcileReport(tick=tick, ran=False)
    changed_before = state.clock.utcnow() - dt.timedelta(seconds=hb.dead_after_s)
    watched: list[str] = []
    for status, stage in ((NodeStatus.healthy.value, HEALTHY), (NodeStatus.unhealthy.value, UNHEALTHY)):
        after = ""
        while True:
            async with state.sessionmaker() as session:
                ids = await repo.settled_node_ids(
                    session, status, changed_before=changed_before, after=after, limit=RECONCILE_PAGE
                )
            watched += await state.hot_store.watch_if_absent(ids, stage, now)
            if len(ids) < RECONCILE_PAGE:
                break
            after = ids[-1]
    if watched:
        log.warning("liveness_reconciled", tick=tick, watched=len(watched), sample=watched[:10])
    return ReconcileReport(tick=tick, ran=True, watched=len(watched))
