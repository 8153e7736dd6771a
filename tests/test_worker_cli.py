"""``orchestrator worker run``: argument checks, and a short run against a real server process."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from orchestrator.cli import app
from orchestrator.worker.problems import arithmetic_tasks
from tests.conftest import REDIS_URL, ROOT, _drop_prefix
from tests.process_helpers import free_port
from tests.waits import HANG_S

runner = CliRunner()
WORKER_ARGS = ["worker", "run", "--backend", "arithmetic", "--backend-opt", "error_rate=0"]
WORKER_ARGS += ["--concurrency", "2", "--cpu-cores", "4", "--ram-mb", "8192"]


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "orchestrator.cli", *args]


def test_bad_worker_arguments_are_refused_before_anything_runs(tmp_path: Path) -> None:
    key, provider = tmp_path / "node.key", tmp_path / "provider.key"
    for path in (key, provider):
        assert runner.invoke(app, ["keys", "generate", str(path)]).exit_code == 0
    base = ["worker", "run", "--pool", "pool_x", "--node-key", str(key), "--server", "http://127.0.0.1:9"]
    without_provider = runner.invoke(app, [*base, "--gpu-model", "A100"])
    assert without_provider.exit_code == 2
    assert "which needs --provider-key" in " ".join(without_provider.output.split())
    base += ["--provider-key", str(provider)]
    cases = [
        (["--node-key", str(provider)], "the node key is the provider key"),
        (["--backend", "quantum"], "unknown backend"),
        (["--backend-opt", "error_rate"], "is not key=value"),
        (["--specs", '{"gpu_count": 1}'], "cpu_cores: Field required"),
        (["--specs", '{"gpu_count": 1, "gpu_memory_mb": 1, "cpu_cores": 1, "ram_mb": 512}'], "gpu_model"),
        (["--specs", "{}", "--cpu-cores", "4"], "either --specs"),
        (["--gpu-count", "2"], "gpu_model"),
        # Options the backend refuses: they were 'worker failed: ValueError: ...', exit 1.
        (["--backend-opt", "error_rate=2"], "error_rate must be between 0 and 1"),
        (["--backend-opt", "error_rate=abc"], "'abc' is not a"),
        (["--backend-opt", "bogus=1"], "unknown arithmetic backend options: bogus"),
        (["--backend", "openai"], "the openai backend needs"),
        # The names ORCH_LOG_LEVEL takes; 'verbose' used to crash in structlog (KeyError).
        (["--log-level", "verbose"], "Invalid value for '--log-level'"),
        (["--log-level", "verbose"], "'verbose' is not one of DEBUG, INFO,"),
        (["--log-level", "trace"], "Invalid value for '--log-level'"),
        # In any case: accepted, so the next check is the one to refuse.
        (["--log-level", "warning", "--backend", "quantum"], "unknown backend"),
        # Codes the join's body refuses: they registered, then ended in pydantic's
        # ValidationError for JoinIn, exit 1. The code is not repeated: it is a secret.
        (["--invite-code", "short"], "'--invite-code': not an invite code: 8 to 100"),
        (["--invite-code", "has spaces in it"], "'--invite-code': not an invite code"),
        (["--invite-code", "x" * 101], "'--invite-code': not an invite code"),
        # The API's paths are built from these: they ended in 404 "No route matches ...".
        (["--pool", ""], "'' is not a pool id"),
        (["--pool", "pool/x"], "'pool/x' is not a pool id"),
        (["--server", "http://127.0.0.1:9/?x=1"], "a base URL takes no query or fragment"),
        (["--server", "http://127.0.0.1:9/#top"], "a base URL takes no query or fragment"),
    ]
    for extra, message in cases:
        result = runner.invoke(app, [*base, *extra], env={"COLUMNS": "200"})
        assert result.exit_code == 2, (extra, result.output)
        assert message in " ".join(result.output.split()), (extra, result.output)


def test_bad_provider_arguments_are_refused_before_anything_runs(tmp_path: Path) -> None:
    key = tmp_path / "provider.key"
    assert runner.invoke(app, ["keys", "generate", str(key)]).exit_code == 0
    base = ["--provider-key", str(key), "--server", "http://127.0.0.1:9"]
    cases = [
        (["withdraw", "--amount", "5", "--idempotency-key", "short"], "must be 8 to 100 characters"),
        (["withdraw", "--amount", "0", "--idempotency-key", "long-enough"], "--amount"),
        (["payouts", "--status", "lost"], "must be requested, paid or rejected"),
    ]
    for extra, message in cases:
        result = runner.invoke(app, ["provider", extra[0], *base, *extra[1:]], env={"COLUMNS": "200"})
        assert result.exit_code == 2, (extra, result.output)
        assert message in " ".join(result.output.split()), (extra, result.output)


def test_a_server_that_cannot_be_reached_is_named_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After the client's retries, a closed port used to end in 'worker failed: ConnectError:
    All connection attempts failed', for the provider commands too, naming no server."""
    import anyio

    async def no_wait(_: float) -> None:
        return None

    monkeypatch.setattr(anyio, "sleep", no_wait)  # the client's retries, without their waits
    key = tmp_path / "provider.key"
    assert runner.invoke(app, ["keys", "generate", str(key)]).exit_code == 0
    with socket.socket() as bound:  # bound, never listening: connections to it are refused
        bound.bind(("127.0.0.1", 0))
        server = f"http://127.0.0.1:{bound.getsockname()[1]}"
        result = runner.invoke(
            app,
            ["provider", "balance", "--provider-key", str(key), "--server", server],
            env={"COLUMNS": "200"},
        )
    assert result.exit_code == 1, (result.output, result.exception)
    last = result.output.strip().splitlines()[-1]
    assert last.startswith(f"cannot reach {server}/: ConnectError"), result.output


