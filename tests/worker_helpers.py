"""Shared pieces of the worker tests: a fault-injecting transport in front of the real app."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import Any

import http_sf
import httpx

from orchestrator.core.keys import generate_key
from orchestrator.worker.client import WorkerClient

BASE_URL = "http://testserver"
ECON = {"reward_per_sample": 7, "reward_hold_s": 3600}
_ips = itertools.count(1)


def nonce_of(request: httpx.Request) -> str:
    parsed = http_sf.parse(request.headers["signature-input"].encode(), tltype="dictionary")
    ((_, (_, params)),) = parsed.items()
    return str(params["nonce"])


@dataclass
class Seen:
    method: str
    path: str
    nonce: str
    body: bytes
    status: int | None = None


@dataclass
class FaultyTransport(httpx.AsyncBaseTransport):
    """Forwards to the real app, except that the next requests to a path get a planned fault.

    Faults, consumed in order per path:
    ``"503"`` / ``"429:<retry-after>"``: answered here, the app never sees the request;
    ``"forward+502"``: the app handles it, then the answer is lost and a 502 returned;
    ``"forward+timeout"``: the app handles it, then the client gets a read timeout;
    ``"connect"``: a connection error before anything is sent;
    ``"timeout"``: a read timeout without a message, as httpx raises one (the app never sees
    the request);
    ``"node_unhealthy"``: a claim answered here as the server answers a node it has not heard
    from lately (no leases, ``Retry-After: 3600``).
    """

    inner: httpx.AsyncBaseTransport
    faults: dict[str, list[str]] = field(default_factory=dict)
    seen: list[Seen] = field(default_factory=list)
    #: While True, every request fails to connect (the server is down).
    down: bool = False

    def fail(self, path: str, *faults: str) -> None:
        self.faults.setdefault(path, []).extend(faults)

    def to(self, path: str) -> list[Seen]:
        return [s for s in self.seen if s.path == path]

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        seen = Seen(request.method, request.url.path, nonce_of(request), body)
        self.seen.append(seen)
        plan = self.faults.get(request.url.path)
        fault = plan.pop(0) if plan else None
        if fault == "connect" or self.down:
            raise httpx.ConnectError("connection refused (injected)", request=request)
        if fault == "timeout":
            raise httpx.ReadTimeout("", request=request)
        if fault == "503":
            seen.status = 503
            return _problem(503, "not_ready", {})
        if fault == "node_unhealthy":
            seen.status = 200
            body = {"leases": [], "reason": "node_unhealthy", "detail": "injected", "retry_after_s": 3600}
            return httpx.Response(200, json=body, headers={"Retry-After": "3600"})
        if fault is not None and fault.startswith("429:"):
            seen.status = 429
            return _problem(429, "rate_limited", {"Retry-After": fault.split(":", 1)[1]})
        response = await self.inner.handle_async_request(request)
        await response.aread()
        seen.status = response.status_code
        if fault == "forward+502":
            return httpx.Response(502, text="<html>bad gateway</html>", headers={"content-type": "text/html"})
        if fault == "forward+timeout":
            raise httpx.ReadTimeout("read timed out (injected)", request=request)
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


def _problem(status: int, code: str, headers: dict[str, str]) -> httpx.Response:
    return httpx.Response(
        status,
        json={
            "type": f"/problems/{code}",
            "title": code,
            "status": status,
            "detail": "injected",
            "code": code,
        },
        headers={"content-type": "application/problem+json", **headers},
    )


def app_transport(app: Any, ip: str | None = None) -> httpx.ASGITransport:
    n = next(_ips)
    return httpx.ASGITransport(
        app=app, client=(ip or f"10.{90 + n // 65536}.{n // 256 % 256}.{n % 256}", 40000)
    )


def new_client(
    app: Any, *, transport: httpx.AsyncBaseTransport | None = None, provider: bool = True, **kwargs: Any
) -> WorkerClient:
    client = WorkerClient(
        BASE_URL,
        generate_key(),
        generate_key() if provider else None,
        transport=transport or app_transport(app),
        **kwargs,
    )
    client.backoff_base_s = 0.01
    return client


def faulty_client(app: Any, **kwargs: Any) -> tuple[WorkerClient, FaultyTransport]:
    transport = FaultyTransport(app_transport(app))
    return new_client(app, transport=transport, **kwargs), transport


SPECS = {"gpu_model": "NVIDIA L4", "gpu_count": 1, "gpu_memory_mb": 23034, "cpu_cores": 8, "ram_mb": 32768}


async def requested(wire: FaultyTransport, path: str, within: float = 5.0) -> None:
    """Wait until ``path`` was requested through ``wire``."""
    for _ in range(int(within / 0.01)):
        if wire.to(path):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"no request to {path} within {within} s")
