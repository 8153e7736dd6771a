"""The orchestrator command line: keys, tokens, migrate, serve's process-model guard."""

from __future__ import annotations

import asyncio
import io
import re
import socket
import stat
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import create_async_engine
from typer.testing import CliRunner

from orchestrator.admin.models import ApiToken
from orchestrator.admin.tokens import hash_token
from orchestrator.audit.models import AuditEntry
from orchestrator.cli import app
from orchestrator.core.keys import generate_key, key_id_of, read_key_file
from orchestrator.settings import get_settings
from tests.conftest import DATABASE_URL, postgres_only
from tests.process_helpers import free_port

runner = CliRunner()


@pytest.fixture(autouse=True)
def _fresh_settings(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # serve checks that its address is free: not the default 8000, which anything may hold.
    monkeypatch.setenv("ORCH_SERVER__PORT", str(free_port()))
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


def test_keys_generate_writes_a_private_file_and_refuses_to_overwrite(tmp_path: Path) -> None:
    path = tmp_path / "node.key"
    result = runner.invoke(app, ["keys", "generate", str(path)])
    assert result.exit_code == 0, result.output
    key = read_key_file(path)
    assert result.stdout.strip() == key_id_of(key)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600

    again = runner.invoke(app, ["keys", "generate", str(path)])
    assert again.exit_code == 1
    said = " ".join(again.output.split())
    assert "--force" in said and "loses that identity" in said
    assert read_key_file(path).encode() == key.encode()

    forced = runner.invoke(app, ["keys", "generate", str(path), "--force"])
    assert forced.exit_code == 0
    assert read_key_file(path).encode() != key.encode()


def test_keys_generate_where_it_cannot_write_says_so_in_a_line(tmp_path: Path) -> None:
    """A missing directory used to end in a traceback (FileNotFoundError from os.open)."""
    for path, force in ((tmp_path / "no-such-dir" / "node.key", []), (tmp_path, ["--force"])):
        result = runner.invoke(app, ["keys", "generate", str(path), *force], env={"COLUMNS": "80"})
        assert result.exit_code == 1, (result.output, result.exception)
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and str(path) in lines[0], result.output
    assert list(tmp_path.iterdir()) == []


def test_create_token_prints_a_working_token_once(database_url: str) -> None:
    result = runner.invoke(
        app,
        ["admin", "create-token", "--role", "operator", "--name", "alice"],
        env={"ORCH_DB__URL": database_url},
    )
    assert result.exit_code == 0, result.output
    token = result.stdout.strip().splitlines()[-1]
    assert token.startswith("orch_")

    async def stored() -> tuple[str, str]:
        engine = create_async_engine(database_url)
        try:
            async with engine.connect() as conn:
                row = (await conn.execute(select(ApiToken.role, ApiToken.token_hash))).one()
                return row.role, row.token_hash
        finally:
            await engine.dispose()

    role, digest = asyncio.run(stored())
    assert role == "operator" and digest == hash_token(token)


def test_create_token_where_there_is_no_database_says_so_and_creates_nothing(tmp_path: Path) -> None:
    missing = tmp_path / "orchestrator.db"
    result = runner.invoke(
        app,
        ["admin", "create-token", "--role", "admin"],
        env={"ORCH_DB__URL": f"sqlite+aiosqlite:///{missing}", "COLUMNS": "200"},
    )
    assert result.exit_code == 2
    assert f"there is no database file {missing}" in result.output
    assert "where `orchestrator serve` runs" in result.output
    assert not missing.exists()


def test_create_token_on_a_database_without_the_schema_says_so(tmp_path: Path) -> None:
    empty = tmp_path / "empty.db"
    empty.touch()
    result = runner.invoke(
        app,
        ["admin", "create-token", "--role", "admin"],
        env={"ORCH_DB__URL": f"sqlite+aiosqlite:///{empty}", "COLUMNS": "200"},
    )
    assert result.exit_code == 2
    assert "has no orchestrator schema" in result.output and "orchestrator migrate" in result.output


def test_create_token_refuses_unknown_roles(database_url: str) -> None:
    result = runner.invoke(
        app, ["admin", "create-token", "--role", "root"], env={"ORCH_DB__URL": database_url}
    )
    assert result.exit_code != 0
    assert "role" in result.output


def test_serve_refuses_several_workers_without_redis() -> None:
    result = runner.invoke(app, ["serve", "--workers", "2"], env={"ORCH_REDIS__URL": ""})
    assert result.exit_code == 2
    assert "ORCH_REDIS__URL" in result.output


def test_serve_passes_the_trusted_proxies_to_uvicorn(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import uvicorn

    seen: list[dict[str, object]] = []
    monkeypatch.setattr(uvicorn, "run", lambda *args, **kwargs: seen.append(kwargs))
    env = {
        "ORCH_DB__URL": f"sqlite+aiosqlite:///{tmp_path / 'p.db'}",
        "ORCH_SERVER__MIGRATE_ON_START": "false",
    }
    assert runner.invoke(app, ["migrate"], env=env).exit_code == 0
    for extra, proxy_headers, allowed in (
        ({}, False, None),
        ({"ORCH_SERVER__TRUST_PROXY_HEADERS": "true"}, True, "*"),
        (
            {"ORCH_SERVER__TRUST_PROXY_HEADERS": "true", "ORCH_SERVER__FORWARDED_ALLOW_IPS": "10.0.0.0/8"},
            True,
            "10.0.0.0/8",
        ),
    ):
        get_settings.cache_clear()
        assert runner.invoke(app, ["serve"], env={**env, **extra}).exit_code == 0
        assert (seen[-1]["proxy_headers"], seen[-1]["forwarded_allow_ips"]) == (proxy_headers, allowed)


def test_serve_on_an_address_in_use_is_one_line_and_exit_2_before_anything_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It used to migrate the database, log "started", and only then fail in uvicorn's bind,
    the error among its start-up and shutdown lines (exit 3)."""
    import uvicorn

    started: list[object] = []
    monkeypatch.setattr(uvicorn, "run", lambda *args, **kwargs: started.append(kwargs))
    path = tmp_path / "p.db"
    env = {"ORCH_DB__URL": f"sqlite+aiosqlite:///{path}", "COLUMNS": "80"}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = runner.invoke(app, ["serve", "--host", "127.0.0.1", "--port", str(port)], env=env)
    assert result.exit_code == 2 and not started, result.output
    [line] = result.output.strip().splitlines()
    assert f"cannot serve on 127.0.0.1:{port}" in line and "--port" in line
    assert not path.exists()  # not migrated

    result = runner.invoke(app, ["serve", "--host", "127.0.0.1", "--port", str(port)], env=env)
    assert result.exit_code == 0 and started[-1]["port"] == port, result.output  # free again
    assert path.exists()


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--port", "70000"], "--port"),
        (["--port", "0"], "--port"),
        (["--workers", "0"], "--workers"),
        (["--workers", "65"], "--workers"),
    ],
)
def test_serve_refuses_a_port_or_worker_count_its_settings_refuse(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], named: str
) -> None:
    """`serve --port 70000` used to start and announce http://127.0.0.1:70000 while the socket
    listened on 70000 - 65536 = 4464 (`--port 0` served on 8000), where ORCH_SERVER__PORT=70000
    is refused: the flags now have the settings' bounds, a bad argument before anything runs."""
    import uvicorn

    started: list[object] = []
    monkeypatch.setattr(uvicorn, "run", lambda *args, **kwargs: started.append(kwargs))
    path = tmp_path / "p.db"
    result = runner.invoke(app, ["serve", *args], env={"ORCH_DB__URL": f"sqlite+aiosqlite:///{path}"})
    assert result.exit_code == 2 and not started, result.output
    assert f"Invalid value for '{named}'" in result.output
    assert not path.exists()  # not migrated


def test_serve_refuses_an_unknown_log_level_before_starting(monkeypatch: pytest.MonkeyPatch) -> None:
    import uvicorn

    started: list[object] = []
    monkeypatch.setattr(uvicorn, "run", lambda *args, **kwargs: started.append(kwargs))
    result = runner.invoke(
        app, ["serve"], env={"ORCH_LOG_LEVEL": "verbose", "ORCH_SERVER__MIGRATE_ON_START": "false"}
    )
    assert result.exit_code == 2 and not started, result.output
    assert "ORCH_LOG_LEVEL" in result.output


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"ORCH_LOG_LEVEL": "verbose"}, "ORCH_LOG_LEVEL"),
        ({"ORCH_HEARTBEAT__INTERVAL_S": "soon"}, "ORCH_HEARTBEAT__INTERVAL_S"),
        ({"ORCH_SIGNATURE__NONCE_TTL_S": "100"}, "nonce_ttl_s (100) must be 0 or at least"),
        ({"ORCH_ENV": "prod"}, "ORCH_SEED_SECRET must be set"),
        # A URL of another driver (psycopg's plain postgresql://) or none at all used to end in
        # a traceback (ModuleNotFoundError, ArgumentError), exit 1.
        ({"ORCH_DB__URL": "postgresql://u:s3cret@127.0.0.1/x"}, "ORCH_DB__URL: the driver 'postgresql'"),
        ({"ORCH_DB__URL": "sqlite:///./x.db"}, "ORCH_DB__URL: the driver 'sqlite'"),
        ({"ORCH_DB__URL": "orchestrator.db"}, "ORCH_DB__URL: not a database URL"),
        # A list setting that is not JSON: pydantic-settings' SettingsError, a traceback, exit 1.
        ({"ORCH_SERVER__ALLOWED_HOSTS": "api.example.org"}, "ORCH_SERVER__ALLOWED_HOSTS: not JSON"),
    ],
)
@pytest.mark.parametrize(
    "args", [["serve"], ["background"], ["migrate"], ["admin", "list-tokens"]], ids=" ".join
)
def test_a_setting_that_does_not_validate_is_named_in_a_line_and_exit_2(
    tmp_path: Path, args: list[str], env: dict[str, str], named: str
) -> None:
    """A bad ORCH_* value used to end every command in a 50-line traceback of pydantic's and
    typer's frames (exit 1), the setting's name near its end."""
    env = {"ORCH_DB__URL": f"sqlite+aiosqlite:///{tmp_path / 'x.db'}", "COLUMNS": "80", **env}
    result = runner.invoke(app, args, env=env)
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and named in lines[0], result.output
    assert lines[0].startswith("invalid setting"), result.output
    assert "s3cret" not in result.output  # never the value: a URL may hold a password
    assert not (tmp_path / "x.db").exists()


