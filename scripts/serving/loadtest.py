#!/usr/bin/env python3
"""Load-test the speculative-decoding model: N requests, closed-loop or open-loop, every answer checked.

The requests mix greedy and sampled (seeded) decoding, and streamed and
non-streamed answers, in the proportions asked for; the mix is fixed by
--mix-seed. Every answer is validated: the fields and their types, a known
finish_reason, and for streams that each NDJSON line parses and the last one
carries finish_reason. The report gives throughput (requests/s and completion
tokens/s), latency percentiles, time to the first chunk of streams, errors by
HTTP status, malformed answers, and LOST requests: no response at all
(connection refused or reset, timeout, stream cut off).

Two ways to send:
- closed loop (default): --concurrency requests in flight, the next sent when one ends;
- open loop (--rate R): requests arrive as a Poisson process of R requests/s,
  whatever the server's state, the way independent users arrive. Only this
  shows queueing: a slow server builds a backlog instead of slowing the sender.

--long-fraction mixes lengths: that share of the requests asks for
--long-max-new-tokens, the others for --max-new-tokens; the report gives
latency, time to first token (TTFT) and time per output token (TPOT, streams:
the time after the first chunk divided by the tokens after it) for each
length. --compare-model sends the same requests, at the same times, to a second
registered model afterwards (e.g. the same pair packaged without
continuousBatching) and prints both with their ratio; --compare-json compares
with an earlier run's --json-out instead (two servers one after the other,
when two workers do not fit in memory).

The exit status is 1 when any request failed, was malformed or was lost,
unless --allow-errors is given.

Usage:
    python -m scripts.serving.loadtest --requests 200 --concurrency 8
    python -m scripts.serving.loadtest --model tiny-spec --no-auth --requests 50 --json-out load.json
    python -m scripts.serving.loadtest --model tiny-spec --compare-model tiny-spec-static --no-auth \\
        --rate 4 --requests 120 --long-fraction 0.25 --max-new-tokens 16 --long-max-new-tokens 256
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import json
import random
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import requests

from scripts.bench.common import percentile
from scripts.serving.torchserve import (
    DEFAULT_INFERENCE_URL,
    DEFAULT_KEY_FILE,
    DEFAULT_MODEL,
    ClientError,
    auth_headers,
    generate,
)

PROMPTS = (
    "Write a Python function that checks whether a string is a palindrome.",
    "def fibonacci(n):",
    "Explain what a hash map is in one sentence.",
    "// A C function that returns the maximum of an int array\nint max_of(const int *xs, size_t n) {",
    "Write a SQL query that counts the orders per customer.",
    "class Stack:\n    def __init__(self):",
    "Write a bash one-liner that counts the lines of all .py files.",
    "What does `git rebase -i` do?",
)
SAMPLED_TEMPERATURE = 0.8
OUTCOMES = ("ok", "http_error", "malformed", "lost")
SHORT, LONG = "short", "long"


@dataclasses.dataclass(frozen=True)
class LoadConfig:
    url: str = DEFAULT_INFERENCE_URL
    model: str = DEFAULT_MODEL
    key_file: Path | None = DEFAULT_KEY_FILE  # None: send no key
    num_requests: int = 100
    concurrency: int = 4
    stream_fraction: float = 0.5
    sampled_fraction: float = 0.5
    max_new_tokens: int = 16
    timeout_s: float = 120.0
    mix_seed: int = 0
    rate: float | None = None  # requests/s of the open loop; None: closed loop at `concurrency`
    long_fraction: float = 0.0
    long_max_new_tokens: int = 256


@dataclasses.dataclass(frozen=True)
class PlannedRequest:
    index: int
    body: dict
    length: str = SHORT  # SHORT or LONG
    send_at: float = 0.0  # seconds after the start (open loop)

    @property
    def kind(self) -> str:
        decoding = "sampled" if self.body.get("temperature", 0) > 0 else "greedy"
        return f"{decoding}/{'stream' if self.body.get('stream') else 'plain'}"


@dataclasses.dataclass
class Outcome:
    """What happened to one request."""

    index: int
    kind: str
    outcome: str  # one of OUTCOMES
    status: int | None = None  # HTTP status, None when lost before any answer
    error: str = ""
    started_at: float = 0.0  # time.monotonic() when sent
    latency_s: float = 0.0
    first_chunk_s: float | None = None
    completion_tokens: int = 0
    length: str = SHORT
    num_lines: int = 0
    acceptance_rate: float | None = None
    mean_accepted_length: float | None = None
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)


def plan_requests(config: LoadConfig) -> list[PlannedRequest]:
    """The request bodies, reproducibly mixed by config.mix_seed."""
    rng = random.Random(config.mix_seed)
    # Separate streams, so that adding lengths or arrivals leaves the older mixes as they were.
    length_rng = random.Random(f"{config.mix_seed}/length")
    arrival_rng = random.Random(f"{config.mix_seed}/arrival")
    planned = []
    send_at = 0.0
    for index in range(config.num_requests):
        length = LONG if length_rng.random() < config.long_fraction else SHORT
        max_new_tokens = config.long_max_new_tokens if length == LONG else config.max_new_tokens
        body: dict = {"prompt": PROMPTS[index % len(PROMPTS)], "max_new_tokens": max_new_tokens}
        if rng.random() < config.sampled_fraction:
            body.update(temperature=SAMPLED_TEMPERATURE, seed=index)
        else:
            body["temperature"] = 0.0
        if rng.random() < config.stream_fraction:
            body["stream"] = True
        if config.rate is not None and index > 0:
            # Poisson arrivals: exponential gaps with mean 1 / rate.
            send_at += arrival_rng.expovariate(config.rate)
        planned.append(PlannedRequest(index, body, length, send_at))
    return planned


def send_one(
    config: LoadConfig, planned: PlannedRequest, headers: dict[str, str], session: requests.Session | None = None
) -> Outcome:
    """Send one planned request and classify what came back; never raises."""
    start = time.perf_counter()
    outcome = Outcome(
        index=planned.index, kind=planned.kind, outcome="ok", started_at=time.monotonic(), length=planned.length
    )
    try:
        answer = generate(
            config.url,
            config.model,
            planned.body,
            headers,
            config.key_file,
            config.timeout_s,
            session=session,
        )
    except ClientError as error:
        outcome.outcome, outcome.status, outcome.error = "http_error", error.status, str(error)
    except requests.RequestException as error:
        outcome.outcome, outcome.error = "lost", f"{type(error).__name__}: {error}"
    except ValueError as error:  # a stream line that is not JSON
        outcome.outcome, outcome.status, outcome.error = "malformed", 200, f"bad stream line: {error}"
    else:
        outcome.status = 200
        outcome.first_chunk_s = answer.first_chunk_s
        outcome.completion_tokens = answer.completion_tokens
        outcome.num_lines = answer.num_lines
        outcome.text, outcome.token_ids = answer.text, answer.token_ids
        speculative = answer.final.get("speculative") or {}
        outcome.acceptance_rate = speculative.get("acceptance_rate")
        outcome.mean_accepted_length = speculative.get("mean_accepted_length")
        if answer.problems:
            outcome.outcome, outcome.error = "malformed", "; ".join(answer.problems)
    outcome.latency_s = time.perf_counter() - start
    return outcome


def run_load(
    config: LoadConfig,
    on_outcome: Callable[[Outcome], None] | None = None,
    stop: threading.Event | None = None,
) -> tuple[list[Outcome], float]:
    """Send all planned requests; returns the outcomes (by index) and the wall time.

    Closed loop at config.concurrency, or open loop when config.rate is set.
    Setting `stop` makes the remaining, not yet started requests be skipped.
    """
    headers = auth_headers(config.key_file)
    planned = plan_requests(config)
    if config.rate is not None:
        return run_open_loop(config, planned, headers, on_outcome, stop)
    local = threading.local()

    def task(item: PlannedRequest) -> Outcome | None:
        if stop is not None and stop.is_set():
            return None
        # One keep-alive session per thread: requests.Session is not thread-safe.
        if not hasattr(local, "session"):
            local.session = requests.Session()
        outcome = send_one(config, item, headers, local.session)
        if outcome.outcome == "lost":
            # The connection may be broken: the next request opens a fresh one.
            local.session.close()
            local.session = requests.Session()
        if on_outcome is not None:
            on_outcome(outcome)
        return outcome

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=config.concurrency) as pool:
        results = list(pool.map(task, planned))
    wall_s = time.perf_counter() - start
    return [r for r in results if r is not None], wall_s


def run_open_loop(
    config: LoadConfig,
    planned: list[PlannedRequest],
    headers: dict[str, str],
    on_outcome: Callable[[Outcome], None] | None = None,
    stop: threading.Event | None = None,
) -> tuple[list[Outcome], float]:
    """Each request sent at its own planned time, in its own thread, whatever is still in flight."""
    results: list[Outcome | None] = [None] * len(planned)

    def task(item: PlannedRequest) -> None:
        # A connection per request: open-loop clients are independent users.
        outcome = send_one(config, item, headers)
        results[item.index] = outcome
        if on_outcome is not None:
            on_outcome(outcome)

    threads = []
    start = time.perf_counter()
    for item in planned:
        delay = start + item.send_at - time.perf_counter()
        if stop is not None and stop.wait(max(0.0, delay)):
            break
        if stop is None and delay > 0:
            time.sleep(delay)
        thread = threading.Thread(target=task, args=(item,), daemon=True)
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
    wall_s = time.perf_counter() - start
    return [r for r in results if r is not None], wall_s


# ---------------------------------------------------------------------------
# Report


def time_per_output_token(outcome: Outcome) -> float | None:
    """Streams: seconds per token after the first chunk; None when it cannot be told."""
    if outcome.first_chunk_s is None or outcome.completion_tokens < 2 or outcome.num_lines < 2:
        return None
    return (outcome.latency_s - outcome.first_chunk_s) / (outcome.completion_tokens - 1)


def latency_figures(ok: list[Outcome]) -> dict:
    """Latency, TTFT and TPOT percentiles of some answered requests."""
    latencies = [o.latency_s for o in ok]
    first_chunks = [o.first_chunk_s for o in ok if o.first_chunk_s is not None]
    per_token = [t for t in (time_per_output_token(o) for o in ok) if t is not None]
    return {
        "requests": len(ok),
        "latency_s": {f"p{q}": percentile(latencies, q) for q in (50, 95, 99)} | {"max": max(latencies, default=None)},
        "ttft_s": {f"p{q}": percentile(first_chunks, q) for q in (50, 99)},
        "tpot_s": {f"p{q}": percentile(per_token, q) for q in (50, 99)},
    }


def summarize(config: LoadConfig, outcomes: list[Outcome], wall_s: float) -> dict:
    ok = [o for o in outcomes if o.outcome == "ok"]
    latencies = [o.latency_s for o in ok]
    first_chunks = [o.first_chunk_s for o in ok if o.first_chunk_s is not None]
    tokens = sum(o.completion_tokens for o in ok)
    errors_by_status = collections.Counter(str(o.status) for o in outcomes if o.outcome == "http_error")
    lost_by_error = collections.Counter(o.error.split(":")[0] for o in outcomes if o.outcome == "lost")
    acceptance = [o.acceptance_rate for o in ok if o.acceptance_rate is not None]
    accepted_length = [o.mean_accepted_length for o in ok if o.mean_accepted_length is not None]
    return {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(config).items()},
        "requests": len(outcomes),
        "by_kind": dict(collections.Counter(o.kind for o in outcomes)),
        "ok": len(ok),
        "errors": sum(errors_by_status.values()),
        "errors_by_status": dict(errors_by_status),
        "malformed": sum(o.outcome == "malformed" for o in outcomes),
        "lost": sum(lost_by_error.values()),
        "lost_by_error": dict(lost_by_error),
        "wall_s": wall_s,
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else 0.0,
        "completion_tokens": tokens,
        "tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
        "latency_s": {f"p{q}": percentile(latencies, q) for q in (50, 95, 99)} | {"max": max(latencies, default=None)},
        "first_chunk_s": {f"p{q}": percentile(first_chunks, q) for q in (50, 95, 99)},
        "mean_acceptance_rate": sum(acceptance) / len(acceptance) if acceptance else None,
        "mean_accepted_length": sum(accepted_length) / len(accepted_length) if accepted_length else None,
        "ttft_s": latency_figures(ok)["ttft_s"],
        "tpot_s": latency_figures(ok)["tpot_s"],
        "by_length": {length: latency_figures([o for o in ok if o.length == length]) for length in (SHORT, LONG)},
        "failures": [
            {"index": o.index, "kind": o.kind, "outcome": o.outcome, "status": o.status, "error": o.error[:300]}
            for o in outcomes
            if o.outcome != "ok"
        ],
    }


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def format_table(summary: dict) -> str:
    config = summary["config"]
    latency, first_chunk = summary["latency_s"], summary["first_chunk_s"]
    kinds = ", ".join(f"{kind} {count}" for kind, count in sorted(summary["by_kind"].items()))
    sending = (
        f"open loop, Poisson at {config['rate']} req/s"
        if config.get("rate")
        else f"concurrency {config['concurrency']}"
    )
    lengths = f"max_new_tokens {config['max_new_tokens']}"
    if config.get("long_fraction"):
        lengths += f", {100 * config['long_fraction']:.0f}% long at {config['long_max_new_tokens']}"
    rows = [
        ("model", f"{config['model']} at {config['url']}"),
        ("requests", f"{summary['requests']}, {sending}, {lengths} ({kinds})"),
        ("ok", str(summary["ok"])),
        ("errors", f"{summary['errors']} {summary['errors_by_status'] or ''}".rstrip()),
        ("malformed", str(summary["malformed"])),
        ("LOST", f"{summary['lost']} {summary['lost_by_error'] or ''}".rstrip()),
        ("wall time", f"{summary['wall_s']:.2f} s"),
        (
            "throughput",
            f"{summary['requests_per_s']:.2f} req/s, {summary['tokens_per_s']:.1f} tokens/s "
            f"({summary['completion_tokens']} completion tokens)",
        ),
        (
            "latency p50/p95/p99",
            " / ".join(_seconds(latency[p]) for p in ("p50", "p95", "p99")) + f" s (max {_seconds(latency['max'])} s)",
        ),
        (
            "first chunk p50/p95/p99",
            " / ".join(_seconds(first_chunk[p]) for p in ("p50", "p95", "p99")) + " s (streams)",
        ),
        ("TPOT p50/p99", " / ".join(_seconds(summary["tpot_s"][p]) for p in ("p50", "p99")) + " s (streams)"),
    ]
    for length, figures in summary["by_length"].items():
        if figures["requests"]:
            rows.append(
                (
                    f"{length}: latency p50/p99",
                    " / ".join(_seconds(figures["latency_s"][p]) for p in ("p50", "p99"))
                    + f" s, TTFT p50 {_seconds(figures['ttft_s']['p50'])} s ({figures['requests']} requests)",
                )
            )
    if summary["mean_acceptance_rate"] is not None:
        rows.append(
            (
                "acceptance",
                f"{100 * summary['mean_acceptance_rate']:.1f}% mean, "
                f"mean accepted length {summary['mean_accepted_length']:.2f} tokens/target pass",
            )
        )
    width = max(len(name) for name, _ in rows)
    lines = [f"{name:<{width}}  {value}" for name, value in rows]
    for failure in summary["failures"][:10]:
        lines.append(
            f"  #{failure['index']} {failure['kind']}: {failure['outcome']} "
            f"(status {failure['status']}) {failure['error'][:160]}"
        )
    if len(summary["failures"]) > 10:
        lines.append(f"  ... and {len(summary['failures']) - 10} more (see --json-out)")
    return "\n".join(lines)


COMPARED = (
    ("tokens/s", lambda s: s["tokens_per_s"]),
    ("latency p50 s", lambda s: s["latency_s"]["p50"]),
    ("latency p99 s", lambda s: s["latency_s"]["p99"]),
    ("short latency p50 s", lambda s: s["by_length"][SHORT]["latency_s"]["p50"]),
    ("short latency p99 s", lambda s: s["by_length"][SHORT]["latency_s"]["p99"]),
    ("long latency p99 s", lambda s: s["by_length"][LONG]["latency_s"]["p99"]),
    ("TTFT p50 s", lambda s: s["ttft_s"]["p50"]),
    ("TTFT p99 s", lambda s: s["ttft_s"]["p99"]),
    ("TPOT p50 s", lambda s: s["tpot_s"]["p50"]),
)


def format_comparison(summary: dict, baseline: dict) -> str:
    """The figures of two runs of the same requests side by side, with their ratio."""
    name, base_name = summary["config"]["model"], baseline["config"]["model"]
    width = max(len(label) for label, _ in COMPARED)
    lines = [f"{'':<{width}}  {name:>22}  {base_name:>22}  {'ratio':>7}"]
    for label, figure in COMPARED:
        value, base = figure(summary), figure(baseline)
        ratio = f"{value / base:.3f}" if value is not None and base else "-"
        lines.append(
            f"{label:<{width}}  {'-' if value is None else f'{value:.3f}':>22}  "
            f"{'-' if base is None else f'{base:.3f}':>22}  {ratio:>7}"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# CLI


def fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {value}")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--url", default=DEFAULT_INFERENCE_URL, help=f"inference address (default {DEFAULT_INFERENCE_URL})"
    )
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"registered model name (default {DEFAULT_MODEL})")
    auth = parser.add_mutually_exclusive_group()
    auth.add_argument("--key-file", type=Path, default=DEFAULT_KEY_FILE, help="default ./key_file.json")
    auth.add_argument("--no-auth", action="store_true", help="send no key (token auth off)")
    parser.add_argument("--requests", type=positive_int, default=100, help="number of requests (default 100)")
    parser.add_argument("--concurrency", type=positive_int, default=4, help="requests in flight (default 4)")
    parser.add_argument("--stream-fraction", type=fraction, default=0.5, help="share streamed (default 0.5)")
    parser.add_argument("--sampled-fraction", type=fraction, default=0.5, help="share sampled, seeded (default 0.5)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=16, help="per request (default 16)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for bytes (default 120)")
    parser.add_argument("--mix-seed", type=int, default=0, help="seed of the request mix (default 0)")
    parser.add_argument("--rate", type=positive_float, help="open loop: Poisson arrivals at this many requests/s")
    parser.add_argument("--long-fraction", type=fraction, default=0.0, help="share of long requests (default 0)")
    parser.add_argument("--long-max-new-tokens", type=positive_int, default=256, help="long requests' (default 256)")
    compare = parser.add_mutually_exclusive_group()
    compare.add_argument("--compare-model", help="then send the same requests to this registered model; print both")
    compare.add_argument("--compare-json", type=Path, help="compare with an earlier run's --json-out (same options)")
    parser.add_argument("--json-out", type=Path, help="write the summary and every failure as JSON here")
    parser.add_argument("--allow-errors", action="store_true", help="exit 0 even with errors or lost requests")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = LoadConfig(
        url=args.url,
        model=args.model,
        key_file=None if args.no_auth else args.key_file,
        num_requests=args.requests,
        concurrency=args.concurrency,
        stream_fraction=args.stream_fraction,
        sampled_fraction=args.sampled_fraction,
        max_new_tokens=args.max_new_tokens,
        timeout_s=args.timeout,
        mix_seed=args.mix_seed,
        rate=args.rate,
        long_fraction=args.long_fraction,
        long_max_new_tokens=args.long_max_new_tokens,
    )
    models = [config.model] + ([args.compare_model] if args.compare_model else [])
    summaries = []
    for model in models:
        summary = run_and_report(dataclasses.replace(config, model=model))
        if summary is None:
            return 2
        summaries.append(summary)
    if args.compare_json is not None:
        baseline = json.loads(args.compare_json.read_text(encoding="utf-8"))
        baseline = baseline["runs"][0] if "runs" in baseline else baseline
        print(f"\nsame requests, same arrival times, against {args.compare_json}:")
        print(format_comparison(summaries[0], baseline))
    if len(summaries) == 2:
        print("\nsame requests, same arrival times:")
        print(format_comparison(summaries[0], summaries[1]))
    if args.json_out is not None:
        report = summaries[0] if len(summaries) == 1 else {"runs": summaries}
        args.json_out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    failed = sum(s["errors"] + s["malformed"] + s["lost"] for s in summaries)
    return 1 if failed and not args.allow_errors else 0


def run_and_report(config: LoadConfig) -> dict | None:
    """One load run with progress on stderr and the table on stdout; None when the key file is unreadable."""
    sending = f"open loop at {config.rate} req/s" if config.rate else f"concurrency {config.concurrency}"
    print(
        f"sending {config.num_requests} requests to {config.url}/predictions/{config.model} ({sending}) ...",
        file=sys.stderr,
    )
    done = [0]
    lock = threading.Lock()

    def progress(outcome: Outcome) -> None:
        with lock:
            done[0] += 1
            if done[0] % max(1, config.num_requests // 10) == 0:
                print(f"  {done[0]}/{config.num_requests} done", file=sys.stderr)

    try:
        outcomes, wall_s = run_load(config, on_outcome=progress)
    except ClientError as error:  # an unreadable key file
        print(f"error: {error}", file=sys.stderr)
        return None
    summary = summarize(config, outcomes, wall_s)
    print(format_table(summary))
    return summary


if __name__ == "__main__":
    sys.exit(main())
