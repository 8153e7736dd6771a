"""Deployment files: docker-compose.yml, Dockerfile and .dockerignore.

The compose facts are written once (``assert_stack``) and fed two sources:

* ``docker compose config --format json``: the real parser, with interpolation and
  validation; skipped where the docker client has no compose plugin;
* PyYAML on the raw file, with the few ``${VAR:-default}`` forms the file uses interpolated
  here the way compose does (``$$`` stays escaped, as in ``config`` output). Always runs.

No image is built and no container is started.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError
from sqlalchemy.engine import make_url

from orchestrator.cli import check_process_model
from orchestrator.settings import Settings

REPO_ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"
DOCKERFILE = REPO_ROOT / "Dockerfile"
DOCKERIGNORE = REPO_ROOT / ".dockerignore"

# Variables docker-compose.yml reads; removed from the inherited environment so each test
# decides them.
COMPOSE_VARIABLES = ("ORCH_SEED_SECRET", "POSTGRES_PASSWORD")
TEST_SECRET = "test-secret"

CONFIG_JSON = ("config", "--format", "json")

ComposeLoader = Callable[[Mapping[str, str]], dict[str, Any]]


# ---- sources -------------------------------------------------------------------------


@functools.cache
def _docker_compose() -> str | None:
    docker = shutil.which("docker")
    if docker is None:
        return None
    try:
        probe = subprocess.run(
            [docker, "compose", "version"], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return docker if probe.returncode == 0 else None


def _load_with_docker(variables: Mapping[str, str]) -> dict[str, Any]:
    docker = _docker_compose()
    assert docker is not None
    env = {k: v for k, v in os.environ.items() if k not in COMPOSE_VARIABLES}
    env.update(variables)
    result = subprocess.run(
        # --env-file: a developer's .env must not change what is checked.
        [docker, "compose", "--env-file", os.devnull, "-f", "docker-compose.yml", *CONFIG_JSON],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, f"docker compose config failed:\n{result.stderr}"
    config: dict[str, Any] = json.loads(result.stdout)
    return config


_VARIABLE = re.compile(r"\$\$|\$\{(?P<name>\w+)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}|\$(?P<bare>\w+)")


def _interpolate(value: Any, variables: Mapping[str, str]) -> Any:
    """Compose-style interpolation of the raw YAML, as ``docker compose config`` prints it."""
    if isinstance(value, dict):
        return {k: _interpolate(v, variables) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v, variables) for v in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$$"
        name = match.group("name") or match.group("bare")
        op, arg = match.group("op"), match.group("arg") or ""
        current = variables.get(name)
        unset = current is None or (op is not None and op.startswith(":") and current == "")
        if op is not None and op.endswith("?") and unset:
            raise AssertionError(f"compose would refuse to start: {name}: {arg}")
        if op is not None and op.endswith("-") and unset:
            return arg
        return current or ""

    return _VARIABLE.sub(substitute, value)


def _load_with_pyyaml(variables: Mapping[str, str]) -> dict[str, Any]:
    raw = yaml.safe_load(COMPOSE_FILE.read_text())  # SafeLoader resolves the `<<` merge keys
    assert isinstance(raw, dict)
    config: dict[str, Any] = _interpolate(raw, variables)
    return config


@pytest.fixture(params=["docker", "pyyaml"], ids=["docker-compose-config", "pyyaml"])
def load_compose(request: pytest.FixtureRequest) -> ComposeLoader:
    if request.param == "docker":
        if _docker_compose() is None:
            pytest.skip("`docker compose` is not available; the pyyaml variant checks the same facts")
        return _load_with_docker
    return _load_with_pyyaml


# ---- normalising the two shapes (short syntax in YAML, long syntax in config output) --


def _environment(service: Mapping[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        return dict(item.split("=", 1) for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def _argv(command: str | list[str] | None) -> list[str]:
    if command is None:
        return []
    return shlex.split(command) if isinstance(command, str) else list(command)


def _healthcheck(service: Mapping[str, Any]) -> str:
    test = service.get("healthcheck", {}).get("test")
    assert test, f"no healthcheck: {service}"
    return " ".join(test) if isinstance(test, list) else str(test)


def _condition(service: Mapping[str, Any], dependency: str) -> str | None:
    depends_on = service.get("depends_on") or {}
    if isinstance(depends_on, list):
        return "service_started" if dependency in depends_on else None
    entry = depends_on.get(dependency)
    return None if entry is None else entry.get("condition", "service_started")


def _published_ports(service: Mapping[str, Any]) -> set[str]:
    published = set()
    for port in service.get("ports") or []:
        if isinstance(port, dict):
            if port.get("published") is not None:
                published.add(str(port["published"]))
        else:
            parts = str(port).split(":")
            if len(parts) >= 2:
                published.add(parts[-2])
    return published


def _volume_targets(service: Mapping[str, Any]) -> dict[str, str]:
    targets = {}
    for volume in service.get("volumes") or []:
        if isinstance(volume, dict):
            targets[volume["target"]] = volume.get("source", "")
        else:
            source, target = str(volume).split(":")[:2]
            targets[target] = source
    return targets


def _nginx_conf(config: Mapping[str, Any], service: Mapping[str, Any]) -> str:
    (mount,) = [c for c in service["configs"] if c["target"] == "/etc/nginx/conf.d/default.conf"]
    content = config["configs"][mount["source"]]["content"]
    return str(content).replace("$$", "$")  # compose's escape for a literal `$`


def _nginx_size(value: str) -> int:
    units = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}
    match = re.fullmatch(r"(\d+)([kKmMgG]?)", value)
    assert match, value
    return int(match.group(1)) * units[match.group(2).lower()]


# ---- the facts --------------------------------------------------------------------------


def assert_stack(config: Mapping[str, Any], *, seed_secret: str) -> None:
    services = config["services"]
    assert {"postgres", "redis", "migrate", "api", "background", "lb"} <= set(services)
    postgres, redis, migrate, api, background, lb = (
        services[name] for name in ("postgres", "redis", "migrate", "api", "background", "lb")
    )

    # postgres: 16, healthy when pg_isready says so, data in a named volume
    assert postgres["image"].startswith("postgres:16")
    assert "pg_isready" in _healthcheck(postgres)
    data_volume = _volume_targets(postgres)["/var/lib/postgresql/data"]
    assert data_volume in config["volumes"], "postgres data must live in a named volume"
    pg_env = _environment(postgres)
    assert pg_env["POSTGRES_PASSWORD"], "postgres needs a password (a dev default is fine)"

    # redis: 7, healthy on PING
    assert redis["image"].startswith("redis:7")
    assert "redis-cli ping" in _healthcheck(redis)

    # migrate: one-shot `orchestrator migrate`, built from this Dockerfile, after postgres is healthy
    assert _argv(migrate["command"]) == ["orchestrator", "migrate"]
    assert _condition(migrate, "postgres") == "service_healthy"
    assert migrate.get("restart") == "no"
    build = migrate["build"]
    build = {"context": build} if isinstance(build, str) else build
    assert (REPO_ROOT / build["context"] / build.get("dockerfile", "Dockerfile")).resolve() == DOCKERFILE

    # api: the same image, two replicas, only after the migration succeeded and redis is healthy
    assert api["image"] == migrate["image"]
    assert api["deploy"]["replicas"] == 2
    assert _condition(api, "migrate") == "service_completed_successfully"
    assert _condition(api, "redis") == "service_healthy"
    argv = _argv(api.get("command"))
    assert argv == [] or argv[:2] == ["orchestrator", "serve"], "api runs the image's `orchestrator serve`"
    assert "/readyz" in _healthcheck(api)

    env = _environment(api)
    assert env["ORCH_ENV"] == "prod"
    assert env["ORCH_SEED_SECRET"] == seed_secret, "the seed secret comes from the caller only"
    assert env["ORCH_REDIS__URL"] == "redis://redis:6379/0"
    assert env["ORCH_SERVER__WORKERS"] == "2"
    assert env["ORCH_SERVER__MIGRATE_ON_START"] == "false"
    assert env["ORCH_SERVER__TRUST_PROXY_HEADERS"] == "true"
    assert env["ORCH_SERVER__BACKGROUND_LOOPS"] == "false", "the background service runs the loops"
    assert _environment(migrate)["ORCH_DB__URL"] == env["ORCH_DB__URL"]

    # background: the loops in a process of their own, on the same database, store and secret,
    # healthy while its event loop keeps rewriting the alive file
    assert background["image"] == migrate["image"]
    assert _condition(background, "migrate") == "service_completed_successfully"
    assert _condition(background, "redis") == "service_healthy"
    argv = _argv(background["command"])
    assert argv[:2] == ["orchestrator", "background"]
    alive = argv[argv.index("--alive-file") + 1]
    assert f"orchestrator alive {alive}" in _healthcheck(background)
    background_env = _environment(background)
    for name in ("ORCH_DB__URL", "ORCH_REDIS__URL", "ORCH_SEED_SECRET", "ORCH_ENV"):
        assert background_env[name] == env[name], name
    assert not background.get("ports")  # nothing published: its metrics are for the compose network
    assert "PROMETHEUS_MULTIPROC_DIR" not in background_env, "orchestrator background refuses it"
    assert argv[argv.index("--metrics-host") + 1] == "0.0.0.0"  # reachable from another container
    assert 1 <= int(argv[argv.index("--metrics-port") + 1]) <= 65535

    db = make_url(env["ORCH_DB__URL"])
    assert db.drivername == "postgresql+asyncpg"
    assert (db.host, db.port) == ("postgres", 5432)
    assert db.username == pg_env["POSTGRES_USER"]
    assert db.password == pg_env["POSTGRES_PASSWORD"]
    assert db.database == pg_env["POSTGRES_DB"]

    prom_dir = env["PROMETHEUS_MULTIPROC_DIR"]
    assert any(str(t).split(":")[0] == prom_dir for t in api.get("tmpfs") or []), (
        "PROMETHEUS_MULTIPROC_DIR must be a fresh tmpfs per container"
    )

    # Proxy headers are trusted from anyone, so the replicas must be reachable only via lb.
    assert not api.get("ports"), "api replicas must not publish ports (they trust X-Forwarded-*)"

    # lb: the only published port, in front of the replicas
    assert "8000" in _published_ports(lb)
    assert _condition(lb, "api") is not None
    nginx = _nginx_conf(config, lb)
    assert "http://api:8000" in nginx
    assert "proxy_set_header X-Forwarded-For $remote_addr;" in nginx
    assert "$proxy_add_x_forwarded_for" not in nginx, "appending lets clients choose their address"
    assert "proxy_set_header Host $http_host;" in nginx, "signatures cover @target-uri (Host)"
    assert "proxy_set_header X-Forwarded-Proto $scheme;" in nginx
    body_limit = re.search(r"client_max_body_size\s+(\w+);", nginx)
    assert body_limit, "nginx's 1 MiB default would reject result submissions"
    assert _nginx_size(body_limit.group(1)) >= Settings().limits.max_result_body_bytes


def _use_environment(monkeypatch: pytest.MonkeyPatch, env: Mapping[str, str]) -> None:
    for name in list(os.environ):
        if name.startswith("ORCH_"):
            monkeypatch.delenv(name)
    for name, value in env.items():
        if name.startswith("ORCH_"):
            monkeypatch.setenv(name, value)


# ---- compose ------------------------------------------------------------------------------


def test_compose_stack(load_compose: ComposeLoader) -> None:
    assert_stack(load_compose({"ORCH_SEED_SECRET": TEST_SECRET}), seed_secret=TEST_SECRET)


def test_compose_environment_is_a_valid_prod_configuration(
    load_compose: ComposeLoader, monkeypatch: pytest.MonkeyPatch
) -> None:
    services = load_compose({"ORCH_SEED_SECRET": TEST_SECRET})["services"]
    _use_environment(monkeypatch, _environment(services["background"]))
    settings = Settings()
    # What `orchestrator background` refuses to run without: a shared store and database.
    assert settings.redis_url is not None and not settings.db.is_sqlite
    _use_environment(monkeypatch, _environment(services["api"]))
    settings = Settings()
    assert settings.env == "prod"
    assert settings.seed_secret.get_secret_value() == TEST_SECRET
    assert not settings.db.is_sqlite
    assert settings.redis_url == "redis://redis:6379/0"
    assert settings.server.workers == 2
    assert settings.server.migrate_on_start is False
    assert settings.server.trust_proxy_headers is True
    check_process_model(settings, settings.server.workers)  # several workers need the shared store


def test_compose_without_seed_secret_is_refused_by_the_app(
    load_compose: ComposeLoader, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No insecure default: unset, the secret is empty and prod settings refuse it."""
    services = load_compose({})["services"]
    for name in ("migrate", "api", "background"):
        env = _environment(services[name])
        assert env["ORCH_SEED_SECRET"] == ""
        _use_environment(monkeypatch, env)
        with pytest.raises(ValidationError, match="ORCH_SEED_SECRET must be set"):
            Settings()


