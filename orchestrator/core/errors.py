"""Errors, rendered as RFC 9457 ``application/problem+json``.

Every error a client can see is an ``OrchestratorError`` with a stable machine ``code``.
The hierarchy::

    OrchestratorError
    ├── BadRequest (400)                 bad_request, host_invalid (sent by HostCheckMiddleware),
    │                                    invalid_query, invalid_header (request validation), ...
    ├── Unauthorized (401)               signature_*, nonce_replayed, unknown_key, token_invalid, ...
    ├── Forbidden (403)                  node_banned, role_forbidden, ...
    ├── NotFound (404)                   not_found, node_not_found, ... (also a path parameter
    │                                    that does not validate: pool_not_found, ...)
    ├── Conflict (409)                   node_bound_to_other_provider, ...
    ├── PayloadTooLarge (413)            payload_too_large
    ├── UriTooLong (414)                 uri_too_long (a signed request's URL, refused before verifying)
    ├── UnprocessableEntity (422)        validation_failed (body does not parse or validate)
    ├── RateLimited (429)                rate_limited (with Retry-After)
    └── ServiceUnavailable (503)         not_ready, hot_store_full, transient_conflict,
                                         hot_store_unavailable, database_unavailable
                                         (with Retry-After)

Framework errors (unknown route, wrong method, request validation) and unhandled
exceptions are rendered in the same format; a 500 never carries a stack trace. A transaction
the database aborted only to resolve contention (a deadlock, a serialization failure, SQLite's
busy timeout) wrote nothing, so it is a 503 ``transient_conflict`` with ``Retry-After``: any
request, even a non-idempotent one, can simply be sent again. A database that cannot be
reached, or that drops the request's connection (refused, reset, shut down or starting up, out
of connections), is a 503 ``database_unavailable`` with ``Retry-After``, like an unreachable
Redis: the request did not complete and can be sent again once the database is back.
"""

from __future__ import annotations

import sys
from typing import Any

import asyncpg
import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MasterDownError, OutOfMemoryError, ReadOnlyError
from redis.exceptions import TimeoutError as RedisTimeoutError
from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from orchestrator.core.routing import JSONNumberTooLong

PROBLEM_MEDIA_TYPE = "application/problem+json"
PROBLEM_TYPE_BASE = "/problems/"

log = structlog.get_logger(__name__)


class OrchestratorError(Exception):
    status: int = 400
    code: str = "bad_request"
    title: str = "Bad request"

    def __init__(
        self,
        detail: str,
        *,
        code: str | None = None,
        status: int | None = None,
        title: str | None = None,
        headers: dict[str, str] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(detail)
        self.detail = detail
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status
        if title is not None:
            self.title = title
        self.headers = headers or {}
        self.extra = extra or {}


class BadRequest(OrchestratorError):
    status, code, title = 400, "bad_request", "Bad request"


class Unauthorized(OrchestratorError):
    status, code, title = 401, "unauthorized", "Not authenticated"


class Forbidden(OrchestratorError):
    status, code, title = 403, "forbidden", "Not permitted"


class NotFound(OrchestratorError):
    status, code, title = 404, "not_found", "Not found"


class Conflict(OrchestratorError):
    status, code, title = 409, "conflict", "Conflict"


class PayloadTooLarge(OrchestratorError):
    status, code, title = 413, "payload_too_large", "Payload too large"


class UriTooLong(OrchestratorError):
    status, code, title = 414, "uri_too_long", "URI too long"


class UnprocessableEntity(OrchestratorError):
    status, code, title = 422, "validation_failed", "Request body did not validate"


class RateLimited(OrchestratorError):
    status, code, title = 429, "rate_limited", "Too many requests"

    def __init__(self, detail: str, *, retry_after: int) -> None:
        super().__init__(detail, headers={"Retry-After": str(max(1, retry_after))})


class ServiceUnavailable(OrchestratorError):
    status, code, title = 503, "not_ready", "Service unavailable"


def problem_body(
    *,
    status: int,
    code: str,
    title: str,
    detail: str,
    instance: str | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "type": PROBLEM_TYPE_BASE + code,
        "title": title,
        "status": status,
        "detail": detail,
        "code": code,
    }
    if instance:
        body["instance"] = instance
    # Extra members never replace the RFC 9457 ones.
    body.update({k: v for k, v in (extra or {}).items() if k not in body and k != "instance"})
    return body


def problem_response(
    *,
    status: int,
    code: str,
    title: str,
    detail: str,
    request: Request | None = None,
    headers: dict[str, str] | None = None,
    extra: dict[str, Any] | None = None,
) -> JSONResponse:
    body = problem_body(
        status=status,
        code=code,
        title=title,
        detail=detail,
        instance=request.url.path if request is not None else None,
        extra=extra,
    )
    return JSONResponse(body, status_code=status, headers=headers, media_type=PROBLEM_MEDIA_TYPE)


_STATUS_CODES = {
    400: ("bad_request", "Bad request"),
    401: ("unauthorized", "Not authenticated"),
    403: ("forbidden", "Not permitted"),
    404: ("not_found", "Not found"),
    405: ("method_not_allowed", "Method not allowed"),
    406: ("not_acceptable", "Not acceptable"),
    413: ("payload_too_large", "Payload too large"),
    414: ("uri_too_long", "URI too long"),
    415: ("unsupported_media_type", "Unsupported media type"),
}


async def _orchestrator_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, OrchestratorError)
    return problem_response(
        status=exc.status,
        code=exc.code,
        title=exc.title,
        detail=exc.detail,
        request=request,
        headers=exc.headers,
        extra=exc.extra,
    )


