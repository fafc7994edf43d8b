"""End-to-end: tool calls and `response_format` through a real TorchServe, with the official `openai` client.

The tiny random model does not choose to call a tool on its own, so the
checks that need calls force them (`tool_choice: "required"` or a named
function); the output is then constrained, and every call's arguments must
validate against its function's parameters. Strings are bounded in the
schemas so that a random model finishes well within max_tokens.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from .conftest import HTTP_TIMEOUT_S

MODEL_VERSION = "1.0"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
QUESTION = [{"role": "user", "content": "What's the weather in Oslo?"}]
PERSON_FORMAT = {
    "type": "json_schema",
    "json_schema": {
        "name": "person",
        "strict": True,
        "schema": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "maximum": 99}},
            "required": ["name", "age"],
            "additionalProperties": False,
        },
    },
}
MAX_TOKENS = 120


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    base_url = f"{server.inference_url}/predictions/{server.model_name}/{MODEL_VERSION}/v1"
    return openai.OpenAI(base_url=base_url, api_key="unused", timeout=HTTP_TIMEOUT_S, max_retries=0)


def chat(client, server, **fields):
    fields.setdefault("messages", QUESTION)
    fields.setdefault("max_completion_tokens", MAX_TOKENS)
    fields.setdefault("temperature", 0)
    return client.chat.completions.create(model=server.model_name, **fields)


def check_calls(calls, names=None) -> None:
    assert calls, "no tool calls"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def test_required_tool_choice_gives_calls_whose_arguments_validate(client, server):
    answer = chat(client, server, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    check_calls(choice.message.tool_calls)
    # With parallel calls allowed, a random model may go on calling until max_tokens; every call it
    # completed still validates.
    answer = chat(client, server, tools=TOOLS, tool_choice="required")
    assert answer.choices[0].finish_reason in ("tool_calls", "length")
    check_calls(answer.choices[0].message.tool_calls)


def test_a_named_function_gives_exactly_that_call(client, server):
    answer = chat(client, server, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls = answer.choices[0].message.tool_calls
    assert len(calls) == 1
    check_calls(calls, names={"get_time"})
    assert answer.choices[0].finish_reason == "tool_calls"


def test_parallel_tool_calls_false_gives_one_call_and_true_may_give_several(client, server):
    single = chat(
        client, server, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=3
    )
    assert len(single.choices[0].message.tool_calls) == 1
    check_calls(single.choices[0].message.tool_calls)
    several = chat(
        client, server, tools=TOOLS, tool_choice="required", parallel_tool_calls=True, temperature=1.0, seed=3
    )
    if several.choices[0].finish_reason == "tool_calls":
        check_calls(several.choices[0].message.tool_calls)
    ids = [call.id for call in several.choices[0].message.tool_calls or []]
    assert len(ids) == len(set(ids))


def test_tool_choice_none_and_auto_answer_without_forcing_a_call(client, server):
    none = chat(client, server, tools=TOOLS, tool_choice="none", max_completion_tokens=12)
    assert none.choices[0].message.tool_calls is None
    assert none.choices[0].finish_reason in ("stop", "length")
    auto = chat(client, server, tools=TOOLS, max_completion_tokens=12)
    message = auto.choices[0].message
    if message.tool_calls:  # whatever the model chose, a parsed call must validate
        check_calls(message.tool_calls)
    else:
        assert isinstance(message.content, str)


def test_a_tool_result_sent_back_is_answered(client, server):
    first = chat(client, server, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    [call] = first.choices[0].message.tool_calls
    history = [
        *QUESTION,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": call.id, "type": "function", "function": call.function.model_dump()}],
        },
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 4, "sky": "cloudy"})},
    ]
    answer = chat(client, server, messages=history, tools=TOOLS, max_completion_tokens=12)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens


def test_streamed_tool_calls_rebuild_the_plain_answer(client, server):
    fields = dict(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    plain = chat(client, server, **fields).choices[0]
    calls: dict[int, dict] = {}
    finish_reason = None
    for chunk in chat(client, server, stream=True, **fields):
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = delta.id or call["id"]
                if delta.function is not None:
                    call["name"] += delta.function.name or ""
                    call["arguments"] += delta.function.arguments or ""
            finish_reason = choice.finish_reason or finish_reason
    assert finish_reason == "tool_calls"
    rebuilt = [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)]
    expected = [(c.function.name, json.loads(c.function.arguments)) for c in plain.message.tool_calls]
    assert rebuilt == expected
    assert all(call["id"] and call["id"].startswith("call_") for call in calls.values())


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_response_format_json_schema_validates(client, server, stream):
    schema = PERSON_FORMAT["json_schema"]["schema"]
    if stream:
        parts = [
            choice.delta.content or ""
            for chunk in chat(client, server, response_format=PERSON_FORMAT, stream=True)
            for choice in chunk.choices
        ]
        text = "".join(parts)
    else:
        text = chat(client, server, response_format=PERSON_FORMAT).choices[0].message.content
    jsonschema.validate(json.loads(text), schema)


def test_response_format_json_object_gives_an_object(client, server):
    # Any object: a random model may write long strings, so only its start is checked when it runs out.
    answer = chat(client, server, response_format={"type": "json_object"}, max_completion_tokens=40)
    text = answer.choices[0].message.content
    assert text.startswith("{")
    if answer.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize(
    "fields",
    [
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        {"tools": [], "tool_choice": "required"},
    ],
)
def test_bad_schemas_and_tools_raise_bad_request(client, server, fields):
    with pytest.raises(openai.BadRequestError) as raised:
        chat(client, server, **fields)
    assert raised.value.status_code == 400
    assert raised.value.body["message"]
