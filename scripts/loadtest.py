#!/usr/bin/env python3
"""Load-test the speculative-decoding model: N requests at concurrency C, every answer checked.

The requests mix greedy and sampled (seeded) decoding, and streamed and
non-streamed answers, in the proportions asked for; the mix is fixed by
--mix-seed. Every answer is validated: the fields and their types, a known
finish_reason, and for streams that each NDJSON line parses and the last one
carries finish_reason. The report gives throughput (requests/s and completion
tokens/s), latency percentiles, time to the first chunk of streams, errors by
HTTP status, malformed answers, and LOST requests: no response at all
(connection refused or reset, timeout, stream cut off).

The exit status is 1 when any request failed, was malformed or was lost,
unless --allow-errors is given.

Usage:
    python -m scripts.loadtest --requests 200 --concurrency 8
    python -m scripts.loadtest --model tiny-spec --no-auth --requests 50 --json-out load.json
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

from scripts.torchserve import (
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


@dataclasses.dataclass(frozen=True)
class PlannedRequest:
    index: int
    body: dict

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
    acceptance_rate: float | None = None
    mean_accepted_length: float | None = None
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)


def plan_requests(config: LoadConfig) -> list[PlannedRequest]:
    """The request bodies, reproducibly mixed by config.mix_seed."""
    rng = random.Random(config.mix_seed)
    planned = []
    for index in range(config.num_requests):
        body: dict = {"prompt": PROMPTS[index % len(PROMPTS)], "max_new_tokens": config.max_new_tokens}
        if rng.random() < config.sampled_fraction:
            body.update(temperature=SAMPLED_TEMPERATURE, seed=index)
        else:
            body["temperature"] = 0.0
        if rng.random() < config.stream_fraction:
            body["stream"] = True
        planned.append(PlannedRequest(index, body))
    return planned


def send_one(
    config: LoadConfig, planned: PlannedRequest, headers: dict[str, str], session: requests.Session | None = None
) -> Outcome:
    """Send one planned request and classify what came back; never raises."""
    start = time.perf_counter()
    outcome = Outcome(index=planned.index, kind=planned.kind, outcome="ok", started_at=time.monotonic())
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
    """Send all planned requests at config.concurrency; returns the outcomes (by index) and the wall time.

    Setting `stop` makes the remaining, not yet started requests be skipped.
    """
    headers = auth_headers(config.key_file)
    planned = plan_requests(config)
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


# ---------------------------------------------------------------------------
# Report


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between closest ranks."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


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
    rows = [
        ("model", f"{config['model']} at {config['url']}"),
        (
            "requests",
            f"{summary['requests']} at concurrency {config['concurrency']}, "
            f"max_new_tokens {config['max_new_tokens']} ({kinds})",
        ),
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
    ]
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
    )
    print(
        f"sending {config.num_requests} requests to {config.url}/predictions/{config.model} "
        f"at concurrency {config.concurrency} ...",
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
        return 2
    summary = summarize(config, outcomes, wall_s)
    print(format_table(summary))
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    failed = summary["errors"] + summary["malformed"] + summary["lost"]
    return 1 if failed and not args.allow_errors else 0


if __name__ == "__main__":
    sys.exit(main())
