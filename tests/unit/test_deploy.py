"""The deployment recipes under deploy/: the Kubernetes manifests are valid against the
Kubernetes schema (shipped by kubernetes-validate, read offline) and agree with each
other and with relaybox (ports, paths, metric names, grace periods); the container's
health check answers from a real relay; the systemd unit passes `systemd-analyze
verify` where systemd is installed. No container runtime is needed."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tomllib
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from relaybox.cli.relay import relay
from relaybox.relay.settings import RelaySettings
from tests.brokers.harness import free_port
from tests.relay_support import eventually

DEPLOY = Path(__file__).parents[2] / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
RELAYBOX = str(Path(sys.executable).parent / "relaybox")
EXPORTER = Path(__file__).parents[2] / "src" / "relaybox" / "observability" / "prometheus.py"


def _manifests() -> dict[str, dict[str, Any]]:
    """Each manifest by its kind (one resource per file)."""
    found = {}
    for path in sorted(KUBERNETES.glob("*.yaml")):
        document = yaml.safe_load(path.read_text())
        if path.name != "kustomization.yaml":
            found[f"{document['kind']}/{document['metadata']['name']}"] = document
    return found


MANIFESTS = _manifests()
DEPLOYMENT = MANIFESTS["Deployment/relaybox-relay"]
POD = DEPLOYMENT["spec"]["template"]["spec"]
(CONTAINER,) = POD["containers"]
ENV = {item["name"]: item["value"] for item in CONTAINER["env"]}
TOML = (DEPLOY / "relaybox.toml").read_text()
SETTINGS = tomllib.loads(TOML)["relay"]


@pytest.mark.parametrize("name", sorted(MANIFESTS))
def test_each_manifest_is_valid_against_the_kubernetes_schema(name: str) -> None:
    import kubernetes_validate
    from kubernetes_validate.utils import latest_version

    kubernetes_validate.validate(MANIFESTS[name], latest_version(), strict=True)


def test_the_schema_check_refuses_a_wrong_manifest() -> None:
    import kubernetes_validate
    from kubernetes_validate.utils import ValidationError, latest_version

    broken = json.loads(json.dumps(DEPLOYMENT))
    broken["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["paht"] = "/"
    with pytest.raises(ValidationError):
        kubernetes_validate.validate(broken, latest_version(), strict=True)


def test_kustomize_applies_every_manifest_of_the_relay() -> None:
    listed = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())["resources"]
    relay_files = {p.name for p in KUBERNETES.glob("*.yaml")} - {
        "kustomization.yaml", "prometheus-adapter.yaml",
    }  # fmt: skip
    assert set(listed) == relay_files


def test_the_configmap_holds_deploy_relaybox_toml_which_the_relay_accepts(
    tmp_path: Path,
) -> None:
    assert MANIFESTS["ConfigMap/relaybox-config"]["data"]["relaybox.toml"] == TOML
    (tmp_path / "relaybox.toml").write_text(TOML)
    params = relay.make_context("relay", ["--config", str(tmp_path / "relaybox.toml")]).params
    assert params["db_files"] == (SETTINGS["db_file"],)
    assert params["broker_files"] == tuple(f"{k}={v}" for k, v in SETTINGS["broker_files"].items())


def test_the_pod_reads_its_config_from_the_configmap_and_its_urls_from_the_secret() -> None:
    mounts = {m["name"]: m["mountPath"] for m in CONTAINER["volumeMounts"]}
    volumes = {v["name"]: v for v in POD["volumes"]}
    assert volumes["config"]["configMap"]["name"] == "relaybox-config"
    assert ENV["RELAYBOX_CONFIG"] == f"{mounts['config']}/relaybox.toml"
    secret = MANIFESTS["Secret/relaybox-urls"]
    assert volumes["urls"]["secret"]["secretName"] == "relaybox-urls"
    files = [SETTINGS["db_file"], *SETTINGS["broker_files"].values()]
    assert {f"{mounts['urls']}/{key}" for key in secret["stringData"]} == set(files)
    assert "RELAYBOX_DB" not in ENV
    assert "RELAYBOX_BROKER" not in ENV


def test_the_probes_hit_the_status_endpoints_and_the_stop_grace_outlasts_the_shutdown() -> None:
    port = int(ENV["RELAYBOX_HTTP"].rpartition(":")[2])
    assert SETTINGS["http"] == ENV["RELAYBOX_HTTP"]
    assert CONTAINER["ports"] == [{"name": "http", "containerPort": port}]
    assert CONTAINER["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert CONTAINER["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert POD["terminationGracePeriodSeconds"] > SETTINGS["shutdown_timeout"]
    assert POD["securityContext"]["runAsNonRoot"]
    assert POD["securityContext"]["runAsUser"] != 0


def test_the_disruption_budget_and_autoscaler_name_the_relay_and_its_metrics() -> None:
    labels = DEPLOYMENT["spec"]["template"]["metadata"]["labels"]
    budget = MANIFESTS["PodDisruptionBudget/relaybox-relay"]["spec"]
    assert budget["selector"]["matchLabels"].items() <= labels.items()
    assert budget["minAvailable"] >= 1
    hpa = MANIFESTS["HorizontalPodAutoscaler/relaybox-relay"]["spec"]
    assert hpa["scaleTargetRef"]["name"] == DEPLOYMENT["metadata"]["name"]
    assert hpa["maxReplicas"] <= SETTINGS["partitions"]
    asked = {metric["external"]["metric"]["name"] for metric in hpa["metrics"]}
    adapter = MANIFESTS["ConfigMap/prometheus-adapter-relaybox"]["data"]["config.yaml"]
    rules = yaml.safe_load(adapter)["externalRules"]
    assert asked == {rule["name"]["as"] for rule in rules}
    exported = set(re.findall(r'"(relaybox_[a-z_]+)"', EXPORTER.read_text()))
    for rule in rules:
        (series,) = re.findall(r"relaybox_[a-z_]+", rule["seriesQuery"])
        assert series in exported
        assert rule["metricsQuery"].startswith("max(")  # each relay reports the whole table


DOCKERFILE = (DEPLOY / "Dockerfile").read_text()


def _instruction(name: str) -> list[str]:
    joined = DOCKERFILE.replace("\\\n", " ")
    return [line.split(None, 1)[1] for line in joined.splitlines() if line.startswith(name + " ")]


def test_the_container_runs_as_a_user_stops_on_sigterm_and_installs_real_extras() -> None:
    (user,) = _instruction("USER")
    assert user.split(":")[0] not in ("root", "0")
    assert _instruction("STOPSIGNAL") == ["SIGTERM"]
    extras = re.search(r"ARG EXTRAS=(\S+)", DOCKERFILE)
    assert extras is not None
    with (DEPLOY.parent / "pyproject.toml").open("rb") as file:
        known = tomllib.load(file)["project"]["optional-dependencies"]
    assert set(extras.group(1).split(",")) <= known.keys()
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]["relay"]
    assert compose["stop_signal"] == "SIGTERM"
    assert int(compose["stop_grace_period"].rstrip("s")) > RelaySettings().shutdown_timeout
    (exposed,) = _instruction("EXPOSE")
    assert f"RELAYBOX_HTTP=0.0.0.0:{exposed}" in DOCKERFILE
    copied = {part for line in _instruction("COPY") if "--from" not in line
              for part in line.split()[:-1]}  # fmt: skip
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    assert {f"!{path.rstrip('/')}" for path in copied} <= {line.rstrip("/") for line in ignore}


async def test_the_container_health_check_passes_on_a_running_relay_and_fails_without(
    tmp_path: Path,
) -> None:
    (check,) = _instruction("HEALTHCHECK")
    command = json.loads(check.split(" CMD ", 1)[1])
    assert command[0] == "python"
    address = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "RELAYBOX_HTTP": address}

    def health() -> int:
        run = [sys.executable, *command[1:]]
        return subprocess.run(run, env=env, capture_output=True, check=False, timeout=10).returncode

    database = f"sqlite:///{tmp_path / 'outbox.db'}"
    subprocess.run([RELAYBOX, "migrate", "--db", database], check=True, capture_output=True)
    process = subprocess.Popen(
        [RELAYBOX, "relay", "--db", database, "--broker", "default=noop://"], env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        await eventually(lambda: _answers(address), timeout=20)
        assert health() == 0
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
    assert process.returncode == 0
    assert health() != 0


def _answers(address: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{address}/healthz", timeout=1):
            return True
    except OSError:
        return False


UNIT = DEPLOY / "systemd" / "relaybox-relay.service"


def _unit() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            name, value = line.split("=", 1)
            found.setdefault(name, []).append(value)
    return found


def test_the_systemd_unit_restarts_on_failure_as_a_user_with_its_secrets_as_credentials(
    tmp_path: Path,
) -> None:
    unit = _unit()
    assert unit["Restart"] == ["on-failure"]
    assert unit["User"] == ["relaybox"]
    assert unit["KillSignal"] == ["SIGTERM"]
    assert int(unit["TimeoutStopSec"][0].rstrip("s")) > RelaySettings().shutdown_timeout
    credentials = dict(entry.split(":", 1) for entry in unit["LoadCredential"])
    (exec_start,) = unit["ExecStart"]
    args = shlex.split(exec_start.replace("%d", str(tmp_path)))
    assert args[:2] == ["/opt/relaybox/bin/relaybox", "relay"]
    params = relay.make_context("relay", args[2:]).params
    assert params["db_files"] == (f"{tmp_path}/db-url",)
    named = {p.rpartition("/")[2] for p in (*params["db_files"], *params["broker_files"])}
    assert named == credentials.keys()
    assert "RELAYBOX_DB" not in UNIT.read_text()


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd is not installed")
def test_systemd_analyze_verifies_the_unit(tmp_path: Path) -> None:
    """`verify` checks the unit's keys and values and that ExecStart's program exists:
    the copy points it at this environment's relaybox."""
    copy = tmp_path / UNIT.name
    copy.write_text(UNIT.read_text().replace("/opt/relaybox/bin/relaybox", RELAYBOX))
    verify = ["systemd-analyze", "verify", str(copy)]
    result = subprocess.run(verify, capture_output=True, check=False, text=True, timeout=60)
    assert (result.returncode, result.stderr) == (0, "")
