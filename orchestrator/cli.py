"""The ``orchestrator`` command: serve, migrate, admin and key tools."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Column, Table

from orchestrator.settings import LOG_LEVELS, Settings, get_settings

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

T = TypeVar("T")


def _typer(help_text: str) -> typer.Typer:
    # Help text is the commands' docstrings, wrapped in the source: in markdown mode Typer joins
    # their lines into paragraphs and wraps them at the terminal's width (Rich markup mode kept
    # every source line break, so the command list broke lines mid-sentence).
    return typer.Typer(help=help_text, no_args_is_help=True, rich_markup_mode="markdown")


app = _typer("Coordinator for permissionless compute pools.")
admin_app = _typer("Operator tokens and other admin tasks.")
keys_app = _typer("Ed25519 key files for providers and nodes.")
worker_app = _typer("Contribute compute: run a worker node.")
provider_app = _typer("A provider's balance, withdrawals, payouts and nodes (signed with its key).")
app.add_typer(admin_app, name="admin")
app.add_typer(keys_app, name="keys")
app.add_typer(worker_app, name="worker")
app.add_typer(provider_app, name="provider")
# Messages are not hard-wrapped at the terminal's width: a path, a URL or a database error in
# them stays one line that can be copied (or grepped, in a log) whole.
console = Console(stderr=True, soft_wrap=True)


def _settings() -> Settings:
    """``get_settings()``; an ORCH_* value that does not validate is one line per error, naming
    the variable, and exit 2, rather than a traceback."""
    from pydantic import BaseModel, ValidationError
    from pydantic_settings import SettingsError

    try:
        return get_settings()
    except SettingsError:
        # A list setting (ORCH_SERVER__ALLOWED_HOSTS) whose value is not JSON: pydantic-settings
        # fails before validation, naming only the group, in a traceback.
        example = '["api.example.org"]'
        for name in _settings_not_json() or ["ORCH_*"]:
            message = f"invalid setting {name}: not JSON; a list setting takes a JSON list, e.g. {example}"
            console.print(escape(message), style="red")
        raise typer.Exit(2) from None
    except ValidationError as exc:
        groups = {
            name
            for name, field in Settings.model_fields.items()
            if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
        }
        for error in exc.errors():
            loc = [str(part) for part in error["loc"]]
            message = error["msg"].removeprefix("Value error, ")
            if not loc:  # a rule over several settings: the message names them
                what = "invalid settings"
            elif len(loc) == 1 and loc[0] in groups:  # a rule over one group's settings
                what = f"invalid setting ORCH_{loc[0].upper()}__*"
            else:
                what = "invalid setting ORCH_" + "__".join(loc).upper()
            # Not the value given: it may be a secret (a password in a URL).
            console.print(escape(f"{what}: {message}"), style="red")
        raise typer.Exit(2) from None


def _settings_not_json() -> list[str]:
    """The ORCH_* variables of list settings whose value does not parse as JSON."""
    import typing

    from pydantic import BaseModel

    environ = {key.upper(): value for key, value in os.environ.items()}
    names = []
    for group, field in Settings.model_fields.items():
        if not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            continue
        for name, inner in field.annotation.model_fields.items():
            variable = f"ORCH_{group}__{name}".upper()
            if typing.get_origin(inner.annotation) in (list, dict, set, tuple) and variable in environ:
                try:
                    json.loads(environ[variable])
                except ValueError:
                    names.append(variable)
    return names


def check_process_model(settings: Settings, workers: int) -> None:
    """The in-process hot store cannot be shared: refuse to run it in several processes."""
    if workers > 1 and settings.redis_url is None:
        raise typer.BadParameter(
            f"--workers {workers} needs a shared hot store: the in-process store (used when "
            "ORCH_REDIS__URL is unset) would give each process its own nonces, liveness and rate "
            "limits. Set ORCH_REDIS__URL=redis://... or run a single worker.",
            param_hint="--workers",
        )


@app.command()
def serve(
    host: Annotated[str | None, typer.Option(help="Bind address [ORCH_SERVER__HOST]")] = None,
    # The bounds ORCH_SERVER__PORT and ORCH_SERVER__WORKERS have: a port past 65535 was taken
    # modulo 65536 by the socket while uvicorn announced the number given.
    port: Annotated[int | None, typer.Option(min=1, max=65535, help="Port [ORCH_SERVER__PORT]")] = None,
    workers: Annotated[
        int | None, typer.Option(min=1, max=64, help="Worker processes [ORCH_SERVER__WORKERS]")
    ] = None,
    migrate: Annotated[
        bool | None, typer.Option(help="Upgrade the schema first [ORCH_SERVER__MIGRATE_ON_START]")
    ] = None,
) -> None:
    """Run the API server (uvicorn)."""
    import uvicorn

    settings = _settings()
    n = workers or settings.server.workers
    check_process_model(settings, n)
    bind = (host or settings.server.host, port or settings.server.port)
    _require_free_port(*bind)
    if migrate if migrate is not None else settings.server.migrate_on_start:
        from orchestrator.core.migrate import current_revision, known_revision, upgrade

        with _database_errors(settings.db.url):
            current = current_revision(settings.db.url)
            if current is not None and not known_revision(current):
                _require_current_schema(settings.db.url)  # the warning, as with --no-migrate
            else:
                upgrade(settings.db.url)
    else:
        _require_current_schema(settings.db.url)
    if settings.redis_url is None:
        _refuse_a_second_instance(settings)
    from orchestrator.core.http_protocol import BoundedHeadProtocol

    if n > 1:  # this process only supervises: no series of its own (its clock offset stayed 0)
        from orchestrator.core import metrics

        metrics.process_ended()
    uvicorn.run(
        "orchestrator.app:serve_app",
        factory=True,
        host=bind[0],
        port=bind[1],
        workers=n,
        http=BoundedHeadProtocol,
        proxy_headers=settings.server.trust_proxy_headers,
        forwarded_allow_ips=settings.server.forwarded_allow_ips
        if settings.server.trust_proxy_headers
        else None,
        access_log=False,
        log_level=settings.log_level.lower(),
        timeout_worker_healthcheck=WORKER_HEALTHCHECK_TIMEOUT_S,
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
    )


# How long uvicorn's supervisor waits for a worker to answer its ping (every half second) before it
# kills the worker as hung and starts another. A worker answers only once it has started, which
# takes seconds of imports, and more on a busy host or under a container's CPU limit: at uvicorn's
# 5 s the supervisor killed its own workers as they started, and with starts slower than that
# never served. The answer comes from a thread of its own, not the event loop, so only a process
# that is wholly stuck misses it.
WORKER_HEALTHCHECK_TIMEOUT_S = 60

# On SIGTERM (or SIGINT) uvicorn stops accepting, closes idle keep-alive connections and lets the
# requests under way finish: for this long at most, then it cancels them (their transactions roll
# back, or stand whole if they had committed, unanswered) and the app stops its loops
# (core.loops.STOP_GRACE_S). uvicorn's default is no bound: one client whose upload stalled
# mid-body (a worker whose link died with no FIN or RST to say so) or a slow reader of a
# streamed export kept the server from stopping for as long as its connection lived.
SHUTDOWN_GRACE_S = 5


def _require_free_port(host: str, port: int, option: str = "--port or ORCH_SERVER__PORT") -> None:
    """An address already in use is one line and exit 2 before the schema is touched. Without
    this check the app started, logged "started" and migrated, and only then did uvicorn fail
    to bind (its error among the start-up and shutdown lines, exit 3)."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        _cannot_listen(host, port, exc, option)
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as exc:
            _cannot_listen(host, port, exc, option)


def _cannot_listen(host: str, port: int, exc: OSError, option: str) -> NoReturn:
    """One red line and exit 2 for an address that cannot be bound."""
    import socket

    line = f"cannot serve on {host}:{port}: {exc.strerror or exc}"
    if not isinstance(exc, socket.gaierror):
        line += f" (another process has it? pick another with {option})"
    console.print(escape(line), style="red", soft_wrap=True)
    raise typer.Exit(2)


def _require_current_schema(url: str) -> None:
    """Without migrating at start: a database that cannot be reached, or that holds no schema or
    an older one than this version needs, is one line and exit 2 before anything runs, rather
    than a process whose every request or tick then fails. A newer schema (a revision this
    version does not know, as while a rolling upgrade has migrated ahead of it) is let through
    with a warning, so that the previous version's replicas can still (re)start meanwhile."""
    from sqlalchemy.engine import make_url

    from orchestrator.core.migrate import current_revision, head_revision, known_revision

    with _database_errors(url):
        current = current_revision(url)
    head = head_revision()
    if current == head:
        return
    where = make_url(url).render_as_string(hide_password=True)
    if current is not None and not known_revision(current):
        console.print(
            escape(
                f"warning: the database {where} has the schema of revision {current}, newer than "
                f"this version's {head}"
            ),
            style="yellow",
        )
        return
    state = "holds no schema" if current is None else f"has the schema of revision {current}"
    console.print(
        escape(
            f"the database {where} {state}; this version needs revision {head}: run "
            "`orchestrator migrate` with the same ORCH_DB__URL first"
        ),
        style="red",
    )
    raise typer.Exit(2)


