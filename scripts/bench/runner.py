"""The in-process runner the engine benchmarks share: the ways to generate (`Method`: Hugging Face
`generate`, plain or assisted, and this engine's rows), one timed pass over the prompts (`timed_run`,
`Run`), and the `Runner` that holds the loaded pair for all of them, with the config the benchmarks
load it with. For serving-shaped runs: requests as the OpenAI chat route makes them (`ChatRoute`),
and the load driver (`drive`) that feeds the engine's step API as the handler's continuous batching
does, closed loop or at Poisson arrivals (`poisson_arrivals`)."""

from __future__ import annotations

import dataclasses
import pathlib
import random
import time
from typing import Any, Callable, Sequence

import torch
import yaml

from handler.api.openai.requests import parse_openai_request
from handler.api.openai.routes import ROUTE_CHAT
from handler.config import HandlerConfig, SamplingParams, handler_config_from_yaml_config
from handler.drafters import HYBRID, MODEL, NGRAM
from handler.engine import (
    EngineSettings,
    GenerationRequest,
    GenerationResult,
    SpeculativeEngine,
    StepRecord,
    build_engine,
    engine_settings,
)
from handler.runtime.loading import LoadedModels
from handler.types import SpeculativeStats

GREEDY = SamplingParams()


@dataclasses.dataclass(frozen=True)
class Method:
    """One way to generate: a Hugging Face `generate` call or this engine with given settings."""

    key: str
    label: str
    k: int | None = None  # the engine's k (its cap when the cost table plans)
    assistant: dict | None = None  # HF assisted generation's schedule
    prompt_lookup: int | None = None  # HF prompt_lookup_num_tokens
    drafter: str | None = None  # set for the engine's rows
    planned: bool = False  # the engine plans each step's k from the cost table
    tree: bool = True  # False: the request says speculative_tree off (look-ups verify chains only)
    confidence: bool = True  # False: the draft model drafts the planned k, without its confidence stop

    @property
    def is_engine(self) -> bool:
        return self.drafter is not None


def hf_target_only() -> Method:
    return Method("hf_target_only", "HF `generate`, target only")


def hf_assisted(schedule: dict, draft_note: str) -> Method:
    threshold = schedule["confidence_threshold"]
    label = f"HF assisted, same {draft_note} draft, {schedule['schedule']} {schedule['num_assistant_tokens']}"
    if threshold:
        label += f", threshold {threshold}"
    return Method("hf_assisted", label, assistant=schedule)


def hf_prompt_lookup(num_tokens: int) -> Method:
    return Method(f"hf_prompt_lookup_{num_tokens}", f"HF prompt lookup, {num_tokens} tokens", prompt_lookup=num_tokens)


def constant_schedule(k: int) -> dict:
    """HF assisted generation drafting exactly k tokens each step, like this engine's fixed k."""
    return {"num_assistant_tokens": k, "schedule": "constant", "confidence_threshold": 0.0}


def engine_method(key: str, drafter: str, k: int, planned: bool, lookup: int = 0) -> Method:
    """One of this engine's rows; `lookup` is the config's prompt_lookup_num_tokens (0: look-ups draft k)."""
    if k == 0:
        label = "this engine, k=0 (plain decoding)"
    else:
        mode = f"cost-table k<={k}" if planned else f"fixed k={k}"
        if drafter == NGRAM and lookup:
            mode = f"cost-table, look-ups<={lookup}" if planned else f"look-ups of {lookup}"
        elif drafter == HYBRID and lookup:
            mode += f", look-ups<={lookup}"
        label = f"this engine, {drafter} drafter, {mode}"
    return Method(key, label, k=k, drafter=drafter, planned=planned)


@dataclasses.dataclass
class Run:
    """One method over a list of prompts, once."""

    num_tokens: int = 0
    seconds: float = 0.0
    outputs: list[list[int]] = dataclasses.field(default_factory=list)
    stats: list[SpeculativeStats] = dataclasses.field(default_factory=list)  # the engine's, per request

    @property
    def tokens_per_second(self) -> float:
        return self.num_tokens / self.seconds if self.seconds else 0.0

    @property
    def totals(self) -> SpeculativeStats:
        """The requests' counters added up (none for a Hugging Face row)."""
        return SpeculativeStats.merge(self.stats) if self.stats else SpeculativeStats(0)

    @property
    def draft_tokens(self) -> int:
        return self.totals.draft_tokens

    @property
    def accepted_tokens(self) -> int:
        return self.totals.accepted_tokens

    @property
    def target_passes(self) -> int:
        return self.totals.target_forward_passes


