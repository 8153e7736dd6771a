"""One process per database while the hot store is in-process.

The in-process hot store keeps nonces, liveness and rate limits in the process's memory. Two
processes serving one database with it (``uvicorn --workers 2``, a second ``orchestrator serve``
started by hand or by a supervisor) would each accept a signed request the other already
accepted: replay protection, rate limits and liveness would all be per process. So a process
that makes its own in-process store first takes an exclusive lock on the database, held until
it stops, and refuses to start if another process holds it:

* SQLite file: ``flock`` on ``<database file>.instance.lock`` (released by the kernel when the
  process dies, however it dies);
* PostgreSQL: a session-level advisory lock on a connection kept for the process's lifetime
  (released by PostgreSQL when that connection ends);
* an in-memory SQLite database is private to its process already: no lock.

With Redis (``ORCH_REDIS__URL``) the store is shared, and any number of processes may serve.
"""

from __future__ import annotations

import contextlib
import fcntl
from typing import IO

from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

# pg_try_advisory_lock's key: the bytes "orchstor" as a signed 64-bit integer.
ADVISORY_KEY = int.from_bytes(b"orchstor", "big", signed=True)


class InstanceLocked(RuntimeError):
    """Another process already serves this database with an in-process hot store."""

    def __init__(self, where: str) -> None:
        super().__init__(
            f"another orchestrator process already serves this database ({where}) with the "
            "in-process hot store, which cannot be shared: each process would accept signed "
            "requests the other had already seen. Run a single process (orchestrator serve "
            "--workers 1), or set ORCH_REDIS__URL=redis://... to share the store between processes."
        )


class InstanceLock:
    """Held from ``acquire`` to ``release``; see the module docstring."""

    def __init__(self) -> None:
        self._file: IO[bytes] | None = None
        self._conn: AsyncConnection | None = None

    async def acquire(self, engine: AsyncEngine) -> None:
        url = make_url(engine.url)
        if url.get_backend_name() == "sqlite":
            if url.database and url.database != ":memory:" and not url.database.startswith("file::memory:"):
                self._lock_file(url.database + ".instance.lock")
            return
        conn = await engine.connect()
        conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
        got = (await conn.execute(text("SELECT pg_try_advisory_lock(:key)"), {"key": ADVISORY_KEY})).scalar()
        if not got:
            await conn.close()
            raise InstanceLocked(f"PostgreSQL database {url.database!r}")
        self._conn = conn

    def _lock_file(self, path: str) -> None:
        handle = open(path, "ab")  # held open (and locked) until release()
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            raise InstanceLocked(f"lock file {path}") from None
        self._file = handle

    async def release(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
            self._file.close()
            self._file = None
        if self._conn is not None:
            with contextlib.suppress(Exception):
                await self._conn.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": ADVISORY_KEY})
            await self._conn.close()
            self._conn = None