def _body_refused(request: Request, msg: str, kind: str) -> JSONResponse:
    """422 ``validation_failed`` for a body refused whole (its one error is at ``body``)."""
    return problem_response(
        status=422,
        code="validation_failed",
        title="Request did not validate",
        detail=f"body: {msg}",
        request=request,
        extra={"errors": [{"loc": ["body"], "msg": msg, "type": kind}]},
    )


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    cause = exc.__cause__
    if exc.status_code == 400 and isinstance(cause, UnicodeDecodeError | RecursionError | JSONNumberTooLong):
        # FastAPI's 400 for a JSON body that is not UTF-8, nested deeper than Python's parser
        # goes (some 1,000 levels), or with an integer longer than it converts (4,300 digits):
        # a body that does not parse, as any other. (Other JSON syntax errors are FastAPI's 422.)
        if isinstance(cause, UnicodeDecodeError):
            msg = "not UTF-8, so not JSON"
        elif isinstance(cause, RecursionError):
            msg = "JSON nested too deeply to parse"
        else:
            msg = f"JSON with a number too long to parse (at most {sys.get_int_max_str_digits()} digits)"
        return _body_refused(request, msg, "json_invalid")
    code, title = _STATUS_CODES.get(exc.status_code, ("http_error", "HTTP error"))
    detail = exc.detail if isinstance(exc.detail, str) else title
    if exc.status_code == 404 and detail == "Not Found":
        detail = f"No route matches {request.method} {request.url.path}"
    headers = dict(exc.headers or {})
    if exc.status_code == 405:
        detail = f"{request.method} is not allowed on {request.url.path}"
        headers["Allow"] = _allowed_methods(request) or headers.get("Allow", "")
    return problem_response(
        status=exc.status_code,
        code=code,
        title=title,
        detail=detail,
        request=request,
        headers=headers,
    )


_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def _allowed_methods(request: Request) -> str:
    """The methods some route serves on this path (a 405's ``Allow``, RFC 9110): Starlette
    names only the first matching route's, and a path may be served by several (GET and POST
    /v1/admin/pools are two routes)."""
    routes = request.app.router.routes
    return ", ".join(
        method
        for method in _METHODS
        if any(route.matches({**request.scope, "method": method})[0] is Match.FULL for route in routes)
    )


# A path parameter that does not validate names no resource that could exist: the same 404
# (and code) as a well-formed id that is not there.
_PATH_NOT_FOUND = {
    "pool_id": "pool_not_found",
    "assignment_id": "assignment_not_found",
    "task_id": "task_not_found",
    "node_id": "node_not_found",
    "provider_id": "provider_not_found",
    "iteration_id": "iteration_not_found",
    "payout_id": "payout_not_found",
    "verdict_id": "verdict_not_found",
    "job_id": "validation_job_not_found",
    "token_id": "token_not_found",
    "run_id": "payout_run_not_found",
}


