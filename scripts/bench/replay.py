"""Real acceptance on random weights, replayed: the real pair's accept lengths at this machine's costs.

No real weights reach the GPU machine. Random-weight models of the real shapes
(`scripts.bench.gpu_check.build_model`) cost what the real ones cost, but their drafts are never
accepted, so a speedup measured on them says nothing. `scripts.bench.accept_traces` recorded on the
CPU how many drafts the real pair (Qwen2.5-Coder 0.5B -> 1.5B, greedy, k = 4) accepted at each target
pass of each request (scripts/bench/traces/). This benchmark replays those outcomes on any pair:

- `ReplayDrafter`, the engine's model drafter, still runs its k draft passes over the batch for
  their cost, and then puts the replay's drafts in place of the draft's draws (one-hot draft
  distributions): the target's own greedy continuation where the real draft was right, a wrong
  token where it was wrong. The engine's verify pass, unchanged, then accepts what the real pair
  accepted, and the output is the target's (verification is the target's: exactness holds for any
  proposal). Benchmark-only: it lives here, never in handler/, and no config can name it.
- The trace is read per position (`matches_of`); position 0, a request's first token, comes from its
  prefill's logits and is never drafted. A greedy draft at completion position p, in a pass
  whose earlier drafts were all accepted, was drawn after exactly the target's tokens before p, so
  whether it was right is a property of p. A recorded pass at t that accepted n < k says positions
  t..t+n-1 right and t+n wrong; one that accepted all k says nothing of t+k, where the target's own
  (bonus) token went. At the trace's fixed k the replay's passes fall where the recorded ones did and
  accept exactly the recorded lengths; where a planner picks another k, a pass can reach a position
  the trace does not know: it is proposed wrong (a lower bound) and counted (`unknown`).
- The target's greedy continuation of each request comes first from plain decoding (k = 0) in the
  same engine, dtype, device and concurrency (its untimed warm-up and timed runs). In bf16 the
  verify pass (other widths, other batch shapes) may choose differently: the replay follows each
  row's committed tokens and counts a request whose text left its continuation (`diverged`); its
  later drafts come from the stale continuation and are mostly rejected, so such a row shows fewer
  tokens a pass than the trace. Before the timed runs, untimed runs settle the continuations: where
  a run diverged, its outputs (the target's own, under the replay's passes) become the next run's
  continuations, for up to --settle-rounds runs. The timed runs report what still diverged.

Greedy only: the trace is greedy, and a wrong token is only wrong against the target's argmax.

Rows, every figure with replayed acceptance: `plain` (k = 0); `fixed` (the replay drafter at the
trace's k, no cost table: every pass drafts k); `planned` (the planner with a cost table measured at
start on this device, k <= the trace's k, chains only, no confidence stop and no guesses: a random
draft's confidences mean nothing, and the replayed ones are certain); `free` (the replayed drafts
proposed as a look-up: no draft pass, c = 0: the ceiling a drafter with the real pair's acceptance
and no cost reaches).

No hybrid row. The trace holds the model drafter's outcomes only: what a hybrid step's look-up
(suffix trees, n-grams over the real prompt and answer) would have proposed, and how much of it the
target would have accepted, was never recorded, nor which proposal the hybrid's rule would have
picked from them. Replaying the model's accept lengths as free look-up drafts is the `free` row: a
ceiling, not the hybrid.

Workload per set and concurrency C (closed loop through the engine's step API,
`scripts.bench.runner.drive`): each of the set's traced requests (or its first --requests-per-set),
replayed on a random prompt of its recorded length (the text does not matter to random weights, its
length does), with its recorded completion length as max_new_tokens and no stop token, repeated (on
other random prompts) until there are --requests-per-client * C at least: a whole number of times,
so that the trace's tokens a pass is the workload's.

The table, per set, C and row: tokens/s (median of --repeats timed runs after the warm-up), x plain,
tokens a target pass (a row's passes, summed over the requests) beside the trace's, the mean k, c
(a draft pass over a target pass of one token, batch C, timed alone with synchronisations), v (a
target pass of k + 1 tokens over one of a token), E/(kc+1) and E/(kc+v) beside the measured ratio
(E: the row's tokens a pass), the passes that accepted what the replay expected, and the requests
that diverged.

    python -m scripts.bench.replay                                    # the tiny pair on the CPU: a check
    python -m scripts.bench.replay --device cuda --runner static --shapes 1.5B,7B --draft-shape 0.5B
    python -m scripts.bench.replay --trace some.json --sets grounded --concurrency 1,2 --repeats 1

Benchmarks are programs: take figures on a quiet machine, never in a test.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import pathlib
import statistics
import tempfile
from typing import Hashable, Mapping, Sequence

import torch

from handler import runners
from handler.drafters import MODEL, NGRAM, DraftRow, Proposal
from handler.drafters.model import ModelDrafter
from handler.engine import EngineOptions, EngineSettings, GenerationRequest, SpeculativeEngine
from handler.engine.build import build_parts
from handler.planning.measure import measure_cost_table
from handler.runtime.loading import LoadedModels
from handler.sampler import SamplingBatch, host_to_device
from scripts.bench import accept_traces
from scripts.bench.common import fmt
from scripts.bench.load import figures
from scripts.bench.runner import GREEDY, drive

logger = logging.getLogger(__name__)

PLAIN, FIXED, PLANNED, FREE = "plain", "fixed", "planned", "free"
ROWS = (PLAIN, FIXED, PLANNED, FREE)
# Each row's requests: their k (None: the trace's) and drafter. Plain rows never reach a drafter.
ROW_REQUESTS = {PLAIN: (0, MODEL), FIXED: (None, MODEL), PLANNED: (None, MODEL), FREE: (None, NGRAM)}


def matches_of(drafted: Sequence[int], accepted: Sequence[int]) -> list[bool | None]:
    """A request's trace read per completion position: whether the real draft's greedy token there
    was the target's (None: unknown, the target's own token after a pass that accepted every draft,
    or a pass without drafts; and the first token, from the prefill). Each pass covers its accepted
    drafts and the target's token after them."""
    matches: list[bool | None] = [None]
    for num_drafts, num_accepted in zip(drafted, accepted):
        matches += [True] * num_accepted
        matches.append(False if num_accepted < num_drafts else None)
    return matches


