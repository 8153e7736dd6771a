"""Alembic: the migration chain is reversible and matches the models, on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import MetaData, Table, inspect, text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import create_async_engine

from orchestrator.all_models import Base
from orchestrator.core.migrate import current_revision, downgrade, head_revision, upgrade
from tests.conftest import DATABASE_URL, IS_POSTGRES, postgres_only


async def _admin(url: str, sql: str) -> None:
    engine = create_async_engine(url, isolation_level="AUTOCOMMIT")
    try:
        async with engine.connect() as conn:
            await conn.execute(text(sql))
    finally:
        await engine.dispose()


@pytest.fixture
def scratch_url(tmp_path: Path) -> Iterator[str]:
    """An empty database of the backend under test, dropped afterwards."""
    if not IS_POSTGRES:
        yield f"sqlite+aiosqlite:///{tmp_path / 'migrations.db'}"
        return
    assert DATABASE_URL is not None
    name = f"orch_mig_{uuid.uuid4().hex[:8]}"
    base = make_url(DATABASE_URL)
    asyncio.run(_admin(base.render_as_string(hide_password=False), f'CREATE DATABASE "{name}"'))
    try:
        yield base.set(database=name).render_as_string(hide_password=False)
    finally:
        asyncio.run(
            _admin(base.render_as_string(hide_password=False), f'DROP DATABASE "{name}" WITH (FORCE)')
        )


async def _inspect(url: str) -> tuple[set[str], list[Any]]:
    engine = create_async_engine(url)
    try:
        async with engine.connect() as conn:

            def read(sync_conn: Any) -> tuple[set[str], list[Any]]:
                tables = set(inspect(sync_conn).get_table_names())
                ctx = MigrationContext.configure(
                    sync_conn, opts={"compare_type": True, "compare_server_default": True}
                )
                return tables, compare_metadata(ctx, Base.metadata)

            return await conn.run_sync(read)
    finally:
        await engine.dispose()


def test_upgrade_downgrade_upgrade_round_trip(scratch_url: str) -> None:
    upgrade(scratch_url)
    tables, _ = asyncio.run(_inspect(scratch_url))
    assert {t.name for t in Base.metadata.sorted_tables} <= tables

    downgrade(scratch_url, "base")
    tables, _ = asyncio.run(_inspect(scratch_url))
    assert tables <= {"alembic_version"}

    upgrade(scratch_url)
    tables, _ = asyncio.run(_inspect(scratch_url))
    assert {t.name for t in Base.metadata.sorted_tables} <= tables


@postgres_only
def test_processes_migrating_one_database_at_once_all_succeed(scratch_url: str) -> None:
    """Several ``serve`` processes started together each migrate first (the default): they ran
    the same DDL side by side and all but one died on a duplicate (UniqueViolationError, with a
    long traceback). They now take turns, and the later ones find the schema at head."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ORCH_", "PROMETHEUS_"))}
    env |= {"ORCH_ENV": "test", "ORCH_DB__URL": scratch_url}
    command = [sys.executable, "-m", "orchestrator.cli", "migrate"]
    runs = [
        subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for _ in range(3)
    ]
    outputs = [run.communicate(timeout=120)[0].decode() for run in runs]
    assert [run.returncode for run in runs] == [0, 0, 0], outputs
    assert current_revision(scratch_url) == head_revision()


def test_models_and_migrations_do_not_drift(scratch_url: str) -> None:
    upgrade(scratch_url)
    _, diff = asyncio.run(_inspect(scratch_url))
    assert diff == [], f"autogenerate would emit: {diff}"


# A pool as the migrations' backfill tests need it (with the token that owns it), inserted
# with Core so that it does not depend on the models' Python defaults.
POOL_ROW = {
    "id": "pool-mig",
    "name": "mig",
    "status": "active",
    "owner_token_id": "tok-mig",
    "admission": "open",
    "requirements": {},
    "min_stake_per_node": 0,
    "reward_per_sample": 1,
    "reward_hold_s": 0,
    "soft_invalid_penalty": 0,
    "fraud_slash_amount": 0,
    "strikes_before_ejection": 3,
    "strikes_before_provider_ban": 3,
    "unbonding_period_s": 0,
    "lease_duration_s": 60,
    "max_attempts": 3,
    "replication_factor": 1,
    "audit_rate_floor": 0.0,
    "max_async_level": 2,
    "max_leases_per_node": 4,
}


def node_row(node_id: str, provider_id: str, at: dt.datetime, **values: Any) -> dict[str, Any]:
    """A healthy node's row, inserted with Core (no model defaults)."""
    return {
        "id": node_id,
        "provider_id": provider_id,
        "attestation": "a",
        "gpu_count": 1,
        "gpu_memory_mb": 1,
        "cpu_cores": 1,
        "ram_mb": 1,
        "version": "1",
        "status": "healthy",
        "status_changed_at": at,
        "created_at": at,
        "updated_at": at,
        **values,
    }


async def _seed_pool(conn: Any) -> None:
    from orchestrator.admin.models import ApiToken
    from orchestrator.pools.models import Pool

    await conn.execute(
        ApiToken.__table__.insert(), [{"id": "tok-mig", "name": "m", "role": "admin", "token_hash": "0" * 64}]
    )
    await _insert_known_columns(conn, Pool.__table__, [POOL_ROW])


async def _insert_known_columns(conn: Any, table: Any, rows: list[dict[str, Any]]) -> None:
    """Insert with the model's defaults, into the columns the database has at its revision only
    (a test that seeds an older schema must not name a column a later migration adds)."""
    names = await conn.run_sync(lambda c: {col["name"] for col in inspect(c).get_columns(table.name)})
    known = Table(table.name, MetaData(), *[c._copy() for c in table.columns if c.name in names])
    await conn.execute(known.insert(), rows)


async def _seed_tasks(conn: Any, statuses: list[tuple[str, str | None]]) -> None:
    """One batch of the pool's tasks, ids 1.., each with (status, failure_reason); no replicas."""
    from orchestrator.tasks.models import Task, TaskBatch

    batch = {"id": 1, "pool_id": "pool-mig", "batch_key": "b", "body_sha256": "0" * 64, "created_by": "t"}
    await conn.execute(TaskBatch.__table__.insert(), [{**batch, "task_count": len(statuses)}])
    await conn.execute(
        Task.__table__.insert(),
        [
            {
                "id": i + 1,
                "pool_id": "pool-mig",
                "batch_id": 1,
                "batch_index": i,
                "prompt": "p",
                "sampling": {},
                "replication": 1,
                "min_quorum": 1,
                "claim_rank": 0,
                "status": status,
                "available_replicas": 0,
                "failure_reason": reason,
            }
            for i, (status, reason) in enumerate(statuses)
        ],
    )


async def _seed_ended_tasks(url: str) -> None:
    """Tasks that ended before revision 0012, each with the failure_reason its path wrote then."""
    engine = create_async_engine(url)
    ended = [
        ("failed", "deadline passed at 2026-11-30T10:00:00+00:00"),
        ("failed", "replica 0 expired 3 times (max attempts)"),
        ("cancelled", "ReST^EM iteration 7 expired"),
        ("cancelled", "cancelled by tok-mig"),
        ("open", None),
    ]
    try:
        async with engine.begin() as conn:
            await _seed_pool(conn)
            await _seed_tasks(conn, ended)
    finally:
        await engine.dispose()


async def _end_reasons(url: str) -> list[tuple[int, str | None]]:
    engine = create_async_engine(url)
    try:
        async with engine.connect() as conn:
            return [
                tuple(r) for r in await conn.execute(text("SELECT id, end_reason FROM tasks ORDER BY id"))
            ]
    finally:
        await engine.dispose()


def test_0012_gives_tasks_that_already_ended_their_end_reason(scratch_url: str) -> None:
    upgrade(scratch_url)
    asyncio.run(_seed_ended_tasks(scratch_url))
    downgrade(scratch_url, "0011")  # the rows as they were before 0012: text only
    upgrade(scratch_url)
    assert asyncio.run(_end_reasons(scratch_url)) == [
        (1, "deadline_passed"),
        (2, "max_attempts"),
        (3, "iteration_expired"),
        (4, "cancelled"),
        (5, None),
    ]


