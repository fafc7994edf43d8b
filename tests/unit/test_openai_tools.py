"""Tool calling and response_format on the OpenAI chat route: parsing, grammars, request rules, templates, answers.

The chat templates are written here, modelled on Qwen2.5's: one renders the
tools in the system turn inside <tools></tools>, an assistant's calls as
<tool_call> blocks and tool results as <tool_response> blocks; the other is
plain ChatML, which renders no tools.
"""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from handler.api.native import RequestError
from handler.api.openai.answers import OpenAIStream, response_body
from handler.api.openai.requests import OpenAIRequest, parse_openai_request
from handler.api.openai.routes import ROUTE_CHAT, ROUTE_COMPLETIONS
from handler.api.openai.tool_formats import JSON_FORMAT, Function, HermesFormat, JsonFormat, ToolCall
from handler.api.openai.tools import NO_PARAMETERS, token_markers, tool_format_for
from handler.config import HandlerConfig
from handler.constraints import KIND_GRAMMAR, KIND_JSON_SCHEMA
from handler.engine import GenerationRequest
from tests.unit.test_openai_answers import FakeResult, events_of, stats

CONFIG = HandlerConfig(max_new_tokens=32, max_new_tokens_limit=64)
MAX_CONTEXT = 4096
MODEL = "tiny-spec"
HERMES = HermesFormat()

TOOL_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    '{{- \'\\n</tools>\\nCall one with <tool_call>\\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for call in message.tool_calls %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' + call.function.name + \'", "arguments": \' }}'
    "{{- (call.function.arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
PLAIN_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
# Pydantic-style parameters: a $ref into $defs, which must keep resolving inside the grammar.
BOOKING = {
    "type": "function",
    "function": {
        "name": "book",
        "parameters": {
            "$defs": {"Day": {"type": "string", "enum": ["mon", "tue"]}},
            "type": "object",
            "properties": {"day": {"$ref": "#/$defs/Day"}},
            "required": ["day"],
        },
    },
}
NOW = {"type": "function", "function": {"name": "now"}}  # no parameters: no arguments
TOOLS = [WEATHER, BOOKING, NOW]
USER = [{"role": "user", "content": "Weather in Paris?"}]


def load_tokenizer(tmp_path_factory, template: str, added_tokens: tuple[str, ...] = ()):
    from transformers import AutoTokenizer

    from scripts.model_tools import make_tiny_models

    out = tmp_path_factory.mktemp("tool-tokenizer")
    make_tiny_models.save_tokenizer(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokenizer.chat_template = template
    tokenizer.add_tokens(list(added_tokens))
    return tokenizer


@pytest.fixture(scope="module")
def tool_tokenizer(tmp_path_factory):
    return load_tokenizer(tmp_path_factory, TOOL_TEMPLATE)


@pytest.fixture(scope="module")
def plain_tokenizer(tmp_path_factory):
    return load_tokenizer(tmp_path_factory, PLAIN_TEMPLATE)


def parse(body, tokenizer, kind=ROUTE_CHAT) -> OpenAIRequest:
    return parse_openai_request(kind, body, CONFIG, tokenizer, MAX_CONTEXT, MODEL)


def refused(body, tokenizer, kind=ROUTE_CHAT) -> str:
    with pytest.raises(RequestError) as info:
        parse(body, tokenizer, kind)
    assert info.value.status == 400
    return str(info.value)


def call_text(name: str, arguments: dict) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


def named(calls: list[ToolCall]) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in calls]


# ---------------------------------------------------------------------------
# Parsing


def test_one_call_has_no_content():
    content, calls = HERMES.parse(call_text("get_weather", {"city": "Paris"}))
    assert content is None and named(calls) == [("get_weather", {"city": "Paris"})]
    assert re.fullmatch(r"call_[0-9a-f]{24}", calls[0].id)
    assert calls[0].as_openai() == {
        "id": calls[0].id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }


def test_parallel_calls_and_the_text_before_them():
    text = "Let me check.\n" + call_text("get_weather", {"city": "Paris"}) + "\n" + call_text("now", {}) + "\n"
    content, calls = HERMES.parse(text)
    assert content == "Let me check."
    assert named(calls) == [("get_weather", {"city": "Paris"}), ("now", {})]
    assert len({call.id for call in calls}) == 2
    # parallel_tool_calls: false keeps the first call only.
    assert named(HERMES.parse(text, max_calls=1)[1]) == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>\n{not json}\n</tool_call>",
        '<tool_call>\n{"name": "f"}\n</tool_call> then text',  # no arguments
        '<tool_call>\n["f", {}]\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": {"x": 1}',  # cut off inside the JSON
    ],
)
def test_a_block_that_is_not_a_call_stays_content(text):
    assert HERMES.parse(text) == (text, [])


