"""The worker loop: register, join, heartbeat, claim, generate, submit, stop cleanly.

``run_worker`` runs until ``stop`` is set (or ``max_tasks`` leases have been worked): it
registers the provider and node (idempotently), joins the pool, heartbeats in the background
every ``next_heartbeat_in_s`` with the ids of the leases it holds (abandoning those the
server names in ``drop_leases``), sooner when a lease would run out before then (by each
lease's deadline, from its claim and each beat's ``lease_deadlines``, on the server's clock:
``_next_beat_at``; a beat refused with a ``Retry-After`` that would let a lease run out is
tried again once just before its deadline: ``WorkerClient.heartbeat``'s ``deadlines``), and
keeps up to ``concurrency`` leases in flight, each run by the backend and submitted. A claim
asks for at most ``CLAIM_MAX_TASKS`` leases (the server's limit); it claims again until
``concurrency`` leases are held. A claim with no work
waits for the server's ``Retry-After``; one refused for the pool's lease cap
(``lease_cap_reached``, the node's own leases) only until one of its leases ends, if sooner.
A result is submitted until the server answers, through an outage of any length (the lease
stays in flight, and heartbeats keep it alive once the server is back).

On stop it claims nothing more, gives the leases it holds ``grace_s`` seconds to finish and
releases the rest, so their replicas are reissued at once, then returns its ``WorkerStats``.
A claim under way at the stop ends at once if it is waiting to be retried (429/503); one whose
request is with the server gets the same ``grace_s`` to answer (its leases are then released)
and is abandoned after that: leases the server may have granted it are not heard of in this
run (they expire on the server, or the next run takes them up). At the start, and after a claim
that failed (its answer may have been lost), it asks the server for the node's live leases and
works those it does not know (``_recover``). A result still being submitted (the server
unreachable) gets the same ``grace_s`` and is then given up; its lease expires on the server.
Signal handling belongs to the caller (the CLI installs SIGINT/SIGTERM handlers that set
``stop``). It never leaves the pool on stop: leaving would start unbonding the stake.

It ends on its own, settling its leases as at the end of ``max_tasks`` (those running finish,
but a revoked node's, whose results the server would refuse, stop at once), and raises
``WorkerEnded`` with its stats, when waiting would bring no more work: a claim answered
``pool_not_active`` or ``not_a_member`` and the node's record (``GET /v1/nodes/me``) shows its
membership in the pool ended (``pool_completed``: completing a pool ends every membership;
``membership_ended``: left, ejected or rejected; a pending one waits, as a paused pool does),
or a refusal as ``node_banned`` that says its provider was retired (``provider_retired: true``,
which a worker without the provider key goes by) or, from a server that does not say, while the
provider key is refused as ``provider_retired`` (``provider_retired``: its earnings, its
successor's now, are no longer shown).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import datetime as dt
import functools
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx
import structlog
from nacl.signing import SigningKey

from api_schemas.identity import HeartbeatOut, NodeSpecs
from api_schemas.tasks import CLAIM_MAX_TASKS, ClaimOut, Lease, ResultIn, ResultOut
from orchestrator import __version__
from orchestrator.core.keys import read_key_file
from orchestrator.worker.backends import Backend, BackendError, Generation, create_backend
from orchestrator.worker.client import WorkerClient
from orchestrator.worker.errors import OrchestratorAPIError, WorkerEnded

log = structlog.get_logger(__name__)

# Refusals that waiting will not fix: bad signatures or clock, a banned node, no such pool.
FATAL_STATUSES = frozenset({401, 403, 404})
RETRYABLE_CODES = frozenset({"nonce_replayed"})
# A submission refused because the server already took the lease back.
LEASE_GONE_CODES = frozenset({"lease_expired", "task_cancelled", "deadline_passed"})
# Answers that say the server did not get to a request (overloaded, restarting, a proxy with no
# server behind it): a result is submitted again, however long the outage, until the server
# answers otherwise or a stop's grace period ends.
NOT_REACHED_STATUSES = frozenset({429, 502, 503, 504})
# No-work reasons after which the node's membership is read (``GET /v1/nodes/me``): the run
# ends once it has ended. A member meets ``pool_not_active`` only once the pool has completed
# (a pool that is not active yet has no members: joins are refused), which ends every
# membership; ``not_a_member`` with a pending membership waits for the operator's approval.
MEMBERSHIP_REASONS = frozenset({"pool_not_active", "not_a_member"})
# Memberships that ended: no work comes to the node in the pool until it joins again.
ENDED_MEMBERSHIPS = frozenset({"left", "ejected", "rejected"})
# The least time between two beats that a lease's deadline brings forward (``_next_beat_at``).
MIN_BEAT_S = 1.0


def says_retired(exc: BaseException) -> bool:
    """A refusal that says an admin retired the provider: of its key (``provider_retired``), or
    of the node key (``node_banned`` with ``provider_retired: true``; the node is revoked for
    good, as its provider's key is)."""
    if not isinstance(exc, OrchestratorAPIError):
        return False
    return exc.code == "provider_retired" or (
        exc.code == "node_banned" and exc.body.get("provider_retired") is True
    )


def local_specs() -> NodeSpecs:
    """This machine as a CPU-only node: its cores and RAM."""
    cores = max(1, min(1024, os.cpu_count() or 1))
    try:
        ram_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
    except (AttributeError, ValueError, OSError):
        ram_mb = 1024
    ram_mb = max(256, min(16_777_216, ram_mb))
    return NodeSpecs(gpu_model=None, gpu_count=0, gpu_memory_mb=0, cpu_cores=cores, ram_mb=ram_mb)


@dataclass
class WorkerConfig:
    """What one worker process runs. Give the keys, or the paths of their key files."""

    server: str
    pool_id: str
    node_key: SigningKey | None = None
    provider_key: SigningKey | None = None
    node_key_path: Path | None = None
    provider_key_path: Path | None = None
    backend: str = "arithmetic"
    backend_options: dict[str, str] = field(default_factory=dict)
    #: Leases held (and run) at once.
    concurrency: int = 1
    #: Stop after working this many leases; None runs until stopped.
    max_tasks: int | None = None
    #: The node's hardware; None registers this machine as a CPU-only node.
    specs: NodeSpecs | dict[str, Any] | None = None
    version: str = __version__
    invite_code: str | None = None
    #: Seconds the leases held at a stop get to finish before they are released.
    grace_s: float = 30.0
    #: A generation running longer is cancelled and its lease given back as failed (a hung
    #: backend would otherwise hold it for ever: the heartbeats extend it). 0: no limit.
    generate_timeout_s: float = 3600.0
    #: How often this node's verdicts are polled for the stats (signed by the node key).
    stats_interval_s: float = 5.0
    #: How often the provider's balance is read for the earnings (needs the provider key).
    #: Every machine of a provider reads it with the provider's key, whose request budget the
    #: provider's registrations share: at 30 s, thousands of machines fit in the default one.
    earnings_interval_s: float = 30.0
    #: Wait after a no-work claim whose answer gives no Retry-After.
    idle_wait_s: float = 5.0
    #: While its membership waits for the operator's approval, how often the node's record is
    #: read (``GET /v1/nodes/me``) to notice a rejection. The claims, every 5 s then (the
    #: server's Retry-After), notice the approval; the record read is only for the rejection.
    pending_read_interval_s: float = 60.0
    #: Cap of the backoff after failed claims.
    max_error_backoff_s: float = 30.0
    timeout_s: float = 30.0
    max_retries: int = 5

    def __post_init__(self) -> None:
        if not 1 <= self.concurrency <= 1024:
            raise ValueError("concurrency must be between 1 and 1024")
        if self.max_tasks is not None and self.max_tasks < 1:
            raise ValueError("max_tasks must be at least 1 (or None)")
        if self.generate_timeout_s < 0:
            raise ValueError("generate_timeout_s must be 0 (no limit) or more")
        if self.node_key is None and self.node_key_path is None:
            raise ValueError("give the node key or the path of its key file")

    async def load_keys(self) -> tuple[SigningKey, SigningKey | None]:
        node = self.node_key
        if node is None:
            assert self.node_key_path is not None
            node = await anyio.to_thread.run_sync(read_key_file, self.node_key_path)
        provider = self.provider_key
        if provider is None and self.provider_key_path is not None:
            provider = await anyio.to_thread.run_sync(read_key_file, self.provider_key_path)
        return node, provider


@dataclass
class WorkerStats:
    node_id: str = ""
    #: starting | running | stopping | stopped
    state: str = "starting"
    #: Leases received.
    claimed: int = 0
    #: Leases worked through to a submission attempt.
    tasks_done: int = 0
    #: Results the server recorded.
    submitted: int = 0
    #: Verdicts on this node's results.
    accepted: int = 0
    rejected: int = 0
    #: Results recorded whose verdict has not been seen yet (the verifier decides them after
    #: the submission; a worker stopping right after its last submission shows them here).
    awaiting_verdict: int = 0
    #: Leases given back (backend failures, stop).
    released: int = 0
    #: Leases the server took back (drop_leases, lease_expired, task_cancelled, deadline_passed).
    dropped: int = 0
    #: Leases the node held on the server without knowing it, taken up (counted in claimed
    #: too): a previous run's, or a claim's whose answer was lost.
    recovered: int = 0
    errors: int = 0
    #: The provider's rewards earned (pending + claimable + withdrawn), from its balance.
    earnings: int | None = None
    in_flight: int = 0
    #: Why the last claim got no work (no_tasks, not_a_member, ...).
    idle_reason: str | None = None


ProgressCallback = Callable[[WorkerStats], None]


async def run_worker(
    config: WorkerConfig,
    *,
    stop: asyncio.Event,
    transport: httpx.AsyncBaseTransport | None = None,
    progress: ProgressCallback | None = None,
    backend: Backend | None = None,
) -> WorkerStats:
    """Run one worker until ``stop`` is set or ``config.max_tasks`` leases are worked.

    ``backend``: one built already from ``config.backend`` and its options (the command line
    builds it first, to refuse bad options as a usage error); closed at the end like one built
    here.

    Raises ``OrchestratorAPIError`` for refusals that waiting will not fix (a refused join,
    an unknown pool, a banned node, a bad signature), after giving back the leases it holds;
    ``WorkerEnded`` (with the final stats) when the pool completed, the node's membership
    ended or its provider was retired (with or without the provider key).
    """
    try:
        node_key, provider_key = await config.load_keys()
        if backend is None:
            backend = create_backend(config.backend, config.backend_options)
    except BaseException:
        close = getattr(backend, "aclose", None)
        if close is not None:
            await close()
        raise
    try:
        async with WorkerClient(
            config.server,
            node_key,
            provider_key,
            transport=transport,
            timeout_s=config.timeout_s,
            max_retries=config.max_retries,
        ) as client:
            worker = _Worker(
                config, client, backend, stop, progress, has_provider_key=provider_key is not None
            )
            with structlog.contextvars.bound_contextvars(node_id=client.node_id, pool_id=config.pool_id):
                return await worker.run()
    finally:
        close = getattr(backend, "aclose", None)
        if close is not None:
            await close()


def _why(exc: BaseException) -> str:
    """What a failed request logs: its message, or the exception's name when it has none (an
    httpx timeout's message is empty, and the line said ``error=`` alone)."""
    return str(exc)[:200] or type(exc).__name__


class _Worker:
    def __init__(
        self,
        config: WorkerConfig,
        client: WorkerClient,
        backend: Backend,
        stop: asyncio.Event,
        progress: ProgressCallback | None,
        *,
        has_provider_key: bool,
    ) -> None:
        self.has_provider_key = has_provider_key
        self.config = config
        self.client = client
        self.backend = backend
        self.stop = stop
        self.progress = progress
        self.stats = WorkerStats(node_id=client.node_id)
        self.running: dict[str, asyncio.Task[None]] = {}
        #: Leases whose samples are made and whose result is being submitted: never cancelled.
        self.submitting: set[str] = set()
        #: Set once the held leases are settled: the background loops end.
        self.closing = asyncio.Event()
        #: Leases in flight that the server took back (a beat's ``drop_leases``) and whose work
        #: is still ending: no beat names them again, and a stop does not give them back. One is
        #: forgotten once its work has ended (kept while the leases are being finished, which
        #: reads it after their work ends), so it holds at most the leases in flight.
        self.dropped: set[str] = set()
        #: Set while ``_finish_leases`` settles the leases held at the end of the run.
        self.finishing = False
        #: Results recorded whose verdict this run has not counted yet; one is forgotten once
        #: counted (in ``stats``), so a run of any length keeps nothing per decided result.
        self.awaiting: set[int] = set()
        #: When the stop was first seen (loop time): the grace period runs from it.
        self.stopped_at: float | None = None
        #: Ask the server for the node's live leases before the next claim: at the start (a
        #: previous run's), and after a claim that failed (its answer may have been lost).
        self.recover = True
        #: Leases in flight that have ended, ever: a claim compares it across its round trip.
        self.ended = 0
        #: When the node's record last showed its membership pending (monotonic clock): its
        #: record is read again only ``pending_read_interval_s`` later (``_membership_ended``).
        self._pending_read_at: float | None = None
        #: Why the run ends on its own (``WorkerEnded``'s reason and detail); None: it does not.
        self.end: tuple[str, str] | None = None
        #: Set with ``end``: the claim loop's waits end at once, as on a stop.
        self.ending = asyncio.Event()
        #: The provider was retired (its key refused as ``provider_retired``, or the node's as
        #: ``node_banned`` saying so): its earnings are not shown.
        self.provider_retired = False
        #: The node's provider, as its record gives it (for a worker without the provider key).
        self.provider_id: str | None = None
        #: Each lease in flight's deadline on the server, on the event loop's clock: from its
        #: claim, then from each beat's ``lease_deadlines``. The heartbeats are timed by them.
        self.deadlines: dict[str, float] = {}
        #: Set when leases are taken: the heartbeat loop works out its next beat again.
        self.leases_taken = asyncio.Event()

    # ------------------------------------------------------------------ top level

    async def run(self) -> WorkerStats:
        self._emit()
        try:
            interval = await self._start()
        except (OrchestratorAPIError, httpx.HTTPError) as exc:
            if says_retired(exc):
                self._retired()  # its registration or its node refused: nothing is held yet
                assert self.end is not None
                raise WorkerEnded(*self.end, self._stopped()) from exc
            if not self.stop.is_set():
                raise
            # Stopped while the start waited out a retry (the server away or busy): nothing is
            # held yet, so the run ends at once, as a stop.
            return self._stopped()
        background = [
            asyncio.create_task(self._heartbeat_loop(interval), name="worker-heartbeat"),
            asyncio.create_task(self._stats_loop(), name="worker-stats"),
        ]
        try:
            await self._claim_loop()
        finally:
            self._set_state("stopping")
            try:
                await self._finish_leases()
            finally:
                # Not cancelled: a request in flight finishes (cancelling it would, with an
                # in-process transport, cancel the server's own handler mid-transaction).
                self.closing.set()
                await asyncio.gather(*background, return_exceptions=True)
        await self._refresh(earnings=not self.provider_retired)
        stats = self._stopped()
        if self.end is not None:
            raise WorkerEnded(*self.end, stats)
        return stats

    def _stopped(self) -> WorkerStats:
        self._set_state("stopped")
        log.info("worker_stopped", **_summary(self.stats))
        return dataclasses.replace(self.stats)

    async def _start(self) -> float:
        """Register, join and beat once (a node is claimable once it is healthy)."""
        c = self.config
        if self.has_provider_key:
            specs = c.specs if c.specs is not None else local_specs()
            node = await self.client.register(specs, c.version, stop=self.stop)
        else:
            node = await self.client.me(stop=self.stop)  # registered by its provider beforehand
            self.provider_id = node.provider_id
        membership = await self.client.join(c.pool_id, c.invite_code, stop=self.stop)
        log.info(
            "worker_joined",
            node_status=node.status,
            membership=membership.status.value,
            backend=self.backend.name,
            concurrency=c.concurrency,
        )
        if membership.status.value == "pending":
            log.warning("membership_pending", detail="the pool's operator must approve this node")
        beat = await self.client.heartbeat(metrics={"in_flight": 0.0}, stop=self.stop)
        self._set_state("running")
        return beat.next_heartbeat_in_s

    # ------------------------------------------------------------------ claiming

    async def _claim_loop(self) -> None:
        c = self.config
        failures = 0
        beat_for_claim = False  # a beat was sent for a claim refused as node_unhealthy
        while not self.stop.is_set() and not self.ending.is_set():
            if c.max_tasks is not None and self.stats.claimed >= c.max_tasks:
                return
            free = c.concurrency - len(self.running)
            if free <= 0:
                await self._wait_for_slot(ending=True)
                continue
            if self.recover and await self._recover():
                continue  # slots were filled: count them again
            want = min(free, CLAIM_MAX_TASKS)
            if c.max_tasks is not None:
                want = min(want, c.max_tasks - self.stats.claimed)
            ended_before = self.ended
            try:
                claim = await self._claim(want)
                if claim is None:  # stopped, the claim abandoned
                    return
            except OrchestratorAPIError as exc:
                if exc.status in FATAL_STATUSES and exc.code not in RETRYABLE_CODES:
                    log.error("claim_refused", status=exc.status, code=exc.code, detail=exc.detail)
                    await self._refused(exc)
                    return
                failures += 1
                self._error("claim_failed", status=exc.status, code=exc.code)
                self.recover = True
                await self._pause(exc.retry_after or self._backoff(failures), ending=True)
                continue
            except httpx.HTTPError as exc:
                failures += 1
                self._error("claim_failed", error=type(exc).__name__)
                self.recover = True
                await self._pause(self._backoff(failures), ending=True)
                continue
            failures = 0
            if claim.reason != "node_unhealthy":
                beat_for_claim = False
            if not claim.leases:
                if self.stats.idle_reason != claim.reason:
                    log.info("no_work", reason=claim.reason, retry_after_s=claim.retry_after_s)
                self.stats.idle_reason = claim.reason
                self._emit()
                if claim.reason in MEMBERSHIP_REASONS and await self._membership_ended(claim):
                    return
                wait = float(claim.retry_after_s or c.idle_wait_s)
                if claim.reason == "node_unhealthy" and not beat_for_claim:
                    # The server has not had a beat lately (it was down, or restarted and lost
                    # the node's last beats): beat now, and claim again at once if that made
                    # the node healthy, rather than wait out the Retry-After.
                    beat_for_claim = True
                    beat = await self._beat(stop=self.stop)  # the claim loop's: ends on stop
                    if beat is not None and beat.status == "healthy":
                        continue
                if claim.reason == "lease_cap_reached":
                    # The cap counts this node's own leases: one of them ending makes room
                    # before the Retry-After has passed, or made it while the claim was away.
                    if self.ended != ended_before:
                        continue
                    if self.running:
                        await self._wait_for_slot(at_most_s=wait, ending=True)
                        continue
                await self._pause(wait, ending=True)
                continue
            self.stats.idle_reason = None
            self.stats.claimed += len(claim.leases)
            if self.stop.is_set():  # stopped while the claim was in flight: give them back
                await asyncio.gather(*(self._release(lease.assignment_id) for lease in claim.leases))
                return
            self._start_work(claim.leases)

    async def _membership_ended(self, claim: ClaimOut) -> bool:
        """After a claim answered ``pool_not_active`` or ``not_a_member``: reads the node's
        record and, if its membership in the pool has ended (or there is none), sets why the run
        ends and answers True. A pending membership (an ``approval`` pool's operator has not
        decided yet) or an active one (approved since the claim) waits, as does a failed read."""
        pool = self.config.pool_id
        now = time.monotonic()
        if (
            claim.reason == "not_a_member"
            and self._pending_read_at is not None
            and now - self._pending_read_at < self.config.pending_read_interval_s
        ):
            return False  # pending at the last read, a moment ago: a claim notices the approval
        self._pending_read_at = None
        try:
            node = await self.client.me(stop=self.stop)
        except OrchestratorAPIError as exc:
            if exc.status in FATAL_STATUSES and exc.code not in RETRYABLE_CODES:
                await self._refused(exc)  # banned meanwhile: raised, or ends as retired
                return True
            log.warning("membership_read_failed", error=_why(exc))
            return False
        except httpx.HTTPError as exc:
            log.warning("membership_read_failed", error=_why(exc))
            return False
        status = next((m.status for m in node.memberships if m.pool_id == pool), None)
        if status is not None and status not in ENDED_MEMBERSHIPS:
            if status == "pending":
                self._pending_read_at = now
            return False
        if claim.reason == "pool_not_active":
            self._end(
                "pool_completed",
                f"the pool {pool} is over ({claim.detail}); completing it ended the node's "
                f"membership ({status or 'none'}): no more work will come there",
            )
        elif status == "left":
            self._end(
                "membership_ended",
                f"the node left the pool {pool}: it is no longer a member (it left, `orchestrator "
                "worker leave`, or the pool's operator blacklisted its provider there), and its "
                "stake there unbonds; running the worker again joins it again, unless its provider "
                "is blacklisted there (the join is refused `provider_blacklisted`)",
            )
        elif status == "ejected":
            self._end(
                "membership_ended",
                f"the node was ejected from the pool {pool} (by its operator or the verifier): it "
                "may not join it again, unless an appeal of the verifier's ejection reinstates it",
            )
        elif status == "rejected":
            self._end("membership_ended", f"the pool {pool}'s operator rejected the node's join")
        else:
            self._end("membership_ended", f"the node is not a member of the pool {pool}")
        return True

    async def _refused(self, exc: OrchestratorAPIError) -> None:
        """A refusal that waiting will not fix: raised, but for a node banned because an admin
        retired its provider, which sets why the run ends instead. The refusal says so
        (``provider_retired: true``); from a server whose refusal does not, the provider key
        tells (refused as ``provider_retired``), when the worker has it."""
        if says_retired(exc):
            self._retired()
            return
        if exc.code == "node_banned" and "provider_retired" not in exc.body and self.has_provider_key:
            try:
                await self.client.balance(stop=self.stop)
            except OrchestratorAPIError as refused:
                if refused.code == "provider_retired":
                    self._retired()
                    return
            except httpx.HTTPError:
                pass
        raise exc

    def _retired(self) -> None:
        """The provider was retired (its key refused as ``provider_retired``, or the node's
        refusal says so): the provider's money is its successor's now, so no earnings are shown,
        and the run ends."""
        self.provider_retired = True
        self.stats.earnings = None
        provider = self.client.provider_id or self.provider_id or "of this worker"
        key = "this provider key" if self.has_provider_key else "its provider key"
        self._end(
            "provider_retired",
            f"the provider {provider} was retired by an admin (its key lost or stolen): its "
            "nodes are revoked and its money, these earnings included, went to the successor "
            f"provider the admin named; {key} can do nothing any more",
        )

    def _end(self, reason: str, detail: str) -> None:
        if self.end is None:
            self.end = (reason, detail)
            log.warning("worker_ending", reason=reason, detail=detail)
        self.ending.set()
        self._emit()

    def _start_work(self, leases: list[Lease]) -> None:
        for lease in leases:
            task = asyncio.create_task(self._work(lease), name=f"lease-{lease.assignment_id}")
            self.running[lease.assignment_id] = task
            self.deadlines[lease.assignment_id] = self._loop_time_of(lease.lease_expires_at)
            task.add_done_callback(functools.partial(self._forget, lease.assignment_id))
        self.leases_taken.set()
        self._emit()

    async def _recover(self) -> bool:
        """Take up the leases the node holds on the server without knowing it: a previous
        run's (killed, say, before it could give them back) or those of a claim whose answer
        was lost. They are worked like claimed ones, as many as there are free slots (and
        ``max_tasks`` allows); the rest are given back at once. Held, they would count against
        the pool's lease cap until they expired. True when it took some up."""
        c = self.config
        # Leases in flight now are this run's even if they end before the answer comes: one
        # whose result went in meanwhile is listed (the server read it still live) but no longer
        # running, and would be generated and submitted again.
        known = set(self.running)
        try:
            held = await self.client.leases(c.pool_id, stop=self.stop)
        except (OrchestratorAPIError, httpx.HTTPError) as exc:
            # Tried again before the next claim (which backs off if the server is still away).
            log.warning("recover_failed", error=_why(exc))
            return False
        self.recover = False
        known.update(self.running)
        unknown = [lease for lease in held if lease.assignment_id not in known]
        if not unknown:
            return False
        room = c.concurrency - len(self.running)
        if c.max_tasks is not None:
            room = min(room, c.max_tasks - self.stats.claimed)
        taken, extra = unknown[: max(room, 0)], unknown[max(room, 0) :]
        log.info("leases_recovered", taken=len(taken), given_back=len(extra))
        self.stats.claimed += len(taken)
        self.stats.recovered += len(taken)
        self._start_work(taken)
        await asyncio.gather(*(self._release(lease.assignment_id) for lease in extra))
        return bool(taken)

    async def _claim(self, want: int) -> ClaimOut | None:
        """One claim, raced against the stop. On stop the client makes no further attempt
        (a backoff ends at once); a request with the server gets the grace period to answer,
        then it is cancelled and None returned."""
        request = asyncio.create_task(self.client.claim(self.config.pool_id, max_tasks=want, stop=self.stop))
        stopper = asyncio.create_task(self.stop.wait())
        try:
            await asyncio.wait([request, stopper], return_when=asyncio.FIRST_COMPLETED)
            if not request.done():
                await asyncio.wait([request], timeout=self._grace_left())
            if not request.done():
                request.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await request
                # Leases the server may have granted are not heard of in this run.
                log.warning("claim_abandoned", detail="stopped while a claim was with the server")
                return None
            return request.result()
        finally:
            stopper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await stopper

    def _grace_left(self) -> float:
        """Seconds left of the grace period, which starts when the stop is first seen."""
        now = asyncio.get_running_loop().time()
        if self.stopped_at is None:
            self.stopped_at = now
        return max(0.0, self.config.grace_s - (now - self.stopped_at))

    def _backoff(self, failures: int) -> float:
        # Capped before it is computed: 0.5 * 2**1024 overflows a float (an outage of hours).
        ceiling = min(self.config.max_error_backoff_s, 0.5 * 2 ** min(failures, 64))
        return random.uniform(ceiling / 2, ceiling)  # noqa: S311 - jitter

    async def _pause(self, seconds: float, *, ending: bool = False) -> None:
        """Sleep, but wake at once when stop is set (or, with ``ending``, the run ends on its
        own: the claim loop's waits)."""
        await self._wait_for_slot(max(0.0, seconds), leases=False, ending=ending)

    async def _wait_for_slot(
        self, at_most_s: float | None = None, *, leases: bool = True, ending: bool = False
    ) -> None:
        """Until a lease in flight ends (with ``leases``), the stop, with ``ending`` the run's
        end of its own, or ``at_most_s`` seconds."""
        stoppers = [asyncio.create_task(self.stop.wait())]
        if ending:
            stoppers.append(asyncio.create_task(self.ending.wait()))
        try:
            await asyncio.wait(
                [*stoppers, *(self.running.values() if leases else ())],
                timeout=at_most_s,
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            for stopper in stoppers:
                stopper.cancel()
            await asyncio.gather(*stoppers, return_exceptions=True)

    # ------------------------------------------------------------------ one lease

    async def _generate(self, lease: Lease) -> Generation:
        limit = self.config.generate_timeout_s
        generation = self.backend.generate(lease.task, lease.seed, lease.policy)
        try:
            made = await (asyncio.wait_for(generation, timeout=limit) if limit else generation)
        except TimeoutError:
            detail = f"the generation took longer than {limit:g} s (--generate-timeout-s)"
            raise BackendError(detail) from None
        return made if isinstance(made, Generation) else Generation(samples=made)

    async def _work(self, lease: Lease) -> None:
        aid = lease.assignment_id
        try:
            made = await self._generate(lease)
            if len(made.samples) != lease.task.sampling.n:
                raise BackendError(
                    f"backend {self.backend.name} made {len(made.samples)} samples, "
                    f"{lease.task.sampling.n} asked"
                )
            claimed = made.claimed_reward
            if claimed is not None and not 0.0 <= claimed <= 1.0:
                # The server judges a claim outside [0, 1] fraud (claim_out_of_bounds): a
                # backend's reward on a scale of its own must not get an honest node slashed.
                raise BackendError(
                    f"backend {self.backend.name} claimed a reward of {claimed!r:.40}, outside [0, 1]"
                )
            # Samples (or a proof, a claimed reward) that do not make a valid result (wrong
            # types, negative counts, a proof too large, ...) are the backend's failure too.
            result = ResultIn(
                fencing_token=lease.fencing_token,
                policy_step=lease.policy.step,
                seed=lease.seed,
                samples=made.samples,
                claimed_reward=made.claimed_reward,
                proof=None if made.proof is None else base64.b64encode(made.proof).decode("ascii"),
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # The task failed here: give the lease back for another node, saying so (the task
            # ends failed once it failed on the nodes of the pool's max_failures providers).
            self._error("backend_failed", assignment_id=aid, error=str(exc)[:300])
            await self._release(aid, error=f"{type(exc).__name__}: {exc}")
            return
        self.submitting.add(aid)
        try:
            out = await self._submit(lease, result)
        except OrchestratorAPIError as exc:
            self.stats.tasks_done += 1
            if exc.code in LEASE_GONE_CODES:
                self.stats.dropped += 1
                log.info("lease_gone", assignment_id=aid, code=exc.code)
                self._emit()
            else:
                self._error("submit_refused", assignment_id=aid, status=exc.status, code=exc.code)
                if exc.status not in FATAL_STATUSES:
                    # The server answered without recording the result (or, after a 5xx, had
                    # recorded it, and then a release changes nothing): give the lease back at
                    # once rather than let it expire. A result refused for what it is (a 4xx,
                    # but for a stale policy: the task taken again comes with the current one)
                    # would be refused again: the release says so, as a failure, and this node
                    # does not take it back. A 429 or 5xx (a stop during an outage, a server
                    # bug) says nothing of the task or the node: no failure is counted.
                    for_content = (
                        exc.status < 500
                        and exc.status not in NOT_REACHED_STATUSES
                        and exc.code != "policy_stale"
                    )
                    await self._release(
                        aid, error=f"result refused: {exc.status} {exc.code}" if for_content else None
                    )
            return
        except httpx.HTTPError as exc:
            self.stats.tasks_done += 1
            self._error("submit_failed", assignment_id=aid, error=type(exc).__name__)
            return
        self.stats.tasks_done += 1
        self.stats.submitted += 1
        self.awaiting.add(out.submission_id)
        self._count_awaiting()
        log.debug("result_submitted", assignment_id=aid, submission_id=out.submission_id)
        self._emit()

    async def _submit(self, lease: Lease, result: ResultIn) -> ResultOut:
        """Submit a result, outlasting a server outage: the client retries for a few seconds;
        after that the submission is made again, with the claim loop's backoff, until the
        server answers (its answer to a repeat is its first one), for as long as the worker
        runs and, after a stop, within the grace period. The lease stays in flight meanwhile,
        so heartbeats keep it alive once the server is back; a result given up on would keep
        the lease held on the server, counting against the node's lease cap, until it expired."""
        failures = 0
        while True:
            try:
                return await self.client.submit(lease, result, stop=self.stop)
            except (OrchestratorAPIError, httpx.TransportError) as exc:
                if isinstance(exc, OrchestratorAPIError):
                    if exc.status not in NOT_REACHED_STATUSES:
                        raise
                    reason, retry_after = f"{exc.status} {exc.code}", exc.retry_after
                else:
                    reason, retry_after = type(exc).__name__, None
                failures += 1
                wait = retry_after or self._backoff(failures)
                if self.stop.is_set():
                    grace = self._grace_left()
                    if grace <= 0:
                        raise
                    wait = min(wait, grace)
                log.warning(
                    "submit_retrying",
                    assignment_id=lease.assignment_id,
                    reason=reason,
                    attempt=failures,
                    wait_s=round(wait, 1),
                )
            if self.stop.is_set():
                await asyncio.sleep(wait)  # the grace period's last seconds: no early wake
            else:
                await self._pause(wait)

    async def _release(self, assignment_id: str, *, error: str | None = None) -> None:
        try:
            await self.client.release(assignment_id, error=error)
        except (OrchestratorAPIError, httpx.HTTPError) as exc:
            self._error("release_failed", assignment_id=assignment_id, error=_why(exc))
            return
        self.stats.released += 1
        self._emit()

    def _forget(self, assignment_id: str, _task: asyncio.Task[None]) -> None:
        self.running.pop(assignment_id, None)
        self.deadlines.pop(assignment_id, None)
        self.ended += 1
        self.submitting.discard(assignment_id)
        if not self.finishing:
            self.dropped.discard(assignment_id)
        self._emit()

    async def _finish_leases(self) -> None:
        """Let the held leases finish (all of them when the task quota was reached, within
        the grace period when stopped), then release what is left."""
        self.finishing = True
        try:
            await self._finish_held()
        finally:
            self.dropped.clear()

    async def _finish_held(self) -> None:
        # A retired provider's nodes are revoked: the server refuses their results and releases
        # (it released their leases itself), so what is still running is stopped at once.
        revoked = self.provider_retired
        while self.running and not self.stop.is_set() and not revoked:
            await self._wait_for_slot()
        if not self.running:
            return
        held = dict(self.running)
        grace = 0.0 if revoked else self._grace_left()
        log.info("finishing_leases", leases=len(held), grace_s=grace)
        if grace > 0:
            await asyncio.wait(held.values(), timeout=grace)
        # Still generating: stop and give back. Already submitting: let the submission end.
        late = {aid: t for aid, t in held.items() if not t.done() and aid not in self.submitting}
        for task in late.values():
            task.cancel()
        await asyncio.gather(*held.values(), return_exceptions=True)
        unfinished = [] if revoked else [aid for aid in late if aid not in self.dropped]
        await asyncio.gather(*(self._release(aid) for aid in unfinished))

    # ------------------------------------------------------------------ background

    async def _closing_within(self, seconds: float, *, wake: asyncio.Event | None = None) -> bool:
        """Wait up to ``seconds`` (or until ``wake`` is set); True once the worker is closing."""
        waits = [asyncio.create_task(self.closing.wait())]
        if wake is not None:
            waits.append(asyncio.create_task(wake.wait()))
        try:
            await asyncio.wait(waits, timeout=max(0.0, seconds), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiting in waits:
                waiting.cancel()
            await asyncio.gather(*waits, return_exceptions=True)
        return self.closing.is_set()

    async def _heartbeat_loop(self, interval: float) -> None:
        loop = asyncio.get_running_loop()
        last = loop.time()
        at: float | None = None
        while not self.closing.is_set():
            self.leases_taken.clear()
            # Leases taken only ever bring the beat forward: worked out afresh from each wake's
            # time, a beat a deadline brought forward (half the time left, or MIN_BEAT_S, from
            # then) was put off at every claim, and never came with claims more than once a
            # MIN_BEAT_S (the lease ran out on the server).
            due = self._next_beat_at(last + interval)
            at = due if at is None else min(at, due)
            if await self._closing_within(at - loop.time(), wake=self.leases_taken):
                return
            if loop.time() < at:
                continue  # leases were taken: the time of the next beat is worked out again
            beat = await self._beat()
            last, at = loop.time(), None
            interval = min(interval, 5.0) if beat is None else beat.next_heartbeat_in_s

    def _next_beat_at(self, at: float) -> float:
        """When to beat next (on the event loop's clock): ``at``, the server's interval after the
        last beat, or sooner when a lease held would run out before then. A beat comes by half
        the time a lease has left (the server extends it then: it extends a lease with less
        than three of its intervals left), down to ``MIN_BEAT_S`` apart; so a lease the server
        no longer extends (its pool's ``max_lease_s`` from the claim) is dropped within about
        that of its deadline, its work stopped, rather than up to an interval later. A deadline
        more than ``MIN_BEAT_S`` past brings no beat forward: the beats after it did not drop
        the lease (the server's clock is behind the estimate, or it could not be reached, and
        an outage of the server gives its leases their time back), so it is left to the
        server's interval, as a failing beat is to its retries."""
        now = asyncio.get_running_loop().time()
        for aid, deadline in self.deadlines.items():
            if aid not in self.dropped and deadline + MIN_BEAT_S > now:
                at = min(at, now + max(MIN_BEAT_S, (deadline - now) / 2))
        return at

    def _loop_time_of(self, at: dt.datetime) -> float:
        """A time on the server's clock (a lease's deadline) on the event loop's, through the
        server's clock as its last ``Date`` header showed it (this machine's without one)."""
        server_now = time.time() + (self.client.clock_offset_s or 0.0)
        return asyncio.get_running_loop().time() + (at.timestamp() - server_now)

    async def _beat(self, stop: asyncio.Event | None = None) -> HeartbeatOut | None:
        """One heartbeat with the leases in flight; abandons those the server names in
        ``drop_leases`` and keeps the others' deadlines (``lease_deadlines``). None if it failed
        (an error counted)."""
        try:
            metrics = {"in_flight": float(len(self.running)), "tasks_done": float(self.stats.tasks_done)}
            leases = [aid for aid in self.running if aid not in self.dropped]
            # Retried until the held leases are settled (closing): a beat keeps them alive. A
            # wait before a retry (a 429's Retry-After) that would let one of their deadlines
            # pass is cut short, once per deadline, to try just before it (the client's).
            beat = await self.client.heartbeat(
                leases=leases,
                metrics=metrics,
                deadlines=[self.deadlines[aid] for aid in leases if aid in self.deadlines],
                stop=stop or self.closing,
            )
        except (OrchestratorAPIError, httpx.HTTPError) as exc:
            self._error("heartbeat_failed", error=_why(exc))
            if says_retired(exc):
                # The run ends, also while every slot is taken by a lease (its node is revoked:
                # it cannot be submitted) and without the provider key.
                self._retired()
            return None
        # The deadlines after the beat (an older server sends none: the claims' stay).
        for d in beat.lease_deadlines:
            if d.assignment_id in self.deadlines:
                self.deadlines[d.assignment_id] = self._loop_time_of(d.lease_expires_at)
        for aid in beat.drop_leases:
            task = self.running.get(aid)
            # A lease being submitted is left alone: the server will refuse the result. One
            # dropped already is not counted again.
            if task is not None and aid not in self.submitting and aid not in self.dropped:
                log.info("lease_dropped", assignment_id=aid)
                self.dropped.add(aid)
                self.stats.dropped += 1
                task.cancel()
        return beat

    async def _stats_loop(self) -> None:
        earnings_read: float | None = None
        while not await self._closing_within(self.config.stats_interval_s):
            now = time.monotonic()
            due = earnings_read is None or now - earnings_read >= self.config.earnings_interval_s
            if due:
                earnings_read = now
            await self._refresh(earnings=due)

    async def _refresh(self, *, earnings: bool = True) -> None:
        """This node's verdicts (node-signed) and, with ``earnings`` and the provider key, the
        provider's balance."""
        try:
            if self.awaiting:
                pending = len(self.awaiting)
                # After a stop, one attempt each: the run's end does not wait out an outage.
                # This node's only: among its provider's other machines', its own were past the
                # newest few hundred as soon as the provider ran a few dozen.
                newest = await self.client.verdicts(
                    limit=min(5000, 100 + 2 * pending), node_only=True, stop=self.stop
                )
                for v in newest:
                    if v.submission_id in self.awaiting:
                        self.awaiting.discard(v.submission_id)
                        if v.outcome == "accepted":
                            self.stats.accepted += 1
                        elif v.outcome == "rejected":
                            self.stats.rejected += 1
            self._count_awaiting()
            if earnings and self.has_provider_key and not self.provider_retired:
                balance = await self.client.balance(stop=self.stop)
                self.stats.earnings = balance.rewards_pending + balance.rewards_claimable + balance.withdrawn
        except (OrchestratorAPIError, httpx.HTTPError) as exc:
            if says_retired(exc):
                # No longer shown, they are the successor's now; and the run ends, also while
                # every slot is taken by a lease (its node is revoked: it cannot be submitted).
                self._retired()
            log.warning("stats_refresh_failed", error=_why(exc))
            return
        self._emit()

    # ------------------------------------------------------------------ reporting

    def _count_awaiting(self) -> None:
        """Results recorded without a verdict seen yet: counted as results are recorded too,
        not only when verdicts are read, so the count stays true while they cannot be."""
        self.stats.awaiting_verdict = len(self.awaiting)

    def _error(self, event: str, **fields: Any) -> None:
        self.stats.errors += 1
        log.warning(event, **fields)
        self._emit()

    def _set_state(self, state: str) -> None:
        self.stats.state = state
        self._emit()

    def _emit(self) -> None:
        self.stats.in_flight = len(self.running)
        if self.progress is None:
            return
        try:
            self.progress(dataclasses.replace(self.stats))
        except Exception:
            log.exception("progress_callback_failed")


def _summary(stats: WorkerStats) -> dict[str, Any]:
    return {k: v for k, v in dataclasses.asdict(stats).items() if k not in {"node_id", "state"}}
