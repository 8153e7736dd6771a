"""The contributor SDK: a signed, retrying async client for the worker wire protocol.

Every request is signed with RFC 9421 (``SignatureAuth``): node calls with the node key,
provider calls (registration, balance, the provider's verdicts, a node's revocation) with the
provider key. A retry is a new
request with a new ``created`` time and a new nonce, never a replay of the old headers (the
server refuses a replayed nonce). Bodies are serialised once per call, so every attempt of a
result submission carries the same bytes and gets the same answer.

Retries (tenacity; exponential backoff with full jitter, ``Retry-After`` honoured):

* idempotent calls (GET, registration, join, leave, heartbeat, result submission, release,
  a withdrawal with its ``Idempotency-Key``, a node's revocation) retry on transport errors, 429 and 5xx;
* a claim is not idempotent (a claim whose answer was lost has leased tasks that the worker
  never saw), so it retries only when the request cannot have reached the server (connect
  errors and connection-pool timeouts) or was refused before any work (429, 503).

A heartbeat is given the deadlines of the leases it names (``deadlines``, on the event loop's
clock): a wait before a retry that would let one of them pass (a 429's ``Retry-After: 60`` with
a lease 10 s from its end) is cut short, once per deadline, so that the retry is sent
``early_retry_lead_s`` (1 s) before it; later waits are the server's again. Waiting the whole
``Retry-After``, the call let the lease run out on the server and its work was lost. Deadlines
within ``early_retry_lead_s`` of an early retry are its too, and early retries come at most
that often; they count among the ``max_retries``.

A ``401`` ``nonce_replayed`` with ``nonces_remembered_since`` (the server lost its spent nonces
and refused, before any work, a signature created before it noticed) is signed afresh and sent
again once by ``SignatureAuth`` itself.

Errors the server answers are raised as ``OrchestratorAPIError`` with the problem's ``code``.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import email.utils
import enum
import functools
import json
import math
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from types import TracebackType
from typing import Any, TypeVar
from urllib.parse import quote

import anyio
import httpx
import structlog
from nacl.signing import SigningKey
from pydantic import BaseModel
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_attempt,
)

from api_schemas.identity import (
    HeartbeatIn,
    HeartbeatOut,
    NodeOut,
    NodeRegister,
    NodeRevocationOut,
    NodeRevokeIn,
    NodeSpecs,
)
from api_schemas.ledger import Balances
from api_schemas.payouts import PayoutOut, WithdrawalOut
from api_schemas.pools import JoinIn, MembershipOut
from api_schemas.tasks import ClaimIn, ClaimOut, Lease, LeasesOut, ReleaseIn, ResultIn, ResultOut
from api_schemas.verification import VerdictOut
from orchestrator import __version__
from orchestrator.core.keys import attest_node, key_id_of
from orchestrator.core.signing import SignatureAuth
from orchestrator.worker.errors import Backoff, NodeKeyRequired, OrchestratorAPIError, ProviderKeyRequired

__all__ = ["NodeKeyRequired", "OrchestratorAPIError", "ProviderKeyRequired", "WorkerClient"]

log = structlog.get_logger(__name__)
M = TypeVar("M", bound=BaseModel)

RETRY_STATUSES_IDEMPOTENT = frozenset({429, 500, 502, 503, 504})
# A 429 or 503 is refused before the request does anything; a 500/502/504 may come after a
# claim was committed, so a claim is not retried on those.
RETRY_STATUSES_UNSENT = frozenset({429, 503})
# What a release's error cannot send: a NUL (which PostgreSQL text cannot hold) and a lone
# surrogate (which UTF-8 cannot encode).
_NOT_TEXT = re.compile("[\x00\ud800-\udfff]")
UNSENT_ERRORS: tuple[type[httpx.TransportError], ...] = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.PoolTimeout,
)


class Retry(enum.Enum):
    """Which failures a call may be retried after."""

    IDEMPOTENT = "idempotent"
    UNSENT_ONLY = "unsent_only"


def _retryable(exc: BaseException, policy: Retry) -> bool:
    if isinstance(exc, OrchestratorAPIError):
        statuses = RETRY_STATUSES_IDEMPOTENT if policy is Retry.IDEMPOTENT else RETRY_STATUSES_UNSENT
        return exc.status in statuses or (policy is Retry.IDEMPOTENT and exc.status >= 500)
    if isinstance(exc, httpx.TransportError):
        return policy is Retry.IDEMPOTENT or isinstance(exc, UNSENT_ERRORS)
    return False


class WorkerClient(Backoff):
    """A node's (and optionally its provider's) signed client for one orchestrator server.

    ``transport`` runs the client against anything httpx can talk to, for example an
    in-process app: ``httpx.ASGITransport(app=app)`` with ``base_url="http://testserver"``.
    """

    #: First backoff step and the largest backoff, in seconds (full jitter: a uniform draw
    #: from 0 to ``min(backoff_max_s, backoff_base_s * 2**attempt)``).
    backoff_base_s: float = 0.5
    backoff_max_s: float = 30.0
    #: A server's ``Retry-After`` is honoured up to this many seconds.
    retry_after_cap_s: float = 300.0
    #: A retry brought forward by a deadline (``heartbeat``'s ``deadlines``) is sent this long
    #: before it, and early retries come at most this often.
    early_retry_lead_s: float = 1.0

    def __init__(
        self,
        base_url: str,
        node_key: SigningKey | None,
        provider_key: SigningKey | None = None,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        timeout_s: float = 30.0,
        max_retries: int = 5,
    ) -> None:
        if max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        self._provider_key = provider_key
        # No node key: a provider's own client (balance, withdrawals, payouts) and nothing else.
        self._node_auth = SignatureAuth(node_key) if node_key is not None else None
        self._provider_auth = SignatureAuth(provider_key) if provider_key is not None else None
        self._provider_id = key_id_of(provider_key) if provider_key is not None else None
        self._node_id = key_id_of(node_key) if node_key is not None else None
        self.max_retries = max_retries
        #: The server's clock less this machine's, in seconds, from the ``Date`` header of its
        #: last answer that had one (whole seconds: an offset under a second reads as 0); None
        #: before such an answer. Read to judge the server's times (a lease's deadline) by the
        #: server's clock: the signatures let this machine's be minutes off.
        self.clock_offset_s: float | None = None
        self._sleep: Callable[[float], Awaitable[None]] = anyio.sleep
        self._http = httpx.AsyncClient(
            base_url=base_url,
            transport=transport,
            timeout=httpx.Timeout(timeout_s, connect=min(10.0, timeout_s)),
            headers={"User-Agent": f"orchestrator-worker/{__version__}", "Accept": "application/json"},
            follow_redirects=False,
        )

    # ------------------------------------------------------------------ identity

    @property
    def node_id(self) -> str:
        """The node's key id (its Ed25519 public key, unpadded base64url)."""
        if self._node_id is None:
            raise NodeKeyRequired("this client was made without a node key")
        return self._node_id

    @property
    def provider_id(self) -> str | None:
        """The provider's key id: from the provider key, or learned from ``register``."""
        return self._provider_id

    # ------------------------------------------------------------------ lifecycle

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> WorkerClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    # ------------------------------------------------------------------ contributor calls

    async def register(
        self,
        specs: NodeSpecs | dict[str, Any],
        version: str,
        *,
        display_name: str | None = None,
        provider_id: str | None = None,
        attestation: str | None = None,
        stop: asyncio.Event | None = None,
    ) -> NodeOut:
        """Register the provider (when this client has its key) and then the node.

        Both registrations are idempotent: a known node gets its specs and version updated.
        Without the provider key, pass the ``provider_id`` and the ``attestation`` the
        provider made for this node (``orchestrator.core.keys.attest_node``).
        """
        node_specs = specs if isinstance(specs, NodeSpecs) else NodeSpecs.model_validate(specs)
        if self._provider_key is not None:
            provider_body = {"display_name": display_name} if display_name is not None else {}
            await self._call("POST", "/v1/providers", provider_body, provider=True, interrupt=stop)
            provider_id = key_id_of(self._provider_key)
            attestation = attest_node(self._provider_key, self.node_id)
        elif provider_id is None or attestation is None:
            raise ProviderKeyRequired(
                "registering a node needs the provider key, or its provider_id and attestation"
            )
        body = NodeRegister(
            provider_id=provider_id, attestation=attestation, specs=node_specs, version=version
        )
        node = await self._call_model(
            NodeOut, "POST", "/v1/nodes", body.model_dump(mode="json"), interrupt=stop
        )
        self._provider_id = node.provider_id
        return node

    async def me(self, *, stop: asyncio.Event | None = None) -> NodeOut:
        """The node's own record: status and pool memberships."""
        return await self._call_model(NodeOut, "GET", "/v1/nodes/me", interrupt=stop)

    async def join(
        self, pool_id: str, invite_code: str | None = None, *, stop: asyncio.Event | None = None
    ) -> MembershipOut:
        """Join a pool (or ask to: the membership may come back ``pending``); idempotent."""
        body = JoinIn(invite_code=invite_code).model_dump(mode="json", exclude_none=True)
        return await self._call_model(
            MembershipOut, "POST", f"/v1/pools/{_seg(pool_id)}/join", body, interrupt=stop
        )

    async def leave(self, pool_id: str) -> MembershipOut:
        """Leave a pool, or withdraw a pending join (idempotent): the membership as it is now.
        Its stake goes to unbonding."""
        return await self._call_model(MembershipOut, "POST", f"/v1/pools/{_seg(pool_id)}/leave")

    async def heartbeat(
        self,
        leases: list[str] | None = None,
        metrics: dict[str, float] | None = None,
        *,
        deadlines: Collection[float] = (),
        stop: asyncio.Event | None = None,
    ) -> HeartbeatOut:
        """Report liveness and the leases being worked on; the answer says when to beat next,
        which leases to drop and, in ``lease_deadlines``, each other one's deadline after the
        beat. Once ``stop`` is set, no further attempt is made.

        ``deadlines``: when the leases run out, on the event loop's clock
        (``asyncio.get_running_loop().time()``; read again before each wait). A wait before a
        retry that would let one pass is cut short, once per deadline, so the retry comes
        ``early_retry_lead_s`` before it (see the module docstring)."""
        body = HeartbeatIn(metrics=metrics or {}, leases=leases or [])
        response = await self._call(
            "POST",
            "/v1/nodes/me/heartbeat",
            body.model_dump(mode="json"),
            interrupt=stop,
            deadlines=deadlines,
        )
        return HeartbeatOut.model_validate_json(response.content)

    async def claim(self, pool_id: str, max_tasks: int = 1, *, stop: asyncio.Event | None = None) -> ClaimOut:
        """Lease up to ``max_tasks`` replicas (at most ``CLAIM_MAX_TASKS``, the server's limit
        per claim). With no work the list is empty and ``reason`` and ``retry_after_s`` say
        why and when to ask again.

        Not retried after a request may have reached the server (see the module docstring):
        a read timeout is raised to the caller, whose leases then expire on the server.
        Once ``stop`` is set, no further attempt is made: a wait between attempts ends at once
        and the failure that was being retried is raised.
        """
        body = ClaimIn(pool_id=pool_id, max_tasks=max_tasks).model_dump(mode="json")
        response = await self._call(
            "POST", "/v1/assignments/claim", body, retry=Retry.UNSENT_ONLY, interrupt=stop
        )
        out = ClaimOut.model_validate_json(response.content)
        if out.retry_after_s is None and not out.leases:
            header = response.headers.get("retry-after")
            if header is not None and header.isdigit():
                out.retry_after_s = int(header)
        return out

    async def submit(self, lease: Lease, result: ResultIn, *, stop: asyncio.Event | None = None) -> ResultOut:
        """Submit the result for a lease. Idempotent: every attempt sends the same bytes, and
        the server answers a repeat with the first answer. Once ``stop`` is set, no further
        attempt is made (as for ``claim``)."""
        response = await self._call(
            "POST",
            f"/v1/assignments/{_seg(lease.assignment_id)}/result",
            result.model_dump(mode="json", exclude_none=True),
            interrupt=stop,
        )
        return ResultOut.model_validate_json(response.content)

    async def release(self, assignment_id: str, *, error: str | None = None) -> None:
        """Give a lease back so its replica is reissued at once (idempotent). ``error`` says the
        task failed on this node (its first 1,000 characters are sent, a NUL or a lone surrogate
        as U+FFFD): after such releases from the nodes of the pool's ``max_failures`` providers
        the task ends failed."""
        body = None
        if error is not None:
            # A lone surrogate (an undecodable file name in an OSError's message, say) is no
            # Unicode text: the release raised (ValidationError) and the lease was not given back.
            text = _NOT_TEXT.sub("\ufffd", error)[:1000]
            body = ReleaseIn(error=text or "error").model_dump()
        await self._call("POST", f"/v1/assignments/{_seg(assignment_id)}/release", body)

    async def leases(self, pool_id: str | None = None, *, stop: asyncio.Event | None = None) -> list[Lease]:
        """The node's live leases (in ``pool_id`` only, if given), oldest first, as its claims
        gave them: after a claim whose answer was lost, or a restart, the leases the node holds
        on the server without knowing it."""
        params = {} if pool_id is None else {"pool_id": pool_id}
        response = await self._call("GET", "/v1/nodes/me/leases", params=params, interrupt=stop)
        return LeasesOut.model_validate_json(response.content).leases

    async def balance(self, *, stop: asyncio.Event | None = None) -> Balances:
        """The provider's stake and reward balances (signed by the provider key). Once ``stop``
        is set, no further attempt is made."""
        return await self._call_model(
            Balances, "GET", "/v1/providers/me/balance", provider=True, interrupt=stop
        )

    async def withdraw(
        self, amount: int, idempotency_key: str, *, stop: asyncio.Event | None = None
    ) -> WithdrawalOut:
        """Withdraw ``amount`` of the provider's claimable rewards into a payout (signed by the
        provider key). Idempotent by ``idempotency_key`` (8 to 100 characters): the same key
        again, by a retry here or by a later call, answers the first withdrawal and moves
        nothing; with another amount it is refused (409 ``idempotency_key_reused``)."""
        response = await self._call(
            "POST",
            "/v1/providers/me/withdrawals",
            {"amount": amount},
            provider=True,
            headers={"Idempotency-Key": idempotency_key},
            interrupt=stop,
        )
        return WithdrawalOut.model_validate_json(response.content)

    async def nodes(
        self, limit: int = 100, *, status: str | None = None, stop: asyncio.Event | None = None
    ) -> list[NodeOut]:
        """The provider's first ``limit`` nodes, by id (``status``: only those in it), following
        the server's pages (signed by the provider key)."""
        params = {"status": status} if status is not None else {}
        pages = self._pages("/v1/providers/me/nodes", limit, provider=True, params=params, stop=stop)
        return [NodeOut.model_validate(item) async for item in pages]

    async def revoke_node(
        self, node_id: str, reason: str | None = None, *, stop: asyncio.Event | None = None
    ) -> NodeRevocationOut:
        """Revoke one of the provider's node keys, for good (signed by the provider key): the
        node is banned and ejected from its pools, and its key can never register again. For a
        machine stolen or compromised. Idempotent: a revoked node is answered as it is."""
        body = NodeRevokeIn(reason=reason).model_dump(mode="json", exclude_none=True)
        return await self._call_model(
            NodeRevocationOut,
            "POST",
            f"/v1/providers/me/nodes/{_seg(node_id)}/revoke",
            body,
            provider=True,
            interrupt=stop,
        )

    async def payouts(
        self, limit: int = 100, *, status: str | None = None, stop: asyncio.Event | None = None
    ) -> list[PayoutOut]:
        """The provider's newest ``limit`` payouts (``status``: requested, paid or rejected),
        newest first, following the server's pages (signed by the provider key)."""
        params = {"status": status} if status is not None else {}
        pages = self._pages("/v1/providers/me/payouts", limit, provider=True, params=params, stop=stop)
        return [PayoutOut.model_validate(item) async for item in pages]

    async def verdicts(
        self, limit: int = 100, *, node_only: bool = False, stop: asyncio.Event | None = None
    ) -> list[VerdictOut]:
        """The newest ``limit`` verdicts, newest first, following the server's pages: the
        provider's (all its nodes; signed by the provider key), or with ``node_only`` this
        client's node's (signed by the node key: no provider key needed, and none of the
        provider's request budget used). Once ``stop`` is set, no further attempt is made."""
        path = "/v1/nodes/me/verdicts" if node_only else "/v1/providers/me/verdicts"
        pages = self._pages(path, limit, provider=not node_only, stop=stop)
        return [VerdictOut.model_validate(item) async for item in pages]

    async def _pages(
        self,
        path: str,
        limit: int,
        *,
        provider: bool,
        params: dict[str, Any] | None = None,
        stop: asyncio.Event | None = None,
    ) -> AsyncIterator[dict[str, Any]]:
        """Up to ``limit`` items of a cursor-paged listing, page by page (500 at most each)."""
        seen = 0
        cursor: str | None = None
        while seen < limit:
            query: dict[str, Any] = {**(params or {}), "limit": min(500, limit - seen)}
            if cursor is not None:
                query["cursor"] = cursor
            response = await self._call("GET", path, provider=provider, params=query, interrupt=stop)
            page = response.json()
            for item in page["items"][: limit - seen]:
                seen += 1
                yield item
            cursor = page.get("next_cursor")
            if not cursor or not page["items"]:
                return

    # ------------------------------------------------------------------ plumbing

    async def _call_model(
        self,
        model: type[M],
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        provider: bool = False,
        interrupt: asyncio.Event | None = None,
    ) -> M:
        response = await self._call(method, path, body, provider=provider, interrupt=interrupt)
        return model.model_validate_json(response.content)

    async def _call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        provider: bool = False,
        retry: Retry = Retry.IDEMPOTENT,
        params: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
        interrupt: asyncio.Event | None = None,
        deadlines: Collection[float] | None = None,
    ) -> httpx.Response:
        """One call, retried per ``retry``. Once ``interrupt`` is set there is no further
        attempt: the wait before the next one ends at once and the last failure is raised.
        ``deadlines`` (event loop times) bring forward a retry whose wait would let one pass
        (``_BeforeDeadlines``)."""
        if provider:
            if self._provider_auth is None:
                raise ProviderKeyRequired(f"{method} {path} must be signed by the provider key")
            auth = self._provider_auth
        else:
            if self._node_auth is None:
                raise NodeKeyRequired(f"{method} {path} must be signed by the node key")
            auth = self._node_auth
        # Serialised once: every attempt sends (and signs a digest of) the same bytes.
        content = (
            json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode() if body is not None else None
        )
        headers = {**({"Content-Type": "application/json"} if content is not None else {}), **(headers or {})}
        sleep = self._sleep if interrupt is None else functools.partial(self._sleep_unless, interrupt)
        wait: Callable[[RetryCallState], float] = self._wait
        if deadlines is not None:
            wait = _BeforeDeadlines(wait, deadlines, self.early_retry_lead_s)
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.max_retries + 1),
            wait=wait,
            retry=retry_if_exception(lambda exc: _retryable(exc, retry)),
            sleep=sleep,
            before_sleep=lambda state: _log_retry(method, path, state),
            reraise=True,
        )
        last: BaseException | None = None
        async for attempt in retrying:
            if last is not None and interrupt is not None and interrupt.is_set():
                # Interrupted before or while waiting to retry (the wait ends at once): the
                # failure being retried ends the call, outside tenacity (no further attempt).
                raise last
            with attempt:
                # A new request per attempt: SignatureAuth signs it with a fresh nonce.
                request = self._http.build_request(
                    method, path, content=content, headers=headers, params=params
                )
                try:
                    response = await self._http.send(request, auth=auth)
                    self._note_clock(response)
                    if response.is_error:
                        raise OrchestratorAPIError.from_response(response)
                except Exception as exc:
                    last = exc
                    raise
                return response
        raise AssertionError("unreachable: tenacity either returns or reraises")  # pragma: no cover

    def _note_clock(self, response: httpx.Response) -> None:
        """``clock_offset_s`` from the answer's ``Date`` (truncated to the second: its middle)."""
        date = response.headers.get("date")
        if not date:
            return
        try:
            at = email.utils.parsedate_to_datetime(date)
        except (TypeError, ValueError, IndexError, OverflowError):
            return
        if at.tzinfo is None:  # "-0000": UTC, said without a zone
            at = at.replace(tzinfo=dt.UTC)
        server = at.timestamp() + 0.5
        offset = server - time.time()
        self.clock_offset_s = 0.0 if abs(offset) < 1.0 else offset

    async def _sleep_unless(self, interrupt: asyncio.Event, seconds: float) -> None:
        """Sleep between attempts, waking at once when ``interrupt`` is set."""
        sleeper = asyncio.ensure_future(self._sleep(seconds))
        waiter = asyncio.ensure_future(interrupt.wait())
        try:
            await asyncio.wait({sleeper, waiter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (sleeper, waiter):
                task.cancel()
            await asyncio.gather(sleeper, waiter, return_exceptions=True)


class _BeforeDeadlines:
    """The wait before a retry (``wait``'s), cut short when it would let one of ``deadlines``
    (event loop times, read again at each wait) pass: the retry then comes ``lead_s`` before the
    nearest one ahead (at once with less than that left). Once per deadline: the early retry's
    own deadline and any within ``lead_s`` after the retry are done with, and the next early
    retry comes ``lead_s`` after it at the soonest (a shorter wait asked for stays). A failed
    early retry is waited after as the server asks (or the backoff says), unless that would let
    a later deadline pass."""

    def __init__(
        self, wait: Callable[[RetryCallState], float], deadlines: Collection[float], lead_s: float
    ) -> None:
        self._wait = wait
        self._deadlines = deadlines
        self._lead_s = lead_s
        #: When the last early retry was sent (event loop time); -inf before one.
        self._early_at = -math.inf

    def __call__(self, state: RetryCallState) -> float:
        seconds = self._wait(state)
        now = asyncio.get_running_loop().time()
        done_until = max(now, self._early_at + self._lead_s)
        nearest = min((d for d in self._deadlines if d > done_until), default=None)
        if nearest is None or now + seconds <= nearest - self._lead_s:
            return seconds
        at = max(now, nearest - self._lead_s, self._early_at + self._lead_s)
        if at >= now + seconds:
            return seconds  # what was asked ends sooner: no early retry needed
        self._early_at = at
        log.info("retry_before_deadline", wait_s=round(seconds, 1), deadline_in_s=round(nearest - now, 1))
        return at - now


def _seg(value: str) -> str:
    """One path segment, escaped (ids come from the server, but never trust a path)."""
    return quote(value, safe="")


def _log_retry(method: str, path: str, state: RetryCallState) -> None:
    exc = state.outcome.exception() if state.outcome is not None else None
    reason = f"{exc.status} {exc.code}" if isinstance(exc, OrchestratorAPIError) else type(exc).__name__
    wait = state.next_action.sleep if state.next_action is not None else None
    log.warning(
        "request_retry", method=method, path=path, attempt=state.attempt_number, reason=reason, wait_s=wait
    )