@dataclasses.dataclass
class Script:
    """One request's replay: its positions' matches (`matches_of`), and the target's greedy completion."""

    matches: list[bool | None]
    continuation: list[int]

    def match(self, position: int) -> bool | None:
        return self.matches[position] if position < len(self.matches) else None


@dataclasses.dataclass
class ReplayCounts:
    """What the replay did in a run."""

    passes: int = 0  # row-passes whose drafts the replay proposed
    as_recorded: int = 0  # of them, those that accepted the length the replay expected
    unknown: int = 0  # passes that reached a position the trace does not know (proposed wrong)
    diverged: int = 0  # requests whose committed tokens left their continuation

    def __add__(self, other: ReplayCounts) -> ReplayCounts:
        return ReplayCounts(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))


class Replay:
    """The scripts of a run's requests, by request id, and where each row stands: what the replay
    drafters share. `begin` before a run; the drafters then call `start`, `follow` and `stop` as the
    engine adds, steps and drops rows, and `drafts` for a row's proposal. The engine shows every
    drafter every row's tokens: a row is followed by the drafter that started it only (`owner`)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.begin({})

    def begin(self, scripts: Mapping[Hashable, Script]) -> None:
        self.scripts = dict(scripts)
        self.committed: dict[Hashable, list[int]] = {}  # each row's completion so far
        self.owner: dict[Hashable, str] = {}  # the drafter that follows each row
        self.expected: dict[Hashable, int] = {}  # the accepted length each row's last proposal expects
        self.diverged_at: dict[Hashable, int] = {}  # where a row's completion left its continuation
        self._counts = ReplayCounts()

    @property
    def counts(self) -> ReplayCounts:
        return dataclasses.replace(self._counts, diverged=len(self.diverged_at))

    def start(self, request_ids, owner: str) -> None:
        for request_id in request_ids:
            assert request_id in self.scripts, f"request {request_id!r} has no replay script"
            self.committed[request_id] = []
            self.owner[request_id] = owner

    def stop(self, request_ids, owner: str) -> None:
        for request_id in request_ids:
            if self.owner.get(request_id) != owner:
                continue
            self.committed.pop(request_id, None)
            self.owner.pop(request_id, None)
            self.expected.pop(request_id, None)

    def follow(self, committed: Mapping[Hashable, Sequence[int]], owner: str) -> None:
        """Takes the tokens each of `owner`'s rows committed in a step: checks them against the
        continuation, and the accepted length against the replay's (a step emits the accepted drafts
        and one token)."""
        for request_id, tokens in committed.items():
            if self.owner.get(request_id) != owner:
                continue
            done = self.committed[request_id]
            continuation = self.scripts[request_id].continuation
            if request_id not in self.diverged_at:
                for position, token in enumerate(tokens, start=len(done)):
                    if position >= len(continuation) or continuation[position] != token:
                        self.diverged_at[request_id] = position
                        break
            expected = self.expected.pop(request_id, None)
            if expected is not None:
                self._counts.passes += 1
                self._counts.as_recorded += len(tokens) == expected + 1
            done.extend(tokens)

    def drafts(self, request_id: Hashable, num: int) -> list[int]:
        """The row's `num` drafts: its continuation while the real draft was right, then wrong tokens
        (the continuation's token plus one: not the target's argmax, so the verify stops there)."""
        if num == 0:
            return []  # a look-up is asked for every row, with no room too: no pass to replay
        script = self.scripts[request_id]
        start = len(self.committed[request_id])
        num_right = 0
        while num_right < num and script.match(start + num_right) is True:
            num_right += 1
        if num_right < num and script.match(start + num_right) is None:
            self._counts.unknown += 1
        self.expected[request_id] = num_right
        continuation = script.continuation
        assert start + num <= len(continuation), "drafts stay inside max_new_tokens"
        return [
            continuation[start + j] if j < num_right else (continuation[start + j] + 1) % self.vocab_size
            for j in range(num)
        ]


class ReplayDrafter(ModelDrafter):
    """The model drafter whose passes run as they would and whose drafts are the replay's.

    Each pass's logits are replaced, after the draft model computed them, by logits certain of the
    replay's draft at that pass (`_target_logits`): the warp makes its distribution one-hot and the
    draw takes it, so the draft model is fed the replay's drafts and its cache rolls back after the
    verify as it would after the real pair's (the accepted drafts stay, the target's token is
    pending). Everything else is the model drafter's own: its chains on the device, its reads. The
    replay adds what the real drafter does not make: a copy of the drafts to the device a proposal,
    and a fill and a scatter of [rows, vocab] a pass.
    """

    def __init__(self, drafter: ModelDrafter, replay: Replay) -> None:
        # Built from the engine's own drafter, on its runner; no guesser (no guessed drafting).
        super().__init__(drafter.model, drafter.vocab_size, drafter.pad_token_id, drafter.prefix_cache, drafter.runner)
        self.replay = replay
        self._replayed: torch.Tensor | None = None  # [cache rows, k]: the proposal's drafts, on the device
        self._num_passes = 0

    def add(self, prompts: Mapping[Hashable, Sequence[int]], private: Sequence[Hashable] = ()) -> None:
        super().add(prompts, private)
        self.replay.start(prompts, self.name)

    def observe(self, committed: Mapping[Hashable, Sequence[int]]) -> None:
        super().observe(committed)
        self.replay.follow(committed, self.name)

    def remove(
        self, request_ids: Sequence[Hashable], sequences: Mapping[Hashable, Sequence[int]] | None = None
    ) -> None:
        super().remove(request_ids, sequences)
        self.replay.stop(request_ids, self.name)

    def propose(self, rows: Sequence[DraftRow], sampling: SamplingBatch, keep_drafting=None) -> list[Proposal]:
        k = max(row.max_tokens for row in rows)
        wanted = {row.request_id: self.replay.drafts(row.request_id, row.max_tokens) for row in rows}
        # Rows of the cache that do not ask draft too, to keep the batch rectangular: any token.
        replayed = [(wanted.get(request_id, []) + [self.pad_token_id] * k)[:k] for request_id in self.order]
        self._replayed = host_to_device(torch.tensor(replayed, dtype=torch.long), self.device)  # [rows, k]
        self._num_passes = 0
        return super().propose(rows, sampling, keep_drafting)

    def _target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:  # [rows, 1, draft_vocab]
        logits = super()._target_logits(draft_logits)  # [rows, 1, vocab]: the draft model's, as it would use them
        assert logits.shape[1] == 1, "one draft a pass: no guesses"
        column = min(self._num_passes, self._replayed.shape[1] - 1)
        self._num_passes += 1
        tokens = self._replayed[:, column]  # [rows]
        return torch.full_like(logits, float("-inf")).scatter_(-1, tokens[:, None, None], 0.0)  # [rows, 1, vocab]


class ReplayLookup:
    """A look-up whose drafts are the replay's: no draft pass (the `free` row)."""

    name = NGRAM

    def __init__(self, replay: Replay) -> None:
        self.replay = replay

    def propose(self, rows: Sequence[DraftRow], sampling: SamplingBatch, keep_drafting=None) -> list[Proposal]:
        return [Proposal(self.replay.drafts(row.request_id, row.max_tokens)) for row in rows]

    def add(self, prompts: Mapping[Hashable, Sequence[int]], private: Sequence[Hashable] = ()) -> None:
        self.replay.start(prompts, self.name)

    def observe(self, committed: Mapping[Hashable, Sequence[int]]) -> None:
        self.replay.follow(committed, self.name)

    def remove(
        self, request_ids: Sequence[Hashable], sequences: Mapping[Hashable, Sequence[int]] | None = None
    ) -> None:
        self.replay.stop(request_ids, self.name)


