#!/usr/bin/env python3
"""Benchmark structured output: constrained speculation against constrained plain decoding.

One run, one machine, the same loaded models (the demo pair and
model-config/qwen-coder.yaml by default); every speedup is a ratio to a
baseline measured in the same run.

Workload: JSON extraction (a passage in, a record out, three schemas) and tool
calls (a question and the tools rendered by the chat template, one call forced
by the grammar the OpenAI route builds for `tool_choice: "required"`), greedy.
Rows, medians of --runs runs after a warm-up, one request at a time:

- constrained plain decoding (k = 0): the baseline;
- the shipped config's drafter and plan, without the grammar's forced-token
  drafts;
- the shipped config as served: forced tokens proposed as free drafts.

Also printed: the forced-token share of the output, tokens per target pass,
the time in grammar masks as a share of the step at batch 1 and at batch 8,
and the validation of sampled requests (T = 0.8, --validate-requests of them
across the four schemas) against their schemas with `jsonschema`.

    python -m scripts.bench.structured
    python -m scripts.bench.structured --target models/tiny/target --draft models/tiny/draft \\
        --config model-config/model-config.yaml --runs 1 --validate-requests 8
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import pathlib
import statistics
import time

import jsonschema
import yaml

from handler.api.openai.tools import tool_format_for, tool_plan
from handler.config import SamplingParams, handler_config_from_yaml_config
from handler.constraints import Constraint, compiler_for
from handler.engine import (
    PROPOSER_GRAMMAR,
    EngineOptions,
    GenerationRequest,
    SpeculativeEngine,
    build_engine,
    engine_settings,
)
from handler.planning.measure import measure_for_config
from handler.runtime.loading import load_models
from handler.types import SpeculativeStats
from scripts.bench.common import write_json
from scripts.bench.runner import timed_run

logger = logging.getLogger("bench_structured")

CONTACT = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "email": {"type": "string"},
        "company": {"type": "string"},
        "role": {"type": "string"},
    },
    "required": ["name", "email", "company", "role"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string"},
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"product": {"type": "string"}, "quantity": {"type": "integer", "minimum": 1}},
                "required": ["product", "quantity"],
                "additionalProperties": False,
            },
        },
        "total_usd": {"type": "number"},
        "express": {"type": "boolean"},
    },
    "required": ["order_id", "items", "total_usd", "express"],
    "additionalProperties": False,
}
EVENT = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "city": {"type": "string"},
        "speakers": {"type": "array", "items": {"type": "string"}},
        "kind": {"enum": ["conference", "meetup", "workshop"]},
    },
    "required": ["title", "date", "city", "speakers", "kind"],
    "additionalProperties": False,
}
EXTRACTION = [
    (
        CONTACT,
        "Hi, I'm Maria Gonzalez, lead data engineer at Northwind Traders. Reach me at maria.g@northwind.example.",
    ),
    (CONTACT, "Please forward the contract to Tom Becker (tom.becker@acme.example), procurement manager at Acme Corp."),
    (CONTACT, "From: Aiko Tanaka <aiko@sakura-labs.example>, CTO, Sakura Labs. Subject: integration timeline."),
    (ORDER, "Order A-1042: 3 USB-C cables and 1 laptop stand, $57.90 in total, shipped express."),
    (ORDER, "Order #77-B contains 2 mechanical keyboards and 4 mouse pads; standard shipping; total 212.50 USD."),
    (ORDER, "Invoice for order ZX9: one 27-inch monitor, two HDMI cables. Total: $349.00. Express delivery: no."),
    (EVENT, "PyData Berlin 2025 takes place on 2025-04-23 in Berlin, with talks by Ines Montani and Jay Alammar."),
    (EVENT, "Join our Rust meetup in Lisbon on 2025-09-12! Speakers: Ana Silva and Pedro Costa."),
    (EVENT, "The Speculative Decoding workshop, Paris, 2025-06-02, led by Yaniv Leviathan and Tri Dao."),
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name"},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search_flights",
            "description": "Search flights between two airports on a date",
            "parameters": {
                "type": "object",
                "properties": {
                    "origin": {"type": "string", "description": "IATA code"},
                    "destination": {"type": "string", "description": "IATA code"},
                    "date": {"type": "string", "description": "YYYY-MM-DD"},
                    "passengers": {"type": "integer", "minimum": 1},
                },
                "required": ["origin", "destination", "date", "passengers"],
                "additionalProperties": False,
            },
        },
    },
]
TOOL_QUESTIONS = [
    "What's the weather like in Oslo right now, in celsius?",
    "Find me flights from SFO to JFK on 2025-12-20 for two people.",
    "Is it hot in Phoenix today? Use fahrenheit.",
    "I need a flight from LHR to CDG on 2025-11-30, just me.",
    "How cold is it in Montreal? Celsius please.",
    "Book-search: 3 passengers, Tokyo HND to Seoul ICN, 2026-01-15.",
]
# A forced call's JSON: one of the functions, with its arguments.
TOOL_CALL_SCHEMA = {
    "anyOf": [
        {
            "type": "object",
            "properties": {"name": {"const": tool["function"]["name"]}, "arguments": tool["function"]["parameters"]},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for tool in TOOLS
    ]
}


@dataclasses.dataclass
class Case:
    set_name: str
    prompt_ids: tuple[int, ...]
    constraint: Constraint
    schema: dict  # what the output's JSON must validate against


def build_cases(tokenizer) -> list[Case]:
    cases = []
    for schema, passage in EXTRACTION:
        messages = [
            {"role": "system", "content": "Extract the record as JSON matching this schema: " + json.dumps(schema)},
            {"role": "user", "content": passage},
        ]
        ids = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        cases.append(Case("extraction", _encode(tokenizer, ids), Constraint.json_schema(schema), schema))
    # The grammar the OpenAI route builds for tool_choice "required" with parallel_tool_calls false.
    plan = tool_plan(
        {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}, tokenizer, tool_format_for(tokenizer)
    )
    for question in TOOL_QUESTIONS:
        messages = [{"role": "user", "content": question}]
        text = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
        cases.append(Case("tool call", _encode(tokenizer, text), Constraint.grammar(plan.grammar), TOOL_CALL_SCHEMA))
    return cases


def _encode(tokenizer, text: str) -> tuple[int, ...]:
    return tuple(tokenizer(text, add_special_tokens=False)["input_ids"])


def output_json(text: str):
    """The JSON of an output: the object itself, or the body of a <tool_call> block."""
    text = text.strip()
    if text.startswith("<tool_call>"):
        text = text.removeprefix("<tool_call>").removesuffix("</tool_call>")
    return json.loads(text)


def run_method(engine: SpeculativeEngine, cases: list[Case], k: int, max_new_tokens: int) -> dict:
    """One pass over the cases, one request at a time (`timed_run`): tokens, seconds, passes, forced
    drafts, mask time."""

    def generate(case: Case):
        request = GenerationRequest(
            case.prompt_ids, max_new_tokens, num_speculative_tokens=k, constraint=case.constraint
        )
        [result] = engine.generate([request])
        return result.token_ids, result.stats

    run = timed_run(generate, cases)
    stats = SpeculativeStats.merge(run.stats)
    return {
        "tokens": run.num_tokens,
        "seconds": run.seconds,
        "passes": stats.target_forward_passes,
        "forced": stats.draft_tokens_by_drafter.get(PROPOSER_GRAMMAR, 0),
        "forced_accepted": stats.accepted_tokens_by_drafter.get(PROPOSER_GRAMMAR, 0),
        "mask_seconds": stats.mask_seconds,
        "outputs": run.outputs,
    }


def mask_share_at_batch(engine: SpeculativeEngine, cases: list[Case], batch_size: int, max_new_tokens: int, k: int):
    """Time in masks over step time, summed over the steps of one batch of `batch_size` requests."""
    chosen = [cases[i % len(cases)] for i in range(batch_size)]
    for index, case in enumerate(chosen):
        request = GenerationRequest(
            case.prompt_ids, max_new_tokens, num_speculative_tokens=k, constraint=case.constraint
        )
        engine.add_request(index, request)
    step_seconds = mask_seconds = 0.0
    while engine.has_unfinished_requests():
        engine.step()
        step_seconds += engine.steps.last_step_seconds
        mask_seconds += engine.steps.last_step_mask_seconds
    return mask_seconds / step_seconds if step_seconds else 0.0


def validate(engine: SpeculativeEngine, cases: list[Case], num_requests: int, max_new_tokens: int, k: int) -> dict:
    """Sampled (T = 0.8, seeded and not) and greedy requests in batches of 8: how many outputs validate."""
    counts = {"requests": 0, "finished": 0, "valid": 0}
    failures = []
    for start in range(0, num_requests, 8):
        batch = []
        for index in range(start, min(start + 8, num_requests)):
            case = cases[index % len(cases)]
            sampling = SamplingParams() if index % 4 == 0 else SamplingParams(temperature=0.8)
            seed = index if index % 2 else None
            batch.append(
                (
                    case,
                    GenerationRequest(
                        case.prompt_ids, max_new_tokens, sampling, k, seed=seed, constraint=case.constraint
                    ),
                )
            )
        results = engine.generate([request for _, request in batch])
        for (case, _), result in zip(batch, results):
            counts["requests"] += 1
            if result.finish_reason != "eos":
                failures.append(f"{case.set_name}: finished by {result.finish_reason}: {result.text[:80]!r}")
                continue
            counts["finished"] += 1
            try:
                jsonschema.validate(output_json(result.text), case.schema)
                counts["valid"] += 1
            except (ValueError, jsonschema.ValidationError) as error:
                failures.append(f"{case.set_name}: {error}: {result.text[:120]!r}")
    counts["failures"] = failures
    return counts


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="models/qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft", default="models/qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--config", default="model-config/qwen-coder.yaml")
    parser.add_argument("--runs", type=int, default=3, help="timed runs per method, after one warm-up")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--validate-requests", type=int, default=64)
    parser.add_argument("--out", default="bench_results/structured.json")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from scripts.bench.common import machine_info

    with open(args.config, encoding="utf-8") as f:
        config = handler_config_from_yaml_config(yaml.safe_load(f))
    config = dataclasses.replace(
        config,
        target_model=str(pathlib.Path(args.target).resolve()),
        draft_model=str(pathlib.Path(args.draft).resolve()),
    )
    models = load_models(config, None)
    machine = machine_info()
    logger.info("machine: %s", machine["description"])
    cost_table = None
    if config.adaptive_k:
        cost_table = measure_for_config(models, config, 8)
    settings = engine_settings(models, config)
    tokenizer = models.tokenizer
    cases = build_cases(tokenizer)
    for case in cases:
        compiler_for(tokenizer).compile(case.constraint)

    def engine(grammar_drafts: bool) -> SpeculativeEngine:
        # No prefix cache: each case runs several times, and later runs would skip their prefill.
        return build_engine(
            models,
            settings,
            cost_table=cost_table,
            options=EngineOptions(grammar_drafts=grammar_drafts),
            prefix_cache_max_bytes=None,
        )

    k = config.num_speculative_tokens
    methods = {
        "constrained plain decoding (k=0)": (engine(True), 0),
        f"{config.drafter}, planned, no forced-token drafts": (engine(False), k),
        f"{config.drafter}, planned, forced tokens as drafts (shipped)": (engine(True), k),
    }
    report: dict = {"machine": machine, "date": time.strftime("%Y-%m-%d"), "config": args.config, "sets": {}}
    for set_name in ("extraction", "tool call"):
        set_cases = [case for case in cases if case.set_name == set_name]
        rows = {}
        for label, (eng, method_k) in methods.items():
            run_method(eng, set_cases[:2], method_k, args.max_new_tokens)  # warm-up
            runs = [run_method(eng, set_cases, method_k, args.max_new_tokens) for _ in range(args.runs)]
            rows[label] = runs
            logger.info("%s / %s: %s", set_name, label, [round(r["tokens"] / r["seconds"], 2) for r in runs])
        report["sets"][set_name] = summarize(rows)
    shipped = engine(True)
    report["mask_share"] = {
        f"batch {b}": mask_share_at_batch(shipped, cases, b, args.max_new_tokens, k) for b in (1, 8)
    }
    report["validation"] = validate(shipped, cases, args.validate_requests, args.max_new_tokens, k)
    print(markdown(report))
    print(f"wrote {write_json(pathlib.Path(args.out), report)}")
    return 0


def summarize(rows: dict[str, list[dict]]) -> list[dict]:
    baseline_label = next(iter(rows))
    baseline_outputs = rows[baseline_label][0]["outputs"]
    baseline = statistics.median(r["tokens"] / r["seconds"] for r in rows[baseline_label])
    summary = []
    for label, runs in rows.items():
        tokens_per_second = statistics.median(r["tokens"] / r["seconds"] for r in runs)
        first = runs[0]
        summary.append(
            {
                "method": label,
                "tokens_per_second": round(tokens_per_second, 2),
                "speedup": round(tokens_per_second / baseline, 2),
                "tokens_per_pass": round(first["tokens"] / first["passes"], 2),
                "forced_share": round(first["forced_accepted"] / first["tokens"], 3),
                "mask_share": round(first["mask_seconds"] / first["seconds"], 4),
                "same_output_as_plain": sum(a == b for a, b in zip(first["outputs"], baseline_outputs)),
                "num_requests": len(first["outputs"]),
                "tokens": first["tokens"],
            }
        )
    return summary


def markdown(report: dict) -> str:
    lines = [f"Structured output, {report['date']}; {report['machine']['description']}; config {report['config']}", ""]
    for set_name, rows in report["sets"].items():
        lines += [
            f"**{set_name}** ({rows[0]['num_requests']} requests, greedy, one at a time, medians of the runs)",
            "",
            "| method | tokens/s | vs plain | tokens per target pass | forced-token share | mask share | "
            "same output as plain |",
            "|---|---|---|---|---|---|---|",
        ]
        for row in rows:
            lines.append(
                f"| {row['method']} | {row['tokens_per_second']:.2f} | {row['speedup']:.2f}x | "
                f"{row['tokens_per_pass']:.2f} | {row['forced_share']:.0%} | {row['mask_share']:.2%} | "
                f"{row['same_output_as_plain']}/{row['num_requests']} |"
            )
        lines.append("")
    shares = ", ".join(f"{name}: {share:.2%}" for name, share in report["mask_share"].items())
    lines.append(f"Time in grammar masks as a share of step time: {shares}.")
    validation = report["validation"]
    lines.append(
        f"Validation: {validation['valid']} of {validation['requests']} sampled and greedy requests validate "
        f"({validation['finished']} ended by EOS)."
    )
    lines += [f"- {failure}" for failure in validation["failures"][:10]]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
