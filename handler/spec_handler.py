"""TorchServe entry point: wires config, loading, request parsing, serving and metrics to the engine.

`torch-model-archiver --handler handler/spec_handler.py` makes this module the
model's handler; the rest of the `handler` package travels in the archive.
TorchServe imports this file as a top-level module and requires it to define
exactly one class: helpers live in the package's other modules.

With `continuousBatching: true` in model-config.yaml, each call is one engine
step over every request in flight (`handler.serving.ContinuousBatcher`);
otherwise each call runs its batch from start to finish (`StaticBatch`).
Both serve the native contract and the OpenAI routes, which TorchServe names
in each request's `url_path` header (`handler.api.openai.requests`).
"""

from __future__ import annotations

import logging
import time

from ts.handler_utils.utils import send_intermediate_predict_response
from ts.torch_handler.base_handler import BaseHandler

from handler.api.openai.requests import sampling_defaults
from handler.api.openai.responses import ResponseStore
from handler.api.openai.routes import Route, route_from_url_path
from handler.config import handler_config_from_yaml_config
from handler.constraints import compiler_for
from handler.engine import engine_from_config
from handler.metrics import (
    CostScaleTally,
    MetricsRecorder,
    PlanTally,
    PrefixCacheTally,
    ResponseStoreTally,
    SuffixTreeTally,
)
from handler.planning.measure import cost_table_cache_dir
from handler.runtime.loading import load_models
from handler.schema import RequestError
from handler.serving import ContinuousBatcher, Reply, StaticBatch, parse_entry

logger = logging.getLogger(__name__)


