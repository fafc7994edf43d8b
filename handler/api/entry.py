"""One TorchServe request entry -> what serves it, and the `Answer` interface of both doors.

A request runs as one engine *row* (the native contract) or several (an
OpenAI request: one per choice). Its answer format, `NativeAnswer`
(`handler.api.native`) or `OpenAIAnswer` (`handler.api.openai.answers`), turns
its rows' steps and results into the response; the schedules in
`handler.serving` only ask it for text, so both serve both doors. A request
answered without the engine (the OpenAI model list, a refused request) is a
ready `Reply`, or a native `RequestError`: the model list, a stored response (GET and DELETE
`v1/responses/{id}`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Mapping, Protocol, Sequence

from handler.api.native import NativeAnswer, ParsedRequest, decode_body, parse_request
from handler.api.openai import requests as openai_requests
from handler.api.openai import routes
from handler.api.openai.answers import OpenAIAnswer
from handler.api.openai.requests import OpenAIRequest
from handler.api.openai.response_answers import ResponsesAnswer
from handler.api.openai.responses import parse_responses_request, stored_response_answer
from handler.api.openai.routes import Route
from handler.config import HandlerConfig
from handler.schema import JSON_CONTENT_TYPE, RequestError
from handler.types import GenerationRequest, GenerationResult

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Reply:
    """One request's answer in one handler call."""

    body: Any  # a dict (sent as JSON), or str
    status: int = 200
    content_type: str | None = None
    more: bool | None = None  # the `ts_stream_next` decision; None: a complete response


# What serves a request entry: the engine (a native or an OpenAI request), a ready Reply, or a native error.
Entry = ParsedRequest | OpenAIRequest | Reply | RequestError


def parse_entry(
    row: Any,
    content_type: str | None,
    config: HandlerConfig,
    tokenizer,
    max_context: int,
    route: Route | None = None,
    model_name: str = "",
    created: int = 0,
    response_store=None,
    openai_defaults: Mapping | None = None,
) -> Entry:
    """One TorchServe request entry -> what serves it (never raises).

    Args:
        row: the entry as TorchServe passes it ({"body": ...} or {"data": ...}).
        content_type: its Content-Type header.
        config, tokenizer, max_context: the request rules (`handler.api.native.parse_request`).
        route: its route, from the `url_path` header; None for the native contract.
        model_name, created: the served model's name and load time (OpenAI routes).
        response_store: the Responses route's store of responses.
        openai_defaults: what the sampling fields an OpenAI request leaves out take
            (`handler.api.openai.requests.sampling_defaults`); None: OpenAI's. The native route's
            are the config's.
    Returns:
        A ParsedRequest or OpenAIRequest for the engine; on an OpenAI route, a
        ready Reply for the model list or an error (OpenAI's body); on the native
        route, the RequestError that rejects the request.
    """
    openai = route is not None and route.is_openai
    try:
        body = row.get("body", row.get("data")) if isinstance(row, dict) else row
        if openai:
            if route.kind == routes.ROUTE_RESPONSES:
                decoded = openai_requests.decode_openai_body(body, content_type)
                parsed = parse_responses_request(
                    decoded, config, tokenizer, max_context, model_name, response_store, openai_defaults
                )
            elif route.kind == routes.ROUTE_RESPONSE:
                parsed = stored_response_answer(route, body, response_store)
            else:
                parsed = openai_requests.parse_openai_entry(
                    route, body, content_type, config, tokenizer, max_context, model_name, created, openai_defaults
                )
            if isinstance(parsed, dict):
                return Reply(parsed, content_type=JSON_CONTENT_TYPE)
        else:
            if body is None:
                # curl -d without a Content-Type sends form data, which TorchServe splits into fields.
                raise RequestError(
                    "body: the request has no body; send JSON with 'Content-Type: application/json' "
                    "or a plain-text prompt with 'Content-Type: text/plain'"
                )
            parsed = parse_request(decode_body(body, content_type), config, tokenizer, max_context)
        _check_fits(engine_rows(parsed), config.max_batch_tokens)
        return parsed
    except RequestError as error:
        rejected = error
    except Exception as error:  # a parsing failure must cost only this request
        logger.exception("a request could not be parsed")
        rejected = RequestError(f"server: could not process the request ({type(error).__name__})", 500)
    if not openai:
        return rejected
    status, body = routes.error_answer(rejected)
    return Reply(body, status=status, content_type=JSON_CONTENT_TYPE)


def _check_fits(generations: Sequence[GenerationRequest], max_batch_tokens: int) -> None:
    """A request larger than max_batch_tokens could never run: a 413 now, rather than a wait forever."""
    num_tokens = request_tokens(generations)
    if not max_batch_tokens or num_tokens <= max_batch_tokens:
        return
    if len(generations) == 1:
        [generation] = generations
        raise RequestError(
            f"prompt: {len(generation.prompt_ids)} prompt tokens + max_new_tokens {generation.max_new_tokens} "
            f"exceed this server's max_batch_tokens of {max_batch_tokens}; shorten the prompt or lower max_new_tokens",
            status=413,
        )
    raise RequestError(
        f"n: {len(generations)} choices of prompt + max tokens hold {num_tokens} tokens, more than this "
        f"server's max_batch_tokens of {max_batch_tokens}; lower n or max_tokens, or shorten the prompt",
        status=413,
    )


def engine_rows(parsed: ParsedRequest | OpenAIRequest) -> tuple[GenerationRequest, ...]:
    """The engine rows of a request: its generation, or one per choice of an OpenAI request."""
    return parsed.generations if isinstance(parsed, OpenAIRequest) else (parsed.generation,)


def request_tokens(generations: Sequence[GenerationRequest]) -> int:
    """What a request may hold in the caches: its rows' prompts plus every token they may generate."""
    return sum(len(generation.prompt_ids) + generation.max_new_tokens for generation in generations)


def error_reply(error: RequestError) -> Reply:
    """A native request's error, answered completely."""
    status, body = NativeAnswer.error(error)
    return Reply(body, status=status, content_type=JSON_CONTENT_TYPE)


class Answer(Protocol):
    """How a request's rows become its response; `NativeAnswer` and `OpenAIAnswer` are the two."""

    generations: Sequence[GenerationRequest]  # its engine rows
    stream: bool
    content_type: str

    def on_tokens(self, row: int, output) -> str:
        """After a step that emitted tokens without finishing `row`: the text to send now ("" for none)."""

    def on_row_finished(self, row: int, result: GenerationResult) -> str:
        """`row` finished (others may run on): the text to send now ("" for none)."""

    def final(self, results: Sequence[GenerationResult]) -> Any:
        """Every row is done (results in row order): the last body (a dict for JSON, or text)."""

    def error(self, error: RequestError) -> tuple[int, Any]:
        """Nothing was sent yet: the status and body of the error response."""

    def error_after_start(self, error: RequestError) -> str:
        """The 200 went out with a first chunk: the text that ends the body with the error."""


def answer_for(parsed: ParsedRequest | OpenAIRequest, tokenizer) -> Answer:
    if isinstance(parsed, OpenAIRequest) and parsed.kind == routes.ROUTE_RESPONSES:
        return ResponsesAnswer(parsed, tokenizer)
    if isinstance(parsed, OpenAIRequest):
        return OpenAIAnswer(parsed, tokenizer)
    return NativeAnswer(parsed, tokenizer)


def is_for_engine(entry: Entry) -> bool:
    return isinstance(entry, (ParsedRequest, OpenAIRequest))
