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

from handler import openai_api
from handler.adaptive import measure_cost_model
from handler.config import handler_config_from_yaml_config
from handler.engine import SpeculativeEngine
from handler.loading import load_models
from handler.metrics import MetricsRecorder
from handler.openai_answers import JSON_CONTENT_TYPE, SSE_CONTENT_TYPE, OpenAIStream, response_body
from handler.openai_api import OpenAIRequest
from handler.protocol import (
    ParsedRequest,
    RequestError,
    decode_body,
    error_to_json,
    parse_request,
    result_to_json,
)
from handler.streaming import RequestProgress

logger = logging.getLogger(__name__)


def _generations(item) -> tuple:
    """The engine rows of a parsed request: one for a native request, one per choice for an OpenAI one."""
    return item.generations if isinstance(item, OpenAIRequest) else (item.generation,)


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
        # The OpenAI routes: `model` must name the model as TorchServe serves it.
        self.model_name = context.model_name
        self.created = int(time.time())
        self.initialized = True
        logger.info("speculative handler ready on %s: %s", self.device, self.config)

    def handle(self, data, context):
        self.context = context
        self.metrics = MetricsRecorder(getattr(context, "metrics", None))
        self.batch_started = time.perf_counter()
        return self.postprocess(self.inference(self.preprocess(data)))

    def preprocess(self, data):
        """One entry per request: a ParsedRequest or OpenAIRequest, a ready answer
        (GET v1/models), or the RequestError that rejects it."""
        parsed = []
        for index, row in enumerate(data):
            try:
                route = self._route(index)
                if route.kind in (openai_api.ROUTE_MODELS, openai_api.ROUTE_MODEL):
                    parsed.append(openai_api.models_answer(route, self.model_name, self.created))
                    continue
                if route.kind == openai_api.ROUTE_UNKNOWN:
                    raise openai_api.unknown_route_error(route)
                body = row.get("body", row.get("data")) if isinstance(row, dict) else row
                if body is None:
                    # curl -d without a Content-Type sends form data, which TorchServe splits into fields.
                    raise RequestError(
                        "body: the request has no body; send JSON with 'Content-Type: application/json' "
                        "or a plain-text prompt with 'Content-Type: text/plain'"
                    )
                tokenizer, max_context = self.models.tokenizer, self.models.max_context
                if route.is_openai:
                    body = openai_api.decode_openai_body(body, self._content_type(index))
                    parsed.append(
                        openai_api.parse_openai_request(
                            route.kind, body, self.config, tokenizer, max_context, self.model_name
                        )
                    )
                else:
                    body = decode_body(body, self._content_type(index))
                    parsed.append(parse_request(body, self.config, tokenizer, max_context))
            except RequestError as error:
                parsed.append(error)
            except Exception as error:  # a parsing failure must cost only this request
                logger.exception("request %d could not be parsed", index)
                parsed.append(RequestError(f"server: could not process the request ({type(error).__name__})", 500))
        return parsed

    def inference(self, data, *args, **kwargs):
        """Runs the valid requests as one batch, one engine row per choice; the rest pass through.

        A native request answers with its GenerationResult, an OpenAI request
        with the list of its choices' results.
        """
        self.parsed = list(data)
        self.streams: dict[int, OpenAIStream] = {}
        outputs = list(data)
        valid = [i for i, item in enumerate(data) if isinstance(item, (ParsedRequest, OpenAIRequest))]
        if not valid:
            return outputs
        rows = [(i, choice) for i in valid for choice in range(len(_generations(data[i])))]
        requests = [_generations(data[i])[choice] for i, choice in rows]
        self.progress = {
            i: RequestProgress(
                isinstance(data[i], ParsedRequest) and data[i].stream,
                self.models.tokenizer,
                _generations(data[i])[0].stop,
            )
            for i in valid
        }
        for i in valid:
            if isinstance(data[i], OpenAIRequest) and data[i].stream:
                self.streams[i] = OpenAIStream(data[i], self.models.tokenizer)
        try:
            results = self.engine.generate(
                requests, on_tokens=lambda n, tokens, row: self._on_tokens(*rows[n], tokens, row)
            )
            by_request = {i: [] for i in valid}
            for (i, _), result in zip(rows, results):
                by_request[i].append(result)
        except Exception:  # a model failure must not take the worker or the other requests down
            logger.exception("batch of %d rows failed; retrying its requests one by one", len(requests))
            by_request = {i: self._generate_alone(i, _generations(data[i])) for i in valid}
        for i, results in by_request.items():
            single = isinstance(data[i], ParsedRequest) and isinstance(results, list)
            outputs[i] = results[0] if single else results
        return outputs

    def _on_tokens(self, index: int, choice: int, new_token_ids: list[int], row) -> None:
        progress = self.progress[index]
        if row.finish_reason is not None:
            progress.finished_at = time.perf_counter()
            if index in self.streams and row.result is not None:
                # This choice is done while others may run on: its last chunk goes now.
                self._send(index, self.streams[index].on_finished(choice, row.result), SSE_CONTENT_TYPE)
            return  # the final chunk carries the rest
        if index in self.streams:
            self._send(index, self.streams[index].on_tokens(choice, row.token_ids), SSE_CONTENT_TYPE)
            return
        if progress.deltas is None:
            return
        line = {"text_delta": progress.deltas.next_delta(row.token_ids), "token_ids": new_token_ids}
        progress.num_sent_tokens += len(new_token_ids)
        self._send(index, json.dumps(line) + "\n", "application/x-ndjson")

    def _send(self, index: int, text: str, content_type: str) -> None:
        """Sends one streamed chunk of request `index` now."""
        if not text:
            return
        progress = self.progress[index]
        if progress.first_chunk_at is None:
            progress.first_chunk_at = time.perf_counter()
            self.context.set_response_content_type(index, content_type)
        request_id = self.context.get_request_id(index)
        send_intermediate_predict_response(
            {index: text},
            {index: request_id},
            "Intermediate prediction success",
            200,
            self.context,
        )

    def _generate_alone(self, index: int, requests):
        """The request's rows as a batch of their own: their results, or the RequestError for all."""
        if self.progress[index].first_chunk_at is not None:
            # Chunks already went out: a retry would send them again.
            return RequestError("server: generation failed mid-stream", status=500)
        try:
            return self.engine.generate(
                requests, on_tokens=lambda n, tokens, row: self._on_tokens(index, n, tokens, row)
            )
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
                self.metrics.record_rejected()
                if self._route(index).is_openai:
                    answers.append(self._openai_error(index, item))
                    continue
                self.context.set_response_status(item.status, str(item), index)
                answers.append(error_to_json(str(item)))
                continue
            if isinstance(item, dict):  # GET v1/models
                self.context.set_response_content_type(index, JSON_CONTENT_TYPE)
                answers.append(item)
                continue
            if isinstance(self.parsed[index], OpenAIRequest):
                answers.append(self._openai_answer(index, self.parsed[index], item))
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

    def _openai_answer(self, index: int, request: OpenAIRequest, results: list) -> dict | str:
        progress = self.progress[index]
        finished_at = progress.finished_at or time.perf_counter()
        if index in self.streams and progress.first_chunk_at is None:
            progress.first_chunk_at = time.perf_counter()  # the final answer is the first chunk
        for result in results:
            self.metrics.record_result(
                result.stats,
                finished_at - self.batch_started,
                None if progress.first_chunk_at is None else progress.first_chunk_at - self.batch_started,
            )
        if index in self.streams:
            self.context.set_response_content_type(index, SSE_CONTENT_TYPE)
            return self.streams[index].close(results)
        self.context.set_response_content_type(index, JSON_CONTENT_TYPE)
        return response_body(request, results, self.models.tokenizer)

    def _openai_error(self, index: int, error: RequestError) -> dict | str:
        stream = getattr(self, "streams", {}).get(index)
        if stream is not None and stream.started:
            return stream.error(error)  # the 200 and the first chunks are out: an error event ends the stream
        status, body = openai_api.error_answer(error)
        self.context.set_response_status(status, str(error), index)
        self.context.set_response_content_type(index, JSON_CONTENT_TYPE)
        return body

    def _route(self, index: int) -> openai_api.Route:
        try:
            url_path = self.context.get_request_header(index, "url_path")
        except (AttributeError, IndexError, KeyError, TypeError):
            url_path = None
        return openai_api.route_from_url_path(url_path)

    def _content_type(self, index: int) -> str | None:
        try:
            headers = self.context.get_request_header(index, "body") or {}
        except (AttributeError, IndexError, KeyError, TypeError):
            return None
        return headers.get("content-type") if isinstance(headers, dict) else None
