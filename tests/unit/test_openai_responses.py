"""The Responses route: request translation, the response object, the event stream and the store.

Checked against the `openai` package's own types: every answer validates as a
`Response`, every event as a `ResponseStreamEvent`, and the client's stream
accumulator (`ResponseStreamState`) rebuilds from the events the same response
the plain answer gives.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from openai import omit
from openai.lib.streaming.responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from handler.api.native import RequestError
from handler.api.openai.requests import parse_openai_entry, sampling_defaults
from handler.api.openai.response_answers import ResponsesAnswer
from handler.api.openai.responses import ResponseStore, input_messages, parse_responses_request
from handler.api.openai.routes import ROUTE_RESPONSE, ROUTE_RESPONSES, Route, route_from_url_path
from handler.config import HandlerConfig
from tests.unit.test_openai_answers import FakeResult, stats

CONFIG = HandlerConfig()
MODEL = "tiny"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
EVENTS = TypeAdapter(ResponseStreamEvent)


def parse(body: dict, tokenizer, store: ResponseStore | None = None):
    return parse_responses_request({"model": MODEL, **body}, CONFIG, tokenizer, 4096, MODEL, store)


def result(text: str, finish: str = "stop", token_ids=None) -> FakeResult:
    token_ids = token_ids if token_ids is not None else list(range(len(text)))
    return FakeResult(token_ids, text, finish, 5, stats(0, 0, len(token_ids), len(token_ids)), cached_tokens=2)


class CharTokenizer:
    """Decodes ids into the answer's characters: token i is character i of `text`."""

    def __init__(self, text: str) -> None:
        self.text = text

    def decode(self, token_ids, skip_special_tokens=True):
        return "".join(self.text[i] for i in token_ids)


