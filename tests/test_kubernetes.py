"""Kubernetes manifests in deploy/kubernetes: parsed with PyYAML, checked for the facts that matter.

No cluster is needed: the checks are about what the files say (probes, the migration Job, the
replica count, the image, secrets only as placeholders, non-root pods) and that the ConfigMap
and the Secret template together make a configuration the application accepts once the
placeholders are replaced, and refuses as they are.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]
from pydantic import ValidationError
from sqlalchemy.engine import make_url

from orchestrator.cli import check_process_model
from orchestrator.settings import Settings

REPO_ROOT = Path(__file__).resolve().parents[1]
K8S_DIR = REPO_ROOT / "deploy" / "kubernetes"
PLACEHOLDER = "change-me"
# Keys whose values are credentials: they may appear only in the Secret, and there only as placeholders.
SECRET_KEYS = {"ORCH_SEED_SECRET", "ORCH_DB__URL", "ORCH_REDIS__URL"}
IMAGE_UID = 10001  # the Dockerfile's USER


def _documents() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for path in sorted(K8S_DIR.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                assert isinstance(doc, dict), path
                doc["__file__"] = path.name
                docs.append(doc)
    return docs


DOCS = _documents()


def _one(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in DOCS if d.get("kind") == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def _pod_spec(workload: Mapping[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


def _container(workload: Mapping[str, Any]) -> dict[str, Any]:
    containers = _pod_spec(workload)["containers"]
    assert len(containers) == 1
    container: dict[str, Any] = containers[0]
    return container


def _argv(container: Mapping[str, Any]) -> list[str]:
    argv = [*container.get("command", []), *container.get("args", [])]
    return [str(a) for a in argv]


def _env_sources(container: Mapping[str, Any]) -> tuple[set[str], set[str]]:
    config_maps, secrets = set(), set()
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            config_maps.add(source["configMapRef"]["name"])
        if "secretRef" in source:
            secrets.add(source["secretRef"]["name"])
    return config_maps, secrets


def _secret_values(secret: Mapping[str, Any]) -> dict[str, str]:
    values = {k: str(v) for k, v in (secret.get("stringData") or {}).items()}
    for key, encoded in (secret.get("data") or {}).items():
        values[key] = base64.b64decode(encoded).decode()
    return values


def _walk(node: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _walk(v, f"{path}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _walk(v, f"{path}[{i}]")
    else:
        yield path, node


DEPLOYMENT = _one("Deployment", "orchestrator")
BACKGROUND = _one("Deployment", "orchestrator-background")
JOB = _one("Job", "orchestrator-migrate")
SERVICE = _one("Service", "orchestrator")
CONFIG_MAP = _one("ConfigMap")
SECRET = _one("Secret")


# ---- every manifest -------------------------------------------------------------------------


def test_every_manifest_parses_and_has_kind_and_name() -> None:
    files = {d["__file__"] for d in DOCS}
    assert {
        "deployment.yaml",
        "service.yaml",
        "migrate-job.yaml",
        "configmap.yaml",
        "secret.template.yaml",
    } <= files
    for doc in DOCS:
        assert doc.get("apiVersion") and doc.get("kind"), doc["__file__"]
        if doc["kind"] != "Kustomization":
            assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", doc["metadata"]["name"]), doc["__file__"]


def test_kustomization_lists_existing_files_and_leaves_the_secret_template_out() -> None:
    kustomization = _one("Kustomization")
    resources = kustomization["resources"]
    for resource in resources:
        assert (K8S_DIR / resource).is_file(), resource
    assert "secret.template.yaml" not in resources, "a template must never be applied as it is"
    assert {"deployment.yaml", "background-deployment.yaml", "service.yaml", "configmap.yaml"} <= set(
        resources
    )
    # The migration Job runs (and completes) before the Deployment: it is applied on its own.
    assert "migrate-job.yaml" not in resources


# ---- the Deployment -------------------------------------------------------------------------


def test_deployment_runs_several_replicas_of_orchestrator_serve() -> None:
    assert DEPLOYMENT["apiVersion"] == "apps/v1"
    assert DEPLOYMENT["spec"]["replicas"] >= 2
    selector = DEPLOYMENT["spec"]["selector"]["matchLabels"]
    labels = DEPLOYMENT["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= labels.items()
    container = _container(DEPLOYMENT)
    argv = _argv(container)
    assert argv[:2] == ["orchestrator", "serve"]
    assert argv[argv.index("--host") + 1] == "0.0.0.0"
    port = int(argv[argv.index("--port") + 1])
    (container_port,) = container["ports"]
    assert container_port["containerPort"] == port and container_port["name"] == "http"
    # Rolling updates never drop below the replica count.
    assert DEPLOYMENT["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


def test_deployment_probes_readyz_and_healthz() -> None:
    container = _container(DEPLOYMENT)
    port_names = {p["name"] for p in container["ports"]} | {p["containerPort"] for p in container["ports"]}
    readiness = container["readinessProbe"]["httpGet"]
    liveness = container["livenessProbe"]["httpGet"]
    assert readiness["path"] == "/readyz"
    assert liveness["path"] == "/healthz", "liveness must not depend on PostgreSQL or Redis"
    assert readiness["port"] in port_names and liveness["port"] in port_names
    if "startupProbe" in container:
        assert container["startupProbe"]["httpGet"]["path"] == "/healthz"


def test_the_app_serves_the_probed_paths() -> None:
    from orchestrator.app import create_app

    paths = create_app(Settings(env="test")).openapi()["paths"]
    assert "get" in paths["/readyz"] and "get" in paths["/healthz"]


def test_deployment_has_resources() -> None:
    resources = _container(DEPLOYMENT)["resources"]
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(resources[kind]), kind
    assert "memory" in resources["limits"]


WORKLOADS = pytest.mark.parametrize(
    "workload", [DEPLOYMENT, BACKGROUND, JOB], ids=["deployment", "background", "migrate-job"]
)


@WORKLOADS
def test_pods_run_as_non_root_without_privileges(workload: dict[str, Any]) -> None:
    pod = _pod_spec(workload)["securityContext"]
    assert pod["runAsNonRoot"] is True
    assert pod["runAsUser"] == IMAGE_UID and pod.get("runAsGroup", IMAGE_UID) != 0
    container = _container(workload)["securityContext"]
    assert container["allowPrivilegeEscalation"] is False
    assert container.get("privileged", False) is False
    assert "ALL" in container["capabilities"]["drop"]
    assert container.get("runAsUser", IMAGE_UID) != 0
    if container.get("readOnlyRootFilesystem"):
        mounts = {m["mountPath"] for m in _container(workload).get("volumeMounts", [])}
        assert "/tmp" in mounts, "a read-only root needs a writable /tmp"


def test_the_image_uid_matches_the_dockerfile() -> None:
    dockerfile = (REPO_ROOT / "Dockerfile").read_text()
    users = re.findall(r"^USER\s+(\S+)", dockerfile, flags=re.MULTILINE)
    assert users and users[-1].split(":")[0] == str(IMAGE_UID)


def _environment(workload: Mapping[str, Any]) -> dict[str, str]:
    """The variables a pod's container gets from the ConfigMap and its own ``env`` (not the Secret)."""
    container = _container(workload)
    config_maps, _ = _env_sources(container)
    env: dict[str, str] = {}
    if CONFIG_MAP["metadata"]["name"] in config_maps:
        env.update(CONFIG_MAP["data"])
    env.update({item["name"]: str(item["value"]) for item in container.get("env", []) if "value" in item})
    return env