def test_serve_without_migrating_needs_the_schema_of_this_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without --migrate, a database with no schema or an older one is one line and exit 2
    before uvicorn starts; it used to start a server whose every request failed."""
    import uvicorn

    from orchestrator.core.migrate import head_revision

    started: list[object] = []
    monkeypatch.setattr(uvicorn, "run", lambda *args, **kwargs: started.append(kwargs))
    path = tmp_path / "s.db"
    env = {"ORCH_DB__URL": f"sqlite+aiosqlite:///{path}", "COLUMNS": "80"}

    result = runner.invoke(app, ["serve", "--no-migrate"], env=env)
    assert result.exit_code == 2 and not started, result.output
    [line] = result.output.strip().splitlines()
    assert "holds no schema" in line and f"needs revision {head_revision()}" in line
    assert "orchestrator migrate" in line
    assert not path.exists()  # not created by the check

    assert runner.invoke(app, ["migrate", "--revision", "0017"], env=env).exit_code == 0
    result = runner.invoke(app, ["serve", "--no-migrate"], env=env)
    assert result.exit_code == 2 and not started, result.output
    assert "has the schema of revision 0017" in result.output

    assert runner.invoke(app, ["migrate"], env=env).exit_code == 0
    assert runner.invoke(app, ["serve", "--no-migrate"], env=env).exit_code == 0 and len(started) == 1

    # A schema newer than this version (a rolling upgrade migrated ahead of it): a warning.
    asyncio.run(_execute(env["ORCH_DB__URL"], "UPDATE alembic_version SET version_num = '9999'"))
    result = runner.invoke(app, ["serve", "--no-migrate"], env=env)
    assert result.exit_code == 0 and len(started) == 2, result.output
    assert "revision 9999, newer than" in result.output


async def _execute(url: str, sql: str) -> None:
    from sqlalchemy import text

    engine = create_async_engine(url)
    try:
        async with engine.begin() as conn:
            await conn.execute(text(sql))
    finally:
        await engine.dispose()


def test_migrate_creates_the_schema(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'cli.db'}"
    result = runner.invoke(app, ["migrate"], env={"ORCH_DB__URL": url})
    assert result.exit_code == 0, result.output
    assert (tmp_path / "cli.db").exists()
    again = runner.invoke(app, ["migrate"], env={"ORCH_DB__URL": url})
    assert again.exit_code == 0


def test_tokens_are_listed_and_revoked_from_the_command_line(database_url: str) -> None:
    env = {"ORCH_DB__URL": database_url, "COLUMNS": "200"}
    made = runner.invoke(
        app, ["admin", "create-token", "--role", "admin", "--name", "ci", "--expires-in-days", "2"], env=env
    )
    assert made.exit_code == 0, made.output
    token = made.stdout.strip().splitlines()[-1]
    assert "valid until" in made.output

    listed = runner.invoke(app, ["admin", "list-tokens"], env=env)
    assert listed.exit_code == 0, listed.output
    token_id = next(word for word in listed.stdout.split() if word.startswith("tok_"))
    assert "ci" in listed.stdout and token not in listed.output

    revoked = runner.invoke(app, ["admin", "revoke-token", token_id], env=env)
    assert revoked.exit_code == 0, revoked.output
    assert f"token {token_id} revoked" in revoked.output

    async def stored() -> tuple[object, object, list[tuple[str, str, str]]]:
        engine = create_async_engine(database_url)
        try:
            async with engine.connect() as conn:
                row = (await conn.execute(select(ApiToken.revoked_at, ApiToken.expires_at))).one()
                audit = (
                    await conn.execute(
                        select(AuditEntry.action, AuditEntry.actor, AuditEntry.actor_role)
                        .where(AuditEntry.target_id == token_id)
                        .order_by(AuditEntry.id)
                    )
                ).all()
                return row.revoked_at, row.expires_at, [tuple(a) for a in audit]
        finally:
            await engine.dispose()

    revoked_at, expires_at, audit = asyncio.run(stored())
    assert revoked_at is not None and expires_at is not None
    # As over the API, creations and revocations are audited; the actor is the command line.
    assert audit == [("token.create", "cli", "admin"), ("token.revoke", "cli", "admin")]
    again = runner.invoke(app, ["admin", "revoke-token", token_id], env=env)
    assert again.exit_code == 0, again.output
    assert len(asyncio.run(stored())[2]) == 2  # revoking again changes nothing

    missing = runner.invoke(app, ["admin", "revoke-token", "tok_0000"], env=env)
    assert missing.exit_code == 1 and "no token tok_0000" in missing.output


def test_a_token_is_rotated_from_the_command_line(database_url: str) -> None:
    """rotate-token gives the token a new secret, printed once; the old one is refused (here:
    rotating by the old secret again finds nothing), and the rotation is audited by the CLI."""
    env = {"ORCH_DB__URL": database_url, "COLUMNS": "200"}
    made = runner.invoke(app, ["admin", "create-token", "--role", "operator", "--name", "lab"], env=env)
    assert made.exit_code == 0, made.output
    old = made.stdout.strip().splitlines()[-1]
    rotated = runner.invoke(app, ["admin", "rotate-token", old, "--expires-in-days", "30"], env=env)
    assert rotated.exit_code == 0, rotated.output
    new = rotated.stdout.strip().splitlines()[-1]
    assert new.startswith("orch_") and new != old and "valid until" in rotated.output
    assert old not in rotated.output
    again = runner.invoke(app, ["admin", "rotate-token", old], env=env)
    assert again.exit_code == 1 and "no token with this secret" in again.output

    async def stored() -> tuple[str, list[str]]:
        engine = create_async_engine(database_url)
        try:
            async with engine.connect() as conn:
                row = (await conn.execute(select(ApiToken.id, ApiToken.token_hash))).one()
                actions = await conn.scalars(
                    select(AuditEntry.action).where(AuditEntry.target_id == row.id).order_by(AuditEntry.id)
                )
                return row.token_hash, list(actions)
        finally:
            await engine.dispose()

    token_hash, actions = asyncio.run(stored())
    assert token_hash == hash_token(new)
    assert actions == ["token.create", "token.rotate"]
    both = runner.invoke(
        app, ["admin", "rotate-token", new, "--no-expiry", "--expires-in-days", "1"], env=env
    )
    assert both.exit_code == 2 and "not both" in both.output


def test_a_leaked_secret_is_revoked_by_itself_and_never_printed(database_url: str) -> None:
    """An admin who holds only a leaked secret (not its id) revokes it with the secret, and no
    answer prints a secret back."""
    env = {"ORCH_DB__URL": database_url, "COLUMNS": "200"}
    made = runner.invoke(app, ["admin", "create-token", "--role", "operator", "--name", "leaked"], env=env)
    assert made.exit_code == 0, made.output
    token = made.stdout.strip().splitlines()[-1]

    unknown = "orch_" + "x" * 43
    missing = runner.invoke(app, ["admin", "revoke-token", unknown], env=env)
    assert missing.exit_code == 1
    assert "no token with this secret" in missing.output and unknown not in missing.output

    revoked = runner.invoke(app, ["admin", "revoke-token", token], env=env)
    assert revoked.exit_code == 0, revoked.output
    assert token not in revoked.output
    listed = runner.invoke(app, ["admin", "list-tokens"], env=env)
    token_id = next(word for word in listed.stdout.split() if word.startswith("tok_"))
    assert f"token {token_id} revoked" in revoked.output

    async def revoked_at() -> object:
        engine = create_async_engine(database_url)
        try:
            async with engine.connect() as conn:
                return (
                    await conn.execute(select(ApiToken.revoked_at).where(ApiToken.id == token_id))
                ).scalar()
        finally:
            await engine.dispose()

    assert asyncio.run(revoked_at()) is not None


@pytest.mark.parametrize(
    ("args", "why"),
    [
        (["--role", "operator", "--pool", "pool_x"], "validator and trainer tokens only"),
        (["--role", "trainer", "--pool", "pool_nope"], "no pool pool_nope"),
    ],
)
def test_create_token_refuses_a_scope_that_cannot_work(database_url: str, args: list[str], why: str) -> None:
    result = runner.invoke(
        app, ["admin", "create-token", *args], env={"ORCH_DB__URL": database_url, "COLUMNS": "200"}
    )
    assert result.exit_code == 2
    assert why in result.output


@pytest.mark.parametrize("name", ["", "x" * 101, "a\x00b"], ids=["empty", "101 characters", "NUL"])
def test_create_token_refuses_a_name_the_api_refuses(database_url: str, name: str) -> None:
    """The API takes 1 to 100 characters without NUL; the command took any name: an empty one was
    stored, and 101 characters failed in PostgreSQL's varchar(100) with a ~590-line traceback."""
    env = {"ORCH_DB__URL": database_url, "COLUMNS": "200"}
    result = runner.invoke(app, ["admin", "create-token", "--role", "admin", "--name", name], env=env)
    assert result.exit_code == 2, (result.output, result.exception)
    assert "Invalid value for '--name'" in result.output
    assert _token_ids(database_url) == []


