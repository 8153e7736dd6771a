"""What operators rely on in an outage and at scale: /metrics still serves the process's own
counters while the database is down, a database that does not answer is a retryable 503, counters
count committed work, every process exports its clock offset, ended workers' series go, and
/readyz on SQLite does not wait behind a writer."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest
from prometheus_client import REGISTRY
from sqlalchemy import event

from orchestrator.core import metrics
from orchestrator.core.clock import SystemClock
from orchestrator.liveness.service import sweep_once
from tests.conftest import postgres_only
from tests.test_serving_marks import OffsetClock


@postgres_only
async def test_a_background_process_whose_clock_is_behind_still_exports_its_offset(app_state: Any) -> None:
    """README: `orchestrator background --metrics-port` serves "its clock's offset from the
    database server's (measured at each sweep)", and OrchestratorClockSkew alerts on it. But a
    background process measures only in a sweep it *claims*; one whose clock runs behind the
    others' computes an older tick number and never claims a sweep, so its gauge keeps its
    initial 0 (or a stale value) for ever and the alert could not fire for the host that is off.
    It is measured at every sweep attempt now."""
    on_time = dataclasses.replace(app_state, clock=SystemClock(), instance_id="bg-a:1")
    behind = dataclasses.replace(app_state, clock=OffsetClock(-20.0), instance_id="bg-b:2")
    assert (await sweep_once(on_time)).ran  # the process on time claims the tick first, as it will
    metrics.CLOCK_OFFSET.set(0.0)  # what a fresh `orchestrator background` process exports
    await sweep_once(behind)  # the process 20 s behind: its sweep of every tick finds it taken
    exported = REGISTRY.get_sample_value("orchestrator_clock_offset_seconds")
    assert exported is not None and round(exported) == -20, (
        f"the process 20 s behind exports an offset of {exported}"
    )


_A_WORKER_THAT_ENDS = """
import asyncio, os, sys
from asgi_lifespan import LifespanManager
from orchestrator.app import create_app
from orchestrator.core import metrics
from orchestrator.core.hotstore import MemoryHotStore
from orchestrator.settings import DatabaseSettings, ServerSettings, Settings

async def main():
    settings = Settings(
        env="test", log_level="WARNING", db=DatabaseSettings(url=sys.argv[1]),
        server=ServerSettings(background_loops=False, migrate_on_start=False),
    )
    app = create_app(settings, hot_store=MemoryHotStore(), serving_marks=False, close_scoring=False)
    async with LifespanManager(app):
        metrics.CLOCK_OFFSET.set(30.0)  # its last serving mark found its clock 30 s off
    print(os.getpid())  # the lifespan has ended: the worker stops, as on SIGTERM or SIGHUP

