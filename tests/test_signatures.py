"""Request signatures: RFC 9421 with ed25519 and RFC 9530 Content-Digest (PROTOCOL.md).

Three signers are used: the server's own ``sign_headers``; ``requests-http-signature``
(an independent implementation, in its default profile); and ``hand_signed`` below, which
builds the RFC 9421 signature base by hand so that any parameter can be left out or set
to a value no library would produce, while the signature itself stays valid.

Every refusal asserts the exact status and stable problem ``code``. Where a refusal could
pass for the wrong reason, the untampered request (same headers, same nonce) is sent
afterwards and accepted: a refused request must not burn its nonce, and this proves that
the tampering alone caused the refusal.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import http_sf
import httpx
import pytest
import redis.asyncio as aioredis
import requests
from asgi_lifespan import LifespanManager
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from http_message_signatures import HTTPSignatureKeyResolver, algorithms
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from nacl.signing import SigningKey
from prometheus_client import REGISTRY
from requests_http_signature import HTTPSignatureAuth

from orchestrator.app import create_app
from orchestrator.core.clock import FakeClock
from orchestrator.core.errors import Unauthorized
from orchestrator.core.hotstore import NONCES_SINCE_KEY, HotStore, Quota, RedisHotStore
from orchestrator.core.keys import generate_key, key_id_of
from orchestrator.core.signing import SignatureAuth, sign_headers, target_uri, verify_request
from orchestrator.settings import Settings
from orchestrator.worker.client import WorkerClient
from tests.conftest import Contributor, _drop_prefix, new_contributor, problem
from tests.pools_helpers import active_pool

BASE = "http://testserver"
ME = "/v1/nodes/me"
HEARTBEAT = "/v1/nodes/me/heartbeat"
BALANCE = "/v1/providers/me/balance"
HB_BODY = json.dumps({"metrics": {"gpu_util": 0.5}}).encode()
OTHER_BODY = json.dumps({"metrics": {"gpu_util": 0.9}}).encode()
REDIS_URL = os.environ.get("ORCH_TEST_REDIS_URL")


# ------------------------------------------------------------------ helpers


def signed(key: SigningKey, method: str, path: str, body: bytes = b"", **options: Any) -> dict[str, str]:
    """Headers from the server's own client-side signer for ``method BASE+path``."""
    return sign_headers(key, method=method, url=BASE + path, body=body, **options)


async def send(
    client: httpx.AsyncClient, method: str, path: str, headers: Any, body: bytes = b""
) -> httpx.Response:
    """Send exactly these headers and raw body bytes (a JSON content type when there is a body)."""
    extra = [("content-type", "application/json")] if body else []
    lines = list(headers.items()) if isinstance(headers, dict) else list(headers)
    return await client.request(method, path, content=body, headers=lines + extra)


def content_digest(body: bytes) -> str:
    return "sha-256=:" + base64.b64encode(hashlib.sha256(body).digest()).decode() + ":"


def _sf(value: int | str) -> str:
    return str(value) if isinstance(value, int) else f'"{value}"'


def hand_signed(
    key: SigningKey,
    method: str,
    path: str,
    body: bytes = b"",
    *,
    components: tuple[str, ...] | None = None,
    label: str = "sig1",
    digest: str | None = None,
    **params: int | str | None,
) -> dict[str, str]:
    """Sign by building the RFC 9421 signature base here, independently of any library.

    Parameters default to created=now, keyid=the key's id, nonce=random, alg="ed25519";
    pass one as None to leave it out, or any value to override it. A body gets a
    Content-Digest header (``digest`` when given, else its SHA-256), covered by default.
    """
    url = BASE + path
    if components is None:
        components = ("@method", "@target-uri", "content-digest") if body else ("@method", "@target-uri")
    defaults: dict[str, int | str | None] = {
        "created": int(time.time()),
        "keyid": key_id_of(key),
        "nonce": secrets.token_urlsafe(16),
        "alg": "ed25519",
    }
    chosen = {name: value for name, value in {**defaults, **params}.items() if value is not None}
    headers: dict[str, str] = {}
    if body:
        headers["Content-Digest"] = digest if digest is not None else content_digest(body)
    parts = urlsplit(url)
    values = {
        "@method": method.upper(),
        "@target-uri": url,
        "@authority": parts.netloc,
        "@path": parts.path,
        "@query": "?" + parts.query,
        "content-digest": headers.get("Content-Digest", ""),
    }
    signature_params = "(" + " ".join(f'"{c}"' for c in components) + ")"
    signature_params += "".join(f";{name}={_sf(value)}" for name, value in chosen.items())
    lines = [f'"{c}": {values[c]}' for c in components]
    lines.append(f'"@signature-params": {signature_params}')
    signature = key.sign("\n".join(lines).encode("ascii")).signature
    headers["Signature-Input"] = f"{label}={signature_params}"
    headers["Signature"] = f"{label}=:{base64.b64encode(signature).decode()}:"
    return headers


class _SeedKeyResolver(HTTPSignatureKeyResolver):
    """Resolves one keyid to a `cryptography` Ed25519 key built from the PyNaCl seed."""

    def __init__(self, key: SigningKey) -> None:
        self.key_id = key_id_of(key)
        self.private_key = Ed25519PrivateKey.from_private_bytes(bytes(key))

    def resolve_private_key(self, key_id: str) -> Ed25519PrivateKey:
        if key_id != self.key_id:
            raise KeyError(key_id)
        return self.private_key

    def resolve_public_key(self, key_id: str) -> Ed25519PublicKey | None:
        return self.private_key.public_key() if key_id == self.key_id else None


def independently_signed(
    key: SigningKey, method: str, path: str, json_body: Any = None, *, base: str = BASE
) -> requests.PreparedRequest:
    """A request for ``base + path`` prepared and signed by requests-http-signature (default
    profile), never sent."""
    auth = HTTPSignatureAuth(
        signature_algorithm=algorithms.ED25519,
        key_id=key_id_of(key),
        key_resolver=_SeedKeyResolver(key),
        use_nonce=True,
    )
    prepared = requests.Request(method, base + path, json=json_body).prepare()
    signed_request = auth(prepared)
    signature_input = signed_request.headers["Signature-Input"]
    # The library's default profile, as PROTOCOL.md promises to accept it.
    for component in ('"@method"', '"@authority"', '"@target-uri"', '"content-digest"'):
        assert component in signature_input, signature_input
    assert 'alg="ed25519"' in signature_input and ";nonce=" in signature_input
    return signed_request


async def replay(client: httpx.AsyncClient, prepared: requests.PreparedRequest) -> httpx.Response:
    """Send a requests-prepared request through the ASGI client, byte for byte."""
    body = prepared.body or b""
    assert isinstance(body, bytes)
    assert prepared.method is not None and prepared.url is not None
    return await client.request(
        prepared.method, prepared.url, content=body, headers=list(prepared.headers.items())
    )


# ------------------------------------------------- an independent implementation


async def test_independent_client_can_register_a_provider(client: httpx.AsyncClient) -> None:
    key = generate_key()
    prepared = independently_signed(key, "POST", "/v1/providers", {"display_name": "independent lab"})
    r = await replay(client, prepared)
    assert r.status_code == 201, r.text
    assert r.json()["id"] == key_id_of(key)


async def test_independent_client_can_read_its_node_record(
    client: httpx.AsyncClient, contributor: Contributor
) -> None:
    r = await replay(client, independently_signed(contributor.node_key, "GET", ME))
    assert r.status_code == 200, r.text
    assert r.json()["id"] == contributor.node_id
    assert r.json()["provider_id"] == contributor.provider_id


async def test_independent_client_can_send_a_heartbeat(
    client: httpx.AsyncClient, contributor: Contributor
) -> None:
    r = await replay(
        client, independently_signed(contributor.node_key, "POST", HEARTBEAT, {"metrics": {"gpu_util": 0.5}})
    )
    assert r.status_code == 200, r.text
    assert r.json()["next_heartbeat_in_s"] > 0
    me = await send(client, "GET", ME, signed(contributor.node_key, "GET", ME))
    assert me.json()["last_heartbeat_at"] is not None


