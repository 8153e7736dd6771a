"""The built-in reward functions' answer reading (orchestrator/verification/rewards.py)."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import time
from collections import Counter
from typing import Any

import pytest
from asgi_lifespan import LifespanManager

from orchestrator.app import create_app
from orchestrator.verification import scoring, service
from orchestrator.verification.models import VerificationJob
from orchestrator.verification.rewards import ExactMatch, MathAnswer


@pytest.mark.parametrize(
    ("gold", "right"),
    [
        ("\\sqrt{2}", "\\sqrt{2}"),
        ("\\pi", "\\pi"),
        ("\\dfrac{3}{4}", "0.75"),
        ("2\\sqrt{2}", "\\sqrt{8}"),
        ("\\infty", "\\infty"),
        ("\\frac{1}{2}", "0.5"),
        ("$\\frac{1}{2}$", "0.5"),
        ("\\(\\frac{1}{2}\\)", "0.5"),
        ("10\\%", "0.1"),
        ("42", "42"),
        # MATH's money answers: an escaped dollar was taken for math mode, and the gold, not
        # wrapped, parsed as nothing (every answer scored 0; a right canary answer was fraud).
        ("\\$18.90", "18.90"),
        ("\\$18.90", "\\$18.90"),
        ("\\$1,000", "1000"),
    ],
)
def test_math_accepts_a_right_answer_to_a_gold_in_bare_or_delimited_latex(gold: str, right: str) -> None:
    # A bare LaTeX gold was parsed as nothing (every answer scored 0) or as its leading number.
    assert MathAnswer().reward(f"The answer is $\\boxed{{{right}}}$", {"answer": gold}) == 1.0


@pytest.mark.parametrize(
    ("gold", "wrong"), [("2\\sqrt{2}", "2"), ("3\\pi", "3"), ("\\sqrt{2}", "2"), ("\\$18.90", "19.90")]
)
def test_math_refuses_a_bare_latex_gold_s_leading_number(gold: str, wrong: str) -> None:
    assert MathAnswer().reward(f"The answer is $\\boxed{{{wrong}}}$", {"answer": gold}) == 0.0


def test_exact_match_reads_a_boxed_answer_nested_at_any_depth() -> None:
    gold = "\\frac{\\sqrt{2}}{2}"
    assert ExactMatch().reward(f"so \\boxed{{{gold}}}", {"answer": gold}) == 1.0
    assert ExactMatch().canonical("\\boxed{a^{b^{c^{d}}}}") == "a^{b^{c^{d}}}"


def test_exact_match_takes_the_last_boxed_answer_not_an_earlier_simpler_one() -> None:
    completion = "First guess \\boxed{7}.\nNo: the answer is \\boxed{\\frac{\\sqrt{2}}{2}}"
    assert ExactMatch().canonical(completion) == "\\frac{\\sqrt{2}}{2}"
    assert ExactMatch().reward(completion, {"answer": "7"}) == 0.0


def test_exact_match_skips_an_unclosed_box_for_the_last_whole_one_or_the_last_line() -> None:
    assert ExactMatch().canonical("\\boxed{7} then \\boxed{8") == "7"
    assert ExactMatch().canonical("no box here\n\\boxed{8\nAnswer: 8") == "answer: 8"


async def test_an_app_stops_its_scoring_processes_when_it_shuts_down(settings: Any, hot_store: Any) -> None:
    """uvicorn ends a SIGTERM'd process with the signal, so atexit never stopped them: the
    processes outlived the server, and the resource tracker warned of leaked semaphores."""
    app = create_app(settings, hot_store=hot_store, serving_marks=False)
    async with LifespanManager(app):
        pool = scoring._pool("requests", 1, 512)
        pid = await asyncio.wrap_future(pool.schedule(os.getpid))
        assert pid != os.getpid()
    assert scoring._pools == {}
    for _ in range(100):  # joined within close_pools; allow the OS a moment to reap it
        if not _alive(pid):
            break
        await asyncio.sleep(0.05)
    assert not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize(
    ("one", "other"),
    [
        ("1/2", "0.5"),
        ("x = 1/2", "The answer is $\\boxed{\\frac{1}{2}}$"),
        (" 1/2 ", "$\\frac12$"),
        ("\\boxed{\\sqrt{2}}", "\\boxed{2^{1/2}}"),
        ("\\boxed{x^2+1}", "\\boxed{1+x^2}"),
        ("no number here", "No number here"),
    ],
)
def test_math_canonical_answers_that_are_one_answer_are_equivalent(one: str, other: str) -> None:
    math = MathAnswer()
    a, b = math.canonical(one), math.canonical(other)
    assert math.equivalent(a, b) and math.equivalent(b, a)


@pytest.mark.parametrize(
    ("one", "other"),
    [("1/2", "1/3"), ("1/2", "0.50001"), ("1/2", "3"), ("\\boxed{(1,2]}", "\\boxed{(1,2)}"), ("yes", "no")],
)
def test_math_canonical_answers_that_differ_are_not_equivalent(one: str, other: str) -> None:
    math = MathAnswer()
    a, b = math.canonical(one), math.canonical(other)
    assert not math.equivalent(a, b) and not math.equivalent(b, a)


def _jobs(*answers: str) -> list[VerificationJob]:
    return [VerificationJob(canonical=json.dumps([MathAnswer().canonical(a)])) for a in answers]


async def test_vote_classes_do_not_depend_on_the_order_the_results_came_in() -> None:
    """Votes joined by a chain of equivalent votes are one class, led by its most common vote
    (ties by text). A vote with another count of samples is never equivalent."""
    scorer = scoring.Scorer(purpose="test")
    answers = ["1/2", "3", "0.5", "1/2", "\\frac{3}{1}", "1/3"]
    seen = []
    for order in (answers, answers[::-1], answers[2:] + answers[:2]):
        jobs = _jobs(*order)
        votes = Counter(service.vote_of(j.canonical) for j in jobs)
        seen.append((await service.vote_classes("math", jobs, votes, scorer)).of)
    one = '["1/2"]'  # the most common text leads its class
    three = '["3"]'  # a tie: "3" comes before "\\frac{3}{1}" as text
    expected = {one: one, '["0.5"]': one, three: three, '["\\\\frac{3}{1}"]': three, '["1/3"]': '["1/3"]'}
    assert seen == [expected] * 3
    jobs = [*_jobs("1/2"), VerificationJob(canonical=json.dumps(["1/2", "1/2"]))]
    votes = Counter(service.vote_of(j.canonical) for j in jobs)
    assert set((await service.vote_classes("math", jobs, votes, scorer)).of.values()) == set(votes)
    # Any other reward function compares as text (in this process: no scoring process asked).
    exact = await service.vote_classes("exact_match", _jobs("1/2", "0.5"), Counter(["a", "b"]), scorer)
    assert exact.of == {"a": "a", "b": "b"} and exact.details() == {}


async def test_votes_too_costly_to_compare_are_compared_as_text() -> None:
    """An answer SymPy cannot finish with (9^(9^9)) against another runs its comparisons out of
    their share of the time: those are made as text, and the verdicts say so."""
    jobs = [VerificationJob(canonical=json.dumps([a])) for a in ("9^{9^{9}}", "9^{9^{9}}+0", "1/2")]
    votes = Counter(service.vote_of(j.canonical) for j in jobs)
    scorer = scoring.Scorer(timeout_s=1.0, purpose="test")
    classes = await service.vote_classes("math", jobs, votes, scorer)
    half = '["1/2"]'
    assert [v for v in votes if classes.of[v] == half] == [half]
    assert classes.details()["equivalence_unchecked"] == classes.unchecked
    assert classes.unchecked is not None and "as text" in classes.unchecked


@pytest.mark.parametrize(
    "answers",
    [
        # (a)=3 and x=3 are each 3, not each other: whichever text comes first, 3 joins them.
        ["\\boxed{(a)=3}", "\\boxed{3}", "\\boxed{x=3}"],
        # x > 0 read as an expected answer is (0, oo); (0, oo) read so is not x > 0.
        ["\\boxed{x>0}", "\\boxed{(0,\\infty)}"],
    ],
)
def test_classes_are_the_votes_joined_by_equivalent_votes_in_any_order(answers: list[str]) -> None:
    """Equivalence is neither transitive nor symmetric: a class chosen by a representative's
    text left out a vote equivalent to one of its members, to be outvoted. The classes are the
    chains of votes equivalent either way round, the same in every order."""
    math = MathAnswer()
    votes = [[math.canonical(a)] for a in answers]
    for order in itertools.permutations(votes):
        assert scoring._vote_classes("math", list(order)) == ([0] * len(votes), 0)
    assert scoring._vote_classes("math", [*votes, ["4"]]) == ([0] * len(votes) + [1], 0)


async def test_a_comparison_over_its_share_of_the_time_is_made_as_text() -> None:
    """One answer SymPy takes long over (some 20 s against another) is cut at its share of the
    time and compared as text; the other votes are still compared by equivalence."""
    scorer = scoring.Scorer(timeout_s=2.5, purpose="test")
    assert await scorer.vote_classes("math", [["1/3"], ["0.5"]]) == ([0, 1], 0)  # the worker started
    started = time.monotonic()
    classes, cut = await scorer.vote_classes("math", [["1/2"], ["(x+y+z+w+1)^{16}"], ["0.5"]])
    assert time.monotonic() - started < 2.5
    assert classes == [0, 1, 0] and cut >= 1
