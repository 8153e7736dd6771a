"""Shared benchmark plumbing: the database, the server subprocess, set-up over HTTP, statistics.

Used by ``benchmarks.claims`` (the claim benchmark) and ``python -m benchmarks`` (the harness).
Everything talks to 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

import asyncpg
import httpx
from nacl.signing import SigningKey
from sqlalchemy.ext.asyncio import AsyncEngine

from orchestrator.core.keys import attest_node, generate_key, key_id_of
from orchestrator.core.signing import SignatureAuth

DEFAULT_DB = "postgresql://postgres@127.0.0.1:5432/orch_bench"
DEFAULT_REDIS = "redis://127.0.0.1:6379/15"
SPECS = {"gpu_model": "H100", "gpu_count": 1, "gpu_memory_mb": 80000, "cpu_cores": 8, "ram_mb": 65536}


# ------------------------------------------------------------------ statistics


def percentile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(len(sorted_values) * q))]


def latency_summary(latencies: Sequence[float]) -> dict[str, float]:
    """p50 / p99 / mean in milliseconds."""
    lat = sorted(latencies)
    return {
        "p50_ms": round(percentile(lat, 0.50) * 1000, 2),
        "p99_ms": round(percentile(lat, 0.99) * 1000, 2),
        "mean_ms": round(statistics.fmean(lat) * 1000, 2) if lat else 0.0,
    }


@dataclass
class Stats:
    latencies: list[float] = field(default_factory=list)
    done: int = 0
    errors: int = 0
    # When the phase's queue first ran dry (time.monotonic()), if it did before the phase ended.
    drained_at: float | None = None
    started_at: float = field(default_factory=time.monotonic)

    def drained(self) -> None:
        """The queue ran dry: the phase's rate counts only the time until now."""
        if self.drained_at is None:
            self.drained_at = time.monotonic()

    def line(self, name: str, seconds: float) -> dict[str, Any]:
        lat = sorted(self.latencies) or [0.0]
        if self.drained_at is not None:
            seconds = min(seconds, self.drained_at - self.started_at)
        return {
            "path": name,
            "claims_per_s": round(self.done / seconds, 1) if seconds > 0 else 0.0,
            "seconds": round(seconds, 2),
            "p50_ms": round(statistics.median(lat) * 1000, 2),
            "p99_ms": round(percentile(lat, 0.99) * 1000, 2),
            "claims": self.done,
            "errors": self.errors,
        }


# ------------------------------------------------------------------ database


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def sqlalchemy_url(dsn: str) -> str:
    return dsn.replace("postgresql://", "postgresql+asyncpg://", 1)


def add_store_args(parser: argparse.ArgumentParser) -> None:
    """--database and --redis, defaulting to ORCH_BENCH_DATABASE_URL / ORCH_BENCH_REDIS_URL."""
    parser.add_argument("--database", default=os.environ.get("ORCH_BENCH_DATABASE_URL", DEFAULT_DB))
    parser.add_argument("--redis", default=os.environ.get("ORCH_BENCH_REDIS_URL", DEFAULT_REDIS))


def engine_for(dsn: str, connections: int | None = None) -> AsyncEngine:
    """The service layer's engine on the benchmark database: ``connections`` pooled, no overflow
    (the application's defaults without it)."""
    from orchestrator.core.db import make_engine
    from orchestrator.settings import DatabaseSettings

    if connections is None:
        return make_engine(DatabaseSettings(url=sqlalchemy_url(dsn)))
    return make_engine(DatabaseSettings(url=sqlalchemy_url(dsn), pool_size=connections, max_overflow=0))


async def reset_database(dsn: str) -> None:
    """Drop and re-create the benchmark database (never one of the test databases)."""
    admin_dsn = dsn.rsplit("/", 1)[0] + "/postgres"
    name = dsn.rsplit("/", 1)[1]
    if name in {"postgres", "test", "root"}:
        raise SystemExit(f"refusing to rebuild database {name!r}: pick a benchmark database")
    conn = await asyncpg.connect(admin_dsn)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()


async def drop_redis_prefix(url: str, prefix: str) -> None:
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(url, socket_timeout=10)
    try:
        batch: list[Any] = []
        async for key in client.scan_iter(match=prefix + "*", count=5000):
            batch.append(key)
            if len(batch) >= 5000:
                await client.delete(*batch)
                batch = []
        if batch:
            await client.delete(*batch)
    finally:
        await client.aclose()


# ------------------------------------------------------------------ the server


def server_env(
    dsn: str, redis_url: str, *, prefix: str = "orch:", extra: Mapping[str, str] | None = None
) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORCH_")}
    env.update(
        {
            "ORCH_DB__URL": sqlalchemy_url(dsn),
            "ORCH_REDIS__URL": redis_url,
            "ORCH_REDIS__PREFIX": prefix,
            "ORCH_LOG_LEVEL": "WARNING",
            "ORCH_HEARTBEAT__INTERVAL_S": "120",
            "ORCH_LIMITS__REGISTRATION_PER_IP": "1000000",
            "ORCH_LIMITS__REGISTRATION_PER_KEY": "1000000",
            # Thousands of fresh keys from one address, as the registrations above.
            "ORCH_LIMITS__UNSEEN_KEYS_PER_IP": "0",
            "ORCH_DB__POOL_SIZE": "40",
        }
    )
    env.update(extra or {})
    return env