def replay_engine(models: LoadedModels, replay: Replay, runner: str, cost_table=None) -> SpeculativeEngine:
    """An engine whose drafters are the replay's: `ReplayDrafter` in place of the model drafter and
    `ReplayLookup` in place of the n-gram look-up, put there before the engine is made from its parts
    so that the planner prices the replay's. Chains only (the trace's), no prefix cache. A row's
    requests pick its drafter and k (`ROW_REQUESTS`); `cost_table`: the planned row's engine."""
    parts = build_parts(models, EngineSettings(speculative_tree="off", runner=runner), cost_table, EngineOptions())
    parts.drafters[NGRAM] = ReplayLookup(replay)
    parts.drafters[MODEL] = ReplayDrafter(parts.drafters[MODEL], replay)
    parts.planner.model_drafter = parts.drafters[MODEL]
    return SpeculativeEngine(parts)


@dataclasses.dataclass(frozen=True)
class Instance:
    """One request of a workload: a traced request replayed on a random prompt of its length."""

    trace: dict
    prompt_ids: tuple[int, ...]

    def request(self, k: int, drafter: str) -> GenerationRequest:
        return GenerationRequest(self.prompt_ids, self.trace["num_tokens"], GREEDY, k, drafter=drafter)

    def script(self, continuation: list[int]) -> Script:
        return Script(matches_of(self.trace["drafted"], self.trace["accepted"]), list(continuation))


