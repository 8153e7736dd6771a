"""``orchestrator background``: the loops in a process of their own, beside API processes that
run none (``ORCH_SERVER__BACKGROUND_LOOPS=false``, as the test app does)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from typer.testing import CliRunner

from orchestrator import background
from orchestrator.cli import app as cli
from orchestrator.settings import Settings
from tests.tasks_helpers import pool_setup, task
from tests.verification_helpers import submit, verdicts


async def test_a_background_process_verifies_what_an_api_process_accepted(
    app: Any, app_state: Any, settings: Settings
) -> None:
    async with pool_setup(app, app_state, workers=1) as s:
        await s.enqueue([task("What is 2+2?"), task("What is 3+3?")])
        w = s.workers[0]
        for answer in ("4", "5"):
            lease = (await w.claim(s.pool_id)).json()["leases"][0]
            await submit(w, lease, [answer])  # 201, checked by the helper
        assert await verdicts(s.admin, s.headers, s.pool_id) == []  # the API process runs no loop

        stop = asyncio.Event()
        runner = asyncio.create_task(background.run(settings, stop))
        try:
            deadline = time.monotonic() + 30
            decided: list[dict[str, Any]] = []
            while len(decided) < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
                decided = await verdicts(s.admin, s.headers, s.pool_id)
        finally:
            stop.set()
            await asyncio.wait_for(runner, timeout=30)
        assert sorted(v["outcome"] for v in decided) == ["accepted", "rejected"], decided


def test_the_command_refuses_to_run_without_a_shared_store_and_database() -> None:
    result = CliRunner().invoke(cli, ["background"], env={"ORCH_REDIS__URL": ""})
    assert result.exit_code == 2
    assert "ORCH_REDIS__URL" in result.output
    result = CliRunner().invoke(
        cli,
        ["background"],
        env={"ORCH_REDIS__URL": "redis://127.0.0.1:6379/0", "ORCH_DB__URL": "sqlite+aiosqlite:///x.db"},
    )
    assert result.exit_code == 2
    assert "PostgreSQL" in result.output