async def test_hand_built_signature_base_is_accepted(
    client: httpx.AsyncClient, contributor: Contributor
) -> None:
    # The hand-built signer is the control for every refusal built with it below.
    r = await send(client, "GET", ME, hand_signed(contributor.node_key, "GET", ME))
    assert r.status_code == 200, r.text
    r = await send(
        client, "POST", HEARTBEAT, hand_signed(contributor.node_key, "POST", HEARTBEAT, HB_BODY), HB_BODY
    )
    assert r.status_code == 200, r.text


async def test_a_target_uri_ending_in_an_empty_query_verifies(
    client: httpx.AsyncClient, contributor: Contributor
) -> None:
    """A client that builds its URL as path + "?" + its (here empty) query sends `GET
    /v1/nodes/me?` and signs "http://testserver/v1/nodes/me?" as @target-uri (RFC 9421, section
    2.2.2: the target URI as sent). The server rebuilt the URL from the ASGI query string, empty
    with a "?" and without alike, and refused a valid signature as signature_invalid."""
    r = await send(client, "GET", ME + "?", hand_signed(contributor.node_key, "GET", ME + "?"))
    assert r.status_code == 200, r.text
    # Another path is still another path, "?" or not.
    r = await send(client, "GET", ME + "?", hand_signed(contributor.node_key, "GET", "/v1/nodes/you?"))
    problem(r, 401, "signature_invalid")


async def test_a_json_body_not_sent_as_json_is_refused_saying_so(
    client: httpx.AsyncClient, contributor: Contributor
) -> None:
    """PROTOCOL.md names no Content-Type, and many HTTP clients send raw bytes with none (or, as
    curl -d does, as a form). Such a body, a well-formed JSON object, was validated as bytes:
    422 "Input should be a valid dictionary or object to extract fields from", which sent the
    author of a client looking at the JSON. The 422 says what the body was sent as, and that it
    must be application/json; sent so, the same body is taken."""
    for media in (None, "application/x-www-form-urlencoded", "text/plain"):
        headers = signed(contributor.node_key, "POST", HEARTBEAT, HB_BODY)
        if media is not None:
            headers["Content-Type"] = media
        r = await client.post(HEARTBEAT, content=HB_BODY, headers=headers)
        body = problem(r, 422, "validation_failed")
        said = f"Content-Type {media!r}" if media else "no Content-Type"
        assert said in body["detail"] and "application/json" in body["detail"], body
        assert body["errors"] == [
            {"loc": ["body"], "msg": body["detail"].removeprefix("body: "), "type": "content_type_not_json"}
        ]
    headers = signed(contributor.node_key, "POST", HEARTBEAT, HB_BODY)
    r = await client.post(HEARTBEAT, content=HB_BODY, headers={**headers, "Content-Type": "application/json"})
    assert r.status_code == 200, r.text


# ------------------------------------------------------------- tampering


async def test_signature_for_another_method_is_refused(
    client: httpx.AsyncClient, contributor: Contributor
) -> None:
    created, nonce = int(time.time()), secrets.token_urlsafe(16)
    as_post = signed(contributor.node_key, "POST", ME, created=created, nonce=nonce)
    problem(await send(client, "GET", ME, as_post), 401, "signature_invalid")
    as_get = signed(contributor.node_key, "GET", ME, created=created, nonce=nonce)
    assert (await send(client, "GET", ME, as_get)).status_code == 200


async def test_signature_for_another_path_is_refused(
    client: httpx.AsyncClient, contributor: Contributor
) -> None:
    headers = signed(contributor.node_key, "POST", HEARTBEAT, HB_BODY)
    problem(await send(client, "POST", "/v1/providers", headers, HB_BODY), 401, "signature_invalid")
    assert (await send(client, "POST", HEARTBEAT, headers, HB_BODY)).status_code == 200


async def test_signature_for_another_query_is_refused(
    client: httpx.AsyncClient, contributor: Contributor
) -> None:
    headers = signed(contributor.node_key, "GET", ME + "?x=1")
    problem(await send(client, "GET", ME + "?x=2", headers), 401, "signature_invalid")
    problem(await send(client, "GET", ME, headers), 401, "signature_invalid")
    assert (await send(client, "GET", ME + "?x=1", headers)).status_code == 200


async def test_tampered_body_is_refused_as_digest_mismatch(
    client: httpx.AsyncClient, contributor: Contributor
) -> None:
    headers = signed(contributor.node_key, "POST", HEARTBEAT, HB_BODY)
    problem(await send(client, "POST", HEARTBEAT, headers, OTHER_BODY), 401, "digest_mismatch")
    assert (await send(client, "POST", HEARTBEAT, headers, HB_BODY)).status_code == 200


async def test_rewritten_content_digest_is_refused(
    client: httpx.AsyncClient, contributor: Contributor
) -> None:
    # The attacker's body with a matching digest: the digest checks out, the signature does not.
    headers = signed(contributor.node_key, "POST", HEARTBEAT, HB_BODY)
    forged = {**headers, "Content-Digest": content_digest(OTHER_BODY)}
    problem(await send(client, "POST", HEARTBEAT, forged, OTHER_BODY), 401, "signature_invalid")
    assert (await send(client, "POST", HEARTBEAT, headers, HB_BODY)).status_code == 200


@pytest.mark.parametrize(
    "digest",
    [
        "sha-256=:AAAA:",  # wrong length
        "md5=:" + base64.b64encode(hashlib.md5(HB_BODY).digest()).decode() + ":",  # unsupported
        "sha-256=" + hashlib.sha256(HB_BODY).hexdigest(),  # not a byte sequence
        "(((",  # not a dictionary
    ],
)
async def test_malformed_content_digest_is_refused(
    client: httpx.AsyncClient, contributor: Contributor, digest: str
) -> None:
    headers = signed(contributor.node_key, "POST", HEARTBEAT, HB_BODY)
    problem(
        await send(client, "POST", HEARTBEAT, {**headers, "Content-Digest": digest}, HB_BODY),
        401,
        "digest_malformed",
    )


def _b64(digest: bytes) -> str:
    return base64.b64encode(digest).decode()


SHA256 = "sha-256=:" + _b64(hashlib.sha256(HB_BODY).digest()) + ":"
SHA512 = "sha-512=:" + _b64(hashlib.sha512(HB_BODY).digest()) + ":"
SHA384 = "sha-384=:" + _b64(hashlib.sha384(HB_BODY).digest()) + ":"
UNIXSUM = "unixsum=:" + _b64(b"12345") + ":"
WRONG_SHA256 = "sha-256=:" + _b64(hashlib.sha256(OTHER_BODY).digest()) + ":"
WRONG_SHA512 = "sha-512=:" + _b64(hashlib.sha512(OTHER_BODY).digest()) + ":"


@pytest.mark.parametrize(
    "digest",
    [
        pytest.param(f"{SHA384}, {SHA256}", id="sha-384,sha-256"),
        pytest.param(f"{SHA256}, {UNIXSUM}", id="sha-256,unixsum"),
        pytest.param(f"{SHA512}, {SHA384}", id="sha-512,sha-384"),
        pytest.param(f"{SHA256}, {SHA512}", id="sha-256,sha-512"),
        pytest.param(f"{UNIXSUM}, {SHA512}, {SHA256}, {SHA384}", id="unixsum,sha-512,sha-256,sha-384"),
    ],
)
async def test_digests_of_unknown_algorithms_beside_a_matching_one_are_ignored(
    client: httpx.AsyncClient, contributor: Contributor, digest: str
) -> None:
    # RFC 9530: a recipient ignores algorithms it does not support. The signature covers the
    # field as sent, unknown members and all.
    headers = hand_signed(contributor.node_key, "POST", HEARTBEAT, HB_BODY, digest=digest)
    assert (await send(client, "POST", HEARTBEAT, headers, HB_BODY)).status_code == 200


