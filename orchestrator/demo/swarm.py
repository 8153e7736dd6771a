"""Run the demo: a coordinator in this process (embedded SQLite by default, or PostgreSQL and
Redis when given), a pool of arithmetic problems, honest workers and cheaters, the background
loops running for real, and a summary computed from the database at the end."""

from __future__ import annotations

import asyncio
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
from asgi_lifespan import LifespanManager
from nacl.signing import SigningKey
from pydantic import SecretStr

from orchestrator.admin.tokens import Role, create_token
from orchestrator.app import create_app
from orchestrator.core.keys import generate_key
from orchestrator.core.migrate import upgrade
from orchestrator.demo.behaviours import KINDS, Blackboard, Worker
from orchestrator.demo.summary import summarise
from orchestrator.settings import (
    DatabaseSettings,
    HeartbeatSettings,
    RedisSettings,
    ServerSettings,
    Settings,
)
from orchestrator.verification.jobs import drain
from orchestrator.worker.client import WorkerClient
from orchestrator.worker.problems import arithmetic_tasks

BASE_URL = "http://demo.local"
ECONOMICS = {
    "min_stake_per_node": 1000,
    "reward_per_sample": 10,
    "reward_hold_s": 5,
    "fraud_slash_amount": 250,
    "strikes_before_ejection": 2,
    "strikes_before_provider_ban": 2,
    "unbonding_period_s": 3600,
}
POLICY = {
    "lease_duration_s": 10,
    "max_attempts": 5,
    "replication_factor": 1,
    "audit_rate_floor": 0.1,
    "max_async_level": 2,
    "max_leases_per_node": 2,
    "reward_function": "exact_match",
}


@dataclass
class DemoConfig:
    duration_s: float = 30.0
    honest: int = 6
    dishonest: int = len(KINDS)
    seed: int = 7
    tasks: int = 400
    database_url: str | None = None
    redis_url: str | None = None


async def _admin_token(app: Any) -> str:
    async with app.state.orch.sessionmaker() as session, session.begin():
        token, _ = await create_token(session, role=Role.admin, name="demo")
    return token


