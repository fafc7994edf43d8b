"""The tool-call formats beyond Hermes: Llama 3's JSON (`llama3_json`) and Mistral's `[TOOL_CALLS]` (`mistral`).

For each: parsing a whole output, streaming it at every split to the same
result, the grammar that forces calls (checked with llguidance on the tiny
tokenizer, with its marker as text and as an added token), recognition from the
chat template and the config's override, and a round trip through a template
that renders the family's calls.
"""

from __future__ import annotations

import re

import pytest

from handler.api.openai.requests import parse_openai_request
from handler.api.openai.routes import ROUTE_CHAT
from handler.api.openai.tool_formats import FORMAT_NAMES, HermesFormat, Llama3JsonFormat, MistralFormat
from handler.api.openai.tools import token_markers, tool_format_for
from handler.config import TOOL_CALL_PARSERS, HandlerConfig, handler_config_from_yaml_config
from tests.unit.test_openai_tools import FUNCTIONS, TOOLS, USER, accepts, load_tokenizer, named, openai_call

LLAMA, MISTRAL = Llama3JsonFormat(), MistralFormat()
CONFIG = HandlerConfig(max_new_tokens=32, max_new_tokens_limit=64)

# Simplified from the families' templates: what matters here is how each renders tools and calls.
LLAMA_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'user' and tools and loop.last %}"
    "{{- '<|start_header_id|>user<|end_header_id|>\\n\\nGiven the following functions, respond with a JSON for a "
    'function call.\\n\\nRespond in the format {"name": function name, "parameters": dictionary of argument name '
    "and its value}.\\n\\n' }}"
    "{%- for tool in tools %}{{- (tool | tojson) + '\\n\\n' }}{%- endfor %}"
    "{{- message.content + '<|eot_id|>' }}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- for call in message.tool_calls %}"
    "{{- '{\"name\": \"' + call.function.name + '\", \"parameters\": ' + (call.function.arguments | tojson) + '}' }}"
    "{%- endfor %}{{- '<|eot_id|>' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}"
    "{%- else %}"
    "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
MISTRAL_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}"
    "{%- if tools and loop.last %}{{- '[AVAILABLE_TOOLS] ' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}{%- endif %}"
    "{{- '[INST] ' + message.content + '[/INST]' }}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{{- '[TOOL_CALLS] [' }}"
    "{%- for call in message.tool_calls %}"
    "{%- if call.id is not string or call.id | length != 9 %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}"
    '{{- \'{"name": "\' + call.function.name + \'", "arguments": \' + (call.function.arguments | tojson)'
    " + ', \"id\": \"' + call.id + '\"}' }}"
    "{%- if not loop.last %}{{- ', ' }}{%- endif %}"
    "{%- endfor %}{{- ']</s>' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '[TOOL_RESULTS] ' + ({'content': message.content, 'call_id': message.tool_call_id} | tojson)"
    " + '[/TOOL_RESULTS]' }}"
    "{%- else %}{{- message.content + '</s>' }}{%- endif %}"
    "{%- endfor %}"
)


def whole_and_streamed(tool_format, text: str, max_calls=None):
    """The whole parse, checked equal to the stream's at every split (the ids aside)."""
    content, calls = tool_format.parse(text, max_calls)
    for pieces in [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]:
        stream = tool_format.stream(max_calls)
        contents, streamed = [], []
        for piece in pieces:
            delta, new = stream.feed(piece)
            contents.append(delta)
            streamed += new
        rest, new = stream.finish()
        assert ("".join(contents) + rest or None, named(streamed + new)) == (content, named(calls)), pieces
    return content, calls


# ---------------------------------------------------------------------------
# Llama 3 JSON


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [("get_weather", {"city": "Paris"})]),
        ('<|python_tag|>{"name": "now", "parameters": {}}', None, [("now", {})]),
        (
            '  {"name": "now", "arguments": {}}; {"name": "book", "parameters": {"day": "tue"}}',
            None,
            [("now", {}), ("book", {"day": "tue"})],
        ),
        ("It is sunny in Paris.", "It is sunny in Paris.", []),
        ('{"weather": "sunny"}', '{"weather": "sunny"}', []),  # JSON, but not a call: content
        ('{"name": "now", "parameters": {}', '{"name": "now", "parameters": {}', []),  # cut short
        ("", None, []),
    ],
)
def test_llama3_json_outputs_parse_whole_and_streamed(text, content, calls):
    parsed_content, parsed_calls = whole_and_streamed(LLAMA, text)
    assert parsed_content == content and named(parsed_calls) == calls


def test_llama3_json_keeps_one_call_without_parallel_calls():
    _, calls = whole_and_streamed(LLAMA, '{"name": "now", "parameters": {}}; {"name": "now", "parameters": {}}', 1)
    assert named(calls) == [("now", {})]


# ---------------------------------------------------------------------------
# Mistral


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ('[TOOL_CALLS] [{"name": "now", "arguments": {"city": "Nice"}}]', None, [("now", {"city": "Nice"})]),
        (
            'Let me check.[TOOL_CALLS] [{"name": "now", "arguments": {}}, {"name": "book", "arguments": {"d": "mon"}}]',
            "Let me check.",
            [("now", {}), ("book", {"d": "mon"})],
        ),
        ("No tools [TOOL] needed.", "No tools [TOOL] needed.", []),
        ("[TOOL_CALLS] not a list", "[TOOL_CALLS] not a list", []),
    ],
)  # fmt: skip
def test_mistral_outputs_parse_whole_and_streamed(text, content, calls):
    parsed_content, parsed_calls = whole_and_streamed(MISTRAL, text)
    assert parsed_content == content and named(parsed_calls) == calls


