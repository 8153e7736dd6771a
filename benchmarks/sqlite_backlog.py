"""``python -m benchmarks.sqlite_backlog``: what workers' claims and results wait on the embedded
default (SQLite, the in-process hot store) while the verifier in ``orchestrator serve`` works a
backlog.

    python -m benchmarks.sqlite_backlog [--backlog 2500] [--pollers 8] [--seconds 30] [--code DIR]

Starts ``orchestrator serve`` (the code in ``--code``, this checkout by default) on a SQLite file
in a temporary directory with its background loops off, sets up one pool with a reward per
sample and 16 member nodes (each its own provider and address), enqueues checkable tasks and has
the nodes claim and answer ``--backlog`` of them over HTTP: results the verifier has not seen.
Then it restarts the server with its loops on (the default) and, while the verifier works that
backlog, ``--pollers`` of the nodes run closed claim -> result cycles for ``--seconds``, each on
its own keep-alive connection: the claims' and results' p50/p99, the cycles per second, and the
verdicts per second meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import IO, Any

import httpx
import orjson

from benchmarks.common import (
    create_pool,
    create_token,
    enqueue,
    free_port,
    latency_summary,
    register_nodes,
    run_main,
    server_env,
    stop_server,
    wait_ready,
)
from benchmarks.loadgen import Conn, FastSigner, self_check
from benchmarks.verifier import ECONOMICS

NODES = 16
CHECKOUT = str(Path(__file__).resolve().parent.parent)


def start(code: str, url: str, port: int, *, loops: bool, log: IO[bytes]) -> subprocess.Popen[bytes]:
    env = server_env(
        url,
        "",
        extra={
            "ORCH_SERVER__TRUST_PROXY_HEADERS": "true",  # each node has its own address
            "ORCH_LIMITS__SIGNED_PER_KEY": "1000000000",
            "ORCH_SERVER__BACKGROUND_LOOPS": "true" if loops else "false",
        },
    )
    for name in ("ORCH_REDIS__URL", "ORCH_REDIS__PREFIX", "ORCH_DB__POOL_SIZE"):
        env.pop(name)  # the embedded default: the in-process hot store
    env["PYTHONPATH"] = code
    return subprocess.Popen(
        [sys.executable, "-m", "orchestrator.cli", "serve", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        cwd=code,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )


class Cycles:
    """Closed claim -> result cycles of some nodes, each on its own connection; with ``pace_s``,
    each node starts a cycle every ``pace_s`` seconds (the nodes' starts spread over the first;
    a node behind its pace goes on at once and does not catch up)."""

    def __init__(self, pace_s: float = 0.0) -> None:
        self.pace_s = pace_s
        self.claims: list[float] = []
        self.results: list[float] = []
        self.done = 0
        self.errors: Counter[str] = Counter()

    async def run(self, base: str, pool_id: str, nodes: list[Any], seconds: float, limit: int = 0) -> float:
        host = base.removeprefix("http://")
        address, port = host.rsplit(":", 1)
        claim = orjson.dumps({"pool_id": pool_id, "max_tasks": 1})
        stop = time.monotonic() + seconds

        async def node(i: int, key: Any) -> None:
            signer, conn = FastSigner(bytes(key), host), Conn(address, int(port))
            due = time.monotonic() + self.pace_s * i / len(nodes)
            try:
                while time.monotonic() < stop and not (limit and self.done >= limit):
                    if self.pace_s:
                        now = time.monotonic()
                        if due > now:
                            await asyncio.sleep(due - now)
                        due = max(due, now) + self.pace_s
                    t0 = time.perf_counter()
                    status, raw = await conn.request(signer.request("/v1/assignments/claim", claim))
                    self.claims.append(time.perf_counter() - t0)
                    leases = orjson.loads(raw).get("leases") if status == 200 else None
                    if not leases:
                        self.errors[f"claim {status}"] += 1
                        await asyncio.sleep(0.05)
                        continue
                    lease = leases[0]
                    sample: dict[str, Any] = {"completion": "4", "finish_reason": "stop", "prompt_tokens": 5}
                    sample["completion_tokens"] = 1
                    body = orjson.dumps(
                        {
                            "fencing_token": lease["fencing_token"],
                            "policy_step": lease["policy"]["step"],
                            "seed": lease["seed"],
                            "samples": [sample],
                        }
                    )
                    path = f"/v1/assignments/{lease['assignment_id']}/result"
                    t0 = time.perf_counter()
                    status, _ = await conn.request(signer.request(path, body))
                    self.results.append(time.perf_counter() - t0)
                    if status == 201:
                        self.done += 1
                    else:
                        self.errors[f"result {status}"] += 1
            finally:
                await conn.close()

        t0 = time.monotonic()
        await asyncio.gather(*(node(i, k) for i, k in enumerate(nodes)))
        return time.monotonic() - t0


def waiting(db: Path) -> int:
    """Results waiting for the verifier (a read: WAL lets it run beside the server's writes)."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30) as conn:
        row = conn.execute("SELECT count(*) FROM verification_jobs WHERE stage = 'checks'").fetchone()
    return int(row[0])


async def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backlog", type=int, default=2500)
    parser.add_argument("--pollers", type=int, default=8, help=f"at most {NODES}")
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--code", default=CHECKOUT, help="the checkout whose server runs")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "orchestrator.db"
        url = f"sqlite+aiosqlite:///{db}"
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        with (Path(tmp) / "serve.log").open("ab") as log:
            server = start(args.code, url, port, loops=False, log=log)
            try:
                await wait_ready(base, 120)
                headers = {"Authorization": f"Bearer {await create_token(url)}"}
                async with httpx.AsyncClient(base_url=base, timeout=120) as c:
                    policy = {"replication_factor": 1, "max_leases_per_node": 4, "lease_duration_s": 3600}
                    pool_id = await create_pool(c, headers, "sqlite-backlog", policy, ECONOMICS)
                    tasks = args.backlog + 200 * round(args.seconds) + 1000
                    await enqueue(c, headers, pool_id, tasks, key="b", verified=True)
                    nodes = await register_nodes(c, NODES, pool_ids=[pool_id], ip_base=4096)
                self_check(base.removeprefix("http://"))
                made = Cycles()
                await made.run(base, pool_id, nodes, 3600, limit=args.backlog)
            finally:
                stop_server(server)
            server = start(args.code, url, port, loops=True, log=log)
            try:
                await wait_ready(base, 120)
                before = waiting(db)
                load = os.getloadavg()[0]
                cycles = Cycles()
                seconds = await cycles.run(base, pool_id, nodes[: args.pollers], args.seconds)
                after = waiting(db)
            finally:
                stop_server(server)
    decided = before + cycles.done - after
    print(f"code={args.code} pollers={args.pollers} backlog={before} cores={os.cpu_count()} load={load:.1f}")
    rate = cycles.done / seconds
    print(f"cycles: {cycles.done} in {seconds:.1f} s = {rate:.1f}/s errors={dict(cycles.errors)}")
    print(f"claim  {latency_summary(cycles.claims)}")
    print(f"result {latency_summary(cycles.results)}")
    print(f"verifier: {decided} decided = {decided / seconds:.1f} verdicts/s, {after} left waiting")


if __name__ == "__main__":
    run_main(main)
