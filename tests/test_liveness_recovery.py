"""The liveness sweeper and reconciler recover from what the hot store and SQL can disagree on:
a sweep whose transaction failed after its hot-store moves (the nodes wait in ``dying`` until
their dead transition commits), and a hot store that lost its liveness sets (a restart of the
in-process store, a Redis flush: the reconciler puts SQL's healthy and unhealthy nodes back under
watch as if last seen then). Time is the tests' FakeClock; nothing here measures speed."""

from __future__ import annotations

from collections.abc import AsyncIterator, Generator
from typing import Any

import httpx
import pytest
from asgi_lifespan import LifespanManager

from orchestrator.app import create_app
from orchestrator.core.clock import FakeClock
from orchestrator.core.hotstore import DYING, HEALTHY, UNHEALTHY, HotStore, MemoryHotStore, RedisHotStore
from orchestrator.core.signing import sign_headers
from orchestrator.identity import repository as repo
from orchestrator.liveness import service as liveness
from orchestrator.liveness.service import reconcile_once, sweep_once
from orchestrator.settings import Settings
from tests.conftest import REDIS_URL, Contributor, _drop_prefix, new_contributor
from tests.test_liveness import history

# Long enough, at 5 s a tick, for a node to be found by a reconcile (once its status is older
# than dead_after_s, 90 s, at the next 60 s tick) and then to die (90 s more).
SILENCE_TICKS = 60


class _SignedAt(httpx.Auth):
    """Signs as of the FakeClock, which these tests move by minutes (past the signature window)."""

    requires_request_body = True

    def __init__(self, c: Contributor, clock: FakeClock) -> None:
        self.key, self.clock = c.node_key, clock

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        request.headers.update(
            sign_headers(
                self.key,
                method=request.method,
                url=str(request.url),
                body=request.content,
                created=int(self.clock.now()),
            )
        )
        yield request


async def _beat(client: httpx.AsyncClient, c: Contributor, clock: FakeClock) -> str:
    r = await client.post("/v1/nodes/me/heartbeat", json={}, auth=_SignedAt(c, clock))
    assert r.status_code == 200, r.text
    return str(r.json()["status"])


async def _me(client: httpx.AsyncClient, c: Contributor, clock: FakeClock) -> dict[str, Any]:
    r = await client.get("/v1/nodes/me", auth=_SignedAt(c, clock))
    assert r.status_code == 200, r.text
    return dict(r.json())


async def status_of(client: httpx.AsyncClient, c: Contributor, clock: FakeClock) -> str:
    return str((await _me(client, c, clock))["status"])


async def _ticks(
    state: Any, clock: FakeClock, n: int, beating: tuple[Contributor, httpx.AsyncClient] | None = None
) -> None:
    """``n`` ticks of 5 s of both loops, as the background loops would run them; ``beating``
    sends a heartbeat every other tick (every 10 s, the interval)."""
    for i in range(n):
        clock.advance(5)
        if beating is not None and i % 2 == 0:
            contributor, client = beating
            await _beat(client, contributor, clock)
        await reconcile_once(state)
        await sweep_once(state)


async def _flaky_dead_transition(monkeypatch: pytest.MonkeyPatch) -> None:
    real = repo.transition

    async def flaky(session: Any, ids: Any, **kw: Any) -> Any:
        if kw["to_status"] == "dead" and ids:
            raise RuntimeError("simulated DB failure (deadlock / connection loss)")
        return await real(session, ids, **kw)

    monkeypatch.setattr(liveness.repo, "transition", flaky)


