"""Serving a TorchServe batch with the engine: static batches and continuous batching.

The handler hands each call's requests here and gets one `Reply` per request
back; nothing here imports TorchServe. Two schedules:

- `StaticBatch`: the call's requests run together from start to finish
  (`engine.generate`); streamed requests get their chunks through a callback.
- `ContinuousBatcher`: TorchServe's `continuousBatching: true` mode. The
  frontend calls the handler again and again with every job in flight: a new
  job carries its body, a job already in flight comes back by request id only,
  and a job whose client has gone is no longer sent. Requests join and leave the
  running batch between calls. Each call runs one engine step, and more while
  the frontend's turnaround between calls (its batching, the worker's socket
  and the JSON: about 1.5-2.5 ms measured on a GPU machine) would otherwise be
  over 5% of the call, up to `max_call_s`. A call that admits a request runs
  one step, and a call ends at the step in which a request finishes, so that
  first tokens and answers go out at once.

Every call must answer every job it holds. The frontend reads the
`ts_stream_next` response header of each answer (`Reply.more`):

- True: a chunk, more follows (the first chunk sends the HTTP status and headers);
- False: the last chunk of a response begun earlier;
- None: a complete response, status and body at once. Errors must be sent
  this way: the frontend closes a chunked response with status >= 400 right
  after its headers. A job answered so may be sent once more, and then gets
  an empty last chunk, which the frontend discards.

A stream is always chunked: one that ends in the call that admitted it sends
its whole text as a first chunk and an empty last chunk in the next call.

What a request is and how its answer is built (native or OpenAI) is
`handler.api.entry`; the schedules only ask its `Answer` for text.

Vocabulary: a request is *waiting* in the handler until its tokens fit in
`max_batch_tokens` (prompt + max_new_tokens, summed over the running rows),
then *running* in the engine until all its rows finish or its client
disconnects (*aborted*: every row it still has in the engine is freed).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from typing import Any, Callable, Hashable, Sequence

import torch

from handler.api.entry import (
    Answer,
    Entry,
    Reply,
    answer_for,
    engine_rows,
    error_reply,
    is_for_engine,
    parse_entry,
    request_tokens,
)
from handler.api.native import NativeAnswer
from handler.metrics import MetricsRecorder
from handler.schema import JSON_CONTENT_TYPE, RequestError
from handler.schema import STREAM_CONTENT_TYPE as NDJSON_CONTENT_TYPE
from handler.types import GenerationResult, StepOutput, count_accepted_prefix

logger = logging.getLogger(__name__)

__all__ = [
    "JSON_CONTENT_TYPE",
    "Answer",
    "NDJSON_CONTENT_TYPE",
    "ContinuousBatcher",
    "NativeAnswer",
    "Reply",
    "SpeculationTally",
    "StaticBatch",
    "engine_rows",
    "parse_entry",
]


def failure_error(error: BaseException) -> RequestError:
    """The client's view of an engine failure."""
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return RequestError("server: out of memory for this request; try fewer tokens", status=507)
    return RequestError(f"server: generation failed ({type(error).__name__})", status=500)


