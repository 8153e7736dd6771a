"""Claim throughput: the HTTP API against a raw asyncpg SKIP LOCKED loop on the same database.

    python -m benchmarks.claims [--pollers 64] [--seconds 20] [--workers 1] [--tasks 20000]

Needs PostgreSQL and Redis (defaults: postgres@127.0.0.1:5432, database ``orch_bench``, created
if missing and rebuilt on every run; redis://127.0.0.1:6379/15). It starts ``orchestrator serve``
as a subprocess on 127.0.0.1, registers one node per poller, and then measures, in the same run:

* api: every poller loops claim (max_tasks=1) -> signed result, over HTTP;
* raw: as many asyncpg connections loop ``SELECT ... FOR UPDATE SKIP LOCKED`` -> UPDATE leased ->
  UPDATE done on a plain jobs table in the same database (the floor any queue on PostgreSQL pays).

It prints claims/s for both, their ratio, and p50/p99 claim latency. Machines here are small and
noisy, so only the ratio measured in one run means anything.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import httpx

from orchestrator.core.keys import attest_node, generate_key, key_id_of
from orchestrator.core.signing import SignatureAuth

DEFAULT_DB = "postgresql://postgres@127.0.0.1:5432/orch_bench"
DEFAULT_REDIS = "redis://127.0.0.1:6379/15"


@dataclass
class Stats:
    latencies: list[float] = field(default_factory=list)
    done: int = 0
    errors: int = 0

    def line(self, name: str, seconds: float) -> dict[str, Any]:
        lat = sorted(self.latencies) or [0.0]
        return {
            "path": name,
            "claims_per_s": round(self.done / seconds, 1),
            "p50_ms": round(statistics.median(lat) * 1000, 2),
            "p99_ms": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1000, 2),
            "claims": self.done,
            "errors": self.errors,
        }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def reset_database(dsn: str) -> None:
    admin_dsn = dsn.rsplit("/", 1)[0] + "/postgres"
    name = dsn.rsplit("/", 1)[1]
    conn = await asyncpg.connect(admin_dsn)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()


def start_server(dsn: str, redis_url: str, port: int, workers: int, log: Any) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "ORCH_DB__URL": dsn.replace("postgresql://", "postgresql+asyncpg://"),
        "ORCH_REDIS__URL": redis_url,
        "ORCH_LOG_LEVEL": "WARNING",
        "ORCH_HEARTBEAT__INTERVAL_S": "120",
        "ORCH_LIMITS__REGISTRATION_PER_IP": "100000",
        "ORCH_DB__POOL_SIZE": "40",
    }
    return subprocess.Popen(
        [sys.executable, "-m", "orchestrator.cli", "serve", "--port", str(port), "--workers", str(workers)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


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
    from orchestrator.core.db import make_engine, make_sessionmaker
    from orchestrator.settings import DatabaseSettings

    engine = make_engine(DatabaseSettings(url=dsn.replace("postgresql://", "postgresql+asyncpg://")))
    try:
        async with make_sessionmaker(engine)() as session, session.begin():
            token, _ = await make(session, role=Role.admin, name="bench")
            return token
    finally:
        await engine.dispose()


async def setup_pool(base: str, token: str, pollers: int, tasks: int) -> tuple[str, list[Any]]:
    headers = {"Authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(base_url=base, timeout=120) as c:
        r = await c.post(
            "/v1/admin/pools",
            headers=headers,
            json={
                "name": "bench",
                "policy": {"replication_factor": 1, "max_leases_per_node": 4, "lease_duration_s": 3600},
            },
        )
        r.raise_for_status()
        pool_id = r.json()["id"]
        (await c.post(f"/v1/admin/pools/{pool_id}/activate", headers=headers)).raise_for_status()
        (
            await c.post(
                f"/v1/admin/pools/{pool_id}/policies",
                headers=headers,
                json={"step": 1, "uri": "s3://bench", "sha256": "a" * 64, "size": 1},
            )
        ).raise_for_status()
        for start in range(0, tasks, 10_000):
            n = min(10_000, tasks - start)
            batch = [{"problem_ref": f"p/{start + i}", "sampling": {"max_tokens": 16}} for i in range(n)]
            (
                await c.post(
                    f"/v1/admin/pools/{pool_id}/tasks",
                    headers=headers,
                    json={"batch_key": f"b{start}", "tasks": batch},
                )
            ).raise_for_status()
        nodes = []
        for _ in range(pollers):
            provider, node = generate_key(), generate_key()
            (await c.post("/v1/providers", json={}, auth=SignatureAuth(provider))).raise_for_status()
            (
                await c.post(
                    "/v1/nodes",
                    auth=SignatureAuth(node),
                    json={
                        "provider_id": key_id_of(provider),
                        "attestation": attest_node(provider, key_id_of(node)),
                        "specs": {
                            "gpu_model": "H100",
                            "gpu_count": 1,
                            "gpu_memory_mb": 80000,
                            "cpu_cores": 8,
                            "ram_mb": 65536,
                        },
                        "version": "bench",
                    },
                )
            ).raise_for_status()
            (await c.post(f"/v1/pools/{pool_id}/join", json={}, auth=SignatureAuth(node))).raise_for_status()
            (await c.post("/v1/nodes/me/heartbeat", json={}, auth=SignatureAuth(node))).raise_for_status()
            nodes.append(node)
    return pool_id, nodes


async def api_phase(base: str, pool_id: str, nodes: list[Any], seconds: float) -> Stats:
    stats = Stats()
    stop = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=len(nodes) + 4, max_keepalive_connections=len(nodes) + 4)

    async with httpx.AsyncClient(base_url=base, timeout=60, limits=limits) as c:

        async def poller(key: Any) -> None:
            auth = SignatureAuth(key)
            while time.monotonic() < stop:
                try:
                    await cycle(auth)
                except httpx.TransportError:
                    stats.errors += 1

        async def cycle(auth: SignatureAuth) -> None:
            t0 = time.perf_counter()
            r = await c.post("/v1/assignments/claim", json={"pool_id": pool_id, "max_tasks": 1}, auth=auth)
            stats.latencies.append(time.perf_counter() - t0)
            if r.status_code != 200 or not r.json()["leases"]:
                stats.errors += 1
                await asyncio.sleep(0.05)
                return
            lease = r.json()["leases"][0]
            body = {
                "fencing_token": lease["fencing_token"],
                "policy_step": lease["policy"]["step"],
                "seed": lease["seed"],
                "samples": [
                    {"completion": "42", "finish_reason": "stop", "prompt_tokens": 5, "completion_tokens": 1}
                ],
            }
            s = await c.post(f"/v1/assignments/{lease['assignment_id']}/result", json=body, auth=auth)
            if s.status_code == 201:
                stats.done += 1
            else:
                stats.errors += 1

        await asyncio.gather(*(poller(k) for k in nodes))
    return stats


async def raw_phase(dsn: str, workers: int, jobs: int, seconds: float) -> Stats:
    conn = await asyncpg.connect(dsn)
    await conn.execute("DROP TABLE IF EXISTS bench_jobs")
    await conn.execute(
        "CREATE TABLE bench_jobs (id bigserial PRIMARY KEY, status text NOT NULL DEFAULT 'open', "
        "node text, payload text)"
    )
    await conn.execute(
        "INSERT INTO bench_jobs (payload) SELECT 'p/' || g FROM generate_series(1, $1) g", jobs
    )
    await conn.execute("CREATE INDEX ON bench_jobs (id) WHERE status = 'open'")
    await conn.close()
    pool = await asyncpg.create_pool(dsn, min_size=workers, max_size=workers)
    stats = Stats()
    stop = time.monotonic() + seconds

    async def worker(i: int) -> None:
        while time.monotonic() < stop:
            t0 = time.perf_counter()
            async with pool.acquire() as c, c.transaction():
                row = await c.fetchrow(
                    "SELECT id, payload FROM bench_jobs WHERE status = 'open' ORDER BY id "
                    "LIMIT 1 FOR UPDATE SKIP LOCKED"
                )
                if row is None:
                    return  # the queue is empty: this worker is done
                await c.execute(
                    "UPDATE bench_jobs SET status = 'leased', node = $2 WHERE id = $1", row["id"], str(i)
                )
            stats.latencies.append(time.perf_counter() - t0)
            async with pool.acquire() as c:
                await c.execute(
                    "UPDATE bench_jobs SET status = 'done' WHERE id = $1 AND node = $2", row["id"], str(i)
                )
            stats.done += 1

    await asyncio.gather(*(worker(i) for i in range(workers)))
    await pool.close()
    return stats


async def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pollers", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--workers", type=int, default=1, help="uvicorn worker processes")
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--raw-jobs", type=int, default=300_000, help="rows in the raw loop's queue")
    parser.add_argument("--database", default=os.environ.get("ORCH_BENCH_DATABASE_URL", DEFAULT_DB))
    parser.add_argument("--redis", default=os.environ.get("ORCH_BENCH_REDIS_URL", DEFAULT_REDIS))
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--server-log", default="benchmarks/out/server.log", help="the server's output")
    args = parser.parse_args()

    await reset_database(args.database)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = Path(args.server_log)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    server = start_server(args.database, args.redis, port, args.workers, log_path.open("wb"))  # noqa: ASYNC230
    try:
        await wait_ready(base)
        token = await create_token(args.database)
        pool_id, nodes = await setup_pool(base, token, args.pollers, args.tasks)
        api = await api_phase(base, pool_id, nodes, args.seconds)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
    raw = await raw_phase(args.database, args.pollers, args.raw_jobs, args.seconds)

    rows = [
        api.line("api: claim + signed result (HTTP)", args.seconds),
        raw.line("raw: asyncpg SKIP LOCKED claim + done", args.seconds),
    ]
    ratio = rows[0]["claims_per_s"] / rows[1]["claims_per_s"] if rows[1]["claims_per_s"] else 0.0
    print(
        f"\npollers={args.pollers} seconds={args.seconds} uvicorn_workers={args.workers} "
        f"cores={os.cpu_count()}"
    )
    print(f"{'path':42} {'claims/s':>10} {'p50 ms':>9} {'p99 ms':>9} {'claims':>8} {'errors':>7}")
    for r in rows:
        print(
            f"{r['path']:42} {r['claims_per_s']:>10} {r['p50_ms']:>9} {r['p99_ms']:>9} {r['claims']:>8} "
            f"{r['errors']:>7}"
        )
    print(f"ratio api/raw = {ratio:.3f} (target >= 0.5)")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "ratio": ratio, "args": vars(args)}, indent=2))  # noqa: ASYNC240


if __name__ == "__main__":
    asyncio.run(main())
