#!/usr/bin/env python3
"""Benchmark: this engine against Hugging Face `generate`, on open-ended and input-grounded prompts.

Everything is measured in one run, on one machine, with the same loaded
models, and every speedup is a ratio to a baseline from the same run.

Prompt sets (scripts/bench/prompts.json): `open` (coding and chat requests)
and `grounded` (code edits whose answer copies much of the prompt). Each set
has `tuning` prompts, on which a sweep picks the fixed k, Hugging Face's best
assisted-generation schedule and the drafters' modes, and `held_out` prompts,
on which the table is measured and nothing is tuned.

Rows, for each prompt set, medians of --runs runs after a warm-up:

- HF `generate`, target only: the baseline;
- HF assisted generation given the *same draft object* the engine uses (the
  int8 one when the config quantizes the draft), at its best schedule;
- HF prompt lookup, `prompt_lookup_num_tokens` 3 and 10;
- this engine: k=0 (plain decoding), the model drafter with the best fixed k,
  the model drafter with k planned from the cost table, the n-gram drafter (in
  the mode that won the sweep) and the hybrid drafter as the demo ships it
  (planned), plus the hybrid drafter at the best fixed k when the sweep found
  that faster.

Greedy outputs are compared with the engine's own plain decoding and with HF
target-only decoding: in bfloat16 a near-tie can flip a token (see
docs/benchmark.md); in float32 they must be equal. Outputs go to --out-dir:
bench.json (every figure), bench.md (the tables) and bench.png (the sweep).

    python -m scripts.bench                      # the demo pair with model-config/qwen-coder.yaml
    python -m scripts.bench --num-prompts 2 --max-new-tokens 32 --runs 3

With --rest-url it also measures a running TorchServe (`make demo` leaves
one), one request at a time and 4 at once; --rest-only measures only that.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import json
import logging
import math
import os
import pathlib
import statistics
import sys
import time

from handler.drafters import HYBRID, MODEL, NGRAM
from handler.runtime.loading import load_models
from scripts.bench.common import (
    DEFAULT_CONFIG,
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    PROMPT_SETS,
    REPO_ROOT,
    describe_cost_table,
    first_difference,
    fmt,
    load_prompt_sets,
    machine_info,
    shown,
    start_up_cost_table,
    write_report,
)
from scripts.bench.runner import (
    Method,
    Run,
    Runner,
    acceptance,
    bench_config,
    constant_schedule,
    engine_method,
    hf_assisted,
    hf_prompt_lookup,
    hf_target_only,
)
from scripts.serving import torchserve

# Hugging Face's two adaptive schedules, tried beside the constant ones of the sweep:
# the default of transformers 5 (20 tokens, stop below 0.4 confidence) and the older heuristic.
HF_DYNAMIC_SCHEDULES = (
    {"num_assistant_tokens": 20, "schedule": "constant", "confidence_threshold": 0.4},
    {"num_assistant_tokens": 5, "schedule": "heuristic", "confidence_threshold": 0.0},
)

logger = logging.getLogger("bench")


# --------------------------------------------------------------------------- methods


# --------------------------------------------------------------------------- sweep


def sweep(runner: Runner, sets: dict, args, draft_note: str) -> dict:
    """Measures every candidate setting once on each set's tuning prompts and picks the best.

    Returns:
        per set: each candidate's tokens/s, the best HF assisted schedule and the best fixed k;
        and across sets: the mode (cost table or fixed k) that wins for each drafter.
    """
    ks = args.sweep_ks
    cap = args.max_k
    lookup = runner.config.prompt_lookup_num_tokens
    result: dict = {"sets": {}}
    for name, prompt_set in sets.items():
        ids = prompt_set["tuning_ids"]
        budget = args.sweep_max_new_tokens[name]
        logger.info("sweep on %s: %d tuning prompts x %d tokens", name, len(ids), budget)

        def measure(method: Method, ids=ids, budget=budget) -> dict:
            runner.run(method, ids[:1], 4)  # warm-up
            run = runner.run(method, ids, budget)
            logger.info("  %-60s %6.2f tokens/s", method.label, run.tokens_per_second)
            return {"label": method.label, "tokens_per_second": run.tokens_per_second, **acceptance(run)}

        baseline = measure(hf_target_only())
        engine_fixed = {k: measure(engine_method("engine_fixed", MODEL, k, planned=False)) for k in ks}
        hf_constant = {k: measure(hf_assisted(constant_schedule(k), draft_note)) for k in ks}
        hf_dynamic = [(schedule, measure(hf_assisted(schedule, draft_note))) for schedule in HF_DYNAMIC_SCHEDULES]
        best_k = max(ks, key=lambda k: engine_fixed[k]["tokens_per_second"])
        hf_candidates = [(constant_schedule(k), row) for k, row in hf_constant.items()] + hf_dynamic
        best_hf = max(hf_candidates, key=lambda item: item[1]["tokens_per_second"])[0]
        modes = {
            "model planned": measure(engine_method("engine_planned", MODEL, cap, planned=True)),
            "ngram planned": measure(engine_method("engine_ngram", NGRAM, cap, True, lookup)),
            "ngram fixed": measure(engine_method("engine_ngram", NGRAM, cap, False, lookup)),
            "hybrid planned": measure(engine_method("engine_hybrid", HYBRID, cap, True, lookup)),
            "hybrid fixed": measure(engine_method("engine_hybrid", HYBRID, best_k, False, lookup)),
        }
        result["sets"][name] = {
            "target_only_tokens_per_second": baseline["tokens_per_second"],
            "engine_fixed": {str(k): row for k, row in engine_fixed.items()},
            "hf_constant": {str(k): row for k, row in hf_constant.items()},
            "hf_dynamic": [dict(schedule=s, **row) for s, row in hf_dynamic],
            "modes": modes,
            "best_k": best_k,
            "best_hf_schedule": best_hf,
        }

    # One mode per drafter for both sets: the higher geometric mean of speedups over target-only.
    def score(mode: str) -> float:
        return geometric_mean(
            s["modes"][mode]["tokens_per_second"] / s["target_only_tokens_per_second"] for s in result["sets"].values()
        )

    result["ngram_planned"] = score("ngram planned") >= score("ngram fixed")
    result["hybrid_planned"] = score("hybrid planned") >= score("hybrid fixed")
    result["scores"] = {mode: score(mode) for mode in next(iter(result["sets"].values()))["modes"]}
    return result


def geometric_mean(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(max(v, 1e-9)) for v in values) / len(values))


# --------------------------------------------------------------------------- main table


def table_methods(set_sweep: dict, sweep_result: dict, cap: int, draft_note: str, lookup: int = 0) -> list[Method]:
    """The rows of one prompt set's table, with the settings its sweep picked."""
    methods = [
        hf_target_only(),
        hf_assisted(set_sweep["best_hf_schedule"], draft_note),
        hf_prompt_lookup(3),
        hf_prompt_lookup(10),
        engine_method("engine_k0", MODEL, 0, planned=False),
        engine_method("engine_fixed", MODEL, set_sweep["best_k"], planned=False),
        engine_method("engine_planned", MODEL, cap, planned=True),
        # The draft model without its confidence stop: the planned k from the acceptance tracker alone.
        dataclasses.replace(
            engine_method("engine_planned_tracker", MODEL, cap, planned=True),
            label=f"this engine, model drafter, cost-table k<={cap}, tracker only (draft_confidence off)",
            confidence=False,
        ),
        engine_method("engine_ngram", NGRAM, cap, sweep_result["ngram_planned"], lookup),
        # The shipped mode always has its row, whatever one noisy sweep run preferred.
        engine_method("engine_hybrid", HYBRID, cap, True, lookup),
    ]
    if not sweep_result["hybrid_planned"]:
        methods.append(engine_method("engine_hybrid_fixed", HYBRID, set_sweep["best_k"], False, lookup))
    # The look-up rows again with speculative_tree off: trees against chains, same plan and cost table.
    for method in [m for m in methods if m.key in ("engine_ngram", "engine_hybrid")]:
        label = f"{method.label}, chains only"
        methods.append(dataclasses.replace(method, key=f"{method.key}_chain", label=label, tree=False))
    return methods


