#!/usr/bin/env python3
"""Benchmark under load: speculation against plain decoding as concurrent requests grow.

One run, one machine, the same loaded models (the demo pair and
model-config/qwen-coder.yaml by default: its dtype, drafter, k cap and a cost
table measured at start, as the handler measures it). Every ratio is to the
`plain` row (k = 0, plain decoding in the same engine) of the same run.

Load, driven through the engine's step API as the handler drives it with
continuous batching (a request joins at the first step boundary after it
arrives):

- closed loop at each concurrency C (--concurrency): C clients, each sending
  its next request as soon as its last one finished, --requests-per-client
  requests each (at least --min-requests in all);
- open loop (--rates, requests per second): Poisson arrivals of
  --open-requests requests, at most --max-in-flight at once. By default the
  rates are 30, 60 and 90 % of the saturation rate, the `plain` row's
  closed-loop request rate at the largest C.

Side by side: every row of a measure runs the same load at once, the rows'
engines stepped in turn, one step each, and each row's times counted on a
clock of its own (its own admissions and steps; an idle wait for the next
arrival moves it without sleeping). On a shared machine whose speed drifts by
a third within a minute, rows measured one after the other compared minutes
that ran at different speeds; stepped in turn, every row meets the same drift.

Warm server: before its first measure, each row's engine serves a closed
loop of 2C requests (4 at least) of --warm-tokens tokens at each C (the same
prompts, taken from the end of the list), so that its calibrations, its
running cost correction and its check of drafting against plain decoding
start from what serving taught them, as a server's do. No answer carries
over: the suffix trees start empty in every measure.

Rows (--rows): `shipped` (the config as shipped), `plain` (k = 0), `k1`,
`k2`, `k4`, `k8` (the model drafter at a fixed k, without the planner), and
each drafter alone with the planner (`model`, `ngram`, `suffix`, `hybrid`), and
`int8-fills` (as shipped, but an int8 draft prefills its rows itself, where start-up kept its
float form to prefill them: `LoadedModels.draft_prefill`).

Prompts are distinct coding requests (chat template applied), greedy, up to
--max-new-tokens tokens each; with --temperature above 0 (and --top-p) sampled, each seeded by
its prompt, so that every row still emits plain decoding's tokens. Each row has its own engine, warmed up (above);
its suffix trees start empty in every warm-up and measure, so that no row drafts
from an earlier row's answers to the same prompts, and the prefix cache is
off. Per measure: tokens/s (completion tokens over the makespan), held
tokens/s (closed loop: until the first client is left without a request, so
that C were in flight throughout; the makespan also counts the drain, whose
steps with fewer rows cost nearly as much as full ones on a CPU, and whose
length depends on how evenly the clients' requests finished), TPOT (seconds
per output token after the first, per request) and TTFT (arrival to first
token) at p50 and p99, and what the planner chose per step: the mean k over
rows, the mean verify width, the share of rows drafting. Medians over
--repeats repeats; a ratio to plain is the median of each repeat's ratio.
Every step's record also goes to load.json, with the cost table's figure for
each step's verify pass and draft passes beside the time measured (where the
time goes).

Outputs in --out-dir: load.json, load.md and load.png (tokens/s against C,
one line per row).

    python -m scripts.bench.load                            # every row, C 1..16, three rates
    python -m scripts.bench.load --rows shipped,plain --rates ""  # the targets only
    python -m scripts.bench.load --target models/tiny/target --draft models/tiny/draft \\
        --config model-config/model-config.yaml --dtype float32 --concurrency 1,2 --rates 20 \\
        --max-new-tokens 8 --open-requests 4
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import itertools
import logging
import os
import pathlib
import statistics
import time
import zlib

from handler.config import SamplingParams
from handler.drafters import HYBRID, MODEL, NGRAM, SUFFIX
from handler.engine import (
    EngineSettings,
    GenerationRequest,
    SpeculativeEngine,
    StepRecord,
    build_engine,
    engine_settings,
)
from handler.planning.cost_table import CostTable
from handler.runtime.loading import load_models
from scripts.bench import common as bench_common
from scripts.bench import runner as bench_runner
from scripts.bench.common import fmt, machine_info, percentile, start_up_cost_table
from scripts.bench.runner import Driver, Traffic, drive, drive_interleaved, poisson_arrivals

logger = logging.getLogger("bench_load")

SHIPPED, PLAIN, INT8_FILLS = "shipped", "plain", "int8-fills"
FIXED_KS = (1, 2, 4, 8)
DRAFTER_ROWS = (MODEL, NGRAM, SUFFIX, HYBRID)
ROWS = (SHIPPED, PLAIN, *(f"k{k}" for k in FIXED_KS), *DRAFTER_ROWS, INT8_FILLS)
GREEDY = SamplingParams()
# The open loop's default rates, as fractions of the saturation rate.
RATE_FRACTIONS = (0.3, 0.6, 0.9)

# Distinct coding requests: every task in every language.
TASKS = (
    "parses an ISO 8601 date string and returns the day of the week",
    "merges two sorted lists into one sorted list",
    "returns the n-th Fibonacci number with memoization",
    "checks whether a string is a palindrome, ignoring case and punctuation",
    "counts the words in a text file and prints the ten most common",
    "flattens a nested list of arbitrary depth",
    "validates an email address with a regular expression",
    "computes the moving average of a list of numbers over a window",
    "reads a CSV file and returns the sum of one column by name",
    "implements binary search over a sorted array",
    "removes duplicate items from a list while keeping their order",
    "converts a Roman numeral to an integer",
    "groups a list of records by a key into a dictionary of lists",
    "implements an LRU cache with get and put",
    "retries a function call with exponential backoff",
    "returns the longest common prefix of a list of strings",
    "transposes a matrix given as a list of rows",
    "parses a query string into a dictionary",
    "computes the Levenshtein distance between two strings",
    "checks whether parentheses, brackets and braces in a string are balanced",
)
LANGUAGES = ("Python", "JavaScript")


@dataclasses.dataclass(frozen=True)
class Row:
    key: str
    label: str
    drafter: str
    k: int
    planned: bool
    float_fills: bool = True  # the draft's float form prefills its rows, where start-up kept one


def row_spec(key: str, config) -> Row:
    cap = config.num_speculative_tokens
    if key == SHIPPED:
        return Row(key, f"as shipped: {config.drafter}, planned, k<={cap}", config.drafter, cap, config.adaptive_k)
    if key == INT8_FILLS:
        label = f"as shipped, the int8 draft prefilling: {config.drafter}, planned, k<={cap}"
        return Row(key, label, config.drafter, cap, config.adaptive_k, float_fills=False)
    if key == PLAIN:
        return Row(key, "plain decoding (k=0)", MODEL, 0, False)
    if key.startswith("k") and key[1:].isdigit():
        return Row(key, f"model drafter, fixed k={key[1:]}", MODEL, int(key[1:]), False)
    assert key in DRAFTER_ROWS, key
    return Row(key, f"{key} drafter alone, planned, k<={cap}", key, cap, True)


def coding_prompts(tokenizer, num: int) -> list[tuple[int, ...]]:
    """`num` distinct coding requests as prompt ids (the chat template applied)."""
    pairs = list(itertools.product(TASKS, LANGUAGES))
    assert num <= len(pairs), f"at most {len(pairs)} distinct prompts"
    prompts = []
    for task, language in pairs[:num]:
        messages = [{"role": "user", "content": f"Write a {language} function that {task}. Code only."}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompts.append(tuple(tokenizer(text, add_special_tokens=False)["input_ids"]))
    return prompts


def figures(traffic: Traffic) -> dict:
    """One measure's figures from what `drive` saw, its per-step records and the outputs."""
    sent, first, done, results, steps = traffic.sent, traffic.first_at, traffic.done_at, traffic.results, traffic.steps
    num = len(results)
    tokens = [len(result.token_ids) for result in results]
    ttft = traffic.ttft()
    tpot = [(d - f) / (n - 1) for d, f, n in zip(done, first, tokens) if n > 1]
    rows_drafting = sum(sum(k > 0 for k in step.ks) for step in steps)
    row_steps = sum(step.batch_size for step in steps)
    return {
        "tokens_per_s": sum(tokens) / (max(done) - sent[0]),
        "steady_tokens_per_s": traffic.steady_tokens_per_s(),
        "requests_per_s": num / (max(done) - sent[0]),
        "tpot_p50_s": percentile(tpot, 50),
        "tpot_p99_s": percentile(tpot, 99),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "mean_k": sum(sum(step.ks) for step in steps) / row_steps,
        "mean_width": statistics.fmean(step.width for step in steps),
        "drafting_share": rows_drafting / row_steps,
        "tokens_per_pass": sum(tokens) / max(1, len(steps)),
        "completion_tokens": sum(tokens),
        # Each step's record and the tokens it emitted (those of rows admitted at its start included).
        "steps": [{**dataclasses.asdict(step), "tokens": n} for step, n in zip(steps, traffic.step_tokens)],
        "token_ids": [result.token_ids for result in results],
    }


