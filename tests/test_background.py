"""``orchestrator background``: the loops in a process of their own, beside API processes that
run none (``ORCH_SERVER__BACKGROUND_LOOPS=false``, as the test app does)."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import structlog
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families
from redis.exceptions import ConnectionError as RedisConnectionError
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine
from typer.testing import CliRunner, Result

from orchestrator import background
from orchestrator.cli import app as cli
from orchestrator.core import metrics
from orchestrator.core.alive import ALIVE_INTERVAL_S, alive_age, keep_alive
from orchestrator.core.clock import SystemClock
from orchestrator.core.loops import STOP_GRACE_S, run_periodically
from orchestrator.settings import Settings, get_settings
from tests.conftest import IS_POSTGRES, REDIS_URL, postgres_only
from tests.process_helpers import free_port
from tests.scoring_helpers import Gate
from tests.tasks_helpers import pool_setup, task
from tests.verification_helpers import submit, verdicts
from tests.waits import HANG_S, until


async def test_a_background_process_verifies_what_an_api_process_accepted(
    app: Any, app_state: Any, settings: Settings, tmp_path: Path
) -> None:
    async with pool_setup(app, app_state, workers=1, economics={"reward_per_sample": 7}) as s:
        await s.enqueue([task("What is 2+2?"), task("What is 3+3?")])
        w = s.workers[0]
        for answer in ("4", "5"):
            lease = (await w.claim(s.pool_id)).json()["leases"][0]
            await submit(w, lease, [answer])  # 201, checked by the helper
        assert await verdicts(s.admin, s.headers, s.pool_id) == []  # the API process runs no loop

        stop = asyncio.Event()
        alive = tmp_path / "alive"
        server, _ = metrics.serve_background("127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        before = await scrape(url)
        runner = asyncio.create_task(background.run(settings, stop, alive_file=alive, metrics_server=server))
        try:
            deadline = time.monotonic() + 30
            decided: list[dict[str, Any]] = []
            while len(decided) < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
                decided = await verdicts(s.admin, s.headers, s.pool_id)
            age = alive_age(alive)
            assert age is not None and age < ALIVE_INTERVAL_S + 1  # the probe's file
            after = await scrape(url)
        finally:
            stop.set()
            await asyncio.wait_for(runner, timeout=30)
        assert sorted(v["outcome"] for v in decided) == ["accepted", "rejected"], decided
        assert not alive.exists()  # a stopped process is not alive

    # Its /metrics counted the two verdicts and the reward, and shows none of the gauges that
    # the API processes read from the database (they would read 0 here).
    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    verdict = "orchestrator_verdicts_total"
    assert delta(verdict, outcome="accepted", category="valid", verifier="reward") == 1
    assert delta(verdict, outcome="rejected", category="invalid", verifier="reward") == 1
    assert delta("orchestrator_rewards_credited_total") == sum(v["reward_amount"] for v in decided) == 7
    assert delta("orchestrator_slashed_total") == sum(v["slashed_amount"] for v in decided)
    names = {name for name, _ in after}
    assert "orchestrator_loop_tick_failures_total" in names and "process_cpu_seconds_total" in names
    assert "orchestrator_clock_offset_seconds" in names
    assert not names & {"orchestrator_tasks_claimable", "orchestrator_nodes", "orchestrator_leases_active"}
    with pytest.raises(httpx.ConnectError):  # stopped with the loops
        await scrape(url)


async def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    async with httpx.AsyncClient() as client:
        r = await client.get(url)
    assert r.status_code == 200
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(r.text)
        for sample in family.samples
    }


async def test_the_alive_file_is_rewritten_while_the_loop_runs_and_removed_on_stop(tmp_path: Path) -> None:
    alive, stop = tmp_path / "alive", asyncio.Event()
    writer = asyncio.create_task(keep_alive(alive, stop, interval=0.05))
    await until(alive.exists, "the alive file is written")
    first = alive.read_text()
    await until(lambda: alive.read_text() != first, "the alive file is rewritten")  # not written once
    age = alive_age(alive)
    assert age is not None and 0 <= age < 1
    stop.set()
    await asyncio.wait_for(writer, timeout=5)
    assert not alive.exists()
    assert alive_age(alive) is None


def test_the_alive_probe_fails_on_a_missing_or_stale_file(tmp_path: Path) -> None:
    alive, runner = tmp_path / "alive", CliRunner()
    result = runner.invoke(cli, ["alive", str(alive)])
    assert result.exit_code == 1
    assert "missing" in result.output
    alive.write_text(f"{time.time() - 100:.3f}\n")  # a process that stopped writing 100 s ago
    result = runner.invoke(cli, ["alive", str(alive), "--max-age", "30"])
    assert result.exit_code == 1
    assert "was written" in result.output and "(> 30 s)" in result.output
    assert runner.invoke(cli, ["alive", str(alive), "--max-age", "120"]).exit_code == 0
    # The file is rewritten every 5 s: a shorter --max-age would fail a healthy process.
    result = runner.invoke(cli, ["alive", str(alive), "--max-age", "4"])
    assert result.exit_code == 2 and "at least 10 s" in " ".join(result.output.split())
    alive.write_text(f"{time.time():.3f}\n")
    result = runner.invoke(cli, ["alive", str(alive)])
    assert result.exit_code == 0, result.output
    alive.write_text("garbage")
    result = runner.invoke(cli, ["alive", str(alive)])
    assert result.exit_code == 1 and "holds no time" in result.output


def invoke(args: list[str], env: dict[str, str]) -> Result:
    """The command as a process would run it: settings read from ``env``, not an earlier cache."""
    get_settings.cache_clear()
    try:
        return CliRunner().invoke(cli, args, env={"COLUMNS": "200", **env})
    finally:
        get_settings.cache_clear()


def test_the_command_refuses_to_run_without_a_shared_store_and_database() -> None:
    result = invoke(["background"], {"ORCH_REDIS__URL": ""})
    assert result.exit_code == 2
    assert "ORCH_REDIS__URL" in result.output
    result = invoke(
        ["background"],
        {"ORCH_REDIS__URL": "redis://127.0.0.1:6379/0", "ORCH_DB__URL": "sqlite+aiosqlite:///x.db"},
    )
    assert result.exit_code == 2
    assert "PostgreSQL" in result.output


async def test_an_unwritable_alive_file_is_retried_and_the_probe_fails(tmp_path: Path) -> None:
    blocked = tmp_path / "gone"
    alive, stop = blocked / "alive", asyncio.Event()
    writer = asyncio.create_task(keep_alive(alive, stop, interval=0.05))
    await asyncio.sleep(0.15)
    assert not writer.done()  # a failed write does not end the writer
    assert alive_age(alive) is None
    blocked.mkdir()  # the directory appears: the next write succeeds
    await until(lambda: alive_age(alive) is not None, "the alive file is written once it can be")
    stop.set()
    await asyncio.wait_for(writer, timeout=5)


def test_the_command_refuses_a_database_it_cannot_use_before_starting() -> None:
    """A wrong ORCH_DB__URL used to start the loops anyway, each tick failing for ever while the
    alive probe passed; now it is one line and exit 2."""
    with socket.socket() as bound:  # bound, never listening: connections to it are refused
        bound.bind(("127.0.0.1", 0))
        port = bound.getsockname()[1]
        env = {
            "ORCH_REDIS__URL": "redis://127.0.0.1:6379/0",
            "ORCH_DB__URL": f"postgresql+asyncpg://postgres@127.0.0.1:{port}/x",
        }
        result = invoke(["background"], env)
    assert result.exit_code == 2, (result.output, result.exception)
    [line] = result.output.strip().splitlines()
    assert "connection refused" in line and "ORCH_DB__URL" in line


def test_the_command_refuses_a_redis_it_cannot_reach_before_starting() -> None:
    """An ORCH_REDIS__URL that does not answer used to start the loops anyway, each tick of each
    loop logging a traceback every few seconds; now it is one line and exit 2, as for the database."""
    with socket.socket() as bound:  # bound, never listening: connections to it are refused
        bound.bind(("127.0.0.1", 0))
        port = bound.getsockname()[1]
        env = {
            "ORCH_REDIS__URL": f"redis://:s3cret@127.0.0.1:{port}/0",
            "ORCH_DB__URL": "postgresql+asyncpg://u@h/db",
        }
        result = invoke(["background"], env)
    assert result.exit_code == 2, (result.output, result.exception)
    [line] = result.output.strip().splitlines()
    assert f"cannot reach Redis at redis://:***@127.0.0.1:{port}/0" in line and "ORCH_REDIS__URL" in line
    assert "s3cret" not in line


async def test_a_tick_that_cannot_reach_redis_or_the_database_logs_a_line_not_a_traceback(
    settings: Settings,
) -> None:
    """During an outage every loop fails at every tick: each failure is one warning naming the
    error, while any other failure keeps its traceback."""
    errors: list[BaseException] = [
        RedisConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused."),
        ConnectionRefusedError(111, "Connection refused"),
        RuntimeError("a bug"),
    ]
    stop = asyncio.Event()

    async def tick(_: Any) -> None:
        error = errors.pop(0)
        if not errors:
            stop.set()
        raise error

    state = SimpleNamespace(clock=SystemClock())

    def failed(cause: str) -> float:
        labels = {"loop": "sweeper", "cause": cause}
        return REGISTRY.get_sample_value("orchestrator_loop_tick_failures_total", labels) or 0.0

    before = {cause: failed(cause) for cause in ("unavailable", "error")}
    with structlog.testing.capture_logs() as logs:
        await asyncio.wait_for(run_periodically(state, "sweeper", 0.01, tick, stop), timeout=10)  # type: ignore[arg-type]
    # ... and each is counted by its cause, for the alert on failing ticks.
    assert {cause: failed(cause) - n for cause, n in before.items()} == {"unavailable": 2, "error": 1}
    assert [(e["event"], e["log_level"], e.get("exc_info"), e.get("error")) for e in logs] == [
        (
            "background_tick_unavailable",
            "warning",
            None,
            "ConnectionError: Error 111 connecting to 127.0.0.1:6379. Connection refused.",
        ),
        (
            "background_tick_unavailable",
            "warning",
            None,
            "ConnectionRefusedError: [Errno 111] Connection refused",
        ),
        ("background_tick_failed", "error", True, None),
    ]


async def test_a_tick_that_says_there_is_more_is_followed_at_once_by_the_next() -> None:
    """The verifier's tick stopped by its budget with results still waiting says ``more``: the
    next starts at once, not at the next interval (here an hour away); others wait as before."""
    stop = asyncio.Event()
    reports = [SimpleNamespace(more=True), SimpleNamespace(more=True), SimpleNamespace(more=False)]
    ran = 0

    async def tick(_: Any) -> Any:
        nonlocal ran
        ran += 1
        report = reports.pop(0)
        if not reports:
            stop.set()
        return report

    state = SimpleNamespace(clock=SystemClock())
    await asyncio.wait_for(run_periodically(state, "verifier", 3600, tick, stop), timeout=10)  # type: ignore[arg-type]
    assert ran == 3


@pytest.mark.skipif(IS_POSTGRES, reason="SQLite's one write lock")
async def test_on_sqlite_a_write_gets_in_between_verifier_ticks_that_say_there_is_more(
    app_state: Any, monkeypatch: Any
) -> None:
    """A verifier working a backlog ticks back to back (``more``), each tick holding the write
    lock for its batches. A claim, result or beat that waits for the lock meanwhile is let in
    after the next tick, not after the backlog: the loop, ticking at once, took the lock again
    before SQLite's busy handler retried the waiting transaction, which waited for seconds."""
    stop, deciding = asyncio.Event(), asyncio.Event()
    ticks = 0
    wrote_after: list[int] = []

    async def verifier_tick(state: Any) -> Any:
        nonlocal ticks
        async with state.sessionmaker() as session, session.begin():  # BEGIN IMMEDIATE
            await session.execute(text("SELECT 1"))
            deciding.set()
            await asyncio.sleep(0.1)  # deciding a batch, with the write lock held
        ticks += 1
        if ticks == 8:
            stop.set()  # the backlog is done
        return SimpleNamespace(more=ticks < 8)

    async def a_claim() -> None:
        await deciding.wait()  # the verifier is working its backlog
        async with app_state.sessionmaker() as session, session.begin():  # waits for the lock
            await session.execute(text("SELECT 1"))
        wrote_after.append(ticks)

    monkeypatch.setattr(background, "loops", lambda settings: [("verifier", 3600, verifier_tick)])
    claim = asyncio.create_task(a_claim())
    tasks = background.start(app_state, stop)
    await asyncio.wait_for(asyncio.gather(*tasks, claim), timeout=HANG_S)
    assert ticks == 8
    assert wrote_after == [1]  # after the first tick, not after the whole backlog (8)


