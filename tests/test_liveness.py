"""Heartbeats and the liveness sweeper."""

from __future__ import annotations

import asyncio
import dataclasses
import re
from typing import Any

import httpx
from asgi_lifespan import LifespanManager
from sqlalchemy import event, func, select

from orchestrator.app import create_app
from orchestrator.core.clock import FakeClock
from orchestrator.core.hotstore import HotStore
from orchestrator.core.ticks import tick_runs
from orchestrator.identity.models import Node, NodeStatusChange
from orchestrator.liveness.service import SWEEPER, sweep_once
from orchestrator.settings import Settings
from orchestrator.tasks.jobs import reap_once
from tests.conftest import Contributor, new_contributor, problem
from tests.test_node_lists import beat_reads


async def status_of(client: httpx.AsyncClient, c: Contributor) -> str:
    r = await client.get("/v1/nodes/me", auth=c.node_auth)
    assert r.status_code == 200, r.text
    return str(r.json()["status"])


async def history(app_state: Any, node_id: str) -> list[tuple[str | None, str, str]]:
    async with app_state.sessionmaker() as session:
        rows = (
            await session.execute(
                select(NodeStatusChange)
                .where(NodeStatusChange.node_id == node_id)
                .order_by(NodeStatusChange.id)
            )
        ).scalars()
        return [(r.from_status, r.to_status, r.actor) for r in rows]


#: A first beat's answer, with nothing to drop or extend.
HEALTHY_BEAT = {"status": "healthy", "next_heartbeat_in_s": 10.0, "drop_leases": [], "lease_deadlines": []}


async def test_heartbeat_makes_a_node_healthy_and_returns_the_interval(
    client: httpx.AsyncClient, contributor: Contributor, app_state: Any
) -> None:
    r = await contributor.beat(client, metrics={"gpu_util": 0.9, "tokens_per_s": 1200.0})
    assert r.status_code == 200
    assert r.json() == HEALTHY_BEAT
    assert await status_of(client, contributor) == "healthy"
    me = (await client.get("/v1/nodes/me", auth=contributor.node_auth)).json()
    assert me["last_heartbeat_at"] is not None
    assert await history(app_state, contributor.node_id) == [("waiting", "healthy", "node")]


async def test_a_heartbeat_without_a_body_is_a_beat(
    client: httpx.AsyncClient, contributor: Contributor, app_state: Any
) -> None:
    """PROTOCOL.md: a beat is liveness, with metrics and lease ids when there are some. A node
    with nothing to report may send the signed POST without a body, as it may a join, a leave
    or a release; it was 422 validation_failed ("body: Field required"), and the node, whose
    beats all failed, never became healthy."""
    r = await client.post("/v1/nodes/me/heartbeat", auth=contributor.node_auth)
    assert r.status_code == 200, r.text
    assert r.json() == HEALTHY_BEAT
    assert await status_of(client, contributor) == "healthy"
    assert await history(app_state, contributor.node_id) == [("waiting", "healthy", "node")]
    # A body, when sent, is still a JSON object that validates.
    r = await client.post(
        "/v1/nodes/me/heartbeat",
        content=b"[]",
        headers={"content-type": "application/json"},
        auth=contributor.node_auth,
    )
    problem(r, 422, "validation_failed")


async def test_steady_heartbeats_write_no_sql(
    client: httpx.AsyncClient, contributor: Contributor, app_state: Any, clock: FakeClock
) -> None:
    await contributor.beat(client)
    async with app_state.sessionmaker() as session:
        before = (
            await session.execute(select(Node.updated_at).where(Node.id == contributor.node_id))
        ).scalar_one()
    for _ in range(5):
        clock.advance(10)
        assert (await contributor.beat(client)).status_code == 200
    async with app_state.sessionmaker() as session:
        after = (
            await session.execute(select(Node.updated_at).where(Node.id == contributor.node_id))
        ).scalar_one()
    assert after == before
    assert len(await history(app_state, contributor.node_id)) == 1


