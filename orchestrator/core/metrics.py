"""Prometheus metrics, labelled by route template (never by id).

With several worker processes set ``PROMETHEUS_MULTIPROC_DIR`` so ``/metrics`` aggregates
them (prometheus_client's multiprocess mode); otherwise each process reports its own.
"""

from __future__ import annotations

import contextlib
import glob
import os
import threading
from collections.abc import Callable
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
    start_http_server,
)
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session, SessionTransaction

REQUESTS = Counter("orchestrator_http_requests_total", "HTTP requests", ["method", "route", "status"])
LATENCY = Histogram(
    "orchestrator_http_request_duration_seconds",
    "HTTP request latency",
    ["method", "route"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
HEARTBEATS = Counter("orchestrator_heartbeats_total", "Heartbeats accepted")
HOT_STORE_MEMORY_LOST = Counter(
    "orchestrator_hot_store_memory_lost_total",
    "Times this process found Redis without its nonces-since marker and set it: a new Redis, or one "
    "that lost its keys (FLUSHDB, a restart without persistence, eviction); signed requests created "
    "before then are refused as possible replays until they leave the signature window",
)
NODES = Gauge(
    "orchestrator_nodes",
    "Nodes by status (read from the database at scrape time)",
    ["status"],
    multiprocess_mode="mostrecent",
)
CLAIMS = Counter(
    "orchestrator_claims_total",
    "Claim requests answered, by outcome: leased, or the no-work reason (no_tasks, lease_cap_reached ...)",
    ["outcome"],
)
LEASES_GRANTED = Counter("orchestrator_leases_granted_total", "Leases handed out by claims")
RESULTS = Counter(
    "orchestrator_results_total",
    "Signed results answered with success, by outcome: accepted (recorded) or replayed (the same body again)",
    ["outcome"],
)
# The work queue, read from the database at scrape time through partial indexes (each read
# visits only the rows it counts: the open queue, the live leases, the unfinished jobs).
TASKS_CLAIMABLE = Gauge(
    "orchestrator_tasks_claimable",
    "Open tasks with a replica waiting to be leased",
    multiprocess_mode="mostrecent",
)
LEASES_ACTIVE = Gauge("orchestrator_leases_active", "Live leases", multiprocess_mode="mostrecent")
POOLS_PAUSED_FOR_BUDGET = Gauge(
    "orchestrator_pools_paused_for_budget",
    "Pools the system paused because their verdicts credited their economics.reward_budget "
    "(status_reason budget_spent), until an operator raises the budget and resumes them or "
    "completes them (read from the database at scrape time)",
    multiprocess_mode="mostrecent",
)
VERIFICATION_JOBS = Gauge(
    "orchestrator_verification_jobs",
    "Results not yet decided, by stage: checks (the verifier's backlog), quorum, validator",
    ["stage"],
    multiprocess_mode="mostrecent",
)
VERIFICATION_LAG = Gauge(
    "orchestrator_verification_oldest_waiting_seconds",
    "Age of the oldest result waiting for the verifier's checks (0 when none waits)",
    multiprocess_mode="mostrecent",
)
VALIDATION_LAG = Gauge(
    "orchestrator_validation_oldest_waiting_seconds",
    "Age of the oldest result waiting for a validator's verdict, since it was received (0 when none "
    "waits); it grows when no validator claims the pool's jobs, until ORCH_VERIFIER__VALIDATOR_WAIT_S "
    "(plus a lease at most) has passed and such results are decided on their checks without the audit",
    multiprocess_mode="mostrecent",
)

DB_GAUGES_READ = Gauge(
    "orchestrator_metrics_database_read",
    "1 when the last scrape read the gauges that come from the database (nodes, the queue, the "
    "loops' ages), 0 when it could not (the database down or slow): those then keep their last values",
    multiprocess_mode="mostrecent",
)

LOOP_LAST_RUN_AGE = Gauge(
    "orchestrator_loop_last_run_age_seconds",
    "Seconds since a background loop last completed a tick in any process (+Inf: never); it grows "
    "when no process runs the loops (API replicas with them off and no `orchestrator background`) "
    "or when their ticks fail (the verifier's: its housekeeping; its batches show in "
    "orchestrator_verification_oldest_waiting_seconds)",
    ["loop"],
    multiprocess_mode="mostrecent",
)

CLOCK_OFFSET = Gauge(
    "orchestrator_clock_offset_seconds",
    "This process's clock less the database server's, as its last serving mark or sweep (every 5 s) "
    "measured it; 0 on SQLite. Beats are timed by the API processes' clocks and judged by the sweeper's: "
    "hosts whose clocks differ by seconds judge liveness wrong, and a sweeper 15 s ahead holds for ever",
    multiprocess_mode="liveall",
)

# What the background loops did, counted by the process that did it (an API process with the
# loops, or `orchestrator background`, whose --metrics-port serves these), once its transaction
# committed: a batch rolled back and retried is counted once.
VERDICTS = Counter(
    "orchestrator_verdicts_total",
    "Verdicts recorded, by outcome (accepted, rejected), category (valid, invalid, fraud, "
    "inconclusive) and verifier (checks, reward, quorum, validator)",
    ["outcome", "category", "verifier"],
)
REWARDS_CREDITED = Counter(
    "orchestrator_rewards_credited_total",
    "Rewards credited to providers' pending balances by verdicts, in ledger units (held for the "
    "pool's reward_hold_s before they can be withdrawn)",
)
SLASHED = Counter(
    "orchestrator_slashed_total",
    "Stake slashed and pending rewards forfeited by verdicts (fraud, and the soft-invalid "
    "penalty), in ledger units; with the rewards appeals paid that a fraud verdict of the result's "
    "hold window forfeited at once (counted by the API process that took the appeal)",
)
VERDICTS_REVERSED = Counter(
    "orchestrator_verdicts_reversed_total",
    "Verdicts reversed on appeal, by the outcome and category they had (counted by the API "
    "process that took the appeal): orchestrator_verdicts_total less these is what stands",
    ["outcome", "category"],
)
REWARDS_PAID_ON_APPEAL = Counter(
    "orchestrator_rewards_paid_on_appeal_total",
    "Rewards that appeals of fraud and invalid verdicts paid into providers' pending balances (what "
    "an acceptance would have paid), in ledger units (counted by the API process that took the "
    "appeal; not in orchestrator_rewards_credited_total)",
)
AUDITS_SKIPPED = Counter(
    "orchestrator_audits_skipped_total",
    "Results drawn for an audit but decided on their own checks (audit_skipped in the verdict's "
    "details): no member of another provider and address could repeat the task, nobody took the "
    "audit replica within ORCH_VERIFIER__QUORUM_WAIT_S, or no validator decided within "
    "ORCH_VERIFIER__VALIDATOR_WAIT_S; a cheat among them goes unchecked",
)
LOOP_TICK_FAILURES = Counter(
    "orchestrator_loop_tick_failures_total",
    "Background ticks that raised, by loop and cause: unavailable (the database or Redis could "
    "not be reached) or error (anything else: its traceback is in the log)",
    ["loop", "cause"],
)
TICK_FAILURE_CAUSES = ("unavailable", "error")

# The metrics ``orchestrator background`` measures itself. Its /metrics leaves out the gauges
# that the API processes read from the database at scrape time (they would read 0 there).
BACKGROUND_METRICS = (VERDICTS, REWARDS_CREDITED, SLASHED, AUDITS_SKIPPED, LOOP_TICK_FAILURES, CLOCK_OFFSET)

_ON_COMMIT = "orchestrator.metrics_on_commit"


def on_commit(session: Session | AsyncSession, count: Callable[[], None]) -> None:
    """Call ``count`` once ``session``'s transaction commits: never if it rolls back, nor if a
    savepoint it was called in rolls back (a verifier batch's failed job) while the rest
    commits."""
    sync = session.sync_session if isinstance(session, AsyncSession) else session
    transaction = sync.get_nested_transaction() or sync.get_transaction()
    session.info.setdefault(_ON_COMMIT, []).append((transaction, count))


@event.listens_for(Session, "after_commit")
def _committed(session: Session) -> None:
    # Still the committing transaction: the innermost savepoint, or the outermost.
    committed = session.get_nested_transaction() or session.get_transaction()
    pending = session.info.get(_ON_COMMIT)
    if committed is None or not pending:
        return
    if committed.nested:  # released: its counts now wait for its parent's commit
        session.info[_ON_COMMIT] = [(committed.parent if t is committed else t, c) for t, c in pending]
    else:
        del session.info[_ON_COMMIT]
        for _, count in pending:
            count()


@event.listens_for(Session, "after_transaction_end")
def _ended(session: Session, transaction: SessionTransaction) -> None:
    # What a transaction committed was passed on above; what is still its own was rolled back.
    pending = session.info.get(_ON_COMMIT)
    if pending:
        session.info[_ON_COMMIT] = [(t, c) for t, c in pending if t is not transaction]


def background_registry() -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=True)
    for collector in (*BACKGROUND_METRICS, PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        registry.register(collector)
    return registry


def serve_background(host: str, port: int) -> tuple[WSGIServer, threading.Thread]:
    """/metrics of ``orchestrator background`` on ``host:port``, in a thread of its own (so a
    scrape is answered while a tick holds the event loop). OSError if the address is taken."""
    return start_http_server(port, addr=host, registry=background_registry())


def process_ended() -> None:
    """With ``PROMETHEUS_MULTIPROC_DIR``: this process's per-process series (the clock offset's,
    ``liveall``) stop being reported. Called as an app ends (a worker that stops, as at a
    SIGHUP's restart of every worker) and by ``serve``'s supervisor before it starts its
    workers: the series of ended workers stayed, at their last values, for the container's life."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        multiprocess.mark_process_dead(os.getpid())  # type: ignore[no-untyped-call]


def _forget_ended_processes(directory: str) -> None:
    """Drop the per-process (``live*``) series of processes that are gone without marking
    themselves dead (SIGKILL, the OOM killer: uvicorn's supervisor starts another worker in
    their place). prometheus_client keeps such a process's files until ``mark_process_dead``,
    so its clock offset stayed, at its last value, for the life of the directory, one series
    more per death. The directory is the process's own (a tmpfs or emptyDir of its container),
    so the pids in it are this host's."""
    for path in glob.glob(os.path.join(directory, "gauge_live*_*.db")):
        try:
            pid = int(os.path.basename(path).rsplit("_", 1)[1].removesuffix(".db"))
            os.kill(pid, 0)
        except ValueError:
            continue
        except ProcessLookupError:
            # As ``mark_process_dead`` would, one file at a time: the container's other workers
            # scrape too, and one of them may have removed it since the glob.
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
        except PermissionError:
            continue  # someone else's process: alive


def render() -> tuple[bytes, str]:
    if directory := os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        _forget_ended_processes(directory)
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(), CONTENT_TYPE_LATEST
