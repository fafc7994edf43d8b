#!/usr/bin/env python3
"""Benchmark the prefix cache: time to first token and throughput, cache off against cache on.

One run, one machine, the same loaded models (the demo pair and
model-config/qwen-coder.yaml by default: its dtype, drafter and k, and with
adaptive_k a cost table measured at start, as the handler measures it). Cache
off and cache on are two engines on those models, a fresh one for every
measure, so the cache holds only what the measure itself left; every ratio is
to the cache-off run of the same invocation.

1. Multi-turn chat: a coding assistant's system prompt and four tools (about
   1,500 tokens as the chat template renders them), then 6 user turns; each
   reply goes back as an assistant message (its text) before the next user
   message. Every prompt is made by the OpenAI chat route's own parsing
   (`parse_openai_request`: chat template, tools, defaults), so the hit rate is
   the route's. One request at a time; TTFT is the time from `add_request` to
   the end of the first step that emits a token for it.
2. Shared system prompt under load: 16 users, one ~1,000-token system prompt
   and a short question each (the same route), arriving as a Poisson process
   at --rate and driven through the step API in wall-clock time: a request
   joins at the first step boundary after its arrival. Same arrivals for both.

Both greedy; medians of --repeats repeats (cache off, then on, each repeat),
after a warm-up. Also printed: how many greedy outputs differ with the cache on
and where they first differ (in bfloat16 a prefix computed in one chunk and
continued in another rounds differently: docs/prefix-caching.md).

    python -m scripts.bench.prefix                     # the demo pair and its shipped config
    python -m scripts.bench.prefix --target models/tiny/target --draft models/tiny/draft \\
        --config model-config/model-config.yaml --dtype float32 --system-tokens 120 --num-tools 1 \\
        --turns 3 --turn-tokens 8 --users 4 --shared-tokens 100 --load-tokens 8 --rate 50 --repeats 1
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import logging
import pathlib
import statistics

import yaml

from handler.config import handler_config_from_yaml_config
from handler.engine import GenerationRequest, GenerationResult, SpeculativeEngine, build_engine, engine_settings
from handler.planning.measure import measure_for_config
from handler.runtime.loading import load_models
from scripts.bench.common import (
    DEFAULT_CONFIG,
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    first_difference,
    fmt,
    machine_info,
    percentile,
    shown,
    write_json,
)
from scripts.bench.runner import ChatRoute, drive, poisson_arrivals

logger = logging.getLogger("bench_prefix")

MODES = ("off", "on")  # cache off (the baseline), cache on
GIB = 2**30
LOAD_KEYS = ("tokens_per_s", "ttft_p50_s", "ttft_p90_s", "decode_tokens_per_s")  # the load table's medians

SYSTEM_HEADER = (
    "You are CodePilot, a senior software engineer who pairs with developers inside their repository. "
    "You can read files, search the code, run the tests and propose patches through the tools you are given. "
    "Follow the rules below in every answer."
)
# Taken in order until the rendered system turn reaches the wanted length.
SYSTEM_SECTIONS = (
    "## Understanding the task\n- Restate the goal in one sentence before you start when the request is "
    "ambiguous, and ask one precise question rather than guessing at intent.\n- Read the code you are about "
    "to change, and the code that calls it, before proposing any edit. Never invent functions, modules or "
    "configuration keys: search for them first.\n- Prefer the smallest change that solves the problem. Do not "
    "refactor unrelated code in the same patch.",
    "## Working with tools\n- Use `search_code` to find definitions and call sites, `read_file` to read them "
    "with enough context (at least the whole function), `run_tests` to check a hypothesis, and `apply_patch` "
    "only once you have read every hunk's surroundings.\n- Call one tool at a time and look at its result "
    "before the next call. If a tool fails, say so and explain what you will try instead; never pretend a call "
    "succeeded.\n- Do not read the same file twice in one turn unless it changed.",
    "## Code style\n- Match the style of the surrounding code: naming, formatting, import order, error "
    "handling, docstring conventions. The repository's linter configuration wins over your preferences.\n- "
    "Python: type hints on public functions, f-strings, pathlib for paths, dataclasses for plain records, "
    "no mutable default arguments, no bare `except:`.\n- Keep functions short and names descriptive: a "
    "reader should understand a function from its name and signature.",
    "## Correctness\n- Think about edge cases explicitly: empty inputs, None, very large inputs, unicode, "
    "time zones, concurrency, partial failures, retries. Mention the ones your change handles.\n- Preserve "
    "backwards compatibility of public interfaces unless the user asked to break it; when you must, say what "
    "breaks and how callers migrate.\n- Never swallow an exception silently. Either handle it meaningfully or "
    "let it propagate with context.",
    "## Tests\n- Every behaviour change comes with a test that fails before the change and passes after it. "
    "Put it next to the existing tests for that module, in the same framework and style.\n- Prefer small, "
    "deterministic unit tests; seed every random generator; never sleep to wait for something, poll with a "
    "deadline instead.\n- After a patch, run the narrowest test selection that covers it, then say which "
    "tests you ran and what they printed.",
    "## Security\n- Treat all input as untrusted: validate at the boundary, use parameterised queries, never "
    "build shell commands by string concatenation, never disable TLS verification.\n- Never print, log or "
    "commit secrets, tokens or credentials, even from test fixtures. If you see one in the code, point it "
    "out and suggest moving it to the secret store.\n- Do not add dependencies without saying why the standard "
    "library is not enough, and prefer well-maintained packages with a pinned version.",
    "## Performance\n- Measure before optimising: ask for or produce a profile, and state the numbers before "
    "and after. Do not trade readability for speed without a measured reason.\n- Watch for N+1 queries, "
    "quadratic loops over user-sized data, unbounded caches and blocking calls inside async code.\n- "
    "When you suggest caching, state the invalidation rule and the memory bound in one sentence each.",
    "## Answers\n- Lead with the answer, then the reasoning. Use short paragraphs and bullet lists; keep "
    "explanations proportional to the question.\n- Show code in fenced blocks with the language named. For "
    "edits, show a unified diff or the complete new function, never fragments with `...`.\n- When you are not "
    "sure, say how sure you are and what would settle it. Do not apologise repeatedly, and do not pad answers.",
    "## Git and reviews\n- Suggest commit messages in the imperative mood, with a short subject line and a "
    "body that explains why, not what.\n- When reviewing, separate blocking issues from suggestions and "
    "nitpicks, and quote the exact lines you mean.\n- Never rewrite published history, force-push shared "
    "branches or delete files you did not create without asking first.",
    "## Environment\n- The project uses Python 3.11, pytest, ruff and a Makefile; run commands through the "
    "Makefile targets when one exists.\n- The CI runs on Linux with 2 CPU cores and no network access during "
    "tests: tests must not download anything.\n- Configuration is read once at start-up from YAML files into "
    "frozen dataclasses; unknown keys are errors.",
    "## Limits\n- You cannot see the user's screen, terminal or browser; ask for the exact error message and "
    "the command that produced it.\n- Decline requests to write malware, to bypass licensing or "
    "authentication, or to collect personal data without consent, and offer a legitimate alternative.",
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": list(properties)},
        },
    }
    for name, description, properties in (
        (
            "read_file",
            "Read a file of the repository, optionally a range of lines",
            {
                "path": {"type": "string", "description": "Path relative to the repository root"},
                "start_line": {"type": "integer", "minimum": 1},
                "end_line": {"type": "integer", "minimum": 1},
            },
        ),
        (
            "search_code",
            "Search the repository for a regular expression; returns matching lines with their paths",
            {
                "pattern": {"type": "string", "description": "A Python regular expression"},
                "glob": {"type": "string", "description": "Only files matching this glob, e.g. src/**/*.py"},
            },
        ),
        (
            "run_tests",
            "Run the test suite or a selection of it with pytest and return the output",
            {
                "selection": {"type": "string", "description": "A pytest node id, file or -k expression"},
                "timeout_s": {"type": "integer", "minimum": 1, "maximum": 600},
            },
        ),
        (
            "apply_patch",
            "Apply a unified diff to the working tree; fails without changing anything if a hunk does not apply",
            {"diff": {"type": "string", "description": "A unified diff with paths relative to the root"}},
        ),
    )
]
USER_TURNS = (
    "Our Flask service's /search endpoint sometimes takes 8 seconds. It queries Postgres through SQLAlchemy "
    "and then formats each result with a helper. What would you look at first?",
    "The helper calls `row.owner.name` for every row, and there are about 300 rows. Is that the problem?",
    "How do I fix it with SQLAlchemy 2.0? Show me the query.",
    "Now the endpoint is fast, but a test fails: it counts queries and expects 2. Why might it see 1?",
    "Should I also add a cache in front of the search? Results change a few times an hour.",
    "Write the commit message for the query fix and the test change.",
)
QUESTIONS = (
    "How do I read a CSV file with pandas and skip the first two rows?",
    "What is the difference between a list and a tuple in Python?",
    "Write a regular expression that matches an ISO 8601 date.",
    "Why does my asyncio program hang when I call time.sleep?",
    "How do I reverse a linked list in place in C?",
    "Explain what a Python context manager is, with a short example.",
    "How can I find which process is listening on port 8080 on Linux?",
    "What does `git rebase -i HEAD~3` do?",
    "How do I make a dataclass immutable and hashable?",
    "Write a SQL query that returns the second highest salary.",
    "What is the time complexity of Python's sorted()?",
    "How do I add a timeout to a requests.get call?",
    "Explain the difference between a process and a thread.",
    "How do I debounce a function in JavaScript?",
    "Why is my Docker image 2 GB, and how do I make it smaller?",
    "How do I write a pytest fixture that creates a temporary directory?",
)


def system_prompt(route: ChatRoute, num_tokens: int, tools: list[dict]) -> str:
    """The header and the sections it takes for the system turn, tools included, to reach num_tokens."""
    text = SYSTEM_HEADER
    for section in SYSTEM_SECTIONS:
        if route.num_tokens(text, tools) >= num_tokens:
            break
        text += "\n\n" + section
    return text


def run_alone(engine: SpeculativeEngine, request: GenerationRequest) -> tuple[GenerationResult, float, float | None]:
    """Runs one request alone in the engine (`drive`, one in flight).

    Returns:
        its result, its time to first token in seconds, and its tokens/s after the first step
        that emitted (None when that step emitted them all).
    """
    traffic = drive(engine, [request], None, max_in_flight=1)
    return traffic.results[0], traffic.ttft()[0], traffic.decode_rates()[0]


def multi_turn(engine: SpeculativeEngine, route: ChatRoute, system: str, tools: list[dict], args) -> list[dict]:
    """The conversation, one turn at a time; each reply's text goes back as an assistant message."""
    messages, turns = [{"role": "system", "content": system}], []
    for user in USER_TURNS[: args.turns]:
        messages.append({"role": "user", "content": user})
        request = route.request(messages, tools, args.turn_tokens)
        result, ttft, decode_tokens_per_s = run_alone(engine, request)
        messages.append({"role": "assistant", "content": result.text})
        turns.append(
            {
                "prompt_tokens": result.prompt_tokens,
                "cached_tokens": result.cached_tokens,
                "completion_tokens": len(result.token_ids),
                "ttft_s": ttft,
                "decode_tokens_per_s": decode_tokens_per_s,
                "token_ids": result.token_ids,
            }
        )
    return turns


