"""Static checks of the container image and the Kubernetes manifests in deploy/.

Docker and Kubernetes do not run here. These tests read the Dockerfile, the
.dockerignore, the container's config.properties and the manifests as text and
YAML, and check what a broken edit would break: ports, probes, selectors,
volumes, the GPU request, what the Service exposes, token authorization. They
also run entrypoint.sh against a stand-in `torchserve` and healthcheck.py
against a stand-in TorchServe HTTP server on 127.0.0.1.
"""

from __future__ import annotations

import http.server
import importlib.util
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
DOCKERFILE = REPO / "Dockerfile"
CONTAINER_CONFIG = DEPLOY / "docker" / "config.properties"
ENTRYPOINT = DEPLOY / "docker" / "entrypoint.sh"
HEALTHCHECK = DEPLOY / "docker" / "healthcheck.py"

MODEL_STORE_PATH = "/home/model-server/model-store"
DEFAULT_MODEL = "qwen-coder-spec"
INFERENCE_PORT, MANAGEMENT_PORT, METRICS_PORT = 8080, 8081, 8082
DEPLOYMENTS = ["deployment.yaml", "deployment-gpu.yaml"]

# The properties TorchServe 0.12 reads; any other key is silently ignored, so a
# misspelt key would quietly fall back to a default.
TORCHSERVE_PROPERTIES = {
    "allowed_urls",
    "async_logging",
    "blacklist_env_vars",
    "certificate_file",
    "cors_allowed_headers",
    "cors_allowed_methods",
    "cors_allowed_origin",
    "cpu_launcher_args",
    "cpu_launcher_enable",
    "decode_input_request",
    "default_response_timeout",
    "default_service_handler",
    "default_startup_timeout",
    "default_workers_per_model",
    "disable_system_metrics",
    "disable_token_authorization",
    "enable_envvars_config",
    "enable_grpc_ssl",
    "enable_metrics_api",
    "enable_model_api",
    "grpc_inference_address",
    "grpc_inference_port",
    "grpc_management_address",
    "grpc_management_port",
    "inference_address",
    "install_py_dep_per_model",
    "job_queue_size",
    "keystore",
    "keystore_pass",
    "keystore_type",
    "load_models",
    "management_address",
    "max_request_size",
    "max_response_size",
    "metrics_address",
    "metrics_config",
    "metrics_mode",
    "model_store",
    "models",
    "number_of_gpu",
    "number_of_netty_threads",
    "netty_client_threads",
    "plugins_path",
    "private_key_file",
    "token_expiration_min",
    "unregister_model_timeout",
    "use_env_allowed_urls",
    "vmargs",
    "workflow_store",
}


# --- readers -------------------------------------------------------------------