def stream_events(request, text: str, finish: str = "stop", steps: int = 3) -> list[dict]:
    """The events of a stream that produced `text` over `steps` steps."""
    answer = ResponsesAnswer(request, CharTokenizer(text))
    chunks = []
    cut = [len(text) * (step + 1) // steps for step in range(steps)]
    for end in cut[:-1]:
        chunks.append(answer.on_tokens(0, dataclasses.make_dataclass("Out", ["token_ids"])(list(range(end)))))
    final = result(text, finish)
    chunks.append(answer.on_row_finished(0, final))
    chunks.append(answer.final([final]))
    events = []
    for block in "".join(chunks).split("\n\n"):
        if block:
            kind, data = block.split("\n")
            assert kind.startswith("event: ") and data.startswith("data: ")
            event = json.loads(data[len("data: ") :])
            assert event["type"] == kind[len("event: ") :]
            events.append(event)
    return events


def accumulate(events: list[dict]) -> Response:
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    final = None
    for event in events:
        state.handle_event(EVENTS.validate_python(event))
        if event["type"] in ("response.completed", "response.incomplete"):
            final = Response.model_validate(event["response"])
    return final


# ---------------------------------------------------------------------------
# Requests


def test_the_route_is_v1_responses():
    assert route_from_url_path("v1/responses").kind == ROUTE_RESPONSES
    with pytest.raises(RequestError, match="/v1/responses"):
        parse_openai_entry(Route("unknown", "v1/nope"), b"{}", "application/json", CONFIG, None, 1, MODEL, 0)


def test_a_string_input_and_instructions_are_a_system_and_a_user_message(tiny_tokenizer):
    request = parse({"input": "Hi", "instructions": "Be brief", "max_output_tokens": 9}, tiny_tokenizer)
    assert request.kind == ROUTE_RESPONSES and request.id.startswith("resp_") and len(request.id) > 40
    assert request.generations[0].max_new_tokens == 9
    chat = tiny_tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Hi"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert tiny_tokenizer.decode(request.generations[0].prompt_ids) == chat
    # The stored conversation leaves the instructions out: they are this response's only.
    assert request.responses.messages == ({"role": "user", "content": "Hi"},)


def test_input_items_become_the_chat_messages_they_mean():
    items = [
        {"role": "developer", "content": "Rules"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2", "output": "rain"},
        {
            "type": "message",
            "role": "assistant",
            "id": "msg_1",
            "status": "completed",
            "content": [{"type": "output_text", "text": "Sunny and rain.", "annotations": [], "logprobs": []}],
        },
        {"role": "user", "content": "Thanks"},
    ]
    calls = [
        {"id": f"call_{i}", "type": "function", "function": {"name": "get_weather", "arguments": f'{{"city": "{c}"}}'}}
        for i, c in ((1, "Oslo"), (2, "Rome"))
    ]
    assert input_messages(items) == [
        {"role": "system", "content": "Rules"},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
        {"role": "assistant", "content": "Sunny and rain."},
        {"role": "user", "content": "Thanks"},
    ]


def test_flat_tools_tool_choice_and_text_format_ride_on_the_chat_route(tiny_tokenizer):
    request = parse(
        {"input": "Weather?", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}},
        tiny_tokenizer,
    )
    assert request.tool_format is not None and request.generations[0].constraint is not None
    assert request.responses.tools[0]["name"] == "get_weather"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    structured = parse(
        {"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": schema, "strict": True}}},
        tiny_tokenizer,
    )
    assert structured.generations[0].constraint is not None
    assert structured.responses.text_format["name"] == "a"
    assert parse({"input": "x", "text": {"format": {"type": "json_object"}}}, tiny_tokenizer).generations[0].constraint


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [{"type": "file_search", "vector_store_ids": []}]}, "tools[0].type"),
        ({"tools": [{"type": "computer_use_preview"}]}, "tools[0].type"),
        ({"tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]}, "tools[0].type"),
        ({"tools": [{"type": "mcp", "server_label": "x"}]}, "tools[0].type"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input[0]"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0]"),
        ({"background": True}, "background"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"text": {"format": {"type": "json_schema", "name": "a"}}}, "text.format"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"surprise": 1}, "surprise"),
        ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]}, "tool_choice"),
    ],
)
def test_unsupported_and_bad_fields_get_a_400_naming_them(tiny_tokenizer, fields, field):
    with pytest.raises(RequestError) as raised:
        parse({"input": "x", **fields}, tiny_tokenizer)
    assert raised.value.status == 400
    assert str(raised.value).startswith(f"{field}"), str(raised.value)


def test_neutral_values_of_the_agents_sdk_are_accepted(tiny_tokenizer):
    request = parse(
        {"input": "x", "include": [], "truncation": "disabled", "store": True, "background": False, "metadata": {}},
        tiny_tokenizer,
    )
    assert request.responses.store


# ---------------------------------------------------------------------------
# The store and previous_response_id


def test_previous_response_id_continues_the_stored_conversation(tiny_tokenizer):
    store = ResponseStore()
    first = parse({"input": "Hi", "instructions": "Be brief"}, tiny_tokenizer, store)
    body = ResponsesAnswer(first, tiny_tokenizer).final([result("Hello!")])
    assert body["id"] in store.entries
    second = parse({"input": "And you?", "previous_response_id": body["id"]}, tiny_tokenizer, store)
    assert [m["content"] for m in second.responses.messages] == ["Hi", "Hello!", "And you?"]
    assert second.responses.previous_response_id == body["id"]
    # The prompt is the re-sent chat history's: the prefix cache finds it the same way.
    resent = tiny_tokenizer.apply_chat_template(
        list(second.responses.messages), tokenize=False, add_generation_prompt=True
    )
    assert tiny_tokenizer.decode(second.generations[0].prompt_ids) == resent