def run_load(engine: SpeculativeEngine, requests: list, arrivals: list[float], max_in_flight: int) -> dict:
    """Adds each request at the first step boundary after its arrival (wall clock), at most max_in_flight at once."""
    traffic = drive(engine, requests, arrivals, max_in_flight)
    done_at, results = traffic.done_at, traffic.results
    completion = [len(result.token_ids) for result in results]
    ttft = traffic.ttft()  # sent at its arrival
    decode = [rate for rate in traffic.decode_rates() if rate is not None]
    return {
        "tokens_per_s": sum(completion) / (max(done_at) - arrivals[0]),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "decode_tokens_per_s": statistics.median(decode) if decode else None,
        "makespan_s": max(done_at) - arrivals[0],
        "completion_tokens": sum(completion),
        "prompt_tokens": sum(result.prompt_tokens for result in results),
        "cached_tokens": sum(result.cached_tokens for result in results),
        "token_ids": [result.token_ids for result in results],
    }


def summarize_chat(runs: dict[str, list[list[dict]]]) -> dict:
    """Per turn: medians over the repeats; hit rate and output equality from the first repeat."""
    off, on = runs["off"], runs["on"]
    rows = []
    for i in range(len(off[0])):
        ttft_off = statistics.median(run[i]["ttft_s"] for run in off)
        ttft_on = statistics.median(run[i]["ttft_s"] for run in on)
        rows.append(
            {
                "turn": i + 1,
                "prompt_tokens": off[0][i]["prompt_tokens"],
                "cached_tokens": on[0][i]["cached_tokens"],
                "ttft_off_s": ttft_off,
                "ttft_on_s": ttft_on,
                "ratio": ttft_on / ttft_off,
                "decode_off": _median([run[i]["decode_tokens_per_s"] for run in off]),
                "decode_on": _median([run[i]["decode_tokens_per_s"] for run in on]),
                "same_output": off[0][i]["token_ids"] == on[0][i]["token_ids"],
            }
        )
    # What could have hit: everything the previous turn's prompt and completion put in the cache.
    hittable = sum(turn["prompt_tokens"] + turn["completion_tokens"] for turn in on[0][:-1])
    cached = sum(turn["cached_tokens"] for turn in on[0][1:])
    return {
        "turns": rows,
        "median_ratio_later_turns": statistics.median(row["ratio"] for row in rows[1:]) if rows[1:] else None,
        "decode_ratio": _ratio(
            _median([row["decode_on"] for row in rows]), _median([row["decode_off"] for row in rows])
        ),
        "hit_rate_later_turns": cached / hittable if hittable else None,
        "identical": all(row["same_output"] for row in rows),
        "runs": {mode: [[_without_ids(turn) for turn in run] for run in runs[mode]] for mode in MODES},
    }


