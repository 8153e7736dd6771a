"""What an operator's changes to a running pool do to the work in it: lifecycle actions and
settings changed while nodes hold leases, tasks are queued and results wait for verdicts."""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any

import httpx
from sqlalchemy import select, text, update

from orchestrator.pools.models import PoolInvite
from orchestrator.tasks.models import Submission, Task
from orchestrator.verification.models import Verdict, VerificationJob
from tests.conftest import postgres_only, problem
from tests.tasks_helpers import pool_setup, task
from tests.verification_helpers import balances, submit, verdicts, verify_all
from tests.waits import until_waiting

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
        assert await s.task_of(half) == replicated
        assert (await a.submit(half)).status_code == 201
        [whole] = (await b.claim(s.pool_id)).json()["leases"]
        assert await s.task_of(whole) == done
        [live] = (await a.claim(s.pool_id)).json()["leases"]
        assert await s.task_of(live) == leased
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


async def _patch(s: Any, body: dict[str, Any]) -> dict[str, Any]:
    r = await s.admin.patch(f"/v1/admin/pools/{s.pool_id}", json=body, headers=s.headers)
    assert r.status_code == 200, r.text
    return dict(r.json())


async def test_a_vote_left_undecided_in_a_completed_pool_asks_for_no_tie_break(
    app: Any, app_state: Any, no_audits: None
) -> None:
    """Both replicas answered, differently, then the pool was completed before the verifier
    reached them. A tie-break replica would reopen the task in a pool where no node can ever
    lease it (it stayed open until the quorum wait withdrew it, an hour by default): the vote
    is decided inconclusive at once instead."""
    async with pool_setup(app, app_state, workers=2) as s:
        task_id = (await s.enqueue([{**FREE_TEXT, "replication": 2}])).json()["first_task_id"]
        for w, answer in zip(s.workers, ["one", "two"], strict=True):
            [lease] = (await w.claim(s.pool_id)).json()["leases"]
            await submit(w, lease, [answer])
        await _lifecycle(s, "pause", "complete")
        await verify_all(app_state)
        detail = (await s.admin.get(f"/v1/admin/pools/{s.pool_id}/tasks/{task_id}", headers=s.headers)).json()
        assert (detail["status"], detail["replication"]) == ("completed", 2)
        vs = await verdicts(s.admin, s.headers, s.pool_id)
        assert [(v["category"], v["reason"]) for v in vs] == [("inconclusive", "no_quorum")] * 2


async def test_results_already_received_are_judged_and_paid_by_the_terms_they_came_in_under(
    app: Any, app_state: Any, client: httpx.AsyncClient, no_audits: None
) -> None:
    """The verifier read the pool's settings when it decided, not those in force when the result
    was received: an operator who lowered ``max_async_level``, turned on ``require_proof`` or
    changed ``reward_per_sample`` while results waited for the verifier had results the server
    had accepted (201) re-judged invalid (``policy_stale``, ``proof_missing``: no reward, and the
    soft penalty forfeited from the node's held rewards) and paid at a rate that depended on how
    far behind the verifier was. A result is now judged and paid by the terms it was received
    under; results received after the change get the new ones."""
    economics = {"reward_per_sample": 5, "soft_invalid_penalty": 3}
    async with pool_setup(app, app_state, workers=1, max_async_level=2, economics=economics) as s:
        [w] = s.workers
        await s.enqueue([task("earlier"), task("stale"), task("no proof"), task("after")])
        [earlier, stale, proofless, after] = (await w.claim(s.pool_id, 4)).json()["leases"]
        await submit(w, earlier, ["4"])
        await verify_all(app_state)
        assert (await balances(client, w))["rewards_pending"] == 5
        for step in (2, 3):
            assert (await s.publish(step)).status_code == 201
        await submit(w, stale, ["4"])  # step 1 of 3: within the bound of 2
        await submit(w, proofless, ["4"], policy_step=3)
        await _patch(
            s,
            {"policy": {"max_async_level": 0, "require_proof": True}, "economics": {"reward_per_sample": 7}},
        )
        problem(await w.submit(after, policy_step=1), 409, "policy_stale")  # the new bound, from now on
        await submit(w, after, ["4"], policy_step=3)  # no proof, received after require_proof
        await verify_all(app_state)
        async with app_state.sessionmaker() as session:
            verdicts = {
                r.task_id: (r.reason, r.reward_amount, r.slashed_amount)
                for r in (await session.execute(select(Verdict))).scalars()
            }
        first = await s.task_of(earlier)
        assert verdicts == {
            first: ("verified", 5, 0),
            await s.task_of(stale): ("verified", 5, 0),
            await s.task_of(proofless): ("verified", 5, 0),
            await s.task_of(after): ("proof_missing", 0, 3),
        }