def timed_run(generate: Callable[[Any], tuple[list[int], SpeculativeStats | None]], items: Sequence) -> Run:
    """The benchmarks' one timed loop: each item generated in turn, alone; seconds count each whole call,
    prefill included. `generate(item)` -> the output tokens and the engine's statistics (None for
    Hugging Face)."""
    run = Run()
    for item in items:
        start = time.perf_counter()
        tokens, stats = generate(item)
        run.seconds += time.perf_counter() - start
        run.num_tokens += len(tokens)
        run.outputs.append(tokens)
        if stats is not None:
            run.stats.append(stats)
    return run


class Runner:
    """Runs methods on the loaded pair: Hugging Face `generate` and this engine share the same models."""

    def __init__(self, models, config: HandlerConfig, cost_table) -> None:
        self.models = models
        self.config = config
        self.cost_table = cost_table
        self.engines: dict[tuple[bool, bool], SpeculativeEngine] = {}
        self.settings: EngineSettings | None = None  # the config's, resolved with the first engine

    def engine(self, planned: bool, confidence: bool = True) -> SpeculativeEngine:
        key = planned, confidence and self.config.draft_confidence
        if key not in self.engines:
            if self.settings is None:
                self.settings = engine_settings(self.models, self.config)
            # No prefix cache: each prompt runs several times, and later runs would skip the prefill
            # that the Hugging Face baselines pay for.
            self.engines[key] = build_engine(
                self.models,
                self.settings,
                cost_table=self.cost_table if planned else None,
                prefix_cache_max_bytes=None,
                draft_confidence=key[1],
            )
        return self.engines[key]

    def encode(self, prompt: dict) -> tuple[int, ...]:
        tokenizer = self.models.tokenizer
        text = tokenizer.apply_chat_template(prompt["messages"], tokenize=False, add_generation_prompt=True)
        return tuple(tokenizer(text, add_special_tokens=False)["input_ids"])

    def run(self, method: Method, prompts_ids: list[tuple[int, ...]], max_new_tokens: int) -> Run:
        """Generates greedily for each prompt in turn; seconds count each whole call, prefill included.

        An engine row's suffix trees start empty: the engine is shared between rows, and trees
        that had learned the other rows' answers to the same prompts would propose them.
        """
        if not method.is_engine:
            return timed_run(
                lambda prompt_ids: (self._hf_generate(method, prompt_ids, max_new_tokens), None), prompts_ids
            )
        engine = self.engine(method.planned, method.confidence)
        engine.forget_suffix_history()

        def generate(prompt_ids: tuple[int, ...]) -> tuple[list[int], SpeculativeStats]:
            tree = None if method.tree else False
            request = GenerationRequest(
                prompt_ids, max_new_tokens, GREEDY, method.k, drafter=method.drafter, speculative_tree=tree
            )
            result = engine.generate([request])[0]
            return result.token_ids, result.stats

        return timed_run(generate, prompts_ids)

    def _hf_generate(self, method: Method, prompt_ids: tuple[int, ...], max_new_tokens: int) -> list[int]:
        models = self.models
        input_ids = torch.tensor([prompt_ids], device=models.device)  # [1, prompt]
        kwargs = dict(
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            eos_token_id=list(models.eos_token_ids),
            pad_token_id=models.pad_token_id,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
        )
        if method.prompt_lookup is not None:
            kwargs["prompt_lookup_num_tokens"] = method.prompt_lookup
        if method.assistant is not None:
            # The draft object the engine uses, int8 layers included: HF runs it as it is.
            draft = models.draft
            kwargs["assistant_model"] = draft
            # transformers reads the schedule from the assistant's own generation config.
            generation_config = draft.generation_config
            generation_config.num_assistant_tokens = method.assistant["num_assistant_tokens"]
            generation_config.num_assistant_tokens_schedule = method.assistant["schedule"]
            generation_config.assistant_confidence_threshold = method.assistant["confidence_threshold"]
            if models.vocab_map is not None:
                # A draft from another family: universal assisted generation, with both tokenizers.
                kwargs.update(tokenizer=models.tokenizer, assistant_tokenizer=models.vocab_map.draft_tokenizer)
            elif draft.config.vocab_size != models.target.config.vocab_size:
                # transformers then insists on universal assisted decoding, which needs both tokenizers.
                kwargs.update(tokenizer=models.tokenizer, assistant_tokenizer=models.tokenizer)
        with torch.inference_mode():
            output = models.target.generate(input_ids, **kwargs)  # [1, prompt + new]
        return trim_at_eos(output[0, len(prompt_ids) :].tolist(), models.eos_token_ids)


