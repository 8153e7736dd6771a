"""The command line's refusals: an older or newer schema, out-of-range arguments, a key file
path that is a symlink. Each is one line and an exit code, never a traceback or a false success."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from orchestrator.cli import app
from orchestrator.core.keys import key_id_of, read_key_file
from orchestrator.settings import get_settings
from tests.test_cli import (
    _execute,
    _fresh_settings,  # noqa: F401 - autouse: a free port, settings read anew
)

runner = CliRunner()


def _sqlite(tmp_path: Path, name: str = "r.db") -> dict[str, str]:
    return {"ORCH_DB__URL": f"sqlite+aiosqlite:///{tmp_path / name}", "COLUMNS": "300"}


@pytest.mark.parametrize(
    "args",
    [
        ["admin", "create-token", "--role", "admin"],
        ["admin", "list-tokens"],
        ["admin", "revoke-token", "tok_x"],
    ],
    ids=" ".join,
)
def test_token_commands_on_an_older_schema_say_to_migrate_in_one_line(
    tmp_path: Path, args: list[str]
) -> None:
    """After a package upgrade, before `orchestrator migrate`: the schema has api_tokens but not
    its newer columns. The token commands checked only that the table exists, then failed in the
    INSERT/SELECT with 'no such column' (a traceback, exit 1); now they say to migrate, exit 2."""
    env = _sqlite(tmp_path)
    assert runner.invoke(app, ["migrate", "--revision", "0016"], env=env).exit_code == 0
    get_settings.cache_clear()
    result = runner.invoke(app, args, env=env)
    assert result.exit_code == 2, (result.exit_code, result.output[-400:], repr(result.exception))
    assert "orchestrator migrate" in result.output


def test_migrate_to_a_revision_below_the_current_one_does_not_report_it_reached(tmp_path: Path) -> None:
    """`migrate --revision 0014` (the operator forgot --downgrade) on a database at head changes
    nothing: it exited 0 and printed 'schema at 0014'. Now it says where the schema was left."""
    from orchestrator.core.migrate import current_revision, head_revision

    env = _sqlite(tmp_path)
    assert runner.invoke(app, ["migrate"], env=env).exit_code == 0
    result = runner.invoke(app, ["migrate", "--revision", "0014"], env=env)
    reached = current_revision(env["ORCH_DB__URL"])
    assert reached == head_revision()
    # Either refused (it is not an upgrade) or the message names the revision actually reached.
    assert result.exit_code != 0 or "schema at 0014" not in result.output, (reached, result.output)


def test_serve_migrating_at_start_on_a_newer_schema_is_not_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rolling upgrade with the default ORCH_SERVER__MIGRATE_ON_START=true: the new release has
    migrated; a replica of the previous one (re)starts. `serve --no-migrate` let it through with
    a warning, but `serve` ended in alembic's CommandError traceback "Can't locate revision
    identified by '9999'", exit 1. Now both warn and serve."""
    import uvicorn

    started: list[object] = []
    monkeypatch.setattr(uvicorn, "run", lambda *a, **kw: started.append(kw))
    env = _sqlite(tmp_path)
    assert runner.invoke(app, ["migrate"], env=env).exit_code == 0
    asyncio.run(_execute(env["ORCH_DB__URL"], "UPDATE alembic_version SET version_num = '9999'"))
    get_settings.cache_clear()
    result = runner.invoke(app, ["serve"], env=env)
    assert result.exit_code in (0, 2), (result.exit_code, repr(result.exception))
    assert "Traceback" not in result.output and "CommandError" not in result.output
    lines = result.output.strip().splitlines()
    assert started or len(lines) == 1, result.output[-600:]


def test_migrate_on_a_newer_schema_does_not_blame_a_revision_argument_never_given(tmp_path: Path) -> None:
    """Plain `orchestrator migrate` of the previous release on a newer schema said 'Invalid value
    for --revision: Can't locate revision ...' although no --revision was given."""
    env = _sqlite(tmp_path)
    assert runner.invoke(app, ["migrate"], env=env).exit_code == 0
    asyncio.run(_execute(env["ORCH_DB__URL"], "UPDATE alembic_version SET version_num = '9999'"))
    get_settings.cache_clear()
    result = runner.invoke(app, ["migrate"], env=env)
    assert result.exit_code != 0
    assert "Invalid value for --revision" not in result.output, result.output


