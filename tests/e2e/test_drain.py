"""End-to-end: the container's entrypoint drains a real TorchServe on SIGTERM.

deploy/docker/entrypoint.sh runs as the container runs it, with the packaged
tiny archive in its model store, a config.properties on free loopback ports,
token authorization off, and the `torchserve` of this environment first on
PATH. Its log, TorchServe's logs, pid file and unpacked archive go to a
temporary folder.

- Drain: streams are running when SIGTERM arrives; readiness turns off at once,
  every stream still ends with its final line, and only then does TorchServe
  stop and the entrypoint exit 0.
- Deadline: a stream longer than DRAIN_TIMEOUT_S is cut, the way the kubelet's
  SIGKILL would cut it past the grace period: the client gets no final line.

Each test starts and stops its own server (the session's `server` fixture
stays up for the other tests); the whole process group is killed in teardown.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from scripts.serving import torchserve
from tests.conftest import REPO_ROOT

from .conftest import HTTP_TIMEOUT_S, MODEL_NAME, STARTUP_TIMEOUT_S, free_ports, package_tiny_pair, write_server_config

ENTRYPOINT = REPO_ROOT / "deploy" / "docker" / "entrypoint.sh"
HEALTHCHECK = REPO_ROOT / "deploy" / "docker" / "healthcheck.py"
EOS_TOKEN_ID = 0  # the tiny tokenizer's <|endoftext|>
NUM_STREAMS = 4
MAX_NEW_TOKENS = 256
# Plain decoding (no drafts) and no EOS: every stream runs to max_new_tokens,
# slowly enough on the tiny pair to be in flight when SIGTERM comes.
STREAM_BODY = {
    "max_new_tokens": MAX_NEW_TOKENS,
    "stream": True,
    "temperature": 0.0,
    "num_speculative_tokens": 0,
    "logit_bias": {str(EOS_TOKEN_ID): -100},
}
PROMPTS = ["import json", "def fibonacci(n):", "The weather today is", "Hello!"]
# Within the tiny pair's 1024 positions, and far longer than the deadline test's drain.
LONG_MAX_NEW_TOKENS = 1000
STOP_TIMEOUT_S = 60


@dataclasses.dataclass
class Container:
    """entrypoint.sh running TorchServe, as in the image."""

    process: subprocess.Popen
    inference_url: str
    management_url: str
    drain_marker: Path
    env: dict[str, str]
    log: Path
    log_dir: Path

    def readiness(self) -> subprocess.CompletedProcess:
        """`healthcheck.py --ready`, as the readiness probe runs it."""
        return subprocess.run(
            [sys.executable, str(HEALTHCHECK), "--ready", "--ping-url", f"{self.inference_url}/ping"]
            + ["--management-url", self.management_url, "--key-file", str(self.log.parent / "no-key-file.json")],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=30,
        )

    def log_tail(self) -> str:
        names = ("ts_log.log", "model_log.log")
        return "\n".join(
            [torchserve.log_tail(self.log, 60)] + [torchserve.log_tail(self.log_dir / name, 40) for name in names]
        )

    def live_processes(self) -> list[int]:
        """The processes of the entrypoint's group (launcher, Java frontend, workers) that still run."""
        pids = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            # After the command's ")": state, ppid, pgrp.
            if int(fields[2]) == self.process.pid and fields[0] != "Z":
                pids.append(int(stat.parent.name))
        return pids


@pytest.fixture(scope="module")
def one_step_archive(tiny_models_dir, tmp_path_factory) -> Path:
    """The tiny pair with one engine step a TorchServe call (`max_call_ms: 0`): its longest stream then
    takes several seconds, where several steps a call finish it in about 2 s on a quiet machine."""
    return package_tiny_pair(tiny_models_dir, tmp_path_factory.mktemp("one-step"), max_call_ms=0)


