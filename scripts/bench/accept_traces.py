#!/usr/bin/env python3
"""Accept-length traces: how many drafts the target accepted at each of its passes, per request.

A GPU study of batching, CUDA graphs or verify widths needs acceptance as the
real pair gives it, not a made-up rate: accepted lengths come in runs (a copied
line accepts every draft, a new identifier none), and a mean hides that. This
runs the demo pair at a fixed k and keeps, for every request, the drafts each
target pass verified and how many of them it accepted, in order, so that a
replay can feed the same sequence of outcomes to any engine or machine.

The engine reports both counts for every step (`StepOutput.num_draft_tokens`
and `num_accepted_tokens`, from the verifier's `num_accepted`); nothing is
re-derived here. Settings: the model drafter at a fixed k (no cost table, no
confidence stop: every pass drafts k, fewer only where max_new_tokens is near),
greedy, one request at a time, no prefix cache, on the dynamic runner.

Prompt sets: `open` and `grounded` from scripts/bench/prompts.json (the
held-out prompts, then the tuning ones, up to --num-prompts each, rendered by
the chat template as `scripts.bench.open_grounded` does), and `agentic`, the
first --num-prompts requests of `scripts.bench.agentic`'s seeded trace, whose
later turns carry the earlier answers (this run's own, which greedy float32
decoding makes the target's).

Each request's trace: `accepted` and `drafted`, one entry per verify pass;
`num_tokens`, its completion tokens; `finish_reason`. The first token comes
from the prompt's prefill, then every pass emits its accepted drafts and one
token of the target's, so 1 + the sum of (accepted + 1) is `num_tokens`,
except where the request stopped inside its last pass (an
EOS or a stop string among its tokens): that pass's tokens after the stop are
dropped. Where max_new_tokens ends a request, its last pass drafted only as
many as fit, and dropped none.

    python -m scripts.bench.accept_traces          # the demo pair, k=4: scripts/bench/traces/
    python -m scripts.bench.accept_traces --num-prompts 2 --max-new-tokens 16 --out /some/where.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import pathlib
from typing import Hashable, Sequence

from handler.drafters import MODEL
from handler.engine import GenerationRequest, GenerationResult, SpeculativeEngine, build_engine, engine_settings
from handler.runtime.loading import load_models
from scripts.bench import agentic as bench_agentic
from scripts.bench import common as bench_common
from scripts.bench import runner as bench_runner

logger = logging.getLogger(__name__)

SETS = ("open", "grounded", "agentic")
DEFAULT_OUT = bench_common.REPO_ROOT / "scripts" / "bench" / "traces" / "qwen-coder-0.5b-1.5b-k4.json"


@dataclasses.dataclass
class RequestTrace:
    """One request's passes: the drafts each verified and how many it accepted, in order."""

    set: str
    index: int
    prompt_tokens: int
    num_tokens: int
    finish_reason: str
    drafted: list[int] = dataclasses.field(default_factory=list)
    accepted: list[int] = dataclasses.field(default_factory=list)


class TracingEngine:
    """A speculative engine whose `generate` also keeps each request's `RequestTrace` (in `traces`).

    It runs one request at a time through the step API, so that every step output it sees is one
    target pass of that request. Requests are numbered within `set_name`, which the caller sets
    before each prompt set; `scripts.bench.agentic.build_trace` can drive it like an engine.
    """

    def __init__(self, engine: SpeculativeEngine) -> None:
        self.engine = engine
        self.set_name = ""
        self.traces: list[RequestTrace] = []

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        return [self._generate_one(request) for request in requests]

    def _generate_one(self, request: GenerationRequest) -> GenerationResult:
        # A row's first token comes from its prefill and shares a step output with its first verify
        # pass (`SpeculativeEngine.step`); each step output is then one pass's drafts and accepted
        # ones, the first token aside. A plain row's passes draft nothing: a trace is of drafting ones.
        assert request.num_speculative_tokens > 0, "a trace is of drafting requests"
        engine = self.engine
        assert not engine.has_unfinished_requests(), "one request at a time"
        request_id: Hashable = ("trace", self.set_name, len(self.traces))
        drafted, accepted = [], []
        engine.add_request(request_id, request)
        result = None
        while engine.has_unfinished_requests():
            for output in engine.step():
                assert output.request_id == request_id
                drafted.append(output.num_draft_tokens)
                accepted.append(output.num_accepted_tokens)
                result = output.result if output.result is not None else result
        assert result is not None
        index = sum(trace.set == self.set_name for trace in self.traces)
        self.traces.append(
            RequestTrace(
                self.set_name,
                index,
                len(request.prompt_ids),
                len(result.token_ids),
                result.finish_reason,
                drafted,
                accepted,
            )
        )
        return result