def test_unknown_and_unstored_ids_get_a_404_naming_the_id(tiny_tokenizer):
    store = ResponseStore()
    unstored = parse({"input": "Hi", "store": False}, tiny_tokenizer, store)
    body = ResponsesAnswer(unstored, tiny_tokenizer).final([result("Hello!")])
    assert len(store) == 0 and body["store"] is False
    for response_id in (body["id"], "resp_nope"):
        with pytest.raises(RequestError) as raised:
            parse({"input": "x", "previous_response_id": response_id}, tiny_tokenizer, store)
        assert raised.value.status == 404 and response_id in str(raised.value)


def test_the_store_is_bounded_in_count_and_bytes_least_recently_used_out_first():
    store = ResponseStore(max_entries=2, max_bytes=10_000)
    store.put("a", [{"role": "user", "content": "a"}], {"id": "a"})
    store.put("b", [{"role": "user", "content": "b"}], {"id": "b"})
    assert store.get("a") is not None  # a is now the most recently used
    store.put("c", [{"role": "user", "content": "c"}], {"id": "c"})
    assert list(store.entries) == ["a", "c"] and store.num_evictions == 1
    big = [{"role": "user", "content": "x" * 6000}]
    store.put("d", big, {"id": "d"})
    store.put("e", big, {"id": "e"})
    assert list(store.entries) == ["e"]
    assert store.num_bytes == len(json.dumps(big)) + len(json.dumps({"id": "e"})) <= 10_000
    assert not store.put("f", [{"role": "user", "content": "x" * 20_000}], {"id": "f"})  # alone over the bound
    assert "f" not in store.entries
    assert not ResponseStore(max_entries=0).put("g", [], {"id": "g"})


def test_left_out_temperature_and_top_p_take_the_defaults_and_the_response_echoes_them(tiny_tokenizer):
    defaults = sampling_defaults({"temperature": 0.7, "top_p": 0.8})
    request = parse_responses_request({"input": "Hi"}, CONFIG, tiny_tokenizer, 4096, MODEL, None, defaults)
    assert (request.generations[0].sampling.temperature, request.generations[0].sampling.top_p) == (0.7, 0.8)
    body = ResponsesAnswer(request, tiny_tokenizer).final([result("Hello")])
    assert (body["temperature"], body["top_p"]) == (0.7, 0.8)
    openai_s = parse({"input": "Hi"}, tiny_tokenizer)  # no generation config: OpenAI's defaults
    assert ResponsesAnswer(openai_s, tiny_tokenizer).final([result("Hello")])["temperature"] == 1.0
    own = parse({"input": "Hi", "temperature": 0}, tiny_tokenizer)
    assert own.generations[0].sampling.temperature == 0.0


# ---------------------------------------------------------------------------
# GET and DELETE v1/responses/{id}

SDK_HEADERS = {"x-stainless-lang": "python", "x-stainless-package-version": "3.51.0"}


@pytest.mark.parametrize(
    "headers, delete",
    [
        ({}, False),
        ({"Accept": "*/*"}, False),  # curl's GET
        ({**SDK_HEADERS, "accept": "application/json"}, False),  # the SDKs' responses.retrieve
        ({**SDK_HEADERS, "accept": "*/*", "content-type": "application/json"}, True),  # their responses.delete
        ({"X-HTTP-Method-Override": "DELETE"}, True),
        ({"x-http-method-override": "delete"}, True),
        ({"X-HTTP-Method-Override": "GET", "Accept": "*/*"}, False),
    ],
)
def test_v1_responses_id_is_a_retrieval_unless_the_headers_say_delete(headers, delete):
    route = route_from_url_path("v1/responses/resp_abc/", headers)
    assert (route.kind, route.response_id, route.delete) == (ROUTE_RESPONSE, "resp_abc", delete)
    assert route_from_url_path("v1/responses/resp_abc/input_items").kind == "unknown"


def stored_entry(route_path: str, store: ResponseStore, headers=None, body=b""):
    from handler.api.entry import parse_entry

    route = route_from_url_path(route_path, headers)
    return parse_entry({"body": body}, None, CONFIG, None, 4096, route, MODEL, created=1, response_store=store)