async def test_sweeper_moves_silent_nodes_healthy_unhealthy_dead(
    client: httpx.AsyncClient, app_state: Any, clock: FakeClock
) -> None:
    silent, steady = new_contributor(), new_contributor()
    for c in (silent, steady):
        await c.register(client)
        await c.beat(client)
    # 3 intervals (30 s) without a beat -> unhealthy; steady keeps beating.
    for _ in range(3):
        clock.advance(10.5)
        await steady.beat(client)
    report = await sweep_once(app_state)
    assert report.ran and report.to_unhealthy == 1 and report.to_dead == 0
    assert await status_of(client, silent) == "unhealthy"
    assert await status_of(client, steady) == "healthy"
    # 9 intervals -> dead.
    for _ in range(6):
        clock.advance(10)
        await steady.beat(client)
    report = await sweep_once(app_state)
    assert report.to_dead == 1
    assert await status_of(client, silent) == "dead"
    assert await status_of(client, steady) == "healthy"
    assert [h[1] for h in await history(app_state, silent.node_id)] == ["healthy", "unhealthy", "dead"]
    reasons = await _reasons(app_state, silent.node_id)
    assert "no heartbeat for 3 intervals" in reasons[1] and "no heartbeat for 9 intervals" in reasons[2]


async def test_a_dead_node_keeps_its_last_heartbeat_after_the_hot_store_forgets_it(
    client: httpx.AsyncClient, app_state: Any, clock: FakeClock
) -> None:
    """The hot store's entry of a node expires at twice the dead threshold; the node's views
    then showed no last heartbeat at all. The sweeper keeps it when it marks the node dead."""
    silent = new_contributor()
    await silent.register(client)
    await silent.beat(client)
    me = (await client.get("/v1/nodes/me", auth=silent.node_auth)).json()
    beat_at = me["last_heartbeat_at"]
    assert beat_at is not None
    clock.advance(31)
    await sweep_once(app_state)
    clock.advance(60)
    assert (await sweep_once(app_state)).to_dead == 1
    await app_state.hot_store.forget_node(silent.node_id)  # as when its entry expires
    me = (await client.get("/v1/nodes/me", auth=silent.node_auth)).json()
    assert (me["status"], me["last_heartbeat_at"]) == ("dead", beat_at)

    await silent.beat(client)  # back: the live value again
    me = (await client.get("/v1/nodes/me", auth=silent.node_auth)).json()
    assert me["status"] == "healthy" and me["last_heartbeat_at"] > beat_at


async def _reasons(app_state: Any, node_id: str) -> list[str]:
    async with app_state.sessionmaker() as session:
        return list(
            (
                await session.execute(
                    select(NodeStatusChange.reason)
                    .where(NodeStatusChange.node_id == node_id)
                    .order_by(NodeStatusChange.id)
                )
            ).scalars()
        )


async def test_a_dead_node_that_beats_again_is_healthy(
    client: httpx.AsyncClient, contributor: Contributor, app_state: Any, clock: FakeClock
) -> None:
    await contributor.beat(client)
    clock.advance(31)
    await sweep_once(app_state)
    clock.advance(60)
    await sweep_once(app_state)
    assert await status_of(client, contributor) == "dead"
    r = await contributor.beat(client)
    assert r.json()["status"] == "healthy"
    assert [h[1] for h in await history(app_state, contributor.node_id)] == [
        "healthy",
        "unhealthy",
        "dead",
        "healthy",
    ]


async def test_an_unhealthy_node_that_beats_again_is_not_later_swept_to_dead(
    client: httpx.AsyncClient, contributor: Contributor, app_state: Any, clock: FakeClock
) -> None:
    await contributor.beat(client)
    clock.advance(31)
    await sweep_once(app_state)
    assert await status_of(client, contributor) == "unhealthy"
    await contributor.beat(client)
    clock.advance(60)
    await contributor.beat(client)
    clock.advance(6)
    await sweep_once(app_state)
    assert await status_of(client, contributor) == "healthy"


async def test_sweeper_runs_once_per_tick_across_processes(
    settings: Settings, clock: FakeClock, hot_store: HotStore, client: httpx.AsyncClient, app_state: Any
) -> None:
    nodes = [new_contributor() for _ in range(4)]
    for c in nodes:
        await c.register(client)
        await c.beat(client)
    clock.advance(31)
    others = [create_app(settings, clock=clock, hot_store=hot_store, serving_marks=False) for _ in range(2)]
    async with LifespanManager(others[0]), LifespanManager(others[1]):
        states = [app_state, others[0].state.orch, others[1].state.orch]
        reports = await asyncio.gather(*(sweep_once(s) for s in states))
    assert sum(r.ran for r in reports) == 1
    assert sum(r.to_unhealthy for r in reports) == 4
    async with app_state.sessionmaker() as session:
        assert await tick_runs(session, SWEEPER) == 1
        changes = await session.scalar(
            select(func.count())
            .select_from(NodeStatusChange)
            .where(NodeStatusChange.to_status == "unhealthy")
        )
    assert changes == 4
    # The next tick runs again (once).
    clock.advance(5)
    assert (await sweep_once(app_state)).ran


