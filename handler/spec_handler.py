"""TorchServe entry point: wires config, loading, request parsing, streaming and metrics to the engine.

`torch-model-archiver --handler handler/spec_handler.py` makes this module the
model's handler; the rest of the `handler` package travels in the archive.
TorchServe imports this file as a top-level module and requires it to define
exactly one class: helpers live in the package's other modules.
"""

from __future__ import annotations

import json
import logging
import time

import torch
from ts.handler_utils.utils import send_intermediate_predict_response
from ts.torch_handler.base_handler import BaseHandler

from handler.adaptive import measure_cost_model
from handler.config import handler_config_from_yaml_config
from handler.engine import SpeculativeEngine
from handler.loading import load_models
from handler.metrics import MetricsRecorder
from handler.protocol import RequestError, decode_body, error_to_json, parse_request, result_to_json
from handler.streaming import RequestProgress

logger = logging.getLogger(__name__)


class SpeculativeHandler(BaseHandler):
    """Serves lossless speculative decoding; one TorchServe batch runs as one engine batch."""

    def initialize(self, context):
        # BaseHandler.initialize expects one serialized model file; this handler loads two folders.
        self.context = context
        self.manifest = context.manifest
        properties = context.system_properties
        self.config = handler_config_from_yaml_config(context.model_yaml_config)
        self.models = load_models(self.config, properties.get("model_dir"), properties.get("gpu_id"))
        self.device = self.models.device
        cost_table = None
        if self.config.adaptive_k:
            cost_table = measure_cost_model(self.models.target, self.models.draft, self.config.num_speculative_tokens)
            logger.info("adaptive k: %s (draft/target cost ratio c = %.3f)", cost_table, cost_table.draft_target_ratio)
        self.engine = SpeculativeEngine(
            self.models.target,
            self.models.draft,
            self.models.tokenizer,
            self.models.eos_token_ids,
            self.models.pad_token_id,
            default_drafter=self.config.drafter,
            cost_table=cost_table,
            prompt_lookup_min=self.config.prompt_lookup_min,
            prompt_lookup_max=self.config.prompt_lookup_max,
        )
        self.initialized = True
        logger.info("speculative handler ready on %s: %s", self.device, self.config)

    def handle(self, data, context):
        self.context = context
        self.metrics = MetricsRecorder(getattr(context, "metrics", None))
        self.batch_started = time.perf_counter()
        return self.postprocess(self.inference(self.preprocess(data)))

    def preprocess(self, data):
        """One entry per request: a ParsedRequest, or the RequestError that rejects it."""
        parsed = []
        for index, row in enumerate(data):
            try:
                body = row.get("body", row.get("data")) if isinstance(row, dict) else row
                if body is None:
                    # curl -d without a Content-Type sends form data, which TorchServe splits into fields.
                    raise RequestError(
                        "body: the request has no body; send JSON with 'Content-Type: application/json' "
                        "or a plain-text prompt with 'Content-Type: text/plain'"
                    )
                parsed.append(
                    parse_request(
                        decode_body(body, self._content_type(index)),
                        self.config,
                        self.models.tokenizer,
                        self.models.max_context,
                    )
                )
            except RequestError as error:
                parsed.append(error)
            except Exception as error:  # a parsing failure must cost only this request
                logger.exception("request %d could not be parsed", index)
                parsed.append(RequestError(f"server: could not process the request ({type(error).__name__})", 500))
        return parsed

    def inference(self, data, *args, **kwargs):
        """Runs the valid requests as one batch; invalid ones pass through untouched."""
        outputs = list(data)
        valid = [i for i, item in enumerate(data) if not isinstance(item, Exception)]
        if not valid:
            return outputs
        requests = [data[i].generation for i in valid]
        self.progress = {
            i: RequestProgress(data[i].stream, self.models.tokenizer, data[i].generation.stop) for i in valid
        }
        try:
            results = self.engine.generate(
                requests, on_tokens=lambda n, tokens, row: self._on_tokens(valid[n], tokens, row)
            )
        except Exception:  # a model failure must not take the worker or the other requests down
            logger.exception("batch of %d failed; retrying its requests one by one", len(requests))
            results = [self._generate_alone(i, request) for i, request in zip(valid, requests)]
        for i, result in zip(valid, results):
            outputs[i] = result
        return outputs

    def _on_tokens(self, index: int, new_token_ids: list[int], row) -> None:
        progress = self.progress[index]
        if row.finish_reason is not None:
            progress.finished_at = time.perf_counter()
            return  # the final chunk carries the rest
        if progress.deltas is None:
            return
        line = {"text_delta": progress.deltas.next_delta(row.token_ids), "token_ids": new_token_ids}
        progress.num_sent_tokens += len(new_token_ids)
        if progress.first_chunk_at is None:
            progress.first_chunk_at = time.perf_counter()
            self.context.set_response_content_type(index, "application/x-ndjson")
        request_id = self.context.get_request_id(index)
        send_intermediate_predict_response(
            {index: json.dumps(line) + "\n"},
            {index: request_id},
            "Intermediate prediction success",
            200,
            self.context,
        )

    def _generate_alone(self, index: int, request):
        if self.progress[index].first_chunk_at is not None:
            # Chunks already went out: a retry would send them again.
            return RequestError("server: generation failed mid-stream", status=500)
        try:
            return self.engine.generate(
                [request], on_tokens=lambda n, tokens, row: self._on_tokens(index, tokens, row)
            )[0]
        except torch.cuda.OutOfMemoryError:
            logger.exception("out of memory")
            return RequestError("server: out of memory for this request; try fewer tokens", status=507)
        except Exception as error:
            logger.exception("request failed")
            return RequestError(f"server: generation failed ({type(error).__name__})", status=500)

    def postprocess(self, data):
        answers = []
        for index, item in enumerate(data):
            if isinstance(item, RequestError):
                self.context.set_response_status(item.status, str(item), index)
                self.metrics.record_rejected()
                answers.append(error_to_json(str(item)))
                continue
            answer = result_to_json(item)
            progress = self.progress[index]
            finished_at = progress.finished_at or time.perf_counter()
            if progress.deltas is not None:
                # The last chunk: the rest of the text and ids, then the request's totals.
                del answer["text"]
                answer = {
                    "text_delta": progress.deltas.final_delta(item.text),
                    **answer,
                    "token_ids": item.token_ids[progress.num_sent_tokens :],
                }
                if progress.first_chunk_at is None:
                    progress.first_chunk_at = time.perf_counter()
                    self.context.set_response_content_type(index, "application/x-ndjson")
            self.metrics.record_result(
                item.stats,
                finished_at - self.batch_started,
                None if progress.first_chunk_at is None else progress.first_chunk_at - self.batch_started,
            )
            answers.append(json.dumps(answer) + "\n" if progress.deltas is not None else answer)
        return answers

    def _content_type(self, index: int) -> str | None:
        try:
            headers = self.context.get_request_header(index, "body") or {}
        except (AttributeError, IndexError, KeyError, TypeError):
            return None
        return headers.get("content-type") if isinstance(headers, dict) else None
