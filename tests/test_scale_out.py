"""Scale-out proof: three ``orchestrator serve`` processes, one PostgreSQL, one Redis.

The API processes are meant to be stateless (ARCHITECTURE.md, "Scaling out"). This test runs
three real servers on separate ports of 127.0.0.1, each with its background loops on, against a
database created for the test (``orch_scale_<random>``, dropped at the end) and a Redis key
prefix of its own, and checks, over HTTP with signed requests:

* registrations spread over the three processes are refused after the per-IP limit *in total*;
* a signed request replayed byte for byte to another process is refused (``nonce_replayed``);
* signed workers spread over the three processes claim and submit concurrently and no replica
  is ever leased twice;
* SIGKILL of one process mid-run loses no acknowledged result: the leases its workers held
  expire, the lease reaper (in a survivor) reissues them, and every task gets its submission;
* each background loop ran at most once per tick across the three processes, and the survivors
  kept the loops going after the kill.

Clients reach the servers directly; ``ORCH_SERVER__TRUST_PROXY_HEADERS`` is on so each
simulated worker can carry its own address in ``X-Forwarded-For`` (one address per worker, as
behind a real load balancer) while the rate-limit probe uses one address for all its requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg  # type: ignore[import-untyped]
import httpx
import pytest
import redis.asyncio as aioredis
from nacl.signing import SigningKey
from sqlalchemy.engine import make_url

from orchestrator.core.keys import attest_node, generate_key, key_id_of
from orchestrator.core.signing import SignatureAuth, sign_headers
from tests.conftest import DATABASE_URL, GPU_SPECS, REDIS_URL, postgres_only
from tests.process_helpers import free_port

pytestmark = [
    postgres_only,
    pytest.mark.skipif(
        not REDIS_URL,
        reason="needs Redis (set ORCH_TEST_REDIS_URL): the three processes must share one hot store; "
        "runs in the PostgreSQL + Redis CI pass",
    ),
]

PROCESSES = 3
WORKERS_PER_PROCESS = 4
SWEEP_INTERVAL_S = 1.0
REAPER_INTERVAL_S = 5.0  # orchestrator.tasks.jobs.INTERVAL_S
# The shortest lease the pool policy accepts (LeaseDuration, ge=10; and three heartbeat intervals).
LEASE_DURATION_S = 10
REGISTRATION_PER_IP = 5
PHASE_TASKS = 90
REQUEST_TIMEOUT = httpx.Timeout(15.0, connect=5.0)
SERVER_READY_S = 45.0
DRAIN_DEADLINE_S = 40.0


# ------------------------------------------------------------------ servers


@dataclass
class Server:
    name: str
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def instance_id(self) -> str:
        # orchestrator.core.state.AppState.instance_id: "<hostname>:<pid>" of the uvicorn process
        # (with one worker, uvicorn serves in the process it was started in).
        return f"{socket.gethostname()}:{self.proc.pid}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "<no log>"


def _server_env(db_url: str, redis_url: str, prefix: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ORCH_", "PROMETHEUS_"))}
    env.update(
        {
            "ORCH_ENV": "test",
            "ORCH_LOG_LEVEL": "WARNING",
            "ORCH_DB__URL": db_url,
            "ORCH_DB__POOL_SIZE": "10",
            "ORCH_REDIS__URL": redis_url,
            "ORCH_REDIS__PREFIX": prefix,
            "ORCH_SERVER__MIGRATE_ON_START": "false",
            "ORCH_SERVER__BACKGROUND_LOOPS": "true",
            "ORCH_SERVER__TRUST_PROXY_HEADERS": "true",
            "ORCH_HEARTBEAT__SWEEP_INTERVAL_S": str(SWEEP_INTERVAL_S),
            # No worker turns unhealthy during the run (60 s without a beat; the sweeper still
            # ticks), while the pool's 10 s lease stays above three heartbeat intervals.
            "ORCH_HEARTBEAT__INTERVAL_S": "3",
            "ORCH_HEARTBEAT__UNHEALTHY_AFTER_MISSED": "20",
            "ORCH_HEARTBEAT__DEAD_AFTER_MISSED": "40",
            "ORCH_LIMITS__REGISTRATION_PER_IP": str(REGISTRATION_PER_IP),
            # One fixed window for the whole run, so no window boundary falls inside the test.
            "ORCH_LIMITS__REGISTRATION_WINDOW_S": str(10**9),
        }
    )
    return env


async def _wait_ready(server: Server, deadline: float) -> None:
    async with httpx.AsyncClient(base_url=server.base, timeout=3) as c:
        while time.monotonic() < deadline:
            if server.proc.poll() is not None:
                raise AssertionError(f"{server.name} exited early:\n{server.log_tail()}")
            with contextlib.suppress(httpx.TransportError):
                if (await c.get("/readyz")).status_code == 200:
                    return
            await asyncio.sleep(0.2)
    raise AssertionError(f"{server.name} not ready within {SERVER_READY_S} s:\n{server.log_tail()}")


def _spawn(name: str, env: dict[str, str], log_dir: Path) -> Server:
    port = free_port()
    log_path = log_dir / f"server-{name}.log"
    command = [sys.executable, "-m", "orchestrator.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    with log_path.open("wb") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            [*command, "--workers", "1", "--no-migrate"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group, killed as a whole
        )
    return Server(name, port, proc, log_path)


@contextlib.asynccontextmanager
async def _servers(db_url: str, redis_url: str, prefix: str, log_dir: Path) -> AsyncIterator[list[Server]]:
    servers: list[Server] = []
    env = _server_env(db_url, redis_url, prefix)
    try:
        for name in "ABC"[:PROCESSES]:
            servers.append(_spawn(name, env, log_dir))
        deadline = time.monotonic() + SERVER_READY_S
        await asyncio.gather(*(_wait_ready(s, deadline) for s in servers))
        yield servers
    finally:
        for s in servers:
            s.kill()


# ------------------------------------------------------------------ database and Redis


def _dsns(base_url: str, name: str) -> tuple[str, str, str]:
    """(SQLAlchemy URL of the new database, its asyncpg DSN, the asyncpg DSN of ``postgres``)."""
    url = make_url(base_url).set(database=name)
    plain = url.set(drivername="postgresql")
    admin = plain.set(database="postgres")
    return (
        url.render_as_string(hide_password=False),
        plain.render_as_string(hide_password=False),
        admin.render_as_string(hide_password=False),
    )


async def _create_database(admin_dsn: str, name: str) -> None:
    conn = await asyncpg.connect(admin_dsn, timeout=10)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()


async def _drop_database(admin_dsn: str, name: str) -> None:
    conn = await asyncpg.connect(admin_dsn, timeout=10)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await conn.close()


async def _drop_prefix(url: str, prefix: str) -> None:
    client = aioredis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
    try:
        keys = [k async for k in client.scan_iter(match=prefix + "*", count=1000)]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()


async def _admin_token(db_url: str) -> str:
    from orchestrator.admin.tokens import Role, create_token
    from orchestrator.core.db import make_engine, make_sessionmaker
    from orchestrator.settings import DatabaseSettings

    engine = make_engine(DatabaseSettings(url=db_url))
    try:
        async with make_sessionmaker(engine)() as session, session.begin():
            token, _ = await create_token(session, role=Role.admin, name="scale-out")
            return token
    finally:
        await engine.dispose()


@dataclass(frozen=True)
class TickRow:
    runs: int
    last_tick: int
    last_runner: str | None


async def _ticks(db: asyncpg.Pool) -> dict[str, TickRow]:
    rows = await db.fetch("SELECT name, runs, last_tick, last_runner FROM background_ticks")
    return {r["name"]: TickRow(int(r["runs"]), int(r["last_tick"]), r["last_runner"]) for r in rows}


# ------------------------------------------------------------------ workers


@dataclass
class Worker:
    index: int
    server: Server
    ip: str
    provider: SigningKey = field(default_factory=generate_key)
    key: SigningKey = field(default_factory=generate_key)
    client: httpx.AsyncClient | None = None
    held: set[str] = field(default_factory=set)  # leases in hand, no answer to their result yet
    unsent: set[str] = field(default_factory=set)  # leases in hand whose result is not sent yet
    claimed: list[str] = field(default_factory=list)
    acknowledged: list[str] = field(default_factory=list)  # results answered 200/201
    stopped: bool = False

    @property
    def node_id(self) -> str:
        return key_id_of(self.key)

    @property
    def http(self) -> httpx.AsyncClient:
        assert self.client is not None
        return self.client

    def open(self) -> None:
        self.client = httpx.AsyncClient(
            base_url=self.server.base, timeout=REQUEST_TIMEOUT, headers={"X-Forwarded-For": self.ip}
        )

    async def register(self, pool_id: str) -> None:
        auth = SignatureAuth(self.provider)
        r = await self.http.post("/v1/providers", json={"display_name": f"w{self.index}"}, auth=auth)
        assert r.status_code == 201, r.text
        body = {
            "provider_id": key_id_of(self.provider),
            "attestation": attest_node(self.provider, self.node_id),
            "specs": dict(GPU_SPECS),
            "version": "scale-out",
        }
        r = await self.http.post("/v1/nodes", json=body, auth=SignatureAuth(self.key))
        assert r.status_code == 201, r.text
        r = await self.http.post("/v1/nodes/me/heartbeat", json={}, auth=SignatureAuth(self.key))
        assert r.status_code == 200, r.text
        r = await self.http.post(f"/v1/pools/{pool_id}/join", json={}, auth=SignatureAuth(self.key))
        assert r.status_code == 201, r.text


def _result(lease: dict[str, Any]) -> dict[str, Any]:
    return {
        "fencing_token": lease["fencing_token"],
        "policy_step": lease["policy"]["step"],
        "seed": lease["seed"],
        "samples": [
            {"completion": "4", "finish_reason": "stop", "prompt_tokens": 6, "completion_tokens": 1}
            for _ in range(lease["task"]["sampling"]["n"])
        ],
        "claimed_reward": 1.0,
    }


async def _work(w: Worker, pool_id: str, done: asyncio.Event, rng: random.Random, work_s: float) -> None:
    """Claim and submit until ``done``; a worker whose server is gone stops (abandoning its leases)."""
    auth = SignatureAuth(w.key)
    while not done.is_set():
        try:
            r = await w.http.post(
                "/v1/assignments/claim", json={"pool_id": pool_id, "max_tasks": rng.randint(1, 3)}, auth=auth
            )
        except httpx.TransportError:
            w.stopped = True
            return
        assert r.status_code == 200, r.text
        leases = r.json()["leases"]
        if not leases:
            assert r.json()["reason"] in ("no_tasks", "lease_cap_reached"), r.text
            await asyncio.sleep(0.2)
            continue
        for lease in leases:
            w.claimed.append(lease["assignment_id"])
            w.held.add(lease["assignment_id"])
            w.unsent.add(lease["assignment_id"])
        for lease in leases:
            await asyncio.sleep(work_s * rng.random())  # "generating" the rollout
            w.unsent.discard(lease["assignment_id"])
            try:
                s = await w.http.post(
                    f"/v1/assignments/{lease['assignment_id']}/result", json=_result(lease), auth=auth
                )
            except httpx.TransportError:
                w.stopped = True  # the server died: the leases in hand are abandoned
                return
            assert s.status_code in (200, 201), s.text
            w.held.discard(lease["assignment_id"])
            w.acknowledged.append(lease["assignment_id"])


async def _enqueue(admin: httpx.AsyncClient, pool_id: str, key: str, n: int) -> None:
    tasks = [
        {
            "prompt": f"{key}: what is 2+2? ({i})",
            "sampling": {"max_tokens": 8, "n": 1},
            "verification": {"expected_answer": "4"},
        }
        for i in range(n)
    ]
    r = await admin.post(f"/v1/admin/pools/{pool_id}/tasks", json={"batch_key": key, "tasks": tasks})
    assert r.status_code == 201, r.text


async def _unfinished(db: asyncpg.Pool, pool_id: str) -> int:
    """Tasks not yet completed: a replica still to submit, or a verdict still to reach.

    Results of a new node are audited by an extra replica (the verifier adds it), so a task with
    a submission may still need another one; a completed task needs nothing more.
    """
    return int(
        await db.fetchval(
            "SELECT count(*) FROM tasks WHERE pool_id = $1 AND status IN ('open', 'submitted')", pool_id
        )
    )


async def _drain(
    db: asyncpg.Pool, pool_id: str, workers: list[Worker], rng: random.Random, work_s: float
) -> asyncio.Task[None]:
    """Run the workers until every task of the pool is completed (or the deadline)."""
    done = asyncio.Event()

    async def monitor() -> None:
        deadline = time.monotonic() + DRAIN_DEADLINE_S
        try:
            while time.monotonic() < deadline and await _unfinished(db, pool_id):  # noqa: ASYNC110 - polls SQL
                await asyncio.sleep(0.3)
        finally:
            done.set()

    async def run() -> None:
        async with asyncio.TaskGroup() as group:  # a failing worker cancels the others
            group.create_task(monitor())
            for w in workers:
                group.create_task(_work(w, pool_id, done, rng, work_s))

    return asyncio.create_task(run())


# ------------------------------------------------------------------ raw HTTP


async def _raw_exchange(port: int, request: bytes) -> tuple[int, dict[str, Any]]:
    """Send exact bytes on a fresh connection; return the status and the JSON body."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), timeout=5)
    try:
        writer.write(request)
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(-1), timeout=10)  # Connection: close
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body)