async def test_sweeper_cost_does_not_grow_with_beating_nodes(
    client: httpx.AsyncClient, app_state: Any, clock: FakeClock
) -> None:
    """A tick reads only what changed: the SQL it issues is the same for 10 or 3,000 beating
    nodes, and a tick where one node went silent touches that one node only."""
    store = app_state.hot_store
    statements: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(statement)

    async def tick_cost(n_beating: int) -> int:
        for i in range(n_beating):
            await store.record_beat(f"beating-{i:05d}", clock.now(), {}, ttl_s=600)
        clock.advance(5)
        statements.clear()
        event.listen(app_state.engine.sync_engine, "before_cursor_execute", count)
        try:
            report = await sweep_once(app_state)
        finally:
            event.remove(app_state.engine.sync_engine, "before_cursor_execute", count)
        assert report.ran
        assert report.to_unhealthy == 0
        return len(statements)

    assert await tick_cost(10) == await tick_cost(3000)

    silent = new_contributor()
    await silent.register(client)
    await silent.beat(client)
    clock.advance(31)
    for i in range(3000):
        await store.record_beat(f"beating-{i:05d}", clock.now(), {}, ttl_s=600)
    report = await sweep_once(app_state)
    assert (report.to_unhealthy, report.to_dead) == (1, 0)


async def test_the_sweeper_reads_the_last_beats_of_the_nodes_it_marks_dead_in_one_call(
    client: httpx.AsyncClient, app_state: Any, clock: FakeClock
) -> None:
    """The last beats kept in SQL for a tick's dead nodes are one hot-store read, not one per
    node (a tick marks up to a batch of them dead, in its transaction)."""
    silent = [new_contributor() for _ in range(4)]
    for c in silent:
        await c.register(client)
        await c.beat(client)
    clock.advance(31)
    assert (await sweep_once(app_state)).to_unhealthy == 4
    clock.advance(60)
    with beat_reads(app_state.hot_store) as reads:
        assert (await sweep_once(app_state)).to_dead == 4
    assert reads == ["last_beats"]
    for c in silent:
        await app_state.hot_store.forget_node(c.node_id)  # as when its entry expires
        me = (await client.get("/v1/nodes/me", auth=c.node_auth)).json()
        assert me["status"] == "dead" and me["last_heartbeat_at"] is not None


async def test_the_openapi_schema_names_the_metric_names_a_heartbeat_takes(
    client: httpx.AsyncClient, contributor: Contributor
) -> None:
    """The schema gave metrics any names; the server takes 1-64 ASCII letters, digits and _ (not
    only _), other than "at". A client that follows the schema gets no 422 for a name."""
    spec = (await client.get("/openapi.json")).json()["components"]["schemas"]["HeartbeatIn"]
    names = spec["properties"]["metrics"]["propertyNames"]

    def documented(name: str) -> bool:
        return (
            re.search(names["pattern"], name) is not None
            and len(name) <= names["maxLength"]
            and name != names["not"]["const"]
        )

    for name in ("gpu_util", "_9", "A" * 64, "A" * 65, "_", "", "at", "x-y", "tokens/s", "é", "gpu util"):
        r = await contributor.beat(client, metrics={name: 1.0})
        assert (r.status_code == 200) is documented(name), (name, r.status_code, r.text)