def _path_not_found_code(request: Request, param: str) -> str:
    """The not-found code of a path parameter that does not validate. On a pool's member routes
    a node id names a membership: a well-formed one that has none is ``member_not_found``."""
    route_path = getattr(request.scope.get("route"), "path", "")
    if param == "node_id" and "/members/{node_id}" in route_path:
        return "member_not_found"
    return _PATH_NOT_FOUND.get(param, "not_found")


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    """Request validation errors by where they are: only in the path -> 404 (the resource's
    not-found code); any in the query -> 400 ``invalid_query``; any in a header or cookie ->
    400 ``invalid_header``; otherwise the body -> 422 ``validation_failed`` (PROTOCOL.md: 422
    only for a body that does not parse or validate)."""
    assert isinstance(exc, RequestValidationError)
    errors = [
        {"loc": list(err.get("loc", ())), "msg": str(err.get("msg", "")), "type": str(err.get("type", ""))}
        for err in exc.errors()
    ]

    def located(*places: str) -> list[dict[str, Any]]:
        return [e for e in errors if e["loc"] and e["loc"][0] in places]

    def detail(error: dict[str, Any]) -> str:
        where = ".".join(str(p) for p in error["loc"])
        return f"{where}: {error['msg']}" if where else str(error["msg"])

    in_path = located("path")
    if in_path and len(in_path) == len(errors):
        param = str(in_path[0]["loc"][1]) if len(in_path[0]["loc"]) > 1 else ""
        return problem_response(
            status=404,
            code=_path_not_found_code(request, param),
            title="Not found",
            detail=f"no such resource ({detail(in_path[0])})",
            request=request,
        )
    for places, code, title in (
        (("query",), "invalid_query", "Query parameters did not validate"),
        (("header", "cookie"), "invalid_header", "Request headers did not validate"),
    ):
        found = located(*places)
        if found:
            return problem_response(
                status=400,
                code=code,
                title=title,
                detail=detail(found[0]),
                request=request,
                extra={"errors": errors},
            )
    if any(tuple(e.get("loc", ())) == ("body",) and isinstance(e.get("input"), bytes) for e in exc.errors()):
        # FastAPI reads a body as JSON only when its Content-Type says JSON; any other body is
        # validated as the raw bytes, which said "Input should be a valid dictionary" of a body
        # that was a JSON object.
        media = request.headers.get("content-type")
        said = f"Content-Type {media[:100]!r}" if media else "no Content-Type"
        msg = f"the body was sent with {said}, so it was not read as JSON; send it as application/json"
        return _body_refused(request, msg, "content_type_not_json")
    first = (located("body") or errors or [{"loc": [], "msg": "invalid"}])[0]
    return problem_response(
        status=422,
        code="validation_failed",
        title="Request did not validate",
        detail=detail(first),
        request=request,
        extra={"errors": errors},
    )