@pytest.mark.parametrize(
    ("digest", "code"),
    [
        # Nothing this server can check.
        pytest.param(f"{SHA384}, {UNIXSUM}", "digest_malformed", id="sha-384,unixsum"),
        pytest.param(SHA384, "digest_malformed", id="sha-384"),
        # Every supported digest must match.
        pytest.param(f"{SHA384}, {WRONG_SHA256}", "digest_mismatch", id="sha-384,wrong-sha-256"),
        pytest.param(f"{SHA256}, {WRONG_SHA512}", "digest_mismatch", id="sha-256,wrong-sha-512"),
        pytest.param(
            f"{WRONG_SHA512}, {SHA256}, {UNIXSUM}", "digest_mismatch", id="wrong-sha-512,sha-256,unixsum"
        ),
        # Every member is a byte sequence, of an algorithm known or not.
        pytest.param(f"{SHA256}, unixsum=12345", "digest_malformed", id="sha-256,unixsum-integer"),
    ],
)
async def test_a_digest_field_without_a_matching_supported_digest_is_refused(
    client: httpx.AsyncClient, contributor: Contributor, digest: str, code: str
) -> None:
    headers = hand_signed(contributor.node_key, "POST", HEARTBEAT, HB_BODY, digest=digest)
    problem(await send(client, "POST", HEARTBEAT, headers, HB_BODY), 401, code)


async def test_body_without_content_digest_is_refused(
    client: httpx.AsyncClient, contributor: Contributor
) -> None:
    headers = signed(contributor.node_key, "POST", HEARTBEAT, HB_BODY)
    del headers["Content-Digest"]
    problem(await send(client, "POST", HEARTBEAT, headers, HB_BODY), 401, "digest_missing")


async def test_body_whose_digest_is_not_signed_is_refused(
    client: httpx.AsyncClient, contributor: Contributor
) -> None:
    headers = hand_signed(
        contributor.node_key, "POST", HEARTBEAT, HB_BODY, components=("@method", "@target-uri")
    )
    assert headers["Content-Digest"] == content_digest(HB_BODY)
    problem(await send(client, "POST", HEARTBEAT, headers, HB_BODY), 401, "signature_coverage_insufficient")


# ---------------------------------------------------------------- time


async def test_stale_created_is_refused(
    client: httpx.AsyncClient, contributor: Contributor, settings: Settings, clock: FakeClock
) -> None:
    window, now = settings.signature.window_s, int(clock.now())
    old = signed(contributor.node_key, "GET", ME, created=now - window - 2)
    problem(await send(client, "GET", ME, old), 401, "signature_stale")
    just_inside = signed(contributor.node_key, "GET", ME, created=now - window + 2)
    assert (await send(client, "GET", ME, just_inside)).status_code == 200


async def test_created_in_the_future_is_refused(
    client: httpx.AsyncClient, contributor: Contributor, settings: Settings, clock: FakeClock
) -> None:
    window, now = settings.signature.window_s, int(clock.now())
    ahead = signed(contributor.node_key, "GET", ME, created=now + window + 2)
    problem(await send(client, "GET", ME, ahead), 401, "signature_from_future")
    just_inside = signed(contributor.node_key, "GET", ME, created=now + window - 2)
    assert (await send(client, "GET", ME, just_inside)).status_code == 200


async def test_signature_goes_stale_as_server_time_passes(
    client: httpx.AsyncClient, contributor: Contributor, settings: Settings, clock: FakeClock
) -> None:
    headers = signed(contributor.node_key, "GET", ME, created=int(clock.now()))
    clock.advance(settings.signature.window_s + 2)
    problem(await send(client, "GET", ME, headers), 401, "signature_stale")


async def test_expired_signature_is_refused(
    client: httpx.AsyncClient, contributor: Contributor, clock: FakeClock
) -> None:
    now = int(clock.now())
    expired = signed(contributor.node_key, "GET", ME, created=now - 10, expires=now - 1)
    problem(await send(client, "GET", ME, expired), 401, "signature_expired")
    valid = signed(contributor.node_key, "GET", ME, created=now - 10, expires=now + 60)
    assert (await send(client, "GET", ME, valid)).status_code == 200


# The largest integer a structured field can carry (RFC 8941, 15 digits): far past year 9999,
# which is as far as a datetime reaches.
SF_INTEGER_MAX = 999_999_999_999_999


@pytest.mark.parametrize("expires", [253_402_300_800, SF_INTEGER_MAX], ids=["year-10000", "sf-integer-max"])
async def test_an_expires_past_year_9999_has_not_passed(
    client: httpx.AsyncClient, contributor: Contributor, clock: FakeClock, expires: int
) -> None:
    now = int(clock.now())
    headers = hand_signed(contributor.node_key, "GET", ME, created=now, expires=expires)
    assert (await send(client, "GET", ME, headers)).status_code == 200
    # The created window still applies.
    old = hand_signed(contributor.node_key, "GET", ME, created=now - 3600, expires=expires)
    problem(await send(client, "GET", ME, old), 401, "signature_stale")


@pytest.mark.parametrize(
    ("created", "code"),
    [
        pytest.param(SF_INTEGER_MAX, "signature_from_future", id="sf-integer-max"),
        pytest.param(253_402_300_800, "signature_from_future", id="year-10000"),
        pytest.param(-SF_INTEGER_MAX, "signature_stale", id="sf-integer-min"),
        pytest.param(-62_135_596_801, "signature_stale", id="before-year-1"),
    ],
)
async def test_a_created_beyond_any_date_is_refused_for_its_time(
    client: httpx.AsyncClient, contributor: Contributor, created: int, code: str
) -> None:
    headers = hand_signed(contributor.node_key, "GET", ME, created=created)
    problem(await send(client, "GET", ME, headers), 401, code)


# ---------------------------------------------------------------- nonces


async def test_replayed_nonce_is_refused(client: httpx.AsyncClient, contributor: Contributor) -> None:
    headers = signed(contributor.node_key, "GET", ME)
    assert (await send(client, "GET", ME, headers)).status_code == 200
    problem(await send(client, "GET", ME, headers), 401, "nonce_replayed")


async def test_replayed_heartbeat_is_refused(client: httpx.AsyncClient, contributor: Contributor) -> None:
    headers = signed(contributor.node_key, "POST", HEARTBEAT, HB_BODY)
    assert (await send(client, "POST", HEARTBEAT, headers, HB_BODY)).status_code == 200
    problem(await send(client, "POST", HEARTBEAT, headers, HB_BODY), 401, "nonce_replayed")


async def test_nonce_reused_in_a_new_signature_is_refused(
    client: httpx.AsyncClient, contributor: Contributor
) -> None:
    nonce = secrets.token_urlsafe(16)
    first = signed(contributor.node_key, "GET", ME, nonce=nonce)
    assert (await send(client, "GET", ME, first)).status_code == 200
    second = signed(contributor.node_key, "POST", HEARTBEAT, HB_BODY, nonce=nonce)
    problem(await send(client, "POST", HEARTBEAT, second, HB_BODY), 401, "nonce_replayed")


async def test_nonces_are_per_key(client: httpx.AsyncClient, contributor: Contributor) -> None:
    other = new_contributor()
    await other.register(client)
    nonce = secrets.token_urlsafe(16)
    for c in (contributor, other):
        r = await send(client, "GET", ME, signed(c.node_key, "GET", ME, nonce=nonce))
        assert r.status_code == 200, r.text
        assert r.json()["id"] == c.node_id


@pytest.fixture
async def second_client(
    settings: Settings, clock: FakeClock, hot_store: HotStore
) -> AsyncIterator[httpx.AsyncClient]:
    """A second app instance on the same database and the same hot store: with Redis, a
    separate connection pool to the same server (as two API processes would have)."""
    store: HotStore = RedisHotStore.from_url(REDIS_URL, settings.redis.prefix) if REDIS_URL else hot_store
    assert (store is not hot_store) == bool(REDIS_URL)
    try:
        application = create_app(settings, clock=clock, hot_store=store)
        async with (
            LifespanManager(application) as manager,
            httpx.AsyncClient(transport=httpx.ASGITransport(app=manager.app), base_url=BASE) as c,
        ):
            yield c
    finally:
        if store is not hot_store:
            await store.aclose()


