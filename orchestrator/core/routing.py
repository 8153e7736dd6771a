"""Routes that authenticate a request before they decode its JSON body, and decode it with the
cyclic garbage collector paused.

FastAPI decodes a JSON body (``json.loads``, on the event loop) before it runs any dependency,
so before the signature or the bearer token is checked. A 10 MiB body of three million empty
lists, sent by anyone to ``/v1/assignments/{id}/result``, held a process's event loop for about
2.9 s before it was refused 401: most of it the cyclic collector walking the containers as the
parser made them (0.2 s with it paused). Every route of the app is a ``GuardedRoute``:

* the body is received first (not decoded), as FastAPI did before any dependency ran: a guard
  decides on the whole request, so a bearer token revoked or expired while a slow client was
  still sending the body is refused, and a client gone mid-body is FastAPI's 400 as before;
* the authentication dependencies registered with ``before_body`` (the RFC 9421 signature, the
  bearer token) run next, and keep their answer in the request's scope for the dependency
  itself to return; a refused request's body is never decoded;
* the body is then decoded with the collector paused: JSON makes no reference cycles, and the
  decoded objects are dropped or kept by the handler as before.
"""

from __future__ import annotations

import gc
import json
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar, cast

from fastapi import HTTPException, Request, Response
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute
from starlette.requests import ClientDisconnect

Guard = Callable[[Request], Awaitable[object]]
F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")

_GUARDS: dict[Callable[..., Any], Guard] = {}
_SCOPE_KEY = "orchestrator.before_body"


def before_body(guard: Guard) -> Callable[[F], F]:
    """Register ``guard`` for the decorated dependency: every route whose dependencies include it
    awaits ``guard(request)`` before its body is decoded. The dependency returns the guard's
    answer with ``guarded_answer``."""

    def register(dependency: F) -> F:
        _GUARDS[dependency] = guard
        return dependency

    return register


async def guarded_answer(request: Request, key: str, compute: Callable[[], Awaitable[T]]) -> T:
    """``compute()``'s answer for this request under ``key``, computed once: the route's guard
    computes it before the body is decoded and the dependency finds it here."""
    answers: dict[str, Any] = request.scope.setdefault(_SCOPE_KEY, {})
    if key not in answers:
        answers[key] = await compute()
    return cast(T, answers[key])


def guards_of(dependant: Dependant) -> list[Guard]:
    """The registered guards among a route's dependencies, each once, a dependency's own
    dependencies' guards before its own (the order FastAPI solves them in)."""
    found: list[Guard] = []

    def visit(current: Dependant) -> None:
        for sub in current.dependencies:
            visit(sub)
        guard = _GUARDS.get(current.call) if current.call is not None else None
        if guard is not None and guard not in found:
            found.append(guard)

    visit(dependant)
    return found


class JSONNumberTooLong(ValueError):
    """A JSON integer with more digits than Python converts (``sys.get_int_max_str_digits``)."""


def loads(body: bytes) -> Any:
    """``json.loads`` of the body as UTF-8 (RFC 8259 section 8.1), with the cyclic garbage
    collector paused (restored as it was). Bytes are decoded strictly first: ``json.loads`` of
    bytes would take UTF-16 and UTF-32 too, and encoded surrogates, none of them JSON; they raise
    ``UnicodeDecodeError`` (a byte order mark stays in the text and does not parse). An integer
    too long to convert raises ``JSONNumberTooLong``."""
    text = body.decode("utf-8")
    enabled = gc.isenabled()
    gc.disable()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise
    except ValueError as exc:  # the only other ValueError the parser raises: the digit limit
        raise JSONNumberTooLong(str(exc)) from exc
    finally:
        if enabled:
            gc.enable()


async def receive_body(request: Request) -> None:
    """Receive the whole body (bytes, not decoded) before any guard runs. A client that hangs up
    first is answered as FastAPI's own body read answers it, 400, not an unhandled error."""
    try:
        await request.body()
    except ClientDisconnect as exc:
        raise HTTPException(status_code=400, detail="There was an error parsing the body") from exc


class GuardedRequest(Request):
    """A request whose JSON body is decoded by ``loads``."""

    async def json(self) -> Any:
        if not hasattr(self, "_decoded"):
            self._decoded = loads(await self.body())
        return self._decoded


class GuardedRoute(APIRoute):
    """An ``APIRoute`` that runs its dependencies' ``before_body`` guards first and decodes its
    body with ``loads``. Every router of the app is made with ``route_class=GuardedRoute``."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        guards = guards_of(self.dependant)

        async def guarded(request: Request) -> Response:
            request = GuardedRequest(request.scope, request.receive)
            if guards:
                await receive_body(request)
            for guard in guards:
                await guard(request)
            return await handler(request)

        return guarded
