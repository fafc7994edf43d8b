"""Benchmark: the draft's prefill of joining rows, by its int8 form against its float form, beside the
target's prefill of the same rows (the plain engine's admission).

A row that drafts with the model costs its admission the draft's prefill on top of the target's. A
prefill is bound by arithmetic, not by reading the weights: where the CPU has bf16 matrix units the
int8 form's dynamic quantization (its activations quantized at every pass) prefills at about half the
float form's speed, so that `draft_quantization: auto` keeps the float form beside an int8 draft for
its prefills where start-up measures it faster (`handler.runtime.cpu_speed.choose_draft_quantization`;
the float form's KV is cast to the int8 form's, counted here).

For each shape (rows x prompt tokens, random ids, no prefix cache) the three prefills run in turn,
the order rotating each repeat; medians. The table gives each one's ms, the draft's seconds a token
in each form, the float form's speed-up, and a drafting admission's prefills against a plain one's:
(target + draft) / target, with each form.

    python -m scripts.bench.draft_fills                     # the demo pair, model-config/qwen-coder.yaml
    python -m scripts.bench.draft_fills --shapes 1x45,8x300 --repeats 3

Benchmarks are programs: take figures on a quiet machine, never in a test.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import logging
import statistics
import sys
import time

import torch

from handler.caches.kv_cache import prefill
from handler.runtime.cpu_speed import quantize_draft_int8
from handler.runtime.loading import load_models
from scripts.bench import common as bench_common
from scripts.bench import runner as bench_runner
from scripts.bench.common import machine_info

logger = logging.getLogger(__name__)

DEFAULT_SHAPES = "1x45,8x45,16x45,1x300,8x300"
FORMS = ("target", "draft int8", "draft float")


def parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for part in text.split(","):
        rows, _, tokens = part.strip().partition("x")
        if not (rows.isdigit() and tokens.isdigit() and int(rows) > 0 and int(tokens) > 1):
            raise ValueError(f"a shape is ROWSxTOKENS, both positive, tokens at least 2: {part!r}")
        shapes.append((int(rows), int(tokens)))
    return shapes


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=bench_common.DEFAULT_TARGET)
    parser.add_argument("--draft", default=bench_common.DEFAULT_DRAFT)
    parser.add_argument("--config", default=bench_common.DEFAULT_CONFIG)
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"))
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="rows x prompt tokens, comma-separated")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per shape, after one warm-up")
    args = parser.parse_args(argv)
    try:
        args.shapes = parse_shapes(args.shapes)
    except ValueError as error:
        parser.error(str(error))
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    args.draft_quantization = "none"  # the float draft as it loads; its int8 form is made here
    return args


def prefill_seconds(model, int8_form, prompts: list[list[int]]) -> float:
    """One prefill of `prompts` by `model`; a float draft's KV then cast to its int8 form's, as a fill does."""
    started = time.perf_counter()
    cache = prefill(model, prompts, 0)
    if int8_form is not None:
        cache.hand_to(int8_form)
    return time.perf_counter() - started


def measure(models, int8_draft, shapes: list[tuple[int, int]], repeats: int) -> list[dict]:
    """Per shape, each form's median seconds over `repeats` rounds (the order rotating)."""
    # Ids both models read (a draft's embedding may hold fewer rows than the target's).
    vocab_size = min(model.get_input_embeddings().num_embeddings for model in (models.target, models.draft))
    generator = torch.Generator().manual_seed(0)
    calls = {
        "target": lambda prompts: prefill_seconds(models.target, None, prompts),
        "draft int8": lambda prompts: prefill_seconds(int8_draft, None, prompts),
        "draft float": lambda prompts: prefill_seconds(models.draft, int8_draft, prompts),
    }
    results = []
    with torch.inference_mode():
        for rows, tokens in shapes:
            prompts = [torch.randint(0, vocab_size, (tokens,), generator=generator).tolist() for _ in range(rows)]
            seconds = {form: [] for form in FORMS}
            for round_ in range(repeats + 1):
                order = FORMS[round_ % len(FORMS) :] + FORMS[: round_ % len(FORMS)]
                for form in order:
                    taken = calls[form](prompts)
                    if round_:  # the first round warms up
                        seconds[form].append(taken)
            medians = {form: statistics.median(values) for form, values in seconds.items()}
            logger.info("%d x %d: %s", rows, tokens, ", ".join(f"{f} {s * 1e3:.0f} ms" for f, s in medians.items()))
            results.append({"rows": rows, "tokens": tokens, **medians})
    return results


def table(results: list[dict]) -> str:
    lines = [
        "| rows x tokens | target ms | draft int8 ms | draft float ms | draft ms a token, int8 / float "
        "| float vs int8 | drafting admission vs plain, int8 / float |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        num = r["rows"] * r["tokens"]
        target, int8, float_ = r["target"], r["draft int8"], r["draft float"]
        lines.append(
            f"| {r['rows']} x {r['tokens']} | {target * 1e3:.0f} | {int8 * 1e3:.0f} | {float_ * 1e3:.0f} "
            f"| {int8 / num * 1e3:.2f} / {float_ / num * 1e3:.2f} | {int8 / float_:.2f}x "
            f"| {(target + int8) / target:.2f}x / {(target + float_) / target:.2f}x |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    config = bench_runner.bench_config(args)
    models = load_models(dataclasses.replace(config, draft_quantization="none"), None)
    if models.draft is None or models.device.type != "cpu":
        print("draft_fills compares a draft's int8 and float prefills on a CPU: it needs a draft model, on the CPU")
        return 2
    int8_draft = quantize_draft_int8(copy.deepcopy(models.draft))
    machine = machine_info()
    results = measure(models, int8_draft, args.shapes, args.repeats)
    dtype = str(models.dtype).replace("torch.", "")
    print(f"\nMachine: {machine['description']}")
    print(
        f"Target {bench_common.shown(args.target)}, draft {bench_common.shown(args.draft)}, {dtype} "
        f"(the draft's float form; its int8 form dynamic); random prompt ids, no prefix cache; "
        f"medians of {args.repeats} rounds, the order rotating. The float form's time includes its KV's cast."
    )
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
