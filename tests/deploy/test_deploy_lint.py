"""Deployment files are code: the Dockerfile passes hadolint and the
Kubernetes manifests pass `kubernetes-validate --strict`, and the manifests
agree with each other and with the server's flags."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest
import yaml

from grain_elevator.tools import cli
from helpers import ROOT

DEPLOY = ROOT / "deploy"
K8S = sorted((DEPLOY / "k8s").glob("*.yaml"))


def _tool(name: str) -> str:
  path = shutil.which(name) or str(pathlib.Path(sys.executable).parent / name)
  if not pathlib.Path(path).exists():
    pytest.skip(f"{name} is not installed (the [test] extra installs it)")
  return path


def test_hadolint_finds_nothing():
  result = subprocess.run([_tool("hadolint"), "--no-color", str(DEPLOY / "Dockerfile")],
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stdout + result.stderr


def test_kubernetes_validate_strict():
  result = subprocess.run([_tool("kubernetes-validate"), "--strict", *map(str, K8S)],
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stdout + result.stderr
  assert result.stdout.count("passed") + result.stderr.count("passed") >= 5


def _objects() -> dict[tuple[str, str], dict]:
  return {(doc["kind"], doc["metadata"]["name"]): doc
          for path in K8S for doc in yaml.safe_load_all(path.read_text()) if doc}


def test_the_manifests_agree_with_the_server_flags_and_each_other():
  objects = _objects()
  deployment = objects[("Deployment", "grain-elevator")]
  pod = deployment["spec"]["template"]
  (container,) = pod["spec"]["containers"]
  args = container["args"]
  # Every flag parses as `elevator` parses it.
  parsed = cli.build_parser().parse_args(args)
  ports = {p["name"]: p["containerPort"] for p in container["ports"]}
  assert ports == {"grpc": parsed.port, "bulk": parsed.bulk_port,
                   "health": parsed.health_port, "metrics": parsed.metrics_port}
  # Every probe asks the health port and says how long it may take.
  probes = [container[k] for k in ("startupProbe", "readinessProbe", "livenessProbe")]
  for probe in probes:
    assert probe["grpc"] == {"port": parsed.health_port}, probe
    assert 1 <= probe["timeoutSeconds"] <= probe["periodSeconds"], probe
  assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(parsed.metrics_port)
  hpa = objects[("HorizontalPodAutoscaler", "grain-elevator")]
  assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
  (metric,) = hpa["spec"]["metrics"]
  assert metric["pods"]["metric"]["name"] == "elevator_utilization"


def test_the_pods_run_locked_down_and_are_reachable_only_as_intended():
  objects = _objects()
  deployment = objects[("Deployment", "grain-elevator")]
  spec = deployment["spec"]["template"]["spec"]
  (container,) = spec["containers"]
  assert not container["image"].endswith(":latest") and ":" in container["image"]
  dockerfile = (DEPLOY / "Dockerfile").read_text()
  assert f"USER {spec['securityContext']['runAsUser']}:" in dockerfile
  assert spec["securityContext"]["runAsNonRoot"] is True
  assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
  sc = container["securityContext"]
  assert sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"]
  assert sc["capabilities"] == {"drop": ["ALL"]}
  assert cli.build_parser().parse_args(container["args"]).workers is None  # auto
  assert container["resources"]["limits"]["cpu"] == container["resources"]["requests"]["cpu"]
  labels = deployment["spec"]["selector"]["matchLabels"]
  assert objects[("PodDisruptionBudget", "grain-elevator")]["spec"]["selector"][
      "matchLabels"] == labels
  policy = objects[("NetworkPolicy", "grain-elevator")]["spec"]
  assert policy["podSelector"]["matchLabels"] == labels
  allowed = {p["port"] for rule in policy["ingress"] for p in rule["ports"]}
  assert allowed == {p["containerPort"] for p in container["ports"]}
  service = objects[("Service", "grain-elevator")]["spec"]
  assert service["clusterIP"] == "None" and service["selector"] == labels
