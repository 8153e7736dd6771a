"""The load generator: runs in its own process (spawned by the harness), on its own event loop.

The harness calls :func:`run` in a ``ProcessPoolExecutor`` with one spawned worker, so the server,
the load generator and the harness never share an interpreter or an event loop. Every phase is a
closed loop over keep-alive HTTP/1.1 connections written with asyncio streams (no HTTP client
library on the hot path), on uvloop when it is installed.

Signed requests are built by :class:`FastSigner`, which writes the RFC 9421 signature base for
the fixed component list ``("@method" "@target-uri" "content-digest")`` directly; it is checked
byte for byte against ``orchestrator.core.signing.sign_headers`` before any phase runs (Ed25519
is deterministic). Where a phase's requests are known in advance (heartbeats, claims, results)
they are signed *before* the clock starts, so the timed window spends the generator's CPU on
I/O only; claim -> result cycles sign on the fly.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextvars
import hashlib
import os
import resource
import secrets
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any

import orjson
from nacl.signing import SigningKey

from benchmarks.common import latency_summary
from orchestrator.core.keys import key_id_of
from orchestrator.core.signing import sign_headers

COMPONENTS = '("@method" "@target-uri" "content-digest")'
# Seconds each phase runs before its measured window (set per phase by ``run``).
_WARMUP: contextvars.ContextVar[float] = contextvars.ContextVar("warmup_s", default=0.0)


class FastSigner:
    """RFC 9421 signatures for one key, without the generic library on the hot path."""

    def __init__(self, seed: bytes, host: str) -> None:
        self.key = SigningKey(seed)
        self.keyid = key_id_of(self.key)
        self.host = host

    def headers(
        self, method: str, path: str, body: bytes, *, created: int | None = None, nonce: str = ""
    ) -> str:
        digest = "sha-256=:" + base64.b64encode(hashlib.sha256(body).digest()).decode() + ":"
        created = int(time.time()) if created is None else created
        nonce = nonce or secrets.token_urlsafe(16)
        params = f'{COMPONENTS};created={created};keyid="{self.keyid}";alg="ed25519";nonce="{nonce}"'
        base = (
            f'"@method": {method}\n"@target-uri": http://{self.host}{path}\n'
            f'"content-digest": {digest}\n"@signature-params": {params}'
        )
        signature = base64.b64encode(self.key.sign(base.encode()).signature).decode()
        return (
            f"Content-Digest: {digest}\r\n"
            f"Signature-Input: pyhms={params}\r\n"
            f"Signature: pyhms=:{signature}:\r\n"
        )

    def request(self, path: str, body: bytes, extra: str = "") -> bytes:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{extra}{self.headers('POST', path, body)}\r\n"
        )
        return head.encode() + body


def self_check(host: str = "127.0.0.1:8000") -> None:
    """FastSigner must produce exactly what the reference client signs."""
    seed = bytes(range(32))
    body = b'{"x": 1}'
    fast = FastSigner(seed, host).headers("POST", "/v1/x", body, created=1_700_000_000, nonce="n0")
    ref = sign_headers(
        SigningKey(seed),
        method="POST",
        url=f"http://{host}/v1/x",
        body=body,
        created=1_700_000_000,
        nonce="n0",
    )
    expected = "".join(f"{k}: {ref[k]}\r\n" for k in ("Content-Digest", "Signature-Input", "Signature"))
    if fast != expected:
        raise AssertionError(f"FastSigner disagrees with sign_headers:\n{fast}\n!=\n{expected}")


# ------------------------------------------------------------------ HTTP/1.1 over asyncio streams


class Conn:
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except OSError:
                pass
            self.writer = None

    async def request(self, data: bytes) -> tuple[int, bytes]:
        if self.writer is None:
            await self.open()
        assert self.reader is not None
        assert self.writer is not None
        self.writer.write(data)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        lower = head.lower()
        i = lower.find(b"\r\ncontent-length:")
        if i < 0:
            raise RuntimeError(f"response without Content-Length: {head[:200]!r}")
        j = lower.index(b"\r\n", i + 2)
        body = await self.reader.readexactly(int(lower[i + 17 : j]))
        if b"\r\nconnection: close" in lower:
            await self.close()
        return status, body


class Recorder:
    """Latencies, statuses and a per-second timeline of successes (plus named extra counters and
    latency lists), all forgotten by :meth:`reset` at the end of the warm-up."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.latencies: list[float] = []
        self.ok = 0
        self.statuses: collections.Counter[int] = collections.Counter()
        self.timeline: collections.Counter[int] = collections.Counter()
        self.errors: collections.Counter[str] = collections.Counter()
        self.counts: collections.Counter[str] = collections.Counter()
        self.extra_latencies: collections.defaultdict[str, list[float]] = collections.defaultdict(list)
        self.t0 = time.monotonic()

    def record(self, status: int, latency: float, ok: bool, units: int = 1) -> None:
        self.latencies.append(latency)
        self.statuses[status] += 1
        if ok:
            self.ok += units
            self.timeline[int(time.monotonic() - self.t0)] += units

    def result(self, elapsed: float, **extra: Any) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "requests": len(self.latencies),
            "elapsed_s": round(elapsed, 3),
            "per_s": round(self.ok / elapsed, 1) if elapsed else 0.0,
            **latency_summary(self.latencies),
            "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
            "errors": dict(self.errors),
            "timeline": [self.timeline.get(s, 0) for s in range(int(elapsed) + 1)],
            **extra,
        }