class Bench:
    """The loaded models, the cost table and one engine per row."""

    def __init__(self, models, config, cost_table: CostTable | None, settings: EngineSettings, args) -> None:
        self.models, self.config, self.cost_table, self.settings = models, config, cost_table, settings
        self.max_new_tokens = args.max_new_tokens
        self.sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p) if args.temperature else GREEDY
        self.warm_tokens = args.warm_tokens or args.max_new_tokens
        self.warm_concurrency = args.concurrency if args.warm_tokens else [1]
        # Taken from the end of the prompts, the measured ones from the start.
        self.warm_prompts = coding_prompts(models.tokenizer, len(TASKS) * len(LANGUAGES))[::-1]
        self.engines: dict[str, SpeculativeEngine] = {}

    def engine(self, row: Row, warm_prompts: list) -> SpeculativeEngine:
        """The row's engine; a new one first serves `warm_prompts` (a closed loop at each of
        `warm_concurrency`), as a server has served traffic before it is measured.

        Each warm-up starts with empty suffix trees, as each measure does (`measure`): what the
        engine learns there of the look-ups (the outcome check's verdicts, the calibrations) is then
        of look-ups as cold as those it measures. The warm-ups at each concurrency serve the same
        first prompts, and with the trees kept a verdict on look-ups that had their answers (22 %
        above their price at 8 rows) drafted cold ones in the measure, at 0.72x plain."""
        if row.key not in self.engines:
            models = self.models
            if not row.float_fills:
                models = dataclasses.replace(models, draft_prefill=None, draft_prefill_speedup=1.0)
            engine = build_engine(
                models,
                self.settings,
                cost_table=self.cost_table if row.planned else None,
                prefix_cache_max_bytes=None,
            )
            for concurrency in self.warm_concurrency:
                engine.forget_suffix_history()
                num = max(4, 2 * concurrency)
                requests = [self.request(row, p, self.warm_tokens) for p in warm_prompts[:num]]
                drive(engine, requests, None, concurrency)
            self.engines[row.key] = engine
        return self.engines[row.key]

    def request(self, row: Row, prompt_ids: tuple[int, ...], max_new_tokens: int | None = None) -> GenerationRequest:
        # A sampled request is seeded by its prompt: every row then emits the same tokens as plain decoding
        # (coupled verification), and the column of outputs that differ still checks exactness.
        seed = None if self.sampling.is_greedy else zlib.crc32(repr(prompt_ids).encode())
        return GenerationRequest(
            prompt_ids,
            max_new_tokens or self.max_new_tokens,
            self.sampling,
            num_speculative_tokens=row.k,
            seed=seed,
            drafter=row.drafter,
        )

    def measure(self, rows: list[Row], prompts: list, arrivals: list[float] | None, concurrency: int) -> list[dict]:
        """One measure of every row under the same load, their engines stepped in turn (see
        `drive_interleaved`): each row's figures, in the order of `rows`."""
        drivers = []
        for row in rows:
            engine = self.engine(row, self.warm_prompts)
            engine.forget_suffix_history()
            drivers.append(Driver(engine, [self.request(row, p) for p in prompts], arrivals, concurrency))
        return [figures(traffic) for traffic in drive_interleaved(drivers)]


