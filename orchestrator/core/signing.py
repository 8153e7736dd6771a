"""RFC 9421 HTTP Message Signatures with Ed25519, as PROTOCOL.md specifies.

Both directions live here: ``verify_request`` (the server's checks, each failure with its
own stable code) and ``sign_headers`` / ``SignatureAuth`` (the client side used by the
worker SDK and the tests). Structured fields are parsed with ``http_sf``; the signature
base is built and checked by ``http_message_signatures``; Content-Digest (RFC 9530) is
checked here (``check_content_digest``), the Ed25519 arithmetic is PyNaCl's.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import secrets
import time
from collections.abc import Generator, Iterable, MutableMapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import http_sf
import httpx
from http_message_signatures import (
    HTTPMessageSigner,
    HTTPMessageVerifier,
    HTTPSignatureAlgorithm,
    HTTPSignatureComponentResolver,
    HTTPSignatureKeyResolver,
    InvalidSignature,
)
from http_message_signatures.exceptions import HTTPMessageSignaturesException
from http_sf.types import BareItemType
from nacl.exceptions import BadSignatureError
from nacl.signing import SigningKey, VerifyKey

from orchestrator.core.errors import Unauthorized, UriTooLong
from orchestrator.core.keys import b64u_decode, is_key_id, key_id_of

ALGORITHM = "ed25519"
DEFAULT_COMPONENTS: tuple[str, ...] = ("@method", "@target-uri")
MAX_NONCE_LENGTH = 128
MAX_SIGNATURE_HEADER = 4096
# Signatures (labels) a request may carry: the client's, and any a proxy on the way added.
MAX_SIGNATURES = 8
MAX_HOST_LENGTH = 255
# A signed result keeps its target URI as evidence, in a column of this many characters.
MAX_TARGET_URI_LENGTH = 2048
# The Content-Digest algorithms checked (RFC 9530's registered, not deprecated ones); members
# of other algorithms are ignored, as RFC 9530 lets a recipient do.
DIGEST_ALGORITHMS: dict[str, Any] = {"sha-256": hashlib.sha256, "sha-512": hashlib.sha512}


class NaclEd25519(HTTPSignatureAlgorithm):
    """RFC 9421 ``ed25519`` backed by PyNaCl; keys are raw 32-byte keys or PyNaCl objects."""

    algorithm_id = ALGORITHM

    def __init__(self, public_key: Any = None, private_key: Any = None) -> None:
        self.public_key = VerifyKey(public_key) if isinstance(public_key, bytes) else public_key
        self.private_key = SigningKey(private_key) if isinstance(private_key, bytes) else private_key

    def sign(self, message: bytes) -> bytes:
        return bytes(self.private_key.sign(message).signature)

    def verify(self, signature: bytes, message: bytes) -> None:
        try:
            self.public_key.verify(message, signature)
        except BadSignatureError as exc:
            raise InvalidSignature("Ed25519 signature does not verify") from exc


class _OneKey(HTTPSignatureKeyResolver):
    def __init__(
        self, key_id: str, verify_key: VerifyKey | None = None, signing_key: SigningKey | None = None
    ):
        self.key_id = key_id
        self.verify_key = verify_key
        self.signing_key = signing_key

    def resolve_public_key(self, key_id: str) -> VerifyKey | None:
        return self.verify_key if key_id == self.key_id else None

    def resolve_private_key(self, key_id: str) -> SigningKey:
        if key_id != self.key_id or self.signing_key is None:
            raise KeyError(key_id)
        return self.signing_key


class _Verifier(HTTPMessageVerifier):
    def validate_created_and_expires(self, sig_input: Any, max_age: Any = None) -> None:
        """Nothing: the time checks are ours (``_check_params``, against the injectable clock,
        with the configured window), done before the library sees the message. The library's
        would also turn any time a datetime cannot hold (an ``expires`` past year 9999, which is
        simply not yet passed) into a refusal."""


class _HeaderLines:
    """Header lines in order, exposing ``items()`` as the signature library expects."""

    def __init__(self, lines: list[tuple[str, str]]) -> None:
        self._lines = lines

    def items(self) -> list[tuple[str, str]]:
        return self._lines


@dataclass
class _Message:
    """The request shape the signature library reads: method, absolute URL, header lines."""

    method: str
    url: str
    headers: Any


@dataclass(frozen=True)
class SignedRequest:
    """A request whose signature, digest, time window and nonce all checked out."""

    keyid: str
    nonce: str
    created: int
    covered: tuple[str, ...]
    method: str
    target_uri: str
    signature_input: str
    signature: str
    content_digest: str | None
    body: bytes
    # Each header line the signature covers, lower-cased name and value, as received: the
    # evidence a later check needs besides Signature-Input and Signature.
    signed_fields: tuple[tuple[str, str], ...] = ()
    # The server time (epoch seconds) its created and expires were checked against: a result is
    # recorded as received then, so that its evidence re-checked at that time holds as it did.
    verified_at: float = 0.0
    # The window (seconds) ``created`` was checked against then: a result keeps it, so that its
    # evidence is re-checked by it, whatever the setting is later.
    window_s: int = 0


# The challenge every 401 of a signed route carries (RFC 9110, section 11.6.1: a 401 names
# at least one). RFC 9421 registers no authentication scheme; ``Signature`` names this one, and
# the guard adds ``Accept-Signature`` (``accept_signature``) saying which signature to send.
SIGNATURE_CHALLENGE = "Signature"


def signature_refused(detail: str, *, code: str, extra: dict[str, Any] | None = None) -> Unauthorized:
    """A 401 of the signature checks, with its ``WWW-Authenticate`` challenge (and ``extra``
    members in its problem)."""
    return Unauthorized(
        detail,
        code=code,
        title="Request signature refused",
        headers={"WWW-Authenticate": SIGNATURE_CHALLENGE},
        extra=extra,
    )


def _fail(code: str, detail: str) -> Unauthorized:
    return signature_refused(detail, code=code)


def _parse_dictionary(name: str, value: str) -> dict[str, Any]:
    if len(value) > MAX_SIGNATURE_HEADER:
        raise _fail("signature_malformed", f"{name} is longer than {MAX_SIGNATURE_HEADER} bytes")

    def reject_duplicate(key: str, context: str) -> None:
        if context == "dictionary":
            raise ValueError(f"duplicate label {key!r}")

    try:
        parsed = http_sf.parse(value.encode("ascii"), tltype="dictionary", on_duplicate_key=reject_duplicate)
    except (ValueError, TypeError, UnicodeEncodeError) as exc:
        raise _fail("signature_malformed", f"{name} is not a valid structured-field dictionary") from exc
    if not isinstance(parsed, dict) or not parsed:
        raise _fail("signature_malformed", f"{name} holds no signature")
    return parsed


@dataclass(frozen=True)
class _Member:
    """One labelled signature: its Signature-Input and Signature members, as parsed."""

    label: str
    input: tuple[Any, dict[str, Any]]
    signature: tuple[Any, dict[str, Any]]

    @property
    def keyid(self) -> object:
        return self.input[1].get("keyid")


@dataclass(frozen=True)
class _Parsed:
    label: str
    components: tuple[str, ...]
    params: dict[str, Any]
    signature: bytes


def _signature_members(sig_input: str, sig: str) -> list[_Member]:
    inputs = _parse_dictionary("Signature-Input", sig_input)
    signatures = _parse_dictionary("Signature", sig)
    if len(inputs) > MAX_SIGNATURES:
        raise _fail("signature_malformed", f"a request carries at most {MAX_SIGNATURES} signatures")
    if inputs.keys() != signatures.keys():
        raise _fail("signature_malformed", "Signature-Input and Signature use different labels")
    return [_Member(label, inputs[label], signatures[label]) for label in inputs]


def _parse_member(member: _Member) -> _Parsed:
    members, params = member.input
    sig_value, _ = member.signature
    if not isinstance(members, list):
        raise _fail("signature_malformed", "Signature-Input member must be an inner list of components")
    components: list[str] = []
    for item, item_params in members:
        if not isinstance(item, str) or item_params:
            raise _fail("signature_malformed", "covered components must be plain strings")
        components.append(item)
    if not isinstance(sig_value, bytes):
        raise _fail("signature_malformed", "Signature member must be a byte sequence")
    return _Parsed(label=member.label, components=tuple(components), params=dict(params), signature=sig_value)


def accept_signature(*, has_body: bool) -> str:
    """The ``Accept-Signature`` field (RFC 9421, section 5.1) a refused signed request is
    answered with: the signature this server asks for. It covers ``@method``, ``@target-uri``
    and, for a request with a body, ``content-digest``, with a ``created`` time and ``alg``
    ``ed25519``. ``keyid`` and ``nonce`` are required too, but section 5.1 gives both a value (the
    key to sign with, the nonce to include) that only the client can choose: they are not named."""
    components: list[http_sf.ItemType] = ["@method", "@target-uri"]
    if has_body:
        components.append("content-digest")
    params: dict[str, BareItemType] = {"created": True, "alg": ALGORITHM}
    return http_sf.ser({"sig1": (components, params)})


def _check_params(params: dict[str, Any], *, now: float, window_s: int) -> tuple[str, int, str]:
    for name in ("keyid", "created", "nonce"):
        if name not in params:
            raise _fail("signature_param_missing", f"the signature parameter {name!r} is required")
    keyid, created, nonce = params["keyid"], params["created"], params["nonce"]
    if not isinstance(keyid, str) or not isinstance(nonce, str) or type(created) is not int:
        raise _fail("signature_malformed", "keyid and nonce must be strings, created an integer")
    if not 8 <= len(nonce) <= MAX_NONCE_LENGTH:
        raise _fail("signature_malformed", f"nonce must be 8 to {MAX_NONCE_LENGTH} characters")
    alg = params.get("alg")
    if alg is not None and alg != ALGORITHM:
        raise _fail("unsupported_algorithm", f"alg {alg!r} is not supported; use {ALGORITHM!r}")
    expires = params.get("expires")
    if expires is not None:
        if type(expires) is not int:
            raise _fail("signature_malformed", "expires must be an integer")
        if expires < now:
            raise _fail("signature_expired", "the signature's expires time has passed")
    if created < now - window_s:
        raise _fail("signature_stale", f"created is more than {window_s} s in the past")
    if created > now + window_s:
        raise _fail("signature_from_future", f"created is more than {window_s} s in the future")
    return keyid, created, nonce


def check_content_digest(value: str, body: bytes) -> None:
    """Check a Content-Digest field (RFC 9530) against the raw body bytes, in constant time.

    The field must be a dictionary of byte sequences holding at least one digest of a supported
    algorithm (``DIGEST_ALGORITHMS``), and every supported one must match (``digest_mismatch``
    otherwise); members of other algorithms are ignored (RFC 9530, section 2: a recipient may
    ignore algorithms it does not support). Anything else is ``digest_malformed``.
    """

    def reject_duplicate(key: str, context: str) -> None:
        if context == "dictionary":
            raise ValueError(f"duplicate algorithm {key!r}")

    try:
        members: Any = http_sf.parse(
            value.encode("ascii"), tltype="dictionary", on_duplicate_key=reject_duplicate
        )
    except (ValueError, TypeError, UnicodeEncodeError) as exc:
        raise _fail("digest_malformed", "Content-Digest is not a valid structured-field dictionary") from exc
    if not isinstance(members, dict) or not members:
        raise _fail("digest_malformed", "Content-Digest holds no digest")
    supported: list[tuple[str, bytes]] = []
    for algorithm, (digest, _params) in members.items():
        if not isinstance(digest, bytes):
            raise _fail("digest_malformed", f"Content-Digest member {algorithm!r} is not a byte sequence")
        hasher = DIGEST_ALGORITHMS.get(algorithm)
        if hasher is None:
            continue
        if len(digest) != hasher().digest_size:
            raise _fail("digest_malformed", f"Content-Digest: the {algorithm} digest has the wrong length")
        supported.append((algorithm, digest))
    if not supported:
        raise _fail(
            "digest_malformed",
            f"Content-Digest holds no digest of a supported algorithm ({', '.join(DIGEST_ALGORITHMS)})",
        )
    for algorithm, digest in supported:
        if not hmac.compare_digest(digest, DIGEST_ALGORITHMS[algorithm](body).digest()):
            raise _fail("digest_mismatch", f"Content-Digest: the {algorithm} digest does not match the body")


def _check_coverage(components: Sequence[str], *, query: str, has_body: bool) -> None:
    covered = set(components)
    if "@method" not in covered:
        raise _fail("signature_coverage_insufficient", "the signature must cover @method")
    if "@target-uri" not in covered:
        if "@path" not in covered:
            raise _fail("signature_coverage_insufficient", "the signature must cover @target-uri or @path")
        if query and "@query" not in covered:
            raise _fail("signature_coverage_insufficient", "the signature must cover @query")
    if has_body and "content-digest" not in covered:
        raise _fail("signature_coverage_insufficient", "a request with a body must sign content-digest")


# The library's component resolver is untyped; it is used only through its documented readers.
_ComponentResolver: Any = HTTPSignatureComponentResolver


@dataclass(frozen=True)
class _UrlReading:
    target_uri: str
    path: str
    query: str


def _read_url(url: str) -> _UrlReading | None:
    """``url`` as the signature library reads it for ``@target-uri``, ``@path`` and ``@query``
    (its strict RFC 3986 grammar; userinfo and fragment dropped), or None if it does not parse."""
    try:
        resolver = _ComponentResolver(_Message(method="GET", url=url, headers=_HeaderLines([])))
    except HTTPMessageSignaturesException:
        return None
    return _UrlReading(str(resolver.get_target_uri()), str(resolver.get_path()), str(resolver.get_query()))


@lru_cache(maxsize=1024)  # a deployment sees a handful of Host values; parse each once
def is_valid_host(host: str) -> bool:
    """Whether a ``Host`` field value is one RFC 3986 authority: a reg-name, an IPv4 address or
    a bracketed IP literal, with an optional ``:port``, and nothing else (no userinfo, no
    ``/``, ``?`` or ``#``, no whitespace), at most ``MAX_HOST_LENGTH`` characters. An empty
    value (allowed by RFC 9112) is valid; the server's own address then stands in for it.

    It is checked with the signature library's URL grammar: a Host that passes can only ever
    be read back as the authority of the URL the signature is verified for.
    """
    if not host:
        return True
    if len(host) > MAX_HOST_LENGTH:
        return False
    url = f"http://{host}/"
    return _read_url(url) == _UrlReading(target_uri=url, path="/", query="?")


def target_uri(scope: MutableMapping[str, Any], host: str, *, scheme: str | None = None) -> str:
    """The absolute request URI as the client addressed it (raw path, raw query), with
    ``scheme`` instead of the one the server received when given (TLS that ends at a proxy).

    Raises ``UriTooLong`` (414 ``uri_too_long``) past ``MAX_TARGET_URI_LENGTH`` characters,
    and ``Unauthorized`` (``signature_invalid``) unless the signature library reads the URL
    back with exactly this request's path and query: a signature can then never be checked
    against another path than the one being served.
    """
    raw_path = (scope.get("raw_path") or scope["path"].encode()).decode("latin-1")
    query = scope.get("query_string", b"").decode("latin-1")
    url = f"{scheme or scope['scheme']}://{host}{raw_path}"
    if query:
        url = f"{url}?{query}"
    if len(url) > MAX_TARGET_URI_LENGTH:
        raise UriTooLong(
            f"the signed URL ({len(url)} characters: scheme, Host, path and query) is longer than "
            f"{MAX_TARGET_URI_LENGTH} characters"
        )
    if _read_url(url) != _UrlReading(target_uri=url, path=raw_path, query="?" + query):
        raise _fail("signature_invalid", "the request's URL is not an absolute URI a signature can cover")
    return url


def verify_request(
    *,
    method: str,
    url: str,
    query: str,
    headers: Iterable[tuple[str, str]],
    body: bytes,
    now: float,
    window_s: int,
) -> SignedRequest:
    """Check a request's signature, coverage, time window and digest (not the nonce).

    A request may carry several labelled signatures (RFC 9421, section 4.3: a proxy on the way
    may add its own). Those whose ``keyid`` is not an Ed25519 key id are someone else's and are
    ignored; of the others, exactly one must pass every check, and it is the one returned.

    Raises ``Unauthorized`` with a stable ``code`` on the first failed check (for several
    signatures by Ed25519 key ids none of which passes, the first one's).
    """
    request = _Request(method=method, url=url, query=query, header_lines=list(headers), body=body)
    if request.signature_input is None or request.signature is None:
        raise _fail("signature_missing", "Signature-Input and Signature headers are required")
    members = _signature_members(request.signature_input, request.signature)
    if len(members) == 1:
        return request.verify(members[0], now=now, window_s=window_s, alone=True)
    ours = [member for member in members if isinstance(member.keyid, str) and is_key_id(member.keyid)]
    if not ours:
        raise _fail(
            "unknown_key",
            f"none of the {len(members)} signatures has a keyid that is a base64url Ed25519 public key",
        )
    verified: list[SignedRequest] = []
    refusals: list[Unauthorized] = []
    for member in ours:
        try:
            verified.append(request.verify(member, now=now, window_s=window_s, alone=False))
        except Unauthorized as exc:
            refusals.append(exc)
    if len(verified) == 1:
        return verified[0]
    if not verified:
        raise refusals[0]
    raise _fail(
        "signature_malformed",
        f"{len(verified)} signatures by Ed25519 key ids verify; exactly one is expected per request",
    )


class _Request:
    """The parts of one request its signatures are checked against; the body's digest is checked
    once, however many signatures there are."""

    def __init__(
        self, *, method: str, url: str, query: str, header_lines: list[tuple[str, str]], body: bytes
    ) -> None:
        self.method = method
        self.url = url
        self.query = query
        self.header_lines = header_lines
        self.body = body
        lookup: dict[str, list[str]] = {}
        for name, value in header_lines:
            lookup.setdefault(name.lower(), []).append(value)

        def joined(name: str) -> str | None:
            values = lookup.get(name)
            return ", ".join(values) if values else None

        self.signature_input = joined("signature-input")
        self.signature = joined("signature")
        self.content_digest = joined("content-digest")
        self._digest_checked = False
        self._digest_refusal: Unauthorized | None = None

    def check_digest(self) -> None:
        if not self._digest_checked and self.content_digest is not None:
            try:
                check_content_digest(self.content_digest, self.body)
            except Unauthorized as exc:
                self._digest_refusal = exc
        self._digest_checked = True
        if self._digest_refusal is not None:
            raise self._digest_refusal

    def verify(self, member: _Member, *, now: float, window_s: int, alone: bool) -> SignedRequest:
        """Check one signature. When it is not ``alone``, the signature library is given the
        request with its Signature-Input and Signature holding this member only."""
        parsed = _parse_member(member)
        keyid, created, nonce = _check_params(parsed.params, now=now, window_s=window_s)
        if self.body and self.content_digest is None:
            raise _fail("digest_missing", "a request with a body must carry a Content-Digest header")
        _check_coverage(parsed.components, query=self.query, has_body=bool(self.body))
        if not is_key_id(keyid):
            raise _fail("unknown_key", "keyid is not a base64url Ed25519 public key")
        self.check_digest()
        lines = self.header_lines
        if not alone:
            try:
                own = [
                    ("signature-input", http_sf.ser({member.label: member.input})),
                    ("signature", http_sf.ser({member.label: member.signature})),
                ]
            except (ValueError, TypeError) as exc:
                raise _fail("signature_malformed", "the signature cannot be read back on its own") from exc
            lines = [(name, value) for name, value in lines if name.lower() not in _SIGNATURE_FIELDS] + own
        verifier = _Verifier(
            signature_algorithm=NaclEd25519,
            key_resolver=_OneKey(keyid, verify_key=VerifyKey(b64u_decode(keyid))),
        )
        message = _Message(method=self.method, url=self.url, headers=_HeaderLines(lines))
        try:
            verifier.verify(message, max_age=None)
        except (InvalidSignature, HTTPMessageSignaturesException) as exc:
            if isinstance(exc, InvalidSignature) and isinstance(exc.__cause__, BadSignatureError):
                raise _fail("signature_invalid", "the signature does not verify for this request") from exc
            # No signature base could be built (a parameter or covered component this server does
            # not know, a covered field the request lacks ...): say which, not that it did not verify.
            raise _fail("signature_malformed", f"the signature base cannot be built: {exc}") from exc
        return SignedRequest(
            keyid=keyid,
            nonce=nonce,
            created=created,
            covered=parsed.components,
            method=self.method,
            target_uri=self.url,
            # Whole, every signature: the evidence is the request as received.
            signature_input=self.signature_input or "",
            signature=self.signature or "",
            content_digest=self.content_digest,
            body=self.body,
            signed_fields=tuple(
                (name.lower(), value)
                for name, value in self.header_lines
                if name.lower() in parsed.components
            ),
            verified_at=now,
            window_s=window_s,
        )


_SIGNATURE_FIELDS = frozenset({"signature-input", "signature"})


# ---------------------------------------------------------------- client side


class _HeaderMap(dict[str, str]):
    """A plain header dict the library can read and write."""


def sign_headers(
    key: SigningKey,
    *,
    method: str,
    url: str,
    body: bytes = b"",
    headers: dict[str, str] | None = None,
    components: Sequence[str] = DEFAULT_COMPONENTS,
    created: int | None = None,
    nonce: str | None = None,
    expires: int | None = None,
) -> dict[str, str]:
    """Return the headers (Content-Digest, Signature-Input, Signature) for one request."""
    keyid = key_id_of(key)
    out = _HeaderMap(headers or {})
    signer = HTTPMessageSigner(signature_algorithm=NaclEd25519, key_resolver=_OneKey(keyid, signing_key=key))
    signer.sign(
        _Message(method=method.upper(), url=url, headers=out),
        key_id=keyid,
        created=dt.datetime.fromtimestamp(created, dt.UTC) if created is not None else None,
        expires=dt.datetime.fromtimestamp(expires, dt.UTC) if expires is not None else None,
        nonce=nonce if nonce is not None else secrets.token_urlsafe(16),
        covered_component_ids=tuple(components),
        body=body if body else None,
    )
    return dict(out)


class SignatureAuth(httpx.Auth):
    """httpx auth that signs every request with one Ed25519 key.

    A request refused ``401`` ``nonce_replayed`` with ``nonces_remembered_since`` (the server's
    Redis lost its record of spent nonces, and this signature was created before the server
    noticed: docs/PROTOCOL.md) did nothing; it is signed afresh, once, with a new nonce and a
    ``created`` not earlier than that time, and sent again.
    """

    requires_request_body = True
    requires_response_body = True

    def __init__(self, key: SigningKey, components: Sequence[str] = DEFAULT_COMPONENTS) -> None:
        self.key = key
        self.components = tuple(components)

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        response = yield self._sign(request, created=None)
        since = nonces_remembered_since(response)
        if since is not None:
            yield self._sign(request, created=max(int(time.time()), since))

    def _sign(self, request: httpx.Request, *, created: int | None) -> httpx.Request:
        for name in ("Signature-Input", "Signature", "Content-Digest"):
            request.headers.pop(name, None)
        covered = {name: value for name, value in request.headers.items() if name in self.components}
        request.headers.update(
            sign_headers(
                self.key,
                method=request.method,
                url=str(request.url),
                body=request.content,
                headers=covered,
                components=self.components,
                created=created,
            )
        )
        return request


def nonces_remembered_since(response: httpx.Response) -> int | None:
    """The ``nonces_remembered_since`` of a ``401`` ``nonce_replayed`` refusal, else None."""
    if response.status_code != 401:
        return None
    try:
        body = response.json()
    except ValueError:
        return None
    if not isinstance(body, dict) or body.get("code") != "nonce_replayed":
        return None
    since = body.get("nonces_remembered_since")
    return since if isinstance(since, int) and not isinstance(since, bool) else None
