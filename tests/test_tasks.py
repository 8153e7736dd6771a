"""Policy versions and task batches (operator and trainer API)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
from pydantic import SecretStr
from sqlalchemy import select, update

from orchestrator.audit.models import AuditEntry
from orchestrator.pools.models import Pool
from orchestrator.tasks.models import TaskReplica
from orchestrator.tasks.seeds import derive_seed
from tests.conftest import make_token, postgres_only, problem
from tests.tasks_helpers import pool_setup, task
from tests.verification_helpers import FixedDraw, submit, verdicts, verify_all
from tests.waits import HANG_S, until_waiting

ECON = {"min_stake_per_node": 1000, "reward_per_sample": 7, "fraud_slash_amount": 200}


async def test_policy_steps_must_increase(app: Any, app_state: Any) -> None:
    async with pool_setup(app, app_state, step=None) as s:
        first = await s.publish(5)
        assert first.status_code == 201
        problem(await s.publish(4), 409, "policy_step_not_increasing")
        other = {"step": 5, "uri": "s3://ckpt/another", "sha256": "a" * 64, "size": 1024}
        r = await s.admin.post(f"/v1/admin/pools/{s.pool_id}/policies", headers=s.headers, json=other)
        assert problem(r, 409, "policy_step_not_increasing")["current_step"] == 5
        assert (await s.publish(6)).status_code == 201
        listed = (await s.admin.get(f"/v1/admin/pools/{s.pool_id}/policies", headers=s.headers)).json()
        assert [p["step"] for p in listed] == [6, 5]
        bad = await s.admin.post(
            f"/v1/admin/pools/{s.pool_id}/policies",
            headers=s.headers,
            json={"step": 7, "uri": "s3://x", "sha256": "XYZ", "size": 1},
        )
        problem(bad, 422, "validation_failed")


async def test_publishing_the_same_version_again_returns_it_and_changes_nothing(
    app: Any, app_state: Any
) -> None:
    """A trainer whose publish timed out retries it: the same step and checkpoint (shards too)
    is the version as published, 200, not a 409 that reads as if another publisher got there
    first; it is audited once, and the step after it still publishes."""
    async with pool_setup(app, app_state, step=None) as s:
        policies = f"/v1/admin/pools/{s.pool_id}/policies"
        shards = [
            {"uri": "s3://ckpt/5/0", "sha256": "b" * 64, "bytes": 4},
            {"uri": "s3://ckpt/5/1", "sha256": "c" * 64, "bytes": 6},
        ]
        version = {"step": 5, "uri": "s3://ckpt/5", "sha256": "a" * 64, "size": 10, "shards": shards}
        first = await s.admin.post(policies, headers=s.headers, json=version)
        assert first.status_code == 201, first.text
        assert (await s.publish(6)).status_code == 201
        again = await s.admin.post(policies, headers=s.headers, json=version)
        assert again.status_code == 200, again.text
        assert again.json() == first.json()
        reordered = {**version, "shards": shards[::-1]}  # another manifest: another checkpoint
        problem(
            await s.admin.post(policies, headers=s.headers, json=reordered), 409, "policy_step_not_increasing"
        )
        listed = (await s.admin.get(policies, headers=s.headers)).json()
        assert [p["step"] for p in listed] == [6, 5]
        audit = await s.admin.get("/v1/admin/audit", params={"pool_id": s.pool_id}, headers=s.admin_headers)
        assert audit.status_code == 200, audit.text
        published = [e["target_id"] for e in audit.json()["items"] if e["action"] == "policy.publish"]
        assert published == ["6", "5"]


async def test_a_blank_uri_or_a_shard_manifest_that_is_not_the_checkpoint_is_refused(
    app: Any, app_state: Any
) -> None:
    """Workers fetch the checkpoint from uri and check it against the manifest: a blank or
    padded URI, shards whose bytes do not add up to the size, or one shard listed twice would
    reach every worker's claims as published. Each is a 422 naming the field; nothing is
    recorded, and a manifest that adds up is still published."""
    async with pool_setup(app, app_state, step=None) as s:
        policies = f"/v1/admin/pools/{s.pool_id}/policies"
        version = {"step": 1, "uri": "s3://ckpt/step-1", "sha256": "a" * 64, "size": 10}
        shard = {"uri": "s3://ckpt/step-1/0", "sha256": "b" * 64, "bytes": 5}
        other = {"uri": "s3://ckpt/step-1/1", "sha256": "c" * 64, "bytes": 5}
        for bad, field in (
            ({"uri": " "}, "body.uri"),
            ({"uri": "\t\n"}, "body.uri"),
            ({"uri": " s3://ckpt/step-1"}, "body.uri"),
            ({"shards": [{**shard, "uri": "  "}, other]}, "body.shards.0.uri"),
            ({"shards": [shard]}, "body.shards"),
            ({"shards": [shard, other, {**other, "uri": "s3://ckpt/step-1/2"}]}, "body.shards"),
            ({"shards": []}, "body.shards"),
            ({"shards": [shard, {**other, "uri": shard["uri"]}]}, "body.shards"),
        ):
            body = problem(
                await s.admin.post(policies, headers=s.headers, json={**version, **bad}),
                422,
                "validation_failed",
            )
            assert body["detail"].startswith(field + ":"), (bad, body["detail"])
        assert (await s.admin.get(policies, headers=s.headers)).json() == []

        ok = await s.admin.post(policies, headers=s.headers, json={**version, "shards": [shard, other]})
        assert ok.status_code == 201, ok.text
        listed = (await s.admin.get(policies, headers=s.headers)).json()
        assert [(p["uri"], p["size"], len(p["shards"])) for p in listed] == [("s3://ckpt/step-1", 10, 2)]


async def test_members_see_the_current_policy(app: Any, app_state: Any) -> None:
    async with pool_setup(app, app_state, workers=1, step=3) as s:
        w = s.workers[0]
        r = await w.client.get(f"/v1/pools/{s.pool_id}/policy", auth=w.contributor.node_auth)
        assert r.status_code == 200 and r.json()["step"] == 3 and r.json()["uri"] == "s3://ckpt/step-3"
        outsider = await s.add_worker()
        await outsider.client.post(
            f"/v1/pools/{s.pool_id}/leave", json={}, auth=outsider.contributor.node_auth
        )
        problem(
            await outsider.client.get(f"/v1/pools/{s.pool_id}/policy", auth=outsider.contributor.node_auth),
            404,
            "pool_not_found",
        )


async def test_a_trainer_token_acts_only_on_its_pools(
    app: Any, app_state: Any, client: httpx.AsyncClient
) -> None:
    async with pool_setup(app, app_state, step=None) as s:
        trainer = {"Authorization": f"Bearer {await make_token(app_state, 'trainer')}"}
        problem(
            await client.post(
                f"/v1/admin/pools/{s.pool_id}/policies",
                headers=trainer,
                json={"step": 1, "uri": "s3://x", "sha256": "a" * 64, "size": 1},
            ),
            404,
            "pool_not_found",
        )
        from orchestrator.admin.tokens import Role, create_token

        async with app_state.sessionmaker() as session, session.begin():
            token, _ = await create_token(session, role=Role.trainer, name="t", pool_ids=[s.pool_id])
        scoped = {"Authorization": f"Bearer {token}"}
        r = await client.post(
            f"/v1/admin/pools/{s.pool_id}/policies",
            headers=scoped,
            json={"step": 1, "uri": "s3://x", "sha256": "a" * 64, "size": 1},
        )
        assert r.status_code == 201
        r = await client.post(
            f"/v1/admin/pools/{s.pool_id}/tasks", headers=scoped, json={"batch_key": "t-1", "tasks": [task()]}
        )
        assert r.status_code == 201
        problem(
            await client.post(f"/v1/admin/pools/{s.pool_id}/tasks/1/cancel", headers=scoped),
            403,
            "role_forbidden",
        )
        other_operator = {"Authorization": f"Bearer {await make_token(app_state, 'operator')}"}
        problem(
            await client.get(f"/v1/admin/pools/{s.pool_id}/tasks", headers=other_operator),
            404,
            "pool_not_found",
        )


async def test_enqueue_is_atomic_and_idempotent_by_batch_key(app: Any, app_state: Any) -> None:
    async with pool_setup(app, app_state) as s:
        tasks = [task(f"problem {i}") for i in range(50)]
        first = await s.enqueue(tasks, key="b-1")
        assert first.status_code == 201
        assert first.json()["task_count"] == 50
        again = await s.enqueue(tasks, key="b-1")
        assert again.status_code == 200
        assert again.json()["batch_id"] == first.json()["batch_id"]
        problem(await s.enqueue(tasks[:10], key="b-1"), 409, "batch_key_reused")
        # One bad task refuses the whole batch.
        bad = [*tasks, {"sampling": {"max_tokens": 10}}]
        problem(await s.enqueue(bad, key="b-2"), 422, "validation_failed")
        listing = (
            await s.admin.get(f"/v1/admin/pools/{s.pool_id}/tasks", params={"limit": 500}, headers=s.headers)
        ).json()
        assert len(listing["items"]) == 50


async def test_an_enqueue_retried_with_its_json_spelled_otherwise_is_the_same_batch(
    app: Any, app_state: Any
) -> None:
    """The batch key compared a hash of the body's JSON as validated: a retry whose metadata
    keys came in another order, or whose deadline had another UTC offset, said the same and was
    refused (409 batch_key_reused). A batch stored before (with that hash) still matches its
    retry; a different body is still refused."""
    from sqlalchemy import update as sql_update

    from api_schemas.tasks import TaskBatchIn
    from orchestrator.core.digest import body_digests
    from orchestrator.tasks.models import TaskBatch

    first = [{**task("a"), "metadata": {"x": 1, "y": 2}, "deadline_at": "2099-01-01T02:00:00+02:00"}]
    respelled = [{**task("a"), "metadata": {"y": 2, "x": 1}, "deadline_at": "2099-01-01T00:00:00Z"}]
    async with pool_setup(app, app_state) as s:
        made = await s.enqueue(first, key="k-1")
        assert made.status_code == 201, made.text
        again = await s.enqueue(respelled, key="k-1")
        assert (again.status_code, again.json()["batch_id"]) == (200, made.json()["batch_id"])
        other = [{**respelled[0], "metadata": {"y": 2, "x": 3}}]
        problem(await s.enqueue(other, key="k-1"), 409, "batch_key_reused")
        # A batch stored with the former digest: the same request again is still the same batch.
        legacy = body_digests(TaskBatchIn.model_validate({"batch_key": "k-1", "tasks": first}))[1]
        async with app_state.sessionmaker() as session, session.begin():
            await session.execute(sql_update(TaskBatch).values(body_sha256=legacy))
        assert (await s.enqueue(first, key="k-1")).status_code == 200


async def test_text_with_nul_and_json_with_nan_are_refused_not_stored(app: Any, app_state: Any) -> None:
    """PostgreSQL stores neither a NUL character in text nor NaN or Infinity in JSON (Python's
    JSON parser accepts the bare words), and SQLite would serve NaN back to workers as null:
    such a policy or batch is a 422 naming the field, and nothing is recorded."""
    async with pool_setup(app, app_state, step=None) as s:
        policies = f"/v1/admin/pools/{s.pool_id}/policies"
        version = {"step": 1, "uri": "s3://ckpt/step-1", "sha256": "a" * 64, "size": 2}
        shard = {"uri": "s3://ckpt/step-1/0", "sha256": "b" * 64, "bytes": 2}
        for bad in ({"uri": "s3://ckpt/\u0000"}, {"shards": [{**shard, "uri": "s3://\u0000"}]}):
            r = await s.admin.post(policies, headers=s.headers, json={**version, **bad})
            problem(r, 422, "validation_failed")
        assert (await s.admin.get(policies, headers=s.headers)).json() == []

        good = '{"prompt": "What is 2+2?", "sampling": {"max_tokens": 8}'
        for i, bad_task in enumerate(
            (
                '{"prompt": "2+2\\u0000?", "sampling": {"max_tokens": 8}}',
                '{"problem_ref": "math/\\u0000", "sampling": {"max_tokens": 8}}',
                good + ', "metadata": {"difficulty": NaN}}',
                good + ', "verification": {"answer": "4", "tolerance": [Infinity]}}',
            )
        ):
            body = f'{{"batch_key": "b-{i}", "tasks": [{good}}}, {bad_task}]}}'
            r = await s.admin.post(
                f"/v1/admin/pools/{s.pool_id}/tasks",
                content=body.encode(),
                headers={**s.headers, "Content-Type": "application/json"},
            )
            assert problem(r, 422, "validation_failed")["errors"][0]["loc"][:3] == ["body", "tasks", 1]
        listing = (await s.admin.get(f"/v1/admin/pools/{s.pool_id}/tasks", headers=s.headers)).json()
        assert listing["items"] == []


def _nested(depth: int) -> dict[str, Any]:
    """An object holding objects ``depth`` deep (itself is level 1)."""
    value: dict[str, Any] = {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


async def test_metadata_or_verification_nested_too_deep_is_refused(app: Any, app_state: Any) -> None:
    """Pydantic serializes some 255 levels at most: a task's metadata 300 deep failed the enqueue
    with a 500, and a verification spec 256 deep was stored and then failed every validator's
    claim of its results (500). Nesting past 64 levels is 422 naming the field, and nothing is
    recorded; 64 levels are taken."""
    async with pool_setup(app, app_state) as s:
        for field, depth in (("metadata", 300), ("verification", 256), ("metadata", 65)):
            r = await s.enqueue([task(), task(**{field: _nested(depth)})], key=f"{field}-{depth}")
            body = problem(r, 422, "validation_failed")
            assert body["errors"][0]["loc"] == ["body", "tasks", 1, field], body
            assert "nested at most 64 deep" in body["detail"]
        problem_set = {"problem_id": "q", "prompt": "p", "verification": _nested(300)}
        r = await s.admin.post(
            f"/v1/admin/pools/{s.pool_id}/restem/iterations",
            json={"name": "deep", "policy_step": 1, "problems": [problem_set]},
            headers=s.headers,
        )
        problem(r, 422, "validation_failed")
        listing = (await s.admin.get(f"/v1/admin/pools/{s.pool_id}/tasks", headers=s.headers)).json()
        assert listing["items"] == []
        r = await s.enqueue([task(metadata=_nested(64), verification={"answer": "4", "x": _nested(63)})])
        assert r.status_code == 201, r.text


async def test_metadata_or_verification_holding_text_that_is_not_unicode_is_refused(
    app: Any, app_state: Any
) -> None:
    """JSON can spell a lone surrogate (\\ud800), which is no Unicode character and which UTF-8
    cannot encode: a task's metadata or verification spec holding one, as a string or as a name,
    failed the enqueue with a 500 (its batch digest could not encode it), and so did a ReST^EM
    problem's. Each is 422 naming the field now, nothing is recorded, and the batch key is still
    free for the right batch."""
    async with pool_setup(app, app_state) as s:
        for field, value in (
            ("metadata", {"difficulty": "LONE"}),
            ("metadata", {"LONE": 1}),
            ("verification", {"answer": "4", "accept": ["4", "fourLONE"]}),
            ("verification", {"answer": "4", "x": {"LONE": True}}),
        ):
            body = {"batch_key": "b", "tasks": [task(), task(**{field: value})]}
            r = await s.admin.post(
                f"/v1/admin/pools/{s.pool_id}/tasks",
                content=json.dumps(body).replace("LONE", "\\ud800").encode(),
                headers={**s.headers, "Content-Type": "application/json"},
            )
            body = problem(r, 422, "validation_failed")
            assert body["errors"][0]["loc"] == ["body", "tasks", 1, field], body
            assert "no lone surrogate" in body["detail"]
        problem_set = {"problem_id": "q", "prompt": "p", "verification": {"answer": "LONE"}}
        r = await s.admin.post(
            f"/v1/admin/pools/{s.pool_id}/restem/iterations",
            content=json.dumps({"name": "lone", "policy_step": 1, "problems": [problem_set]})
            .replace("LONE", "\\ud800")
            .encode(),
            headers={**s.headers, "Content-Type": "application/json"},
        )
        problem(r, 422, "validation_failed")
        listing = (await s.admin.get(f"/v1/admin/pools/{s.pool_id}/tasks", headers=s.headers)).json()
        assert listing["items"] == []
        r = await s.enqueue([task(), task(metadata={"difficulty": "\u00e9"})], key="b")
        assert r.status_code == 201, r.text


async def test_enqueue_refuses_tasks_whose_reward_could_never_be_paid(app: Any, app_state: Any) -> None:
    """A pool stored before reward_per_sample was bounded may pay more per sample than a result
    of many samples can be paid in one ledger transfer (10^15): such tasks are refused when
    they are enqueued, not decided never."""
    async with pool_setup(app, app_state) as s:
        async with app_state.sessionmaker() as session, session.begin():
            await session.execute(
                update(Pool).where(Pool.id == s.pool_id).values(reward_per_sample=10**15 // 2)
            )
        body = problem(
            await s.enqueue([task(n=1), task(n=3), task(n=2)], key="b-1"), 409, "reward_exceeds_ledger_limit"
        )
        assert body["task_indexes"] == [1]
        assert (await s.enqueue([task(n=2)], key="b-2")).status_code == 201
        listing = (await s.admin.get(f"/v1/admin/pools/{s.pool_id}/tasks", headers=s.headers)).json()
        assert len(listing["items"]) == 1  # only the batch that fits


async def test_enqueue_refuses_more_replicas_than_the_pool_admits_nodes(app: Any, app_state: Any) -> None:
    """Replicas of a task go to different nodes; a pool capped at max_nodes can never lease
    more replicas of one task than that (its replication_factor is held to the cap already),
    so a task asking for more would stay open for ever: refused, naming the tasks."""
    async with pool_setup(app, app_state) as s:
        r = await s.admin.patch(
            f"/v1/admin/pools/{s.pool_id}", json={"caps": {"max_nodes": 2}}, headers=s.headers
        )
        assert r.status_code == 200, r.text
        body = problem(
            await s.enqueue([task(replication=2), task(replication=3)], key="b-1"),
            409,
            "replication_exceeds_max_nodes",
        )
        assert body["task_indexes"] == [1] and body["max_nodes"] == 2
        assert (await s.enqueue([task(replication=2)], key="b-2")).status_code == 201
        listing = (await s.admin.get(f"/v1/admin/pools/{s.pool_id}/tasks", headers=s.headers)).json()
        assert [t["replication"] for t in listing["items"]] == [2]


async def test_enqueue_refuses_more_than_10000_tasks(app: Any, app_state: Any) -> None:
    """Refused for the count (the body, 1.3 MB, is within a batch's 10 MiB limit: a 413 for
    its size would be the general 1 MiB limit wrongly applied to batches), and nothing is
    enqueued."""
    async with pool_setup(app, app_state) as s:
        body = {"batch_key": "big", "tasks": [task()] * 10_001}
        r = await s.admin.post(f"/v1/admin/pools/{s.pool_id}/tasks", json=body, headers=s.headers)
        errors = problem(r, 422, "validation_failed")["errors"]
        assert [(e["loc"], e["type"]) for e in errors] == [(["body", "tasks"], "too_long")], errors
        listing = (await s.admin.get(f"/v1/admin/pools/{s.pool_id}/tasks", headers=s.headers)).json()
        assert listing["items"] == []


async def test_enqueue_accepts_a_10000_task_batch(app: Any, app_state: Any) -> None:
    async with pool_setup(app, app_state) as s:
        r = await s.enqueue(
            [{"problem_ref": f"math/{i}", "sampling": {"max_tokens": 64}} for i in range(10_000)], key="full"
        )
        assert r.status_code == 201, r.text
        assert r.json()["task_count"] == 10_000


async def test_seeds_are_assigned_by_the_server_per_replica(app: Any, app_state: Any) -> None:
    async with pool_setup(app, app_state, replication_factor=3) as s:
        r = await s.enqueue([task()])
        task_id = r.json()["first_task_id"]
        detail = (await s.admin.get(f"/v1/admin/pools/{s.pool_id}/tasks/{task_id}", headers=s.headers)).json()
        secret = app_state.settings.seed_secret.get_secret_value().encode()
        seeds = [rep["seed"] for rep in detail["replicas"]]
        assert seeds == [derive_seed(secret, task_id, i) for i in range(3)]
        assert len(set(seeds)) == 3
        assert derive_seed(b"another secret", task_id, 0) != seeds[0]


async def test_a_client_that_reads_json_numbers_as_doubles_echoes_its_seed_exactly(
    app: Any, app_state: Any
) -> None:
    """A worker in JavaScript (JSON.parse reads every number as a double) is a third-party client
    the protocol is for. Seeds used to take 63 bits: such a client read 5194911570601331987 as
    5194911570601332000, echoed that, and every result it sent was judged fraud (seed_mismatch)."""
    app_state.rng = FixedDraw(1.0)  # no audit
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000) as s:
        w = s.workers[0]
        await s.enqueue([task() for _ in range(20)], key="many")
        r = await w.claim(s.pool_id, max_tasks=4)
        as_doubles = json.loads(r.text, parse_int=float)  # what JSON.parse gives
        for lease, exact in zip(as_doubles["leases"], r.json()["leases"], strict=True):
            assert 0 <= exact["seed"] < 2**53
            echoed = int(lease["seed"])  # JSON.stringify writes the double's integer back
            await submit(w, exact, ["4"], seed=echoed)
        await verify_all(app_state)
        found = await verdicts(s.admin, s.headers, s.pool_id)
        assert [(v["category"], v["reason"]) for v in found] == [("valid", "verified")] * 4


async def test_a_seed_secret_change_keeps_the_seeds_already_handed_out(app: Any, app_state: Any) -> None:
    """The seeds are recorded with the replicas: after ORCH_SEED_SECRET changes (a rotation, or
    a background process started with another one), a result echoing the seed its lease gave is
    still the assigned seed, not fraud; replicas made afterwards get seeds of the new secret."""
    app_state.rng = FixedDraw(1.0)  # no audit
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000) as s:
        w = s.workers[0]
        await s.enqueue([task()], key="before")
        lease = (await w.claim(s.pool_id)).json()["leases"][0]
        await submit(w, lease, ["4"])
        app_state.settings = app_state.settings.model_copy(update={"seed_secret": SecretStr("rotated")})
        await verify_all(app_state)
        [v] = await verdicts(s.admin, s.headers, s.pool_id)
        assert (v["outcome"], v["category"], v["reason"]) == ("accepted", "valid", "verified")
        assert v["slashed_amount"] == 0 and v["reward_amount"] == 7
        after = (await s.enqueue([task()], key="after")).json()["first_task_id"]
        detail = (await s.admin.get(f"/v1/admin/pools/{s.pool_id}/tasks/{after}", headers=s.headers)).json()
        assert detail["replicas"][0]["seed"] == derive_seed(b"rotated", after, 0)


async def test_operators_can_cancel_a_task(app: Any, app_state: Any) -> None:
    async with pool_setup(app, app_state, workers=1) as s:
        task_id = (await s.enqueue([task()])).json()["first_task_id"]
        lease = (await s.workers[0].claim(s.pool_id)).json()["leases"][0]
        r = await s.admin.post(f"/v1/admin/pools/{s.pool_id}/tasks/{task_id}/cancel", headers=s.headers)
        assert r.json()["status"] == "cancelled" and r.json()["end_reason"] == "cancelled"
        beat = await s.workers[0].beat([lease["assignment_id"]])
        assert beat.json()["drop_leases"] == [lease["assignment_id"]]
        body = problem(await s.workers[0].submit(lease), 409, "task_cancelled")
        assert (body["task_status"], body["end_reason"]) == ("cancelled", "cancelled")
        audit = (
            await s.admin.get("/v1/admin/audit", params={"pool_id": s.pool_id}, headers=s.headers)
        ).json()
        assert "task.cancel" in {e["action"] for e in audit["items"]}


async def test_a_cancel_leaves_a_task_whose_results_are_all_in_to_their_verdicts(
    app: Any, app_state: Any
) -> None:
    """Its result is judged and paid all the same (as when its pool completes), so the cancel
    said ``cancelled`` of a task that was then accepted, paid and fed to the trainer, and that
    stayed ``cancelled``. It now answers the task unchanged and audits nothing."""
    async with pool_setup(app, app_state, workers=1) as s:
        task_id = (await s.enqueue([task()])).json()["first_task_id"]
        [lease] = (await s.workers[0].claim(s.pool_id)).json()["leases"]
        await submit(s.workers[0], lease, ["4"])
        r = await s.admin.post(f"/v1/admin/pools/{s.pool_id}/tasks/{task_id}/cancel", headers=s.headers)
        assert r.status_code == 200 and (r.json()["status"], r.json()["end_reason"]) == ("submitted", None)
        await verify_all(app_state)
        detail = (await s.admin.get(f"/v1/admin/pools/{s.pool_id}/tasks/{task_id}", headers=s.headers)).json()
        assert (detail["status"], detail["end_reason"]) == ("completed", None)
        fed = (await s.admin.get(f"/v1/pools/{s.pool_id}/rollouts", headers=s.headers)).json()["items"]
        assert [item["task"]["task_id"] for item in fed] == [task_id]
        audit = (
            await s.admin.get("/v1/admin/audit", params={"pool_id": s.pool_id}, headers=s.headers)
        ).json()
        assert "task.cancel" not in {e["action"] for e in audit["items"]}


@postgres_only
async def test_two_cancels_of_one_task_at_once_cancel_it_and_are_audited_once(
    app: Any, app_state: Any
) -> None:
    """Both cancels find the task open and then wait (here for its replica, which another
    transaction holds): the second must find it cancelled and change nothing, so the audit log
    says it was cancelled once."""
    async with pool_setup(app, app_state) as s:
        task_id = (await s.enqueue([task()])).json()["first_task_id"]
        url = f"/v1/admin/pools/{s.pool_id}/tasks/{task_id}/cancel"
        async with app_state.sessionmaker() as session, session.begin():
            await session.execute(select(TaskReplica).where(TaskReplica.task_id == task_id).with_for_update())
            cancels = [asyncio.create_task(s.admin.post(url, headers=s.headers)) for _ in range(2)]
            await until_waiting(app_state, 2, *cancels, on="row")
            assert not any(c.done() for c in cancels)
        responses = [await c for c in cancels]
        assert [(r.status_code, r.json()["status"]) for r in responses] == [(200, "cancelled")] * 2
        async with app_state.sessionmaker() as session:
            actions = (
                await session.scalars(select(AuditEntry.action).where(AuditEntry.target_type == "task"))
            ).all()
        assert actions == ["task.cancel"]


@postgres_only
async def test_a_cancel_of_another_pools_task_is_a_404_that_waits_on_no_lock(
    app: Any, app_state: Any
) -> None:
    """The cancel locked the task's live leases before it checked that the task was the pool's:
    an operator naming another pool's task waited on (and briefly held) that pool's leases
    before its 404."""
    from orchestrator.tasks.models import Assignment

    async with pool_setup(app, app_state, workers=1) as theirs, pool_setup(app, app_state) as mine:
        task_id = (await theirs.enqueue([task()])).json()["first_task_id"]
        assert len((await theirs.workers[0].claim(theirs.pool_id)).json()["leases"]) == 1
        url = f"/v1/admin/pools/{mine.pool_id}/tasks/{task_id}/cancel"
        async with app_state.sessionmaker() as session, session.begin():
            await session.execute(select(Assignment).where(Assignment.task_id == task_id).with_for_update())
            r = await asyncio.wait_for(mine.admin.post(url, headers=mine.headers), timeout=HANG_S)
        problem(r, 404, "task_not_found")


@postgres_only
async def test_a_policy_is_not_published_into_a_pool_completed_while_the_publish_waited(
    app: Any, app_state: Any
) -> None:
    """The publish reads the pool (scope check), then locks it. A completion that commits in
    between must be seen: the lock used to keep the pool as first read, status and all."""
    async with pool_setup(app, app_state) as s:
        async with app_state.sessionmaker() as session, session.begin():
            await session.execute(select(Pool).where(Pool.id == s.pool_id).with_for_update())
            publish = asyncio.create_task(s.publish(2))
            await until_waiting(app_state, 1, publish, on="row")
            assert not publish.done()
            await session.execute(update(Pool).where(Pool.id == s.pool_id).values(status="completed"))
        problem(await publish, 409, "pool_completed")
        listed = (await s.admin.get(f"/v1/admin/pools/{s.pool_id}/policies", headers=s.headers)).json()
        assert [p["step"] for p in listed] == [1]
