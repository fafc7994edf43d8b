"""Request parsing that needs the model: JSON bodies in, validated `GenerationRequest`s and answers out.

The contract itself (field names, limits, finish reasons, answer layout) is
`handler.schema`; this module adds what depends on the model config (defaults
and limits), the tokenizer (prompt and chat template) and the context size.
Every problem with a request raises `RequestError` with the HTTP status and a
message naming the field and the rule; the handler turns it into that
request's own error answer, never the batch's.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any, Sequence

from handler import schema
from handler.config import (
    SAMPLING_NUMBER_FIELDS,
    SPECULATIVE_TREE_MODES,
    HandlerConfig,
    SamplingParams,
    sampling_problem,
)
from handler.constraints import Constraint, check_json_schema, compiler_for

# Re-exported: the handler entry point imports them from here.
from handler.schema import JSON_CONTENT_TYPE, STREAM_CONTENT_TYPE, RequestError, decode_body
from handler.streaming import DeltaTracker
from handler.types import GenerationRequest, GenerationResult

__all__ = [
    "NativeAnswer",
    "ParsedRequest",
    "RequestError",
    "decode_body",
    "error_to_json",
    "parse_request",
    "result_to_json",
]


@dataclasses.dataclass(frozen=True)
class ParsedRequest:
    generation: GenerationRequest
    stream: bool = False


def _sampling(body: Mapping, default: SamplingParams, tokenizer) -> SamplingParams:
    """The request's sampling fields, each defaulting to the config's (logit_bias: to none)."""
    values: dict[str, Any] = {
        key: schema.number_field(body, key, getattr(default, key)) for key in SAMPLING_NUMBER_FIELDS
    }
    values["top_k"] = schema.integer_field(body, "top_k", default.top_k, *schema.TOP_K_RANGE)
    values["logit_bias"] = schema.logit_bias_field(body)
    problem = sampling_problem(**values)
    if problem:
        raise RequestError(problem)
    if values["logit_bias"]:
        # len(tokenizer) counts the added tokens too, unlike tokenizer.vocab_size.
        vocab_size = len(tokenizer)
        too_large = [token_id for token_id, _ in values["logit_bias"] if token_id >= vocab_size]
        if too_large:
            raise RequestError(
                f"logit_bias: token {too_large[0]} is not in this model's vocabulary (ids 0 to {vocab_size - 1})"
            )
    return SamplingParams(**values)


# Message keys besides role and content that go to the chat template as they are (tool calling:
# an assistant's tool_calls, a tool result's tool_call_id, a name).
TEMPLATE_MESSAGE_KEYS = ("tool_calls", "tool_call_id", "name")


def _prompt_ids(body: Mapping, tokenizer, tools: Sequence[Mapping] | None = None) -> list[int]:
    has_prompt, has_messages = "prompt" in body, "messages" in body
    if has_prompt == has_messages:
        raise RequestError("prompt/messages: give exactly one of 'prompt' (a string) or 'messages' (a list)")
    if has_prompt:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise RequestError(f"prompt: must be a string, got {type(prompt).__name__}")
        if not prompt:
            raise RequestError("prompt: must not be empty")
        return tokenizer(prompt, add_special_tokens=True)["input_ids"]
    messages = body["messages"]
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages: must be a non-empty list of {role, content} objects")
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise RequestError(f"messages[{index}]: must be an object with 'role' and 'content'")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise RequestError(f"messages[{index}].{key}: must be a string")
    if not getattr(tokenizer, "chat_template", None):
        raise RequestError("messages: this model's tokenizer has no chat template; send 'prompt' instead")
    try:
        rendered = tokenizer.apply_chat_template(
            [_template_message(m) for m in messages],
            tools=list(tools) if tools else None,
            tokenize=False,
            add_generation_prompt=True,
        )
    except Exception as error:  # templates raise their own errors, e.g. for an unknown role
        raise RequestError(f"messages: the model's chat template rejected them ({error})") from None
    # The template already holds any special tokens the model expects.
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def _template_message(message: Mapping) -> dict:
    extra = {key: message[key] for key in TEMPLATE_MESSAGE_KEYS if message.get(key) is not None}
    return {"role": message["role"], "content": message["content"], **extra}


def parse_request(
    body: Mapping, config: HandlerConfig, tokenizer, max_context: int, tools: Sequence[Mapping] | None = None
) -> ParsedRequest:
    """Validates one JSON request against the config and the model's context size.

    `tools`: tool definitions the chat template renders with `messages` (the
    OpenAI route's `tools`, validated there; not a native field).
    """
    schema.check_known_fields(body)
    max_new_tokens = schema.integer_field(body, "max_new_tokens", config.max_new_tokens, 1, config.max_new_tokens_limit)
    sampling = _sampling(body, config.sampling, tokenizer)
    num_speculative_tokens = schema.integer_field(
        body, "num_speculative_tokens", config.num_speculative_tokens, 0, config.max_num_speculative_tokens
    )
    seed = schema.seed_field(body)
    stream = schema.stream_field(body)
    stop = schema.stop_field(body)
    drafter = body.get("drafter", config.drafter)
    if drafter not in config.drafters:
        raise RequestError(
            f"drafter: {json.dumps(drafter)} is not available in this model archive; choose one of "
            f"{', '.join(config.drafters)}"
        )
    share = schema.optional_bool_field(body, "suffix_share_across_requests")
    if share and not config.suffix_options.share_across_requests:
        raise RequestError(
            "suffix_share_across_requests: this model keeps each request's text to itself "
            "(handler.suffix_share_across_requests is false); a request can only opt out"
        )
    tree = body.get("speculative_tree", config.speculative_tree)
    if tree not in SPECULATIVE_TREE_MODES:
        raise RequestError(f"speculative_tree: {json.dumps(tree)} is not one of {', '.join(SPECULATIVE_TREE_MODES)}")
    constraint = _constraint(body, tokenizer, config)
    prompt_ids = _prompt_ids(body, tokenizer, tools)
    if not prompt_ids:
        raise RequestError("prompt: encodes to no tokens")
    if len(prompt_ids) + max_new_tokens > max_context:
        raise RequestError(
            f"prompt: {len(prompt_ids)} prompt tokens + max_new_tokens {max_new_tokens} exceed the model's "
            f"context of {max_context} tokens; shorten the prompt or lower max_new_tokens",
            status=413,
        )
    generation = GenerationRequest(
        prompt_ids=tuple(prompt_ids),
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        num_speculative_tokens=num_speculative_tokens,
        seed=seed,
        stop=stop,
        drafter=drafter,
        suffix_share_across_requests=share,
        speculative_tree=None if tree == "auto" else False,
        constraint=constraint,
    )
    return ParsedRequest(generation=generation, stream=stream)


def _constraint(body: Mapping, tokenizer, config: HandlerConfig) -> Constraint | None:
    """The request's structured-output constraint, compiled now so that a bad one is this request's 400."""
    given = schema.constraint_field(body)
    if given is None:
        return None
    key, value = given
    if key == "json_schema":
        check_json_schema(value, key)
        constraint = Constraint.json_schema(value, field=key)
    elif key == "regex":
        constraint = Constraint.regex(value)
    else:
        constraint = Constraint.grammar(value)
    compiler_for(tokenizer, config.grammar_compile_timeout_s).compile(constraint)
    return constraint


def result_to_json(result: GenerationResult) -> dict:
    return schema.answer(
        text=result.text,
        token_ids=result.token_ids,
        finish_reason=result.finish_reason,
        prompt_tokens=result.prompt_tokens,
        speculative=result.stats.as_dict(),
        cached_tokens=result.cached_tokens,
    )


def error_to_json(message: str) -> dict:
    return schema.error_answer(message)


class NativeAnswer:
    """The native contract's response: the JSON answer, or NDJSON lines when streamed."""

    def __init__(self, parsed: ParsedRequest, tokenizer) -> None:
        self.generations = (parsed.generation,)
        self.stream = parsed.stream
        self.content_type = STREAM_CONTENT_TYPE if parsed.stream else JSON_CONTENT_TYPE
        self.deltas = DeltaTracker(tokenizer, parsed.generation.stop) if parsed.stream else None
        self.num_sent_tokens = 0

    def on_tokens(self, row: int, output) -> str:
        if self.deltas is None or not output.new_token_ids:
            return ""
        self.num_sent_tokens += len(output.new_token_ids)
        line = {"text_delta": self.deltas.next_delta(output.token_ids), "token_ids": list(output.new_token_ids)}
        return json.dumps(line) + "\n"

    def on_row_finished(self, row: int, result: GenerationResult) -> str:
        return ""  # one row: the final answer carries the rest

    def final(self, results: Sequence[GenerationResult]) -> Any:
        [result] = results
        answer = result_to_json(result)
        if self.deltas is None:
            return answer
        # The last line: the rest of the text and ids, then the request's totals.
        del answer["text"]
        answer = {
            "text_delta": self.deltas.final_delta(result.text),
            **answer,
            "token_ids": result.token_ids[self.num_sent_tokens :],
        }
        return json.dumps(answer) + "\n"

    @staticmethod
    def error(error: RequestError) -> tuple[int, Any]:
        return error.status, error_to_json(str(error))

    def error_after_start(self, error: RequestError) -> str:
        return json.dumps(error_to_json(str(error))) + ("\n" if self.stream else "")
