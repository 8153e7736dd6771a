"""A database that cannot be reached, or that drops a request's connection, is a 503
``database_unavailable`` with ``Retry-After`` (which workers retry, submissions included), not a
500 ``internal_error``: a worker gave its result up on the 500 and the lease stayed held."""

from __future__ import annotations

from typing import Any

import httpx
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from orchestrator.core.state import Session
from tests.conftest import postgres_only
from tests.process_helpers import free_port


def assert_unavailable(r: httpx.Response) -> None:
    assert r.status_code == 503, r.text
    assert r.headers["content-type"] == "application/problem+json"
    assert r.headers["retry-after"] == "5"
    assert r.json()["code"] == "database_unavailable"


async def test_a_database_that_refuses_connections_is_a_503_to_retry(
    app: Any, client: httpx.AsyncClient
) -> None:
    # What the app's engine raises when PostgreSQL is down: nothing listens on the port.
    engine = create_async_engine(f"postgresql+asyncpg://postgres@127.0.0.1:{free_port()}/none")

    async def down() -> None:
        async with engine.connect() as conn:
            await conn.execute(text("SELECT 1"))

    app.add_api_route("/test/database-down", down, methods=["POST"])
    try:
        assert_unavailable(await client.post("/test/database-down"))
    finally:
        await engine.dispose()


@postgres_only
async def test_a_request_whose_connection_the_database_ends_is_a_503_to_retry(
    app: Any, client: httpx.AsyncClient
) -> None:
    async def terminated(session: Session) -> None:
        # What an administrator's pg_terminate_backend, or a database restart, does to it.
        await session.execute(text("SELECT pg_terminate_backend(pg_backend_pid())"))

    app.add_api_route("/test/terminated", terminated, methods=["POST"])
    assert_unavailable(await client.post("/test/terminated"))
    assert (await client.get("/readyz")).status_code == 200  # the pool replaced the connection
