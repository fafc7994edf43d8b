"""The REST contract: request bodies in, validated `GenerationRequest`s and JSON answers out.

Every problem with a request raises `RequestError` with the HTTP status and a
message naming the field and the rule; the handler turns it into that
request's own error answer, never the batch's.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Mapping

from handler.config import HandlerConfig, SamplingParams, sampling_problem
from handler.engine import GenerationRequest, GenerationResult

REQUEST_FIELDS = (
    "prompt",
    "messages",
    "max_new_tokens",
    "temperature",
    "top_k",
    "top_p",
    "seed",
    "num_speculative_tokens",
    "stop",
    "stream",
    "drafter",
)
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
SEED_RANGE = (0, 2**63 - 1)


class RequestError(ValueError):
    """A request the client must change; `status` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclasses.dataclass(frozen=True)
class ParsedRequest:
    generation: GenerationRequest
    stream: bool = False


def decode_body(value: Any, content_type: str | None = None) -> dict:
    """Turns what TorchServe hands over for one request into a JSON object.

    TorchServe has already parsed an `application/json` body when it could, and
    passes anything else as bytes or text. A body that is not a JSON object or
    array but is UTF-8 text is taken as the prompt.
    """
    is_json = (content_type or "").split(";")[0].strip().lower() == "application/json"
    if isinstance(value, str) and is_json:
        # TorchServe parsed this JSON body already (it passes bytes when it cannot): a JSON string.
        raise RequestError("body: a JSON body must be an object, got str")
    if isinstance(value, (bytes, bytearray)):
        try:
            value = bytes(value).decode("utf-8")
        except UnicodeDecodeError as error:
            raise RequestError(f"body: not valid UTF-8 ({error.reason} at byte {error.start})") from None
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as error:
            if is_json:
                raise RequestError(f"body: Content-Type is application/json but the body is not valid JSON ({error})")
            return {"prompt": value}
        # Plain text that happens to parse as a JSON scalar, such as "42", is still a prompt.
        if not isinstance(parsed, (dict, list)) and not is_json:
            return {"prompt": value}
        value = parsed
    if not isinstance(value, Mapping):
        raise RequestError(f"body: a JSON body must be an object, got {type(value).__name__}")
    return dict(value)


def _integer(body: Mapping, key: str, default: int, minimum: int, maximum: int) -> int:
    value = body.get(key, default)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{key}: must be an integer, got {json.dumps(value)}")
    if not minimum <= value <= maximum:
        raise RequestError(f"{key}: must be between {minimum} and {maximum}, got {value}")
    return value


def _number(body: Mapping, key: str, default: float) -> float:
    value = body.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(f"{key}: must be a finite number, got {json.dumps(value)}")
    return float(value)


def _sampling(body: Mapping, default: SamplingParams) -> SamplingParams:
    temperature = _number(body, "temperature", default.temperature)
    top_p = _number(body, "top_p", default.top_p)
    top_k = _integer(body, "top_k", default.top_k, 0, 2**31 - 1)
    problem = sampling_problem(temperature, top_k, top_p)
    if problem:
        raise RequestError(problem)
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)


def _stop_strings(body: Mapping) -> tuple[str, ...]:
    stop = body.get("stop", [])
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise RequestError("stop: must be a list of strings")
    if len(stop) > MAX_STOP_STRINGS:
        raise RequestError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    if any(not s or len(s) > MAX_STOP_STRING_CHARS for s in stop):
        raise RequestError(f"stop: each stop string must have 1 to {MAX_STOP_STRING_CHARS} characters")
    return tuple(stop)


def _prompt_ids(body: Mapping, tokenizer) -> list[int]:
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
            [{"role": m["role"], "content": m["content"]} for m in messages],
            tokenize=False,
            add_generation_prompt=True,
        )
    except Exception as error:  # templates raise their own errors, e.g. for an unknown role
        raise RequestError(f"messages: the model's chat template rejected them ({error})") from None
    # The template already holds any special tokens the model expects.
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def parse_request(body: Mapping, config: HandlerConfig, tokenizer, max_context: int) -> ParsedRequest:
    """Validates one JSON request against the config and the model's context size."""
    unknown = sorted(set(body) - set(REQUEST_FIELDS))
    if unknown:
        raise RequestError(f"{unknown[0]}: unknown field; known fields are {', '.join(REQUEST_FIELDS)}")
    max_new_tokens = _integer(body, "max_new_tokens", config.max_new_tokens, 1, config.max_new_tokens_limit)
    sampling = _sampling(body, config.sampling)
    num_speculative_tokens = _integer(
        body, "num_speculative_tokens", config.num_speculative_tokens, 0, config.max_num_speculative_tokens
    )
    seed = body.get("seed")
    if seed is not None:
        seed = _integer(body, "seed", 0, *SEED_RANGE)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(f"stream: must be true or false, got {json.dumps(stream)}")
    stop = _stop_strings(body)
    drafter = body.get("drafter", config.drafter)
    if drafter not in config.drafters:
        raise RequestError(
            f"drafter: {json.dumps(drafter)} is not available in this model archive; choose one of "
            f"{', '.join(config.drafters)}"
        )
    prompt_ids = _prompt_ids(body, tokenizer)
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
    )
    return ParsedRequest(generation=generation, stream=stream)


def result_to_json(result: GenerationResult) -> dict:
    return {
        "text": result.text,
        "token_ids": result.token_ids,
        "finish_reason": result.finish_reason,
        "usage": {"prompt_tokens": result.prompt_tokens, "completion_tokens": len(result.token_ids)},
        "speculative": result.stats.as_dict(),
    }


def error_to_json(message: str) -> dict:
    return {"error": message}
