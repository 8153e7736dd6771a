"""A list's cursor is refused by every other list (400 cursor_invalid): another pool's list of the
same kind, another list, the same list with other filters or for another caller. A cursor is a
position; taken by a list that did not issue it, it used to skip that list's rows below it, or
serve rows twice, without an error. The list that issued it still resumes from it."""

from __future__ import annotations

import datetime as dt
from typing import Any

import httpx
import pytest

from tests.conftest import FakeClock, problem
from tests.tasks_helpers import PoolSetup, Worker, pool_setup, task
from tests.test_payouts import give_claimable
from tests.verification_helpers import submit, verify_all

pytestmark = pytest.mark.usefixtures("no_audits")

OTHER_LIST = "the cursor is not one this list issued"


async def page(client: httpx.AsyncClient, url: str, *, limit: int = 1, **kw: Any) -> dict[str, Any]:
    """A page of ``limit`` (default: one) items; ``params``, ``headers``, ``auth`` as httpx takes them."""
    params = {"limit": limit, **kw.pop("params", {})}
    r = await client.get(url, params=params, **kw)
    assert r.status_code == 200, r.text
    return dict(r.json())


async def first_cursor(client: httpx.AsyncClient, url: str, **kw: Any) -> tuple[Any, str]:
    """The first item of a list and the cursor after it (the list has more)."""
    body = await page(client, url, **kw)
    assert body["next_cursor"], body
    return body["items"][0], body["next_cursor"]


async def refused(client: httpx.AsyncClient, url: str, cursor: str, **kw: Any) -> None:
    params = {**kw.pop("params", {}), "cursor": cursor}
    r = await client.get(url, params=params, **kw)
    assert problem(r, 400, "cursor_invalid")["detail"].startswith(OTHER_LIST), (url, params)


async def verdicts_of(app_state: Any, s: PoolSetup, worker: Worker, count: int) -> None:
    """``count`` accepted results of ``worker`` in pool ``s``, verified."""
    assert (await s.enqueue([task(verification={"answer": "4"}) for _ in range(count)])).status_code == 201
    leases = (await worker.claim(s.pool_id, max_tasks=count)).json()["leases"]
    assert len(leases) == count
    for lease in leases:
        await submit(worker, lease, ["4"])
    await verify_all(app_state)