async def closed_loop(
    host: str,
    port: int,
    concurrency: int,
    duration_s: float,
    step: Callable[[int, Conn, Recorder], Awaitable[bool]],
) -> tuple[Recorder, float]:
    """Run ``step(worker, conn, rec)`` on ``concurrency`` connections until the time is up or
    every step returned False (nothing left to send)."""
    conns = [Conn(host, port) for _ in range(concurrency)]
    await asyncio.gather(*(c.open() for c in conns))
    rec = Recorder()
    warmup_s = float(_WARMUP.get(0.0))
    stop_at = time.monotonic() + warmup_s + duration_s

    async def worker(i: int) -> None:
        conn = conns[i]
        while time.monotonic() < stop_at:
            try:
                if not await step(i, conn, rec):
                    return
            except (OSError, asyncio.IncompleteReadError, RuntimeError) as exc:
                rec.errors[type(exc).__name__] += 1
                await conn.close()
                await asyncio.sleep(0.05)

    start = time.monotonic()
    rec.t0 = start
    warm = asyncio.get_running_loop().call_later(warmup_s, rec.reset) if warmup_s else None
    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    if warm is not None:
        warm.cancel()
    elapsed = time.monotonic() - rec.t0  # from the end of the warm-up, if it ended
    await asyncio.gather(*(c.close() for c in conns))
    return rec, elapsed


# ------------------------------------------------------------------ phases


def _host(spec: dict[str, Any]) -> str:
    return f"127.0.0.1:{spec['port']}"


async def phase_bare(spec: dict[str, Any]) -> dict[str, Any]:
    request = f"GET {spec.get('path', '/healthz')} HTTP/1.1\r\nHost: {_host(spec)}\r\n\r\n".encode()

    async def step(i: int, conn: Conn, rec: Recorder) -> bool:
        t0 = time.perf_counter()
        status, _ = await conn.request(request)
        rec.record(status, time.perf_counter() - t0, status == 200)
        return True

    rec, elapsed = await closed_loop("127.0.0.1", spec["port"], spec["concurrency"], spec["duration_s"], step)
    return rec.result(elapsed)


