"""Shared set-up for the task tests: a pool with a policy and member nodes on distinct IPs."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
from nacl.signing import SigningKey
from sqlalchemy import select

from orchestrator.tasks.models import Assignment
from tests.conftest import Contributor, make_token, new_contributor

_ips = itertools.count(1)


def client_for(app: Any, ip: str | None = None) -> httpx.AsyncClient:
    """A client whose requests come from ``ip`` (the server records it as the node's address)."""
    n = next(_ips)
    address = ip or f"10.{n // 65536 % 256}.{n // 256 % 256}.{n % 256}"
    transport = httpx.ASGITransport(app=app, client=(address, 40000))
    return httpx.AsyncClient(transport=transport, base_url="http://testserver")


@dataclass
class Worker:
    contributor: Contributor
    client: httpx.AsyncClient

    @property
    def node_id(self) -> str:
        return self.contributor.node_id

    async def claim(self, pool_id: str, max_tasks: int = 1) -> httpx.Response:
        return await self.client.post(
            "/v1/assignments/claim",
            json={"pool_id": pool_id, "max_tasks": max_tasks},
            auth=self.contributor.node_auth,
        )

    async def submit(self, lease: dict[str, Any], **overrides: Any) -> httpx.Response:
        body = result_body(lease, **overrides)
        return await self.client.post(
            f"/v1/assignments/{lease['assignment_id']}/result", json=body, auth=self.contributor.node_auth
        )

    async def release(self, lease: dict[str, Any], **body: Any) -> httpx.Response:
        return await self.client.post(
            f"/v1/assignments/{lease['assignment_id']}/release", json=body, auth=self.contributor.node_auth
        )

    async def beat(self, leases: list[str] | None = None) -> httpx.Response:
        return await self.client.post(
            "/v1/nodes/me/heartbeat", json={"leases": leases or []}, auth=self.contributor.node_auth
        )


def result_body(lease: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    n = lease["task"]["sampling"]["n"]
    body = {
        "fencing_token": lease["fencing_token"],
        "policy_step": lease["policy"]["step"],
        "seed": lease["seed"],
        "samples": [
            {
                "completion": f"answer {i}",
                "finish_reason": "stop",
                "prompt_tokens": 12,
                "completion_tokens": 7,
            }
            for i in range(n)
        ],
        "claimed_reward": 1.0,
    }
    body.update(overrides)
    return body


@dataclass
class PoolSetup:
    app: Any
    admin: httpx.AsyncClient
    headers: dict[str, str]
    pool_id: str
    admin_headers: dict[str, str] = field(default_factory=dict)
    workers: list[Worker] = field(default_factory=list)

    async def enqueue(self, tasks: list[dict[str, Any]], key: str = "batch-1") -> httpx.Response:
        return await self.admin.post(
            f"/v1/admin/pools/{self.pool_id}/tasks",
            json={"batch_key": key, "tasks": tasks},
            headers=self.headers,
        )

    async def publish(self, step: int) -> httpx.Response:
        return await self.admin.post(
            f"/v1/admin/pools/{self.pool_id}/policies",
            headers=self.headers,
            json={"step": step, "uri": f"s3://ckpt/step-{step}", "sha256": "a" * 64, "size": 1024},
        )

    async def add_worker(
        self, provider_key: SigningKey | None = None, ip: str | None = None, beat: bool = True, stake: int = 0
    ) -> Worker:
        c = new_contributor(provider_key)
        client = client_for(self.app, ip)
        await c.register(client)
        if stake:
            r = await self.admin.post(
                f"/v1/admin/providers/{c.provider_id}/deposits",
                json={"amount": stake},
                headers={**self.admin_headers, "Idempotency-Key": f"stake-{c.node_id[:24]}"},
            )
            assert r.status_code in (200, 201), r.text
        r = await client.post(f"/v1/pools/{self.pool_id}/join", json={}, auth=c.node_auth)
        assert r.status_code in (200, 201), r.text
        worker = Worker(c, client)
        if beat:
            assert (await worker.beat()).status_code == 200
        self.workers.append(worker)
        return worker

    async def task_of(self, lease: dict[str, Any] | str) -> int:
        """The real id of a lease's task (the lease, or its assignment id), as operators see it:
        a node's lease names its task by the node's own reference, not by its id. Read from the
        lease's row."""
        assignment_id = lease if isinstance(lease, str) else lease["assignment_id"]
        async with self.app.state.orch.sessionmaker() as session:
            task_id = await session.scalar(select(Assignment.task_id).where(Assignment.id == assignment_id))
        assert task_id is not None, assignment_id
        return int(task_id)

    async def close(self) -> None:
        for w in self.workers:
            await w.client.aclose()
        await self.admin.aclose()


def task(prompt: str = "What is 2+2?", n: int = 1, **extra: Any) -> dict[str, Any]:
    return {
        "prompt": prompt,
        "sampling": {"temperature": 0.6, "max_tokens": 256, "n": n},
        "verification": {"expected_answer": "4"},
        **extra,
    }


@asynccontextmanager
async def pool_setup(
    app: Any,
    app_state: Any,
    *,
    workers: int = 0,
    step: int | None = 1,
    economics: dict[str, Any] | None = None,
    stake: int = 0,
    **policy: Any,
) -> AsyncIterator[PoolSetup]:
    token = await make_token(app_state, "operator", name="pool-operator")
    headers = {"Authorization": f"Bearer {token}"}
    admin = client_for(app, "192.0.2.1")
    body = {
        "name": "rollouts",
        "economics": economics or {},
        "policy": {
            "audit_rate_floor": 0.0,
            "lease_duration_s": 600,
            "max_attempts": 3,
            "replication_factor": 1,
            "max_leases_per_node": 4,
            **policy,
        },
    }
    r = await admin.post("/v1/admin/pools", json=body, headers=headers)
    assert r.status_code == 201, r.text
    pool_id = r.json()["id"]
    assert (await admin.post(f"/v1/admin/pools/{pool_id}/activate", headers=headers)).status_code == 200
    admin_token = await make_token(app_state, "admin", name="pool-admin")
    setup = PoolSetup(
        app=app,
        admin=admin,
        headers=headers,
        pool_id=pool_id,
        admin_headers={"Authorization": f"Bearer {admin_token}"},
    )
    if step is not None:
        assert (await setup.publish(step)).status_code == 201
    for _ in range(workers):
        await setup.add_worker(stake=stake)
    try:
        yield setup
    finally:
        await setup.close()