async def test_a_cursor_from_another_pools_list_is_refused(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    async with (
        pool_setup(app, app_state, workers=2) as a,
        pool_setup(app, app_state, workers=2) as b,
    ):
        admin = a.admin

        # Memberships, in join order. B's members joined after A's: B's cursor, read as a
        # position in A's list, answered an empty page, hiding A's second member.
        members_a, members_b = (f"/v1/admin/pools/{s.pool_id}/members" for s in (a, b))
        first_a, cursor_a = await first_cursor(admin, members_a, headers=a.headers)
        _, cursor_b = await first_cursor(admin, members_b, headers=b.headers)
        await refused(admin, members_a, cursor_b, headers=a.admin_headers)
        await refused(admin, members_b, cursor_a, headers=b.admin_headers)
        rest = await page(admin, members_a, params={"cursor": cursor_a}, headers=a.headers)
        assert [m["node_id"] for m in rest["items"]] == [a.workers[1].node_id] != [first_a["node_id"]]

        # ReST^EM iterations, newest first.
        url_a, url_b = (f"/v1/admin/pools/{s.pool_id}/restem/iterations" for s in (a, b))
        ids = []
        for name in ("it-1", "it-2"):
            body = {
                "name": name,
                "problems": [{"problem_id": "p1", "prompt": "What is 2+2?", "verification": {"answer": "4"}}],
                "samples_per_problem": 2,
                "keep_correct": 1,
                "policy_step": 1,
                "deadline_at": (clock.utcnow() + dt.timedelta(seconds=60)).isoformat(),
            }
            r = await a.admin.post(url_a, json=body, headers=a.headers)
            assert r.status_code == 201, r.text
            ids.append(r.json()["id"])
            clock.advance(61)  # it expires, and the next may start
        newest, cursor = await first_cursor(a.admin, url_a, headers=a.headers)
        assert newest["id"] == ids[1]
        await refused(b.admin, url_b, cursor, headers=b.headers)
        rest = await page(a.admin, url_a, params={"cursor": cursor}, headers=a.headers)
        assert [it["id"] for it in rest["items"]] == [ids[0]]


async def payouts_of(app_state: Any, worker: Worker, count: int) -> None:
    await give_claimable(app_state, worker.contributor.provider_id, 100)
    for i in range(count):
        r = await worker.client.post(
            "/v1/providers/me/withdrawals",
            json={"amount": 10},
            headers={"Idempotency-Key": f"withdrawal-{i:04}"},
            auth=worker.contributor.provider_auth,
        )
        assert r.status_code == 201, r.text


async def test_a_cursor_from_another_list_is_refused(app: Any, app_state: Any) -> None:
    async with pool_setup(app, app_state, workers=2) as a, pool_setup(app, app_state) as b:
        admin, headers = a.admin, a.admin_headers
        wa, wb = a.workers
        await payouts_of(app_state, wa, 2)
        await payouts_of(app_state, wb, 1)
        for key in ("run-0001", "run-0002"):
            r = await admin.post(
                "/v1/admin/payouts/runs", json={"max_payouts": 1}, headers={**headers, "Idempotency-Key": key}
            )
            assert r.status_code == 201, r.text

        # Lists ordered by the same kind of key (node ids and token ids, pool ids, row ids)
        # used to take each other's cursors.
        cursors = {
            "/v1/admin/nodes": (await first_cursor(admin, "/v1/admin/nodes", headers=headers))[1],
            "/v1/admin/tokens": (await first_cursor(admin, "/v1/admin/tokens", headers=headers))[1],
            "/v1/pools": (await first_cursor(admin, "/v1/pools"))[1],
            "/v1/admin/pools": (await first_cursor(admin, "/v1/admin/pools", headers=headers))[1],
            "/v1/admin/audit": (await first_cursor(admin, "/v1/admin/audit", headers=headers))[1],
            "/v1/admin/payouts": (await first_cursor(admin, "/v1/admin/payouts", headers=headers))[1],
            "/v1/admin/payouts/runs": (await first_cursor(admin, "/v1/admin/payouts/runs", headers=headers))[
                1
            ],
            f"/v1/admin/pools/{a.pool_id}/members": (
                await first_cursor(admin, f"/v1/admin/pools/{a.pool_id}/members", headers=headers)
            )[1],
        }
        mine, my_cursor = await first_cursor(
            wa.client, "/v1/providers/me/payouts", auth=wa.contributor.provider_auth
        )
        for issued_by, cursor in cursors.items():
            for url in cursors:
                if url != issued_by:
                    await refused(admin, url, cursor, headers=headers)
            await refused(wa.client, "/v1/providers/me/payouts", cursor, auth=wa.contributor.provider_auth)
            await refused(admin, f"/v1/admin/pools/{b.pool_id}/restem/iterations", cursor, headers=headers)
            assert (await page(admin, issued_by, params={"cursor": cursor}, headers=headers))["items"]
        for url in cursors:
            await refused(admin, url, my_cursor, headers=headers)
        rest = await page(
            wa.client,
            "/v1/providers/me/payouts",
            params={"cursor": my_cursor},
            auth=wa.contributor.provider_auth,
        )
        assert [p["provider_id"] for p in rest["items"]] == [wa.contributor.provider_id]
        assert rest["items"][0]["id"] < mine["id"]


async def test_a_cursor_is_bound_to_the_filters_and_the_caller_it_was_issued_for(
    app: Any, app_state: Any
) -> None:
    async with pool_setup(app, app_state, workers=2) as a, pool_setup(app, app_state, workers=1) as b:
        admin, headers = a.admin, a.admin_headers
        wa, wb = a.workers
        await payouts_of(app_state, wa, 2)
        await payouts_of(app_state, wb, 2)

        # The audit log: A's entries, by pool filter, then B's, or all of them, or one actor's.
        audit = "/v1/admin/audit"
        newest, cursor = await first_cursor(admin, audit, params={"pool_id": a.pool_id}, headers=headers)
        for params in ({"pool_id": b.pool_id}, {}, {"pool_id": a.pool_id, "actor": newest["actor"]}):
            await refused(admin, audit, cursor, params=params, headers=headers)
        # The same filter for another caller: an operator's log is its pools' and its own.
        await refused(admin, audit, cursor, params={"pool_id": a.pool_id}, headers=a.headers)
        _, operator_cursor = await first_cursor(admin, audit, headers=a.headers)
        await refused(admin, audit, operator_cursor, headers=b.headers)
        await refused(admin, audit, operator_cursor, headers=headers)
        rest = await page(admin, audit, params={"pool_id": a.pool_id, "cursor": cursor}, headers=headers)
        assert rest["items"][0]["id"] < newest["id"] and rest["items"][0]["pool_id"] == a.pool_id

        # Pools: the admin's list (every pool) and an operator's (its own), by status.
        pools = "/v1/admin/pools"
        _, cursor = await first_cursor(admin, pools, headers=headers)
        await refused(admin, pools, cursor, headers=a.headers)
        await refused(admin, pools, cursor, params={"status": "active"}, headers=headers)
        assert (await page(admin, pools, params={"cursor": cursor}, headers=headers))["items"]

        # Nodes, by status and provider.
        nodes = "/v1/admin/nodes"
        _, cursor = await first_cursor(admin, nodes, headers=headers)
        await refused(admin, nodes, cursor, params={"status": "healthy"}, headers=headers)
        await refused(
            admin, nodes, cursor, params={"provider_id": wb.contributor.provider_id}, headers=headers
        )
        assert (await page(admin, nodes, params={"cursor": cursor}, headers=headers))["items"]

        # Payouts: one provider's are not another's; the admin's list by status and provider.
        _, cursor = await first_cursor(
            wa.client, "/v1/providers/me/payouts", auth=wa.contributor.provider_auth
        )
        await refused(wb.client, "/v1/providers/me/payouts", cursor, auth=wb.contributor.provider_auth)
        await refused(
            wa.client,
            "/v1/providers/me/payouts",
            cursor,
            params={"status": "requested"},
            auth=wa.contributor.provider_auth,
        )
        payouts = "/v1/admin/payouts"
        by_provider = {"provider_id": wa.contributor.provider_id}
        newest, cursor = await first_cursor(admin, payouts, params=by_provider, headers=headers)
        for params in (
            {},
            {"provider_id": wb.contributor.provider_id},
            {**by_provider, "status": "requested"},
        ):
            await refused(admin, payouts, cursor, params=params, headers=headers)
        rest = await page(admin, payouts, params={**by_provider, "cursor": cursor}, headers=headers)
        assert [p["provider_id"] for p in rest["items"]] == [wa.contributor.provider_id]
        assert rest["items"][0]["id"] < newest["id"]


async def test_a_task_or_verdict_cursor_must_be_a_row_of_its_list(app: Any, app_state: Any) -> None:
    """These cursors are ids in the clear (an integer parameter, documented as the last id of
    the previous page): the id must be one of the list's tasks or verdicts."""
    async with (
        pool_setup(app, app_state, workers=2) as a,
        pool_setup(app, app_state, workers=2) as b,
    ):
        await verdicts_of(app_state, a, a.workers[0], 2)
        await verdicts_of(app_state, b, b.workers[0], 2)
        admin = a.admin

        # Tasks, by id: a task of this pool. B's tasks were enqueued after A's: B's cursor, read as
        # a position in A's list, answered an empty page, hiding A's second task.
        tasks_a, tasks_b = (f"/v1/admin/pools/{s.pool_id}/tasks" for s in (a, b))
        first_task, task_cursor = await first_cursor(admin, tasks_a, headers=a.headers)
        _, task_cursor_b = await first_cursor(admin, tasks_b, headers=b.headers)
        await refused(admin, tasks_a, task_cursor_b, headers=a.headers)
        await refused(admin, tasks_b, task_cursor, headers=b.headers)
        rest = await page(admin, tasks_a, params={"cursor": task_cursor}, headers=a.headers)
        assert rest["items"][0]["id"] > first_task["id"] and rest["items"][0]["pool_id"] == a.pool_id

        # Verdicts, newest first: a verdict id of this list's pool, node or provider. A's newest
        # verdict is older than B's: read in B's list, A's cursor answered nothing of B's.
        verdicts_a, verdicts_b = (f"/v1/admin/pools/{s.pool_id}/verdicts" for s in (a, b))
        newest, verdict_cursor = await first_cursor(admin, verdicts_a, headers=a.headers)
        await refused(admin, verdicts_b, verdict_cursor, headers=b.headers)
        rest = await page(admin, verdicts_a, params={"cursor": verdict_cursor}, headers=a.headers)
        assert [v["pool_id"] for v in rest["items"]] == [a.pool_id] and rest["items"][0]["id"] < newest["id"]

        wa, wb = a.workers[0], b.workers[0]
        _, node_cursor = await first_cursor(wa.client, "/v1/nodes/me/verdicts", auth=wa.contributor.node_auth)
        await refused(wb.client, "/v1/nodes/me/verdicts", node_cursor, auth=wb.contributor.node_auth)
        await refused(wb.client, "/v1/providers/me/verdicts", node_cursor, auth=wb.contributor.provider_auth)
        await refused(admin, f"/v1/admin/nodes/{wb.node_id}/verdicts", node_cursor, headers=a.admin_headers)
        await refused(
            admin,
            f"/v1/admin/providers/{wb.contributor.provider_id}/verdicts",
            node_cursor,
            headers=a.admin_headers,
        )
        # A node filter is part of the provider's list.
        await refused(
            wa.client,
            "/v1/providers/me/verdicts",
            node_cursor,
            params={"node_id": a.workers[1].node_id},
            auth=wa.contributor.provider_auth,
        )
        rest = await page(
            wa.client, "/v1/nodes/me/verdicts", params={"cursor": node_cursor}, auth=wa.contributor.node_auth
        )
        assert [v["node_id"] for v in rest["items"]] == [wa.node_id]
