"""Serving a TorchServe batch with the engine: static batches and continuous batching.

The handler hands each call's requests here and gets one `Reply` per request
back; nothing here imports TorchServe. Two schedules:

- `StaticBatch`: the call's requests run together from start to finish
  (`engine.generate`); streamed requests get their chunks through a callback.
- `ContinuousBatcher`: TorchServe's `continuousBatching: true` mode. The
  frontend calls the handler again and again with every job in flight: a new
  job carries its body, a job already in flight comes back by request id only,
  and a job whose client has gone is no longer sent. Each call runs one engine
  step, so requests join and leave the running batch at every step.

Every call must answer every job it holds. The frontend reads the
`ts_stream_next` response header of each answer (`Reply.more`):

- True: a chunk, more follows (the first chunk sends the HTTP status and headers);
- False: the last chunk of a response begun earlier;
- None: a complete response, status and body at once. Errors must be sent
  this way: the frontend closes a chunked response with status >= 400 right
  after its headers. A job answered so may be sent once more, and then gets
  an empty last chunk, which the frontend discards.

Vocabulary: a request is *waiting* in the handler until its tokens fit in
`max_batch_tokens` (prompt + max_new_tokens, summed over the running batch),
then *running* in the engine until it finishes or its client disconnects
(*aborted*).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import time
from typing import Any, Callable, Hashable, Sequence

import torch

from handler.config import HandlerConfig
from handler.metrics import MetricsRecorder
from handler.protocol import ParsedRequest, RequestError, decode_body, error_to_json, parse_request, result_to_json
from handler.streaming import DeltaTracker

logger = logging.getLogger(__name__)

JSON_CONTENT_TYPE = "application/json"
NDJSON_CONTENT_TYPE = "application/x-ndjson"


@dataclasses.dataclass
class Reply:
    """One request's answer in one handler call."""

    body: Any  # a dict (sent as JSON), or str
    status: int = 200
    content_type: str | None = None
    more: bool | None = None  # the `ts_stream_next` decision; None: a complete response


def parse_entry(row: Any, content_type: str | None, config: HandlerConfig, tokenizer, max_context: int):
    """One TorchServe request entry -> a ParsedRequest, or the RequestError that rejects it (never raises)."""
    try:
        body = row.get("body", row.get("data")) if isinstance(row, dict) else row
        if body is None:
            # curl -d without a Content-Type sends form data, which TorchServe splits into fields.
            raise RequestError(
                "body: the request has no body; send JSON with 'Content-Type: application/json' "
                "or a plain-text prompt with 'Content-Type: text/plain'"
            )
        parsed = parse_request(decode_body(body, content_type), config, tokenizer, max_context)
        generation = parsed.generation
        num_tokens = len(generation.prompt_ids) + generation.max_new_tokens
        if config.max_batch_tokens and num_tokens > config.max_batch_tokens:
            raise RequestError(
                f"prompt: {len(generation.prompt_ids)} prompt tokens + max_new_tokens {generation.max_new_tokens} "
                f"exceed this server's max_batch_tokens of {config.max_batch_tokens}; "
                "shorten the prompt or lower max_new_tokens",
                status=413,
            )
        return parsed
    except RequestError as error:
        return error
    except Exception as error:  # a parsing failure must cost only this request
        logger.exception("a request could not be parsed")
        return RequestError(f"server: could not process the request ({type(error).__name__})", 500)


def request_tokens(parsed: ParsedRequest) -> int:
    """What a request may hold in the caches: its prompt plus every token it may generate."""
    return len(parsed.generation.prompt_ids) + parsed.generation.max_new_tokens


def failure_error(error: BaseException) -> RequestError:
    """The client's view of an engine failure."""
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return RequestError("server: out of memory for this request; try fewer tokens", status=507)
    return RequestError(f"server: generation failed ({type(error).__name__})", status=500)