def test_the_api_pods_aggregate_their_workers_metrics_in_a_fresh_volume() -> None:
    directory = _environment(DEPLOYMENT)["PROMETHEUS_MULTIPROC_DIR"]
    mounts = {m["mountPath"]: m["name"] for m in _container(DEPLOYMENT)["volumeMounts"]}
    assert directory in mounts
    volumes = {v["name"]: v for v in _pod_spec(DEPLOYMENT)["volumes"]}
    assert "emptyDir" in volumes[mounts[directory]], "per-pod and empty at start"


def test_the_background_pods_are_given_no_metrics_directory() -> None:
    """`orchestrator background` refuses PROMETHEUS_MULTIPROC_DIR (exit 2): it serves its own
    metrics, and in the API's directory they were counted twice."""
    assert "PROMETHEUS_MULTIPROC_DIR" not in _environment(BACKGROUND)


@WORKLOADS
def test_a_metrics_directory_a_pod_is_given_exists_in_that_pod(workload: dict[str, Any]) -> None:
    """prometheus_client writes its files into PROMETHEUS_MULTIPROC_DIR as soon as the metrics
    module is imported: a pod given the variable without the directory fails at start."""
    directory = _environment(workload).get("PROMETHEUS_MULTIPROC_DIR")
    if directory is None:
        return
    mounts = {m["mountPath"].rstrip("/") for m in _container(workload).get("volumeMounts", [])}
    assert directory.rstrip("/") in mounts, f"{workload['metadata']['name']}: {directory} is not mounted"


# ---- image, configuration and secrets -----------------------------------------------------