async def test_replayed_nonce_is_refused_across_app_instances(
    client: httpx.AsyncClient, second_client: httpx.AsyncClient, contributor: Contributor
) -> None:
    headers = signed(contributor.node_key, "POST", HEARTBEAT, HB_BODY)
    assert (await send(client, "POST", HEARTBEAT, headers, HB_BODY)).status_code == 200
    problem(await send(second_client, "POST", HEARTBEAT, headers, HB_BODY), 401, "nonce_replayed")

    headers = signed(contributor.node_key, "GET", ME)
    assert (await send(second_client, "GET", ME, headers)).status_code == 200
    problem(await send(client, "GET", ME, headers), 401, "nonce_replayed")


def _memory_losses() -> float:
    return REGISTRY.get_sample_value("orchestrator_hot_store_memory_lost_total") or 0.0


async def _nonces_since(settings: Settings) -> int | None:
    """The nonce-loss marker in the test's Redis (``NONCES_SINCE_KEY``), if set."""
    redis = aioredis.Redis.from_url(REDIS_URL or "")
    try:
        value = await redis.get(settings.redis.prefix + NONCES_SINCE_KEY)
    finally:
        await redis.aclose()
    return int(value) if value is not None else None


@pytest.mark.skipif(not REDIS_URL, reason="Redis loses its keys (ORCH_TEST_REDIS_URL)")
async def test_a_request_replayed_after_redis_lost_its_keys_is_refused(
    client: httpx.AsyncClient,
    second_client: httpx.AsyncClient,
    contributor: Contributor,
    settings: Settings,
    clock: FakeClock,
) -> None:
    """Redis emptied (a flush, a restart without persistence: here the test's prefix deleted)
    forgets the spent nonces; a captured request sent again within its window is still refused,
    to whichever API process, as a possible replay, while a request signed afresh is served."""
    signed_at = int(time.time()) - 2  # sent a moment before the loss (Redis's clock is this host's)
    beat = hand_signed(contributor.node_key, "POST", HEARTBEAT, HB_BODY, created=signed_at)
    me = hand_signed(contributor.node_key, "GET", ME, created=signed_at)
    assert (await send(client, "POST", HEARTBEAT, beat, HB_BODY)).status_code == 200
    assert (await send(second_client, "GET", ME, me)).status_code == 200
    clock.advance(5)
    await _drop_prefix(REDIS_URL or "", settings.redis.prefix)
    losses = _memory_losses()
    body = problem(await send(client, "POST", HEARTBEAT, beat, HB_BODY), 401, "nonce_replayed")
    since = await _nonces_since(settings)
    assert body["nonces_remembered_since"] == since, body
    assert signed_at < since <= time.time()  # when Redis found it lost them, by its own clock
    assert "sign the request afresh" in body["detail"]
    body = problem(await send(second_client, "GET", ME, me), 401, "nonce_replayed")
    assert body["nonces_remembered_since"] == since
    fresh = hand_signed(contributor.node_key, "POST", HEARTBEAT, HB_BODY, created=int(clock.now()))
    assert (await send(second_client, "POST", HEARTBEAT, fresh, HB_BODY)).status_code == 200
    body = problem(await send(client, "POST", HEARTBEAT, fresh, HB_BODY), 401, "nonce_replayed")
    assert "nonces_remembered_since" not in body  # a replay the store remembers, as ever
    assert _memory_losses() == losses + 1  # the loss is reported once, by one of the processes
    # Once the old request's created is out of the window, it is refused for that alone.
    clock.advance(300)
    problem(await send(client, "POST", HEARTBEAT, beat, HB_BODY), 401, "signature_stale")


async def test_the_problem_schema_documents_when_the_nonces_are_remembered_since(
    client: httpx.AsyncClient,
) -> None:
    schemas = (await client.get("/openapi.json")).json()["components"]["schemas"]
    member = schemas["Problem"]["properties"]["nonces_remembered_since"]
    assert "nonce_replayed" in member["description"]


@pytest.mark.skipif(not REDIS_URL, reason="Redis loses its keys (ORCH_TEST_REDIS_URL)")
async def test_a_request_refused_for_the_lost_nonces_counts_nothing_and_spends_no_nonce(
    hot_store: HotStore, settings: Settings
) -> None:
    now = 60 * 20_000 + 0.5  # the caller's clock, which places the request in the quotas' windows
    quotas = [Quota("key:test-key", 1, 60)]
    await _drop_prefix(REDIS_URL or "", settings.redis.prefix)  # a Redis that lost its memory
    created = int(time.time()) - 1
    refused = await hot_store.admit("test-key", "nonce-0001", 601, quotas, now, created)
    assert refused is not None and refused.refused_by is None
    since = refused.forgotten_before  # Redis's clock when it found the marker gone, not ``now``
    assert since == await _nonces_since(settings) and created < since <= time.time()
    # Nothing counted: the key's one request of the window is still to come; nothing spent.
    admitted = await hot_store.admit("test-key", "nonce-0001", 601, quotas, now + 5, since)
    assert admitted is not None and admitted.refused_by is None and admitted.forgotten_before is None
    assert await hot_store.admit("test-key", "nonce-0001", 601, quotas, now + 5, since) is None


@pytest.mark.skipif(not REDIS_URL, reason="Redis loses its keys (ORCH_TEST_REDIS_URL)")
async def test_an_api_process_whose_clock_runs_ahead_refuses_no_fresh_request_after_redis_lost_its_keys(
    client: httpx.AsyncClient, contributor: Contributor, settings: Settings, clock: FakeClock
) -> None:
    """The time since which Redis holds the nonces is read from Redis's own clock, which every
    API process shares, not from the clock of the process that found them lost: one running a
    minute ahead set it a minute in the future, and for that minute every request signed
    afresh, by a client whose clock is right, was refused 401 nonce_replayed by every process."""
    clock.advance(60)  # this API process's clock, a minute ahead of the clients' and Redis's
    captured = hand_signed(contributor.node_key, "GET", ME, created=int(time.time()) - 2)
    await _drop_prefix(REDIS_URL or "", settings.redis.prefix)
    body = problem(await send(client, "GET", ME, captured), 401, "nonce_replayed")
    since = body["nonces_remembered_since"]
    assert since == await _nonces_since(settings) and since <= time.time(), body
    fresh = hand_signed(contributor.node_key, "POST", HEARTBEAT, HB_BODY, created=int(time.time()))
    assert (await send(client, "POST", HEARTBEAT, fresh, HB_BODY)).status_code == 200


# ------------------------------------------------------------- keys and algorithms


async def test_unregistered_key_is_refused(client: httpx.AsyncClient) -> None:
    stranger = generate_key()
    problem(await send(client, "GET", ME, signed(stranger, "GET", ME)), 401, "unknown_key")
    headers = signed(stranger, "POST", HEARTBEAT, HB_BODY)
    problem(await send(client, "POST", HEARTBEAT, headers, HB_BODY), 401, "unknown_key")


async def test_provider_key_cannot_act_as_a_node(client: httpx.AsyncClient, contributor: Contributor) -> None:
    headers = signed(contributor.provider_key, "GET", ME)
    problem(await send(client, "GET", ME, headers), 401, "unknown_key")


async def test_keyid_that_is_not_a_public_key_is_refused(
    client: httpx.AsyncClient, contributor: Contributor
) -> None:
    for keyid in ("not-a-key", contributor.node_id + "A", contributor.node_id[:-1] + "="):
        headers = hand_signed(contributor.node_key, "GET", ME, keyid=keyid)
        problem(await send(client, "GET", ME, headers), 401, "unknown_key")


async def test_signature_by_another_key_than_keyid_is_refused(
    client: httpx.AsyncClient, contributor: Contributor
) -> None:
    impostor = hand_signed(generate_key(), "GET", ME, keyid=contributor.node_id)
    problem(await send(client, "GET", ME, impostor), 401, "signature_invalid")
    body_impostor = hand_signed(generate_key(), "POST", HEARTBEAT, HB_BODY, keyid=contributor.node_id)
    problem(await send(client, "POST", HEARTBEAT, body_impostor, HB_BODY), 401, "signature_invalid")


