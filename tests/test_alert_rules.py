"""deploy/prometheus/alerts.yaml: well-formed rules that only name metrics and labels the
service really exports (checked against a scrape of ``/metrics``), and, where promtool is
installed (``.ci/run`` fetches it), ``promtool check rules`` and the rules' unit tests in
deploy/prometheus/alerts.test.yaml."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml  # type: ignore[import-untyped]
from prometheus_client.parser import text_string_to_metric_families

RULES = Path(__file__).resolve().parents[1] / "deploy" / "prometheus" / "alerts.yaml"
RULE_TESTS = RULES.with_name("alerts.test.yaml")
_SELECTOR = re.compile(r"\b(orchestrator_\w+)(?:\{([^}]*)\})?")
_GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")


def _rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def test_every_rule_is_complete() -> None:
    rules = _rules()
    assert rules
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names)), "alert names are unique"
    for rule in rules:
        assert re.fullmatch(r"Orchestrator[A-Z]\w+", rule["alert"]), rule["alert"]
        assert rule["expr"].strip() and re.fullmatch(r"\d+[smh]", rule["for"]), rule["alert"]
        assert rule["labels"]["severity"] in {"warning", "critical"}, rule["alert"]
        assert rule["annotations"]["summary"], rule["alert"]


async def test_the_rules_name_only_exported_metrics_and_labels(client: httpx.AsyncClient) -> None:
    await client.get("/healthz")  # so the request counter has a sample to show
    text = (await client.get("/metrics")).text
    labels: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels.setdefault(sample.name, set()).update(sample.labels)
    for rule in _rules():
        expr = rule["expr"]
        used = _SELECTOR.findall(expr)
        assert used, f"{rule['alert']} names no orchestrator metric"
        grouped = {g.strip() for groups in _GROUPING.findall(expr) for g in groups.split(",") if g.strip()}
        for metric, selector in used:
            assert metric in labels, f"{rule['alert']}: {metric} is not exported"
            matchers = {m.split("=")[0].rstrip("!~").strip() for m in selector.split(",") if m.strip()}
            assert matchers <= labels[metric], (
                f"{rule['alert']}: {metric} has no label {matchers - labels[metric]}"
            )
        exported = set().union(*(labels[m] for m, _ in used))
        assert grouped <= exported, f"{rule['alert']}: grouping by {grouped - exported}, which no metric has"


@pytest.mark.parametrize(
    "command", [("check", "rules", RULES), ("test", "rules", RULE_TESTS)], ids=["check", "unit-tests"]
)
def test_promtool_accepts_the_rules_and_they_fire_when_they_should(command: tuple[str, str, Path]) -> None:
    """``check rules``: the expressions parse; ``test rules``: each alert fires on the series in
    alerts.test.yaml that should raise it (with its labels and text), and not before."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (.ci/run fetches it); the tests above check names and labels")
    done = subprocess.run(
        [promtool, *map(str, command)], capture_output=True, text=True, check=False, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