def _refuse_a_second_instance(settings: Settings) -> None:
    """With the in-process hot store, another process serving this database is said in one line
    (exit 2) before uvicorn starts. The app takes the lock for good at start-up; a refusal there
    would be uvicorn's traceback of the lifespan, the reason on its last lines."""
    from orchestrator.core.db import make_engine
    from orchestrator.core.instance_lock import InstanceLock, InstanceLocked

    async def probe() -> None:
        engine = make_engine(settings.db)
        lock = InstanceLock()
        try:
            await lock.acquire(engine)
            await lock.release()
        finally:
            await engine.dispose()

    try:
        with _database_errors(settings.db.url):
            asyncio.run(probe())
    except InstanceLocked as exc:
        console.print(escape(str(exc)), style="red")
        raise typer.Exit(2) from None


@app.command("background")
def background_cmd(
    alive_file: Annotated[
        Path | None,
        typer.Option(help="Rewrite this file every 5 s while the event loop runs, for `orchestrator alive`"),
    ] = None,
    metrics_port: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=65535,
            help="Serve Prometheus metrics on this port at /metrics: verdicts, rewards credited, stake "
            "slashed, failed ticks, this host's clock offset from the database server's",
        ),
    ] = None,
    metrics_host: Annotated[
        str, typer.Option(help="Bind address of --metrics-port (0.0.0.0 in a container)")
    ] = "127.0.0.1",
) -> None:
    """Run only the background loops (liveness sweeper and reconciler, lease reaper, verifier,
    reward and stake releases, ReST^EM barrier), without serving HTTP. Start the API replicas with
    ORCH_SERVER__BACKGROUND_LOOPS=false and one or more of these beside them; each tick still runs
    once across processes, and verifiers share the backlog. Needs Redis and a shared database.
    With --metrics-port it serves what it measures to Prometheus."""
    _refuse_a_metrics_directory()
    from orchestrator import background
    from orchestrator.core.logging import configure_logging

    settings = _settings()
    if settings.redis_url is None or settings.db.is_sqlite:
        raise typer.BadParameter(
            "a separate background process must share the hot store and the database with the API "
            "processes: set ORCH_REDIS__URL=redis://... and a PostgreSQL ORCH_DB__URL (with the "
            "embedded default, keep the loops in `orchestrator serve`)"
        )
    if alive_file is not None:
        directory = alive_file.parent
        if not directory.is_dir() or not os.access(directory, os.W_OK | os.X_OK):
            raise typer.BadParameter(f"{directory} is not a writable directory", param_hint="--alive-file")
    if metrics_port is not None:
        _require_free_port(metrics_host, metrics_port, "--metrics-port")
    _require_redis(settings.redis_url)
    _require_current_schema(settings.db.url)
    metrics_server = None
    if metrics_port is not None:
        from orchestrator.core import metrics

        try:
            metrics_server, _ = metrics.serve_background(metrics_host, metrics_port)
        except OSError as exc:
            _cannot_listen(metrics_host, metrics_port, exc, "--metrics-port")
    configure_logging(settings.log_level, json=settings.log_json)
    asyncio.run(
        background.run(settings, alive_file=alive_file, metrics_server=metrics_server, exit_after_stop=True)
    )


def _refuse_a_metrics_directory() -> None:
    """``orchestrator background`` with ``PROMETHEUS_MULTIPROC_DIR`` set is one line and exit 2,
    before anything is imported that writes there. Its counters went into that directory, which
    is the API processes' (a variable set for every process, on one host or in a shared env
    file): their /metrics added its verdicts, rewards, slashes and failed ticks to their own and
    served them too, so a sum over both scrape targets counted each twice (and in another PID
    namespace, a process with the same PID shares its files). It serves what it measures itself,
    on --metrics-port, from its own memory: the directory is of no use to it."""
    directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if directory:
        console.print(
            escape(
                f"PROMETHEUS_MULTIPROC_DIR is set ({directory}): unset it for orchestrator background, "
                "which serves its own metrics on --metrics-port (in the API processes' directory its "
                "counters would show on their /metrics too and be counted twice)"
            ),
            style="red",
            soft_wrap=True,
        )
        raise typer.Exit(2)


def _require_redis(url: str) -> None:
    """Redis that does not answer at start is one line and exit 2, as a database that cannot be
    reached is; it used to start, then log a traceback for every tick of every loop."""
    import redis
    from sqlalchemy.engine import make_url

    client = redis.Redis.from_url(url, socket_connect_timeout=5, socket_timeout=5)
    try:
        client.ping()
    except redis.RedisError as exc:
        where = make_url(url).render_as_string(hide_password=True)
        why = str(exc).rstrip(".")
        console.print(
            escape(f"cannot reach Redis at {where}: {why}. Start it, or set ORCH_REDIS__URL to it."),
            style="red",
            soft_wrap=True,
        )
        raise typer.Exit(2) from None
    finally:
        client.close()


@app.command("alive")
def alive_cmd(
    alive_file: Annotated[Path, typer.Argument(help="What `background --alive-file` writes")],
    max_age: Annotated[float, typer.Option(help="Seconds since its last write that count as alive")] = 30.0,
) -> None:
    """Liveness probe for `orchestrator background`: exit 0 if its alive file was written within
    --max-age seconds, 1 otherwise (missing, unreadable or stale). Its event loop writes the file,
    so a blocked event loop or a dead process fails the probe; a database outage does not."""
    from orchestrator.core.alive import ALIVE_INTERVAL_S, alive_age

    if not max_age >= 2 * ALIVE_INTERVAL_S:  # NaN too
        # Below that a healthy process, which writes every ALIVE_INTERVAL_S, fails some probes.
        raise typer.BadParameter(
            f"must be at least {2 * ALIVE_INTERVAL_S:g} s: the file is rewritten every "
            f"{ALIVE_INTERVAL_S:g} s",
            param_hint="'--max-age'",
        )

    age = alive_age(alive_file)
    if age is None:
        console.print(f"[red]not alive: {alive_file} is missing or unreadable, or holds no time[/red]")
        raise typer.Exit(1)
    if age > max_age:
        console.print(f"[red]not alive: {alive_file} was written {age:.1f} s ago (> {max_age:g} s)[/red]")
        raise typer.Exit(1)
    console.print(f"alive: written {age:.1f} s ago")


@app.command("migrate")
def migrate_cmd(
    revision: Annotated[
        str | None, typer.Option(help="Target revision (upgrade: default head; downgrade: required)")
    ] = None,
    downgrade: Annotated[
        bool, typer.Option(help="Downgrade to --revision (e.g. -1, 0014, or base: every table dropped)")
    ] = False,
) -> None:
    """Upgrade (or downgrade) the database schema."""
    from alembic.util import CommandError

    from orchestrator.core import migrate

    url = _settings().db.url
    if downgrade and (revision is None or revision == "head"):
        raise typer.BadParameter(
            "a downgrade needs the revision to go down to: -1 (one step), a revision id such as "
            "0014, or base (drops every table and its data)",
            param_hint="--revision",
        )
    target = revision or "head"
    try:
        with _database_errors(url):
            if downgrade:
                migrate.downgrade(url, target)
            else:
                migrate.upgrade(url, target)
    except CommandError as exc:  # no such revision, or one on the wrong side of the current one
        if revision in (None, "head"):  # not the argument's fault: the schema is at one this version lacks
            current = migrate.current_revision(url)
            reason = (
                f"the database has the schema of revision {current}, which this version (at "
                f"{migrate.head_revision()}) does not know: a newer version migrated it. Nothing was changed"
                if current is not None and not migrate.known_revision(current)
                else f"cannot migrate: {exc}"
            )
            console.print(escape(reason), style="red")
            raise typer.Exit(2) from None
        raise typer.BadParameter(str(exc), param_hint="--revision") from None
    except RuntimeError as exc:
        if not downgrade or isinstance(exc, typer.Exit):  # typer.Exit is a RuntimeError too
            raise
        # A revision's downgrade refuses data the older schema cannot hold (a requested payout
        # in a run...); the run is one transaction, rolled back whole.
        console.print(f"[red]downgrade refused, the schema is unchanged:[/red] {exc}")
        raise typer.Exit(1) from None
    reached = migrate.current_revision(url)
    if not downgrade and revision is not None and migrate.known_revision(revision) and reached != revision:
        # Alembic's upgrade to a revision below the current one does nothing, successfully.
        console.print(
            f"[red]schema left at {reached}: {revision} is below it, and an upgrade does not go "
            "down (pass --downgrade to go down to it)[/red]"
        )
        raise typer.Exit(2)
    console.print(f"[green]schema {'downgraded to' if downgrade else 'at'} {reached or 'base'}[/green]")


