"""Tool calling on the OpenAI chat route: the request's `tools` and `tool_choice`, checked and planned.

A *function* is what the client declares in `tools`; each model family's markup for calling one,
and the grammar that forces it, is its format (`handler.api.openai.tool_formats`).

`tool_choice`, as OpenAI defines it:
- `none`: the tools are not rendered and nothing is parsed;
- `auto` (the default with tools): rendered, the output is free, and the
  family's call blocks are parsed out of it;
- `required`: the output is one or more calls (exactly one with
  `parallel_tool_calls: false`), forced by a grammar;
- `{"type": "function", "function": {"name": ...}}`: exactly one call to it.
Under a grammar the arguments always validate against the function's `parameters`.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from typing import Any

from handler.api.openai.tool_formats import FORMATS, JSON_FORMAT, Function, ToolCallFormat
from handler.constraints import check_json_schema
from handler.schema import RequestError

TOOL_CHOICE_NONE = "none"
TOOL_CHOICE_AUTO = "auto"
TOOL_CHOICE_REQUIRED = "required"
TOOL_CHOICE_FUNCTION = "function"  # a named function
TOOL_CHOICES = (TOOL_CHOICE_NONE, TOOL_CHOICE_AUTO, TOOL_CHOICE_REQUIRED)
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule
TOOL_KEYS = ("type", "function")
FUNCTION_KEYS = ("name", "description", "parameters", "strict")
# A function without `parameters` takes none (OpenAI: "an empty parameter list").
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def chat_template_text(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    # A tokenizer may hold several named templates (a dict); tools use any of them.
    return "\n".join(template.values()) if isinstance(template, Mapping) else str(template)


def tool_format_for(tokenizer, parser: str = "auto") -> ToolCallFormat | None:
    """The tool-call format of the tokenizer's chat template: the one it renders, else `JsonFormat`
    (the handler writes the tools into the prompt); None without a chat template.

    parser: `auto` (recognise it from the template), or a format's name (`tool_call_parser` in the
    config: vLLM's names, and `json`). A family's format named for a template that renders no tools
    is None.
    """
    template = chat_template_text(tokenizer)
    if not template:
        return None  # no chat template: no chat at all
    if parser == JSON_FORMAT.name:
        return JSON_FORMAT
    if parser != "auto":
        renders_tools = "tools" in template or any(f.matches(template) for f in FORMATS)
        return next(f for f in FORMATS if f.name == parser) if renders_tools else None
    return next((f for f in FORMATS if f.matches(template)), JSON_FORMAT)


def token_markers(tokenizer, tool_format: ToolCallFormat) -> dict[str, str]:
    """The format's markers that are single added tokens of the tokenizer -> how a Lark grammar names each:
    `<tool_call>` as itself (llguidance's special-token syntax), any other (`[TOOL_CALLS]`) by its id."""
    added = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
    return {
        marker: marker if marker.startswith("<") and marker.endswith(">") else f"<[{added[marker]}]>"
        for marker in tool_format.markers
        if marker in added
    }


# ---------------------------------------------------------------------------
# Requests


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """What a chat request does with its tools.

    tools: the tool objects the chat template renders; None when none are.
    tool_format: parses the output's calls; None: nothing is parsed.
    max_calls: calls kept per choice (1 with parallel_tool_calls false); None for all.
    grammar: the Lark grammar forcing the calls (required or a named function); None: free output.
    """

    tools: tuple[dict, ...] | None = None
    tool_format: ToolCallFormat | None = None
    max_calls: int | None = None
    grammar: str | None = None


def tool_plan(body: Mapping, tokenizer, tool_format: ToolCallFormat | None) -> ToolPlan:
    """Validates `tools`, `tool_choice` and `parallel_tool_calls` of a chat body (`tool_format`: the
    tokenizer's, `tool_format_for`; None where it takes no tools).

    Raises:
        RequestError: 400 naming the field, e.g. `tools[1].function.parameters`.
    """
    tools = body.get("tools", [])
    if not isinstance(tools, list):
        raise RequestError('tools: must be a list of {"type": "function", "function": {...}} objects')
    functions = tuple(_function(tool, f"tools[{index}]") for index, tool in enumerate(tools))
    names = [function.name for function in functions]
    for index, name in enumerate(names):
        if name in names[:index]:
            raise RequestError(f"tools[{index}].function.name: {json.dumps(name)} is declared twice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise RequestError(f"parallel_tool_calls: must be true or false, got {json.dumps(parallel)}")
    choice, forced_name = _tool_choice(body.get("tool_choice", TOOL_CHOICE_AUTO if tools else TOOL_CHOICE_NONE))
    if choice == TOOL_CHOICE_REQUIRED and not tools:
        raise RequestError('tool_choice: "required" needs tools')
    if forced_name is not None and forced_name not in names:
        raise RequestError(f"tool_choice: no function {json.dumps(forced_name)} in tools")
    if not tools or choice == TOOL_CHOICE_NONE:
        return ToolPlan()
    if tool_format is None:
        raise RequestError(
            "tools: this model's chat template does not render tools; leave them out or send tool_choice: none"
        )
    grammar = None
    if choice == TOOL_CHOICE_REQUIRED:
        grammar = tool_format.grammar(functions, parallel, token_markers(tokenizer, tool_format))
    elif choice == TOOL_CHOICE_FUNCTION:
        forced = tuple(function for function in functions if function.name == forced_name)
        grammar = tool_format.grammar(forced, False, token_markers(tokenizer, tool_format))
    return ToolPlan(
        tools=tuple(_rendered_tool(tool) for tool in tools),
        tool_format=tool_format,
        max_calls=None if parallel else 1,
        grammar=grammar,
    )


def _function(tool: Any, field: str) -> Function:
    if not isinstance(tool, Mapping):
        raise RequestError(f'{field}: must be an object {{"type": "function", "function": {{...}}}}')
    for key in tool:
        if key not in TOOL_KEYS:
            raise RequestError(f"{field}.{key}: unknown field; a tool has {', '.join(TOOL_KEYS)}")
    if tool.get("type") != "function":
        raise RequestError(f'{field}.type: must be "function", got {json.dumps(tool.get("type"))}')
    function = tool.get("function")
    if not isinstance(function, Mapping):
        raise RequestError(f"{field}.function: must be an object with a name")
    field = f"{field}.function"
    for key, value in function.items():
        if key not in FUNCTION_KEYS:
            raise RequestError(f"{field}.{key}: unknown field; a function has {', '.join(FUNCTION_KEYS)}")
        if key == "description" and value is not None and not isinstance(value, str):
            raise RequestError(f"{field}.description: must be a string")
        if key == "strict" and value is not None and not isinstance(value, bool):
            raise RequestError(f"{field}.strict: must be true or false, got {json.dumps(value)}")
    name = function.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
        raise RequestError(
            f"{field}.name: must be 1 to 64 letters, digits, underscores or dashes, got {json.dumps(name)}"
        )
    parameters = function.get("parameters")
    if parameters is None:
        return Function(name, NO_PARAMETERS)
    if not isinstance(parameters, Mapping):
        raise RequestError(f"{field}.parameters: must be a JSON Schema object, got {json.dumps(parameters)[:80]}")
    check_json_schema(dict(parameters), f"{field}.parameters")
    return Function(name, dict(parameters))


def _tool_choice(value: Any) -> tuple[str, str | None]:
    """(mode, the named function or None)."""
    if isinstance(value, str):
        if value not in TOOL_CHOICES:
            raise RequestError(
                f'tool_choice: must be one of {", ".join(TOOL_CHOICES)} or {{"type": "function", "function": '
                f'{{"name": ...}}}}, got {json.dumps(value)}'
            )
        return value, None
    if (
        isinstance(value, Mapping)
        and value.get("type") == "function"
        and isinstance(value.get("function"), Mapping)
        and isinstance(value["function"].get("name"), str)
    ):
        return TOOL_CHOICE_FUNCTION, value["function"]["name"]
    raise RequestError(
        f'tool_choice: must be one of {", ".join(TOOL_CHOICES)} or {{"type": "function", "function": '
        f'{{"name": ...}}}}, got {json.dumps(value)[:80]}'
    )


def _rendered_tool(tool: Mapping) -> dict:
    """A tool as the chat template gets it: OpenAI's object, nulls left out."""
    function = {key: value for key, value in tool["function"].items() if value is not None}
    return {"type": "function", "function": function}


def message_tool_calls(value: Any, field: str) -> list[dict]:
    """An assistant message's `tool_calls`, as chat templates take them: arguments as an object.

    Qwen's template writes `arguments | tojson`, so a JSON string would be
    quoted twice; vLLM passes them parsed too.
    """
    if not isinstance(value, list):
        raise RequestError(f"{field}: must be a list of tool calls")
    calls = []
    for index, call in enumerate(value):
        where = f"{field}[{index}]"
        if not isinstance(call, Mapping):
            raise RequestError(f'{where}: must be an object {{"id", "type": "function", "function"}}')
        if not isinstance(call.get("id"), str):
            raise RequestError(f"{where}.id: must be a string")
        if call.get("type", "function") != "function":
            raise RequestError(f'{where}.type: must be "function", got {json.dumps(call.get("type"))}')
        function = call.get("function")
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise RequestError(f"{where}.function: must be an object with a name and arguments")
        arguments = function.get("arguments", "{}")
        try:
            parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
        except json.JSONDecodeError:
            parsed = None
        if not isinstance(parsed, Mapping):
            raise RequestError(f"{where}.function.arguments: must be a JSON object, as a string")
        calls.append(
            {"id": call["id"], "type": "function", "function": {"name": function["name"], "arguments": dict(parsed)}}
        )
    return calls
