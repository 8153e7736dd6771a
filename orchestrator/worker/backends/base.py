"""What a rollout backend is: something that turns a leased task into samples.

A backend is built from string options (``--backend-opt key=value`` on the command line) by
a factory, and then asked to ``generate`` exactly ``task.sampling.n`` samples for a lease,
with the lease's seed and policy. It returns the samples, or a ``Generation``: the samples with
the result's proof (a pool with ``require_proof`` judges a result without one invalid; TOPLOC's
proofs, say) and the reward the backend claims for them. A backend that holds resources (an
HTTP client, a model) may also have ``async def aclose()``; the worker calls it when it stops.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from api_schemas.tasks import LeasedTask, PolicyRef, Sample
from orchestrator.worker.errors import BackendError

__all__ = ["Backend", "BackendError", "BackendFactory", "Generation", "option_float", "option_int"]


@dataclass(frozen=True)
class Generation:
    """A backend's samples with what the result may carry besides them: ``proof``, the raw
    bytes of a proof of the generation (sent as the result's base64 ``proof``; at most
    ``api_schemas.tasks.MAX_PROOF_BYTES``), and ``claimed_reward``, the mean reward over the
    samples by the backend's own grading, in [0, 1] (the server recomputes it; a claim above the
    server's is fraud; the worker sends none outside [0, 1], which the server judges fraud too,
    and releases the lease as the backend's failure instead)."""

    samples: list[Sample]
    proof: bytes | None = None
    claimed_reward: float | None = None


@runtime_checkable
class Backend(Protocol):
    @property
    def name(self) -> str: ...

    async def generate(self, task: LeasedTask, seed: int, policy: PolicyRef) -> list[Sample] | Generation:
        """Exactly ``task.sampling.n`` samples, alone or in a ``Generation`` with a proof and a
        claimed reward. Raise ``BackendError`` when the task cannot be run; the worker then
        gives the lease back."""
        ...


class BackendFactory(Protocol):
    """Builds a backend from its options; raises ``ValueError`` for a bad or missing one."""

    def __call__(self, options: Mapping[str, str]) -> Backend: ...


def option_float(options: Mapping[str, str], name: str, default: float) -> float:
    raw = options.get(name)
    if raw is None:
        return default
    try:
        return float(raw)
    except ValueError as exc:
        raise ValueError(f"backend option {name}={raw!r} is not a number") from exc


def option_int(options: Mapping[str, str], name: str, default: int | None) -> int | None:
    raw = options.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError as exc:
        raise ValueError(f"backend option {name}={raw!r} is not an integer") from exc
