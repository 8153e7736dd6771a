"""A reward function whose scoring takes exactly as long as a test wants: ``gated``.

Tests that check what goes on while a result is being scored (a write, a validator's verdict,
a stop) used to score an answer SymPy cannot finish and then measure, with sleeps and time
limits, that the other work did not wait; under load they failed, or passed without the
scoring having begun. A result whose verification spec names a ``gate`` is scored by ``gated``
only once the test opens the gate, and the scoring process says when it has begun: the test
waits for that, does its work while the scoring is still held, and checks the work is done
before it opens the gate. Work that waited for the scoring would never be done meanwhile.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.waits import HANG_S

#: How long a held scoring process waits for its gate before it gives up (a test that failed).
HOLD_S = 300.0


@dataclass(frozen=True)
class Gated:
    """Full reward for a completion that ends with ``spec['answer']``. With ``spec['gate']``,
    only once that file exists; its scoring process first adds a line to ``spec['started']``."""

    name: str = "gated"

    def canonical(self, completion: str) -> str:
        return completion.strip()

    def reward(self, completion: str, spec: Mapping[str, Any]) -> float | None:
        if "gate" in spec:
            with Path(spec["started"]).open("a") as started:
                started.write("scoring\n")
            gate, until = Path(spec["gate"]), time.monotonic() + HOLD_S
            while not gate.exists() and time.monotonic() < until:
                time.sleep(0.01)
        return 1.0 if completion.strip().endswith(str(spec["answer"])) else 0.0


@dataclass
class Gate:
    """The gate of the results a test holds in scoring (see :class:`Gated`)."""

    directory: Path

    @property
    def spec(self) -> dict[str, str]:
        """What to add to a task's verification spec for its result to be held."""
        return {"gate": str(self.directory / "open"), "started": str(self.directory / "started")}

    async def scoring_started(self) -> None:
        """Wait until a held result's scoring process has begun scoring it."""
        started, until = self.directory / "started", time.monotonic() + HANG_S
        while not started.exists():
            assert time.monotonic() < until, "the held result's scoring never began"
            await asyncio.sleep(0.02)

    def open(self) -> None:
        (self.directory / "open").touch()