def test_text_without_calls_is_kept_exactly_and_odd_blocks_are_tolerated():
    assert HERMES.parse("Hello \n <tool") == ("Hello \n <tool", [])
    assert HERMES.parse("") == (None, [])
    # A block left open at the end counts when its JSON is complete; arguments may be a JSON string.
    content, calls = HERMES.parse('Hi <tool_call>\n{"name": "f", "arguments": "{\\"x\\": 1}"}')
    assert content == "Hi" and named(calls) == [("f", {"x": 1})]


STREAM_SAMPLES = [
    "Sure, checking.\n" + call_text("get_weather", {"city": "Paris"}) + "\n" + call_text("now", {}),
    "  <tool_call>\n{oops}\n</tool_call>\n" + call_text("f", {"a": [1, 2]}) + "\n\nDone. <tool_",
    "plain text with a <tag> and trailing space ",
    'x <tool_call>\n{"name": "f", "arguments": {}}',
]


@pytest.mark.parametrize("text", STREAM_SAMPLES)
def test_streamed_deltas_reassemble_to_the_whole_parse_at_every_split(text):
    whole_content, whole_calls = HERMES.parse(text)
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for pieces in splits:
        stream = HERMES.stream()
        contents, calls = [], []
        for piece in pieces:
            content, new_calls = stream.feed(piece)
            contents.append(content)
            calls += new_calls
        content, new_calls = stream.finish()
        assert ("".join(contents) + content or None, calls + new_calls) == (whole_content, whole_calls), pieces


def test_marker_text_is_held_back_until_it_is_decided():
    stream = HERMES.stream()
    assert stream.feed("Hi <tool") == ("Hi", [])
    assert stream.feed("s>") == (" <tools>", [])
    assert stream.feed(" <tool_call>\n") == ("", [])
    content, calls = stream.feed('{"name": "f", "arguments": {}}\n</tool_call>')
    assert content == "" and named(calls) == [("f", {})]


# ---------------------------------------------------------------------------
# Grammars


def matcher_for(lark: str, tokenizer):
    import llguidance
    import llguidance.hf

    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer)
    grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    assert llguidance.LLMatcher.validate_grammar(grammar, ll_tokenizer) == ""
    return llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)


def accepts(lark: str, tokenizer, text: str) -> bool:
    matcher = matcher_for(lark, tokenizer)
    token_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if matcher.validate_tokens(token_ids) < len(token_ids):
        return False
    assert all(matcher.consume_token(token_id) for token_id in token_ids)
    return matcher.is_accepting()


FUNCTIONS = (
    Function("get_weather", WEATHER["function"]["parameters"]),
    Function("book", BOOKING["function"]["parameters"]),
)


@pytest.mark.parametrize("added_tokens", [(), ("<tool_call>", "</tool_call>")], ids=["text-markers", "token-markers"])
def test_the_grammar_compiles_and_takes_exactly_valid_calls(tmp_path_factory, added_tokens):
    tokenizer = load_tokenizer(tmp_path_factory, TOOL_TEMPLATE, added_tokens)
    markers = token_markers(tokenizer, HERMES)
    assert set(markers) == set(added_tokens)
    weather = call_text("get_weather", {"city": "Paris"})
    booking = call_text("book", {"day": "tue"})

    parallel = HERMES.grammar(FUNCTIONS, True, markers)
    assert accepts(parallel, tokenizer, weather)
    assert accepts(parallel, tokenizer, weather + "\n" + booking)
    assert not accepts(parallel, tokenizer, call_text("book", {"day": "sun"})), "the $ref'd enum holds"
    assert not accepts(parallel, tokenizer, call_text("get_weather", {"town": "Paris"}))
    assert not accepts(parallel, tokenizer, call_text("now", {})), "not one of the functions"
    assert not accepts(parallel, tokenizer, "Sure. " + weather)

    single = HERMES.grammar(FUNCTIONS, False, markers)
    assert accepts(single, tokenizer, booking) and not accepts(single, tokenizer, weather + "\n" + booking)
    one = HERMES.grammar(FUNCTIONS[1:], False, markers)
    assert accepts(one, tokenizer, booking) and not accepts(one, tokenizer, weather)