class SpeculationTally:
    """vLLM's speculation counters (drafts, draft tokens, accepted tokens per position), counted per
    step from each row's `StepOutput`: its drafts this step and how many were accepted (a prefix, so
    they give the per-position counts)."""

    def __init__(self) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position: list[int] = []

    def add_step(self, output: StepOutput) -> None:
        num_draft_tokens, num_accepted = output.num_draft_tokens, output.num_accepted_tokens
        assert 0 <= num_accepted <= num_draft_tokens
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        count_accepted_prefix(self.accepted_per_position, num_accepted)

    def record(self, metrics: MetricsRecorder) -> None:
        metrics.record_drafts(
            self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, self.accepted_per_position
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
        entries: Sequence[Entry],
        send_chunk: Callable[[int, str, str], None],
        metrics: MetricsRecorder,
    ) -> list[Reply]:
        """Runs the requests for the engine, all rows of a request in one group; the others get their Reply.

        Args:
            entries: one per request of the call (`parse_entry`).
            send_chunk: sends request `index` a chunk now, with its content type (streamed requests).
            metrics: where the figures go.
        Returns:
            a complete Reply per request, in order.
        """
        started_at = self.clock()
        outcomes: list[Any] = list(entries)
        self.tracked = {
            i: _Tracked(answer_for(entry, self.tokenizer), started_at)
            for i, entry in enumerate(entries)
            if is_for_engine(entry)
        }
        for group in self._groups(list(self.tracked)):
            waited = self.clock() - started_at
            for _ in group:
                metrics.record_queue_wait(waited)
            metrics.record_batch_occupancy(sum(len(self.tracked[i].results) for i in group))
            tally = SpeculationTally()
            for index, outcome in self._generate(group, send_chunk, tally).items():
                outcomes[index] = outcome
            tally.record(metrics)
        return [self._reply(index, outcome, send_chunk, metrics) for index, outcome in enumerate(outcomes)]

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

    def _generate(self, group: list[int], send_chunk, tally: SpeculationTally) -> dict[int, Any]:
        """The group's rows as one engine batch: each request's results in row order, or its RequestError."""
        rows = [(index, row) for index in group for row in range(len(self.tracked[index].results))]
        requests = [self.tracked[index].answer.generations[row] for index, row in rows]

        def on_tokens(position: int, _new_token_ids: list[int], output) -> None:
            tally.add_step(output)
            self._on_tokens(*rows[position], output, send_chunk)

        try:
            results = self.engine.generate(requests, on_tokens=on_tokens)
        except Exception:  # a model failure must not take the worker or the other requests down
            logger.exception("batch of %d rows failed; retrying its requests one by one", len(requests))
            return {index: self._generate_alone(index, send_chunk, tally) for index in group}
        by_request: dict[int, Any] = {index: [] for index in group}
        for (index, _), result in zip(rows, results):
            by_request[index].append(result)
        return by_request

    def _generate_alone(self, index: int, send_chunk, tally: SpeculationTally):
        tracked = self.tracked[index]
        if tracked.started:
            # Chunks already went out: a retry would send them again.
            return RequestError("server: generation failed mid-stream", status=500)
        tracked.first_token_at = None  # the failed batch's tokens are gone; the answer's come from the retry

        def on_tokens(row: int, _new_token_ids: list[int], output) -> None:
            tally.add_step(output)
            self._on_tokens(index, row, output, send_chunk)

        try:
            return self.engine.generate(tracked.answer.generations, on_tokens=on_tokens)
        except Exception as error:
            logger.exception("request failed")
            return failure_error(error)

    def _on_tokens(self, index: int, row: int, output, send_chunk) -> None:
        """After a step that emitted tokens for this row."""
        tracked = self.tracked[index]
        if tracked.first_token_at is None:
            tracked.first_token_at = self.clock()
        if output.finish_reason is not None:
            tracked.finished_at = self.clock()  # the last row's time is the request's
            text = tracked.answer.on_row_finished(row, output.result)
        else:
            text = tracked.answer.on_tokens(row, output)
        if not text:
            return
        tracked.started = True
        send_chunk(index, text, tracked.answer.content_type)

    def _reply(self, index: int, outcome, send_chunk, metrics: MetricsRecorder) -> Reply:
        if isinstance(outcome, Reply):  # answered without the engine
            if outcome.status >= 400:
                metrics.record_rejected()
            return outcome
        tracked = self.tracked.get(index)
        if isinstance(outcome, RequestError):
            metrics.record_rejected()
            if tracked is None:
                return error_reply(outcome)
            if tracked.started:
                return Reply(tracked.answer.error_after_start(outcome))
            status, body = tracked.answer.error(outcome)
            return Reply(body, status=status, content_type=JSON_CONTENT_TYPE)
        finished_at = tracked.finished_at or self.clock()
        metrics.record_time_to_first_token((tracked.first_token_at or finished_at) - tracked.arrived_at)
        for result in outcome:
            metrics.record_result(result.stats, finished_at - tracked.arrived_at)
        body = tracked.answer.final(outcome)
        if tracked.started:
            return Reply(body)
        if tracked.answer.stream:  # it sent nothing before its end: still a chunked stream, as in continuous mode
            send_chunk(index, body, tracked.answer.content_type)
            return Reply("")
        return Reply(body, content_type=tracked.answer.content_type)


class _Tracked:
    """One request's progress across steps (and, in continuous batching, handler calls)."""

    def __init__(self, answer: Answer, arrived_at: float) -> None:
        self.answer = answer
        self.arrived_at = arrived_at
        self.num_tokens = request_tokens(answer.generations)
        self.results: list[GenerationResult | None] = [None] * len(answer.generations)  # per row, once finished
        self.started = False  # a chunk (and so the HTTP status) went out
        # The end of the first step that emitted a token for it, streamed or not (any of its rows).
        self.first_token_at: float | None = None
        self.finished_at: float | None = None

    @property
    def unfinished_rows(self) -> list[int]:
        return [row for row, result in enumerate(self.results) if result is None]


