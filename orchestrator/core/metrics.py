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


def render() -> tuple[bytes, str]:
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(), CONTENT_TYPE_LATEST
