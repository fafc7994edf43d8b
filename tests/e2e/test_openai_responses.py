"""End-to-end: the Responses route through a real TorchServe, with the official `openai` client and the
OpenAI Agents SDK's default model (`OpenAIResponsesModel`).

The tiny random model does not choose to call a tool on its own, so the checks
that need a call force one (`tool_choice: "required"`); schemas bound their
strings so that a random model finishes well within its tokens.
"""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pytest
import requests

from .conftest import HTTP_TIMEOUT_S, counter

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 6}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "name": "get_weather", "parameters": WEATHER_PARAMETERS, "strict": True}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "maximum": 99}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def create(client, server, **fields):
    fields.setdefault("input", "Tell me a story.")
    fields.setdefault("max_output_tokens", 12)
    fields.setdefault("temperature", 0)
    return client.responses.create(model=server.model_name, **fields)


def test_a_response_and_its_stream_give_the_same_greedy_text(client, server):
    plain = create(client, server, instructions="Be brief.")
    assert plain.object == "response" and plain.id.startswith("resp_")
    assert plain.status in ("completed", "incomplete") and plain.output_text
    assert plain.usage.output_tokens > 0 and plain.usage.input_tokens > 0
    events = list(create(client, server, instructions="Be brief.", stream=True))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] == f"response.{plain.status}"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == events[-1].response.output_text == plain.output_text


def test_a_tool_loop_through_function_call_output(client, server):
    question = [{"role": "user", "content": "What's the weather in Oslo?"}]
    first = create(
        client,
        server,
        input=question,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=120,
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and first.status == "completed", first.output
    call = calls[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)
    answer = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}
    second = create(client, server, input=[*question, *first.output, answer], tools=[WEATHER], tool_choice="none")
    assert second.status in ("completed", "incomplete") and second.output_text
    assert not [item for item in second.output if item.type == "function_call"]


def test_text_format_json_schema_answers_validate(client, server):
    text = {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}
    answer = create(client, server, text=text, max_output_tokens=80)
    assert answer.status == "completed"
    jsonschema.validate(json.loads(answer.output_text), PERSON)


def test_previous_response_id_continues_the_conversation_from_the_prefix_cache(client, server):
    first = create(client, server, input="Tell me a story about a fox.", max_output_tokens=8)
    second = create(client, server, input="And then?", previous_response_id=first.id, max_output_tokens=8)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    # The earlier prompt and answer are a prefix of the new prompt: their KV is reused.
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    # The store's size is on /metrics (metrics go out at the end of each handler call).
    assert counter(server, "SpecResponsesStored") >= 1 and counter(server, "SpecResponsesStoreBytes") > 0
    unstored = create(client, server, store=False, max_output_tokens=4)
    for response_id in (unstored.id, "resp_unknown"):
        with pytest.raises(openai.NotFoundError, match=response_id):
            create(client, server, input="x", previous_response_id=response_id)


def test_a_stored_response_is_retrieved_and_deleted_through_the_client(client, server):
    """TorchServe passes GET and DELETE on the model's path to the handler, without the method: the SDK's
    delete says so by its headers, and a retrieval changes nothing."""
    made = create(client, server, input="Tell me a story about an owl.", max_output_tokens=6)
    for _ in range(2):
        got = client.responses.retrieve(made.id)
        assert got.model_dump() == made.model_dump(), "the response object as it was answered"
    assert client.responses.delete(made.id) is None  # the SDK reads no body from a delete
    for call in (client.responses.retrieve, client.responses.delete):
        with pytest.raises(openai.NotFoundError) as raised:
            call(made.id)
        assert raised.value.status_code == 404
        assert raised.value.body["type"] == "invalid_request_error" and raised.value.body["param"] == "response_id"
        assert made.id in raised.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        create(client, server, input="x", previous_response_id=made.id)


def test_retrieve_and_delete_over_plain_http(client, server, base_url):
    made = create(client, server, input="Tell me a story about a cat.", max_output_tokens=4)
    url = f"{base_url}/responses/{made.id}"
    got = requests.get(url, timeout=HTTP_TIMEOUT_S)
    assert got.status_code == 200 and got.json()["id"] == made.id and got.json()["output_text"] == made.output_text
    # A DELETE that does not say so in its headers reaches the handler as a retrieval: nothing is deleted.
    plain_delete = requests.delete(url, timeout=HTTP_TIMEOUT_S)
    assert plain_delete.status_code == 200 and plain_delete.json()["object"] == "response"
    override = {"X-HTTP-Method-Override": "DELETE"}
    deleted = requests.delete(url, headers=override, timeout=HTTP_TIMEOUT_S)
    assert deleted.status_code == 200
    assert deleted.json() == {"id": made.id, "object": "response.deleted", "deleted": True}
    gone = requests.get(url, timeout=HTTP_TIMEOUT_S)
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "response_id"
    assert requests.delete(url, headers=override, timeout=HTTP_TIMEOUT_S).status_code == 404


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools[0].type"),
        ({"tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]}, "tools[0].type"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]}, "input"),
        ({"background": True}, "background"),
        ({"conversation": "conv_1"}, "conversation"),
    ],
)
def test_unsupported_fields_are_a_bad_request_naming_the_field(client, server, fields, field):
    with pytest.raises(openai.BadRequestError) as raised:
        create(client, server, **fields)
    assert raised.value.body["param"].startswith(field), raised.value.body


def test_the_agents_sdk_default_model_runs_a_function_tool_agent_to_its_final_output(base_url, server):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)  # the trace exporter would send to OpenAI
    agents.set_default_openai_client(
        openai.AsyncOpenAI(base_url=base_url, api_key="unused", timeout=HTTP_TIMEOUT_S, max_retries=0),
        use_for_tracing=False,
    )
    seen = []

    @agents.function_tool
    def get_weather(city: Literal["Oslo", "Paris"]) -> str:
        """The weather in a city."""
        seen.append(city)
        return f"Sunny in {city}"

    agent = agents.Agent(
        name="weather",
        instructions="Answer with the weather tool.",
        model=server.model_name,  # a name: the default provider serves it with OpenAIResponsesModel
        tools=[get_weather],
        model_settings=agents.ModelSettings(
            tool_choice="required", parallel_tool_calls=False, max_tokens=120, temperature=0
        ),
        tool_use_behavior="stop_on_first_tool",
    )
    result = agents.Runner.run_sync(agent, "What's the weather in Oslo?")
    assert len(seen) == 1 and result.final_output == f"Sunny in {seen[0]}"
    assert isinstance(agent.model, str)
    [response] = result.raw_responses
    assert response.response_id.startswith("resp_")


def test_the_demo_sends_a_response_and_continues_it(server):
    import io

    from scripts.serving import openai_demo

    out = io.StringIO()
    first, second = openai_demo.run_responses(server.inference_url, server.model_name, None, max_tokens=6, out=out)
    assert second.previous_response_id == first.id
    assert "input tokens from the prefix cache" in out.getvalue()
