"""``openai``: any OpenAI-compatible completions endpoint (vLLM, llama.cpp server, ...).

One request per lease: ``POST {base_url}/v1/completions`` with the task's prompt and
sampling parameters, ``n`` choices and the lease's seed (``top_k`` only when the task sets
one; vLLM accepts it as an extra parameter). Choices become samples in index order.

Options (``--backend-opt key=value``):

* ``base_url`` (required): the server, e.g. ``http://127.0.0.1:8000`` (a trailing ``/v1`` is
  fine);
* ``model`` (required): the served model name;
* ``api_key_env``: the name of an environment variable that holds the API key (sent as a
  bearer token; the key itself is never an option, never logged);
* ``timeout_s`` (default none: the worker's ``--generate-timeout-s`` bounds a generation; a
  long one sends nothing until it is done) and ``connect_timeout_s`` (default 10);
* ``retry_s`` (default 300): how long one generation waits for a server that is not there or
  not ready (connection refused or cut, 429, 502, 503, 504: a model still loading, a server
  restarting, a proxy), trying again with a backoff that honours ``Retry-After``, before it
  fails; 0 tries once;
* ``logprobs``: ask for this many top logprobs per token and send a summary (sum, mean,
  min, count of the sampled tokens' logprobs) with each sample;
* ``max_n``: the most choices the server gives in one request (llama.cpp's refused ``n`` > 1
  until late 2025, and since then ``n`` above its ``--parallel`` slots): a task's ``n``
  above it is asked in several requests at once, the one from choice i on (from 0) with the
  lease's seed + i (vLLM seeds a request's i-th choice with its seed + i: the parts give the
  samples one request of ``n`` would).
"""

from __future__ import annotations

import asyncio
import math
import os
import random
from collections.abc import Mapping
from typing import Any

import httpx
import structlog
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, stop_after_delay

from api_schemas.tasks import LeasedTask, PolicyRef, Sample
from orchestrator.worker.backends.base import option_float, option_int
from orchestrator.worker.errors import BackendError, parse_retry_after

log = structlog.get_logger(__name__)

OPTIONS = frozenset(
    {"base_url", "model", "api_key_env", "timeout_s", "connect_timeout_s", "logprobs", "retry_s", "max_n"}
)
#: Answers of a server that is not ready yet (loading the model, restarting) or of a proxy in
#: front of one: tried again. Any other error answer is the task's failure.
UNAVAILABLE_STATUSES = frozenset({429, 502, 503, 504})
#: Transport failures that say the server is away or went away mid-answer (restarted, crashed):
#: tried again. A read timeout is not: the generation took longer than ``timeout_s``.
UNAVAILABLE_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError)
BACKOFF_BASE_S = 0.5
BACKOFF_MAX_S = 10.0
RETRY_AFTER_CAP_S = 60.0


