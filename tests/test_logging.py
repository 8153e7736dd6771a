"""structlog output: JSON lines by default; ORCH_LOG_JSON=false renders for people."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import structlog

from orchestrator.core.logging import configure_logging


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    yield
    configure_logging("INFO", json=True)  # what create_app sets by default


def test_json_lines_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("INFO", json=True)
    structlog.get_logger("t").info("started", db="sqlite", token="orch_x")
    line = json.loads(capsys.readouterr().out)
    assert line["event"] == "started" and line["db"] == "sqlite" and line["token"] == "[redacted]"


def test_console_lines_carry_no_colour_codes_when_stdout_is_not_a_terminal(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """With ORCH_LOG_JSON=false and stdout redirected to a file or a pipe (a service's log), every
    line was wrapped in ANSI colour escapes ('\\x1b[2m2026-...\\x1b[0m [\\x1b[32m\\x1b[1minfo')."""
    configure_logging("INFO", json=False)
    structlog.get_logger("t").info("started", db="sqlite")
    out = capsys.readouterr().out
    assert "started" in out and "db=sqlite" in out
    assert "\x1b[" not in out, repr(out)


_A_PROCESS_THAT_LOGS = """
import structlog
from orchestrator.core.logging import configure_logging
configure_logging("INFO", json=True)
log = structlog.get_logger("t")
for i in range(3000):
    log.info("request", route="/v1/assignments/{assignment_id}/result", status=201, i=i)
"""


def test_processes_sharing_stdout_write_whole_lines() -> None:
    """The workers of ``serve --workers N`` share one stdout (a container's log pipe), and the
    image runs Python unbuffered (PYTHONUNBUFFERED=1). structlog's PrintLogger wrote each record
    and its newline as two writes, so another worker's record could come between them: two
    records on one line and an empty one after, which a log shipper cannot read as JSON (in a
    25-minute soak with two workers, 14 such lines; each lost both records). Each record is
    now one write with its newline."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    read, write = os.pipe()
    children = [
        subprocess.Popen([sys.executable, "-c", _A_PROCESS_THAT_LOGS], stdout=write, env=env)
        for _ in range(3)
    ]
    os.close(write)
    with os.fdopen(read) as pipe:
        lines = pipe.read().splitlines()
    for child in children:
        assert child.wait(timeout=120) == 0
    broken = []
    for line in lines:
        try:
            json.loads(line)
        except ValueError:
            broken.append(line)
    assert not broken and len(lines) == 9000, (len(broken), len(lines), broken[:2])
