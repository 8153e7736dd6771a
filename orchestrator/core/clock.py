"""Time, injectable so tests can move it."""

from __future__ import annotations

import datetime as dt
import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds since the epoch."""

    def utcnow(self) -> dt.datetime: ...


class SystemClock:
    def now(self) -> float:
        return time.time()

    def utcnow(self) -> dt.datetime:
        return dt.datetime.now(dt.UTC)


class FakeClock:
    """A clock that only moves when told to."""

    def __init__(self, start: float | None = None) -> None:
        self._now = time.time() if start is None else start

    def now(self) -> float:
        return self._now

    def utcnow(self) -> dt.datetime:
        return dt.datetime.fromtimestamp(self._now, dt.UTC)

    def advance(self, seconds: float) -> None:
        self._now += seconds