class CallTurnaround:
    """The frontend's turnaround: the time from the end of one handler call to the start of the next
    while requests are in flight (TorchServe's batching, the socket, the JSON), a moving average.

    A call that runs steps for `call_budget` keeps that turnaround at `SHARE` of the call or less."""

    SHARE = 0.05
    WEIGHT = 0.2  # of the newest turnaround in the average

    def __init__(self) -> None:
        self.mean_s: float | None = None
        self._busy_end: float | None = None

    def call_started(self, now: float) -> None:
        if self._busy_end is not None:
            gap = now - self._busy_end
            self.mean_s = gap if self.mean_s is None else (1 - self.WEIGHT) * self.mean_s + self.WEIGHT * gap
        self._busy_end = None

    def call_ended(self, now: float, busy: bool) -> None:
        """`busy`: requests are still in flight, so the frontend calls again at once."""
        self._busy_end = now if busy else None

    def call_budget(self, max_call_s: float) -> float:
        """Seconds a call may run steps for: 0 (one step) until a turnaround was seen."""
        if self.mean_s is None or max_call_s <= 0:
            return 0.0
        return min(max_call_s, self.mean_s * (1 - self.SHARE) / self.SHARE)


class ContinuousBatcher:
    """TorchServe's continuous-batching calls over the engine's step API (see the module docstring).

    The engine knows a request's rows by (request id, row).
    """

    def __init__(
        self,
        engine,
        tokenizer,
        max_batch_tokens: int = 0,
        clock: Callable[[], float] = time.perf_counter,
        max_call_s: float = 0.0,
    ) -> None:
        """`max_batch_tokens` 0 means no bound beyond TorchServe's batchSize; `max_call_s` 0, one step a call."""
        self.engine = engine
        self.tokenizer = tokenizer
        self.max_batch_tokens = max_batch_tokens
        self.clock = clock
        self.max_call_s = max_call_s
        self.turnaround = CallTurnaround()
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

    @property
    def num_running_rows(self) -> int:
        return sum(len(tracked.unfinished_rows) for tracked in self.running.values())

    def run_call(
        self,
        request_ids: Sequence[Hashable],
        new_requests: dict[Hashable, Entry],
        metrics: MetricsRecorder,
    ) -> list[Reply]:
        """One handler call: abort the vanished, admit the new, one engine step, one reply per request.

        Args:
            request_ids: every job of the call, in order.
            new_requests: the entry (`parse_entry`) of each job this batcher does not know yet.
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
                entry = new_requests.get(request_id)
                if entry is None:
                    # A job in flight that this worker never saw (its state died with a failure).
                    entry = RequestError("server: the worker lost this request; send it again", 500)
                if isinstance(entry, RequestError):
                    entry = error_reply(entry)
                if isinstance(entry, Reply):
                    replies[request_id] = self._complete(request_id, entry, metrics)
                else:
                    self.waiting[request_id] = _Tracked(answer_for(entry, self.tokenizer), self.clock())

        finished: dict[Hashable, tuple[_Tracked, Any]] = {}
        chunks: dict[Hashable, list[str]] = {}
        started = self.clock()
        self.turnaround.call_started(started)
        num_admitted = self._admit(metrics, finished)
        self._step(metrics, finished, chunks)
        # A call that admitted a request answers after one step: its first token (and a stream's
        # headers) go out at once, so a request's time to first token is what one step a call gives.
        budget = 0.0 if num_admitted else self.turnaround.call_budget(self.max_call_s)
        last_step = self.clock() - started
        while budget > 0 and self.running and not finished and self.clock() - started + last_step <= budget:
            step_started = self.clock()
            self._step(metrics, finished, chunks)
            last_step = self.clock() - step_started
        self.turnaround.call_ended(self.clock(), busy=bool(self.running or self.waiting))

        for request_id in request_ids:
            if request_id in replies:
                continue
            if request_id in finished:
                tracked, outcome = finished[request_id]
                replies[request_id] = self._final_reply(request_id, tracked, outcome, chunks.get(request_id), metrics)
            else:
                tracked = self.running.get(request_id) or self.waiting[request_id]
                replies[request_id] = self._chunk_reply(tracked, chunks.get(request_id, []))
        return [replies[request_id] for request_id in request_ids]

    def _abort_rows(self, request_id: Hashable, rows: Sequence[int]) -> None:
        for row in rows:
            try:
                self.engine.abort_request((request_id, row))
            except Exception:  # the row may have gone with a failed step
                logger.exception("request %s: abort of row %d failed", request_id, row)

    def _abort_vanished(self, in_call: set, metrics: MetricsRecorder) -> None:
        """The frontend stops sending a job whose client went away: free what it held."""
        self.closing &= in_call
        for request_id in [r for r in self.waiting if r not in in_call]:
            del self.waiting[request_id]
            metrics.record_aborted()
            logger.info("request %s: client gone while waiting", request_id)
        for request_id in [r for r in self.running if r not in in_call]:
            tracked = self.running.pop(request_id)
            metrics.record_aborted()
            logger.info("request %s: client gone; its %d rows are freed", request_id, len(tracked.unfinished_rows))
            self._abort_rows(request_id, tracked.unfinished_rows)

    def _admit(self, metrics: MetricsRecorder, finished: dict) -> int:
        """Waiting requests join the engine in arrival order, while their tokens fit; returns how many joined."""
        budget, num_admitted = self.num_running_tokens, 0
        while self.waiting:
            request_id, tracked = next(iter(self.waiting.items()))
            # Strict arrival order: letting short requests overtake a long one could starve it.
            # A request alone always fits: parsing rejected any larger than max_batch_tokens.
            if self.max_batch_tokens and self.running and budget + tracked.num_tokens > self.max_batch_tokens:
                break
            del self.waiting[request_id]
            num_added = 0
            try:
                for row, generation in enumerate(tracked.answer.generations):
                    self.engine.add_request((request_id, row), generation)
                    num_added += 1
            except Exception as error:  # this request only
                logger.exception("request %s could not join the batch", request_id)
                self._abort_rows(request_id, range(num_added))
                finished[request_id] = (tracked, failure_error(error))
                continue
            self.running[request_id] = tracked
            budget += tracked.num_tokens
            num_admitted += 1
            metrics.record_queue_wait(self.clock() - tracked.arrived_at)
        return num_admitted

    def _step(self, metrics: MetricsRecorder, finished: dict, chunks: dict) -> None:
        """One engine step over the running requests; fills `finished` and the streamed `chunks`."""
        if not self.running:
            return
        if self.num_running_rows != self.recorded_occupancy:
            self.recorded_occupancy = self.num_running_rows
            metrics.record_batch_occupancy(self.recorded_occupancy)
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
            request_id, row = output.request_id
            tracked = self.running.get(request_id)
            if tracked is None:
                continue  # aborted this call
            tally.add_step(output)
            if output.new_token_ids and tracked.first_token_at is None:
                tracked.first_token_at = now
            if output.finish_reason is None:
                text = tracked.answer.on_tokens(row, output)
            else:
                result = output.result
                assert result is not None, "a finished step output carries its result"
                tracked.results[row] = result
                metrics.record_result(result.stats, now - tracked.arrived_at)
                text = tracked.answer.on_row_finished(row, result)
                if not tracked.unfinished_rows:
                    metrics.record_time_to_first_token((tracked.first_token_at or now) - tracked.arrived_at)
                    del self.running[request_id]
                    finished[request_id] = (tracked, tracked.results)
            if text:
                chunks.setdefault(request_id, []).append(text)
        if finished:
            tally.record(metrics)
            self.tally = SpeculationTally()
        if not self.running:
            self.recorded_occupancy = 0
            metrics.record_batch_occupancy(0)

    def _drop_everything(self) -> None:
        """After a failed step the caches are undefined: the engine drops every request."""
        self.engine.reset()

    def _chunk_reply(self, tracked: _Tracked, chunks: list[str]) -> Reply:
        """A request still waiting or running: its new streamed chunks, or an empty chunk."""
        content_type = None if tracked.started else tracked.answer.content_type
        tracked.started = True
        return Reply("".join(chunks), content_type=content_type, more=True)

    def _final_reply(
        self, request_id: Hashable, tracked: _Tracked, outcome, chunks: list[str] | None, metrics: MetricsRecorder
    ) -> Reply:
        if isinstance(outcome, RequestError):
            if not tracked.started:
                status, body = tracked.answer.error(outcome)
                return self._complete(request_id, Reply(body, status=status, content_type=JSON_CONTENT_TYPE), metrics)
            metrics.record_rejected()
            # The status went out with the first chunk: the error travels in the body.
            return Reply(tracked.answer.error_after_start(outcome), more=False)
        body = tracked.answer.final(outcome)
        if chunks:  # rows that finished in this step, before the last one: a stream's text
            body = "".join(chunks) + body
        if tracked.started:
            return Reply(body, more=False)
        self.closing.add(request_id)
        if tracked.answer.stream:
            # A stream stays chunked even when it ends in the call that admitted it (a short answer,
            # or one drafted whole): its whole text is the first chunk, an empty last chunk follows.
            return Reply(body, content_type=tracked.answer.content_type, more=True)
        return Reply(body, content_type=tracked.answer.content_type, more=None)

    def _complete(self, request_id: Hashable, reply: Reply, metrics: MetricsRecorder) -> Reply:
        """A complete response (an error, or an answer known at once); the frontend may send the job once more."""
        if reply.status >= 400:
            metrics.record_rejected()
        self.closing.add(request_id)
        return dataclasses.replace(reply, more=None)