def test_deployment_and_job_use_the_same_pinned_image() -> None:
    image = _container(DEPLOYMENT)["image"]
    assert _container(JOB)["image"] == image
    assert _container(BACKGROUND)["image"] == image
    name, _, tag = image.rpartition(":")
    assert name.rsplit("/", 1)[-1] == "orchestrator"
    assert tag and tag != "latest" and "/" not in tag, "pin a tag, never :latest"
    kustomization = _one("Kustomization")
    for entry in kustomization.get("images", []):
        assert entry["name"] == name
        assert entry.get("newTag", tag) == tag, "kustomize would deploy another tag than the Job runs"


@WORKLOADS
def test_environment_comes_from_the_config_map_and_the_secret(workload: dict[str, Any]) -> None:
    container = _container(workload)
    config_maps, secrets = _env_sources(container)
    assert config_maps == {CONFIG_MAP["metadata"]["name"]}
    assert secrets == {SECRET["metadata"]["name"]}
    for item in container.get("env", []):
        assert item["name"] not in SECRET_KEYS or "valueFrom" in item, item


def test_migration_job_runs_orchestrator_migrate_once() -> None:
    assert JOB["apiVersion"] == "batch/v1"
    assert _argv(_container(JOB)) == ["orchestrator", "migrate"]
    assert _pod_spec(JOB)["restartPolicy"] in {"Never", "OnFailure"}
    assert JOB["spec"].get("parallelism", 1) == 1 and JOB["spec"].get("completions", 1) == 1
    assert JOB["spec"]["backoffLimit"] >= 1


def test_config_map_holds_no_credentials_and_only_strings() -> None:
    data = CONFIG_MAP["data"]
    assert all(isinstance(v, str) for v in data.values()), "ConfigMap values must be strings"
    assert not SECRET_KEYS & set(data), "credentials belong in the Secret"
    assert data["ORCH_ENV"] == "prod"
    assert data["ORCH_SERVER__MIGRATE_ON_START"] == "false", "the Job migrates, not N pods at once"


def test_no_plaintext_secret_values_anywhere() -> None:
    assert SECRET["__file__"] == "secret.template.yaml"
    values = _secret_values(SECRET)
    assert set(values) == SECRET_KEYS
    for key, value in values.items():
        assert PLACEHOLDER in value, f"{key} must be a placeholder in the template, got {value!r}"
    assert make_url(values["ORCH_DB__URL"]).password in (None, PLACEHOLDER)
    # Nothing else carries a credential: no password in any URL, no secret-named key with a value.
    for doc in DOCS:
        if doc is SECRET:
            continue
        for path, value in _walk(doc):
            if not isinstance(value, str):
                continue
            assert not re.search(r"://[^/@\s:]*:[^/@\s]+@", value), f"{doc['__file__']}{path}: credentials"
            if re.search(r"(secret|password|token)$", path.lower()) and "Ref" not in path:
                raise AssertionError(f"{doc['__file__']}{path} looks like a credential: {value!r}")


def _environment_of_the_pods(monkeypatch: pytest.MonkeyPatch, secret: Mapping[str, str]) -> None:
    for name in list(os.environ):
        if name.startswith("ORCH_"):
            monkeypatch.delenv(name)
    for name, value in {**CONFIG_MAP["data"], **secret}.items():
        if name.startswith("ORCH_"):
            monkeypatch.setenv(name, value)


def test_the_template_as_it_is_is_refused_by_the_app(monkeypatch: pytest.MonkeyPatch) -> None:
    _environment_of_the_pods(monkeypatch, _secret_values(SECRET))
    with pytest.raises(ValidationError, match="ORCH_SEED_SECRET must be set"):
        Settings()


