"""``orchestrator serve`` on the embedded default stops promptly on SIGTERM while workers claim and
submit and the verifier works their results, and loses no result it answered 201."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from nacl.signing import SigningKey

from api_schemas.tasks import ResultIn
from orchestrator.worker.client import WorkerClient
from orchestrator.worker.problems import arithmetic_tasks
from tests.conftest import GPU_SPECS
from tests.process_helpers import embedded_env, serving
from tests.tasks_helpers import result_body
from tests.waits import HANG_S

pytestmark = pytest.mark.skipif(
    bool(os.environ.get("ORCH_TEST_DATABASE_URL")),
    reason="the embedded default (SQLite, in-process hot store): runs in the SQLite pass",
)

NODES = 4

# A worker's result upload whose link died mid-body: the head and the first bytes of a body that
# never comes, on a connection that stays open (no FIN or RST reaches the server).
STALLED_UPLOAD = (
    b"POST /v1/assignments/claim HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"
)


def _log_lines(log: str) -> list[dict[str, Any]]:
    """The service's JSON lines in ``log`` (uvicorn's own lines and tracebacks are plain text)."""
    return [json.loads(line) for line in log.splitlines() if line.startswith("{")]


def _admin_headers(cwd: Path, env: dict[str, str]) -> dict[str, str]:
    made = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "admin", "create-token", "--role", "admin", "--name", "t"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
        check=True,
    )
    return {"Authorization": f"Bearer {made.stdout.strip().splitlines()[-1]}"}


def _pool(base: str, headers: dict[str, str], tasks: int) -> str:
    with httpx.Client(base_url=base, headers=headers, timeout=HANG_S) as http:
        r = http.post(
            "/v1/admin/pools",
            json={
                "name": "stop",
                "economics": {"reward_per_sample": 5},
                "policy": {"max_leases_per_node": 4},
            },
        )
        assert r.status_code == 201, r.text
        pool_id = str(r.json()["id"])
        assert http.post(f"/v1/admin/pools/{pool_id}/activate").status_code == 200
        policy = {"step": 1, "uri": "s3://ckpt/1", "sha256": "b" * 64, "size": 10}
        assert http.post(f"/v1/admin/pools/{pool_id}/policies", json=policy).status_code == 201
        batch = {"batch_key": "stop", "tasks": arithmetic_tasks(tasks, seed=7)}
        r = http.post(f"/v1/admin/pools/{pool_id}/tasks", json=batch)
        assert r.status_code == 201, r.text
    return pool_id


async def _load_then_sigterm(
    base: str, pool_id: str, server: subprocess.Popen[bytes]
) -> tuple[list[str], float | None]:
    """Nodes claim and submit until the server has exited; SIGTERM once they have had 20 results
    accepted, with an upload stalled mid-body. The assignments answered 201, and how long the
    server took to exit (None: not within ``HANG_S``)."""
    accepted: list[str] = []
    errors: list[str] = []
    stop = asyncio.Event()
    clients = [
        WorkerClient(base, SigningKey.generate(), SigningKey.generate(), max_retries=0) for _ in range(NODES)
    ]
    for client in clients:
        await client.register(GPU_SPECS, "test")
        await client.join(pool_id)
        await client.heartbeat()

    async def work(client: WorkerClient) -> None:
        while not stop.is_set():
            try:
                claimed = await client.claim(pool_id, stop=stop)
                if not claimed.leases:
                    errors.append(f"no lease: {claimed.reason}")
                    await asyncio.sleep(0.05)
                for lease in claimed.leases:
                    result = ResultIn.model_validate(result_body(lease.model_dump(mode="json")))
                    await client.submit(lease, result, stop=stop)
                    accepted.append(lease.assignment_id)  # answered 201
            except Exception as exc:  # refused, or the server is going: go on until it has exited
                errors.append(repr(exc))
                await asyncio.sleep(0.05)

    workers = [asyncio.create_task(work(c)) for c in clients]
    host, port = base.removeprefix("http://").rsplit(":", 1)
    stalled = socket.create_connection((host, int(port)))
    try:
        started = asyncio.get_running_loop().time()
        while len(accepted) < 20:
            assert asyncio.get_running_loop().time() - started < HANG_S, errors[-5:]
            await asyncio.sleep(0.05)
        stalled.sendall(STALLED_UPLOAD)
        await asyncio.sleep(2)  # its head read: a request under way, waiting for its body
        loop = asyncio.get_running_loop()
        sent = loop.time()
        server.send_signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(server.wait, HANG_S)
            took: float | None = loop.time() - sent
        except subprocess.TimeoutExpired:
            took = None
    finally:
        stop.set()
        await asyncio.gather(*workers)
        stalled.close()
        for client in clients:
            await client.aclose()
    return accepted, took


@pytest.mark.timeout(4 * HANG_S)
def test_sigterm_under_load_stops_the_server_promptly_and_keeps_every_accepted_result(tmp_path: Path) -> None:
    env = embedded_env(ORCH_LOG_LEVEL="INFO")  # the requests' lines
    with serving(tmp_path, env) as (server, port):
        base = f"http://127.0.0.1:{port}"
        pool_id = _pool(base, _admin_headers(tmp_path, env), tasks=2000)
        accepted, took = asyncio.run(_load_then_sigterm(base, pool_id, server))
    log = (tmp_path / "serve.log").read_text()
    # Within the requests' grace (5 s) and the loops' (5 s) at most, usually about a second; the
    # stalled upload held the old server for as long as its connection lived.
    assert took is not None, f"the server had not exited {HANG_S:g} s after SIGTERM\n{log[-3000:]}"
    assert "timeout graceful shutdown exceeded" in log  # the stalled upload was cancelled
    # ... and is logged (and counted in orchestrator_http_requests_total) as 499, not as a 500,
    # which would count against the 5xx alert at every deploy: no answer was sent.
    requests = [line for line in _log_lines(log) if line["event"] == "request"]
    cancelled = [r["status"] for r in requests if r.get("cancelled")]
    assert cancelled and set(cancelled) == {499}, [r for r in requests if r["status"] >= 499]
    assert not [r for r in requests if r["status"] == 500]
    with sqlite3.connect(tmp_path / "orchestrator.db") as db:
        stored = {row[0] for row in db.execute("SELECT assignment_id FROM submissions")}
    assert len(accepted) >= 20
    assert set(accepted) <= stored


@pytest.mark.timeout(4 * HANG_S)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_server_stops_promptly_while_another_process_holds_the_write_lock(
    tmp_path: Path, sig: signal.Signals
) -> None:
    """Another process (the ``sqlite3`` shell, an ``orchestrator admin`` command) holds the
    database's write lock, a write request and the loops' ticks wait for it, and the server is
    stopped: it exits within its graces while the lock is still held. Before, the cancelled
    request's and ticks' rollbacks waited behind SQLite's busy wait (30 s), and the process with
    them (measured: 33 s after SIGTERM; with SIGINT, asyncio's last cancellation could then wait
    for good)."""
    env = embedded_env(ORCH_LOG_LEVEL="WARNING")
    answers: list[object] = []
    with serving(tmp_path, env) as (server, port):
        headers = _admin_headers(tmp_path, env)
        outside = sqlite3.connect(tmp_path / "orchestrator.db", isolation_level=None)
        outside.execute("BEGIN IMMEDIATE")

        def create_pool() -> None:
            body = {"name": "locked", "economics": {"reward_per_sample": 5}}
            try:
                url = f"http://127.0.0.1:{port}/v1/admin/pools"
                answers.append(httpx.post(url, headers=headers, json=body, timeout=HANG_S).status_code)
            except httpx.HTTPError as exc:  # the server went before answering
                answers.append(repr(exc))

        request = threading.Thread(target=create_pool)
        request.start()
        time.sleep(0.5)  # under way (it waits for the lock for the whole of the server's grace)
        server.send_signal(sig)
        try:
            # The requests' grace (5 s), the loops' (5 s) and 1 s for what they cancelled, and
            # well under the busy timeout (30 s) that ended the old server's wait.
            server.wait(20)
            exited = True
        except subprocess.TimeoutExpired:
            exited = False
        outside.execute("ROLLBACK")
        outside.close()
        request.join(HANG_S)
    log = (tmp_path / "serve.log").read_text()
    assert exited, f"the server was still running 20 s after {sig.name}\n{log[-3000:]}"
    # Its cleanup done, what was left only waited for the lock: ended, and a clean stop (0).
    forced = [line for line in _log_lines(log) if line["event"] == "exit_forced"]
    assert [(f["cleanup_done"], f["status"]) for f in forced] == [(True, 0)], log[-3000:]
    assert server.returncode == 0
    assert answers and answers[0] != 201, answers
    with sqlite3.connect(tmp_path / "orchestrator.db") as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        assert db.execute("SELECT count(*) FROM pools").fetchone() == (0,)  # it never began


# Run in the server's process at start (Python imports ``sitecustomize`` from its path): an exit
# that takes a while after the service's own stop is done, as a library's atexit handler or a
# thread still finishing can make it.
SLOW_EXIT = """
import atexit, time
atexit.register(time.sleep, 3)
"""


@pytest.mark.timeout(4 * HANG_S)
def test_a_server_whose_exit_is_merely_slow_is_not_cut_short_and_exits_0(tmp_path: Path) -> None:
    """Stopped with nothing stuck, the server's own cleanup is done at once, and the rest of its
    exit (here an atexit handler) takes 3 s: it is let finish, and the exit status is 0. Before,
    the process was ended 1 s after its cleanup whatever was still running (``exit_forced``,
    "tasks still waiting after the stop"), with status 1, as if something had hung."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SLOW_EXIT)
    path = os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH", "")) if p)
    env = embedded_env(ORCH_LOG_LEVEL="WARNING", PYTHONPATH=path)
    with serving(tmp_path, env) as (server, _port):
        server.send_signal(signal.SIGINT)  # SIGTERM ends uvicorn with the signal: no atexit
        server.wait(HANG_S)
    log = (tmp_path / "serve.log").read_text()
    assert "exit_forced" not in log, log[-3000:]
    assert server.returncode == 0, log[-3000:]


