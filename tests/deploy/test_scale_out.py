"""Static checks of the scale-out manifests: the HPA, the Prometheus Adapter rule, the PodDisruptionBudget and the
KServe InferenceService.

They check what ties these files to the rest of the project: the names the HPA
and the adapter use against the Deployment and against the metrics the handler
exports, the selectors against the pods' labels, the InferenceService's
container against the Deployment's. What the autoscaler then does with the
metric only a cluster shows (deploy/README.md).
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from handler import metrics as handler_metrics

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
AUTOSCALING = K8S / "autoscaling"
ISVC_PATH = REPO / "deploy" / "kserve" / "inferenceservice.yaml"
METRICS_CONFIG = REPO / "model-config" / "metrics.yaml"
# The archive deploy/README.md builds (make package without CONFIG).
DEFAULT_MODEL_CONFIG = REPO / "model-config" / "model-config.yaml"
OPERATIONS_DOC = REPO / "docs" / "operations.md"
DEPLOYMENTS = ["deployment.yaml", "deployment-gpu.yaml"]
INFERENCE_PORT, MANAGEMENT_PORT, METRICS_PORT = 8080, 8081, 8082


def load_one(path: Path) -> dict:
    docs = [doc for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if doc]
    assert len(docs) == 1, f"{path.name}: expected one document"
    return docs[0]


def pod_labels(deployment: dict) -> dict:
    return deployment["spec"]["template"]["metadata"]["labels"]


def the_container(pod_spec: dict) -> dict:
    (container,) = pod_spec["containers"]
    return container


def quantity(text: str) -> float:
    """An HPA target value: '2', '1500m'."""
    match = re.fullmatch(r"([0-9.]+)(m?)", str(text))
    assert match, f"bad quantity {text!r}"
    return float(match.group(1)) / (1000 if match.group(2) else 1)


def hpa() -> dict:
    return load_one(AUTOSCALING / "hpa.yaml")


def hpa_metric_name() -> str:
    (metric,) = hpa()["spec"]["metrics"]
    return metric["pods"]["metric"]["name"]


def adapter_rules() -> list[dict]:
    config_map = load_one(AUTOSCALING / "prometheus-adapter-config.yaml")
    # The file the adapter's --config reads, and the key the Helm chart's rules.existing mounts.
    config = yaml.safe_load(config_map["data"]["config.yaml"])
    return config["rules"]


def declared_model_metrics() -> dict[str, dict]:
    """model_metrics of model-config/metrics.yaml: {name: {"type": ..., "dimensions": [...]}}."""
    config = yaml.safe_load(METRICS_CONFIG.read_text(encoding="utf-8"))
    return {
        metric["name"]: {"type": metric_type, "dimensions": metric["dimensions"]}
        for metric_type, metrics in config["model_metrics"].items()
        for metric in metrics
    }


# --- HorizontalPodAutoscaler ---------------------------------------------------------------


def test_hpa_targets_the_deployment_by_name():
    spec = hpa()["spec"]
    deployment = load_one(K8S / "deployment.yaml")
    assert spec["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": deployment["metadata"]["name"],
    }
    # The component's patch frees the same Deployment's replica count for the HPA.
    component = load_one(AUTOSCALING / "kustomization.yaml")
    (patch,) = component["patches"]
    assert patch["target"]["kind"] == "Deployment" and patch["target"]["name"] == spec["scaleTargetRef"]["name"]
    assert yaml.safe_load(patch["patch"]) == [{"op": "remove", "path": "/spec/replicas"}]
    # Two pods, so that one serves while another loads or is drained.
    assert 2 <= spec["minReplicas"] < spec["maxReplicas"]


def test_hpa_metric_is_a_per_pod_gauge_the_handler_exports():
    (metric,) = hpa()["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["target"]["type"] == "AverageValue"
    name = hpa_metric_name()
    assert declared_model_metrics()[name]["type"] == "gauge", "TorchServe drops a metric not declared here"
    assert name in handler_metrics.GAUGES


def test_hpa_target_is_half_the_batch_size_of_the_default_archive():
    batch_size = yaml.safe_load(DEFAULT_MODEL_CONFIG.read_text(encoding="utf-8"))["batchSize"]
    target = quantity(hpa()["spec"]["metrics"][0]["pods"]["target"]["averageValue"])
    assert target == batch_size / 2, "hpa.yaml and deploy/README.md explain the choice; change them together"


def test_hpa_scales_down_one_drained_pod_at_a_time():
    scale_down = hpa()["spec"]["behavior"]["scaleDown"]
    assert scale_down["stabilizationWindowSeconds"] >= 300
    assert [(policy["type"], policy["value"]) for policy in scale_down["policies"]] == [("Pods", 1)]


# --- Prometheus Adapter rule ---------------------------------------------------------------


def series_name(series_query: str) -> str:
    match = re.fullmatch(r"([A-Za-z_:][A-Za-z0-9_:]*)\{(.*)\}", series_query.strip())
    assert match, f"seriesQuery names no metric: {series_query!r}"
    return match.group(1)


def test_adapter_rule_queries_the_metric_as_torchserve_exports_it():
    (rule,) = adapter_rules()
    name = hpa_metric_name()
    # TorchServe exports a model metric under its declared name, no prefix or suffix
    # (docs/operations.md shows lines scraped from the demo server).
    exported = re.findall(r"^(\w+)\{ModelName=\"[^\"]+\",Level=\"Model\",Hostname=", OPERATIONS_DOC.read_text(), re.M)
    assert exported and set(exported) <= set(declared_model_metrics())
    assert series_name(rule["seriesQuery"]) == name
    # The name the adapter serves is the one the HPA asks for.
    assert re.fullmatch(rule["name"]["matches"], name)
    assert rule["name"].get("as", name) == name


def test_adapter_rule_maps_the_series_to_pods():
    (rule,) = adapter_rules()
    overrides = rule["resources"]["overrides"]
    assert overrides == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
    for label in overrides:
        assert f'{label}!=""' in rule["seriesQuery"], f"series without a {label} label cannot be mapped"
    query = rule["metricsQuery"]
    for placeholder in ("<<.Series>>", "<<.LabelMatchers>>", "<<.GroupBy>>"):
        assert placeholder in query
    # A gauge is averaged over time, never rate()d.
    assert "avg_over_time(" in query and "rate(" not in query


def test_adapter_config_stays_out_of_the_component():
    # It lives in the adapter's namespace: applying the component must not need it.
    config_map = load_one(AUTOSCALING / "prometheus-adapter-config.yaml")
    assert config_map["metadata"]["namespace"] != "default"
    component = load_one(AUTOSCALING / "kustomization.yaml")
    assert component["kind"] == "Component" and component["resources"] == ["hpa.yaml"]


def test_base_applies_without_the_autoscaler():
    base = load_one(K8S / "kustomization.yaml")
    assert "components" not in base, "`kubectl apply -k deploy/k8s` must work on a cluster without the adapter"
    assert not any("autoscaling" in name or "hpa" in name for name in base["resources"])


# --- PodDisruptionBudget -------------------------------------------------------------------


def test_pdb_selects_the_pods_of_either_deployment():
    pdb = load_one(K8S / "pdb.yaml")
    assert (pdb["apiVersion"], pdb["kind"]) == ("policy/v1", "PodDisruptionBudget")
    assert "pdb.yaml" in load_one(K8S / "kustomization.yaml")["resources"]
    selector = pdb["spec"]["selector"]["matchLabels"]
    for name in DEPLOYMENTS:
        assert selector.items() <= pod_labels(load_one(K8S / name)).items(), name
    assert selector.items() <= load_one(ISVC_PATH)["spec"]["predictor"]["labels"].items()


def test_pdb_never_blocks_a_drain_of_a_single_replica():
    spec = load_one(K8S / "pdb.yaml")["spec"]
    # minAvailable: 1 with one replica would forbid every eviction.
    assert spec["maxUnavailable"] == 1 and "minAvailable" not in spec
    assert spec["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


# --- KServe InferenceService ---------------------------------------------------------------


def test_inferenceservice_is_a_custom_container_with_our_image():
    isvc = load_one(ISVC_PATH)
    assert (isvc["apiVersion"], isvc["kind"]) == ("serving.kserve.io/v1beta1", "InferenceService")
    predictor = isvc["spec"]["predictor"]
    # Not KServe's TorchServe runtime, whose wrapper reaches neither the OpenAI routes nor streaming.
    assert not {"pytorch", "model"} & set(predictor)
    container = the_container(predictor)
    assert container["name"] == "kserve-container"
    assert container["image"] == the_container(load_one(K8S / "deployment.yaml")["spec"]["template"]["spec"])["image"]
    # A plain Deployment and Service, not a Knative Service (one port only).
    assert isvc["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == "Standard"


def test_inferenceservice_exposes_inference_first_and_never_management():
    predictor = load_one(ISVC_PATH)["spec"]["predictor"]
    ports = the_container(predictor)["ports"]
    # KServe serves the first port as the Service's port 80, and puts every other listed port on the Service.
    assert ports[0]["containerPort"] == INFERENCE_PORT
    assert {p["containerPort"] for p in ports} == {INFERENCE_PORT, METRICS_PORT}
    assert MANAGEMENT_PORT not in {p["containerPort"] for p in ports}
    annotations = predictor["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == METRICS_PORT


def test_inferenceservice_runs_the_pod_of_the_deployment():
    predictor = load_one(ISVC_PATH)["spec"]["predictor"]
    deployment = load_one(K8S / "deployment.yaml")
    pod = deployment["spec"]["template"]["spec"]
    ours, theirs = the_container(predictor), the_container(pod)
    for key in (
        "env",
        "startupProbe",
        "livenessProbe",
        "readinessProbe",
        "lifecycle",
        "resources",
        "securityContext",
        "volumeMounts",
    ):
        assert ours.get(key) == theirs.get(key), f"container {key} differs from deployment.yaml"
    for key in ("terminationGracePeriodSeconds", "securityContext", "volumes"):
        assert predictor.get(key) == pod.get(key), f"pod {key} differs from deployment.yaml"
    assert predictor["deploymentStrategy"] == deployment["spec"]["strategy"]
