"""Seeds the coordinator assigns to each replica: HMAC-SHA256 of a server secret, the task and
the replica, so workers can neither predict nor choose them, and the server can recompute them."""

from __future__ import annotations

import hashlib
import hmac

SEED_CONTEXT = b"orchestrator/v1/seed:"


def derive_seed(secret: bytes, task_id: int, replica_index: int) -> int:
    """A 63-bit seed (fits a signed 64-bit column and every sampler's seed argument)."""
    message = SEED_CONTEXT + f"{task_id}:{replica_index}".encode()
    digest = hmac.new(secret, message, hashlib.sha256).digest()
    return int.from_bytes(digest[:8], "big") >> 1