def test_a_key_file_that_cannot_be_read_is_a_bad_argument(tmp_path: Path) -> None:
    """A missing or garbled key file is refused as a bad argument (exit 2, naming the option
    and the file) before anything runs; it used to be 'worker failed: FileNotFoundError: ...',
    exit 1, after `run` had drawn its table."""
    good, garbled, missing = tmp_path / "good.key", tmp_path / "garbled.key", tmp_path / "missing.key"
    assert runner.invoke(app, ["keys", "generate", str(good)]).exit_code == 0
    garbled.write_text("not a key\n")
    server = ["--server", "http://127.0.0.1:9"]
    for bad in (missing, garbled):
        for option, other in (("--node-key", "--provider-key"), ("--provider-key", "--node-key")):
            keys = [option, str(bad), other, str(good)]
            for command in (["worker", "register"], ["worker", "run", "--pool", "pool_x"]):
                result = runner.invoke(app, [*command, *keys, *server], env={"COLUMNS": "200"})
                assert result.exit_code == 2, (command, keys, result.output)
                output = " ".join(result.output.split())
                assert f"Invalid value for {option}" in output and str(bad) in output, output
                assert "in flight" not in output, output


def test_a_server_that_is_not_an_http_url_is_a_bad_argument(tmp_path: Path) -> None:
    """'--server 127.0.0.1:8000' (no scheme) used to end in a ~290-line traceback of
    HTTPMessageSignaturesException ('Invalid URL: expected an encoded absolute URL'), exit 1."""
    keys = [tmp_path / "provider.key", tmp_path / "node.key"]
    for key in keys:
        assert runner.invoke(app, ["keys", "generate", str(key)]).exit_code == 0
    key_args = ["--provider-key", str(keys[0]), "--node-key", str(keys[1])]
    for server in ("127.0.0.1:8000", "localhost", "ftp://127.0.0.1:8000", "http://"):
        for command in (["worker", "register"], ["worker", "run", "--pool", "pool_x"]):
            result = runner.invoke(app, [*command, *key_args, "--server", server], env={"COLUMNS": "200"})
            assert result.exit_code == 2, (command, server, result.output, result.exception)
            output = " ".join(result.output.split())
            assert "Invalid value for '--server'" in output and "http://" in output, output