def summarize_load(runs: dict[str, list[dict]]) -> dict:
    """Per mode: medians over the repeats; prompt and cached tokens from the first repeat; on/off ratios."""
    medians = {}
    for mode in MODES:
        medians[mode] = {key: _median([run[key] for run in runs[mode]]) for key in LOAD_KEYS}
        medians[mode].update({key: runs[mode][0][key] for key in ("prompt_tokens", "cached_tokens")})
    ratios = {key: _ratio(medians["on"][key], medians["off"][key]) for key in LOAD_KEYS}
    raw = {mode: [_without_ids(run) for run in runs[mode]] for mode in MODES}
    return {**medians, "ratio": ratios, "runs": raw}


def _without_ids(record: dict) -> dict:
    return {key: value for key, value in record.items() if key != "token_ids"}


def _median(values: list) -> float | None:
    values = [value for value in values if value is not None]
    return statistics.median(values) if values else None


def _ratio(on: float | None, off: float | None) -> float | None:
    return on / off if on is not None and off else None


def output_differences(pairs: list[tuple[list[int], list[int]]]) -> dict:
    """How many (off, on) greedy outputs differ, and the median index of their first differing token."""
    positions = [d for off, on in pairs if (d := first_difference(off, on)) is not None]
    return {"num_outputs": len(pairs), "num_differ": len(positions), "median_first_difference": _median(positions)}


