"""``python -m benchmarks.verifier_sqlite``: how fast the verifier decides a backlog on the
embedded default (SQLite, the in-process hot store), where it runs inside ``orchestrator serve``.

    python -m benchmarks.verifier_sqlite [--results 2000] [--pollers 16] [--wrong 0.1]

Builds the app in this process on a SQLite file in a temporary directory, sets up one pool with
a reward per sample and ``--pollers`` member nodes (each its own provider and address), enqueues
``--results`` checkable tasks (expected answer 4) and has the nodes claim and answer them all
through the service layer (``benchmarks.claims``' service phase), a share ``--wrong`` wrongly.
Then the verifier's loop, as ``orchestrator serve`` runs it (``core.loops.run_periodically``
with ``verify_once``, every second), decides the backlog; the script prints how long that took,
the verdicts per second, and how many ticks and batches it took. Nothing else runs meanwhile:
no requests, no other loop. The figure is the verifier's own ceiling on this host.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
from asgi_lifespan import LifespanManager
from sqlalchemy import func, select

from benchmarks.claims import service_phase
from benchmarks.common import SPECS, create_pool, create_token, enqueue, run_main
from benchmarks.verifier import ECONOMICS
from orchestrator.app import create_app
from orchestrator.core.keys import attest_node, generate_key, key_id_of
from orchestrator.core.loops import run_periodically
from orchestrator.core.migrate import upgrade
from orchestrator.core.signing import SignatureAuth
from orchestrator.settings import DatabaseSettings, ServerSettings, Settings
from orchestrator.verification import jobs
from orchestrator.verification.models import Verdict, VerificationJob


async def register(app: Any, index: int, pool_id: str) -> str:
    """A node of its own provider, from its own address: registered, beating, a member."""
    transport = httpx.ASGITransport(app=app, client=(f"10.9.{index // 256}.{index % 256}", 40000))
    provider, node = generate_key(), generate_key()
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as c:
        (await c.post("/v1/providers", json={}, auth=SignatureAuth(provider))).raise_for_status()
        body = {
            "provider_id": key_id_of(provider),
            "attestation": attest_node(provider, key_id_of(node)),
            "specs": SPECS,
            "version": "bench",
        }
        (await c.post("/v1/nodes", json=body, auth=SignatureAuth(node))).raise_for_status()
        (await c.post("/v1/nodes/me/heartbeat", json={}, auth=SignatureAuth(node))).raise_for_status()
        (await c.post(f"/v1/pools/{pool_id}/join", json={}, auth=SignatureAuth(node))).raise_for_status()
    return key_id_of(node)


async def count(state: Any, stmt: Any) -> int:
    async with state.sessionmaker() as session:
        return int(await session.scalar(stmt) or 0)


async def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--results", type=int, default=2000)
    parser.add_argument("--pollers", type=int, default=16)
    parser.add_argument("--wrong", type=float, default=0.1, help="share of wrong answers")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite+aiosqlite:///{Path(tmp) / 'orchestrator.db'}"
        await asyncio.to_thread(upgrade, url)  # alembic runs its own event loop
        settings = Settings(
            env="dev",
            log_level="WARNING",
            db=DatabaseSettings(url=url),
            server=ServerSettings(background_loops=False, migrate_on_start=False),
        )
        app = create_app(settings)
        async with LifespanManager(app):
            state = app.state.orch
            headers = {"Authorization": f"Bearer {await create_token(url)}"}
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://testserver", timeout=120) as c:
                policy = {"replication_factor": 1, "max_leases_per_node": 4, "lease_duration_s": 3600}
                pool_id = await create_pool(c, headers, "verifier-sqlite", policy, ECONOMICS)
                node_ids = [await register(app, i, pool_id) for i in range(args.pollers)]
                await enqueue(
                    c, headers, pool_id, args.results, key=f"v-{uuid.uuid4().hex[:6]}", verified=True
                )
            wrong_every = round(1 / args.wrong) if args.wrong > 0 else 0
            answers = tuple(
                "5" if wrong_every and i % wrong_every == 0 else "4" for i in range(max(wrong_every, 1))
            )
            t0 = time.perf_counter()
            stats = await service_phase(url, pool_id, node_ids, 3600, answers=answers, until_empty=True)
            accept_s = time.perf_counter() - t0
            waiting = (
                select(func.count()).select_from(VerificationJob).where(VerificationJob.stage == "checks")
            )
            backlog = await count(state, waiting)

            ticks = processed = 0
            stop = asyncio.Event()

            async def tick(s: Any) -> jobs.VerifyReport:
                nonlocal ticks, processed
                report = await jobs.verify_once(s)
                ticks += 1
                processed += report.processed
                if not getattr(report, "more", False) and not await count(state, waiting):
                    stop.set()  # the backlog is decided
                return report

            t0 = time.perf_counter()
            await run_periodically(state, jobs.VERIFIER, jobs.VERIFY_INTERVAL_S, tick, stop)
            seconds = time.perf_counter() - t0
            verdicts = await count(state, select(func.count()).select_from(Verdict))
    print(
        f"results={stats.done} accepted at {stats.done / accept_s:.1f}/s; backlog={backlog}; "
        f"batch_size={settings.verifier.batch_size} tick_budget_s={settings.verifier.tick_budget_s} "
        f"cores={os.cpu_count()} load={os.getloadavg()[0]:.1f}"
    )
    print(
        f"verifier loop: {verdicts} verdicts in {seconds:.1f} s = {verdicts / seconds:.1f} verdicts/s "
        f"({ticks} ticks, {processed} processed, {processed / max(ticks, 1):.1f} per tick)"
    )


if __name__ == "__main__":
    run_main(main)