def workload(traces: list[dict], concurrency: int, per_client: int, vocab: int, seed: int) -> list[Instance]:
    """The set's traced requests, each on a random prompt of its recorded length, repeated a whole
    number of times until there are `per_client * concurrency` at least."""
    copies = math.ceil(max(len(traces), per_client * concurrency) / len(traces))
    generator = torch.Generator().manual_seed(seed)
    return [
        Instance(trace, tuple(torch.randint(0, vocab, (trace["prompt_tokens"],), generator=generator).tolist()))
        for _ in range(copies)
        for trace in traces
    ]


@dataclasses.dataclass
class Pair:
    """What every measure on a pair shares: its models, the replay, its engines, the trace's k."""

    target: torch.nn.Module
    draft: torch.nn.Module
    replay: Replay
    engine: SpeculativeEngine  # the plain, fixed and free rows'
    planned: SpeculativeEngine | None  # the planned row's: the same with a cost table
    k: int

    @property
    def prompt_vocab(self) -> int:
        return min(model.config.get_text_config().vocab_size for model in (self.target, self.draft))

    def run(self, row: str, instances: list[Instance], concurrency: int, continuations=None) -> dict:
        """One closed-loop run of the row's requests (`continuations`: a replayed row's, one per
        instance): its figures (`scripts.bench.load.figures`), the rows' passes, the replay's counts."""
        k, drafter = ROW_REQUESTS[row]
        scripts = {} if row == PLAIN else {i: x.script(c) for i, (x, c) in enumerate(zip(instances, continuations))}
        self.replay.begin(scripts)
        engine = self.planned if row == PLANNED else self.engine
        requests = [instance.request(self.k if k is None else k, drafter) for instance in instances]
        traffic = drive(engine, requests, None, concurrency)
        run = figures(traffic)
        run["row_passes"] = sum(result.stats.target_forward_passes for result in traffic.results)
        run["counts"] = self.replay.counts
        return run