class SpeculativeHandler(BaseHandler):
    """Serves lossless speculative decoding, continuously batched or one TorchServe batch at a time."""

    def initialize(self, context):
        # BaseHandler.initialize expects one serialized model file; this handler loads two folders.
        self.context = context
        self.manifest = context.manifest
        properties = context.system_properties
        self.config = handler_config_from_yaml_config(context.model_yaml_config)
        self.models = load_models(self.config, properties.get("model_dir"), properties.get("gpu_id"))
        self.device = self.models.device
        # The prefix cache's budget, the runner and (adaptive_k) the cost table are worked out now, on the
        # device and dtype that serve; the table is cached in the model dir.
        self.engine = engine_from_config(
            self.models,
            self.config,
            max_batch_size=int((context.model_yaml_config or {}).get("batchSize", 1)),
            cache_dir=cost_table_cache_dir(properties.get("model_dir")),
            model_identity=f"{context.model_name}/{(self.manifest or {}).get('model', {}).get('modelVersion', '')}",
        )
        self.prefix_cache_tally = PrefixCacheTally()
        self.suffix_tree_tally = SuffixTreeTally()
        self.cost_scale_tally = CostScaleTally()
        self.plan_tally = PlanTally()
        self.response_store = ResponseStore(
            self.config.responses_store_max_entries, self.config.responses_store_max_bytes
        )
        self.response_store_tally = ResponseStoreTally()
        # The grammar engine's view of the vocabulary (about 1 s for 150k tokens), built now
        # rather than inside the first structured request while the batch waits.
        try:
            compiler_for(self.models.tokenizer, self.config.grammar_compile_timeout_s)
        except RequestError as error:
            # Said once here; each structured request gets it as its 400, and the rest serve.
            logger.warning("%s", error)
        # The OpenAI routes: `model` must name the model as TorchServe serves it, and the sampling fields
        # a request leaves out take the target's generation_config.json, then OpenAI's defaults.
        self.model_name = context.model_name
        self.created = int(time.time())
        generation = getattr(self.models.target, "generation_config", None)
        self.openai_defaults = sampling_defaults(None if generation is None else generation.to_diff_dict())
        self.continuous = (context.model_yaml_config or {}).get("continuousBatching") is True
        tokenizer, max_batch_tokens = self.models.tokenizer, self.config.max_batch_tokens
        self.batcher = (
            ContinuousBatcher(self.engine, tokenizer, max_batch_tokens, max_call_s=self.config.max_call_ms / 1000)
            if self.continuous
            else None
        )
        self.static_batch = StaticBatch(self.engine, tokenizer, max_batch_tokens)
        self.initialized = True
        logger.info(
            "speculative handler ready on %s (%s batching): %s",
            self.device,
            "continuous" if self.continuous else "static",
            self.config,
        )

    def handle(self, data, context):
        self.context = context
        metrics = MetricsRecorder(getattr(context, "metrics", None), self.config.metrics_latency_buckets_s)
        if self.continuous:
            request_ids = [self._request_id(index) for index in range(len(data))]
            new_requests = {
                request_id: self._parse(index, row)
                for index, (request_id, row) in enumerate(zip(request_ids, data))
                if not self.batcher.knows(request_id)
            }
            replies = self.batcher.run_call(request_ids, new_requests, metrics)
        else:
            replies = self.static_batch.run(self.preprocess(data), self._send_chunk, metrics)
        # The cache's counters move at admission and its bytes when requests leave, the suffix tree
        # and the cost correction with every step: once per call covers every step (one per call in
        # continuous batching, the whole batch otherwise).
        self.prefix_cache_tally.record(metrics, self.engine.prefix_cache_stats)
        self.suffix_tree_tally.record(metrics, self.engine.suffix_tree_stats)
        self.cost_scale_tally.record(metrics, self.engine.cost_scales)
        self.plan_tally.record(metrics, self.engine.steps.num_steps, self.engine.steps.recent_steps)
        self.response_store_tally.record(metrics, self.response_store)
        if self.models.vocab_map is not None:
            metrics.record_shared_vocabulary(100 * self.models.vocab_map.shared_share)
        return self._answer(replies)

    def preprocess(self, data):
        """One entry per request (`handler.serving.parse_entry`)."""
        return [self._parse(index, row) for index, row in enumerate(data)]

    def _parse(self, index: int, row):
        tokenizer, max_context = self.models.tokenizer, self.models.max_context
        route = self._route(index)
        return parse_entry(
            row,
            self._content_type(index),
            self.config,
            tokenizer,
            max_context,
            route,
            self.model_name,
            self.created,
            self.response_store,
            self.openai_defaults,
        )

    def _answer(self, replies: list[Reply]) -> list:
        """Per-request status, content type and, in continuous mode, the stream decision; returns the bodies."""
        for index, reply in enumerate(replies):
            if reply.status != 200:
                error = reply.body.get("error", "")
                message = error.get("message", "") if isinstance(error, dict) else error  # OpenAI's or ours
                self.context.set_response_status(reply.status, str(message), index)
            if reply.content_type is not None:
                self.context.set_response_content_type(index, reply.content_type)
        # TorchServe asks stopping_criteria[i] whether answer i ends its response: True ends a
        # stream, False continues it, None sends a complete response. Static mode leaves it unset.
        self.context.stopping_criteria = (
            [lambda _answer, more=reply.more: None if more is None else not more for reply in replies]
            if self.continuous
            else None
        )
        return [reply.body for reply in replies]

    def _send_chunk(self, index: int, text: str, content_type: str) -> None:
        self.context.set_response_content_type(index, content_type)
        send_intermediate_predict_response(
            {index: text},
            {index: self.context.get_request_id(index)},
            "Intermediate prediction success",
            200,
            self.context,
        )

    def _request_id(self, index: int) -> str:
        request_id = self.context.get_request_id(index)
        assert request_id is not None, "TorchServe names every job of a continuous batch"
        return request_id

    def _route(self, index: int) -> Route:
        """The request's route: TorchServe names the path after `/predictions/{model}/{version}/` in `url_path`,
        and passes the HTTP headers but not the method (`route_from_url_path`)."""
        url_path = self._header(index, "url_path")
        try:
            headers = self.context.get_all_request_header(index)
        except (AttributeError, IndexError, KeyError, TypeError):
            headers = None
        return route_from_url_path(url_path if isinstance(url_path, str) else None, headers)

    def _content_type(self, index: int) -> str | None:
        headers = self._header(index, "body") or {}
        return headers.get("content-type") if isinstance(headers, dict) else None

    def _header(self, index: int, name: str):
        try:
            return self.context.get_request_header(index, name)
        except (AttributeError, IndexError, KeyError, TypeError):
            return None