STEP_FIELDS = tuple(field.name for field in dataclasses.fields(StepRecord))


def step_costs(steps: list[dict], table: CostTable | None) -> dict | None:
    """The measured step time against the cost table's, by batch size: where the time goes."""
    if table is None or not steps:
        return None
    by_batch: dict[int, list[StepRecord]] = collections.defaultdict(list)
    for step in steps:
        by_batch[step["batch_size"]].append(StepRecord(**{key: step[key] for key in STEP_FIELDS}))
    summary = {}
    for batch, group in sorted(by_batch.items()):
        drafting = [s for s in group if s.draft_passes]
        summary[batch] = {
            "steps": len(group),
            "step_s": statistics.median(s.seconds for s in group),
            "verify_s": statistics.median(s.verify_seconds for s in group),
            "verify_table_s": statistics.median(table.target_seconds(batch, s.width) for s in group),
            "draft_s": statistics.median(s.draft_seconds for s in drafting) if drafting else 0.0,
            "draft_table_s": (
                statistics.median(s.draft_passes * table.draft_seconds(batch) for s in drafting) if drafting else 0.0
            ),
            "draft_passes": statistics.fmean(s.draft_passes for s in group),
            "width": statistics.fmean(s.width for s in group),
            # Padding: verified columns beyond each row's own drafts and pending token.
            "padding_share": sum(s.width * batch - sum(s.ks) - batch for s in group)
            / sum(s.width * batch for s in group),
            "other_s": statistics.median(s.seconds - s.verify_seconds - s.draft_seconds for s in group),
        }
    return summary


