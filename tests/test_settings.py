"""Configuration from ORCH_* environment variables."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import BaseModel, SecretStr, ValidationError

from orchestrator.settings import Settings


def test_nested_environment_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORCH_DB__URL", "postgresql+asyncpg://u@db/orch")
    monkeypatch.setenv("ORCH_REDIS__URL", "redis://cache:6379/1")
    monkeypatch.setenv("ORCH_HEARTBEAT__INTERVAL_S", "5")
    monkeypatch.setenv("ORCH_SIGNATURE__WINDOW_S", "120")
    s = Settings()
    assert s.db.url == "postgresql+asyncpg://u@db/orch" and not s.db.is_sqlite
    assert s.redis_url == "redis://cache:6379/1"
    assert "cache" not in repr(s)  # the Redis URL may hold a password: it is a secret
    assert s.heartbeat.interval_s == 5 and s.heartbeat.unhealthy_after_s == 15
    assert s.signature.window_s == 120 and s.signature.effective_nonce_ttl_s == 241


def test_defaults_are_the_embedded_setup(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("ORCH_DB__URL", "ORCH_REDIS__URL"):
        monkeypatch.delenv(name, raising=False)
    s = Settings()
    assert s.db.url == "sqlite+aiosqlite:///./orchestrator.db"
    assert s.redis_url is None
    assert (s.heartbeat.interval_s, s.heartbeat.unhealthy_after_missed, s.heartbeat.dead_after_missed) == (
        10,
        3,
        9,
    )


def test_production_refuses_the_placeholder_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORCH_ENV", "prod")
    monkeypatch.delenv("ORCH_SEED_SECRET", raising=False)
    with pytest.raises(ValidationError, match="ORCH_SEED_SECRET"):
        Settings()
    monkeypatch.setenv("ORCH_SEED_SECRET", "a-real-long-random-secret-value")
    assert Settings().env == "prod"


def test_dead_must_come_after_unhealthy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORCH_HEARTBEAT__UNHEALTHY_AFTER_MISSED", "5")
    monkeypatch.setenv("ORCH_HEARTBEAT__DEAD_AFTER_MISSED", "4")
    with pytest.raises(ValidationError, match="dead_after_missed"):
        Settings()


def test_public_scheme_is_http_or_https(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings().server.public_scheme is None
    monkeypatch.setenv("ORCH_SERVER__PUBLIC_SCHEME", "https")
    assert Settings().server.public_scheme == "https"
    monkeypatch.setenv("ORCH_SERVER__PUBLIC_SCHEME", "ftp")
    with pytest.raises(ValidationError, match="public_scheme"):
        Settings()


def test_a_nonce_ttl_shorter_than_the_signature_window_allows_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A signature is acceptable from created = now + window until created + window: 2 x window.
    monkeypatch.setenv("ORCH_SIGNATURE__WINDOW_S", "300")
    for ttl in ("300", "600"):
        monkeypatch.setenv("ORCH_SIGNATURE__NONCE_TTL_S", ttl)
        with pytest.raises(
            ValidationError, match=r"nonce_ttl_s \(\d+\) must be 0 or at least 2 \* window_s \+ 1 = 601"
        ):
            Settings()
    for ttl, effective in (("601", 601), ("3600", 3600), ("0", 601)):
        monkeypatch.setenv("ORCH_SIGNATURE__NONCE_TTL_S", ttl)
        assert Settings().signature.effective_nonce_ttl_s == effective


def test_allowed_hosts_are_a_json_list_compared_in_lower_case(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings().server.allowed_hosts == []
    monkeypatch.setenv("ORCH_SERVER__ALLOWED_HOSTS", '["API.example.org", " api2.example.org "]')
    assert Settings().server.allowed_hosts == ["api.example.org", "api2.example.org"]


def test_an_unknown_log_level_is_refused_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    # uvicorn and structlog know different level names: one either does not know is refused
    # here, naming the setting, instead of crashing inside uvicorn (KeyError: 'verbose') or at
    # the first log line.
    for level in ("verbose", "trace", "warn", "notset"):
        monkeypatch.setenv("ORCH_LOG_LEVEL", level)
        with pytest.raises(ValidationError, match="log_level"):
            Settings()
    monkeypatch.setenv("ORCH_LOG_LEVEL", "warning")
    assert Settings().log_level == "WARNING"


def _readme_configuration_table() -> dict[str, str]:
    """The README's configuration table as {variable: default}, read as a reader would: a row
    naming several variables (`ORCH_REDIS__MAX_CONNECTIONS` / `_POOL_TIMEOUT_S`) gives the
    later ones by their name within the first one's group, each with its own default in order;
    `unset` is no default."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    match = re.search(r"^## Configuration\n(.*?)(?=^## )", readme, flags=re.MULTILINE | re.DOTALL)
    assert match, "README section 'Configuration'"
    table: dict[str, str] = {}
    for row in match.group(1).splitlines():
        if not row.startswith("| `"):
            continue
        variables_cell, default_cell = (cell.strip() for cell in row.strip("|").split(" | ")[:2])
        names = re.findall(r"`([^`]+)`", variables_cell)
        defaults = re.findall(r"`([^`]+)`", default_cell) or ["unset"] * len(names)
        assert len(defaults) == len(names), f"a default for each variable: {row[:120]}"
        for name, default in zip(names, defaults, strict=True):
            if name.startswith("_"):
                name = f"{names[0].split('__')[0]}__{name.lstrip('_')}"
            table[name] = default
    return table


def _settings_defaults(model: type[BaseModel], prefix: str = "ORCH_") -> dict[str, str]:
    """Every setting's variable with its default, written as the README writes it."""
    defaults: dict[str, str] = {}
    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            defaults |= _settings_defaults(field.annotation, f"{prefix}{name.upper()}__")
            continue
        value = field.get_default(call_default_factory=True)
        if isinstance(value, SecretStr):
            value = value.get_secret_value()
        if value is None or value == []:
            shown = "unset"
        elif isinstance(value, bool):
            shown = str(value).lower()
        elif isinstance(value, float) and value.is_integer():
            shown = str(int(value))
        else:
            shown = str(value)
        defaults[f"{prefix}{name.upper()}"] = shown
    return defaults


def test_the_readme_configuration_table_is_every_setting_with_its_default() -> None:
    """Each ORCH_* variable the README's table names is a setting with the default it shows, and
    every setting is in the table: a renamed, added or re-defaulted setting fails here until the
    README says so too."""
    documented = {k: v for k, v in _readme_configuration_table().items() if k.startswith("ORCH_")}
    assert documented == _settings_defaults(Settings)
