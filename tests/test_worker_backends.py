"""Rollout backends: the arithmetic toy policy, the OpenAI-compatible client, the registry."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib.metadata import EntryPoint
from typing import Any

import pytest

from api_schemas.tasks import LeasedTask, PolicyRef, Sample, Sampling, TaskIn
from orchestrator.verification.rewards import get as reward_function
from orchestrator.worker.backends import (
    ArithmeticBackend,
    Backend,
    BackendError,
    OpenAIBackend,
    available,
    create_backend,
    registry,
)
from orchestrator.worker.backends.openai_compat import samples_from
from orchestrator.worker.problems import arithmetic_tasks, parse_problem
from tests.inference_helpers import serving

POLICY = PolicyRef(step=3, uri="s3://ckpt/step-3", sha256="a" * 64)
EXACT = reward_function("exact_match")


def leased(
    prompt: str | None = "What is 17 + 25?",
    *,
    ref: str | None = None,
    n: int = 1,
    max_tokens: int = 32,
    **s: Any,
) -> LeasedTask:
    return LeasedTask(
        task_id=1,
        prompt=None if ref else prompt,
        problem_ref=ref,
        sampling=Sampling(max_tokens=max_tokens, n=n, **s),
        metadata=None,
    )


# ------------------------------------------------------------------ arithmetic


@pytest.mark.parametrize(
    ("prompt", "ref", "answer"),
    [
        ("What is 17 + 25?", None, "42"),
        ("What is 9 - 30?", None, "-21"),
        ("What is 12 * 12?", None, "144"),
        (None, "arith:17+25", "42"),
        (None, "arith:-4*6", "-24"),
        (None, "arith:5--3", "8"),
    ],
)
async def test_arithmetic_answers_are_right_and_pass_the_servers_exact_match(
    prompt: str | None, ref: str | None, answer: str
) -> None:
    [sample] = await ArithmeticBackend().generate(leased(prompt, ref=ref), seed=1, policy=POLICY)
    assert sample.completion is not None
    assert sample.completion.splitlines()[-1] == answer
    assert sample.finish_reason == "stop"
    assert sample.completion_tokens == len(sample.completion.split())
    assert EXACT.reward(sample.completion, {"answer": answer}) == 1.0


async def test_arithmetic_gives_exactly_n_samples() -> None:
    samples = await ArithmeticBackend().generate(leased(n=5), seed=1, policy=POLICY)
    assert len(samples) == 5 and all(isinstance(s, Sample) for s in samples)
    assert samples[0].completion == "17 + 25 = 42\n42"
    assert samples[0].prompt_tokens == 5  # "What is 17 + 25?"


async def test_error_draws_are_reproducible_and_near_the_rate() -> None:
    backend = ArithmeticBackend(error_rate=0.3)
    task = leased(n=400)
    first = await backend.generate(task, seed=1234, policy=POLICY)
    assert first == await ArithmeticBackend(error_rate=0.3).generate(task, seed=1234, policy=POLICY)
    answers = [int((s.completion or "").splitlines()[-1]) for s in first]
    wrong = [a for a in answers if a != 42]
    assert 0.2 < len(wrong) / len(answers) < 0.4
    assert all(1 <= abs(a - 42) <= 3 for a in wrong)
    other_seed = await backend.generate(task, seed=1235, policy=POLICY)
    assert [s.completion for s in other_seed] != [s.completion for s in first]


async def test_error_rate_bounds() -> None:
    task = leased(n=50)
    assert all(
        s.completion == "17 + 25 = 42\n42" for s in await ArithmeticBackend(0.0).generate(task, 7, POLICY)
    )
    assert all(
        not (s.completion or "").endswith("\n42")
        for s in await ArithmeticBackend(1.0).generate(task, 7, POLICY)
    )
    with pytest.raises(ValueError, match="error_rate"):
        ArithmeticBackend(1.5)


async def test_a_completion_longer_than_max_tokens_is_cut_with_length() -> None:
    [sample] = await ArithmeticBackend().generate(leased(max_tokens=3), seed=1, policy=POLICY)
    assert (sample.completion, sample.completion_tokens, sample.finish_reason) == ("17 + 25", 3, "length")
    assert EXACT.reward(sample.completion or "", {"answer": "42"}) == 0.0


async def test_an_unreadable_problem_gets_an_honest_non_answer() -> None:
    [sample] = await ArithmeticBackend().generate(leased("Write a poem."), seed=1, policy=POLICY)
    assert (sample.completion or "").endswith("\nunknown") and sample.finish_reason == "stop"


def test_arithmetic_tasks_are_reproducible_valid_enqueue_bodies() -> None:
    tasks = arithmetic_tasks(50, seed=11, n=2)
    assert tasks == arithmetic_tasks(50, seed=11, n=2)
    assert tasks != arithmetic_tasks(50, seed=12, n=2)
    for t in tasks:
        TaskIn.model_validate(t)
        problem = parse_problem(t["prompt"])
        assert problem is not None and str(problem.answer) == t["verification"]["answer"]
        assert t["sampling"]["n"] == 2
    assert {parse_problem(t["prompt"]).op for t in tasks} == {"+", "-", "*"}  # type: ignore[union-attr]
    refs = arithmetic_tasks(5, seed=11, as_ref=True)
    assert all(t["problem_ref"].startswith("arith:") and "prompt" not in t for t in refs)
    assert [parse_problem(problem_ref=r["problem_ref"]) for r in refs] == [
        parse_problem(t["prompt"]) for t in arithmetic_tasks(5, seed=11)
    ]


# ------------------------------------------------------------------ registry and plugins


@dataclass
class EchoBackend:
    """A plugin backend, loaded through an entry point in the tests."""

    word: str
    name: str = "echo"

    @classmethod
    def from_options(cls, options: Mapping[str, str]) -> EchoBackend:
        return cls(word=options.get("word", "hi"))

    async def generate(self, task: LeasedTask, seed: int, policy: PolicyRef) -> list[Sample]:
        return [
            Sample(completion=self.word, finish_reason="stop", prompt_tokens=0, completion_tokens=1)
        ] * task.sampling.n


@pytest.fixture
def echo_plugin(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    ep = EntryPoint(
        name="echo",
        value="tests.test_worker_backends:EchoBackend.from_options",
        group=registry.ENTRY_POINT_GROUP,
    )

    def fake_entry_points(*, group: str) -> list[EntryPoint]:
        return [ep] if group == registry.ENTRY_POINT_GROUP else []

    registry._plugins.cache_clear()
    monkeypatch.setattr(registry, "entry_points", fake_entry_points)
    yield
    registry._plugins.cache_clear()


async def test_backends_are_found_by_name_including_plugins(echo_plugin: None) -> None:
    assert {"arithmetic", "openai", "echo"} <= set(available())
    backend = create_backend("echo", {"word": "pong"})
    assert isinstance(backend, Backend) and backend.name == "echo"
    assert [s.completion for s in await backend.generate(leased(n=2), 1, POLICY)] == ["pong", "pong"]
    assert isinstance(create_backend("arithmetic", {"error_rate": "0.25"}), ArithmeticBackend)
    with pytest.raises(KeyError, match="available: arithmetic, echo, openai"):
        create_backend("nope")


def test_a_plugin_that_cannot_be_imported_breaks_only_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    # An installed plugin whose import fails on this machine (it needs a GPU library that is
    # missing, say) made every backend name fail, the built-ins too: `worker run --backend
    # openai` ended in that plugin's ModuleNotFoundError.
    group = registry.ENTRY_POINT_GROUP
    plugins = [
        EntryPoint(name="echo", value="tests.test_worker_backends:EchoBackend.from_options", group=group),
        EntryPoint(name="needs-cuda", value="tests.no_such_module:Backend", group=group),
    ]

    def fake_entry_points(*, group: str) -> list[EntryPoint]:
        return plugins if group == registry.ENTRY_POINT_GROUP else []

    registry._plugins.cache_clear()
    monkeypatch.setattr(registry, "entry_points", fake_entry_points)
    try:
        assert {"arithmetic", "openai", "echo", "needs-cuda"} <= set(available())
        assert isinstance(create_backend("arithmetic"), ArithmeticBackend)
        assert create_backend("echo", {"word": "pong"}).name == "echo"
        with pytest.raises(ModuleNotFoundError, match=r"tests\.no_such_module"):
            create_backend("needs-cuda")  # the one asked for still says why it cannot be built
    finally:
        registry._plugins.cache_clear()


def test_bad_backend_options_are_refused() -> None:
    with pytest.raises(ValueError, match="not a number"):
        create_backend("arithmetic", {"error_rate": "lots"})
    with pytest.raises(ValueError, match="unknown arithmetic backend options: colour"):
        create_backend("arithmetic", {"colour": "red"})
    with pytest.raises(ValueError, match="model"):
        create_backend("openai", {"base_url": "http://127.0.0.1:1"})
    with pytest.raises(ValueError, match="NOT_SET_ANYWHERE"):
        create_backend("openai", {"base_url": "http://x", "model": "m", "api_key_env": "NOT_SET_ANYWHERE"})


# ------------------------------------------------------------------ openai-compatible server


@dataclass
class FakeCompletions:
    """A tiny OpenAI-compatible completions server on 127.0.0.1 (real HTTP, stdlib)."""

    reply: Any = None
    status: int = 200
    requests: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    url: str = ""


@pytest.fixture
def fake_openai() -> Iterator[FakeCompletions]:
    fake = FakeCompletions()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            fake.paths.append(self.path)
            fake.headers.append({k.lower(): v for k, v in self.headers.items()})
            request = json.loads(body)
            fake.requests.append(request)
            reply = fake.reply(request) if callable(fake.reply) else fake.reply
            payload = json.dumps(reply).encode()
            self.send_response(fake.status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    with serving(ThreadingHTTPServer(("127.0.0.1", 0), Handler)) as fake.url:
        yield fake


def completion_reply(request: dict[str, Any]) -> dict[str, Any]:
    n = request["n"]
    # Out of index order on purpose; usage only as a total (choice 0 was cut at max_tokens, the
    # others had 3 tokens each).
    choices = [
        {"index": i, "text": f" answer {i}\n{i}", "finish_reason": "length" if i == 0 else "stop"}
        for i in reversed(range(n))
    ]
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "model": request["model"],
        "choices": choices,
        "usage": {
            "prompt_tokens": 11,
            "completion_tokens": request["max_tokens"] + 3 * (n - 1),
            "total_tokens": 11 + request["max_tokens"] + 3 * (n - 1),
        },
    }


async def test_openai_backend_sends_the_lease_seed_and_sampling(
    fake_openai: FakeCompletions, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_openai.reply = completion_reply
    monkeypatch.setenv("TEST_COMPLETIONS_KEY", "sk-test-123")
    backend = create_backend(
        "openai", {"base_url": fake_openai.url, "model": "qwen-0.5b", "api_key_env": "TEST_COMPLETIONS_KEY"}
    )
    assert isinstance(backend, OpenAIBackend)
    assert "sk-test-123" not in repr(backend)
    try:
        task = leased("Q: 2+2?", n=3, max_tokens=64, temperature=0.7, top_p=0.9, top_k=40)
        samples = await backend.generate(task, seed=987654321, policy=POLICY)
        untopped = await backend.generate(leased("Q: 1+1?"), seed=5, policy=POLICY)
    finally:
        await backend.aclose()
    sent = fake_openai.requests[0]
    assert fake_openai.paths == ["/v1/completions", "/v1/completions"]
    assert sent == {
        "model": "qwen-0.5b",
        "prompt": "Q: 2+2?",
        "temperature": 0.7,
        "top_p": 0.9,
        "max_tokens": 64,
        "n": 3,
        "seed": 987654321,
        "top_k": 40,
    }
    assert "top_k" not in fake_openai.requests[1] and fake_openai.requests[1]["seed"] == 5
    assert fake_openai.headers[0]["authorization"] == "Bearer sk-test-123"
    assert [s.completion for s in samples] == [" answer 0\n0", " answer 1\n1", " answer 2\n2"]
    assert [s.finish_reason for s in samples] == ["length", "stop", "stop"]
    # The cut choice had max_tokens; the others share the rest of the total reported.
    assert [s.completion_tokens for s in samples] == [64, 3, 3]
    assert {s.prompt_tokens for s in samples} == {11}
    assert len(untopped) == 1


async def test_a_long_generation_is_bounded_by_generate_timeout_not_a_600_s_read_timeout() -> None:
    # vLLM answers a non-streaming request only when every choice is done: a reasoning rollout
    # of 32k tokens on a busy server takes 10 to 20 minutes. The backend's own read timeout of
    # 600 s failed each such generation (ReadTimeout, released as a task failure; after three
    # the node was refused claims) though the worker allows --generate-timeout-s 3600 for one.
    backend = create_backend("openai", {"base_url": "http://127.0.0.1:1", "model": "m"})
    assert isinstance(backend, OpenAIBackend)
    try:
        timeout = backend._http.timeout
        assert (timeout.connect, timeout.read, timeout.write) == (10.0, None, None)
    finally:
        await backend.aclose()
    backend = create_backend("openai", {"base_url": "http://127.0.0.1:1", "model": "m", "timeout_s": "30"})
    assert isinstance(backend, OpenAIBackend)
    try:
        assert backend._http.timeout.read == 30.0
    finally:
        await backend.aclose()


def test_token_counts_never_add_up_to_more_than_the_server_reported() -> None:
    task = leased("Q", n=2, max_tokens=100)
    choices = [
        {"index": 0, "text": "a b c", "finish_reason": "length"},
        {"index": 1, "text": "d", "finish_reason": "stop"},
    ]
    counts = [
        s.completion_tokens
        for s in samples_from({"choices": choices, "usage": {"completion_tokens": 102}}, task)
    ]
    assert counts == [100, 2]
    # The server cut the first shorter than max_tokens (its own limit): its total says so, and
    # the sample says what the server reported, not max_tokens.
    counts = [
        s.completion_tokens
        for s in samples_from({"choices": choices, "usage": {"completion_tokens": 60}}, task)
    ]
    assert counts == [30, 30]


async def test_openai_per_choice_tokens_and_logprob_summary(fake_openai: FakeCompletions) -> None:
    fake_openai.reply = {
        "choices": [
            {
                "index": 0,
                "text": "4",
                "finish_reason": "stop",
                "logprobs": {"tokens": ["4", "<eos>"], "token_logprobs": [-0.5, -1.5]},
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 99},
    }
    backend = OpenAIBackend(fake_openai.url + "/v1/", "m", logprobs=1)
    try:
        [sample] = await backend.generate(leased("Q"), seed=1, policy=POLICY)
    finally:
        await backend.aclose()
    assert fake_openai.paths == ["/v1/completions"] and fake_openai.requests[0]["logprobs"] == 1
    assert sample.completion_tokens == 2
    assert sample.logprob_summary == {"sum": -2.0, "mean": -1.0, "min": -1.5, "count": 2.0}


async def test_openai_failures_are_backend_errors(fake_openai: FakeCompletions) -> None:
    backend = OpenAIBackend(fake_openai.url, "m")
    try:
        fake_openai.status, fake_openai.reply = 500, {"error": "out of memory"}
        with pytest.raises(BackendError, match="500"):
            await backend.generate(leased("Q"), seed=1, policy=POLICY)
        fake_openai.status, fake_openai.reply = 200, {"choices": [], "usage": {}}
        with pytest.raises(BackendError, match="0 choices, 2 were asked for"):
            await backend.generate(leased("Q", n=2), seed=1, policy=POLICY)
        with pytest.raises(BackendError, match="needs a prompt"):
            await backend.generate(leased(ref="arith:1+1"), seed=1, policy=POLICY)
    finally:
        await backend.aclose()
    # A server that is not there is waited for, retry_s long, then the generation fails.
    dead = OpenAIBackend("http://127.0.0.1:9", "m", connect_timeout_s=2, retry_s=1.5)
    try:
        started = time.monotonic()
        with pytest.raises(BackendError, match=r"unavailable for 1.5 s \(retry_s\): ConnectError"):
            await dead.generate(leased("Q"), seed=1, policy=POLICY)
        assert 1.5 <= time.monotonic() - started < 15
    finally:
        await dead.aclose()
    with pytest.raises(ValueError, match="retry_s"):
        create_backend("openai", {"base_url": "http://x", "model": "m", "retry_s": "-1"})
