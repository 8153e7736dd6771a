"""``arithmetic``: a deterministic toy policy for the generated arithmetic problems.

It answers ``"What is 17 + 25?"`` (or ``problem_ref`` ``arith:17+25``) with a working line
and the answer on its own last line (``"17 + 25 = 42\\n42"``). With probability
``error_rate`` a sample's answer is off by 1 to 3; the draw is a hash of (seed, sample
index), so the same lease always gets the same samples. Tokens are whitespace-separated
words; a completion longer than ``max_tokens`` is cut there with finish reason ``length``.

Options: ``error_rate`` (0..1, default 0).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping

from api_schemas.tasks import LeasedTask, PolicyRef, Sample
from orchestrator.worker.backends.base import option_float
from orchestrator.worker.problems import parse_problem

OFFSETS = (-3, -2, -1, 1, 2, 3)
_TOKEN = re.compile(r"\S+")


def error_draw(seed: int, index: int) -> tuple[float, int]:
    """A uniform number in [0, 1) and an offset, both fixed by (seed, sample index)."""
    digest = hashlib.sha256(f"orchestrator/arithmetic/{seed}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64, OFFSETS[digest[8] % len(OFFSETS)]


def count_tokens(text: str) -> int:
    return len(text.split())


def truncate(text: str, max_tokens: int) -> tuple[str, int, str]:
    """(completion, completion tokens, finish reason) with at most ``max_tokens`` tokens."""
    tokens = list(_TOKEN.finditer(text))
    if len(tokens) <= max_tokens:
        return text, len(tokens), "stop"
    return text[: tokens[max_tokens - 1].end()], max_tokens, "length"


class ArithmeticBackend:
    name = "arithmetic"

    def __init__(self, error_rate: float = 0.0) -> None:
        if not 0.0 <= error_rate <= 1.0:
            raise ValueError("error_rate must be between 0 and 1")
        self.error_rate = error_rate

    @classmethod
    def from_options(cls, options: Mapping[str, str]) -> ArithmeticBackend:
        unknown = set(options) - {"error_rate"}
        if unknown:
            raise ValueError(f"unknown arithmetic backend options: {', '.join(sorted(unknown))}")
        return cls(error_rate=option_float(options, "error_rate", 0.0))

    def completion(self, task: LeasedTask, seed: int, index: int) -> str:
        problem = parse_problem(task.prompt, task.problem_ref)
        if problem is None:
            return "I cannot read an arithmetic problem here.\nunknown"
        answer = problem.answer
        u, offset = error_draw(seed, index)
        if u < self.error_rate:
            answer += offset
        return f"{problem.a} {problem.op} {problem.b} = {answer}\n{answer}"

    async def generate(self, task: LeasedTask, seed: int, policy: PolicyRef) -> list[Sample]:
        prompt_tokens = count_tokens(task.prompt or task.problem_ref or "")
        samples = []
        for index in range(task.sampling.n):
            text, tokens, finish = truncate(self.completion(task, seed, index), task.sampling.max_tokens)
            samples.append(
                Sample(
                    completion=text,
                    finish_reason=finish,
                    prompt_tokens=prompt_tokens,
                    completion_tokens=tokens,
                )
            )
        return samples
