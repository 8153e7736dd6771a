"""A liveness file for processes that serve no HTTP (``orchestrator background``).

The process's event loop rewrites the file with the time; a probe (``orchestrator alive``)
reads it. This module imports nothing of the application, so the probe starts fast.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from pathlib import Path

import structlog

__all__ = ["ALIVE_INTERVAL_S", "alive_age", "keep_alive"]

# How often ``keep_alive`` rewrites the file; a probe allows several missed writes.
ALIVE_INTERVAL_S = 5.0

log = structlog.get_logger(__name__)


async def keep_alive(path: Path, stop: asyncio.Event, interval: float = ALIVE_INTERVAL_S) -> None:
    """Write the time to ``path`` every ``interval`` seconds from this event loop, so that a
    liveness probe sees a blocked event loop or a dead process (not a database outage: the loops
    only log those) as a file that stops changing. The write is a rename, so a probe never reads
    half a file. A failed write is logged and retried: the file goes stale and the probe fails."""
    failing = False
    try:
        while not stop.is_set():
            try:
                _write_alive(path)
                failing = False
            except OSError as exc:
                if not failing:
                    log.error("alive_file_unwritable", path=str(path), error=str(exc))
                failing = True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=interval)
    finally:
        with contextlib.suppress(OSError):  # stopped: no longer alive
            path.unlink(missing_ok=True)  # noqa: ASYNC240


def _write_alive(path: Path) -> None:
    # A few bytes on a local file: cheaper than handing them to a thread.
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    partial.write_text(f"{time.time():.3f}\n")
    partial.replace(path)


def alive_age(path: Path, now: float | None = None) -> float | None:
    """Seconds since ``keep_alive`` last wrote ``path``; None if it never did."""
    try:
        written = float(path.read_text().strip())
    except (OSError, ValueError):
        return None
    return (time.time() if now is None else now) - written