def trace_engine(models, config) -> TracingEngine:
    """The engine the traces run: the config's settings, no prefix cache, no cost table (fixed k)."""
    settings = engine_settings(models, config)
    return TracingEngine(build_engine(models, settings, cost_table=None, prefix_cache_max_bytes=None))


def trace_config(args):
    """The handler config of the run: the model-config file and the CLI's paths and dtype, then the
    model drafter at a fixed k: no cost table to plan it, no confidence stop to cut it short."""
    config = bench_runner.bench_config(args)
    return dataclasses.replace(
        config,
        drafter=MODEL,
        num_speculative_tokens=args.k,
        adaptive_k=False,
        draft_confidence=False,
        draft_guesses=False,
        runner="dynamic",
    )


def run_sets(tracer: TracingEngine, models, config, args, names: Sequence[str]) -> list[RequestTrace]:
    """The sets' requests through `tracer`, one at a time; returns the traces of this call."""
    first = len(tracer.traces)
    prompt_sets = json.loads(pathlib.Path(args.prompts).read_text(encoding="utf-8"))
    encoder = bench_runner.Runner(models, config, None)
    for name in names:
        tracer.set_name = name
        logger.info("set %s", name)
        if name == "agentic":
            plan = bench_agentic.make_plan(args.agentic_seed, bench_agentic.DEFAULT_REQUESTS, args.compact)
            route = bench_runner.ChatRoute(config, models)
            # The route gives each request the config's k and the engine's default drafter.
            bench_agentic.build_trace(plan[: args.num_prompts], route, tracer, args.max_new_tokens, plain=False)
            continue
        prompts = (prompt_sets[name]["held_out"] + prompt_sets[name]["tuning"])[: args.num_prompts]
        for prompt in prompts:
            request = GenerationRequest(
                encoder.encode(prompt), args.max_new_tokens, bench_runner.GREEDY, args.k, drafter=MODEL
            )
            tracer.generate([request])
    return tracer.traces[first:]


def summarize(traces: list[RequestTrace]) -> dict[str, dict]:
    """Per set: requests, target passes, tokens, drafts and accepted drafts, and their ratios."""
    summary = {}
    for name in dict.fromkeys(trace.set for trace in traces):
        chosen = [trace for trace in traces if trace.set == name]
        passes = sum(len(trace.accepted) for trace in chosen)
        tokens = sum(trace.num_tokens for trace in chosen)
        drafted = sum(sum(trace.drafted) for trace in chosen)
        accepted = sum(sum(trace.accepted) for trace in chosen)
        summary[name] = {
            "requests": len(chosen),
            "passes": passes,
            "tokens": tokens,
            "drafted": drafted,
            "accepted": accepted,
            "mean_accepted_per_pass": accepted / passes if passes else None,
            # Per target pass, each request's prefill included: it gave the request's first token.
            "tokens_per_pass": tokens / (passes + len(chosen)) if chosen else None,
            "acceptance_rate": accepted / drafted if drafted else None,
        }
    return summary


