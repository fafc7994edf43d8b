"""The Kubernetes manifests against the Kubernetes OpenAPI schema, offline, and their kustomize render.

kubernetes-validate (pinned in requirements-dev.txt) ships the JSON schemas of
each Kubernetes release, so nothing is downloaded: the tests block the network
while it runs to make sure. `--strict` also rejects a field the schema does not
have, so a misspelt or misplaced key fails here instead of at `kubectl apply`.

The tool has no schema for custom resources and only warns about them. The one
shipped here, KServe's InferenceService, is checked for its built-in parts: its
predictor is a pod spec plus KServe's own fields, and the pod part is validated
as the Deployment KServe makes of it. Not checked: the KServe fields themselves
and the annotations' values, which only KServe's CRD and controller know.

`kubectl kustomize` renders deploy/k8s, with and without the autoscaling
component, where kubectl is installed; the rendered objects are validated too.
"""

from __future__ import annotations

import copy
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from kubernetes_validate import utils as kubernetes_validate
from kubernetes_validate.__main__ import main as kubernetes_validate_main

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
KSERVE = REPO / "deploy" / "kserve"

# The Kubernetes release whose API the manifests are checked against: the
# oldest of the three minor releases maintained upstream at the time of writing
# (2026-11: 1.35 to 1.37). A field that only a later release has fails here, so
# the manifests apply on every maintained cluster. kubernetes-validate 1.37.0
# ships the schemas of 1.25 to 1.37.
KUBERNETES_VERSION = "1.35"

KUSTOMIZE_KINDS = {"Kustomization", "Component"}
# Kinds without a schema in kubernetes-validate, and where their built-in parts are checked.
CUSTOM_KINDS = {("serving.kserve.io/v1beta1", "InferenceService")}

# KServe's own predictor fields (v1beta1 PredictorSpec and ComponentExtensionSpec,
# KServe 0.16 to 0.20); every other predictor field belongs to its pod spec.
KSERVE_PREDICTOR_FIELDS = {
    "name",
    "sklearn",
    "xgboost",
    "tensorflow",
    "pytorch",
    "triton",
    "onnx",
    "huggingface",
    "pmml",
    "lightgbm",
    "paddle",
    "model",
    "storageUris",
    "storageContainerName",
    "workerSpec",
    "minReplicas",
    "maxReplicas",
    "scaleTarget",
    "scaleMetric",
    "scaleMetricType",
    "autoScaling",
    "containerConcurrency",
    "timeout",
    "canaryTrafficPercent",
    "logger",
    "batcher",
    "labels",
    "annotations",
    "deploymentStrategy",
}


def yaml_docs(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [doc for doc in yaml.safe_load_all(f) if doc]


def manifest_files() -> list[Path]:
    """Every file under deploy/k8s and deploy/kserve that holds API objects (not kustomize's own)."""
    files = sorted(K8S.rglob("*.yaml")) + sorted(KSERVE.rglob("*.yaml"))
    return [p for p in files if not any(doc["kind"] in KUSTOMIZE_KINDS for doc in yaml_docs(p))]


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to resolve a name or open a connection fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access during an offline check: {args!r}")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)


def validate_strict(doc: dict) -> None:
    """One object against the pinned release's strict schema; raises on the first error."""
    assert kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True) == KUBERNETES_VERSION


# --- every manifest, through the command line ---------------------------------------------


def test_the_pinned_release_is_one_the_tool_ships():
    assert KUBERNETES_VERSION in {kubernetes_validate.major_minor(v) for v in kubernetes_validate.all_versions()}


def test_every_manifest_passes_strict_validation(no_network, monkeypatch, capsys):
    files = [str(p.relative_to(REPO)) for p in manifest_files()]
    assert any("autoscaling" in f for f in files) and any("kserve" in f for f in files)
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "argv", ["kubernetes-validate", "--strict", "-k", KUBERNETES_VERSION, *files])
    returncode = kubernetes_validate_main()
    lines = capsys.readouterr().out.splitlines()

    errors = [line for line in lines if not line.startswith(("INFO", "WARN"))]
    assert returncode == 0 and not errors, "\n".join(errors)
    # The tool only warns about a kind it has no schema for: every object must be
    # accounted for, either passed or an expected custom resource.
    expected_passed, expected_unknown = set(), set()
    for name in files:
        for doc in yaml_docs(REPO / name):
            if (doc["apiVersion"], doc["kind"]) in CUSTOM_KINDS:
                expected_unknown.add((name, doc["kind"]))
            else:
                resource = f"{doc['kind'].lower()}/{doc['metadata']['name']}"
                expected_passed.add(f"INFO {name} passed for resource {resource} against version {KUBERNETES_VERSION}")
    assert {line for line in lines if line.startswith("INFO")} == expected_passed
    warnings = sorted(line for line in lines if line.startswith("WARN"))
    expected_warnings = sorted(f"WARN {name} Couldn't find schema for kind {kind} " for name, kind in expected_unknown)
    assert len(warnings) == len(expected_warnings), "\n".join(warnings)
    assert all(w.startswith(e) for w, e in zip(warnings, expected_warnings)), "\n".join(warnings)


