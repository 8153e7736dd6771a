"""Reward functions run in worker processes, within a time and a memory limit.

A result's completions are a stranger's text, and what a reward function costs can depend on
that text without bound: ``math`` hands a final answer such as ``\\boxed{9^{9^{9}}}`` to SymPy,
which computes the power, for minutes and gigabytes, in one C call that no signal or thread can
interrupt. Run in a thread of the verifier, one such result would hold up its batch, the
batch's locks and every later result for good. So the reward functions run in a pool of worker
processes (``pebble``), started on first use, one pool per server process and purpose (the
verifier loop's, and the validator verdict route's, so that a validator's request never queues
behind a verifier batch's slow results in a process running both; and the comparisons of
equivalent answers a quorum makes while it holds its locks, ``Scorer.vote_classes``, beside
each; those made before the batch's transaction use the scoring pool): scoring a result
that takes longer than ``timeout_s`` kills its worker (a new one takes its place), and each
worker's address space is capped at ``memory_mb``. Such a result is ``Unscorable``; the
verifier judges it ``inconclusive`` (``reward_unscorable``: no reward, no penalty, since the
limit may be the verifier's own fault, under load). A worker that dies while scoring (killed
from outside) is replaced and the result tried once more before it is unscorable.
"""

from __future__ import annotations

import asyncio
import atexit
import multiprocessing
import resource
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import structlog
from pebble import ProcessExpired, ProcessPool

from orchestrator.settings import VerifierSettings
from orchestrator.verification import rewards

Scores = tuple[list[float | None], list[str]]
_R = TypeVar("_R")
_V = TypeVar("_V")

log = structlog.get_logger(__name__)

#: How many times a result's scoring process may die before the result is ``Unscorable``.
DEATHS_ALLOWED = 2


class Unscorable(Exception):
    """The reward function ran out of time or memory on a result, or its process died."""


class RewardFunctionFailed(Exception):
    """The reward function raised on a result (a bug of the operator's plugin): it would raise
    the same at every attempt, so the result is judged without a score rather than retried."""


def _start_worker(memory_mb: int) -> None:
    """Cap the worker's memory, then import what the reward functions use (math-verify, SymPy,
    plugins), so that a worker's start does not count against a result's time limit."""
    limit = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    rewards.preload()


def _score(reward_function: str, completions: Sequence[str], spec: Mapping[str, Any]) -> Scores:
    """In a worker: each completion's reward and canonical answer."""
    fn = rewards.get(reward_function)  # not installed: a KeyError, tried again later
    try:
        return [fn.reward(c, spec) for c in completions], [fn.canonical(c) for c in completions]
    except MemoryError:
        raise  # its memory cap: Unscorable
    except rewards.RewardUnavailable as exc:  # tried again later; a plain copy crosses processes
        raise rewards.RewardUnavailable(
            f"reward function {reward_function!r} is unavailable: {exc}"[:500]
        ) from None
    except Exception as exc:
        raise RewardFunctionFailed(
            f"reward function {reward_function!r} raised {type(exc).__name__}: {exc}"[:500]
        ) from None


#: Of a quorum's time limit, the share its comparisons of answers may use one by one (the rest
#: is left for the worker to answer before the pool's timeout kills it).
COMPARISONS_SHARE = 0.8


class _ComparisonTimedOut(BaseException):
    """A comparison of two answers ran out of its time (``SIGALRM`` in a worker). A
    ``BaseException``: math-verify turns every ``Exception`` into "not equivalent"."""


