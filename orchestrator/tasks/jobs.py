"""The lease reaper, once per tick: expired leases are ended and their replicas reissued, and
open tasks past their deadline fail.

Each batch is a transaction of its own, of at most ``REAP_BATCH`` leases and as many tasks. A
backlog larger than a batch (a mass death of nodes: their leases all run out at the sweeper's
tick) is drained by further batches in the same tick, for up to ``INTERVAL_S`` of work, instead
of one batch every ``INTERVAL_S``. Claims and results get the database between batches (on
SQLite, its write lock).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import structlog

from orchestrator.core.state import AppState
from orchestrator.core.ticks import claim_tick
from orchestrator.tasks.service import fail_past_deadline, reap_expired

log = structlog.get_logger(__name__)

LEASE_REAPER = "lease_reaper"
INTERVAL_S = 5.0
REAP_BATCH = 1000


@dataclass(frozen=True)
class ReapReport:
    tick: int
    ran: bool
    expired: int = 0
    failed_tasks: int = 0
    past_deadline: int = 0
    batches: int = 0


async def reap_once(state: AppState) -> ReapReport:
    now = state.clock.now()
    tick = int(now // INTERVAL_S)
    until = time.monotonic() + INTERVAL_S
    totals = [0, 0, 0]  # leases expired, tasks failed (max attempts), tasks past their deadline
    batches = 0
    while True:
        async with state.sessionmaker() as session, session.begin():
            if not batches and not await claim_tick(session, LEASE_REAPER, tick, state.instance_id):
                return ReapReport(tick=tick, ran=False)
            utcnow = state.clock.utcnow()
            expired, failed = await reap_expired(session, now=utcnow, limit=REAP_BATCH)
            past_deadline = await fail_past_deadline(session, now=utcnow, limit=REAP_BATCH)
        batches += 1
        totals = [a + b for a, b in zip(totals, (expired, failed, past_deadline), strict=True)]
        if max(expired, past_deadline) < REAP_BATCH or time.monotonic() >= until:
            break
    expired, failed, past_deadline = totals
    if expired:
        log.info("leases_expired", count=expired, failed_tasks=failed, batches=batches)
    return ReapReport(tick, True, expired, failed, past_deadline, batches)