def measure_table(runner: Runner, sets: dict, methods: dict[str, list[Method]], args) -> dict[str, dict[str, list]]:
    """Every method on every set's held-out prompts, --runs times, the order rotated from run to run."""
    runs: dict[str, dict[str, list[Run]]] = {name: {m.key: [] for m in methods[name]} for name in sets}
    for name in sets:
        for method in methods[name]:
            runner.run(method, sets[name]["held_out_ids"][:1], 4)  # warm-up
    for index in range(args.runs):
        for name in sets:
            ids = sets[name]["held_out_ids"]
            # Rotating the order spreads slow drift of a shared machine over every row alike.
            shift = index % len(methods[name])
            for method in methods[name][shift:] + methods[name][:shift]:
                run = runner.run(method, ids, args.max_new_tokens[name])
                runs[name][method.key].append(run)
                logger.info(
                    "run %d/%d %s: %-60s %6.2f tokens/s",
                    index + 1,
                    args.runs,
                    name,
                    method.label,
                    run.tokens_per_second,
                )
    return runs


def summarize_set(methods: list[Method], runs: dict[str, list[Run]]) -> list[dict]:
    """Median tokens/s, ratios to the baselines, acceptance and output checks for each row."""
    medians = {m.key: statistics.median(r.tokens_per_second for r in runs[m.key]) for m in methods}
    target_only = medians["hf_target_only"]
    hf_keys = [m.key for m in methods if not m.is_engine and m.key != "hf_target_only"]
    best_hf_key = max(hf_keys, key=medians.__getitem__)
    reference = {"engine k=0": runs["engine_k0"][0].outputs, "HF target only": runs["hf_target_only"][0].outputs}
    rows = []
    for m in methods:
        first = runs[m.key][0]
        row = {
            "key": m.key,
            "method": m.label,
            "k": m.k,
            "drafter": m.drafter,
            "planned": m.planned,
            "runs_tokens_per_second": [r.tokens_per_second for r in runs[m.key]],
            "tokens_per_second": medians[m.key],
            "num_tokens": first.num_tokens,
            "vs_target_only": medians[m.key] / target_only,
            "vs_hf_assisted": medians[m.key] / medians["hf_assisted"],
            "vs_best_hf": medians[m.key] / medians[best_hf_key],
            "best_hf": best_hf_key,
            **acceptance(first),
            # Greedy decoding is deterministic, so every run must give the first run's outputs.
            "same_outputs_every_run": all(r.outputs == first.outputs for r in runs[m.key]),
            "differences": {
                name: [
                    {"prompt": i, "first_differing_token": d}
                    for i, (a, b) in enumerate(zip(first.outputs, outputs))
                    if (d := first_difference(a, b)) is not None
                ]
                for name, outputs in reference.items()
            },
        }
        rows.append(row)
    return rows


