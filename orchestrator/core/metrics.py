"""Prometheus metrics, labelled by route template (never by id).

With several worker processes set ``PROMETHEUS_MULTIPROC_DIR`` so ``/metrics`` aggregates
them (prometheus_client's multiprocess mode); otherwise each process reports its own.
"""

from __future__ import annotations

import os

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

REQUESTS = Counter("orchestrator_http_requests_total", "HTTP requests", ["method", "route", "status"])
LATENCY = Histogram(
    "orchestrator_http_request_duration_seconds",
    "HTTP request latency",
    ["method", "route"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
HEARTBEATS = Counter("orchestrator_heartbeats_total", "Heartbeats accepted")
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
    "This process's clock less the database server's, as its last serving mark (every 5 s) measured "
    "it; 0 on SQLite. Beats are timed by the API processes' clocks and judged by the sweeper's: "
    "hosts whose clocks differ by seconds judge liveness wrong, and a sweeper 15 s ahead holds for ever",
    multiprocess_mode="liveall",
)


def render() -> tuple[bytes, str]:
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(), CONTENT_TYPE_LATEST