async def test_heartbeat_rejects_bad_metrics(client: httpx.AsyncClient, contributor: Contributor) -> None:
    r = await contributor.beat(client, metrics={"bad name!": 1})
    assert r.status_code == 422
    r = await contributor.beat(client, metrics={f"m{i}": i for i in range(40)})
    assert r.status_code == 422
    # "at" is the beat's own time: a metric of that name could fake it (or, huge, break the
    # node views that read it).
    r = await contributor.beat(client, metrics={"at": 1e300})
    assert r.status_code == 422 and "reserved" in r.json()["detail"]
    # A metric is a JSON number: true and "0.9" were read as 1.0 and 0.9.
    for bad in (True, "0.9"):
        r = await contributor.beat(client, metrics={"gpu_util": bad})
        body = problem(r, 422, "validation_failed")
        assert any(e["loc"][-2:] == ["metrics", "gpu_util"] for e in body["errors"]), body
    # NaN and Infinity are not JSON numbers, though Python's parser reads the bare words.
    for word in (b"NaN", b"Infinity", b"-Infinity"):
        r = await client.post(
            "/v1/nodes/me/heartbeat",
            content=b'{"metrics": {"gpu_util": ' + word + b"}}",
            headers={"content-type": "application/json"},
            auth=contributor.node_auth,
        )
        body = problem(r, 422, "validation_failed")
        assert any(e["loc"][-2:] == ["metrics", "gpu_util"] for e in body["errors"]), body
    assert (await status_of(client, contributor)) == "waiting"


async def test_the_sweeper_goes_on_after_its_interval_is_raised(
    settings: Settings, client: httpx.AsyncClient, app_state: Any, clock: FakeClock, hot_store: HotStore
) -> None:
    """A tick's number is the time over the sweep interval: with ORCH_HEARTBEAT__SWEEP_INTERVAL_S
    raised from 5 to 10 s, every later tick's number was half the one recorded, so no tick could
    be claimed again (for decades) and a node that stopped beating stayed healthy for good. The
    tick recorded ahead is taken over once it has stood still for a minute."""
    silent = new_contributor()
    await silent.register(client)
    await silent.beat(client)
    clock.advance(5)
    assert (await sweep_once(app_state)).ran

    slower = settings.model_copy(
        update={"heartbeat": settings.heartbeat.model_copy(update={"sweep_interval_s": 10.0})}
    )
    restarted = create_app(slower, clock=clock, hot_store=hot_store, serving_marks=False)
    async with LifespanManager(restarted):
        state = restarted.state.orch
        clock.advance(1)
        assert not (await sweep_once(state)).ran  # the tick recorded ahead, first seen
        clock.advance(60)
        report = await sweep_once(state)
        assert report.ran and report.to_unhealthy == 1
        assert await status_of(client, silent) == "unhealthy"
        assert not (await sweep_once(state)).ran  # still once per tick
        clock.advance(10)
        assert (await sweep_once(state)).ran


async def test_a_process_whose_clock_is_behind_does_not_run_every_tick_again(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    """A second process two minutes slow (a host without NTP) sees every tick the process on
    time records as more than a minute ahead of its own. It claimed over each of them, and the
    one on time claimed its next tick as usual: every loop ran twice per interval, half of its
    runs judged on the slow clock. The recorded tick keeps moving, so it is not taken over."""
    slow_clock = FakeClock(clock.now() - 120)
    slow = dataclasses.replace(app_state, clock=slow_clock)
    for _ in range(24):  # two minutes of both processes ticking every 5 s
        assert (await sweep_once(app_state)).ran and (await reap_once(app_state)).ran
        assert not (await sweep_once(slow)).ran and not (await reap_once(slow)).ran
        clock.advance(5)
        slow_clock.advance(5)
    async with app_state.sessionmaker() as session:
        assert await tick_runs(session, SWEEPER) == 24


async def test_one_process_whose_clock_ran_ahead_does_not_stop_the_loops_everywhere(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    """A host whose clock ran a day ahead for one tick (then set right) recorded a tick a day
    ahead: every other process's claim failed until the clocks caught up with it (no lease
    expired, no node was judged, for a day). A recorded tick over a minute ahead, that no claim
    has moved for a minute, is claimed."""
    ahead = dataclasses.replace(app_state, clock=FakeClock(clock.now() + 86400))
    assert (await sweep_once(ahead)).ran and (await reap_once(ahead)).ran
    for _ in range(12):  # a minute of ticks, the recorded one standing still a day ahead
        clock.advance(5)
        assert not (await sweep_once(app_state)).ran and not (await reap_once(app_state)).ran
    clock.advance(5)
    assert (await sweep_once(app_state)).ran and (await reap_once(app_state)).ran
    assert not (await sweep_once(app_state)).ran  # still once per tick
    # A process whose clock is a few seconds ahead (within the minute) does not run a tick twice.
    slightly = dataclasses.replace(app_state, clock=FakeClock(clock.now() + 20))
    assert (await sweep_once(slightly)).ran
    clock.advance(5)
    assert not (await sweep_once(app_state)).ran
