"""The OpenAI-compatible API, answers side: response bodies, logprobs, usage and SSE chunks.

Our finish reasons map onto OpenAI's: `eos` and `stop` are `stop`, `length`
stays `length`, and a chat choice that made tool calls and did not stop for
length finished with `tool_calls`. The speculative counters ride in an extra
`speculative` field: the request's totals in a plain answer, each choice's own
in the streamed chunk that finishes it.

Tool calls (`OpenAIRequest.tool_format`) are parsed out of a choice's text:
`message.tool_calls` holds them and `message.content` the text outside them
(null when empty). A stream sends each call once it is complete, as OpenAI
does: a delta with its index, id, type, name and empty arguments, then one
with the arguments.

Logprobs are the target's log-softmax of its raw logits (before temperature,
top-k and top-p) at each emitted token, as the engine reports them in
`GenerationResult.logprobs`. Token texts and bytes: see `TokenTexts`.
"""

from __future__ import annotations

import codecs
import json
from typing import Sequence

from handler.api.openai.requests import OpenAIRequest
from handler.api.openai.routes import ROUTE_CHAT, error_answer
from handler.api.openai.tool_formats import ToolCall
from handler.detokenizer import REPLACEMENT_CHARACTER
from handler.schema import JSON_CONTENT_TYPE, RequestError
from handler.streaming import DeltaTracker
from handler.token_bytes import piece_bytes
from handler.types import GenerationResult, SpeculativeStats

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}
FINISH_TOOL_CALLS = "tool_calls"
# JSON has no -Infinity; OpenAI reports impossible tokens at -9999.
MIN_LOGPROB = -9999.0
DONE_EVENT = "data: [DONE]\n\n"
SSE_CONTENT_TYPE = "text/event-stream"


def finish_reason(reason: str, made_tool_calls: bool = False) -> str:
    """OpenAI's name for an engine finish reason (unknown ones pass through).

    A choice that made tool calls finished with `tool_calls`, unless it ran
    out of tokens (or was aborted).
    """
    openai_reason = FINISH_REASONS.get(reason, reason)
    return FINISH_TOOL_CALLS if made_tool_calls and openai_reason == "stop" else openai_reason


def usage(request: OpenAIRequest, results: Sequence[GenerationResult]) -> dict:
    """Prompt tokens once per prompt, as OpenAI counts them for n > 1; completion tokens of every choice.

    `prompt_tokens_details.cached_tokens`: of the prompt tokens, those whose KV came from the
    prefix cache, also once per prompt (its first choice's).
    """
    firsts = [results[prompt * request.n] for prompt in range(request.num_prompts)]
    prompt_tokens = sum(result.prompt_tokens for result in firsts)
    completion_tokens = sum(len(result.token_ids) for result in results)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": sum(result.cached_tokens for result in firsts)},
    }


def speculative_totals(results: Sequence[GenerationResult]) -> dict:
    """The request's speculative counters: one choice's own, or the choices' added up
    (`SpeculativeStats.merge`)."""
    return SpeculativeStats.merge([result.stats for result in results]).as_dict()


# ---------------------------------------------------------------------------
# Logprobs


