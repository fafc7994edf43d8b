"""The handler in continuous-batching mode with TorchServe's own Context and the tiny pair, no server.

The test plays the frontend: each call carries every job in flight (new ones
with their body), and reads each answer's `ts_stream_next` decision the way
TorchServe's encoder does, through `context.stopping_criteria`.
"""

from __future__ import annotations

import json

import pytest
from ts.context import Context, RequestProcessor

from handler.spec_handler import SpeculativeHandler
from tests.models.test_spec_handler import HANDLER_SECTION


def make_context(model_dir, continuous: bool) -> Context:
    yaml_config = {"batchSize": 4, "handler": dict(HANDLER_SECTION)}
    if continuous:
        yaml_config["continuousBatching"] = True
    return Context(
        "tiny", str(model_dir), {"model": {"modelName": "tiny"}}, 4, None, "0.12.0", model_yaml_config=yaml_config
    )


@pytest.fixture(scope="module")
def handlers(tiny_models_dir):
    continuous, static = SpeculativeHandler(), SpeculativeHandler()
    continuous.initialize(make_context(tiny_models_dir, True))
    static.initialize(make_context(tiny_models_dir, False))
    assert continuous.continuous and not static.continuous
    return continuous, static


class Frontend:
    def __init__(self, handler, model_dir):
        self.handler = handler
        self.model_dir = model_dir
        self.in_flight: dict[str, dict] = {}  # request id -> body, None once sent
        self.url_paths: dict[str, str] = {}
        self.received: dict[str, list] = {}
        self.statuses: dict[str, int] = {}
        self.steps = 0
        self.metrics = None  # TorchServe's metrics cache, or a test's stand-in

    def submit(self, request_id: str, body, url_path: str = "") -> None:
        """A new job; `url_path` is what TorchServe sets ("" on the native route, e.g. "v1/completions")."""
        self.in_flight[request_id] = body
        self.url_paths[request_id] = url_path

    def call(self) -> None:
        ids = list(self.in_flight)
        data = [{"body": self.in_flight[r]} if self.in_flight[r] is not None else {} for r in ids]
        context = make_context(self.model_dir, True)
        context.request_ids = dict(enumerate(ids))
        context.metrics = self.metrics
        context.request_processor = [
            RequestProcessor({"body": {"content-type": "application/json"}, "url_path": self.url_paths[r]}) for r in ids
        ]
        answers = self.handler.handle(data, context)
        self.steps += 1
        for index, request_id in enumerate(ids):
            self.in_flight[request_id] = None
            stop = context.stopping_criteria[index](answers[index])
            self.statuses.setdefault(request_id, context.get_response_status(index)[0])
            self.received.setdefault(request_id, []).append(answers[index])
            if stop is True:
                del self.in_flight[request_id]
            elif stop is None and len(self.received[request_id]) > 1:
                raise AssertionError("a complete response after chunks")

    def run(self, max_calls: int = 500) -> None:
        for _ in range(max_calls):
            if not self.in_flight:
                return
            self.call()
        raise AssertionError("requests still in flight")

    def answer(self, request_id: str):
        """What the client gets: the body, or the NDJSON lines of a stream."""
        parts = [p for p in self.received[request_id] if p != ""]
        if len(parts) == 1 and isinstance(parts[0], dict):
            return parts[0]
        return [json.loads(line) for line in self.text(request_id).splitlines()]

    def text(self, request_id: str) -> str:
        """A streamed body's chunks joined."""
        return "".join(part for part in self.received[request_id] if isinstance(part, str))


def solo(static_handler, model_dir, body: dict) -> dict:
    context = make_context(model_dir, False)
    context.request_processor = [RequestProcessor({"body": {"content-type": "application/json"}})]
    context.request_ids = {0: "solo"}
    return static_handler.handle([{"body": {k: v for k, v in body.items() if k != "stream"}}], context)[0]


def test_staggered_requests_join_the_running_batch_and_match_their_solo_outputs(handlers, tiny_models_dir):
    continuous, static = handlers
    long = {"prompt": "import json", "max_new_tokens": 60, "stream": True}
    shorts = {
        "greedy": {"prompt": "def add(a, b):", "max_new_tokens": 8},
        "greedy-stream": {"prompt": "Hello", "max_new_tokens": 8, "stream": True},
        "sampled": {"prompt": "Once upon", "max_new_tokens": 8, "temperature": 0.9, "seed": 5},
    }
    frontend = Frontend(continuous, tiny_models_dir)
    frontend.submit("long", long)
    frontend.call()
    frontend.call()
    for name, body in shorts.items():
        frontend.submit(name, body)
    frontend.run()

    long_lines = frontend.answer("long")
    assert sum((line["token_ids"] for line in long_lines), []) == solo(static, tiny_models_dir, long)["token_ids"]
    for name, body in shorts.items():
        alone = solo(static, tiny_models_dir, body)
        answer = frontend.answer(name)
        if body.get("stream"):
            assert sum((line["token_ids"] for line in answer), []) == alone["token_ids"]
            assert "".join(line["text_delta"] for line in answer) == alone["text"]
        else:
            assert answer["token_ids"] == alone["token_ids"] and answer["text"] == alone["text"]
        # The short ones left long before the long one finished.
        assert len(frontend.received[name]) < len(frontend.received["long"]) - 2
    assert all(status == 200 for status in frontend.statuses.values())
    assert not continuous.engine.has_unfinished_requests()


def test_a_bad_request_fails_alone_and_a_vanished_one_is_aborted(handlers, tiny_models_dir):
    continuous, static = handlers
    frontend = Frontend(continuous, tiny_models_dir)
    frontend.submit("gone", {"prompt": "import os", "max_new_tokens": 60, "stream": True})
    frontend.submit("bad", {"prompt": "x", "temperature": -1})
    frontend.submit("good", {"prompt": "def add(a, b):", "max_new_tokens": 10})
    frontend.call()
    assert frontend.statuses["bad"] == 400 and "temperature" in frontend.received["bad"][0]["error"]
    del frontend.in_flight["gone"]  # its client disconnected: the frontend stops sending it
    frontend.call()
    assert not continuous.batcher.knows("gone")
    frontend.run()
    assert (
        frontend.answer("good")["token_ids"]
        == solo(static, tiny_models_dir, {"prompt": "def add(a, b):", "max_new_tokens": 10})["token_ids"]
    )
    assert not continuous.engine.has_unfinished_requests()
