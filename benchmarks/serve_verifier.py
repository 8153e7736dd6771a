"""``python -m benchmarks.serve_verifier``: whether the verifier inside one ``orchestrator serve``
keeps up with workers sending results at a steady rate, on PostgreSQL + Redis.

    python -m benchmarks.serve_verifier [--nodes 8] [--rate 30] [--seconds 60] [--code DIR]
                                        [--background-process] [--py-spy FILE]

Rebuilds the benchmark database, starts ``orchestrator serve`` (the code in ``--code``, this
checkout by default; one worker, the server's, database's and verifier's settings at their
defaults, so the background loops, the verifier among them, run in the API process; only the
rate limits are lifted) and sets up one pool with a reward per sample and ``--nodes`` member
nodes, each its own provider and address. Then the nodes run claim -> result cycles over HTTP
for ``--seconds``, paced so that together they send ``--rate`` results a second (a node that
falls behind its pace goes on at once, it does not catch up), while the verifier decides them.
Every 5 s it prints the results accepted, the verdicts decided and the backlog
(``verification_jobs`` at stage ``checks``, as ``orchestrator_verification_jobs`` reports it);
at the end the rates over the run, the backlog's growth per second, the claims' and results'
p50/p99, the CPU of the server's processes and how many verifier partition locks (batches with
a transaction open) were held and how long their transactions had been open, sampled every
0.1 s. With ``--background-process`` the API runs with
``ORCH_SERVER__BACKGROUND_LOOPS=false`` beside an ``orchestrator background`` process, the
deployment the README advises for more verdicts. ``--py-spy FILE`` records the server's
processes (``py-spy record --subprocesses``) for the run, as a speedscope file.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import asyncpg
import httpx

from benchmarks.common import (
    CpuMeter,
    add_store_args,
    create_pool,
    create_token,
    drop_redis_prefix,
    enqueue,
    free_port,
    latency_summary,
    register_nodes,
    reset_database,
    run_main,
    server_env,
    stop_server,
    wait_ready,
)
from benchmarks.loadgen import self_check
from benchmarks.sqlite_backlog import Cycles
from benchmarks.verifier import ECONOMICS

VERIFIER_LOCK = 0x5646  # orchestrator.verification.service.VERIFIER_LOCK (any --code's)

CHECKOUT = str(Path(__file__).resolve().parent.parent)
PREFIX = "orch-serve-verifier:"


def start(
    code: str, dsn: str, redis: str, port: int, *, loops: bool, log: IO[bytes], command: str = "serve"
) -> subprocess.Popen[bytes]:
    env = server_env(
        dsn,
        redis,
        prefix=PREFIX,
        extra={
            "ORCH_SERVER__TRUST_PROXY_HEADERS": "true",  # each node has its own address
            "ORCH_LIMITS__SIGNED_PER_KEY": "1000000000",
            "ORCH_SERVER__BACKGROUND_LOOPS": "true" if loops else "false",
        },
    )
    env.pop("ORCH_DB__POOL_SIZE")  # the default
    env["PYTHONPATH"] = code
    args = ["serve", "--host", "127.0.0.1", "--port", str(port)] if command == "serve" else [command]
    return subprocess.Popen(
        [sys.executable, "-m", "orchestrator.cli", *args],
        env=env,
        cwd=code,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )


def open_log(path: str) -> IO[bytes]:
    return Path(path).open("ab")


def record(pid: int, out: str, seconds: float) -> subprocess.Popen[bytes]:
    """py-spy recording the server's processes for ``seconds``."""
    command = ["py-spy", "record", "--subprocesses", "--format", "speedscope", "-o", out]
    command += ["--pid", str(pid), "--duration", str(int(seconds))]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def counts(conn: asyncpg.Connection) -> tuple[int, int]:
    """(results waiting for the verifier, verdicts decided)."""
    row = await conn.fetchrow(
        "SELECT (SELECT count(*) FROM verification_jobs WHERE stage = 'checks') AS waiting,"
        " (SELECT count(*) FROM verdicts) AS decided"
    )
    assert row is not None
    return int(row["waiting"]), int(row["decided"])


async def sample_locks(dsn: str, stop: asyncio.Event, samples: list[int], ages: list[float]) -> None:
    """Every 0.1 s, how many verifier partition locks (``service.VERIFIER_LOCK``) are held by an
    open transaction (one per batch whose transaction is open; a lane also holds its partition's
    at session level, with no transaction, while its batch is scored), and how long each
    holder's transaction has been open."""
    conn = await asyncpg.connect(dsn)
    try:
        while not stop.is_set():
            rows = await conn.fetch(
                "SELECT extract(epoch FROM now() - a.xact_start) AS age"
                " FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid"
                " WHERE l.locktype = 'advisory' AND l.granted AND l.classid = $1 AND l.objsubid = 2"
                " AND a.xact_start IS NOT NULL"  # a lane's own hold, no transaction open: not a batch
                " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())",
                VERIFIER_LOCK,
            )
            samples.append(len(rows))
            ages.extend(float(r["age"]) for r in rows if r["age"] is not None)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.1)
    finally:
        await conn.close()


