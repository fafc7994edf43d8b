"""Each model family's tool-call format: how to recognise its chat template, parse its calls and force them.

Vocabulary: a *function* is what the client declares in `tools` (a name, a
description, a JSON Schema of its parameters); a *tool call* is the model
asking for one in its family's markup, parsed out of the generated text into
OpenAI's `tool_calls`; a *format* (`ToolCallFormat`) is one family's markup:
how to recognise its chat template, how to parse its calls (whole, or
incrementally for a stream) and the Lark grammar (llguidance's dialect) that
forces them. The chat template itself renders the tools, the assistant's
earlier calls and the tool results (`apply_chat_template(..., tools=...)`).
A new family is one new `ToolCallFormat` subclass, listed in `FORMATS`.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from handler.constraints import JSON_ITEM_SEPARATOR, JSON_KEY_SEPARATOR

# llguidance's JSON options inside a tool grammar: the separators of handler.constraints, no free whitespace.
JSON_OPTIONS = {
    "whitespace_flexible": False,
    "item_separator": JSON_ITEM_SEPARATOR,
    "key_separator": JSON_KEY_SEPARATOR,
}


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclasses.dataclass(frozen=True)
class Function:
    """A function the client declared; `parameters` is the JSON Schema of its arguments object."""

    name: str
    parameters: dict


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """A call parsed out of the output; `arguments` is JSON text, as OpenAI sends it."""

    name: str
    arguments: str
    id: str = dataclasses.field(default_factory=new_call_id, compare=False)

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


# ---------------------------------------------------------------------------
# Formats


class ToolCallStream:
    """Parses one choice's text as it streams in: content deltas out, completed calls out.

    `feed` takes the next text delta and returns the content that can no
    longer change and the calls completed by it; `finish` returns the rest.
    The contents joined and the calls equal `ToolCallFormat.parse` of the
    whole text, wherever it was split.
    """

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        raise NotImplementedError

    def finish(self) -> tuple[str, list[ToolCall]]:
        raise NotImplementedError


class ToolCallFormat:
    """One model family's tool-call markup."""

    name = ""
    # Whether the chat template renders the tools and the calls (else `JsonFormat.prompt_messages`).
    renders_tools = True
    # Markers that may be single (added) tokens of the tokenizer: the grammar names those as tokens.
    markers: tuple[str, ...] = ()

    def matches(self, chat_template: str) -> bool:
        """Whether a chat template renders tools in this format."""
        raise NotImplementedError

    def stream(self, max_calls: int | None = None) -> ToolCallStream:
        """An incremental parser; calls past `max_calls` are dropped (parallel_tool_calls: false)."""
        raise NotImplementedError

    def grammar(self, functions: tuple[Function, ...], parallel: bool, token_markers: Mapping[str, str]) -> str:
        """A Lark grammar for one call to one of `functions`, or one or more when `parallel`.

        `token_markers`: the markers that are single tokens of the tokenizer, and the Lark reference to each.
        """
        raise NotImplementedError

    def parse(self, text: str, max_calls: int | None = None) -> tuple[str | None, list[ToolCall]]:
        """The content outside the calls (None when empty) and the calls of a whole output."""
        stream = self.stream(max_calls)
        content, calls = stream.feed(text)
        rest, more = stream.finish()
        return (content + rest) or None, calls + more


