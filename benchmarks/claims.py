"""Claim throughput: the HTTP API against a raw asyncpg SKIP LOCKED loop on the same database.

    python -m benchmarks.claims [--pollers 64] [--seconds 20] [--workers 1] [--tasks N]

Needs PostgreSQL and Redis (defaults: postgres@127.0.0.1:5432, database ``orch_bench``, created
if missing and rebuilt on every run; redis://127.0.0.1:6379/15). It starts ``orchestrator serve``
as a subprocess on 127.0.0.1, registers one node per poller, and then measures, in the same run:

* api: every poller loops claim (max_tasks=1) -> signed result, over HTTP;
* service: as many coroutines in this process call the service layer's claim and result
  (``orchestrator.tasks.service``, the same SQL the routes run, one transaction each) on the same
  pool, without HTTP, the signature check or FastAPI: what the database work an API cycle asks
  for costs on its own;
* raw: as many asyncpg connections loop ``SELECT ... FOR UPDATE SKIP LOCKED`` -> UPDATE leased ->
  UPDATE done on a plain jobs table in the same database (the floor any queue on PostgreSQL pays).

It prints claims/s for each, the ratios to raw, and p50/p99 claim latency. Machines here are small and
noisy, so only the ratio measured in one run means anything.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
import uuid
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, TypeVar

import asyncpg
import orjson

from api_schemas.tasks import ResultIn
from benchmarks.common import (
    DEFAULT_DB,
    DEFAULT_REDIS,
    CpuMeter,
    Stats,
    add_store_args,
    create_token,
    drop_redis_prefix,
    engine_for,
    free_port,
    prepare_raw,
    reset_database,
    run_main,
    setup_pool,
    start_server,
    stop_server,
    wait_ready,
)
from benchmarks.loadgen import Conn, FastSigner, self_check
from orchestrator.core.clock import SystemClock
from orchestrator.core.db import make_sessionmaker
from orchestrator.core.keys import key_id_of
from orchestrator.core.signing import SignedRequest
from orchestrator.tasks import service

__all__ = ["DEFAULT_DB", "DEFAULT_REDIS", "Stats", "api_phase", "main", "raw_phase", "service_phase"]

T = TypeVar("T")
utcnow = SystemClock().utcnow
GROUPS = ("server", "postgres", "redis", "loadgen")
# The key the service phase's leases name their tasks with (nothing reads the references here).
REF_KEY = b"benchmark-task-refs"


async def metered(meter: CpuMeter, phase: Awaitable[T]) -> tuple[T, dict[str, float]]:
    """Run a phase while ``meter`` samples /proc; return its result and the cores each group
    of processes used meanwhile."""
    stop = asyncio.Event()
    sampling = asyncio.create_task(meter.measure(stop))
    try:
        result = await phase
    finally:
        stop.set()
    return result, await sampling


async def api_phase(base: str, pool_id: str, nodes: list[Any], seconds: float) -> Stats:
    """Each poller: claim one task, submit its signed result, repeat, on its own keep-alive
    connection. Requests are signed with the load generator's ``FastSigner`` (checked against
    the reference signer first), so the client's own cost stays small next to the server's."""
    host = base.removeprefix("http://")
    self_check(host)
    address, port = host.rsplit(":", 1)
    stats = Stats()
    stop = time.monotonic() + seconds
    claim_body = orjson.dumps({"pool_id": pool_id, "max_tasks": 1})

    async def poller(key: Any) -> None:
        signer = FastSigner(bytes(key), host)
        conn = Conn(address, int(port))
        try:
            while time.monotonic() < stop and stats.drained_at is None:
                try:
                    await cycle(signer, conn)
                except (OSError, asyncio.IncompleteReadError):
                    stats.errors += 1
                    await conn.close()
        finally:
            await conn.close()

    async def cycle(signer: FastSigner, conn: Conn) -> None:
        t0 = time.perf_counter()
        status, raw = await conn.request(signer.request("/v1/assignments/claim", claim_body))
        stats.latencies.append(time.perf_counter() - t0)
        out = orjson.loads(raw) if status == 200 else {}
        leases = out.get("leases")
        if not leases:
            if out.get("reason") == "no_tasks":
                stats.drained()  # every task is taken: the rate counts the time until now
                return
            stats.errors += 1
            await asyncio.sleep(0.05)
            return
        lease = leases[0]
        body = orjson.dumps(
            {
                "fencing_token": lease["fencing_token"],
                "policy_step": lease["policy"]["step"],
                "seed": lease["seed"],
                "samples": [
                    {"completion": "42", "finish_reason": "stop", "prompt_tokens": 5, "completion_tokens": 1}
                ],
            }
        )
        path = f"/v1/assignments/{lease['assignment_id']}/result"
        status, _ = await conn.request(signer.request(path, body))
        if status == 201:
            stats.done += 1
        else:
            stats.errors += 1

    await asyncio.gather(*(poller(k) for k in nodes))
    return stats


async def service_phase(
    dsn: str,
    pool_id: str,
    node_ids: list[str],
    seconds: float,
    *,
    answers: tuple[str, ...] = ("42",),
    until_empty: bool = False,
) -> Stats:
    """Each poller's claim -> result cycle through the service layer, in this process: the
    routes' own SQL and transactions, without HTTP, FastAPI or the RFC 9421 check. The stored
    evidence is a fixed stand-in (nothing checks it here). Results take ``answers`` in turn;
    with ``until_empty`` a poller stops at its first empty claim."""
    engine = engine_for(dsn, len(node_ids))
    sessions = make_sessionmaker(engine)
    stats = Stats()
    stop = time.monotonic() + seconds

    async def poller(node_id: str) -> None:
        while time.monotonic() < stop:
            t0 = time.perf_counter()
            async with sessions() as session, session.begin():
                out = await service.claim(session, node_id, pool_id, 1, now=utcnow(), ref_key=REF_KEY)
            stats.latencies.append(time.perf_counter() - t0)
            if not out.leases:
                if until_empty:
                    return
                if out.reason == "no_tasks":
                    stats.drained()
                    return
                stats.errors += 1
                await asyncio.sleep(0.05)
                continue
            lease = out.leases[0]
            body = {
                "fencing_token": lease.fencing_token,
                "policy_step": lease.policy.step,
                "seed": lease.seed,
                "samples": [
                    {
                        "completion": answers[stats.done % len(answers)],
                        "finish_reason": "stop",
                        "prompt_tokens": 5,
                        "completion_tokens": 1,
                    }
                ],
            }
            raw = orjson.dumps(body)
            signed = SignedRequest(
                keyid=node_id,
                nonce=uuid.uuid4().hex,
                created=int(time.time()),
                covered=("@method", "@target-uri", "content-digest"),
                method="POST",
                target_uri=f"http://bench/v1/assignments/{lease.assignment_id}/result",
                signature_input="sig1=()",
                signature="sig1=::",
                content_digest=None,
                body=raw,
            )
            async with sessions() as session, session.begin():
                result = await service.submit_result(
                    session,
                    signed,
                    lease.assignment_id,
                    ResultIn.model_validate(body),
                    now=utcnow(),
                    ref_key=REF_KEY,
                )
            if result.created:
                stats.done += 1
            else:
                stats.errors += 1

    try:
        await asyncio.gather(*(poller(n) for n in node_ids))
    finally:
        await engine.dispose()
    return stats


async def raw_phase(dsn: str, workers: int, seconds: float) -> Stats:
    """``workers`` connections loop claim -> done on the queue ``prepare_raw`` made."""
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
                    stats.drained()  # the queue is empty: this worker is done
                    return
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
    parser.add_argument(
        "--tasks",
        type=int,
        help="tasks enqueued for the api and service phases (default: 1,000 per second of --seconds, "
        "at least 20,000); a phase that empties the queue is timed until then",
    )
    parser.add_argument("--raw-jobs", type=int, default=300_000, help="rows in the raw loop's queue")
    add_store_args(parser)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--server-log", default="benchmarks/out/server.log", help="the server's output")
    parser.add_argument(
        "--server-env",
        action="append",
        default=[],
        metavar="ORCH_X=value",
        help="extra server setting, repeatable (e.g. ORCH_SERVER__BACKGROUND_LOOPS=false)",
    )
    args = parser.parse_args()
    if args.tasks is None:
        args.tasks = max(20_000, int(1000 * args.seconds))
    # Each poller registers from its own address (X-Forwarded-For), as in the harness.
    # A poller cycles far faster than a real node: the per-key limit is still counted (the same
    # Redis script as in production), only set out of reach.
    extra_env = {"ORCH_SERVER__TRUST_PROXY_HEADERS": "true", "ORCH_LIMITS__SIGNED_PER_KEY": "1000000000"}
    extra_env.update(item.split("=", 1) for item in args.server_env)

    database = args.database.rsplit("/", 1)[1]
    await reset_database(args.database)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = Path(args.server_log)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    prefix = f"bench:{uuid.uuid4().hex[:8]}:"
    server = start_server(
        args.database,
        args.redis,
        port,
        args.workers,
        log_path.open("wb"),  # noqa: ASYNC230
        prefix=prefix,
        extra_env=extra_env,
    )
    try:
        await wait_ready(base)
        token = await create_token(args.database)
        pool_id, nodes = await setup_pool(base, token, args.pollers, args.tasks)
        meter = CpuMeter({server.pid}, os.getpid(), database)
        api, api_cores = await metered(meter, api_phase(base, pool_id, nodes, args.seconds))
    finally:
        stop_server(server)
        await drop_redis_prefix(args.redis, prefix)
    # The same pool, its remaining tasks and nodes, through the service layer in this process.
    meter = CpuMeter(set(), os.getpid(), database)
    node_ids = [key_id_of(k.verify_key) for k in nodes]
    svc, svc_cores = await metered(meter, service_phase(args.database, pool_id, node_ids, args.seconds))
    await prepare_raw(args.database, args.raw_jobs)
    meter = CpuMeter(set(), os.getpid(), database)
    raw, raw_cores = await metered(meter, raw_phase(args.database, args.pollers, args.seconds))

    rows = [
        api.line("api: claim + signed result (HTTP)", args.seconds),
        svc.line("service: claim + result, no HTTP", args.seconds),
        raw.line("raw: asyncpg SKIP LOCKED claim + done", args.seconds),
    ]
    raw_rate = rows[2]["claims_per_s"]
    ratio = rows[0]["claims_per_s"] / raw_rate if raw_rate else 0.0
    service_ratio = rows[1]["claims_per_s"] / raw_rate if raw_rate else 0.0
    print(
        f"\npollers={args.pollers} seconds={args.seconds} uvicorn_workers={args.workers} "
        f"cores={os.cpu_count()}"
    )
    print(f"{'path':42} {'claims/s':>10} {'p50 ms':>9} {'p99 ms':>9} {'claims':>8} {'errors':>7} {'s':>6}")
    for r in rows:
        print(
            f"{r['path']:42} {r['claims_per_s']:>10} {r['p50_ms']:>9} {r['p99_ms']:>9} {r['claims']:>8} "
            f"{r['errors']:>7} {r['seconds']:>6}"
        )
    if any(r["seconds"] < args.seconds for r in rows):
        print("(s < --seconds: that phase emptied its queue then; its rate counts the time until then)")
    print(f"ratio api/raw = {ratio:.3f} (target >= 0.5); service/raw = {service_ratio:.3f}")

    # Where each claim's CPU went: the ratio cannot beat the ratio of these totals once the
    # machine is saturated, whatever the concurrency.
    cpu = {}
    print(
        f"\nCPU ms per claim   {'server':>7} {'postgres':>9} {'redis':>6} {'client':>7} {'total':>7}"
        "  machine cores busy"
    )
    phases = (("api", rows[0], api_cores), ("service", rows[1], svc_cores), ("raw", rows[2], raw_cores))
    for name, row, cores in phases:
        rate = row["claims_per_s"] or float("nan")
        per = {g: 1000 * cores.get(g, 0.0) / rate for g in GROUPS}
        per["total"] = sum(per.values())
        cpu[name] = {**{k: round(v, 3) for k, v in per.items()}, "machine_cores": cores.get("machine")}
        print(
            f"{name:18} {per['server']:>7.2f} {per['postgres']:>9.2f} {per['redis']:>6.2f} "
            f"{per['loadgen']:>7.2f} {per['total']:>7.2f}  {cores.get('machine')}"
        )
    if args.json:
        Path(args.json).write_text(  # noqa: ASYNC240
            json.dumps(
                {
                    "rows": rows,
                    "ratio": ratio,
                    "service_ratio": service_ratio,
                    "cpu_ms_per_claim": cpu,
                    "args": vars(args),
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    run_main(main)