SUMMARY_KEYS = (
    "tokens_per_s",
    "steady_tokens_per_s",
    "requests_per_s",
    "tpot_p50_s",
    "tpot_p99_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "mean_k",
    "mean_width",
    "drafting_share",
    "tokens_per_pass",
)


def median_summary(runs: list[dict]) -> dict:
    return {key: _median(run[key] for run in runs) for key in SUMMARY_KEYS}


def _median(values) -> float | None:
    values = [value for value in values if value is not None]
    return statistics.median(values) if values else None


def paired_ratio(runs: list[dict], baseline: list[dict], key: str) -> float | None:
    """The median over repeats of each repeat's ratio to the baseline's measure beside it (the rows
    of a repeat ran side by side: the ratio cancels what the machine's drift did to both)."""
    return _median(
        run[key] / base[key] if run[key] is not None and base[key] else None for run, base in zip(runs, baseline)
    )


def run_all(bench_: Bench, rows: list[Row], loads: list[tuple[str, float]], prompts: list, args) -> dict:
    """Every load's measure of all rows side by side, repeated; the row that steps first rotates."""
    results: dict[str, dict[str, list[dict]]] = {name: {row.key: [] for row in rows} for name, _ in loads}
    for repeat in range(args.repeats):
        for name, value in loads:
            order = rows[repeat % len(rows) :] + rows[: repeat % len(rows)]
            if name.startswith("C="):
                concurrency = int(value)
                num = max(args.min_requests, concurrency * args.requests_per_client)
                measures = bench_.measure(order, prompts[:num], None, concurrency)
            else:
                arrivals = poisson_arrivals(args.open_requests, value, seed=repeat)
                measures = bench_.measure(order, prompts[: args.open_requests], arrivals, args.max_in_flight)
            for row, measure in zip(order, measures):
                results[name][row.key].append(measure)
                logger.info(
                    "%s %-8s %.2f tok/s (held %s)  k %.2f  width %.2f  drafting %.2f",
                    name,
                    row.key,
                    measure["tokens_per_s"],
                    fmt(measure["steady_tokens_per_s"]),
                    measure["mean_k"],
                    measure["mean_width"],
                    measure["drafting_share"],
                )
    return results


def summarize(rows: list[Row], results: dict, table: CostTable | None) -> dict:
    summary = {}
    for name, by_row in results.items():
        plain = by_row.get(PLAIN)
        plain_outputs = plain[0]["token_ids"] if plain else None
        cells = {}
        for row in rows:
            cell = median_summary(by_row[row.key])
            if plain:
                cell["vs_plain"] = paired_ratio(by_row[row.key], plain, "tokens_per_s")
                cell["steady_vs_plain"] = paired_ratio(by_row[row.key], plain, "steady_tokens_per_s")
                outputs = by_row[row.key][0]["token_ids"]
                cell["outputs_differ"] = sum(a != b for a, b in zip(outputs, plain_outputs))
            cell["by_batch"] = step_costs(by_row[row.key][0]["steps"], table)
            cell["plan_histogram"] = plan_histogram(by_row[row.key][0]["steps"])
            cells[row.key] = cell
        summary[name] = cells
    return summary


def plan_histogram(steps: list[dict]) -> dict[int, dict[int, int]]:
    """Batch size -> k -> rows that verified k drafts in steps of that batch size."""
    histogram: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for step in steps:
        histogram[step["batch_size"]].update(step["ks"])
    return {batch: dict(sorted(counts.items())) for batch, counts in sorted(histogram.items())}