asyncio.run(main())
"""

_THE_WORKER_LEFT = """
from orchestrator.core import metrics
metrics.CLOCK_OFFSET.set(0.0)
print(metrics.render()[0].decode())
"""


def _clock_offset_series(env: dict[str, str]) -> list[str]:
    """The clock offset series a scrape by a new process (``_THE_WORKER_LEFT``) shows."""
    import subprocess
    import sys

    scrape = subprocess.run(
        [sys.executable, "-c", _THE_WORKER_LEFT],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    return [line for line in scrape.splitlines() if line.startswith("orchestrator_clock_offset_seconds{")]


def test_a_worker_that_ended_leaves_no_clock_offset_series_behind(tmp_path: Any, database_url: str) -> None:
    """README: with PROMETHEUS_MULTIPROC_DIR, orchestrator_clock_offset_seconds is "one series
    per process ..., labelled pid" (multiprocess_mode="liveall", alert OrchestratorClockSkew).
    prometheus_client keeps a process's liveall files until ``mark_process_dead(pid)`` is
    called, which nothing did: a uvicorn worker that ended (SIGHUP's restart of every worker)
    was still reported, at the value it last had, for the container's life. One that left at
    30 s kept the alert firing for ever. An app now marks its process dead as it ends."""
    import os
    import subprocess
    import sys

    prom = tmp_path / "prom"
    prom.mkdir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(prom)}
    done = subprocess.run(
        [sys.executable, "-c", _A_WORKER_THAT_ENDS, database_url],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    gone = done.stdout.strip().splitlines()[-1]
    series = _clock_offset_series(env)
    assert not [line for line in series if f'pid="{gone}"' in line], series


_A_WORKER_KILLED = """
import os, signal
from orchestrator.core import metrics
metrics.CLOCK_OFFSET.set(30.0)
print(os.getpid(), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_worker_that_was_killed_leaves_no_clock_offset_series_behind(tmp_path: Any) -> None:
    """A worker that cannot mark itself dead (SIGKILL, the OOM killer; uvicorn's supervisor
    starts another in its place) left its liveall file, so its clock offset was reported at
    its last value for the container's life, one more series for every such death: one killed
    at 30 s kept OrchestratorClockSkew firing for ever. A scrape now forgets the per-process
    series of processes that are gone."""
    import os
    import subprocess
    import sys

    prom = tmp_path / "prom"
    prom.mkdir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(prom)}
    killed = subprocess.run(
        [sys.executable, "-c", _A_WORKER_KILLED], env=env, capture_output=True, text=True, timeout=120
    )
    assert killed.returncode == -9, killed.stderr
    gone = killed.stdout.strip().splitlines()[-1]
    series = _clock_offset_series(env)
    assert len(series) == 1 and f'pid="{gone}"' not in series[0], series


def test_scrapes_of_two_workers_forgetting_the_same_ended_process_both_answer(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The workers of one container share its PROMETHEUS_MULTIPROC_DIR, and each scrape forgets
    the files of processes that are gone. Two scrapes at once (two Prometheus servers, or one and
    an operator's curl, served by two workers) both find a killed worker's file, and the second
    to remove it raised FileNotFoundError out of render(): that scrape was a 500. A file another
    scrape removed first is forgotten already."""
    import os
    import subprocess
    import sys

    ended = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    pid = int(ended.stdout)
    for mode in ("liveall", "livemax"):
        (tmp_path / f"gauge_{mode}_{pid}.db").write_bytes(b"")
    remove = os.remove

    def other_scrape_first(path: Any, *args: Any, **kwargs: Any) -> None:
        if os.path.exists(path):
            remove(path)  # the other worker's scrape, between this one's glob and its remove
        remove(path, *args, **kwargs)

    monkeypatch.setattr(os, "remove", other_scrape_first)
    metrics._forget_ended_processes(str(tmp_path))
    assert list(tmp_path.iterdir()) == []


async def test_metrics_still_serve_the_request_counters_while_the_database_is_down(
    settings: Any, clock: Any
) -> None:
    """/metrics reads its queue and node gauges from the database first and answers 503
    database_unavailable when it could not: every API process's scrape failed for as long as
    the database was down, so orchestrator_http_requests_total disappeared and
    OrchestratorServerErrors (5xx rate) could not fire in the very outage that makes every
    request a 503. The process's own counters need no database: they are served, and
    orchestrator_metrics_database_read says the database's gauges could not be read."""
    import httpx
    from asgi_lifespan import LifespanManager

    from orchestrator.app import create_app
    from orchestrator.core.hotstore import MemoryHotStore
    from orchestrator.settings import DatabaseSettings

    down = settings.model_copy(
        update={"db": DatabaseSettings(url="postgresql+asyncpg://postgres@127.0.0.1:1/none")}
    )
    app = create_app(down, clock=clock, hot_store=MemoryHotStore(), serving_marks=False, close_scoring=False)
    async with (
        LifespanManager(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as c,
    ):
        assert (await c.get("/readyz")).status_code == 503
        r = await c.get("/metrics")
    assert r.status_code == 200, (r.status_code, r.text[:200])
    assert 'orchestrator_http_requests_total{method="GET",route="/readyz",status="503"}' in r.text


async def test_a_result_whose_transaction_did_not_commit_is_not_counted_as_accepted(
    app: Any, app_state: Any
) -> None:
    """orchestrator_results_total{outcome="accepted"} and the claim counters are incremented in
    the route, before the request's transaction commits (``Session``'s commit runs after the
    handler returns). A commit that failed (the database dropping the connection: 503
    database_unavailable, sent again by the worker) left a result counted as accepted that was
    not recorded, and the worker's retry counted it again: one recorded result, two
    "accepted". They wait for the commit now (``metrics.on_commit``), as the verifier's do."""
    from sqlalchemy import event
    from sqlalchemy.orm import Session as OrmSession

    from tests.tasks_helpers import pool_setup, task

    def accepted() -> float:
        return REGISTRY.get_sample_value("orchestrator_results_total", {"outcome": "accepted"}) or 0.0

    async with pool_setup(app, app_state, workers=1) as s:
        [w] = s.workers
        await s.enqueue([task()])
        [lease] = (await w.claim(s.pool_id)).json()["leases"]
        before = accepted()
        failing = {"commit": True}

        def drop_the_connection(_session: Any) -> None:
            if failing.pop("commit", False):
                raise ConnectionResetError("connection reset by peer")  # as at a failover

        event.listen(OrmSession, "before_commit", drop_the_connection)
        try:
            r = await w.submit(lease)
        finally:
            event.remove(OrmSession, "before_commit", drop_the_connection)
        assert r.status_code == 503 and r.json()["code"] == "database_unavailable", r.text
        again = await w.submit(lease)  # the worker sends it again, as Retry-After asks
        assert again.status_code == 201, again.text
    assert accepted() - before == 1, f"one result recorded, counted {accepted() - before} times as accepted"


async def _answers_while(settings: Any, clock: Any, monkeypatch: Any, url: str, **engine: Any) -> Any:
    """An app whose engine is made with ``engine``'s options (a short connect or pool timeout,
    so that the test need not wait asyncpg's 60 s or the pool's 30 s)."""
    import httpx
    from asgi_lifespan import LifespanManager
    from sqlalchemy.ext.asyncio import create_async_engine

    import orchestrator.core.state as state_module
    from orchestrator.app import create_app
    from orchestrator.core.hotstore import MemoryHotStore
    from orchestrator.settings import DatabaseSettings

    monkeypatch.setattr(
        state_module, "make_engine", lambda db: create_async_engine(db.url, hide_parameters=True, **engine)
    )
    app = create_app(
        settings.model_copy(update={"db": DatabaseSettings(url=url)}),
        clock=clock,
        hot_store=MemoryHotStore(),
        serving_marks=False,
        close_scoring=False,
    )
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return app, LifespanManager(app), httpx.AsyncClient(transport=transport, base_url="http://testserver")


def _retryable_503(r: Any) -> None:
    assert r.status_code == 503, (r.status_code, r.text[:300])
    assert r.json()["code"] == "database_unavailable" and r.headers["retry-after"] == "5", r.text


async def test_a_database_that_does_not_answer_the_connection_is_a_503_not_a_500(
    settings: Any, clock: Any, monkeypatch: Any
) -> None:
    """errors.py: a database that cannot be reached is 503 database_unavailable (Retry-After),
    which workers wait out, keeping their result. A server that accepts the TCP connection but
    never answers (a black-holed failover address, a hung PostgreSQL or PgBouncer) makes
    asyncpg's connect raise TimeoutError, which ``database_unavailable`` did not know: 500
    internal_error with a traceback, after which a worker gave its result up and released the
    lease (runner: only 429/502/503/504 are "not reached")."""
    import socket

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # accepts (the kernel does), never speaks
    url = f"postgresql+asyncpg://postgres@127.0.0.1:{silent.getsockname()[1]}/none"
    try:
        _, lifespan, client = await _answers_while(
            settings, clock, monkeypatch, url, connect_args={"timeout": 1}
        )
        async with lifespan, client:
            _retryable_503(await client.get("/v1/pools"))
    finally:
        silent.close()


async def test_a_request_that_finds_every_database_connection_busy_is_a_503_not_a_500(
    settings: Any, clock: Any, monkeypatch: Any, database_url: str
) -> None:
    """Every pooled connection busy (a burst, a slow database) past the pool's timeout raises
    sqlalchemy.exc.TimeoutError ("QueuePool limit ... reached"), which no handler mapped: 500
    internal_error, where Redis's pool in the same state is 503 hot_store_unavailable (README,
    ORCH_REDIS__MAX_CONNECTIONS). The request did nothing and can be sent again."""
    extra = {"pool_size": 1, "max_overflow": 0, "pool_timeout": 1}
    if database_url.startswith("sqlite"):
        from sqlalchemy.pool import AsyncAdaptedQueuePool

        extra["poolclass"] = AsyncAdaptedQueuePool
    app, lifespan, client = await _answers_while(settings, clock, monkeypatch, database_url, **extra)
    async with lifespan, client:
        async with app.state.orch.engine.connect():  # the pool's one connection, held
            r = await client.get("/v1/pools")
        _retryable_503(r)


@pytest.mark.parametrize("path", ["/readyz", "/metrics"])
async def test_probes_on_sqlite_do_not_wait_behind_a_writer(
    client: Any, database_url: str, path: str
) -> None:
    """/readyz probes the database with ``SELECT 1`` on a connection of the app's engine, and
    /metrics reads its gauges in a session of it; on SQLite their every transaction began with
    BEGIN IMMEDIATE (the database's one write lock). While any write transaction ran (a verifier
    batch, a task batch, prune-evidence) each waited for that lock: not the 3 s their wait_for
    promises but the 30 s busy timeout (past Prometheus's 10 s scrape timeout), then /readyz
    answered 503 "database: unavailable: TimeoutError" of a database that is reachable and
    serving. Their transactions are deferred now: they take no lock (WAL readers need none)."""
    import time

    import pytest
    from sqlalchemy import text

    from orchestrator.core.db import make_engine
    from orchestrator.settings import DatabaseSettings

    if not database_url.startswith("sqlite"):
        pytest.skip("SQLite's write lock; PostgreSQL's SELECT 1 takes none")
    writer = make_engine(DatabaseSettings(url=database_url))
    try:
        async with writer.connect() as conn:
            await conn.execute(text("SELECT 1"))  # a write transaction in progress (BEGIN IMMEDIATE)
            started = time.monotonic()
            r = await client.get(path)
            took = time.monotonic() - started
    finally:
        await writer.dispose()
    assert took < 5 and r.status_code == 200, (round(took, 1), r.status_code, r.text[:300])
    if path == "/metrics":
        assert "orchestrator_metrics_database_read 1.0" in r.text


async def test_concurrent_scrapes_share_one_read_of_the_database_gauges(client: Any, app_state: Any) -> None:
    """/metrics is public, and each scrape read the database's gauges (counts of nodes, claimable
    tasks, leases, waiting jobs): 20 scrapes at once ran 20 such reads. Now a scrape that comes
    while a read is under way waits for that one, so a flood of scrapes costs one read at a time;
    each still gets the gauges, read since it asked."""
    reads = 0

    def count(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        nonlocal reads
        reads += "AS oldest_validator" in statement

    event.listen(app_state.engine.sync_engine, "before_cursor_execute", count)
    try:
        answers = await asyncio.gather(*(client.get("/metrics") for _ in range(20)))
        assert [r.status_code for r in answers] == [200] * 20
        assert all("orchestrator_tasks_claimable" in r.text for r in answers)
        assert 1 <= reads <= 3, f"{reads} reads of the gauges for 20 scrapes at once"
        before = reads
        assert (await client.get("/metrics")).status_code == 200
        assert reads == before + 1  # a scrape after the read ended reads afresh
    finally:
        event.remove(app_state.engine.sync_engine, "before_cursor_execute", count)