def pass_costs(target, draft, runner: str, batch_size: int, k: int, context: int, repeats: int) -> dict[str, float]:
    """c (a draft pass over a target pass, one token each) and v (a target pass of k + 1 tokens over
    one of a token), at `batch_size` rows of `context` tokens, each pass timed alone."""

    def seconds(model, width: int) -> float:
        return runners.time_runner_pass(runners.make_runner(runner, model), batch_size, width, context, repeats)

    step = seconds(target, 1)
    return {"c": seconds(draft, 1) / step, "v": seconds(target, k + 1) / step, "target_step_s": step}


def summarize(runs: list[dict], instances: list[Instance]) -> dict:
    """A row's figures over its timed runs: median tokens/s; tokens a pass, the trace's, mean k (the
    first run's: every run replays the same); the replay's counts, summed."""
    tokens = sum(len(ids) for ids in runs[0]["token_ids"])
    return {
        "tokens_per_s": statistics.median(run["tokens_per_s"] for run in runs),
        "tokens_per_pass": tokens / runs[0]["row_passes"],
        # Each request's passes and its prefill's, which gave its first token (as the stats count them).
        "trace_tokens_per_pass": sum(x.trace["num_tokens"] for x in instances)
        / sum(len(x.trace["accepted"]) + 1 for x in instances),
        "mean_k": runs[0]["mean_k"],
        "counts": dataclasses.asdict(sum((run["counts"] for run in runs), ReplayCounts())),
    }


def settled_runs(pair: Pair, row: str, instances: list[Instance], continuations, concurrency: int, args):
    """A replayed row's timed runs, after untimed ones (the first a warm-up) that settle the
    continuations: a run that diverged hands its outputs (the target's own, under the replay's
    passes) to the next as continuations. Returns the timed runs and the untimed ones' number."""
    settle_runs = 0
    while settle_runs < max(1, args.settle_rounds):
        untimed = pair.run(row, instances, concurrency, continuations)
        settle_runs += 1
        if not untimed["counts"].diverged:
            break
        continuations = untimed["token_ids"]
    return [pair.run(row, instances, concurrency, continuations) for _ in range(args.repeats)], settle_runs


def measure_load(pair: Pair, traces: list[dict], name: str, concurrency: int, seed: int, args) -> list[dict]:
    """Every row at one set and concurrency: plain first (its outputs are the first continuations)."""
    instances = workload(traces, concurrency, args.requests_per_client, pair.prompt_vocab, seed)
    context = round(statistics.fmean(t["prompt_tokens"] + t["num_tokens"] / 2 for t in traces))
    costs = pass_costs(pair.target, pair.draft, args.runner, concurrency, pair.k, context, args.pass_repeats)
    base = {"set": name, "concurrency": concurrency, "requests": len(instances), "k": pair.k, **costs}
    pair.run(PLAIN, instances, concurrency)  # warm-up
    plain_runs = [pair.run(PLAIN, instances, concurrency) for _ in range(args.repeats)]
    plain_outputs = plain_runs[0]["token_ids"]
    cells = [{**base, "row": PLAIN, **summarize(plain_runs, instances), "settle_runs": 0}]
    for row in args.rows:
        if row == PLAIN:
            continue
        runs, settle_runs = settled_runs(pair, row, instances, plain_outputs, concurrency, args)
        cell = {**base, "row": row, **summarize(runs, instances), "settle_runs": settle_runs}
        cell["vs_plain"] = cell["tokens_per_s"] / cells[0]["tokens_per_s"]
        cell["outputs_differ"] = sum(a != b for a, b in zip(runs[0]["token_ids"], plain_outputs))
        cells.append(cell)
        logger.info("%s C=%d %s: %.1f tok/s", name, concurrency, row, cell["tokens_per_s"])
    return cells