async def run_demo(
    config: DemoConfig, on_update: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    tmp = tempfile.TemporaryDirectory(prefix="orchestrator-demo-")
    url = config.database_url or f"sqlite+aiosqlite:///{Path(tmp.name) / 'demo.db'}"
    settings = Settings(
        env="dev",
        log_level="WARNING",
        db=DatabaseSettings(url=url),
        redis=RedisSettings(
            url=SecretStr(config.redis_url) if config.redis_url else None,
            prefix=f"demo:{random.getrandbits(32):x}:",
        ),
        heartbeat=HeartbeatSettings(
            interval_s=2, unhealthy_after_missed=3, dead_after_missed=9, sweep_interval_s=1
        ),
        server=ServerSettings(background_loops=True, migrate_on_start=False),
    )
    await anyio.to_thread.run_sync(upgrade, url)
    app = create_app(settings)
    try:
        async with LifespanManager(app):
            return await _run(app, config, on_update)
    finally:
        tmp.cleanup()


async def _run(
    app: Any, config: DemoConfig, on_update: Callable[[dict[str, Any]], None] | None
) -> dict[str, Any]:
    transport = httpx.ASGITransport(app=app)
    rng = random.Random(config.seed)
    started = time.monotonic()
    async with httpx.AsyncClient(transport=transport, base_url=BASE_URL) as http:
        headers = {"Authorization": f"Bearer {await _admin_token(app)}"}
        r = await http.post(
            "/v1/admin/pools",
            headers=headers,
            json={"name": "demo: arithmetic", "economics": ECONOMICS, "policy": POLICY},
        )
        r.raise_for_status()
        pool_id = r.json()["id"]
        (await http.post(f"/v1/admin/pools/{pool_id}/activate", headers=headers)).raise_for_status()
        for step in (1, 2, 3, 4):  # a few policy versions: the stale worker answers with an old one
            (
                await http.post(
                    f"/v1/admin/pools/{pool_id}/policies",
                    headers=headers,
                    json={"step": step, "uri": f"demo://policy/{step}", "sha256": f"{step:064x}", "size": 1},
                )
            ).raise_for_status()
        problems = arithmetic_tasks(config.tasks, config.seed)
        (
            await http.post(
                f"/v1/admin/pools/{pool_id}/tasks",
                headers=headers,
                json={"batch_key": "demo", "tasks": problems},
            )
        ).raise_for_status()

        board = Blackboard()
        kinds = ["honest"] * config.honest + [KINDS[i % len(KINDS)] for i in range(config.dishonest)]
        workers: list[Worker] = []
        for i, kind in enumerate(kinds):
            provider_key, node_key = generate_key(), generate_key()
            worker = await _enrol(
                http,
                transport,
                headers,
                pool_id,
                kind,
                provider_key,
                node_key,
                board,
                random.Random(rng.random()),
                i,
            )
            workers.append(worker)
        board.node_ids = [w.client.node_id for w in workers]

        stop = asyncio.Event()
        runs = [asyncio.create_task(w.run(stop)) for w in workers]
        deadline = started + config.duration_s
        top_ups = 0
        while time.monotonic() < deadline:
            await asyncio.sleep(1.0)
            progress = await summarise(app.state.orch, pool_id, workers, elapsed=time.monotonic() - started)
            if on_update is not None:
                on_update(progress)
            # Done when every task is finished and every cheater present has been caught.
            cheats = [k["caught"] for name, k in progress["kinds"].items() if name != "honest"]
            if await _all_done(http, headers, pool_id):
                if all(cheats):
                    break
                # Work ran out before every cheater had its turn: top the queue up.
                top_ups += 1
                more = arithmetic_tasks(2 * len(workers), config.seed + top_ups)
                (
                    await http.post(
                        f"/v1/admin/pools/{pool_id}/tasks",
                        headers=headers,
                        json={"batch_key": f"demo-{top_ups}", "tasks": more},
                    )
                ).raise_for_status()
        stop.set()
        await asyncio.gather(*runs, return_exceptions=True)
        for w in workers:
            await w.client.aclose()
            await w.http.aclose()
        await drain(app.state.orch)
        summary = await summarise(
            app.state.orch, pool_id, workers, elapsed=time.monotonic() - started, final=True
        )
        summary["trainer_feed"] = await _read_feed(app, http, pool_id, summary["accepted_verdict_ids"])
        return summary


async def _read_feed(app: Any, http: httpx.AsyncClient, pool_id: str, accepted: list[int]) -> dict[str, Any]:
    """What a trainer reads: every accepted result, and nothing else."""
    async with app.state.orch.sessionmaker() as session, session.begin():
        token, _ = await create_token(session, role=Role.trainer, name="demo-trainer", pool_ids=[pool_id])
    seen: list[int] = []
    cursor: str | None = None
    while True:
        params: dict[str, Any] = {"limit": 500, **({"after": cursor} if cursor else {})}
        response = await http.get(
            f"/v1/pools/{pool_id}/rollouts", params=params, headers={"Authorization": f"Bearer {token}"}
        )
        response.raise_for_status()
        page = response.json()
        seen += [item["verdict_id"] for item in page["items"]]
        if not page["items"]:
            break
        cursor = page["next_cursor"]
    return {
        "rollouts": len(seen),
        "only_accepted": set(seen) <= set(accepted),
        "all_accepted_present": set(seen) == set(accepted),
        "in_order": seen == sorted(seen),
    }


async def _enrol(
    http: httpx.AsyncClient,
    transport: httpx.AsyncBaseTransport,
    headers: dict[str, str],
    pool_id: str,
    kind: str,
    provider_key: SigningKey,
    node_key: SigningKey,
    board: Blackboard,
    rng: random.Random,
    index: int,
) -> Worker:
    # Each worker comes from its own address, as separate machines would.
    ip = f"10.77.{index // 250}.{index % 250 + 1}"
    node_transport = httpx.ASGITransport(app=transport.app, client=(ip, 40000))  # type: ignore[attr-defined]
    client = WorkerClient(BASE_URL, node_key, provider_key, transport=node_transport, max_retries=2)
    await client.register(
        {"gpu_model": "NVIDIA L4", "gpu_count": 1, "gpu_memory_mb": 23034, "cpu_cores": 8, "ram_mb": 32768},
        "demo",
    )
    deposit = await http.post(
        f"/v1/admin/providers/{client.provider_id}/deposits",
        json={"amount": 2000},
        headers={**headers, "Idempotency-Key": f"demo-stake-{index:04d}"},
    )
    deposit.raise_for_status()
    await client.join(pool_id)
    await client.heartbeat()
    raw = httpx.AsyncClient(transport=node_transport, base_url=BASE_URL)
    return Worker(
        kind=kind, client=client, pool_id=pool_id, rng=rng, board=board, http=raw, node_key=node_key
    )


async def _all_done(http: httpx.AsyncClient, headers: dict[str, str], pool_id: str) -> bool:
    stats = (await http.get(f"/v1/admin/pools/{pool_id}/stats", headers=headers)).json()
    by_status = stats.get("tasks_by_status", {})
    return not by_status.get("open") and not by_status.get("submitted")