def _within(seconds: float, compare: Callable[[], bool]) -> bool | None:
    """``compare()``, or None past ``seconds``: an alarm signal in the worker's main thread
    interrupts SymPy between two Python steps (a C call that does not return in time is cut by
    the pool's timeout instead)."""
    armed = [True]

    def expire(signum: int, frame: Any) -> None:
        if armed[0]:
            raise _ComparisonTimedOut

    previous = signal.signal(signal.SIGALRM, expire)
    # Again every 50 ms until disarmed: an exception raised where Python ignores it (a garbage
    # collector's callback, a ``__del__``) or a bare ``except:`` would lose a single alarm.
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001), 0.05)
    try:
        result = compare()
        armed[0] = False
        return result
    except _ComparisonTimedOut:
        return None
    finally:
        armed[0] = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _vote_classes(
    reward_function: str, answers: Sequence[Sequence[str]], budget_s: float | None = None
) -> tuple[list[int], int]:
    """In a worker: each vote's class (``classes_of``) by the reward function's ``equivalent``,
    and how many comparisons ran out of time. A vote is a result's canonical answers, one a
    sample; two votes are equivalent when they have as many answers and each answer of one is
    equivalent to the other's, either way round (``equivalent`` reads its first answer as an
    expected one, and ``x > 0`` read so is ``(0, \\infty)``, not the other way round).

    With ``budget_s`` each comparison may take its share of what is left of it (what is left,
    over the comparisons that may be left): one that takes longer is cut and its two answers
    are compared as text (they differ), so that one answer SymPy takes long over does not leave
    every other vote compared as text."""
    fn = rewards.get(reward_function)
    equivalent = cast(rewards.ComparesAnswers, fn).equivalent
    width = max((len(a) for a in answers), default=0)
    left = [len(answers) * (len(answers) - 1) * width]  # at most: each pair, each way, each sample
    deadline = None if budget_s is None else time.monotonic() + budget_s
    timed_out = [0]

    def compare(a: str, b: str) -> bool:
        left[0] = max(left[0] - 1, 1)
        if deadline is None or a == b:
            return equivalent(a, b)
        share = (deadline - time.monotonic()) / left[0]
        result = _within(share, lambda: equivalent(a, b))
        if result is None:
            timed_out[0] += 1
        return bool(result)

    def same(one: Sequence[str], other: Sequence[str]) -> bool:
        return len(one) == len(other) and all(
            compare(a, b) or compare(b, a) for a, b in zip(one, other, strict=True)
        )

    try:
        return classes_of(answers, same), timed_out[0]
    except MemoryError:
        raise
    except Exception as exc:
        raise RewardFunctionFailed(
            f"reward function {reward_function!r} raised {type(exc).__name__}: {exc}"[:500]
        ) from None


def classes_of(votes: Sequence[_V], same: Callable[[_V, _V], bool]) -> list[int]:
    """Each vote's class, in the order given: two votes are one class when a chain of votes,
    each ``same`` as the next, joins them (``same(earlier, later)``), and the classes are
    numbered in the order of their first votes. Equivalence need not be transitive (``x=3``
    and ``3`` are one answer, ``3`` and ``(a)=3`` too, ``x=3`` and ``(a)=3`` not): the chains
    make the classes the same whatever the order, so that no vote is outvoted by a class
    holding a vote it is the same as, whichever vote's text comes first. Each pair of votes
    not yet in one class is compared once."""
    root = list(range(len(votes)))

    def find(i: int) -> int:
        while root[i] != i:
            i = root[i]
        return i

    for later in range(len(votes)):
        for earlier in range(later):
            a, b = find(earlier), find(later)
            if a != b and same(votes[earlier], votes[later]):
                root[max(a, b)] = min(a, b)
    numbers: dict[int, int] = {}
    return [numbers.setdefault(find(i), len(numbers)) for i in range(len(votes))]


_pools: dict[tuple[str, int, int], ProcessPool] = {}
_pools_lock = threading.Lock()


def _pool(purpose: str, processes: int, memory_mb: int) -> ProcessPool:
    with _pools_lock:
        pool = _pools.get((purpose, processes, memory_mb))
        if pool is None or not pool.active:
            # spawn, not fork: the server's threads (the pool's own among them) may hold locks.
            pool = ProcessPool(
                max_workers=processes,
                initializer=_start_worker,
                initargs=(memory_mb,),
                context=multiprocessing.get_context("spawn"),
            )
            _pools[(purpose, processes, memory_mb)] = pool
        return pool


