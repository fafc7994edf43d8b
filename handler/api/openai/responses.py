"""The OpenAI Responses API, `POST v1/responses`: requests, answers, streamed events, the store.

A Responses body is translated into the chat body it means, and that body is
parsed by `handler.api.openai.requests.parse_openai_request`: one request model
inside, so the chat template, the tool grammars, `response_format`, the
speculative fields and every limit are the chat route's. What differs is only
the shape:

- `input`: a string, or items: messages (roles user, system, developer and
  assistant; text parts), `function_call` (the model's earlier calls) and
  `function_call_output` (their results). `instructions` is a system message
  first, for this response only, as in OpenAI's API.
- `tools`: function tools in the flat form (`{"type": "function", "name", ...}`);
  `tool_choice` the flat `{"type": "function", "name"}`; `text.format`:
  `json_schema` or `json_object`; `max_output_tokens`.
- The answer is a `response` object whose `output` holds a `message` item with
  its `output_text`, and one `function_call` item per call; a stream is the
  documented event sequence, each event with its `sequence_number`.

The store (`ResponseStore`) keeps each response's conversation, so that a
request with `previous_response_id` continues it: the earlier input and output
come first, as a re-sent chat history would, and hit the prefix cache the same
way. It keeps the response object too, for `GET v1/responses/{id}`;
`DELETE v1/responses/{id}` forgets both (`stored_response_answer`). `store`
defaults to true, as in OpenAI's API; the store is in memory, bounded in count
and bytes, and forgets the least recently used first.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import re
import secrets
from typing import Any, Mapping, Sequence

from handler.api.openai.requests import OpenAIRequest, parse_openai_request
from handler.api.openai.routes import ROUTE_CHAT, ROUTE_RESPONSE, ROUTE_RESPONSES, Route
from handler.schema import RequestError

# Fields passed to the chat body as they are (the extensions are the chat route's, as in vLLM).
PASSED_FIELDS = (
    "model",
    "temperature",
    "top_p",
    "seed",
    "stream",
    "parallel_tool_calls",
    "user",
    "prompt_cache_key",
    "safety_identifier",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "stop",
    "num_speculative_tokens",
    "drafter",
    "suffix_share_across_requests",
    "speculative_tree",
)
TRANSLATED_FIELDS = (
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "text",
    "max_output_tokens",
    "store",
    "previous_response_id",
    "metadata",
    "stream_options",
)
# Standard fields refused unless left out (or null): why, for the 400.
REFUSED_FIELDS = {
    "reasoning": "reasoning options are for reasoning models; this server's models do not reason apart",
    "conversation": "conversations are not stored here; chain responses with previous_response_id",
    "prompt": "stored prompt templates are not kept here; send input and instructions",
    "context_management": "context management is not supported",
    "prompt_cache_retention": "the prefix cache's retention is the server's (prefix_cache_max_bytes)",
    "prompt_cache_options": "the prefix cache's options are the server's",
}
# Standard fields accepted at one neutral value: (accepts, the value to tell the client).
NEUTRAL_FIELDS = {
    "background": (lambda v: v is False, "false; background responses are not supported"),
    "include": (lambda v: v == [], "[]; no extra output is included"),
    "truncation": (lambda v: v == "disabled", '"disabled"; a prompt too long for the context is a 400'),
    "top_logprobs": (lambda v: v == 0, "0; use /v1/chat/completions for logprobs"),
    "max_tool_calls": (lambda v: False, "null; parallel_tool_calls: false allows one call"),
    "service_tier": (lambda v: v in ("auto", "default"), '"auto"'),
}
BUILT_IN_TOOLS = (
    "web_search",
    "web_search_preview",
    "file_search",
    "computer_use",
    "computer_use_preview",
    "computer",
    "code_interpreter",
    "mcp",
    "image_generation",
    "local_shell",
    "shell",
    "apply_patch",
    "custom",
)
FUNCTION_TOOL_KEYS = ("type", "name", "description", "parameters", "strict")
TEXT_FORMATS = ("text", "json_object", "json_schema")
INPUT_ROLES = ("user", "system", "developer", "assistant")
TEXT_PART_TYPES = {"user": "input_text", "system": "input_text", "developer": "input_text", "assistant": "output_text"}
# Keys a text part may carry beside its type and text (the SDKs send them back from earlier outputs).
TEXT_PART_EXTRA_KEYS = ("annotations", "logprobs")
MESSAGE_ITEM_KEYS = ("type", "role", "content", "id", "status")
FUNCTION_CALL_KEYS = ("type", "call_id", "name", "arguments", "id", "status")
FUNCTION_OUTPUT_KEYS = ("type", "call_id", "output", "id", "status")

# The store's defaults: responses kept, and their bytes (the JSON of each one's conversation).
STORE_MAX_ENTRIES = 1024
STORE_MAX_BYTES = 64 * 2**20


def new_id(prefix: str) -> str:
    """A random, unguessable id: 192 bits."""
    return f"{prefix}_{secrets.token_hex(24)}"


# ---------------------------------------------------------------------------
# The store


@dataclasses.dataclass
class StoredResponse:
    messages: list[dict]  # the chat messages of its conversation, its own output last (no instructions)
    response: dict  # the response object as it was answered (`GET v1/responses/{id}`)
    num_bytes: int


class ResponseStore:
    """Stored responses, in memory: bounded in count and bytes, least recently used out first."""

    def __init__(self, max_entries: int = STORE_MAX_ENTRIES, max_bytes: int = STORE_MAX_BYTES) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.entries: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()
        self.num_bytes = 0
        self.num_evictions = 0

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self.entries.get(response_id)
        if entry is not None:
            self.entries.move_to_end(response_id)
        return entry

    def put(self, response_id: str, messages: list[dict], response: dict) -> bool:
        """Keeps a response's conversation and its object; False where they alone are over the bounds
        (nothing kept)."""
        encoded = json.dumps(response)
        num_bytes = len(json.dumps(messages)) + len(encoded)
        if self.max_entries < 1 or num_bytes > self.max_bytes:
            return False
        self.delete(response_id)
        # A copy: what GET answers later is what was answered now.
        self.entries[response_id] = StoredResponse(messages, json.loads(encoded), num_bytes)
        self.num_bytes += num_bytes
        while len(self.entries) > self.max_entries or self.num_bytes > self.max_bytes:
            _, evicted = self.entries.popitem(last=False)
            self.num_bytes -= evicted.num_bytes
            self.num_evictions += 1
        return True

    def delete(self, response_id: str) -> bool:
        """Forgets a response; False where it was not stored."""
        entry = self.entries.pop(response_id, None)
        if entry is None:
            return False
        self.num_bytes -= entry.num_bytes
        return True


def stored_response_answer(route: Route, body: Any, response_store: ResponseStore | None) -> dict:
    """`GET v1/responses/{id}`: the stored response object; `DELETE` (`route.delete`): OpenAI's
    deletion object, the response forgotten.

    Raises:
        RequestError: 404 for an id not in the store, in OpenAI's words; 400 for a body.
    """
    assert route.kind == ROUTE_RESPONSE and route.response_id is not None, route
    if body not in (None, b"", "", {}):
        raise RequestError(
            "body: /v1/responses/{id} takes none; GET retrieves the response, DELETE deletes it, and "
            "POST /v1/responses creates one"
        )
    response_id = route.response_id
    if route.delete:
        if response_store is None or not response_store.delete(response_id):
            raise _not_stored(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}
    stored = response_store.get(response_id) if response_store is not None else None
    if stored is None:
        raise _not_stored(response_id)
    return stored.response


def _not_stored(response_id: str) -> RequestError:
    return RequestError(
        f"response_id: Response with id {json.dumps(response_id)} not found (unknown, deleted, evicted from the "
        "store, made with store: false, or stored by another replica)",
        status=404,
    )


# ---------------------------------------------------------------------------
# Requests


@dataclasses.dataclass(frozen=True)
class ResponsesContext:
    """What a Responses request echoes in its response, and where its conversation is stored."""

    messages: tuple[dict, ...]  # its conversation before its output, in chat form (no instructions)
    instructions: str | None
    tools: tuple[dict, ...]
    tool_choice: Any
    parallel_tool_calls: bool
    text_format: dict
    max_output_tokens: int | None
    temperature: float
    top_p: float
    previous_response_id: str | None
    metadata: dict
    store: bool
    response_store: ResponseStore | None = dataclasses.field(default=None, compare=False, repr=False)


def parse_responses_request(
    body: Mapping,
    config,
    tokenizer,
    max_context: int,
    model_name: str,
    response_store: ResponseStore | None,
    defaults: Mapping | None = None,
) -> OpenAIRequest:
    """Validates a Responses body and translates it into the chat request it means.

    `defaults`: what left-out sampling fields take (`handler.api.openai.requests.sampling_defaults`);
    None: OpenAI's.

    Raises:
        RequestError: 400 naming the Responses field; 404 for an unknown `previous_response_id`.
    """
    body = {key: value for key, value in body.items() if value is not None}
    known = PASSED_FIELDS + TRANSLATED_FIELDS + tuple(REFUSED_FIELDS) + tuple(NEUTRAL_FIELDS)
    unknown = sorted(set(body) - set(known))
    if unknown:
        raise RequestError(f"{unknown[0]}: unknown field for /v1/responses")
    for key, why in REFUSED_FIELDS.items():
        if key in body:
            raise RequestError(f"{key}: not supported by this server ({why}); leave it out")
    for key, (accepts, neutral) in NEUTRAL_FIELDS.items():
        if key in body and not accepts(body[key]):
            raise RequestError(f"{key}: not supported by this server; leave it out or send {neutral}")
    store = body.get("store", True)
    if not isinstance(store, bool):
        raise RequestError(f"store: must be true or false, got {json.dumps(store)}")
    metadata = body.get("metadata", {})
    if not isinstance(metadata, Mapping) or not all(isinstance(value, str) for value in metadata.values()):
        raise RequestError("metadata: must be an object of strings")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise RequestError("instructions: must be a string")

    history: list[dict] = []
    previous_id = body.get("previous_response_id")
    if previous_id is not None:
        if not isinstance(previous_id, str):
            raise RequestError("previous_response_id: must be a string, the id of a stored response")
        stored = response_store.get(previous_id) if response_store is not None else None
        if stored is None:
            raise RequestError(
                f"previous_response_id: no stored response {json.dumps(previous_id)} on this server (unknown, "
                "evicted from the store, made with store: false, or stored by another replica)",
                status=404,
            )
        history = [dict(message) for message in stored.messages]
    if "input" not in body:
        raise RequestError("input: required; a string or a list of input items")
    messages = history + input_messages(body["input"])
    tools = body.get("tools", [])
    if not isinstance(tools, list):
        raise RequestError('tools: must be a list of {"type": "function", "name": ...} objects')
    text_format = _text_format(body.get("text"))

    chat: dict[str, Any] = {key: body[key] for key in PASSED_FIELDS if key in body}
    chat["messages"] = ([{"role": "system", "content": instructions}] if instructions is not None else []) + messages
    if tools:
        chat["tools"] = [_chat_tool(tool, f"tools[{index}]") for index, tool in enumerate(tools)]
    if "tool_choice" in body:
        chat["tool_choice"] = _chat_tool_choice(body["tool_choice"])
    if "max_output_tokens" in body:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    if "stream_options" in body:
        options = body["stream_options"]
        if not isinstance(options, Mapping) or set(options) - {"include_obfuscation"}:
            raise RequestError('stream_options: only {"include_obfuscation": ...} is known here')
    if text_format["type"] == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif text_format["type"] == "json_schema":
        spec = {key: value for key, value in text_format.items() if key != "type"}
        chat["response_format"] = {"type": "json_schema", "json_schema": spec}
    try:
        request = parse_openai_request(ROUTE_CHAT, chat, config, tokenizer, max_context, model_name, defaults)
    except RequestError as error:
        raise _in_responses_terms(error) from None
    context = ResponsesContext(
        messages=tuple(messages),
        instructions=instructions,
        tools=tuple(_flat_tool(tool) for tool in tools),
        tool_choice=body.get("tool_choice", "auto"),
        parallel_tool_calls=body.get("parallel_tool_calls", True),
        text_format=text_format,
        max_output_tokens=body.get("max_output_tokens"),
        # What it samples with, the defaults included, as OpenAI's response echoes them.
        temperature=request.generations[0].sampling.temperature,
        top_p=request.generations[0].sampling.top_p,
        previous_response_id=previous_id,
        metadata=dict(metadata),
        store=store,
        response_store=response_store,
    )
    return dataclasses.replace(request, kind=ROUTE_RESPONSES, id=new_id("resp"), responses=context)


def input_messages(value: Any) -> list[dict]:
    """`input` as chat messages: each message item, and each run of function calls as one assistant
    message with `tool_calls` (the assistant message just before it takes them), and each
    function call output as a tool message."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise RequestError("input: must be a string or a non-empty list of input items")
    messages: list[dict] = []
    for index, item in enumerate(value):
        field = f"input[{index}]"
        if not isinstance(item, Mapping):
            raise RequestError(f"{field}: must be an object (a message, function_call or function_call_output)")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, field))
        elif kind == "function_call":
            _check_keys(item, FUNCTION_CALL_KEYS, field)
            call = _function_call(item, field)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            _check_keys(item, FUNCTION_OUTPUT_KEYS, field)
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise RequestError(f"{field}.call_id: must be a string, the call_id of the call it answers")
            if isinstance(output, list):
                output = _text_of(output, f"{field}.output", "input_text")
            if not isinstance(output, str):
                raise RequestError(f"{field}.output: must be a string")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        else:
            raise RequestError(
                f"{field}.type: {json.dumps(kind)} items are not supported; send message, function_call "
                "or function_call_output items"
            )
    return messages


