"""The FastAPI application factory and its lifespan."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import multiprocessing
import os
import signal
import sys
from collections.abc import AsyncIterator
from typing import Any

import structlog
from fastapi import FastAPI

from orchestrator import __version__, background
from orchestrator.admin.router import router as admin_router
from orchestrator.audit.router import router as audit_router
from orchestrator.core import metrics
from orchestrator.core.clock import Clock, SystemClock
from orchestrator.core.errors import PROBLEM_MEDIA_TYPE, install_error_handlers
from orchestrator.core.health import router as health_router
from orchestrator.core.hotstore import HotStore, check_hot_store_clock, check_memory_policy
from orchestrator.core.instance_lock import InstanceLock
from orchestrator.core.logging import configure_logging
from orchestrator.core.loops import ExitGuard, await_stuck, stop_loops
from orchestrator.core.middleware import BodyLimitMiddleware, HostCheckMiddleware, RequestContextMiddleware
from orchestrator.core.problem_types import router as problem_types_router
from orchestrator.core.state import open_state
from orchestrator.feed.router import router as feed_router
from orchestrator.identity.router import router as identity_router
from orchestrator.ledger.router import router as ledger_router
from orchestrator.liveness.router import router as liveness_router
from orchestrator.payouts.router import admin_router as payouts_admin_router
from orchestrator.payouts.router import router as payouts_router
from orchestrator.pools.router import admin_router as pools_admin_router
from orchestrator.pools.router import router as pools_router
from orchestrator.restem.router import admin_router as restem_admin_router
from orchestrator.settings import Settings, get_settings
from orchestrator.tasks.router import admin_router as tasks_admin_router
from orchestrator.tasks.router import router as tasks_router
from orchestrator.verification import scoring
from orchestrator.verification.router import admin_router as verification_admin_router
from orchestrator.verification.router import router as verification_router
from orchestrator.verification.router import validation_router

log = structlog.get_logger(__name__)

DESCRIPTION = """
Coordinator for permissionless compute pools: contributors register Ed25519-keyed nodes,
heartbeat, claim rollout tasks and submit signed results; operators run pools through the
admin API.

