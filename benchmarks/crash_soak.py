"""Crash soak: SIGKILL the real server (and/or ``orchestrator background``) under load, restart it,
let things settle, then check the promises from the database.

Run on demand (not part of the test suite), from a checkout with the package importable:

    python -m benchmarks.crash_soak                                   # SQLite + in-process store
    python -m benchmarks.crash_soak --db postgresql+asyncpg://postgres@127.0.0.1/orch_x \\
        --redis redis://127.0.0.1:6379/7 --separate-background --kill both --forget-redis

Load: honest workers and a few cheaters (the demo's behaviours, over real HTTP with the worker
SDK), providers withdrawing with Idempotency-Keys, an admin starting payout runs, marking payouts
paid or rejecting them and reversing verdicts (appeals). Every answer that was a 2xx is recorded,
and the same request (same body, same Idempotency-Key; a fresh signature) is sent again after a
restart and must get the same answer. ``--forget-redis`` also deletes the deployment's Redis keys
(its prefix only) now and then while the server runs.

Checked at the end (exit 1 and one line per violation otherwise):

* every ledger account's balance is the sum of its transfers, the balances sum to 0, and no
  account that may not go negative is negative;
* no verdict has two rewards or two releases; no payout's transfer is shared; one payout per
  withdrawal key, of the amount asked;
* no replica has two live leases, and none is live past its expiry once the reaper has run;
* every result answered 2xx is stored, with the same body, and its evidence verifies;
* no task is left open or submitted after the settle, and every reward hold is released or
  forfeited.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import structlog
from sqlalchemy import func, select, text
from sqlalchemy.ext.asyncio import create_async_engine

from orchestrator.core.keys import generate_key
from orchestrator.demo.behaviours import Blackboard, Worker
from orchestrator.demo.swarm import ECONOMICS, POLICY
from orchestrator.worker.client import WorkerClient
from orchestrator.worker.errors import OrchestratorAPIError
from orchestrator.worker.problems import arithmetic_tasks

ROOT = Path(__file__).resolve().parent.parent

# Loaded by the server and background processes with --crash-at-commit: each COMMIT is, with
# probability CRASH_SOAK_P, preceded or followed by the process's SIGKILL (before: the
# transaction is lost; after: it stands and nothing after it in the request or tick runs, the
# answer included).
INJECT = """
import os, random, signal
_p = float(os.environ.get("CRASH_SOAK_P", "0") or 0)
_armed = os.environ.get("CRASH_SOAK_ARMED", "")
if _p:
    from sqlalchemy import event
    from sqlalchemy.engine import Engine
    from sqlalchemy.orm import Session

    def _maybe(*args, **kwargs):
        if random.random() < _p and os.path.exists(_armed):
            os.kill(os.getpid(), signal.SIGKILL)

    event.listen(Engine, "commit", _maybe)
    event.listen(Session, "after_commit", _maybe)