@pytest.fixture
def start_container(java_runtime, model_archive, tmp_path):
    """Starts entrypoint.sh with the given extra environment and waits until it is ready."""
    started: list[Container] = []

    def start(archive: Path = model_archive, **extra_env: str) -> Container:
        model_store = archive.parent
        root = tmp_path / f"container{len(started)}"
        log_dir, temp_dir = root / "logs", root / "tmp"
        log_dir.mkdir(parents=True)
        temp_dir.mkdir()
        ports = free_ports(5)
        ts_config = root / "config.properties"
        write_server_config(ts_config, model_store, ports)
        # The entrypoint runs `torchserve` itself: JAVA_HOME and PATH for the Java the tests run on.
        env = java_runtime.environment()
        env.pop("TS_CONFIG_FILE", None)  # it would override --ts-config
        env.update(
            PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
            MODEL_NAMES=MODEL_NAME,
            MODEL_STORE=str(model_store),
            TS_CONFIG=str(ts_config),
            DISABLE_TOKEN_AUTH="true",
            DRAIN_MARKER=str(root / "draining"),
            LOG_LOCATION=str(log_dir),
            METRICS_LOCATION=str(log_dir),
            # torchserve's pid file is in the temp folder: `torchserve --stop` finds this server only.
            TMPDIR=str(temp_dir),
            TEMP=str(temp_dir),
            TMP=str(temp_dir),
            **extra_env,
        )
        log = root / "entrypoint.log"
        with log.open("w") as output:
            # A file, not a pipe: the Java frontend inherits it and would block on a full pipe.
            process = subprocess.Popen(
                [str(ENTRYPOINT)], cwd=root, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
            )
        container = Container(
            process=process,
            inference_url=f"http://127.0.0.1:{ports[0]}",
            management_url=f"http://127.0.0.1:{ports[1]}",
            drain_marker=root / "draining",
            env=env,
            log=log,
            log_dir=log_dir,
        )
        started.append(container)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while (check := container.readiness()).returncode != 0:
            assert process.poll() is None, f"the entrypoint exited with {process.returncode}\n{container.log_tail()}"
            assert time.monotonic() < deadline, f"never ready: {check.stdout}\n{container.log_tail()}"
            time.sleep(0.5)
        return container

    yield start
    for container in started:
        try:
            os.killpg(container.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        container.process.wait(timeout=30)


class Stream:
    """One streamed request read line by line in a thread; its fields are set as lines arrive."""

    def __init__(self, container: Container, prompt: str, max_new_tokens: int) -> None:
        self.token_ids: list[int] = []
        self.final: dict | None = None
        self.error = ""
        self.first_chunk = threading.Event()
        self.finished_at = 0.0
        body = {**STREAM_BODY, "prompt": prompt, "max_new_tokens": max_new_tokens}
        url = f"{container.inference_url}/predictions/{MODEL_NAME}"
        self.thread = threading.Thread(target=self._read, args=(url, body), daemon=True)
        self.thread.start()

    def _read(self, url: str, body: dict) -> None:
        try:
            with requests.post(url, json=body, stream=True, timeout=HTTP_TIMEOUT_S) as response:
                if response.status_code != 200:
                    self.error = f"HTTP {response.status_code}: {response.text}"
                    return
                for line in response.iter_lines():
                    if not line.strip():
                        continue
                    chunk = json.loads(line)
                    self.token_ids += chunk["token_ids"]
                    self.first_chunk.set()
                    if "finish_reason" in chunk:
                        self.final = chunk
        except requests.RequestException as error:
            self.error = f"{type(error).__name__}: {error}"
        finally:
            self.finished_at = time.monotonic()
            self.first_chunk.set()  # never leave the test waiting on a failed stream


def wait_until_gone(container: Container) -> None:
    """TorchServe's processes have exited and its inference port refuses connections."""
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while container.live_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not container.live_processes(), f"still running: {container.live_processes()}\n{container.log_tail()}"
    host, port = container.inference_url.removeprefix("http://").split(":")
    with pytest.raises(OSError):
        socket.create_connection((host, int(port)), timeout=5).close()


def test_sigterm_drains_the_streams_in_flight_then_stops(start_container):
    container = start_container()
    started_at = time.monotonic()
    streams = [Stream(container, PROMPTS[i % len(PROMPTS)], MAX_NEW_TOKENS) for i in range(NUM_STREAMS)]
    for stream in streams:
        assert stream.first_chunk.wait(HTTP_TIMEOUT_S), container.log_tail()
        assert not stream.error, f"{stream.error}\n{container.log_tail()}"

    container.process.send_signal(signal.SIGTERM)  # the entrypoint alone, as tini passes it on
    sigterm_at = time.monotonic()
    tokens_at_sigterm = [len(stream.token_ids) for stream in streams]

    # Readiness turns off during the drain, while the streams go on.
    deadline = time.monotonic() + 10
    while (check := container.readiness()).returncode == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert check.returncode == 1 and "draining" in check.stdout, check.stdout
    ready_off_after_s = time.monotonic() - sigterm_at
    assert container.process.poll() is None, "the entrypoint must wait for the streams"

    for stream in streams:
        stream.thread.join(HTTP_TIMEOUT_S)
    assert container.process.wait(timeout=STOP_TIMEOUT_S) == 0, container.log_tail()
    stopped_at = time.monotonic()
    print(
        f"\ndrain: {NUM_STREAMS} streams of {MAX_NEW_TOKENS} tokens, SIGTERM "
        f"{sigterm_at - started_at:.2f} s after they started with {tokens_at_sigterm} tokens streamed; "
        f"readiness off {ready_off_after_s:.2f} s after it; last stream ended "
        f"{max(s.finished_at for s in streams) - sigterm_at:.2f} s after it; entrypoint exited "
        f"{stopped_at - sigterm_at:.2f} s after it"
    )

    for stream, tokens_then in zip(streams, tokens_at_sigterm):
        assert not stream.error, f"stream cut: {stream.error}\n{container.log_tail()}"
        assert tokens_then < MAX_NEW_TOKENS, "the stream was not in flight at SIGTERM; make it longer"
        assert stream.final is not None, f"no final line after {len(stream.token_ids)} tokens"
        assert stream.final["finish_reason"] == "length"
        assert stream.final["usage"]["completion_tokens"] == len(stream.token_ids) == MAX_NEW_TOKENS
        assert stream.finished_at > sigterm_at
    log = container.log.read_text()
    assert "drained" in log and "DRAIN_TIMEOUT_S" not in log, container.log_tail()
    wait_until_gone(container)


def test_past_drain_timeout_the_entrypoint_stops_anyway(start_container, one_step_archive):
    drain_timeout_s = 2
    container = start_container(one_step_archive, DRAIN_TIMEOUT_S=str(drain_timeout_s))
    stream = Stream(container, PROMPTS[0], LONG_MAX_NEW_TOKENS)
    assert stream.first_chunk.wait(HTTP_TIMEOUT_S) and not stream.error, f"{stream.error}\n{container.log_tail()}"

    container.process.send_signal(signal.SIGTERM)
    sigterm_at = time.monotonic()
    assert container.process.wait(timeout=drain_timeout_s + STOP_TIMEOUT_S) == 0, container.log_tail()
    assert time.monotonic() - sigterm_at >= drain_timeout_s
    stopped_after_s = time.monotonic() - sigterm_at
    stream.thread.join(HTTP_TIMEOUT_S)
    print(
        f"\ndeadline: DRAIN_TIMEOUT_S={drain_timeout_s}, entrypoint exited {stopped_after_s:.2f} s after SIGTERM; "
        f"the stream got {len(stream.token_ids)} of {LONG_MAX_NEW_TOKENS} tokens and ended with "
        f"{stream.error or 'no error'}, final line: {stream.final is not None}"
    )

    # The client sees its stream end without the final line (or the connection fail).
    assert stream.final is None, f"the stream finished in {drain_timeout_s} s; make it longer"
    assert len(stream.token_ids) < LONG_MAX_NEW_TOKENS
    log = container.log.read_text()
    assert "DRAIN_TIMEOUT_S" in log and "1 connection(s)" in log, container.log_tail()
    wait_until_gone(container)
