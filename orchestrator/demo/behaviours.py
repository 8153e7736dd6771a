"""What each simulated worker does. Honest workers compute; each dishonest kind tries one trick
the coordinator must catch:

* ``forger``   -- wrong answers with a forged claimed reward of 1.0 (fraud: slashed, then ejected);
* ``replayer`` -- re-sends a request it already sent, byte for byte (401 ``nonce_replayed``);
* ``copier``   -- submits another node's result instead of working (fraud: the seed is not its own);
* ``stale``    -- generates with a policy older than the staleness bound (409 ``policy_stale``);
* ``spoofer``  -- signs requests claiming another node's key id (401 ``signature_invalid``) and
  submits to another node's lease (404 ``assignment_not_found``);
* ``squatter`` -- claims leases and never answers (they expire and are reissued to others);
* ``lazy``     -- returns garbage without doing the work (invalid: never paid).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from nacl.signing import SigningKey

from api_schemas.tasks import Lease, ResultIn, Sample
from orchestrator.core.keys import key_id_of
from orchestrator.core.signing import sign_headers
from orchestrator.worker.backends.arithmetic import ArithmeticBackend
from orchestrator.worker.client import WorkerClient
from orchestrator.worker.errors import OrchestratorAPIError

KINDS = ("forger", "replayer", "copier", "stale", "spoofer", "squatter", "lazy")
HEARTBEAT_EVERY_S = 2.0
TRICK_PAUSE_S = 1.0  # tricks that do no work are tried about once a second


@dataclass
class Blackboard:
    """What workers can overhear from each other (the copier reads it)."""

    recent_results: list[dict[str, Any]] = field(default_factory=list)
    node_ids: list[str] = field(default_factory=list)
    live_leases: dict[str, str] = field(default_factory=dict)  # assignment id -> node id


@dataclass
class WorkerLog:
    kind: str
    node_id: str
    submitted: int = 0
    refused: Counter[str] = field(default_factory=Counter)
    claimed: int = 0
    errors: int = 0
    idle: Counter[str] = field(default_factory=Counter)  # why claims came back empty


@dataclass
class Worker:
    kind: str
    client: WorkerClient
    pool_id: str
    rng: random.Random
    board: Blackboard
    http: httpx.AsyncClient  # raw access for the tricks that need exact bytes
    node_key: SigningKey
    error_rate: float = 0.02
    log: WorkerLog = field(init=False)

    def __post_init__(self) -> None:
        self.log = WorkerLog(self.kind, self.client.node_id)
        self.last_beat = 0.0
        self.backend = ArithmeticBackend(error_rate=self.error_rate if self.kind == "honest" else 0.0)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                worked = await self.step()
            except OrchestratorAPIError as exc:
                self.log.refused[exc.code] += 1
                worked = True
            except (httpx.HTTPError, OSError):
                self.log.errors += 1
                worked = False
            if not worked:
                try:
                    await asyncio.wait_for(stop.wait(), timeout=0.3)
                except TimeoutError:
                    pass

    async def _lease(self) -> Lease | None:
        now = time.monotonic()
        if now - self.last_beat >= HEARTBEAT_EVERY_S:
            self.last_beat = now
            await self.client.heartbeat(leases=list(self._held()))
        out = await self.client.claim(self.pool_id, max_tasks=1)
        if not out.leases:
            self.log.idle[out.reason or "none"] += 1
            return None
        self.log.claimed += 1
        lease = out.leases[0]
        self.board.live_leases[lease.assignment_id] = self.client.node_id
        return lease

    def _held(self) -> list[str]:
        return [a for a, n in self.board.live_leases.items() if n == self.client.node_id]

    async def _submit(self, lease: Lease, result: ResultIn) -> None:
        self.board.live_leases.pop(lease.assignment_id, None)
        await self.client.submit(lease, result)
        self.log.submitted += 1

    async def _honest_result(self, lease: Lease) -> ResultIn:
        samples = await self.backend.generate(lease.task, lease.seed, lease.policy)
        return ResultIn(
            fencing_token=lease.fencing_token, policy_step=lease.policy.step, seed=lease.seed, samples=samples
        )

    async def step(self) -> bool:
        behaviour: Callable[[], Awaitable[bool]] = getattr(self, f"_{self.kind}")
        return await behaviour()

    # ------------------------------------------------------------------ behaviours

    async def _honest(self) -> bool:
        lease = await self._lease()
        if lease is None:
            return False
        result = await self._honest_result(lease)
        await self._submit(lease, result)
        self.board.recent_results.append(result.model_dump(mode="json"))
        del self.board.recent_results[:-50]
        return True

    async def _forger(self) -> bool:
        lease = await self._lease()
        if lease is None:
            return False
        honest = await self._honest_result(lease)
        wrong = [
            Sample(
                completion=f"{s.completion}1",
                finish_reason="stop",
                prompt_tokens=s.prompt_tokens,
                completion_tokens=s.completion_tokens,
            )
            for s in honest.samples
        ]
        await self._submit(lease, honest.model_copy(update={"samples": wrong, "claimed_reward": 1.0}))
        return True

    async def _lazy(self) -> bool:
        lease = await self._lease()
        if lease is None:
            return False
        n = lease.task.sampling.n
        garbage = [
            Sample(completion="lorem ipsum", finish_reason="stop", prompt_tokens=5, completion_tokens=2)
            for _ in range(n)
        ]
        await self._submit(
            lease,
            ResultIn(
                fencing_token=lease.fencing_token,
                policy_step=lease.policy.step,
                seed=lease.seed,
                samples=garbage,
            ),
        )
        return True

    async def _copier(self) -> bool:
        if not self.board.recent_results:
            return False
        lease = await self._lease()
        if lease is None:
            return False
        stolen = self.rng.choice(self.board.recent_results)
        copied = ResultIn.model_validate(
            {**stolen, "fencing_token": lease.fencing_token, "policy_step": lease.policy.step}
        )
        await self._submit(lease, copied)
        return True

    async def _stale(self) -> bool:
        lease = await self._lease()
        if lease is None:
            return False
        result = await self._honest_result(lease)
        old = max(0, lease.policy.step - 3)
        try:
            await self._submit(lease, result.model_copy(update={"policy_step": old}))
        except OrchestratorAPIError as exc:
            self.log.refused[exc.code] += 1
            await self.client.release(lease.assignment_id)
        return True

    async def _squatter(self) -> bool:
        await self.client.heartbeat()  # stays healthy, but never mentions its leases
        out = await self.client.claim(self.pool_id, max_tasks=2)
        self.log.claimed += len(out.leases)
        # Leases held unanswered are what the spoofer overhears and answers: the other workers
        # submit theirs before yielding, so without these it would never find one to try.
        for lease in out.leases:
            self.board.live_leases[lease.assignment_id] = self.client.node_id
        await asyncio.sleep(TRICK_PAUSE_S)
        return bool(out.leases)  # and never answers

    def _signed(self, path: str, payload: dict[str, Any]) -> tuple[bytes, dict[str, str]]:
        body = json.dumps(payload).encode()
        url = str(self.http.base_url.join(path))
        headers = sign_headers(
            self.node_key, method="POST", url=url, body=body, headers={"content-type": "application/json"}
        )
        return body, headers

    async def _post_raw(self, path: str, body: bytes, headers: dict[str, str]) -> None:
        r = await self.http.post(path, content=body, headers=headers)
        if r.status_code >= 400:
            self.log.refused[str(r.json().get("code", r.status_code))] += 1

    async def _replayer(self) -> bool:
        body, headers = self._signed("/v1/nodes/me/heartbeat", {"metrics": {"gpu_util": 0.5}, "leases": []})
        for _ in range(2):  # the second is the replay
            await self._post_raw("/v1/nodes/me/heartbeat", body, headers)
        await asyncio.sleep(TRICK_PAUSE_S)
        return await self._honest()

    async def _spoofer(self) -> bool:
        victims = [n for n in self.board.node_ids if n != self.client.node_id]
        if not victims:
            return False
        victim = self.rng.choice(victims)
        # 1. Claim work as the victim: its key id, our signature.
        body, headers = self._signed("/v1/assignments/claim", {"pool_id": self.pool_id, "max_tasks": 1})
        headers["Signature-Input"] = headers["Signature-Input"].replace(key_id_of(self.node_key), victim)
        await self._post_raw("/v1/assignments/claim", body, headers)
        # 2. Answer for a lease another node holds.
        others = [a for a, n in self.board.live_leases.items() if n != self.client.node_id]
        if others:
            fake = {
                "fencing_token": 1,
                "policy_step": 1,
                "seed": 0,
                "samples": [
                    {"completion": "0", "finish_reason": "stop", "prompt_tokens": 1, "completion_tokens": 1}
                ],
            }
            path = f"/v1/assignments/{others[0]}/result"
            body, headers = self._signed(path, fake)
            await self._post_raw(path, body, headers)
        await asyncio.sleep(TRICK_PAUSE_S)
        return True