class SpeculationTally:
    """vLLM's speculation counters (drafts, draft tokens, accepted tokens per position).

    Counted per step when the engine's step outputs carry `num_draft_tokens`
    (this step's k for the request) and `num_accepted_tokens`: accepted drafts
    are a prefix, so they give the per-position counts. Otherwise each
    request's final stats give them (`num_drafts` and `accepted_per_position`
    read when present), and an aborted request is not counted.
    """

    def __init__(self) -> None:
        self.num_drafts: int | None = 0  # None: the engine does not tell
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position: list[int] | None = []  # None: the engine does not tell
        self.per_step = True

    def _add_positions(self, accepted_per_position: Sequence[int]) -> None:
        assert self.accepted_per_position is not None
        if len(self.accepted_per_position) < len(accepted_per_position):
            self.accepted_per_position.extend([0] * (len(accepted_per_position) - len(self.accepted_per_position)))
        for position, count in enumerate(accepted_per_position):
            self.accepted_per_position[position] += count

    def add_step(self, output) -> None:
        num_draft_tokens = getattr(output, "num_draft_tokens", None)
        num_accepted = getattr(output, "num_accepted_tokens", None)
        if not isinstance(num_draft_tokens, int) or not isinstance(num_accepted, int):
            self.per_step = False
            return
        assert 0 <= num_accepted <= num_draft_tokens
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        self._add_positions([1] * num_accepted)

    def add_final(self, stats) -> None:
        if self.per_step:
            return
        self.num_draft_tokens += stats.draft_tokens
        self.num_accepted_tokens += stats.accepted_tokens
        num_drafts = getattr(stats, "num_drafts", None)
        self.num_drafts = None if num_drafts is None or self.num_drafts is None else self.num_drafts + num_drafts
        per_position = getattr(stats, "accepted_per_position", None)
        if per_position is None or self.accepted_per_position is None:
            self.accepted_per_position = None
        else:
            self._add_positions(per_position)

    def record(self, metrics: MetricsRecorder) -> None:
        metrics.record_drafts(
            self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, self.accepted_per_position or ()
        )