async def _run_queue(spec: dict[str, Any], queue: collections.deque[bytes], ok_status: int) -> dict[str, Any]:
    async def step(i: int, conn: Conn, rec: Recorder) -> bool:
        if not queue:
            return False
        data = queue.popleft()
        t0 = time.perf_counter()
        status, body = await conn.request(data)
        rec.record(status, time.perf_counter() - t0, status == ok_status)
        if status != ok_status and len(rec.errors) < 20:
            rec.errors[f"{status}:{body[:120].decode(errors='replace')}"] += 1
        return True

    rec, elapsed = await closed_loop("127.0.0.1", spec["port"], spec["concurrency"], spec["duration_s"], step)
    return rec.result(elapsed, exhausted=not queue)


async def phase_heartbeat(spec: dict[str, Any]) -> dict[str, Any]:
    """Signed heartbeats from a sample of nodes, signed before the clock starts."""
    signers = [FastSigner(seed, _host(spec)) for seed in spec["seeds"]]
    body = orjson.dumps({"metrics": {"gpu_util": 0.93, "mem_used_mb": 61234}})
    t0 = time.perf_counter()
    queue = collections.deque(
        signers[i % len(signers)].request("/v1/nodes/me/heartbeat", body) for i in range(spec["budget"])
    )
    signing_s = time.perf_counter() - t0
    return await _run_queue(spec, queue, 200) | {"presign_s": round(signing_s, 2), "presigned": len(queue)}


def result_body(lease: dict[str, Any], answer: str) -> bytes:
    return orjson.dumps(
        {
            "fencing_token": lease["fencing_token"],
            "policy_step": lease["policy"]["step"],
            "seed": lease["seed"],
            "samples": [
                {"completion": answer, "finish_reason": "stop", "prompt_tokens": 12, "completion_tokens": 1}
                for _ in range(lease["task"]["sampling"].get("n", 1))
            ],
            "claimed_reward": 1.0,
        }
    )


async def phase_results(spec: dict[str, Any]) -> dict[str, Any]:
    """Signed result submissions for leases claimed earlier, signed before the clock starts."""
    signers = {
        seed: FastSigner(seed, _host(spec)) for seed in {lease["seed_key"] for lease in spec["leases"]}
    }
    t0 = time.perf_counter()
    queue = collections.deque(
        signers[lease["seed_key"]].request(f"/v1/assignments/{lease['assignment_id']}/result", lease["body"])
        for lease in spec["leases"][: spec["budget"]]
    )
    signing_s = time.perf_counter() - t0
    return await _run_queue(spec, queue, 201) | {"presign_s": round(signing_s, 2), "presigned": len(queue)}


async def phase_claims(spec: dict[str, Any]) -> dict[str, Any]:
    """Claim-only: each connection is one node claiming ``batch`` at a time; leases are kept."""
    host = _host(spec)
    batch = spec["batch"]
    body = orjson.dumps({"pool_id": spec["pool_id"], "max_tasks": batch})
    signers = [FastSigner(seed, host) for seed in spec["seeds"]]
    t0 = time.perf_counter()
    queues = [
        collections.deque(s.request("/v1/assignments/claim", body) for _ in range(spec["budget"]))
        for s in signers
    ]
    signing_s = time.perf_counter() - t0
    leases: list[dict[str, Any]] = []
    answer = spec.get("answer", "42")

    async def step(i: int, conn: Conn, rec: Recorder) -> bool:
        if not queues[i]:
            return False
        data = queues[i].popleft()
        t0 = time.perf_counter()
        status, raw = await conn.request(data)
        latency = time.perf_counter() - t0
        if status != 200:
            rec.record(status, latency, False)
            rec.errors[f"{status}:{raw[:120].decode(errors='replace')}"] += 1
            return True
        out = orjson.loads(raw)
        got = out["leases"]
        rec.record(status, latency, bool(got), units=len(got))
        if not got:
            rec.counts["no_work:" + (out.get("reason") or "?")] += 1
            return out.get("reason") != "no_tasks"
        for lease in got:
            leases.append(
                {
                    "seed_key": spec["seeds"][i],
                    "assignment_id": lease["assignment_id"],
                    "body": result_body(lease, answer),
                }
            )
        return True

    rec, elapsed = await closed_loop("127.0.0.1", spec["port"], len(signers), spec["duration_s"], step)
    claims = rec.statuses.get(200, 0)
    return rec.result(
        elapsed,
        claim_requests_per_s=round(claims / elapsed, 1) if elapsed else 0.0,
        no_work=dict(rec.counts),
        presign_s=round(signing_s, 2),
        leases=leases,
    )