def _wait(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


@pytest.fixture
def server(database_url: str, redis_prefix: str, tmp_path: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """``orchestrator serve`` on a free port, on the test database and hot store."""
    env = {
        **os.environ,
        "ORCH_DB__URL": database_url,
        "ORCH_REDIS__PREFIX": redis_prefix,
        "ORCH_SERVER__MIGRATE_ON_START": "false",
        "ORCH_LOG_LEVEL": "WARNING",
    }
    env.pop("ORCH_REDIS__URL", None)
    if REDIS_URL:
        env["ORCH_REDIS__URL"] = REDIS_URL
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with (tmp_path / "server.log").open("wb") as log:
        proc = subprocess.Popen(
            cli("serve", "--host", "127.0.0.1", "--port", str(port)),
            env=env,
            cwd=ROOT,
            stdout=log,
            stderr=log,
        )
        try:

            def up() -> bool:
                assert proc.poll() is None, (tmp_path / "server.log").read_text()
                try:
                    return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
                except httpx.HTTPError:
                    return False

            _wait(up, HANG_S, "the server")
            yield url, env
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    if REDIS_URL:
        asyncio.run(_drop_prefix(REDIS_URL, redis_prefix))


def _pool(http: httpx.Client, headers: dict[str, str], economics: dict[str, Any], tasks: int) -> str:
    r = http.post(
        "/v1/admin/pools",
        headers=headers,
        json={"name": "cli-test", "economics": economics, "policy": {"max_leases_per_node": 4}},
    )
    assert r.status_code == 201, r.text
    pool_id = str(r.json()["id"])
    assert http.post(f"/v1/admin/pools/{pool_id}/activate", headers=headers).status_code == 200
    policy = {"step": 1, "uri": "s3://ckpt/1", "sha256": "b" * 64, "size": 10}
    assert http.post(f"/v1/admin/pools/{pool_id}/policies", headers=headers, json=policy).status_code == 201
    if tasks:
        batch = {"batch_key": "cli", "tasks": arithmetic_tasks(tasks, seed=3)}
        r = http.post(f"/v1/admin/pools/{pool_id}/tasks", headers=headers, json=batch)
        assert r.status_code == 201, r.text
    return pool_id


def admin_headers(env: dict[str, str]) -> dict[str, str]:
    """An admin token made with the CLI, against the server's database."""
    made = subprocess.run(
        cli("admin", "create-token", "--role", "admin", "--name", "cli-test"),
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return {"Authorization": f"Bearer {made.stdout.strip().splitlines()[-1]}"}


@pytest.mark.timeout(60)
def test_worker_run_submits_results_and_exits_cleanly_on_sigint(
    server: tuple[str, dict[str, str]], tmp_path: Path
) -> None:
    url, env = server
    headers = admin_headers(env)
    keys, key_ids = {}, {}
    for name in ("provider", "node"):
        keys[name] = tmp_path / f"{name}.key"
        done = subprocess.run(
            cli("keys", "generate", str(keys[name])), capture_output=True, text=True, check=True
        )
        key_ids[name] = done.stdout.strip()
        assert len(key_ids[name]) == 43

    key_args = ["--provider-key", str(keys["provider"]), "--node-key", str(keys["node"])]
    with httpx.Client(base_url=url, timeout=10) as http:
        pool_id = _pool(http, headers, {"reward_per_sample": 5}, tasks=6)

        def worker(pool: str, *extra: str) -> subprocess.Popen[str]:
            return subprocess.Popen(
                cli(*WORKER_ARGS, "--server", url, "--pool", pool, *key_args, *extra),
                env=env,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )

        proc = worker(pool_id)
        try:

            def all_submitted() -> bool:
                assert proc.poll() is None, proc.communicate()
                r = http.get(f"/v1/admin/pools/{pool_id}/tasks", params={"status": "open"}, headers=headers)
                return r.json()["items"] == []

            _wait(all_submitted, HANG_S, "the worker's results")
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=20)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert proc.returncode == 0, err
        stats = json.loads(out.strip().splitlines()[-1])
        assert stats["submitted"] == 6 and stats["state"] == "stopped" and stats["errors"] == 0
        assert "SIGINT: stopping" in err
        # The stats name the node (its key's id), which did all the work.
        node_id = stats["node_id"]
        assert node_id == key_ids["node"]
        r = http.get(f"/v1/admin/pools/{pool_id}/lease-stats", headers=headers)
        assert [(row["node_id"], row["submitted"]) for row in r.json()] == [(node_id, 6)]

        # A join the pool refuses ends the run with exit 1 and the server's reasons ...
        staked = _pool(http, headers, {"min_stake_per_node": 100}, tasks=1)
        refused = worker(staked)
        out, err = refused.communicate(timeout=20)
        assert refused.returncode == 1
        assert "403 stake_insufficient" in err and out == ""
        # On a line of its own, off a terminal too (a log file): it was glued to the table's
        # last border, '└──...──┘the server refused: ...'.
        assert any(line.startswith("the server refused: 403") for line in err.splitlines()), err

        # ... until the operator deposits the provider's stake (its id from `worker register`).
        registered = runner.invoke(app, ["worker", "register", "--server", url, *key_args])
        assert registered.exit_code == 0, registered.output
        ids = json.loads(registered.stdout.strip().splitlines()[-1])
        assert ids["node_id"] == node_id
        deposit = http.post(
            f"/v1/admin/providers/{ids['provider_id']}/deposits",
            json={"amount": 100},
            headers={**headers, "Idempotency-Key": "cli-stake"},
        )
        assert deposit.status_code == 201, deposit.text
        once = worker(staked, "--max-tasks", "1")
        out, err = once.communicate(timeout=20)  # ends by itself after one task
        assert once.returncode == 0, err
        assert json.loads(out.strip().splitlines()[-1])["submitted"] == 1

        # The provider's own commands, with its key only: its stake is locked in the pool, and
        # no reward is claimable yet (the hold), so a withdrawal is refused and moves nothing.
        provider = ["--server", url, "--provider-key", str(keys["provider"])]
        balance = runner.invoke(app, ["provider", "balance", *provider])
        assert balance.exit_code == 0, balance.output
        assert json.loads(balance.stdout)["stake_locked"] == 100
        refused = runner.invoke(
            app, ["provider", "withdraw", *provider, "--amount", "5", "--idempotency-key", "cli-payday-1"]
        )
        assert refused.exit_code == 1 and "409 insufficient_funds" in refused.output
        listed = runner.invoke(app, ["provider", "payouts", *provider])
        assert listed.exit_code == 0 and listed.stdout == ""

        # The node leaves the pool (the run never does): its stake there starts unbonding.
        leave = ["worker", "leave", "--server", url, "--pool", staked, "--node-key", str(keys["node"])]
        left = runner.invoke(app, leave)
        assert left.exit_code == 0, left.output
        assert (json.loads(left.stdout)["status"], json.loads(left.stdout)["pool_id"]) == ("left", staked)
        balance = json.loads(runner.invoke(app, ["provider", "balance", *provider]).stdout)
        assert (balance["stake_locked"], balance["stake_unbonding"]) == (0, 100)
        again = runner.invoke(app, leave)  # idempotent
        assert again.exit_code == 0 and json.loads(again.stdout)["status"] == "left", again.output

        # A node never registered, run without the provider key: refused, with what to do.
        stranger = tmp_path / "stranger.key"
        assert runner.invoke(app, ["keys", "generate", str(stranger)]).exit_code == 0
        unknown = subprocess.run(
            cli(*WORKER_ARGS[:-4], "--server", url, "--pool", staked, "--node-key", str(stranger)),
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert unknown.returncode == 1
        assert "401 unknown_key" in unknown.stderr and "orchestrator worker register" in unknown.stderr


@pytest.mark.timeout(60)
def test_a_second_signal_after_the_stats_were_printed_does_not_change_the_exit_status(
    server: tuple[str, dict[str, str]], tmp_path: Path
) -> None:
    """Ctrl-C twice in a row: when the first stop was already complete (the stats printed on
    stdout), the second signal came while the process was still exiting (for about half a
    second) and turned a clean stop into exit 130 (KeyboardInterrupt), with nothing said."""
    url, env = server
    headers = admin_headers(env)
    keys = [tmp_path / "provider.key", tmp_path / "node.key"]
    for key in keys:
        assert runner.invoke(app, ["keys", "generate", str(key)]).exit_code == 0
    key_args = ["--provider-key", str(keys[0]), "--node-key", str(keys[1])]
    with httpx.Client(base_url=url, timeout=10) as http:
        pool_id = _pool(http, headers, {"reward_per_sample": 5}, tasks=0)
        proc = subprocess.Popen(
            cli(*WORKER_ARGS, "--server", url, "--pool", pool_id, *key_args),
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:

            def joined() -> bool:
                assert proc.poll() is None, proc.communicate()
                r = http.get(f"/v1/admin/pools/{pool_id}/members", headers=headers)
                return len(r.json()["items"]) == 1

            _wait(joined, HANG_S, "the worker's join")
            proc.send_signal(signal.SIGINT)
            assert proc.stdout is not None
            stats = json.loads(proc.stdout.readline())  # the run is over
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=20)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert stats["state"] == "stopped" and out == ""
    assert proc.returncode == 0, err


def test_the_live_table_shows_the_leases_the_server_took_back() -> None:
    from rich.console import Console

    from orchestrator.cli import _stats_table
    from orchestrator.worker.runner import WorkerStats

    # done 3 = submitted 1 + dropped 2: without the row, two leases went unaccounted for.
    stats = WorkerStats(node_id="n" * 43, tasks_done=3, submitted=1, dropped=2)
    out = Console(width=80, record=True)
    out.print(_stats_table(stats))
    rows = {line.strip("│ ").split("│")[0].strip(): line for line in out.export_text().splitlines()}
    assert rows["dropped"].split("│")[-2].strip() == "2"


@pytest.mark.timeout(180)
def test_worker_run_ends_by_itself_with_a_status_of_its_own_when_no_work_can_come(
    server: tuple[str, dict[str, str]], tmp_path: Path
) -> None:
    """A worker whose pool completed exits 3, one whose node left the pool 4, one whose provider
    an admin retired 5, each with the stats (no earnings after a retirement: they are the
    successor's) and a line saying why; before, each asked the server for ever. A worker of the
    retired provider run without --provider-key exits 5 too (its node's refusal says why): it
    exited 4, as a banned node's."""
    url, env = server
    headers = admin_headers(env)

    def keys(name: str) -> list[str]:
        paths = [tmp_path / f"{name}-provider.key", tmp_path / f"{name}-node.key"]
        for path in paths:
            assert runner.invoke(app, ["keys", "generate", str(path)]).exit_code == 0
        return ["--provider-key", str(paths[0]), "--node-key", str(paths[1])]

    def ids(key_args: list[str]) -> dict[str, str]:
        done = runner.invoke(app, ["worker", "register", "--server", url, *key_args])
        assert done.exit_code == 0, done.output
        return dict(json.loads(done.stdout.strip().splitlines()[-1]))

    with httpx.Client(base_url=url, timeout=10) as http:
        done_pool = _pool(http, headers, {"reward_per_sample": 5}, tasks=0)
        pool = _pool(http, headers, {"reward_per_sample": 5}, tasks=0)
        runs: dict[str, tuple[list[str], str]] = {
            "completed": (keys("completed"), done_pool),
            "left": (keys("left"), pool),
            "retired": (keys("retired"), pool),
        }
        # Another machine of the retired provider, registered by it and run with its node key only.
        keyless_node = tmp_path / "keyless-node.key"
        assert runner.invoke(app, ["keys", "generate", str(keyless_node)]).exit_code == 0
        ids([runs["retired"][0][0], runs["retired"][0][1], "--node-key", str(keyless_node)])
        runs["keyless"] = (["--node-key", str(keyless_node)], pool)
        specs = WORKER_ARGS.index("--cpu-cores")  # sent only with the provider key
        procs = {
            name: subprocess.Popen(
                cli(
                    *(WORKER_ARGS if name != "keyless" else WORKER_ARGS[:specs]),
                    "--server",
                    url,
                    "--pool",
                    pool_id,
                    *key_args,
                ),
                env=env,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for name, (key_args, pool_id) in runs.items()
        }
        try:

            def members(pool_id: str) -> int:
                for proc in procs.values():
                    assert proc.poll() is None, proc.communicate()
                r = http.get(
                    f"/v1/admin/pools/{pool_id}/members", params={"status": "active"}, headers=headers
                )
                return len(r.json()["items"])

            _wait(lambda: members(done_pool) == 1 and members(pool) == 3, HANG_S, "the workers' joins")
            for action in ("pause", "complete"):
                r = http.post(f"/v1/admin/pools/{done_pool}/{action}", headers=headers)
                assert r.status_code == 200, r.text
            node_key = runs["left"][0][3]
            left = runner.invoke(
                app, ["worker", "leave", "--server", url, "--pool", pool, "--node-key", node_key]
            )
            assert left.exit_code == 0, left.output
            retired = ids(runs["retired"][0])["provider_id"]
            heir = ids(keys("heir"))["provider_id"]
            r = http.post(
                f"/v1/admin/providers/{retired}/retire",
                json={"successor_id": heir, "reason": "provider key stolen"},
                headers={**headers, "Idempotency-Key": "cli-retire-1"},
            )
            assert r.status_code == 201, r.text
            ended = {name: proc.communicate(timeout=HANG_S) for name, proc in procs.items()}
            # `worker leave` says it as `worker run` does, with the same statuses: the retired
            # provider's node 5 (it exited 1, "refused: node_banned", with no word of the
            # retirement), a banned node 4.
            for name in ("retired", "keyless"):
                node_key = runs[name][0][-1]
                gone = runner.invoke(
                    app, ["worker", "leave", "--server", url, "--pool", pool, "--node-key", node_key]
                )
                assert gone.exit_code == 5, gone.output
                assert "provider was retired by an admin" in " ".join(gone.output.split())
            r = http.post(
                f"/v1/admin/nodes/{ids(runs['left'][0])['node_id']}/ban",
                json={"reason": "x"},
                headers=headers,
            )
            assert r.status_code == 200, r.text
            banned = runner.invoke(
                app, ["worker", "leave", "--server", url, "--pool", pool, "--node-key", runs["left"][0][3]]
            )
            assert banned.exit_code == 4 and "the node is banned" in banned.output, banned.output
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate()
    codes = {name: proc.returncode for name, proc in procs.items()}
    assert codes == {"completed": 3, "left": 4, "retired": 5, "keyless": 5}, ended
    said = {name: " ".join(err.split()) for name, (_, err) in ended.items()}
    stats = {name: json.loads(out.strip().splitlines()[-1]) for name, (out, _) in ended.items()}
    assert f"the worker ended: the pool {done_pool} is over (the pool is completed)" in said["completed"]
    assert f"the worker ended: the node left the pool {pool}" in said["left"]
    assert f"the worker ended: the provider {retired} was retired by an admin" in said["retired"]
    assert "went to the successor provider" in said["retired"]
    assert f"the worker ended: the provider {retired} was retired by an admin" in said["keyless"]
    assert stats["retired"]["earnings"] is None and stats["left"]["earnings"] == 0
    assert stats["keyless"]["earnings"] is None
    assert all(s["state"] == "stopped" and s["in_flight"] == 0 for s in stats.values())