def test_get_returns_the_stored_response_and_delete_forgets_it(tiny_tokenizer):
    store = ResponseStore()
    for stream in (False, True):
        request = parse({"input": "Hi", "stream": stream}, tiny_tokenizer, store)
        answer = ResponsesAnswer(request, CharTokenizer("Hello there"))
        final = answer.final([result("Hello there")])
        answered = final if not stream else json.loads(final.rsplit("data: ", 1)[1])["response"]
        got = stored_entry(f"v1/responses/{request.id}", store)
        assert got.status == 200 and got.content_type == "application/json"
        assert got.body == answered and Response.model_validate(got.body).output_text == "Hello there"
        num_bytes = store.num_bytes
        deleted = stored_entry(f"v1/responses/{request.id}", store, {**SDK_HEADERS, "accept": "*/*"})
        assert deleted.status == 200
        assert deleted.body == {"id": request.id, "object": "response.deleted", "deleted": True}
        assert request.id not in store.entries and store.num_bytes < num_bytes
        with pytest.raises(RequestError) as raised:
            parse({"input": "More", "previous_response_id": request.id}, tiny_tokenizer, store)
        assert raised.value.status == 404, "a deleted response cannot be continued"
    assert store.num_bytes == 0 and store.num_evictions == 0


@pytest.mark.parametrize("headers", [None, {"X-HTTP-Method-Override": "DELETE"}])
def test_an_unknown_or_deleted_id_gets_openai_s_404(headers):
    store = ResponseStore()
    store.put("resp_kept", [{"role": "user", "content": "a"}], {"id": "resp_kept"})
    reply = stored_entry("v1/responses/resp_nope", store, headers)
    assert reply.status == 404
    error = reply.body["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "response_id" and error["code"] is None
    assert "resp_nope" in error["message"] and "not found" in error["message"]
    assert list(store.entries) == ["resp_kept"]
    assert stored_entry("v1/responses/resp_nope", None, headers).status == 404, "no store: nothing stored"


def test_a_body_on_v1_responses_id_is_a_400_and_deletes_nothing():
    store = ResponseStore()
    store.put("resp_kept", [{"role": "user", "content": "a"}], {"id": "resp_kept"})
    reply = stored_entry("v1/responses/resp_kept", store, {"X-HTTP-Method-Override": "DELETE"}, {"input": "x"})
    assert reply.status == 400 and reply.body["error"]["param"] is None and "body" in reply.body["error"]["message"]
    assert "resp_kept" in store.entries


# ---------------------------------------------------------------------------
# Answers and streams


def test_a_plain_answer_is_a_response_with_a_message_and_usage(tiny_tokenizer):
    request = parse({"input": "Hi"}, tiny_tokenizer)
    body = ResponsesAnswer(request, tiny_tokenizer).final([result("Hello there")])
    response = Response.model_validate(body)
    assert response.status == "completed" and response.output_text == "Hello there"
    assert response.output[0].type == "message" and response.output[0].content[0].text == "Hello there"
    assert response.usage.input_tokens == 5 and response.usage.output_tokens == 11
    assert response.usage.input_tokens_details.cached_tokens == 2
    assert body["speculative"]["target_forward_passes"] == 11
    length = ResponsesAnswer(request, tiny_tokenizer).final([result("Hel", "length")])
    assert length["status"] == "incomplete" and length["incomplete_details"] == {"reason": "max_output_tokens"}


def test_tool_calls_are_function_call_items(tiny_tokenizer):
    request = parse({"input": "Weather?", "tools": [WEATHER]}, tiny_tokenizer)
    text = 'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    body = ResponsesAnswer(request, tiny_tokenizer).final([result(text)])
    response = Response.model_validate(body)
    message, call = response.output
    assert message.content[0].text == "Let me look."
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert json.loads(call.arguments) == {"city": "Oslo"}


@pytest.mark.parametrize("steps", [1, 2, 5])
def test_a_stream_is_the_documented_event_sequence_and_adds_up_to_the_plain_answer(tiny_tokenizer, steps):
    text = 'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    request = dataclasses.replace(parse({"input": "Weather?", "tools": [WEATHER]}, tiny_tokenizer), stream=True)
    events = stream_events(request, text, steps=steps)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-1] == "response.completed"
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert "".join(deltas) == "Let me look."
    call_events = kinds[kinds.index("response.function_call_arguments.delta") - 1 :]
    assert call_events[:4] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    assert kinds.index("response.output_text.done") < kinds.index("response.function_call_arguments.delta")
    final = accumulate(events)
    assert final.output_text == "Let me look."
    [call] = [item for item in final.output if item.type == "function_call"]
    assert json.loads(call.arguments) == {"city": "Oslo"}


