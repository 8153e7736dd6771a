"""The README's "Run a worker" walkthrough, run as a new user would: its shell blocks, against
`orchestrator serve` on the embedded default (SQLite, no Redis) in an empty directory.

The commands are the README's own, read from it at test time. The only changes are the ones a
reader makes: the server's address (a free port here), the venv's path, the placeholders filled
in from what earlier commands printed, and `--max-tasks 100` on the worker, which otherwise runs
until Ctrl-C. Runs in the SQLite pass (the walkthrough never touches PostgreSQL or Redis).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.process_helpers import embedded_env, serving

REPO_ROOT = Path(__file__).resolve().parents[1]
README_ADDRESS = "http://127.0.0.1:8000"

pytestmark = [
    pytest.mark.skipif(
        bool(os.environ.get("ORCH_TEST_DATABASE_URL")),
        reason="the walkthrough uses the embedded default: it runs in the SQLite pass",
    ),
    pytest.mark.skipif(shutil.which("curl") is None, reason="the walkthrough's commands use curl"),
]


def _section(title: str) -> str:
    readme = (REPO_ROOT / "README.md").read_text()
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## )", readme, flags=re.MULTILINE | re.DOTALL)
    assert match, f"README section {title!r}"
    return match.group(1)


def _bash_blocks(section: str) -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```", section, flags=re.MULTILINE | re.DOTALL)


def _commands(block: str) -> list[str]:
    """The block's commands: continuation lines joined, comments and blank lines dropped."""
    commands, current = [], ""
    for line in block.splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        current += line.rstrip("\\").rstrip() + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            commands.append(current.strip())
            current = ""
    assert not current, "a dangling line continuation"
    return commands


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """`orchestrator serve` in an empty directory, with no ORCH_* setting: the embedded default."""
    env = embedded_env()
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    with serving(tmp_path, env) as (_, port):
        yield f"http://127.0.0.1:{port}", env


def _as_reader_would(command: str, base: str) -> str:
    venv_bin = str(Path(sys.executable).parent) + "/"
    return command.replace(README_ADDRESS, base).replace(".venv/bin/", venv_bin)


def _run(script: str, cwd: Path, env: dict[str, str], timeout: float = 120) -> str:
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, f"{script}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
    return done.stdout


def test_the_run_a_worker_walkthrough_works_as_written(
    server: tuple[str, dict[str, str]], tmp_path: Path
) -> None:
    base, env = server
    operator, contributor = _bash_blocks(_section("Run a worker"))[:2]

    # The operator's block as one script (its commands share $T and $POOL); then what it made.
    out = _run(_as_reader_would(operator, base) + '\nprintf "\\n%s %s\\n" "$POOL" "$T"\n', tmp_path, env)
    pool_id, token = out.strip().splitlines()[-1].split()
    headers = {"Authorization": f"Bearer {token}"}
    pool = httpx.get(f"{base}/v1/admin/pools/{pool_id}", headers=headers).json()
    assert pool["status"] == "active"
    tasks = httpx.get(f"{base}/v1/admin/pools/{pool_id}/tasks", params={"limit": 500}, headers=headers)
    assert len(tasks.json()["items"]) == 100

    # The contributor's commands one by one, placeholders filled in as the reader would.
    commands = _commands(contributor)
    assert [c.split()[1:3] for c in commands if c.startswith(".venv/bin/orchestrator")] == [
        ["keys", "generate"],
        ["keys", "generate"],
        ["worker", "register"],
        ["worker", "run"],
    ]
    provider_id = node_id = None
    final: dict[str, object] = {}
    for command in commands:
        command = _as_reader_would(command, base)
        command = command.replace("<admin token>", token).replace("<pool_id>", pool_id)
        if "<provider_id>" in command:
            assert provider_id is not None, "the README uses the provider id before printing it"
            command = command.replace("<provider_id>", provider_id)
        if " worker run " in command:
            command += " --max-tasks 100"
        assert "<" not in command, f"an unfilled placeholder: {command}"
        out = _run(command, tmp_path, env, timeout=240)
        if " worker register " in command:
            provider_id, node_id = json.loads(out)["provider_id"], json.loads(out)["node_id"]
        if " worker run " in command:
            final = json.loads(out.strip().splitlines()[-1])

    # The worker leased, answered and submitted all 100 problems, and none was refused.
    assert final["claimed"] == 100 and final["submitted"] == 100, final
    assert final["errors"] == 0 and final["rejected"] == 0, final
    open_left = httpx.get(
        f"{base}/v1/admin/pools/{pool_id}/tasks", params={"status": "open"}, headers=headers
    ).json()
    assert open_left["items"] == []

    # "A machine stolen or compromised": the node's key revoked, then the machine back at work
    # with a new key in the same file, as the README's block does it.
    revocation = _commands(_bash_blocks(_section("Run a worker"))[3])
    assert [c.split()[1:3] for c in revocation] == [
        ["provider", "nodes"],
        ["provider", "revoke-node"],
        ["keys", "generate"],
        ["worker", "register"],
    ]
    outputs = []
    for command in revocation:
        command = _as_reader_would(command, base).replace("<node_id>", str(node_id))
        assert "<" not in command, f"an unfilled placeholder: {command}"
        outputs.append(_run(command, tmp_path, env))
    revoked = json.loads(outputs[1])
    assert revoked["id"] == node_id and revoked["status"] == "banned" and revoked["revoked_at"]
    assert revoked["ejected_from"] == [pool_id]
    again = json.loads(outputs[-1])
    assert again["provider_id"] == provider_id and again["node_id"] != node_id
