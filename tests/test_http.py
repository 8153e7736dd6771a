"""Errors (RFC 9457), body limits, health, OpenAPI, logs and metrics."""

from __future__ import annotations

import asyncio
import json
import re
import select
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from asgi_lifespan import LifespanManager
from prometheus_client import REGISTRY

from orchestrator.app import create_app
from orchestrator.core.clock import FakeClock
from orchestrator.core.hotstore import HotStore, RedisHotStore
from orchestrator.core.keys import generate_key
from orchestrator.core.signing import SignatureAuth
from orchestrator.settings import LimitSettings, Settings
from tests.conftest import Contributor, asgi_post, problem
from tests.process_helpers import embedded_env, serving
from tests.waits import HANG_S


async def test_unknown_route_and_wrong_method_are_problems(client: httpx.AsyncClient) -> None:
    body = problem(await client.get("/v1/nope"), 404, "not_found")
    assert body["instance"] == "/v1/nope"
    problem(await client.delete("/v1/nodes/me"), 405, "method_not_allowed")


async def test_a_405_names_every_method_of_its_path_in_allow(client: httpx.AsyncClient) -> None:
    """RFC 9110: a 405 lists the methods the resource supports. A path served by several routes
    (GET and POST /v1/admin/pools are two) named only the first route's."""
    for path, allowed in (
        ("/v1/admin/pools", "GET, POST"),
        ("/v1/admin/pools/pool_0000000000000000", "GET, PATCH"),
        ("/v1/admin/pools/pool_0000000000000000/tasks", "GET, POST"),
        ("/v1/nodes/me", "GET"),
    ):
        r = await client.request("OPTIONS", path)
        problem(r, 405, "method_not_allowed")
        assert r.headers["allow"] == allowed, (path, r.headers.get("allow"))


async def test_a_body_that_does_not_parse_is_a_422_problem(
    client: httpx.AsyncClient, contributor: Contributor
) -> None:
    r = await client.post(
        "/v1/nodes/me/heartbeat",
        content=b"{not json",
        auth=contributor.node_auth,
        headers={"content-type": "application/json"},
    )
    body = problem(r, 422, "validation_failed")
    assert body["errors"]


async def test_a_json_body_that_is_not_utf8_is_a_422_problem(
    client: httpx.AsyncClient, admin_headers: dict[str, str]
) -> None:
    """JSON is UTF-8 (RFC 8259): other bytes are a body that does not parse, like any other."""
    r = await client.post(
        "/v1/admin/pools",
        content=b'{"name": "caf\xe9"}',
        headers={**admin_headers, "content-type": "application/json"},
    )
    body = problem(r, 422, "validation_failed")
    assert body["errors"][0]["loc"] == ["body"]
    assert (await client.get("/v1/admin/pools", headers=admin_headers)).json()["items"] == []


async def test_a_json_body_nested_too_deeply_to_parse_is_a_422_problem(
    client: httpx.AsyncClient, contributor: Contributor
) -> None:
    """PROTOCOL.md: 422 for a body that does not parse. One nested past the depth Python's JSON
    parser goes to (a RecursionError) was 400 bad_request, 'There was an error parsing the body'."""
    for path, auth in (
        ("/v1/nodes/me/heartbeat", contributor.node_auth),
        ("/v1/providers", contributor.provider_auth),
    ):
        r = await client.post(
            path,
            content=b'{"metrics": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
            auth=auth,
            headers={"content-type": "application/json"},
        )
        body = problem(r, 422, "validation_failed")
        assert body["errors"] == [
            {"loc": ["body"], "msg": "JSON nested too deeply to parse", "type": "json_invalid"}
        ]