def test_the_command_refuses_a_metrics_port_in_use_before_starting() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {"ORCH_REDIS__URL": "redis://127.0.0.1:6379/0", "ORCH_DB__URL": "postgresql+asyncpg://u@h/db"}
        result = invoke(["background", "--metrics-port", str(port)], env)
    assert result.exit_code == 2, (result.output, result.exception)
    [line] = result.output.strip().splitlines()
    assert f"cannot serve on 127.0.0.1:{port}" in line and "--metrics-port" in line


def test_the_command_refuses_an_alive_file_in_a_missing_directory(tmp_path: Path) -> None:
    env = {"ORCH_REDIS__URL": "redis://127.0.0.1:6379/0", "ORCH_DB__URL": "postgresql+asyncpg://u@h/db"}
    result = invoke(["background", "--alive-file", str(tmp_path / "no" / "alive")], env)
    assert result.exit_code == 2
    assert "is not a writable directory" in result.output


def _spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:  # the child has its own copy of the descriptor
        return subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT)


@postgres_only
@pytest.mark.skipif(not REDIS_URL, reason="`orchestrator background` needs Redis (set ORCH_TEST_REDIS_URL)")
async def test_the_process_runs_the_loops_passes_its_probe_and_stops_on_sigterm(
    settings: Settings, tmp_path: Path
) -> None:
    """The command as a container runs it: a process of its own, its probe, SIGTERM."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ORCH_", "PROMETHEUS_"))}
    env |= {
        "ORCH_ENV": "test",
        "ORCH_LOG_LEVEL": "WARNING",
        "ORCH_DB__URL": settings.db.url,
        "ORCH_REDIS__URL": str(REDIS_URL),
        "ORCH_REDIS__PREFIX": settings.redis.prefix,
    }
    alive, log = tmp_path / "alive", tmp_path / "background.log"
    command = [sys.executable, "-m", "orchestrator.cli"]

    def probe() -> int:
        return subprocess.run(
            [*command, "alive", str(alive)], env=env, capture_output=True, check=False
        ).returncode

    port = free_port()
    args = ["background", "--alive-file", str(alive), "--metrics-port", str(port)]
    proc = _spawn([*command, *args], env, log)
    engine = create_async_engine(settings.db.url)
    try:
        deadline = time.monotonic() + 30
        swept = None
        while swept is None or not alive.exists():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, f"no tick and no alive file in 30 s:\n{log.read_text()}"
            await asyncio.sleep(0.2)
            async with engine.connect() as conn:
                swept = await conn.scalar(
                    text("SELECT last_run_at FROM background_ticks WHERE name = 'liveness_sweeper'")
                )
        assert await asyncio.to_thread(probe) == 0
        # Its sweeps measured this host's clock against the database server's, for the alert on
        # clock skew (the API processes export theirs on their /metrics).
        scraped = await scrape(f"http://127.0.0.1:{port}/metrics")
        assert 0 < abs(scraped[("orchestrator_clock_offset_seconds", ())]) < 1  # measured, not the initial 0
        verifier_errors = (
            "orchestrator_loop_tick_failures_total",
            (("cause", "error"), ("loop", "verifier")),
        )
        assert scraped[verifier_errors] == 0

        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 30) == 0, log.read_text()
        assert not alive.exists()
        assert await asyncio.to_thread(probe) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        await engine.dispose()


async def test_a_stop_is_prompt_while_the_verifier_scores_and_leaves_no_scoring_process(
    app: Any, app_state: Any, settings: Settings, gate: Gate
) -> None:
    """A stop waited for the verifier's tick, whose batch scores its results one after the other,
    each up to reward_timeout_s: a SIGTERM took 34 s with three such results waiting (minutes
    with a batch of them). The tick is now cancelled after a grace; the result it was scoring is
    not judged (it waits for the next verifier) and no scoring process is left busy. The results
    here are held in scoring for as long as the test runs: a stop that waited for them would
    never end."""
    settings.verifier.reward_timeout_s = 600
    async with pool_setup(app, app_state, workers=1, reward_function="gated") as s:
        await s.enqueue(
            [task("What is 6 * 7?", verification={"answer": "42", **gate.spec}) for _ in range(2)]
        )
        w = s.workers[0]
        for _ in range(2):
            lease = (await w.claim(s.pool_id)).json()["leases"][0]
            await submit(w, lease, ["42"])

        stop = asyncio.Event()
        runner = asyncio.create_task(background.run(settings, stop))
        await gate.scoring_started()  # the verifier's scoring process is held on a result
        assert multiprocessing.active_children()
        stop.set()
        # Not wait_for: it cancels the run, which a stop that waits for its loops swallows.
        done, _ = await asyncio.wait({runner}, timeout=STOP_GRACE_S + HANG_S)
        if not done:
            gate.open()
            await runner
        assert done, "the stop waited for the scoring"
        assert await verdicts(s.admin, s.headers, s.pool_id) == []  # left for the next verifier
        until = time.monotonic() + HANG_S
        while multiprocessing.active_children():
            assert time.monotonic() < until, "a scoring process was left behind"
            await asyncio.sleep(0.1)


def test_the_command_refuses_a_prometheus_multiproc_dir_and_writes_nothing_there(tmp_path: Path) -> None:
    """README: `orchestrator background` serves what it measures on its own --metrics-port. Given
    PROMETHEUS_MULTIPROC_DIR (set for every process: on one host, in a shared env file), it wrote
    its counters into the API processes' directory, whose /metrics then served its verdicts,
    rewards and failed ticks as well: summed over both scrape targets, each was counted twice. It
    refuses now, in one line, before writing anything there."""
    prom = tmp_path / "prom"
    prom.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORCH_")}
    env |= {
        "PROMETHEUS_MULTIPROC_DIR": str(prom),
        "ORCH_REDIS__URL": "redis://127.0.0.1:1/0",  # nothing it could reach: it must not get there
        "ORCH_DB__URL": "postgresql+asyncpg://u@127.0.0.1:1/db",
    }
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "background", "--metrics-port", str(free_port())],
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert done.returncode == 2, (done.stdout, done.stderr)
    [line] = done.stderr.strip().splitlines()
    assert "PROMETHEUS_MULTIPROC_DIR is set" in line and "unset it for orchestrator background" in line
    assert list(prom.iterdir()) == []  # no counter files for the API's /metrics to add up


async def test_a_stop_ends_with_no_tick_left_pending_even_one_stuck_in_its_rollback(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tick the stop cancels whose rollback then waits (in life behind another process's
    SQLite write lock; here for an event) is stuck: the stop does the rest of its cleanup
    without it (``background_tick_stuck``) and then waits for it, so that no task is left
    pending when the event loop closes. Before, the stop returned with the tick pending, and
    asyncio warned "Task was destroyed but it is pending" for it at exit. (The CLI's process
    does not wait that long: core.loops.ExitGuard ends it, test_server_stop.)"""
    started, released = asyncio.Event(), asyncio.Event()

    async def stuck_tick(_state: Any) -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await released.wait()  # its rollback, behind another process's lock
            raise

    monkeypatch.setattr(background, "loops", lambda _settings: [("stuck", 3600.0, stuck_tick)])
    stop = asyncio.Event()
    with structlog.testing.capture_logs() as logs:
        runner = asyncio.create_task(background.run(settings, stop))
        await asyncio.wait_for(started.wait(), HANG_S)
        stop.set()
        events = lambda: [entry["event"] for entry in logs]  # noqa: E731
        await until(
            lambda: runner.done() or "stop_awaiting_stuck_ticks" in events(), "the stop ends or waits"
        )
        left = [t.get_name() for t in asyncio.all_tasks() if t.get_name() == "stuck" and not t.done()]
        stopped_first = runner.done()
        released.set()
        await runner
    assert not stopped_first, f"the stop ended with its tick pending: {left}"
    assert not [t for t in asyncio.all_tasks() if t.get_name() == "stuck" and not t.done()]
    assert events().index("stop_awaiting_stuck_ticks") > events().index("background_tick_stuck")
