"""Seeds the coordinator assigns to each replica: HMAC-SHA256 of a server secret, the task and
the replica, so workers can neither predict nor choose them, and the server can recompute them."""

from __future__ import annotations

import hashlib
import hmac

SEED_CONTEXT = b"orchestrator/v1/seed:"


#: Seeds are below 2^53: every JSON parser reads them exactly (RFC 8259, section 6), also one
#: that reads numbers as doubles (JavaScript's JSON.parse, Go's into an interface{}). A 63-bit
#: seed came back from such a client rounded, and a result echoing it was judged fraud
#: (``seed_mismatch``), for every result the client sent.
SEED_BITS = 53


def derive_seed(secret: bytes, task_id: int, replica_index: int) -> int:
    """A seed in [0, 2^53), from the first bytes of the HMAC."""
    message = SEED_CONTEXT + f"{task_id}:{replica_index}".encode()
    digest = hmac.new(secret, message, hashlib.sha256).digest()
    return int.from_bytes(digest[:8], "big") >> (64 - SEED_BITS)