async def _dead_transition_fails_once(
    client: httpx.AsyncClient,
    contributor: Contributor,
    app_state: Any,
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The node beats once, turns unhealthy, and the tick that should mark it dead fails."""
    await _beat(client, contributor, clock)
    clock.advance(31)
    await sweep_once(app_state)
    assert await status_of(client, contributor, clock) == "unhealthy"
    clock.advance(60)
    with monkeypatch.context() as m:
        await _flaky_dead_transition(m)
        with pytest.raises(RuntimeError):
            await sweep_once(app_state)


async def test_a_sweep_whose_dead_transition_failed_is_caught_up_by_the_next_tick(
    client: httpx.AsyncClient,
    contributor: Contributor,
    app_state: Any,
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    await _dead_transition_fails_once(client, contributor, app_state, clock, monkeypatch)
    # The node waits in ``dying`` until its transition commits.
    assert await app_state.hot_store.stage_members(DYING, 10) == [contributor.node_id]
    clock.advance(5)
    report = await sweep_once(app_state)
    assert report.to_dead == 1
    assert await status_of(client, contributor, clock) == "dead"
    assert await app_state.hot_store.stage_members(DYING, 10) == []
    assert [h[1:] for h in await history(app_state, contributor.node_id)][-1] == ("dead", "sweeper")
    # Later ticks find nothing more to do.
    clock.advance(5)
    assert (await sweep_once(app_state)).to_dead == 0


async def test_a_node_that_beats_while_dying_after_a_failed_tick_stays_healthy(
    client: httpx.AsyncClient,
    contributor: Contributor,
    app_state: Any,
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    await _dead_transition_fails_once(client, contributor, app_state, clock, monkeypatch)
    assert await _beat(client, contributor, clock) == "healthy"
    assert await app_state.hot_store.stage_members(DYING, 10) == []
    clock.advance(5)
    assert (await sweep_once(app_state)).to_dead == 0
    assert await status_of(client, contributor, clock) == "healthy"


@pytest.fixture
async def restarted(settings: Settings, clock: FakeClock) -> AsyncIterator[tuple[Any, httpx.AsyncClient]]:
    """The server restarted with the embedded store: a fresh, empty in-process hot store."""
    other = create_app(settings, clock=clock, hot_store=MemoryHotStore(), serving_marks=False)
    async with (
        LifespanManager(other),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=other), base_url="http://testserver") as c,
    ):
        yield other.state.orch, c


async def _last_heartbeat(client: httpx.AsyncClient, c: Contributor, clock: FakeClock) -> Any:
    return (await _me(client, c, clock))["last_heartbeat_at"]


async def test_after_a_restart_of_the_in_process_store_a_silent_node_dies(
    clock: FakeClock,
    client: httpx.AsyncClient,
    contributor: Contributor,
    restarted: tuple[Any, httpx.AsyncClient],
) -> None:
    await _beat(client, contributor, clock)
    state, new_client = restarted
    await _ticks(state, clock, SILENCE_TICKS)
    assert await status_of(new_client, contributor, clock) == "dead"
    assert [h[1] for h in await history(state, contributor.node_id)] == ["healthy", "unhealthy", "dead"]
    # Its last heartbeat is not faked by the reconcile: the new store never saw one.
    assert await _last_heartbeat(new_client, contributor, clock) is None


async def test_after_a_restart_an_unhealthy_node_that_stays_silent_dies(
    clock: FakeClock,
    client: httpx.AsyncClient,
    contributor: Contributor,
    app_state: Any,
    restarted: tuple[Any, httpx.AsyncClient],
) -> None:
    await _beat(client, contributor, clock)
    clock.advance(31)
    await sweep_once(app_state)
    assert await status_of(client, contributor, clock) == "unhealthy"
    state, new_client = restarted
    await _ticks(state, clock, SILENCE_TICKS)
    assert await status_of(new_client, contributor, clock) == "dead"


async def test_after_a_restart_a_node_that_keeps_beating_is_never_marked_dead(
    clock: FakeClock,
    client: httpx.AsyncClient,
    contributor: Contributor,
    restarted: tuple[Any, httpx.AsyncClient],
) -> None:
    # It beat steadily before the restart, long enough for its status to be older than
    # dead_after_s, so the first reconcile after the restart (before its next beat) watches it.
    await _beat(client, contributor, clock)
    for _ in range(12):
        clock.advance(10)
        await _beat(client, contributor, clock)
    state, new_client = restarted
    report = await reconcile_once(state)
    assert report.ran and report.watched == 1
    # Its next beats reach the new store; the reconciler never puts it back twice.
    await _ticks(state, clock, SILENCE_TICKS, beating=(contributor, new_client))
    assert await status_of(new_client, contributor, clock) == "healthy"
    assert [h[1] for h in await history(state, contributor.node_id)] == ["healthy"]
    assert await _last_heartbeat(new_client, contributor, clock) is not None


async def test_a_reconcile_leaves_beating_nodes_and_other_statuses_alone(
    client: httpx.AsyncClient, app_state: Any, clock: FakeClock
) -> None:
    beating, waiting = new_contributor(), new_contributor()
    await beating.register(client)
    await waiting.register(client)  # registered, never beat: not watched
    await _beat(client, beating, clock)
    for _ in range(12):
        clock.advance(10)
        await _beat(client, beating, clock)
    report = await reconcile_once(app_state)
    assert report.ran and report.watched == 0
    assert await status_of(client, waiting, clock) == "waiting"
    # Once per tick across processes.
    assert not (await reconcile_once(app_state)).ran
    clock.advance(liveness.RECONCILE_INTERVAL_S)
    assert (await reconcile_once(app_state)).ran


async def test_the_reconciler_pages_through_many_nodes(
    client: httpx.AsyncClient, app_state: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(liveness, "RECONCILE_PAGE", 2)
    nodes = [new_contributor() for _ in range(5)]
    for c in nodes:
        await c.register(client)
        await _beat(client, c, clock)
    clock.advance(31)
    await sweep_once(app_state)  # all unhealthy
    for c in nodes[:2]:
        await _beat(client, c, clock)  # two healthy again
    clock.advance(95)
    for c in nodes[:2]:
        await _beat(client, c, clock)
    for c in nodes:
        await app_state.hot_store.forget_node(c.node_id)  # the store lost them all
    report = await reconcile_once(app_state)
    assert report.watched == 5
    clock.advance(liveness.RECONCILE_INTERVAL_S)
    assert (await reconcile_once(app_state)).watched == 0


@pytest.mark.skipif(not REDIS_URL, reason="a Redis flush (ORCH_TEST_REDIS_URL)")
async def test_after_a_redis_flush_a_silent_node_dies(
    settings: Settings, client: httpx.AsyncClient, contributor: Contributor, app_state: Any, clock: FakeClock
) -> None:
    assert isinstance(app_state.hot_store, RedisHotStore)
    await _beat(client, contributor, clock)
    await _drop_prefix(REDIS_URL, settings.redis.prefix)
    await _ticks(app_state, clock, SILENCE_TICKS)
    assert await status_of(client, contributor, clock) == "dead"


# ------------------------------------------------------------ the store's methods, both kinds


async def test_dying_members_stay_until_dropped_and_a_beat_removes_them(hot_store: HotStore) -> None:
    for node, at in (("n1", 100.0), ("n2", 90.0), ("n3", 95.0)):
        await hot_store.record_beat(node, at, {}, ttl_s=600)
    assert await hot_store.move_stale(HEALTHY, UNHEALTHY, 200.0, 10) == ["n2", "n3", "n1"]
    assert await hot_store.move_stale(UNHEALTHY, DYING, 96.0, 10) == ["n2", "n3"]
    assert await hot_store.stage_members(DYING, 10) == ["n2", "n3"]
    assert await hot_store.stage_members(DYING, 1) == ["n2"]
    assert await hot_store.stage_members(DYING, 10) == ["n2", "n3"]  # reading does not remove
    await hot_store.record_beat("n3", 300.0, {}, ttl_s=600)
    assert await hot_store.stage_members(DYING, 10) == ["n2"]
    await hot_store.drop(DYING, ["n2", "absent"])
    assert await hot_store.stage_members(DYING, 10) == []
    await hot_store.drop(DYING, [])


async def test_watch_if_absent_adds_only_nodes_in_no_stage(hot_store: HotStore) -> None:
    await hot_store.record_beat("h", 100.0, {}, ttl_s=600)
    await hot_store.record_beat("u", 100.0, {}, ttl_s=600)
    await hot_store.record_beat("d", 90.0, {}, ttl_s=600)
    await hot_store.move_stale(HEALTHY, UNHEALTHY, 100.0, 10)
    await hot_store.record_beat("h", 150.0, {}, ttl_s=600)
    await hot_store.move_stale(UNHEALTHY, DYING, 95.0, 10)  # d
    assert await hot_store.watch_if_absent(["d", "h", "lost", "u"], UNHEALTHY, 500.0) == ["lost"]
    assert await hot_store.watch_if_absent([], HEALTHY, 500.0) == []
    assert await hot_store.last_beat("lost") is None  # its last beat is not faked
    # It is watched as if last seen at 500: stale only after that.
    assert await hot_store.move_stale(UNHEALTHY, DYING, 499.0, 10) == ["u"]
    assert await hot_store.move_stale(UNHEALTHY, DYING, 500.0, 10) == ["lost"]
    await hot_store.forget_node("lost")
    assert await hot_store.stage_members(DYING, 10) == ["d", "u"]