@pytest.mark.parametrize("alg", ["hmac-sha256", "rsa-pss-sha512", "ecdsa-p256-sha256", "ED25519", ""])
async def test_algorithm_other_than_ed25519_is_refused(
    client: httpx.AsyncClient, contributor: Contributor, alg: str
) -> None:
    # A genuine ed25519 signature over a base that names another alg: refused for the alg.
    problem(
        await send(client, "GET", ME, hand_signed(contributor.node_key, "GET", ME, alg=alg)),
        401,
        "unsupported_algorithm",
    )
    # The same rewrite of a library-made header is refused for the alg too, before the crypto.
    headers = signed(contributor.node_key, "GET", ME)
    assert 'alg="ed25519"' in headers["Signature-Input"]
    headers["Signature-Input"] = headers["Signature-Input"].replace('alg="ed25519"', f'alg="{alg}"')
    problem(await send(client, "GET", ME, headers), 401, "unsupported_algorithm")


async def test_signature_without_alg_is_accepted(client: httpx.AsyncClient, contributor: Contributor) -> None:
    r = await send(client, "GET", ME, hand_signed(contributor.node_key, "GET", ME, alg=None))
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------- coverage


@pytest.mark.parametrize(
    "components",
    [
        ("@method",),
        ("@target-uri",),
        ("@authority", "@target-uri"),
        ("@method", "@authority"),
        ("@method", "@query"),
    ],
)
async def test_too_few_covered_components_are_refused(
    client: httpx.AsyncClient, contributor: Contributor, components: tuple[str, ...]
) -> None:
    headers = signed(contributor.node_key, "GET", ME, components=components)
    problem(await send(client, "GET", ME, headers), 401, "signature_coverage_insufficient")


async def test_path_and_query_coverage_is_accepted(
    client: httpx.AsyncClient, contributor: Contributor
) -> None:
    components = ("@method", "@path", "@query")
    headers = signed(contributor.node_key, "GET", ME + "?x=1", components=components)
    problem(await send(client, "GET", ME + "?x=2", headers), 401, "signature_invalid")
    assert (await send(client, "GET", ME + "?x=1", headers)).status_code == 200

    headers = hand_signed(contributor.node_key, "GET", ME + "?x=1", components=components)
    assert (await send(client, "GET", ME + "?x=1", headers)).status_code == 200

    beat = signed(contributor.node_key, "POST", HEARTBEAT, HB_BODY, components=components)
    assert (await send(client, "POST", HEARTBEAT, beat, HB_BODY)).status_code == 200


async def test_query_not_covered_with_path_is_refused(
    client: httpx.AsyncClient, contributor: Contributor
) -> None:
    headers = signed(contributor.node_key, "GET", ME + "?x=1", components=("@method", "@path"))
    problem(await send(client, "GET", ME + "?x=1", headers), 401, "signature_coverage_insufficient")
    # Without a query, @path alone is the whole request target.
    headers = signed(contributor.node_key, "GET", ME, components=("@method", "@path"))
    assert (await send(client, "GET", ME, headers)).status_code == 200


# ------------------------------------------------------------- parameters and syntax


@pytest.mark.parametrize("missing", ["keyid", "created", "nonce"])
async def test_missing_signature_parameter_is_refused(
    client: httpx.AsyncClient, contributor: Contributor, missing: str
) -> None:
    headers = hand_signed(contributor.node_key, "GET", ME, **{missing: None})
    problem(await send(client, "GET", ME, headers), 401, "signature_param_missing")


def _with_components(headers: dict[str, str], components: str) -> dict[str, str]:
    """``headers`` whose Signature-Input covers ``components`` instead (the signature no longer
    matters: no signature base can be built for them)."""
    label, rest = headers["Signature-Input"].split("=", 1)
    return {**headers, "Signature-Input": f"{label}=({components})" + rest[rest.index(")") + 1 :]}


@pytest.mark.parametrize(
    ("tamper", "says"),
    [
        pytest.param(lambda h: h, "foo", id="unknown-parameter"),
        pytest.param(
            lambda h: _with_components(h, '"@method" "@target-uri" "x-absent"'), "x-absent", id="absent-field"
        ),
        pytest.param(
            lambda h: _with_components(h, '"@method" "@target-uri" "@nope"'), "@nope", id="unknown-derived"
        ),
        pytest.param(
            lambda h: _with_components(h, '"@method" "@target-uri" "@method"'),
            "multiple times",
            id="repeated",
        ),
        pytest.param(
            lambda h: _with_components(h, '"@method" "@target-uri" "X-Run"'), "lowercase", id="uppercase"
        ),
    ],
)
async def test_a_signature_whose_base_cannot_be_built_is_refused_as_malformed(
    client: httpx.AsyncClient, contributor: Contributor, tamper: Any, says: str
) -> None:
    """A parameter or covered component the server cannot build a signature base for is a
    malformed signature, and the refusal says which; it was ``signature_invalid``, "the
    signature does not verify for this request", as for a forged one."""
    headers = hand_signed(contributor.node_key, "GET", ME, foo="bar" if says == "foo" else None)
    body = problem(
        await send(client, "GET", ME, {**tamper(headers), "X-Run": "1"}), 401, "signature_malformed"
    )
    assert says in body["detail"], body
    # A forged signature is still signature_invalid.
    forged = hand_signed(generate_key(), "GET", ME, keyid=contributor.node_id)
    problem(await send(client, "GET", ME, forged), 401, "signature_invalid")


@pytest.mark.parametrize(
    "present",
    [
        pytest.param({}, id="none"),
        pytest.param({"Signature-Input"}, id="signature-input-only"),
        pytest.param({"Signature"}, id="signature-only"),
    ],
)
async def test_missing_signature_headers_are_refused(
    client: httpx.AsyncClient, contributor: Contributor, present: set[str]
) -> None:
    headers = signed(contributor.node_key, "GET", ME)
    kept = {name: value for name, value in headers.items() if name in present}
    problem(await send(client, "GET", ME, kept), 401, "signature_missing")


def _malformed_cases(key: SigningKey) -> dict[str, Any]:
    """Valid-looking requests for GET /v1/nodes/me, each broken in one way."""
    h = hand_signed(key, "GET", ME)
    other = hand_signed(key, "GET", ME, label="sig2")
    return {
        "garbage-signature-input": {**h, "Signature-Input": "((("},
        "signature-input-not-ascii": {
            **h,
            "Signature-Input": (h["Signature-Input"] + ';x="\u00e9"').encode("latin-1"),
        },
        "signature-input-empty": {**h, "Signature-Input": " "},
        "signature-input-not-inner-list": {
            **h,
            "Signature-Input": 'sig1="@method";created=1;keyid="k";nonce="12345678"',
        },
        "signature-input-too-long": {
            **h,
            "Signature-Input": h["Signature-Input"] + ';pad="' + "x" * 4096 + '"',
        },
        "component-with-parameters": {
            **h,
            "Signature-Input": h["Signature-Input"].replace('"@method"', '"@method";req'),
        },
        "signature-not-byte-sequence": {**h, "Signature": 'sig1="' + h["Signature"][6:-1] + '"'},
        "signature-is-inner-list": {**h, "Signature": "sig1=(" + h["Signature"][5:] + ")"},
        "two-signatures": {
            "Signature-Input": h["Signature-Input"] + ", " + other["Signature-Input"],
            "Signature": h["Signature"] + ", " + other["Signature"],
        },
        "two-signatures-in-two-field-lines": [
            ("Signature-Input", h["Signature-Input"]),
            ("Signature-Input", other["Signature-Input"]),
            ("Signature", h["Signature"]),
            ("Signature", other["Signature"]),
        ],
        "mismatched-labels": {**h, "Signature": other["Signature"]},
        "duplicate-label": {
            "Signature-Input": h["Signature-Input"] + ", " + h["Signature-Input"],
            "Signature": h["Signature"],
        },
        "nonce-too-short": hand_signed(key, "GET", ME, nonce="1234567"),
        "nonce-too-long": hand_signed(key, "GET", ME, nonce="n" * 129),
        "created-not-an-integer": hand_signed(key, "GET", ME, created=str(int(time.time()))),
        "keyid-not-a-string": hand_signed(key, "GET", ME, keyid=12345),
        "expires-not-an-integer": hand_signed(key, "GET", ME, expires=str(int(time.time()) + 60)),
    }