async def test_results_already_received_are_penalised_and_held_by_the_terms_they_came_in_under(
    app: Any, app_state: Any, no_audits: None
) -> None:
    """The pool's fraud slash, soft penalty and reward hold that decide a result's verdict are
    those in force when the result was received: an operator who raises them while results
    wait for the verifier changes nothing for those results, only for the ones that follow."""
    economics = {
        "min_stake_per_node": 1000,
        "reward_per_sample": 7,
        "reward_hold_s": 3600,
        "soft_invalid_penalty": 3,
        "fraud_slash_amount": 200,
    }
    async with pool_setup(app, app_state, workers=1, economics=economics, stake=1000) as s:
        [w] = s.workers
        await s.enqueue([task("honest"), task("wrong"), task("forged"), task("after")])
        [honest, wrong, forged, after] = (await w.claim(s.pool_id, 4)).json()["leases"]
        await submit(w, honest, ["4"])
        await submit(w, wrong, ["5"], claimed_reward=0.0)
        await submit(w, forged, ["5"], claimed_reward=1.0)
        changed = {"fraud_slash_amount": 500, "soft_invalid_penalty": 5, "reward_hold_s": 7200}
        await _patch(s, {"economics": changed})
        await submit(w, after, ["4"])
        await verify_all(app_state)
        async with app_state.sessionmaker() as session:
            decided = {
                r.task_id: (
                    r.reason,
                    r.reward_amount,
                    r.slashed_amount,
                    r.hold_until and r.hold_until - r.decided_at,
                )
                for r in (await session.execute(select(Verdict))).scalars()
            }
        hours = [dt.timedelta(hours=h) for h in (1, 2)]
        assert decided == {
            await s.task_of(honest): ("verified", 7, 0, hours[0]),
            # 3 of the honest reward; held by the hold it came in under, as a fraud verdict's
            # window over the solve rates counts it (ReST^EM)
            await s.task_of(wrong): ("wrong_answer", 0, 3, hours[0]),
            await s.task_of(forged): ("reward_forged", 0, 200 + 4, None),  # the stake, the rest held
            await s.task_of(after): ("verified", 7, 0, hours[1]),
        }


async def test_canary_misses_already_received_are_judged_by_the_canary_rule_they_came_in_under(
    app: Any, app_state: Any, no_audits: None
) -> None:
    """An operator who tightens the canary rule while misses wait for the verifier does not make
    them fraud: each is judged by the canary_miss_limit and canary_window in force when it was
    received (a result stored before migration 0040, which has none recorded, by the pool's)."""
    economics = {"min_stake_per_node": 1000, "fraud_slash_amount": 200, "strikes_before_ejection": 5}
    sampled = {"max_tokens": 256}  # temperature 1.0: a miss may be honest
    async with pool_setup(app, app_state, workers=1, economics=economics, stake=1000) as s:
        [w] = s.workers
        await s.enqueue([task(f"c{i}", canary=True, sampling=sampled) for i in range(3)])
        before, stored_before_0040, after = (await w.claim(s.pool_id, 3)).json()["leases"]
        await submit(w, before, ["5"])
        await submit(w, stored_before_0040, ["5"])
        async with app_state.sessionmaker() as session, session.begin():
            await session.execute(
                update(Submission)
                .where(Submission.assignment_id == stored_before_0040["assignment_id"])
                .values(canary_miss_limit=None, canary_window=None)
            )
        await _patch(s, {"policy": {"canary_miss_limit": 1, "canary_window": 1}})
        await submit(w, after, ["5"])
        await verify_all(app_state)
        async with app_state.sessionmaker() as session:
            decided = {r.task_id: r.category for r in (await session.execute(select(Verdict))).scalars()}
        assert decided == {
            await s.task_of(before): "invalid",  # the 1st miss of 3 allowed then
            await s.task_of(stored_before_0040): "fraud",  # the pool's rule at the verdict
            await s.task_of(after): "fraud",
        }