async def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--rate", type=float, default=30, help="results/s all nodes together")
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--code", default=CHECKOUT, help="the checkout whose server runs")
    parser.add_argument("--background-process", action="store_true")
    parser.add_argument("--py-spy", default="", help="record the server with py-spy into FILE")
    parser.add_argument("--log", default="", help="the server's output (default: discarded)")
    add_store_args(parser)
    args = parser.parse_args()

    await reset_database(args.database)
    await drop_redis_prefix(args.redis, PREFIX)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = open_log(args.log or os.devnull)  # closed below
    procs: list[subprocess.Popen[bytes]] = []
    spy: subprocess.Popen[bytes] | None = None
    conn = await asyncpg.connect(args.database)
    try:
        server = start(args.code, args.database, args.redis, port, loops=not args.background_process, log=log)
        procs.append(server)
        await wait_ready(base, 120)
        if args.background_process:
            procs.append(
                start(args.code, args.database, args.redis, port, loops=False, log=log, command="background")
            )
        headers = {"Authorization": f"Bearer {await create_token(args.database)}"}
        async with httpx.AsyncClient(base_url=base, timeout=120) as c:
            policy = {"replication_factor": 1, "max_leases_per_node": 4, "lease_duration_s": 3600}
            pool_id = await create_pool(c, headers, "serve-verifier", policy, ECONOMICS)
            tasks = int(args.rate * args.seconds * 1.5) + 500
            await enqueue(c, headers, pool_id, tasks, key="s", verified=True)
            nodes = await register_nodes(c, args.nodes, pool_ids=[pool_id], ip_base=8192)
        self_check(base.removeprefix("http://"))
        if args.py_spy:
            spy = record(server.pid, args.py_spy, args.seconds)
        meter = CpuMeter({p.pid for p in procs}, os.getpid(), args.database.rsplit("/", 1)[1])
        stop = asyncio.Event()
        cpu = asyncio.create_task(meter.measure(stop))
        locks: list[int] = []
        ages: list[float] = []
        sampler = asyncio.create_task(sample_locks(args.database, stop, locks, ages))
        cycles = Cycles(pace_s=args.nodes / args.rate)
        waiting0, decided0 = await counts(conn)
        load = os.getloadavg()[0]
        run = asyncio.create_task(cycles.run(base, pool_id, nodes, args.seconds))
        print("  t    sent/s  verdicts/s  waiting")
        t0, last_done, last_decided = time.monotonic(), 0, decided0
        while not run.done():
            await asyncio.wait({run}, timeout=5)
            waiting, decided = await counts(conn)
            print(
                f"{time.monotonic() - t0:5.0f}  {(cycles.done - last_done) / 5:7.1f}"
                f"  {(decided - last_decided) / 5:10.1f}  {waiting:7d}"
            )
            last_done, last_decided = cycles.done, decided
        seconds = run.result()
        waiting1, decided1 = await counts(conn)
        stop.set()
        cores = await cpu
        await sampler
    finally:
        if spy is not None:
            spy.wait(timeout=60)
        for p in reversed(procs):
            stop_server(p)
        await conn.close()
        log.close()
    deployment = "serve + background" if args.background_process else "serve (loops in the API process)"
    print(f"code={args.code} {deployment} nodes={args.nodes} rate={args.rate}", end=" ")
    print(f"cores={os.cpu_count()} load={load:.1f}")
    rate = cycles.done / seconds
    print(f"results: {cycles.done} in {seconds:.1f} s = {rate:.1f}/s errors={dict(cycles.errors)}")
    decided = decided1 - decided0
    print(
        f"verifier: {decided} decided = {decided / seconds:.1f} verdicts/s;"
        f" waiting {waiting0} -> {waiting1} ({(waiting1 - waiting0) / seconds:+.1f}/s)"
    )
    print(f"claim  {latency_summary(cycles.claims)}")
    print(f"result {latency_summary(cycles.results)}")
    print(f"cores: {cores}")
    mean = sum(locks) / max(1, len(locks))
    print(f"partition locks held (open verifier batches): mean {mean:.2f} max {max(locks, default=0)}")
    ages.sort()
    if ages:
        p50, p99 = ages[len(ages) // 2], ages[min(len(ages) - 1, int(len(ages) * 0.99))]
        print(f"their transactions' age when sampled: p50 {p50:.2f} s p99 {p99:.2f} s max {ages[-1]:.2f} s")


if __name__ == "__main__":
    run_main(main)