def test_strict_mode_catches_a_misspelt_field(no_network):
    # The check has power: a typo that the non-strict schema accepts silently.
    deployment = yaml_docs(K8S / "deployment.yaml")[0]
    broken = copy.deepcopy(deployment)
    container = broken["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=False)
    with pytest.raises(kubernetes_validate.ValidationError, match="readinesProbe"):
        validate_strict(broken)


# --- custom resources: their built-in parts -------------------------------------------------


def kserve_predictor_as_deployment(isvc: dict) -> dict:
    """The apps/v1 Deployment that KServe's Standard mode makes of a predictor (the parts Kubernetes checks)."""
    predictor = isvc["spec"]["predictor"]
    pod_spec = {key: value for key, value in predictor.items() if key not in KSERVE_PREDICTOR_FIELDS}
    labels = {**predictor.get("labels", {}), "app": f"isvc.{isvc['metadata']['name']}-predictor"}
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": f"{isvc['metadata']['name']}-predictor", "annotations": isvc["metadata"]["annotations"]},
        "spec": {
            "replicas": predictor.get("minReplicas", 1),
            "selector": {"matchLabels": {"app": labels["app"]}},
            "template": {
                "metadata": {"labels": labels, "annotations": predictor.get("annotations", {})},
                "spec": pod_spec,
            },
        },
    }
    if "deploymentStrategy" in predictor:
        deployment["spec"]["strategy"] = predictor["deploymentStrategy"]
    return deployment


def has_schema(doc: dict) -> bool:
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=False)
    except kubernetes_validate.SchemaNotFoundError:
        return False
    return True


def test_custom_resources_are_the_known_ones():
    docs = [doc for path in manifest_files() for doc in yaml_docs(path)]
    custom = {(doc["apiVersion"], doc["kind"]) for doc in docs if not has_schema(doc)}
    assert custom == CUSTOM_KINDS, f"no check of the built-in parts of {sorted(custom - CUSTOM_KINDS)}"


def test_inferenceservice_pod_spec_passes_strict_validation(no_network):
    (isvc,) = yaml_docs(KSERVE / "inferenceservice.yaml")
    predictor = isvc["spec"]["predictor"]
    assert "containers" in predictor, "a custom predictor: the pod spec carries the container"
    validate_strict(kserve_predictor_as_deployment(isvc))
    # The KServe fields used are the ones the mapping above carries into the Deployment; the
    # others would go unchecked. Their own types are for KServe's CRD to check.
    assert set(predictor) & KSERVE_PREDICTOR_FIELDS <= {
        "minReplicas",
        "labels",
        "annotations",
        "deploymentStrategy",
    }


# --- kustomize ---------------------------------------------------------------------------


def kustomize_build(folder: Path) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: `kubectl kustomize deploy/k8s` is checked where it is")
    result = subprocess.run([kubectl, "kustomize", str(folder)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def test_kustomize_renders_the_base_without_the_autoscaler():
    docs = kustomize_build(K8S)
    kinds = sorted(doc["kind"] for doc in docs)
    # The claims: the model store and the cost tables.
    kinds_expected = ["Deployment", "NetworkPolicy", "PersistentVolumeClaim", "PersistentVolumeClaim"]
    assert kinds == [*kinds_expected, "PodDisruptionBudget", "Service"]
    for doc in docs:
        validate_strict(doc)


def test_kustomize_renders_the_autoscaling_component(tmp_path):
    # The documented way to enable it: `components: [autoscaling]` in deploy/k8s/kustomization.yaml.
    base = tmp_path / "k8s"
    shutil.copytree(K8S, base)
    kustomization = yaml.safe_load((base / "kustomization.yaml").read_text())
    kustomization["components"] = ["autoscaling"]
    (base / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    docs = kustomize_build(base)
    by_kind = {doc["kind"]: doc for doc in docs}
    assert "HorizontalPodAutoscaler" in by_kind and "ConfigMap" not in by_kind
    assert "replicas" not in by_kind["Deployment"]["spec"], "the HPA owns the replica count"
    for doc in docs:
        validate_strict(doc)
