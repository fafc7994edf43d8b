"""The OpenAI-compatible API, requests side: request translation (routes, errors and the model list
are in `handler.api.openai.routes`).

An OpenAI body is translated into one native body per prompt and parsed by
`handler.api.native.parse_request`, so both doors share every validation rule,
default and limit. One OpenAI request becomes one engine row per choice
(`n` choices per prompt, prompt-major: choice i belongs to prompt i // n), each
with its own seed derived from the request's.

A sampling field the request leaves out takes the model's
`generation_config.json`, then OpenAI's default (`sampling_defaults`), as in
vLLM; the config's `sampling:` section is the native route's.

Standard OpenAI fields this server does not implement are accepted at their
neutral value (`echo: false`, `store: false`, ...) and refused with a
400 naming them otherwise; unknown fields are refused as on the native route.
A JSON `null` counts as a field left out, as in the OpenAI API.

Structured output rides on the native constraint fields: `response_format`
becomes the native `json_schema`, and forced tool calls (`tool_choice`
required or named) the native `grammar` (`handler.api.openai.tools`), so one
place compiles and refuses them.

Answers and SSE chunks are built in `handler.api.openai.answers`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
import uuid
from typing import Any, Callable, Mapping

from handler.api.native import parse_request
from handler.api.openai.routes import (
    PATHS,
    ROUTE_CHAT,
    ROUTE_COMPLETIONS,
    ROUTE_MODEL,
    ROUTE_MODELS,
    ROUTE_RESPONSES,
    ROUTE_UNKNOWN,
    Route,
    models_answer,
    unknown_route_error,
)
from handler.api.openai.tool_formats import ToolCallFormat
from handler.api.openai.tools import FUNCTION_NAME, ToolPlan, message_tool_calls, tool_format_for, tool_plan
from handler.config import HandlerConfig
from handler.schema import REQUEST_FIELDS, SEED_RANGE, RequestError, integer_field
from handler.types import GenerationRequest, sampling_problem

logger = logging.getLogger(__name__)

MAX_CHOICES = 8  # engine rows one request may take: prompts x n
MAX_TOP_LOGPROBS = 20

# Fields both routes translate; the native field each one feeds is in brackets.
SHARED_FIELDS = (
    "model",
    "max_tokens",  # [max_new_tokens]
    "temperature",
    "top_p",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "n",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "logprobs",
    "response_format",  # [json_schema]
    "user",  # an end-user id for abuse tracking: accepted, not used
    # Extensions, as in vLLM: not in the OpenAI API.
    "top_k",
    "min_p",
    "repetition_penalty",
    "num_speculative_tokens",
    "drafter",
    "suffix_share_across_requests",
    "speculative_tree",
)
# What a sampling field the request leaves out takes when the model's generation config does not
# set it: OpenAI's defaults (temperature and top_p 1: sampling), and the extensions off, as in vLLM.
OPENAI_SAMPLING_DEFAULTS: Mapping[str, float | int] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
}
# The ones a model's generation_config.json may set, as vLLM reads it (Hugging Face has no
# presence or frequency penalty; `do_sample` is not read, as in vLLM).
GENERATION_CONFIG_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# Shared fields that go to the native request as they are (stop and stream are translated).
PASSED_THROUGH = tuple(key for key in REQUEST_FIELDS if key in SHARED_FIELDS and key not in ("stop", "stream"))
ROUTE_FIELDS = {
    ROUTE_COMPLETIONS: ("prompt",),
    # prompt_cache_key and safety_identifier are routing and abuse hints, like user: accepted, not used.
    ROUTE_CHAT: (
        "messages",
        "max_completion_tokens",
        "top_logprobs",
        "prompt_cache_key",
        "safety_identifier",
        "tools",  # [grammar, with tool_choice required or named]
        "tool_choice",
        "parallel_tool_calls",
    ),
}


def _is_empty(value: Any) -> bool:
    return value in ({}, [])


# Standard fields without an implementation: (accepts the value, the neutral value to tell the client).
Neutral = tuple[Callable[[Any], bool], str]
SHARED_NEUTRAL: dict[str, Neutral] = {}
ROUTE_NEUTRAL: dict[str, dict[str, Neutral]] = {
    ROUTE_COMPLETIONS: {
        "echo": (lambda v: v is False, "false"),
        "suffix": (lambda v: v == "", '""'),
        # best_of is validated against n in `_check_neutral_fields`.
        "best_of": (lambda v: True, "n"),
    },
    ROUTE_CHAT: {
        # The deprecated forms of tools and tool_choice.
        "functions": (_is_empty, "[]"),
        "function_call": (lambda v: v == "none", '"none"'),
        "modalities": (lambda v: v == ["text"], '["text"]'),
        "store": (lambda v: v is False, "false"),
        # Tags for stored completions; with nothing stored they change nothing.
        "metadata": (lambda v: isinstance(v, Mapping), "an object"),
        "service_tier": (lambda v: v in ("auto", "default"), '"auto"'),
        "audio": (lambda v: False, "null"),
        "prediction": (lambda v: False, "null"),
        "reasoning_effort": (lambda v: False, "null"),
        "verbosity": (lambda v: False, "null"),
        "web_search_options": (lambda v: False, "null"),
    },
}
STREAM_OPTIONS = ("include_usage", "include_obfuscation")
# Keys of a chat message besides role and content that may only be null or empty.
MESSAGE_EXTRA_KEYS = ("function_call", "refusal", "audio", "annotations")
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
JSON_SCHEMA_FORMAT_KEYS = ("name", "schema", "strict", "description")


@dataclasses.dataclass(frozen=True)
class OpenAIRequest:
    """One validated OpenAI request: the engine rows it runs as, and how to answer it."""

    kind: str  # ROUTE_COMPLETIONS | ROUTE_CHAT | ROUTE_RESPONSES
    model: str
    generations: tuple[GenerationRequest, ...]  # one row per choice, in choice order
    n: int
    stream: bool = False
    include_usage: bool = False
    # None: no logprobs. Else the number of most likely alternatives per token
    # (completions `logprobs: N`, chat `top_logprobs`).
    num_top_logprobs: int | None = None
    # Chat: parses each choice's tool calls out of its text; None when the request has no tools to call.
    tool_format: ToolCallFormat | None = None
    max_tool_calls: int | None = None  # calls kept per choice (1 with parallel_tool_calls: false); None: all
    id: str = ""
    created: int = 0
    # A Responses request: what its response echoes and where it is stored
    # (`handler.api.openai.responses.ResponsesContext`); None on the other routes.
    responses: Any = None

    @property
    def num_prompts(self) -> int:
        return len(self.generations) // self.n


def sampling_defaults(generation_config: Mapping | None = None) -> dict[str, float | int]:
    """What the sampling fields an OpenAI request leaves out take: the model's generation config
    where it sets them, else OpenAI's defaults (`OPENAI_SAMPLING_DEFAULTS`), as vLLM does.

    Args:
        generation_config: the fields the target's `generation_config.json` sets (Hugging Face's
            `GenerationConfig.to_diff_dict()`); None or {} for a model without one.
    Returns:
        A value for each field of OPENAI_SAMPLING_DEFAULTS. A value the request rules refuse
        (`top_p: 0`, a string) is left out with a warning: the model serves with OpenAI's.
    """
    defaults = dict(OPENAI_SAMPLING_DEFAULTS)
    for key in GENERATION_CONFIG_FIELDS:
        value = (generation_config or {}).get(key)
        if value is None:
            continue
        integral = key == "top_k"
        if isinstance(value, bool) or not isinstance(value, int if integral else (int, float)):
            problem = f"{key}: must be {'an integer' if integral else 'a number'}, got {value!r}"
        else:
            problem = sampling_problem(**{**defaults, key: value})
        if problem:
            logger.warning("generation_config.json: %s; the OpenAI routes default to %s", problem, defaults[key])
            continue
        defaults[key] = value if integral else float(value)
    return defaults


def choice_seed(seed: int | None, choice: int) -> int | None:
    """The seed of choice `choice` of a request with `seed`.

    Choice 0 keeps the request's seed, so that `n: 1` answers as the native
    route does with the same seed. The others hash (seed, choice): `seed + choice`
    would make choice 1 of seed 7 repeat choice 0 of seed 8.
    """
    if seed is None or choice == 0:
        return seed
    digest = hashlib.sha256(f"{seed}/{choice}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % (SEED_RANGE[1] + 1)


def parse_openai_entry(
    route: Route,
    body: Any,
    content_type: str | None,
    config: HandlerConfig,
    tokenizer,
    max_context: int,
    model_name: str,
    created: int,
    defaults: Mapping | None = None,
) -> OpenAIRequest | dict:
    """A request on an OpenAI route: the request for the engine, or the model list, answered without it.

    Args:
        route: the route, from `route_from_url_path`; not the native one.
        body: the request's body as TorchServe passed it (empty on v1/models).
        content_type: its Content-Type header.
        config, tokenizer, max_context: as for `handler.api.native.parse_request`.
        model_name: the name this model is served under.
        created: when it was loaded (Unix seconds), for the model list.
        defaults: what left-out sampling fields take (`sampling_defaults`); None: OpenAI's.
    Returns:
        An OpenAIRequest, or the JSON answer of v1/models.
    Raises:
        RequestError: naming the field, or the route, and what to change.
    """
    assert route.is_openai and route.kind != ROUTE_RESPONSES, route  # handler.api.entry routes Responses
    if route.kind in (ROUTE_MODELS, ROUTE_MODEL):
        return models_answer(route, model_name, created)
    if route.kind == ROUTE_UNKNOWN:
        raise unknown_route_error(route)
    return parse_openai_request(
        route.kind, decode_openai_body(body, content_type), config, tokenizer, max_context, model_name, defaults
    )


def decode_openai_body(value: Any, content_type: str | None) -> dict:
    """The JSON object of an OpenAI request, whatever Content-Type it came with.

    Unlike the native route, plain text is never a prompt here, and an empty
    body (a GET on a generation route) is refused as such.
    """
    if value in (b"", ""):
        raise RequestError("body: empty; POST the request as a JSON object")
    is_json = (content_type or "").split(";")[0].strip().lower() == "application/json"
    # TorchServe passes bytes when it did not parse the body, and text as str for
    # a text/* type; a str with a JSON type is a body that parsed to a JSON string.
    if isinstance(value, (bytes, bytearray)) or (isinstance(value, str) and not is_json):
        try:
            text = value if isinstance(value, str) else bytes(value).decode("utf-8")
            value = json.loads(text)
        except UnicodeDecodeError as error:
            raise RequestError(f"body: not valid UTF-8 ({error.reason} at byte {error.start})") from None
        except json.JSONDecodeError as error:
            raise RequestError(f"body: not valid JSON ({error})") from None
    if not isinstance(value, Mapping):
        raise RequestError(f"body: must be a JSON object, got {type(value).__name__}")
    return dict(value)


def parse_openai_request(
    kind: str,
    body: Mapping,
    config: HandlerConfig,
    tokenizer,
    max_context: int,
    model_name: str,
    defaults: Mapping | None = None,
) -> OpenAIRequest:
    """Validates an OpenAI completions or chat body and translates it into engine rows.

    Args:
        kind: ROUTE_COMPLETIONS or ROUTE_CHAT.
        body: the decoded JSON object.
        config, tokenizer, max_context: as for `handler.api.native.parse_request`.
        model_name: the name this model is served under; `model` must be it.
        defaults: what the sampling fields the body leaves out take (`sampling_defaults`: the
            model's generation config, then OpenAI's); None: OpenAI's. Never the config's `sampling:`.
    Returns:
        The request, with one GenerationRequest per choice.
    Raises:
        RequestError: naming the field and what to change.
    """
    assert kind in ROUTE_FIELDS, kind
    body = {key: value for key, value in body.items() if value is not None}
    neutral = {**SHARED_NEUTRAL, **ROUTE_NEUTRAL[kind]}
    known = SHARED_FIELDS + ROUTE_FIELDS[kind] + tuple(neutral)
    unknown = sorted(set(body) - set(known))
    if unknown:
        raise RequestError(f"{unknown[0]}: unknown field for /v1/{_path_of(kind)}")
    n = integer_field(body, "n", 1, 1, MAX_CHOICES)
    _check_neutral_fields(body, neutral, n)

    model = body.get("model", model_name)
    if model != model_name:
        raise RequestError(
            f"model: the model {json.dumps(model)} does not exist; this endpoint serves {json.dumps(model_name)}",
            status=404,
        )
    stream, include_usage = _stream_fields(body)
    num_top_logprobs = _logprobs_fields(kind, body)

    native: dict[str, Any] = dict(OPENAI_SAMPLING_DEFAULTS if defaults is None else defaults)
    native.update({key: body[key] for key in PASSED_THROUGH if key in body})
    max_tokens_key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    if max_tokens_key in body:
        native["max_new_tokens"] = integer_field(
            body, max_tokens_key, config.max_new_tokens, 1, config.max_new_tokens_limit
        )
    if "stop" in body:
        stop = body["stop"]
        native["stop"] = [stop] if isinstance(stop, str) else stop
    json_schema = _response_format(body)
    if json_schema is not None:
        native["json_schema"] = json_schema

    plan = ToolPlan()
    if kind == ROUTE_CHAT:
        tool_format = tool_format_for(tokenizer, config.tool_call_parser)
        plan = tool_plan(body, tokenizer, tool_format)
        if plan.grammar is not None:
            if json_schema is not None:
                raise RequestError(
                    "response_format: cannot be combined with tool_choice required or a named function; "
                    "the tool call's arguments already follow the function's parameters"
                )
            native["grammar"] = plan.grammar
        messages = _chat_messages(body.get("messages"), tool_format)
        if tool_format is not None and not tool_format.renders_tools:
            # A template without tools: the tools, the calls and their results are written as text.
            messages = tool_format.prompt_messages(messages, plan.tools)
            plan = dataclasses.replace(plan, tools=None)
        prompts = [{"messages": messages}]
    else:
        prompts = [{"prompt": prompt} for prompt in _completion_prompts(body.get("prompt"))]
    if len(prompts) * n > MAX_CHOICES:
        raise RequestError(
            f"n: {len(prompts)} prompts x n {n} = {len(prompts) * n} choices; at most {MAX_CHOICES} per request"
        )
    generations = []
    for index, prompt in enumerate(prompts):
        try:
            generation = parse_request({**native, **prompt}, config, tokenizer, max_context, plan.tools).generation
        except RequestError as error:
            if len(prompts) > 1 and str(error).startswith("prompt:"):
                raise RequestError(f"prompt[{index}]:{str(error)[len('prompt:') :]}", error.status) from None
            raise _with_openai_field(error) from None
        for choice in range(n):
            generations.append(
                dataclasses.replace(generation, seed=choice_seed(generation.seed, choice), logprobs=num_top_logprobs)
            )
    prefix = "chatcmpl-" if kind == ROUTE_CHAT else "cmpl-"
    return OpenAIRequest(
        kind=kind,
        model=model_name,
        generations=tuple(generations),
        n=n,
        stream=stream,
        include_usage=include_usage,
        num_top_logprobs=num_top_logprobs,
        tool_format=plan.tool_format,
        max_tool_calls=plan.max_calls,
        id=prefix + uuid.uuid4().hex,
        created=int(time.time()),
    )


def _path_of(kind: str) -> str:
    return next(path for path, route in PATHS.items() if route == kind).removeprefix("v1/")


def _check_neutral_fields(body: Mapping, neutral: Mapping[str, Neutral], n: int) -> None:
    for key, (accepts, neutral_value) in neutral.items():
        if key in body and not accepts(body[key]):
            raise RequestError(
                f"{key}: not supported by this server; leave it out or send {neutral_value}, "
                f"got {json.dumps(body[key])}"
            )
    if "best_of" in body and body["best_of"] != n:
        raise RequestError(f"best_of: not supported by this server; leave it out or send n ({n})")


def _stream_fields(body: Mapping) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(f"stream: must be true or false, got {json.dumps(stream)}")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise RequestError("stream_options: only allowed with stream: true")
    if not isinstance(options, Mapping):
        raise RequestError('stream_options: must be an object such as {"include_usage": true}')
    for key, value in options.items():
        if key not in STREAM_OPTIONS:
            raise RequestError(f"stream_options.{key}: unknown option; known options are {', '.join(STREAM_OPTIONS)}")
        # include_obfuscation pads chunks against length side channels; no padding changes no content.
        if value is not None and not isinstance(value, bool):
            raise RequestError(f"stream_options.{key}: must be true or false, got {json.dumps(value)}")
    return stream, bool(options.get("include_usage"))


def _logprobs_fields(kind: str, body: Mapping) -> int | None:
    """The number of alternatives per token, or None when no logprobs were asked for."""
    if kind == ROUTE_COMPLETIONS:
        if "logprobs" not in body:
            return None
        return integer_field(body, "logprobs", 0, 0, MAX_TOP_LOGPROBS)
    logprobs = body.get("logprobs", False)
    if not isinstance(logprobs, bool):
        raise RequestError(f"logprobs: must be true or false, got {json.dumps(logprobs)}")
    if "top_logprobs" in body and not logprobs:
        raise RequestError("top_logprobs: needs logprobs: true")
    if not logprobs:
        return None
    return integer_field(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)


def _completion_prompts(prompt: Any) -> list[str]:
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, (int, list)) for p in prompt):
        raise RequestError("prompt: token-id prompts are not supported; send the text")
    raise RequestError("prompt: must be a string or a non-empty list of strings")


def _chat_messages(messages: Any, tool_format: ToolCallFormat | None) -> list[dict]:
    """OpenAI messages as the messages `parse_request` takes: {role, content} strings, and tool keys.

    Content may be a list of text parts, which are joined with newlines;
    `developer` (OpenAI's newer name for `system`) becomes `system`, the role
    open models' chat templates know. An assistant message's `tool_calls`
    (its content may then be null) and a tool message's `tool_call_id` go to
    the chat template, which must render tools; so does a `name`.
    """
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages: must be a non-empty list of {role, content} objects")
    normalised = []
    for index, message in enumerate(messages):
        field = f"messages[{index}]"
        if not isinstance(message, Mapping):
            raise RequestError(f"{field}: must be an object with 'role' and 'content'")
        for key, value in message.items():
            if key in ("role", "content", "name", "tool_calls", "tool_call_id"):
                continue
            if key not in MESSAGE_EXTRA_KEYS:
                raise RequestError(f"{field}.{key}: unknown field")
            if value is not None and not _is_empty(value):
                raise RequestError(f"{field}.{key}: not supported by this server")
        role = message.get("role")
        content = message.get("content")
        if isinstance(content, list):
            content = _text_of_parts(content, f"{field}.content")
        normalised.append({"role": "system" if role == "developer" else role, "content": content})
        if message.get("name") is not None:
            if not isinstance(message["name"], str):
                raise RequestError(f"{field}.name: must be a string")
            normalised[-1]["name"] = message["name"]
        normalised[-1].update(_tool_keys(message, field, tool_format))
    return normalised


def _tool_keys(message: Mapping, field: str, tool_format: ToolCallFormat | None) -> dict:
    """An assistant message's tool calls, or a tool message's tool_call_id, for the chat template."""
    role, calls, call_id = message.get("role"), message.get("tool_calls"), message.get("tool_call_id")
    keys: dict[str, Any] = {}
    if calls is not None and not _is_empty(calls):
        if role != "assistant":
            raise RequestError(f"{field}.tool_calls: only assistant messages carry tool calls")
        keys["tool_calls"] = message_tool_calls(calls, f"{field}.tool_calls")
        if message.get("content") is None:
            keys["content"] = ""
    if role == "tool":
        if not isinstance(call_id, str):
            raise RequestError(f"{field}.tool_call_id: must be a string, the id of the call this message answers")
        keys["tool_call_id"] = call_id
    elif call_id is not None:
        raise RequestError(f"{field}.tool_call_id: only tool messages answer a call")
    if keys and tool_format is None:
        what = "tool_calls" if "tool_calls" in keys else "role"
        raise RequestError(f"{field}.{what}: this model's chat template does not render tool calls or tool results")
    return keys


def _response_format(body: Mapping) -> dict | None:
    """The JSON Schema `response_format` asks the output to match, or None for free text.

    `json_object` is any JSON object; `json_schema` is its `schema`, always
    enforced (`strict` is accepted, and changes nothing).
    """
    value = body.get("response_format")
    if value is None:
        return None
    if not isinstance(value, Mapping) or value.get("type") not in RESPONSE_FORMATS:
        raise RequestError(
            'response_format: must be {"type": "text"}, {"type": "json_object"} or '
            f'{{"type": "json_schema", "json_schema": {{"name": ..., "schema": ...}}}}, got {json.dumps(value)[:80]}'
        )
    kind = value["type"]
    for key in value:
        if key != "type" and not (kind == "json_schema" and key == "json_schema"):
            raise RequestError(f"response_format.{key}: unknown field for type {json.dumps(kind)}")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    spec = value.get("json_schema")
    field = "response_format.json_schema"
    if not isinstance(spec, Mapping):
        raise RequestError(f"{field}: must be an object with a name and a schema")
    for key in spec:
        if key not in JSON_SCHEMA_FORMAT_KEYS:
            raise RequestError(f"{field}.{key}: unknown field; known fields are {', '.join(JSON_SCHEMA_FORMAT_KEYS)}")
    name = spec.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
        raise RequestError(
            f"{field}.name: must be 1 to 64 letters, digits, underscores or dashes, got {json.dumps(name)}"
        )
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise RequestError(f"{field}.strict: must be true or false, got {json.dumps(spec['strict'])}")
    if spec.get("description") is not None and not isinstance(spec["description"], str):
        raise RequestError(f"{field}.description: must be a string")
    schema = spec.get("schema")
    if not isinstance(schema, Mapping):
        raise RequestError(f"{field}.schema: must be a JSON Schema object, got {json.dumps(schema)[:80]}")
    return dict(schema)


# What the native constraint fields are called in an OpenAI request, for its error messages.
OPENAI_CONSTRAINT_FIELDS = {"json_schema": "response_format.json_schema.schema", "grammar": "tools"}


def _with_openai_field(error: RequestError) -> RequestError:
    """A native error about a constraint field, renamed to the OpenAI field it came from."""
    message = str(error)
    for native, openai in OPENAI_CONSTRAINT_FIELDS.items():
        if message.startswith(f"{native}:"):
            return RequestError(f"{openai}:{message[len(native) + 1 :]}", error.status)
    return error


def _text_of_parts(parts: list, field: str) -> str:
    texts = []
    for index, part in enumerate(parts):
        if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise RequestError(f'{field}[{index}]: only {{"type": "text", "text": ...}} parts are supported')
        texts.append(part["text"])
    return "\n".join(texts)