def trim_at_eos(tokens: list[int], eos_token_ids) -> list[int]:
    """The tokens up to and including the first EOS, as the engine returns them."""
    for i, token in enumerate(tokens):
        if token in eos_token_ids:
            return tokens[: i + 1]
    return tokens


def acceptance(run: Run) -> dict:
    return {
        "acceptance_rate": run.accepted_tokens / run.draft_tokens if run.draft_tokens else None,
        "tokens_per_pass": run.num_tokens / run.target_passes if run.target_passes else None,
        "drafts_per_pass": run.draft_tokens / run.target_passes if run.target_passes else None,
    }


def bench_config(args) -> HandlerConfig:
    """The handler config the bench loads with: the model-config file, the paths and overrides from the CLI."""
    with open(args.config, encoding="utf-8") as f:
        config = handler_config_from_yaml_config(yaml.safe_load(f))
    overrides = {"target_model": str(pathlib.Path(args.target).resolve())}
    overrides["draft_model"] = str(pathlib.Path(args.draft).resolve())
    overrides["drafter"] = MODEL if config.drafter == NGRAM else config.drafter
    if args.dtype:
        overrides["dtype"] = args.dtype
    if args.draft_quantization:
        overrides["draft_quantization"] = args.draft_quantization
    return dataclasses.replace(config, **overrides)


# --------------------------------------------------------------------------- serving-shaped runs

MODEL_NAME = "bench"  # the served name the parsed requests address


@dataclasses.dataclass(frozen=True)
class ChatRoute:
    """Engine rows as the OpenAI chat route makes them (`parse_openai_request`): template, tools, defaults."""

    config: HandlerConfig
    models: LoadedModels

    def request(self, messages: list[dict], tools: list[dict], max_new_tokens: int) -> GenerationRequest:
        body: dict = {"messages": messages, "max_tokens": max_new_tokens, "temperature": 0}
        if tools:
            body["tools"] = tools
        tokenizer, max_context = self.models.tokenizer, self.models.max_context
        parsed = parse_openai_request(ROUTE_CHAT, body, self.config, tokenizer, max_context, MODEL_NAME)
        [generation] = parsed.generations
        return generation

    def num_tokens(self, system: str, tools: list[dict]) -> int:
        """Tokens of the system turn with its tools, as rendered for the model."""
        return len(self.request([{"role": "system", "content": system}], tools, 1).prompt_ids)


def poisson_arrivals(num_requests: int, rate: float, seed: int) -> list[float]:
    """Arrival times in seconds from the start: the first at 0, then exponential gaps of mean 1 / rate."""
    rng, arrivals, now = random.Random(seed), [], 0.0
    for _ in range(num_requests):
        arrivals.append(now)
        now += rng.expovariate(rate)
    return arrivals


@dataclasses.dataclass
class Traffic:
    """What `drive` saw: per request, in seconds from the start, when it was sent, when the first
    step that emitted a token for it ended (and how many that step emitted), when it finished and
    its result; the engine's record of every step, and when each step ended with the tokens it emitted."""

    sent: list[float]
    first_at: list[float]
    first_tokens: list[int]
    done_at: list[float]
    results: list[GenerationResult]
    steps: list[StepRecord]
    emitted: list[tuple[float, int]] = dataclasses.field(default_factory=list)  # (step's end, tokens)
    step_tokens: list[int] = dataclasses.field(default_factory=list)  # the tokens of each of `steps`

    def steady_tokens_per_s(self) -> float | None:
        """Tokens/s while the load held: from the start until the first request that finished after the
        last one was sent (in a closed loop, the first client left without a next request), the tokens
        of the steps that ended by then. After it the batch drains as the clients finish: a drain's
        steps, with fewer rows, cost nearly as much as full ones on a CPU, and its length depends on
        how evenly the clients' requests finished. None where every request was sent at the start."""
        last_sent = max(self.sent)
        if last_sent <= 0.0:
            return None
        end = min(done for done in self.done_at if done > last_sent)
        return sum(tokens for at, tokens in self.emitted if at <= end) / end

    def ttft(self) -> list[float]:
        """Each request's time to its first token, from when it was sent."""
        return [first - sent for first, sent in zip(self.first_at, self.sent)]

    def decode_rates(self) -> list[float | None]:
        """Each request's tokens/s after the first step that emitted for it: what a streaming client
        sees once the answer starts (None where that step emitted them all)."""
        return [
            (len(result.token_ids) - first_n) / (done - first)
            if len(result.token_ids) > first_n and done > first
            else None
            for result, first_n, done, first in zip(self.results, self.first_tokens, self.done_at, self.first_at)
        ]