def _count(num: int, noun: str) -> str:
    return f"{num} {noun}{'' if num == 1 else 's'}"


def markdown(report: dict) -> str:
    s, chat, load, diff = report["settings"], report["multi_turn"], report["shared_prompt"], report["differences"]
    planned = ", planned from the cost table" if s["adaptive_k"] else ""
    header = [
        f"Date: {report['date']}. Machine: {report['machine']['description']}.",
        f"Models: target {s['target']}, draft {s['draft']}, {s['dtype']}; config {s['config']} (drafter "
        f"{s['drafter']}, k {s['k']}{planned}); prefix cache {s['cache_gib']:.1f} GiB when on; "
        f"medians of {_count(s['repeats'], 'repeat')}.",
        "",
    ]
    num_turns = len(chat["turns"])
    lines = header + [
        f"**Multi-turn chat**: system prompt and {_count(s['num_tools'], 'tool')} ({s['system_prompt_tokens']} "
        f"tokens), {_count(num_turns, 'user turn')} of up to {s['turn_tokens']} new tokens, greedy, one at a time.",
        "",
        "| turn | prompt tokens | cached tokens | TTFT off (s) | TTFT on (s) | on/off "
        "| decode tokens/s off | decode tokens/s on |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in chat["turns"]:
        lines.append(
            f"| {row['turn']} | {row['prompt_tokens']} | {row['cached_tokens']} | {row['ttft_off_s']:.3f} | "
            f"{row['ttft_on_s']:.3f} | {row['ratio']:.2f}x | {fmt(row['decode_off'])} | {fmt(row['decode_on'])} |"
        )
    same = sum(row["same_output"] for row in chat["turns"])
    lines += [
        "",
        f"Turns 2-{num_turns}: median TTFT on/off {fmt(chat['median_ratio_later_turns'], '{:.2f}x')}; hit rate "
        f"{fmt(chat['hit_rate_later_turns'], '{:.1%}')} (cached tokens / the previous turn's prompt and "
        f"completion); greedy replies identical on and off: {'yes' if chat['identical'] else 'no'} "
        f"({same}/{num_turns}). Decoding after the first token, on/off: {fmt(chat['decode_ratio'], '{:.2f}x')} "
        "(median over the turns).",
        "",
        *header,
        f"**Shared system prompt under load**: {_count(s['users'], 'user')}, a {s['shared_prompt_tokens']}-token "
        f"system prompt and a question each; Poisson arrivals at {s['rate']:g} req/s (seed {s['seed']}), up to "
        f"{s['max_in_flight']} in flight; up to {s['load_tokens']} new tokens, greedy; TTFT from arrival.",
        "",
        "| cache | tokens/s | TTFT p50 (s) | TTFT p90 (s) | decode tokens/s per request | cached / prompt tokens |",
        "|---|---|---|---|---|---|",
    ]
    for mode in MODES:
        m = load[mode]
        lines.append(
            f"| {mode} | {m['tokens_per_s']:.2f} | {m['ttft_p50_s']:.3f} | {m['ttft_p90_s']:.3f} | "
            f"{fmt(m['decode_tokens_per_s'])} | {m['cached_tokens']} / {m['prompt_tokens']} |"
        )
    ratios = " | ".join(fmt(load["ratio"][key], "{:.2f}x") for key in LOAD_KEYS)
    where = f", first at token {diff['median_first_difference']:g} (median)" if diff["num_differ"] else ""
    lines += [
        f"| on/off | {ratios} | |",
        "",
        f"Greedy outputs, cache on vs off ({s['dtype']}): {diff['num_differ']} of {diff['num_outputs']} differ{where} "
        "(the chat turns and the shared-prompt requests of the first repeat; a turn after a differing reply has "
        "a different prompt).",
    ]
    return "\n".join(lines)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=str(DEFAULT_TARGET))
    parser.add_argument("--draft", default=str(DEFAULT_DRAFT))
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="model-config.yaml (default: the demo's)")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], help="overrides the config")
    parser.add_argument(
        "--cache-gib",
        type=float,
        default=0.0,
        help="the prefix cache's budget when on; 0 = the config's (automatic: a quarter of free memory)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="measures of each table; medians are reported")
    parser.add_argument("--system-tokens", type=int, default=1500, help="chat: system prompt and tools, rendered")
    parser.add_argument("--num-tools", type=int, default=len(TOOLS), choices=range(len(TOOLS) + 1))
    parser.add_argument("--turns", type=int, default=len(USER_TURNS), choices=range(1, len(USER_TURNS) + 1))
    parser.add_argument("--turn-tokens", type=int, default=48, help="chat: max_new_tokens per turn")
    parser.add_argument("--users", type=int, default=len(QUESTIONS), choices=range(1, len(QUESTIONS) + 1))
    parser.add_argument("--shared-tokens", type=int, default=1000, help="load: the shared system prompt's tokens")
    parser.add_argument("--load-tokens", type=int, default=64, help="load: max_new_tokens per request")
    parser.add_argument(
        "--rate",
        type=float,
        default=0.5,
        help="load: Poisson arrivals per second. 0.5 keeps the demo pair's batch busy on a 2-core CPU both ways: "
        "with the cache off each 1,000-token prefill takes seconds and the queue grows; with it on, 64-token "
        "answers at about 20 tokens/s for the batch (docs/continuous-batching.md) still overlap. The ratios then "
        "measure the cache, not idle time between arrivals",
    )
    parser.add_argument("--seed", type=int, default=0, help="load: the arrival schedule's seed")
    parser.add_argument("--max-in-flight", type=int, help="load: requests in the engine at once (default: batchSize)")
    parser.add_argument("--out", default="bench_results/prefix.json")
    args = parser.parse_args(argv)
    if min(args.repeats, args.turn_tokens, args.load_tokens, args.system_tokens, args.shared_tokens) < 1:
        parser.error("--repeats, --turn-tokens, --load-tokens and the prompt sizes must be at least 1")
    if args.rate <= 0 or args.cache_gib < 0:
        parser.error("--rate must be positive and --cache-gib at least 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    with open(args.config, encoding="utf-8") as f:
        raw_config = yaml.safe_load(f)
    config = handler_config_from_yaml_config(raw_config)
    overrides = {"target_model": str(pathlib.Path(args.target).resolve())}
    overrides["draft_model"] = str(pathlib.Path(args.draft).resolve())
    if args.dtype:
        overrides["dtype"] = args.dtype
    config = dataclasses.replace(config, **overrides)
    batch_size = int(raw_config.get("batchSize", 1))  # TorchServe's batch: the rows decoding together
    models = load_models(config, None)
    machine = machine_info()
    # As the handler takes it: after loading, before anything else takes memory; --cache-gib 0 is the
    # config's automatic budget.
    cache_config = dataclasses.replace(config, prefix_cache=True, prefix_cache_max_bytes=int(args.cache_gib * GIB))
    settings = engine_settings(models, cache_config)
    cache_bytes = settings.prefix_cache_max_bytes
    logger.info("machine: %s", machine["description"])
    cost_table = None
    if config.adaptive_k:  # as the handler measures it at start-up
        cost_table = measure_for_config(models, config, batch_size)

    def engine(mode: str) -> SpeculativeEngine:
        budget = cache_bytes if mode == "on" else None
        return build_engine(models, settings, cost_table=cost_table, prefix_cache_max_bytes=budget)

    route, tools = ChatRoute(config, models), TOOLS[: args.num_tools]
    system, shared = system_prompt(route, args.system_tokens, tools), system_prompt(route, args.shared_tokens, [])
    shared_turn = {"role": "system", "content": shared}
    load_requests = [
        route.request([shared_turn, {"role": "user", "content": question}], [], args.load_tokens)
        for question in QUESTIONS[: args.users]
    ]
    arrivals = poisson_arrivals(args.users, args.rate, args.seed)
    max_in_flight = args.max_in_flight or batch_size
    first_turn = [{"role": "system", "content": system}, {"role": "user", "content": USER_TURNS[0]}]
    warm_up = route.request(first_turn, tools, 4)
    for mode in MODES:
        run_alone(engine(mode), warm_up)

    chat_runs: dict[str, list] = {mode: [] for mode in MODES}
    load_runs: dict[str, list] = {mode: [] for mode in MODES}
    cache_stats = None
    for repeat in range(args.repeats):
        for mode in MODES:
            eng = engine(mode)
            chat_runs[mode].append(multi_turn(eng, route, system, tools, args))
            if mode == "on":
                cache_stats = dataclasses.asdict(eng.prefix_cache_stats)
            ttfts = [round(turn["ttft_s"], 3) for turn in chat_runs[mode][-1]]
            logger.info("repeat %d, chat, cache %s: TTFT %s", repeat, mode, ttfts)
    for repeat in range(args.repeats):
        for mode in MODES:
            load_runs[mode].append(run_load(engine(mode), load_requests, arrivals, max_in_flight))
            logger.info("repeat %d, load, cache %s: %.2f tokens/s", repeat, mode, load_runs[mode][-1]["tokens_per_s"])

    pairs = [(off["token_ids"], on["token_ids"]) for off, on in zip(chat_runs["off"][0], chat_runs["on"][0])]
    pairs += list(zip(load_runs["off"][0]["token_ids"], load_runs["on"][0]["token_ids"]))
    report = {
        "date": datetime.date.today().isoformat(),
        "machine": machine,
        "settings": {
            **{key: value for key, value in vars(args).items() if key not in ("target", "draft", "out")},
            "target": shown(args.target),
            "draft": shown(args.draft),
            "config": shown(args.config),
            "dtype": str(models.dtype).replace("torch.", ""),
            "drafter": config.drafter,
            "k": config.num_speculative_tokens,
            "adaptive_k": config.adaptive_k,
            "max_in_flight": max_in_flight,
            "cache_gib": cache_bytes / GIB,
            "system_prompt_tokens": route.num_tokens(system, tools),
            "shared_prompt_tokens": route.num_tokens(shared, []),
            "arrivals_s": arrivals,
        },
        "multi_turn": {**summarize_chat(chat_runs), "prefix_cache_stats": cache_stats},
        "shared_prompt": summarize_load(load_runs),
        "differences": output_differences(pairs),
    }
    print(markdown(report))
    print(f"wrote {write_json(pathlib.Path(args.out), report)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