def test_a_downgrade_needs_an_explicit_revision(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'down.db'}"
    assert runner.invoke(app, ["migrate"], env={"ORCH_DB__URL": url}).exit_code == 0
    # `--downgrade` alone used to mean "down to base": every table dropped, data and all.
    result = runner.invoke(app, ["migrate", "--downgrade"], env={"ORCH_DB__URL": url})
    assert result.exit_code == 2 and "--revision" in result.output
    assert "api_tokens" in _tables(url)
    result = runner.invoke(app, ["migrate", "--downgrade", "--revision", "-1"], env={"ORCH_DB__URL": url})
    assert result.exit_code == 0, result.output
    assert "api_tokens" in _tables(url)
    # The revision reached, not the relative target ("downgraded to -1").
    from orchestrator.core.migrate import current_revision

    reached = current_revision(url)
    assert reached is not None and f"schema downgraded to {reached}" in result.output, result.output
    result = runner.invoke(app, ["migrate", "--downgrade", "--revision", "base"], env={"ORCH_DB__URL": url})
    assert result.exit_code == 0, result.output
    assert "api_tokens" not in _tables(url) and "schema downgraded to base" in result.output


def test_a_downgrade_a_revision_refuses_is_one_line_and_changes_nothing(tmp_path: Path) -> None:
    """0018 cannot hold a rejected payout: the downgrade to 0017 stops there, exit 1 with the
    reason (it was a traceback), and the revisions above it are not undone either."""
    from orchestrator.core.migrate import current_revision, head_revision
    from tests.test_migrations import _seed_payouts

    url = f"sqlite+aiosqlite:///{tmp_path / 'refused.db'}"
    assert runner.invoke(app, ["migrate"], env={"ORCH_DB__URL": url}).exit_code == 0
    asyncio.run(_seed_payouts(url))
    env = {"ORCH_DB__URL": url, "COLUMNS": "300"}
    result = runner.invoke(app, ["migrate", "--downgrade", "--revision", "0017"], env=env)
    assert result.exit_code == 1, (result.output, result.exception)
    assert "downgrade refused, the schema is unchanged" in result.output
    assert "1 payouts are rejected" in result.output and "Traceback" not in result.output
    assert current_revision(url) == head_revision()