def test_a_stream_that_runs_out_of_tokens_ends_incomplete(tiny_tokenizer):
    request = dataclasses.replace(parse({"input": "Hi"}, tiny_tokenizer), stream=True)
    events = stream_events(request, "Hello wor", finish="length")
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert accumulate(events).output_text == "Hello wor"


def test_an_error_after_the_stream_began_is_an_error_event(tiny_tokenizer):
    request = dataclasses.replace(parse({"input": "Hi"}, tiny_tokenizer), stream=True)
    answer = ResponsesAnswer(request, tiny_tokenizer)
    answer.on_tokens(0, dataclasses.make_dataclass("Out", ["token_ids"])([]))
    event = answer.error_after_start(RequestError("server: the worker failed", 500))
    payload = json.loads(event.split("\n")[1][len("data: ") :])
    assert payload["type"] == "error" and payload["message"] == "server: the worker failed"
    EVENTS.validate_python(payload)


def test_both_schedules_serve_the_route_plain_and_streamed(tiny_tokenizer):
    """The static batch and the continuous batcher answer a Responses request as they answer chat."""
    from handler.api.entry import parse_entry
    from handler.metrics import MetricsRecorder
    from handler.serving import StaticBatch
    from tests.unit.test_serving import TOKENIZER, FakeGenerateEngine, Harness, RecordingMetrics

    route = route_from_url_path("v1/responses")
    store = ResponseStore()

    def entry(body: dict):
        return parse_entry({"body": {"model": MODEL, **body}}, "application/json", CONFIG, tiny_tokenizer, 4096,
                           route, MODEL, created=1, response_store=store)  # fmt: skip

    engine = FakeGenerateEngine()
    entries = [
        entry({"input": "a", "max_output_tokens": 5}),
        entry({"input": "b", "max_output_tokens": 5, "stream": True}),
    ]
    sent = []
    replies = StaticBatch(engine, TOKENIZER).run(
        entries, lambda index, text, _: sent.append(text), MetricsRecorder(RecordingMetrics())
    )
    plain = Response.model_validate(replies[0].body)
    assert plain.output_text == engine.solo_text(entries[0].generations[0]) and plain.status == "incomplete"
    events = [
        json.loads(block.split("\n")[1][len("data: ") :])
        for block in "".join([*sent, replies[1].body]).split("\n\n")
        if block
    ]
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.incomplete"
    assert accumulate(events).output_text == engine.solo_text(entries[1].generations[0])
    assert len(store) == 2

    batcher = Harness().batcher
    batcher.tokenizer = TOKENIZER
    new = {"c": entry({"input": "c", "max_output_tokens": 4, "stream": True})}
    bodies = []
    for _ in range(10):
        [reply] = batcher.run_call(["c"], new, MetricsRecorder(RecordingMetrics()))
        bodies.append(reply.body)
        new = {}
        if reply.more is False:
            break
    events = [json.loads(block.split("\n")[1][len("data: ") :]) for block in "".join(bodies).split("\n\n") if block]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == "response.incomplete" and len(store) == 3
