"""Rate limits counted in the hot store, so they hold across API processes."""

from __future__ import annotations

from orchestrator.core.errors import RateLimited
from orchestrator.core.state import AppState


async def enforce(state: AppState, bucket: str, *, limit: int, window_s: int) -> None:
    decision = await state.hot_store.hit(bucket, limit, window_s, state.clock.now())
    if not decision.allowed:
        raise RateLimited(
            f"more than {limit} requests in {window_s} s for this {bucket.split(':', 1)[0]}",
            retry_after=decision.retry_after_s,
        )
