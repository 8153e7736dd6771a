"""Pure ASGI middleware: request ids, access logs and metrics, Host checks, body size limits."""

from __future__ import annotations

import asyncio
import re
import secrets
import time

import orjson
import structlog
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from orchestrator.core import metrics
from orchestrator.core.errors import PROBLEM_MEDIA_TYPE, problem_body
from orchestrator.core.signing import MAX_HOST_LENGTH, is_valid_host

REQUEST_ID_HEADER = "x-request-id"
# The methods the metrics label by name; any other (a client may send any token) is "other",
# so a scanner cannot grow the metrics' label sets without bound.
_KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
#: The status the access log and ``orchestrator_http_requests_total`` give a request the server
#: cancelled before answering it (a stopping server's, past its grace): nginx's "client closed
#: request", a 4xx and so outside the 5xx alert. The client got no answer from the service (at
#: most uvicorn's plain "Internal Server Error", if its connection was still open).
CANCELLED_STATUS = 499
log = structlog.get_logger("orchestrator.access")


class RequestContextMiddleware:
    """Binds a request id (the caller's if sane, else a new one), returns it as X-Request-ID,
    logs one access line and records metrics by route template."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        incoming = dict(scope["headers"]).get(REQUEST_ID_HEADER.encode(), b"").decode("latin-1")
        request_id = incoming if _REQUEST_ID_RE.fullmatch(incoming) else secrets.token_hex(8)
        structlog.contextvars.clear_contextvars()
        structlog.contextvars.bind_contextvars(request_id=request_id)
        scope.setdefault("state", {})["request_id"] = request_id
        started = time.perf_counter()
        status = 500
        answering = False

        async def send_wrapper(message: Message) -> None:
            nonlocal status, answering
            if message["type"] == "http.response.start":
                status = message["status"]
                answering = True
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (REQUEST_ID_HEADER.encode(), request_id.encode())]
            await send(message)

        cancelled = False
        try:
            await self.app(scope, receive, send_wrapper)
        except asyncio.CancelledError:
            # The server cancelled the request: a stopping one, past its grace for the requests
            # under way (cli.SHUTDOWN_GRACE_S). Unanswered, it is no server error (a deploy's
            # would raise OrchestratorServerErrors): CANCELLED_STATUS, not the 500 it was counted
            # as. One already answering keeps the status it sent.
            cancelled = True
            if not answering:
                status = CANCELLED_STATUS
            raise
        finally:
            elapsed = time.perf_counter() - started
            template = _route_template(scope)
            method = scope["method"]
            label = method if method in _KNOWN_METHODS else "other"
            metrics.REQUESTS.labels(label, template, str(status)).inc()
            metrics.LATENCY.labels(label, template).observe(elapsed)
            fields = {"cancelled": True} if cancelled else {}
            log.info(
                "request",
                method=method[:32],
                route=template,
                status=status,
                duration_ms=round(elapsed * 1000, 2),
                **fields,
            )
            structlog.contextvars.clear_contextvars()


def _route_template(scope: Scope) -> str:
    """The path template of the route that answered, or "unmatched". FastAPI names its own
    routes in ``scope["route"]``, but not plain Starlette ones (``/openapi.json``, ``/docs``),
    which were counted as "unmatched" although they answered 200: those are found by endpoint."""
    path = getattr(scope.get("route"), "path", None)
    endpoint = scope.get("endpoint")
    if path is None and endpoint is not None:
        routes = getattr(scope.get("app"), "routes", ())
        path = next((r.path for r in routes if getattr(r, "endpoint", None) is endpoint), None)
    return path or "unmatched"


class HostCheckMiddleware:
    """Refuses with 400 ``host_invalid`` a request with more than one Host field or a Host that
    is not one RFC 3986 authority (RFC 9112 section 3.2 asks for exactly this 400), before any
    routing. Signatures cover the URL rebuilt from Host, so a Host that carried a path, query or
    fragment could make a signature made for one path verify on another."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        hosts = [value for name, value in scope["headers"] if name == b"host"]
        detail = None
        if len(hosts) > 1:
            detail = "a request must carry exactly one Host field"
        elif hosts and not is_valid_host(hosts[0].decode("latin-1")):
            detail = (
                "Host must be one authority: host name, IPv4 address or [IP literal], with an optional "
                f":port, at most {MAX_HOST_LENGTH} characters"
            )
        if detail is None:
            await self.app(scope, receive, send)
            return
        await _send_problem(scope, send, 400, "host_invalid", "Bad request", detail)


class BodyLimitMiddleware:
    """Refuses bodies over the limit with 413 before any parsing: at once when
    Content-Length says so, otherwise as soon as the streamed bytes pass the limit."""

    def __init__(self, app: ASGIApp, *, default_limit: int, large_limit: int, large_paths: str) -> None:
        self.app = app
        self.default_limit = default_limit
        self.large_limit = large_limit
        self.large_paths = re.compile(large_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.large_limit if self.large_paths.fullmatch(scope["path"]) else self.default_limit
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            try:
                too_big = int(declared) > limit
            except ValueError:
                too_big = False
            if too_big:
                await _send_413(scope, send, limit)
                return
        seen = 0
        refused = False

        async def limited_receive() -> Message:
            nonlocal seen, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    # Answer 413 now; the app sees a disconnected client and its reply is dropped.
                    refused = True
                    await _send_413(scope, send, limit)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            if not refused:
                await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except ClientDisconnect:
            if not refused:
                raise


async def _send_413(scope: Scope, send: Send, limit: int) -> None:
    await _send_problem(
        scope,
        send,
        413,
        "payload_too_large",
        "Payload too large",
        f"request body exceeds {limit} bytes",
        close=True,
    )


async def _send_problem(
    scope: Scope, send: Send, status: int, code: str, title: str, detail: str, *, close: bool = False
) -> None:
    body = orjson.dumps(
        problem_body(status=status, code=code, title=title, detail=detail, instance=scope["path"])
    )
    headers = [
        (b"content-type", PROBLEM_MEDIA_TYPE.encode()),
        (b"content-length", str(len(body)).encode()),
    ]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
