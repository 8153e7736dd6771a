"""GET /problems/{code}: every problem's ``type`` (a relative reference ``/problems/<code>``)
dereferences to a page saying what the code means and what to do (RFC 9457, section 3.1.1).
It was a 404 for every code."""

from __future__ import annotations

import ast
import pathlib
from typing import Any

import httpx

from orchestrator.core.errors import _PATH_NOT_FOUND, _STATUS_CODES
from orchestrator.core.problem_types import PROBLEM_TYPES
from tests.conftest import problem

SOURCE = pathlib.Path(__file__).resolve().parent.parent / "orchestrator"
# Clients of the server (the bundled worker, the demo swarm): they emit no problem.
CLIENTS = ("worker", "demo")
# Calls that take a ``code`` that is no problem's: a verdict's findings (seed_mismatch,
# reward_forged, ...) and a result's evidence re-check (body_altered, signer_mismatch, ...),
# shown in verdicts and evidence views, never as a refusal's code.
NOT_PROBLEMS = frozenset({"Finding", "EvidenceCheck"})


def _callee(call: ast.Call) -> str:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def _text(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def emitted_codes() -> set[str]:
    """Every problem code the source can produce, however it is spelt: ``code="..."`` in any call;
    a literal passed where a function or dataclass takes its ``code`` positionally (``_fail``,
    ``_unavailable``, ``_send_problem``, a join's ``Refusal``); a class's ``code`` attribute (the
    OrchestratorError subclasses); a ``for ..., code, ... in ((..., "x", ...), ...)`` loop; and
    errors.py's tables for framework errors (by status, and by path parameter)."""
    trees = [
        ast.parse(path.read_text())
        for path in sorted(SOURCE.rglob("*.py"))
        if path.relative_to(SOURCE).parts[0] not in CLIENTS
    ]
    positional: dict[str, int] = {}
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                names = [a.arg for a in node.args.posonlyargs + node.args.args]
            elif isinstance(node, ast.ClassDef):  # a dataclass's fields, in order
                names = [
                    s.target.id
                    for s in node.body
                    if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                ]
            else:
                continue
            if "code" in names:
                positional[node.name] = names.index("code")
    codes: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _callee(node) not in NOT_PROBLEMS:
                codes.update(t for kw in node.keywords if kw.arg == "code" and (t := _text(kw.value)))
                at = positional.get(_callee(node))
                if at is not None and len(node.args) > at and (t := _text(node.args[at])):
                    codes.add(t)
            elif isinstance(node, ast.ClassDef):
                for stmt in node.body:
                    if not isinstance(stmt, ast.Assign):
                        continue
                    for target in stmt.targets:
                        if isinstance(target, ast.Name) and target.id == "code" and (t := _text(stmt.value)):
                            codes.add(t)
                        elif isinstance(target, ast.Tuple) and isinstance(stmt.value, ast.Tuple):
                            codes.update(
                                t
                                for name, value in zip(target.elts, stmt.value.elts, strict=False)
                                if isinstance(name, ast.Name) and name.id == "code" and (t := _text(value))
                            )
            elif isinstance(node, ast.For) and isinstance(node.target, ast.Tuple):
                names = [n.id if isinstance(n, ast.Name) else "" for n in node.target.elts]
                if "code" in names and isinstance(node.iter, ast.Tuple | ast.List):
                    at = names.index("code")
                    codes.update(
                        t
                        for row in node.iter.elts
                        if isinstance(row, ast.Tuple) and len(row.elts) > at and (t := _text(row.elts[at]))
                    )
    codes |= {code for code, _ in _STATUS_CODES.values()} | set(_PATH_NOT_FOUND.values())
    codes.add("http_error")  # errors._http_error: a status without a code in _STATUS_CODES
    return codes


def test_the_scan_finds_the_codes_of_every_way_they_are_produced() -> None:
    """So that a scan that finds nothing (or misses a way) cannot pass the test below."""
    found = emitted_codes()
    for code in (
        "result_conflict",  # Conflict(..., code="result_conflict")
        "signature_stale",  # _fail("signature_stale", ...)
        "database_unavailable",  # _unavailable(request, "database_unavailable", ...)
        "host_invalid",  # _send_problem(scope, send, 400, "host_invalid", ...)
        "pool_full",  # Refusal("pool_full", ...), a join's code
        "insufficient_funds",  # class InsufficientFunds(Conflict): code = ...
        "rate_limited",  # class RateLimited: status, code, title = ...
        "invalid_query",  # for places, code, title in ((..., "invalid_query", ...), ...)
        "method_not_allowed",  # _STATUS_CODES
        "payout_run_not_found",  # _PATH_NOT_FOUND
        "header_fields_too_large",  # the HTTP protocol's own refusal
    ):
        assert code in found, code
    assert not found & {"seed_mismatch", "body_altered", "signer_mismatch"}  # not problems
    assert len(found) > 100


def test_every_problem_code_the_server_can_emit_has_a_description_and_no_other() -> None:
    """A new code without a description fails here; so does a description of a code that no
    source produces any more (a page that would document a problem that never comes)."""
    found = emitted_codes()
    assert sorted(found - set(PROBLEM_TYPES)) == [], "codes without a description in PROBLEM_TYPES"
    assert sorted(set(PROBLEM_TYPES) - found) == [], "descriptions of codes no source produces"
    for code, described in PROBLEM_TYPES.items():
        assert described.title and described.meaning and described.action, code
        assert all(100 <= status <= 599 for status in described.statuses), code


async def test_every_code_has_a_page(client: httpx.AsyncClient) -> None:
    for code, described in PROBLEM_TYPES.items():
        r = await client.get(f"/problems/{code}", headers={"accept": "application/json"})
        assert r.status_code == 200, (code, r.text)
        assert r.headers["content-type"] == "application/json"
        assert r.json() == {
            "type": f"/problems/{code}",
            "code": code,
            "title": described.title,
            "statuses": list(described.statuses),
            "meaning": described.meaning,
            "action": described.action,
        }


async def test_a_problems_type_dereferences_to_its_page(client: httpx.AsyncClient, contributor: Any) -> None:
    """Followed as RFC 3986 resolves the relative reference against the request's URL, with no
    credentials, as a browser does: an HTML page by default, JSON when asked for, cacheable."""
    refused = await client.get("/v1/nodes/me")  # unsigned
    problem(refused, 401, "signature_missing")
    url = refused.request.url.join(refused.json()["type"])
    assert url.path == "/problems/signature_missing"

    page = await client.get(url, headers={"accept": "text/html,application/xhtml+xml,*/*;q=0.8"})
    assert page.status_code == 200
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    assert "public" in page.headers["cache-control"] and "max-age=" in page.headers["cache-control"]
    assert page.headers["vary"] == "Accept"
    described = PROBLEM_TYPES["signature_missing"]
    assert "<h1><code>signature_missing</code>: Request signature refused</h1>" in page.text
    assert "HTTP status: 401." in page.text and described.meaning in page.text
    assert (await client.get(url)).headers["content-type"].startswith("text/html")  # no Accept
    as_json = await client.get(url, headers={"accept": "application/json"})
    assert as_json.json()["statuses"] == [401] and as_json.headers["vary"] == "Accept"
    # HTML ranked above JSON stays HTML; JSON ranked above stays JSON.
    ranked = {"accept": "application/json;q=0.5, text/html"}
    assert (await client.get(url, headers=ranked)).headers["content-type"].startswith("text/html")
    ranked = {"accept": "text/*;q=0.2, application/*"}
    assert (await client.get(url, headers=ranked)).headers["content-type"] == "application/json"
    # The registry's text is escaped in the HTML page.
    assert "Bearer <token>" in PROBLEM_TYPES["token_missing"].action
    assert "Bearer &lt;token&gt;" in (await client.get("/problems/token_missing")).text


async def test_an_unknown_code_is_a_404_problem(client: httpx.AsyncClient) -> None:
    for path in ("/problems/no_such_code", "/problems/%3Cscript%3E", "/problems/" + "x" * 300):
        r = problem(await client.get(path), 404, "problem_type_not_found")
        assert r["type"] == "/problems/problem_type_not_found"
        assert "<script>" in r["detail"] or "no_such_code" in r["detail"] or "x" * 100 in r["detail"]
        assert len(r["detail"]) < 200
    # Its own code has a page.
    assert (await client.get("/problems/problem_type_not_found")).status_code == 200


async def test_the_served_schema_documents_the_problem_pages(client: httpx.AsyncClient) -> None:
    spec = (await client.get("/openapi.json")).json()
    operation = spec["paths"]["/problems/{code}"]["get"]
    assert set(operation["responses"]["200"]["content"]) == {"text/html", "application/json"}
    assert "application/problem+json" in operation["responses"]["404"]["content"]
    assert "security" not in operation
