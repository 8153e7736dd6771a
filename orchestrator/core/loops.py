"""Background loops: run a tick at every interval boundary, once across all processes."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog

from orchestrator.core.state import AppState

log = structlog.get_logger(__name__)


async def run_periodically(
    state: AppState,
    name: str,
    interval_s: float,
    tick: Callable[[AppState], Awaitable[object]],
    stop: asyncio.Event,
) -> None:
    """Call ``tick(state)`` at each multiple of ``interval_s`` until ``stop`` is set.

    ``tick`` claims its own tick number (``core.ticks.claim_tick``); an error is logged and the
    loop goes on, so one bad tick never stops liveness or payouts.
    """
    while not stop.is_set():
        try:
            await tick(state)
        except Exception:
            log.exception("background_tick_failed", loop=name)
        delay = interval_s - (state.clock.now() % interval_s) + 0.05
        try:
            await asyncio.wait_for(stop.wait(), timeout=delay)
        except TimeoutError:
            pass