MALFORMED = list(_malformed_cases(SigningKey(bytes(32))))


@pytest.mark.parametrize("case", MALFORMED)
async def test_malformed_signature_headers_are_refused(
    client: httpx.AsyncClient, contributor: Contributor, case: str
) -> None:
    headers = _malformed_cases(contributor.node_key)[case]
    problem(await send(client, "GET", ME, headers), 401, "signature_malformed")


# ------------------------------------------------------------------ identity


async def test_node_acts_only_as_itself(client: httpx.AsyncClient, contributor: Contributor) -> None:
    other = new_contributor()
    await other.register(client)
    r = await send(
        client, "POST", HEARTBEAT, signed(contributor.node_key, "POST", HEARTBEAT, HB_BODY), HB_BODY
    )
    assert r.status_code == 200, r.text

    mine = await send(client, "GET", ME, signed(contributor.node_key, "GET", ME))
    theirs = await send(client, "GET", ME, signed(other.node_key, "GET", ME))
    assert mine.status_code == theirs.status_code == 200
    assert mine.json()["id"] == contributor.node_id
    assert mine.json()["provider_id"] == contributor.provider_id
    assert mine.json()["last_heartbeat_at"] is not None
    assert theirs.json()["id"] == other.node_id
    assert theirs.json()["provider_id"] == other.provider_id
    assert theirs.json()["last_heartbeat_at"] is None  # A's heartbeat never landed on B


# ------------------------------------------------------- several signatures


def proxy_signature(
    label: str = "proxy", keyid: str = "edge-proxy-1", covers: str = "sig1"
) -> dict[str, str]:
    """A signature as a proxy on the way adds its own (RFC 9421, section 4.3): its keyid is not
    an Ed25519 key id, it covers the client's signature, and this server cannot check it."""
    return {
        "Signature-Input": f'{label}=("@method" "signature";key="{covers}");created={int(time.time())};'
        f'keyid="{keyid}";alg="rsa-pss-sha512"',
        "Signature": f"{label}=:{base64.b64encode(secrets.token_bytes(256)).decode()}:",
    }


def with_signatures(body: dict[str, str], *added: dict[str, str], lines: bool = False) -> Any:
    """``body``'s headers with ``added``'s signatures after its own: in the same field lines
    (``lines=False``) or each in a field line of its own."""
    out: Any = dict(body)
    if lines:
        out = list(body.items())
        for extra in added:
            out += list(extra.items())
        return out
    for extra in added:
        out["Signature-Input"] += ", " + extra["Signature-Input"]
        out["Signature"] += ", " + extra["Signature"]
    return out


@pytest.mark.parametrize("lines", [False, True], ids=["one-field-line", "field-line-each"])
async def test_a_signature_a_proxy_added_is_ignored(
    client: httpx.AsyncClient, contributor: Contributor, lines: bool
) -> None:
    headers = with_signatures(
        hand_signed(contributor.node_key, "POST", HEARTBEAT, HB_BODY), proxy_signature(), lines=lines
    )
    assert (await send(client, "POST", HEARTBEAT, headers, HB_BODY)).status_code == 200
    # The node's nonce is spent, whatever else the request carries.
    problem(await send(client, "POST", HEARTBEAT, headers, HB_BODY), 401, "nonce_replayed")


async def test_the_nodes_signature_may_come_after_others(
    client: httpx.AsyncClient, contributor: Contributor
) -> None:
    mine = hand_signed(contributor.node_key, "GET", ME, label="client")
    headers = with_signatures(
        proxy_signature("edge", covers="client"), mine, proxy_signature("cdn", keyid="cdn", covers="edge")
    )
    r = await send(client, "GET", ME, headers)
    assert r.status_code == 200, r.text
    assert r.json()["id"] == contributor.node_id


async def test_a_signature_that_does_not_verify_beside_the_nodes_valid_one_is_ignored(
    client: httpx.AsyncClient, contributor: Contributor
) -> None:
    # Another Ed25519 key id (a proxy keyed that way), its signature not valid for this request.
    stranger = hand_signed(generate_key(), "GET", ME + "?elsewhere=1", label="edge")
    headers = with_signatures(hand_signed(contributor.node_key, "GET", ME), stranger)
    assert (await send(client, "GET", ME, headers)).status_code == 200


async def test_of_several_signatures_the_nodes_own_refusal_is_given(
    client: httpx.AsyncClient, contributor: Contributor, clock: FakeClock
) -> None:
    stale = hand_signed(contributor.node_key, "GET", ME, created=int(clock.now()) - 3600)
    problem(await send(client, "GET", ME, with_signatures(stale, proxy_signature())), 401, "signature_stale")
    forged = hand_signed(generate_key(), "GET", ME, keyid=contributor.node_id)
    problem(
        await send(client, "GET", ME, with_signatures(forged, proxy_signature())), 401, "signature_invalid"
    )


async def test_a_request_with_no_signature_by_an_ed25519_key_is_refused(
    client: httpx.AsyncClient, contributor: Contributor
) -> None:
    headers = with_signatures(proxy_signature("a", covers="b"), proxy_signature("b", covers="a"))
    problem(await send(client, "GET", ME, headers), 401, "unknown_key")


async def test_two_valid_signatures_by_different_keys_are_refused(
    client: httpx.AsyncClient, contributor: Contributor
) -> None:
    # Which identity would act is not for the server to guess; nor is a captured request of
    # another node's made to act for it by adding one's own signature.
    other = new_contributor()
    await other.register(client)
    mine = hand_signed(contributor.node_key, "GET", ME)
    theirs = hand_signed(other.node_key, "GET", ME, label="sig2")
    problem(await send(client, "GET", ME, with_signatures(mine, theirs)), 401, "signature_malformed")
    # Neither nonce was spent.
    assert (await send(client, "GET", ME, mine)).status_code == 200
    assert (await send(client, "GET", ME, theirs)).status_code == 200


async def test_more_than_eight_signatures_are_refused(
    client: httpx.AsyncClient, contributor: Contributor
) -> None:
    mine = hand_signed(contributor.node_key, "GET", ME)
    seven = [proxy_signature(f"p{i}", keyid=f"p{i}") for i in range(7)]
    assert (await send(client, "GET", ME, with_signatures(mine, *seven))).status_code == 200
    again = hand_signed(contributor.node_key, "GET", ME)
    eight = [*seven, proxy_signature("p7", keyid="p7")]
    problem(await send(client, "GET", ME, with_signatures(again, *eight)), 401, "signature_malformed")


# ------------------------------------------------- what a refusal asks for


def accepted_signature(response: httpx.Response) -> tuple[list[str], dict[str, Any]]:
    """The one signature a response's Accept-Signature field (RFC 9421, section 5.1) asks for:
    its covered components and parameters."""
    requested = http_sf.parse(response.headers["accept-signature"].encode(), tltype="dictionary")
    assert isinstance(requested, dict) and len(requested) == 1, requested
    ((components, params),) = requested.values()
    assert isinstance(components, list) and isinstance(params, dict)
    return [name for name, _ in components], params