"""


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Proc:
    name: str
    args: list[str]
    env: dict[str, str]
    cwd: Path
    port: int | None = None
    popen: subprocess.Popen[bytes] | None = None
    starts: int = 0
    kills: int = 0

    def start(self) -> None:
        log = (self.cwd / f"{self.name}.log").open("ab")
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "orchestrator.cli", *self.args],
            cwd=self.cwd,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        self.starts += 1

    def kill(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            os.kill(self.popen.pid, signal.SIGKILL)
            self.popen.wait()
            self.kills += 1

    def stop(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()

    async def ready(self, within_s: float = 90) -> None:
        deadline = time.monotonic() + within_s
        async with httpx.AsyncClient() as http:
            while time.monotonic() < deadline:
                assert self.popen is not None
                if self.popen.poll() is not None:
                    # a restart may race the lock of the process just killed: start again
                    await asyncio.sleep(0.5)
                    self.start()
                    continue
                if self.port is None:
                    await asyncio.sleep(1.0)
                    return
                with contextlib.suppress(httpx.HTTPError):
                    r = await http.get(f"http://127.0.0.1:{self.port}/readyz", timeout=1)
                    if r.status_code == 200:
                        return
                await asyncio.sleep(0.2)
        raise RuntimeError(f"{self.name} did not become ready: see {self.cwd / (self.name + '.log')}")


@dataclass
class Record:
    submissions: dict[str, tuple[Worker, Any, Any, Any]] = field(default_factory=dict)
    withdrawals: dict[tuple[int, str], tuple[int, dict[str, Any]]] = field(default_factory=dict)
    admin: dict[tuple[str, str, str], dict[str, Any]] = field(default_factory=dict)
    mismatches: list[str] = field(default_factory=list)
    repeats: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)


def body_bytes(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()


class Soak:
    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.workdir = workdir
        self.db_url = args.db or f"sqlite+aiosqlite:///{workdir / 'orchestrator.db'}"
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.prefix = f"crash{random.getrandbits(24):x}:"
        env = {k: v for k, v in os.environ.items() if not k.startswith("ORCH_")}
        env |= {
            "PYTHONPATH": str(ROOT),
            "ORCH_DB__URL": self.db_url,
            "ORCH_LOG_LEVEL": "WARNING",
            "ORCH_HEARTBEAT__INTERVAL_S": "2",
            "ORCH_HEARTBEAT__SWEEP_INTERVAL_S": "1",
            "ORCH_REDIS__PREFIX": self.prefix,
            "ORCH_LIMITS__SIGNED_PER_KEY": "0",
            "ORCH_LIMITS__SIGNED_PER_PROVIDER_KEY": "0",
            "ORCH_VERIFIER__REWARD_RETRY_S": "0",
            "ORCH_SERVER__TRUST_PROXY_HEADERS": "true",
            "ORCH_SERVER__FORWARDED_ALLOW_IPS": "127.0.0.1",
        }
        if args.redis:
            env["ORCH_REDIS__URL"] = args.redis
        self.env = env
        if args.crash_at_commit:
            inject = workdir / "inject"
            inject.mkdir()
            (inject / "sitecustomize.py").write_text(INJECT)
            env = env | {
                "PYTHONPATH": f"{inject}:{ROOT}",
                "CRASH_SOAK_P": str(args.crash_at_commit),
                "CRASH_SOAK_ARMED": str(workdir / "armed"),
            }
        serve_env = env | {"ORCH_SERVER__BACKGROUND_LOOPS": "false" if args.separate_background else "true"}
        self.server = Proc("serve", ["serve", "--port", str(self.port)], serve_env, workdir, port=self.port)
        self.background = (
            Proc("background", ["background"], env, workdir) if args.separate_background else None
        )
        self.rec = Record()
        self.stop = asyncio.Event()
        self.killing = True
        self.restarts = 0
        self.redis_forgets = 0

    # ------------------------------------------------------------------ setup

    def cli(self, *args: str) -> str:
        out = subprocess.run(
            [sys.executable, "-m", "orchestrator.cli", *args],
            cwd=self.workdir,
            env=self.env,
            capture_output=True,
            text=True,
            check=True,
        )
        return out.stdout

    async def setup(self) -> None:
        self.cli("migrate")
        self.token = (
            self.cli("admin", "create-token", "--role", "admin", "--name", "crash").strip().splitlines()[-1]
        )
        self.headers = {"Authorization": f"Bearer {self.token}"}
        self.server.start()
        if self.background is not None:
            self.background.start()
        await self.server.ready()
        self.http = httpx.AsyncClient(base_url=self.base, timeout=30)
        economics = ECONOMICS | {"reward_hold_s": 2}
        policy = POLICY | {"lease_duration_s": 10}
        r = await self.http.post(
            "/v1/admin/pools",
            headers=self.headers,
            json={"name": "crash", "economics": economics, "policy": policy},
        )
        if r.status_code != 201:
            raise RuntimeError(r.text)
        self.pool_id = r.json()["id"]
        (
            await self.http.post(f"/v1/admin/pools/{self.pool_id}/activate", headers=self.headers)
        ).raise_for_status()
        (
            await self.http.post(
                f"/v1/admin/pools/{self.pool_id}/policies",
                headers=self.headers,
                json={"step": 1, "uri": "demo://policy/1", "sha256": f"{1:064x}", "size": 1},
            )
        ).raise_for_status()
        problems = arithmetic_tasks(self.args.tasks, 11)
        (
            await self.http.post(
                f"/v1/admin/pools/{self.pool_id}/tasks",
                headers=self.headers,
                json={"batch_key": "crash", "tasks": problems},
            )
        ).raise_for_status()
        self.board = Blackboard()
        kinds = ["honest"] * self.args.honest + ["forger", "lazy", "squatter", "copier"]
        self.workers: list[Worker] = []
        self.providers: list[WorkerClient] = []
        for i, kind in enumerate(kinds):
            pk, nk = generate_key(), generate_key()
            client = WorkerClient(self.base, nk, pk, max_retries=12)
            client.backoff_max_s = 2.0
            # Each worker from an address of its own (a task's replicas go to distinct ones).
            ip = {"X-Forwarded-For": f"10.66.0.{i + 1}"}
            client._http.headers.update(ip)
            await client.register(
                {"gpu_model": "L4", "gpu_count": 1, "gpu_memory_mb": 1024, "cpu_cores": 1, "ram_mb": 1024},
                "x",
            )
            (
                await self.http.post(
                    f"/v1/admin/providers/{client.provider_id}/deposits",
                    json={"amount": 2000},
                    headers={**self.headers, "Idempotency-Key": f"crash-stake-{i:04d}"},
                )
            ).raise_for_status()
            await client.join(self.pool_id)
            await client.heartbeat()
            raw = httpx.AsyncClient(base_url=self.base, headers=ip)
            w = Worker(
                kind=kind,
                client=client,
                pool_id=self.pool_id,
                rng=random.Random(i),
                board=self.board,
                http=raw,
                node_key=nk,
            )
            w._submit = self._recording_submit(w)  # type: ignore[method-assign]
            self.workers.append(w)
            self.providers.append(client)
        self.board.node_ids = [w.client.node_id for w in self.workers]

    def _recording_submit(self, w: Worker) -> Any:
        async def submit(lease: Any, result: Any) -> None:
            self.board.live_leases.pop(lease.assignment_id, None)
            out = await w.client.submit(lease, result)
            w.log.submitted += 1
            self.rec.submissions[lease.assignment_id] = (w, lease, result, out)

        return submit

    # ------------------------------------------------------------------ load

    async def withdrawals(self, index: int, client: WorkerClient) -> None:
        n = 0
        pending: tuple[str, int] | None = None
        while not self.stop.is_set():
            await asyncio.sleep(random.uniform(0.5, 2.0))
            try:
                if pending is None:
                    claimable = (await client.balance()).rewards_claimable
                    if claimable < 3:
                        continue
                    n += 1
                    pending = (f"wd-{index:03d}-{n:05d}", random.randint(1, max(1, claimable // 2)))
                key, amount = pending
                out = await client.withdraw(amount, key)
                self.rec.withdrawals[(index, key)] = (amount, out.payout.model_dump(mode="json"))
                pending = None
            except OrchestratorAPIError as exc:
                self.rec.errors[f"withdraw {exc.status} {exc.code}"] += 1
                if exc.status < 500 and exc.status != 429:
                    pending = None  # e.g. insufficient funds: a new key for a new amount
            except (httpx.HTTPError, OSError) as exc:
                self.rec.errors[f"withdraw {type(exc).__name__}"] += 1

    async def admin_call(
        self, method: str, path: str, body: dict[str, Any] | None, key: str | None
    ) -> dict[str, Any] | None:
        headers = dict(self.headers)
        if key:
            headers["Idempotency-Key"] = key
        r = await self.http.request(method, path, json=body, headers=headers)
        if r.status_code >= 400:
            self.rec.errors[f"admin {path.split('/')[-1]} {r.status_code} {r.json().get('code')}"] += 1
            return None
        out = r.json()
        self.rec.admin[(path, json.dumps(body, sort_keys=True), key or "")] = out
        return out

    async def admin(self) -> None:
        runs = 0
        while not self.stop.is_set():
            await asyncio.sleep(random.uniform(1.0, 3.0))
            try:
                runs += 1
                await self.admin_call("POST", "/v1/admin/payouts/runs", {"max_payouts": 5}, f"run-{runs:05d}")
                r = await self.http.get(
                    "/v1/admin/payouts", params={"status": "requested", "limit": 10}, headers=self.headers
                )
                if r.status_code == 200:
                    for p in r.json()["items"][:3]:
                        if random.random() < 0.7:
                            await self.admin_call(
                                "POST",
                                f"/v1/admin/payouts/{p['id']}/mark-paid",
                                {"external_reference": f"ref-{p['id']}"},
                                None,
                            )
                        else:
                            await self.admin_call(
                                "POST", f"/v1/admin/payouts/{p['id']}/reject", {"reason": "no"}, None
                            )
                r = await self.http.get(
                    f"/v1/admin/pools/{self.pool_id}/verdicts", params={"limit": 50}, headers=self.headers
                )
                if r.status_code == 200:
                    items = [v for v in r.json()["items"] if not v.get("reversed_at")]
                    if items and random.random() < 0.5:
                        v = random.choice(items)
                        await self.admin_call(
                            "POST", f"/v1/admin/verdicts/{v['id']}/reverse", {"reason": "appeal"}, None
                        )
            except (httpx.HTTPError, OSError, ValueError) as exc:
                self.rec.errors[f"admin {type(exc).__name__}"] += 1

    async def forget_redis(self) -> None:
        import redis.asyncio as aioredis

        r = aioredis.from_url(self.args.redis)
        try:
            while not self.stop.is_set() and self.killing:
                await asyncio.sleep(random.uniform(5, 15))
                keys = [k async for k in r.scan_iter(match=f"{self.prefix}*", count=1000)]
                if keys:
                    await r.delete(*keys)
                self.redis_forgets += 1
        finally:
            await r.aclose()

    async def self_kills(self) -> None:
        """--crash-at-commit: the processes kill themselves just before or just after a COMMIT
        (the injected ``sitecustomize``); restart whichever died, until the duration is over."""
        (self.workdir / "armed").touch()
        deadline = time.monotonic() + self.args.duration
        procs = [p for p in (self.server, self.background) if p is not None]
        while time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            died = [p for p in procs if p.popen is not None and p.popen.poll() is not None]
            for p in died:
                p.kills += 1
                p.start()
            for p in died:
                await p.ready()
            if died:
                self.restarts += 1
                await self.repeat_answers(sample=8)
        (self.workdir / "armed").unlink()  # no more injected crashes from here on
        for p in procs:
            if p.popen is not None and p.popen.poll() is not None:
                p.start()
                await p.ready()
        self.killing = False

    async def killer(self) -> None:
        if self.args.crash_at_commit:
            return await self.self_kills()
        deadline = time.monotonic() + self.args.duration
        targets: list[Proc] = []
        if self.args.kill in ("server", "both"):
            targets.append(self.server)
        if self.args.kill in ("background", "both") and self.background is not None:
            targets.append(self.background)
        while time.monotonic() < deadline:
            await asyncio.sleep(random.uniform(self.args.min_gap, self.args.max_gap))
            victims = [t for t in targets if random.random() < 0.7] or [random.choice(targets)]
            for v in victims:
                v.kill()
            await asyncio.sleep(random.uniform(0.0, 1.5))
            for v in victims:
                v.start()
            for v in victims:
                await v.ready()
            self.restarts += 1
            await self.repeat_answers(sample=8)
        self.killing = False

    # ------------------------------------------------------------------ repeats

    async def repeat_answers(self, sample: int | None) -> None:
        """The same requests again: the same answers."""
        subs = list(self.rec.submissions.items())
        wds = list(self.rec.withdrawals.items())
        adm = list(self.rec.admin.items())
        if sample is not None:
            subs = random.sample(subs, min(sample, len(subs)))
            wds = random.sample(wds, min(sample, len(wds)))
            adm = random.sample(adm, min(sample, len(adm)))
        for aid, (w, lease, result, out) in subs:
            try:
                again = await w.client.submit(lease, result)
            except OrchestratorAPIError as exc:
                self.rec.mismatches.append(f"result {aid}: first {out.status}, again {exc.status} {exc.code}")
                continue
            except (httpx.HTTPError, OSError):
                continue
            self.rec.repeats["result"] += 1
            if again.model_dump() != out.model_dump():
                self.rec.mismatches.append(f"result {aid}: {out.model_dump()} then {again.model_dump()}")
        for (index, key), (amount, payout) in wds:
            try:
                again = await self.providers[index].withdraw(amount, key)
            except OrchestratorAPIError as exc:
                self.rec.mismatches.append(f"withdrawal {key}: again {exc.status} {exc.code}")
                continue
            except (httpx.HTTPError, OSError):
                continue
            self.rec.repeats["withdrawal"] += 1
            a = again.payout.model_dump(mode="json")
            if (a["id"], a["amount"]) != (payout["id"], payout["amount"]):
                self.rec.mismatches.append(f"withdrawal {key}: {payout} then {a}")
        for (path, body, key), out in adm:
            headers = dict(self.headers) | ({"Idempotency-Key": key} if key else {})
            try:
                r = await self.http.post(
                    path, content=body.encode(), headers={**headers, "content-type": "application/json"}
                )
            except (httpx.HTTPError, OSError):
                continue
            self.rec.repeats["admin"] += 1
            if r.status_code >= 400:
                self.rec.mismatches.append(f"admin {path}: again {r.status_code} {r.text[:200]}")
            elif "runs" in path and r.json()["id"] != out["id"]:
                self.rec.mismatches.append(f"admin {path} {key}: run {out['id']} then {r.json()['id']}")
            elif "/payouts/" in path and "runs" not in path and r.json()["status"] != out["status"]:
                self.rec.mismatches.append(f"admin {path}: {out['status']} then {r.json()['status']}")

    # ------------------------------------------------------------------ run

    async def run(self) -> int:
        await self.setup()
        workers = [asyncio.create_task(w.run(self.stop)) for w in self.workers]
        side = [asyncio.create_task(self.withdrawals(i, c)) for i, c in enumerate(self.providers)]
        side.append(asyncio.create_task(self.admin()))
        if self.args.forget_redis and self.args.redis:
            side.append(asyncio.create_task(self.forget_redis()))
        await self.killer()
        print(
            f"killing over: {self.server.kills} server kills, "
            f"{self.background.kills if self.background else 0} background kills, "
            f"{self.redis_forgets} redis forgets",
            flush=True,
        )
        # Settle: no more kills; the workers finish the queue, the loops drain.
        settle_deadline = time.monotonic() + self.args.settle
        while time.monotonic() < settle_deadline:
            await asyncio.sleep(2)
            r = await self.http.get(f"/v1/admin/pools/{self.pool_id}/stats", headers=self.headers)
            by = r.json().get("tasks_by_status", {})
            if not by.get("open") and not by.get("submitted"):
                break
        self.stop.set()
        await asyncio.gather(*workers, *side, return_exceptions=True)
        await asyncio.sleep(max(8.0, 3 * ECONOMICS["reward_hold_s"]))  # holds released, leases reaped
        await self.repeat_answers(sample=None)
        problems = await self.check()
        self.server.stop()
        if self.background is not None:
            self.background.stop()
        subs = len(self.rec.submissions)
        print(
            f"submissions recorded {subs}; withdrawals {len(self.rec.withdrawals)}; "
            f"admin calls {len(self.rec.admin)}"
        )
        print(f"repeats {dict(self.rec.repeats)}; restarts {self.restarts}")
        print(f"errors seen by the load (expected while down): {dict(self.rec.errors.most_common(12))}")
        for w in self.workers:
            print(
                f"  {w.kind:8} submitted {w.log.submitted} refused {dict(w.log.refused)} "
                f"errors {w.log.errors}"
            )
        for p in problems + self.rec.mismatches:
            print("VIOLATION:", p)
        print("OK" if not problems and not self.rec.mismatches else "FAILED")
        return 1 if problems or self.rec.mismatches else 0

    async def check(self) -> list[str]:
        from orchestrator.settings import Settings
        from orchestrator.tasks.evidence import recheck
        from orchestrator.tasks.models import Submission

        out: list[str] = []
        engine = create_async_engine(self.db_url)
        async with engine.connect() as c:

            async def rows(sql: str) -> list[Any]:
                return list((await c.execute(text(sql))).all())

            for r in await rows(
                """SELECT a.id, a.balance, a.allow_negative,
                   COALESCE((SELECT SUM(amount) FROM ledger_transfers WHERE credit_account_id = a.id), 0)
                 - COALESCE((SELECT SUM(amount) FROM ledger_transfers WHERE debit_account_id = a.id), 0)
                   FROM ledger_accounts a"""
            ):
                if r[1] != r[3]:
                    out.append(f"account {r[0]}: balance {r[1]} but transfers sum to {r[3]}")
                if r[1] < 0 and not r[2]:
                    out.append(f"account {r[0]} negative: {r[1]}")
            total = (await rows("SELECT COALESCE(SUM(balance), 0) FROM ledger_accounts"))[0][0]
            if total != 0:
                out.append(f"balances sum to {total}")
            for r in await rows(
                """SELECT reason, reference_id, COUNT(*) FROM ledger_transfers
                   WHERE reason IN ('reward', 'reward_release')
                   GROUP BY reason, reference_id HAVING COUNT(*) > 1"""
            ):
                out.append(f"verdict {r[1]}: {r[2]} transfers of reason {r[0]}")
            for r in await rows(
                """SELECT replica_id, COUNT(*) FROM assignments WHERE status = 'active'
                   GROUP BY replica_id HAVING COUNT(*) > 1"""
            ):
                out.append(f"replica {r[0]}: {r[1]} live leases")
            for r in await rows(
                """SELECT r.id, r.status, r.current_assignment_id, a.status FROM task_replicas r
                   LEFT JOIN assignments a ON a.id = r.current_assignment_id
                   WHERE (r.status = 'leased') <> (a.status IS NOT NULL AND a.status = 'active')"""
            ):
                out.append(f"replica {r[0]} is {r[1]} but its lease {r[2]} is {r[3]}")
            now = dt.datetime.now(dt.UTC)
            expired = (
                await c.execute(
                    text(
                        "SELECT COUNT(*) FROM assignments WHERE status = 'active' AND lease_expires_at < :t"
                    ),
                    {
                        "t": (now - dt.timedelta(seconds=30)).replace(tzinfo=None)
                        if self.db_url.startswith("sqlite")
                        else now - dt.timedelta(seconds=30)
                    },
                )
            ).scalar()
            if expired:
                out.append(f"{expired} leases live 30 s past their expiry")
            for r in await rows("SELECT status, COUNT(*) FROM tasks GROUP BY status"):
                if r[0] in ("open", "submitted"):
                    out.append(f"{r[1]} tasks still {r[0]} after the settle")
            for r in await rows("SELECT status, COUNT(*) FROM reward_holds GROUP BY status"):
                print(f"  reward holds {r[0]}: {r[1]}")
            for r in await rows("SELECT status, COUNT(*) FROM payouts GROUP BY status"):
                print(f"  payouts {r[0]}: {r[1]}")
            for r in await rows(
                "SELECT reason, COUNT(*), SUM(amount) FROM ledger_transfers GROUP BY reason ORDER BY reason"
            ):
                print(f"  transfers {r[0]}: {r[1]} ({r[2]})")
            payout_keys = {
                r[0]: r for r in await rows("SELECT idempotency_key, amount, id, provider_id FROM payouts")
            }
            for (index, key), (amount, payout) in self.rec.withdrawals.items():
                pid = self.providers[index].provider_id
                row = payout_keys.get(f"withdrawal:{pid}:{key}")
                if row is None:
                    out.append(f"withdrawal {key} answered {payout['id']} but no payout has its key")
                elif row[1] != amount or row[2] != payout["id"]:
                    out.append(f"withdrawal {key}: payout {row[2]} of {row[1]}, answered {payout}")
            # Every result answered 2xx: stored, same body, evidence valid.
            window = Settings().signature.window_s
        from sqlalchemy.ext.asyncio import async_sessionmaker

        async with async_sessionmaker(engine)() as s:
            for aid, (_w, _lease, result, answer) in self.rec.submissions.items():
                sub = await s.scalar(select(Submission).where(Submission.assignment_id == aid))
                if sub is None:
                    out.append(
                        f"result for {aid} answered {answer.status} ({answer.submission_id}) is not stored"
                    )
                    continue
                sent = body_bytes(result.model_dump(mode="json", exclude_none=True))
                if sub.id != answer.submission_id or sub.body != sent:
                    out.append(f"result for {aid}: stored {sub.id} differs from what was answered/sent")
                check = recheck(sub, window_s=window)
                if not check.valid:
                    out.append(f"result for {aid}: evidence {check.code} {check.detail}")
            n = await s.scalar(select(func.count()).select_from(Submission))
            print(f"  submissions stored {n}, answered 2xx {len(self.rec.submissions)}")
        await engine.dispose()
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--db", help="an empty postgresql+asyncpg database (migrated here); default a new SQLite file"
    )
    p.add_argument("--redis", help="redis://host:port/db; default the in-process store")
    p.add_argument(
        "--separate-background", action="store_true", help="serve without loops + orchestrator background"
    )
    p.add_argument("--kill", choices=("server", "background", "both"), default="server")
    p.add_argument(
        "--crash-at-commit",
        type=float,
        default=0.0,
        metavar="P",
        help="instead of kills from outside: each COMMIT is preceded or followed by a SIGKILL "
        "with probability P",
    )
    p.add_argument("--forget-redis", action="store_true", help="delete this run's Redis keys now and then")
    p.add_argument("--duration", type=float, default=120, help="seconds of kills")
    p.add_argument("--min-gap", type=float, default=2.0)
    p.add_argument("--max-gap", type=float, default=8.0)
    p.add_argument("--settle", type=float, default=120)
    p.add_argument("--tasks", type=int, default=600)
    p.add_argument("--honest", type=int, default=5)
    p.add_argument("--seed", type=int, default=None)
    args = p.parse_args()
    # The SDK logs every retry, and there are many while the server is down.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    if args.seed is not None:
        random.seed(args.seed)
    with tempfile.TemporaryDirectory(prefix="crash-soak-") as tmp:
        soak = Soak(args, Path(tmp))
        try:
            code = asyncio.run(soak.run())
        finally:
            soak.server.kill()
            if soak.background is not None:
                soak.background.kill()
            if code_logs := os.environ.get("CRASH_SOAK_KEEP_LOGS"):
                for f in Path(tmp).glob("*.log"):
                    (Path(code_logs) / f.name).write_bytes(f.read_bytes())
    sys.exit(code)


if __name__ == "__main__":
    main()
