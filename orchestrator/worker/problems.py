"""Generated arithmetic problems: the toy workload of the ``arithmetic`` backend and the demo.

A problem is a prompt ``"What is 17 + 25?"`` or a ``problem_ref`` ``"arith:17+25"``, with
the operators ``+``, ``-`` and ``*``. ``arithmetic_tasks`` makes task dicts for the enqueue
API (``POST /v1/admin/pools/{id}/tasks``) whose hidden verification spec holds the answer,
which the server's ``exact_match`` reward compares with a completion's last line.
"""

from __future__ import annotations

import operator
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

OPERATORS: dict[str, Callable[[int, int], int]] = {"+": operator.add, "-": operator.sub, "*": operator.mul}
REF_PREFIX = "arith:"
_IN_TEXT = re.compile(r"(-?\d{1,18})\s*([-+*])\s*(-?\d{1,18})")


@dataclass(frozen=True)
class Problem:
    a: int
    op: str
    b: int

    @property
    def answer(self) -> int:
        return OPERATORS[self.op](self.a, self.b)

    @property
    def prompt(self) -> str:
        return f"What is {self.a} {self.op} {self.b}?"

    @property
    def ref(self) -> str:
        return f"{REF_PREFIX}{self.a}{self.op}{self.b}"


def parse_problem(prompt: str | None = None, problem_ref: str | None = None) -> Problem | None:
    """The problem in a prompt (the first ``a op b`` in it) or a ``arith:a op b`` reference;
    ``None`` if there is none."""
    if problem_ref is not None:
        if not problem_ref.startswith(REF_PREFIX):
            return None
        match = _IN_TEXT.fullmatch(problem_ref[len(REF_PREFIX) :].strip())
    elif prompt is not None:
        match = _IN_TEXT.search(prompt)
    else:
        return None
    if match is None:
        return None
    return Problem(int(match.group(1)), match.group(2), int(match.group(3)))


def arithmetic_tasks(
    count: int,
    seed: int,
    *,
    n: int = 1,
    max_tokens: int = 32,
    temperature: float = 1.0,
    as_ref: bool = False,
    max_operand: int = 99,
) -> list[dict[str, Any]]:
    """``count`` task dicts for the enqueue API, the same for the same ``seed``.

    Each is ``{"prompt": "What is a op b?", "sampling": {...}, "verification": {"answer":
    "..."}}`` (``"problem_ref": "arith:a op b"`` instead of the prompt when ``as_ref``).
    """
    if count < 0:
        raise ValueError("count must be >= 0")
    rng = random.Random(seed)  # noqa: S311 - reproducible workload, not a secret
    ops = sorted(OPERATORS)
    tasks: list[dict[str, Any]] = []
    for _ in range(count):
        problem = Problem(rng.randint(1, max_operand), rng.choice(ops), rng.randint(1, max_operand))
        task: dict[str, Any] = {"problem_ref": problem.ref} if as_ref else {"prompt": problem.prompt}
        task["sampling"] = {"temperature": temperature, "top_p": 1.0, "max_tokens": max_tokens, "n": n}
        task["verification"] = {"answer": str(problem.answer)}
        tasks.append(task)
    return tasks