@pytest.mark.parametrize(
    "args", [["--revision", "bogus"], ["--downgrade", "--revision", "9999"]], ids=" ".join
)
def test_migrate_to_a_revision_that_does_not_exist_is_a_bad_argument(tmp_path: Path, args: list[str]) -> None:
    """It was a ~315-line traceback of alembic's CommandError, exit 1."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'rev.db'}"
    assert runner.invoke(app, ["migrate"], env={"ORCH_DB__URL": url}).exit_code == 0
    result = runner.invoke(app, ["migrate", *args], env={"ORCH_DB__URL": url, "COLUMNS": "200"})
    assert result.exit_code == 2, (result.output, result.exception)
    output = " ".join(result.output.split())
    assert "Invalid value for --revision" in output and "Can't locate revision" in output, output
    assert "api_tokens" in _tables(url)


def _token_ids(url: str) -> list[str]:
    async def read() -> list[str]:
        engine = create_async_engine(url)
        try:
            async with engine.connect() as conn:
                return list((await conn.execute(select(ApiToken.id))).scalars())
        finally:
            await engine.dispose()

    return asyncio.run(read())


def _tables(url: str) -> set[str]:
    from sqlalchemy import inspect

    async def read() -> set[str]:
        engine = create_async_engine(url)
        try:
            async with engine.connect() as conn:
                return set(await conn.run_sync(lambda sync: inspect(sync).get_table_names()))
        finally:
            await engine.dispose()

    return asyncio.run(read())


DATABASE_COMMANDS = [
    ["admin", "create-token", "--role", "admin"],
    ["admin", "list-tokens"],
    ["admin", "revoke-token", "tok_0000"],
    ["migrate"],
    ["migrate", "--downgrade", "--revision", "-1"],
    ["serve", "--migrate"],
    ["serve", "--no-migrate"],
]


def _one_line_exit_2(args: list[str], url: str) -> str:
    result = runner.invoke(app, args, env={"ORCH_DB__URL": url, "COLUMNS": "80"})
    assert result.exit_code == 2, (result.exit_code, result.output[-2000:])
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output[-2000:]
    return lines[0]


@pytest.mark.parametrize("args", DATABASE_COMMANDS, ids=" ".join)
def test_a_database_server_that_cannot_be_reached_is_one_line_and_exit_2(args: list[str]) -> None:
    """A closed port used to print some 490 lines of traceback and exit 1; the password in the
    URL must not be printed."""
    with socket.socket() as bound:  # bound, never listening: connections to it are refused
        bound.bind(("127.0.0.1", 0))
        port = bound.getsockname()[1]
        url = f"postgresql+asyncpg://postgres:s3cret-pw@127.0.0.1:{port}/x"
        line = _one_line_exit_2(args, url)
    assert f"postgresql+asyncpg://postgres:***@127.0.0.1:{port}/x" in line
    assert "s3cret-pw" not in line
    assert "connection refused" in line and "ORCH_DB__URL" in line


@postgres_only
@pytest.mark.parametrize("args", DATABASE_COMMANDS, ids=" ".join)
def test_a_database_that_does_not_exist_is_one_line_and_exit_2(args: list[str]) -> None:
    url = make_url(DATABASE_URL).set(database="orch_no_such_db")
    line = _one_line_exit_2(args, url.render_as_string(hide_password=False))
    assert url.render_as_string(hide_password=True) in line
    assert url.password is None or str(url.password) not in line
    assert 'database "orch_no_such_db" does not exist' in line and "createdb" in line


def _create_token(name: str, env: Mapping[str, str | None]) -> None:
    made = runner.invoke(
        app,
        ["admin", "create-token", "--role", "admin", "--name", name, "--expires-in-days", "2"],
        env=env,
    )
    assert made.exit_code == 0, made.output


def test_list_tokens_shows_whole_ids_in_a_narrow_terminal(database_url: str) -> None:
    """revoke-token takes the id list-tokens shows: in an 80-column terminal (or piped, where
    Rich assumes 80) the table cut it to 'tok_6427a2d…', which no command accepts."""
    env = {"ORCH_DB__URL": database_url, "COLUMNS": "80"}
    for name in ("a rather long token name for the ci", "another"):
        _create_token(name, env)

    listed = runner.invoke(app, ["admin", "list-tokens"], env=env)
    assert listed.exit_code == 0, listed.output
    for token_id in _token_ids(database_url):
        assert token_id in listed.stdout.split(), listed.stdout


def test_list_tokens_written_to_a_pipe_gives_each_token_one_line(database_url: str) -> None:
    """Piped (to grep, say), rich assumed 80 columns and folded the dates and names of every row
    over several lines; with no COLUMNS set a pipe gets 160."""
    env: dict[str, str | None] = {"ORCH_DB__URL": database_url, "COLUMNS": None}
    name = "a rather long token name for the ci"
    _create_token(name, env)
    listed = runner.invoke(app, ["admin", "list-tokens"], env=env)
    assert listed.exit_code == 0, listed.output
    [token_id] = _token_ids(database_url)
    [row] = [line for line in listed.stdout.splitlines() if token_id in line]
    assert name in row  # not folded
    assert len(re.findall(r"\d{4}-\d{2}-\d{2} \d{2}:\d{2}", row)) == 2, row  # created and expires


def test_help_joins_a_docstrings_lines_into_paragraphs() -> None:
    """The command list and each command's help wrap at the terminal's width, not where the
    docstring's lines end in the source (the list broke 'background' after 'verifier,')."""
    listed = runner.invoke(app, ["--help"], env={"COLUMNS": "200", "TERMINAL_WIDTH": "200"})
    assert listed.exit_code == 0
    assert (
        "Run only the background loops (liveness sweeper and reconciler, lease reaper, verifier, reward and "
        "stake releases, ReST^EM barrier), without serving HTTP." in listed.output
    )
    run_help = runner.invoke(
        app, ["worker", "run", "--help"], env={"COLUMNS": "200", "TERMINAL_WIDTH": "200"}
    )
    assert (
        "SIGINT or SIGTERM stops it cleanly: no new claims, held leases finish within --grace-s or are released."
        in run_help.output
    )


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--tasks", "0"], "--tasks"),
        (["--tasks", "10001"], "--tasks"),  # above one enqueue batch: a 422 once the run had started
        (["--honest", "-1"], "--honest"),
        (["--dishonest", "-1"], "--dishonest"),
        (["--duration", "0"], "--duration"),
        (["--json", "{missing}/summary.json"], "--json"),
    ],
)
def test_demo_refuses_bad_arguments_before_it_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], named: str
) -> None:
    """--tasks 0 or 10001 ended the demo in a traceback (exit 1) and a --json in a missing
    directory did so after the whole run; negative counts and durations ran as if fine."""
    import orchestrator.demo.cli

    ran: list[object] = []
    monkeypatch.setattr(orchestrator.demo.cli, "demo", lambda **kwargs: ran.append(kwargs))
    args = [arg.format(missing=tmp_path / "missing") for arg in args]
    result = runner.invoke(app, ["demo", *args], env={"COLUMNS": "200"})
    assert result.exit_code == 2 and not ran, (result.exit_code, result.output)
    assert named in result.output

    ok = runner.invoke(app, ["demo", "--tasks", "10000", "--json", str(tmp_path / "s.json")])
    assert ok.exit_code == 0 and len(ran) == 1, ok.output


