"""A Redis that answers but refuses writes: out of memory under ``noeviction`` (``OOM command not
allowed``), or a primary demoted to a read-only replica by a failover while the clients still
talk to it (``READONLY``). It answers PING, so it looked up, while no nonce, beat or counter
could be written."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import OutOfMemoryError, ReadOnlyError, ResponseError
from sqlalchemy import select

from orchestrator.core.clock import FakeClock
from orchestrator.core.hotstore import RedisHotStore
from orchestrator.liveness.serving import ServingMark, mark_serving
from orchestrator.tasks.jobs import reap_once
from tests.conftest import problem
from tests.tasks_helpers import pool_setup, task

REFUSALS = [
    pytest.param(ReadOnlyError("You can't write against a read only replica."), id="read_only_replica"),
    pytest.param(OutOfMemoryError("command not allowed when used memory > 'maxmemory'."), id="out_of_memory"),
]


class _RefusingWrites(aioredis.Redis):
    """A client of a Redis that answers PING and refuses every other command with ``error``
    (a read-only replica refuses writes only, but every command the hot store sends writes,
    EVALSHA included; no server is contacted)."""

    def __init__(self, error: ResponseError) -> None:
        super().__init__(host="127.0.0.1", port=1)
        self.error = error

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        if args[0] == "PING":
            return True
        raise self.error


@pytest.mark.parametrize("error", REFUSALS)
async def test_a_redis_that_refuses_writes_is_no_serving_mark(app_state: Any, error: ResponseError) -> None:
    """The marks said the service could take beats while every beat was refused: the sweeper
    marked the fleet unhealthy 30 s and dead 90 s into such an outage, and the reaper expired
    their leases (seen with a Redis at its maxmemory). A process marks now only once its hot
    store has taken a write."""
    store = RedisHotStore(_RefusingWrites(error), "refusing:")
    with pytest.raises(type(error)):
        await mark_serving(dataclasses.replace(app_state, hot_store=store))
    async with app_state.sessionmaker() as session:
        assert (await session.execute(select(ServingMark))).first() is None


@pytest.mark.parametrize("error", REFUSALS)
async def test_requests_a_redis_refuses_are_503_to_send_again(
    app: Any, app_state: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch, error: ResponseError
) -> None:
    """They were 500 internal_error, which the worker takes as a refusal of the result itself:
    it gave the lease back and dropped the work it had done. They are 503 hot_store_unavailable
    with Retry-After, as for a Redis that does not answer, and the worker submits the result
    again until it is taken."""
    async with pool_setup(app, app_state, workers=1, lease_duration_s=600) as s:
        [w] = s.workers
        await s.enqueue([task()])
        lease = (await w.claim(s.pool_id)).json()["leases"][0]

        async def refuse(*args: Any, **kwargs: Any) -> Any:
            raise error

        for name in ("admit", "record_beat"):
            monkeypatch.setattr(app_state.hot_store, name, refuse)
        for r in (await w.submit(lease), await w.beat()):
            problem(r, 503, "hot_store_unavailable")
            assert r.headers["Retry-After"] == "1"
        monkeypatch.undo()

        assert (await reap_once(app_state)).expired == 0
        assert (await w.submit(lease)).status_code == 201
