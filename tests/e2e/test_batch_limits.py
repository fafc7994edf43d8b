"""What a client sees at the limits, through the real TorchServe of conftest.py.

The tiny pair is registered a second time, as `tiny-spec-limits`, in
continuous batching with three small limits: `max_batch_tokens` (the handler's
memory bound), `batchSize: 2` and a per-model `jobQueueSize: 1` (TorchServe's
queue of jobs not yet sent to the worker).

- A request larger than max_batch_tokens alone gets a 413 naming it, and the
  worker carries on.
- Two requests that fit alone but not together both get a 200: the second
  waits in the handler until the first finishes, its answer equals its answer
  alone, and the wait reaches the SpecQueueWaitSeconds histogram.
- A burst beyond batchSize + jobQueueSize: TorchServe answers 503 to the
  overflow, every other request gets its full answer, none is lost, and the
  worker carries on.
"""

from __future__ import annotations

import dataclasses
import shutil
import threading

import pytest
import requests
import yaml

from scripts.model_tools import package_mar
from scripts.serving import torchserve

from .conftest import HTTP_TIMEOUT_S, REGISTER_TIMEOUT_S, in_thread, metric_samples, send, write_model_config

MODEL_NAME = "tiny-spec-limits"
MAX_BATCH_TOKENS = 64
# Greedy: outputs are comparable with the same request alone. The tiny pair decodes
# "import json" to the length limit without an EOS, so FIRST holds the batch for many steps.
FIRST = {"prompt": "import json", "max_new_tokens": 48, "temperature": 0.0, "stream": True}
SECOND = {"prompt": "def fibonacci(n):", "max_new_tokens": 12, "temperature": 0.0}
NUM_BURST = 8


@pytest.fixture(scope="module")
def limited(server, tiny_models_dir, tmp_path_factory):
    """The conftest server with the tiny pair registered again under tight limits; unregistered at the end."""
    config_path = tmp_path_factory.mktemp("limits") / "limits.yaml"
    write_model_config(config_path)
    config = yaml.safe_load(config_path.read_text())
    config.update(continuousBatching=True, batchSize=2, maxBatchDelay=50, jobQueueSize=1)
    config["handler"]["max_batch_tokens"] = MAX_BATCH_TOKENS
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    # A plain folder, which TorchServe loads in place: no archive to zip and unzip.
    folder = package_mar.package(
        MODEL_NAME,
        tiny_models_dir / "target",
        tiny_models_dir / "draft",
        config_path,
        server.model_store,
        archive_format="no-archive",
        force=True,
    )
    try:
        torchserve.register(server.management_url, folder.name, MODEL_NAME, {}, REGISTER_TIMEOUT_S)
        yield dataclasses.replace(server, model_name=MODEL_NAME)
    except torchserve.ClientError as error:
        pytest.fail(f"{error}\n{server.log_tail()}")
    finally:
        requests.delete(f"{server.management_url}/models/{MODEL_NAME}", timeout=HTTP_TIMEOUT_S)
        shutil.rmtree(folder, ignore_errors=True)


def model_series(server, name: str) -> dict[str, float]:
    """This model's series of a metric, by the name they carry (e.g. `_count`, `_bucket` with its `le`)."""
    series = {}
    for full_name, labels, value in metric_samples(server):
        if not full_name.startswith(name) or labels.get("ModelName") != server.model_name:
            continue
        key = full_name + (f"[{labels['le']}]" if "le" in labels else "")
        series[key] = series.get(key, 0.0) + value
    return series


def worker_pids(server) -> list[int]:
    return [worker["pid"] for worker in server.workers()]


def test_a_request_that_can_never_fit_gets_413_and_the_worker_carries_on(limited):
    pids = worker_pids(limited)
    for body in ({"prompt": "Hello!", "max_new_tokens": MAX_BATCH_TOKENS}, {**FIRST, "max_new_tokens": 60}):
        outcome = send(limited, body)
        assert outcome.status == 413, (body, outcome.status, outcome.error)
        assert "max_batch_tokens" in outcome.error and str(MAX_BATCH_TOKENS) in outcome.error, outcome.error
    after = send(limited, SECOND)
    assert after.status == 200 and after.finish_reason, after.error
    assert worker_pids(limited) == pids