async def phase_cycle(spec: dict[str, Any]) -> dict[str, Any]:
    """Simulated workers: claim ``batch`` -> sign and submit each result, signed on the fly.

    ``ok`` counts accepted results; claim and result latencies are kept apart.
    """
    host = _host(spec)
    signers = [FastSigner(seed, host) for seed in spec["seeds"]]
    claim_body = orjson.dumps({"pool_id": spec["pool_id"], "max_tasks": spec["batch"]})
    answer = spec.get("answer", "42")

    async def step(i: int, conn: Conn, rec: Recorder) -> bool:
        signer = signers[i]
        t0 = time.perf_counter()
        status, raw = await conn.request(signer.request("/v1/assignments/claim", claim_body))
        rec.extra_latencies["claim"].append(time.perf_counter() - t0)
        if status != 200:
            rec.errors[f"claim {status}:{raw[:120].decode(errors='replace')}"] += 1
            await asyncio.sleep(0.05)
            return True
        out = orjson.loads(raw)
        if not out["leases"]:
            rec.counts["no_work:" + (out.get("reason") or "?")] += 1
            await asyncio.sleep(min(1.0, float(out.get("retry_after_s") or 1)) / 4)
            return True
        rec.counts["claimed"] += len(out["leases"])
        for lease in out["leases"]:
            path = f"/v1/assignments/{lease['assignment_id']}/result"
            t1 = time.perf_counter()
            status, raw = await conn.request(signer.request(path, result_body(lease, answer)))
            rec.record(status, time.perf_counter() - t1, status == 201)
            if status != 201:
                rec.errors[f"result {status}:{raw[:120].decode(errors='replace')}"] += 1
        return True

    rec, elapsed = await closed_loop("127.0.0.1", spec["port"], len(signers), spec["duration_s"], step)
    claimed = rec.counts["claimed"]
    return rec.result(
        elapsed,
        claimed=claimed,
        claims_per_s=round(claimed / elapsed, 1) if elapsed else 0.0,
        claim_latency=latency_summary(rec.extra_latencies["claim"]),
        result_latency=latency_summary(rec.latencies),
        no_work={k: v for k, v in rec.counts.items() if k.startswith("no_work:")},
    )