def start_server(
    dsn: str,
    redis_url: str,
    port: int,
    workers: int,
    log: IO[bytes] | int,
    *,
    prefix: str = "orch:",
    extra_env: Mapping[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """``orchestrator serve`` in its own process group (so all its workers stop together)."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "orchestrator.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            str(workers),
        ],
        env=server_env(dsn, redis_url, prefix=prefix, extra=extra_env),
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )


def stop_server(server: subprocess.Popen[bytes], timeout: float = 30) -> None:
    if server.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=10)


async def wait_ready(base: str, within_s: float = 60) -> None:
    deadline = time.monotonic() + within_s
    async with httpx.AsyncClient(base_url=base) as c:
        while time.monotonic() < deadline:
            try:
                if (await c.get("/readyz")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.3)
    raise RuntimeError("server did not become ready")


async def create_token(dsn: str) -> str:
    from orchestrator.admin.tokens import Role
    from orchestrator.admin.tokens import create_token as make
    from orchestrator.core.db import make_sessionmaker

    engine = engine_for(dsn)
    try:
        async with make_sessionmaker(engine)() as session, session.begin():
            token, _ = await make(session, role=Role.admin, name="bench")
            return token
    finally:
        await engine.dispose()


# ------------------------------------------------------------------ set-up over HTTP


async def create_pool(
    c: httpx.AsyncClient,
    headers: Mapping[str, str],
    name: str,
    policy: Mapping[str, Any],
    economics: Mapping[str, Any] | None = None,
) -> str:
    body: dict[str, Any] = {"name": name, "policy": dict(policy)}
    if economics:
        body["economics"] = dict(economics)
    r = await c.post("/v1/admin/pools", headers=dict(headers), json=body)
    r.raise_for_status()
    pool_id = str(r.json()["id"])
    (await c.post(f"/v1/admin/pools/{pool_id}/activate", headers=dict(headers))).raise_for_status()
    (
        await c.post(
            f"/v1/admin/pools/{pool_id}/policies",
            headers=dict(headers),
            json={"step": 1, "uri": "s3://bench", "sha256": "a" * 64, "size": 1},
        )
    ).raise_for_status()
    return pool_id


def bench_task(i: int, *, verified: bool = False) -> dict[str, Any]:
    if verified:
        return {
            "prompt": f"What is 2+2? ({i})",
            "sampling": {"max_tokens": 16},
            "verification": {"expected_answer": "4"},
        }
    return {"problem_ref": f"p/{i}", "sampling": {"max_tokens": 16}}


async def enqueue(
    c: httpx.AsyncClient,
    headers: Mapping[str, str],
    pool_id: str,
    n: int,
    *,
    key: str,
    verified: bool = False,
    batch: int = 10_000,
) -> float:
    """Enqueue ``n`` tasks in batches; return the seconds it took."""
    t0 = time.perf_counter()
    for start in range(0, n, batch):
        size = min(batch, n - start)
        tasks = [bench_task(start + i, verified=verified) for i in range(size)]
        r = await c.post(
            f"/v1/admin/pools/{pool_id}/tasks",
            headers=dict(headers),
            json={"batch_key": f"{key}-{start}", "tasks": tasks},
        )
        r.raise_for_status()
    return time.perf_counter() - t0


async def register_node(
    c: httpx.AsyncClient,
    node: SigningKey,
    *,
    pool_ids: Sequence[str] = (),
    provider: SigningKey | None = None,
    ip: str | None = None,
) -> None:
    """Register a provider and its node (from ``ip`` when the server trusts proxy headers),
    beat once (healthy) and join the pools."""
    provider = provider or generate_key()
    headers = {"X-Forwarded-For": ip} if ip else {}
    r = await c.post("/v1/providers", json={}, headers=headers, auth=SignatureAuth(provider))
    r.raise_for_status()
    body = {
        "provider_id": key_id_of(provider),
        "attestation": attest_node(provider, key_id_of(node)),
        "specs": SPECS,
        "version": "bench",
    }
    (await c.post("/v1/nodes", headers=headers, json=body, auth=SignatureAuth(node))).raise_for_status()
    auth = SignatureAuth(node)
    (await c.post("/v1/nodes/me/heartbeat", headers=headers, json={}, auth=auth)).raise_for_status()
    for pool_id in pool_ids:
        r = await c.post(f"/v1/pools/{pool_id}/join", headers=headers, json={}, auth=SignatureAuth(node))
        r.raise_for_status()


async def register_nodes(
    c: httpx.AsyncClient, count: int, *, pool_ids: Sequence[str], ip_base: int, parallel: int = 8
) -> list[SigningKey]:
    """``count`` nodes, each with its own provider and address (10.x.y.z from ``ip_base``)."""
    nodes = [generate_key() for _ in range(count)]
    gate = asyncio.Semaphore(parallel)

    async def one(i: int, node: SigningKey) -> None:
        n = ip_base + i
        async with gate:
            await register_node(
                c, node, pool_ids=pool_ids, ip=f"10.{n // 65536 % 256}.{n // 256 % 256}.{n % 256}"
            )

    await asyncio.gather(*(one(i, node) for i, node in enumerate(nodes)))
    return nodes


async def setup_pool(base: str, token: str, pollers: int, tasks: int) -> tuple[str, list[Any]]:
    """One pool with ``tasks`` tasks and ``pollers`` member nodes (``benchmarks.claims``)."""
    headers = {"Authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(base_url=base, timeout=120) as c:
        pool_id = await create_pool(
            c,
            headers,
            "bench",
            {"replication_factor": 1, "max_leases_per_node": 4, "lease_duration_s": 3600},
        )
        await enqueue(c, headers, pool_id, tasks, key="b")
        # Each poller is its own provider on its own address, as real nodes are: the placement
        # rule (no two replicas of a task on one provider or IP) must be satisfiable for the
        # second replicas the verifier asks for, or they would pile up unclaimable at the head
        # of the queue. The server must trust X-Forwarded-For (``start_server`` callers set it).
        nodes = await register_nodes(c, pollers, pool_ids=[pool_id], ip_base=4096)
    return pool_id, nodes


async def prepare_raw(dsn: str, jobs: int) -> None:
    """The raw baseline's queue: ``jobs`` open rows in a plain table, with a partial index."""
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("DROP TABLE IF EXISTS bench_jobs")
        await conn.execute(
            "CREATE TABLE bench_jobs (id bigserial PRIMARY KEY, status text NOT NULL DEFAULT 'open', "
            "node text, payload text)"
        )
        await conn.execute(
            "INSERT INTO bench_jobs (payload) SELECT 'p/' || g FROM generate_series(1, $1) g", jobs
        )
        await conn.execute("CREATE INDEX ON bench_jobs (id) WHERE status = 'open'")
        await conn.execute("VACUUM ANALYZE bench_jobs")
    finally:
        await conn.close()


# ------------------------------------------------------------------ CPU accounting


class CpuMeter:
    """CPU used per group of processes while a phase runs, sampled from /proc every 0.5 s: the
    server's process group, the load generator, PostgreSQL backends of the benchmark database,
    Redis, and the whole machine (``other`` = everything else, e.g. other jobs on a shared host).

    Per process, the delta is its last sample minus its first (zero for one born mid-phase), so
    PostgreSQL backends that come and go are counted up to their last sample."""

    def __init__(self, server_pgids: set[int], loadgen_pid: int, database: str) -> None:
        self.server_pgids, self.loadgen_pid = server_pgids, loadgen_pid
        self.database = database
        self.tick = os.sysconf("SC_CLK_TCK")

    def _group(self, pid: int, pgrp: int, comm: str) -> str | None:
        if pgrp in self.server_pgids:
            return "server"
        if pid == self.loadgen_pid:
            return "loadgen"
        if comm.startswith("redis-server"):
            return "redis"
        if comm == "postgres":
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read().replace(b"\0", b" ")
            except OSError:
                return None
            if f" {self.database} ".encode() in cmdline:
                return "postgres"
        return None

    def sample(self) -> dict[int, tuple[str, float]]:
        out: dict[int, tuple[str, float]] = {}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    raw = f.read()
            except OSError:
                continue
            comm = raw[raw.index("(") + 1 : raw.rindex(")")]
            rest = raw[raw.rindex(")") + 2 :].split()
            group = self._group(int(entry.name), int(rest[2]), comm)
            if group is not None:
                out[int(entry.name)] = (group, (int(rest[11]) + int(rest[12])) / self.tick)
        return out

    async def measure(self, stop: asyncio.Event) -> dict[str, float]:
        """Sample until ``stop`` is set; return the cores each group used meanwhile."""
        first = self.sample()
        last = dict(first)
        busy0, t0 = machine_busy_s(), time.monotonic()
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=0.5)
            for pid, (group, cpu) in self.sample().items():
                last[pid] = (group, cpu)
                first.setdefault(pid, (group, 0.0))
        elapsed = time.monotonic() - t0
        used = dict.fromkeys(("server", "loadgen", "postgres", "redis"), 0.0)
        for pid, (group, cpu) in last.items():
            used[group] += cpu - first[pid][1]
        cores = {k: round(v / elapsed, 2) for k, v in used.items()}
        cores["machine"] = round((machine_busy_s() - busy0) / elapsed, 2)
        cores["other"] = round(max(0.0, cores["machine"] - sum(used.values()) / elapsed), 2)
        return cores


def machine_busy_s() -> float:
    """CPU seconds all cores spent not idle since boot (/proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def run_main(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """A benchmark's entry point on uvloop, as uvicorn and ``orchestrator background`` run: the
    benchmark process's own CPU then costs what it would in the server."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main())
    else:
        uvloop.run(main())