def test_the_grammar_takes_what_the_template_writes_for_a_call(tool_tokenizer):
    """A call the model copies from its prompt's history is one the grammar allows."""
    messages = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [openai_call("c1", "get_weather", {"city": "Nice"})]},
    ]
    rendered = tool_tokenizer.decode(
        list(parse({"messages": messages, "tools": TOOLS}, tool_tokenizer).generations[0].prompt_ids)
    )
    written = re.findall(r"<tool_call>\n\{.*?</tool_call>", rendered, re.DOTALL)[-1]  # the call, not the example
    assert "Nice" in written
    assert accepts(HERMES.grammar(FUNCTIONS, True, {}), tool_tokenizer, written)


# ---------------------------------------------------------------------------
# Requests


def openai_call(call_id: str, name: str, arguments: dict) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def test_the_family_comes_from_the_chat_template(tool_tokenizer, plain_tokenizer):
    assert tool_format_for(tool_tokenizer) == HERMES and tool_format_for(plain_tokenizer) == JSON_FORMAT


def test_auto_renders_the_tools_and_parses_free_output(tool_tokenizer):
    request = parse({"messages": USER, "tools": TOOLS}, tool_tokenizer)
    (generation,) = request.generations
    prompt = tool_tokenizer.decode(list(generation.prompt_ids))
    assert "<tools>\n" + json.dumps(WEATHER) in prompt
    assert generation.constraint is None
    assert request.tool_format == HERMES and request.max_tool_calls is None
    assert parse({"messages": USER, "tools": TOOLS, "parallel_tool_calls": False}, tool_tokenizer).max_tool_calls == 1


def test_none_neither_renders_nor_parses(tool_tokenizer):
    request = parse({"messages": USER, "tools": TOOLS, "tool_choice": "none"}, tool_tokenizer)
    assert request.generations == parse({"messages": USER}, tool_tokenizer).generations
    assert request.tool_format is None


def test_required_and_named_choices_constrain_the_output_to_calls(tool_tokenizer):
    functions = (
        Function("get_weather", WEATHER["function"]["parameters"]),
        Function("book", BOOKING["function"]["parameters"]),
        Function("now", {"type": "object", "properties": {}, "additionalProperties": False}),
    )
    body = {"messages": USER, "tools": TOOLS, "n": 2}
    required = parse({**body, "tool_choice": "required"}, tool_tokenizer)
    constraints = {generation.constraint for generation in required.generations}
    assert constraints == {required.generations[0].constraint}, "every choice carries it"
    (constraint,) = constraints
    assert constraint.kind == KIND_GRAMMAR and constraint.source == HERMES.grammar(functions, True, {})
    single = parse({**body, "tool_choice": "required", "parallel_tool_calls": False}, tool_tokenizer)
    assert single.generations[0].constraint.source == HERMES.grammar(functions, False, {})
    choice = {"type": "function", "function": {"name": "book"}}
    forced = parse({**body, "tool_choice": choice}, tool_tokenizer)
    assert forced.generations[0].constraint.source == HERMES.grammar(functions[1:2], False, {})
    assert forced.tool_format == HERMES


def test_response_format_becomes_a_json_schema_on_both_routes(tool_tokenizer):
    schema = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}, "required": ["b"]}
    json_schema = {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": True}}
    for kind, prompt in [(ROUTE_CHAT, {"messages": USER}), (ROUTE_COMPLETIONS, {"prompt": "x"})]:
        (generation,) = parse({**prompt, "response_format": json_schema}, tool_tokenizer, kind).generations
        assert generation.constraint.kind == KIND_JSON_SCHEMA and json.loads(generation.constraint.source) == schema
        (generation,) = parse({**prompt, "response_format": {"type": "json_object"}}, tool_tokenizer, kind).generations
        assert json.loads(generation.constraint.source) == {"type": "object"}
        (generation,) = parse({**prompt, "response_format": {"type": "text"}}, tool_tokenizer, kind).generations
        assert generation.constraint is None
    # With tool_choice auto the output stays free to be JSON: allowed.
    assert parse({"messages": USER, "tools": TOOLS, "response_format": json_schema}, tool_tokenizer).tool_format


def test_tool_calls_and_results_render_through_the_template(tool_tokenizer):
    messages = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                openai_call("c1", "get_weather", {"city": "Paris"}),
                openai_call("c2", "now", {}),
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21C"},
        {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "12:00"}]},
    ]
    (generation,) = parse({"messages": messages, "tools": TOOLS}, tool_tokenizer).generations
    prompt = tool_tokenizer.decode(list(generation.prompt_ids))
    assert prompt.endswith(
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nsunny, 21C\n</tool_response><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n12:00\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    ), "arguments reach the template as an object, as vLLM passes them"