def _signed_heartbeat_bytes(key: SigningKey, port: int, ip: str) -> bytes:
    host = f"127.0.0.1:{port}"
    body = b'{"metrics": {"gpu_util": 0.5}}'
    signed = sign_headers(key, method="POST", url=f"http://{host}/v1/nodes/me/heartbeat", body=body)
    headers = {
        "Host": host,
        "Content-Type": "application/json",
        "Content-Length": str(len(body)),
        "X-Forwarded-For": ip,
        "Connection": "close",
        **signed,
    }
    head = "POST /v1/nodes/me/heartbeat HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return head.encode("latin-1") + b"\r\n" + body


# ------------------------------------------------------------------ the test


async def test_three_processes_share_one_database_and_one_hot_store(tmp_path: Path) -> None:
    assert DATABASE_URL and REDIS_URL
    name = f"orch_scale_{uuid.uuid4().hex[:10]}"
    prefix = f"scale:{uuid.uuid4().hex[:12]}:"
    db_url, dsn, admin_dsn = _dsns(DATABASE_URL, name)
    await _create_database(admin_dsn, name)
    try:
        from orchestrator.core.migrate import upgrade

        await asyncio.wait_for(asyncio.to_thread(upgrade, db_url), timeout=60)
        async with _servers(db_url, REDIS_URL, prefix, tmp_path) as servers:
            db = await asyncpg.create_pool(dsn, min_size=1, max_size=4, timeout=10)
            try:
                await _scenario(servers, db, db_url)
            finally:
                await db.close()
    finally:
        await _drop_database(admin_dsn, name)
        await _drop_prefix(REDIS_URL, prefix)