def _message(item: Mapping, field: str) -> dict:
    _check_keys(item, MESSAGE_ITEM_KEYS, field)
    role = item.get("role")
    if role not in INPUT_ROLES:
        raise RequestError(f"{field}.role: must be one of {', '.join(INPUT_ROLES)}, got {json.dumps(role)}")
    content = item.get("content")
    if isinstance(content, list):
        content = _text_of(content, f"{field}.content", TEXT_PART_TYPES[role])
    if not isinstance(content, str):
        raise RequestError(f"{field}.content: must be a string or a list of text parts")
    return {"role": "system" if role == "developer" else role, "content": content}


def _text_of(parts: list, field: str, part_type: str) -> str:
    texts = []
    for index, part in enumerate(parts):
        where = f"{field}[{index}]"
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind in ("input_image", "input_file", "input_audio", "image_url", "file"):
            raise RequestError(f"{where}.type: {json.dumps(kind)} input is not supported; this server takes text only")
        if kind not in (part_type, "input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise RequestError(f'{where}: must be a text part {{"type": "{part_type}", "text": ...}}')
        extra = set(part) - {"type", "text", *TEXT_PART_EXTRA_KEYS}
        if extra:
            raise RequestError(f"{where}.{sorted(extra)[0]}: unknown field of a text part")
        texts.append(part["text"])
    return "\n".join(texts)


def _function_call(item: Mapping, field: str) -> dict:
    call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments", "{}")
    if not isinstance(call_id, str):
        raise RequestError(f"{field}.call_id: must be a string")
    if not isinstance(name, str):
        raise RequestError(f"{field}.name: must be a string, the function's name")
    if not isinstance(arguments, str):
        raise RequestError(f"{field}.arguments: must be a JSON object, as a string")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _check_keys(item: Mapping, known: Sequence[str], field: str) -> None:
    for key in item:
        if key not in known:
            raise RequestError(f"{field}.{key}: unknown field; known fields are {', '.join(known)}")


def _chat_tool(tool: Any, field: str) -> dict:
    if not isinstance(tool, Mapping):
        raise RequestError(f'{field}: must be an object {{"type": "function", "name": ...}}')
    kind = tool.get("type")
    if kind in BUILT_IN_TOOLS or (isinstance(kind, str) and kind.startswith(BUILT_IN_TOOLS)):
        raise RequestError(
            f"{field}.type: {json.dumps(kind)} is a built-in tool of OpenAI's, not supported by this server; "
            "only function tools are"
        )
    if kind != "function":
        raise RequestError(f'{field}.type: must be "function", got {json.dumps(kind)}')
    _check_keys(tool, FUNCTION_TOOL_KEYS, field)
    return {"type": "function", "function": {key: value for key, value in tool.items() if key != "type"}}


def _flat_tool(tool: Mapping) -> dict:
    """A function tool as the response echoes it."""
    return {
        "type": "function",
        "name": tool["name"],
        "description": tool.get("description"),
        "parameters": tool.get("parameters"),
        "strict": tool.get("strict", True),
    }


def _chat_tool_choice(value: Any) -> Any:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and value.get("type") == "function" and isinstance(value.get("name"), str):
        return {"type": "function", "function": {"name": value["name"]}}
    kind = value.get("type") if isinstance(value, Mapping) else None
    if kind in BUILT_IN_TOOLS or kind in ("allowed_tools", "mcp"):
        raise RequestError(f"tool_choice: {json.dumps(kind)} is not supported by this server")
    raise RequestError(
        'tool_choice: must be "auto", "none", "required" or {"type": "function", "name": ...}, '
        f"got {json.dumps(value)[:80]}"
    )


def _text_format(text: Any) -> dict:
    if text is None:
        return {"type": "text"}
    if not isinstance(text, Mapping):
        raise RequestError('text: must be an object such as {"format": {"type": "json_schema", ...}}')
    for key, value in text.items():
        if key == "verbosity" and value not in (None, "medium"):
            raise RequestError('text.verbosity: not supported by this server; leave it out or send "medium"')
        if key not in ("format", "verbosity"):
            raise RequestError(f"text.{key}: unknown field; known fields are format, verbosity")
    spec = text.get("format") or {"type": "text"}
    if not isinstance(spec, Mapping) or spec.get("type") not in TEXT_FORMATS:
        raise RequestError(f"text.format.type: must be one of {', '.join(TEXT_FORMATS)}")
    if spec["type"] != "json_schema":
        if set(spec) != {"type"}:
            raise RequestError(f"text.format.{sorted(set(spec) - {'type'})[0]}: unknown field for {spec['type']}")
    return dict(spec)


# Chat field names in the chat parser's errors -> the Responses fields they came from.
_RENAMES = (
    (re.compile(r"^response_format\.json_schema\.schema"), "text.format.schema"),
    (re.compile(r"^response_format\.json_schema"), "text.format"),
    (re.compile(r"^response_format"), "text.format"),
    (re.compile(r"^max_completion_tokens"), "max_output_tokens"),
    (re.compile(r"^tools\[(\d+)\]\.function"), r"tools[\1]"),
    (re.compile(r"^messages(\[\d+\])?"), "input"),
)


def _in_responses_terms(error: RequestError) -> RequestError:
    message = str(error)
    for pattern, name in _RENAMES:
        renamed = pattern.sub(name, message, count=1)
        if renamed != message:
            return RequestError(renamed, error.status)
    return error
