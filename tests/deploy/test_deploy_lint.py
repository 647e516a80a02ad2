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
# The variant that reads its shards from a bucket (no volume): applied instead of elevator.yaml.
BUCKET_K8S = DEPLOY / "k8s" / "buckets" / "elevator.yaml"


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
  result = subprocess.run([_tool("kubernetes-validate"), "--strict", *map(str, K8S),
                           str(BUCKET_K8S)], capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stdout + result.stderr
  assert result.stdout.count("passed") + result.stderr.count("passed") >= 11


def _objects(paths: list[pathlib.Path] = K8S) -> dict[tuple[str, str], dict]:
  return {(doc["kind"], doc["metadata"]["name"]): doc
          for path in paths for doc in yaml.safe_load_all(path.read_text()) if doc}


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


def test_the_bucket_variant_is_the_volume_one_reading_a_bucket():
  """deploy/k8s/buckets/elevator.yaml: the same server, ports, probes and
  lockdown as elevator.yaml; its paths are bucket URLs the config loader
  takes; no volume holds shards; credentials come from a service account."""
  volume, bucket = _objects(), _objects([BUCKET_K8S])
  pod = bucket[("Deployment", "grain-elevator")]["spec"]["template"]["spec"]
  base_pod = volume[("Deployment", "grain-elevator")]["spec"]["template"]["spec"]
  (container,), (base,) = pod["containers"], base_pod["containers"]
  for key in ("args", "ports", "securityContext", "startupProbe", "readinessProbe",
              "livenessProbe", "image"):
    assert container[key] == base[key], key
  assert pod["securityContext"] == base_pod["securityContext"]
  assert {v["name"] for v in pod["volumes"]} == {"config", "tmp"}
  assert {m["mountPath"] for m in container["volumeMounts"]} == {"/etc/elevator", "/tmp"}
  assert not any(kind == "PersistentVolumeClaim" for kind, _ in bucket)
  assert ("ServiceAccount", pod["serviceAccountName"]) in bucket
  for kind in ("Service", "PodDisruptionBudget", "NetworkPolicy"):
    assert bucket[(kind, "grain-elevator")]["spec"] == volume[(kind, "grain-elevator")]["spec"]
  # Its config names the shards in a bucket (listed when the server starts).
  import tomllib  # pylint: disable=g-import-not-at-top
  from grain_elevator.server.data.storage import urls  # pylint: disable=g-import-not-at-top
  config = tomllib.loads(bucket[("ConfigMap", "grain-elevator-config")]["data"]["elevator.toml"])
  base_config = tomllib.loads(volume[("ConfigMap", "grain-elevator-config")]["data"][
      "elevator.toml"])
  paths = config["datasets"]["train"].pop("paths")
  assert paths and all(urls.is_url(p) and urls.split(p)[0] in ("gs", "s3") for p in paths)
  base_config["datasets"]["train"].pop("paths")
  assert config == base_config
