"""``python -m benchmarks.verifier``: how many results per second the verifier decides, next to
how many per second the claim -> result path accepts, on PostgreSQL.

    python -m benchmarks.verifier [--results 3000] [--verifiers 1,2] [--wrong 0.1] [--feed-readers 0]

Starts the server (background loops off) only to set up one pool with a reward per sample and
``--pollers`` member nodes, each its own provider and address. Then, for each verifier count V:
``--results`` checkable tasks (expected answer 4) are enqueued, and the pollers claim and answer
them through the service layer in this process (``benchmarks.claims``' service phase), a share
``--wrong`` of them wrongly; then V processes, each a loop of the verifier's batches
(``verify_batches``, as ``orchestrator background`` runs them), decide them all. It prints the
results/s accepted, the verdicts/s decided, and the CPU per verdict of the verifier processes
and PostgreSQL. Every verdict is a real one: checks, the reward function, the node's trust, the
verdict row and, for a correct answer, the reward transfer and its hold.

With ``--feed-readers N``, N trainers read the pool's feed while the verifiers run, as a trainer
waiting for rollouts does: a page of up to 100 after their cursor, again at once when the page
was full, after 50 ms when it was not. On PostgreSQL each read first waits until no transaction
is writing verdicts (``LOCK TABLE verdicts IN SHARE MODE``, see ``orchestrator.feed.service``),
so the phase shows what the readers cost the verifiers, and the pages/s and ``feed_busy``
answers the readers got.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import asyncpg
import httpx

from benchmarks.claims import metered, service_phase
from benchmarks.common import (
    CpuMeter,
    add_store_args,
    create_pool,
    create_token,
    drop_redis_prefix,
    engine_for,
    enqueue,
    free_port,
    register_nodes,
    reset_database,
    run_main,
    server_env,
    start_server,
    stop_server,
    wait_ready,
)
from orchestrator.core.db import make_sessionmaker
from orchestrator.core.errors import ServiceUnavailable
from orchestrator.core.keys import key_id_of
from orchestrator.feed import service as feed

ECONOMICS = {"min_stake_per_node": 0, "reward_per_sample": 7, "reward_hold_s": 3600}


async def child() -> None:
    """One verifier process: says ready once imported and connected, waits for the go on
    stdin (so that start-up is not measured), then takes batches until none is left."""
    from orchestrator.core.logging import configure_logging
    from orchestrator.core.state import open_state
    from orchestrator.settings import Settings
    from orchestrator.verification.jobs import verify_batches

    settings = Settings()
    configure_logging(settings.log_level, json=settings.log_json)  # as `orchestrator background`
    state = open_state(settings)
    async with state.engine.connect():
        pass
    print("ready", flush=True)
    await asyncio.to_thread(sys.stdin.readline)
    try:
        while await verify_batches(state, budget_s=math.inf) > 0:
            pass
    finally:
        await state.engine.dispose()
        await state.hot_store.aclose()


class FeedReaders:
    """``count`` trainers reading one pool's feed until stopped (see the module doc)."""

    def __init__(self, dsn: str, pool_id: str, count: int) -> None:
        self.dsn, self.pool_id, self.count = dsn, pool_id, count
        self.pages = self.rollouts = self.busy = 0
        self.waits: list[float] = []

    async def run(self, stop: asyncio.Event) -> None:
        if not self.count:
            return
        engine = engine_for(self.dsn, self.count)
        sessions = make_sessionmaker(engine)

        async def reader() -> None:
            cursor: str | None = None
            while not stop.is_set():
                t0 = time.perf_counter()
                try:
                    async with sessions() as session, session.begin():
                        page = await feed.page(session, self.pool_id, after=cursor, limit=100)
                except ServiceUnavailable:  # feed_busy: wait as the 503's Retry-After asks
                    self.busy += 1
                    await asyncio.sleep(feed.RETRY_AFTER_S)
                    continue
                finally:
                    self.waits.append(time.perf_counter() - t0)
                self.pages += 1
                self.rollouts += len(page.items)
                cursor = page.next_cursor
                if not page.has_more:
                    await asyncio.sleep(0.05)

        try:
            await asyncio.gather(*(reader() for _ in range(self.count)))
        finally:
            await engine.dispose()


async def verify_phase(
    dsn: str, redis: str, verifiers: int, readers: FeedReaders
) -> tuple[int, float, dict[str, float]]:
    """``verifiers`` processes decide the waiting results while ``readers`` read the feed;
    returns verdicts, seconds, cores."""
    env = server_env(dsn, redis)
    conn = await asyncpg.connect(dsn)
    try:
        before = int(await conn.fetchval("SELECT count(*) FROM verdicts"))
        procs = [
            await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "benchmarks.verifier",
                "--child",
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                start_new_session=True,  # its own process group: CpuMeter's "server" group
            )
            for _ in range(verifiers)
        ]
        for p in procs:
            assert p.stdout is not None
            if (await p.stdout.readline()).strip() != b"ready":
                raise SystemExit("a verifier process did not start")
        meter = CpuMeter({p.pid for p in procs}, os.getpid(), dsn.rsplit("/", 1)[1])

        stop = asyncio.Event()
        reading = asyncio.create_task(readers.run(stop))
        t0 = time.perf_counter()
        # The go, then what the processes print (read to the end, so that a full pipe never
        # stops one) until they exit.
        try:
            _, cores = await metered(meter, asyncio.gather(*(p.communicate(b"go\n") for p in procs)))
            seconds = time.perf_counter() - t0
        finally:
            stop.set()
            await reading
        if any(p.returncode for p in procs):
            raise SystemExit(f"a verifier process failed: {[p.returncode for p in procs]}")
        verdicts = int(await conn.fetchval("SELECT count(*) FROM verdicts")) - before
        left = int(await conn.fetchval("SELECT count(*) FROM verification_jobs WHERE stage = 'checks'"))
        if left:
            raise SystemExit(f"{left} results were left unverified")
    finally:
        await conn.close()
    return verdicts, seconds, cores


