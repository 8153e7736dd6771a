"""With the in-process hot store, one process only serves a database: a second one (another
``orchestrator serve``, a second uvicorn worker) refuses to start instead of keeping nonces,
liveness and rate limits of its own, which would let it accept a replay of a signed request
the first process had already accepted."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from asgi_lifespan import LifespanManager

from orchestrator.app import create_app
from orchestrator.core.instance_lock import InstanceLocked
from orchestrator.core.migrate import upgrade
from orchestrator.settings import RedisSettings, Settings
from tests.process_helpers import free_port, wait_ready


def in_process_store(settings: Settings) -> Settings:
    """The same settings without Redis: the app makes its own in-process store."""
    return settings.model_copy(update={"redis": RedisSettings(url=None)})


async def test_a_second_app_on_the_same_database_refuses_until_the_first_stops(settings: Settings) -> None:
    alone = in_process_store(settings)
    first = create_app(alone)
    async with LifespanManager(first):
        with pytest.raises(InstanceLocked, match="ORCH_REDIS__URL"):
            async with LifespanManager(create_app(alone)):
                pass
        # The first one is unaffected by the refused start.
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=first), base_url="http://t") as c:
            assert (await c.get("/readyz")).status_code == 200
    # Stopped: the lock is free again.
    async with LifespanManager(create_app(alone)):
        pass


async def test_a_shared_store_lets_processes_serve_together(settings: Settings, hot_store: Any) -> None:
    async with LifespanManager(create_app(settings, hot_store=hot_store)):
        async with LifespanManager(create_app(settings, hot_store=hot_store)):
            pass


def _serve(db: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORCH_")}
    env |= {"ORCH_DB__URL": f"sqlite+aiosqlite:///{db}", "ORCH_SERVER__MIGRATE_ON_START": "false"}
    cmd = [sys.executable, "-m", "orchestrator.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    with log.open("wb") as out:  # the child has its own copy of the descriptor
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)


def test_a_second_serve_on_the_same_sqlite_file_exits_with_the_reason(tmp_path: Path) -> None:
    db = tmp_path / "one.db"
    upgrade(f"sqlite+aiosqlite:///{db}")
    port = free_port()
    first = _serve(db, port, tmp_path / "first.log")
    try:
        wait_ready(port, first)
        second = _serve(db, free_port(), tmp_path / "second.log")
        try:
            code = second.wait(timeout=30)
        finally:
            second.kill()
            second.wait()
        output = (tmp_path / "second.log").read_text()
        # One line and exit 2, as for a database that cannot be used: it was uvicorn's ~90-line
        # traceback of the lifespan (exit 3), the reason on its last lines.
        assert code == 2, (code, output)
        lines = output.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in output, output
        assert "another orchestrator process already serves this database" in lines[0]
        assert "ORCH_REDIS__URL" in lines[0]
        assert httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5).status_code == 200
    finally:
        first.terminate()
        first.wait(timeout=30)
    # Once the first has stopped, a new one starts.
    port = free_port()
    again = _serve(db, port, tmp_path / "again.log")
    try:
        wait_ready(port, again)
    finally:
        again.terminate()
        again.wait(timeout=30)
