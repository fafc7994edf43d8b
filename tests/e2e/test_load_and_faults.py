"""Load and fault tolerance against the real TorchServe of conftest.py (tiny pair, batchSize 4).

- scripts.serving.loadtest, 200 mixed requests at concurrency 8: no errors, none
  lost, every answer well-formed.
- A greedy and a seeded sampled request give the same tokens under load as
  alone: batching with other requests does not change a request's output.
- kill -9 of the model worker while a load runs: TorchServe starts a new
  worker (new pid, READY again); the requests in flight fail fast with a 5xx
  or a broken connection, never hang; requests after the restart succeed.
- kill -9 of a static-batching worker while it decodes a plain request whose
  answer has not started: that request gets HTTP 507 `Worker died.`, or 500
  where TorchServe had not yet seen the process's exit status (the statuses
  docs/operations.md and deploy/README.md give).

Every request has a timeout, so a hang fails the test instead of stalling it.
What the clients saw is printed (pytest -s shows it).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import Counter

import pytest
import requests
import yaml

from scripts.serving import loadtest, torchserve
from tests.conftest import run_module

from .conftest import REGISTER_TIMEOUT_S

REQUEST_TIMEOUT_S = 60  # longest wait for the next bytes of one answer
RESTART_TIMEOUT_S = 90  # TorchServe restarts a dead worker after a short backoff, then it reloads
GREEDY_BODY = {"prompt": "def fibonacci(n):", "max_new_tokens": 16, "temperature": 0.0}
SAMPLED_BODY = {"prompt": "The weather today is", "max_new_tokens": 16, "temperature": 0.7, "seed": 1234}
# Errors a client may see when the worker dies under it: a 5xx from the
# frontend, or the connection reset under a stream that had already started.
CONNECTION_ERRORS = ("ConnectionError", "ChunkedEncodingError")
STATIC_MODEL_NAME = "tiny-static"


def generate(server, body: dict) -> torchserve.Answer:
    return torchserve.generate(server.inference_url, server.model_name, body, {}, None, REQUEST_TIMEOUT_S)


class BackgroundLoad:
    """loadtest.run_load in a thread; `stop()` skips the requests not yet sent and waits."""

    def __init__(self, server, **overrides) -> None:
        settings = dict(
            url=server.inference_url,
            model=server.model_name,
            key_file=None,
            timeout_s=REQUEST_TIMEOUT_S,
        )
        settings.update(overrides)
        self.config = loadtest.LoadConfig(**settings)
        self.outcomes: list[loadtest.Outcome] = []
        self._stop = threading.Event()
        self._done = threading.Condition()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.error: BaseException | None = None

    def _record(self, outcome: loadtest.Outcome) -> None:
        with self._done:
            self.outcomes.append(outcome)
            self._done.notify_all()

    def _run(self) -> None:
        try:
            loadtest.run_load(self.config, on_outcome=self._record, stop=self._stop)
        except BaseException as error:  # reported by stop()
            self.error = error

    def start(self, wait_for: int) -> BackgroundLoad:
        """Start, and return once `wait_for` requests have finished (so the load is running)."""
        self._thread.start()
        with self._done:
            running = self._done.wait_for(lambda: len(self.outcomes) >= wait_for, timeout=REQUEST_TIMEOUT_S)
        if not running:
            self.stop()
            pytest.fail(f"the background load finished only {len(self.outcomes)} requests in {REQUEST_TIMEOUT_S} s")
        return self

    def wait_for(self, predicate, timeout_s: float) -> bool:
        """Wait until predicate(outcomes so far) holds; False on timeout or when the load is over."""
        with self._done:
            return self._done.wait_for(
                lambda: predicate(self.outcomes) or not self._thread.is_alive(), timeout=timeout_s
            ) and predicate(self.outcomes)

    def stop(self) -> list[loadtest.Outcome]:
        """Idempotent; returns every outcome so far."""
        self._stop.set()
        # Each request in flight ends within its own timeout.
        self._thread.join(timeout=2 * REQUEST_TIMEOUT_S)
        assert not self._thread.is_alive(), "the background load did not finish: a request hung"
        assert self.error is None, f"the background load crashed: {self.error!r}"
        return list(self.outcomes)


def ready_worker_pid(server) -> int:
    [worker] = server.workers()
    assert worker["status"] == "READY", worker
    return worker["pid"]


def wait_for_new_worker(server, old_pid: int, deadline: float) -> tuple[int | None, float | None]:
    """(pid, time.monotonic()) of the first READY worker whose pid is not old_pid; (None, None) at the deadline."""
    return wait_for_new_worker_of(server, server.model_name, old_pid, deadline)


def wait_for_new_worker_of(server, model_name: str, old_pid: int, deadline: float) -> tuple[int | None, float | None]:
    while time.monotonic() < deadline:
        try:
            [worker] = torchserve.model_workers(server.management_url, model_name)
        except (torchserve.ClientError, ValueError, LookupError):
            worker = {}  # the frontend may be busy cleaning up the dead worker
        if worker.get("status") == "READY" and worker.get("pid") not in (None, old_pid):
            return worker["pid"], time.monotonic()
        time.sleep(0.2)
    return None, None


def test_loadtest_200_requests_no_errors_none_lost(server, tmp_path):
    report = tmp_path / "load.json"
    result = run_module(
        "scripts.serving.loadtest",
        *("--url", server.inference_url, "--model", server.model_name, "--no-auth", "--json-out", str(report)),
        *("--requests", "200", "--concurrency", "8", "--max-new-tokens", "12", "--timeout", str(REQUEST_TIMEOUT_S)),
    )
    print(result.stdout)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}\n{server.log_tail()}"
    summary = json.loads(report.read_text())
    assert summary["requests"] == 200
    assert (summary["ok"], summary["errors"], summary["malformed"], summary["lost"]) == (200, 0, 0, 0), summary
    # The mix really mixed: both decodings, streamed and not.
    assert set(summary["by_kind"]) == {"greedy/plain", "greedy/stream", "sampled/plain", "sampled/stream"}
    assert summary["completion_tokens"] > 0
    assert summary["first_chunk_s"]["p50"] is not None


def test_outputs_under_load_equal_outputs_alone(server):
    greedy_alone = generate(server, GREEDY_BODY)
    sampled_alone = generate(server, SAMPLED_BODY)
    assert not greedy_alone.problems and not sampled_alone.problems

    load = BackgroundLoad(server, num_requests=400, concurrency=6, max_new_tokens=12, mix_seed=1).start(wait_for=4)
    try:
        greedy_loaded = generate(server, GREEDY_BODY)
        sampled_loaded = generate(server, SAMPLED_BODY)
        sampled_streamed = generate(server, dict(SAMPLED_BODY, stream=True))
        num_finished_during_checks = len(load.outcomes)
    finally:
        outcomes = load.stop()

    assert num_finished_during_checks < load.config.num_requests, "the load ended before the checks ran"
    assert greedy_loaded.token_ids == greedy_alone.token_ids
    assert greedy_loaded.text == greedy_alone.text
    assert sampled_loaded.token_ids == sampled_alone.token_ids
    assert sampled_loaded.text == sampled_alone.text
    assert sampled_streamed.token_ids == sampled_alone.token_ids
    assert sampled_streamed.text == sampled_alone.text
    failures = [(o.kind, o.status, o.error) for o in outcomes if o.outcome != "ok"]
    assert not failures, failures


def test_worker_killed_under_load_is_restarted(server):
    old_pid = ready_worker_pid(server)

    # A long stream that is surely in flight when the worker dies.
    first_chunk = threading.Event()
    stream_result: dict = {}

    def long_stream() -> None:
        try:
            # The tiny pair decodes this greedily to the length limit, without an EOS:
            # 400 of its 1024 positions, a second or more of decoding.
            body = {"prompt": "import json", "max_new_tokens": 400, "temperature": 0.0, "stream": True}
            answer = torchserve.generate(
                server.inference_url,
                server.model_name,
                body,
                {},
                None,
                REQUEST_TIMEOUT_S,
                on_delta=lambda _: first_chunk.set(),
            )
            stream_result["seen"] = f"complete answer, finish_reason {answer.final.get('finish_reason')}"
            stream_result["ok"] = False
        except torchserve.ClientError as error:
            stream_result["seen"], stream_result["ok"] = f"HTTP {error.status}: {error}", error.status >= 500
        except requests.Timeout as error:
            stream_result["seen"], stream_result["ok"] = f"hung: {type(error).__name__}", False
        except requests.RequestException as error:
            stream_result["seen"], stream_result["ok"] = f"{type(error).__name__}: {error}", True

    stream_thread = threading.Thread(target=long_stream, daemon=True)
    load = BackgroundLoad(server, num_requests=120, concurrency=4, max_new_tokens=24, mix_seed=2)
    load.start(wait_for=4)
    stream_thread.start()
    try:
        deadline = time.monotonic() + REQUEST_TIMEOUT_S
        while not first_chunk.wait(0.05) and stream_thread.is_alive() and time.monotonic() < deadline:
            pass
        assert first_chunk.is_set() and stream_thread.is_alive(), (
            f"the long stream should be under way; saw: {stream_result.get('seen', 'no chunk')}"
        )
        killed_at = time.monotonic()
        os.kill(old_pid, signal.SIGKILL)
        new_pid, ready_at = wait_for_new_worker(server, old_pid, killed_at + RESTART_TIMEOUT_S)
        stream_thread.join(timeout=2 * REQUEST_TIMEOUT_S)
        # Let the load run on the new worker for a few requests.
        if ready_at is not None:
            load.wait_for(lambda done: sum(o.started_at > ready_at for o in done) >= 4, REQUEST_TIMEOUT_S)
    finally:
        outcomes = load.stop()

    # What the clients saw, printed for the record.
    failed = [o for o in outcomes if o.outcome != "ok"]
    print(
        f"\nworker {old_pid} killed; new worker {new_pid} READY after "
        f"{'-' if ready_at is None else f'{ready_at - killed_at:.1f}'} s"
    )
    print(f"long stream in flight: {stream_result.get('seen', 'no result (hung)')}")
    num_served_after = sum(o.outcome == "ok" and o.started_at > ready_at for o in outcomes) if ready_at else 0
    print(
        f"background load: {len(outcomes)} requests, {len(outcomes) - len(failed)} ok "
        f"({num_served_after} of them sent after the restart), "
        f"failures: {dict(Counter((o.outcome, o.status, o.error.split(':')[0]) for o in failed)) or 'none'}"
    )
    for outcome in failed:
        print(
            f"  #{outcome.index} {outcome.kind} sent {outcome.started_at - killed_at:+.2f} s from the kill, "
            f"answered after {outcome.latency_s:.2f} s: {outcome.outcome} {outcome.status} {outcome.error[:120]}"
        )

    assert new_pid is not None, (
        f"no READY worker with a new pid {RESTART_TIMEOUT_S} s after the kill: {server.workers()}\n{server.log_tail()}"
    )
    assert not stream_thread.is_alive(), "the in-flight stream hung after the worker died"
    assert stream_result["ok"], (
        f"the in-flight stream should have failed with a 5xx or a broken connection, saw: {stream_result['seen']}"
    )
    for outcome in failed:
        assert (outcome.outcome == "http_error" and outcome.status >= 500) or (
            outcome.outcome == "lost" and outcome.error.startswith(CONNECTION_ERRORS)
        ), f"request #{outcome.index} failed in an unexpected way: {outcome}"
        assert outcome.started_at < ready_at, f"request #{outcome.index}, sent after the restart, failed: {outcome}"
    assert num_served_after >= 4, "the load did not go on after the restart"

    # The new worker serves: greedy, sampled and streamed requests all succeed.
    after = [
        generate(server, GREEDY_BODY),
        generate(server, SAMPLED_BODY),
        generate(server, dict(SAMPLED_BODY, stream=True)),
    ]
    assert all(not answer.problems for answer in after), [answer.problems for answer in after]
    assert after[1].token_ids == after[2].token_ids
    assert ready_worker_pid(server) == new_pid


@pytest.fixture(scope="module")
def static_model(server, tiny_models_dir, tmp_path_factory):
    """The tiny pair registered beside the session's model as a no-archive folder with static batching:
    two requests that arrive within 3 s share one batch, which runs to its end."""
    root = tmp_path_factory.mktemp("static-package")
    config = yaml.safe_load((server.model_store.parent / "model-config.yaml").read_text())
    config.update(continuousBatching=False, batchSize=2, maxBatchDelay=3000)
    (root / "model-config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    result = run_module(
        "scripts.model_tools.package_mar",
        *("--model-name", STATIC_MODEL_NAME, "--config", str(root / "model-config.yaml")),
        *("--export-path", str(server.model_store), "--archive-format", "no-archive"),
        *("--target", str(tiny_models_dir / "target"), "--draft", str(tiny_models_dir / "draft")),
    )
    assert result.returncode == 0, f"package_mar failed:\n{result.stdout}\n{result.stderr}"
    torchserve.register(server.management_url, STATIC_MODEL_NAME, STATIC_MODEL_NAME, {}, REGISTER_TIMEOUT_S)
    try:
        yield STATIC_MODEL_NAME
    finally:
        torchserve.unregister(server.management_url, STATIC_MODEL_NAME, {})


def test_worker_killed_mid_batch_answers_507_or_500(server, static_model):
    """The status a client sees when the worker dies under a request whose answer has not started.

    A stream and a plain request share one static batch; once the stream's first chunk is out, the
    plain request is being decoded and its answer is not started. TorchServe 0.12 answers it when
    it loses the worker (WorkerThread): 507 where the process has already exited with status 137
    (SIGKILL: kill -9, or the kernel's out-of-memory killer), else 500. Which one a kill -9 gives
    is a race between TorchServe's socket read and its reaping of the process: both occur.
    """
    [worker] = torchserve.model_workers(server.management_url, static_model)
    assert worker["status"] == "READY", worker
    url = f"{server.inference_url}/predictions/{static_model}"
    # The tiny pair decodes "import json" greedily to the length limit, a second or more.
    long_body = {"prompt": "import json", "max_new_tokens": 400, "temperature": 0.0}
    first_chunk = threading.Event()
    seen: dict = {}

    def stream() -> None:
        try:
            with requests.post(url, json=dict(long_body, stream=True), stream=True, timeout=REQUEST_TIMEOUT_S) as r:
                for _ in r.iter_lines():
                    first_chunk.set()
        except requests.RequestException as error:
            seen["stream"] = type(error).__name__

    def plain() -> None:
        try:
            seen["plain"] = requests.post(url, json=long_body, timeout=REQUEST_TIMEOUT_S)
        except requests.RequestException as error:
            seen["plain"] = error

    threads = [threading.Thread(target=stream, daemon=True), threading.Thread(target=plain, daemon=True)]
    for thread in threads:
        thread.start()
    assert first_chunk.wait(REQUEST_TIMEOUT_S), f"the stream never started: {seen}\n{server.log_tail()}"
    assert threads[1].is_alive(), f"the plain request ended before the kill: {seen.get('plain')}"
    os.kill(worker["pid"], signal.SIGKILL)
    for thread in threads:
        thread.join(timeout=REQUEST_TIMEOUT_S)
    assert not any(thread.is_alive() for thread in threads), "a request hung after the worker died"

    plain_answer = seen["plain"]
    assert isinstance(plain_answer, requests.Response), f"the plain request saw no answer: {plain_answer!r}"
    print(f"\nplain request in the killed batch: HTTP {plain_answer.status_code} {plain_answer.text.strip()}")
    assert plain_answer.status_code in (507, 500), plain_answer.text
    expected = {"code": plain_answer.status_code, "type": "InternalServerException", "message": "Worker died."}
    assert plain_answer.json() == expected
    new_pid, _ = wait_for_new_worker_of(server, static_model, worker["pid"], time.monotonic() + RESTART_TIMEOUT_S)
    assert new_pid is not None, f"no new worker for {static_model}\n{server.log_tail()}"