async def test_a_result_stored_before_terms_were_recorded_is_judged_by_the_pools_settings(
    app: Any, app_state: Any, client: httpx.AsyncClient, no_audits: None
) -> None:
    """Submissions from before migration 0022 have no terms recorded (NULL): the verifier falls
    back on the pool's settings at the verdict, as it always did for them."""
    async with pool_setup(app, app_state, workers=1, economics={"reward_per_sample": 5}) as s:
        [w] = s.workers
        await s.enqueue([task()])
        [lease] = (await w.claim(s.pool_id)).json()["leases"]
        await submit(w, lease, ["4"])
        async with app_state.sessionmaker() as session, session.begin():
            await session.execute(
                update(Submission).values(
                    {
                        "max_async_level": None,
                        "require_proof": None,
                        "reward_per_sample": None,
                        "reward_hold_s": None,
                        "soft_invalid_penalty": None,
                        "fraud_slash_amount": None,
                        "canary_miss_limit": None,
                        "canary_window": None,
                    }
                )
            )
        await _patch(s, {"economics": {"reward_per_sample": 7, "reward_hold_s": 60}})
        await verify_all(app_state)
        assert (await balances(client, w))["rewards_pending"] == 7
        async with app_state.sessionmaker() as session:
            [v] = (await session.execute(select(Verdict))).scalars()
            assert v.hold_until is not None and v.hold_until - v.decided_at == dt.timedelta(seconds=60)


async def _while_the_pool_is_locked(s: Any, app_state: Any, *requests: Any) -> list[httpx.Response]:
    """Send ``requests`` (coroutine factories) one after another while another transaction holds
    the pool's row, so that each reads the pool (the scope check) before the lock, and waits for
    it; then let them go, in the order they queued."""
    async with app_state.sessionmaker() as session, session.begin():
        await session.execute(text("SELECT 1 FROM pools WHERE id = :id FOR UPDATE"), {"id": s.pool_id})
        pending = []
        for request in requests:
            pending.append(asyncio.create_task(request()))
            await until_waiting(app_state, len(pending), *pending, on="row")  # queued in this order
        assert not any(p.done() for p in pending)
    return list(await asyncio.gather(*pending))


@postgres_only
async def test_a_resume_and_a_complete_at_once_never_reopen_a_completed_pool(
    app: Any, app_state: Any
) -> None:
    """Lifecycle actions queue on the pool's row and each judges its transition on what the one
    before it committed (not on the pool its scope check read before the lock): a resume queued
    behind a complete is refused and never reopens the completed pool; audited once each."""
    async with pool_setup(app, app_state, workers=1) as s:
        await _lifecycle(s, "pause")
        complete, resume = await _while_the_pool_is_locked(
            s,
            app_state,
            lambda: s.admin.post(f"/v1/admin/pools/{s.pool_id}/complete", headers=s.headers),
            lambda: s.admin.post(f"/v1/admin/pools/{s.pool_id}/resume", headers=s.headers),
        )
        assert complete.status_code == 200, complete.text
        problem(resume, 409, "pool_transition_invalid")
        assert resume.json()["pool_status"] == "completed"
        pool = (await s.admin.get(f"/v1/admin/pools/{s.pool_id}", headers=s.headers)).json()
        assert pool["status"] == "completed"
        audit = (
            await s.admin.get("/v1/admin/audit", params={"pool_id": s.pool_id}, headers=s.headers)
        ).json()
        assert [e["action"] for e in audit["items"]][:2] == ["pool.complete", "pool.pause"]


@postgres_only
async def test_two_patches_at_once_are_validated_on_each_others_result(app: Any, app_state: Any) -> None:
    """Two PATCHes queue on the pool's row and the second merges its change into the first's
    result and validates that: each alone is valid, but together they would store a
    fraud_slash_amount above min_stake_per_node, so the second is refused (422) and changes
    nothing."""
    async with pool_setup(app, app_state) as s:
        url = f"/v1/admin/pools/{s.pool_id}"
        first, second = await _while_the_pool_is_locked(
            s,
            app_state,
            lambda: s.admin.patch(
                url,
                json={"economics": {"min_stake_per_node": 10, "fraud_slash_amount": 10}},
                headers=s.headers,
            ),
            lambda: s.admin.patch(url, json={"economics": {"min_stake_per_node": 5}}, headers=s.headers),
        )
        assert first.status_code == 200, first.text
        problem(second, 422, "validation_failed")
        economics = (await s.admin.get(url, headers=s.headers)).json()["economics"]
        assert (economics["min_stake_per_node"], economics["fraud_slash_amount"]) == (10, 10)