BAD_TOOLS = [
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": ["get_weather"]}, "tools[0]"),
    ({"tools": [{"type": "retrieval", "function": WEATHER["function"]}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [{**WEATHER, "cache": True}]}, "tools[0].cache"),
    ({"tools": [NOW, {"type": "function", "function": {"name": "get weather"}}]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f" * 65}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "returns": {}}}]}, "tools[0].function.returns"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]}, "tools[0].function.strict"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "tools[0].function.parameters"),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
        "tools[0].function.parameters",
    ),
    ({"tools": [NOW, WEATHER, NOW]}, "tools[2].function.name"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "fly"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "now"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [], "tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    (
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"format": "no-such-format"}}}],
            "tool_choice": "required",
        },
        "tools",  # valid JSON Schema, but llguidance cannot enforce the format: the native grammar's 400, renamed
    ),
]


@pytest.mark.parametrize("extra, field", BAD_TOOLS, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD_TOOLS)])
def test_bad_tool_fields_are_400s_naming_the_field(extra, field, tool_tokenizer):
    message = refused({"messages": USER, **extra}, tool_tokenizer)
    assert message.startswith(f"{field}:"), message


def schema_format(**fields) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, **fields}}}


BAD_FORMATS = [
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "text", "json_schema": {}}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    (schema_format(name="a name"), "response_format.json_schema.name"),
    (schema_format(strict="yes"), "response_format.json_schema.strict"),
    (schema_format(description=1), "response_format.json_schema.description"),
    (schema_format(schemas={}), "response_format.json_schema.schemas"),
    (schema_format(schema=None), "response_format.json_schema.schema"),
    (schema_format(schema=[]), "response_format.json_schema.schema"),
    (schema_format(schema={"type": 5}), "response_format.json_schema.schema"),
]


@pytest.mark.parametrize("extra, field", BAD_FORMATS, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD_FORMATS)])
def test_bad_response_formats_are_400s_naming_the_field(extra, field, tool_tokenizer):
    for kind, prompt in [(ROUTE_CHAT, {"messages": USER}), (ROUTE_COMPLETIONS, {"prompt": "x"})]:
        message = refused({**prompt, **extra}, tool_tokenizer, kind)
        assert message.startswith(f"{field}:"), message