def test_two_requests_that_fit_only_alone_run_one_after_the_other(limited):
    alone = [limited.predict_ok({**body, "stream": False}) for body in (FIRST, SECOND)]
    sizes = [answer["usage"]["prompt_tokens"] + body["max_new_tokens"] for answer, body in zip(alone, (FIRST, SECOND))]
    assert max(sizes) <= MAX_BATCH_TOKENS < sum(sizes), f"the premise: each fits alone, not together ({sizes})"
    waits_before = model_series(limited, "SpecQueueWaitSeconds")

    results: dict = {}
    first_streams = threading.Event()
    first = in_thread(limited, FIRST, results, "first", first_streams)
    assert first_streams.wait(HTTP_TIMEOUT_S), f"the first request never streamed\n{limited.log_tail()}"
    second = in_thread(limited, SECOND, results, "second")
    for thread in (first, second):
        thread.join(2 * HTTP_TIMEOUT_S)

    for key, answer in zip(("first", "second"), alone):
        outcome = results[key]
        assert outcome.status == 200 and not outcome.error, f"{key}: {outcome.error}\n{limited.log_tail()}"
        assert outcome.token_ids == answer["token_ids"] and outcome.text == answer["text"], key
    # The second is far shorter, yet ends later: it joined only once the first had left.
    assert results["second"].finished > results["first"].finished

    waits = model_series(limited, "SpecQueueWaitSeconds")
    delta = {key: value - waits_before.get(key, 0.0) for key, value in waits.items()}
    assert delta.get("SpecQueueWaitSeconds_count") == 2, delta  # both were admitted, after a wait or none
    # The first joined in the call it arrived in, the second only after at least one step of the first.
    buckets = sorted((float(key[key.index("[") + 1 : -1]), value) for key, value in delta.items() if "[" in key)
    assert buckets and buckets[0][1] <= 1 and buckets[-1][1] == 2, delta
    assert delta["SpecQueueWaitSeconds_sum"] > 0, delta


def test_a_burst_beyond_the_job_queue_gets_503_for_the_overflow_only(limited):
    body = {**FIRST, "stream": False}
    alone = limited.predict_ok(body)
    pids = worker_pids(limited)

    results: dict = {}
    start = threading.Barrier(NUM_BURST)

    def burst(index: int) -> None:
        start.wait()
        try:
            response = limited.predict(body)
            results[index] = (response.status_code, response.json())
        except (requests.RequestException, ValueError) as error:  # a broken or malformed answer
            results[index] = (None, f"{type(error).__name__}: {error}")

    threads = [threading.Thread(target=burst, args=(index,), daemon=True) for index in range(NUM_BURST)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(2 * HTTP_TIMEOUT_S)

    assert sorted(results) == list(range(NUM_BURST)), "every request got an answer"
    statuses = [status for status, _ in results.values()]
    assert set(statuses) <= {200, 503}, results
    # batchSize 2 + jobQueueSize 1: at most 3 of the burst are taken before the first ends.
    assert statuses.count(503) >= 1 and statuses.count(200) >= 1, statuses
    for status, answer in results.values():
        if status == 503:  # the frontend's own refusal: the job never reached the worker
            assert answer["code"] == 503 and answer["type"] == "ServiceUnavailableException", answer
        else:
            assert answer["token_ids"] == alone["token_ids"] and answer["text"] == alone["text"], answer
            assert answer["finish_reason"] == alone["finish_reason"]
    print(f"\nburst of {NUM_BURST}: {statuses.count(200)} answered, {statuses.count(503)} refused with 503")

    assert limited.predict_ok(SECOND)["token_ids"], "the worker answers after the burst"
    assert worker_pids(limited) == pids