async def _seed_replicas(url: str, replicas: list[tuple[int, int]]) -> None:
    """One task with a replica per (seed, leases_issued)."""
    from orchestrator.tasks.models import TaskReplica

    engine = create_async_engine(url)
    try:
        async with engine.begin() as conn:
            await _seed_pool(conn)
            await _seed_tasks(conn, [("open", None)])
            await conn.execute(
                TaskReplica.__table__.insert(),
                [
                    {
                        "task_id": 1,
                        "replica_index": i,
                        "seed": seed,
                        "status": "available",
                        "leases_issued": issued,
                    }
                    for i, (seed, issued) in enumerate(replicas)
                ],
            )
    finally:
        await engine.dispose()


async def _seeds(url: str) -> list[int]:
    engine = create_async_engine(url)
    try:
        async with engine.connect() as conn:
            rows = await conn.execute(text("SELECT seed FROM task_replicas ORDER BY replica_index"))
            return [int(seed) for (seed,) in rows]
    finally:
        await engine.dispose()


def test_0027_brings_the_seeds_of_replicas_never_leased_below_2_53(scratch_url: str) -> None:
    """A worker that reads JSON numbers as doubles echoes a seed of 2^53 or more rounded (judged
    fraud); a replica no lease has shown yet gets a seed it reads exactly, one already leased
    keeps the seed its leases gave."""
    upgrade(scratch_url, "0026")
    big = 2**62 + 12_345
    asyncio.run(_seed_replicas(scratch_url, [(big, 0), (big, 1), (77, 0), (2**53, 0)]))
    upgrade(scratch_url)
    assert asyncio.run(_seeds(scratch_url)) == [big // 1024, big, 77, 2**43]
    downgrade(scratch_url, "0026")
    assert asyncio.run(_seeds(scratch_url)) == [big // 1024, big, 77, 2**43]


async def _seed_failed_everywhere(url: str) -> None:
    """A task that ended max_failures (revision 0020) and one that ended max_attempts."""
    engine = create_async_engine(url)
    try:
        async with engine.begin() as conn:
            await _seed_pool(conn)
            await _seed_tasks(
                conn,
                [
                    ("failed", "failed on the nodes of 3 providers (max failures)"),
                    ("failed", "replica 0 expired 3 times (max attempts)"),
                ],
            )
            await conn.execute(
                text(
                    "UPDATE tasks SET end_reason = CASE id WHEN 1 THEN 'max_failures' ELSE 'max_attempts' END"
                )
            )
    finally:
        await engine.dispose()


def test_0020_downgrade_keeps_a_task_that_failed_everywhere_without_its_end_reason(scratch_url: str) -> None:
    """0019's check allows no max_failures: such a task keeps its words, and NULL, as tasks that
    ended before 0012 without a known reason do; the others keep theirs."""
    upgrade(scratch_url)
    asyncio.run(_seed_failed_everywhere(scratch_url))
    downgrade(scratch_url, "0019")
    assert asyncio.run(_end_reasons(scratch_url)) == [(1, None), (2, "max_attempts")]
    upgrade(scratch_url)
    assert asyncio.run(_end_reasons(scratch_url)) == [(1, None), (2, "max_attempts")]


def test_0021_downgrade_turns_a_task_its_pool_completion_cancelled_into_a_plain_cancel(
    scratch_url: str,
) -> None:
    """0020's check allows no pool_completed: such a task is ``cancelled`` (its words still say
    the pool was completed); the others keep theirs."""
    upgrade(scratch_url)
    asyncio.run(_seed_failed_everywhere(scratch_url))
    asyncio.run(_set_end_reason(scratch_url, 2, "pool_completed"))
    downgrade(scratch_url, "0020")
    assert asyncio.run(_end_reasons(scratch_url)) == [(1, "max_failures"), (2, "cancelled")]
    upgrade(scratch_url)
    assert asyncio.run(_set_end_reason(scratch_url, 2, "pool_completed")) is None
    assert asyncio.run(_end_reasons(scratch_url)) == [(1, "max_failures"), (2, "pool_completed")]


async def _set_end_reason(url: str, task_id: int, reason: str) -> None:
    engine = create_async_engine(url)
    try:
        async with engine.begin() as conn:
            await conn.execute(
                text("UPDATE tasks SET end_reason = :r WHERE id = :id"), {"r": reason, "id": task_id}
            )
    finally:
        await engine.dispose()


async def _seed_forfeited_holds(url: str) -> None:
    """What the code before 0013 left: node N's rewards v1 and v2 forfeited by fraud verdict f3
    (one slash-pending transfer); v4 forfeited by fraud verdict f5, which an appeal reversed
    (its slash-pending transfer reversed, the hold left forfeited); v6 held; v7 released."""
    from orchestrator.identity.models import Node, Provider
    from orchestrator.ledger.models import LedgerAccount, LedgerTransfer
    from orchestrator.tasks.models import Assignment, Submission, TaskReplica
    from orchestrator.verification.models import Verdict

    engine = create_async_engine(url)
    at = dt.datetime(2026, 11, 30, 12, tzinfo=dt.UTC)
    node, provider = "N" * 43, "P" * 43
    kinds = {1: "valid", 2: "valid", 3: "fraud", 4: "valid", 5: "fraud", 6: "valid", 7: "valid"}
    try:
        async with engine.begin() as conn:
            await conn.execute(Provider.__table__.insert(), [{"id": provider, "created_at": at}])
            await conn.execute(
                Node.__table__.insert(),
                [node_row(node, provider, at)],
            )
            await conn.execute(
                TaskReplica.__table__.insert(),
                [
                    {
                        "id": 1,
                        "task_id": 5,
                        "replica_index": 0,
                        "seed": 1,
                        "status": "leased",
                        "leases_issued": 7,
                        "expirations": 0,
                    }
                ],
            )
            common = {"task_id": 5, "pool_id": "pool-mig", "node_id": node, "provider_id": provider}
            await conn.execute(
                Assignment.__table__.insert(),
                [
                    {
                        **common,
                        "id": f"a{i}",
                        "replica_id": 1,
                        "fencing_token": i,
                        "policy_step": 1,
                        "status": "submitted",
                        "lease_expires_at": at,
                        "created_at": at,
                    }
                    for i in kinds
                ],
            )
            await conn.execute(
                Submission.__table__.insert(),
                [
                    {
                        **common,
                        "id": i,
                        "assignment_id": f"a{i}",
                        "replica_id": 1,
                        "policy_step": 1,
                        "policy_current_step": 1,
                        "sample_count": 1,
                        "status": "accepted",
                        "body_sha256": "0" * 64,
                        "body": b"{}",
                        "method": "POST",
                        "target_uri": "/",
                        "signature_input": "s",
                        "signature": "s",
                        "response": {},
                        "received_at": at,
                    }
                    for i in kinds
                ],
            )
            await conn.execute(
                Verdict.__table__.insert(),
                [
                    {
                        **common,
                        "id": i,
                        "submission_id": i,
                        "outcome": "accepted" if kind == "valid" else "rejected",
                        "category": kind,
                        "reason": "r",
                        "verifier": "checks",
                        "details": {},
                        "paid_samples": 1,
                        "reward_amount": 7 if kind == "valid" else 0,
                        "slashed_amount": 0,
                        "decided_at": at,
                        "reversed_at": at if i == 5 else None,
                    }
                    for i, kind in kinds.items()
                ],
            )
            await conn.execute(
                LedgerAccount.__table__.insert(),
                [
                    {
                        "id": 1,
                        "owner_type": "provider",
                        "owner_id": provider,
                        "kind": "rewards_pending",
                        "balance": 14,
                        "allow_negative": False,
                        "created_at": at,
                    },
                    {
                        "id": 2,
                        "owner_type": "system",
                        "owner_id": "system/3",
                        "kind": "slashed",
                        "balance": 14,
                        "allow_negative": True,
                        "created_at": at,
                    },
                ],
            )
            transfer = {
                "debit_account_id": 1,
                "credit_account_id": 2,
                "reason": "slash_pending_rewards",
                "actor": "verifier",
                "created_at": at,
                "reference_type": "verdict",
            }
            await conn.execute(
                LedgerTransfer.__table__.insert(),
                [
                    {
                        **transfer,
                        "id": 1,
                        "idempotency_key": "submission:3:slash-pending",
                        "amount": 14,
                        "reference_id": "3",
                    },
                    {
                        **transfer,
                        "id": 2,
                        "idempotency_key": "submission:5:slash-pending",
                        "amount": 7,
                        "reference_id": "5",
                    },
                    {
                        **transfer,
                        "id": 3,
                        "idempotency_key": "verdict:5:reverse:2",
                        "amount": 7,
                        "reference_id": "5",
                        "debit_account_id": 2,
                        "credit_account_id": 1,
                        "reverses_transfer_id": 2,
                    },
                ],
            )
    finally:
        await engine.dispose()


async def _seed_holds_before_0013(url: str) -> None:
    engine = create_async_engine(url)
    status = {1: "forfeited", 2: "forfeited", 4: "forfeited", 6: "held", 7: "released"}
    try:
        async with engine.begin() as conn:
            for verdict, s in status.items():
                await conn.execute(
                    text(
                        "INSERT INTO reward_holds (id, verdict_id, pool_id, node_id, provider_id, amount, "
                        "release_at, status, created_at) VALUES (:id, :id, 'pool-mig', :node, :provider, 7, "
                        ":at, :status, :at)"
                    ),
                    {
                        "id": verdict,
                        "node": "N" * 43,
                        "provider": "P" * 43,
                        "status": s,
                        "at": dt.datetime(2026, 11, 30, 12, tzinfo=dt.UTC),
                    },
                )
    finally:
        await engine.dispose()


async def _forfeits_and_holds(url: str) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    engine = create_async_engine(url)
    try:
        async with engine.connect() as conn:
            forfeits = await conn.execute(
                text(
                    "SELECT verdict_id, hold_id, amount, slashed_account_id, status FROM reward_forfeits ORDER BY hold_id"
                )
            )
            holds = await conn.execute(
                text("SELECT id, status, forfeited_amount FROM reward_holds ORDER BY id")
            )
            return [tuple(r) for r in forfeits], [tuple(r) for r in holds]
    finally:
        await engine.dispose()


def test_0013_records_which_fraud_verdict_forfeited_each_hold(scratch_url: str) -> None:
    upgrade(scratch_url)
    asyncio.run(_seed_ended_tasks(scratch_url))
    asyncio.run(_seed_forfeited_holds(scratch_url))
    downgrade(scratch_url, "0012")
    asyncio.run(_seed_holds_before_0013(scratch_url))
    upgrade(scratch_url)
    forfeits, holds = asyncio.run(_forfeits_and_holds(scratch_url))
    assert forfeits == [(3, 1, 7, 2, "forfeited"), (3, 2, 7, 2, "forfeited"), (5, 4, 7, 2, "restored")]
    # v4's fraud verdict was reversed and its money is back in pending: held again, released when due.
    assert holds == [
        (1, "forfeited", 7),
        (2, "forfeited", 7),
        (4, "held", 0),
        (6, "held", 0),
        (7, "released", 0),
    ]


async def _hold_until(url: str) -> list[tuple[int, Any]]:
    engine = create_async_engine(url)
    try:
        async with engine.connect() as conn:
            rows = await conn.execute(text("SELECT id, hold_until FROM verdicts ORDER BY id"))
            return [(i, None if at is None else str(at)[:19]) for i, at in rows]
    finally:
        await engine.dispose()


def test_0034_gives_rewarded_verdicts_their_holds_release_as_hold_until(scratch_url: str) -> None:
    """The end of the hold window a fraud verdict withdraws a rollout in: the hold's release
    time for the accepted verdicts that earned one (all of them here), none for fraud."""
    upgrade(scratch_url)
    asyncio.run(_seed_ended_tasks(scratch_url))
    asyncio.run(_seed_forfeited_holds(scratch_url))
    downgrade(scratch_url, "0012")
    asyncio.run(_seed_holds_before_0013(scratch_url))  # each released at 2026-11-30 12:00
    upgrade(scratch_url)
    at = "2026-11-30 12:00:00"
    assert asyncio.run(_hold_until(scratch_url)) == [
        (1, at),
        (2, at),
        (3, None),
        (4, at),
        (5, None),
        (6, at),
        (7, at),
    ]


async def _change_history(url: str) -> None:
    """Of the seeded verdicts (fraud 3 standing, fraud 5 reversed): every accepted one's hold
    window runs a day longer, so the fraud verdicts fall in the windows of those before them;
    and v6 was reversed on appeal."""
    from orchestrator.verification.models import Verdict

    engine = create_async_engine(url)
    at = dt.datetime(2026, 11, 30, 12, tzinfo=dt.UTC)
    verdicts = Verdict.__table__
    try:
        async with engine.begin() as conn:
            await conn.execute(
                verdicts.update()
                .where(verdicts.c.outcome == "accepted")
                .values(hold_until=at + dt.timedelta(days=1))
            )
            await conn.execute(
                verdicts.update().where(verdicts.c.id == 6).values(reversed_at=at + dt.timedelta(hours=3))
            )
    finally:
        await engine.dispose()


async def _rollout_changes(url: str) -> list[tuple[Any, ...]]:
    engine = create_async_engine(url)
    try:
        async with engine.connect() as conn:
            rows = await conn.execute(
                text(
                    "SELECT id, pool_id, verdict_id, change, cause_verdict_id, created_at "
                    "FROM rollout_changes ORDER BY id"
                )
            )
            return [(*r[:5], str(r[5])[:19]) for r in rows]
    finally:
        await engine.dispose()


def test_0035_gives_each_rollout_whose_standing_changed_a_notice(scratch_url: str) -> None:
    """v1 and v2 are withdrawn by fraud 3; v4 was withdrawn by fraud 5 only, reversed since, so
    it stands again; v6 was reversed; v7 came after both fraud verdicts. Each notice is dated
    when its change happened."""
    upgrade(scratch_url)
    asyncio.run(_seed_ended_tasks(scratch_url))
    asyncio.run(_seed_forfeited_holds(scratch_url))
    downgrade(scratch_url, "0034")
    asyncio.run(_change_history(scratch_url))
    upgrade(scratch_url)
    at, later = "2026-11-30 12:00:00", "2026-11-30 15:00:00"
    assert asyncio.run(_rollout_changes(scratch_url)) == [
        (1, "pool-mig", 1, "withdrawn", 3, at),
        (2, "pool-mig", 2, "withdrawn", 3, at),
        (3, "pool-mig", 4, "restored", 5, at),
        (4, "pool-mig", 6, "reversed", None, later),
    ]


async def _seed_node_addresses(url: str, addresses: list[str]) -> None:
    """Nodes as registered before revision 0014: the address as the client connected from."""
    from orchestrator.identity.models import Node, Provider

    engine = create_async_engine(url)
    try:
        async with engine.begin() as conn:
            at = dt.datetime(2026, 11, 30, 12, tzinfo=dt.UTC)
            await conn.execute(Provider.__table__.insert(), [{"id": "p" * 43, "created_at": at}])
            await conn.execute(
                Node.__table__.insert(),
                [
                    node_row(f"{i:043d}", "p" * 43, at, ip_address=address)
                    for i, address in enumerate(addresses)
                ],
            )
    finally:
        await engine.dispose()


async def _node_addresses(url: str) -> list[str | None]:
    engine = create_async_engine(url)
    try:
        async with engine.connect() as conn:
            return list((await conn.execute(text("SELECT ip_address FROM nodes ORDER BY id"))).scalars())
    finally:
        await engine.dispose()


def test_0014_records_earlier_ipv6_addresses_as_their_64(scratch_url: str) -> None:
    upgrade(scratch_url)
    before = ["2001:db8:1:2::10", "2001:db8:1:2:ffff::1", "::ffff:192.0.2.7", "192.0.2.8", "unknown", None]
    asyncio.run(_seed_node_addresses(scratch_url, before))  # type: ignore[arg-type]
    downgrade(scratch_url, "0013")
    upgrade(scratch_url)
    assert asyncio.run(_node_addresses(scratch_url)) == [
        "2001:db8:1:2::/64",
        "2001:db8:1:2::/64",
        "192.0.2.7",
        "192.0.2.8",
        "unknown",
        None,
    ]


async def _seed_ejections(url: str, reasons: list[tuple[str, str | None]]) -> None:
    """Memberships as the code before 0015 left them: a status and a reason, no ejected_by."""
    from orchestrator.identity.models import Node, Provider
    from orchestrator.pools.models import PoolMembership

    engine = create_async_engine(url)
    at = dt.datetime(2026, 12, 1, 9, tzinfo=dt.UTC)
    provider = "P" * 43
    nodes = [chr(ord("A") + i) * 43 for i in range(len(reasons))]
    try:
        async with engine.begin() as conn:
            await _seed_pool(conn)
            await conn.execute(Provider.__table__.insert(), [{"id": provider, "created_at": at}])
            await conn.execute(
                Node.__table__.insert(),
                [node_row(node, provider, at) for node in nodes],
            )
            await conn.execute(
                PoolMembership.__table__.insert(),
                [
                    {
                        "id": i + 1,
                        "pool_id": "pool-mig",
                        "node_id": node,
                        "provider_id": provider,
                        "status": status,
                        "reason": reason,
                    }
                    for i, (node, (status, reason)) in enumerate(zip(nodes, reasons, strict=True))
                ],
            )
    finally:
        await engine.dispose()


async def _ejected_by(url: str) -> list[tuple[int, str | None]]:
    engine = create_async_engine(url)
    try:
        async with engine.connect() as conn:
            rows = await conn.execute(text("SELECT id, ejected_by FROM pool_memberships ORDER BY id"))
            return [tuple(r) for r in rows]  # type: ignore[misc]
    finally:
        await engine.dispose()


def test_0015_records_who_ejected_earlier_ejections(scratch_url: str) -> None:
    upgrade(scratch_url)
    asyncio.run(
        _seed_ejections(
            scratch_url,
            [
                ("ejected", "node banned: sybil farm"),
                ("ejected", "3 fraud strikes"),
                ("ejected", "operator's call"),
                ("ejected", "NODE BANNED: not the ban's text"),
                ("left", "ban lifted"),
                ("active", None),
            ],
        )
    )
    downgrade(scratch_url, "0014")
    upgrade(scratch_url)
    assert asyncio.run(_ejected_by(scratch_url)) == [
        (1, "ban"),
        (2, "verifier"),
        (3, "operator"),
        (4, "operator"),
        (5, None),
        (6, None),
    ]


async def _seed_task_in_progress(url: str) -> None:
    """A task with a leased replica: rows of other tables (replicas, leases) refer to it."""
    from orchestrator.identity.models import Node, Provider
    from orchestrator.tasks.models import Assignment, TaskReplica

    at = dt.datetime(2026, 11, 30, 12, tzinfo=dt.UTC)
    node, provider = "N" * 43, "P" * 43
    engine = create_async_engine(url)
    try:
        async with engine.begin() as conn:
            await _seed_pool(conn)
            await conn.execute(Provider.__table__.insert(), [{"id": provider, "created_at": at}])
            await conn.execute(Node.__table__.insert(), [node_row(node, provider, at)])
            await _seed_tasks(conn, [("open", None)])
            await conn.execute(
                TaskReplica.__table__.insert(),
                [
                    {
                        "id": 1,
                        "task_id": 1,
                        "replica_index": 0,
                        "seed": 1,
                        "status": "leased",
                        "leases_issued": 1,
                    }
                ],
            )
            await conn.execute(
                Assignment.__table__.insert(),
                [
                    {
                        "id": "a1",
                        "task_id": 1,
                        "replica_id": 1,
                        "pool_id": "pool-mig",
                        "node_id": node,
                        "provider_id": provider,
                        "fencing_token": 1,
                        "policy_step": 1,
                        "status": "active",
                        "lease_expires_at": at,
                        "created_at": at,
                    }
                ],
            )
    finally:
        await engine.dispose()


async def _counts(url: str) -> dict[str, int]:
    engine = create_async_engine(url)
    try:
        async with engine.connect() as conn:
            return {
                table: (await conn.execute(text(f"SELECT count(*) FROM {table}"))).scalar_one()
                for table in ("tasks", "task_replicas", "assignments")
            }
    finally:
        await engine.dispose()


def test_migrations_rebuild_tables_without_losing_or_refusing_the_rows_that_refer_to_them(
    scratch_url: str,
) -> None:
    # On SQLite, batch mode rebuilds a table to alter it (0006 and 0012 rebuild tasks): copy,
    # DROP, rename. With foreign keys enforced, that DROP of a table other rows refer to failed
    # ("FOREIGN KEY constraint failed"), so a database with tasks could neither be upgraded past
    # those revisions nor downgraded below them.
    upgrade(scratch_url)
    asyncio.run(_seed_task_in_progress(scratch_url))
    downgrade(scratch_url, "0005")
    assert asyncio.run(_counts(scratch_url)) == {"tasks": 1, "task_replicas": 1, "assignments": 1}
    upgrade(scratch_url)
    assert asyncio.run(_counts(scratch_url)) == {"tasks": 1, "task_replicas": 1, "assignments": 1}


async def _seed_payouts(url: str) -> None:
    """Three payouts of one provider, each with its withdrawal: requested, paid and rejected."""
    from orchestrator.identity.models import Provider
    from orchestrator.ledger.models import LedgerAccount, LedgerTransfer
    from orchestrator.payouts.models import Payout

    at = dt.datetime(2026, 12, 1, 12, tzinfo=dt.UTC)
    provider = "P" * 43
    engine = create_async_engine(url)
    try:
        async with engine.begin() as conn:
            await conn.execute(Provider.__table__.insert(), [{"id": provider, "created_at": at}])
            await conn.execute(
                LedgerAccount.__table__.insert(),
                [
                    {
                        "id": i,
                        "owner_type": "provider",
                        "owner_id": provider,
                        "kind": kind,
                        "balance": 0,
                        "allow_negative": False,
                        "created_at": at,
                    }
                    for i, kind in ((1, "rewards_claimable"), (2, "withdrawn"))
                ],
            )
            keys = {i: f"withdrawal:{provider}:key-{i}" for i in (1, 2, 3)}
            await conn.execute(
                LedgerTransfer.__table__.insert(),
                [
                    {
                        "id": i,
                        "idempotency_key": keys[i],
                        "debit_account_id": 1,
                        "credit_account_id": 2,
                        "amount": 10 * i,
                        "reason": "withdrawal",
                        "actor": "test",
                        "created_at": at,
                    }
                    for i in keys
                ],
            )
            # Every row names every column: an executemany takes its columns from the first row.
            unset = dict.fromkeys(
                ("paid_at", "paid_by", "external_reference", "rejected_at", "rejected_by", "rejection_reason")
            )
            rows = [
                {"status": "requested"},
                {"status": "paid", "paid_at": at, "paid_by": "tok-admin", "external_reference": "wire-2"},
                {
                    "status": "rejected",
                    "rejected_at": at,
                    "rejected_by": "tok-admin",
                    "rejection_reason": "bad destination",
                },
            ]
            await conn.execute(
                Payout.__table__.insert(),
                [
                    {
                        "id": i,
                        "provider_id": provider,
                        "amount": 10 * i,
                        "idempotency_key": keys[i],
                        "transfer_id": i,
                        "requested_at": at,
                        **unset,
                        **row,
                    }
                    for i, row in enumerate(rows, start=1)
                ],
            )
    finally:
        await engine.dispose()


async def _payouts_and_revision(url: str, sql: str | None = None) -> tuple[list[Any], str]:
    engine = create_async_engine(url)
    try:
        async with engine.begin() as conn:
            if sql is not None:
                await conn.execute(text(sql))
            payouts = (
                await conn.execute(
                    text("SELECT id, status, amount, external_reference FROM payouts ORDER BY id")
                )
            ).all()
            revision = (await conn.execute(text("SELECT version_num FROM alembic_version"))).scalar_one()
            return [tuple(p) for p in payouts], revision
    finally:
        await engine.dispose()


def test_0018_downgrade_refuses_to_drop_rejected_payouts_and_keeps_the_others(scratch_url: str) -> None:
    # 0017 has no rejected status: as a requested payout, a rejected one (whose money went back
    # to claimable rewards) would be paid again, so the downgrade refuses while one exists.
    upgrade(scratch_url, "0018")
    asyncio.run(_seed_payouts(scratch_url))
    everything = [(1, "requested", 10, None), (2, "paid", 20, "wire-2"), (3, "rejected", 30, None)]
    with pytest.raises(RuntimeError, match="1 payouts are rejected"):
        downgrade(scratch_url, "0017")
    assert asyncio.run(_payouts_and_revision(scratch_url)) == (everything, "0018")

    kept = everything[:2]
    assert asyncio.run(_payouts_and_revision(scratch_url, "DELETE FROM payouts WHERE id = 3")) == (
        kept,
        "0018",
    )
    downgrade(scratch_url, "0017")
    assert asyncio.run(_payouts_and_revision(scratch_url)) == (kept, "0017")
    upgrade(scratch_url, "0018")
    assert asyncio.run(_payouts_and_revision(scratch_url)) == (kept, "0018")


def test_0028_downgrade_refuses_while_a_requested_payout_is_in_a_run(scratch_url: str) -> None:
    # 0027 has no runs: a requested payout that a run took (its file may be being paid) would be
    # in no run after the downgrade, and the next run would list it again.
    upgrade(scratch_url, "0028")
    asyncio.run(_seed_payouts(scratch_url))
    everything = [(1, "requested", 10, None), (2, "paid", 20, "wire-2"), (3, "rejected", 30, None)]
    run = (
        "INSERT INTO payout_runs (id, idempotency_key, max_payouts, payouts, amount, created_at, created_by)"
        " VALUES (1, 'run-1', 1000, 2, 30, '2026-12-01 12:00:00', 'tok-admin');"
    )
    asyncio.run(_payouts_and_revision(scratch_url, run))
    assert asyncio.run(
        _payouts_and_revision(scratch_url, "UPDATE payouts SET run_id = 1 WHERE id IN (1, 2)")
    ) == (
        everything,
        "0028",
    )
    with pytest.raises(RuntimeError, match="1 requested payouts are in a payout run"):
        downgrade(scratch_url, "0027")
    assert asyncio.run(_payouts_and_revision(scratch_url, "SELECT 1")) == (everything, "0028")

    # Once that payout is settled (here: paid), only the paid one is in the run; losing a paid
    # payout's run costs no money, so the downgrade goes ahead.
    paid = (
        "UPDATE payouts SET status = 'paid', paid_at = '2026-12-01 13:00:00', paid_by = 'tok-admin',"
        " external_reference = 'wire-1' WHERE id = 1"
    )
    asyncio.run(_payouts_and_revision(scratch_url, paid))
    downgrade(scratch_url, "0027")
    settled = [(1, "paid", 10, "wire-1"), *everything[1:]]
    assert asyncio.run(_payouts_and_revision(scratch_url)) == (settled, "0027")
    upgrade(scratch_url, "0028")
    assert asyncio.run(_payouts_and_revision(scratch_url)) == (settled, "0028")


async def _max_leases(url: str) -> list[tuple[str, int]]:
    engine = create_async_engine(url)
    try:
        async with engine.connect() as conn:
            rows = await conn.execute(text("SELECT id, max_lease_s FROM pools ORDER BY id"))
            return [(r[0], r[1]) for r in rows]
    finally:
        await engine.dispose()


async def _seed_pools_with_leases(url: str, durations: dict[str, int]) -> None:
    from orchestrator.admin.models import ApiToken
    from orchestrator.pools.models import Pool

    engine = create_async_engine(url)
    try:
        async with engine.begin() as conn:
            await conn.execute(
                ApiToken.__table__.insert(),
                [{"id": "tok-mig", "name": "m", "role": "admin", "token_hash": "0" * 64}],
            )
            rows = [
                {**POOL_ROW, "id": pool_id, "name": pool_id, "lease_duration_s": duration}
                for pool_id, duration in durations.items()
            ]
            await _insert_known_columns(conn, Pool.__table__, rows)
    finally:
        await engine.dispose()


def test_0029_gives_existing_pools_a_day_or_their_longer_lease_as_max_lease_s(scratch_url: str) -> None:
    upgrade(scratch_url, "0028")
    asyncio.run(_seed_pools_with_leases(scratch_url, {"pool-a": 60, "pool-b": 2 * 86400}))
    upgrade(scratch_url)
    assert asyncio.run(_max_leases(scratch_url)) == [("pool-a", 86400), ("pool-b", 2 * 86400)]


async def _validation_jobs(url: str, sql: str | None = None) -> list[tuple[Any, ...]]:
    engine = create_async_engine(url)
    try:
        async with engine.begin() as conn:
            if sql is not None:
                await conn.execute(text(sql))
            rows = await conn.execute(text("SELECT id, status FROM validation_jobs ORDER BY id"))
            return [tuple(r) for r in rows]
    finally:
        await engine.dispose()


def test_0031_downgrade_keeps_withdrawn_validation_jobs_as_decided(scratch_url: str) -> None:
    """0030's check allows no withdrawn: such a job (its result decided on the server's checks)
    is ``done`` there, not ``open`` again, where validators would be offered a decided result."""
    upgrade(scratch_url)
    asyncio.run(_seed_ended_tasks(scratch_url))
    asyncio.run(_seed_forfeited_holds(scratch_url))
    at = "'2026-11-30 12:00:00'"
    insert = (
        "INSERT INTO validation_jobs (id, submission_id, pool_id, status, fencing_token, created_at) "
        f"VALUES (1, 1, 'pool-mig', 'withdrawn', 1, {at}), (2, 2, 'pool-mig', 'done', 1, {at}), "
        f"(3, 3, 'pool-mig', 'open', 0, {at})"
    )
    assert asyncio.run(_validation_jobs(scratch_url, insert)) == [(1, "withdrawn"), (2, "done"), (3, "open")]
    downgrade(scratch_url, "0030")
    assert asyncio.run(_validation_jobs(scratch_url)) == [(1, "done"), (2, "done"), (3, "open")]
    upgrade(scratch_url)
    withdraw = "UPDATE validation_jobs SET status = 'withdrawn' WHERE id = 3"
    assert asyncio.run(_validation_jobs(scratch_url, withdraw)) == [
        (1, "done"),
        (2, "done"),
        (3, "withdrawn"),
    ]


async def _run_sql(url: str, *statements: str, **params: Any) -> str:
    """Run ``statements`` (each with the ``params`` it names) in one transaction; the revision."""
    engine = create_async_engine(url)
    try:
        async with engine.begin() as conn:
            for sql in statements:
                clause = text(sql)
                await conn.execute(clause, {k: v for k, v in params.items() if k in clause._bindparams})
            revision = (await conn.execute(text("SELECT version_num FROM alembic_version"))).scalar_one()
            return str(revision)
    finally:
        await engine.dispose()


async def _rows(url: str, sql: str) -> list[tuple[Any, ...]]:
    engine = create_async_engine(url)
    try:
        async with engine.connect() as conn:
            return [tuple(r) for r in await conn.execute(text(sql))]
    finally:
        await engine.dispose()


AT = dt.datetime(2026, 11, 30, 12, tzinfo=dt.UTC)


def test_0013_downgrade_refuses_a_hold_forfeited_by_a_later_fraud_verdict_than_its_first(
    scratch_url: str,
) -> None:
    """Fraud verdict f5 forfeited v4's hold and was reversed on appeal (forfeit restored, the
    hold held again); fraud verdict f7 then forfeited the hold for good. 0012 records only
    "forfeited", and the re-upgrade's backfill gives every forfeited hold to the node's first
    fraud verdict after it: f5, reversed, so the forfeit came back 'restored' and the hold
    'held', and the release loop paid out the 7 that f7 slashed. The guard counted only
    partial and non-fraud forfeits, so the downgrade went ahead."""
    upgrade(scratch_url)
    asyncio.run(_seed_ended_tasks(scratch_url))
    asyncio.run(_seed_forfeited_holds(scratch_url))
    state = (
        "UPDATE verdicts SET outcome = 'rejected', category = 'fraud', reward_amount = 0 WHERE id = 7",
        "INSERT INTO reward_holds (id, verdict_id, pool_id, node_id, provider_id, amount, forfeited_amount,"
        " release_at, status, created_at) VALUES"
        " (1, 1, 'pool-mig', :node, :provider, 7, 7, :later, 'forfeited', :at),"
        " (2, 2, 'pool-mig', :node, :provider, 7, 7, :later, 'forfeited', :at),"
        " (4, 4, 'pool-mig', :node, :provider, 7, 7, :later, 'forfeited', :at)",
        "INSERT INTO reward_forfeits (id, verdict_id, hold_id, amount, slashed_account_id, status, created_at)"
        " VALUES (1, 3, 1, 7, 2, 'forfeited', :at), (2, 3, 2, 7, 2, 'forfeited', :at),"
        " (3, 5, 4, 7, 2, 'restored', :at), (4, 7, 4, 7, 2, 'forfeited', :at)",
    )
    later = AT + dt.timedelta(days=1)
    asyncio.run(_run_sql(scratch_url, *state, node="N" * 43, provider="P" * 43, at=AT, later=later))
    downgrade(scratch_url, "0013")
    with pytest.raises(RuntimeError, match=r"1 reward forfeits.*later fraud verdict"):
        downgrade(scratch_url, "0012")
    assert asyncio.run(_run_sql(scratch_url)) == "0013"
    holds = "SELECT id, status, forfeited_amount FROM reward_holds ORDER BY id"
    assert asyncio.run(_rows(scratch_url, holds)) == [
        (1, "forfeited", 7),
        (2, "forfeited", 7),
        (4, "forfeited", 7),
    ]

    # f3's forfeits of v1 and v2 (the node's first fraud verdict after each) are 0012's own.
    asyncio.run(_run_sql(scratch_url, "DELETE FROM reward_forfeits WHERE id = 4"))
    asyncio.run(
        _run_sql(scratch_url, "UPDATE reward_holds SET status = 'held', forfeited_amount = 0 WHERE id = 4")
    )
    downgrade(scratch_url, "0012")
    assert asyncio.run(_run_sql(scratch_url)) == "0012"


def test_0013_downgrade_refuses_while_a_soft_penalty_forfeit_is_in_force(scratch_url: str) -> None:
    # 0012 knows no partial forfeit: v7, invalid, took 3 of the 7 that v6's hold keeps (the 3 are
    # in the slashed account). Without forfeited_amount the release pays all 7 out of pending
    # (the 3 paid twice: slashed and claimable), and without the forfeit row an appeal of v7 gives
    # nothing back; the re-upgrade's backfill rebuilds only fraud verdicts' whole forfeits.
    upgrade(scratch_url)
    asyncio.run(_seed_ended_tasks(scratch_url))
    asyncio.run(_seed_forfeited_holds(scratch_url))
    penalty = (
        "UPDATE verdicts SET outcome = 'rejected', category = 'invalid', reward_amount = 0,"
        " slashed_amount = 3 WHERE id = 7",
        "INSERT INTO reward_holds (id, verdict_id, pool_id, node_id, provider_id, amount, forfeited_amount,"
        " release_at, status, created_at) VALUES (6, 6, 'pool-mig', :node, :provider, 7, 3, :later, 'held', :at)",
        "INSERT INTO reward_forfeits (id, verdict_id, hold_id, amount, slashed_account_id, status, created_at)"
        " VALUES (1, 7, 6, 3, 2, 'forfeited', :at)",
    )
    later = AT + dt.timedelta(days=1)
    asyncio.run(_run_sql(scratch_url, *penalty, node="N" * 43, provider="P" * 43, at=AT, later=later))
    holds = "SELECT id, amount, forfeited_amount, status FROM reward_holds ORDER BY id"
    downgrade(scratch_url, "0013")
    with pytest.raises(RuntimeError, match="1 reward forfeits"):
        downgrade(scratch_url, "0012")
    assert asyncio.run(_run_sql(scratch_url)) == "0013"
    assert asyncio.run(_rows(scratch_url, holds)) == [(6, 7, 3, "held")]

    # Once v7 is reversed on appeal (its forfeit restored), the hold is whole again: 0012 holds it.
    restored = (
        "UPDATE reward_forfeits SET status = 'restored' WHERE id = 1",
        "UPDATE reward_holds SET forfeited_amount = 0 WHERE id = 6",
    )
    asyncio.run(_run_sql(scratch_url, *restored))
    downgrade(scratch_url, "0012")
    upgrade(scratch_url)
    assert asyncio.run(_rows(scratch_url, holds)) == [(6, 7, 0, "held")]


def test_0017_downgrade_refuses_while_a_live_token_has_an_expiry(scratch_url: str) -> None:
    # 0016 has no expiry: an expired token would authenticate again (and, re-upgraded with
    # expires_at NULL, never expire), and one that expires later would not.
    upgrade(scratch_url, "0017")
    tokens = (
        "INSERT INTO api_tokens (id, name, role, token_hash, created_at, expires_at) VALUES"
        " ('tok-old', 'o', 'admin', :h1, :at, :at), ('tok-forever', 'f', 'admin', :h2, :at, NULL)"
    )
    assert asyncio.run(_run_sql(scratch_url, tokens, h1="1" * 64, h2="2" * 64, at=AT)) == "0017"
    with pytest.raises(RuntimeError, match="1 tokens"):
        downgrade(scratch_url, "0016")
    assert asyncio.run(_run_sql(scratch_url)) == "0017"

    # A revoked token stays refused without its expiry: the downgrade goes ahead.
    asyncio.run(_run_sql(scratch_url, "UPDATE api_tokens SET revoked_at = :at WHERE id = 'tok-old'", at=AT))
    downgrade(scratch_url, "0016")
    revoked = "SELECT id, revoked_at IS NOT NULL FROM api_tokens ORDER BY id"
    assert asyncio.run(_rows(scratch_url, revoked)) == [("tok-forever", False), ("tok-old", True)]


def test_0033_downgrade_refuses_while_a_result_has_its_evidence_pruned(scratch_url: str) -> None:
    # 0032 cannot tell a pruned result from a stored one: its emptied body would be served (the
    # feed, its export and ReST^EM parse b"" and fail, at every read from there on), and after a
    # re-upgrade it is "stored" again (evidence_pruned_at NULL), with the same failures.
    upgrade(scratch_url)
    asyncio.run(_seed_ended_tasks(scratch_url))
    asyncio.run(_seed_forfeited_holds(scratch_url))
    prune = "UPDATE submissions SET body = :empty, evidence_pruned_at = :at WHERE id = 1"
    asyncio.run(_run_sql(scratch_url, prune, empty=b"", at=AT))
    downgrade(scratch_url, "0033")
    with pytest.raises(RuntimeError, match="1 results"):
        downgrade(scratch_url, "0032")
    assert asyncio.run(_run_sql(scratch_url)) == "0033"
    pruned = "SELECT id FROM submissions WHERE evidence_pruned_at IS NOT NULL"
    assert asyncio.run(_rows(scratch_url, pruned)) == [(1,)]


def test_0034_downgrade_refuses_while_a_fraud_verdict_withdraws_an_unrewarded_rollout(
    scratch_url: str,
) -> None:
    # v1 and v2 were accepted with no reward (no correct sample, or a pool that pays nothing): no
    # reward hold, but a hold window, in which fraud verdict v3 withdraws them from the feed. The
    # re-upgrade rebuilds hold_until from reward holds only: they would be served again.
    upgrade(scratch_url)
    asyncio.run(_seed_ended_tasks(scratch_url))
    asyncio.run(_seed_forfeited_holds(scratch_url))
    windows = (
        "UPDATE verdicts SET hold_until = :later WHERE outcome = 'accepted'",
        "UPDATE verdicts SET reward_amount = 0, paid_samples = 0 WHERE id IN (1, 2)",
    )
    asyncio.run(_run_sql(scratch_url, *windows, later=AT + dt.timedelta(days=1)))
    downgrade(scratch_url, "0034")
    with pytest.raises(RuntimeError, match="2 accepted verdicts"):
        downgrade(scratch_url, "0033")
    assert asyncio.run(_run_sql(scratch_url)) == "0034"

    # Once fraud verdict v3 is reversed, nothing withdraws them: the downgrade goes ahead.
    asyncio.run(_run_sql(scratch_url, "UPDATE verdicts SET reversed_at = :at WHERE id = 3", at=AT))
    downgrade(scratch_url, "0033")


def test_0005_downgrade_refuses_while_a_payout_is_requested(scratch_url: str) -> None:
    # 0004 has no payouts: a requested payout's money is in withdrawn (moved from claimable
    # rewards), and with its row gone nobody is asked to pay it, nor can it be rejected: lost.
    upgrade(scratch_url)
    asyncio.run(_seed_payouts(scratch_url))
    asyncio.run(_run_sql(scratch_url, "DELETE FROM payouts WHERE id = 3"))  # rejected: 0018 refuses
    downgrade(scratch_url, "0005")
    with pytest.raises(RuntimeError, match="1 payouts are requested"):
        downgrade(scratch_url, "0004")
    assert asyncio.run(_run_sql(scratch_url)) == "0005"
    assert asyncio.run(_rows(scratch_url, "SELECT id, status FROM payouts ORDER BY id")) == [
        (1, "requested"),
        (2, "paid"),
    ]


def test_a_refused_downgrade_leaves_the_database_where_it_was(scratch_url: str) -> None:
    # A downgrade of several revisions that one of them refuses (here 0018's, for a rejected
    # payout) is undone as a whole: on SQLite, Alembic (no transactional DDL there by default)
    # committed each revision's downgrade, leaving the database at 0018 with 0037..0019 undone.
    upgrade(scratch_url)
    asyncio.run(_seed_payouts(scratch_url))
    with pytest.raises(RuntimeError, match="1 payouts are rejected"):
        downgrade(scratch_url, "0017")
    assert asyncio.run(_run_sql(scratch_url)) == head_revision()


async def _seed_revoked_node(url: str) -> None:
    """A provider's two nodes, each a member of a pool: one revoked (banned), one healthy."""
    from orchestrator.identity.models import Node, Provider
    from orchestrator.pools.models import PoolMembership

    provider, revoked, kept = "P" * 43, "R" * 43, "K" * 43
    engine = create_async_engine(url)
    try:
        async with engine.begin() as conn:
            await _seed_pool(conn)
            await conn.execute(Provider.__table__.insert(), [{"id": provider, "created_at": AT}])
            await conn.execute(
                Node.__table__.insert(),
                [
                    node_row(revoked, provider, AT, status="banned", revoked_at=AT),
                    node_row(kept, provider, AT, revoked_at=None),
                ],
            )
            await conn.execute(
                PoolMembership.__table__.insert(),
                [
                    {
                        "id": 1,
                        "pool_id": "pool-mig",
                        "node_id": revoked,
                        "provider_id": provider,
                        "status": "ejected",
                    },
                    {
                        "id": 2,
                        "pool_id": "pool-mig",
                        "node_id": kept,
                        "provider_id": provider,
                        "status": "active",
                    },
                ],
            )
    finally:
        await engine.dispose()


def test_0039_downgrade_refuses_while_a_node_is_revoked(scratch_url: str) -> None:
    # 0038 would see a plain ban, which an admin's unban lifts: the key of a stolen machine
    # would work again.
    upgrade(scratch_url, "0039")
    asyncio.run(_seed_revoked_node(scratch_url))
    with pytest.raises(RuntimeError, match="1 nodes were revoked"):
        downgrade(scratch_url, "0038")
    assert asyncio.run(_run_sql(scratch_url)) == "0039"
    revoked = "SELECT id, status FROM nodes WHERE revoked_at IS NOT NULL"
    assert asyncio.run(_rows(scratch_url, revoked)) == [("R" * 43, "banned")]

    # Without a revocation the downgrade goes ahead, and the rebuilt table keeps its nodes and
    # the rows that refer to them.
    asyncio.run(_run_sql(scratch_url, "UPDATE nodes SET revoked_at = NULL"))
    downgrade(scratch_url, "0038")
    upgrade(scratch_url)
    nodes = "SELECT n.id, n.status, n.revoked_at, m.status FROM nodes n JOIN pool_memberships m ON m.node_id = n.id"
    assert sorted(asyncio.run(_rows(scratch_url, nodes))) == [
        ("K" * 43, "healthy", None, "active"),
        ("R" * 43, "banned", None, "ejected"),
    ]


def test_0040_gives_existing_pools_the_default_canary_rule_and_its_downgrade_drops_it(
    scratch_url: str,
) -> None:
    """Pools made before 0040 judge a canary missed at a temperature by the defaults (fraud as
    the 3rd miss of the node's last 10 canaries). The downgrade drops the columns (the pools'
    and the submissions') and keeps the pools."""
    upgrade(scratch_url, "0039")
    asyncio.run(_seed_pools_with_leases(scratch_url, {"pool-a": 60}))
    upgrade(scratch_url, "0040")
    canary_rule = "SELECT id, canary_miss_limit, canary_window FROM pools"
    assert asyncio.run(_rows(scratch_url, canary_rule)) == [("pool-a", 3, 10)]
    downgrade(scratch_url, "0039")
    for table in ("pools", "submissions"):
        assert not {"canary_miss_limit", "canary_window"} & asyncio.run(_column_names(scratch_url, table))
    assert asyncio.run(_rows(scratch_url, "SELECT id FROM pools")) == [("pool-a",)]
    upgrade(scratch_url)
    assert asyncio.run(_rows(scratch_url, canary_rule)) == [("pool-a", 3, 10)]


async def _column_names(url: str, table: str) -> set[str]:
    engine = create_async_engine(url)
    try:
        async with engine.connect() as conn:
            return await conn.run_sync(lambda c: {col["name"] for col in inspect(c).get_columns(table)})
    finally:
        await engine.dispose()


def test_0041_downgrade_refuses_while_an_appeal_paid_a_reward(scratch_url: str) -> None:
    # 0040 cannot record what an appeal paid: upgraded again, it would be 0, and the pools'
    # stats and reward budgets (0042) would forget money the ledger paid.
    upgrade(scratch_url, "0041")
    asyncio.run(_seed_ended_tasks(scratch_url))
    asyncio.run(_seed_forfeited_holds(scratch_url))
    paid = "UPDATE verdicts SET reversed_at = :at, reward_paid_on_appeal = 3 WHERE id = 5"
    asyncio.run(_run_sql(scratch_url, paid, at=AT))
    with pytest.raises(RuntimeError, match="1 verdicts were reversed on appeal with a reward paid"):
        downgrade(scratch_url, "0040")
    assert asyncio.run(_run_sql(scratch_url)) == "0041"
    assert asyncio.run(_rows(scratch_url, "SELECT reward_paid_on_appeal FROM verdicts WHERE id = 5")) == [
        (3,)
    ]

    asyncio.run(_run_sql(scratch_url, "UPDATE verdicts SET reward_paid_on_appeal = 0"))
    downgrade(scratch_url, "0040")
    assert "reward_paid_on_appeal" not in asyncio.run(_column_names(scratch_url, "verdicts"))
    upgrade(scratch_url)


def test_0042_counts_what_each_nodes_verdicts_credited_and_leaves_pools_without_a_budget(
    scratch_url: str,
) -> None:
    # The verdicts of node N in pool-mig: valid 1, 2, 4, 6 and 7 (7 each), fraud 3 and 5 (none).
    upgrade(scratch_url, "0041")
    asyncio.run(_seed_ended_tasks(scratch_url))
    asyncio.run(_seed_forfeited_holds(scratch_url))
    trust = (
        "INSERT INTO node_trust (pool_id, node_id, provider_id, consecutive_valid, valid, invalid, "
        "fraud, strikes, updated_at) VALUES ('pool-mig', :node, :provider, 0, 0, 0, 0, 0, :at)"
    )
    asyncio.run(_run_sql(scratch_url, trust, node="N" * 43, provider="P" * 43, at=AT))
    asyncio.run(_run_sql(scratch_url, trust, node="M" * 43, provider="P" * 43, at=AT))  # none
    asyncio.run(_run_sql(scratch_url, "UPDATE verdicts SET reversed_at = :at WHERE id = 6", at=AT))
    # Fraud verdict 5's appeal paid 3 (0041).
    asyncio.run(
        _run_sql(
            scratch_url,
            "UPDATE verdicts SET reversed_at = :at, reward_paid_on_appeal = 3 WHERE id = 5",
            at=AT,
        )
    )
    upgrade(scratch_url)
    # As the stats count rewards_credited: 6 was reversed on appeal, and 5's appeal paid 3.
    credited = "SELECT node_id, rewards_credited FROM node_trust ORDER BY node_id"
    assert asyncio.run(_rows(scratch_url, credited)) == [("M" * 43, 0), ("N" * 43, 31)]
    pools = "SELECT id, status, reward_budget, status_reason FROM pools"
    assert asyncio.run(_rows(scratch_url, pools)) == [("pool-mig", "active", None, None)]

    # A pool paused for its budget stays paused without it.
    asyncio.run(
        _run_sql(
            scratch_url,
            "UPDATE pools SET status = 'paused', reward_budget = 28, status_reason = 'budget_spent'",
        )
    )
    downgrade(scratch_url, "0041")
    assert asyncio.run(_rows(scratch_url, "SELECT id, status FROM pools")) == [("pool-mig", "paused")]
    upgrade(scratch_url)
    assert asyncio.run(_rows(scratch_url, pools)) == [("pool-mig", "paused", None, None)]
    assert asyncio.run(_rows(scratch_url, credited)) == [("M" * 43, 0), ("N" * 43, 31)]


def test_0043_downgrade_refuses_while_a_provider_is_retired(scratch_url: str) -> None:
    # 0042 would see a plain provider: its key, lost or stolen, would be accepted again, and what
    # it still has maturing would no longer go to its successor.
    upgrade(scratch_url, "0043")
    retired, successor = "P" * 43, "S" * 43
    asyncio.run(
        _run_sql(
            scratch_url,
            "INSERT INTO providers (id, created_at) VALUES (:successor, :at)",
            "INSERT INTO providers (id, created_at, retired_at, successor_id, retirement_reason, "
            "retirement_key, retired_by) VALUES (:retired, :at, :at, :successor, 'key lost', "
            "'retire-0001', 'tok_admin')",
            retired=retired,
            successor=successor,
            at=AT,
        )
    )
    with pytest.raises(RuntimeError, match="1 providers are retired"):
        downgrade(scratch_url, "0042")
    assert asyncio.run(_run_sql(scratch_url)) == "0043"
    found = "SELECT id, successor_id FROM providers WHERE retired_at IS NOT NULL"
    assert asyncio.run(_rows(scratch_url, found)) == [(retired, successor)]

    # A retirement is recorded whole or not at all.
    with pytest.raises(Exception, match=r"(?i)retirement_complete|constraint"):
        asyncio.run(_run_sql(scratch_url, "UPDATE providers SET retirement_key = NULL"))

    # Without a retirement the downgrade goes ahead, and the providers stay.
    asyncio.run(
        _run_sql(
            scratch_url,
            "UPDATE providers SET retired_at = NULL, successor_id = NULL, retirement_reason = NULL, "
            "retirement_key = NULL, retired_by = NULL",
        )
    )
    downgrade(scratch_url, "0042")
    assert sorted(asyncio.run(_rows(scratch_url, "SELECT id FROM providers"))) == [(retired,), (successor,)]
    upgrade(scratch_url)
    assert asyncio.run(_rows(scratch_url, found)) == []


def test_0044_downgrade_refuses_while_an_appeals_payment_was_forfeited_on_appeal(scratch_url: str) -> None:
    # 0043 could not say which fraud verdict forfeited an appeal's payment: the pools' slashed
    # totals would forget money the ledger moved to slashed.
    upgrade(scratch_url, "0044")
    asyncio.run(_seed_ended_tasks(scratch_url))
    asyncio.run(_seed_forfeited_holds(scratch_url))
    forfeited = "UPDATE verdicts SET reversed_at = :at, reward_paid_on_appeal = 3, reward_forfeited_by = 3 WHERE id = 5"
    asyncio.run(_run_sql(scratch_url, forfeited, at=AT))
    with pytest.raises(
        RuntimeError, match="1 verdicts were reversed on appeal with a reward paid and forfeited"
    ):
        downgrade(scratch_url, "0043")
    assert asyncio.run(_run_sql(scratch_url)) == "0044"
    assert asyncio.run(_rows(scratch_url, "SELECT reward_forfeited_by FROM verdicts WHERE id = 5")) == [(3,)]

    asyncio.run(_run_sql(scratch_url, "UPDATE verdicts SET reward_forfeited_by = NULL"))
    downgrade(scratch_url, "0043")
    assert "reward_forfeited_by" not in asyncio.run(_column_names(scratch_url, "verdicts"))
    upgrade(scratch_url)


def test_0044_downgrade_refuses_while_a_penalty_took_part_of_a_payment(scratch_url: str) -> None:
    # An invalid verdict's soft penalty took, at the appeal, what the rewards on hold lacked of
    # it from the payment (its own forfeit, keyed by the appeal; reward_forfeited_by stays NULL):
    # revision 0043's slashed totals would forget it as they would a fraud verdict's forfeit.
    upgrade(scratch_url, "0044")
    asyncio.run(_seed_ended_tasks(scratch_url))
    asyncio.run(_seed_forfeited_holds(scratch_url))
    paid = "UPDATE verdicts SET reversed_at = :at, reward_paid_on_appeal = 3 WHERE id = 5"
    part = (
        "INSERT INTO ledger_transfers (id, debit_account_id, credit_account_id, amount, idempotency_key, "
        "reason, actor, created_at, reference_type, reference_id) VALUES (10, 1, 2, 2, "
        "'verdict:5:reverse:reward:forfeit:3', 'soft_invalid_penalty', 'admin', :at, 'verdict', '3')"
    )
    asyncio.run(_run_sql(scratch_url, paid, part, at=AT))
    with pytest.raises(RuntimeError, match="1 forfeits by soft-invalid penalties of what appeals paid"):
        downgrade(scratch_url, "0043")
    assert asyncio.run(_run_sql(scratch_url)) == "0044"
    assert "reward_forfeited_by" in asyncio.run(_column_names(scratch_url, "verdicts"))
    # (Without it the downgrade goes ahead: the test above. The ledger is append-only on
    # PostgreSQL, so the transfer stays, and so does the refusal, as 0041's for the payment.)


async def _reverse_seeded(
    url: str, reversals: dict[int, dt.datetime], decided: dict[int, dt.datetime]
) -> None:
    """Date the seeded verdicts' decisions (``decided``) and reversals (``reversals``)."""
    from orchestrator.verification.models import Verdict

    verdicts = Verdict.__table__
    engine = create_async_engine(url)
    try:
        async with engine.begin() as conn:
            await conn.execute(verdicts.update().values(reversed_at=None))
            for i, at in decided.items():
                await conn.execute(verdicts.update().where(verdicts.c.id == i).values(decided_at=at))
            for i, at in reversals.items():
                await conn.execute(verdicts.update().where(verdicts.c.id == i).values(reversed_at=at))
    finally:
        await engine.dispose()


def test_0045_gives_earlier_reversals_the_place_their_time_gave_them(scratch_url: str) -> None:
    # Node N's verdicts: valid 1, 2, 4, 6, 7 and fraud 3, 5, all dated AT but fraud 5, an hour
    # later. Before 0045 a reversal came after the latest fraud or invalid verdict dated no later
    # than it, or its own verdict if later: so it does now, written down.
    upgrade(scratch_url, "0044")
    asyncio.run(_seed_ended_tasks(scratch_url))
    asyncio.run(_seed_forfeited_holds(scratch_url))
    hour = dt.timedelta(hours=1)
    asyncio.run(
        _reverse_seeded(
            scratch_url,
            {3: AT + hour, 5: AT + 2 * hour, 6: AT},  # 3: after fraud 5 (dated AT + 1 h); 6: its own
            {5: AT + hour},
        )
    )
    upgrade(scratch_url)
    placed = "SELECT id, reversed_after FROM verdicts ORDER BY id"
    expected = [(1, None), (2, None), (3, 5), (4, None), (5, 5), (6, 6), (7, None)]
    assert asyncio.run(_rows(scratch_url, placed)) == expected
    downgrade(scratch_url, "0044")
    assert "reversed_after" not in asyncio.run(_column_names(scratch_url, "verdicts"))
    upgrade(scratch_url)
    assert asyncio.run(_rows(scratch_url, placed)) == expected

    # A reversal placed elsewhere than its time places it (one 0045 placed, written after fraud
    # 5 but dated before it) would go back to its time's place, wrong, with an upgrade after the
    # downgrade: the downgrade refuses while there is one.
    head = asyncio.run(_run_sql(scratch_url, "UPDATE verdicts SET reversed_after = 7 WHERE id = 6"))
    with pytest.raises(RuntimeError, match="1 reversals"):
        downgrade(scratch_url, "0044")
    assert asyncio.run(_run_sql(scratch_url)) == head  # rolled back whole
    assert asyncio.run(_rows(scratch_url, placed))[5] == (6, 7)