def markdown(report: dict) -> str:
    settings = report["settings"]
    lines = [
        f"# Under load: speculation against plain decoding ({report['date']})",
        "",
        f"Machine: {report['machine']['description']}. Models: target {settings['target']}, "
        f"draft {settings['draft']} ({settings['draft_note']}), {settings['dtype']}; config {settings['config']}.",
        f"{settings.get('sampling', 'Greedy')}, up to {settings['max_new_tokens']} new tokens per request; "
        "closed loop: "
        f"{settings['requests_per_client']} requests per client (at least {settings['min_requests']}); "
        f"open loop: {settings['open_requests']} Poisson arrivals, at most {settings['max_in_flight']} in flight; "
        "rows stepped in turn, each on its own clock; "
        f"medians of {settings['repeats']} repeat(s); each engine first served 2C requests of "
        f"{settings['warm_tokens']} tokens at each C. "
        f"Load average {report['load_average']['start']:.2f} at start, "
        f"{report['load_average']['end']:.2f} at the end.",
        "",
        "| load | row | tok/s | × plain | held tok/s | × plain | TPOT p50 / p99 (ms) | TTFT p50 / p99 (s) "
        "| mean k | mean width | drafting | tok/pass | outputs ≠ plain |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    labels = {row["key"]: row["label"] for row in report["rows"]}
    for name, cells in report["loads"].items():
        for key, cell in cells.items():
            lines.append(
                f"| {name} | {labels[key]} | {cell['tokens_per_s']:.2f} | {fmt(cell.get('vs_plain'))}x "
                f"| {fmt(cell['steady_tokens_per_s'])} | {fmt(cell.get('steady_vs_plain'))}x "
                f"| {cell['tpot_p50_s'] * 1e3:.0f} / {cell['tpot_p99_s'] * 1e3:.0f} "
                f"| {cell['ttft_p50_s']:.2f} / {cell['ttft_p99_s']:.2f} | {cell['mean_k']:.2f} "
                f"| {cell['mean_width']:.2f} | {cell['drafting_share']:.2f} | {cell['tokens_per_pass']:.2f} "
                f"| {fmt(cell.get('outputs_differ'), '{}')} |"
            )
    lines += ["", "Where the time goes (first repeat; medians per step, by batch size; table: the cost table's):", ""]
    lines.append(
        "| load | row | batch | steps | step ms | verify ms (table) | draft ms (table) | draft passes | width "
        "| padding | other ms |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, cells in report["loads"].items():
        for key, cell in cells.items():
            for batch, c in (cell["by_batch"] or {}).items():
                lines.append(
                    f"| {name} | {key} | {batch} | {c['steps']} | {c['step_s'] * 1e3:.0f} "
                    f"| {c['verify_s'] * 1e3:.0f} ({c['verify_table_s'] * 1e3:.0f}) "
                    f"| {c['draft_s'] * 1e3:.0f} ({c['draft_table_s'] * 1e3:.0f}) | {c['draft_passes']:.2f} "
                    f"| {c['width']:.2f} | {c['padding_share']:.2f} | {c['other_s'] * 1e3:.0f} |"
                )
    return "\n".join(lines) + "\n"


def plot(report: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    closed = {name: cells for name, cells in report["loads"].items() if name.startswith("C=")}
    if not closed:
        return
    concurrency = [int(name[2:]) for name in closed]
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for row in report["rows"]:
        values = [cells[row["key"]]["tokens_per_s"] for cells in closed.values()]
        axis.plot(concurrency, values, marker="o", label=row["label"], linewidth=2.5 if row["key"] == SHIPPED else 1)
    axis.set_xscale("log", base=2)
    axis.set_xticks(concurrency, [str(c) for c in concurrency])
    axis.set_xlabel("concurrent requests (closed loop)")
    axis.set_ylabel("tokens/s")
    axis.set_title(f"Tokens/s under load, {report['date']}")
    axis.legend(fontsize=7)
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=str(bench_common.DEFAULT_TARGET))
    parser.add_argument("--draft", default=str(bench_common.DEFAULT_DRAFT))
    parser.add_argument("--config", default=str(bench_common.DEFAULT_CONFIG))
    parser.add_argument("--dtype", default=None, help="override the config's dtype")
    parser.add_argument("--draft-quantization", default=None, help="override the config's draft_quantization")
    parser.add_argument("--drafter", default=None, help="override the config's drafter (the shipped row's)")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    parser.add_argument("--concurrency", default="1,2,4,8,16", help="closed-loop client counts")
    parser.add_argument(
        "--rates",
        default=None,
        help="open-loop requests/s, comma-separated ('' for none); default: 30/60/90%% of saturation",
    )
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--min-requests", type=int, default=4)
    parser.add_argument("--open-requests", type=int, default=24)
    parser.add_argument("--max-in-flight", type=int, default=16, help="open loop: the batch's room (batchSize)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; above 0: sampled, seeded")
    parser.add_argument("--top-p", type=float, default=1.0, help="sampled requests' top-p (1.0: off)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument(
        "--warm-tokens",
        type=int,
        default=32,
        help="warm-up: each engine serves 2C requests of this many tokens at each C first (0: 4 requests at C=1)",
    )
    parser.add_argument(
        "--gpu-id", default=None, help="serve on this CUDA device, as TorchServe's gpu_id (default: the CPU)"
    )
    parser.add_argument("--out-dir", default="bench_results")
    args = parser.parse_args(argv)
    args.rows = [key.strip() for key in args.rows.split(",") if key.strip()]
    unknown = sorted(set(args.rows) - set(ROWS))
    if unknown:
        parser.error(f"unknown rows {unknown}; known: {', '.join(ROWS)}")
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if args.rates is not None:
        args.rates = [float(r) for r in args.rates.split(",") if r.strip()]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    started, load_at_start = time.perf_counter(), os.getloadavg()[0]
    config = bench_runner.bench_config(args)
    if args.drafter:
        config = dataclasses.replace(config, drafter=args.drafter)
    models = load_models(config, None, args.gpu_id)
    machine = machine_info()
    logger.info("machine: %s", machine["description"])
    batch_room = max(args.max_in_flight, *args.concurrency)
    settings = engine_settings(models, config)
    # Measured afresh, as the handler measures it at start-up, up to the batch this run reaches.
    cost_table = start_up_cost_table(models, config, batch_room, runner=settings.runner)
    num_prompts = max(args.open_requests, args.min_requests, max(args.concurrency) * args.requests_per_client)
    prompts = coding_prompts(models.tokenizer, num_prompts)
    rows = [row_spec(key, config) for key in ROWS if key in args.rows]
    runner = Bench(models, config, cost_table, settings, args)
    closed = [(f"C={c}", float(c)) for c in args.concurrency]
    results = run_all(runner, rows, closed, prompts, args)
    rates = args.rates
    if rates is None:
        saturation = None
        if closed and PLAIN in args.rows:
            saturation = median_summary(results[closed[-1][0]][PLAIN])["requests_per_s"]
        rates = [round(fraction * saturation, 3) for fraction in RATE_FRACTIONS] if saturation else []
    if rates:
        results.update(run_all(runner, rows, [(f"{rate:g} req/s", rate) for rate in rates], prompts, args))

    draft_note = "int8" if models.draft_quantization == "int8" else str(models.dtype).replace("torch.", "")
    if models.draft_prefill is not None:
        draft_note += f", its {str(models.draft_prefill.dtype).removeprefix('torch.')} form prefilling"
    report = {
        "date": datetime.date.today().isoformat(),
        "machine": machine,
        "load_average": {"start": load_at_start, "end": os.getloadavg()[0]},
        "settings": {
            "target": bench_common.shown(args.target),
            "draft": bench_common.shown(args.draft),
            "config": bench_common.shown(args.config),
            "dtype": str(models.dtype).replace("torch.", ""),
            "draft_note": draft_note,
            "max_new_tokens": args.max_new_tokens,
            "sampling": (
                f"Sampled (temperature {args.temperature:g}, top-p {args.top_p:g}, seeded)"
                if args.temperature
                else "Greedy"
            ),
            "requests_per_client": args.requests_per_client,
            "min_requests": args.min_requests,
            "open_requests": args.open_requests,
            "max_in_flight": args.max_in_flight,
            "repeats": args.repeats,
            "warm_tokens": args.warm_tokens,
            "rates": rates,
        },
        "cost_table": bench_common.describe_cost_table(cost_table),
        "rows": [dataclasses.asdict(row) for row in rows],
        "loads": summarize(rows, results, cost_table),
        "raw": {
            name: {key: [run["steps"] for run in runs] for key, runs in by_row.items()}
            for name, by_row in results.items()
        },
    }
    report["wall_seconds"] = time.perf_counter() - started
    bench_common.write_report(pathlib.Path(args.out_dir), "load", report, markdown, plot, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
