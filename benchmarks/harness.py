"""``python -m benchmarks``: throughput and latency of every hot path, each against a baseline
measured in the same run, on PostgreSQL + Redis.

    python -m benchmarks [--workers 1] [--duration 10] [--sustained 60] [--node-counts 1000,10000,100000]
                         [--json benchmarks/out/results.json] [--profile heartbeat,claim_b1,...]

What it does, in order (see README "Benchmarks"):

1. Ed25519 verifications/s on one core (PyNaCl), plus whole RFC 9421 request verifications/s.
2. Rebuilds the benchmark database (default ``orch_bench``), starts ``orchestrator serve
   --workers N`` on 127.0.0.1 with its background loops on, and a load generator in a spawned
   process (``benchmarks.loadgen``): server and client never share an event loop.
3. ``bare``: ``GET /healthz`` on the same server, the baseline for signed paths (twice: at the
   start and before the result phase; the ratio uses their mean).
4. ``heartbeat@N``: signed heartbeats from a random sample of N registered nodes, N = 1k, 10k,
   100k; nodes beyond the few registered over HTTP are inserted in bulk (SQL COPY, and the
   hot store's liveness set), as registering 100k over HTTP would take too long.
5. ``claim_b1`` / ``claim_b10``: claim-only (each node takes 1 or 10 tasks per request and keeps
   the leases) against ``raw_b1`` / ``raw_b10``: an asyncpg ``SELECT ... LIMIT k FOR UPDATE SKIP
   LOCKED`` + ``UPDATE`` loop with as many connections, on a plain table of the same database.
6. ``results``: the leases from 5 submitted as signed results, against ``bare``.
7. ``e2e``: simulated workers claim, answer and submit; the verifier decides and the ledger
   credits rewards; verified rollouts/s = verdicts decided per second.
8. ``sustained``: claim -> result cycles (batch 1) for ``--sustained`` seconds, throughput per
   window and its decay from the first to the last window, against ``raw_cycle`` (SKIP LOCKED
   claim + done, as in ``benchmarks.claims``).

The table and a JSON file (``--json``) carry every number; targets are checked at the end.
Machines here are small and noisy: only ratios measured in one run mean much.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import datetime as dt
import json
import multiprocessing
import os
import platform
import random
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import asyncpg
import httpx
from nacl.signing import SigningKey

from benchmarks import loadgen, profiling
from benchmarks.common import (
    CpuMeter,
    add_store_args,
    create_pool,
    create_token,
    drop_redis_prefix,
    enqueue,
    free_port,
    prepare_raw,
    register_nodes,
    reset_database,
    server_env,
    start_server,
    stop_server,
    wait_ready,
)
from orchestrator.core.keys import attest_node, key_id_of

TARGETS = {
    "heartbeat_vs_bare": 0.50,
    "claims_vs_raw": 0.50,
    "sustained_decay_max": 0.20,
    "batch_claims_tasks_per_s": 10_000,
    "results_vs_bare": 0.40,
    "heartbeat_growth_max": 1.20,
}


async def wait_until_quiet(meter: CpuMeter, max_wait_s: float, busy_cores: float = 0.3) -> float:
    """Wait (up to ``max_wait_s``) until processes other than the benchmark's own use at most
    ``busy_cores`` over 5 s; return what they used last. On a shared host this keeps other jobs
    out of the numbers (the ``other`` column shows what remained)."""
    deadline = time.monotonic() + max_wait_s
    while True:
        stop = asyncio.Event()
        task = asyncio.create_task(meter.measure(stop))
        await asyncio.sleep(5)
        stop.set()
        other = (await task)["other"]
        if other <= busy_cores or time.monotonic() >= deadline:
            return other
        print(f"  other processes busy ({other:.2f} cores); waiting for a quiet machine ...", flush=True)


# ------------------------------------------------------------------ bulk nodes


async def bulk_nodes(dsn: str, redis_url: str, prefix: str, count: int, *, tag: int) -> list[bytes]:
    """Insert ``count`` healthy nodes (with real keys and attestations, 100 per provider) by COPY,
    and put them in the hot store's liveness set as if they had just beaten. Returns their seeds."""
    import redis.asyncio as aioredis

    seeds = [os.urandom(32) for _ in range(count)]
    node_ids = [key_id_of(SigningKey(s)) for s in seeds]
    now = dt.datetime.now(dt.UTC)
    providers: list[tuple[Any, ...]] = []
    nodes: list[dict[str, Any]] = []
    provider_key = SigningKey.generate()
    for i, node_id in enumerate(node_ids):
        if i % 100 == 0:
            provider_key = SigningKey.generate()
            providers.append((key_id_of(provider_key), f"bulk-{tag}-{i // 100}", "10.250.0.1", now))
        n = tag * 1_000_000 + i
        nodes.append(
            {
                "id": node_id,
                "provider_id": key_id_of(provider_key),
                "attestation": attest_node(provider_key, node_id),
                "gpu_model": "H100",
                "gpu_count": 1,
                "gpu_memory_mb": 80000,
                "cpu_cores": 8,
                "ram_mb": 65536,
                "version": "bench-bulk",
                "ip_address": f"172.{16 + n // 16_777_216 % 16}.{n // 65536 % 256}.{n // 256 % 256}",
                "status": "healthy",
                "status_changed_at": now,
                "ban_reason": None,
                "created_at": now,
                "updated_at": now,
            }
        )
    conn = await asyncpg.connect(dsn)
    try:
        columns = await conn.fetch(
            "SELECT column_name, is_nullable, column_default FROM information_schema.columns "
            "WHERE table_name = 'nodes' AND table_schema = 'public'"
        )
        names = [c["column_name"] for c in columns]
        missing = [
            c["column_name"]
            for c in columns
            if c["column_name"] not in nodes[0] and c["is_nullable"] == "NO" and c["column_default"] is None
        ]
        if missing:
            raise RuntimeError(f"bulk_nodes does not know how to fill nodes.{missing}")
        names = [n for n in names if n in nodes[0]]
        await conn.copy_records_to_table(
            "providers", records=providers, columns=["id", "display_name", "registered_ip", "created_at"]
        )
        await conn.copy_records_to_table(
            "nodes", records=[tuple(r[n] for n in names) for r in nodes], columns=names
        )
        await conn.execute("ANALYZE nodes")
    finally:
        await conn.close()
    client = aioredis.Redis.from_url(redis_url)
    try:
        at = time.time()
        for start in range(0, count, 10_000):
            await client.zadd(prefix + "live:healthy", dict.fromkeys(node_ids[start : start + 10000], at))
    finally:
        await client.aclose()
    return seeds


