"""``orchestrator serve --workers N``: the worker processes end with the process that started them."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.conftest import REDIS_URL
from tests.process_helpers import embedded_env, serving

pytestmark = pytest.mark.skipif(
    not REDIS_URL,
    reason="needs Redis (set ORCH_TEST_REDIS_URL): several workers share one hot store; runs in the "
    "PostgreSQL + Redis CI pass",
)


def _workers_of(pid: int) -> list[int]:
    """The uvicorn worker processes ``pid`` started (multiprocessing children running
    ``spawn_main``; not its resource tracker)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == pid and b"spawn_main" in cmdline:
            found.append(int(entry.name))
    return found


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan may wait a while for whoever adopts it to reap it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _answers(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_the_workers_end_when_serve_is_killed(tmp_path: Path) -> None:
    """A SIGKILL of `serve --workers 2` (an OOM kill, a supervisor that kills only the process it
    started) left both workers running, still serving the port: a restart then found the port in
    use. The workers now get a SIGTERM when the process that started them dies, and stop."""
    env = embedded_env(
        ORCH_DB__URL=f"sqlite+aiosqlite:///{tmp_path / 'orchestrator.db'}",
        ORCH_REDIS__URL=REDIS_URL or "",
        ORCH_REDIS__PREFIX=f"t{uuid.uuid4().hex[:12]}:",
        ORCH_SERVER__BACKGROUND_LOOPS="false",
        ORCH_LOG_LEVEL="WARNING",
    )
    log = tmp_path / "serve.log"
    workers: list[int] = []
    try:
        with serving(tmp_path, env, "--workers", "2") as (server, port):
            deadline = time.monotonic() + 30
            while len(workers := _workers_of(server.pid)) < 2 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert len(workers) == 2, (workers, log.read_text())
            server.send_signal(signal.SIGKILL)
            server.wait(timeout=10)
            deadline = time.monotonic() + 20
            while any(_running(pid) for pid in workers) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert not [pid for pid in workers if _running(pid)], log.read_text()
            assert not _answers(port)
    finally:
        for pid in workers:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


# Imported by every Python process started with its folder on PYTHONPATH: a uvicorn worker (a
# multiprocessing child running ``spawn_main``) takes this long to start, as its imports take on
# a busy host or under a container's CPU limit.
_SLOW_START = """
from pathlib import Path
import time

if b"spawn_main" in Path("/proc/self/cmdline").read_bytes():
    time.sleep({delay})
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_slow_to_start_are_not_killed_as_hung(tmp_path: Path) -> None:
    """uvicorn's supervisor pings each worker every half second and kills one that has not
    answered within its health-check timeout (5 s by default), taking it for hung, then starts
    another. A worker still starting has not answered yet: on a busy host (its imports took
    6 s here at a load of 20) or under a container's CPU limit, `serve --workers 2` killed its own
    workers as they started ("Child process [...] died"), at every start and after every crash,
    and with starts slower than the timeout it never served at all."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_SLOW_START.format(delay=7))
    env = embedded_env(
        ORCH_DB__URL=f"sqlite+aiosqlite:///{tmp_path / 'orchestrator.db'}",
        ORCH_REDIS__URL=REDIS_URL or "",
        ORCH_REDIS__PREFIX=f"t{uuid.uuid4().hex[:12]}:",
        ORCH_SERVER__BACKGROUND_LOOPS="false",
        ORCH_LOG_LEVEL="INFO",  # uvicorn says a worker "died" at INFO
        PYTHONPATH=os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])]),
    )
    log = tmp_path / "serve.log"
    with serving(tmp_path, env, "--workers", "2", timeout=60) as (server, _port):
        first = sorted(_workers_of(server.pid))
        time.sleep(2)
        assert "died" not in log.read_text(), log.read_text()
        assert sorted(_workers_of(server.pid)) == first and len(first) == 2, log.read_text()
