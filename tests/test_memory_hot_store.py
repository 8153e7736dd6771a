"""The in-process hot store (the embedded default): nonces and rate-limit counters expire as
they would in Redis, expired ones really go, and each kind is capped; past the cap a new entry
is refused (503 ``hot_store_full``) and a replay is still refused as a replay.

Time is the store's injected monotonic clock; nothing here measures speed.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from asgi_lifespan import LifespanManager

from orchestrator.app import create_app
from orchestrator.core.clock import FakeClock
from orchestrator.core.hotstore import HotStoreFull, MemoryHotStore, Quota
from orchestrator.core.signing import sign_headers
from orchestrator.liveness.serving import mark_serving
from orchestrator.settings import Settings
from tests.conftest import new_contributor, problem, spend_nonce

KEY_A, KEY_B = "A" * 43, "B" * 43


class Monotonic:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def mono() -> Monotonic:
    return Monotonic()


async def test_a_nonce_is_refused_until_its_ttl_has_passed(mono: Monotonic) -> None:
    store = MemoryHotStore(monotonic=mono)
    assert await spend_nonce(store, KEY_A, "nonce-one", 10)
    assert not await spend_nonce(store, KEY_A, "nonce-one", 10)
    assert await spend_nonce(store, KEY_B, "nonce-one", 10)  # nonces are per key
    mono.t += 9.9
    assert not await spend_nonce(store, KEY_A, "nonce-one", 10)
    mono.t += 0.1
    assert await spend_nonce(store, KEY_A, "nonce-one", 10)  # forgotten once its TTL is over
    assert not await spend_nonce(store, KEY_A, "nonce-one", 10)


async def test_the_nonces_held_never_exceed_the_limit_and_expired_ones_make_room(mono: Monotonic) -> None:
    store = MemoryHotStore(max_keys=3, monotonic=mono)
    # Claimed at t0, t0 + 4 and t0 + 8, with a 10 s TTL: they expire one by one.
    assert await spend_nonce(store, KEY_A, "n-0", 10)
    mono.t += 4
    assert await spend_nonce(store, KEY_A, "n-1", 10)
    mono.t += 4
    assert await spend_nonce(store, KEY_A, "n-2", 10)
    with pytest.raises(HotStoreFull) as full:
        await spend_nonce(store, KEY_A, "n-3", 10)
    assert full.value.status == 503 and full.value.code == "hot_store_full"
    assert full.value.headers["Retry-After"] == "2"  # n-0 expires at t0 + 10, now is t0 + 8
    for nonce in ("n-0", "n-1", "n-2"):  # at the limit a replay is still a replay
        assert not await spend_nonce(store, KEY_A, nonce, 10)

    mono.t += 2  # n-0 has expired: exactly one place
    assert await spend_nonce(store, KEY_A, "n-3", 10)
    with pytest.raises(HotStoreFull):
        await spend_nonce(store, KEY_A, "n-4", 10)
    mono.t += 1000  # everything expired: the whole capacity is free again
    for i in range(3):
        assert await spend_nonce(store, KEY_B, f"m-{i}", 10)
    with pytest.raises(HotStoreFull):
        await spend_nonce(store, KEY_B, "m-3", 10)


async def test_rate_limit_counters_count_per_window_expire_and_are_capped(mono: Monotonic) -> None:
    store = MemoryHotStore(max_keys=2, monotonic=mono)
    now = 6000.0  # the start of a 60 s window
    decisions = [await store.hit("ip:192.0.2.1", 2, 60, now) for _ in range(3)]
    assert [(d.allowed, d.remaining) for d in decisions] == [(True, 1), (True, 0), (False, 0)]
    assert (await store.hit("ip:192.0.2.2", 2, 60, now)).allowed
    with pytest.raises(HotStoreFull):
        await store.hit("ip:192.0.2.3", 2, 60, now)
    assert not (await store.hit("ip:192.0.2.1", 2, 60, now)).allowed  # live buckets still count
    mono.t += 61  # both counters have expired
    now += 60
    assert (await store.hit("ip:192.0.2.3", 2, 60, now)).remaining == 1
    assert (await store.hit("ip:192.0.2.1", 2, 60, now)).remaining == 1


async def test_a_request_refused_for_want_of_counter_room_counts_toward_no_limit(mono: Monotonic) -> None:
    """A signed request counts toward several limits (its key's, its address's). When the
    counters have room for only some of its new ones, it is refused (503 hot_store_full) having
    counted nothing: before, the limits counted before the full one kept their counts, so each
    such refusal used up one of the key's requests in the window."""
    store = MemoryHotStore(max_keys=3, monotonic=mono)
    now = 6000.0  # the start of a 60 s window
    for other in ("other", "another"):  # gone in 11 s; one counter left till then
        assert (await store.hit(other, 5, 10, now)).allowed
    quotas = [Quota(f"key:{KEY_A}", 2, 60), Quota("ip:192.0.2.1", 2, 60)]
    for nonce in ("n1", "n2"):
        with pytest.raises(HotStoreFull):
            await store.admit(KEY_A, nonce, 600, quotas, now, int(now))
    mono.t += 12  # "other" has expired: room for both counters, in the same 60 s window
    now += 12
    answers = [await store.admit(KEY_A, nonce, 600, quotas, now, int(now)) for nonce in ("n4", "n5", "n6")]
    assert [a is not None and a.refused_by for a in answers] == [None, None, quotas[0]]


async def test_a_full_store_refuses_new_signed_requests_with_503_until_nonces_expire(
    settings: Settings, clock: FakeClock, mono: Monotonic
) -> None:
    limit = 8
    store = MemoryHotStore(max_keys=limit, monotonic=mono)
    app: Any = create_app(settings, clock=clock, hot_store=store)
    contributor = new_contributor()
    async with (
        LifespanManager(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as client,
    ):
        await contributor.register(client)  # two nonces
        sent: list[dict[str, str]] = []
        statuses = []
        for _ in range(limit):
            headers = sign_headers(contributor.node_key, method="GET", url="http://testserver/v1/nodes/me")
            statuses.append((await client.get("/v1/nodes/me", headers=headers)).status_code)
            sent.append(headers)
        assert statuses == [200] * (limit - 2) + [503] * 2
        refused = await client.get("/v1/nodes/me", headers=sent[-1])
        body = problem(refused, 503, "hot_store_full")
        assert "ORCH_REDIS__URL" in body["detail"]
        assert int(refused.headers["retry-after"]) >= 1
        # A replay is still refused as one, and unsigned routes are unaffected.
        problem(await client.get("/v1/nodes/me", headers=sent[0]), 401, "nonce_replayed")
        assert (await client.get("/v1/pools")).status_code == 200
        # Full, it takes no beats: it is not ready, and writes no serving mark, so the sweeper
        # holds instead of marking dead the nodes whose beats it refuses (it said "ok" and marked).
        ready = await client.get("/readyz")
        assert ready.status_code == 503 and ready.json()["checks"]["hot_store"] == "unavailable: full"
        assert not await mark_serving(app.state.orch)
        # Once the nonces have expired (2 x window + 1 s), signed requests go through again.
        mono.t += settings.signature.effective_nonce_ttl_s
        assert await mark_serving(app.state.orch)
        assert (await client.get("/readyz")).status_code == 200
        assert (await client.get("/v1/nodes/me", headers=sent[-1])).status_code == 200
