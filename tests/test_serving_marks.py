"""An outage does not mark the fleet dead: the sweeper counts silence only while some API
process could take beats (``liveness.serving``)."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import logging
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
import structlog
from asgi_lifespan import LifespanManager
from prometheus_client import REGISTRY
from redis.exceptions import ConnectionError as RedisConnectionError
from sqlalchemy import select

from orchestrator.app import create_app
from orchestrator.core.clock import FakeClock, SystemClock
from orchestrator.core.hotstore import HotStore, MemoryHotStore, RedisHotStore
from orchestrator.identity.models import Node, NodeStatusChange
from orchestrator.liveness.service import HELD_REPEAT_S, sweep_once
from orchestrator.liveness.serving import (
    ABANDONED_CONFIRM_S,
    ABANDONED_S,
    MARK_INTERVAL_S,
    STALL_S,
    ServingMark,
    check_clock,
    mark_serving,
)
from orchestrator.settings import Settings
from orchestrator.tasks.jobs import reap_once
from orchestrator.tasks.models import Assignment
from tests.conftest import Contributor, new_contributor, postgres_only, problem
from tests.tasks_helpers import pool_setup, task


@contextmanager
def info_logs() -> Iterator[list[dict[str, Any]]]:
    """The log lines of the block, from the INFO level (the tests log from WARNING)."""
    wrapper = structlog.get_config()["wrapper_class"]
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
    try:
        with structlog.testing.capture_logs() as logs:
            yield logs
    finally:
        structlog.configure(wrapper_class=wrapper)


async def status_of(client: httpx.AsyncClient, c: Contributor) -> str:
    r = await client.get("/v1/nodes/me", auth=c.node_auth)
    assert r.status_code == 200, r.text
    return str(r.json()["status"])


async def mark(app_state: Any) -> ServingMark:
    assert await mark_serving(app_state)
    async with app_state.sessionmaker() as session:
        return (await session.execute(select(ServingMark))).scalar_one()


async def serve_for(
    app_state: Any, clock: FakeClock, seconds: float, beat: Callable[[], Awaitable[httpx.Response]]
) -> None:
    """``seconds`` of normal service: a mark every 5 s, and ``beat`` every 10 s."""
    for step in range(int(seconds // MARK_INTERVAL_S)):
        clock.advance(MARK_INTERVAL_S)
        await mark(app_state)
        if step % 2:
            assert (await beat()).status_code == 200


async def test_an_outage_longer_than_the_dead_threshold_marks_no_node_dead_and_keeps_its_leases(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    async with pool_setup(app, app_state, workers=1, lease_duration_s=600) as s:
        w = s.workers[0]
        await s.enqueue([task()])
        lease = (await w.claim(s.pool_id)).json()["leases"][0]
        await mark(app_state)
        await serve_for(app_state, clock, 95, lambda: w.beat([lease["assignment_id"]]))
        assert (await sweep_once(app_state)).held is None

        # The database or Redis is down, or every API process is: no mark, no beat, for 150 s
        # (the dead threshold is 90 s). A sweeper that can still tick moves no node once the
        # last mark is older than the stall. (The clock moves less than the 300 s a request's
        # signature stays fresh: the test's requests are signed with the real time.)
        down_at = clock.now()
        with info_logs() as logs:
            for second in range(5, 155, 5):
                clock.advance(5)
                report = await sweep_once(app_state)
                held = None if second <= STALL_S else "not_serving"
                assert (report.held, report.to_unhealthy, report.to_dead) == (held, 0, 0)

            # Back. The worker's first beat comes 25 s later (its backoff): the lease is still its.
            await mark(app_state)
            for _ in range(5):
                clock.advance(5)
                await mark(app_state)
                report = await sweep_once(app_state)
                assert (report.held, report.to_unhealthy, report.to_dead) == ("resumed", 0, 0)
        # A warning as the outage's 27 held ticks began, again in each minute they went on (130 s:
        # three minutes or four), then one line for the return's 5 ticks.
        holds = [
            (e["event"], e["log_level"], e.get("reason")) for e in logs if e["event"] != "serving_resumed"
        ]
        held_ticks = [down_at + second for second in range(5, 155, 5) if second > STALL_S]
        minutes = len({int(at // HELD_REPEAT_S) for at in held_ticks})
        assert (len(held_ticks), minutes in (3, 4)) == (27, True)
        assert holds == [("liveness_sweep_held", "warning", "not_serving")] * minutes + [
            ("liveness_sweep_held", "info", "resumed")
        ]
        beat = (await w.beat([lease["assignment_id"]])).json()
        assert [x["assignment_id"] for x in beat.pop("lease_deadlines")] == [lease["assignment_id"]]
        assert beat == {"status": "healthy", "next_heartbeat_in_s": 10.0, "drop_leases": []}
        assert (await w.submit(lease)).status_code == 201
        async with app_state.sessionmaker() as session:
            changes = (
                await session.execute(
                    select(NodeStatusChange.to_status).where(NodeStatusChange.node_id == w.node_id)
                )
            ).scalars()
            assert list(changes) == ["healthy"]


async def test_after_an_outage_a_silent_node_dies_the_dead_threshold_after_the_return(
    client: httpx.AsyncClient, app_state: Any, clock: FakeClock
) -> None:
    gone, steady = new_contributor(), new_contributor()
    for c in (gone, steady):
        await c.register(client)
        await c.beat(client)
    await mark(app_state)
    clock.advance(150)  # the outage; ``gone`` stopped during it and never comes back
    returned = (await mark(app_state)).since
    assert returned == clock.now()

    def beat() -> Awaitable[httpx.Response]:
        return steady.beat(client)

    with info_logs() as logs:
        await serve_for(app_state, clock, 25, beat)  # 25 s back: under the unhealthy threshold
        assert (await sweep_once(app_state)).held == "resumed"
        assert await status_of(client, gone) == "healthy"
        await serve_for(app_state, clock, 10, beat)  # 35 s back: silent for 30 s of service
        report = await sweep_once(app_state)
        assert (report.held, report.to_unhealthy, report.to_dead) == ("resumed", 1, 0)
        assert await status_of(client, gone) == "unhealthy"
        await serve_for(app_state, clock, 50, beat)  # 85 s back
        assert (await sweep_once(app_state)).to_dead == 0
        await serve_for(app_state, clock, 10, beat)  # 95 s back: dead, judged as usual again
        report = await sweep_once(app_state)
        assert (report.held, report.to_dead) == (None, 1)
    assert (await status_of(client, gone), await status_of(client, steady)) == ("dead", "healthy")
    # The hold is logged as it begins (with when every silence is judged again) and as it
    # ends, not on each of the ticks between.
    holds = [e for e in logs if e["event"].startswith("liveness_sweep_")]
    assert [(e["event"], e.get("reason"), e.get("judged_in_full_in_s")) for e in holds] == [
        ("liveness_sweep_held", "resumed", 65.0),
        ("liveness_sweep_judging", None, None),
    ]


async def test_a_mark_after_a_gap_starts_a_new_run_and_a_clock_behind_never_moves_it_back(
    app_state: Any, clock: FakeClock
) -> None:
    start = clock.now()
    first = await mark(app_state)
    assert (first.at, first.since) == (start, start)
    clock.advance(STALL_S)  # a mark at most the stall after the last one continues the run
    assert ((m := await mark(app_state)).at, m.since) == (start + STALL_S, start)
    clock.advance(STALL_S + 1)
    assert ((m := await mark(app_state)).at, m.since) == (start + 2 * STALL_S + 1, start + 2 * STALL_S + 1)
    behind = dataclasses.replace(app_state, clock=FakeClock(start + 2 * STALL_S - 3))
    assert await mark_serving(behind)
    assert ((m := await mark(app_state)).at, m.since) == (start + 2 * STALL_S + 1, start + 2 * STALL_S + 1)


async def test_a_process_that_cannot_reach_redis_marks_nothing(app_state: Any) -> None:
    store = RedisHotStore.from_url("redis://127.0.0.1:1/0", "unreachable:")
    try:
        with pytest.raises(RedisConnectionError):
            await mark_serving(dataclasses.replace(app_state, hot_store=store))
    finally:
        await store.aclose()
    async with app_state.sessionmaker() as session:
        assert (await session.execute(select(ServingMark))).first() is None


async def test_an_api_process_without_background_loops_marks_at_start(
    settings: Settings, clock: FakeClock, hot_store: HotStore
) -> None:
    """An API replica of a deployment whose loops run in ``orchestrator background`` marks too:
    it is where the beats are taken."""
    assert not settings.server.background_loops
    application = create_app(settings, clock=clock, hot_store=hot_store)
    async with LifespanManager(application):
        state = application.state.orch
        async with asyncio.timeout(30):
            while True:
                async with state.sessionmaker() as session:
                    row = (await session.execute(select(ServingMark))).scalar_one_or_none()
                if row is not None:
                    break
                await asyncio.sleep(0.05)
        assert (row.at, row.since) == (clock.now(), clock.now())


async def test_a_lease_outlives_an_outage_longer_than_itself(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    """A 60 s lease and a 120 s outage: the reaper expires nothing while no process marks, and
    the first mark after the outage gives the lease the outage's length back, so the node's
    answer after the return is taken. A lease nobody renews after that runs out as usual."""
    async with pool_setup(app, app_state, workers=2, lease_duration_s=60) as s:
        kept, dropped = s.workers
        await s.enqueue([task(), task()])
        leases = [(await w.claim(s.pool_id)).json()["leases"][0] for w in (kept, dropped)]
        await mark(app_state)
        began = clock.now()
        deadlines = await lease_deadlines(app_state)

        for _ in range(24):  # 120 s without a mark
            clock.advance(5)
            assert (await reap_once(app_state)).expired == 0
        assert (await mark(app_state)).since == began + 120
        assert await lease_deadlines(app_state) == [d + dt.timedelta(seconds=120) for d in deadlines]
        assert (await reap_once(app_state)).expired == 0
        assert (await kept.submit(leases[0])).status_code == 201

        # The other node never comes back: its lease runs out 60 s after the outage ended.
        await serve_for(app_state, clock, 55, lambda: kept.beat())
        assert (await reap_once(app_state)).expired == 0
        await serve_for(app_state, clock, 10, lambda: kept.beat())
        assert (await reap_once(app_state)).expired == 1
        problem(await dropped.submit(leases[1]), 409, "lease_expired")


async def test_requests_at_the_return_from_an_outage_judge_leases_after_the_first_mark(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    """60 s leases and a 120 s outage; the service is back, and the marks loop's next tick is
    up to 5 s away. Requests served in that moment saw every lease as run out: a result refused
    (409 lease_expired), a beat told to drop its lease (which the mark then made live again), a
    claim past the lease cap of 1, a release counted as an expiry. Now an API process whose own
    last mark is stale writes one before such a request, and each is answered as after it."""
    app_state.marking = True  # an API process; its marks loop does not tick on this clock
    async with pool_setup(app, app_state, workers=4, lease_duration_s=60, max_leases_per_node=1) as s:
        answers, beats, claims, releases = s.workers
        await s.enqueue([task(f"t{i}") for i in range(5)])
        leases = [(await w.claim(s.pool_id)).json()["leases"][0] for w in s.workers]
        await mark(app_state)
        for _ in range(24):  # 120 s without a mark: the database or Redis was down
            clock.advance(5)
            assert (await reap_once(app_state)).expired == 0
        clock.advance(1)  # back

        assert (await answers.submit(leases[0])).status_code == 201
        r = await beats.beat([leases[1]["assignment_id"]])
        assert r.status_code == 200 and r.json()["drop_leases"] == [], r.text
        r = await claims.claim(s.pool_id)
        assert (r.json()["leases"], r.json()["reason"]) == ([], "lease_cap_reached"), r.text
        r = await releases.release(leases[3])
        assert r.status_code == 200 and r.json()["status"] == "released", r.text
        assert (await mark(app_state)).since == clock.now()  # the run began with the first request
        assert (await reap_once(app_state)).expired == 0


async def test_the_live_leases_read_at_the_return_from_an_outage_are_those_after_the_first_mark(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    """A worker reads its live leases after a failed claim, so at the return from an outage: the
    read left out every lease that had run out meanwhile, which the mark moments later made
    live again; the worker never took them up, and they ran out as attempts."""
    app_state.marking = True
    async with pool_setup(app, app_state, workers=1, lease_duration_s=60) as s:
        [w] = s.workers
        await s.enqueue([task()])
        lease = (await w.claim(s.pool_id)).json()["leases"][0]
        await mark(app_state)
        clock.advance(121)  # the outage, then back
        r = await w.client.get("/v1/nodes/me/leases", auth=w.contributor.node_auth)
        assert r.status_code == 200, r.text
        assert [x["assignment_id"] for x in r.json()["leases"]] == [lease["assignment_id"]]
        assert (await mark(app_state)).since == clock.now()  # the read wrote the first mark of the run
        [deadline] = await lease_deadlines(app_state)
        assert deadline > app_state.clock.utcnow()


async def test_a_lease_taken_after_an_outage_began_does_not_get_its_length(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    """Only a lease live when the outage began lost time to it: one claimed meanwhile (by a
    process that writes no marks) keeps the deadline it was given."""
    async with pool_setup(app, app_state, workers=1, lease_duration_s=600) as s:
        [w] = s.workers
        await s.enqueue([task()])
        await mark(app_state)
        clock.advance(120)
        assert len((await w.claim(s.pool_id)).json()["leases"]) == 1
        [deadline] = await lease_deadlines(app_state)
        await mark(app_state)  # the first after the outage
        assert await lease_deadlines(app_state) == [deadline]


async def test_a_lease_taken_after_the_last_mark_before_an_outage_outlives_it(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    """Marks come every 5 s, so an outage begins up to 5 s (``STALL_S`` at most) after the last
    one, and leases are claimed in between (a busy pool claims many a second). Those were left
    out of the extension at the return, as if claimed during the outage: a 60 s lease claimed 3 s
    after the last mark, then a 120 s outage, and the lease had run out at the return (the
    reaper expired it, the node's result was refused 409 lease_expired and the work was lost).
    Such a lease now gets back the part of the outage it lived through."""
    async with pool_setup(app, app_state, workers=1, lease_duration_s=60) as s:
        [w] = s.workers
        await s.enqueue([task()])
        await mark(app_state)
        began = clock.now()
        clock.advance(3)
        lease = (await w.claim(s.pool_id)).json()["leases"][0]
        [deadline] = await lease_deadlines(app_state)
        clock.advance(2)  # the database or Redis goes down
        for _ in range(24):  # 120 s without a mark
            clock.advance(5)
            assert (await reap_once(app_state)).expired == 0
        assert (await mark(app_state)).since == clock.now()
        assert await lease_deadlines(app_state) == [deadline + dt.timedelta(seconds=clock.now() - began - 3)]
        assert (await reap_once(app_state)).expired == 0
        assert (await w.submit(lease)).status_code == 201


async def lease_deadlines(app_state: Any) -> list[dt.datetime]:
    async with app_state.sessionmaker() as session:
        query = (
            select(Assignment.lease_expires_at).where(Assignment.status == "active").order_by(Assignment.id)
        )
        return list((await session.execute(query)).scalars())


async def test_marks_nobody_writes_for_an_hour_no_longer_hold_the_sweeper_and_the_reaper(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    """Every API process stopped marking (of a version that writes none, or none left) while
    the loops run on: the last mark must not hold liveness and lease expiry for ever. Past an
    hour, once each loop has itself seen them missing for 5 minutes more, they judge as without
    marks."""
    async with pool_setup(app, app_state, workers=1, lease_duration_s=60) as s:
        w = s.workers[0]
        await s.enqueue([task()])
        await w.claim(s.pool_id)
        await mark(app_state)
        clock.advance(ABANDONED_S)
        assert (await sweep_once(app_state)).held == "not_serving"
        assert (await reap_once(app_state)).expired == 0
        for _ in range(int(ABANDONED_CONFIRM_S // 5)):
            clock.advance(5)
            assert (await sweep_once(app_state)).held == "not_serving"
            assert (await reap_once(app_state)).expired == 0
        clock.advance(5)
        with info_logs() as logs:
            report = await sweep_once(app_state)
            assert (report.held, report.to_unhealthy, report.to_dead) == (None, 1, 1)
            assert (await reap_once(app_state)).expired == 1
            clock.advance(5)
            await sweep_once(app_state)
            clock.advance(5)
            await mark(app_state)  # an API process marks again
            assert (await sweep_once(app_state)).held == "resumed"
        # Said once per loop by the process, however many reads find the marks abandoned, and
        # once as they are recent again (here the sweeper's read; the reaper reads no more).
        assert [(e["event"], e["loop"]) for e in logs if e["event"].startswith("serving_marks")] == [
            ("serving_marks_abandoned", "liveness_sweeper"),
            ("serving_marks_abandoned", "lease_reaper"),
            ("serving_marks_recent", "liveness_sweeper"),
        ]
        async with app_state.sessionmaker() as session:
            status = await session.scalar(select(Node.status).where(Node.id == w.node_id))
        assert status == "dead"


async def test_abandoned_marks_stop_holding_a_sweeper_whose_interval_is_over_a_minute(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    """The confirmation counted only reads at most a minute apart: a sweeper ticking every 2
    minutes started it again at every read and held for ever."""
    hb = app_state.settings.heartbeat.model_copy(update={"sweep_interval_s": 120.0})
    slow = dataclasses.replace(app_state, settings=app_state.settings.model_copy(update={"heartbeat": hb}))
    async with pool_setup(app, slow, workers=1, lease_duration_s=60) as s:
        w = s.workers[0]
        await s.enqueue([task()])
        await w.claim(s.pool_id)
        await mark(slow)
        clock.advance(ABANDONED_S + 1)
        held = []
        for _ in range(8):  # 16 minutes of sweeps past the hour
            clock.advance(120)
            held.append((await sweep_once(slow)).held)
        assert held[:2] == ["not_serving"] * 2 and held[-1] is None, held
        async with slow.sessionmaker() as session:
            assert await session.scalar(select(Node.status).where(Node.id == w.node_id)) == "dead"


@pytest.mark.parametrize("outage_s", [ABANDONED_S - 600, ABANDONED_S + 600])
async def test_an_outage_of_the_database_of_any_length_marks_no_node_dead_at_the_return(
    app: Any, app_state: Any, clock: FakeClock, outage_s: float
) -> None:
    """Nothing ticks or marks while the database is down. At the return the loops' first ticks
    may come before the first mark: past an hour they took the marks as abandoned and judged
    the node, silent through the outage, as stopped (dead, its lease expired)."""
    async with pool_setup(app, app_state, workers=1, lease_duration_s=600) as s:
        w = s.workers[0]
        await s.enqueue([task()])
        lease = (await w.claim(s.pool_id)).json()["leases"][0]
        assert (await w.beat([lease["assignment_id"]])).status_code == 200
        await mark(app_state)
        clock.advance(outage_s)
        for _ in range(3):  # the marks loop is late: 10 s of the other loops' ticks first
            sweep, reap = await sweep_once(app_state), await reap_once(app_state)
            assert (sweep.held, sweep.to_dead, reap.expired) == ("not_serving", 0, 0)
            clock.advance(5)
        await mark(app_state)
        assert (await sweep_once(app_state)).to_dead == 0
        async with app_state.sessionmaker() as session:
            node = await session.scalar(select(Node.status).where(Node.id == w.node_id))
            status = await session.scalar(
                select(Assignment.status).where(Assignment.id == lease["assignment_id"])
            )
        assert (node, status) == ("healthy", "active")


async def test_a_node_that_dies_after_an_outage_keeps_its_last_heartbeat(
    settings: Settings, clock: FakeClock
) -> None:
    """After a 150 s outage a silent node dies the dead threshold after the return, over three
    minutes after its last beat: its hash in the hot store (kept twice the dead threshold) had
    expired, nothing was copied into SQL, and its view said last_heartbeat_at null for good."""
    store = MemoryHotStore(monotonic=clock.monotonic)  # TTLs on the test's clock, as Redis's
    app = create_app(settings, clock=clock, hot_store=store, serving_marks=False, close_scoring=False)
    gone = new_contributor()
    async with (
        LifespanManager(app) as manager,
        httpx.AsyncClient(
            transport=httpx.ASGITransport(app=manager.app), base_url="http://testserver"
        ) as client,
    ):
        state = app.state.orch
        await gone.register(client)
        await gone.beat(client)
        beat_at = clock.utcnow()
        await mark(state)
        clock.advance(150)  # the outage
        for _ in range(21):  # 105 s of service after the return
            await mark(state)
            await sweep_once(state)
            clock.advance(5)
        async with state.sessionmaker() as session:
            node = (await session.execute(select(Node).where(Node.id == gone.node_id))).scalar_one()
        assert node.status == "dead"
        assert (
            node.last_heartbeat_at is not None and abs((node.last_heartbeat_at - beat_at).total_seconds()) < 1
        )


class OffsetClock(SystemClock):
    """The system's clock, set ``offset`` seconds off."""

    def __init__(self, offset: float) -> None:
        self.offset = offset

    def now(self) -> float:
        return super().now() + self.offset

    def utcnow(self) -> dt.datetime:
        return super().utcnow() + dt.timedelta(seconds=self.offset)


@postgres_only
async def test_a_process_whose_clock_is_off_from_the_databases_says_so(app_state: Any) -> None:
    """A sweeper whose clock runs 15 s ahead of the API processes' holds for ever (every mark
    looks stale): each mark and each sweep compares its clock with the database server's."""
    ahead = dataclasses.replace(app_state, clock=OffsetClock(30.0))
    with info_logs() as logs:
        assert await mark_serving(ahead)
        exported = REGISTRY.get_sample_value("orchestrator_clock_offset_seconds")
        assert exported is not None and round(exported) == 30  # for the alert rule
        ahead.clock.offset = 0.0  # set right
        assert await mark_serving(ahead)
        behind = dataclasses.replace(app_state, clock=OffsetClock(-20.0))
        await sweep_once(behind)
    said = [(e["event"], round(e["offset_s"])) for e in logs if e["event"].startswith("clock_")]
    assert said == [("clock_skew", 30), ("clock_agrees", 0), ("clock_skew", -20)], said
    async with app_state.sessionmaker() as session:
        offset = await check_clock(dataclasses.replace(app_state, clock=SystemClock()), session)
    assert offset is not None and abs(offset) < 1  # the tests' host and its database agree


async def test_a_clock_is_compared_only_with_a_database_on_another_host(
    app_state: Any, database_url: str
) -> None:
    """SQLite is a file on this host: there is no other clock to compare with."""
    if database_url.startswith("postgresql"):
        pytest.skip("the PostgreSQL case is the test above")
    async with app_state.sessionmaker() as session:
        assert await check_clock(dataclasses.replace(app_state, clock=OffsetClock(30.0)), session) is None


async def _lease_status(app_state: Any, assignment_id: str) -> str:
    async with app_state.sessionmaker() as session:
        row = await session.get(Assignment, assignment_id)
        assert row is not None
        return row.status


@pytest.mark.parametrize(
    ("marking", "ended_as"),
    [(True, "released"), (False, "expired")],
    ids=["the route marks first", "a process that does not mark"],
)
@pytest.mark.parametrize("action", ["eject", "ban", "leave"])
async def test_a_node_that_leaves_at_the_return_from_an_outage_keeps_no_live_lease(
    app: Any, app_state: Any, clock: FakeClock, action: str, marking: bool, ended_as: str
) -> None:
    """A 60 s lease, a 120 s outage (no API process marked; the reaper held off), and at the
    return the node is ejected, banned or leaves before the marks loop's next tick. Ending the
    membership gave back only the leases whose deadline was still ahead and left this one
    active "for the reaper"; the mark then gave it the outage's length back, and the node, no
    longer in the pool, held a live lease: its result was taken and paid, and after an unban its
    beats kept the lease. Now the routes that end memberships write the mark first (the lease,
    live again, is given back), and a lease still overdue when a membership ends (the verifier's
    ejection, in a process that writes no marks) expires then."""
    app_state.marking = marking
    async with pool_setup(app, app_state, workers=1, lease_duration_s=60) as s:
        [w] = s.workers
        await s.enqueue([task()])
        [lease] = (await w.claim(s.pool_id)).json()["leases"]
        await mark(app_state)
        clock.advance(121)  # the outage, then back
        if action == "eject":
            url = f"/v1/admin/pools/{s.pool_id}/members/{w.node_id}/eject"
            r = await s.admin.post(url, json={"reason": "cheating"}, headers=s.headers)
        elif action == "ban":
            url = f"/v1/admin/nodes/{w.node_id}/ban"
            r = await s.admin.post(url, json={"reason": "sybil"}, headers=s.admin_headers)
        else:
            r = await w.client.post(f"/v1/pools/{s.pool_id}/leave", auth=w.contributor.node_auth)
        assert r.status_code == 200, r.text
        await mark(app_state)  # the marks loop's next tick
        assert await _lease_status(app_state, lease["assignment_id"]) == ended_as
        if action == "ban":
            r = await s.admin.post(f"/v1/admin/nodes/{w.node_id}/unban", headers=s.admin_headers)
            assert r.status_code == 200, r.text
            assert (await w.beat([lease["assignment_id"]])).json()["drop_leases"] == [lease["assignment_id"]]
        r = await w.submit(lease)
        assert r.status_code in (403, 409), r.text
        assert await _lease_status(app_state, lease["assignment_id"]) == ended_as
