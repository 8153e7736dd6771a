"""The hot paths stay small: a claim and a result run a fixed handful of SQL statements whatever
the batch size, a steady heartbeat writes no SQL, and the signer checks (401/403) hold on them."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from sqlalchemy import bindparam, event, text

from orchestrator.core.db import UTCDateTime
from orchestrator.tasks.service import _pick_statement
from tests.conftest import new_contributor, postgres_only, problem
from tests.tasks_helpers import pool_setup, result_body, task


@asynccontextmanager
async def sql_log(app_state: Any) -> AsyncIterator[list[str]]:
    """The SQL statements the server sends while the block runs (transaction control excluded)."""
    statements: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        verb = statement.lstrip().split(None, 1)[0].upper()
        if verb not in ("BEGIN", "COMMIT", "ROLLBACK", "SAVEPOINT", "RELEASE"):
            statements.append(statement)

    engine = app_state.engine.sync_engine
    event.listen(engine, "before_cursor_execute", record)
    try:
        yield statements
    finally:
        event.remove(engine, "before_cursor_execute", record)


def spent_nonces(app_state: Any, statements: list[str]) -> list[str]:
    """Take the statements on ``spent_nonces`` out of ``statements`` (they are the signed
    request's nonce, not its work) and check them: with a hot store of the process's own, one
    claim of the nonce (and perhaps one pruning of expired ones); with Redis, none."""
    nonce = [st for st in statements if "spent_nonces" in st]
    statements[:] = [st for st in statements if "spent_nonces" not in st]
    claims = [st for st in nonce if st.lstrip().upper().startswith("INSERT")]
    assert len(claims) == (0 if app_state.hot_store.shared_across_processes else 1), nonce
    return nonce


def writes(statements: list[str]) -> list[str]:
    return [s for s in statements if s.lstrip().split(None, 1)[0].upper() in ("INSERT", "UPDATE", "DELETE")]


async def test_a_claim_runs_the_same_few_statements_for_one_task_or_ten(app: Any, app_state: Any) -> None:
    async with pool_setup(app, app_state, workers=2, max_leases_per_node=20) as s:
        await s.enqueue([task(f"q{i}") for i in range(30)])
        one, ten = s.workers
        async with sql_log(app_state) as single:
            r = await one.claim(s.pool_id, max_tasks=1)
        assert len(r.json()["leases"]) == 1
        spent_nonces(app_state, single)
        async with sql_log(app_state) as batch:
            r = await ten.claim(s.pool_id, max_tasks=10)
        assert len(r.json()["leases"]) == 10
        spent_nonces(app_state, batch)
        # One read of node, pool, membership, policy and held leases; one locked pick with the
        # replicas and payloads; INSERT assignments; UPDATE replicas; UPDATE tasks. PostgreSQL
        # first locks the signer's row (one node's claims queue up; its lease cap holds), picks
        # in two steps (lock the tasks, then choose their replicas with a fresh snapshot), and
        # makes the three writes one statement of data-modifying CTEs.
        if app_state.engine.dialect.name == "postgresql":
            assert len(single) == len(batch) == 5, batch
            [fused] = [st for st in batch if st.lstrip().startswith("WITH v AS")]
            for write in ("INSERT INTO assignments", "UPDATE task_replicas", "UPDATE tasks"):
                assert write in fused, write
        else:
            assert len(single) == len(batch) == 5, batch
            assert len(writes(batch)) == 3


async def test_a_result_runs_one_read_and_five_writes(app: Any, app_state: Any) -> None:
    async with pool_setup(app, app_state, workers=1) as s:
        await s.enqueue([task()])
        w = s.workers[0]
        lease = (await w.claim(s.pool_id)).json()["leases"][0]
        async with sql_log(app_state) as statements:
            r = await w.submit(lease)
        assert r.status_code == 201, r.text
        spent_nonces(app_state, statements)
        if app_state.engine.dialect.name == "postgresql":
            # The five writes are one statement of data-modifying CTEs: one round trip.
            assert len(statements) == 2, statements
            [fused] = [st for st in statements if st.lstrip().startswith("WITH")]
            for write in (
                "INSERT INTO submissions",
                "INSERT INTO verification_jobs",
                "UPDATE assignments SET status=",
                "UPDATE task_replicas SET status=",
                "UPDATE tasks SET status=",
            ):
                assert write in fused, write
        else:
            assert len(statements) == 6, statements
            assert len(writes(statements)) == 5
        # The replay is one read and writes nothing.
        async with sql_log(app_state) as replay:
            again = await w.submit(lease)
        assert again.status_code == 200 and again.json() == r.json()
        spent_nonces(app_state, replay)
        assert len(replay) == 1 and not writes(replay)


async def test_a_steady_heartbeat_reads_one_row_and_writes_no_sql(app: Any, app_state: Any) -> None:
    """No SQL written but, with a hot store of the process's own, the claim of its nonce."""
    async with pool_setup(app, app_state, workers=1) as s:
        w = s.workers[0]  # registered and already beating: healthy
        async with sql_log(app_state) as statements:
            r = await w.beat()
        assert r.status_code == 200 and r.json()["status"] == "healthy"
        spent_nonces(app_state, statements)
        assert len(statements) == 1 and not writes(statements)


async def test_a_heartbeat_that_extends_a_lease_reads_once_and_writes_once(
    app: Any, app_state: Any, clock: Any
) -> None:
    """The signer's row, the node's named leases, one UPDATE: telling the node each lease's
    deadline costs no statement (the read that finds the leases has their deadlines, and the
    extension writes the ones it says)."""
    async with pool_setup(app, app_state, workers=1, lease_duration_s=60) as s:
        w = s.workers[0]
        await s.enqueue([task()])
        lease = (await w.claim(s.pool_id)).json()["leases"][0]
        clock.advance(40)
        async with sql_log(app_state) as statements:
            r = await w.beat([lease["assignment_id"]])
        assert r.status_code == 200 and r.json()["drop_leases"] == []
        spent_nonces(app_state, statements)
        assert len(statements) == 3 and len(writes(statements)) == 1, statements


async def test_claims_and_results_check_the_signer(app: Any, app_state: Any) -> None:
    async with pool_setup(app, app_state, workers=2) as s:
        await s.enqueue([task(), task("other")])
        honest, banned = s.workers
        lease = (await banned.claim(s.pool_id)).json()["leases"][0]
        r = await s.admin.post(
            f"/v1/admin/nodes/{banned.node_id}/ban", json={"reason": "test"}, headers=s.admin_headers
        )
        assert r.status_code == 200
        problem(await banned.claim(s.pool_id), 403, "node_banned")
        problem(await banned.submit(lease), 403, "node_banned")
        problem(await banned.beat(), 403, "node_banned")

        # Someone else's lease: not found for this node, and nothing recorded.
        problem(await honest.submit(lease), 404, "assignment_not_found")
        # A key no node is registered with: 401 before anything else, even for a missing lease.
        stranger = new_contributor()
        problem(
            await honest.client.post(
                "/v1/assignments/claim", json={"pool_id": s.pool_id, "max_tasks": 1}, auth=stranger.node_auth
            ),
            401,
            "unknown_key",
        )
        problem(
            await honest.client.post(
                f"/v1/assignments/{lease['assignment_id']}/result",
                json=result_body(lease),
                auth=stranger.node_auth,
            ),
            401,
            "unknown_key",
        )
        problem(
            await honest.client.post(
                "/v1/assignments/asg_missing/result", json=result_body(lease), auth=stranger.node_auth
            ),
            401,
            "unknown_key",
        )
        problem(
            await honest.client.post(
                "/v1/assignments/claim",
                json={"pool_id": "pool_missing", "max_tasks": 1},
                auth=honest.contributor.node_auth,
            ),
            404,
            "pool_not_found",
        )


@postgres_only
async def test_one_nodes_concurrent_claims_never_pass_its_lease_cap(app: Any, app_state: Any) -> None:
    """The claim locks the signer's node row, so eight claims racing from one node (over eight
    connections) still leave it with exactly its cap of four leases."""
    async with pool_setup(app, app_state, workers=1, max_leases_per_node=4) as s:
        await s.enqueue([task(f"q{i}") for i in range(40)])
        w = s.workers[0]
        replies = await asyncio.gather(*(w.claim(s.pool_id, max_tasks=3) for _ in range(8)))
        assert all(r.status_code == 200 for r in replies)
        assert sum(len(r.json()["leases"]) for r in replies) == 4
        assert {r.json()["reason"] for r in replies if not r.json()["leases"]} == {"lease_cap_reached"}


_HISTORY = text(
    """
    INSERT INTO assignments (id, replica_id, task_id, pool_id, node_id, provider_id, ip_address,
                             fencing_token, policy_step, status, lease_expires_at, created_at,
                             ended_at, error)
    SELECT 'asg_h' || :status || r.id, r.id, r.task_id, t.pool_id, n.id, n.provider_id,
           n.ip_address, 9, 1, :status, now(), now(), now(), :error
      FROM task_replicas r JOIN tasks t ON t.id = r.task_id JOIN nodes n ON n.id = :node
     WHERE t.pool_id = :pool AND t.id > (SELECT min(id) + :skip FROM tasks WHERE pool_id = :pool)
    """
)


def _plan_nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    return [plan, *(n for child in plan.get("Plans", []) for n in _plan_nodes(child))]


@postgres_only
async def test_the_claims_pick_walks_the_queue_in_claim_order_and_stops_at_room(
    app: Any, app_state: Any
) -> None:
    """The pick's rule reads each candidate task's leases through an index and stops after
    ``room`` tasks. A check of the node's leases given back, written as a subquery, once made
    PostgreSQL hash the whole queue (or materialise the node's whole history) for every claim:
    20 ms a claim at 15,000 open tasks, a fourth of the benchmark's throughput."""
    async with pool_setup(app, app_state, workers=1, max_leases_per_node=100) as s:
        await s.enqueue([task(f"q{i}") for i in range(3000)])
        w = s.workers[0]
        for lease in (await w.claim(s.pool_id, max_tasks=20)).json()["leases"]:
            if int(lease["task"]["prompt"][1:]) % 2:
                assert (await w.release(lease)).status_code == 200
            else:
                assert (await w.submit(lease)).status_code == 201
        other = await s.add_worker()
        async with app_state.engine.connect() as conn:
            # A history at the scale where the plans differ: the node failed 2,000 tasks, and
            # another node answered 2,500 (tasks past the first 500, which stay the node's to take).
            for node, skip, status, error in (
                (w, 1000, "released", "engine crashed"),
                (other, 500, "submitted", None),
            ):
                await conn.execute(
                    _HISTORY,
                    {"status": status, "error": error, "node": node.node_id, "pool": s.pool_id, "skip": skip},
                )
            ip = (
                await conn.execute(text("SELECT ip_address FROM nodes WHERE id = :n"), {"n": w.node_id})
            ).scalar()
            params = {
                "pool_id": s.pool_id,
                "node_id": w.node_id,
                "provider_id": w.contributor.provider_id,
                "ip_address": ip,
                "now": dt.datetime.now(dt.UTC),
                "retake_before": dt.datetime.now(dt.UTC) - dt.timedelta(hours=1),
                "room": 4,
            }
            # Both variants of the rule: expired leases never taken back, or after a while.
            explains = []
            for retake in (False, True):
                sql = "EXPLAIN (ANALYZE, FORMAT JSON) " + _pick_statement("lock", True, retake).element.text
                names = ("now", "retake_before") if retake else ("now",)
                explains.append(text(sql).bindparams(*(bindparam(n, type_=UTCDateTime()) for n in names)))
            # Right after a bulk enqueue the statistics lag (the benchmark's case), then not.
            plans = [(await conn.execute(explain, params)).scalar_one() for explain in explains]
            await conn.execute(text("ANALYZE tasks, task_replicas, assignments"))
            plans += [(await conn.execute(explain, params)).scalar_one() for explain in explains]
            await conn.rollback()
        for plan in plans:
            nodes = _plan_nodes(plan[0]["Plan"])
            scans = {n.get("Relation Name"): n for n in nodes if "Relation Name" in n}
            assert scans["tasks"]["Node Type"] == "Index Scan" and scans["tasks"]["Actual Rows"] <= 20
            shape = [(n["Node Type"], n.get("Relation Name"), n.get("Actual Rows")) for n in nodes]
            assert all(n["Node Type"] not in ("Seq Scan", "Hash", "Materialize", "Sort") for n in nodes), (
                shape
            )
