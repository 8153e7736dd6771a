"""Reward functions the server runs itself (the worker's claimed reward is never trusted).

A reward function takes one completion and the task's hidden verification spec and returns a
reward in [0, 1], or ``None`` when the spec gives it nothing to check against. It also names
the completion's canonical answer, which quorum voting compares across replicas: as text, or,
for a reward function that defines ``equivalent`` (``math``), by that.

Built in: ``exact_match`` (the completion's last ``\\boxed{...}``, or else its last
non-empty line, equals ``spec["answer"]``, both normalised) and ``math`` (final-answer
equivalence of LaTeX / boxed answers with the ``math-verify`` package). Others are plugins:
an installed package declares an entry point in the group ``orchestrator.rewards`` whose
object is a ``RewardFunction``.

A reward function that needs a service which is down for a while (a code-execution sandbox,
say) raises ``RewardUnavailable``: the verifier tries the result again at later ticks, for up to
``ORCH_VERIFIER__REWARD_RETRY_S`` after the result arrived, and only then judges it
``inconclusive`` (``reward_unavailable``). Any other exception is the function's bug, the same
at every try: the result is ``inconclusive`` (``reward_invalid``) at once.
"""

from __future__ import annotations

import logging
import re
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from importlib.metadata import entry_points
from typing import Any, Protocol

ENTRY_POINT_GROUP = "orchestrator.rewards"
# Completions are cut to their tail before parsing: the final answer is at the end, and a
# bounded input bounds the parse time (math-verify's own timeouts need the main thread).
MAX_PARSE_CHARS = 4000
logging.getLogger("math_verify").setLevel(logging.ERROR)
_BOXED_OPEN = re.compile(r"\\boxed\{")
# A gold answer already in math mode; any other (``\sqrt{2}``, ``2\sqrt{2}``, ``0.5``) is
# wrapped in ``$...$``: math-verify reads bare LaTeX as nothing, or as its leading number only.
_MATH_MODE = ("$", "\\(", "\\[", "\\boxed")


class RewardUnavailable(Exception):
    """Raised by a reward function that cannot score now but may later (a service it calls is
    down): the result is tried again later, up to ``reward_retry_s`` after it arrived."""


class RewardFunction(Protocol):
    @property
    def name(self) -> str: ...

    def reward(self, completion: str, spec: Mapping[str, Any]) -> float | None: ...

    def canonical(self, completion: str) -> str: ...


class ComparesAnswers(Protocol):
    """A reward function whose canonical answers may differ as text and still be the same
    answer (``math``: ``1/2`` and ``0.5``). Quorum votes compare its answers with
    ``equivalent`` (in a scoring process, see ``scoring.Scorer.vote_classes``); any other's
    are compared as text."""

    def equivalent(self, representative: str, answer: str) -> bool: ...


def compares_answers(fn: RewardFunction) -> bool:
    """Whether ``fn``'s canonical answers are compared by ``equivalent`` rather than as text."""
    return callable(getattr(fn, "equivalent", None))


def _last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` whose braces balance, at any depth (one linear
    pass), or None."""
    closes: dict[int, int] = {}
    opens: list[int] = []
    for i, ch in enumerate(text):
        if ch == "{":
            opens.append(i)
        elif ch == "}" and opens:
            closes[opens.pop()] = i
    for match in reversed(list(_BOXED_OPEN.finditer(text))):
        brace = match.end() - 1
        if brace in closes:
            return text[brace + 1 : closes[brace]]
    return None


def _normalise(text: str) -> str:
    return " ".join(unicodedata.normalize("NFKC", text).strip().split()).casefold()


def _expected(spec: Mapping[str, Any]) -> str | None:
    for key in ("answer", "expected_answer"):
        if key in spec and spec[key] is not None:
            return str(spec[key])
    return None


@dataclass(frozen=True)
class ExactMatch:
    name: str = "exact_match"

    def canonical(self, completion: str) -> str:
        boxed = _last_boxed(completion)
        if boxed is not None:
            return _normalise(boxed)
        lines = [line for line in completion.strip().splitlines() if line.strip()]
        return _normalise(lines[-1]) if lines else ""

    def reward(self, completion: str, spec: Mapping[str, Any]) -> float | None:
        expected = _expected(spec)
        if expected is None:
            return None
        return 1.0 if self.canonical(completion) == _normalise(expected) else 0.0


@dataclass(frozen=True)
class MathAnswer:
    """Final-answer equivalence (``\\frac{1}{2}`` == ``0.5``) using math-verify."""

    name: str = "math"

    def canonical(self, completion: str) -> str:
        from math_verify import parse

        parsed = parse(completion[-MAX_PARSE_CHARS:], parsing_timeout=None)
        return _normalise(str(parsed[-1])) if parsed else ExactMatch().canonical(completion)

    def reward(self, completion: str, spec: Mapping[str, Any]) -> float | None:
        from math_verify import parse, verify

        expected = _expected(spec)
        if expected is None:
            return None
        gold = _parse_gold(expected)
        answer = parse(completion[-MAX_PARSE_CHARS:], parsing_timeout=None)
        if not gold or not answer:
            return 0.0
        return 1.0 if verify(gold, answer, timeout_seconds=None) else 0.0

    def equivalent(self, representative: str, answer: str) -> bool:
        """Whether two canonical answers are the same answer (``1/2``, ``0.5``, ``\\frac{1}{2}``),
        as ``reward`` judges a completion against an expected answer: ``representative`` is read
        as an expected answer is, ``answer`` then as a completion's; one that does not parse
        (a canonical answer made of text) is equivalent only to the same text."""
        from math_verify import verify

        if representative == answer:
            return True
        gold = _parse_gold(representative)
        parsed = _parse_gold(answer)
        return bool(gold and parsed and verify(gold, parsed, timeout_seconds=None))


def _parse_gold(expected: str) -> list[Any]:
    """An expected answer as math-verify reads it (empty: nothing it can read)."""
    from math_verify import parse

    # An escaped dollar (``\$18.90``, MATH's money answers) is text, not a math delimiter.
    in_math_mode = any(mark in expected.replace("\\$", "") for mark in _MATH_MODE)
    return list(parse(expected if in_math_mode else f"${expected}$", parsing_timeout=None))


BUILT_IN: dict[str, RewardFunction] = {"exact_match": ExactMatch(), "math": MathAnswer()}


@cache
def _plugins() -> dict[str, RewardFunction]:
    found: dict[str, RewardFunction] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        obj = ep.load()
        fn = obj() if isinstance(obj, type) else obj
        found[ep.name] = fn
    return found


def preload() -> None:
    """Import the reward functions' dependencies now rather than on first use."""
    import math_verify  # noqa: F401

    _plugins()


def available() -> list[str]:
    return sorted({*BUILT_IN, *_plugins()})


def get(name: str) -> RewardFunction:
    if name in BUILT_IN:
        return BUILT_IN[name]
    plugins = _plugins()
    if name in plugins:
        return plugins[name]
    raise KeyError(f"no reward function {name!r}; available: {', '.join(available())}")