def test_the_demo_table_written_to_a_file_keeps_its_names_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """Piped or written to a file, rich assumed 80 columns and cut the table's names to
    "hone…", "forg…", "nonc…"; there it is 160 wide unless COLUMNS is set."""
    from orchestrator.core.console import wide_console
    from orchestrator.demo.cli import _table

    kind = {"nodes": 1, "submitted": 0, "accepted": 0, "rewards": 0, "slashed": 0, "ejected": 0}
    summary = {
        "elapsed_s": 45.0,
        "tasks": {"completed": 148, "total": 150},
        "verdicts": 148,
        "accepted": 117,
        "rewards_paid": 1170,
        "stake_slashed": 2000,
        "kinds": {
            "honest": {**kind, "nodes": 6, "rejected": {"wrong_answer": 5}, "refused": {}, "caught": None},
            "spoofer": {
                **kind,
                "rejected": {},
                "refused": {"signature_invalid": 10, "assignment_not_found": 9},
                "caught": True,
            },
        },
    }
    monkeypatch.delenv("COLUMNS", raising=False)
    out = io.StringIO()
    wide_console(out).print(_table(summary))
    text = out.getvalue()
    assert "spoofer" in text and "signature_invalid 10, assignment_not_found 9" in text, text
    assert max(len(line) for line in text.splitlines()) > 80
    monkeypatch.setenv("COLUMNS", "60")
    narrow = io.StringIO()
    wide_console(narrow).print(_table(summary))
    assert max(len(line) for line in narrow.getvalue().splitlines()) <= 60