CALL = openai_call("c1", "get_weather", {"city": "Paris"})
BAD_MESSAGES = [
    ([{"role": "user", "content": "x", "tool_calls": [CALL]}], "messages[0].tool_calls"),
    ([{"role": "assistant", "content": None, "tool_calls": "c1"}], "messages[0].tool_calls"),
    ([{"role": "assistant", "content": None, "tool_calls": [{**CALL, "id": 1}]}], "messages[0].tool_calls[0].id"),
    ([{"role": "assistant", "tool_calls": [{**CALL, "type": "code"}]}], "messages[0].tool_calls[0].type"),
    ([{"role": "assistant", "tool_calls": [{"id": "c1", "type": "function"}]}], "messages[0].tool_calls[0].function"),
    (
        [{"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "{"}}]}],
        "messages[0].tool_calls[0].function.arguments",
    ),
    ([*USER, {"role": "tool", "content": "sunny"}], "messages[1].tool_call_id"),
    ([{"role": "user", "content": "x", "tool_call_id": "c1"}], "messages[0].tool_call_id"),
    ([{"role": "user", "content": "x", "name": 7}], "messages[0].name"),
    ([{"role": "assistant", "content": None}], "messages[0].content"),  # null content needs tool calls
]


@pytest.mark.parametrize("messages, field", BAD_MESSAGES, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD_MESSAGES)])
def test_bad_tool_messages_are_400s_naming_the_field(messages, field, tool_tokenizer):
    message = refused({"messages": messages}, tool_tokenizer)
    assert message.startswith(f"{field}:"), message


def test_a_template_without_tools_gets_them_written_into_the_prompt(plain_tokenizer):
    """The generic JSON format: the handler writes the tools, the calls and the results as text."""
    request = parse({"messages": USER, "tools": TOOLS}, plain_tokenizer)
    assert request.tool_format == JSON_FORMAT
    prompt = plain_tokenizer.decode(list(request.generations[0].prompt_ids))
    assert prompt.startswith("<|im_start|>system\n" + JsonFormat.INSTRUCTIONS)
    assert json.dumps(WEATHER["function"]) in prompt and "Weather in Paris?" in prompt
    history = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    prompt = plain_tokenizer.decode(list(parse({"messages": history}, plain_tokenizer).generations[0].prompt_ids))
    arguments = json.loads(CALL["function"]["arguments"])
    written = json.dumps({"name": CALL["function"]["name"], "arguments": arguments})
    assert f"<|im_start|>assistant\n{written}<|im_end|>" in prompt
    assert "<|im_start|>user\nResult of call c1:\nsunny<|im_end|>" in prompt
    # Forced calls follow the grammar; a family's own format named for such a template refuses tools.
    forced = parse({"messages": USER, "tools": TOOLS, "tool_choice": "required"}, plain_tokenizer)
    assert forced.generations[0].constraint.source == JSON_FORMAT.grammar(
        tuple(Function(t["function"]["name"], t["function"].get("parameters", NO_PARAMETERS)) for t in TOOLS), True, {}
    )
    hermes_config = dataclasses.replace(CONFIG, tool_call_parser="hermes")
    with pytest.raises(RequestError, match="does not render tools"):
        parse_openai_request(
            ROUTE_CHAT, {"messages": USER, "tools": TOOLS}, hermes_config, plain_tokenizer, 4096, MODEL
        )
    assert parse({"messages": USER, "tools": TOOLS, "tool_choice": "none"}, plain_tokenizer).tool_format is None


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ('{"name": "get_weather", "arguments": {"city": "Nice"}}', None, [("get_weather", {"city": "Nice"})]),
        ('{"name": "now", "arguments": {}}\n{"name": "book", "arguments": {"day": "mon"}}', None,
         [("now", {}), ("book", {"day": "mon"})]),
        ("Sunny in Nice.", "Sunny in Nice.", []),
    ],
)  # fmt: skip
def test_json_calls_parse_whole_and_streamed(text, content, calls):
    from tests.unit.test_tool_formats import whole_and_streamed

    parsed_content, parsed_calls = whole_and_streamed(JSON_FORMAT, text)
    assert parsed_content == content and named(parsed_calls) == calls


def test_the_json_grammar_takes_exactly_valid_calls(plain_tokenizer):
    grammar = JSON_FORMAT.grammar(FUNCTIONS, True, {})
    weather = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    assert accepts(grammar, plain_tokenizer, weather)
    assert accepts(grammar, plain_tokenizer, weather + '\n{"name": "book", "arguments": {"day": "tue"}}')
    assert not accepts(grammar, plain_tokenizer, '{"name": "book", "arguments": {"day": "sun"}}')
    assert not accepts(JSON_FORMAT.grammar(FUNCTIONS, False, {}), plain_tokenizer, weather + "\n" + weather)


# ---------------------------------------------------------------------------
# Answers


