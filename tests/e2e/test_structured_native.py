"""End-to-end: structured output on the native route, plain and streamed, beside free requests, and its metrics."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema

from .conftest import counter
from .test_streaming_and_metrics import check_stream_equals_plain, stream

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_json_schema_regex_and_grammar_requests_match_beside_free_ones(server):
    bodies = [
        {"prompt": "A person:", "json_schema": PERSON, "max_new_tokens": 80, "temperature": 0},
        {"prompt": "Today is", "regex": "[0-9]{4}-[0-9]{2}-[0-9]{2}", "max_new_tokens": 30, "temperature": 0.8},
        {"prompt": "Answer:", "grammar": 'start: "yes" | "no"', "max_new_tokens": 10},
        {"prompt": "def fibonacci(n):", "max_new_tokens": 12},
    ]
    before = counter(server, "SpecConstrainedRequests")
    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(server.predict_ok, bodies))
    assert all(answer["finish_reason"] == "eos" for answer in answers[:3]), answers
    jsonschema.validate(json.loads(answers[0]["text"]), PERSON)
    assert re.fullmatch("[0-9]{4}-[0-9]{2}-[0-9]{2}", answers[1]["text"])
    assert answers[2]["text"] in ("yes", "no")
    assert answers[3]["text"] == server.predict_ok(bodies[3])["text"]  # the free row is unchanged beside them
    assert "grammar" in answers[0]["speculative"]["by_drafter"]  # '{"name": "' is forced
    assert counter(server, "SpecConstrainedRequests") - before == 3


def test_a_streamed_constrained_answer_equals_the_plain_one(server):
    body = {"prompt": "A person:", "json_schema": PERSON, "max_new_tokens": 80, "temperature": 0}
    lines, _ = stream(server, body)
    check_stream_equals_plain(lines, server.predict_ok(body))


def test_a_bad_constraint_is_a_400_naming_its_field(server):
    for body, field in (
        ({"prompt": "x", "regex": "(("}, "regex"),
        ({"prompt": "x", "json_schema": {"type": "strin"}}, "json_schema"),
        ({"prompt": "x", "grammar": "start: ("}, "grammar"),
        ({"prompt": "x", "regex": "a", "grammar": 'start: "a"'}, "grammar"),
    ):
        response = server.predict(body)
        assert response.status_code == 400, response.text
        assert response.json()["error"].startswith(field + ":"), response.text
