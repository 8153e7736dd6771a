"""Claims: atomic leases, placement rules, caps and every no-work reason."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
from sqlalchemy import func, select, text

from orchestrator.core.keys import generate_key
from orchestrator.tasks.models import Assignment
from tests.conftest import postgres_only, problem
from tests.tasks_helpers import pool_setup, task
from tests.waits import until_waiting


async def test_a_claim_returns_a_lease_without_the_verification_spec(app: Any, app_state: Any) -> None:
    async with pool_setup(app, app_state, workers=1, step=7) as s:
        await s.enqueue([task("What is 6*7?", n=4, metadata={"source": "gsm8k"})])
        r = await s.workers[0].claim(s.pool_id, max_tasks=5)
        assert r.status_code == 200
        body = r.json()
        assert body["reason"] is None and len(body["leases"]) == 1
        lease = body["leases"][0]
        assert lease["assignment_id"].startswith("asg_")
        assert lease["fencing_token"] == 1
        assert lease["policy"] == {"step": 7, "uri": "s3://ckpt/step-7", "sha256": "a" * 64}
        assert lease["task"]["prompt"] == "What is 6*7?"
        assert lease["task"]["sampling"]["n"] == 4 and lease["task"]["metadata"] == {"source": "gsm8k"}
        assert "verification" not in lease["task"] and "expected_answer" not in r.text
        assert isinstance(lease["seed"], int)


async def test_a_number_field_takes_a_json_number_only(app: Any, app_state: Any) -> None:
    """pydantic reads true as 1 and "5" as 5: a claim with max_tasks true leased a task, and a
    task enqueued with "temperature": "0.5" was queued. Both are 422 now, naming the field, and
    change nothing."""
    async with pool_setup(app, app_state, workers=1) as s:
        await s.enqueue([task()], key="one")
        w = s.workers[0]
        for bad, kind in ((True, "true or false"), ("1", "a string")):
            r = await w.client.post(
                "/v1/assignments/claim",
                json={"pool_id": s.pool_id, "max_tasks": bad},
                auth=w.contributor.node_auth,
            )
            body = problem(r, 422, "validation_failed")
            assert any(
                e["loc"][-1] == "max_tasks" and f"must be a JSON number, not {kind}" in e["msg"]
                for e in body["errors"]
            ), body
        r = await s.enqueue([task(sampling={"temperature": "0.5", "max_tokens": 8})], key="text")
        assert r.status_code == 422 and "temperature" in r.text, r.text
        async with app_state.sessionmaker() as session:
            assert await session.scalar(select(func.count()).select_from(Assignment)) == 0
        leases = (await w.claim(s.pool_id, max_tasks=4)).json()["leases"]  # still there, as it was
        assert [lease["task"]["sampling"]["temperature"] for lease in leases] == [0.6]


async def test_a_pending_member_is_told_to_claim_again_within_seconds(app: Any, app_state: Any) -> None:
    """An approval pool's operator may approve a pending join at any moment: the claim tells the
    node to ask again in 5 s, as an idle member's no_tasks does, so its work starts within
    seconds of the approval (it said 60 s, and the worker waited them out). A node that is no
    member (it left) is still told 60 s: no work comes until it joins again."""
    async with pool_setup(app, app_state, workers=1) as s:
        r = await s.admin.patch(
            f"/v1/admin/pools/{s.pool_id}", json={"admission": "approval"}, headers=s.headers
        )
        assert r.status_code == 200, r.text
        await s.enqueue([task()])
        pending = await s.add_worker()
        r = await pending.claim(s.pool_id)
        assert r.status_code == 200, r.text
        assert (r.json()["reason"], r.json()["leases"]) == ("not_a_member", [])
        assert "approve" in r.json()["detail"]
        assert r.json()["retry_after_s"] == 5 and r.headers["retry-after"] == "5"
        w = s.workers[0]
        await w.client.post(f"/v1/pools/{s.pool_id}/leave", json={}, auth=w.contributor.node_auth)
        r = await w.claim(s.pool_id)
        assert r.json()["reason"] == "not_a_member" and r.headers["retry-after"] == "60"
        r = await s.admin.post(
            f"/v1/admin/pools/{s.pool_id}/members/{pending.node_id}/approve", headers=s.headers
        )
        assert r.status_code == 200, r.text
        assert len((await pending.claim(s.pool_id)).json()["leases"]) == 1


async def test_no_work_reasons(app: Any, app_state: Any, clock: Any) -> None:
    async with pool_setup(app, app_state, workers=1, step=None, max_leases_per_node=1) as s:
        w = s.workers[0]

        async def reason() -> str:
            r = await w.claim(s.pool_id)
            assert r.status_code == 200
            assert r.json()["leases"] == []
            assert int(r.headers["retry-after"]) == r.json()["retry_after_s"] > 0
            return str(r.json()["reason"])

        assert await reason() == "no_policy"
        await s.publish(1)
        assert await reason() == "no_tasks"
        await s.enqueue([task(), task("other")])
        assert len((await w.claim(s.pool_id)).json()["leases"]) == 1
        assert await reason() == "lease_cap_reached"
        await s.admin.post(f"/v1/admin/pools/{s.pool_id}/pause", headers=s.headers)
        assert await reason() == "pool_paused"
        await s.admin.post(f"/v1/admin/pools/{s.pool_id}/resume", headers=s.headers)
        clock.advance(31)
        from orchestrator.liveness.service import sweep_once

        await sweep_once(app_state)
        assert await reason() == "node_unhealthy"
        stranger = await s.add_worker()
        await stranger.client.post(
            f"/v1/pools/{s.pool_id}/leave", json={}, auth=stranger.contributor.node_auth
        )
        r = await stranger.claim(s.pool_id)
        assert r.json()["reason"] == "not_a_member"
        await s.admin.post(f"/v1/admin/pools/{s.pool_id}/pause", headers=s.headers)
        assert (
            await s.admin.post(f"/v1/admin/pools/{s.pool_id}/complete", headers=s.headers)
        ).status_code == 200
        await w.beat()
        assert await reason() == "pool_not_active"
        problem(await w.claim("pool_doesnotexist00"), 404, "pool_not_found")
        # A NUL, which PostgreSQL cannot compare, is a body that does not validate (was a 500).
        problem(await w.claim("pool_\x00"), 422, "validation_failed")


async def test_replicas_go_to_different_providers_and_ips(app: Any, app_state: Any) -> None:
    async with pool_setup(app, app_state, replication_factor=3) as s:
        shared_provider = generate_key()
        a = await s.add_worker(provider_key=shared_provider)
        a_twin = await s.add_worker(provider_key=shared_provider)  # same provider as a
        b = await s.add_worker(ip="10.200.0.1")
        b_same_ip = await s.add_worker(ip="10.200.0.1")  # same IP as b
        c = await s.add_worker()
        await s.enqueue([task()])
        got = {}
        for w in (a, a_twin, b, b_same_ip, c):
            got[w.node_id] = len((await w.claim(s.pool_id)).json()["leases"])
        assert got[a.node_id] == 1 and got[a_twin.node_id] == 0
        assert got[b.node_id] == 1 and got[b_same_ip.node_id] == 0
        assert got[c.node_id] == 1
        # A node never gets a second replica of the same task.
        more = await s.add_worker()
        assert len((await more.claim(s.pool_id, max_tasks=3)).json()["leases"]) == 0


async def test_the_ip_rule_takes_an_ipv6_64_as_one_address_and_mapped_ipv4_as_ipv4(
    app: Any, app_state: Any
) -> None:
    async with pool_setup(app, app_state, replication_factor=2) as s:
        v6 = await s.add_worker(ip="2001:db8:1:2::10")
        v6_same_64 = await s.add_worker(ip="2001:db8:1:2:ffff::1")  # another address, same /64
        v6_other_64 = await s.add_worker(ip="2001:db8:1:3::10")
        await s.enqueue([task("v6")])
        got = [len((await w.claim(s.pool_id)).json()["leases"]) for w in (v6, v6_same_64, v6_other_64)]
        assert got == [1, 0, 1]

        v4 = await s.add_worker(ip="192.0.2.77")
        v4_mapped = await s.add_worker(ip="::ffff:192.0.2.77")  # the same host over IPv6
        await s.enqueue([task("v4")], key="batch-2")
        assert len((await v4.claim(s.pool_id)).json()["leases"]) == 1
        assert (await v4_mapped.claim(s.pool_id)).json()["reason"] == "no_tasks"
        node = (await s.admin.get(f"/v1/admin/nodes/{v6_same_64.node_id}", headers=s.admin_headers)).json()
        assert node["ip_address"] == "2001:db8:1:2::/64"


async def test_a_node_never_gets_two_replicas_of_one_task_in_one_claim(app: Any, app_state: Any) -> None:
    async with pool_setup(app, app_state, workers=1, replication_factor=3, max_leases_per_node=10) as s:
        await s.enqueue([task("one"), task("two")])
        leases = (await s.workers[0].claim(s.pool_id, max_tasks=10)).json()["leases"]
        assert sorted(lease["task"]["task_id"] for lease in leases) == sorted(
            {le["task"]["task_id"] for le in leases}
        )
        assert len(leases) == 2


async def test_higher_priority_is_leased_first(app: Any, app_state: Any) -> None:
    async with pool_setup(app, app_state, workers=1, max_leases_per_node=1) as s:
        await s.enqueue([task("low", priority=-5), task("high", priority=9), task("mid")])
        lease = (await s.workers[0].claim(s.pool_id)).json()["leases"][0]
        assert lease["task"]["prompt"] == "high"


async def test_concurrent_claimers_never_share_a_replica(app: Any, app_state: Any) -> None:
    workers = 12 if not _is_postgres(app_state) else 50
    async with pool_setup(app, app_state, replication_factor=1, max_leases_per_node=100) as s:
        for _ in range(workers):
            await s.add_worker()
        total = 600
        assert (
            await s.enqueue(
                [{"problem_ref": f"p/{i}", "sampling": {"max_tokens": 8}} for i in range(total)], key="many"
            )
        ).status_code == 201

        async def drain(w: Any) -> list[str]:
            got: list[str] = []
            while True:
                r = await w.claim(s.pool_id, max_tasks=25)
                leases = r.json()["leases"]
                if not leases:
                    assert r.json()["reason"] == "no_tasks"
                    return got
                got += [lease["assignment_id"] for lease in leases]
                for lease in leases:
                    assert (await w.submit(lease)).status_code == 201

        results = await asyncio.gather(*(drain(w) for w in s.workers))
        flat = [a for r in results for a in r]
        assert len(flat) == len(set(flat)) == total
        async with app_state.sessionmaker() as session:
            per_replica = (
                await session.execute(
                    select(Assignment.replica_id, func.count())
                    .group_by(Assignment.replica_id)
                    .having(func.count() > 1)
                )
            ).all()
        assert per_replica == []


def _is_postgres(app_state: Any) -> bool:
    return bool(app_state.engine.dialect.name == "postgresql")


# A claim whose pick started before a concurrent claim of the same task committed, and which
# reaches the task only after that commit: the task's row lock is free again by then, so SKIP
# LOCKED does not skip it. test_claim_delay() holds a claim in its scan (in a session that sets
# test.claim_held) on an advisory lock that the test holds (_claims_held) until it lets it go.
HOLD_KEY = 7300001
_DELAY_FN = f"""
CREATE OR REPLACE FUNCTION test_claim_delay() RETURNS boolean LANGUAGE plpgsql VOLATILE AS $$
BEGIN
  IF current_setting('test.claim_held', true) = 'on' THEN
    PERFORM pg_advisory_xact_lock_shared({HOLD_KEY});
  END IF;
  RETURN true;
