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