# --------------------------------------------------------------------------- machine, cost table


def cost_table_markdown(cost: dict) -> list[str]:
    draft_ms = cost["draft_ms"] or [None] * len(cost["batch_sizes"])
    lines = [
        "| batch | " + " | ".join(f"target, width {w} (ms)" for w in cost["widths"]) + " | draft step (ms) |",
        "|---" * (len(cost["widths"]) + 2) + "|",
    ]
    for b, target_ms, draft in zip(cost["batch_sizes"], cost["target_ms"], draft_ms):
        lines.append(f"| {b} | " + " | ".join(f"{ms:.1f}" for ms in target_ms) + f" | {fmt(draft, '{:.1f}')} |")
    width_1 = cost["target_ms"][0][0]
    lines += [
        "",
        "Batch 1, cost of width w over width 1: "
        + ", ".join(f"{w}: {ms / width_1:.2f}" for w, ms in zip(cost["widths"], cost["target_ms"][0]))
        + ".",
    ]
    return lines


# --------------------------------------------------------------------------- report


def _same_output(row: dict, num_prompts: int) -> str:
    parts = []
    for differences in row["differences"].values():
        same = num_prompts - len(differences)
        where = ", ".join(f"#{d['prompt']} from token {d['first_differing_token']}" for d in differences)
        parts.append(f"{same}/{num_prompts}" + (f" ({where})" if where else ""))
    return " / ".join(parts)


def _budgets(per_set: dict[str, int]) -> str:
    return ", ".join(f"{tokens} ({name})" for name, tokens in per_set.items())