def measure(args, target, draft, tokenizer) -> dict:
    """Every set, concurrency and row of `args` on the pair: the report `table` prints."""
    report = json.loads(pathlib.Path(args.trace).read_text(encoding="utf-8"))
    assert report.get("sampling", "greedy") == "greedy", "the replay is greedy, as its trace must be"
    k = report["k"]
    models = LoadedModels.of(target, draft, tokenizer, eos_token_ids=())
    replay = Replay(target.config.get_text_config().vocab_size)
    planned = None
    if PLANNED in args.rows:
        # Measured as the handler measures it at start-up, on this device, up to the widest C.
        max_batch_size = max(args.concurrency)
        cost_table = measure_cost_table(target, draft, k + 1, max_batch_size, runner=args.runner)
        planned = replay_engine(models, replay, args.runner, cost_table)
    pair = Pair(target, draft, replay, replay_engine(models, replay, args.runner), planned, k)
    cells = []
    for set_index, name in enumerate(args.sets):
        traces = [trace for trace in report["requests"] if trace["set"] == name][: args.requests_per_set or None]
        if not traces:
            raise ValueError(f"{args.trace}: no requests of set {name!r}")
        for concurrency in args.concurrency:
            cells += measure_load(pair, traces, name, concurrency, args.seed + set_index, args)
    return {
        "trace": {key: report[key] for key in ("date", "target", "draft", "k", "dtype", "max_new_tokens")},
        "dtype": str(models.dtype).replace("torch.", ""),
        "device": str(models.device),
        "runner": args.runner,
        "cells": cells,
    }


ROW_LABELS = {PLAIN: "plain (k = 0)", FIXED: "model, fixed k", PLANNED: "model, planned", FREE: "free drafts (c = 0)"}


def predicted(cell: dict) -> tuple[float | None, float | None]:
    """E/(kc+1) and E/(kc+v) for a row at a fixed k (the free row's c is 0); None for the others."""
    if cell["row"] not in (FIXED, FREE):
        return None, None
    k, c, v, e = cell["k"], (cell["c"] if cell["row"] == FIXED else 0.0), cell["v"], cell["tokens_per_pass"]
    return e / (k * c + 1), e / (k * c + v)


def table(report: dict) -> str:
    """The report as a markdown table, every figure labelled as replayed acceptance."""
    trace = report["trace"]
    lines = [
        f"Replayed acceptance: the {trace['draft']} -> {trace['target']} pair's accept lengths (k = {trace['k']}, "
        f"greedy, recorded {trace['date']}) on this pair's costs ({report['dtype']}, {report['device']}, "
        f"{report['runner']} runner); x plain: against k = 0 in the same run.",
        "",
        "| set | C | row (replayed acceptance) | tok/s | x plain | tok/pass | trace tok/pass | mean k | c | v "
        "| E/(kc+1) | E/(kc+v) | passes as recorded | unknown | diverged |",
        "|" + "---|" * 15,
    ]
    for cell in report["cells"]:
        counts = cell["counts"]
        simple, with_v = predicted(cell)
        if cell["row"] == PLAIN:
            trace_tokens, recorded, unknown, diverged = "-", "-", "-", "-"
        else:
            trace_tokens = f"{cell['trace_tokens_per_pass']:.2f}"
            recorded = f"{counts['as_recorded']}/{counts['passes']}"
            unknown, diverged = counts["unknown"], counts["diverged"]
        lines.append(
            f"| {cell['set']} | {cell['concurrency']} | {ROW_LABELS[cell['row']]} | {cell['tokens_per_s']:.1f} "
            f"| {fmt(cell.get('vs_plain'))} | {cell['tokens_per_pass']:.2f} | {trace_tokens} | {cell['mean_k']:.2f} "
            f"| {cell['c']:.3f} | {cell['v']:.2f} | {fmt(simple)} | {fmt(with_v)} "
            f"| {recorded} | {unknown} | {diverged} |"
        )
    return "\n".join(lines)


