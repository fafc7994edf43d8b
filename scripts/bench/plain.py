"""Benchmark: this engine's plain decoding (k = 0) against Hugging Face `generate`, in pairs.

Plain decoding is the floor under every speculative step: the engine's own
work per pass (its ragged cache, masks, sampling and bookkeeping) is paid at
every k. On a shared machine two rows timed minutes apart differ by more than
the few percent in question, so this program times the two back to back on
the same prompt, alternating which goes first, and reports the median of the
per-pair ratios beside each side's median tokens/s.

Both sides run the same loaded target (packed as the engine loads it), greedy,
with no prefix cache; each call is timed whole, prefill included. Outputs are
compared: in bfloat16 a near-tie may flip a token (docs/benchmark.md).

    python -m scripts.bench.plain                    # the demo pair's target, model-config/qwen-coder.yaml
    python -m scripts.bench.plain --pairs 4 --max-new-tokens 32
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import pathlib
import statistics
import sys
import time

from handler.drafters import NGRAM
from handler.runtime.loading import load_models
from scripts.bench import common as bench_common
from scripts.bench import runner as bench_runner
from scripts.bench.common import machine_info

logger = logging.getLogger(__name__)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=bench_common.DEFAULT_TARGET)
    parser.add_argument("--config", default=bench_common.DEFAULT_CONFIG)
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"))
    parser.add_argument("--prompts", default=str(bench_common.REPO_ROOT / "scripts" / "bench" / "prompts.json"))
    parser.add_argument("--num-prompts", type=int, default=3, help="held-out prompts per set")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--pairs", type=int, default=6, help="timed pairs per prompt, after one warm-up pair")
    args = parser.parse_args(argv)
    if args.pairs < 1 or args.num_prompts < 1 or args.max_new_tokens < 1:
        parser.error("--pairs, --num-prompts and --max-new-tokens must be at least 1")
    args.draft, args.draft_quantization = bench_common.DEFAULT_DRAFT, None  # for bench_config; no draft is loaded
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    # Plain decoding needs no draft: neither loaded nor timed for its quantization.
    config = dataclasses.replace(bench_runner.bench_config(args), draft_model=None, drafter=NGRAM)
    models = load_models(config, None)
    machine = machine_info()
    runner = bench_runner.Runner(models, config, cost_table=None)
    sets = bench_common.load_prompt_sets(pathlib.Path(args.prompts), args.num_prompts, 1)
    prompts = [runner.encode(prompt) for prompt_set in sets.values() for prompt in prompt_set["held_out"]]
    methods = {"engine": bench_runner.engine_method("engine_k0", NGRAM, 0, False), "hf": bench_runner.hf_target_only()}
    rates = {name: [] for name in methods}
    ratios, same, started = [], 0, time.perf_counter()
    for index, prompt_ids in enumerate(prompts):
        for pair in range(args.pairs + 1):
            order = ("engine", "hf") if pair % 2 == 0 else ("hf", "engine")
            runs = {name: runner.run(methods[name], [prompt_ids], args.max_new_tokens) for name in order}
            if pair == 0:
                same += runs["engine"].outputs == runs["hf"].outputs
                continue  # the warm-up pair
            rate = {name: run.num_tokens / run.seconds for name, run in runs.items()}
            for name in methods:
                rates[name].append(rate[name])
            ratios.append(rate["engine"] / rate["hf"])
            logger.info("prompt %d pair %d: engine %.2f, HF %.2f tokens/s", index, pair, rate["engine"], rate["hf"])
    print(f"\nMachine: {machine['description']}")
    dtype = str(models.dtype).replace("torch.", "")
    print(f"Target {bench_common.shown(args.target)}, {dtype}; {len(prompts)} prompts (open and grounded")
    print(f"held-out sets), {args.max_new_tokens} new tokens, greedy; {args.pairs} timed pairs per prompt, order")
    print(f"alternating; wall time {(time.perf_counter() - started) / 60:.1f} min.\n")
    print("| row | tokens/s, median (min-max) |\n|---|---|")
    for name, label in (("hf", "HF `generate`, target only"), ("engine", "this engine, k=0")):
        values = rates[name]
        print(f"| {label} | {statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f}) |")
    print(
        f"\nengine / HF per pair: median {statistics.median(ratios):.3f}x "
        f"(min {min(ratios):.3f}x, max {max(ratios):.3f}x, {len(ratios)} pairs); "
        f"same greedy output on {same}/{len(prompts)} prompts"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
