"""What an operator's changes to a running pool do to the work in it: lifecycle actions and
settings changed while nodes hold leases, tasks are queued and results wait for verdicts."""

from __future__ import annotations

from typing import Any

import httpx
from sqlalchemy import select

from orchestrator.tasks.models import Task
from orchestrator.verification.models import Verdict, VerificationJob
from tests.conftest import problem
from tests.tasks_helpers import pool_setup, task
from tests.verification_helpers import balances, submit, verify_all

FREE_TEXT = {"prompt": "Write a haiku.", "sampling": {"max_tokens": 16}}  # the server cannot check it


async def _lifecycle(s: Any, *actions: str) -> dict[str, Any]:
    body: dict[str, Any] = {}
    for action in actions:
        r = await s.admin.post(f"/v1/admin/pools/{s.pool_id}/{action}", headers=s.headers)
        assert r.status_code == 200, r.text
        body = r.json()
    return body


async def test_completing_a_pool_cancels_its_open_tasks_and_settles_results_left_waiting(
    app: Any, app_state: Any, client: httpx.AsyncClient, no_audits: None
) -> None:
    """A completed pool's tasks can never be leased again. They stayed ``open``: counted as
    claimable on /metrics for ever (and so in the 'work without healthy nodes' alert), and the
    result of a replicated task waited for its sibling for ever, never decided. Now every open
    task is cancelled (``end_reason`` ``pool_completed``), the waiting result is settled, and a
    task whose every replica is in is still verified and paid."""
    async with pool_setup(app, app_state, max_leases_per_node=1, economics={"reward_per_sample": 5}) as s:
        a = await s.add_worker()
        b = await s.add_worker(a.contributor.provider_key)  # one provider: b cannot take a's sibling
        r = await s.enqueue(
            [
                {**FREE_TEXT, "replication": 2, "priority": 3},
                task("done", priority=2),
                task("leased", priority=1),
                task("queued"),
            ]
        )
        replicated, done, leased, queued = range(r.json()["first_task_id"], r.json()["first_task_id"] + 4)
        [half] = (await a.claim(s.pool_id)).json()["leases"]
        assert half["task"]["task_id"] == replicated
        assert (await a.submit(half)).status_code == 201
        [whole] = (await b.claim(s.pool_id)).json()["leases"]
        assert whole["task"]["task_id"] == done
        [live] = (await a.claim(s.pool_id)).json()["leases"]
        assert live["task"]["task_id"] == leased
        # The pool pauses with the lease live: the result still counts, claims stop.
        await _lifecycle(s, "pause")
        assert (await b.claim(s.pool_id)).json()["reason"] == "pool_paused"
        assert (await a.beat([live["assignment_id"]])).json()["drop_leases"] == []
        await submit(b, whole, ["4"])  # right
        await verify_all(app_state)

        await _lifecycle(s, "complete")
        problem(await a.submit(live), 409, "lease_expired")  # given back when the member left
        tasks = {
            t["id"]: t
            for t in (await s.admin.get(f"/v1/admin/pools/{s.pool_id}/tasks", headers=s.headers)).json()[
                "items"
            ]
        }
        assert {i: (t["status"], t["end_reason"]) for i, t in tasks.items()} == {
            replicated: ("cancelled", "pool_completed"),
            done: ("completed", None),
            leased: ("cancelled", "pool_completed"),
            queued: ("cancelled", "pool_completed"),
        }
        assert tasks[queued]["failure_reason"] == "the pool was completed"
        metrics = (await client.get("/metrics")).text
        assert "orchestrator_tasks_claimable 0.0" in metrics
        assert "orchestrator_leases_active 0.0" in metrics
        async with app_state.sessionmaker() as session:
            stages = dict(
                (await session.execute(select(VerificationJob.task_id, VerificationJob.stage))).all()
            )
            verdicts = dict((await session.execute(select(Verdict.task_id, Verdict.reason))).all())
            replicas = (
                await session.execute(select(Task.available_replicas).where(Task.id == queued))
            ).scalar()
        assert stages == {replicated: "done", done: "done"}
        assert verdicts == {replicated: "task_abandoned", done: "verified"}
        assert replicas == 0
        assert (await balances(client, b))["rewards_pending"] == 5
        audit = (
            await s.admin.get("/v1/admin/audit", params={"pool_id": s.pool_id}, headers=s.headers)
        ).json()["items"][0]
        assert audit["action"] == "pool.complete"
        assert audit["after"]["cancelled_tasks"] == 3
        # A repeat changes nothing and is not audited again.
        assert (await _lifecycle(s, "complete"))["status"] == "completed"
        again = (
            await s.admin.get("/v1/admin/audit", params={"pool_id": s.pool_id}, headers=s.headers)
        ).json()
        assert again["items"][0]["id"] == audit["id"]