@atexit.register
def close_pools() -> None:
    """Stop every scoring worker (at exit; tests may call it)."""
    with _pools_lock:
        pools = list(_pools.values())
        _pools.clear()
    for pool in pools:
        pool.stop()  # type: ignore[no-untyped-call]
        pool.join(timeout=5)


@dataclass(frozen=True)
class Scorer:
    """The verifier's limits on scoring one result (``VerifierSettings``)."""

    timeout_s: float = 10.0
    memory_mb: int = 1024
    processes: int = 1
    #: Scorers of one purpose share a pool: ``verifier`` (the loop) or ``requests``.
    purpose: str = "verifier"
    #: The longest a quorum's comparisons of answers may take while the caller holds a
    #: transaction's locks (``vote_classes(locked=True)``), capped by ``timeout_s``.
    vote_compare_s: float = 2.0

    async def score(
        self, reward_function: str, completions: Sequence[str], spec: Mapping[str, Any]
    ) -> Scores:
        """Each completion's reward and canonical answer; ``Unscorable`` past the limits. Any
        other error the reward function raises is ``RewardFunctionFailed``, except
        ``RewardUnavailable`` (try later); one of its lookup (not installed) is raised as it is.
        A scoring process that dies (the
        kernel's OOM killer, an operator's kill) is replaced and the result scored once more: a
        result is unscorable only if its process dies ``DEATHS_ALLOWED`` times, as one whose
        scoring crashes the process would."""
        return await self._run(self.purpose, _score, (reward_function, list(completions), dict(spec)))

    async def vote_classes(
        self, reward_function: str, votes: Sequence[Sequence[str]], *, locked: bool = True
    ) -> tuple[list[int], int]:
        """Each vote's class (``classes_of``) by the reward function's ``equivalent``, and how
        many comparisons were cut and made as text (``_vote_classes``: each may take its share
        of ``COMPARISONS_SHARE`` of the time limit), within a time limit and the memory limit
        (``Unscorable`` past them, ``RewardFunctionFailed`` if it raises).

        ``locked``: the caller holds a transaction's locks (a quorum decided in its batch's
        transaction, or by the housekeeping): the time limit is ``vote_compare_s`` (at most
        ``timeout_s``), in a pool of its own (``<purpose>-votes``, started on first use), so
        that the locks are not held for a whole ``timeout_s`` per quorum and the comparisons do
        not queue behind the scoring of other batches' results. Otherwise (``service.prescore``,
        no transaction open) the time limit is ``timeout_s``, in the scoring pool, as a result's
        scoring."""
        limit_s = min(self.vote_compare_s, self.timeout_s) if locked else self.timeout_s
        purpose = f"{self.purpose}-votes" if locked else self.purpose
        args = (reward_function, [list(v) for v in votes], limit_s * COMPARISONS_SHARE)
        return await self._run(purpose, _vote_classes, args, limit_s)

    async def _run(
        self, purpose: str, function: Callable[..., _R], args: tuple[Any, ...], timeout_s: float | None = None
    ) -> _R:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        for death in range(1, DEATHS_ALLOWED + 1):
            future = _pool(purpose, self.processes, self.memory_mb).schedule(
                function, args=args, timeout=timeout_s
            )
            try:
                return await asyncio.wrap_future(future)
            except FutureTimeout as exc:
                raise Unscorable(f"scoring took longer than {timeout_s:g} s") from exc
            except MemoryError as exc:
                raise Unscorable(f"scoring needed more than {self.memory_mb} MB") from exc
            except ProcessExpired as exc:
                if death == DEATHS_ALLOWED:
                    raise Unscorable(
                        f"the scoring process died {death} times (last exit code {exc.exitcode})"
                    ) from exc
                log.warning("scoring_process_died", exit_code=exc.exitcode, retrying=True)
        raise AssertionError("unreachable")


def scorer_for(settings: VerifierSettings, purpose: str = "verifier") -> Scorer:
    return Scorer(
        timeout_s=settings.reward_timeout_s,
        memory_mb=settings.reward_memory_mb,
        processes=settings.reward_processes,
        purpose=purpose,
        vote_compare_s=settings.vote_compare_s,
    )