@postgres_only
async def test_an_enqueue_waits_for_a_completion_in_progress_and_is_refused_after_it(
    app: Any, app_state: Any
) -> None:
    """The enqueue read the pool without a lock: while a completion was in progress (the pool
    row locked, its open tasks being cancelled) it inserted its batch regardless, and once both
    had committed the completed pool had open tasks again, claimable for ever. It now waits for
    the completion and is refused (409 ``pool_completed``), recording nothing."""
    async with pool_setup(app, app_state) as s:
        await _lifecycle(s, "pause")
        async with app_state.sessionmaker() as session, session.begin():
            # A completion in progress: it holds the pool's row until it commits.
            await session.execute(
                text("SELECT 1 FROM pools WHERE id = :id FOR NO KEY UPDATE"), {"id": s.pool_id}
            )
            enqueue = asyncio.create_task(s.enqueue([task()]))
            await until_waiting(app_state, 1, enqueue, on="row")
            assert not enqueue.done()
            await session.execute(
                text("UPDATE pools SET status = 'completed' WHERE id = :id"), {"id": s.pool_id}
            )
        problem(await enqueue, 409, "pool_completed")
        listed = (await s.admin.get(f"/v1/admin/pools/{s.pool_id}/tasks", headers=s.headers)).json()
        assert listed["items"] == []


@postgres_only
async def test_an_invite_waits_for_a_completion_in_progress_and_is_refused_after_it(
    app: Any, app_state: Any
) -> None:
    """Creating an invite read the pool without a lock: while a completion was in progress
    (the pool row held FOR NO KEY UPDATE, which the invite's foreign-key check does not wait
    for) it stored an invite and an ``invite.create`` entry for a pool that then committed as
    completed, which is read-only. It now waits for the completion and is refused (409
    ``pool_completed``), recording nothing."""
    async with pool_setup(app, app_state) as s:
        await _lifecycle(s, "pause")
        url = f"/v1/admin/pools/{s.pool_id}/invites"
        async with app_state.sessionmaker() as session, session.begin():
            await session.execute(
                text("SELECT 1 FROM pools WHERE id = :id FOR NO KEY UPDATE"), {"id": s.pool_id}
            )
            created = asyncio.create_task(s.admin.post(url, headers=s.headers))
            await until_waiting(app_state, 1, created, on="row")
            assert not created.done()
            await session.execute(
                text("UPDATE pools SET status = 'completed' WHERE id = :id"), {"id": s.pool_id}
            )
        problem(await created, 409, "pool_completed")
        async with app_state.sessionmaker() as session:
            assert (await session.execute(select(PoolInvite))).scalars().all() == []
        audit = (
            await s.admin.get("/v1/admin/audit", params={"pool_id": s.pool_id}, headers=s.headers)
        ).json()
        assert "invite.create" not in [e["action"] for e in audit["items"]]


async def test_max_nodes_is_not_lowered_below_the_replicas_of_an_open_task(app: Any, app_state: Any) -> None:
    """Replicas of a task go to different nodes, so a pool capped below a queued task's replicas
    would never finish it, as the enqueue of such a task is refused for. The change is refused
    too, naming the highest replication still open, and changes nothing (not even the other
    fields sent with it); once the task is cancelled the cap may be lowered."""
    async with pool_setup(app, app_state) as s:
        r = await s.enqueue([task(replication=3), task(replication=2), task()], key="b-1")
        first = r.json()["first_task_id"]
        r = await s.admin.patch(
            f"/v1/admin/pools/{s.pool_id}",
            json={"caps": {"max_nodes": 1}, "description": "smaller"},
            headers=s.headers,
        )
        body = problem(r, 409, "replication_exceeds_max_nodes")
        assert (body["max_nodes"], body["max_replication"], body["open_tasks"]) == (1, 3, 2)
        pool = (await s.admin.get(f"/v1/admin/pools/{s.pool_id}", headers=s.headers)).json()
        assert pool["caps"]["max_nodes"] is None and pool["description"] != "smaller"
        audit = await s.admin.get("/v1/admin/audit", params={"pool_id": s.pool_id}, headers=s.admin_headers)
        assert "pool.update" not in [e["action"] for e in audit.json()["items"]]
        cancel = await s.admin.post(f"/v1/admin/pools/{s.pool_id}/tasks/{first}/cancel", headers=s.headers)
        assert cancel.status_code == 200, cancel.text
        r = await s.admin.patch(
            f"/v1/admin/pools/{s.pool_id}", json={"caps": {"max_nodes": 2}}, headers=s.headers
        )
        assert r.status_code == 200, r.text
        assert r.json()["caps"]["max_nodes"] == 2
