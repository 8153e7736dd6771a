"""Cheap checks run on every result: the result's shape against the task and the lease.

Each failed check is a ``Finding`` with a stable reason code and a category: ``invalid``
(an honest failure: no reward, no slash) or ``fraud`` (a lie the worker had to tell on
purpose: slashed). A seed other than the one assigned is fraud: the worker chose its own.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

VALID_FINISH_REASONS = frozenset({"stop", "length"})
REWARD_TOLERANCE = 1e-6


@dataclass(frozen=True)
class Finding:
    code: str
    category: str  # "invalid" | "fraud" | "inconclusive" (the server could not score it)
    detail: str


@dataclass(frozen=True)
class Expectations:
    seed: int
    n: int
    max_tokens: int
    current_step: int
    max_async_level: int
    require_proof: bool


def sanity(result: Mapping[str, Any], expect: Expectations) -> list[Finding]:
    found: list[Finding] = []
    if result.get("seed") != expect.seed:
        found.append(
            Finding(
                "seed_mismatch",
                "fraud",
                f"echoed seed {result.get('seed')} is not the assigned {expect.seed}",
            )
        )
    samples: Sequence[Mapping[str, Any]] = result.get("samples") or []
    if len(samples) != expect.n:
        found.append(
            Finding("sample_count", "invalid", f"{len(samples)} samples, the task asked for {expect.n}")
        )
    for i, sample in enumerate(samples):
        tokens = sample.get("completion_tokens", 0)
        if tokens > expect.max_tokens:
            found.append(
                Finding(
                    "token_overflow",
                    "invalid",
                    f"sample {i}: {tokens} completion tokens > max_tokens {expect.max_tokens}",
                )
            )
        if sample.get("finish_reason") not in VALID_FINISH_REASONS:
            found.append(
                Finding(
                    "finish_reason",
                    "invalid",
                    f"sample {i}: finish reason {sample.get('finish_reason')!r} is not stop or length",
                )
            )
        if sample.get("finish_reason") == "length" and tokens < expect.max_tokens:
            found.append(
                Finding(
                    "finish_reason",
                    "invalid",
                    f"sample {i}: 'length' with {tokens} < max_tokens {expect.max_tokens} tokens",
                )
            )
        if not isinstance(sample.get("completion"), str):
            # Sent as token_ids alone: not graded as "", as the server has no tokenizer to read
            # them with, and not left unscored, which would pay it unchecked.
            found.append(
                Finding(
                    "completion_missing",
                    "invalid",
                    f"sample {i} has no completion text (the server grades text; it has no tokenizer "
                    "for token_ids)",
                )
            )
    step = result.get("policy_step", -1)
    if step < expect.current_step - expect.max_async_level or step > expect.current_step:
        found.append(
            Finding(
                "policy_stale",
                "invalid",
                f"policy step {step} is outside [{expect.current_step - expect.max_async_level}, "
                f"{expect.current_step}]",
            )
        )
    if expect.require_proof and not result.get("proof"):
        found.append(Finding("proof_missing", "invalid", "the pool requires a proof with every result"))
    claimed = result.get("claimed_reward")
    if claimed is not None and (
        not isinstance(claimed, int | float) or not math.isfinite(claimed) or not 0.0 <= claimed <= 1.0
    ):
        found.append(Finding("claim_out_of_bounds", "fraud", f"claimed reward {claimed!r} is outside [0, 1]"))
    return found


def forged_claim(claimed: float | None, server_reward: float | None) -> Finding | None:
    """A claimed reward above the server's own is a fraud signal. One below it is not: it gains
    the worker nothing (the server pays by its own reward), and an honest worker whose own
    grader is stricter than the pool's (an exact match where the pool reads math) claims less
    than the server finds for a right answer."""
    if claimed is None or server_reward is None:
        return None
    if claimed - server_reward > REWARD_TOLERANCE:
        return Finding(
            "reward_forged", "fraud", f"claimed reward {claimed} but the server computed {server_reward}"
        )
    return None