def markdown(summary: dict[str, dict], k: int) -> str:
    lines = [
        f"| set | requests | passes | tokens | mean accepted per pass (0..{k}) | tokens per pass E | acceptance |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in summary.items():
        lines.append(
            f"| {name} | {row['requests']} | {row['passes']} | {row['tokens']} | "
            f"{bench_common.fmt(row['mean_accepted_per_pass'])} | {bench_common.fmt(row['tokens_per_pass'])} | "
            f"{bench_common.fmt(row['acceptance_rate'])} |"
        )
    return "\n".join(lines) + "\n"


def to_json(report: dict) -> str:
    """The report as JSON, one request's trace to a line: small, and a diff shows which request moved."""
    requests = report["requests"]
    head = json.dumps({key: value for key, value in report.items() if key != "requests"}, indent=1)
    rows = ",\n".join("  " + json.dumps(trace, separators=(",", ":")) for trace in requests)
    return head[:-2] + ',\n "requests": [\n' + rows + "\n ]\n}\n"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=str(bench_common.DEFAULT_TARGET))
    parser.add_argument("--draft", default=str(bench_common.DEFAULT_DRAFT))
    parser.add_argument("--config", default=str(bench_common.DEFAULT_CONFIG), help="model-config.yaml")
    parser.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument(
        "--draft-quantization", default="none", choices=["none", "int8", "auto"], help="none: the draft in --dtype"
    )
    parser.add_argument("--k", type=int, default=4, help="drafts per pass (fewer only near max_new_tokens)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=8, help="requests per set at most")
    parser.add_argument("--sets", default=",".join(SETS), help=f"comma-separated: {', '.join(SETS)}")
    parser.add_argument("--prompts", default=str(bench_common.REPO_ROOT / "scripts" / "bench" / "prompts.json"))
    parser.add_argument("--agentic-seed", type=int, default=7, help="scripts.bench.agentic's --seed")
    parser.add_argument("--compact", action="store_true", help="scripts.bench.agentic's --compact (tiny contexts)")
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args(argv)
    args.sets = [name.strip() for name in args.sets.split(",") if name.strip()]
    unknown = sorted(set(args.sets) - set(SETS))
    if unknown or not args.sets:
        parser.error(f"--sets: unknown set {', '.join(unknown) or '(none given)'}; choose from {', '.join(SETS)}")
    if min(args.k, args.max_new_tokens, args.num_prompts) < 1:
        parser.error("--k, --max-new-tokens and --num-prompts must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    config = trace_config(args)
    models = load_models(config, None)
    tracer = trace_engine(models, config)
    sets = {
        "open": "scripts/bench/prompts.json open: held_out then tuning",
        "grounded": "scripts/bench/prompts.json grounded: held_out then tuning",
        "agentic": f"scripts.bench.agentic trace, seed {args.agentic_seed}, first requests"
        + (", compact" if args.compact else ""),
    }
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Written again after each set: a run cut short keeps the sets it finished.
    for done, name in enumerate(args.sets, start=1):
        run_sets(tracer, models, config, args, [name])
        summary = summarize(tracer.traces)
        report = {
            "date": datetime.date.today().isoformat(),
            "target": pathlib.Path(args.target).name,  # the folder's name: the file holds no local path
            "draft": pathlib.Path(args.draft).name,
            "drafter": MODEL,
            "k": args.k,
            "dtype": str(models.dtype).replace("torch.", ""),
            "draft_quantization": models.draft_quantization,
            "sampling": "greedy",
            "runner": "dynamic",
            "max_new_tokens": args.max_new_tokens,
            "num_prompts": args.num_prompts,
            "sets": {set_name: sets[set_name] for set_name in args.sets[:done]},
            "summary": summary,
            "requests": [dataclasses.asdict(trace) for trace in tracer.traces],
        }
        out.write_text(to_json(report), encoding="utf-8")
    print(markdown(summary, args.k))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