# ------------------------------------------------------------------ the run


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.results: dict[str, Any] = {}
        self.profiles: dict[str, Any] = {}
        self.executor = concurrent.futures.ProcessPoolExecutor(
            max_workers=1, mp_context=multiprocessing.get_context("spawn")
        )
        self.port = free_port()
        self.prefix = f"bench:{uuid.uuid4().hex[:8]}:"
        self.server: subprocess.Popen[bytes] | None = None
        self.meter: CpuMeter | None = None

    async def loadgen(self, spec: dict[str, Any]) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        result: dict[str, Any] = await loop.run_in_executor(self.executor, loadgen.run, spec)
        return result

    async def phase(
        self, name: str, spec: dict[str, Any], *, keep: bool = True, quiet_wait: bool = True
    ) -> dict[str, Any]:
        """Run one load-generator phase, with CPU accounting and (if asked) a py-spy profile."""
        spec = {"port": self.port, "warmup_s": self.args.warmup, **spec}
        assert self.meter is not None
        if self.args.quiet_wait and quiet_wait:
            await wait_until_quiet(self.meter, self.args.quiet_wait)
        profiler = None
        if name in self.args.profile and self.server is not None:
            profiler = profiling.start(
                self.server.pid,
                spec.get("duration_s", 10),
                Path(self.args.out_dir) / f"profile-{name}.txt",
                subprocesses=self.args.workers > 1,
            )
        assert self.meter is not None
        stop = asyncio.Event()
        meter = asyncio.create_task(self.meter.measure(stop))
        try:
            out = await self.loadgen(spec)
        finally:
            stop.set()
            cores = await meter
        out["cpu_cores"] = cores
        if out.get("per_s"):
            # What one operation costs the service: server + PostgreSQL + Redis CPU per unit
            # (per request, or per task for claims). Robust to other load on a shared machine,
            # unlike the throughput.
            own = cores.get("server", 0) + cores.get("postgres", 0) + cores.get("redis", 0)
            out["cpu_ms_per_op"] = round(1000 * own / out["per_s"], 3)
            out["server_cpu_ms_per_op"] = round(1000 * cores.get("server", 0) / out["per_s"], 3)
        if profiler is not None:
            await asyncio.to_thread(profiler.wait, 120)
            path = Path(self.args.out_dir) / f"profile-{name}.txt"
            if path.exists():
                self.profiles[name] = profiling.summarise(path)
                print(profiling.render(name, self.profiles[name]))
        slim = {k: v for k, v in out.items() if k != "leases"}
        if keep:
            self.results[name] = slim
        print(f"  {name:16} {self._brief(slim)}", flush=True)
        return out

    @staticmethod
    def _brief(r: dict[str, Any]) -> str:
        return (
            f"{r.get('per_s', 0):>9}/s  p50 {r.get('p50_ms', 0)} ms  p99 {r.get('p99_ms', 0)} ms  "
            f"n={r.get('ok', 0)}  statuses={r.get('statuses')}  cpu={r.get('cpu_cores')}"
            + (f"  errors={r['errors']}" if r.get("errors") else "")
        )

    async def run(self) -> None:
        args = self.args
        out_dir = Path(args.out_dir)
        await asyncio.to_thread(out_dir.mkdir, parents=True, exist_ok=True)
        self.results["machine"] = machine()
        self.results["args"] = dict(vars(args))
        loadgen_pid = (await self.loadgen({"kind": "pid"}))["pid"]
        await self.loadgen({"kind": "self_check"})
        print("ed25519 (one core) ...", flush=True)
        self.results["ed25519"] = await self.loadgen({"kind": "ed25519", "duration_s": 2.0})
        print(f"  {self.results['ed25519']}", flush=True)

        await reset_database(args.database)
        log = (out_dir / "server.log").open("wb")
        extra = {
            "ORCH_SERVER__TRUST_PROXY_HEADERS": "true",  # each simulated node has its own address
            "ORCH_HEARTBEAT__INTERVAL_S": "3600",  # bulk nodes stay healthy for the whole run
            # A simulated node sends far more than a real one; the limit is still counted
            # (the same Redis script), only set out of reach.
            "ORCH_LIMITS__SIGNED_PER_KEY": "1000000000",
            # A fixed pool, shared out over the workers: overflow connections are closed on
            # return, so a pool smaller than the load opens a connection per request.
            "ORCH_DB__POOL_SIZE": str(max(5, args.db_pool // args.workers)),
            "ORCH_DB__MAX_OVERFLOW": "0",
        }
        if args.background_process:
            extra["ORCH_SERVER__BACKGROUND_LOOPS"] = "false"
        self.server = start_server(
            args.database, args.redis, self.port, args.workers, log, prefix=self.prefix, extra_env=extra
        )
        background = None
        try:
            await wait_ready(f"http://127.0.0.1:{self.port}", within_s=120)  # schema migrated
            if args.background_process:
                # Its own process group, counted as the server's CPU and stopped with it.
                extra.pop("ORCH_SERVER__BACKGROUND_LOOPS")
                background = subprocess.Popen(  # noqa: ASYNC220 - once, at start-up, like start_server
                    [sys.executable, "-m", "orchestrator.cli", "background"],
                    env=server_env(args.database, args.redis, prefix=self.prefix, extra=extra),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            groups = {self.server.pid} | ({background.pid} if background is not None else set())
            self.meter = CpuMeter(groups, loadgen_pid, args.database.rsplit("/", 1)[1])
            await self.scenario()
        finally:
            if background is not None:
                stop_server(background)
            stop_server(self.server)
            log.close()
            self.executor.shutdown(wait=True, cancel_futures=True)
            await drop_redis_prefix(args.redis, self.prefix)

    async def scenario(self) -> None:
        args = self.args
        base = f"http://127.0.0.1:{self.port}"
        headers = {"Authorization": f"Bearer {await create_token(args.database)}"}
        d = args.duration
        async with httpx.AsyncClient(base_url=base, timeout=300) as c:
            print("set-up: pools, nodes, tasks ...", flush=True)
            t0 = time.perf_counter()
            lease_policy = {"replication_factor": 1, "lease_duration_s": 3600, "audit_rate_floor": 0.0}
            pools = {
                name: await create_pool(
                    c, headers, f"bench-{name}", {**lease_policy, "max_leases_per_node": cap}
                )
                for name, cap in (("b1", 1024), ("b10", 1024), ("cycle", 4))
            }
            pools["e2e"] = await create_pool(
                c,
                headers,
                "bench-e2e",
                {**lease_policy, "max_leases_per_node": 4},
                economics={"reward_per_sample": 1, "reward_hold_s": 0},
            )
            groups: dict[str, list[SigningKey]] = {}
            for i, (name, count) in enumerate(
                (
                    ("b1", args.pollers),
                    ("b10", args.pollers),
                    ("cycle", args.pollers),
                    ("e2e", args.e2e_workers),
                )
            ):
                groups[name] = await register_nodes(c, count, pool_ids=[pools[name]], ip_base=(i + 1) * 4096)
            registered = sum(len(g) for g in groups.values())
            enqueue_s = 0.0
            enqueued = 0
            for name, n in (
                ("b1", args.tasks_b1),
                ("b10", args.tasks_b10),
                ("cycle", args.tasks_cycle),
                ("e2e", args.tasks_e2e),
            ):
                enqueue_s += await enqueue(c, headers, pools[name], n, key=name, verified=name == "e2e")
                enqueued += n
            self.results["setup"] = {
                "seconds": round(time.perf_counter() - t0, 1),
                "nodes_over_http": registered,
                "tasks_enqueued": enqueued,
                "enqueue_tasks_per_s": round(enqueued / enqueue_s, 1),
            }
            print(f"  {self.results['setup']}", flush=True)

        dsn = args.database
        seeds: list[bytes] = []
        bare = [await self.phase("bare", {"kind": "bare", "concurrency": args.concurrency, "duration_s": d})]

        # ---- heartbeats with 1k, 10k, 100k registered nodes
        rng = random.Random(7)
        for target in args.node_counts:
            have = registered + len(seeds)
            if target > have:
                print(f"bulk-inserting {target - have} nodes ...", flush=True)
                seeds += await bulk_nodes(dsn, args.redis, self.prefix, target - have, tag=len(seeds))
            sample = rng.sample(seeds, min(args.hb_sample, len(seeds)))
            await self.phase(
                f"heartbeat@{target}",
                {
                    "kind": "heartbeat",
                    "seeds": sample,
                    "concurrency": args.concurrency,
                    "duration_s": d,
                    "budget": int(d * args.presign_rate),
                },
            )

        # ---- claims, batch 1 and 10, against raw SKIP LOCKED
        leases: list[dict[str, Any]] = []
        for batch in (1, 10):
            out = await self.phase(
                f"claim_b{batch}",
                {
                    "kind": "claims",
                    "pool_id": pools[f"b{batch}"],
                    "batch": batch,
                    "seeds": [bytes(k) for k in groups[f"b{batch}"]],
                    "duration_s": d,
                    "budget": max(50, int(d * args.presign_rate / batch / len(groups[f"b{batch}"]))),
                },
            )
            leases += out["leases"]
            await prepare_raw(dsn, max(200_000, int(30_000 * (d + args.warmup))))
            await self.phase(
                f"raw_b{batch}",
                {
                    "kind": "raw",
                    "dsn": dsn,
                    "mode": "lease",
                    "batch": batch,
                    "concurrency": args.raw_connections,
                    "duration_s": d,
                },
            )

        # ---- signed results for those leases, against bare again
        bare.append(
            await self.phase("bare#2", {"kind": "bare", "concurrency": args.concurrency, "duration_s": d})
        )
        random.Random(11).shuffle(leases)
        await self.phase(
            "results",
            {
                "kind": "results",
                "leases": leases,
                "concurrency": args.concurrency,
                "duration_s": d,
                "budget": int(d * args.presign_rate),
            },
        )
        self.results["bare_mean_per_s"] = round(sum(b["per_s"] for b in bare) / len(bare), 1)

        # ---- end to end: claim, result, verification, ledger
        await self.drain_verifier("before_e2e")
        await self.e2e(dsn, pools["e2e"], groups["e2e"])
        await self.drain_verifier("before_sustained")

        # ---- sustained claim -> result cycles, against raw claim + done
        await self.phase(
            "sustained",
            {
                "kind": "cycle",
                "pool_id": pools["cycle"],
                "batch": 1,
                "seeds": [bytes(k) for k in groups["cycle"]],
                "duration_s": args.sustained,
            },
        )
        await prepare_raw(dsn, max(200_000, int(30_000 * (d + args.warmup))))
        await self.phase(
            "raw_cycle",
            {
                "kind": "raw",
                "dsn": dsn,
                "mode": "cycle",
                "batch": 1,
                "concurrency": args.raw_connections,
                "duration_s": d,
            },
        )

    async def drain_verifier(self, name: str, max_s: float = 300) -> None:
        """Let the verifier finish the results of earlier phases (it runs in the server's
        processes), so the next phase starts on an idle server; record its drain rate."""
        conn = await asyncpg.connect(self.args.database)
        try:
            query = "SELECT count(*) FROM verification_jobs WHERE stage = 'checks'"
            start = int(await conn.fetchval(query))
            t0 = time.monotonic()
            left = start
            while left and time.monotonic() - t0 < max_s:
                await asyncio.sleep(1)
                left = int(await conn.fetchval(query))
        finally:
            await conn.close()
        elapsed = time.monotonic() - t0
        done = start - left
        self.results[f"verifier_drain_{name}"] = {
            "jobs": done,
            "seconds": round(elapsed, 1),
            "jobs_per_s": round(done / elapsed, 1) if done and elapsed else None,
            "left": left,
        }
        if done:
            print(
                f"  verifier drained {done} jobs in {elapsed:.1f} s ({done / elapsed:.1f}/s); {left} left",
                flush=True,
            )

    async def e2e(self, dsn: str, pool_id: str, nodes: Sequence[SigningKey]) -> None:
        """Verified rollouts/s: verdicts the verifier decides while simulated workers run the
        claim -> result loop (audit replicas included: a new node's results are audited until
        it has a record, and an audited result waits for its second replica)."""
        conn = await asyncpg.connect(dsn)

        async def counts() -> dict[str, int]:
            row = await conn.fetchrow(
                "SELECT (SELECT count(*) FROM verdicts WHERE pool_id = $1) AS verdicts, "
                "(SELECT count(*) FROM verdicts WHERE pool_id = $1 "
                "   AND outcome = 'accepted') AS accepted, "
                "(SELECT count(*) FROM submissions WHERE pool_id = $1) AS submissions, "
                "(SELECT count(*) FROM ledger_transfers) AS transfers, "
                "(SELECT count(*) FROM verification_jobs WHERE pool_id = $1 "
                "   AND stage = 'checks') AS pending_checks, "
                "(SELECT count(*) FROM verification_jobs WHERE pool_id = $1 "
                "   AND stage = 'quorum') AS waiting_quorum",
                pool_id,
            )
            return dict(row)

        try:
            if self.args.quiet_wait:
                assert self.meter is not None
                await wait_until_quiet(self.meter, self.args.quiet_wait)
            before = await counts()
            t0 = time.monotonic()
            out = await self.phase(
                "e2e",
                {
                    "kind": "cycle",
                    "pool_id": pool_id,
                    "batch": 1,
                    "answer": "4",
                    "seeds": [bytes(k) for k in nodes],
                    "duration_s": self.args.e2e_duration,
                },
                keep=False,
                quiet_wait=False,
            )
            window = time.monotonic() - t0
            after = await counts()
            # After the load: the verifier catches up with this phase's results.
            drain_deadline = time.monotonic() + 300
            while (last := await counts())["pending_checks"] and time.monotonic() < drain_deadline:  # noqa: ASYNC110
                await asyncio.sleep(0.5)
            until_drained = time.monotonic() - t0
            latency = await conn.fetchrow(
                "WITH d AS (SELECT extract(epoch FROM v.decided_at - s.received_at) AS s FROM verdicts v "
                "   JOIN submissions s ON s.id = v.submission_id WHERE v.pool_id = $1) "
                "SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY s) AS p50, "
                "percentile_cont(0.99) WITHIN GROUP (ORDER BY s) AS p99 FROM d",
                pool_id,
            )
        finally:
            await conn.close()
        delta = {k: after[k] - before[k] for k in ("verdicts", "accepted", "submissions", "transfers")}
        self.results["e2e"] = {
            **{k: v for k, v in out.items() if k != "leases"},
            "results_per_s": out["per_s"],
            "verdicts_in_window": delta["verdicts"],
            "verified_per_s": round(delta["verdicts"] / window, 1),
            "accepted_in_window": delta["accepted"],
            "ledger_transfers_in_window": delta["transfers"],
            "pending_checks_at_end": after["pending_checks"],
            "drain_s_after_window": round(until_drained - window, 1),
            "verdicts_until_drained": last["verdicts"] - before["verdicts"],
            "verified_per_s_incl_drain": round((last["verdicts"] - before["verdicts"]) / until_drained, 1),
            "waiting_for_audit_replica_after_drain": last["waiting_quorum"],
            "waiting_for_audit_replica_at_end": after["waiting_quorum"],
            "verification_p50_ms": round(float(latency["p50"] or 0) * 1000, 1),
            "verification_p99_ms": round(float(latency["p99"] or 0) * 1000, 1),
        }
        e = self.results["e2e"]
        print(
            f"  e2e: {e['verified_per_s']} verdicts/s ({e['accepted_in_window']} accepted, "
            f"{e['ledger_transfers_in_window']} ledger transfers), results {e['results_per_s']}/s, "
            f"verifier backlog {e['pending_checks_at_end']} at the end of the window, drained in "
            f"{e['drain_s_after_window']} s more: {e['verified_per_s_incl_drain']} verdicts/s overall; "
            f"awaiting an audit replica {e['waiting_for_audit_replica_after_drain']}",
            flush=True,
        )


def machine() -> dict[str, Any]:
    def sh(cmd: str) -> str:
        try:
            return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""

    return {
        "nproc": sh("nproc"),
        "lscpu": sh("lscpu | head -20"),
        "memory": sh("free -h | head -2"),
        "python": platform.python_version(),
        "postgres": sh("psql -h 127.0.0.1 -U postgres -Atc 'show server_version' 2>/dev/null"),
        "redis": sh("redis-cli -h 127.0.0.1 info server 2>/dev/null | grep redis_version"),
    }


# ------------------------------------------------------------------ the report


def windows(timeline: Sequence[int], window_s: int) -> list[float]:
    full = len(timeline) - 1  # the last second is partial
    return [sum(timeline[s : s + window_s]) / window_s for s in range(0, full - window_s + 1, window_s)]


def report(
    results: dict[str, Any], args: argparse.Namespace
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    r = results
    bare = r["bare_mean_per_s"]
    rows: list[dict[str, Any]] = []

    def row(
        path: str, res: dict[str, Any], unit: str, rate: float, baseline: str, ratio: float | None
    ) -> None:
        rows.append(
            {
                "path": path,
                "rate": rate,
                "unit": unit,
                "baseline": baseline,
                "ratio": None if ratio is None else round(ratio, 3),
                "p50_ms": res.get("p50_ms"),
                "p99_ms": res.get("p99_ms"),
                "n": res.get("ok"),
                "server_cores": (res.get("cpu_cores") or {}).get("server"),
                "postgres_cores": (res.get("cpu_cores") or {}).get("postgres"),
                "loadgen_cores": (res.get("cpu_cores") or {}).get("loadgen"),
                "other_cores": (res.get("cpu_cores") or {}).get("other"),
                "cpu_ms_per_op": res.get("cpu_ms_per_op"),
            }
        )

    row("GET /healthz (bare)", r["bare"], "req/s", r["bare"]["per_s"], "-", None)
    row("GET /healthz (bare) #2", r["bare#2"], "req/s", r["bare#2"]["per_s"], "-", None)
    hb_first = None
    for n in args.node_counts:
        res = r[f"heartbeat@{n}"]
        if hb_first is None:
            hb_first = res
            row(f"signed heartbeat, {n} nodes", res, "req/s", res["per_s"], "bare", res["per_s"] / bare)
        else:
            row(
                f"signed heartbeat, {n} nodes",
                res,
                "req/s",
                res["per_s"],
                f"heartbeat {args.node_counts[0]}",
                res["per_s"] / hb_first["per_s"],
            )
    for batch in (1, 10):
        api, raw = r[f"claim_b{batch}"], r[f"raw_b{batch}"]
        row(
            f"claim, batch {batch} (API)",
            api,
            "tasks/s",
            api["per_s"],
            f"raw b{batch}",
            api["per_s"] / raw["per_s"],
        )
        row(f"raw SKIP LOCKED, batch {batch}", raw, "tasks/s", raw["per_s"], "-", None)
    row("signed result", r["results"], "req/s", r["results"]["per_s"], "bare", r["results"]["per_s"] / bare)
    e2e = r["e2e"]
    row("e2e: result accepted (201)", e2e, "rollouts/s", e2e["results_per_s"], "-", None)
    rows.append(
        {
            "path": "e2e: verified (verdict + ledger)",
            "rate": e2e["verified_per_s"],
            "unit": "verdicts/s",
            "baseline": "results",
            "ratio": round(e2e["verified_per_s"] / e2e["results_per_s"], 3) if e2e["results_per_s"] else None,
            "p50_ms": e2e["verification_p50_ms"],
            "p99_ms": e2e["verification_p99_ms"],
            "n": e2e["verdicts_in_window"],
        }
    )
    rows.append(
        {
            "path": "e2e: verified, window + drain",
            "rate": e2e["verified_per_s_incl_drain"],
            "unit": "verdicts/s",
            "baseline": "results",
            "ratio": round(e2e["verified_per_s_incl_drain"] / e2e["results_per_s"], 3)
            if e2e["results_per_s"]
            else None,
            "n": e2e["verdicts_until_drained"],
        }
    )
    for key, label in (("verifier_drain_before_e2e", "verifier drain, idle server"),):
        drain = r.get(key) or {}
        if drain.get("jobs_per_s"):
            rows.append(
                {
                    "path": label,
                    "rate": drain["jobs_per_s"],
                    "unit": "jobs/s",
                    "n": drain["jobs"],
                    "baseline": "-",
                }
            )
    sus, raw_cycle = r["sustained"], r["raw_cycle"]
    window_s = args.window or (60 if args.sustained >= 180 else max(1, int(args.sustained // 4)))
    w = windows(sus["timeline"], window_s)
    first, last = (w[0], w[-1]) if w else (0.0, 0.0)
    decay = 1 - last / first if first else 0.0
    sus["windows_per_s"] = [round(x, 1) for x in w]
    sus["window_s"] = window_s
    sus["decay"] = round(decay, 3)
    row(
        "sustained claim+result cycle",
        sus,
        "cycles/s",
        sus["per_s"],
        "raw cycle",
        sus["per_s"] / raw_cycle["per_s"],
    )
    rows[-1]["p50_ms"], rows[-1]["p99_ms"] = sus["claim_latency"]["p50_ms"], sus["claim_latency"]["p99_ms"]
    rows.append(
        {
            "path": f"  first / last {window_s} s window",
            "rate": f"{first:.0f} / {last:.0f}",
            "unit": "cycles/s",
            "baseline": "first",
            "ratio": round(last / first, 3) if first else None,
        }
    )
    row("raw SKIP LOCKED claim + done", raw_cycle, "cycles/s", raw_cycle["per_s"], "-", None)
    ed = r["ed25519"]
    rows.append({"path": "Ed25519 verify, one core", "rate": ed["ed25519_verify_per_s"], "unit": "verify/s"})
    rows.append(
        {"path": "RFC 9421 verify_request, one core", "rate": ed["verify_request_per_s"], "unit": "req/s"}
    )

    hb_last = r[f"heartbeat@{args.node_counts[-1]}"]
    growth = (
        hb_last["cpu_ms_per_op"] / hb_first["cpu_ms_per_op"]
        if hb_first and hb_first.get("cpu_ms_per_op") and hb_last.get("cpu_ms_per_op")
        else 0.0
    )
    thr_growth = hb_first["per_s"] / hb_last["per_s"] if hb_first and hb_last["per_s"] else 0.0
    p50_growth = hb_last["p50_ms"] / hb_first["p50_ms"] if hb_first and hb_first["p50_ms"] else 0.0
    targets = [
        _target(
            "signed heartbeats >= 50% of bare",
            hb_first["per_s"] / bare if hb_first else 0,
            ">=",
            TARGETS["heartbeat_vs_bare"],
        ),
        _target(
            "claims (batch 1) >= 50% of raw SKIP LOCKED",
            r["claim_b1"]["per_s"] / r["raw_b1"]["per_s"],
            ">=",
            TARGETS["claims_vs_raw"],
        ),
        _target("sustained claim cycle decay < 20%", decay, "<", TARGETS["sustained_decay_max"]),
        _target(
            "batch claims >= 10k tasks/s", r["claim_b10"]["per_s"], ">=", TARGETS["batch_claims_tasks_per_s"]
        ),
        _target("results >= 40% of bare", r["results"]["per_s"] / bare, ">=", TARGETS["results_vs_bare"]),
        _target(
            f"heartbeat cost growth {args.node_counts[0]} -> {args.node_counts[-1]} nodes <= 1.2x",
            growth,
            "<=",
            TARGETS["heartbeat_growth_max"],
            note=f"CPU per heartbeat; by throughput {thr_growth:.2f}x, by p50 latency {p50_growth:.2f}x",
        ),
    ]
    return rows, targets


def _target(name: str, value: float, op: str, goal: float, note: str = "") -> dict[str, Any]:
    met = {">=": value >= goal, "<": value < goal, "<=": value <= goal}[op]
    return {"target": name, "value": round(value, 3), "goal": f"{op} {goal}", "met": met, "note": note}


def render(rows: list[dict[str, Any]], targets: list[dict[str, Any]]) -> str:
    head = (
        f"{'path':38} {'rate':>12} {'unit':10} {'vs':12} {'ratio':>7} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'n':>8} {'cpu ms':>7} {'srv':>5} {'pg':>5} {'gen':>5} {'other':>5}"
    )
    lines = [head, "-" * len(head)]

    def fmt(v: Any, width: int) -> str:
        return f"{'' if v is None else v:>{width}}"

    for r in rows:
        cells = [
            f"{r['path']:38}",
            fmt(r.get("rate"), 12),
            f"{r.get('unit', ''):10}",
            f"{r.get('baseline') or '':12}",
            fmt(r.get("ratio"), 7),
            fmt(r.get("p50_ms"), 8),
            fmt(r.get("p99_ms"), 8),
            fmt(r.get("n"), 8),
            fmt(r.get("cpu_ms_per_op"), 7),
            fmt(r.get("server_cores"), 5),
            fmt(r.get("postgres_cores"), 5),
            fmt(r.get("loadgen_cores"), 5),
            fmt(r.get("other_cores"), 5),
        ]
        lines.append(" ".join(cells))
    lines.append("")
    lines.append(
        "cpu ms: server + PostgreSQL + Redis CPU per operation (request, task or cycle); srv / pg / gen /"
        " other: CPU cores used meanwhile by the server (all workers), PostgreSQL (the benchmark"
        " database's backends), the load generator, and everything else on the machine"
    )
    lines.append("")
    for t in targets:
        mark = "MET    " if t["met"] else "NOT MET"
        lines.append(f"[{mark}] {t['target']}: {t['value']} (goal {t['goal']}) {t['note']}")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--workers", type=int, default=1, help="uvicorn worker processes of the server")
    p.add_argument("--duration", type=float, default=10, help="seconds per measured phase")
    p.add_argument("--warmup", type=float, default=2, help="seconds each phase runs before it is measured")
    p.add_argument("--sustained", type=float, default=60, help="seconds of the sustained claim cycle run")
    p.add_argument("--e2e-duration", type=float, default=20, help="seconds of the end-to-end phase")
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=0,
        help="before each phase, wait up to this many seconds for the machine to be idle (shared hosts)",
    )
    p.add_argument(
        "--window",
        type=int,
        default=0,
        help="decay window in s (default: 60 if --sustained >= 180, else a quarter)",
    )
    p.add_argument(
        "--concurrency", type=int, default=32, help="connections for bare, heartbeat and result phases"
    )
    p.add_argument(
        "--pollers", type=int, default=64, help="nodes (= connections) per claim phase, and raw connections"
    )
    p.add_argument("--e2e-workers", type=int, default=32, help="simulated workers in the end-to-end phase")
    p.add_argument(
        "--node-counts", type=lambda s: [int(x) for x in s.split(",")], default=[1000, 10_000, 100_000]
    )
    p.add_argument("--hb-sample", type=int, default=512, help="nodes that send the timed heartbeats")
    p.add_argument("--tasks-b1", type=int, default=30_000)
    p.add_argument("--tasks-b10", type=int, default=60_000)
    p.add_argument("--tasks-cycle", type=int, default=60_000)
    p.add_argument("--tasks-e2e", type=int, default=20_000)
    p.add_argument(
        "--presign-rate", type=int, default=4000, help="requests/s signed ahead per phase (upper bound)"
    )
    p.add_argument(
        "--db-pool", type=int, default=30, help="server database connections in all (split over the workers)"
    )
    p.add_argument("--raw-connections", type=int, default=32, help="connections of the raw SKIP LOCKED loops")
    p.add_argument(
        "--background-process",
        action="store_true",
        help="run the background loops (verifier etc.) in a separate `orchestrator background` "
        "process instead of in the API workers (its CPU counts as the server's)",
    )
    add_store_args(p)
    p.add_argument("--out-dir", default="benchmarks/out")
    p.add_argument("--json", default="benchmarks/out/results.json")
    p.add_argument(
        "--profile",
        type=lambda s: set(s.split(",")) if s else set(),
        default=set(),
        help="phases to profile with py-spy (e.g. heartbeat@1000,claim_b1,results); perturbs them",
    )
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    bench = Bench(args)
    started = time.time()
    asyncio.run(bench.run())
    rows, targets = report(bench.results, args)
    table = render(rows, targets)
    print()
    print(
        f"workers={args.workers} duration={args.duration}s sustained={args.sustained}s "
        f"concurrency={args.concurrency} pollers={args.pollers} cores={os.cpu_count()}"
    )
    print(table)
    payload = {
        "started_at": dt.datetime.fromtimestamp(started, dt.UTC).isoformat(),
        "wall_s": round(time.time() - started, 1),
        "rows": rows,
        "targets": targets,
        "phases": bench.results,
        "profiles": bench.profiles,
        "table": table,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(payload, indent=2, default=str))
    print(f"\nwrote {args.json}")