**Contributor requests** are signed with RFC 9421 HTTP Message Signatures (ed25519) and
carry an RFC 9530 Content-Digest with any body (scheme `HttpMessageSignature`).
**Operator requests** use a bearer token with a role (scheme `BearerToken`).
Every error is RFC 9457 `application/problem+json` with a stable `code`.
"""

# Result submissions (proofs), task batches, policies (a manifest of up to 10,000 shards) and
# ReST^EM problem sets get the larger body limit.
LARGE_BODY_PATHS = (
    r"/v1/assignments/[^/]+/result|/v1/admin/pools/[^/]+/tasks|/v1/admin/pools/[^/]+/policies"
    r"|/v1/admin/pools/[^/]+/restem/iterations"
)


PR_SET_PDEATHSIG = 1  # prctl(2)


def end_with_supervisor() -> None:
    """In a worker of ``serve --workers N`` (a multiprocessing child of uvicorn's supervisor),
    ask Linux for a SIGTERM when the supervisor dies, which uvicorn takes as a graceful stop.
    Without it a supervisor killed outright (SIGKILL, the OOM killer, a process manager that
    signals only the process it started) left its workers serving the port, and a restart found
    the port in use. Elsewhere (one process, another system) this does nothing."""
    parent = multiprocessing.parent_process()
    if parent is None or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        log.warning("parent_death_signal_unavailable", errno=ctypes.get_errno())
        return
    if os.getppid() != parent.pid:  # the supervisor died before the call: no signal will come
        os.kill(os.getpid(), signal.SIGTERM)


ROUTERS = (
    health_router,
    problem_types_router,
    identity_router,
    liveness_router,
    admin_router,
    ledger_router,
    pools_router,
    pools_admin_router,
    audit_router,
    tasks_router,
    tasks_admin_router,
    payouts_router,
    payouts_admin_router,
    verification_router,
    verification_admin_router,
    validation_router,
    feed_router,
    restem_admin_router,
)
"""Every router of the service, in the order the app matches them."""


def serve_app() -> FastAPI:
    """The application of ``orchestrator serve`` (uvicorn's factory): its process exits promptly
    once stopped even when a request or tick it cancelled waits for another process's SQLite
    write lock (``core.loops.ExitGuard``)."""
    return create_app(exit_after_stop=True)


def create_app(
    settings: Settings | None = None,
    *,
    clock: Clock | None = None,
    hot_store: HotStore | None = None,
    serving_marks: bool = True,
    close_scoring: bool = True,
    exit_after_stop: bool = False,
) -> FastAPI:
    """The application. ``clock``, ``hot_store``, ``serving_marks`` and ``close_scoring`` are for
    tests: a test that drives the clock itself writes the serving marks itself
    (``liveness.serving``), or the sweeper would find them stale whenever it moves the clock; and
    tests keep the scoring processes (process-wide) from one app to the next. ``exit_after_stop``
    (``serve_app``) ends the process if its stop outlasts its bound, or soon after the lifespan's
    cleanup when a tick is stuck (``core.loops.ExitGuard``)."""
    settings = settings or get_settings()
    configure_logging(settings.log_level, json=settings.log_json)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        end_with_supervisor()
        state = open_state(settings, clock=clock, hot_store=hot_store)
        engine, store = state.engine, state.hot_store
        # An in-process store of our own serves this process only: no other process may serve
        # this database with one meanwhile (an injected store is the caller's business).
        lock = InstanceLock()
        if hot_store is None and not store.shared_across_processes:
            try:
                await lock.acquire(engine)
            except BaseException:
                await store.aclose()
                await engine.dispose()
                raise
        app.state.orch = state
        # A Redis that may evict keys loses spent nonces unseen (README, Redis): said at startup.
        await check_memory_policy(store)
        if isinstance(state.clock, SystemClock):  # a test's clock is not the host's
            await check_hot_store_clock(store, state.clock.now)
        stop = asyncio.Event()
        tasks = background.start(state, stop) if settings.server.background_loops else []
        if serving_marks:  # every API process, whatever its background_loops
            state.marking = True
            tasks.append(background.start_serving_marks(state, stop))
        log.info(
            "started",
            version=__version__,
            db=engine.dialect.name,
            hot_store=type(store).__name__,
            background_loops=settings.server.background_loops,
        )
        try:
            yield
        finally:
            guard = ExitGuard() if exit_after_stop else None
            stopped = await stop_loops(tasks, stop)
            if stopped.cancelled or close_scoring:
                # The scoring processes (the verifier's, a validator verdict's), one a cancelled
                # verifier may have left busy with a result among them: stopped now, not at exit:
                # uvicorn ends a SIGTERM'd process with the signal, so no atexit handler runs, and
                # they were left to the resource tracker ("leaked semaphore objects").
                await asyncio.to_thread(scoring.close_pools)
            if hot_store is None:
                await store.aclose()
            await lock.release()
            await engine.dispose()
            metrics.process_ended()
            if guard is not None:
                guard.cleaned_up(stuck=bool(stopped.stuck))
            await await_stuck(stopped.stuck)

    app = FastAPI(
        title="orchestrator",
        version=__version__,
        description=DESCRIPTION,
        lifespan=lifespan,
    )
    install_error_handlers(app)
    app.add_middleware(
        BodyLimitMiddleware,
        default_limit=settings.limits.max_body_bytes,
        large_limit=settings.limits.max_result_body_bytes,
        large_paths=LARGE_BODY_PATHS,
    )
    app.add_middleware(HostCheckMiddleware)
    app.add_middleware(RequestContextMiddleware)
    # FastAPI (>= 0.137) keeps an included router as its own node and rebuilds every route's
    # dependency tree and model fields for each app that includes it; the tests build an app
    # per test, so that was a quarter of the suite's time. The routers carry no prefix, tags
    # or dependencies of their own at inclusion, so the app shares their routes as they are:
    # the OpenAPI document and the matching are the same. The one thing lost is
    # app.dependency_overrides on those routes, which nothing here uses.
    for router in ROUTERS:
        app.router.routes.extend(router.routes)
    generate_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        return _problems_as_served(generate_openapi())

    app.openapi = openapi  # type: ignore[method-assign]
    return app


def _problems_as_served(schema: dict[str, Any]) -> dict[str, Any]:
    """Errors are served as application/problem+json only, but FastAPI files a response model's
    schema under the route's media type (application/json): move it to problem+json."""
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            for response in operation.get("responses", {}).values():
                content = response.get("content", {})
                if PROBLEM_MEDIA_TYPE in content and "application/json" in content:
                    content[PROBLEM_MEDIA_TYPE] = content.pop("application/json")
    return schema