def test_prune_evidence_with_a_large_age_is_a_bad_argument_not_a_traceback(tmp_path: Path) -> None:
    """--older-than-days had min=1 and no max: 1000000 ended in OverflowError ('date value out
    of range') from `now - timedelta(days=...)`, a traceback and exit 1."""
    env = _sqlite(tmp_path)
    assert runner.invoke(app, ["migrate"], env=env).exit_code == 0
    get_settings.cache_clear()
    result = runner.invoke(
        app, ["admin", "prune-evidence", "--older-than-days", "1000000", "--dry-run"], env=env
    )
    assert not isinstance(result.exception, OverflowError), repr(result.exception)
    assert result.exit_code in (0, 2), (result.exit_code, result.output[-300:])


def test_alive_with_a_max_age_of_nan_does_not_pass_every_file(tmp_path: Path) -> None:
    """`--max-age nan` passed the lower-bound check (nan < 10 is False) and then every age
    compared as not greater: a file written decades ago was 'alive', exit 0."""
    path = tmp_path / "alive"
    path.write_text("1.0\n")  # written in 1970
    result = runner.invoke(app, ["alive", str(path), "--max-age", "nan"])
    assert result.exit_code != 0, result.output


@pytest.mark.parametrize("idempotency_key", ["payday 2024/05", "payday-2024-05\n"], ids=["space", "newline"])
def test_provider_withdraw_refuses_an_idempotency_key_the_api_refuses_before_sending(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, idempotency_key: str
) -> None:
    """The CLI checked only the length (8 to 100); the API's Idempotency-Key also has the
    pattern [A-Za-z0-9._:-]+. 'payday 2024/05' went to the server and came back 422 (exit 1),
    not a bad argument (exit 2) before anything runs; and with re.match, whose '$' also matches
    before a final newline, 'payday-2024-05\\n' passed where the API refuses it."""
    import orchestrator.cli

    sent: list[object] = []

    def no_request(*args: object) -> object:
        sent.append(args)
        raise AssertionError("sent to the server")

    monkeypatch.setattr(orchestrator.cli, "_as_provider", no_request)
    key = tmp_path / "provider.key"
    assert runner.invoke(app, ["keys", "generate", str(key)]).exit_code == 0
    result = runner.invoke(
        app,
        [
            "provider",
            "withdraw",
            "--provider-key",
            str(key),
            "--server",
            "http://127.0.0.1:9",
            "--amount",
            "5",
            "--idempotency-key",
            idempotency_key,
        ],
    )
    assert not sent and result.exit_code == 2, (result.exit_code, result.output)


def test_demo_with_an_ambient_orch_setting_that_does_not_parse_is_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The demo 'needs no setup', yet builds Settings() from the environment: an ORCH_* value
    that does not parse (a production shell's ORCH_SERVER__ALLOWED_HOSTS=api.example.org) ended
    it in pydantic-settings' SettingsError traceback, where every other command says it in a
    line and exits 2, as the demo now does."""
    monkeypatch.setenv("ORCH_SERVER__ALLOWED_HOSTS", "api.example.org")
    result = runner.invoke(
        app, ["demo", "--duration", "1", "--honest", "0", "--dishonest", "0", "--tasks", "1"]
    )
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)


def test_keys_generate_does_not_write_the_secret_through_a_dangling_symlink(tmp_path: Path) -> None:
    """write_key_file checked path.exists() (False for a dangling symlink, and racy) and then
    opened with O_CREAT|O_TRUNC without O_EXCL: the new secret was written wherever the link
    pointed, and two concurrent runs both 'succeeded' with different key ids."""
    target = tmp_path / "elsewhere" / "stolen.key"
    target.parent.mkdir()
    link = tmp_path / "node.key"
    os.symlink(target, link)
    result = runner.invoke(app, ["keys", "generate", str(link)])
    assert not target.exists(), "the secret was written through the symlink"
    assert result.exit_code == 1, result.output


def test_keys_generate_force_replaces_a_symlink_not_the_file_it_points_to(tmp_path: Path) -> None:
    """With --force the new secret was written through a symlink (O_TRUNC on the link's
    target), into whatever file it pointed to. Now the replacement is written beside the path
    and renamed over it: the link is replaced, the file it pointed to is left as it was, and
    the new key file is the owner's only."""
    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_text("not a key\n")
    link = tmp_path / "node.key"
    os.symlink(elsewhere, link)
    result = runner.invoke(app, ["keys", "generate", str(link), "--force"])
    assert result.exit_code == 0, result.output
    assert elsewhere.read_text() == "not a key\n"
    assert not link.is_symlink() and stat.S_IMODE(link.stat().st_mode) == 0o600
    assert key_id_of(read_key_file(link)) == result.stdout.strip()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere.txt", "node.key"]  # no temporary left