async def test_a_refused_signature_is_answered_with_the_signature_asked_for(
    client: httpx.AsyncClient, contributor: Contributor, clock: FakeClock
) -> None:
    unsigned = await client.get(ME)
    problem(unsigned, 401, "signature_missing")
    assert accepted_signature(unsigned) == (["@method", "@target-uri"], {"created": True, "alg": "ed25519"})

    # With a body, the digest is asked for too.
    stale = signed(contributor.node_key, "POST", HEARTBEAT, HB_BODY, created=int(clock.now()) - 3600)
    refused = await send(client, "POST", HEARTBEAT, stale, HB_BODY)
    problem(refused, 401, "signature_stale")
    assert accepted_signature(refused) == (
        ["@method", "@target-uri", "content-digest"],
        {"created": True, "alg": "ed25519"},
    )

    headers = signed(contributor.node_key, "GET", ME)
    accepted = await send(client, "GET", ME, headers)
    assert accepted.status_code == 200 and "accept-signature" not in accepted.headers
    replayed = await send(client, "GET", ME, headers)
    problem(replayed, 401, "nonce_replayed")
    assert accepted_signature(replayed)[0] == ["@method", "@target-uri"]

    # A key not registered, on a provider route.
    stranger = await send(client, "GET", BALANCE, signed(generate_key(), "GET", BALANCE))
    problem(stranger, 401, "unknown_key")
    assert accepted_signature(stranger)[0] == ["@method", "@target-uri"]


async def test_a_refused_signature_names_its_authentication_scheme(
    client: httpx.AsyncClient, contributor: Contributor, clock: FakeClock
) -> None:
    """RFC 9110, section 11.6.1: a 401 carries a WWW-Authenticate challenge. Signed routes' 401s
    had only Accept-Signature, so a generic client (or proxy) saw a 401 naming no scheme."""
    stale = signed(contributor.node_key, "POST", HEARTBEAT, HB_BODY, created=int(clock.now()) - 3600)
    headers = signed(contributor.node_key, "GET", ME)
    assert (await send(client, "GET", ME, headers)).status_code == 200
    refusals = {
        "signature_missing": await client.get(ME),
        "signature_stale": await send(client, "POST", HEARTBEAT, stale, HB_BODY),
        "nonce_replayed": await send(client, "GET", ME, headers),
        "unknown_key": await send(client, "GET", BALANCE, signed(generate_key(), "GET", BALANCE)),
    }
    for code, refused in refusals.items():
        problem(refused, 401, code)
        assert refused.headers.get("www-authenticate") == "Signature", (code, refused.headers)
        assert accepted_signature(refused)[1] == {"created": True, "alg": "ed25519"}
    # A bearer token's route still challenges for its own scheme.
    r = await client.get("/v1/admin/pools")
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"


async def test_a_refusal_that_is_not_the_signatures_asks_for_none(
    client: httpx.AsyncClient, contributor: Contributor
) -> None:
    body = b'{"metrics": "none"}'
    r = await send(client, "POST", HEARTBEAT, signed(contributor.node_key, "POST", HEARTBEAT, body), body)
    problem(r, 422, "validation_failed")
    assert "accept-signature" not in r.headers
    path = "/v1/pools/no-such-pool/join"
    r = await send(client, "POST", path, signed(contributor.node_key, "POST", path))
    problem(r, 404, "pool_not_found")
    assert "accept-signature" not in r.headers


# ---------------------------------------------------- Host and the rebuilt URL


async def test_a_host_that_carries_a_path_cannot_move_a_signature_to_another_path(
    client: httpx.AsyncClient, contributor: Contributor, admin_headers: dict[str, str]
) -> None:
    # The node signs a harmless re-join; a relay sends it to .../leave with a Host that ends in
    # the signed path and '#', so that the rebuilt URL would read as the join URL + a fragment.
    pool_id = (await active_pool(client, admin_headers))["id"]
    join, leave = f"/v1/pools/{pool_id}/join", f"/v1/pools/{pool_id}/leave"
    assert (await send(client, "POST", join, signed(contributor.node_key, "POST", join))).status_code == 201
    headers = signed(contributor.node_key, "POST", join)
    forged = await send(client, "POST", leave, {**headers, "Host": f"testserver{join}#"})
    problem(forged, 400, "host_invalid")
    me = await send(client, "GET", ME, signed(contributor.node_key, "GET", ME))
    assert me.json()["memberships"] == [{"pool_id": pool_id, "status": "active"}]
    # Nothing was used up: the genuine request still goes through, where it was meant to go.
    assert (await send(client, "POST", join, headers)).status_code == 200


BAD_HOSTS = [
    pytest.param("testserver/v1/nodes/me#", id="path-and-fragment"),
    pytest.param("testserver#", id="fragment"),
    pytest.param("testserver?x=1", id="query"),
    pytest.param("user@testserver", id="userinfo"),
    pytest.param("[", id="open-bracket"),
    pytest.param("[::1", id="unclosed-ip-literal"),
    pytest.param("[not-an-address]", id="bad-ip-literal"),
    pytest.param("test server", id="space"),
    pytest.param("testserver:80x", id="bad-port"),
    pytest.param("t\xe9st".encode("latin-1"), id="non-ascii"),
    pytest.param("a" * 256, id="too-long"),
]


@pytest.mark.parametrize("host", BAD_HOSTS)
async def test_a_host_that_is_not_one_authority_is_refused_on_every_route(
    client: httpx.AsyncClient, contributor: Contributor, host: str | bytes
) -> None:
    headers = signed(contributor.node_key, "GET", ME)
    problem(await send(client, "GET", ME, {**headers, "Host": host}), 400, "host_invalid")
    problem(await client.get("/v1/pools", headers={"Host": host}), 400, "host_invalid")  # public
    problem(await client.get("/nope", headers={"Host": host}), 400, "host_invalid")  # no route
    assert (await send(client, "GET", ME, headers)).status_code == 200  # its nonce was not used


async def test_two_host_fields_are_refused(client: httpx.AsyncClient, contributor: Contributor) -> None:
    headers = signed(contributor.node_key, "GET", ME)
    lines = [*headers.items(), ("Host", "testserver"), ("Host", "testserver")]
    problem(await send(client, "GET", ME, lines), 400, "host_invalid")


@pytest.mark.parametrize(
    "host", ["TestServer", "testserver:80", "orchestrator.example:8443", "192.0.2.7:8000", "[::1]:8000"]
)
async def test_any_well_formed_host_is_the_authority_that_is_verified(
    client: httpx.AsyncClient, contributor: Contributor, host: str
) -> None:
    headers = sign_headers(contributor.node_key, method="GET", url=f"http://{host}{ME}")
    r = await send(client, "GET", ME, {**headers, "Host": host})
    assert r.status_code == 200, r.text
    # Signed for another host than the one addressed: refused.
    other = sign_headers(contributor.node_key, method="GET", url=f"http://elsewhere.example{ME}")
    problem(await send(client, "GET", ME, {**other, "Host": host}), 401, "signature_invalid")


@pytest.mark.parametrize(
    ("host", "raw_path", "query"),
    [
        ("testserver/v1/pools/P/join#", b"/v1/pools/P/leave", b""),
        ("testserver/v1", b"/nodes/me", b""),
        ("testserver?", b"/v1/nodes/me", b""),
        ("u@testserver", b"/v1/nodes/me", b"x=1"),
        ("testserver", b"/v1/nodes/me#x", b""),
        ("testserver", b"/v1/nodes/me", b"x=1#y"),
        ("testserver", b"/v1/n\xe9", b""),
    ],
)
def test_the_verified_url_has_exactly_the_served_path_and_query(
    host: str, raw_path: bytes, query: bytes
) -> None:
    # Defence in depth behind the Host check: whatever the parts, the URL a signature is
    # checked against is refused unless it reads back as exactly the path and query served.
    scope = {
        "scheme": "http",
        "path": raw_path.decode("latin-1"),
        "raw_path": raw_path,
        "query_string": query,
    }
    with pytest.raises(Unauthorized) as refused:
        target_uri(scope, host)
    assert refused.value.code == "signature_invalid"
    good = {"scheme": "http", "path": "/v1/nodes/me", "raw_path": b"/v1/nodes/me", "query_string": b"x=1"}
    assert target_uri(good, "testserver:8000") == "http://testserver:8000/v1/nodes/me?x=1"