END $$;
"""


@asynccontextmanager
async def _claims_held(app_state: Any) -> AsyncIterator[None]:
    """While inside, a claim whose session sets ``test.claim_held`` waits in its scan."""
    async with app_state.sessionmaker() as holder, holder.begin():
        await holder.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": HOLD_KEY})
        yield


async def _held_claim(app_state: Any, clock: Any, node_id: str, pool_id: str) -> Any:
    from orchestrator.tasks import service

    async with app_state.sessionmaker() as session, session.begin():
        await session.execute(text("SET LOCAL test.claim_held = 'on'"))
        return await service.claim(
            session, node_id, pool_id, 1, now=clock.utcnow(), ref_key=app_state.settings.seed_key
        )


async def _claim_behind_a_concurrent_claim(
    app_state: Any, clock: Any, monkeypatch: Any, s: Any, slow: Any, fast: Any
) -> tuple[list[Any], list[Any]]:
    from orchestrator.tasks import service

    monkeypatch.setattr(service, "_MAY_TAKE", service._MAY_TAKE + " AND test_claim_delay()")
    service._pick_statement.cache_clear()
    try:
        async with app_state.sessionmaker() as session, session.begin():
            await session.execute(text(_DELAY_FN))
        async with _claims_held(app_state):
            late = asyncio.create_task(_held_claim(app_state, clock, slow.node_id, s.pool_id))
            await until_waiting(app_state, 1, late, on="advisory")  # it has its snapshot and is scanning
            async with app_state.sessionmaker() as session, session.begin():
                early = await service.claim(
                    session,
                    fast.node_id,
                    s.pool_id,
                    1,
                    now=clock.utcnow(),
                    ref_key=app_state.settings.seed_key,
                )
        await late
    finally:
        monkeypatch.undo()
        service._pick_statement.cache_clear()
    return late.result().leases, early.leases


async def _replica_index(app_state: Any, lease: Any) -> int:
    """Which replica of its task a lease is (the server knows; the node is not told)."""
    async with app_state.sessionmaker() as session:
        index = await session.scalar(
            text(
                "SELECT r.replica_index FROM assignments a JOIN task_replicas r ON r.id = a.replica_id"
                " WHERE a.id = :id"
            ),
            {"id": lease.assignment_id},
        )
    return int(index)


@postgres_only
async def test_a_claim_that_reaches_a_task_after_a_concurrent_claim_takes_the_next_replica(
    app: Any, app_state: Any, clock: Any, monkeypatch: Any
) -> None:
    async with pool_setup(app, app_state, replication_factor=2) as s:
        slow, fast = await s.add_worker(ip="198.51.100.1"), await s.add_worker(ip="198.51.100.2")
        assert (await s.enqueue([task("race")])).status_code == 201
        late, early = await _claim_behind_a_concurrent_claim(app_state, clock, monkeypatch, s, slow, fast)
        assert [(await _replica_index(app_state, x), x.fencing_token) for x in early] == [(0, 1)]
        assert [(await _replica_index(app_state, x), x.fencing_token) for x in late] == [(1, 1)]
        async with app_state.sessionmaker() as session:
            replicas = (
                await session.execute(
                    text("SELECT replica_index, status FROM task_replicas ORDER BY replica_index")
                )
            ).all()
            available = await session.scalar(text("SELECT available_replicas FROM tasks"))
        assert [tuple(r) for r in replicas] == [(0, "leased"), (1, "leased")] and available == 0


@postgres_only
async def test_a_claim_that_reaches_a_task_after_a_concurrent_claim_keeps_the_placement_rule_and_looks_again(
    app: Any, app_state: Any, clock: Any, monkeypatch: Any
) -> None:
    async with pool_setup(app, app_state, replication_factor=2) as s:
        slow, fast = await s.add_worker(ip="198.51.100.1"), await s.add_worker(ip="198.51.100.1")
        assert (await s.enqueue([task("race"), task("next")])).status_code == 201
        late, early = await _claim_behind_a_concurrent_claim(app_state, clock, monkeypatch, s, slow, fast)
        # Same IP: the first task's second replica may not go to the slow claimer, which looks
        # again and takes the next task instead of answering no_tasks.
        assert [(x.task.prompt, await _replica_index(app_state, x)) for x in early] == [("race", 0)]
        assert [(x.task.prompt, await _replica_index(app_state, x)) for x in late] == [("next", 0)]


@postgres_only
async def test_fifty_concurrent_claimers_on_postgres_lease_each_replica_once(
    app: Any, app_state: Any
) -> None:
    async with pool_setup(app, app_state, replication_factor=2, max_leases_per_node=1000) as s:
        for _ in range(50):
            await s.add_worker()
        await s.enqueue(
            [{"problem_ref": f"q/{i}", "sampling": {"max_tokens": 8}} for i in range(1500)], key="r2"
        )

        async def grab(w: Any) -> list[tuple[str, int, str]]:
            out = []
            for _ in range(400):
                leases = (await w.claim(s.pool_id, max_tasks=5)).json()["leases"]
                if not leases:
                    break
                # A replica by its seed (one per task and replica): the node is not told its index.
                out += [(lease["assignment_id"], lease["seed"], w.node_id) for lease in leases]
            return out

        results = await asyncio.gather(*(grab(w) for w in s.workers))
        # The tasks by their ids (a node's lease names its task by the node's own reference).
        async with app_state.sessionmaker() as session:
            task_of = dict((await session.execute(select(Assignment.id, Assignment.task_id))).all())
        leased = [(task_of[a], seed, node) for r in results for a, seed, node in r]
        # Every replica of every task leased exactly once, to two different nodes per task.
        assert len(leased) == 3000
        assert len({(task_id, replica) for task_id, replica, _ in leased}) == 3000
        per_task: dict[int, set[str]] = {}
        for task_id, _, node in leased:
            per_task.setdefault(task_id, set()).add(node)
        assert all(len(nodes) == 2 for nodes in per_task.values())
        async with app_state.sessionmaker() as session:
            double = await session.scalar(
                text(
                    "SELECT count(*) FROM (SELECT replica_id FROM assignments WHERE status = 'active' "
                    "GROUP BY replica_id HAVING count(*) > 1) d"
                )
            )
            left = await session.scalar(
                text(
                    "SELECT count(*) FROM task_replicas WHERE status <> 'leased' OR current_assignment_id IS NULL"
                )
            )
        assert (double, left) == (0, 0)


async def _leave(
    app_state: Any, s: Any, w: Any, clock: Any, *, meanwhile: Callable[[], Awaitable[None]] | None = None
) -> None:
    """``w`` leaves the pool; ``meanwhile`` runs once it has, before it commits."""
    from orchestrator.identity import repository as identity
    from orchestrator.pools import service as pools

    async with app_state.sessionmaker() as session, session.begin():
        node = await identity.get_node(session, w.node_id)
        assert node is not None
        await pools.leave(session, s.pool_id, node, now=clock.utcnow())
        if meanwhile is not None:
            await meanwhile()  # still committing


async def _live_leases(app_state: Any, node_id: str) -> list[str]:
    async with app_state.sessionmaker() as session:
        rows = await session.execute(
            select(Assignment.id).where(Assignment.node_id == node_id, Assignment.status == "active")
        )
        return list(rows.scalars())


@postgres_only
async def test_a_claim_waits_for_a_leave_that_is_committing_and_then_finds_no_membership(
    app: Any, app_state: Any, clock: Any
) -> None:
    from orchestrator.tasks import service

    async with pool_setup(app, app_state, workers=1) as s:
        w = s.workers[0]
        assert (await s.enqueue([task("x")])).status_code == 201

        left = asyncio.Event()

        async def claim_meanwhile() -> Any:
            await left.wait()  # the leave has ended the membership and not yet committed
            async with app_state.sessionmaker() as session, session.begin():
                return await service.claim(
                    session, w.node_id, s.pool_id, 1, now=clock.utcnow(), ref_key=app_state.settings.seed_key
                )

        claiming = asyncio.create_task(claim_meanwhile())

        async def until_the_claim_waits() -> None:
            left.set()
            await until_waiting(app_state, 1, claiming, on="row")

        await _leave(app_state, s, w, clock, meanwhile=until_the_claim_waits)
        out = await claiming
        assert (out.reason, out.leases) == ("not_a_member", [])
        assert await _live_leases(app_state, w.node_id) == []


async def _claim_racing(
    app_state: Any, clock: Any, monkeypatch: Any, s: Any, w: Any, other: Callable[[], Awaitable[Any]]
) -> tuple[Any, Any]:
    """A claim of ``w`` that has read its membership as active and is scanning for tasks when
    ``other`` starts, which must wait for the claim (on a row lock). Returns both outcomes."""
    from orchestrator.tasks import service

    assert (await s.enqueue([task("x")])).status_code == 201
    async with app_state.sessionmaker() as session, session.begin():
        await session.execute(text(_DELAY_FN))
    monkeypatch.setattr(service, "_MAY_TAKE", service._MAY_TAKE + " AND test_claim_delay()")
    service._pick_statement.cache_clear()
    try:
        async with _claims_held(app_state):
            claiming = asyncio.create_task(_held_claim(app_state, clock, w.node_id, s.pool_id))
            # The claim has read the membership as active and is scanning for tasks.
            await until_waiting(app_state, 1, claiming, on="advisory")
            racing = asyncio.create_task(other())
            await until_waiting(app_state, 1, racing, on="row")  # it waits for the claim
        return await claiming, await racing
    finally:
        monkeypatch.undo()
        service._pick_statement.cache_clear()


async def _given_back(app_state: Any, w: Any, out: Any) -> None:
    """The claim's one lease was given back: nothing live, the next heartbeat says to drop it,
    and a result for it is not recorded."""
    [lease] = out.leases
    assert await _live_leases(app_state, w.node_id) == []
    assert (await w.beat([lease.assignment_id])).json()["drop_leases"] == [lease.assignment_id]
    problem(await w.submit(lease.model_dump(mode="json")), 409, "lease_expired")


@postgres_only
async def test_a_leave_waits_for_a_claim_that_read_the_membership_and_gives_its_lease_back(
    app: Any, app_state: Any, clock: Any, monkeypatch: Any
) -> None:
    async with pool_setup(app, app_state, workers=1) as s:
        w = s.workers[0]
        out, _ = await _claim_racing(
            app_state, clock, monkeypatch, s, w, lambda: _leave(app_state, s, w, clock)
        )
        await _given_back(app_state, w, out)


#: An operator's ways of ending a node's membership: (path, body) for the pool and the worker.
REMOVALS: dict[str, Callable[[Any, Any], tuple[str, dict[str, str]]]] = {
    "eject": lambda s, w: (f"/v1/admin/pools/{s.pool_id}/members/{w.node_id}/eject", {"reason": "cheat"}),
    "blacklist": lambda s, w: (
        f"/v1/admin/pools/{s.pool_id}/blacklist",
        {"provider_id": w.contributor.provider_id, "reason": "sybil"},
    ),
}


@postgres_only
@pytest.mark.parametrize("removal", sorted(REMOVALS))
async def test_an_operator_removing_a_node_waits_for_its_claim_and_gives_its_lease_back(
    app: Any, app_state: Any, clock: Any, monkeypatch: Any, removal: str
) -> None:
    """As a leave does. The claim's lease, inserted after the removal began to wait for it, has
    its foreign key checked on the pool, which the removal holds locked (FOR NO KEY UPDATE): the
    check does not wait for the removal, so the two do not deadlock."""
    async with pool_setup(app, app_state, workers=1) as s:
        w = s.workers[0]
        path, body = REMOVALS[removal](s, w)
        out, r = await _claim_racing(
            app_state, clock, monkeypatch, s, w, lambda: s.admin.post(path, json=body, headers=s.headers)
        )
        assert r.status_code in (200, 201), r.text
        await _given_back(app_state, w, out)


@postgres_only
async def test_a_claim_does_not_wait_for_a_policy_being_published(app: Any, app_state: Any) -> None:
    """A publish holds the pool locked until it commits. A claim meanwhile leases at once, with
    the policy committed before it (its lease's foreign key check on the pool does not wait)."""
    from api_schemas.tasks import PolicyIn
    from orchestrator.admin.tokens import Principal, Role
    from orchestrator.tasks import service
    from orchestrator.tasks.access import pool_for

    async with pool_setup(app, app_state, workers=1, step=7) as s:
        assert (await s.enqueue([task("x")])).status_code == 201
        admin = Principal(token_id="tok_test_admin", name="admin", role=Role.admin)
        async with app_state.sessionmaker() as session, session.begin():
            pool = await pool_for(session, admin, s.pool_id, for_update=True)
            step_8 = PolicyIn(step=8, uri="s3://ckpt/step-8", sha256="a" * 64, size=1024)  # as s.publish
            await service.publish_policy(session, pool, step_8, admin.token_id)
            claiming = asyncio.create_task(s.workers[0].claim(s.pool_id))
            await until_waiting(app_state, 1, claiming, on="row")  # returns once it is done
            assert claiming.done(), "the claim must not wait for the publish to commit"
        [lease] = claiming.result().json()["leases"]
        assert lease["policy"]["step"] == 7
        assert (await s.publish(8)).status_code == 200  # the same version again: it was published