def _held_marker_prefix(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker`."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:length]):
            return length
    return 0


class BlockStream(ToolCallStream):
    """Calls written as blocks between a start and an end marker, each block's body parsed on its own.

    A block whose body does not parse stays content, verbatim. A block left
    open at the end is a call if its body parses. Whitespace touching a call
    is dropped, so the text between calls does not become content; the
    trailing whitespace and any tail that may start a marker are held back
    until the next text decides them.
    """

    def __init__(
        self, start: str, end: str, parse_body: Callable[[str], ToolCall | None], max_calls: int | None
    ) -> None:
        self.start, self.end, self.parse_body, self.max_calls = start, end, parse_body, max_calls
        self.outside = ""  # text outside a block, not sent yet; it holds no start marker after `feed`
        self.before = ""  # the unsent text before the open block
        self.inside: str | None = None  # the open block's body so far; None outside a block
        self.after_call = False  # whitespace from here on touches a call
        self.num_calls = 0

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        content, calls = [], []
        if self.inside is None:
            self.outside += delta
        else:
            self.inside += delta
        while True:
            if self.inside is None:
                if self.after_call:
                    self.outside = self.outside.lstrip()
                    self.after_call = not self.outside
                index = self.outside.find(self.start)
                if index < 0:
                    sendable = self.outside[: len(self.outside) - _held_marker_prefix(self.outside, self.start)]
                    sendable = sendable.rstrip()  # trailing whitespace may precede a call
                    content.append(sendable)
                    self.outside = self.outside[len(sendable) :]
                    return "".join(content), calls
                self.before, self.inside = self.outside[:index], self.outside[index + len(self.start) :]
                self.outside = ""
            end = self.inside.find(self.end)
            if end < 0:
                return "".join(content), calls
            body, rest = self.inside[:end], self.inside[end + len(self.end) :]
            content.append(self._close(body, calls, self.start + body + self.end))
            self.outside = rest

    def finish(self) -> tuple[str, list[ToolCall]]:
        calls: list[ToolCall] = []
        if self.inside is not None:
            content = self._close(self.inside, calls, self.start + self.inside)
        else:
            content = self.outside
        self.outside = ""
        return content, calls

    def _close(self, body: str, calls: list[ToolCall], verbatim: str) -> str:
        """Closes the open block: the content it leaves (text before it, or all of it when not a call)."""
        call = self.parse_body(body)
        before, self.inside = self.before, None
        if call is None:
            self.after_call = False
            return before + verbatim
        if self.max_calls is None or self.num_calls < self.max_calls:
            calls.append(call)
        self.num_calls += 1
        self.after_call = True
        return before.rstrip()


def _call_rules(functions: tuple[Function, ...], arguments_key: str, before: str = "", after: str = "") -> list[str]:
    """The Lark rules of one call to any of `functions`: `call`, and per function `call_i` (its name,
    then its arguments under `arguments_key`, their schema the root of their own %json, so that its
    local $refs keep working) and `args_i`. `before`/`after`: Lark around each call's JSON
    (`after` goes inside the object's closing brace)."""
    lines = ["call: " + " | ".join(f"call_{i}" for i in range(len(functions)))]
    for i, function in enumerate(functions):
        head = f'{{"name": {json.dumps(function.name)}, {json.dumps(arguments_key)}: '
        lines.append(f'call_{i}: {before}{json.dumps(head)} args_{i} {after}"}}"')
        lines.append(f"args_{i}: %json {json.dumps({**function.parameters, 'x-guidance': JSON_OPTIONS})}")
    return lines


def _lark_literal(text: str, token_markers: Mapping[str, str]) -> str:
    """A Lark terminal for `text`: a token reference when it is one added token, else a string.

    llguidance reads an added token (Qwen's `<tool_call>`) as a special token,
    never as its text, so a quoted string would forbid the token the model writes.
    """
    return token_markers.get(text) or json.dumps(text)


@dataclasses.dataclass(frozen=True)
class HermesFormat(ToolCallFormat):
    """Hermes / Qwen2.5: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call."""

    name = "hermes"
    START = "<tool_call>"
    END = "</tool_call>"
    markers = (START, END)

    def matches(self, chat_template: str) -> bool:
        return self.START in chat_template

    def stream(self, max_calls: int | None = None) -> ToolCallStream:
        return BlockStream(self.START, self.END, _hermes_call, max_calls)

    def grammar(self, functions: tuple[Function, ...], parallel: bool, token_markers: Mapping[str, str]) -> str:
        # The JSON around the arguments is written as the Qwen template writes a call, so the
        # arguments' schema is the root of its own %json (its local $refs keep working).
        start, end = _lark_literal(self.START, token_markers), _lark_literal(self.END, token_markers)
        lines = ['start: block ("\\n" block)*' if parallel else "start: block"]
        lines.append(f'block: {start} "\\n" call "\\n" {end}')
        return "\n".join(lines + _call_rules(functions, "arguments")) + "\n"


def _hermes_call(body: str) -> ToolCall | None:
    """A Hermes block's body as a call, or None when it is not `{"name": str, "arguments": object}`."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    return _call_of(value, ("arguments",), required=True)


def _json_values(text: str) -> list[Any] | None:
    """The JSON values written one after another in `text`, separated by whitespace or `;`; None when
    anything else is there (an output that is not calls stays content)."""
    decoder, values, index = json.JSONDecoder(), [], 0
    while True:
        while index < len(text) and (text[index].isspace() or (values and text[index] == ";")):
            index += 1
        if index == len(text):
            return values or None
        try:
            value, index = decoder.raw_decode(text, index)
        except json.JSONDecodeError:
            return None
        values.append(value)


def _call_of(
    value: Any, arguments_keys: tuple[str, ...], call_id: str | None = None, required: bool = False
) -> ToolCall | None:
    """A JSON object `{"name": str, <one of arguments_keys>: object}` as a call, else None (`required`:
    the arguments must be there; else left out means none). Arguments written as a JSON string
    (some models do) are parsed."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    key = next((key for key in arguments_keys if key in value), None)
    if key is None and required:
        return None
    arguments = {} if key is None else value[key]
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    call = ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))
    return call if call_id is None else dataclasses.replace(call, id=call_id)


class TailStream(ToolCallStream):
    """Calls written at the end of the output, after a marker (Mistral's `[TOOL_CALLS]`), or as the whole
    output from its first character (Llama 3's JSON, `marker` empty; `<|python_tag|>` may lead).

    The content before the marker streams as it comes (a tail that may start the marker is held
    back); everything after it is kept and parsed at the end, where `parse_tail` either gives the
    calls or None, and the text then stays content, verbatim.
    """

    def __init__(
        self,
        marker: str,
        parse_tail: Callable[[str], list[ToolCall] | None],
        max_calls: int | None,
        leads: tuple[str, ...] = (),
    ) -> None:
        self.marker, self.parse_tail, self.max_calls, self.leads = marker, parse_tail, max_calls, leads
        self.held = ""  # text not sent yet
        self.in_calls = False  # the marker was seen (or, without one, the output opened as a call)
        self.decided = bool(marker)  # without a marker: whether the output is text or calls is known

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self.held += delta
        if self.in_calls:
            return "", []
        if not self.marker:
            if self.decided:
                sendable, self.held = self.held, ""
                return sendable, []
            start = self.held.lstrip()
            if not start:
                return "", []
            body = start
            for lead in self.leads:
                if lead.startswith(body):
                    return "", []  # may still be the lead
                body = body.removeprefix(lead).lstrip()
            if not body:
                return "", []
            self.decided = True
            if body.startswith("{") or body.startswith("["):
                self.in_calls = True
                return "", []
            sendable, self.held = self.held, ""
            return sendable, []
        index = self.held.find(self.marker)
        if index >= 0:
            sendable = self.held[:index].rstrip()
            self.held = self.held[index:]
            self.in_calls = True
            return sendable, []
        keep = _held_marker_prefix(self.held, self.marker)
        sendable = self.held[: len(self.held) - keep]
        self.held = self.held[len(sendable) :]
        return sendable, []

    def finish(self) -> tuple[str, list[ToolCall]]:
        held, self.held = self.held, ""
        if not self.in_calls:
            return held, []
        tail = held[len(self.marker) :] if self.marker else held.lstrip()
        for lead in self.leads:
            tail = tail.removeprefix(lead)
        calls = self.parse_tail(tail)
        if calls is None:
            return held, []
        return "", calls if self.max_calls is None else calls[: self.max_calls]


def _llama3_calls(text: str) -> list[ToolCall] | None:
    values = _json_values(text)
    if values is None:
        return None
    calls = [_call_of(value, ("parameters", "arguments")) for value in values]
    return None if any(call is None for call in calls) else calls


@dataclasses.dataclass(frozen=True)
class Llama3JsonFormat(ToolCallFormat):
    """Llama 3.1 / 3.2 / 3.3 (vLLM's `llama3_json`): the whole output is `{"name": ..., "parameters": {...}}`,
    several calls separated by `; `, maybe after `<|python_tag|>`."""

    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"
    markers = (PYTHON_TAG,)
    # What Llama 3.1's template says when it renders tools, and the tag its built-in tools use.
    TEMPLATE_SIGNS = ('"parameters": dictionary of argument name', PYTHON_TAG)

    def matches(self, chat_template: str) -> bool:
        return "tools" in chat_template and any(sign in chat_template for sign in self.TEMPLATE_SIGNS)

    def stream(self, max_calls: int | None = None) -> ToolCallStream:
        return TailStream("", _llama3_calls, max_calls, leads=(self.PYTHON_TAG,))

    def grammar(self, functions: tuple[Function, ...], parallel: bool, token_markers: Mapping[str, str]) -> str:
        start = 'start: call ("; " call)*' if parallel else "start: call"
        return "\n".join([start, *_call_rules(functions, "parameters")]) + "\n"


def mistral_call_id() -> str:
    """Mistral's templates take call ids of exactly 9 letters and digits."""
    return uuid.uuid4().hex[:9]


def _mistral_calls(text: str) -> list[ToolCall] | None:
    values = _json_values(text)
    if values is None or len(values) != 1 or not isinstance(values[0], list) or not values[0]:
        return None
    calls = []
    for value in values[0]:
        call_id = value.get("id") if isinstance(value, dict) else None
        valid_id = isinstance(call_id, str) and len(call_id) == 9 and call_id.isalnum()
        call = _call_of(value, ("arguments",), call_id if valid_id else mistral_call_id())
        if call is None:
            return None
        calls.append(call)
    return calls


@dataclasses.dataclass(frozen=True)
class MistralFormat(ToolCallFormat):
    """Mistral (vLLM's `mistral`): `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` ends the output;
    call ids are 9 letters and digits, as its templates require."""

    name = "mistral"
    START = "[TOOL_CALLS]"
    markers = (START,)

    def matches(self, chat_template: str) -> bool:
        return self.START in chat_template

    def stream(self, max_calls: int | None = None) -> ToolCallStream:
        return TailStream(self.START, _mistral_calls, max_calls)

    def grammar(self, functions: tuple[Function, ...], parallel: bool, token_markers: Mapping[str, str]) -> str:
        start = _lark_literal(self.START, token_markers)
        lines = [f'start: {start} " [" call ("," " " call)* "]"' if parallel else f'start: {start} " [" call "]"']
        # The id the templates write after the arguments may follow, as the model saw calls written.
        lines.append('call_id: ", \\"id\\": \\"" /[A-Za-z0-9]{9}/ "\\""')
        return "\n".join(lines + _call_rules(functions, "arguments", after="call_id? ")) + "\n"


def _json_calls(text: str) -> list[ToolCall] | None:
    values = _json_values(text)
    if values is None:
        return None
    calls = [_call_of(value, ("arguments", "parameters")) for value in values]
    return None if any(call is None for call in calls) else calls


@dataclasses.dataclass(frozen=True)
class JsonFormat(ToolCallFormat):
    """For a chat template that renders no tools: the handler writes them into the system message, with
    how to call one, and the model answers with `{"name": ..., "arguments": {...}}` as its whole
    output, one call per line. Earlier calls and their results are written into the conversation as
    text, in roles every template takes (assistant, user)."""

    name = "json"
    renders_tools = False
    INSTRUCTIONS = (
        "You can call the functions below. To call one, answer with only a JSON object "
        '{"name": <function name>, "arguments": <an object of its parameters>}, '
        "and nothing else; to call several, write one such object per line."
    )

    def matches(self, chat_template: str) -> bool:
        return False  # the fallback where no format matches, or named by tool_call_parser

    def stream(self, max_calls: int | None = None) -> ToolCallStream:
        return TailStream("", _json_calls, max_calls)

    def grammar(self, functions: tuple[Function, ...], parallel: bool, token_markers: Mapping[str, str]) -> str:
        start = 'start: call ("\\n" call)*' if parallel else "start: call"
        return "\n".join([start, *_call_rules(functions, "arguments")]) + "\n"

    def prompt_messages(self, messages: list[dict], tools: tuple[dict, ...] | None) -> list[dict]:
        """`messages` as a template without tools renders them: the tools in the system message, an
        assistant's calls as its JSON lines, a tool result as a user message naming its call."""
        written = []
        for message in messages:
            if message.get("tool_calls"):
                lines = [message["content"]] if message.get("content") else []
                lines += [
                    json.dumps({"name": call["function"]["name"], "arguments": call["function"]["arguments"]})
                    for call in message["tool_calls"]
                ]
                written.append({"role": "assistant", "content": "\n".join(lines)})
            elif message.get("role") == "tool":
                written.append(
                    {"role": "user", "content": f"Result of call {message['tool_call_id']}:\n{message['content']}"}
                )
            else:
                written.append({key: value for key, value in message.items() if key != "tool_call_id"})
        if tools:
            listed = "\n".join(json.dumps(tool["function"]) for tool in tools)
            text = f"{self.INSTRUCTIONS}\n\n{listed}"
            if written and written[0]["role"] == "system":
                written[0] = {**written[0], "content": f"{written[0]['content']}\n\n{text}"}
            else:
                written.insert(0, {"role": "system", "content": text})
        return written


JSON_FORMAT = JsonFormat()
# In the order they are tried on a chat template; `tool_call_parser` in the config names one instead.
# Where none matches, the handler writes the tools into the prompt itself (`JsonFormat`).
FORMATS: tuple[ToolCallFormat, ...] = (HermesFormat(), MistralFormat(), Llama3JsonFormat(), JSON_FORMAT)
FORMAT_NAMES = tuple(tool_format.name for tool_format in FORMATS)