def markdown(report: dict) -> str:
    settings = report["settings"]
    lines = [
        f"Date: {report['date']}. Machine: {report['machine']['description']}.",
        f"Load average (1 min) at start {report['load_average']['start']:.2f}, at end "
        f"{report['load_average']['end']:.2f}; wall time {report['wall_seconds'] / 60:.1f} min.",
        f"Target {shown(settings['target'])}, draft {shown(settings['draft'])}; dtype {settings['dtype']}, draft "
        f"{settings['draft_note']}; every row runs the same target object (linear layers packed for oneDNN: "
        f"{'yes' if settings['cpu_packed_weights'] else 'no'}) and the same draft object. This engine's n-gram "
        f"look-up matches suffixes of {settings['prompt_lookup_min']} to {settings['prompt_lookup_max']} tokens; "
        f"the cost-table rows draft at most k={settings['max_k']}"
        + (
            f", and a look-up proposes up to {settings['prompt_lookup_num_tokens']} tokens (prompt_lookup_num_tokens)."
            if settings.get("prompt_lookup_num_tokens")
            else "; a look-up proposes up to k tokens."
        ),
        f"Held-out prompts: {settings['num_prompts']} per set, up to {_budgets(settings['max_new_tokens'])} new "
        f"tokens, greedy; tokens/s = generated tokens / seconds over the set, prefill included, median of "
        f"{settings['runs']} runs (row order rotated each run); sweep on {settings['sweep_prompts']} tuning "
        f"prompt(s) per set x {_budgets(settings['sweep_max_new_tokens'])} tokens.",
        "",
        "Cost table, measured at start (handler.planning.cost_table; between grid points the planner interpolates):",
        "",
        *cost_table_markdown(report["cost_table"]),
    ]
    for name, data in report["sets"].items():
        n = settings["num_prompts"]
        lines += [
            "",
            f"**{name}** ({data['description']}; {n} held-out prompts, prompt lengths "
            f"{min(data['prompt_tokens'])}-{max(data['prompt_tokens'])} tokens):",
            "",
            "| method | tokens/s | runs (min-max) | vs target-only | vs HF assisted (same draft) | vs best HF "
            "| acceptance | tokens/pass | drafts/pass | same output as engine k=0 / HF target-only |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in data["rows"]:
            runs = row["runs_tokens_per_second"]
            lines.append(
                f"| {row['method']} | {row['tokens_per_second']:.2f} | {min(runs):.2f}-{max(runs):.2f} "
                f"| {row['vs_target_only']:.2f}x | {row['vs_hf_assisted']:.2f}x | {row['vs_best_hf']:.2f}x "
                f"| {fmt(row['acceptance_rate'])} | {fmt(row['tokens_per_pass'])} | {fmt(row['drafts_per_pass'])} "
                f"| {_same_output(row, n)} |"
            )
        best_hf = next(r["method"] for r in data["rows"] if r["key"] == data["rows"][0]["best_hf"])
        lines += ["", f"Best HF row on {name}: {best_hf}."]
    lines += ["", "Sweep on the tuning prompts (one run each; tokens/s):", ""]
    for name, data in report["sweep"]["sets"].items():
        ks = list(data["engine_fixed"])
        lines += [
            f"*{name}* (target only {data['target_only_tokens_per_second']:.2f} tokens/s):",
            "",
            "| k | " + " | ".join(ks) + " |",
            "|---" * (len(ks) + 1) + "|",
            "| this engine, model drafter, fixed k | "
            + " | ".join(f"{data['engine_fixed'][k]['tokens_per_second']:.2f}" for k in ks)
            + " |",
            "| HF assisted, constant k | "
            + " | ".join(f"{data['hf_constant'][k]['tokens_per_second']:.2f}" for k in ks)
            + " |",
            "",
            "; ".join(f"{row['label']}: {row['tokens_per_second']:.2f}" for row in data["hf_dynamic"])
            + "; "
            + "; ".join(f"{row['label']}: {row['tokens_per_second']:.2f}" for row in data["modes"].values())
            + ".",
            "",
        ]
    scores = report["sweep"]["scores"]
    lines.append(
        "Geometric mean over both sets of the speedup over target-only on the tuning prompts: "
        + ", ".join(f"{mode} {value:.2f}x" for mode, value in scores.items())
        + "."
    )
    if report.get("rest"):
        lines += ["", "Through TorchServe over REST: " + rest_summary(report["rest"])]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = report["sweep"]["sets"]
    fig, axes = plt.subplots(1, len(sets), figsize=(6 * len(sets), 4), squeeze=False)
    for ax, (name, data) in zip(axes[0], sets.items()):
        ks = [int(k) for k in data["engine_fixed"]]
        ax.plot(ks, [row["tokens_per_second"] for row in data["engine_fixed"].values()], "o-", label="this engine")
        ax.plot(ks, [row["tokens_per_second"] for row in data["hf_constant"].values()], "s-", label="HF assisted")
        ax.axhline(data["target_only_tokens_per_second"], color="gray", linestyle="--", label="target only")
        ax.set_title(f"{name} (tuning prompts)")
        ax.set_xlabel("k (draft tokens per step)")
        ax.set_ylabel("tokens/s")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{pathlib.Path(report['settings']['target']).name}, {report['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


# --------------------------------------------------------------------------- REST


def measure_rest(args, prompts: list[dict]) -> dict:
    """Tokens/s through a running TorchServe, against target-only decoding through the same server.

    Target-only is the same request with `num_speculative_tokens: 0`: the same worker,
    models and HTTP path, with no drafting. The two alternate, one request at a time,
    --runs times; then 4 requests go at once against the same 4 one after another.
    """
    key_file = pathlib.Path(args.key_file) if args.key_file else None
    headers = torchserve.auth_headers(key_file)

    def post(prompt, extra=None):
        body = {"messages": prompt["messages"], "max_new_tokens": args.max_new_tokens["open"], "temperature": 0}
        body.update(extra or {})
        answer = torchserve.generate(args.rest_url, args.model, body, headers, key_file, args.rest_timeout)
        return answer.final, answer.elapsed_s

    def completion_tokens(answers) -> int:
        return sum(answer["usage"]["completion_tokens"] for answer, _ in answers)

    target_only = {"num_speculative_tokens": 0}
    post(prompts[0])  # warm-up, both modes
    post(prompts[0], target_only)
    runs: dict[str, list[float]] = {"shipped": [], "target_only": []}
    answers: list = []
    for index in range(args.runs):
        order = ["shipped", "target_only"] if index % 2 == 0 else ["target_only", "shipped"]
        for mode in order:
            done = [post(p, None if mode == "shipped" else target_only) for p in prompts]
            runs[mode].append(completion_tokens(done) / sum(t for _, t in done))
            if mode == "shipped":
                answers += done
            logger.info("REST run %d/%d %s: %.2f tokens/s", index + 1, args.runs, mode, runs[mode][-1])
    tokens = completion_tokens(answers)
    sequential = {
        "tokens_per_second": statistics.median(runs["shipped"]),
        "target_only_tokens_per_second": statistics.median(runs["target_only"]),
        "runs": runs,
        "acceptance_rate": sum(a["speculative"]["accepted_tokens"] for a, _ in answers)
        / max(1, sum(a["speculative"]["draft_tokens"] for a, _ in answers)),
        "mean_accepted_length": tokens / max(1, sum(a["speculative"]["target_forward_passes"] for a, _ in answers)),
    }
    sequential["ratio"] = sequential["tokens_per_second"] / sequential["target_only_tokens_per_second"]
    four = (prompts * 4)[:4]
    start = time.perf_counter()
    one_by_one = [post(p) for p in four]
    sequential_seconds = time.perf_counter() - start
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        start = time.perf_counter()
        together = list(pool.map(post, four))
        concurrent_seconds = time.perf_counter() - start
    batch = {
        "sequential_tokens_per_second": completion_tokens(one_by_one) / sequential_seconds,
        "concurrent_tokens_per_second": completion_tokens(together) / concurrent_seconds,
    }
    batch["ratio"] = batch["concurrent_tokens_per_second"] / batch["sequential_tokens_per_second"]
    return {"num_prompts": len(prompts), "sequential": sequential, "batch_of_4": batch}


def rest_summary(rest: dict) -> str:
    sequential, batch = rest["sequential"], rest["batch_of_4"]
    return (
        f"one request at a time, {sequential['tokens_per_second']:.2f} tokens/s with the archive's config against "
        f"{sequential['target_only_tokens_per_second']:.2f} target-only through the same server "
        f"(`num_speculative_tokens: 0`): {sequential['ratio']:.2f}x (medians; acceptance "
        f"{sequential['acceptance_rate']:.2f}, {sequential['mean_accepted_length']:.2f} tokens/pass); 4 concurrent "
        f"requests: {batch['concurrent_tokens_per_second']:.2f} tokens/s aggregate vs "
        f"{batch['sequential_tokens_per_second']:.2f} one after another ({batch['ratio']:.2f}x)."
    )


# --------------------------------------------------------------------------- entry point


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=str(DEFAULT_TARGET))
    parser.add_argument("--draft", default=str(DEFAULT_DRAFT))
    parser.add_argument(
        "--config",
        default=str(DEFAULT_CONFIG),
        help="model-config.yaml whose handler section gives dtype, draft_quantization, cpu_threads and the "
        "n-gram sizes (default: the demo's)",
    )
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], help="overrides the config")
    parser.add_argument("--draft-quantization", choices=["none", "int8", "auto"], help="overrides the config")
    parser.add_argument("--prompts", default=str(REPO_ROOT / "scripts" / "bench" / "prompts.json"))
    parser.add_argument(
        "--sets", default=",".join(PROMPT_SETS), help=f"prompt sets, comma-separated: {', '.join(PROMPT_SETS)}"
    )
    # The defaults take about 45 minutes on a 2-core CPU with the demo pair: 9 rows x 2 sets x 3 runs.
    parser.add_argument("--num-prompts", type=int, default=3, help="held-out prompts per set")
    # An edit's answer copies the code it edits, so it runs longer than a chat answer; 40 tokens of it
    # would be mostly the preamble and the prefill of a long prompt.
    parser.add_argument(
        "--max-new-tokens",
        default="open=64,grounded=128",
        help="new tokens per held-out prompt: one number for every set, or per set as open=N,grounded=M",
    )
    parser.add_argument("--runs", type=int, default=3, help="runs per row; the table gives their median")
    parser.add_argument("--sweep-ks", default="1,2,3,4,6", help="fixed k for this engine and constant HF schedules")
    parser.add_argument("--sweep-prompts", type=int, default=1, help="tuning prompts per set")
    parser.add_argument("--sweep-max-new-tokens", default="open=32,grounded=64", help="as --max-new-tokens")
    parser.add_argument(
        "--max-k",
        type=int,
        help="the cap of the cost-table and n-gram rows (default: the config's num_speculative_tokens)",
    )
    parser.add_argument(
        "--cost-max-batch-size", type=int, default=1, help="the cost table's largest batch (the bench decodes one row)"
    )
    parser.add_argument("--rest-url", help="a running TorchServe's inference URL, e.g. http://127.0.0.1:8080")
    parser.add_argument("--model", default="qwen-coder-spec", help="the model name registered in TorchServe")
    parser.add_argument("--key-file", default="key_file.json")
    parser.add_argument("--rest-timeout", type=float, default=900)
    parser.add_argument("--rest-only", action="store_true", help="measure only the running TorchServe")
    parser.add_argument("--out-dir", default="bench_results")
    args = parser.parse_args(argv)
    args.sweep_ks = [int(k) for k in args.sweep_ks.split(",")]
    args.sets = [name.strip() for name in args.sets.split(",") if name.strip()]
    if not args.sets or set(args.sets) - set(PROMPT_SETS):
        parser.error(f"--sets: choose from {', '.join(PROMPT_SETS)}")
    for name in ("max_new_tokens", "sweep_max_new_tokens"):
        try:
            setattr(args, name, _per_set(getattr(args, name)))
        except ValueError as error:
            parser.error(f"--{name.replace('_', '-')}: {error}")
    if args.runs < 1 or args.num_prompts < 1 or args.sweep_prompts < 1 or min(args.sweep_ks) < 1:
        parser.error("--runs, --num-prompts, --sweep-prompts and every --sweep-ks value must be at least 1")
    if args.rest_only and not args.rest_url:
        parser.error("--rest-only needs --rest-url")
    return args