class _Unavailable(Exception):
    def __init__(self, reason: str, retry_after: float | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after = retry_after


def completions_url(base_url: str) -> str:
    base = base_url.rstrip("/")
    return f"{base}/completions" if base.endswith("/v1") else f"{base}/v1/completions"


class OpenAIBackend:
    name = "openai"

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str | None = None,
        timeout_s: float | None = None,
        connect_timeout_s: float = 10.0,
        logprobs: int | None = None,
        retry_s: float = 300.0,
        max_n: int | None = None,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError("base_url must be an http:// or https:// URL")
        if not retry_s >= 0:
            raise ValueError("retry_s must be 0 or more")
        if timeout_s is not None and not timeout_s >= 0:
            raise ValueError("timeout_s must be 0 (none) or more")
        if max_n is not None and max_n < 1:
            raise ValueError("max_n must be at least 1")
        self.max_n = max_n
        self.retry_s = retry_s
        self.url = completions_url(base_url)
        self.model = model
        self.logprobs = logprobs
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # No cap on connections: the worker's --concurrency bounds the requests in flight, one a
        # lease, and a batching server (vLLM) runs hundreds at once. httpx's default pool of 100
        # held the rest back, and failed them with a PoolTimeout once timeout_s had passed. No
        # read timeout unless asked for: the worker's --generate-timeout-s bounds a generation.
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s or None, connect=connect_timeout_s),
            headers=headers,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        )

    def __repr__(self) -> str:  # never shows the key
        return f"OpenAIBackend(url={self.url!r}, model={self.model!r})"

    @classmethod
    def from_options(cls, options: Mapping[str, str]) -> OpenAIBackend:
        unknown = set(options) - OPTIONS
        if unknown:
            raise ValueError(f"unknown openai backend options: {', '.join(sorted(unknown))}")
        for required in ("base_url", "model"):
            if not options.get(required):
                raise ValueError(f"the openai backend needs --backend-opt {required}=...")
        api_key = None
        env_name = options.get("api_key_env")
        if env_name:
            api_key = os.environ.get(env_name)
            if not api_key:
                raise ValueError(f"api_key_env names {env_name}, which is not set")
        return cls(
            options["base_url"],
            options["model"],
            api_key=api_key,
            timeout_s=option_float(options, "timeout_s", 0.0) or None,
            connect_timeout_s=option_float(options, "connect_timeout_s", 10.0),
            logprobs=option_int(options, "logprobs", None),
            retry_s=option_float(options, "retry_s", 300.0),
            max_n=option_int(options, "max_n", None),
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    def request_body(self, task: LeasedTask, seed: int) -> dict[str, Any]:
        if task.prompt is None:
            raise BackendError(
                f"task {task.task_id} has only a problem_ref; the openai backend needs a prompt"
            )
        s = task.sampling
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": task.prompt,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "max_tokens": s.max_tokens,
            "n": s.n,
            "seed": seed,
        }
        if s.top_k >= 0:
            body["top_k"] = s.top_k
        if self.logprobs is not None:
            body["logprobs"] = self.logprobs
        return body

    async def generate(self, task: LeasedTask, seed: int, policy: PolicyRef) -> list[Sample]:
        n, most = task.sampling.n, self.max_n
        if most is None or n <= most:
            return await self._complete(task, seed)
        # In parts of at most max_n choices, asked at once; one failing fails (and stops) all.
        # The part from choice ``start`` on is seeded seed + start: vLLM samples the i-th choice
        # of a request seeded s with seed s + i, so the parts draw seed .. seed + n - 1, the
        # samples one request of n would give (parts seeded seed + k overlapped: two of a task's
        # samples were the same one).
        starts = range(0, n, most)
        try:
            async with asyncio.TaskGroup() as group:
                parts = [
                    group.create_task(
                        self._complete(
                            task.model_copy(
                                update={
                                    "sampling": task.sampling.model_copy(update={"n": min(most, n - start)})
                                }
                            ),
                            seed + start,
                        )
                    )
                    for start in starts
                ]
        except ExceptionGroup as failed:
            raise failed.exceptions[0] from None  # the BackendError itself, for the release
        return [sample for part in parts for sample in part.result()]

    async def _complete(self, task: LeasedTask, seed: int) -> list[Sample]:
        """One completions request for ``task.sampling.n`` choices."""
        body = self.request_body(task, seed)
        retrying = AsyncRetrying(
            stop=stop_after_delay(self.retry_s),
            wait=_wait,
            retry=retry_if_exception_type(_Unavailable),
            before_sleep=_log_retry,
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    response = await self._post(body)
        except _Unavailable as exc:
            raise BackendError(
                f"completions endpoint {self.url} unavailable for {self.retry_s:g} s (retry_s): {exc.reason}"
            ) from exc
        try:
            payload = response.json()
        except ValueError as exc:
            raise BackendError("completions endpoint answered something that is not JSON") from exc
        return samples_from(payload, task)

    async def _post(self, body: dict[str, Any]) -> httpx.Response:
        try:
            response = await self._http.post(self.url, json=body)
        except UNAVAILABLE_ERRORS as exc:
            raise _Unavailable(type(exc).__name__) from exc
        except httpx.HTTPError as exc:
            raise BackendError(f"completions request to {self.url} failed: {type(exc).__name__}") from exc
        if response.status_code in UNAVAILABLE_STATUSES:
            raise _Unavailable(
                f"answered {response.status_code}: {response.text[:200]!r}",
                parse_retry_after(response.headers.get("retry-after")),
            )
        if response.is_error:
            raise BackendError(
                f"completions endpoint answered {response.status_code}: {response.text[:200]!r}"
            )
        return response


def _wait(state: RetryCallState) -> float:
    """The server's ``Retry-After`` (at least ``BACKOFF_BASE_S``: a proxy's ``0`` made a tight
    loop of requests; at most ``RETRY_AFTER_CAP_S``), else exponential backoff with full jitter."""
    exc = state.outcome.exception() if state.outcome is not None else None
    if isinstance(exc, _Unavailable) and exc.retry_after is not None:
        return min(max(exc.retry_after, BACKOFF_BASE_S), RETRY_AFTER_CAP_S)
    ceiling = min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2 ** min(state.attempt_number - 1, 32))
    return random.uniform(0, ceiling)  # noqa: S311 - jitter, not a secret