async def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--results", type=int, default=3000, help="results per phase")
    parser.add_argument("--verifiers", default="1,2", help="verifier process counts, one phase each")
    parser.add_argument("--wrong", type=float, default=0.1, help="share of wrong answers")
    parser.add_argument("--pollers", type=int, default=64)
    parser.add_argument("--feed-readers", type=int, default=0, help="trainers reading the feed meanwhile")
    add_store_args(parser)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        await child()
        return

    await reset_database(args.database)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    prefix = f"bench:{uuid.uuid4().hex[:8]}:"
    extra = {"ORCH_SERVER__TRUST_PROXY_HEADERS": "true", "ORCH_SERVER__BACKGROUND_LOOPS": "false"}
    log_path = Path("benchmarks/out/server.log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    server = start_server(
        args.database,
        args.redis,
        port,
        1,
        log_path.open("wb"),  # noqa: ASYNC230
        prefix=prefix,
        extra_env=extra,
    )
    rows: list[dict[str, Any]] = []
    try:
        await wait_ready(base)
        headers = {"Authorization": f"Bearer {await create_token(args.database)}"}
        async with httpx.AsyncClient(base_url=base, timeout=120) as c:
            policy = {"replication_factor": 1, "max_leases_per_node": 4, "lease_duration_s": 3600}
            pool_id = await create_pool(c, headers, "verifier-bench", policy, ECONOMICS)
            nodes = await register_nodes(c, args.pollers, pool_ids=[pool_id], ip_base=8192)
            node_ids = [key_id_of(k.verify_key) for k in nodes]
            wrong_every = round(1 / args.wrong) if args.wrong > 0 else 0
            answers = tuple(
                "5" if wrong_every and i % wrong_every == 0 else "4" for i in range(max(wrong_every, 1))
            )
            for v in (int(x) for x in args.verifiers.split(",")):
                key = f"v{v}-{uuid.uuid4().hex[:6]}"
                await enqueue(c, headers, pool_id, args.results, key=key, verified=True)
                t0 = time.perf_counter()
                stats = await service_phase(
                    args.database, pool_id, node_ids, 3600, answers=answers, until_empty=True
                )
                accept_s = time.perf_counter() - t0
                readers = FeedReaders(args.database, pool_id, args.feed_readers)
                verdicts, seconds, cores = await verify_phase(args.database, args.redis, v, readers)
                rate = verdicts / seconds if seconds else 0.0
                waits = sorted(readers.waits) or [0.0]
                rows.append(
                    {
                        "verifiers": v,
                        "results": stats.done,
                        "results_per_s": round(stats.done / accept_s, 1),
                        "verdicts": verdicts,
                        "verdicts_per_s": round(rate, 1),
                        "verifier_cpu_ms_per_verdict": round(1000 * cores.get("server", 0) / rate, 2),
                        "postgres_cpu_ms_per_verdict": round(1000 * cores.get("postgres", 0) / rate, 2),
                        "machine_cores": cores.get("machine"),
                        "feed_pages_per_s": round(readers.pages / seconds, 1) if seconds else 0.0,
                        "feed_rollouts": readers.rollouts,
                        "feed_busy": readers.busy,
                        "feed_p99_ms": round(1000 * waits[int(0.99 * (len(waits) - 1))], 1),
                    }
                )
    finally:
        stop_server(server)
        await drop_redis_prefix(args.redis, prefix)

    print(
        f"\npollers={args.pollers} results per phase={args.results} wrong={args.wrong} cores={os.cpu_count()}"
    )
    feed_head = f"  {'feed pages/s':>12} {'busy':>5} {'p99 ms':>7}" if args.feed_readers else ""
    print(
        f"{'verifiers':>9} {'results/s in':>13} {'verdicts/s':>11} {'verifier ms':>12} {'postgres ms':>12}"
        f"  machine cores busy{feed_head}"
    )
    for r in rows:
        feed_cols = ""
        if args.feed_readers:
            feed_cols = f"  {r['feed_pages_per_s']:>12} {r['feed_busy']:>5} {r['feed_p99_ms']:>7}"
        print(
            f"{r['verifiers']:>9} {r['results_per_s']:>13} {r['verdicts_per_s']:>11} "
            f"{r['verifier_cpu_ms_per_verdict']:>12} {r['postgres_cpu_ms_per_verdict']:>12}  "
            f"{r['machine_cores']!s:>18}{feed_cols}"
        )
    print("(results/s in: accepted through the service layer, no HTTP; ms: CPU per verdict)")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "args": vars(args)}, indent=2))  # noqa: ASYNC240


if __name__ == "__main__":
    run_main(main)