def test_mistral_call_ids_are_nine_letters_and_digits_or_the_models_own():
    _, calls = MISTRAL.parse(
        '[TOOL_CALLS] [{"name": "now", "arguments": {}}, {"name": "now", "arguments": {}, "id": "abcDEF123"}]'
    )
    assert re.fullmatch(r"[A-Za-z0-9]{9}", calls[0].id) and calls[1].id == "abcDEF123"


# ---------------------------------------------------------------------------
# Grammars


@pytest.mark.parametrize("added", [False, True], ids=["text-marker", "token-marker"])
def test_the_mistral_grammar_takes_exactly_valid_calls(tmp_path_factory, added):
    tokenizer = load_tokenizer(tmp_path_factory, MISTRAL_TEMPLATE, ("[TOOL_CALLS]",) if added else ())
    markers = token_markers(tokenizer, MISTRAL)
    assert set(markers) == ({"[TOOL_CALLS]"} if added else set())
    weather = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    booking = '{"name": "book", "arguments": {"day": "tue"}, "id": "a1b2c3d4e"}'
    parallel = MISTRAL.grammar(FUNCTIONS, True, markers)
    assert accepts(parallel, tokenizer, f"[TOOL_CALLS] [{weather}]")
    assert accepts(parallel, tokenizer, f"[TOOL_CALLS] [{weather}, {booking}]")
    assert not accepts(parallel, tokenizer, '[TOOL_CALLS] [{"name": "book", "arguments": {"day": "sun"}}]')
    assert not accepts(parallel, tokenizer, f"Sure. [TOOL_CALLS] [{weather}]")
    single = MISTRAL.grammar(FUNCTIONS, False, markers)
    assert accepts(single, tokenizer, f"[TOOL_CALLS] [{booking}]")
    assert not accepts(single, tokenizer, f"[TOOL_CALLS] [{weather}, {booking}]")


def test_the_llama3_grammar_takes_exactly_valid_calls(tmp_path_factory):
    tokenizer = load_tokenizer(tmp_path_factory, LLAMA_TEMPLATE)
    weather = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    booking = '{"name": "book", "parameters": {"day": "tue"}}'
    parallel = LLAMA.grammar(FUNCTIONS, True, {})
    assert accepts(parallel, tokenizer, weather) and accepts(parallel, tokenizer, f"{weather}; {booking}")
    assert not accepts(parallel, tokenizer, '{"name": "get_weather", "parameters": {"town": "Paris"}}')
    assert not accepts(parallel, tokenizer, "Sure. " + weather)
    single = LLAMA.grammar(FUNCTIONS, False, {})
    assert accepts(single, tokenizer, booking) and not accepts(single, tokenizer, f"{weather}; {booking}")


# ---------------------------------------------------------------------------
# Through the chat route


@pytest.fixture(scope="module")
def llama_tokenizer(tmp_path_factory):
    return load_tokenizer(tmp_path_factory, LLAMA_TEMPLATE)


@pytest.fixture(scope="module")
def mistral_tokenizer(tmp_path_factory):
    return load_tokenizer(tmp_path_factory, MISTRAL_TEMPLATE)


def test_the_family_comes_from_the_template_or_the_config(llama_tokenizer, mistral_tokenizer):
    assert tool_format_for(llama_tokenizer) == LLAMA and tool_format_for(mistral_tokenizer) == MISTRAL
    assert tool_format_for(llama_tokenizer, "hermes") == HermesFormat()
    assert TOOL_CALL_PARSERS == ("auto", *FORMAT_NAMES)
    with pytest.raises(ValueError, match="tool_call_parser"):
        handler_config_from_yaml_config({"handler": {"tool_call_parser": "pythonic"}})


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_a_call_the_template_writes_is_one_the_grammar_allows(family, llama_tokenizer, mistral_tokenizer):
    """A call copied from the prompt's history, as the family's template wrote it, is one the grammar forces."""
    tokenizer, tool_format = (llama_tokenizer, LLAMA) if family == "llama" else (mistral_tokenizer, MISTRAL)
    call = openai_call("a1b2c3d4e", "get_weather", {"city": "Nice"})
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "user", "content": "?"}]
    request = parse_openai_request(ROUTE_CHAT, {"messages": messages, "tools": TOOLS}, CONFIG, tokenizer, 4096, "m")
    rendered = tokenizer.decode(list(request.generations[0].prompt_ids))
    pattern = r"\[TOOL_CALLS\] \[.*?\]</s>" if family == "mistral" else r'\{"name": "get_weather", "parameters".*?\}\}'
    written = re.findall(pattern, rendered)[-1].removesuffix("</s>")
    assert accepts(tool_format.grammar(FUNCTIONS, True, {}), tokenizer, written)
    assert named(tool_format.parse(written)[1]) == [("get_weather", {"city": "Nice"})]


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_required_tool_choice_forces_the_familys_grammar(family, llama_tokenizer, mistral_tokenizer):
    tokenizer = llama_tokenizer if family == "llama" else mistral_tokenizer
    body = {"messages": USER, "tools": TOOLS, "tool_choice": "required"}
    request = parse_openai_request(ROUTE_CHAT, body, CONFIG, tokenizer, 4096, "m")
    assert request.tool_format.name == ("llama3_json" if family == "llama" else "mistral")
    assert request.generations[0].constraint is not None
