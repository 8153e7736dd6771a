"""A fake OpenAI-compatible inference server on 127.0.0.1 that answers as vLLM's does.

``POST /v1/completions`` generates ``n`` choices: a "token" is a whitespace-separated word,
a choice is cut at ``max_tokens`` with ``finish_reason`` ``length`` (and has exactly
``max_tokens`` tokens then), else it ends with ``stop``. As vLLM answers a non-streaming
request: the choices in index order, ``logprobs`` null unless asked for (then ``tokens`` and
``token_logprobs`` per choice), and ``usage`` only for the whole request, its
``completion_tokens`` the sum over the choices.

What the model says is ``text(request, index)``; the arithmetic prompts get a right answer by
default. ``plan`` holds faults for the next requests, one a request, as real servers have them:
``("status", 503, {"Retry-After": "1"}, body)`` (llama.cpp's answer while it loads the model, a
proxy's 429 or 502), ``("cut",)`` (the connection closed half way through the answer: the
server died), ``("delay", seconds)`` (a slow generation, then the answer). With ``gather``
set, each request waits (up to ``gather_s``) until that many are being served at once, as a
batching server holds them while it generates; ``most_at_once`` is how many it served at once.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from orchestrator.worker.problems import parse_problem

_TOKEN = re.compile(r"\s*\S+")

LOADING = (
    "status",
    503,
    {},
    {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}},
)


def right_answer(request: dict[str, Any], index: int) -> str:
    problem = parse_problem(str(request.get("prompt")))
    if problem is None:
        return " I do not know.\nunknown"
    return f" {problem.a} {problem.op} {problem.b} = {problem.answer}\n{problem.answer}"


def generate(text: str, max_tokens: int) -> tuple[str, int, str]:
    """(text, tokens, finish reason) as the model ends it: cut at ``max_tokens`` tokens."""
    tokens = [m.group(0) for m in _TOKEN.finditer(text)]
    if len(tokens) <= max_tokens:
        return text, len(tokens), "stop"
    return "".join(tokens[:max_tokens]), max_tokens, "length"


@dataclass
class FakeVLLM:
    url: str = ""
    text: Callable[[dict[str, Any], int], str] = right_answer
    plan: list[tuple[Any, ...]] = field(default_factory=list)
    requests: list[dict[str, Any]] = field(default_factory=list)
    #: Requests answered with a completion (not a planned fault).
    completed: int = 0
    #: The most choices one request may ask for, as llama.cpp's server (which refused any n
    #: but 1 until late 2025, and since then more than its --parallel slots): more is a 500.
    max_n: int | None = None
    gather: int = 0
    gather_s: float = 10.0
    in_flight: int = 0
    most_at_once: int = 0
    lock: threading.Condition = field(default_factory=threading.Condition)

    def _gather(self) -> None:
        with self.lock:
            self.in_flight += 1
            self.most_at_once = max(self.most_at_once, self.in_flight)
            self.lock.notify_all()
            self.lock.wait_for(lambda: self.most_at_once >= self.gather, timeout=self.gather_s)

    def _done(self) -> None:
        with self.lock:
            self.in_flight -= 1

    def answer(self, request: dict[str, Any]) -> dict[str, Any]:
        choices = []
        total = 0
        for i in range(int(request.get("n", 1))):
            text, tokens, finish = generate(self.text(request, i), int(request["max_tokens"]))
            total += tokens
            logprobs = None
            if request.get("logprobs") is not None:
                words = [m.group(0) for m in _TOKEN.finditer(text)]
                logprobs = {
                    "text_offset": [],
                    "token_logprobs": [-0.25] * len(words),
                    "tokens": words,
                    "top_logprobs": [],
                }
            choices.append(
                {"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish, "stop_reason": None}
            )
        prompt_tokens = len(str(request.get("prompt", "")).split())
        return {
            "id": "cmpl-fake",
            "object": "text_completion",
            "created": int(time.time()),
            "model": request.get("model"),
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": total,
                "total_tokens": prompt_tokens + total,
            },
        }


@contextmanager
def fake_vllm(**kwargs: Any) -> Iterator[FakeVLLM]:
    fake = FakeVLLM(**kwargs)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with fake.lock:
                fake.requests.append(request)
                fault = fake.plan.pop(0) if fake.plan else None
            fake._gather()
            try:
                self._answer(request, fault)
            finally:
                fake._done()

        def _answer(self, request: dict[str, Any], fault: tuple[Any, ...] | None) -> None:
            if fault is not None and fault[0] == "delay":
                time.sleep(fault[1])
                fault = None
            if fault is None and fake.max_n is not None and int(request.get("n", 1)) > fake.max_n:
                error = {
                    "code": 500,
                    "message": "Only one completion choice is allowed",
                    "type": "server_error",
                }
                fault = ("status", 500, {}, {"error": error})
            if fault is not None and fault[0] == "status":
                _, status, headers, body = fault
                self._send(status, json.dumps(body).encode(), headers)
                return
            payload = json.dumps(fake.answer(request)).encode()
            if fault is not None and fault[0] == "cut":
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload[: len(payload) // 2])
                self.wfile.flush()
                self.close_connection = True
                return
            with fake.lock:
                fake.completed += 1
            self._send(200, payload, {})

        def _send(self, status: int, payload: bytes, headers: dict[str, str]) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            for name, value in headers.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    class Server(ThreadingHTTPServer):
        request_queue_size = 1024  # many connections at once, as a worker's leases open them

    server = Server(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    with serving(server) as fake.url:
        yield fake


@contextlib.contextmanager
def serving(server: ThreadingHTTPServer) -> Iterator[str]:
    """Serve ``server`` on a thread of its own; its URL, until the block ends."""
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
