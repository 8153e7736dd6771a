"""The task id a node is shown: an opaque reference of its own for each task, not the task's id.

Task ids are sequential, so a real one tells a node how old its task is: an audit replica,
added to a task answered long ago, would carry an id far below the fresh tasks' around it, and
a node that answered honestly only there would cheat everywhere else unseen. The reference is
HMAC-SHA256 of the server secret (the one seeds are derived with), the node and the task: the
same for a node each time it sees the task (a lease given back and leased again, the live lease
list, the result's answer, its verdict), different for another node, and in no order."""

from __future__ import annotations

import hashlib
import hmac

from orchestrator.tasks.seeds import SEED_BITS

TASK_REF_CONTEXT = b"orchestrator/v1/task-ref:"


def task_ref(secret: bytes, node_id: str, task_id: int) -> int:
    """The node's reference for the task: in [0, 2^53), like a seed, so that every JSON parser
    reads it exactly."""
    message = TASK_REF_CONTEXT + f"{node_id}:{task_id}".encode()
    digest = hmac.new(secret, message, hashlib.sha256).digest()
    return int.from_bytes(digest[:8], "big") >> (64 - SEED_BITS)