class StaticBatch:
    """A TorchServe batch run from start to finish, in groups that fit max_batch_tokens."""

    def __init__(self, engine, tokenizer, max_batch_tokens: int = 0, clock: Callable[[], float] = time.perf_counter):
        self.engine = engine
        self.tokenizer = tokenizer
        self.max_batch_tokens = max_batch_tokens
        self.clock = clock

    def run(
        self,
        parsed: Sequence[ParsedRequest | RequestError],
        send_chunk: Callable[[int, str], None],
        metrics: MetricsRecorder,
    ) -> list[Reply]:
        """Runs the valid requests; bad ones get their error.

        Args:
            parsed: one entry per request of the call.
            send_chunk: sends request `index` one NDJSON line now (streamed requests).
            metrics: where the figures go.
        Returns:
            a complete Reply per request, in order.
        """
        started_at = self.clock()
        outcomes: list[Any] = list(parsed)
        self.tracked = {
            i: _Tracked(p, self.tokenizer, started_at) for i, p in enumerate(parsed) if isinstance(p, ParsedRequest)
        }
        for group in self._groups(list(self.tracked)):
            waited = self.clock() - started_at
            for _ in group:
                metrics.record_queue_wait(waited)
            metrics.record_batch_occupancy(len(group))
            tally = SpeculationTally()
            for index, outcome in zip(group, self._generate(group, send_chunk, tally)):
                outcomes[index] = outcome
                if not isinstance(outcome, RequestError):
                    tally.add_final(outcome.stats)
            tally.record(metrics)
        return [self._reply(index, outcome, metrics) for index, outcome in enumerate(outcomes)]

    def _groups(self, indices: list[int]) -> list[list[int]]:
        """Consecutive groups whose tokens fit max_batch_tokens; one group when unbounded."""
        groups: list[list[int]] = []
        budget = 0
        for index in indices:
            num_tokens = self.tracked[index].num_tokens
            if not groups or (self.max_batch_tokens and budget + num_tokens > self.max_batch_tokens):
                groups.append([])
                budget = 0
            groups[-1].append(index)
            budget += num_tokens
        return groups

    def _generate(self, group: list[int], send_chunk, tally: SpeculationTally) -> list[Any]:
        requests = [self.tracked[i].parsed.generation for i in group]

        def on_tokens(position: int, new_token_ids: list[int], output) -> None:
            tally.add_step(output)
            self._on_tokens(group[position], new_token_ids, output, send_chunk)

        try:
            return self.engine.generate(requests, on_tokens=on_tokens)
        except Exception:  # a model failure must not take the worker or the other requests down
            logger.exception("batch of %d failed; retrying its requests one by one", len(requests))
            return [self._generate_alone(index, send_chunk, tally) for index in group]

    def _generate_alone(self, index: int, send_chunk, tally: SpeculationTally):
        tracked = self.tracked[index]
        if tracked.first_chunk_at is not None:
            # Chunks already went out: a retry would send them again.
            return RequestError("server: generation failed mid-stream", status=500)

        def on_tokens(_: int, new_token_ids: list[int], output) -> None:
            tally.add_step(output)
            self._on_tokens(index, new_token_ids, output, send_chunk)

        try:
            return self.engine.generate([tracked.parsed.generation], on_tokens=on_tokens)[0]
        except Exception as error:
            logger.exception("request failed")
            return failure_error(error)

    def _on_tokens(self, index: int, new_token_ids: list[int], output, send_chunk) -> None:
        tracked = self.tracked[index]
        if output.finish_reason is not None:
            tracked.finished_at = self.clock()
            return  # the final line carries the rest
        if tracked.deltas is None:
            return
        line = {"text_delta": tracked.deltas.next_delta(output.token_ids), "token_ids": list(new_token_ids)}
        tracked.num_sent_tokens += len(new_token_ids)
        if tracked.first_chunk_at is None:
            tracked.first_chunk_at = self.clock()
        send_chunk(index, json.dumps(line) + "\n")

    def _reply(self, index: int, outcome, metrics: MetricsRecorder) -> Reply:
        if isinstance(outcome, RequestError):
            metrics.record_rejected()
            return Reply(error_to_json(str(outcome)), status=outcome.status)
        tracked = self.tracked[index]
        finished_at = tracked.finished_at or self.clock()
        answer = result_to_json(outcome)
        content_type = None
        if tracked.deltas is not None:
            # The last line: the rest of the text and ids, then the request's totals.
            del answer["text"]
            answer = {
                "text_delta": tracked.deltas.final_delta(outcome.text),
                **answer,
                "token_ids": outcome.token_ids[tracked.num_sent_tokens :],
            }
            if tracked.first_chunk_at is None:
                tracked.first_chunk_at = self.clock()
                content_type = NDJSON_CONTENT_TYPE
        first_chunk = None if tracked.first_chunk_at is None else tracked.first_chunk_at - tracked.arrived_at
        metrics.record_result(outcome.stats, finished_at - tracked.arrived_at, first_chunk)
        body = json.dumps(answer) + "\n" if tracked.deltas is not None else answer
        return Reply(body, content_type=content_type)


class _Tracked:
    """One request's progress across handler calls."""

    def __init__(self, parsed: ParsedRequest, tokenizer, arrived_at: float) -> None:
        self.parsed = parsed
        self.deltas = DeltaTracker(tokenizer, parsed.generation.stop) if parsed.stream else None
        self.arrived_at = arrived_at
        self.num_tokens = request_tokens(parsed)
        self.num_sent_tokens = 0
        self.started = False  # a chunk (and so the HTTP status) went out
        self.first_chunk_at: float | None = None
        self.finished_at: float | None = None


