"""What a node is told of its tasks' ids: its own opaque reference for each task, not the id.

Task ids are sequential. An audit in a pool of replication 1 adds a second replica to a task
answered long ago, so its lease carried a task id far below those of the fresh tasks leased
around it: a node could answer honestly only on leases with an old task id (where its answer
is compared with another node's) and cheat on all the others."""

from __future__ import annotations

from typing import Any

from orchestrator.tasks.models import Submission
from orchestrator.tasks.refs import task_ref
from tests.tasks_helpers import pool_setup, task
from tests.verification_helpers import FixedDraw, answer_body, submit, verify_all

# An answer the server cannot check: with audits on, a result is repeated by another node.
OPEN_ENDED = {"prompt": "Name the capital of France.", "sampling": {"max_tokens": 64}}


def task_ids_in(answer: Any) -> list[int]:
    """Every ``task_id`` anywhere in a JSON answer."""
    if isinstance(answer, dict):
        found = [answer["task_id"]] if "task_id" in answer else []
        return found + [i for value in answer.values() for i in task_ids_in(value)]
    if isinstance(answer, list):
        return [i for value in answer for i in task_ids_in(value)]
    return []


async def test_a_nodes_leases_do_not_say_how_old_their_tasks_are(app: Any, app_state: Any) -> None:
    """An audit replica of an old task, claimed with thirty fresh tasks: the node's claim and
    live lease list name none of them by its id, only by the node's HMAC references, whose
    order is not the tasks' (the audit's task id was the lowest by far)."""
    app_state.rng = FixedDraw(0.0)  # the first result is audited
    async with pool_setup(app, app_state, workers=2, max_leases_per_node=50) as s:
        first, second = s.workers
        assert (await s.enqueue([OPEN_ENDED], key="old")).status_code == 201
        [answered] = (await first.claim(s.pool_id)).json()["leases"]
        await submit(first, answered, ["Paris"])
        await verify_all(app_state)  # audited: the old task has a second replica now
        app_state.rng = FixedDraw(1.0)
        assert (await s.enqueue([task(f"fresh {i}") for i in range(30)], key="fresh")).status_code == 201

        r = await second.claim(s.pool_id, max_tasks=50)
        assert r.status_code == 200, r.text
        leases = r.json()["leases"]
        real = {lease["assignment_id"]: await s.task_of(lease) for lease in leases}
        old = await s.task_of(answered)
        assert sorted(real.values()) == list(range(old, old + 31))  # the audit replica and the fresh
        listed = await s.admin.get(f"/v1/admin/pools/{s.pool_id}/tasks?limit=100", headers=s.headers)
        ids = {t["id"] for t in listed.json()["items"]}
        assert len(ids) == 31
        assert not ids & set(task_ids_in(r.json())), "a task's real id is in the node's claim answer"
        key = app_state.settings.seed_key
        refs = [lease["task"]["task_id"] for lease in leases]
        assert refs == [task_ref(key, second.node_id, real[lease["assignment_id"]]) for lease in leases]
        assert all(0 <= ref < 2**53 for ref in refs) and len(set(refs)) == 31
        by_age = sorted(leases, key=lambda lease: real[lease["assignment_id"]])
        by_ref = sorted(leases, key=lambda lease: lease["task"]["task_id"])
        assert by_ref != by_age  # by chance once in 31! (about 10^34) runs

        mine = await second.client.get("/v1/nodes/me/leases", auth=second.contributor.node_auth)
        assert mine.status_code == 200, mine.text
        assert not ids & set(task_ids_in(mine.json()))
        assert {lease["assignment_id"]: lease["task"]["task_id"] for lease in mine.json()["leases"]} == {
            lease["assignment_id"]: lease["task"]["task_id"] for lease in leases
        }


