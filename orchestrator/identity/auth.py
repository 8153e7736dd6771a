"""Contributor authentication: RFC 9421 signed requests, resolved to a provider or node.

``signed_request`` checks the signature (``orchestrator.core.signing``), counts the request
toward its key's rate limit (a registration toward its address's and key's registration limits
first) and, within them, claims the nonce in the hot store (one round trip; a replay counts
nothing);
``current_node`` and ``current_provider`` then load the signer, so a handler can only ever
act as the identity that signed.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Literal
from urllib.parse import urlsplit

import structlog
from fastapi import Depends, Request, Security
from fastapi.security import APIKeyHeader
from sqlalchemy import bindparam, select

from orchestrator.core import ratelimit
from orchestrator.core.errors import BadRequest, RateLimited, Unauthorized
from orchestrator.core.hotstore import Quota
from orchestrator.core.routing import before_body, guarded_answer
from orchestrator.core.signing import (
    SIGNATURE_CHALLENGE,
    SignedRequest,
    accept_signature,
    signature_refused,
    target_uri,
    verify_request,
)
from orchestrator.core.state import AppState, Session, State, app_state
from orchestrator.identity import repository as repo
from orchestrator.identity.models import Node, NodeStatus, Provider
from orchestrator.identity.service import banned_node_of, network_of, retired_provider

# Declares the scheme in the OpenAPI document; the checks are ours (auto_error=False).
signature_scheme = APIKeyHeader(
    name="Signature",
    scheme_name="HttpMessageSignature",
    description=(
        "RFC 9421 HTTP Message Signature, algorithm ed25519. Send Signature-Input and Signature, "
        "and Content-Digest (RFC 9530) with any body. Parameters keyid, created and nonce are "
        "required; @method and @target-uri (or @path and @query) must be covered, plus "
        "content-digest when there is a body. A 401 for the signature carries "
        "WWW-Authenticate: Signature and Accept-Signature (RFC 9421, section 5.1) naming the "
        "covered components and parameters asked for. "
        "See PROTOCOL.md."
    ),
    auto_error=False,
)


# Signing keys a process remembers as registered (``AppState.known_keys``); past it the memory
# starts again, which costs each key one primary-key read more.
KNOWN_KEYS_MAX = 100_000
_IS_REGISTERED = {
    "node": select(Node.id).where(Node.id == bindparam("key")),
    "provider": select(Provider.id).where(Provider.id == bindparam("key")),
}
Kind = Literal["node", "provider"]
# What a guard checks between the signature and the hot store, given the signer's key id: it
# answers the quotas the request counts toward before its key's own, with its nonce.
Admission = Callable[[str], Awaitable[Sequence[Quota]]]


async def is_registered(state: AppState, kind: Kind, keyid: str, address: str) -> bool:
    """Whether ``keyid`` is a registered node (provider) key: from this process's memory, else
    one primary-key read outside any transaction, which first counts toward the requests of
    unseen keys from ``address`` (``limits.unseen_keys_per_ip``: keys cost nothing to make, and a
    request of a fresh one would otherwise cost the database a read at whatever rate they come).
    Keys are never unregistered (a ban is checked by the route's own read of the signer)."""
    if (kind, keyid) in state.known_keys:
        return True
    limits = state.settings.limits
    if limits.unseen_keys_per_ip:
        window_s = limits.unseen_keys_window_s
        await ratelimit.enforce(
            state,
            f"ip:unseen:{network_of(address)}",
            limit=limits.unseen_keys_per_ip,
            window_s=window_s,
            what=f"signed requests in {window_s} s from this address with keys this server has not "
            "seen yet (ORCH_LIMITS__UNSEEN_KEYS_PER_IP)",
        )
    async with state.reader.connect() as conn:
        found = (await conn.execute(_IS_REGISTERED[kind], {"key": keyid})).first() is not None
    if found:
        if len(state.known_keys) >= KNOWN_KEYS_MAX:
            state.known_keys.clear()
        state.known_keys.add((kind, keyid))
    return found


def registered(request: Request, state: AppState, kind: Kind) -> Admission:
    """Refuse an unregistered signer with 401 ``unknown_key`` before its nonce is recorded: a key
    costs nothing to make, so requests signed with fresh keys each left a nonce (and a
    rate-limit counter) in Redis for the nonce's lifetime, at whatever rate they came."""

    async def check(keyid: str) -> Sequence[Quota]:
        if not await is_registered(state, kind, keyid, client_ip(request)):
            raise unknown_node() if kind == "node" else unknown_provider()
        return ()

    return check


def registering(request: Request, state: AppState, kind: Kind) -> Admission:
    """A registration's admission: a key registered already passes (registering again is
    idempotent; every machine of a provider registers the provider's key when its worker
    starts). A new key counts toward its address's registrations (an IPv6 /64 as one, as for
    the pools' per-IP rules), then toward its own, attempts that fail later included, in the
    step that checks and records its nonce: a replayed registration counts toward neither (a
    captured one sent again cannot use up the key's registrations), and one past a limit
    records no nonce (an address past its limit writes nothing more per key)."""

    async def check(keyid: str) -> Sequence[Quota]:
        if await is_registered(state, kind, keyid, client_ip(request)):
            return ()
        limits = state.settings.limits
        window_s = limits.registration_window_s
        return (
            Quota(
                f"ip:register:{network_of(client_ip(request))}",
                limits.registration_per_ip,
                window_s,
                what=f"registrations in {window_s} s from this address (ORCH_LIMITS__REGISTRATION_PER_IP)",
            ),
            Quota(
                f"key:register:{keyid}",
                limits.registration_per_key,
                window_s,
                what=f"registrations in {window_s} s of this key (ORCH_LIMITS__REGISTRATION_PER_KEY)",
            ),
        )

    return check


async def _verified(
    request: Request, state: AppState, *, limit: int, budget: str, admission: Admission
) -> SignedRequest:
    """Check the signature and the signer (``admission``), then count the request toward the
    admission's quotas and its key's ``limit`` (the settings field named ``budget``) and, within
    them, claim the nonce."""
    body = await request.body()
    host = request.headers.get("host") or (
        f"{request.url.hostname}:{request.url.port}" if request.url.port else str(request.url.hostname)
    )
    allowed = state.settings.server.allowed_hosts
    if allowed and (urlsplit(f"//{host}").hostname or "") not in allowed:
        raise BadRequest(
            f"signed requests must address one of {', '.join(allowed)} (ORCH_SERVER__ALLOWED_HOSTS)",
            code="host_not_allowed",
        )
    url = target_uri(request.scope, host, scheme=state.settings.server.public_scheme)

    def verify(signed_url: str) -> SignedRequest:
        return verify_request(
            method=request.method,
            url=signed_url,
            query=request.url.query,
            headers=request.headers.items(),
            body=body,
            now=state.clock.now(),
            window_s=state.settings.signature.window_s,
        )

    try:
        signed = verify(url)
    except Unauthorized as refused:
        # A URL sent with an empty query ("/v1/nodes/me?") was signed with its "?" as
        # @target-uri (RFC 9421, 2.2.2: the target URI as sent), which ASGI does not keep (an
        # empty query string either way): the same resource, checked once more with it.
        if request.url.query or refused.code != "signature_invalid":
            raise
        try:
            signed = verify(url + "?")
        except Unauthorized:
            raise refused from None
    # The signature holds: the request's log line names its key, a refusal's below included.
    structlog.contextvars.bind_contextvars(keyid=signed.keyid)
    window_s = state.settings.limits.signed_window_s
    quotas = [
        *await admission(signed.keyid),
        Quota(
            f"key:{signed.keyid}",
            limit,
            window_s,
            what=f"signed requests in {window_s} s with this key (ORCH_LIMITS__{budget.upper()})",
        ),
    ]
    now, ttl_s = state.clock.now(), state.settings.signature.effective_nonce_ttl_s
    decision = await state.hot_store.admit(signed.keyid, signed.nonce, ttl_s, quotas, now, signed.created)
    replayed = signature_refused("this nonce was already used with this key", code="nonce_replayed")
    if decision is None:
        raise replayed
    if decision.forgotten_before is not None:
        # Redis lost the nonces spent before then (docs/PROTOCOL.md): this one may be among them.
        # The client's remedy is a replay's, so the code is too, with when its memory starts.
        since = decision.forgotten_before
        raise signature_refused(
            f"this nonce may already have been used: the server's record of spent nonces starts at "
            f"{since} (epoch seconds), after this signature's created ({signed.created}); sign the "
            "request afresh, with a new nonce",
            code="nonce_replayed",
            extra={"nonces_remembered_since": since},
        )
    if decision.refused_by is not None:
        # Refused before it did anything: its nonce is not spent (in the hot store nor below),
        # so the same signed request may be sent again after Retry-After.
        past = decision.refused_by
        raise RateLimited(f"more than {past.limit} {past.what}", retry_after=decision.retry_after_s)
    if state.spent_nonces is not None:
        # The nonce's row, in a short transaction of its own before the request's. Unless it
        # is written (a replay: the row was there), the request ends here having done nothing,
        # so the hot store takes back what ``admit`` counted, and, when the write failed (its
        # transaction aborted or the database unreachable: a 503, or the request cancelled),
        # forgets the nonce, so the same signed request may be sent again; a row that was
        # written all the same still refuses it as a replay.
        claimed: bool | None = None
        try:
            claimed = await state.spent_nonces.claim(signed.keyid, signed.nonce, ttl_s, state.clock.utcnow())
        finally:
            if not claimed:
                await state.hot_store.unadmit(signed.keyid, signed.nonce, quotas, now, spent=claimed is False)
        if not claimed:
            raise replayed
    return signed


def _signature(kind: Kind, *, registration: bool) -> Callable[[Request], Awaitable[SignedRequest]]:
    budget = "signed_per_key" if kind == "node" else "signed_per_provider_key"

    async def guard(request: Request) -> SignedRequest:
        state = app_state(request)
        admission = (registering if registration else registered)(request, state, kind)
        limit = getattr(state.settings.limits, budget)
        try:
            return await guarded_answer(
                request,
                "signed",
                lambda: _verified(request, state, limit=limit, budget=budget, admission=admission),
            )
        except Unauthorized as exc:
            # RFC 9421, section 5: the answer says which signature the server asks for; RFC 9110,
            # section 11.6.1: a 401 names the authentication scheme.
            exc.headers.setdefault("WWW-Authenticate", SIGNATURE_CHALLENGE)
            exc.headers.setdefault("Accept-Signature", accept_signature(has_body=bool(await request.body())))
            raise

    return guard


node_signature = _signature("node", registration=False)
provider_signature = _signature("provider", registration=False)
node_registration_signature = _signature("node", registration=True)
provider_registration_signature = _signature("provider", registration=True)


@before_body(node_signature)
async def signed_request(
    request: Request, _scheme: Annotated[str | None, Security(signature_scheme)] = None
) -> SignedRequest:
    """A request signed by a node key (one per machine): ``limits.signed_per_key``. Checked
    before the body is decoded (``core.routing``)."""
    return await node_signature(request)


@before_body(provider_signature)
async def provider_signed_request(
    request: Request, _scheme: Annotated[str | None, Security(signature_scheme)] = None
) -> SignedRequest:
    """A request signed by a provider key, which every machine of the provider shares (each
    worker reads its balance and verdicts with it): ``limits.signed_per_provider_key``."""
    return await provider_signature(request)


@before_body(node_registration_signature)
async def node_registration_request(
    request: Request, _scheme: Annotated[str | None, Security(signature_scheme)] = None
) -> SignedRequest:
    """A node's registration, the one node-signed request of a key not registered yet."""
    return await node_registration_signature(request)


@before_body(provider_registration_signature)
async def provider_registration_request(
    request: Request, _scheme: Annotated[str | None, Security(signature_scheme)] = None
) -> SignedRequest:
    """A provider's registration, the one provider-signed request of a key not registered yet."""
    return await provider_registration_signature(request)


Signed = Annotated[SignedRequest, Depends(signed_request)]
ProviderSigned = Annotated[SignedRequest, Depends(provider_signed_request)]
RegisteringNode = Annotated[SignedRequest, Depends(node_registration_request)]
RegisteringProvider = Annotated[SignedRequest, Depends(provider_registration_request)]


def unknown_node() -> Unauthorized:
    return signature_refused("no node is registered with this key", code="unknown_key")


async def current_node(signed: Signed, session: Session) -> Node:
    node = await repo.get_node(session, signed.keyid)
    if node is None:
        raise unknown_node()
    if node.status == NodeStatus.banned:
        raise await banned_node_of(session, node.id)
    structlog.contextvars.bind_contextvars(node_id=node.id)
    return node


@dataclass(frozen=True, slots=True)
class NodeRef:
    """The signer's identity and status, read without opening a transaction."""

    id: str
    provider_id: str
    ip_address: str | None
    status: str


_NODE_REF = select(Node.provider_id, Node.ip_address, Node.status).where(Node.id == bindparam("node_id"))


async def signed_node(signed: Signed, state: State) -> NodeRef:
    """The signing node from one primary-key read outside any transaction (on PostgreSQL an
    autocommit SELECT: no BEGIN/COMMIT round trips), for paths that mostly touch the hot store."""
    async with state.reader.connect() as conn:
        row = (await conn.execute(_NODE_REF, {"node_id": signed.keyid})).first()
        if row is not None and row.status == NodeStatus.banned:
            raise await banned_node_of(conn, signed.keyid)
    if row is None:
        raise unknown_node()
    structlog.contextvars.bind_contextvars(node_id=signed.keyid)
    return NodeRef(signed.keyid, row.provider_id, row.ip_address, row.status)


def unknown_provider() -> Unauthorized:
    return signature_refused("no provider is registered with this key", code="unknown_key")


async def current_provider(signed: ProviderSigned, session: Session) -> Provider:
    provider = await repo.get_provider(session, signed.keyid)
    if provider is None:
        raise unknown_provider()
    if provider.retired_at is not None:
        raise retired_provider()
    structlog.contextvars.bind_contextvars(provider_id=provider.id)
    return provider


CurrentNode = Annotated[Node, Depends(current_node)]
SignedNode = Annotated[NodeRef, Depends(signed_node)]
CurrentProvider = Annotated[Provider, Depends(current_provider)]


def client_ip(request: Request) -> str:
    return request.client.host if request.client else "unknown"
