"""A transaction the database aborts only to resolve contention (a deadlock on PostgreSQL, the
busy timeout on SQLite) wrote nothing: the client gets a 503 ``transient_conflict`` with
``Retry-After``, which the worker SDK retries even for claims, and not a 500."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.exc import DBAPIError

from orchestrator.core.errors import transient_cause
from orchestrator.core.state import Session
from tests.conftest import postgres_only
from tests.waits import until_waiting

PROBE = "test_deadlock_probe"


@pytest.fixture
async def probe_table(app_state: Any) -> AsyncIterator[None]:
    async with app_state.engine.begin() as conn:
        await conn.execute(text(f"DROP TABLE IF EXISTS {PROBE}"))
        await conn.execute(text(f"CREATE TABLE {PROBE} (id integer PRIMARY KEY, v text NOT NULL)"))
        await conn.execute(text(f"INSERT INTO {PROBE} VALUES (1, 'start'), (2, 'start')"))
    try:
        yield
    finally:
        async with app_state.engine.begin() as conn:
            await conn.execute(text(f"DROP TABLE {PROBE}"))


@postgres_only
async def test_a_deadlocked_request_is_a_503_to_retry_and_writes_nothing(
    app: Any, app_state: Any, client: httpx.AsyncClient, probe_table: None
) -> None:
    route_holds_row_2 = asyncio.Event()

    async def probe(session: Session) -> dict[str, str]:
        # PostgreSQL looks for a cycle once, deadlock_timeout after a wait starts; this one's
        # look comes first and finds it, so this transaction is the one aborted.
        await session.execute(text("SET LOCAL deadlock_timeout = '1s'"))
        await session.execute(text(f"UPDATE {PROBE} SET v = 'request' WHERE id = 2"))
        route_holds_row_2.set()
        await session.execute(text(f"UPDATE {PROBE} SET v = 'request' WHERE id = 1"))
        return {"ok": "unreachable"}

    app.add_api_route("/test/deadlock", probe, methods=["POST"])
    async with app_state.engine.connect() as other:
        await other.execute(text("SET LOCAL deadlock_timeout = '10s'"))
        await other.execute(text(f"UPDATE {PROBE} SET v = 'other' WHERE id = 1"))
        request = asyncio.create_task(client.post("/test/deadlock"))
        await asyncio.wait_for(route_holds_row_2.wait(), 10)
        await until_waiting(app_state, 1, request, on="row")  # the request now waits for row 1
        await other.execute(text(f"UPDATE {PROBE} SET v = 'other' WHERE id = 2"))  # the cycle
        r = await asyncio.wait_for(request, 10)
        await other.commit()

    assert r.status_code == 503, r.text
    assert r.headers["content-type"] == "application/problem+json"
    assert r.headers["retry-after"] == "1"
    problem = r.json()
    assert problem["code"] == "transient_conflict" and problem["cause"] == "deadlock_detected"
    assert "nothing was recorded" in problem["detail"]
    # Its nonce is spent: the detail says to sign the retry afresh, as PROTOCOL does.
    assert "signed afresh, with a new nonce" in problem["detail"]
    async with app_state.engine.connect() as conn:
        rows = dict((await conn.execute(text(f"SELECT id, v FROM {PROBE}"))).all())
    assert rows == {1: "other", 2: "other"}  # the request's write to row 2 was rolled back


async def test_other_database_errors_stay_a_500_without_details(app: Any, client: httpx.AsyncClient) -> None:
    async def broken(session: Session) -> None:
        await session.execute(text("SELECT * FROM no_such_table"))

    app.add_api_route("/test/broken", broken, methods=["POST"])
    r = await client.post("/test/broken")
    assert r.status_code == 500
    assert r.json()["code"] == "internal_error"
    assert "no_such_table" not in r.text and "retry-after" not in r.headers


def test_sqlites_busy_timeout_counts_as_transient(tmp_path: Path) -> None:
    engine = create_engine(f"sqlite:///{tmp_path / 'busy.db'}", connect_args={"timeout": 0})
    with engine.connect() as holder:
        holder.execute(text("CREATE TABLE t (x integer)"))
        holder.commit()
        holder.exec_driver_sql("BEGIN IMMEDIATE")
        with engine.connect() as writer, pytest.raises(DBAPIError) as caught:
            writer.execute(text("INSERT INTO t VALUES (1)"))
        holder.rollback()
    engine.dispose()
    assert transient_cause(caught.value) == "database_locked"