class ContinuousBatcher:
    """TorchServe's continuous-batching calls over the engine's step API (see the module docstring)."""

    def __init__(
        self,
        engine,
        tokenizer,
        max_batch_tokens: int = 0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """`max_batch_tokens` 0 means no bound beyond TorchServe's batchSize."""
        self.engine = engine
        self.tokenizer = tokenizer
        self.max_batch_tokens = max_batch_tokens
        self.clock = clock
        self.waiting: collections.OrderedDict[Hashable, _Tracked] = collections.OrderedDict()
        self.running: dict[Hashable, _Tracked] = {}
        # Answered completely; the frontend may send them once more.
        self.closing: set[Hashable] = set()
        # Metrics go out through the worker's log, one line each: per-step figures are
        # gathered and sent when a request finishes, the occupancy when it changes.
        self.tally = SpeculationTally()
        self.recorded_occupancy: int | None = None

    def knows(self, request_id: Hashable) -> bool:
        return request_id in self.waiting or request_id in self.running or request_id in self.closing

    @property
    def num_running_tokens(self) -> int:
        return sum(tracked.num_tokens for tracked in self.running.values())

    def run_call(
        self,
        request_ids: Sequence[Hashable],
        new_requests: dict[Hashable, ParsedRequest | RequestError],
        metrics: MetricsRecorder,
    ) -> list[Reply]:
        """One handler call: abort the vanished, admit the new, one engine step, one reply per request.

        Args:
            request_ids: every job of the call, in order.
            new_requests: the parsed (or rejected) body of each job this batcher does not know yet.
            metrics: where this call's figures go.
        Returns:
            a Reply per request id, in order.
        """
        assert len(set(request_ids)) == len(request_ids), "a job appears once per call"
        self._abort_vanished(set(request_ids), metrics)
        replies: dict[Hashable, Reply] = {}
        for request_id in request_ids:
            if request_id in self.closing:
                self.closing.discard(request_id)
                replies[request_id] = Reply("", more=False)
            elif not self.knows(request_id):
                parsed = new_requests.get(request_id)
                if parsed is None:
                    # A job in flight that this worker never saw (its state died with a failure).
                    parsed = RequestError("server: the worker lost this request; send it again", 500)
                if isinstance(parsed, RequestError):
                    replies[request_id] = self._complete_error(request_id, parsed, metrics)
                else:
                    self.waiting[request_id] = _Tracked(parsed, self.tokenizer, self.clock())

        finished: dict[Hashable, tuple[_Tracked, Any]] = {}
        lines: dict[Hashable, list[str]] = {}
        self._admit(metrics, finished)
        self._step(metrics, finished, lines)

        for request_id in request_ids:
            if request_id in replies:
                continue
            if request_id in finished:
                tracked, outcome = finished[request_id]
                replies[request_id] = self._final_reply(request_id, tracked, outcome, metrics)
            else:
                tracked = self.running.get(request_id) or self.waiting[request_id]
                replies[request_id] = self._chunk_reply(tracked, lines.get(request_id, []))
        return [replies[request_id] for request_id in request_ids]

    def _abort_vanished(self, in_call: set, metrics: MetricsRecorder) -> None:
        """The frontend stops sending a job whose client went away: free what it held."""
        self.closing &= in_call
        for request_id in [r for r in self.waiting if r not in in_call]:
            del self.waiting[request_id]
            metrics.record_aborted()
            logger.info("request %s: client gone while waiting", request_id)
        for request_id in [r for r in self.running if r not in in_call]:
            del self.running[request_id]
            metrics.record_aborted()
            logger.info("request %s: client gone; its row is freed", request_id)
            try:
                self.engine.abort_request(request_id)
            except Exception:  # the row may have gone with a failed step
                logger.exception("request %s: abort failed", request_id)

    def _admit(self, metrics: MetricsRecorder, finished: dict) -> None:
        """Waiting requests join the engine in arrival order, while their tokens fit."""
        budget = self.num_running_tokens
        while self.waiting:
            request_id, tracked = next(iter(self.waiting.items()))
            # Strict arrival order: letting short requests overtake a long one could starve it.
            # A request alone always fits: parsing rejected any larger than max_batch_tokens.
            if self.max_batch_tokens and self.running and budget + tracked.num_tokens > self.max_batch_tokens:
                break
            del self.waiting[request_id]
            try:
                self.engine.add_request(request_id, tracked.parsed.generation)
            except Exception as error:  # this request only
                logger.exception("request %s could not join the batch", request_id)
                finished[request_id] = (tracked, failure_error(error))
                continue
            self.running[request_id] = tracked
            budget += tracked.num_tokens
            metrics.record_queue_wait(self.clock() - tracked.arrived_at)

    def _step(self, metrics: MetricsRecorder, finished: dict, lines: dict) -> None:
        """One engine step over the running requests; fills `finished` and the stream `lines`."""
        if not self.running:
            return
        if len(self.running) != self.recorded_occupancy:
            self.recorded_occupancy = len(self.running)
            metrics.record_batch_occupancy(len(self.running))
        try:
            outputs = self.engine.step()
        except Exception as error:  # the whole step failed: its requests fail, the worker carries on
            logger.exception("engine step failed; failing its %d requests", len(self.running))
            self._drop_everything()
            for request_id, tracked in self.running.items():
                finished[request_id] = (tracked, failure_error(error))
            self.running.clear()
            self.recorded_occupancy = 0
            metrics.record_batch_occupancy(0)
            return
        now = self.clock()
        tally = self.tally
        for output in outputs:
            tracked = self.running.get(output.request_id)
            if tracked is None:
                continue  # aborted this call
            tally.add_step(output)
            if output.finish_reason is None:
                if output.new_token_ids and tracked.deltas is not None:
                    lines[output.request_id] = [self._stream_line(tracked, output)]
                continue
            del self.running[output.request_id]
            result = output.result
            assert result is not None, "a finished step output carries its result"
            tally.add_final(result.stats)
            first_chunk = None if tracked.deltas is None else (tracked.first_chunk_at or now) - tracked.arrived_at
            metrics.record_result(result.stats, now - tracked.arrived_at, first_chunk)
            finished[output.request_id] = (tracked, result)
        if finished:
            tally.record(metrics)
            self.tally = SpeculationTally()
        if not self.running:
            self.recorded_occupancy = 0
            metrics.record_batch_occupancy(0)

    def _drop_everything(self) -> None:
        """After a failed step the caches are undefined: the engine drops every request."""
        reset = getattr(self.engine, "reset", None)
        if reset is not None:
            reset()
            return
        for request_id in self.running:
            try:
                self.engine.abort_request(request_id)
            except Exception:
                logger.exception("request %s: abort after a failed step failed", request_id)

    @staticmethod
    def _stream_line(tracked: _Tracked, output) -> str:
        tracked.num_sent_tokens += len(output.new_token_ids)
        line = {"text_delta": tracked.deltas.next_delta(output.token_ids), "token_ids": list(output.new_token_ids)}
        return json.dumps(line) + "\n"

    @staticmethod
    def _content_type(tracked: _Tracked) -> str:
        return NDJSON_CONTENT_TYPE if tracked.deltas is not None else JSON_CONTENT_TYPE

    def _chunk_reply(self, tracked: _Tracked, lines: list[str]) -> Reply:
        """A request still waiting or running: its new stream lines, or an empty chunk."""
        content_type = None if tracked.started else self._content_type(tracked)
        tracked.started = True
        if lines and tracked.first_chunk_at is None:
            tracked.first_chunk_at = self.clock()
        return Reply("".join(lines), content_type=content_type, more=True)

    def _final_reply(self, request_id: Hashable, tracked: _Tracked, outcome, metrics: MetricsRecorder) -> Reply:
        if isinstance(outcome, RequestError):
            if not tracked.started:
                return self._complete_error(request_id, outcome, metrics)
            metrics.record_rejected()
            # The status went out with the first chunk: the error travels in the body.
            body = json.dumps(error_to_json(str(outcome))) + ("\n" if tracked.deltas is not None else "")
            return Reply(body, more=False)
        answer = result_to_json(outcome)
        if tracked.deltas is not None:
            # The last line: the rest of the text and ids, then the request's totals.
            del answer["text"]
            answer = {
                "text_delta": tracked.deltas.final_delta(outcome.text),
                **answer,
                "token_ids": outcome.token_ids[tracked.num_sent_tokens :],
            }
            body: Any = json.dumps(answer) + "\n"
        else:
            body = answer
        if tracked.started:
            return Reply(body, more=False)
        self.closing.add(request_id)
        return Reply(body, content_type=self._content_type(tracked), more=None)

    def _complete_error(self, request_id: Hashable, error: RequestError, metrics: MetricsRecorder) -> Reply:
        metrics.record_rejected()
        self.closing.add(request_id)
        return Reply(error_to_json(str(error)), status=error.status, content_type=JSON_CONTENT_TYPE, more=None)