async def test_a_json_body_in_utf16_or_utf32_or_with_a_byte_order_mark_is_a_422_problem(
    client: httpx.AsyncClient, contributor: Contributor, admin_headers: dict[str, str]
) -> None:
    """RFC 8259: JSON is UTF-8, without a byte order mark. Python's parser, given bytes, also
    reads UTF-16 and UTF-32 (and encoded surrogates): such a body was taken, and a signed result
    in UTF-16 was stored as its evidence, which strict JSON parsers then refuse."""
    pool = json.dumps({"name": "utf"})
    for content in (
        pool.encode("utf-16"),
        pool.encode("utf-32"),
        pool.encode("utf-16-le"),
        b"\xef\xbb\xbf" + pool.encode(),
        b'{"name": "\xed\xa0\x80"}',  # a surrogate, encoded
    ):
        r = await client.post(
            "/v1/admin/pools", content=content, headers={**admin_headers, "content-type": "application/json"}
        )
        body = problem(r, 422, "validation_failed")
        assert body["errors"][0]["loc"][0] == "body", content
    assert (await client.get("/v1/admin/pools", headers=admin_headers)).json()["items"] == []
    r = await client.post(
        "/v1/nodes/me/heartbeat",
        content=json.dumps({"metrics": {}}).encode("utf-16"),
        auth=contributor.node_auth,
        headers={"content-type": "application/json"},
    )
    problem(r, 422, "validation_failed")


async def test_a_json_integer_longer_than_the_parser_converts_is_a_422_problem(
    client: httpx.AsyncClient, contributor: Contributor, admin_headers: dict[str, str]
) -> None:
    """Python converts at most 4,300 digits to an int; a longer JSON number was 400 bad_request
    ('There was an error parsing the body') instead of a body that does not parse."""
    huge = b"1" + b"0" * 5000
    for path, content, kw in (
        ("/v1/admin/pools", b'{"name": "n", "x": ' + huge + b"}", {"headers": admin_headers}),
        (
            "/v1/nodes/me/heartbeat",
            b'{"metrics": {"gpu_util": ' + huge + b"}}",
            {"auth": contributor.node_auth},
        ),
    ):
        headers = {**kw.pop("headers", {}), "content-type": "application/json"}
        r = await client.post(path, content=content, headers=headers, **kw)
        body = problem(r, 422, "validation_failed")
        assert body["errors"] == [
            {
                "loc": ["body"],
                "msg": "JSON with a number too long to parse (at most 4300 digits)",
                "type": "json_invalid",
            }
        ]
    assert (await client.get("/v1/admin/pools", headers=admin_headers)).json()["items"] == []


async def test_a_path_parameter_that_cannot_be_an_id_is_the_same_404_as_an_unknown_id(
    client: httpx.AsyncClient, contributor: Contributor, admin_headers: dict[str, str]
) -> None:
    # PROTOCOL.md: 422 only for a body. A 41-character pool id names no pool, like a 40-character one.
    for pool_id in ("p" * 40, "p" * 41):
        problem(
            await client.post(f"/v1/pools/{pool_id}/join", auth=contributor.node_auth), 404, "pool_not_found"
        )
        problem(await client.get(f"/v1/admin/pools/{pool_id}", headers=admin_headers), 404, "pool_not_found")
    for assignment_id in ("a" * 40, "a" * 41):
        r = await client.post(f"/v1/assignments/{assignment_id}/release", auth=contributor.node_auth)
        problem(r, 404, "assignment_not_found")
    for payout_id in ("999999", "not-a-number", str(2**63)):
        r = await client.post(
            f"/v1/admin/payouts/{payout_id}/mark-paid",
            json={"external_reference": "wire-1"},
            headers=admin_headers,
        )
        problem(r, 404, "payout_not_found")
    # A payout run's id and, on a pool's member routes, a node id: a malformed one was 404
    # not_found and node_not_found, where an unknown one is payout_run_not_found and
    # member_not_found.
    for run_id in ("999999", "not-a-number"):
        r = await client.get(f"/v1/admin/payouts/runs/{run_id}", headers=admin_headers)
        problem(r, 404, "payout_run_not_found")
    pool = (await client.post("/v1/admin/pools", json={"name": "p"}, headers=admin_headers)).json()["id"]
    for node_id in ("n" * 43, "not-a-key"):
        r = await client.post(f"/v1/admin/pools/{pool}/members/{node_id}/approve", headers=admin_headers)
        problem(r, 404, "member_not_found")