class TokenTexts:
    """Each token id's own text and bytes, decoded once per answer.

    A token that ends inside a UTF-8 character decodes to U+FFFD on its own;
    with a byte-level tokenizer its exact bytes are known, and its text is
    written `bytes:\\xe2\\x80` so that such tokens stay apart. Otherwise its
    `bytes` are None.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, tuple[str, list[int] | None]] = {}

    def __call__(self, token_id: int) -> str:
        return self.text_and_bytes(token_id)[0]

    def bytes(self, token_id: int) -> list[int] | None:
        return self.text_and_bytes(token_id)[1]

    def text_and_bytes(self, token_id: int) -> tuple[str, list[int] | None]:
        if token_id not in self.cache:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            token_bytes = None if REPLACEMENT_CHARACTER in text else list(text.encode("utf-8"))
            if token_bytes is None:
                spelled = piece_bytes(self.tokenizer, token_id)
                if spelled is not None:
                    token_bytes = list(spelled)
                    text = "bytes:" + "".join(f"\\x{byte:02x}" for byte in token_bytes)
            self.cache[token_id] = (text, token_bytes)
        return self.cache[token_id]


def _logprob(value: float) -> float:
    return max(float(value), MIN_LOGPROB)


def chat_logprobs(entries: Sequence, texts: TokenTexts, num_top: int) -> dict:
    """`choices[].logprobs` of a chat answer.

    Args:
        entries: TokenLogprob per emitted token (token_id, logprob, top [(id, logprob)...]).
        texts: the token-text decoder.
        num_top: how many alternatives to list per token (top_logprobs).
    """
    content = []
    for entry in entries:
        content.append(
            {
                "token": texts(entry.token_id),
                "logprob": _logprob(entry.logprob),
                "bytes": texts.bytes(entry.token_id),
                "top_logprobs": [
                    {"token": texts(token_id), "logprob": _logprob(logprob), "bytes": texts.bytes(token_id)}
                    for token_id, logprob in entry.top[:num_top]
                ],
            }
        )
    return {"content": content, "refusal": None}


class TextOffsets:
    """Where each token's text starts in the completion, in characters.

    The tokens' bytes run through an incremental UTF-8 decoder, so a character
    split across tokens counts once, when its last byte arrives.
    """

    def __init__(self) -> None:
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.num_chars = 0

    def advance(self, token_bytes: bytes) -> int:
        """The offset of the token with these bytes; moves past it."""
        offset = self.num_chars
        self.num_chars += len(self.decoder.decode(token_bytes))
        return offset


def completion_logprobs(entries: Sequence, texts: TokenTexts, num_top: int, offsets: TextOffsets | None = None) -> dict:
    """`choices[].logprobs` of a (legacy) completions answer.

    `top_logprobs[i]` maps the `num_top` likeliest tokens' texts, and the
    emitted token's, to their logprobs, as OpenAI's legacy API does.
    `text_offset[i]` is where token i's text starts; pass the same `offsets`
    to successive calls for one streamed choice.
    """
    offsets = offsets or TextOffsets()
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for entry in entries:
        token = texts(entry.token_id)
        tokens.append(token)
        token_logprobs.append(_logprob(entry.logprob))
        top: dict[str, float] = {}
        # Tokens may share a text: each text keeps its likeliest token's logprob.
        for token_id, logprob in entry.top[:num_top]:
            top.setdefault(texts(token_id), _logprob(logprob))
        top.setdefault(token, _logprob(entry.logprob))
        top_logprobs.append(top)
        token_bytes = texts.bytes(entry.token_id)
        text_offset.append(offsets.advance(bytes(token_bytes) if token_bytes is not None else token.encode("utf-8")))
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    }


# ---------------------------------------------------------------------------
# Plain answers


def response_body(request: OpenAIRequest, results: Sequence[GenerationResult], tokenizer) -> dict:
    """The JSON answer to a non-streamed request.

    Args:
        request: the parsed request.
        results: one engine result per choice, in choice order.
        tokenizer: for the logprobs' token texts.
    """
    assert len(results) == len(request.generations)
    texts = TokenTexts(tokenizer)
    choices = []
    for index, result in enumerate(results):
        logprobs = None
        if request.num_top_logprobs is not None:
            assert result.logprobs is not None, "the engine returned no logprobs"
            format_logprobs = chat_logprobs if request.kind == ROUTE_CHAT else completion_logprobs
            logprobs = format_logprobs(result.logprobs, texts, request.num_top_logprobs)
        choice = {"index": index}
        calls: list[ToolCall] = []
        if request.kind == ROUTE_CHAT:
            choice["message"] = {"role": "assistant", "content": result.text}
            if request.tool_format is not None:
                content, calls = request.tool_format.parse(result.text, request.max_tool_calls)
                choice["message"]["content"] = content
                if calls:
                    choice["message"]["tool_calls"] = [call.as_openai() for call in calls]
        else:
            choice["text"] = result.text
        choice.update(logprobs=logprobs, finish_reason=finish_reason(result.finish_reason, bool(calls)))
        choices.append(choice)
    return {
        "id": request.id,
        "object": "chat.completion" if request.kind == ROUTE_CHAT else "text_completion",
        "created": request.created,
        "model": request.model,
        "choices": choices,
        "usage": usage(request, results),
        "speculative": speculative_totals(results),
    }


# ---------------------------------------------------------------------------
# Server-Sent Events


def sse_event(payload: dict | str) -> str:
    """One SSE event: `data: <JSON>` and a blank line."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class OpenAIStream:
    """Turns one request's engine progress into SSE chunks.

    Call `on_tokens` as a choice's tokens arrive, `on_finished` when a choice
    is done (when the engine says so; `close` finishes any choice left), then
    `close`, which adds the usage chunk when asked and `data: [DONE]`. Each
    method returns the text to send now, "" when there is none. Text is held
    back as on the native stream (`handler.streaming.DeltaTracker`), so the
    deltas joined equal the plain answer's text; with tool calls, each choice's
    text also runs through its `ToolCallStream`, so the content deltas and the
    calls equal the plain answer's.
    """

    def __init__(self, request: OpenAIRequest, tokenizer) -> None:
        assert request.stream
        self.request = request
        self.texts = TokenTexts(tokenizer)
        num_choices = len(request.generations)
        self.deltas = [DeltaTracker(tokenizer, generation.stop) for generation in request.generations]
        self.role_sent = [False] * num_choices
        self.finished = [False] * num_choices
        self.num_logprobs_sent = [0] * num_choices
        self.text_offsets = [TextOffsets() for _ in range(num_choices)]
        tool_format = request.tool_format if request.kind == ROUTE_CHAT else None
        self.tool_streams = [
            None if tool_format is None else tool_format.stream(request.max_tool_calls) for _ in range(num_choices)
        ]
        self.num_tool_calls = [0] * num_choices
        self.started = False  # whether anything was sent: the status can no longer change

    def on_tokens(self, choice: int, token_ids: Sequence[int], new_logprobs: Sequence = ()) -> str:
        """After a step: the choice's new stable text, as a chunk.

        Args:
            choice: the choice index.
            token_ids: all its tokens so far.
            new_logprobs: TokenLogprobs of the tokens new in this step, when
                the engine reports them per step; otherwise they come with the
                finishing chunk.
        """
        assert not self.finished[choice]
        delta = self.deltas[choice].next_delta(token_ids)
        calls: list[ToolCall] = []
        tool_stream = self.tool_streams[choice]
        if tool_stream is not None:
            delta, calls = tool_stream.feed(delta)
        events = self._chunk(choice, delta, new_logprobs, None) if delta or new_logprobs else ""
        return events + self._tool_call_chunks(choice, calls)

    def on_finished(self, choice: int, result: GenerationResult) -> str:
        """The choice's last chunk: the rest of its text and logprobs, its finish reason and counters."""
        assert not self.finished[choice]
        self.finished[choice] = True
        delta = self.deltas[choice].final_delta(result.text)
        calls: list[ToolCall] = []
        tool_stream = self.tool_streams[choice]
        if tool_stream is not None:
            delta, calls = tool_stream.feed(delta)
            rest, more = tool_stream.finish()
            delta, calls = delta + rest, calls + more
        logprobs = ()
        if self.request.num_top_logprobs is not None:
            assert result.logprobs is not None, "the engine returned no logprobs"
            logprobs = result.logprobs[self.num_logprobs_sent[choice] :]
        # The calls go first: content and calls accumulate apart, and the finish reason comes last.
        return self._tool_call_chunks(choice, calls) + self._chunk(choice, delta, logprobs, result)

    def close(self, results: Sequence[GenerationResult]) -> str:
        """The end of the stream: the choices not finished yet, the usage chunk when asked, `[DONE]`."""
        events = [self.on_finished(i, result) for i, result in enumerate(results) if not self.finished[i]]
        if self.request.include_usage:
            events.append(sse_event({**self._envelope(), "choices": [], "usage": usage(self.request, results)}))
        events.append(DONE_EVENT)
        self.started = True
        return "".join(events)

    def error(self, error: RequestError) -> str:
        """An error after the stream began: an error event (the OpenAI client raises it), then `[DONE]`."""
        self.started = True
        return sse_event(error_answer(error)[1]) + DONE_EVENT

    def _envelope(self) -> dict:
        request = self.request
        chunk = {
            "id": request.id,
            "object": "chat.completion.chunk" if request.kind == ROUTE_CHAT else "text_completion",
            "created": request.created,
            "model": request.model,
        }
        if request.include_usage:
            chunk["usage"] = None  # every chunk but the last has usage null, as OpenAI sends it
        return chunk

    def _tool_call_chunks(self, choice: int, calls: Sequence[ToolCall]) -> str:
        """Two chunks per call, as OpenAI streams one: its head, then its arguments."""
        events = []
        for call in calls:
            index = self.num_tool_calls[choice]
            self.num_tool_calls[choice] += 1
            head = {"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
            arguments = {"index": index, "function": {"arguments": call.arguments}}
            events.append(self._chunk(choice, {"tool_calls": [head]}, None, None))
            events.append(self._chunk(choice, {"tool_calls": [arguments]}, None, None))
        return "".join(events)

    def _chunk(self, choice: int, delta: str | dict, logprobs: Sequence | None, result: GenerationResult | None) -> str:
        """One chunk of a choice: its delta, its logprobs, and its finish when `result` is given.

        `delta` is text, or a chat delta (a tool call's); `logprobs` None sends none even when asked for.
        """
        request = self.request
        formatted = None
        if request.num_top_logprobs is not None and logprobs is not None:
            if request.kind == ROUTE_CHAT:
                formatted = chat_logprobs(logprobs, self.texts, request.num_top_logprobs)
            else:
                formatted = completion_logprobs(
                    logprobs, self.texts, request.num_top_logprobs, self.text_offsets[choice]
                )
            self.num_logprobs_sent[choice] += len(logprobs)
        payload: dict = {"index": choice}
        if request.kind == ROUTE_CHAT:
            if isinstance(delta, dict):
                payload["delta"] = delta
            elif delta or self.tool_streams[choice] is None:
                payload["delta"] = {"content": delta}
            else:  # with tools, no "" content: an answer with no content accumulates to null
                payload["delta"] = {}
            if not self.role_sent[choice]:
                payload["delta"] = {"role": "assistant", **payload["delta"]}
                self.role_sent[choice] = True
        else:
            payload["text"] = delta
        payload["logprobs"] = formatted
        made_tool_calls = self.num_tool_calls[choice] > 0
        payload["finish_reason"] = None if result is None else finish_reason(result.finish_reason, made_tool_calls)
        chunk = {**self._envelope(), "choices": [payload]}
        if result is not None:
            chunk["speculative"] = result.stats.as_dict()
        self.started = True
        return sse_event(chunk)


# ---------------------------------------------------------------------------
# Serving


class OpenAIAnswer:
    """An OpenAI request's response as `handler.serving` builds it, step by step: JSON, or SSE when streamed.

    The same surface as `handler.serving.NativeAnswer`: the request's engine
    rows (one per choice), the text to send after a step and when a choice
    finishes, the final body, and its errors in OpenAI's shape.
    """

    def __init__(self, request: OpenAIRequest, tokenizer) -> None:
        self.request = request
        self.tokenizer = tokenizer
        self.generations = request.generations
        self.stream = request.stream
        self.content_type = SSE_CONTENT_TYPE if request.stream else JSON_CONTENT_TYPE
        self.events = OpenAIStream(request, tokenizer) if request.stream else None

    def on_tokens(self, row: int, output) -> str:
        """After a step that did not finish choice `row`: its chunk ("" when nothing is new or not streamed)."""
        return "" if self.events is None else self.events.on_tokens(row, output.token_ids)

    def on_row_finished(self, row: int, result: GenerationResult) -> str:
        """Choice `row` is done while others may run on: its last chunk goes at once."""
        return "" if self.events is None else self.events.on_finished(row, result)

    def final(self, results: Sequence[GenerationResult]) -> dict | str:
        """Every choice is done: the JSON answer, or the stream's end (usage chunk when asked, `[DONE]`)."""
        if self.events is None:
            return response_body(self.request, results, self.tokenizer)
        return self.events.close(results)

    def error(self, error: RequestError) -> tuple[int, dict]:
        """Nothing was sent yet: OpenAI's status and error body."""
        return error_answer(error)

    def error_after_start(self, error: RequestError) -> str:
        """The 200 went out with a first chunk: the error ends the body (an error event and `[DONE]` in a stream)."""
        if self.events is not None:
            return self.events.error(error)
        return json.dumps(error_answer(error)[1])
