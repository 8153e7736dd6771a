"""The worker's ``openai`` backend end to end: a real coordinator (the tests' app) and a fake
inference server on 127.0.0.1 that answers as vLLM's OpenAI server does
(``tests.inference_helpers``)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from api_schemas.tasks import LeasedTask, PolicyRef, Sampling
from orchestrator.verification.jobs import drain
from orchestrator.worker.backends import BackendError, OpenAIBackend
from orchestrator.worker.problems import arithmetic_tasks
from tests.inference_helpers import LOADING, fake_vllm, right_answer
from tests.tasks_helpers import pool_setup
from tests.test_worker_runner import start
from tests.waits import HANG_S
from tests.worker_helpers import ECON

pytestmark = pytest.mark.usefixtures("no_audits")

POLICY = PolicyRef(step=1, uri="file:///policy-1", sha256="a" * 64)


def leased(task_id: int, *, n: int = 1, max_tokens: int = 16) -> LeasedTask:
    return LeasedTask(
        task_id=task_id + 1,
        prompt=f"What is {task_id} + 1?",
        problem_ref=None,
        sampling=Sampling(max_tokens=max_tokens, n=n),
        metadata=None,
    )


def rambles_first(request: dict[str, Any], index: int) -> str:
    """Choice 0 thinks aloud past ``max_tokens``; the others answer at once."""
    if index == 0:
        return " Let me think about this step by step, carefully, one digit at a time." * 4
    return right_answer(request, index)


async def test_n_choices_from_vllm_one_cut_at_max_tokens_are_accepted(app: Any, app_state: Any) -> None:
    # vLLM reports usage for the whole request only. A choice cut at max_tokens ("length") had
    # max_tokens tokens; the worker must not report fewer, or the verifier rejects the result
    # ('length' with fewer tokens than max_tokens) and the honest node earns nothing.
    with fake_vllm(text=rambles_first) as server:
        async with pool_setup(app, app_state, economics=ECON) as s:
            await s.enqueue(arithmetic_tasks(2, seed=5, n=3, max_tokens=12))
            run = start(
                app, s.pool_id, backend="openai", backend_options={"base_url": server.url, "model": "m"}
            )
            await run.until(lambda st: st.submitted == 2)
            assert await drain(app_state) == 2
            await run.until(lambda st: st.accepted + st.rejected == 2)
            stats = await run.finish()
    assert (stats.accepted, stats.rejected, stats.errors) == (2, 0, 0)
    assert stats.earnings == 2 * 2 * 7  # the two right samples of each


@pytest.mark.parametrize(
    "faults",
    [
        pytest.param([LOADING, LOADING], id="llama.cpp-loading-503"),
        pytest.param([("status", 429, {"Retry-After": "1"}, {"error": "rate limited"})], id="proxy-429"),
        pytest.param([("status", 502, {}, {"error": "bad gateway"})], id="proxy-502"),
        pytest.param([("cut",)], id="connection-cut-mid-answer"),
    ],
)
async def test_an_inference_server_briefly_unavailable_is_waited_for_not_a_task_failure(
    app: Any, app_state: Any, faults: list[tuple[Any, ...]]
) -> None:
    # The model still loading, a proxy's 429/502, a server restarting mid-answer: the task is
    # fine and so is the node, a moment later. The generation is tried again, not given back
    # as failed (which counts towards the task's max_failures, keeps this node from ever
    # taking the task again, and after three makes the server refuse the node's claims).
    with fake_vllm(plan=list(faults)) as server:
        async with pool_setup(app, app_state, economics=ECON) as s:
            await s.enqueue(arithmetic_tasks(1, seed=9, n=2))
            run = start(
                app, s.pool_id, backend="openai", backend_options={"base_url": server.url, "model": "m"}
            )
            await run.until(lambda st: st.submitted == 1 or st.released > 0, within=30)
            stats = await run.finish()
            assert (stats.submitted, stats.released) == (1, 0)
            assert len(server.requests) == len(faults) + 1
            assert await drain(app_state) == 1


async def test_every_lease_of_a_large_concurrency_reaches_the_server_at_once() -> None:
    # --concurrency goes up to 1024 and vLLM batches hundreds of requests: each lease's
    # generation is one request, and none of them may wait for another's connection (an
    # HTTP client's default pool of 100 connections held the rest back, and failed them with a
    # pool timeout once timeout_s passed).
    leases = 150
    with fake_vllm(gather=leases) as server:
        backend = OpenAIBackend(server.url, "m", timeout_s=30)
        try:
            done = await asyncio.wait_for(
                asyncio.gather(
                    *(backend.generate(leased(seed), seed, POLICY) for seed in range(leases)),
                    return_exceptions=True,
                ),
                HANG_S,
            )
        finally:
            await backend.aclose()
    assert [d for d in done if isinstance(d, BaseException)] == []
    assert server.most_at_once == leases


async def test_a_server_that_gives_one_choice_a_request_is_asked_n_times(app: Any, app_state: Any) -> None:
    # llama.cpp's server refuses n > 1 ("Only one completion choice is allowed"; recent builds,
    # n above their --parallel slots): with max_n=1 each of the task's n samples is its own
    # request, with its own seed (the lease's, then the next ones), not a failed lease.
    with fake_vllm(max_n=1) as server:
        async with pool_setup(app, app_state, economics=ECON) as s:
            await s.enqueue(arithmetic_tasks(1, seed=3, n=3))
            run = start(
                app,
                s.pool_id,
                backend="openai",
                backend_options={"base_url": server.url, "model": "m", "max_n": "1"},
            )
            await run.until(lambda st: st.submitted == 1 or st.released > 0)
            stats = await run.finish()
            assert (stats.submitted, stats.released, stats.errors) == (1, 0, 0)
            assert await drain(app_state) == 1
            [lease] = (await s.admin.get(f"/v1/admin/pools/{s.pool_id}/tasks", headers=s.headers)).json()[
                "items"
            ]
            assert lease["status"] == "completed"
    assert [r["n"] for r in server.requests] == [1, 1, 1]
    seeds = [r["seed"] for r in server.requests]
    assert sorted(seeds) == list(range(min(seeds), min(seeds) + 3))


async def test_a_part_of_n_that_fails_fails_the_generation_with_its_own_error() -> None:
    refused = (
        "status",
        400,
        {},
        {"error": {"code": 400, "message": "prompt too long", "type": "invalid_request_error"}},
    )
    with fake_vllm(max_n=1, plan=[refused]) as server:
        backend = OpenAIBackend(server.url, "m", max_n=1)
        try:
            with pytest.raises(BackendError, match=r"answered 400: .*prompt too long"):
                await backend.generate(leased(1, n=3), 11, POLICY)
        finally:
            await backend.aclose()


def seeded_per_choice(request: dict[str, Any], index: int) -> str:
    """vLLM's (V1) parallel sampling: a request of ``n`` choices with seed s samples choice i as
    a request of its own with seed s + i."""
    return f" drawn with seed {request['seed'] + index}\n{request['seed'] + index}"


async def test_a_task_asked_in_parts_gets_the_samples_one_request_would_give() -> None:
    # vLLM samples the i-th choice of a request seeded s with seed s + i. Parts seeded the lease's
    # seed + k (k the part's number) overlapped: with max_n=2 the first part drew s and s + 1,
    # the second s + 1 and s + 2, so two of the task's samples were the same sample.
    with fake_vllm(text=seeded_per_choice) as server:
        whole = OpenAIBackend(server.url, "m")
        parts = OpenAIBackend(server.url, "m", max_n=2)
        try:
            one_request = await whole.generate(leased(1, n=5), 11, POLICY)
            in_parts = await parts.generate(leased(1, n=5), 11, POLICY)
        finally:
            await whole.aclose()
            await parts.aclose()
    assert [s.completion for s in in_parts] == [s.completion for s in one_request]
    assert len({s.completion for s in in_parts}) == 5
    assert sorted((r["n"], r["seed"]) for r in server.requests[1:]) == [(1, 15), (2, 11), (2, 13)]


async def test_a_retry_after_of_zero_is_not_a_tight_loop_against_the_inference_server() -> None:
    # A proxy answering 503 with "Retry-After: 0" while the model loads: the backend waited 0 s
    # between tries: requests as fast as the server answered them, for the whole retry_s.
    faults = [("status", 503, {"Retry-After": "0"}, {"error": "loading"})] * 10_000
    with fake_vllm(plan=faults) as server:
        backend = OpenAIBackend(server.url, "m", timeout_s=30, retry_s=1.0)
        try:
            with pytest.raises(BackendError, match="unavailable for 1 s"):
                await asyncio.wait_for(backend.generate(leased(1), 1, POLICY), HANG_S)
        finally:
            await backend.aclose()
        assert len(server.requests) <= 4, len(server.requests)
