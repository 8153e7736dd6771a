"""Ids in paths, queries and cursors above what a BIGINT column holds are refused as input
(the resource's 404 in a path, 400 in a query or an opaque cursor), never sent to the database
to fail there (500)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from orchestrator.core.keys import b64u_encode
from orchestrator.core.pagination import (
    ID_MAX,
    NOT_ISSUED,
    SCOPED_PREFIX,
    TAG_BYTES,
    CursorScope,
    encode_cursor,
)
from tests.conftest import problem
from tests.tasks_helpers import pool_setup, task
from tests.verification_helpers import answer_body

HUGE = 2**64


def forged(key: bytes) -> str:
    """A list's cursor wrapping ``key``, as a client could make one: whichever list it claims to
    be from, its key is read first."""
    return b64u_encode(SCOPED_PREFIX + bytes(TAG_BYTES) + key)


@pytest.fixture
async def lenient(app: Any) -> Any:
    """A client that reports a server error as the 500 it sends instead of raising it."""
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as c:
        yield c


async def test_huge_ids_in_paths_are_404_and_in_queries_400(app: Any, app_state: Any, lenient: Any) -> None:
    async with pool_setup(app, app_state) as s:
        admin, operator = s.admin_headers, s.headers
        pool = f"/v1/admin/pools/{s.pool_id}"
        for method, url, headers, body, status, code in (
            ("POST", f"/v1/admin/verdicts/{HUGE}/reverse", admin, {"reason": "x"}, 404, "verdict_not_found"),
            ("POST", "/v1/admin/verdicts/0/reverse", admin, {"reason": "x"}, 404, "verdict_not_found"),
            (
                "POST",
                f"/v1/validation/jobs/{HUGE}/verdict",
                admin,
                {"outcome": "valid", "reason": "ok", "fencing_token": 1, "evidence": {}},
                404,
                "validation_job_not_found",
            ),
            ("GET", f"{pool}/tasks/{HUGE}", operator, None, 404, "task_not_found"),
            ("POST", f"{pool}/tasks/{HUGE}/cancel", operator, None, 404, "task_not_found"),
            ("GET", f"{pool}/tasks?cursor={HUGE}", operator, None, 400, "invalid_query"),
            ("GET", f"{pool}/verdicts?cursor={HUGE}", operator, None, 400, "invalid_query"),
            (
                "POST",
                f"/v1/admin/payouts/{HUGE}/mark-paid",
                admin,
                {"external_reference": "wire-1"},
                404,
                "payout_not_found",
            ),
            ("POST", f"/v1/admin/payouts/{HUGE}/reject", admin, {"reason": "x"}, 404, "payout_not_found"),
        ):
            problem(await lenient.request(method, url, headers=headers, json=body), status, code)
        # The largest id is a fine id that names nothing.
        problem(
            await lenient.post(f"/v1/admin/verdicts/{ID_MAX}/reverse", headers=admin, json={"reason": "x"}),
            404,
            "verdict_not_found",
        )
        problem(await lenient.get(f"{pool}/tasks/{ID_MAX}", headers=operator), 404, "task_not_found")
        # As a cursor, it is compared in the database, and names no task or verdict of the pool.
        for listing in ("tasks", "verdicts"):
            r = await lenient.get(f"{pool}/{listing}?cursor={ID_MAX}", headers=operator)
            assert "names no" in problem(r, 400, "cursor_invalid")["detail"]


async def test_huge_ids_in_opaque_cursors_are_400(app: Any, app_state: Any, lenient: Any) -> None:
    async with pool_setup(app, app_state) as s:
        for url, headers, scope in (
            (
                "/v1/admin/audit",
                s.admin_headers,
                CursorScope("admin.audit", viewer=None, pool_id=None, actor=None),
            ),
            (
                "/v1/admin/payouts",
                s.admin_headers,
                CursorScope("admin.payouts", provider_id=None, status=None, run_id=None),
            ),
            ("/v1/admin/payouts/runs", s.admin_headers, CursorScope("admin.payouts.runs")),
            (
                f"/v1/admin/pools/{s.pool_id}/members",
                s.headers,
                CursorScope("admin.pools.members", pool_id=s.pool_id, status=None),
            ),
            (
                f"/v1/admin/pools/{s.pool_id}/restem/iterations",
                s.headers,
                CursorScope("restem.iterations", pool_id=s.pool_id),
            ),
        ):
            # The list's own cursor, as a client could make it, around an id out of range.
            r = await lenient.get(url, headers=headers, params={"cursor": scope.encode(HUGE)})
            assert problem(r, 400, "cursor_invalid")["detail"] == NOT_ISSUED, url
        feed = await lenient.get(
            f"/v1/pools/{s.pool_id}/rollouts",
            headers=s.headers,
            params={"after": encode_cursor(f"rollouts:{HUGE}")},
        )
        problem(feed, 400, "cursor_invalid")


async def test_a_result_echoing_a_seed_beyond_64_bits_is_422_and_not_recorded(
    app: Any, app_state: Any
) -> None:
    async with pool_setup(app, app_state, workers=1) as s:
        w = s.workers[0]
        await s.enqueue([task()])
        lease = (await w.claim(s.pool_id)).json()["leases"][0]
        url = f"/v1/assignments/{lease['assignment_id']}/result"
        auth = w.contributor.node_auth
        r = await w.client.post(url, json=answer_body(lease, ["4"], seed=HUGE), auth=auth)
        problem(r, 422, "validation_failed")
        assert (await w.client.post(url, json=answer_body(lease, ["4"]), auth=auth)).status_code == 201


async def test_forged_cursors_that_are_not_text_are_400_on_every_paginated_route(
    app: Any, app_state: Any, lenient: Any
) -> None:
    """A cursor decodes to bytes: bytes that are not UTF-8, or text holding a NUL (which
    PostgreSQL cannot compare), are a forged cursor like any other, not a 500."""
    async with pool_setup(app, app_state) as s:
        for key in (b"\xff\xfe", b"pool_\x00", b"1\x00"):
            for url, headers, param, cursor in (
                ("/v1/pools", {}, "cursor", forged(key)),
                ("/v1/admin/pools", s.headers, "cursor", forged(key)),
                ("/v1/admin/nodes", s.admin_headers, "cursor", forged(key)),
                ("/v1/admin/tokens", s.admin_headers, "cursor", forged(key)),
                ("/v1/admin/audit", s.admin_headers, "cursor", forged(key)),
                ("/v1/admin/payouts", s.admin_headers, "cursor", forged(key)),
                (f"/v1/admin/pools/{s.pool_id}/members", s.headers, "cursor", forged(key)),
                (f"/v1/admin/pools/{s.pool_id}/restem/iterations", s.headers, "cursor", forged(key)),
                (f"/v1/pools/{s.pool_id}/rollouts", s.headers, "after", b64u_encode(b"k1:" + key)),
            ):
                r = await lenient.get(url, headers=headers, params={param: cursor})
                assert problem(r, 400, "cursor_invalid")["detail"] == NOT_ISSUED, url


async def test_a_nul_character_in_operator_input_is_refused_as_bad_input(
    app: Any, app_state: Any, lenient: Any
) -> None:
    """PostgreSQL cannot store or compare a NUL (U+0000) in text, so free text, path ids and
    query filters holding one are refused like any other bad input (the body's 422, the query's
    400, the resource's 404), never sent to the database to fail there (500), and on SQLite
    not stored either."""
    async with pool_setup(app, app_state, workers=1) as s:
        admin, operator, w = s.admin_headers, s.headers, s.workers[0]
        pool = f"/v1/admin/pools/{s.pool_id}"
        node, provider = w.node_id, w.contributor.provider_id
        batch = {"batch_key": "nul", "tasks": [task()]}
        for method, url, headers, body in (
            ("POST", "/v1/admin/pools", operator, {"name": "p", "description": "a\x00b"}),
            ("PATCH", pool, operator, {"description": "\x00"}),
            ("POST", f"/v1/admin/nodes/{node}/ban", admin, {"reason": "a\x00"}),
            ("POST", f"{pool}/members/{node}/eject", operator, {"reason": "a\x00"}),
            ("POST", f"{pool}/members/{node}/reject", operator, {"reason": "a\x00"}),
            ("POST", f"{pool}/blacklist", operator, {"provider_id": provider, "reason": "a\x00"}),
            (
                "POST",
                f"{pool}/policies",
                operator,
                {"step": 2, "uri": "s3://\x00", "sha256": "a" * 64, "size": 1},
            ),
            (
                "POST",
                f"{pool}/policies",
                operator,
                {
                    "step": 2,
                    "uri": "s3://x",
                    "sha256": "a" * 64,
                    "size": 1,
                    "shards": [{"uri": "s3://\x00", "sha256": "a" * 64, "bytes": 1}],
                },
            ),
            ("POST", f"{pool}/tasks", operator, {**batch, "tasks": [task(prompt="2+2\x00")]}),
            (
                "POST",
                f"{pool}/tasks",
                operator,
                {**batch, "tasks": [{**task(), "prompt": None, "problem_ref": "a\x00"}]},
            ),
            (
                "POST",
                f"{pool}/restem/iterations",
                operator,
                {
                    "name": "it\x00",
                    "policy_step": 1,
                    "problems": [{"problem_id": "q\x00", "prompt": "p\x00", "verification": {"answer": "4"}}],
                },
            ),
            ("POST", "/v1/admin/verdicts/1/reverse", admin, {"reason": "a\x00"}),
            ("POST", "/v1/admin/payouts/1/reject", admin, {"reason": "a\x00"}),
        ):
            r = await lenient.request(method, url, headers=headers, json=body)
            body_problem = problem(r, 422, "validation_failed")
            assert "NUL" in body_problem["detail"], (url, body_problem)
        r = await lenient.post(
            f"/v1/admin/providers/{provider}/deposits",
            headers={**admin, "Idempotency-Key": "nul-deposit-1"},
            json={"amount": 5, "reference": "wire\x00"},
        )
        problem(r, 422, "validation_failed")
        for url, headers, params in (
            ("/v1/admin/audit", admin, {"actor": "tok_\x00"}),
            ("/v1/admin/audit", operator, {"pool_id": "pool_\x00"}),
            ("/v1/admin/payouts", admin, {"provider_id": "\x00"}),
        ):
            problem(await lenient.get(url, headers=headers, params=params), 400, "invalid_query")
        for url in (
            "/v1/admin/pools/pool_%00",
            "/v1/admin/pools/pool_%00/members",
            "/v1/admin/pools/pool_%00/tasks",
            "/v1/admin/pools/pool_%00/verdicts",
            "/v1/admin/pools/pool_%00/restem/iterations",
            "/v1/pools/pool_%00/rollouts",
        ):
            problem(await lenient.get(url, headers=operator), 404, "pool_not_found")
        node_auth = w.contributor.node_auth
        problem(await lenient.post("/v1/pools/pool_%00/join", json={}, auth=node_auth), 404, "pool_not_found")
        problem(await lenient.get("/v1/pools/pool_%00/policy", auth=node_auth), 404, "pool_not_found")
        r = await lenient.post("/v1/assignments/asg_%00/release", auth=node_auth)
        problem(r, 404, "assignment_not_found")
        nothing_changed = (await lenient.get(f"/v1/admin/nodes/{node}", headers=admin)).json()
        assert nothing_changed["status"] != "banned"
        assert (await lenient.get("/v1/providers/me/balance", auth=w.contributor.provider_auth)).json()[
            "stake_free"
        ] == 0