def test_config_map_and_filled_secret_make_a_valid_multi_process_configuration(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    filled = {
        k: v.replace(PLACEHOLDER, "s3cr3t-value-from-the-vault") for k, v in _secret_values(SECRET).items()
    }
    _environment_of_the_pods(monkeypatch, filled)
    settings = Settings()
    assert settings.env == "prod"
    assert make_url(settings.db.url).drivername == "postgresql+asyncpg"
    assert settings.redis_url is not None and settings.redis_url.startswith("redis://")
    assert settings.server.migrate_on_start is False
    # The API pods leave the loops to the orchestrator-background Deployment.
    assert settings.server.background_loops is False
    # TLS ends at the Ingress and proxy headers are not trusted: the signed URL is rebuilt as https.
    assert settings.server.trust_proxy_headers is False and settings.server.public_scheme == "https"
    workers = settings.server.workers
    assert workers >= 1
    check_process_model(settings, workers)  # several workers need the shared hot store
    # The README's sizing rule: connections per pod stay bounded.
    per_process = settings.db.pool_size + settings.db.max_overflow
    connections = per_process * (workers * DEPLOYMENT["spec"]["replicas"] + BACKGROUND["spec"]["replicas"])
    assert connections <= 200, "would exhaust PostgreSQL's default 100-200"
    argv = _argv(_container(DEPLOYMENT))
    assert "--workers" not in argv or int(argv[argv.index("--workers") + 1]) == workers


# ---- the background Deployment ----------------------------------------------------------------


def test_the_background_deployment_runs_the_loops_and_probes_its_alive_file() -> None:
    from orchestrator.core.alive import ALIVE_INTERVAL_S

    assert BACKGROUND["spec"]["replicas"] >= 1
    selector = BACKGROUND["spec"]["selector"]["matchLabels"]
    assert selector.items() <= BACKGROUND["spec"]["template"]["metadata"]["labels"].items()
    container = _container(BACKGROUND)
    argv = _argv(container)
    assert argv[:2] == ["orchestrator", "background"]
    alive = argv[argv.index("--alive-file") + 1]
    for probe in ("livenessProbe", "startupProbe"):
        command = container[probe]["exec"]["command"]
        assert command[:3] == ["orchestrator", "alive", alive], probe
        max_age = float(command[command.index("--max-age") + 1]) if "--max-age" in command else 30.0
        assert max_age >= 3 * ALIVE_INTERVAL_S, "a probe must allow a few missed writes"
    # The file lives on a writable volume (the root file system is read-only).
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert any(alive.startswith(m.rstrip("/") + "/") for m in mounts), alive
    # Its only HTTP is its metrics, on the port it declares, on every interface of the pod.
    assert "readinessProbe" not in container, "no traffic is routed to it"
    (port,) = container["ports"]
    assert (port["name"], port["containerPort"]) == ("metrics", int(argv[argv.index("--metrics-port") + 1]))
    assert argv[argv.index("--metrics-host") + 1] == "0.0.0.0"


def test_no_http_traffic_or_api_disruption_budget_selects_the_background_pods() -> None:
    labels = BACKGROUND["spec"]["template"]["metadata"]["labels"]
    assert not SERVICE["spec"]["selector"].items() <= labels.items()
    pdb = _one("PodDisruptionBudget", "orchestrator")
    assert not pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    # The background pods have a budget of their own: a drain never evicts all of them at once.
    background_pdb = _one("PodDisruptionBudget", "orchestrator-background")
    assert background_pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert background_pdb["spec"]["minAvailable"] >= 1
    assert not BACKGROUND["spec"]["selector"]["matchLabels"].items() <= (
        DEPLOYMENT["spec"]["template"]["metadata"]["labels"].items()
    ), "each Deployment must own only its own pods"


# ---- Service ----------------------------------------------------------------------------------


def test_service_selects_the_api_pods_on_the_http_port() -> None:
    labels = DEPLOYMENT["spec"]["template"]["metadata"]["labels"]
    assert SERVICE["spec"]["selector"].items() <= labels.items()
    (port,) = SERVICE["spec"]["ports"]
    names = {p["name"] for p in _container(DEPLOYMENT)["ports"]}
    numbers = {p["containerPort"] for p in _container(DEPLOYMENT)["ports"]}
    assert port["targetPort"] in names | numbers


def test_readme_explains_running_n_replicas() -> None:
    readme = (REPO_ROOT / "README.md").read_text()
    match = re.search(r"^## Running N replicas\n(.*?)(?=^## )", readme, flags=re.MULTILINE | re.DOTALL)
    assert match, "README section 'Running N replicas'"
    section = match.group(1)
    for needle in ("deploy/kubernetes", "migrate-job.yaml", "replicas", "docker compose"):
        assert needle in section, needle
    for mentioned in re.findall(r"deploy/kubernetes/[\w.-]+\.yaml", section):
        assert (REPO_ROOT / mentioned).is_file(), mentioned


def test_kustomize_renders_both_deployments_with_the_pinned_image() -> None:
    """The real renderer, where kubectl is installed (``kubectl kustomize`` needs no cluster)."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed; the checks above read the same files")
    rendered = subprocess.run(
        [kubectl, "kustomize", str(K8S_DIR)], capture_output=True, text=True, timeout=60, check=False
    )
    assert rendered.returncode == 0, rendered.stderr
    docs = [d for d in yaml.safe_load_all(rendered.stdout) if d]
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    assert set(deployments) == {"orchestrator", "orchestrator-background"}
    (entry,) = _one("Kustomization")["images"]
    for deployment in deployments.values():
        assert _container(deployment)["image"] == f"{entry['name']}:{entry['newTag']}"
    assert not [d for d in docs if d["kind"] in {"Secret", "Job"}], "applied on their own, in order"
