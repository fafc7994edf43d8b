"""The OpenAI Responses API's answers: output items, the `response` object, streamed events.

`ResponsesAnswer` builds a Responses request's answer (`handler.api.openai.responses` parses the
request): a `response` whose `output` holds a `message` item with its `output_text` and one
`function_call` item per call, or the documented event sequence of a stream, each event with its
`sequence_number`. What it answered goes into the store, so that `previous_response_id` continues it
and `GET v1/responses/{id}` returns it.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from handler.api.openai.answers import SSE_CONTENT_TYPE
from handler.api.openai.requests import OpenAIRequest
from handler.api.openai.responses import new_id
from handler.api.openai.routes import ROUTE_RESPONSES, error_answer
from handler.api.openai.tool_formats import ToolCall
from handler.schema import JSON_CONTENT_TYPE, RequestError
from handler.streaming import DeltaTracker
from handler.types import GenerationResult


def usage(result: GenerationResult) -> dict:
    return {
        "input_tokens": result.prompt_tokens,
        # cache_write_tokens: not counted (the prefix cache keeps every prompt it has room for).
        "input_tokens_details": {"cached_tokens": result.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": len(result.token_ids),
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": result.prompt_tokens + len(result.token_ids),
    }


def message_item(item_id: str, text: str, status: str = "completed") -> dict:
    content = (
        [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" else []
    )
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def function_call_item(item_id: str, call: ToolCall, status: str = "completed") -> dict:
    arguments = call.arguments if status == "completed" else ""
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call.id,
        "name": call.name,
        "arguments": arguments,
        "status": status,
    }


def output_text(items: Sequence[dict]) -> str:
    return "".join(
        part["text"] for item in items if item["type"] == "message" for part in item["content"] if "text" in part
    )


def response_object(
    request: OpenAIRequest, status: str, items: Sequence[dict], result: GenerationResult | None = None
) -> dict:
    """The `response` object: its settings echoed, and its output, usage and statistics once done."""
    context = request.responses
    incomplete = None
    if status == "incomplete":
        incomplete = {"reason": "max_output_tokens"}
    text_format = context.text_format
    return {
        "id": request.id,
        "object": "response",
        "created_at": request.created,
        "status": status,
        "error": None,
        "incomplete_details": incomplete,
        "instructions": context.instructions,
        "max_output_tokens": context.max_output_tokens,
        "model": request.model,
        "output": list(items),
        "output_text": output_text(items),
        "parallel_tool_calls": context.parallel_tool_calls,
        "previous_response_id": context.previous_response_id,
        "reasoning": None,
        "store": context.store,
        "temperature": context.temperature,
        "text": {"format": text_format},
        "tool_choice": context.tool_choice,
        "tools": list(context.tools),
        "top_p": context.top_p,
        "truncation": "disabled",
        "usage": None if result is None else usage(result),
        "user": None,
        "metadata": context.metadata,
        "speculative": None if result is None else result.stats.as_dict(),
    }


def _status(result: GenerationResult) -> str:
    return "incomplete" if result.finish_reason == "length" else "completed"


def conversation_after(request: OpenAIRequest, items: Sequence[dict]) -> list[dict]:
    """The chat messages of a response's conversation, its output included, as the store keeps them."""
    messages = [dict(message) for message in request.responses.messages]
    text = output_text(items)
    calls = [
        {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
        for item in items
        if item["type"] == "function_call"
    ]
    assistant: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        assistant["tool_calls"] = calls
    return [*messages, assistant]


class ResponsesAnswer:
    """A Responses request's answer as `handler.serving` builds it: a `response` object, or its events.

    The same surface as `handler.api.openai.answers.OpenAIAnswer` (`handler.api.entry.Answer`).
    A stream sends `response.created` and `response.in_progress` first, then each output item as
    it forms: a message's text deltas as they come (held back as on the chat stream, so that the
    deltas joined equal the final text), a function call once it is complete; then
    `response.completed`, or `response.incomplete` when the output ran out of tokens.
    """

    def __init__(self, request: OpenAIRequest, tokenizer) -> None:
        assert request.kind == ROUTE_RESPONSES and len(request.generations) == 1
        self.request = request
        self.generations = request.generations
        self.stream = request.stream
        self.content_type = SSE_CONTENT_TYPE if request.stream else JSON_CONTENT_TYPE
        generation = request.generations[0]
        self.deltas = DeltaTracker(tokenizer, generation.stop)
        self.tool_stream = None if request.tool_format is None else request.tool_format.stream(request.max_tool_calls)
        self.items: list[dict] = []  # the output items so far, completed or in progress
        self.open_message: dict | None = None  # the message item receiving text
        self.sequence_number = 0
        self.started = False
        self.finished = False

    # -- the Answer surface

    def on_tokens(self, row: int, output) -> str:
        if not self.stream:
            return ""
        delta = self.deltas.next_delta(output.token_ids)
        return self._preamble() + self._text_and_calls(delta)

    def on_row_finished(self, row: int, result: GenerationResult) -> str:
        if not self.stream:
            return ""
        self.finished = True
        delta = self.deltas.final_delta(result.text)
        events = self._preamble() + self._text_and_calls(delta, finish=True) + self._close_message()
        return events

    def final(self, results: Sequence[GenerationResult]) -> dict | str:
        [result] = results
        if not self.stream:
            items = self._items_of(result)
            body = response_object(self.request, _status(result), items, result)
            self._store(items, body)
            return body
        events = "" if self.finished else self.on_row_finished(0, result)
        status = _status(result)
        body = response_object(self.request, status, self.items, result)
        self._store(self.items, body)
        return events + self._event(f"response.{status}", {"response": body})

    def error(self, error: RequestError) -> tuple[int, dict]:
        return error_answer(error)

    def error_after_start(self, error: RequestError) -> str:
        if not self.stream:
            return json.dumps(error_answer(error)[1])
        body = error_answer(error)[1]["error"]
        return self._event("error", {"code": body["code"], "message": body["message"], "param": body["param"]})

    # -- building

    def _items_of(self, result: GenerationResult) -> list[dict]:
        text, calls = result.text, []
        if self.request.tool_format is not None:
            text, calls = self.request.tool_format.parse(result.text, self.request.max_tool_calls)
        items = [message_item(new_id("msg"), text)] if text else []
        return items + [function_call_item(new_id("fc"), call) for call in calls]

    def _store(self, items: Sequence[dict], response: dict) -> None:
        context = self.request.responses
        if context.store and context.response_store is not None:
            context.response_store.put(self.request.id, conversation_after(self.request, items), response)

    # -- streaming

    def _event(self, kind: str, fields: dict) -> str:
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        self.started = True
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    def _preamble(self) -> str:
        if self.sequence_number:
            return ""
        body = response_object(self.request, "in_progress", [])
        return self._event("response.created", {"response": body}) + self._event(
            "response.in_progress", {"response": body}
        )

    def _text_and_calls(self, delta: str, finish: bool = False) -> str:
        calls: list[ToolCall] = []
        if self.tool_stream is not None:
            delta, calls = self.tool_stream.feed(delta)
            if finish:
                rest, more = self.tool_stream.finish()
                delta, calls = delta + rest, calls + more
        events = self._text(delta) if delta else ""
        if calls:
            events += self._close_message()
        for call in calls:
            events += self._call(call)
        return events

    def _text(self, delta: str) -> str:
        events = ""
        if self.open_message is None:
            self.open_message = message_item(new_id("msg"), "", status="in_progress")
            self.items.append(self.open_message)
            events += self._event(
                "response.output_item.added", {"output_index": len(self.items) - 1, "item": dict(self.open_message)}
            )
            events += self._event(
                "response.content_part.added",
                {**self._where(), "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}},
            )
            self.open_message["content"] = [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]
        self.open_message["content"][0]["text"] += delta
        return events + self._event("response.output_text.delta", {**self._where(), "delta": delta, "logprobs": []})

    def _where(self) -> dict:
        index = self.items.index(self.open_message)
        return {"item_id": self.open_message["id"], "output_index": index, "content_index": 0}

    def _close_message(self) -> str:
        message = self.open_message
        if message is None:
            return ""
        where = self._where()
        part = message["content"][0]
        message["status"] = "completed"
        self.open_message = None
        return (
            self._event("response.output_text.done", {**where, "text": part["text"], "logprobs": []})
            + self._event("response.content_part.done", {**where, "part": part})
            + self._event("response.output_item.done", {"output_index": where["output_index"], "item": message})
        )

    def _call(self, call: ToolCall) -> str:
        item = function_call_item(new_id("fc"), call, status="in_progress")
        self.items.append(item)
        index = len(self.items) - 1
        where = {"item_id": item["id"], "output_index": index}
        events = self._event("response.output_item.added", {"output_index": index, "item": dict(item)})
        events += self._event("response.function_call_arguments.delta", {**where, "delta": call.arguments})
        events += self._event("response.function_call_arguments.done", {**where, "arguments": call.arguments})
        item.update(arguments=call.arguments, status="completed")
        return events + self._event("response.output_item.done", {"output_index": index, "item": item})