def _per_set(value: str) -> dict[str, int]:
    """'64' or 'open=64,grounded=128' as {set name: tokens} for every prompt set."""
    if "=" not in value:
        per_set = {name: int(value) for name in PROMPT_SETS}
    else:
        pairs = [item.split("=", 1) for item in value.split(",")]
        per_set = {name.strip(): int(tokens) for name, tokens in pairs}
        if set(per_set) != set(PROMPT_SETS):
            raise ValueError(f"name every prompt set ({', '.join(PROMPT_SETS)}), got {', '.join(per_set)}")
    if min(per_set.values()) < 1:
        raise ValueError("token budgets must be at least 1")
    return {name: per_set[name] for name in PROMPT_SETS}


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    started, load_at_start = time.perf_counter(), os.getloadavg()[0]
    sets = load_prompt_sets(pathlib.Path(args.prompts), args.num_prompts, args.sweep_prompts)
    sets = {name: prompt_set for name, prompt_set in sets.items() if name in args.sets}
    if args.rest_only:
        return rest_only(args, sets)

    config = bench_config(args)
    if args.max_k is None:
        args.max_k = max(1, config.num_speculative_tokens)
    models = load_models(config, None)
    machine = machine_info()
    logger.info("machine: %s", machine["description"])
    draft_note = "int8" if models.draft_quantization == "int8" else str(models.dtype).replace("torch.", "")
    # Measured afresh (never read from a cache), as the handler measures it at start-up; as wide as the
    # sweep's largest k or the longest look-up.
    cost_table = start_up_cost_table(models, config, args.cost_max_batch_size, max_k=args.max_k)
    cost = describe_cost_table(cost_table)

    runner = Runner(models, config, cost_table)
    for prompt_set in sets.values():
        prompt_set["tuning_ids"] = [runner.encode(p) for p in prompt_set["tuning"]]
        prompt_set["held_out_ids"] = [runner.encode(p) for p in prompt_set["held_out"]]
    sweep_result = sweep(runner, sets, args, draft_note)
    lookup = config.prompt_lookup_num_tokens
    methods = {
        name: table_methods(sweep_result["sets"][name], sweep_result, args.max_k, draft_note, lookup) for name in sets
    }
    runs = measure_table(runner, sets, methods, args)

    report = {
        "date": datetime.date.today().isoformat(),
        "machine": machine,
        "load_average": {"start": load_at_start, "end": os.getloadavg()[0]},
        "settings": {
            "target": args.target,
            "draft": args.draft,
            "config": args.config,
            "dtype": str(models.dtype).replace("torch.", ""),
            "draft_note": draft_note,
            "num_prompts": args.num_prompts,
            "max_new_tokens": args.max_new_tokens,
            "runs": args.runs,
            "sweep_ks": args.sweep_ks,
            "sweep_prompts": args.sweep_prompts,
            "sweep_max_new_tokens": args.sweep_max_new_tokens,
            "max_k": args.max_k,
            "cpu_packed_weights": config.cpu_packed_weights and models.device.type == "cpu",
            "prompt_lookup_min": config.prompt_lookup_min,
            "prompt_lookup_max": config.prompt_lookup_max,
            "prompt_lookup_num_tokens": config.prompt_lookup_num_tokens,
        },
        "cost_table": cost,
        "sweep": sweep_result,
        "sets": {
            name: {
                "description": sets[name]["description"],
                "prompt_tokens": [len(ids) for ids in sets[name]["held_out_ids"]],
                "rows": summarize_set(methods[name], runs[name]),
            }
            for name in sets
        },
        "rest": measure_rest(args, sets["open"]["held_out"]) if args.rest_url and "open" in sets else None,
    }
    report["wall_seconds"] = time.perf_counter() - started
    write_report(pathlib.Path(args.out_dir), "bench", report, markdown, plot)
    return 0


def rest_only(args, sets: dict) -> int:
    rest = measure_rest(args, sets["open"]["held_out"])
    report = {"date": datetime.date.today().isoformat(), "machine": machine_info(), "model": args.model, "rest": rest}
    out = pathlib.Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_rest.json").write_text(json.dumps(report, indent=2))
    print(f"TorchServe {args.model}: {rest_summary(rest)}")
    print(f"wrote {out / 'bench_rest.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