def test_a_provider_is_retired_from_the_command_line(database_url: str) -> None:
    """retire-provider retires as the API does: the free stake moves to the successor, the
    retirement is audited by the CLI, the same key again is answered the same, another is refused."""
    from orchestrator.core.db import make_sessionmaker
    from orchestrator.identity.models import Provider
    from orchestrator.ledger import service as ledger
    from orchestrator.ledger.service import ProviderAccount, SystemAccount, provider_account, system_account

    lost, heir = key_id_of(generate_key()), key_id_of(generate_key())

    async def seed() -> None:
        engine = create_async_engine(database_url)
        try:
            async with make_sessionmaker(engine)() as session, session.begin():
                session.add_all([Provider(id=lost), Provider(id=heir)])
                await session.flush()
                await ledger.transfer(
                    session,
                    debit=system_account(SystemAccount.deposits),
                    credit=provider_account(lost, ProviderAccount.stake_free),
                    amount=900,
                    key=f"deposit:{lost}:cli-test",
                    reason="deposit",
                    actor="test",
                )
        finally:
            await engine.dispose()

    async def stored() -> tuple[Any, dict[str, int], list[tuple[str, str]]]:
        engine = create_async_engine(database_url)
        try:
            async with make_sessionmaker(engine)() as session:
                row = (
                    await session.execute(
                        select(Provider.retired_at, Provider.successor_id).where(Provider.id == lost)
                    )
                ).one()
                heirs = await ledger.provider_balances(session, heir)
                audit = (
                    await session.execute(
                        select(AuditEntry.action, AuditEntry.actor).where(AuditEntry.target_id == lost)
                    )
                ).all()
                return row, heirs, [tuple(a) for a in audit]
        finally:
            await engine.dispose()

    asyncio.run(seed())
    env = {"ORCH_DB__URL": database_url, "COLUMNS": "300"}
    args = ["admin", "retire-provider", "--provider-id", lost, "--successor-id", heir, "--reason", "key lost"]
    done = runner.invoke(app, [*args, "--idempotency-key", "cli-retire-1"], env=env)
    assert done.exit_code == 0, done.output
    assert f"provider {lost} retired" in done.output and "900 stake_free" in done.output
    (retired_at, successor), heirs, audit = asyncio.run(stored())
    assert retired_at is not None and successor == heir
    assert heirs["stake_free"] == 900
    assert audit == [("provider.retire", "cli")]

    again = runner.invoke(app, [*args, "--idempotency-key", "cli-retire-1"], env=env)
    assert again.exit_code == 0, again.output
    assert "retired already with this idempotency key" in again.output and "900 stake_free" in again.output
    other = runner.invoke(app, [*args, "--idempotency-key", "cli-retire-2"], env=env)
    assert other.exit_code == 2 and "retired already" in other.output
    assert asyncio.run(stored())[1]["stake_free"] == 900
    bad = runner.invoke(
        app,
        ["admin", "retire-provider", "--provider-id", "x", "--successor-id", heir, "--reason", "r"],
        env=env,
    )
    assert bad.exit_code == 2