def load_yaml_docs(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def manifest(name: str) -> dict:
    docs = load_yaml_docs(K8S / name)
    assert len(docs) == 1, f"{name}: expected one document, got {len(docs)}"
    return docs[0]


def read_properties(path: Path) -> dict[str, str]:
    """Java properties as TorchServe reads them: `key=value`, `#` comments."""
    props: dict[str, str] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line or line.startswith(("#", "!")):
            continue
        key, sep, value = line.partition("=")
        assert sep, f"{path.name}: not a key=value line: {line!r}"
        key = key.strip()
        assert key not in props, f"{path.name}: {key} is set twice"
        props[key] = value.strip()
    return props


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with continuation lines joined and comments dropped."""
    instructions, pending = [], ""
    for raw in DOCKERFILE.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not pending):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        if line:
            keyword, _, args = line.partition(" ")
            instructions.append((keyword.upper(), args.strip()))
    return instructions


def dockerfile_stages() -> dict[str, list[tuple[str, str]]]:
    """Instructions per build stage, keyed by stage name ('' before the first FROM)."""
    stages: dict[str, list[tuple[str, str]]] = {"": []}
    current = ""
    for keyword, args in dockerfile_instructions():
        if keyword == "FROM":
            match = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", args, re.IGNORECASE)
            assert match and match.group(2), f"every stage must be named: FROM {args}"
            current = match.group(2)
            stages[current] = [("FROM", match.group(1))]
        else:
            stages[current].append((keyword, args))
    return stages


def instructions_named(keyword: str) -> list[str]:
    return [args for kw, args in dockerfile_instructions() if kw == keyword]


def container(deployment: dict) -> dict:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1, "one container per pod: TorchServe"
    return containers[0]


def port_number(port, ports: list[dict]) -> int:
    """A probe or Service port, given as a number or as a container port's name."""
    if isinstance(port, int):
        return port
    by_name = {p["name"]: p["containerPort"] for p in ports if "name" in p}
    assert port in by_name, f"port name {port!r} is not a container port"
    return by_name[port]


def env_of(c: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in c.get("env", [])}


def quantity(value) -> float:
    """A Kubernetes quantity as a number: '500m' -> 0.5, '16Gi' -> 16 * 2**30."""
    text = str(value)
    suffixes = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    match = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", text)
    assert match and (match.group(2) in suffixes or not match.group(2)), f"bad quantity {text!r}"
    return float(match.group(1)) * suffixes.get(match.group(2), 1)


# --- every manifest ----------------------------------------------------------------


@pytest.mark.parametrize("path", sorted(K8S.glob("*.yaml")), ids=lambda p: p.name)
def test_manifest_parses_with_required_fields(path):
    docs = load_yaml_docs(path)
    assert docs, f"{path.name} is empty"
    for doc in docs:
        assert doc.get("apiVersion") and doc.get("kind"), f"{path.name}: apiVersion and kind"
        if doc["kind"] == "Kustomization":
            assert doc.get("resources"), "kustomization lists no resources"
            continue
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", doc["metadata"]["name"])
        assert isinstance(doc.get("spec"), dict), f"{path.name}: spec"


def test_kustomization_lists_the_cpu_resources():
    resources = manifest("kustomization.yaml")["resources"]
    for name in resources:
        assert (K8S / name).is_file(), f"kustomization lists missing {name}"
    assert {"deployment.yaml", "service.yaml", "pvc.yaml", "networkpolicy.yaml"} <= set(resources)
    assert "deployment-gpu.yaml" not in resources, "the GPU variant is applied instead, not as well"


# --- Deployments -----------------------------------------------------------------


@pytest.mark.parametrize("name", DEPLOYMENTS)
def test_deployment_selector_matches_template_labels(name):
    d = manifest(name)
    assert (d["apiVersion"], d["kind"]) == ("apps/v1", "Deployment")
    selector = d["spec"]["selector"]["matchLabels"]
    labels = d["spec"]["template"]["metadata"]["labels"]
    assert selector and selector.items() <= labels.items()


def test_cpu_and_gpu_deployments_do_not_select_each_others_pods():
    cpu, gpu = manifest("deployment.yaml"), manifest("deployment-gpu.yaml")
    assert cpu["metadata"]["name"] != gpu["metadata"]["name"]
    cpu_sel = cpu["spec"]["selector"]["matchLabels"]
    gpu_labels = gpu["spec"]["template"]["metadata"]["labels"]
    gpu_sel = gpu["spec"]["selector"]["matchLabels"]
    cpu_labels = cpu["spec"]["template"]["metadata"]["labels"]
    assert not cpu_sel.items() <= gpu_labels.items()
    assert not gpu_sel.items() <= cpu_labels.items()


@pytest.mark.parametrize("name", DEPLOYMENTS)
def test_container_ports_are_the_three_apis(name):
    ports = container(manifest(name))["ports"]
    assert {p["containerPort"] for p in ports} >= {INFERENCE_PORT, MANAGEMENT_PORT, METRICS_PORT}
    assert port_number("metrics", ports) == METRICS_PORT
    assert port_number("inference", ports) == INFERENCE_PORT


@pytest.mark.parametrize("name", DEPLOYMENTS)
def test_http_probes_ping_the_inference_port(name):
    c = container(manifest(name))
    for probe_name in ("startupProbe", "livenessProbe"):
        probe = c[probe_name]["httpGet"]
        assert probe["path"] == "/ping", probe_name
        assert port_number(probe["port"], c["ports"]) == INFERENCE_PORT, probe_name


@pytest.mark.parametrize("name", DEPLOYMENTS)
def test_readiness_waits_for_loaded_models(name):
    command = container(manifest(name))["readinessProbe"]["exec"]["command"]
    assert Path(command[0]).name == "healthcheck.py" and "--ready" in command
    ping_url = command[command.index("--ping-url") + 1]
    assert re.fullmatch(rf"http://(127\.0\.0\.1|localhost):{INFERENCE_PORT}/ping", ping_url)


@pytest.mark.parametrize("name", DEPLOYMENTS)
def test_probe_timings_allow_a_slow_model_load(name):
    c = container(manifest(name))
    startup = c["startupProbe"]
    # The frontend binds its ports only after unpacking every archive.
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300
    liveness = c["livenessProbe"]
    assert liveness["periodSeconds"] * liveness["failureThreshold"] >= 60
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe].get("timeoutSeconds", 1) >= 2, f"{probe}: a busy JVM can take over 1 s"