@pytest.fixture
async def tls_proxied_client(
    settings: Settings, clock: FakeClock, hot_store: HotStore
) -> AsyncIterator[httpx.AsyncClient]:
    """The app behind a proxy that ends TLS: clients sign https:// URLs, the app receives http,
    and ORCH_SERVER__PUBLIC_SCHEME=https tells it so."""
    server = settings.server.model_copy(update={"public_scheme": "https"})
    application = create_app(settings.model_copy(update={"server": server}), clock=clock, hot_store=hot_store)
    async with (
        LifespanManager(application) as manager,
        httpx.AsyncClient(transport=httpx.ASGITransport(app=manager.app), base_url=BASE) as c,
    ):
        yield c


async def test_signatures_for_https_verify_behind_a_tls_proxy_with_the_public_scheme_set(
    client: httpx.AsyncClient, tls_proxied_client: httpx.AsyncClient, contributor: Contributor
) -> None:
    as_https = sign_headers(contributor.node_key, method="GET", url="https://testserver" + ME)
    # Without the setting, the app rebuilds http://... and the client's https signature fails.
    problem(await send(client, "GET", ME, as_https), 401, "signature_invalid")
    r = await send(tls_proxied_client, "GET", ME, as_https)
    assert r.status_code == 200, r.text
    problem(
        await send(tls_proxied_client, "GET", ME, signed(contributor.node_key, "GET", ME)),
        401,
        "signature_invalid",
    )
    # The libraries' default profile (@authority, @target-uri, content-digest), signed for https
    # and received as http.
    prepared = independently_signed(
        contributor.node_key, "POST", HEARTBEAT, {"metrics": {"gpu_util": 0.5}}, base="https://testserver"
    )
    assert isinstance(prepared.body, bytes)
    r = await tls_proxied_client.post(
        HEARTBEAT, content=prepared.body, headers=list(prepared.headers.items())
    )
    assert r.status_code == 200, r.text


async def test_with_allowed_hosts_a_signed_request_for_another_host_is_refused(
    settings: Settings, clock: FakeClock, hot_store: HotStore, contributor: Contributor
) -> None:
    # e.g. a request signed for a staging deployment that knows the same keys, replayed here.
    server = settings.server.model_copy(update={"allowed_hosts": ["api.example.org"]})
    application = create_app(settings.model_copy(update={"server": server}), clock=clock, hot_store=hot_store)
    async with (
        LifespanManager(application) as manager,
        httpx.AsyncClient(
            transport=httpx.ASGITransport(app=manager.app), base_url="http://api.example.org"
        ) as c,
    ):
        await contributor.register(c)
        for host in ("api.example.org", "API.Example.org:8443"):
            headers = sign_headers(contributor.node_key, method="GET", url=f"http://{host}{ME}")
            r = await send(c, "GET", ME, {**headers, "Host": host})
            assert r.status_code == 200, r.text
        for host in ("staging.example.org", "testserver", "api.example.org.evil.example"):
            headers = sign_headers(contributor.node_key, method="GET", url=f"http://{host}{ME}")
            body = problem(await send(c, "GET", ME, {**headers, "Host": host}), 400, "host_not_allowed")
            assert "api.example.org" in body["detail"]
        assert (await c.get("/v1/pools")).status_code == 200  # unsigned routes: any Host
        assert (await c.get("/healthz")).status_code == 200


# ------------------------------------------------------------------ properties

PROPERTY_KEY = SigningKey(hashlib.sha256(b"test_signatures property key").digest())
PROPERTY_URL = BASE + HEARTBEAT


def _json_containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    # A named function, not a lambda: hypothesis reads a lambda's source from its file to check
    # that it uses its argument; when the file had changed under a running suite it could not,
    # and warned "doesn't use its argument" (an error under the suite's warning filters).
    return st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)


json_documents = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    _json_containers,
    max_leaves=12,
)


def _verify(headers: dict[str, str], body: bytes, now: int) -> Any:
    return verify_request(
        method="POST",
        url=PROPERTY_URL,
        query="",
        headers=list(headers.items()),
        body=body,
        now=now,
        window_s=300,
    )


@hypothesis_settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    document=json_documents,
    ascii_only=st.booleans(),
    position=st.integers(min_value=0),
    flip=st.integers(min_value=1, max_value=255),
)
def test_any_json_body_round_trips_and_any_flipped_byte_is_caught(
    document: Any, ascii_only: bool, position: int, flip: int
) -> None:
    body = json.dumps(document, ensure_ascii=ascii_only).encode()
    now = 1_750_000_000
    headers = sign_headers(PROPERTY_KEY, method="POST", url=PROPERTY_URL, body=body, created=now)

    result = _verify(headers, body, now)
    assert result.keyid == key_id_of(PROPERTY_KEY)
    assert result.body == body
    assert "content-digest" in result.covered

    tampered = bytearray(body)
    tampered[position % len(body)] ^= flip
    with pytest.raises(Unauthorized) as refused:
        _verify(headers, bytes(tampered), now)
    assert refused.value.status == 401
    assert refused.value.code == "digest_mismatch"


@pytest.mark.skipif(not REDIS_URL, reason="Redis's nonces-since marker (ORCH_TEST_REDIS_URL)")
async def test_the_worker_sdk_signs_afresh_and_retries_a_request_refused_for_the_lost_nonces(
    app: Any, contributor: Contributor, settings: Settings
) -> None:
    """After Redis lost its nonces, a request signed before the server noticed (or by a client
    whose clock is a little behind the server's) is refused 401 nonce_replayed with
    nonces_remembered_since; it did nothing, and the same request signed afresh is served. The
    SDK retries it so: before, the refusal ended the call, and a worker starting then (its
    registration or record read) exited with the error."""
    since = int(time.time()) + 2  # the marker a server set two seconds ahead of this client
    marker = aioredis.Redis.from_url(REDIS_URL or "")
    try:
        await marker.set(settings.redis.prefix + NONCES_SINCE_KEY, since)
    finally:
        await marker.aclose()
    waits: list[float] = []

    async def sleep(seconds: float) -> None:  # the backoff, lasting until the client's clock is there
        waits.append(seconds)
        await asyncio.sleep(max(0.0, since - time.time()))

    async with WorkerClient(
        BASE, contributor.node_key, contributor.provider_key, transport=httpx.ASGITransport(app=app)
    ) as worker:
        worker._sleep = sleep
        node = await worker.me()
    assert node.id == key_id_of(contributor.node_key)
    assert waits == []  # signed afresh at once, with a created of the server's marker (SignatureAuth)


@pytest.mark.skipif(not REDIS_URL, reason="Redis loses its keys (ORCH_TEST_REDIS_URL)")
async def test_signature_auth_signs_afresh_a_request_refused_for_the_lost_nonces(
    client: httpx.AsyncClient, contributor: Contributor, settings: Settings
) -> None:
    """Requests signed (SignatureAuth) just before the server noticed that Redis lost its keys are
    refused 401 nonce_replayed with nonces_remembered_since, having done nothing. SignatureAuth
    signs such a request afresh, once, with a created not earlier than that time, so it is served.
    Before, the refusal was the answer: the first run of benchmarks/claims.py on a new Redis
    stopped at its first registrations."""
    # Redis noticed the loss at what this client's clock calls two seconds from now (Redis's clock
    # sets the marker: this client's runs behind it, or the server noticed just after it signed).
    redis = aioredis.Redis.from_url(REDIS_URL or "")
    try:
        await redis.set(settings.redis.prefix + NONCES_SINCE_KEY, int(time.time()) + 2)
    finally:
        await redis.aclose()
    auth = SignatureAuth(contributor.node_key)
    beat = await client.post(
        HEARTBEAT, content=HB_BODY, headers={"content-type": "application/json"}, auth=auth
    )
    assert beat.status_code == 200, beat.text
    assert (await client.get(ME, auth=auth)).json()["id"] == key_id_of(contributor.node_key)
    # A refusal of another kind is the answer, as before: no second try.
    other = SignatureAuth(generate_key())
    problem(await client.get(ME, auth=other), 401, "unknown_key")