async def test_a_nodes_reference_for_a_task_is_its_own_and_stays_the_same(
    app: Any, app_state: Any, no_audits: None
) -> None:
    """Two nodes with a replica each of one task see two references (colluding nodes cannot
    match their leases by it); each sees its own again in a lease given back and taken again,
    its lease list, its result's answer (also replayed), and its own and its provider's
    verdicts. Operators and trainers see the task's real id."""
    async with pool_setup(app, app_state, workers=2) as s:
        a, b = s.workers
        task_id = (await s.enqueue([task(replication=2)])).json()["first_task_id"]
        [lease_a] = (await a.claim(s.pool_id)).json()["leases"]
        [lease_b] = (await b.claim(s.pool_id)).json()["leases"]
        assert await s.task_of(lease_a) == await s.task_of(lease_b) == task_id
        ref_a, ref_b = lease_a["task"]["task_id"], lease_b["task"]["task_id"]
        assert ref_a != ref_b and task_id not in (ref_a, ref_b)

        assert (await a.release(lease_a)).status_code == 200
        [again] = (await a.claim(s.pool_id)).json()["leases"]
        assert (again["seed"], again["task"]["task_id"]) == (lease_a["seed"], ref_a)  # the same replica
        listed = (await a.client.get("/v1/nodes/me/leases", auth=a.contributor.node_auth)).json()
        assert [lease["task"]["task_id"] for lease in listed["leases"]] == [ref_a]

        url = f"/v1/assignments/{again['assignment_id']}/result"
        body = answer_body(again, ["4"])
        first = await a.client.post(url, json=body, auth=a.contributor.node_auth)
        assert (first.status_code, first.json()["task_id"]) == (201, ref_a)
        replay = await a.client.post(url, json=body, auth=a.contributor.node_auth)
        assert (replay.status_code, replay.json()["task_id"]) == (200, ref_a)
        assert (await submit(b, lease_b, ["4"]))["task_id"] == ref_b
        await verify_all(app_state)

        for worker, ref in ((a, ref_a), (b, ref_b)):
            own = await worker.client.get("/v1/nodes/me/verdicts", auth=worker.contributor.node_auth)
            assert [v["task_id"] for v in own.json()["items"]] == [ref], own.text
            provider = await worker.client.get(
                "/v1/providers/me/verdicts", auth=worker.contributor.provider_auth
            )
            assert [v["task_id"] for v in provider.json()["items"]] == [ref], provider.text

        # Operators and trainers: the task's id.
        pool_verdicts = await s.admin.get(f"/v1/admin/pools/{s.pool_id}/verdicts", headers=s.headers)
        assert [v["task_id"] for v in pool_verdicts.json()["items"]] == [task_id, task_id]
        assert [v["category"] for v in pool_verdicts.json()["items"]] == ["valid", "valid"]
        node_verdicts = await s.admin.get(f"/v1/admin/nodes/{a.node_id}/verdicts", headers=s.admin_headers)
        assert [v["task_id"] for v in node_verdicts.json()["items"]] == [task_id]
        detail = await s.admin.get(f"/v1/admin/pools/{s.pool_id}/tasks/{task_id}", headers=s.headers)
        assert detail.json()["id"] == task_id
        assert {x["id"] for x in detail.json()["assignments"]} == {
            lease_a["assignment_id"],
            again["assignment_id"],
            lease_b["assignment_id"],
        }
        subs = await s.admin.get(
            f"/v1/admin/pools/{s.pool_id}/tasks/{task_id}/submissions", headers=s.headers
        )
        assert subs.json()["task_id"] == task_id and len(subs.json()["submissions"]) == 2
        fed = await s.admin.get(f"/v1/pools/{s.pool_id}/rollouts", headers=s.headers)
        assert [item["task"]["task_id"] for item in fed.json()["items"]] == [task_id, task_id]


async def test_a_result_answered_with_the_task_id_replays_with_the_reference(
    app: Any, app_state: Any, no_audits: None
) -> None:
    """A result's answer is kept for its replays. One kept before the references were given
    has the task's real id in it: a replay answers with the node's reference instead."""
    async with pool_setup(app, app_state, workers=1) as s:
        w = s.workers[0]
        task_id = (await s.enqueue([task()])).json()["first_task_id"]
        [lease] = (await w.claim(s.pool_id)).json()["leases"]
        ref = lease["task"]["task_id"]
        answer = await submit(w, lease, ["4"])
        assert answer["task_id"] == ref != task_id
        async with app_state.sessionmaker() as session, session.begin():
            stored = await session.get(Submission, answer["submission_id"])
            assert stored is not None and stored.response["task_id"] == ref
            stored.response = {**stored.response, "task_id": task_id}  # as it was kept before
        replay = await w.client.post(
            f"/v1/assignments/{lease['assignment_id']}/result",
            json=answer_body(lease, ["4"]),
            auth=w.contributor.node_auth,
        )
        assert replay.status_code == 200, replay.text
        assert replay.json() == {**answer, "task_id": ref}