@pytest.mark.parametrize("name", DEPLOYMENTS)
def test_prometheus_annotations_point_at_the_metrics_port(name):
    d = manifest(name)
    annotations = d["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(METRICS_PORT)
    assert annotations["prometheus.io/path"] == "/metrics"
    assert int(annotations["prometheus.io/port"]) in {p["containerPort"] for p in container(d)["ports"]}


@pytest.mark.parametrize("name", DEPLOYMENTS)
def test_resources_have_cpu_and_memory_requests_within_limits(name):
    resources = container(manifest(name))["resources"]
    for kind in ("cpu", "memory"):
        request, limit = resources["requests"][kind], resources["limits"][kind]
        assert quantity(request) <= quantity(limit), kind
    assert quantity(resources["requests"]["memory"]) >= 4 * 2**30, "an LLM pair needs GiBs"


@pytest.mark.parametrize("name", DEPLOYMENTS)
def test_model_store_comes_from_the_pvc(name):
    d = manifest(name)
    c = container(d)
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert MODEL_STORE_PATH in mounts
    volumes = {v["name"]: v for v in d["spec"]["template"]["spec"]["volumes"]}
    claim = volumes[mounts[MODEL_STORE_PATH]]["persistentVolumeClaim"]["claimName"]
    assert claim == manifest("pvc.yaml")["metadata"]["name"]


def test_model_store_path_agrees_across_image_config_and_manifests():
    assert read_properties(CONTAINER_CONFIG)["model_store"] == MODEL_STORE_PATH
    env_lines = " ".join(instructions_named("ENV"))
    assert f"MODEL_STORE={MODEL_STORE_PATH}" in env_lines
    assert any(
        args.split()[-1].rstrip("/") == MODEL_STORE_PATH
        for args in instructions_named("COPY")
        if "model_store/" in args
    )


@pytest.mark.parametrize("name", DEPLOYMENTS)
def test_pods_run_as_the_image_user(name):
    security = manifest(name)["spec"]["template"]["spec"]["securityContext"]
    assert security["runAsNonRoot"] is True
    uid = re.search(r"useradd\b.*--uid (\d+)", " ".join(instructions_named("RUN")))
    assert uid and security["runAsUser"] == int(uid.group(1))


@pytest.mark.parametrize("name", DEPLOYMENTS)
def test_graceful_stop_fits_in_the_grace_period(name):
    d = manifest(name)
    c = container(d)
    command = " ".join(c["lifecycle"]["preStop"]["exec"]["command"])
    # preStop marks the pod as draining (readiness fails), then waits for the endpoints to follow.
    assert "healthcheck.py --drain" in command
    prestop_wait_s = int(re.search(r"\bsleep (\d+)", command).group(1))
    assert 5 <= prestop_wait_s <= 30
    drain_timeout_s = int(env_of(c)["DRAIN_TIMEOUT_S"])
    # TorchServe's own stop takes a few seconds after the drain.
    stop_s = 10
    grace_s = d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace_s >= prestop_wait_s + drain_timeout_s + stop_s


def test_gpu_deployment_requests_a_gpu_on_gpu_nodes():
    d = manifest("deployment-gpu.yaml")
    c = container(d)
    assert int(c["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    pod = d["spec"]["template"]["spec"]
    assert pod.get("nodeSelector") or pod.get("tolerations")
    assert any(t.get("key") == "nvidia.com/gpu" for t in pod.get("tolerations", []))
    assert "cuda" in c["image"]


def test_cpu_deployment_requests_no_gpu():
    c = container(manifest("deployment.yaml"))
    assert "nvidia.com/gpu" not in c["resources"].get("limits", {})
    assert "cuda" not in c["image"]


@pytest.mark.parametrize("name", DEPLOYMENTS)
def test_token_auth_is_off_only_behind_the_network_policy(name):
    d = manifest(name)
    if env_of(container(d)).get("DISABLE_TOKEN_AUTH") != "true":
        return
    policy = manifest("networkpolicy.yaml")
    assert "networkpolicy.yaml" in manifest("kustomization.yaml")["resources"]
    selected = policy["spec"]["podSelector"]["matchLabels"]
    assert selected.items() <= d["spec"]["template"]["metadata"]["labels"].items()
    assert "Ingress" in policy["spec"]["policyTypes"]


# --- Service, network policy, PVC ----------------------------------------------------


def test_service_exposes_inference_and_metrics_but_not_management():
    service = manifest("service.yaml")
    assert service["spec"].get("type", "ClusterIP") == "ClusterIP"
    for name in DEPLOYMENTS:
        d = manifest(name)
        assert service["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()
        ports = container(d)["ports"]
        exposed = {port_number(p.get("targetPort", p["port"]), ports) for p in service["spec"]["ports"]}
        assert exposed == {INFERENCE_PORT, METRICS_PORT}, name
    assert MANAGEMENT_PORT not in {p["port"] for p in service["spec"]["ports"]}


def test_network_policy_never_admits_the_management_port():
    policy = manifest("networkpolicy.yaml")
    admitted = {p["port"] for rule in policy["spec"]["ingress"] for p in rule.get("ports", [])}
    assert MANAGEMENT_PORT not in admitted and "management" not in admitted
    assert {INFERENCE_PORT, METRICS_PORT} <= admitted
    for rule in policy["spec"]["ingress"]:
        assert rule.get("ports"), "a rule without ports would admit every port, 8081 included"
        assert rule.get("from"), "a rule without sources would admit everyone"


COST_TABLE_PATH = "/home/model-server/cost-tables"
COST_TABLE_PVC = "pvc-cost-tables.yaml"


def pod_spec(path: Path) -> dict:
    """The pod of a Deployment, or of an InferenceService's predictor."""
    [doc] = load_yaml_docs(path)
    return doc["spec"]["predictor"] if doc["kind"] == "InferenceService" else doc["spec"]["template"]["spec"]


@pytest.mark.parametrize(
    "path", [K8S / name for name in DEPLOYMENTS] + [DEPLOY / "kserve" / "inferenceservice.yaml"], ids=lambda p: p.name
)
def test_the_cost_table_is_cached_on_a_volume_that_outlives_the_pod(path):
    """Without it every pod measures the table again (minutes on a CPU): the model store is
    read-only and /tmp, where an archive is unpacked, is an emptyDir."""
    from handler.planning.measure import COST_TABLE_DIR_ENV

    pod = pod_spec(path)
    [c] = pod["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    folder = env[COST_TABLE_DIR_ENV]
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert folder in mounts, f"{COST_TABLE_DIR_ENV}={folder} is not a mounted volume"
    assert not mounts[folder].get("readOnly"), "the workers write the table there"
    volume = {v["name"]: v for v in pod["volumes"]}[mounts[folder]["name"]]
    assert volume["persistentVolumeClaim"]["claimName"] == manifest(COST_TABLE_PVC)["metadata"]["name"]
    assert not volume["persistentVolumeClaim"].get("readOnly")
    assert folder == COST_TABLE_PATH


def test_the_cost_table_claim_is_shared_by_replicas_and_applied_with_the_rest():
    pvc = manifest(COST_TABLE_PVC)
    assert (pvc["apiVersion"], pvc["kind"]) == ("v1", "PersistentVolumeClaim")
    # Every replica writes, wherever it runs.
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert 0 < quantity(pvc["spec"]["resources"]["requests"]["storage"]) <= 2**30, "a table is kilobytes"
    assert pvc["metadata"]["labels"] == manifest("pvc.yaml")["metadata"]["labels"]
    assert COST_TABLE_PVC in manifest("kustomization.yaml")["resources"]
    assert f"-f deploy/k8s/{COST_TABLE_PVC}" in (DEPLOY / "README.md").read_text(), "the GPU and KServe recipes"


def test_entrypoint_points_the_cost_table_at_the_path_the_manifests_mount(entrypoint_env):
    """A plain `docker run` keeps the table in the container (or a volume mounted there) instead of
    the archive's folder, which TorchServe unpacks anew at every start; a set value is kept."""
    Path(entrypoint_env["MODEL_STORE"], f"{DEFAULT_MODEL}.mar").write_bytes(b"")
    seen = Path(entrypoint_env["STUB_LOG"] + ".cost_table_dir")
    run_entrypoint(entrypoint_env)
    assert seen.read_text().strip() == COST_TABLE_PATH
    run_entrypoint(entrypoint_env, SPEC_COST_TABLE_DIR="/elsewhere")
    assert seen.read_text().strip() == "/elsewhere"


def test_pvc_requests_storage_mountable_by_several_replicas():
    pvc = manifest("pvc.yaml")
    assert (pvc["apiVersion"], pvc["kind"]) == ("v1", "PersistentVolumeClaim")
    assert set(pvc["spec"]["accessModes"]) & {"ReadWriteMany", "ReadOnlyMany"}
    assert quantity(pvc["spec"]["resources"]["requests"]["storage"]) > 0


# --- Dockerfile and .dockerignore ----------------------------------------------------


def test_dockerfile_variant_arg_selects_cpu_or_cuda_base():
    stages = dockerfile_stages()
    # ARGs before the first FROM: the variant and the two base images.
    global_args = dict(a.split("=", 1) for kw, a in stages[""] if kw == "ARG" and "=" in a)
    assert global_args["VARIANT"] == "cpu"
    final = list(stages)[-1]
    assert stages[final][0] == ("FROM", "base-${VARIANT}")

    def base_image(stage):
        return global_args[stages[stage][0][1].strip("${}")]

    assert base_image("base-cpu").startswith("python:3.11")
    assert base_image("base-cuda").startswith("nvidia/cuda:")
    cpu_text = " ".join(a for _, a in stages["base-cpu"])
    cuda_text = " ".join(a for _, a in stages["base-cuda"])
    assert "openjdk-17" in cpu_text and "openjdk-17" in cuda_text
    assert "python3.11" in cuda_text
    assert "download.pytorch.org/whl/cpu" in cpu_text, "CPU torch from the CPU wheel index"
    assert "TORCH_SPEC" in cpu_text and "TORCH_SPEC" in cuda_text


def test_dockerfile_exposes_the_three_ports_and_pings_for_health():
    exposed = {int(p) for args in instructions_named("EXPOSE") for p in args.split()}
    assert exposed == {INFERENCE_PORT, MANAGEMENT_PORT, METRICS_PORT}
    (healthcheck,) = instructions_named("HEALTHCHECK")
    assert re.search(rf"http://(localhost|127\.0\.0\.1):{INFERENCE_PORT}/ping", healthcheck)
    assert "--start-period" in healthcheck, "loading the models takes minutes"


def test_dockerfile_runs_as_non_root_and_installs_requirements():
    users = instructions_named("USER")
    assert users and users[-1] == "model-server"
    run = " ".join(instructions_named("RUN"))
    assert "requirements.txt" in run and "useradd" in run


def test_dockerfile_copies_what_the_container_config_names():
    props = read_properties(CONTAINER_CONFIG)
    copies = {args.split()[-1]: args.split()[-2] for args in instructions_named("COPY")}
    assert copies[props["metrics_config"]] == "model-config/metrics.yaml"
    ts_config = re.search(r"TS_CONFIG=(\S+)", " ".join(instructions_named("ENV"))).group(1)
    assert copies[ts_config] == "deploy/docker/config.properties"
    assert "deploy/docker/entrypoint.sh" in copies.values()


def test_dockerfile_copy_sources_exist():
    # A missing source fails `docker build`; requirements.txt and
    # model-config/metrics.yaml belong to the serving setup, not to deploy/.
    # A copy from an earlier build stage must name a stage the file defines.
    stages = {args.split()[-1] for args in instructions_named("FROM") if " AS " in args.upper()}
    for args in instructions_named("COPY"):
        source = args.split()[-2]
        stage = re.search(r"--from=(\S+)", args)
        if stage:
            assert stage.group(1) in stages, f"COPY --from={stage.group(1)} names no build stage"
            continue
        assert (REPO / source).exists(), f"COPY source {source} is missing: the image cannot build"


def test_dockerfile_entrypoint_is_the_script_under_an_init():
    (entrypoint,) = instructions_named("ENTRYPOINT")
    argv = json.loads(entrypoint)
    assert argv[0] == "tini" and Path(argv[-1]).name == ENTRYPOINT.name


def dockerignore_excludes(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or a parent folder wins."""
    excluded = False
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        if pattern.startswith("**/"):
            regex = r"(.*/)?" + re.escape(pattern[3:]).replace(r"\*", "[^/]*")
        elif pattern.endswith("/**"):
            regex = re.escape(pattern[:-3]) + "/.*"
        else:
            regex = re.escape(pattern).replace(r"\*", "[^/]*")
        if any(re.fullmatch(regex, c) for c in candidates):
            excluded = not negate
    return excluded


def test_dockerignore_keeps_out_weights_and_secrets_but_not_what_is_copied():
    lines = (REPO / ".dockerignore").read_text(encoding="utf-8").splitlines()
    patterns = [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]
    for path in [
        ".venv/bin/python",
        "models/target/model.safetensors",
        "logs/ts_log.log",
        "tests/unit/test_x.py",
        ".git/HEAD",
        "key_file.json",
        "model_store/x/weights.bin",
    ]:
        assert dockerignore_excludes(path, patterns), f"{path} would be sent to the builder"
    copied = [args.split()[-2] for args in instructions_named("COPY")]
    for path in copied + [f"model_store/{DEFAULT_MODEL}.mar"]:
        if path.endswith("/"):
            continue
        assert not dockerignore_excludes(path, patterns), f"the build needs {path}"


# --- container config.properties -------------------------------------------------------


def test_container_config_binds_all_interfaces_on_the_three_ports():
    props = read_properties(CONTAINER_CONFIG)
    assert props["inference_address"] == f"http://0.0.0.0:{INFERENCE_PORT}"
    assert props["management_address"] == f"http://0.0.0.0:{MANAGEMENT_PORT}"
    assert props["metrics_address"] == f"http://0.0.0.0:{METRICS_PORT}"
    for key in ("grpc_inference_address", "grpc_management_address"):
        assert props[key] == "127.0.0.1", "gRPC cannot be turned off: keep it inside the container"


def test_container_config_keeps_token_auth_and_model_api_locked():
    props = read_properties(CONTAINER_CONFIG)
    assert props["metrics_mode"] == "prometheus"
    assert props.get("disable_token_authorization", "false").lower() == "false"
    assert props.get("enable_envvars_config", "false").lower() == "false", "env could undo the above"
    assert props["enable_model_api"].lower() == "false"
    assert props["allowed_urls"] == f"file://{MODEL_STORE_PATH}/.*"
    assert props.get("install_py_dep_per_model", "false").lower() == "false"


def test_container_config_uses_only_known_torchserve_keys():
    unknown = set(read_properties(CONTAINER_CONFIG)) - TORCHSERVE_PROPERTIES
    assert not unknown, f"TorchServe 0.12 ignores {sorted(unknown)}"


# --- entrypoint.sh, run against a stand-in torchserve ------------------------------------

STUB_TORCHSERVE = """#!/usr/bin/env bash
echo "$*" >> "$STUB_LOG"
echo "${SPEC_COST_TABLE_DIR-unset}" > "$STUB_LOG.cost_table_dir"
if [[ "$1" == --start && -n "${STUB_EXIT:-}" ]]; then
    exit "$STUB_EXIT"
elif [[ "$1" == --start && -n "${STUB_WAIT:-}" ]]; then
    while [[ ! -f "$STUB_LOG.stopped" ]]; do sleep 0.02; done
elif [[ "$1" == --stop ]]; then
    touch "$STUB_LOG.stopped"
fi
"""


@pytest.fixture
def entrypoint_env(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub = bin_dir / "torchserve"
    stub.write_text(STUB_TORCHSERVE)
    stub.chmod(0o755)
    store = tmp_path / "store"
    store.mkdir()
    config = tmp_path / "config.properties"
    # Port 1: nothing is connected to it, so a drain ends at once.
    config.write_text("inference_address=http://127.0.0.1:1\n")
    return {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "STUB_LOG": str(tmp_path / "calls.log"),
        "MODEL_STORE": str(store),
        "TS_CONFIG": str(config),
        "DRAIN_MARKER": str(tmp_path / "draining"),
        "DRAIN_QUIET_S": "0",
    }


def run_entrypoint(env: dict, **extra) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(ENTRYPOINT)],
        env={**env, **extra},
        capture_output=True,
        text=True,
        timeout=30,
        cwd=Path(env["MODEL_STORE"]).parent,
    )


def stub_calls(env: dict) -> list[list[str]]:
    log = Path(env["STUB_LOG"])
    return [shlex.split(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_entrypoint_is_an_executable_bash_script_with_foreground():
    assert os.access(ENTRYPOINT, os.X_OK), "entrypoint.sh must be executable (git mode 755)"
    text = ENTRYPOINT.read_text(encoding="utf-8")
    assert text.startswith("#!/usr/bin/env bash")
    assert "--foreground" in text
    subprocess.run(["bash", "-n", str(ENTRYPOINT)], check=True)


def test_entrypoint_starts_the_default_model_in_the_foreground(entrypoint_env):
    Path(entrypoint_env["MODEL_STORE"], f"{DEFAULT_MODEL}.mar").write_bytes(b"")
    result = run_entrypoint(entrypoint_env)
    (call,) = stub_calls(entrypoint_env)
    assert call[:3] == ["--start", "--foreground", "--ncs"]
    assert call[call.index("--ts-config") + 1] == entrypoint_env["TS_CONFIG"]
    assert call[call.index("--model-store") + 1] == entrypoint_env["MODEL_STORE"]
    assert call[call.index("--models") + 1] == f"{DEFAULT_MODEL}={DEFAULT_MODEL}.mar"
    assert "--disable-token-auth" not in call
    assert "key_file.json" in result.stdout, "tell the user where the keys are"


def test_entrypoint_loads_archives_and_unpacked_folders(entrypoint_env):
    store = Path(entrypoint_env["MODEL_STORE"])
    (store / "a.mar").write_bytes(b"")
    (store / "b" / "MAR-INF").mkdir(parents=True)
    (store / "b" / "MAR-INF" / "MANIFEST.json").write_text("{}")
    run_entrypoint(entrypoint_env, MODEL_NAMES="a, b")
    (call,) = stub_calls(entrypoint_env)
    assert call[call.index("--models") + 1 :] == ["a=a.mar", "b=b"]


def test_entrypoint_fails_clearly_without_the_archive(entrypoint_env):
    Path(entrypoint_env["MODEL_STORE"], "other.mar").write_bytes(b"")
    result = run_entrypoint(entrypoint_env)
    assert result.returncode == 1
    assert f"{DEFAULT_MODEL}.mar" in result.stderr and "other.mar" in result.stderr
    assert stub_calls(entrypoint_env) == []


def test_entrypoint_token_switch(entrypoint_env):
    Path(entrypoint_env["MODEL_STORE"], f"{DEFAULT_MODEL}.mar").write_bytes(b"")
    result = run_entrypoint(entrypoint_env, DISABLE_TOKEN_AUTH="true")
    assert "--disable-token-auth" in stub_calls(entrypoint_env)[0]
    assert "WARNING" in result.stderr
    result = run_entrypoint(entrypoint_env, DISABLE_TOKEN_AUTH="yes")
    assert result.returncode == 1 and "DISABLE_TOKEN_AUTH" in result.stderr


def test_entrypoint_exits_with_torchserves_status(entrypoint_env):
    # A server that fails must fail the container, so that it is restarted.
    Path(entrypoint_env["MODEL_STORE"], f"{DEFAULT_MODEL}.mar").write_bytes(b"")
    assert run_entrypoint(entrypoint_env, STUB_EXIT="3").returncode == 3
    # torchserve's launcher exits 0 even when the Java frontend dies.
    result = run_entrypoint(entrypoint_env, STUB_EXIT="0")
    assert result.returncode == 1 and "without being asked" in result.stderr


def test_entrypoint_stops_torchserve_on_sigterm(entrypoint_env):
    Path(entrypoint_env["MODEL_STORE"], f"{DEFAULT_MODEL}.mar").write_bytes(b"")
    process = subprocess.Popen(
        [str(ENTRYPOINT)],
        env={**entrypoint_env, "STUB_WAIT": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # a group of its own: `kill_entrypoint` takes the stub with it
    )
    try:
        deadline = time.monotonic() + 10
        while not stub_calls(entrypoint_env) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert stub_calls(entrypoint_env), "torchserve --start never ran"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0
    finally:
        kill_entrypoint(process)
    assert [call[0] for call in stub_calls(entrypoint_env)] == ["--start", "--stop"]


def start_entrypoint_and_wait_for_start(env: dict) -> subprocess.Popen:
    Path(env["MODEL_STORE"], f"{DEFAULT_MODEL}.mar").write_bytes(b"")
    process = subprocess.Popen(
        [str(ENTRYPOINT)],
        env={**env, "STUB_WAIT": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a group of its own: `kill_entrypoint` takes the stub with it
    )
    deadline = time.monotonic() + 10
    while not stub_calls(env) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert stub_calls(env), "torchserve --start never ran"
    return process


def kill_entrypoint(process: subprocess.Popen) -> None:
    """After a failed check: the entrypoint and its stub `torchserve`, which would otherwise wait forever."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)


@pytest.fixture
def open_connection(entrypoint_env):
    """A client connection to a stand-in inference port, named in the stub's TS_CONFIG."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    Path(entrypoint_env["TS_CONFIG"]).write_text(f"inference_address=http://127.0.0.1:{port}\n")
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = listener.accept()
    try:
        yield client
    finally:
        for sock in (client, accepted, listener):
            sock.close()


def test_entrypoint_drains_until_the_inference_connections_close(entrypoint_env, open_connection):
    # One quiet second, as in a pod (2 s by default), not none: with none, one poll that missed the
    # connection would end the drain, and the sleep below still outlasts the quiet second.
    entrypoint_env["DRAIN_QUIET_S"] = "1"
    process = start_entrypoint_and_wait_for_start(entrypoint_env)
    try:
        process.send_signal(signal.SIGTERM)
        marker = Path(entrypoint_env["DRAIN_MARKER"])
        deadline = time.monotonic() + 10
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert marker.exists(), "SIGTERM must mark the container as draining"
        time.sleep(1.5)
        assert [call[0] for call in stub_calls(entrypoint_env)] == ["--start"], "stopped with a connection open"
        open_connection.close()
        stdout, _ = process.communicate(timeout=10)
        assert process.returncode == 0
    finally:
        kill_entrypoint(process)
    assert [call[0] for call in stub_calls(entrypoint_env)] == ["--start", "--stop"]
    assert "drained" in stdout


def test_entrypoint_stops_anyway_past_the_drain_timeout(entrypoint_env, open_connection):
    # An idle keep-alive connection looks like a request in flight: only the deadline ends the drain.
    process = start_entrypoint_and_wait_for_start({**entrypoint_env, "DRAIN_TIMEOUT_S": "1"})
    try:
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=10)
        assert process.returncode == 0
    finally:
        kill_entrypoint(process)
    assert [call[0] for call in stub_calls(entrypoint_env)] == ["--start", "--stop"]
    assert "DRAIN_TIMEOUT_S" in stderr and "1 connection(s)" in stderr


def test_entrypoint_removes_a_stale_drain_marker(entrypoint_env):
    # The previous container of the pod may have left it in /tmp (a volume that outlives it).
    Path(entrypoint_env["MODEL_STORE"], f"{DEFAULT_MODEL}.mar").write_bytes(b"")
    marker = Path(entrypoint_env["DRAIN_MARKER"])
    marker.touch()
    run_entrypoint(entrypoint_env, STUB_EXIT="0")
    assert not marker.exists()


def test_entrypoint_and_healthcheck_agree_on_the_drain_marker():
    default = re.search(r'DRAIN_MARKER="\$\{DRAIN_MARKER:-([^}]+)\}"', ENTRYPOINT.read_text()).group(1)
    assert default == load_healthcheck().DEFAULT_DRAIN_MARKER


# --- healthcheck.py, run against a stand-in TorchServe -----------------------------------


def load_healthcheck():
    spec = importlib.util.spec_from_file_location("deploy_healthcheck", HEALTHCHECK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class FakeTorchServe(http.server.BaseHTTPRequestHandler):
    """Answers /ping and /models/<name> like TorchServe 0.12, from class attributes."""

    ping_status = 200
    worker_states: list[str] = ["READY"]
    required_key: str | None = None

    def do_GET(self):  # noqa: N802 (http.server's naming)
        if self.required_key and self.headers.get("Authorization") != f"Bearer {self.required_key}":
            return self.answer(400, {"code": 400, "type": "InvalidKeyException", "message": "no"})
        if self.path == "/ping":
            return self.answer(self.ping_status, {"status": "Healthy" if self.ping_status == 200 else "Unhealthy"})
        if self.path.startswith("/models/"):
            workers = [{"id": str(9000 + i), "status": s} for i, s in enumerate(self.worker_states)]
            return self.answer(200, [{"modelName": self.path.split("/")[2], "minWorkers": 1, "workers": workers}])
        return self.answer(404, {"code": 404})

    def answer(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_server():
    handler = type("Handler", (FakeTorchServe,), {})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield handler, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def run_healthcheck(url, *args, key_file="/nonexistent/key_file.json"):
    argv = ["--ping-url", f"{url}/ping", "--management-url", url, "--key-file", str(key_file), "--timeout", "2", *args]
    return load_healthcheck().main(argv)


def test_healthcheck_alive_follows_ping(fake_server, capsys):
    handler, url = fake_server
    assert run_healthcheck(url) == 0
    handler.ping_status = 500
    assert run_healthcheck(url) == 1
    assert "500" in capsys.readouterr().out


def test_healthcheck_ready_needs_ready_workers(fake_server, monkeypatch, capsys):
    handler, url = fake_server
    monkeypatch.setenv("MODEL_NAMES", "a,b")
    handler.worker_states = ["WORKER_STARTED"]
    assert run_healthcheck(url) == 0, "alive while loading"
    assert run_healthcheck(url, "--ready") == 1
    assert "0 of 1 workers READY" in capsys.readouterr().out
    handler.worker_states = ["READY"]
    assert run_healthcheck(url, "--ready") == 0


def test_healthcheck_sends_the_keys_from_the_key_file(fake_server, tmp_path, capsys):
    handler, url = fake_server
    handler.required_key = "secret"
    assert run_healthcheck(url) == 1, "no key file, token on"
    key_file = tmp_path / "key_file.json"
    future = "2999-01-01T00:00:00.123456789Z"
    key_file.write_text(
        json.dumps(
            {
                "inference": {"key": "secret", "expiration time": future},
                "management": {"key": "secret", "expiration time": future},
                "API": {"key": "api"},
            }
        )
    )
    assert run_healthcheck(url, "--ready", key_file=key_file) == 0
    key_file.write_text(json.dumps({"inference": {"key": "old", "expiration time": "2000-01-01T00:00:00Z"}}))
    assert run_healthcheck(url, key_file=key_file) == 1
    assert "expired" in capsys.readouterr().out


def test_healthcheck_drain_makes_ready_fail_but_not_alive(fake_server, tmp_path, monkeypatch, capsys):
    _, url = fake_server
    marker = tmp_path / "draining"
    monkeypatch.setenv("DRAIN_MARKER", str(marker))
    assert run_healthcheck(url, "--ready") == 0
    assert load_healthcheck().main(["--drain"]) == 0
    assert marker.exists()
    # No HTTP call at all while draining: the check must not count as a request in flight.
    assert run_healthcheck("http://127.0.0.1:9", "--ready") == 1
    assert "draining" in capsys.readouterr().out
    assert run_healthcheck(url) == 0, "a draining server is still alive"


def test_healthcheck_reports_an_unreachable_server(capsys):
    assert run_healthcheck("http://127.0.0.1:9") == 1
    assert "unreachable" in capsys.readouterr().out


def test_healthcheck_runs_as_a_script():
    assert os.access(HEALTHCHECK, os.X_OK)
    result = subprocess.run([sys.executable, str(HEALTHCHECK), "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "--ready" in result.stdout