async def _scenario(servers: list[Server], db: asyncpg.Pool, db_url: str) -> None:
    a, b, c = servers
    rng = random.Random(20240611)  # the load's shape only
    # Every process runs its loops' first tick at start-up; wait for the sweeper's row.
    deadline = time.monotonic() + 10
    while "liveness_sweeper" not in (ticks_at_start := await _ticks(db)):
        assert time.monotonic() < deadline, "the sweeper never ran"
        await asyncio.sleep(0.1)
    started = time.monotonic()

    # Who ran the loops, sampled all along (last_runner shows the latest claimant of each loop).
    runners: list[tuple[float, str, str | None]] = []
    killed_at: list[float] = []

    async def sample_runners() -> None:
        while True:
            for loop, row in (await _ticks(db)).items():
                runners.append((time.monotonic(), loop, row.last_runner))
            await asyncio.sleep(0.25)

    sampler = asyncio.create_task(sample_runners())
    try:
        # ---- rate limits are global: one address, registrations spread over A, B, C
        statuses = []
        for i in range(REGISTRATION_PER_IP + 4):
            async with httpx.AsyncClient(base_url=servers[i % 3].base, timeout=REQUEST_TIMEOUT) as client:
                r = await client.post(
                    "/v1/providers",
                    json={},
                    headers={"X-Forwarded-For": "198.51.100.77"},
                    auth=SignatureAuth(generate_key()),
                )
            statuses.append(r.status_code)
            if r.status_code == 429:
                assert r.json()["code"] == "rate_limited", r.text
        assert statuses == [201] * REGISTRATION_PER_IP + [429] * 4, statuses

        # ---- a pool, and signed workers spread over the three processes
        token = await _admin_token(db_url)
        admin = httpx.AsyncClient(
            base_url=a.base,
            timeout=REQUEST_TIMEOUT,
            headers={"Authorization": f"Bearer {token}", "X-Forwarded-For": "192.0.2.1"},
        )
        workers = [
            Worker(i, servers[i % PROCESSES], ip=f"10.77.0.{i + 1}")
            for i in range(PROCESSES * WORKERS_PER_PROCESS)
        ]
        try:
            r = await admin.post(
                "/v1/admin/pools",
                json={
                    "name": "scale-out",
                    "policy": {
                        "replication_factor": 1,
                        "lease_duration_s": LEASE_DURATION_S,
                        "max_attempts": 10,
                        "max_leases_per_node": 4,
                        "audit_rate_floor": 0.0,
                    },
                },
            )
            assert r.status_code == 201, r.text
            pool_id = r.json()["id"]
            assert (await admin.post(f"/v1/admin/pools/{pool_id}/activate")).status_code == 200
            r = await admin.post(
                f"/v1/admin/pools/{pool_id}/policies",
                json={"step": 1, "uri": "s3://ckpt/1", "sha256": "a" * 64, "size": 1},
            )
            assert r.status_code == 201, r.text
            for w in workers:
                w.open()
            await asyncio.gather(*(w.register(pool_id) for w in workers))

            # ---- a nonce replayed to another process is refused
            replay = _signed_heartbeat_bytes(workers[0].key, a.port, workers[0].ip)
            first = await _raw_exchange(a.port, replay)
            assert first[0] == 200, first
            for other in (b, c):
                status, problem = await _raw_exchange(other.port, replay)
                assert (status, problem["code"]) == (401, "nonce_replayed"), (status, problem)

            # ---- phase 1: all twelve workers claim and submit concurrently through A, B and C
            await _enqueue(admin, pool_id, "phase-1", PHASE_TASKS)
            phase1 = await _drain(db, pool_id, workers, rng, work_s=0.02)
            await asyncio.wait_for(phase1, timeout=DRAIN_DEADLINE_S + 20)
            assert await _unfinished(db, pool_id) == 0
            assert all(not w.stopped for w in workers)
            assert all(w.claimed for w in workers), "every worker got work"

            # ---- phase 2: SIGKILL C while its workers hold leases
            await _enqueue(admin, pool_id, "phase-2", PHASE_TASKS)
            on_c = [w for w in workers if w.server is c]
            phase2 = await _drain(db, pool_id, workers, rng, work_s=0.4)
            kill_deadline = time.monotonic() + 20
            while not any(w.unsent for w in on_c):
                assert time.monotonic() < kill_deadline, "C's workers never held a lease"
                assert not phase2.done()
                await asyncio.sleep(0.01)
            # No await between the check and the kill: those results are never sent.
            never_sent = {a_id for w in on_c for a_id in w.unsent}
            c.kill()
            killed_at.append(time.monotonic())
            await asyncio.wait_for(phase2, timeout=DRAIN_DEADLINE_S + 20)
            assert all(w.stopped for w in on_c)
            abandoned = {a_id for w in on_c for a_id in w.held}
        finally:
            for w in workers:
                if w.client is not None:
                    await w.client.aclose()
            await admin.aclose()
        elapsed = time.monotonic() - started
        ticks_at_end = await _ticks(db)
    finally:
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler

    # ---- every task completed; every replica has exactly one submission; nothing acknowledged is lost
    statuses = await db.fetch(
        "SELECT status, count(*) AS n FROM tasks WHERE pool_id = $1 GROUP BY 1", pool_id
    )
    assert {r["status"]: r["n"] for r in statuses} == {"completed": 2 * PHASE_TASKS}, statuses
    per_replica = await db.fetch(
        "SELECT r.id, r.status, count(s.id) AS n FROM task_replicas r JOIN tasks t ON t.id = r.task_id "
        "LEFT JOIN submissions s ON s.replica_id = r.id WHERE t.pool_id = $1 GROUP BY r.id, r.status",
        pool_id,
    )
    assert len(per_replica) >= 2 * PHASE_TASKS
    bad = [dict(r) for r in per_replica if r["n"] != 1 or r["status"] != "submitted"]
    assert bad == [], bad
    acknowledged = [a_id for w in workers for a_id in w.acknowledged]
    assert len(acknowledged) == len(set(acknowledged))
    stored = {
        r["assignment_id"]
        for r in await db.fetch("SELECT assignment_id FROM submissions WHERE pool_id = $1", pool_id)
    }
    assert set(acknowledged) <= stored, set(acknowledged) - stored

    # ---- no replica was ever leased twice at once, and no lease was handed out twice
    claimed = [a_id for w in workers for a_id in w.claimed]
    assert len(claimed) == len(set(claimed))
    doubled = await db.fetch(
        "SELECT replica_id, count(*) AS n FROM assignments "
        "WHERE status IN ('active', 'submitted') GROUP BY replica_id HAVING count(*) > 1"
    )
    assert doubled == [], [dict(r) for r in doubled]
    assert await db.fetchval("SELECT count(*) FROM assignments WHERE status = 'active'") == 0

    # ---- the leases C's workers abandoned expired and their replicas were reissued and submitted
    assert abandoned, "the kill happened while C's workers held leases"
    rows = await db.fetch(
        "SELECT a.id, a.status, a.replica_id, "
        "  (SELECT count(*) FROM assignments b WHERE b.replica_id = a.replica_id "
        "     AND b.status = 'submitted' AND b.fencing_token > a.fencing_token) AS later "
        "FROM assignments a WHERE a.id = ANY($1::text[])",
        list(abandoned),
    )
    assert len(rows) == len(abandoned)
    for row in rows:
        # A submit in flight when C died may have committed there; otherwise the lease expired.
        if row["status"] != "submitted":
            assert row["status"] == "expired" and row["later"] == 1, dict(row)
    assert never_sent <= abandoned
    assert all(row["status"] == "expired" for row in rows if row["id"] in never_sent), [dict(r) for r in rows]

    # ---- background loops: at most one run per tick across the three processes
    instance_ids = {s.instance_id for s in servers}
    for loop, end in ticks_at_end.items():
        begin = ticks_at_start.get(loop)
        if begin is not None:
            assert end.runs - begin.runs <= end.last_tick - begin.last_tick, (loop, begin, end)
    sweeper0, sweeper1 = ticks_at_start["liveness_sweeper"], ticks_at_end["liveness_sweeper"]
    runs = sweeper1.runs - sweeper0.runs
    distinct_ticks = sweeper1.last_tick - sweeper0.last_tick
    expected = elapsed / SWEEP_INTERVAL_S
    expired = await db.fetchval("SELECT count(*) FROM assignments WHERE status = 'expired'")
    print(  # visible with -s: the numbers behind the assertions
        f"\nelapsed {elapsed:.1f} s; sweeper: {runs} runs, {distinct_ticks} distinct ticks, "
        f"elapsed/interval {expected:.1f}; leases claimed per process "
        f"{ {s.name: sum(len(w.claimed) for w in workers if w.server is s) for s in servers} }; "
        f"results acknowledged {len(acknowledged)}; abandoned at the kill {len(abandoned)} "
        f"(never sent {len(never_sent)}); leases expired and reissued {expired}"
    )
    assert runs <= distinct_ticks <= expected + 2, (runs, distinct_ticks, expected)
    assert runs >= expected / 2, f"the sweeper ran only {runs} times in {elapsed:.1f} s"
    seen = {runner for _, loop, runner in runners if runner is not None}
    assert seen <= instance_ids, (seen, instance_ids)
    after_kill = {
        runner
        for t, loop, runner in runners
        if loop == "liveness_sweeper" and runner and t > killed_at[0] + 2 * SWEEP_INTERVAL_S
    }
    assert after_kill and c.instance_id not in after_kill, after_kill
    reaper = ticks_at_end["lease_reaper"]
    assert reaper.last_runner in {a.instance_id, b.instance_id}
    by_name = {s.instance_id: s.name for s in servers}
    print(
        "loop runners seen: "
        + ", ".join(
            f"{loop}: {sorted({by_name[r] for _, lp, r in runners if lp == loop and r})}"
            for loop in sorted({lp for _, lp, _ in runners})
        )
    )