class NoSchema(Exception):
    """The configured database has no orchestrator schema (or, on SQLite, no file)."""


def _connect_failure(url: str, exc: BaseException) -> str | None:
    """One line saying why the database at ``url`` could not be used and what to do, if ``exc``
    is a failure to reach it or to be let in; None for any other error (which keeps its
    traceback). The URL is shown without its password."""
    import socket
    import sqlite3

    from sqlalchemy.engine import make_url

    where = make_url(url).render_as_string(hide_password=True)
    causes: list[BaseException] = []
    cause: BaseException | None = exc
    while cause is not None and cause not in causes:
        causes.append(cause)
        orig = getattr(cause, "orig", None)  # sqlalchemy's DBAPIError wraps the driver's error
        cause = orig if isinstance(orig, BaseException) else cause.__cause__ or cause.__context__
    fix = "or set ORCH_DB__URL to the server's database"
    reach = f"cannot reach the database {where}"
    for c in causes:
        # PostgreSQL's SQLSTATE, as asyncpg's errors (InvalidCatalogNameError, ...) carry it
        sqlstate = getattr(c, "sqlstate", None)
        if sqlstate == "3D000":  # invalid_catalog_name: no such database
            return (
                f"cannot use the database {where}: {c}. Create it (createdb {make_url(url).database}) "
                f"and run `orchestrator migrate`, {fix}."
            )
        if sqlstate in {"28000", "28P01"}:  # invalid_authorization_specification, invalid_password
            return (
                f"cannot use the database {where}: the server refused the login ({c}). Check the user "
                "and password in ORCH_DB__URL."
            )
        if isinstance(c, ConnectionRefusedError):
            return (
                f"{reach}: connection refused. Start the database server (or check the host and port), {fix}."
            )
        if isinstance(c, socket.gaierror):
            return f"{reach}: its host name does not resolve ({c}). Check the host, {fix}."
        if isinstance(c, TimeoutError):
            return f"{reach}: the connection timed out. Check the server and the network, {fix}."
        if isinstance(c, OSError) and make_url(url).get_backend_name() == "sqlite":  # its lock file
            return (
                f"cannot open the database {where}: {c}. Check that its directory exists and is "
                f"writable, {fix}."
            )
        if isinstance(c, OSError):
            return f"{reach}: {c}. Check the server and the network, {fix}."
        if isinstance(c, sqlite3.OperationalError) and "unable to open database file" in str(c):
            return (
                f"cannot open the database {where}: unable to open the database file. Check that its "
                f"directory exists and is writable, {fix}."
            )
    return None


@contextmanager
def _database_errors(url: str) -> Iterator[None]:
    """A database that cannot be reached (or does not exist, or refuses the login) is one line
    and exit 2, naming the URL without its password, rather than a traceback."""
    from sqlalchemy.exc import DBAPIError

    try:
        yield
    except (OSError, DBAPIError) as exc:
        message = _connect_failure(url, exc)
        if message is None:
            raise
        console.print(escape(message), style="red", soft_wrap=True)
        raise typer.Exit(2) from None


async def _with_schema(work: Callable[[async_sessionmaker[AsyncSession]], Awaitable[T]]) -> T:
    """Run ``work`` with sessions of the configured database, once it is known to hold the
    schema this version needs, or a newer one (``NoSchema`` otherwise: an empty database is not
    changed, and an older schema, as after a package upgrade before ``migrate``, is not read)."""
    from sqlalchemy import inspect
    from sqlalchemy.engine import make_url

    from orchestrator.core.db import make_engine, make_sessionmaker
    from orchestrator.core.migrate import head_revision, known_revision, revision_of

    settings = _settings().db
    engine = make_engine(settings)
    try:
        async with engine.connect() as conn:
            if not await conn.run_sync(lambda sync: inspect(sync).has_table("api_tokens")):
                raise NoSchema(f"the database {make_url(settings.url)!r} has no orchestrator schema")
            current = await conn.run_sync(revision_of)
            head = head_revision()
            if current != head and (current is None or known_revision(current)):
                raise NoSchema(
                    f"the database {make_url(settings.url)!r} has the schema of revision {current}, "
                    f"older than this version's {head}"
                )
        return await work(make_sessionmaker(engine))
    finally:
        await engine.dispose()


async def _with_token_table(work: Callable[[AsyncSession], Awaitable[T]]) -> T:
    """Run ``work`` in one transaction (``_with_schema``)."""

    async def one_transaction(sessionmaker: async_sessionmaker[AsyncSession]) -> T:
        async with sessionmaker() as session, session.begin():
            return await work(session)

    return await _with_schema(one_transaction)


def _run_on_tokens(work: Callable[[AsyncSession], Awaitable[T]]) -> T:
    """``_with_token_table``, with the CLI's answers to a missing schema and refused input."""
    return _run_on_database(lambda: _with_token_table(work))