def test_interpolation_emulation_matches_compose_rules() -> None:
    variables = {"SET": "value", "EMPTY": ""}
    assert _interpolate("${SET:-d}/${EMPTY:-d}/${EMPTY-d}/${UNSET-d}/${UNSET}/$$x", variables) == (
        "value/d//d//$$x"
    )
    with pytest.raises(AssertionError, match="refuse"):
        _interpolate("${UNSET:?set it}", variables)


# ---- Dockerfile -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str


def _dockerfile_stages() -> list[list[Instruction]]:
    logical: list[str] = []
    buffer = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            buffer += line[:-1] + " "
            continue
        logical.append(buffer + line)
        buffer = ""
    assert not buffer, "dangling line continuation"
    stages: list[list[Instruction]] = []
    for line in logical:
        keyword, _, args = line.partition(" ")
        instruction = Instruction(keyword.upper(), args.strip())
        if instruction.keyword == "FROM":
            stages.append([])
        assert stages, f"instruction before FROM: {line}"
        stages[-1].append(instruction)
    return stages


def _args(stage: list[Instruction], keyword: str) -> list[str]:
    return [i.args for i in stage if i.keyword == keyword]


def _env(stage: list[Instruction]) -> dict[str, str]:
    env: dict[str, str] = {}
    for args in _args(stage, "ENV"):
        for pair in shlex.split(args):
            name, _, value = pair.partition("=")
            env[name] = value
    return env