async def test_a_query_or_header_that_does_not_validate_is_a_400_problem(
    client: httpx.AsyncClient, contributor: Contributor, admin_headers: dict[str, str]
) -> None:
    for params in ({"limit": 0}, {"limit": "many"}, {"status": "sleepy"}):
        body = problem(
            await client.get("/v1/admin/nodes", params=params, headers=admin_headers), 400, "invalid_query"
        )
        assert body["detail"].startswith("query.") and body["errors"][0]["loc"][0] == "query"
    r = await client.post(
        "/v1/providers/me/withdrawals",
        json={"amount": 10},
        headers={"Idempotency-Key": "short"},
        auth=contributor.provider_auth,
    )
    body = problem(r, 400, "invalid_header")
    assert body["detail"].startswith("header.Idempotency-Key")
    # A body that does not validate stays a 422, with the query and path fine.
    problem(
        await client.post("/v1/nodes/me/heartbeat", json={"metrics": "x"}, auth=contributor.node_auth),
        422,
        "validation_failed",
    )


async def test_unhandled_errors_are_a_500_problem_without_internals(
    settings: Settings, clock: FakeClock, hot_store: HotStore, capsys: Any
) -> None:
    app = create_app(settings, clock=clock, hot_store=hot_store)

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("secret internal detail")

    async with LifespanManager(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as c:
            r = await c.get("/boom", headers={"Authorization": "Bearer orch_do-not-log-me"})
    body = problem(r, 500, "internal_error")
    assert "secret" not in r.text and "Traceback" not in r.text
    assert body["detail"]
    logged = capsys.readouterr().out
    assert "unhandled_error" in logged and "RuntimeError" in logged
    assert "do-not-log-me" not in logged


# A statement the database refuses (a trigger stands in for a lost connection, a statement
# timeout or a value the column cannot hold): the request fails with a 500 and is logged.
_REFUSE_TASKS = {
    "sqlite": [
        "CREATE TRIGGER refuse_tasks BEFORE INSERT ON tasks BEGIN SELECT RAISE(ABORT, 'refused'); END"
    ],
    "postgresql": [
        "CREATE FUNCTION refuse_tasks() RETURNS trigger LANGUAGE plpgsql AS "
        "$$ BEGIN RAISE EXCEPTION 'refused'; END $$",
        "CREATE TRIGGER refuse_tasks BEFORE INSERT ON tasks FOR EACH ROW EXECUTE FUNCTION refuse_tasks()",
    ],
}
_ALLOW_TASKS = {
    "sqlite": ["DROP TRIGGER refuse_tasks"],
    "postgresql": ["DROP TRIGGER refuse_tasks ON tasks", "DROP FUNCTION refuse_tasks()"],
}


async def test_a_database_error_is_logged_without_the_values_of_the_statement(
    settings: Settings, clock: FakeClock, hot_store: HotStore, capsys: Any
) -> None:
    from sqlalchemy import text

    from tests.tasks_helpers import pool_setup, task

    app = create_app(settings, clock=clock, hot_store=hot_store)
    async with LifespanManager(app), pool_setup(app, app.state.orch) as setup:
        engine = app.state.orch.engine
        dialect = engine.dialect.name
        async with engine.begin() as conn:
            for sql in _REFUSE_TASKS[dialect]:
                await conn.execute(text(sql))
        try:
            body = {"batch_key": "b1", "tasks": [task(verification={"expected_answer": "answer-key-4217"})]}
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as c:
                r = await c.post(f"/v1/admin/pools/{setup.pool_id}/tasks", json=body, headers=setup.headers)
        finally:
            async with engine.begin() as conn:
                for sql in _ALLOW_TASKS[dialect]:
                    await conn.execute(text(sql))
    problem(r, 500, "internal_error")
    logged = capsys.readouterr().out
    assert "unhandled_error" in logged and "INSERT INTO tasks" in logged
    # The task's answer key (and, elsewhere, signed bodies and signatures) stay out of the logs.
    assert "answer-key-4217" not in logged


async def _limited_app(settings: Settings, clock: FakeClock, hot_store: HotStore) -> Any:
    limited = settings.model_copy(
        update={"limits": LimitSettings(max_body_bytes=2048, max_result_body_bytes=4096)}
    )
    return create_app(limited, clock=clock, hot_store=hot_store)


async def test_oversized_bodies_are_refused_with_413_before_parsing(
    settings: Settings, clock: FakeClock, hot_store: HotStore, contributor: Contributor
) -> None:
    app = await _limited_app(settings, clock, hot_store)
    big = json.dumps({"metrics": {}, "leases": ["x" * 100] * 30}).encode()
    assert len(big) > 2048
    async with (
        LifespanManager(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as c,
    ):
        r = await c.post(
            "/v1/nodes/me/heartbeat",
            content=big,
            auth=contributor.node_auth,
            headers={"content-type": "application/json"},
        )
        problem(r, 413, "payload_too_large")

        async def chunks() -> AsyncIterator[bytes]:
            for _ in range(3):
                yield b"x" * 1000

        # No Content-Length: refused while streaming, as soon as the limit is passed.
        r = await c.post("/v1/providers", content=chunks(), headers={"content-type": "application/json"})
        problem(r, 413, "payload_too_large")
        # Result submissions have their own, larger limit.
        r = await c.post("/v1/assignments/abc/result", content=b"x" * 3000)
        problem(r, 401, "signature_missing")  # past the body limit, stopped by the signature check
        r = await c.post("/v1/assignments/abc/result", content=b"x" * 5000)
        problem(r, 413, "payload_too_large")


async def test_a_body_with_many_faults_is_refused_with_a_few_errors(
    client: httpx.AsyncClient, contributor: Contributor
) -> None:
    """Anyone can sign with a new key, and any registered node can post a result of up to
    10 MiB: a body with an error per item or key (a million "x" token ids, a million unknown
    fields) was answered with every one of them, 147 MB and 19 s of the event loop for a body
    of 4 MB. A list or dict field reports its first bad item, and more than ten unknown fields
    are one error; a few unknown fields are still named one by one."""
    sample = {"finish_reason": "stop", "prompt_tokens": 1, "completion_tokens": 1}
    result = {"fencing_token": 1, "policy_step": 1, "seed": 1}
    stranger = SignatureAuth(generate_key())
    for path, body, auth, first in (
        (
            "/v1/assignments/asg_x/result",
            {**result, "samples": [{**sample, "token_ids": ["x"] * 50_000}] * 3},
            contributor.node_auth,
            ["body", "samples", 0, "token_ids", 0],
        ),
        (
            "/v1/assignments/asg_x/result",
            {**result, "samples": [{**sample, **{f"k{i}": 1 for i in range(50_000)}}]},
            contributor.node_auth,
            ["body", "samples", 0],
        ),
        (
            "/v1/nodes/me/heartbeat",
            {"metrics": {f"m{i}": "x" for i in range(50_000)}},
            contributor.node_auth,
            ["body", "metrics", "m0"],
        ),
        ("/v1/providers", {f"k{i}": 1 for i in range(50_000)}, stranger, ["body"]),
    ):
        r = await client.post(path, json=body, auth=auth)
        errors = problem(r, 422, "validation_failed")["errors"]
        assert errors[0]["loc"] == first and len(errors) <= 3, (path, len(errors), errors[:3])
        assert len(r.content) < 2000, (path, len(r.content))
    r = await client.post("/v1/providers", json={"display_name": "p", "a": 1, "b": 2}, auth=stranger)
    errors = problem(r, 422, "validation_failed")["errors"]
    assert sorted((e["loc"], e["type"]) for e in errors) == [
        (["body", "a"], "extra_forbidden"),
        (["body", "b"], "extra_forbidden"),
    ]
    many = {f"k{i}": 1 for i in range(50_000)}
    assert "50000 unknown fields" in (await client.post("/v1/providers", json=many, auth=stranger)).text
    problem(await client.get("/v1/providers/me/balance", auth=stranger), 401, "unknown_key")


def _raw_request(port: int, head: bytes, body: bytes = b"", piece: int = 16 * 1024) -> bytes:
    """Send ``head`` (and ``body``) in pieces, each once the server has read the last; the whole
    answer. A server that answers and closes early is read at once, before anything more is sent
    (more would reset the connection and lose the answer)."""
    data = head + body
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        for start in range(0, len(data), piece):
            sock.sendall(data[start : start + piece])
            if select.select([sock], [], [], 0.05)[0]:
                break
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
            if b"\r\n\r\n" in answer and b"connection: close" not in answer.lower():
                length = int(re.search(rb"content-length: (\d+)", answer, re.I).group(1))  # type: ignore[union-attr]
                if len(answer.split(b"\r\n\r\n", 1)[1]) >= length:
                    break
        return answer


def test_orchestrator_serve_refuses_a_request_head_past_64_kib(tmp_path: Path) -> None:
    """uvicorn's httptools protocol set no limit on a request's head: four GET /healthz with a
    header field of 300 MB each were answered 200 and took the server to 1.5 GB, before the app
    saw them. A head past 64 KiB is now 431 header_fields_too_large and the connection closed; a
    smaller one, and a large body, go through as before."""
    with serving(tmp_path, embedded_env()) as (_, port):
        host = f"Host: 127.0.0.1:{port}\r\n".encode()
        answer = _raw_request(
            port, b"GET /healthz HTTP/1.1\r\n" + host + b"X-Big: " + b"a" * 2**20 + b"\r\n\r\n"
        )
        status, _, rest = answer.partition(b"\r\n")
        assert status == b"HTTP/1.1 431 Request Header Fields Too Large", answer[:300]
        problem_json = json.loads(rest.split(b"\r\n\r\n", 1)[1])
        assert problem_json["status"] == 431 and problem_json["code"] == "header_fields_too_large"
        fine = b"GET /healthz HTTP/1.1\r\n" + host + b"X-Big: " + b"a" * 60_000 + b"\r\n\r\n"
        assert _raw_request(port, fine).startswith(b"HTTP/1.1 200 OK")
        body = b"[" + b"0," * 1_500_000 + b"0]"
        post = b"POST /v1/assignments/asg_x/result HTTP/1.1\r\n" + host
        post += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        answer = _raw_request(port, post, body, piece=256 * 1024)
        assert answer.startswith(b"HTTP/1.1 401 Unauthorized") and b"signature_missing" in answer


def test_orchestrator_serve_answers_a_request_it_cannot_parse_with_a_problem(tmp_path: Path) -> None:
    """uvicorn answered a request httptools refused with a text/plain 400, "Invalid HTTP request
    received.": a request line past 64 KiB (httptools parses no URL longer than 65535 bytes,
    though the README promises such a head 431 header_fields_too_large), a header line without a
    colon, bytes that are not HTTP at all. Each is now a problem, and a URL just below the limit
    is served."""
    with serving(tmp_path, embedded_env()) as (_, port):
        host = f"Host: 127.0.0.1:{port}\r\n".encode()

        def problem_of(answer: bytes) -> tuple[bytes, dict[str, Any]]:
            head, _, body = answer.partition(b"\r\n\r\n")
            assert b"content-type: application/problem+json" in head.lower(), answer[:300]
            return head.split(b"\r\n")[0], json.loads(body)

        long_target = b"GET /healthz?x=" + b"a" * 66_000 + b" HTTP/1.1\r\n"
        status, body = problem_of(_raw_request(port, long_target + host + b"\r\n"))
        assert status == b"HTTP/1.1 431 Request Header Fields Too Large"
        assert body["code"] == "header_fields_too_large"
        for bad in (
            b"GET /healthz HTTP/1.1\r\n" + host + b"No colon here\r\n\r\n",
            b"\x16\x03\x01\x02\x00\r\n\r\n",
        ):
            status, body = problem_of(_raw_request(port, bad))
            assert status == b"HTTP/1.1 400 Bad Request"
            assert (body["status"], body["code"]) == (400, "request_malformed")
        fine = b"GET /healthz?x=" + b"a" * 64_000 + b" HTTP/1.1\r\n" + host + b"\r\n"
        assert _raw_request(port, fine).startswith(b"HTTP/1.1 200 OK")


async def test_healthz_and_readyz(client: httpx.AsyncClient) -> None:
    assert (await client.get("/healthz")).json() == {"status": "ok"}
    r = await client.get("/readyz")
    assert r.status_code == 200
    assert r.json()["checks"] == {"database": "ok", "hot_store": "ok"}


async def test_readyz_is_503_when_the_hot_store_is_down(settings: Settings, clock: FakeClock) -> None:
    dead = RedisHotStore.from_url("redis://127.0.0.1:1/0")
    app = create_app(settings, clock=clock, hot_store=dead)
    async with (
        LifespanManager(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as c,
    ):
        r = await c.get("/readyz")
    await dead.aclose()
    body = problem(r, 503, "not_ready")
    assert body["checks"]["database"] == "ok"
    assert body["checks"]["hot_store"].startswith("unavailable")


# Body strings whose schema may let a NUL through: refused another way (a known reward
# function's name, base64), or kept as the signed body's bytes, never a SQL text value.
NUL_REFUSED_OTHERWISE_OR_HARMLESS = {
    "Policy.reward_function",
    "PolicyPatch.reward_function",
    "ResultIn.proof",
    "Sample.completion",
    "Sample.finish_reason",
    "ToplocEvidence.notes",
}


async def test_openapi_says_which_body_strings_refuse_a_nul(client: httpx.AsyncClient) -> None:
    """A string of a request body that is refused with a NUL (Text: PostgreSQL text cannot hold
    one) says so with a pattern; the schema offered NUL everywhere, and a client following it
    got 422s."""
    spec = (await client.get("/openapi.json")).json()
    schemas = spec["components"]["schemas"]
    silent: set[str] = set()

    def walk(node: Any, where: str, seen: frozenset[str]) -> None:
        if isinstance(node, list):
            for item in node:
                walk(item, where, seen)
        if not isinstance(node, dict):
            return
        ref = node.get("$ref", "").rsplit("/", 1)[-1]
        if ref and ref not in seen:
            walk(schemas[ref], ref, seen | {ref})
        if node.get("type") == "string" and "enum" not in node and "format" not in node:
            if re.search(node.get("pattern", ""), "a\x00b") is not None:
                silent.add(where)
        for key, value in node.items():
            if key == "properties":
                for name, prop in value.items():
                    walk(prop, f"{where}.{name}", seen)
            elif key in ("anyOf", "items", "additionalProperties"):
                walk(value, where, seen)

    for operations in spec["paths"].values():
        for operation in operations.values():
            for content in operation.get("requestBody", {}).get("content", {}).values():
                walk(content["schema"], "", frozenset())
    assert silent == NUL_REFUSED_OTHERWISE_OR_HARMLESS


async def test_openapi_documents_the_503s_every_route_that_reaches_a_backend_can_answer(
    client: httpx.AsyncClient,
) -> None:
    """Any request the database aborts to resolve a conflict is a 503 transient_conflict (a
    database or Redis that does not answer: database_unavailable, hot_store_unavailable),
    problem+json with Retry-After. The schema documented a 503 on three routes only, two of them
    without its media type."""
    spec = (await client.get("/openapi.json")).json()
    undocumented = [
        f"{method.upper()} {path}"
        for path, operations in spec["paths"].items()
        if path not in ("/healthz", "/metrics", "/problems/{code}")  # these reach no backend
        for method, operation in operations.items()
        if "application/problem+json" not in operation["responses"].get("503", {}).get("content", {})
    ]
    assert undocumented == []


async def test_openapi_documents_errors_as_the_problem_json_they_are_served_as(
    client: httpx.AsyncClient,
) -> None:
    """Errors are served as application/problem+json only. The schema gave their Problem model
    under application/json, a media type no error is served with, and problem+json without a
    schema, so a client (or a fuzzer) could not check an error's body against it."""
    spec = (await client.get("/openapi.json")).json()
    misfiled = []
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            for status, response in operation["responses"].items():
                content = response.get("content", {})
                if "application/problem+json" not in content:
                    continue
                schema = content["application/problem+json"].get("schema")
                if "application/json" in content or (path != "/readyz" and schema is None):
                    misfiled.append(f"{method.upper()} {path} {status}")
    assert misfiled == []
    r = await client.get("/v1/admin/pools")
    problem(r, 401, "token_missing")


async def test_openapi_documents_both_security_schemes(client: httpx.AsyncClient) -> None:
    spec = (await client.get("/openapi.json")).json()
    schemes = spec["components"]["securitySchemes"]
    assert "HttpMessageSignature" in schemes and "BearerToken" in schemes
    assert schemes["BearerToken"]["scheme"] == "bearer"
    heartbeat = spec["paths"]["/v1/nodes/me/heartbeat"]["post"]
    assert {"HttpMessageSignature": []} in heartbeat["security"]
    assert {"BearerToken": []} in spec["paths"]["/v1/admin/nodes"]["get"]["security"]
    assert "application/problem+json" in heartbeat["responses"]["401"]["content"]
    docs = await client.get("/docs")
    assert docs.status_code == 200 and "swagger" in docs.text.lower()


async def test_openapi_documents_the_headers_clients_act_on(client: httpx.AsyncClient) -> None:
    """PROTOCOL.md: everything is documented in the served OpenAPI schema. A claim without work
    answers Retry-After, as a 429 and the 503s do, and a 401 carries WWW-Authenticate and, on
    the signed routes, Accept-Signature: a client generated from the schema saw none of them."""
    spec = (await client.get("/openapi.json")).json()
    claim = spec["paths"]["/v1/assignments/claim"]["post"]["responses"]
    assert claim["200"]["headers"]["Retry-After"]["schema"] == {"type": "integer", "minimum": 0}
    assert "ClaimOut" in claim["200"]["content"]["application/json"]["schema"]["$ref"]
    for path, method in (("/v1/nodes/me/heartbeat", "post"), ("/v1/admin/nodes", "get")):
        responses = spec["paths"][path][method]["responses"]
        for status in ("429", "503"):
            assert responses[status]["headers"]["Retry-After"]["schema"]["type"] == "integer", path
        assert "WWW-Authenticate" in responses["401"]["headers"], path
    assert (
        "Accept-Signature" in spec["paths"]["/v1/nodes/me/heartbeat"]["post"]["responses"]["401"]["headers"]
    )


async def test_request_id_is_returned_and_logged_without_secrets(
    settings: Settings, clock: FakeClock, hot_store: HotStore, capsys: Any
) -> None:
    from tests.conftest import new_contributor

    app = create_app(settings.model_copy(update={"log_level": "INFO"}), clock=clock, hot_store=hot_store)
    c = new_contributor()
    async with (
        LifespanManager(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as client,
    ):
        await c.register(client)
        r = await client.post(
            "/v1/nodes/me/heartbeat", json={}, auth=c.node_auth, headers={"X-Request-ID": "req-abc-123"}
        )
        assert r.headers["x-request-id"] == "req-abc-123"
        generated = (await client.get("/healthz")).headers["x-request-id"]
        assert len(generated) >= 8
        signed = r.request.headers["signature"]
    out = capsys.readouterr().out
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    beat = [ln for ln in lines if ln.get("request_id") == "req-abc-123" and ln.get("event") == "request"]
    assert beat and beat[0]["route"] == "/v1/nodes/me/heartbeat" and beat[0]["status"] == 200
    assert beat[0]["node_id"] == c.node_id
    assert signed.split(":")[1] not in out
    assert "signature-input" not in out.lower()


def _heartbeats_counted(text: str) -> float:
    [value] = re.findall(r"^orchestrator_heartbeats_total (\S+)$", text, re.M)
    return float(value)


async def test_metrics_are_labelled_by_route_template(
    client: httpx.AsyncClient, contributor: Contributor, admin_headers: dict[str, str]
) -> None:
    # The counters are the process's: other tests count too.
    before = _heartbeats_counted((await client.get("/metrics")).text)
    await contributor.beat(client)
    node = await client.get(f"/v1/admin/nodes/{contributor.node_id}", headers=admin_headers)
    assert node.status_code == 200, node.text
    text = (await client.get("/metrics")).text
    assert 'route="/v1/nodes/me/heartbeat"' in text
    assert (
        'orchestrator_http_requests_total{method="GET",route="/v1/admin/nodes/{node_id}",status="200"}'
        in text
    )
    assert contributor.node_id not in text
    assert _heartbeats_counted(text) == before + 1
    assert 'orchestrator_nodes{status="healthy"} 1.0' in text


async def test_the_served_docs_are_counted_under_their_own_route_in_the_metrics(
    client: httpx.AsyncClient,
) -> None:
    """/openapi.json and /docs were counted as route="unmatched" although they answered 200 (the
    README promises requests by route template), mixed with the 404s of unknown paths."""
    for path in ("/openapi.json", "/docs"):
        assert (await client.get(path)).status_code == 200
    assert (await client.get("/no/such/path")).status_code == 404
    text = (await client.get("/metrics")).text
    for path in ("/openapi.json", "/docs"):  # the counters are the process's: other tests count too
        assert f'orchestrator_http_requests_total{{method="GET",route="{path}",status="200"}}' in text
    assert 'route="unmatched",status="200"' not in text
    assert 'orchestrator_http_requests_total{method="GET",route="unmatched",status="404"}' in text


def _pool_creations(status: int) -> float:
    labels = {"method": "POST", "route": "/v1/admin/pools", "status": str(status)}
    return REGISTRY.get_sample_value("orchestrator_http_requests_total", labels) or 0.0


async def test_a_request_the_server_cancels_unanswered_is_counted_and_logged_as_499_not_500(
    app: Any, admin_headers: dict[str, str]
) -> None:
    """A stopping server cancels the requests still under way after its grace (uvicorn's
    timeout_graceful_shutdown): here an upload whose body never comes. It sent no answer and
    failed in nothing, so it is counted (and logged: test_server_stop) with status 499 (as nginx names a request
    that ended before its answer), not 500: a deploy's cancelled requests do not count as
    server errors (deploy/prometheus/alerts.yaml, OrchestratorServerErrors). Before: 500."""
    receiving = asyncio.Event()

    async def receive() -> dict[str, Any]:
        receiving.set()
        await asyncio.Event().wait()  # the body never comes
        raise AssertionError("unreachable")

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    headers = {"content-type": "application/json", "content-length": "100", **admin_headers}
    scope = asgi_post("/v1/admin/pools", headers, client=("127.0.0.1", 50000))
    before = _pool_creations(499), _pool_creations(500)
    request = asyncio.create_task(app(scope, receive, send))
    await asyncio.wait_for(receiving.wait(), HANG_S)  # its head read, waiting for its body
    request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await request
    assert sent == []
    assert (_pool_creations(499), _pool_creations(500)) == (before[0] + 1, before[1])


async def test_an_unknown_method_is_one_metrics_label_whatever_its_name(client: httpx.AsyncClient) -> None:
    """A client may send any method token: the metrics name the standard ones and count the
    rest as "other", so a scanner cannot grow the label sets without bound."""
    for method in ("FOO", "BAR9", "X" * 200):
        r = await client.request(method, "/healthz")
        assert r.status_code == 405
    text = (await client.get("/metrics")).text
    assert "FOO" not in text and "BAR9" not in text and "XXXX" not in text
    assert 'orchestrator_http_requests_total{method="other",route="/healthz",status="405"}' in text


async def test_signed_requests_work_with_the_sdk_auth(
    client: httpx.AsyncClient, contributor: Contributor
) -> None:
    auth = SignatureAuth(contributor.node_key, components=("@method", "@path", "@query"))
    r = await client.get("/v1/nodes/me", auth=auth)
    assert r.status_code == 200