async def _unhandled(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled_error", path=request.url.path, error_type=type(exc).__name__)
    return problem_response(
        status=500,
        code="internal_error",
        title="Internal server error",
        detail="The server failed to handle this request; it has been logged.",
        request=request,
    )


# PostgreSQL aborts a transaction with these only to resolve contention; nothing it did is kept.
TRANSIENT_SQLSTATES = {
    "40P01": "deadlock_detected",
    "40001": "serialization_failure",
    "55P03": "lock_not_available",
}
TRANSIENT_RETRY_AFTER_S = 1


def transient_cause(exc: DBAPIError) -> str | None:
    """Why the database aborted this transaction to resolve contention, or None if it did not."""
    sqlstate = getattr(exc.orig, "sqlstate", None)
    if sqlstate in TRANSIENT_SQLSTATES:
        return TRANSIENT_SQLSTATES[sqlstate]
    if "database is locked" in str(exc.orig):  # SQLite: the busy timeout ran out
        return "database_locked"
    return None


# SQLSTATE classes and codes of a database that cannot serve the connection: connection
# exceptions (08...), operator intervention (57P01 admin_shutdown, as pg_terminate_backend
# sends; 57P03 cannot_connect_now, while it starts or stops), too_many_connections.
UNAVAILABLE_SQLSTATES = ("08", "57P", "53300")
UNAVAILABLE_RETRY_AFTER_S = 5


def database_unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` says the database could not be reached or dropped the connection: a
    refused or reset connection (raised as the OS error when connecting), a connection that
    timed out (a server that accepts and never answers: a black-holed address, a hung server
    or pooler), every pooled connection busy past the pool's timeout, a connection SQLAlchemy
    found dead, or one of ``UNAVAILABLE_SQLSTATES``. The request did nothing, and can be sent
    again (the timeouts were a 500, after which a worker gave its result up)."""
    if isinstance(exc, PoolTimeout):
        return True
    if isinstance(exc, DBAPIError):
        if exc.connection_invalidated:
            return True
        exc = exc.orig if exc.orig is not None else exc
    sqlstate = getattr(exc, "sqlstate", None)
    if isinstance(sqlstate, str) and sqlstate.startswith(UNAVAILABLE_SQLSTATES):
        return True
    return isinstance(exc, ConnectionError | TimeoutError)


async def _database_unavailable(request: Request, exc: Exception) -> JSONResponse:
    if not database_unavailable(exc):
        return await _unhandled(request, exc)
    log.warning("database_unavailable", path=request.url.path, error=type(exc).__name__)
    return _unavailable(
        request,
        "database_unavailable",
        "The database could not be reached; the request was not completed. "
        "Send it again once the service is back (a signed request signed afresh, with a new nonce).",
        UNAVAILABLE_RETRY_AFTER_S,
    )


async def _database_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, DBAPIError)
    cause = transient_cause(exc)
    if cause is None:
        return await _database_unavailable(request, exc)
    log.warning("transaction_aborted", path=request.url.path, cause=cause)
    return _unavailable(
        request,
        "transient_conflict",
        f"The database aborted this request's transaction ({cause}) to resolve a conflict "
        "with concurrent work; nothing was recorded. Send the request again (a signed request "
        "signed afresh, with a new nonce).",
        TRANSIENT_RETRY_AFTER_S,
        extra={"cause": cause},
    )


# Redis answers but takes no writes: out of memory under ``noeviction``, a primary demoted to a
# read-only replica by a failover while this process still talks to it, a replica cut off from
# its primary. Nothing was written: an outage of the hot store, as when it does not answer.
REDIS_REFUSALS: tuple[type[Exception], ...] = (OutOfMemoryError, ReadOnlyError, MasterDownError)
HOT_STORE_UNAVAILABLE: tuple[type[Exception], ...] = (
    RedisConnectionError,
    RedisTimeoutError,
    *REDIS_REFUSALS,
)


async def _hot_store_error(request: Request, exc: Exception) -> JSONResponse:
    """Redis did not answer (all of this process's connections busy past the pool's timeout,
    or the server unreachable) or refused to write: the request is refused at the step that
    needed it."""
    log.warning("hot_store_unavailable", path=request.url.path, error=type(exc).__name__)
    return _unavailable(
        request,
        "hot_store_unavailable",
        "The hot store (Redis) did not answer in time or refused the write; the request was not "
        "completed. Send the request again (a signed request signed afresh, with a new nonce).",
        TRANSIENT_RETRY_AFTER_S,
    )


def _unavailable(
    request: Request, code: str, detail: str, retry_after_s: int, extra: dict[str, Any] | None = None
) -> JSONResponse:
    """A 503 for a dependency that failed the request, with when to send it again."""
    return problem_response(
        status=503,
        code=code,
        title="Service unavailable",
        detail=detail,
        request=request,
        headers={"Retry-After": str(retry_after_s)},
        extra=extra,
    )


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(OrchestratorError, _orchestrator_error)
    app.add_exception_handler(DBAPIError, _database_error)
    # Raised as they are (not as a DBAPIError) when a new connection cannot be opened.
    app.add_exception_handler(ConnectionError, _database_unavailable)
    app.add_exception_handler(TimeoutError, _database_unavailable)  # connecting timed out
    app.add_exception_handler(PoolTimeout, _database_unavailable)  # every connection busy
    app.add_exception_handler(asyncpg.PostgresError, _database_unavailable)
    for refused in HOT_STORE_UNAVAILABLE:
        app.add_exception_handler(refused, _hot_store_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _unhandled)
