"""Shared pieces of the tests that start real server processes: a free port, waiting for ready,
stopping."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(
    port: int, server: subprocess.Popen[bytes], timeout: float = 30, log: Path | None = None
) -> None:
    """Until ``/readyz`` answers 200; fails at once if the server exits (with its ``log``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert server.poll() is None, f"the server exited\n{log.read_text() if log else ''}"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("the server did not become ready")


def stop(server: subprocess.Popen[bytes], timeout: float = 30) -> None:
    """SIGTERM, then SIGKILL if it has not exited within ``timeout``."""
    server.terminate()
    try:
        server.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def embedded_env(**settings: str) -> dict[str, str]:
    """This process's environment without any ORCH_* setting (the embedded default), plus
    ``settings``."""
    return {k: v for k, v in os.environ.items() if not k.startswith("ORCH_")} | settings


@contextlib.contextmanager
def serving(
    tmp_path: Path, env: dict[str, str], *args: str, timeout: float = 60
) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """``orchestrator serve`` with ``args``, run by this interpreter in ``tmp_path`` on a free port,
    its output in ``tmp_path/serve.log``: ready when yielded, stopped afterwards."""
    port = free_port()
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "orchestrator.cli", "serve", "--port", str(port), *args],
            cwd=tmp_path,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_ready(port, server, timeout=timeout, log=log)
        yield server, port
    finally:
        stop(server)