class Driver:
    """One engine's traffic, advanced one step at a time on a clock of its own.

    The clock counts the seconds this driver spent admitting and stepping (measured, wall clock) and
    jumps over idle waits for the next arrival (nothing runs then; no sleep). Driven alone it reads
    what a wall clock would; several drivers advanced in turn (`drive_interleaved`) each count only
    their own steps, so that machine drift between measures falls on every engine alike.
    """

    def __init__(
        self, engine: SpeculativeEngine, requests: list, arrivals: list[float] | None, max_in_flight: int
    ) -> None:
        num = len(requests)
        self.engine, self.requests, self.arrivals, self.max_in_flight = engine, requests, arrivals, max_in_flight
        # What it saw so far, filled in as it advances.
        self.traffic = Traffic([0.0] * num, [0.0] * num, [0] * num, [0.0] * num, [None] * num, [])
        self.next_index, self.clock = 0, 0.0

    @property
    def done(self) -> bool:
        return self.next_index == len(self.requests) and not self.engine.has_unfinished_requests()

    def advance(self) -> None:
        """Admits what has arrived (each request joins at the first step boundary after it arrives;
        in a closed loop, as soon as fewer than max_in_flight are in flight) and runs one step."""
        engine, num, arrivals, traffic = self.engine, len(self.requests), self.arrivals, self.traffic
        started = time.perf_counter() - self.clock
        now = self.clock
        while self.next_index < num and engine.num_active_requests < self.max_in_flight:
            index = self.next_index
            if arrivals is not None and arrivals[index] > now:
                break
            traffic.sent[index] = now if arrivals is None else arrivals[index]
            engine.add_request(index, self.requests[index])
            self.next_index += 1
        if not engine.has_unfinished_requests():
            # Idle until the next arrival: the clock moves there.
            self.clock = max(time.perf_counter() - started, arrivals[self.next_index])
            return
        num_steps = engine.steps.num_steps
        outputs = engine.step()
        now = self.clock = time.perf_counter() - started
        num_tokens = sum(len(output.new_token_ids) for output in outputs)
        traffic.emitted.append((now, num_tokens))
        if engine.steps.num_steps > num_steps:  # a step that only admitted requests keeps no record
            traffic.steps.append(engine.steps.recent_steps[-1])
            traffic.step_tokens.append(num_tokens)
        for output in outputs:
            index = output.request_id
            if not traffic.first_tokens[index] and output.new_token_ids:
                traffic.first_at[index], traffic.first_tokens[index] = now, len(output.new_token_ids)
            if output.result is not None:
                traffic.done_at[index], traffic.results[index] = now, output.result


def drive(engine: SpeculativeEngine, requests: list, arrivals: list[float] | None, max_in_flight: int) -> Traffic:
    """Runs `requests` through the engine's step API, as the handler's continuous batching does.

    With `arrivals` (seconds from the start), each request joins at the first step boundary after
    it arrives; without, a closed loop: each joins as soon as fewer than `max_in_flight` are in
    flight. At most `max_in_flight` run at once either way. Times are the `Driver`'s clock.
    """
    [traffic] = drive_interleaved([Driver(engine, requests, arrivals, max_in_flight)])
    return traffic


def drive_interleaved(drivers: list[Driver]) -> list[Traffic]:
    """Advances the drivers in turn, one step each, until all are done: engines measured side by side
    on one machine meet the same drift (a neighbour's load, a slow spell), step by step, instead
    of one engine's measure catching a slow minute that another's missed."""
    while not all(driver.done for driver in drivers):
        for driver in drivers:
            if not driver.done:
                driver.advance()
    return [driver.traffic for driver in drivers]