def _run_on_database(work: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run ``work()`` (``_with_schema``) with the CLI's answers to a missing schema and refused input."""
    from sqlalchemy.engine import make_url

    from orchestrator.core.errors import OrchestratorError

    settings = _settings().db
    database = make_url(settings.url).database
    try:
        if settings.is_sqlite and database and database != ":memory:" and not Path(database).exists():
            raise NoSchema(f"there is no database file {database}")  # connecting would create it
        with _database_errors(settings.url):
            return asyncio.run(work())
    except NoSchema as exc:
        console.print(
            f"[red]{exc}.[/red] Run this where `orchestrator serve` runs (the embedded default is "
            "./orchestrator.db, relative to the current directory), set ORCH_DB__URL to the "
            "server's database, or create (or upgrade) the schema with `orchestrator migrate`."
        )
        raise typer.Exit(2) from None
    except OrchestratorError as exc:
        console.print(f"[red]{exc.detail}[/red]")
        raise typer.Exit(2) from None


async def _audit_token(session: AsyncSession, action: str, row: Any) -> None:
    """Audit a token's creation or revocation as the admin API does, by the actor ``cli``: whoever
    can run this command on the server's database (the first admin token has no other)."""
    from orchestrator.admin.router import token_out
    from orchestrator.audit.service import record

    after = token_out(row).model_dump()
    await record(session, _cli_actor(), action, target_type="token", target_id=row.id, after=after)


def _cli_actor() -> Any:
    """The audit's actor for what these commands do: whoever can run them on the server's database."""
    from orchestrator.admin.tokens import Principal, Role

    return Principal(token_id="cli", name="command line", role=Role.admin)  # noqa: S106 - an actor, not a secret


def _token_name(value: str) -> str:
    """--name: what the API takes (1 to 100 characters, no NUL); a longer one failed in
    PostgreSQL's varchar(100) with a traceback."""
    from pydantic import ValidationError

    from api_schemas.admin import TokenIn

    try:
        TokenIn(role="admin", name=value)
    except ValidationError as exc:
        raise typer.BadParameter("; ".join(str(e["msg"]) for e in exc.errors())) from None
    return value


@admin_app.command("create-token")
def create_token_cmd(
    role: Annotated[str, typer.Option(help="admin | operator | validator | trainer")],
    name: Annotated[
        str, typer.Option(help="Who or what the token is for (1 to 100 characters)", callback=_token_name)
    ] = "cli",
    pool: Annotated[
        list[str] | None,
        typer.Option(help="A pool a validator or trainer token may act on (repeatable; it must exist)"),
    ] = None,
    expires_in_days: Annotated[
        float | None, typer.Option(min=0.001, max=3650, help="Lifetime in days; default: until revoked")
    ] = None,
) -> None:
    """Create an API token and print it once (only its hash is stored)."""
    from orchestrator.admin.tokens import Role, check_scope, create_token
    from orchestrator.core.db import utcnow

    if role not in {"admin", "operator", "validator", "trainer"}:
        raise typer.BadParameter("role must be admin, operator, validator or trainer", param_hint="--role")
    if role in {"validator", "trainer"} and not pool:
        raise typer.BadParameter("validator and trainer tokens need at least one --pool", param_hint="--pool")
    if role in {"admin", "operator"} and pool:
        raise typer.BadParameter(
            "--pool applies to validator and trainer tokens only (an operator acts on the pools it creates)",
            param_hint="--pool",
        )

    async def work(session: AsyncSession) -> tuple[str, str, Any]:
        await check_scope(session, Role(role), list(pool or []))
        now = utcnow()
        expires_at = now + dt.timedelta(days=expires_in_days) if expires_in_days is not None else None
        token, row = await create_token(
            session, role=Role(role), name=name, pool_ids=list(pool or []), expires_at=expires_at, now=now
        )
        await _audit_token(session, "token.create", row)
        return token, row.id, row.expires_at

    token, token_id, expires_at = _run_on_tokens(work)
    until = f", valid until {expires_at:%Y-%m-%d %H:%M} UTC" if expires_at is not None else ""
    console.print(f"created {role} token {token_id}{until}; it is shown only now:")
    typer.echo(token)


@admin_app.command("list-tokens")
def list_tokens_cmd() -> None:
    """List the API tokens (never their secrets): id, role, name, pools, created, expires, revoked."""
    from sqlalchemy import select

    from orchestrator.admin.models import ApiToken

    async def work(session: AsyncSession) -> list[ApiToken]:
        return list(
            (await session.execute(select(ApiToken).order_by(ApiToken.created_at, ApiToken.id))).scalars()
        )

    # The id is what revoke-token takes: never cut (an 80-column terminal, or a pipe, made it
    # 'tok_6427a2d…'); the other columns fold rather than lose characters.
    table = Table(
        Column("id", no_wrap=True, min_width=len("tok_") + 16),
        *(Column(c, overflow="fold") for c in ("role", "name", "pools", "created", "expires", "revoked")),
    )
    for row in _run_on_tokens(work):
        table.add_row(
            row.id,
            row.role,
            row.name,
            ", ".join(row.pool_ids or ()),
            f"{row.created_at:%Y-%m-%d %H:%M}",
            f"{row.expires_at:%Y-%m-%d %H:%M}" if row.expires_at else "",
            f"{row.revoked_at:%Y-%m-%d %H:%M}" if row.revoked_at else "",
        )
    from orchestrator.core.console import wide_console

    wide_console().print(table)


async def _token_id_of(session: AsyncSession, token: str) -> str | None:
    """The id a token command was given (tok_...), or that of the token whose secret it was given
    (orch_...: a leaked secret whose id is not known); None for a secret no token has."""
    from sqlalchemy import select

    from orchestrator.admin.models import ApiToken
    from orchestrator.admin.tokens import TOKEN_PREFIX, hash_token

    if not token.startswith(TOKEN_PREFIX):
        return token
    found = await session.scalar(select(ApiToken.id).where(ApiToken.token_hash == hash_token(token)))
    return str(found) if found is not None else None


@admin_app.command("revoke-token")
def revoke_token_cmd(
    token: Annotated[
        str,
        typer.Argument(
            help="The token's id (tok_..., as list-tokens shows it), or the secret itself "
            "(orch_...: a leaked token whose id is not known)"
        ),
    ],
) -> None:
    """Revoke an API token at once and for good (every request with it is then 401, and an
    export it is streaming breaks off before its next chunk, left unfinished)."""
    from orchestrator.admin.tokens import TOKEN_PREFIX, revoke_token

    by_secret = token.startswith(TOKEN_PREFIX)
    # A secret is never printed back: it is named by its id once found, else as "this secret".
    named = "with this secret" if by_secret else token

    async def work(session: AsyncSession) -> tuple[str | None, Any]:
        token_id = await _token_id_of(session, token)
        if token_id is None:
            return None, None
        row, revoked_now = await revoke_token(session, token_id)
        if row is not None and revoked_now:
            await _audit_token(session, "token.revoke", row)
        return (row.id, row.revoked_at) if row is not None else (None, None)

    token_id, revoked_at = _run_on_tokens(work)
    if token_id is None:
        console.print(f"[red]no token {named}[/red] (see `orchestrator admin list-tokens`)")
        raise typer.Exit(1)
    console.print(f"token {token_id} revoked (at {revoked_at:%Y-%m-%d %H:%M:%S} UTC)")


@admin_app.command("rotate-token")
def rotate_token_cmd(
    token: Annotated[
        str,
        typer.Argument(
            help="The token's id (tok_..., as list-tokens shows it), or its current secret (orch_...)"
        ),
    ],
    expires_in_days: Annotated[
        float | None,
        typer.Option(min=0.001, max=3650, help="A new lifetime in days from now; default: the expiry stays"),
    ] = None,
    no_expiry: Annotated[bool, typer.Option("--no-expiry", help="Valid until revoked from now on")] = False,
) -> None:
    """Give an API token a new secret and print it once: the token keeps its id, role, scope and
    the pools it owns, and its old secret is refused at once, an export streaming with it breaking
    off before its next chunk (a leaked secret, a rotation policy)."""

    from orchestrator.admin.tokens import KEEP_EXPIRY, TOKEN_PREFIX, rotate_token
    from orchestrator.core.db import utcnow

    if no_expiry and expires_in_days is not None:
        raise typer.BadParameter("give --expires-in-days or --no-expiry, not both", param_hint="--no-expiry")
    by_secret = token.startswith(TOKEN_PREFIX)
    named = "with this secret" if by_secret else token

    async def work(session: AsyncSession) -> tuple[str, str, Any] | None:
        token_id = await _token_id_of(session, token)
        if token_id is None:
            return None
        now = utcnow()
        expires_at: Any = KEEP_EXPIRY
        if no_expiry:
            expires_at = None
        elif expires_in_days is not None:
            expires_at = now + dt.timedelta(days=expires_in_days)
        rotated = await rotate_token(session, token_id, expires_at=expires_at, now=now)
        if rotated is None:
            return None
        secret, row = rotated
        await _audit_token(session, "token.rotate", row)
        return secret, row.id, row.expires_at

    done = _run_on_tokens(work)
    if done is None:
        console.print(f"[red]no token {named}[/red] (see `orchestrator admin list-tokens`)")
        raise typer.Exit(1)
    secret, token_id, expires_at = done
    until = f", valid until {expires_at:%Y-%m-%d %H:%M} UTC" if expires_at is not None else ""
    console.print(f"token {token_id} has a new secret{until}; the old one is refused; it is shown only now:")
    typer.echo(secret)


def _provider_key_id(value: str) -> str:
    """--provider-id, --successor-id: a provider id as the API takes it (43 characters of
    unpadded base64url, an Ed25519 public key)."""
    from pydantic import TypeAdapter, ValidationError

    from api_schemas.common import KeyId

    try:
        TypeAdapter(KeyId).validate_python(value)
    except ValidationError as exc:
        raise typer.BadParameter("; ".join(str(e["msg"]) for e in exc.errors())) from None
    return value


@admin_app.command("retire-provider")
def retire_provider_cmd(
    provider_id: Annotated[
        str, typer.Option(help="The provider whose key is lost or stolen", callback=_provider_key_id)
    ],
    successor_id: Annotated[
        str,
        typer.Option(
            help="The registered provider that receives its money, now and as it matures",
            callback=_provider_key_id,
        ),
    ],
    reason: Annotated[str, typer.Option(help="Why (1 to 500 characters); audited")],
    idempotency_key: Annotated[
        str | None,
        typer.Option(
            help="As the API's Idempotency-Key (8 to 100 of A-Z a-z 0-9 . _ : -): the same command "
            "again with it is answered as the first was; default: a new one"
        ),
    ] = None,
) -> None:
    """Retire a provider whose key is lost or stolen, for good, as POST
    /v1/admin/providers/{id}/retire does: its key is refused from then on, its nodes are
    revoked, the successor is blacklisted where it is, and its money goes to the successor (what
    is free at once, the rest as it matures). Audited by the actor ``cli``."""
    import re
    import secrets

    from pydantic import ValidationError

    from api_schemas.admin import RetireIn
    from orchestrator.core.clock import SystemClock
    from orchestrator.core.db import run_after_commit
    from orchestrator.core.hotstore import make_hot_store
    from orchestrator.core.state import AppState
    from orchestrator.identity.retirement import retire
    from orchestrator.ledger import IDEMPOTENCY_KEY_PATTERN

    try:
        RetireIn(successor_id=successor_id, reason=reason)
    except ValidationError as exc:
        raise typer.BadParameter(
            "; ".join(str(e["msg"]) for e in exc.errors()), param_hint="--reason"
        ) from None
    key = idempotency_key or f"cli-{secrets.token_hex(12)}"
    if not (8 <= len(key) <= 100 and re.fullmatch(IDEMPOTENCY_KEY_PATTERN, key)):
        raise typer.BadParameter(
            "8 to 100 of A-Z a-z 0-9 . _ : - (as the API's Idempotency-Key)", param_hint="--idempotency-key"
        )

    async def work(sessionmaker: async_sessionmaker[AsyncSession]) -> Any:
        settings = _settings()
        # The server's hot store (Redis, if it has one): the revoked nodes are forgotten there
        # once the retirement commits, as the API's retirement does.
        state = AppState(
            settings=settings,
            engine=sessionmaker.kw["bind"],
            sessionmaker=sessionmaker,
            hot_store=make_hot_store(settings.redis_url, settings.redis),
            clock=SystemClock(),
        )
        try:
            async with sessionmaker() as session:
                async with session.begin():
                    done = await retire(
                        session, state, provider_id, successor_id, reason, key=key, principal=_cli_actor()
                    )
                await run_after_commit(session)
            return done
        finally:
            await state.hot_store.aclose()

    done = _run_on_database(lambda: _with_schema(work))
    after = done.after
    if not done.created:
        console.print(f"provider {provider_id} was retired already with this idempotency key:")
    console.print(f"provider {provider_id} retired; its money goes to {successor_id}")
    moved = ", ".join(f"{v} {k}" for k, v in after["moved"].items()) or "nothing"
    console.print(f"moved at once: {moved}")
    maturing = ", ".join(f"{v} {k}" for k, v in after["maturing"].items() if v) or "nothing"
    console.print(f"reaches the successor as it matures: {maturing}")
    nodes = after["revoked_nodes"]
    console.print(f"nodes revoked: {len(nodes)}" + (f" ({', '.join(nodes)})" if nodes else ""))
    if after["blacklists_copied"]:
        console.print(f"successor blacklisted in: {', '.join(after['blacklists_copied'])}")
    if after["payouts_requested"]:
        ids = ", ".join(str(i) for i in after["payouts_requested"])
        console.print(f"requested payouts left to settle or reject: {ids}")


@admin_app.command("prune-evidence")
def prune_evidence_cmd(
    older_than_days: Annotated[
        int,
        typer.Option(
            min=1,
            max=36_500,
            help="Prune results whose verdict was decided more than this many days ago (1 to 36500)",
        ),
    ],
    archive: Annotated[
        Path | None,
        typer.Option(
            help="The file (JSON Lines; gzip'd if it ends in .gz) that receives each result's "
            "evidence before its body is emptied: a new one, or an earlier run's archive, appended "
            "to; required unless --dry-run"
        ),
    ] = None,
    pool: Annotated[str | None, typer.Option(help="Only this pool's results")] = None,
    batch_size: Annotated[
        int,
        typer.Option(
            min=1,
            max=200,
            help="Results per transaction; a batch's bodies are held in memory, each up to "
            "ORCH_LIMITS__MAX_RESULT_BODY_BYTES",
        ),
    ] = 50,
    dry_run: Annotated[bool, typer.Option(help="Count what would be pruned; change nothing")] = False,
) -> None:
    """Archive, then empty, the signed bodies of results decided long ago: each result's whole
    evidence (the body, the signature and the header lines it covers, its verdict) is written to
    --archive and fsync'd before its stored body is emptied, batch by batch; the digest and the
    signature stay in the database. Pruned results leave the trainer feed and ReST^EM datasets.
    Results not yet decided are never pruned. The run is audited (evidence.prune)."""
    import datetime as dt

    from rich.progress import MofNCompleteColumn, Progress
    from sqlalchemy import select

    from orchestrator.audit.service import record
    from orchestrator.core.errors import NotFound
    from orchestrator.pools.models import Pool
    from orchestrator.tasks import retention
    from orchestrator.tasks.models import Submission

    if archive is None and not dry_run:
        raise typer.BadParameter("name the file that keeps the pruned evidence", param_hint="--archive")
    # An earlier run's archive: where its whole part ends, and its size, when checked here.
    checked: tuple[int, int] | None = None
    if archive is not None and not dry_run:
        if archive.exists():
            # An earlier run's archive is appended to (after the batch it was killed writing,
            # if it was); anything else is refused, untouched.
            try:
                checked = retention.whole_length(archive)
            except (retention.NotAnArchive, OSError) as exc:
                why = exc.strerror if isinstance(exc, OSError) else str(exc)
                raise typer.BadParameter(
                    f"{archive} exists and is not an evidence archive ({why}): name a new file",
                    param_hint="--archive",
                ) from exc
        directory = archive.parent
        if not directory.is_dir() or not os.access(directory, os.W_OK | os.X_OK):
            raise typer.BadParameter(f"{directory} is not a writable directory", param_hint="--archive")
    _require_current_schema(_settings().db.url)
    now = dt.datetime.now(dt.UTC)
    cutoff = now - dt.timedelta(days=older_than_days)

    async def work(sessionmaker: async_sessionmaker[AsyncSession]) -> retention.PruneReport:
        if pool is not None:
            async with sessionmaker() as session:
                if await session.get(Pool, pool) is None:  # a typo is not a pool with nothing to prune
                    raise NotFound(f"no pool {pool}", code="pool_not_found")
        if dry_run:
            async with sessionmaker() as session:
                return await retention.measure(session, cutoff=cutoff, pool_id=pool)
        assert archive is not None
        async with sessionmaker() as session:
            expected = (await retention.measure(session, cutoff=cutoff, pool_id=pool)).submissions
        if checked is not None:
            # A torn end is cut off only when it holds no result already emptied: one an archive
            # of an earlier version may hold (one gzip stream per run), the only copy of them.
            # (A file changed since it was checked is refused below: Archive(checked=).)
            torn = retention.torn_submission_ids(archive, checked[0])
            async with sessionmaker() as session:
                emptied = [
                    sid
                    for at in range(0, len(torn), 500)
                    for sid in await session.scalars(
                        select(Submission.id).where(
                            Submission.id.in_(torn[at : at + 500]), Submission.evidence_pruned_at.is_not(None)
                        )
                    )
                ]
            if emptied:
                raise typer.BadParameter(
                    f"{archive}: its torn end, from byte {checked[0]}, holds {len(emptied)} results "
                    f"already emptied (submissions {', '.join(map(str, emptied[:5]))}"
                    f"{', ...' if len(emptied) > 5 else ''}), written as one gzip stream by an earlier "
                    "version; cutting it would lose their only copy. Recover its lines with "
                    "'zcat' (which reads up to the tear) and name a new file",
                    param_hint="--archive",
                )
        try:
            kept = retention.Archive(archive, checked=checked)
        except (retention.NotAnArchive, retention.ArchiveBusy) as exc:
            raise typer.BadParameter(f"{archive}: {exc}", param_hint="--archive") from exc
        if kept.cut:
            console.print(
                f"cut {kept.cut} bytes off the end of {archive}: a batch a run was killed writing "
                "(its results were not emptied; this run archives them again)"
            )
        # What the committed batches pruned, audited even if a later batch fails (a full disk, an
        # outage): their bodies are gone whether or not the run finishes.
        done = [0, 0]

        async def audit() -> None:
            assert archive is not None
            async with sessionmaker() as session, session.begin():
                await record(
                    session,
                    _cli_actor(),
                    "evidence.prune",
                    target_type="pool" if pool else "submissions",
                    target_id=pool or "all",
                    pool_id=pool,
                    after={
                        "submissions": done[0],
                        "body_bytes": done[1],
                        "older_than_days": older_than_days,
                        "archive": str(archive.resolve()),
                    },
                )

        # On a terminal, a bar of the results pruned (a run over millions takes a while); none
        # in a pipe or a cron job's log.
        with Progress(
            *Progress.get_default_columns(),
            MofNCompleteColumn(),
            console=console,
            transient=True,
            disable=not console.is_terminal,
        ) as bar:
            task = bar.add_task("pruning", total=expected)

            def pruned(n: int, size: int) -> None:
                done[0] += n
                done[1] += size
                bar.advance(task, n)

            try:
                report = await retention.prune(
                    sessionmaker,
                    kept,
                    cutoff=cutoff,
                    now=now,
                    pool_id=pool,
                    batch=batch_size,
                    on_batch=pruned,
                )
            finally:
                kept.close()
                if done[0]:
                    await audit()
        return report

    report = _run_on_database(lambda: _with_schema(work))
    what = f"{report.submissions} results ({report.body_bytes} bytes of signed bodies)"
    before = f"decided before {cutoff:%Y-%m-%d %H:%M} UTC"
    if dry_run:
        console.print(f"would prune {what} {before}")
    elif not report.submissions:
        written = f"nothing added to {archive}" if checked is not None else "no archive written"
        console.print(f"nothing to prune: no result {before} is stored whole ({written})")
    else:
        console.print(f"pruned {what}; their evidence is in {archive}")


@keys_app.command("generate")
def keys_generate(
    path: Annotated[Path, typer.Argument(help="Key file to write (mode 0600)")],
    force: Annotated[bool, typer.Option(help="Overwrite an existing file")] = False,
) -> None:
    """Generate an Ed25519 key file and print its public id."""
    from orchestrator.core.keys import generate_key, key_id_of, write_key_file

    key = generate_key()
    try:
        write_key_file(path, key, force=force)
    except FileExistsError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(1) from exc
    except OSError as exc:  # a missing directory, no permission, a directory named
        console.print(escape(f"cannot write {path}: {exc.strerror or exc}"), style="red")
        raise typer.Exit(1) from exc
    typer.echo(key_id_of(key))


# ---------------------------------------------------------------- worker


def _backend_options(pairs: list[str]) -> dict[str, str]:
    options: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise typer.BadParameter(f"{pair!r} is not key=value", param_hint="--backend-opt")
        options[name.strip()] = value
    return options


def _worker_specs(specs_json: str | None, overrides: dict[str, Any]) -> Any:
    """The node's specs: --specs JSON, or this machine (CPU-only) with the flags given."""
    from pydantic import ValidationError

    from api_schemas.identity import NodeSpecs
    from orchestrator.worker.runner import local_specs

    given = {k: v for k, v in overrides.items() if v is not None}
    if specs_json is not None:
        if given:
            raise typer.BadParameter("give either --specs or the single spec flags", param_hint="--specs")
        try:
            raw = json.loads(specs_json)
        except ValueError as exc:
            raise typer.BadParameter(f"not JSON: {exc}", param_hint="--specs") from exc
    else:
        raw = {**local_specs().model_dump(), **given}
        if "gpu_model" in given and "gpu_count" not in given:
            raw["gpu_count"] = 1
    try:
        return NodeSpecs.model_validate(raw)
    except ValidationError as exc:
        message = "; ".join(
            f"{'.'.join(str(part) for part in e['loc']) or 'specs'}: {e['msg']}" for e in exc.errors()
        )
        raise typer.BadParameter(message, param_hint="--specs / --gpu-*") from exc


def _stats_table(stats: Any) -> Any:
    from rich.table import Table

    table = Table(title=f"worker {stats.node_id[:12]} ({stats.state})", title_justify="left", min_width=34)
    earnings = "-" if stats.earnings is None else str(stats.earnings)
    cells = {
        "in flight": stats.in_flight,
        "done": stats.tasks_done,
        "submitted": stats.submitted,
        "accepted": stats.accepted,
        "rejected": stats.rejected,
        "awaiting verdict": stats.awaiting_verdict,
        "released": stats.released,
        "dropped": stats.dropped,
        "errors": stats.errors,
        "earnings": earnings,
    }
    table.add_column("")
    table.add_column("", justify="right")
    table.show_header = False
    for name, value in cells.items():
        table.add_row(name, str(value))
    if stats.idle_reason:
        table.caption = f"no work: {stats.idle_reason}"
    return table


class _ConsoleLogger:
    """structlog output through the rich console, so log lines print above the live table."""

    def __init__(self, out: Console) -> None:
        self.out = out

    def msg(self, message: str) -> None:
        from rich.text import Text

        self.out.print(Text.from_ansi(message), soft_wrap=True)

    debug = info = warning = warn = error = critical = exception = fatal = log = msg


async def _run_worker_live(config: Any, live: Any, backend: Any) -> Any:
    import signal

    from orchestrator.worker.runner import run_worker

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    signals = 0

    def on_signal(signum: int) -> None:
        nonlocal signals
        signals += 1
        if signals == 1:
            console.print(f"[yellow]{signal.Signals(signum).name}: stopping (again to quit now)[/yellow]")
            stop.set()
        elif main is not None:
            main.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        return await run_worker(
            config, stop=stop, progress=lambda s: live.update(_stats_table(s)), backend=backend
        )
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
            # The run is over and the process only exits now (which takes a moment): a signal
            # then, e.g. Ctrl-C pressed twice, would turn its exit status into a
            # KeyboardInterrupt's 130 after a clean stop.
            signal.signal(sig, signal.SIG_IGN)


def _server_url(value: str) -> str:
    """--server: an absolute http(s) URL; anything else is a usage error, not a traceback from
    the signing library at the first request."""
    import httpx

    try:
        url = httpx.URL(value)
    except httpx.InvalidURL:
        url = None
    if url is None or url.scheme not in ("http", "https") or not url.host:
        raise typer.BadParameter(f"{value!r} is not an http:// or https:// URL, e.g. {DEFAULT_SERVER}")
    if url.query or url.fragment or value.rstrip("/").endswith(("?", "#")):
        # The API's paths are appended to it: "/?x=1" ended in 404 "No route matches GET /".
        raise typer.BadParameter(f"{value!r}: a base URL takes no query or fragment, e.g. {DEFAULT_SERVER}")
    return value


def _pool_id(value: str) -> str:
    """--pool: a pool id as the API's paths take it; "" or "a/b" ended in a 404 "No route matches"
    after the node had registered."""
    if (
        not 1 <= len(value) <= 40
        or any(c in value for c in "/?#%")
        or not value.isprintable()
        or " " in value
    ):
        raise typer.BadParameter(f"{value!r} is not a pool id (e.g. pool_0123456789abcdef)")
    return value


ServerOpt = Annotated[str, typer.Option(help="The orchestrator's base URL", callback=_server_url)]
NodeKeyOpt = Annotated[Path, typer.Option("--node-key", help="The node's key file")]
SpecsOpt = Annotated[
    str | None,
    typer.Option(
        "--specs",
        help=(
            'Node specs as JSON, the whole record: {"gpu_model", "gpu_count", "gpu_memory_mb", '
            '"cpu_cores", "ram_mb"} (gpu_model null without GPUs); none from this machine'
        ),
    ),
]
GpuModelOpt = Annotated[str | None, typer.Option(help="GPU model as the driver reports it")]
GpuCountOpt = Annotated[int | None, typer.Option(min=0, help="Number of GPUs")]
GpuMemoryOpt = Annotated[int | None, typer.Option(min=0, help="Memory per GPU, MiB")]
CpuCoresOpt = Annotated[int | None, typer.Option(min=1, help="CPU cores (default: this machine's)")]
RamOpt = Annotated[int | None, typer.Option(min=256, help="RAM in MiB (default: this machine's)")]
DEFAULT_SERVER = "http://127.0.0.1:8000"


@contextmanager
def _table_ends_its_line() -> Iterator[None]:
    """Rich ends a live display's last render with a newline on a terminal only: off one (a log
    file, a pipe) what is printed next would continue the table's last line."""
    try:
        yield
    finally:
        if not console.is_terminal:
            console.line()


@contextmanager
def _worker_errors(
    hints: dict[str, str] | None = None, exits: dict[str, int] | None = None
) -> Iterator[None]:
    """Refusals and failures as one readable line (plus a join's reasons, or the hint for the
    problem's code) and exit 1 (or the status ``exits`` gives the problem's code). A refusal
    that says the provider was retired (``provider_retired``, or ``node_banned`` with
    ``provider_retired: true``, which is all a node key is told) takes the hint and status of
    ``provider_retired``. A ``WorkerEnded`` goes through, for the caller."""
    import httpx

    from orchestrator.worker.errors import OrchestratorAPIError, WorkerEnded, WorkerError
    from orchestrator.worker.runner import says_retired

    try:
        yield
    except WorkerEnded:
        raise
    except OrchestratorAPIError as exc:
        console.print(f"[red]the server refused: {exc.status} {exc.code}: {exc.detail}[/red]")
        for reason in exc.body.get("reasons") or []:
            console.print(f"[red]  - {reason.get('code')}: {reason.get('detail')}[/red]")
        code = "provider_retired" if says_retired(exc) else exc.code
        if hints and code in hints:
            console.print(escape(hints[code]), style="red")
        raise typer.Exit((exits or {}).get(code, 1)) from exc
    except httpx.TransportError as exc:  # after the client's retries
        console.print(
            escape(f"cannot reach {_server_of(exc)}: {type(exc).__name__}: {exc}"),
            style="red",
            soft_wrap=True,
        )
        raise typer.Exit(1) from exc
    except (WorkerError, ValueError, KeyError, OSError, httpx.HTTPError) as exc:
        console.print(escape(f"failed: {type(exc).__name__}: {exc}"), style="red", soft_wrap=True)
        raise typer.Exit(1) from exc


def _server_of(exc: Any) -> str:
    """The server a transport error failed to reach (its origin), as far as the error knows."""
    try:
        url = exc.request.url
    except RuntimeError:  # httpx: an error raised without its request
        return "the server"
    return str(url.copy_with(path="/", query=None))


def _key_file(path: Path, option: str) -> Any:
    """The key in ``path``; one that cannot be read is a bad argument (exit 2), before anything runs."""
    from orchestrator.core.keys import read_key_file

    try:
        return read_key_file(path)
    except OSError as exc:
        raise typer.BadParameter(
            f"cannot read the key file {path}: {exc.strerror or exc}", param_hint=option
        ) from None
    except ValueError as exc:  # not base64url, or not 32 bytes
        raise typer.BadParameter(
            f"{path} is not a key file (`orchestrator keys generate` writes one): {exc}", param_hint=option
        ) from None


def _separate_keys(provider_key: Any, node_key: Any) -> None:
    """The provider key is who gets paid: it is not a node's key too (the server refuses it)."""
    if bytes(provider_key) == bytes(node_key):
        raise typer.BadParameter(
            "the node key is the provider key; a node has a key of its own "
            "(`orchestrator keys generate node.key`), and the provider key stays off the workers",
            param_hint="--node-key",
        )


async def _register_node(server: str, provider_key: Any, node_key: Any, specs: Any) -> Any:
    from orchestrator import __version__
    from orchestrator.worker.client import WorkerClient

    async with WorkerClient(server, node_key, provider_key) as client:
        return await client.register(specs, __version__)


@worker_app.command("register")
def worker_register(
    provider_key: Annotated[Path, typer.Option("--provider-key", help="The provider's key file")],
    node_key: NodeKeyOpt,
    server: ServerOpt = DEFAULT_SERVER,
    specs: SpecsOpt = None,
    gpu_model: GpuModelOpt = None,
    gpu_count: GpuCountOpt = None,
    gpu_memory_mb: GpuMemoryOpt = None,
    cpu_cores: CpuCoresOpt = None,
    ram_mb: RamOpt = None,
) -> None:
    """Register the provider and the node (idempotent) and print their ids, e.g. so that an
    operator can deposit the provider's stake before the node joins a pool."""
    overrides = {"gpu_model": gpu_model, "gpu_count": gpu_count, "gpu_memory_mb": gpu_memory_mb}
    node_specs = _worker_specs(specs, {**overrides, "cpu_cores": cpu_cores, "ram_mb": ram_mb})
    keys = _key_file(provider_key, "--provider-key"), _key_file(node_key, "--node-key")
    _separate_keys(*keys)
    with _worker_errors():
        node = asyncio.run(_register_node(server, *keys, node_specs))
    typer.echo(json.dumps({"provider_id": node.provider_id, "node_id": node.id, "status": node.status}))


ProviderKeyOpt = Annotated[Path, typer.Option("--provider-key", help="The provider's key file")]


async def _as_provider(server: str, provider_key: Any, call: Callable[[Any], Awaitable[Any]]) -> Any:
    from orchestrator.worker.client import WorkerClient

    async with WorkerClient(server, None, provider_key) as client:
        return await call(client)


def _print_model(value: Any) -> None:
    typer.echo(value.model_dump_json())


@provider_app.command("balance")
def provider_balance(provider_key: ProviderKeyOpt, server: ServerOpt = DEFAULT_SERVER) -> None:
    """Print the provider's balances as JSON: stake (free, locked, unbonding) and rewards
    (pending, claimable, withdrawn)."""
    key = _key_file(provider_key, "--provider-key")
    with _worker_errors():
        _print_model(asyncio.run(_as_provider(server, key, lambda c: c.balance())))


@provider_app.command("withdraw")
def provider_withdraw(
    provider_key: ProviderKeyOpt,
    amount: Annotated[int, typer.Option(min=1, max=10**15, help="How much of the claimable rewards")],
    idempotency_key: Annotated[
        str,
        typer.Option(
            help="8 to 100 letters, digits, '.', '_', ':' and '-', your own (e.g. a date and a "
            "counter, 2026-12-04.1): running the command "
            "again with the same key answers the first withdrawal and moves nothing"
        ),
    ],
    server: ServerOpt = DEFAULT_SERVER,
) -> None:
    """Withdraw claimable rewards into a payout, which an admin settles off-chain; prints the
    payout and the balances after it as JSON. A command that failed or timed out is safe to
    run again with the same `--idempotency-key`."""
    import re

    from orchestrator.ledger import IDEMPOTENCY_KEY_CHARS, IDEMPOTENCY_KEY_PATTERN

    if not 8 <= len(idempotency_key) <= 100 or not re.fullmatch(IDEMPOTENCY_KEY_PATTERN, idempotency_key):
        # As the API checks it: a key it refuses is a bad argument here, before anything is sent.
        raise typer.BadParameter(
            f"must be 8 to 100 characters, {IDEMPOTENCY_KEY_CHARS} only", param_hint="--idempotency-key"
        )
    key = _key_file(provider_key, "--provider-key")
    with _worker_errors():
        out = asyncio.run(_as_provider(server, key, lambda c: c.withdraw(amount, idempotency_key)))
    _print_model(out)


@provider_app.command("payouts")
def provider_payouts(
    provider_key: ProviderKeyOpt,
    status: Annotated[
        str | None, typer.Option(help="Only payouts in this status: requested, paid or rejected")
    ] = None,
    limit: Annotated[int, typer.Option(min=1, max=10_000, help="How many, newest first")] = 100,
    server: ServerOpt = DEFAULT_SERVER,
) -> None:
    """Print the provider's payouts, newest first, one JSON object per line."""
    from api_schemas.payouts import PayoutStatus

    if status is not None and status not in set(PayoutStatus):
        raise typer.BadParameter("must be requested, paid or rejected", param_hint="--status")
    key = _key_file(provider_key, "--provider-key")
    with _worker_errors():
        payouts = asyncio.run(_as_provider(server, key, lambda c: c.payouts(limit, status=status)))
    for payout in payouts:
        _print_model(payout)


@provider_app.command("nodes")
def provider_nodes(
    provider_key: ProviderKeyOpt,
    status: Annotated[
        str | None,
        typer.Option(help="Only nodes in this status: waiting, healthy, unhealthy, dead or banned"),
    ] = None,
    limit: Annotated[int, typer.Option(min=1, max=100_000, help="How many, by id")] = 1000,
    server: ServerOpt = DEFAULT_SERVER,
) -> None:
    """Print the provider's nodes, by id, one JSON object per line: each one's status, specs,
    memberships, last heartbeat and `revoked_at`."""
    from orchestrator.identity.models import NODE_STATUSES

    if status is not None and status not in NODE_STATUSES:
        raise typer.BadParameter(f"must be one of {', '.join(NODE_STATUSES)}", param_hint="--status")
    key = _key_file(provider_key, "--provider-key")
    with _worker_errors():
        nodes = asyncio.run(_as_provider(server, key, lambda c: c.nodes(limit, status=status)))
    for node in nodes:
        _print_model(node)


def _node_id(value: str) -> str:
    """A node id argument: what the API takes (a key id), else a bad argument before anything runs."""
    from pydantic import TypeAdapter, ValidationError

    from api_schemas.common import KeyId

    try:
        return TypeAdapter(KeyId).validate_python(value)
    except ValidationError:
        raise typer.BadParameter(
            "not a node id: 43 characters of unpadded base64url (`worker register` printed it)"
        ) from None


def _revoke_reason(value: str | None) -> str | None:
    """--reason: 1 to 500 characters, no NUL, as the API takes it."""
    if value is not None and not (1 <= len(value) <= 500 and "\x00" not in value):
        raise typer.BadParameter("must be 1 to 500 characters")
    return value


@provider_app.command("revoke-node")
def provider_revoke_node(
    provider_key: ProviderKeyOpt,
    # An option, not an argument: an id may begin with "-", which an argument would be taken for.
    node_id: Annotated[
        str,
        typer.Option(
            "--node-id",
            help="The node's id (`worker register` and `provider nodes` print it)",
            callback=_node_id,
        ),
    ],
    reason: Annotated[
        str | None,
        typer.Option(
            help="Why, 1 to 500 characters (kept in the node's status history)", callback=_revoke_reason
        ),
    ] = None,
    server: ServerOpt = DEFAULT_SERVER,
) -> None:
    """Revoke one of the provider's node keys, for good, when its machine is stolen or
    compromised: the node is banned at once (every request its key signs is refused), ejected
    from its pools (its leases go back to the pools, its stake unbonds), and its key can never
    register again; run the machine again with a new node key. Results it submitted before are
    judged as usual. Prints the node's record as JSON, with the pools it was ejected from;
    running it again changes nothing."""
    key = _key_file(provider_key, "--provider-key")
    with _worker_errors():
        out = asyncio.run(_as_provider(server, key, lambda c: c.revoke_node(node_id, reason)))
    _print_model(out)


def _log_level(value: str) -> str:
    """--log-level: the names ORCH_LOG_LEVEL takes, in any case; any other is a usage error."""
    level = value.strip().upper()
    if level not in LOG_LEVELS:
        raise typer.BadParameter(f"{value!r} is not one of {', '.join(LOG_LEVELS)} (in any case)")
    return level


def _invite_code(value: str | None) -> str | None:
    """--invite-code: what the join's body takes; another used to end the run after registering,
    in pydantic's ValidationError for JoinIn (exit 1)."""
    from pydantic import ValidationError

    from api_schemas.pools import JoinIn

    try:
        JoinIn(invite_code=value)
    except ValidationError:
        # Without the value: a code is a secret, if a mistyped one.
        raise typer.BadParameter("not an invite code: 8 to 100 letters, digits, '-' or '_'") from None
    return value


async def _leave(server: str, node_key: Any, pool: str) -> Any:
    from orchestrator.worker.client import WorkerClient

    async with WorkerClient(server, node_key) as client:
        return await client.leave(pool)


@worker_app.command("leave")
def worker_leave(
    pool: Annotated[str, typer.Option("--pool", help="The pool to leave", callback=_pool_id)],
    node_key: NodeKeyOpt,
    server: ServerOpt = DEFAULT_SERVER,
) -> None:
    """Leave a pool, or withdraw a pending join (idempotent), and print the membership as JSON.
    The node's stake there starts unbonding (the pool's unbonding_period_s; a pending join's
    comes back at once), and leases it still holds there are given back. `worker run` never
    leaves: stopping it keeps the node a member. A banned node exits 4 and one whose provider
    an admin retired 5, as `worker run` does: the ban or the retirement ejected it already."""
    key = _key_file(node_key, "--node-key")
    with _worker_errors({"node_banned": BANNED_HINT, "provider_retired": RETIRED_LEAVE_HINT}, WORKER_EXITS):
        _print_model(asyncio.run(_leave(server, key, pool)))


# `worker run`'s exit statuses when the run ends on its own (``WorkerEnded``'s reasons) or the
# server refuses the node or the provider for good (problem codes); 1 for other refusals.
# `worker leave` exits with the last two, for the same refusals.
WORKER_EXITS = {
    "pool_completed": 3,
    "membership_ended": 4,
    "node_banned": 4,
    "provider_retired": 5,
}
BANNED_HINT = (
    "the node is banned: it was ejected from every pool. An admin's ban may be lifted (an admin's "
    "unban); a key its provider revoked, or its provider's retirement revoked, never "
    "works again: generate a new node key and register it (with the successor's provider key, "
    "after a retirement)"
)

RETIRED_LEAVE_HINT = (
    "the node's provider was retired by an admin (its key lost or stolen): its nodes are revoked, "
    "which ejected them from every pool, so there is nothing left to leave; its money goes to the "
    "successor provider the admin named (the stake there once its unbonding ends). This node key "
    "can do nothing any more: generate a new one and register it with the successor's provider key"
)


@worker_app.command("run")
def worker_run(
    pool: Annotated[str, typer.Option("--pool", help="The pool to work for", callback=_pool_id)],
    node_key: NodeKeyOpt,
    provider_key: Annotated[
        Path | None,
        typer.Option(
            "--provider-key",
            help="The provider's key file: registers provider and node and shows the earnings. "
            "Without it the node must already be registered.",
        ),
    ] = None,
    server: ServerOpt = DEFAULT_SERVER,
    backend: Annotated[
        str, typer.Option(help="Rollout backend: arithmetic, openai or a plugin")
    ] = "arithmetic",
    backend_opt: Annotated[
        list[str] | None, typer.Option("--backend-opt", help="Backend option key=value (repeatable)")
    ] = None,
    concurrency: Annotated[int, typer.Option(min=1, max=1024, help="Leases held at once")] = 1,
    max_tasks: Annotated[int | None, typer.Option(min=1, help="Stop after this many leases")] = None,
    specs: SpecsOpt = None,
    gpu_model: GpuModelOpt = None,
    gpu_count: GpuCountOpt = None,
    gpu_memory_mb: GpuMemoryOpt = None,
    cpu_cores: CpuCoresOpt = None,
    ram_mb: RamOpt = None,
    invite_code: Annotated[
        str | None, typer.Option(callback=_invite_code, help="Invite code, for invite-only pools")
    ] = None,
    grace_s: Annotated[
        float, typer.Option(min=0, help="On stop, seconds held leases get to finish before release")
    ] = 30.0,
    generate_timeout_s: Annotated[
        float,
        typer.Option(
            min=0,
            help="A generation running longer is cancelled and its lease given back as failed (0: no limit)",
        ),
    ] = 3600.0,
    log_level: Annotated[
        str, typer.Option(callback=_log_level, help="DEBUG, INFO, WARNING, ERROR or CRITICAL (any case)")
    ] = "INFO",
) -> None:
    """Run a worker: register, join the pool, then claim, generate and submit until stopped.

    SIGINT or SIGTERM stops it cleanly: no new claims, held leases finish within --grace-s or
    are released. A second signal quits at once. The final stats are printed as JSON.
    """
    import dataclasses

    import structlog
    from rich.live import Live

    from orchestrator.core.logging import configure_logging
    from orchestrator.worker.backends import available
    from orchestrator.worker.errors import WorkerEnded
    from orchestrator.worker.runner import WorkerConfig, WorkerStats

    if backend not in available():
        names = ", ".join(available())
        raise typer.BadParameter(f"unknown backend; available: {names}", param_hint="--backend")
    overrides = {"gpu_model": gpu_model, "gpu_count": gpu_count, "gpu_memory_mb": gpu_memory_mb}
    overrides |= {"cpu_cores": cpu_cores, "ram_mb": ram_mb}
    if provider_key is None and (specs is not None or any(v is not None for v in overrides.values())):
        # Only the provider registers the node (its attestation): without its key the server's
        # record of the node, specs included, is used as it is.
        raise typer.BadParameter(
            "--specs, --gpu-*, --cpu-cores and --ram-mb are sent only when the node registers, "
            "which needs --provider-key; without it, update them with `orchestrator worker register`",
            param_hint="--provider-key",
        )
    node_specs = _worker_specs(specs, overrides)
    node = _key_file(node_key, "--node-key")
    if provider_key is not None:
        _separate_keys(_key_file(provider_key, "--provider-key"), node)
    config = WorkerConfig(
        server=server,
        pool_id=pool,
        node_key_path=node_key,
        provider_key_path=provider_key,
        backend=backend,
        backend_options=_backend_options(list(backend_opt or [])),
        concurrency=concurrency,
        max_tasks=max_tasks,
        specs=node_specs,
        invite_code=invite_code,
        grace_s=grace_s,
        generate_timeout_s=generate_timeout_s,
    )
    from orchestrator.worker.backends import create_backend

    with _worker_errors():  # a plugin that fails otherwise (its model missing): exit 1
        try:
            rollout_backend = create_backend(backend, config.backend_options)
        except ValueError as exc:  # options it refuses are a bad argument, before anything runs
            raise typer.BadParameter(str(exc), param_hint="--backend-opt") from None
    # Colours for the rich console, which drops them where stderr is not a terminal.
    configure_logging(log_level, json=False, colors=True)
    structlog.configure(logger_factory=lambda *_: _ConsoleLogger(console))
    # Without the provider key the node must be registered already: say how, if it is not.
    unregistered = (
        "the node is not registered: register it once with `orchestrator worker register "
        "--provider-key ... --node-key ...`, or pass --provider-key here"
    )
    hints = {"unknown_key": unregistered} if provider_key is None else {}
    hints["node_banned"] = BANNED_HINT
    try:
        with (
            _worker_errors(hints, WORKER_EXITS),
            _table_ends_its_line(),
            Live(_stats_table(WorkerStats()), console=console, refresh_per_second=4) as live,
        ):
            stats = asyncio.run(_run_worker_live(config, live, rollout_backend))
    except asyncio.CancelledError as exc:
        console.print("[red]stopped at once; held leases expire on the server[/red]")
        raise typer.Exit(130) from exc
    except WorkerEnded as exc:
        # It ended on its own, its leases settled: the stats, then why, and the status for it.
        typer.echo(json.dumps(dataclasses.asdict(exc.stats)))
        console.print(escape(f"the worker ended: {exc.detail}"), style="red", soft_wrap=True)
        raise typer.Exit(WORKER_EXITS[exc.reason]) from exc
    typer.echo(json.dumps(dataclasses.asdict(stats)))


@app.command("demo")
def demo_cmd(
    duration: Annotated[float, typer.Option(min=1, help="Seconds to run at most")] = 45.0,
    honest: Annotated[int, typer.Option(min=0, help="Honest workers")] = 6,
    dishonest: Annotated[int, typer.Option(min=0, help="Dishonest workers, one of each kind in turn")] = 7,
    seed: Annotated[int, typer.Option(help="Seed of the problems and the workers' choices")] = 7,
    # One batch of the enqueue API, which takes 1 to 10,000 tasks.
    tasks: Annotated[int, typer.Option(min=1, max=10_000, help="Arithmetic problems to enqueue")] = 150,
    json_path: Annotated[
        Path | None, typer.Option("--json", help="Also write the summary here as JSON")
    ] = None,
) -> None:
    """Run a coordinator in-process with honest workers and cheaters, and show what is caught."""
    from orchestrator.demo.cli import demo

    # Refused before the run, not in a traceback once it is over (--tasks 0 or 20000, and a
    # --json in a missing directory, ended the run so).
    if json_path is not None and (json_path.is_dir() or not json_path.parent.is_dir()):
        raise typer.BadParameter(f"{json_path} is not a file in an existing directory", param_hint="--json")

    _settings()  # the demo's Settings() read ORCH_* too: one that does not parse is a line, exit 2
    demo(duration=duration, honest=honest, dishonest=dishonest, seed=seed, tasks=tasks, json_path=json_path)


if __name__ == "__main__":
    app()