async def phase_raw(spec: dict[str, Any]) -> dict[str, Any]:
    """The floor any PostgreSQL queue pays: asyncpg ``FOR UPDATE SKIP LOCKED`` on a plain table.

    ``mode="lease"``: one transaction takes ``batch`` open rows and marks them leased.
    ``mode="cycle"``: the same, then a second statement marks them done (claim + result).
    """
    import asyncpg

    batch, mode = spec["batch"], spec["mode"]
    pool = await asyncpg.create_pool(spec["dsn"], min_size=spec["concurrency"], max_size=spec["concurrency"])
    rec = Recorder()
    warmup_s = float(spec.get("warmup_s", 0.0))
    stop_at = time.monotonic() + warmup_s + spec["duration_s"]
    done_lat: list[float] = []

    async def worker(i: int) -> None:
        while time.monotonic() < stop_at:
            t0 = time.perf_counter()
            async with pool.acquire() as c, c.transaction():
                rows = await c.fetch(
                    "SELECT id FROM bench_jobs WHERE status = 'open' ORDER BY id "
                    "LIMIT $1 FOR UPDATE SKIP LOCKED",
                    batch,
                )
                if not rows:
                    return
                ids = [r["id"] for r in rows]
                await c.execute(
                    "UPDATE bench_jobs SET status = 'leased', node = $2 WHERE id = ANY($1::bigint[])",
                    ids,
                    str(i),
                )
            rec.record(200, time.perf_counter() - t0, True, units=len(ids))
            if mode == "cycle":
                t1 = time.perf_counter()
                async with pool.acquire() as c:
                    await c.execute(
                        "UPDATE bench_jobs SET status = 'done' WHERE id = ANY($1::bigint[]) AND node = $2",
                        ids,
                        str(i),
                    )
                done_lat.append(time.perf_counter() - t1)

    start = time.monotonic()
    rec.t0 = start
    warm = asyncio.get_running_loop().call_later(warmup_s, rec.reset) if warmup_s else None
    await asyncio.gather(*(worker(i) for i in range(spec["concurrency"])))
    if warm is not None:
        warm.cancel()
    elapsed = time.monotonic() - rec.t0  # from the end of the warm-up, if it ended
    await pool.close()
    return rec.result(elapsed, claim_requests_per_s=round(len(rec.latencies) / elapsed, 1))


def phase_ed25519(spec: dict[str, Any]) -> dict[str, Any]:
    """Ed25519 verifications per second on one core (PyNaCl), and full request verifications."""
    from orchestrator.core.signing import verify_request

    key = SigningKey.generate()
    message = os.urandom(spec.get("message_bytes", 256))
    signed = key.sign(message)
    verify_key = key.verify_key
    out: dict[str, Any] = {}
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < spec["duration_s"]:
        for _ in range(500):
            verify_key.verify(signed)
        n += 500
    out["ed25519_verify_per_s"] = round(n / (time.perf_counter() - t0), 1)
    url = "http://127.0.0.1:8000/v1/nodes/me/heartbeat"
    body = b'{"metrics": {"gpu_util": 0.93}}'
    signed_headers = [list(sign_headers(key, method="POST", url=url, body=body).items()) for _ in range(500)]
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < spec["duration_s"]:
        for headers in signed_headers:
            verify_request(
                method="POST", url=url, query="", headers=headers, body=body, now=time.time(), window_s=300
            )
        n += len(signed_headers)
    out["verify_request_per_s"] = round(n / (time.perf_counter() - t0), 1)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < spec["duration_s"]:
        for _ in range(100):
            sign_headers(key, method="POST", url=url, body=body)
        n += 100
    out["sign_headers_per_s"] = round(n / (time.perf_counter() - t0), 1)
    signer = FastSigner(bytes(key), "127.0.0.1:8000")
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < spec["duration_s"]:
        for _ in range(100):
            signer.request("/v1/nodes/me/heartbeat", body)
        n += 100
    out["fast_sign_per_s"] = round(n / (time.perf_counter() - t0), 1)
    return out


PHASES: dict[str, Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]] = {
    "bare": phase_bare,
    "heartbeat": phase_heartbeat,
    "results": phase_results,
    "claims": phase_claims,
    "cycle": phase_cycle,
    "raw": phase_raw,
}


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Entry point in the load-generator process: one phase, on a fresh event loop."""
    kind = spec["kind"]
    if kind == "pid":
        return {"pid": os.getpid()}
    if kind == "self_check":
        self_check(f"127.0.0.1:{spec.get('port', 8000)}")
        return {"ok": True}
    _WARMUP.set(float(spec.get("warmup_s", 0.0)))
    cpu0 = _cpu_s()
    if kind == "ed25519":
        out = phase_ed25519(spec)
    else:
        try:
            import uvloop

            out = uvloop.run(PHASES[kind](spec))
        except ImportError:
            out = asyncio.run(PHASES[kind](spec))
    out["loadgen_cpu_s"] = round(_cpu_s() - cpu0, 2)
    return out


def chunks(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]