def _log_retry(state: RetryCallState) -> None:
    exc = state.outcome.exception() if state.outcome is not None else None
    wait = state.next_action.sleep if state.next_action is not None else 0.0
    log.warning(
        "inference_unavailable",
        reason=getattr(exc, "reason", repr(exc)),
        attempt=state.attempt_number,
        wait_s=round(wait, 1),
    )


def samples_from(payload: Any, task: LeasedTask) -> list[Sample]:
    """Map an OpenAI completions response to ``task.sampling.n`` samples.

    A choice's completion tokens are its own count where the server gives one (a per-choice
    ``usage``, its ``token_ids``, its logprobs' ``tokens``); a choice cut at ``max_tokens``
    (``finish_reason`` ``length``) has ``max_tokens``, unless the reported total is smaller than
    that makes (a server that cut it shorter than asked); the rest share what is left of the
    request's ``usage.completion_tokens``, which vLLM and others give only as the sum over the
    choices."""
    n = task.sampling.n
    max_tokens = task.sampling.max_tokens
    choices = payload.get("choices") if isinstance(payload, dict) else None
    if not isinstance(choices, list) or len(choices) != n:
        got = len(choices) if isinstance(choices, list) else "no"
        raise BackendError(f"completions endpoint returned {got} choices, {n} were asked for")
    choices = sorted(choices, key=lambda c: int(c.get("index", 0)))
    usage = payload.get("usage") or {}
    total = usage.get("completion_tokens") if isinstance(usage.get("completion_tokens"), int) else None
    counts = [_own_tokens(choice) for choice in choices]
    known = sum(count for count in counts if count is not None)
    cut = [
        i for i, count in enumerate(counts) if count is None and choices[i].get("finish_reason") == "length"
    ]
    if total is None or total >= known + max_tokens * len(cut):
        for i in cut:
            counts[i] = max_tokens
        known += max_tokens * len(cut)
    unknown = [i for i, count in enumerate(counts) if count is None]
    if unknown and total is not None and total >= known:
        for i, share in zip(unknown, _split(total - known, len(unknown)), strict=True):
            counts[i] = min(share, max_tokens)
    samples = []
    for choice, count in zip(choices, counts, strict=True):
        text = str(choice.get("text") or "")
        logprobs = choice.get("logprobs") or {}
        own = choice.get("usage") or {}
        prompt_tokens = own.get("prompt_tokens", usage.get("prompt_tokens"))
        samples.append(
            Sample(
                completion=text,
                finish_reason=str(choice.get("finish_reason") or "unknown"),
                prompt_tokens=int(prompt_tokens) if isinstance(prompt_tokens, int) else 0,
                completion_tokens=count if count is not None else min(len(text.split()), max_tokens),
                logprob_summary=_summary(logprobs.get("token_logprobs")),
            )
        )
    return samples


def _own_tokens(choice: dict[str, Any]) -> int | None:
    """A choice's completion tokens, if the choice itself tells them."""
    own = choice.get("usage") or {}
    if isinstance(own.get("completion_tokens"), int):
        return int(own["completion_tokens"])
    if isinstance(choice.get("token_ids"), list):
        return len(choice["token_ids"])
    logprobs = choice.get("logprobs") or {}
    if isinstance(logprobs.get("tokens"), list):
        return len(logprobs["tokens"])
    return None


def _split(total: int, parts: int) -> list[int]:
    base, extra = divmod(max(total, 0), parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def _summary(values: Any) -> dict[str, float] | None:
    if not isinstance(values, list):
        return None
    finite = [float(v) for v in values if isinstance(v, int | float) and math.isfinite(v)]
    if not finite:
        return None
    total = math.fsum(finite)
    return {"sum": total, "mean": total / len(finite), "min": min(finite), "count": float(len(finite))}
