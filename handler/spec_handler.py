"""TorchServe entry point: wires config, loading, request parsing and the engine together.

`torch-model-archiver --handler handler/spec_handler.py` makes this module the
model's handler; the rest of the `handler` package travels in the archive.
"""

from __future__ import annotations

import logging

import torch
from ts.torch_handler.base_handler import BaseHandler

from handler.adaptive import AdaptiveK, measure_cost_model
from handler.config import handler_config_from_yaml_config
from handler.engine import SpeculativeEngine
from handler.loading import load_models
from handler.protocol import RequestError, decode_body, error_to_json, parse_request, result_to_json

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
        adaptive = None
        if self.config.adaptive_k:
            cost = measure_cost_model(self.models.target, self.models.draft, self.config.num_speculative_tokens)
            logger.info("adaptive k: %s (draft/target cost ratio c = %.3f)", cost, cost.draft_target_ratio)
            adaptive = AdaptiveK(cost)
        self.engine = SpeculativeEngine(
            self.models.target,
            self.models.draft,
            self.models.tokenizer,
            self.models.eos_token_ids,
            self.models.pad_token_id,
            adaptive=adaptive,
        )
        self.initialized = True
        logger.info("speculative handler ready: %s", self.config)

    def handle(self, data, context):
        self.context = context
        return self.postprocess(self.inference(self.preprocess(data)))

    def preprocess(self, data):
        """One entry per request: a ParsedRequest, or the RequestError that rejects it."""
        parsed = []
        for index, row in enumerate(data):
            try:
                body = row.get("body", row.get("data")) if isinstance(row, dict) else row
                if body is None:
                    raise RequestError("body: the request has no body")
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
        return parsed

    def inference(self, data, *args, **kwargs):
        """Runs the valid requests as one batch; invalid ones pass through untouched."""
        outputs = list(data)
        valid = [i for i, item in enumerate(data) if not isinstance(item, Exception)]
        if not valid:
            return outputs
        requests = [data[i].generation for i in valid]
        try:
            results = self.engine.generate(requests)
        except Exception:  # a model failure must not take the worker or the other requests down
            logger.exception("batch of %d failed; retrying its requests one by one", len(requests))
            results = [self._generate_alone(request) for request in requests]
        for i, result in zip(valid, results):
            outputs[i] = result
        return outputs

    def _generate_alone(self, request):
        try:
            return self.engine.generate([request])[0]
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
                answers.append(error_to_json(str(item)))
            else:
                answers.append(result_to_json(item))
        return answers

    def _content_type(self, index: int) -> str | None:
        try:
            headers = self.context.get_request_header(index, "body") or {}
        except (AttributeError, IndexError, KeyError, TypeError):
            return None
        return headers.get("content-type") if isinstance(headers, dict) else None