def test_dockerfile_is_multi_stage_on_python_311_slim() -> None:
    stages = _dockerfile_stages()
    assert len(stages) >= 2
    for stage in stages:
        assert stage[0].args.split()[0] == "python:3.11-slim"
    builder_name = stages[0][0].args.split()[-1]
    builder_runs = " ".join(_args(stages[0], "RUN"))
    assert re.search(r"\bpip install \.(\s|$)", builder_runs), "a non-editable `pip install .`"
    assert not re.search(r"pip install[^&]*\s(-e|--editable)\b", builder_runs)
    runtime_copies = _args(stages[-1], "COPY")
    assert f"--from={builder_name} /opt/venv /opt/venv" in runtime_copies
    assert not _args(stages[-1], "RUN") or "pip install" not in " ".join(_args(stages[-1], "RUN"))


def test_dockerfile_runs_as_non_root() -> None:
    runtime = _dockerfile_stages()[-1]
    users = _args(runtime, "USER")
    assert users, "the runtime stage must set USER"
    user = users[-1].split(":")[0]
    assert user not in {"root", "0"}
    if user.isdigit():
        assert int(user) >= 1000
        assert re.search(rf"useradd\b.*--uid {user}\b", " ".join(_args(runtime, "RUN")))


def test_dockerfile_serves_on_8000_and_checks_healthz() -> None:
    runtime = _dockerfile_stages()[-1]
    (cmd,) = _args(runtime, "CMD")[-1:]
    argv = json.loads(cmd)  # exec form: signals reach the server, no shell in between
    assert argv[:2] == ["orchestrator", "serve"]
    assert argv[argv.index("--host") + 1] == "0.0.0.0"
    assert argv[argv.index("--port") + 1] == "8000"
    assert "8000" in " ".join(_args(runtime, "EXPOSE")).split()
    healthcheck = " ".join(_args(runtime, "HEALTHCHECK"))
    assert "/healthz" in healthcheck
    assert "python" in healthcheck and "curl" not in healthcheck
    env = _env(runtime)
    assert env["ORCH_SERVER__MIGRATE_ON_START"] == "false"
    assert env["PATH"].startswith("/opt/venv/bin:")


