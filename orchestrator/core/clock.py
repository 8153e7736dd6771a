"""Time, injectable so tests can move it."""

from __future__ import annotations

import datetime as dt
import time
from typing import Protocol

# Past this difference from a server's clock (the database's, Redis's) a process says so.
CLOCK_SKEW_WARN_S = 5.0


class Clock(Protocol):
    def now(self) -> float:
        """Seconds since the epoch."""

    def utcnow(self) -> dt.datetime: ...

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back, for how long work took: a tick's time
        budget is measured on it."""


class SystemClock:
    def now(self) -> float:
        return time.time()

    def utcnow(self) -> dt.datetime:
        return dt.datetime.now(dt.UTC)

    def monotonic(self) -> float:
        return time.monotonic()


class FakeClock:
    """A clock that only moves when told to: work takes no time on it, so a tick's budget runs
    out only when a test moves the clock while the tick works."""

    def __init__(self, start: float | None = None) -> None:
        self._now = time.time() if start is None else start

    def now(self) -> float:
        return self._now

    def utcnow(self) -> dt.datetime:
        return dt.datetime.fromtimestamp(self._now, dt.UTC)

    def monotonic(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += seconds
