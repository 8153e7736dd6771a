"""Rate limits counted in the hot store, so they hold across API processes."""

from __future__ import annotations

from orchestrator.core.errors import RateLimited
from orchestrator.core.state import AppState


async def enforce(
    state: AppState, bucket: str, *, limit: int, window_s: int, what: str | None = None
) -> None:
    """Count one request in ``bucket``; past ``limit`` in the window, 429 with ``Retry-After``
    and a detail saying what was counted (``what``: by default the bucket's kind)."""
    decision = await state.hot_store.hit(bucket, limit, window_s, state.clock.now())
    if not decision.allowed:
        counted = what or f"requests in {window_s} s for this {bucket.split(':', 1)[0]}"
        raise RateLimited(f"more than {limit} {counted}", retry_after=decision.retry_after_s)