# A process whose stop hangs in its cleanup (a database or Redis that stopped answering): the
# guard, armed as a stop's cleanup starts, must end it. With "stalled", its stdout, where the log
# goes, is a pipe nobody reads: a thread's write has filled it and blocks there, holding the
# stream's lock, as a process logging to a hung log shipper does.
HUNG_CLEANUP = """
import sys, threading, time
from orchestrator.core.logging import configure_logging
from orchestrator.core.loops import ExitGuard

configure_logging("WARNING", json=True)
if sys.argv[1] == "stalled":
    def flood():
        while True:
            sys.stdout.write("x" * 65536 + "\\n")
            sys.stdout.flush()
    threading.Thread(target=flood, daemon=True).start()
    time.sleep(0.5)
ExitGuard(0.5)
time.sleep(60)
"""


@pytest.mark.parametrize("stdout", ["read", "stalled"])
def test_a_stop_whose_cleanup_hangs_is_ended_with_status_1_even_with_its_log_stalled(
    tmp_path: Path, stdout: str
) -> None:
    """The guard's forced exit with the cleanup not done: status 1 (something the stop needs
    hung), within the guard's bound, with an ``exit_forced`` line saying so. With stdout stalled
    the guard's own log line blocked for good, and the process with it (it never exited); now the
    line gets a second, then the process ends all the same, the line on stderr instead."""
    out = tmp_path / "stdout"
    err = tmp_path / "stderr"
    with out.open("wb") as out_file, err.open("wb") as err_file:
        proc = subprocess.Popen(
            [sys.executable, "-c", HUNG_CLEANUP, stdout],
            stdout=subprocess.PIPE if stdout == "stalled" else out_file,
            stderr=err_file,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        began = time.monotonic()
        try:
            status = proc.wait(8)
        except subprocess.TimeoutExpired:
            status = None
        finally:
            proc.kill()
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
    took = time.monotonic() - began
    said = _log_lines(out.read_text() if stdout == "read" else err.read_text())
    assert status == 1, (status, err.read_text()[-2000:])
    assert took < 5, took
    forced = [line for line in said if line["event"] == "exit_forced"]
    assert [(f["cleanup_done"], f["status"], f["reason"]) for f in forced] == [(False, 1, "stop_bound")]
    assert forced[0].get("log_blocked", False) is (stdout == "stalled")