def test_dockerfile_copies_every_packaged_package() -> None:
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert {"orchestrator", "api_schemas", "migrations"} <= packages
    sources = _builder_copy_sources()
    assert packages <= sources
    assert {"pyproject.toml", pyproject["project"]["readme"]} <= sources


def _builder_copy_sources() -> set[str]:
    sources: set[str] = set()
    for args in _args(_dockerfile_stages()[0], "COPY"):
        parts = [p for p in args.split() if not p.startswith("--")]
        sources.update(p.rstrip("/").removeprefix("./") for p in parts[:-1])
    return sources


def _dockerignored(path: str, patterns: list[str]) -> bool:
    return any(fnmatch(path, p) or fnmatch(path, p.removeprefix("**/")) for p in patterns)


def test_dockerignore_keeps_build_inputs_and_drops_local_state() -> None:
    patterns = [
        line.strip().lstrip("/")
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert not [p for p in patterns if p.startswith("!")], "no re-includes expected"
    for source in _builder_copy_sources():
        assert not _dockerignored(source, patterns), f"{source} is copied but ignored"
    for local in (".venv", ".git", "orchestrator.db", ".env", "orchestrator/__pycache__", ".pytest_cache"):
        assert _dockerignored(local, patterns), f"{local} should not be in the build context"