class TextTokenizer:
    """Token i decodes to pieces[i]: any text, cut where a test likes."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def decode(self, token_ids, skip_special_tokens=False):
        return "".join(self.pieces[i] for i in token_ids)


def tool_request(num_choices: int = 1, stream: bool = False, max_tool_calls: int | None = None) -> OpenAIRequest:
    return OpenAIRequest(
        kind=ROUTE_CHAT,
        model=MODEL,
        generations=(GenerationRequest(prompt_ids=(1, 2), max_new_tokens=64),) * num_choices,
        n=num_choices,
        stream=stream,
        tool_format=HERMES,
        max_tool_calls=max_tool_calls,
        id="chatcmpl-x",
        created=1700000000,
    )


def results_of(pieces_per_choice: list[list[str]], finish_reasons: list[str]) -> tuple[TextTokenizer, list]:
    """One tokenizer spelling every choice's pieces, and each choice's result (its own token ids)."""
    tokenizer, results = TextTokenizer([]), []
    for pieces, reason in zip(pieces_per_choice, finish_reasons):
        token_ids = list(range(len(tokenizer.pieces), len(tokenizer.pieces) + len(pieces)))
        tokenizer.pieces += pieces
        results.append(FakeResult(token_ids, "".join(pieces), reason, 2, stats(4, 2, 2, len(pieces))))
    return tokenizer, results


def pieces_of(text: str, size: int = 3) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


TWO_CALLS = "On it.\n" + call_text("get_weather", {"city": "Paris"}) + "\n" + call_text("now", {})


def test_the_plain_answer_carries_tool_calls():
    tokenizer, results = results_of([pieces_of(TWO_CALLS)] * 2 + [["Hi!"]], ["eos", "length", "eos"])
    body = response_body(tool_request(3), results, tokenizer)
    parsed = ChatCompletion.model_validate(json.loads(json.dumps(body)))
    first, cut, plain = parsed.choices
    assert first.message.content == "On it." and first.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in first.message.tool_calls] == [
        ("get_weather", {"city": "Paris"}),
        ("now", {}),
    ]
    assert all(c.type == "function" and re.fullmatch(r"call_[0-9a-f]{24}", c.id) for c in first.message.tool_calls)
    assert cut.finish_reason == "length", "a choice cut short says so, calls or not"
    assert plain.message.content == "Hi!" and plain.message.tool_calls is None and plain.finish_reason == "stop"
    assert "tool_calls" not in body["choices"][2]["message"]


def streamed(request: OpenAIRequest, pieces_per_choice: list[list[str]], finish_reasons: list[str]):
    """Feeds each choice one token per step; returns the chunks and the results."""
    tokenizer, results = results_of(pieces_per_choice, finish_reasons)
    stream = OpenAIStream(request, tokenizer)
    text = ""
    for step in range(max(len(pieces) for pieces in pieces_per_choice)):
        for choice, result in enumerate(results):
            if step < len(result.token_ids):
                text += stream.on_tokens(choice, result.token_ids[: step + 1])
    text += stream.close(results)
    events = events_of(text)
    assert events[-1] == "[DONE]"
    return [ChatCompletionChunk.model_validate(event) for event in events[:-1]], results


@pytest.mark.parametrize("size", [1, 4, 1000], ids=["char", "pieces", "whole"])
def test_the_stream_accumulates_to_the_plain_answer(size):
    texts = [TWO_CALLS, "No tools needed.", "<tool_call>\n{broken}\n</tool_call>", call_text("now", {})]
    pieces = [pieces_of(text, size) for text in texts]
    request = tool_request(len(texts), stream=True)
    chunks, results = streamed(request, pieces, ["eos", "eos", "stop", "eos"])
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(chunk)
    final = state.get_final_completion()
    plain = ChatCompletion.model_validate(response_body(dataclasses.replace(request, stream=False), results, None))

    def view(choice):
        calls = [(c.type, c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return choice.index, choice.message.content, calls, choice.finish_reason

    assert [view(c) for c in final.choices] == [view(c) for c in plain.choices]
    assert [choice.finish_reason for choice in final.choices] == ["tool_calls", "stop", "stop", "tool_calls"]
    assert final.choices[1].message.content == "No tools needed." and final.choices[1].message.tool_calls is None


def test_streamed_calls_come_as_openai_sends_them():
    chunks, _ = streamed(tool_request(stream=True), [pieces_of(TWO_CALLS)], ["eos"])
    deltas = [chunk.choices[0].delta for chunk in chunks]
    assert deltas[0].role == "assistant"
    call_deltas = [d.tool_calls[0] for d in deltas if d.tool_calls]
    head, arguments = call_deltas[:2]
    assert (head.index, head.type, head.function.name, head.function.arguments) == (0, "function", "get_weather", "")
    assert re.fullmatch(r"call_[0-9a-f]{24}", head.id)
    assert (arguments.index, arguments.id, arguments.function.name) == (0, None, None)
    assert json.loads(arguments.function.arguments) == {"city": "Paris"}
    assert [d.index for d in call_deltas] == [0, 0, 1, 1]
    assert all(d.content is None for d in deltas if d.tool_calls)
    assert "".join(d.content or "" for d in deltas) == "On it."
    assert [c.choices[0].finish_reason for c in chunks][-1] == "tool_calls"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_a_stream_cut_short_finishes_with_length():
    chunks, _ = streamed(tool_request(stream=True), [pieces_of(TWO_CALLS)], ["length"])
    assert chunks[-1].choices[0].finish_reason == "length"


def test_a_stream_without_parallel_calls_sends_the_first_only():
    chunks, _ = streamed(tool_request(stream=True, max_tool_calls=1), [pieces_of(TWO_CALLS)], ["eos"])
    names = [d.tool_calls[0].function.name for d in (c.choices[0].delta for c in chunks) if d.tool_calls]
    assert names == ["get_weather", None]