def load_tiny_pair(models: pathlib.Path | None, device: str):
    """The tiny pair in float32 and its tokenizer, from `models` (target/ and draft/), built now where None."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if models is None:
        from scripts.model_tools import make_tiny_models

        with tempfile.TemporaryDirectory() as folder:
            target, draft, tokenizer = make_tiny_models.build(pathlib.Path(folder), seed=0, draft_noise=0.1)
        return target.to(device), draft.to(device), tokenizer
    tokenizer = AutoTokenizer.from_pretrained(models / "target")
    target, draft = (
        AutoModelForCausalLM.from_pretrained(models / role, dtype=torch.float32).eval().to(device)
        for role in ("target", "draft")
    )
    return target, draft, tokenizer


def load_shapes(shape: str, draft_shape: str, device: str):
    """Random-weight Qwen2.5 shapes in bf16 (`scripts.bench.gpu_check.SHAPES`) and a text tokenizer."""
    from scripts.bench import gpu_check

    build = lambda name: gpu_check.build_model(gpu_check.SHAPES[name], torch.device(device), torch.bfloat16)  # noqa: E731
    return build(shape), build(draft_shape), gpu_check.text_tokenizer()


def comma_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", default=str(accept_traces.DEFAULT_OUT), help="a scripts.bench.accept_traces file")
    parser.add_argument("--sets", type=comma_list, default=list(accept_traces.SETS), help="e.g. open,grounded")
    parser.add_argument("--rows", type=comma_list, default=list(ROWS), help=f"of {', '.join(ROWS)}")
    parser.add_argument("--concurrency", type=lambda text: [int(c) for c in comma_list(text)], default=[1, 4, 16])
    parser.add_argument("--requests-per-set", type=int, default=0, help="the set's first traced requests (0: all)")
    parser.add_argument("--requests-per-client", type=int, default=2, help="requests at least: this times C")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each row (median)")
    parser.add_argument("--settle-rounds", type=int, default=3, help="untimed runs before them, at most (>= 1)")
    parser.add_argument("--pass-repeats", type=int, default=10, help="timed passes for c and v (median)")
    parser.add_argument("--runner", choices=(runners.DYNAMIC, runners.STATIC), default=runners.DYNAMIC)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--models", type=pathlib.Path, default=None, help="the tiny pair's folder (default: built now)")
    parser.add_argument("--shapes", type=comma_list, default=[], help="gpu_check target shapes, e.g. 1.5B,7B (bf16)")
    parser.add_argument("--draft-shape", default="0.5B", help="the draft's gpu_check shape, with --shapes")
    parser.add_argument("--seed", type=int, default=0, help="of the random prompts")
    args = parser.parse_args(argv)
    for name, chosen, known in (("--rows", args.rows, ROWS), ("--sets", args.sets, accept_traces.SETS)):
        unknown = sorted(set(chosen) - set(known))
        if unknown or not chosen:
            parser.error(f"{name}: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(known)}")
    if PLAIN not in args.rows:
        args.rows = [PLAIN, *args.rows]  # every ratio is to it
    if min(args.concurrency, default=0) < 1 or args.repeats < 1:
        parser.error("--concurrency and --repeats must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING)
    args = parse_args(argv)
    for shape in args.shapes or [None]:
        if shape is None:
            target, draft, tokenizer = load_tiny_pair(args.models, args.device)
            what = "the tiny pair, float32"
        else:
            target, draft, tokenizer = load_shapes(shape, args.draft_shape, args.device)
            what = f"random weights, {args.draft_shape} draft -> {shape} target, bf16"
        report = measure(args, target, draft, tokenizer)
        print(f"Replayed acceptance on {what}")
        print(table(report), flush=True)
        del target, draft
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
