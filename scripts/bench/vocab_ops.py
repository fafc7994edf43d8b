"""What the step's reductions over a vocabulary cost: torch's own against the engine's.

A greedy step takes an argmax of every draft pass's logits and of every verified position's, and the
draft's confidence takes its likeliest other token. On a CPU, torch's `argmax` and `topk` are scalar
loops, many times slower than `amax` over the same logits; the engine's `handler.sampler.argmax_vocab`
(by blocks) and `handler.drafters.model.confidence_tensors` (an argmax with the draft's own entry
put below the rest, instead of a top two) replace them. A sampled row with top-p sorts each
position's probabilities, and a CPU's sort over a vocabulary is slower still: the engine's top-p
(`handler.sampler._apply_top_p`) reads the likeliest 256 first and sorts only the positions whose
nucleus reaches past them (a flat distribution's). A draw from a distribution (`sample_from_probs`)
sums the vocabulary in blocks and takes the cumulative sum of one block, where one float64
cumulative sum of the whole row and a scan for its last token with mass read every token
several times. This program times both on random logits of
the shapes a step reduces (rows x positions x vocabulary, in the models' dtypes), checks that they
agree index for index, and prints a table with the ratio of each.

    python -m scripts.bench.vocab_ops                          # 151,936 tokens (Qwen2.5), 1 and 16 rows
    python -m scripts.bench.vocab_ops --vocab 49152 --rows 1,4 --device cuda

Benchmarks are programs: take figures on a quiet machine, never in a test.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

PEAKED_SCALE = 8.0  # logits of N(0, 8^2): the nucleus of 0.9 holds a few dozen of 151,936 tokens


def seconds(call, repeats: int, device: torch.device) -> float:
    """Median seconds of `call` over `repeats` runs after two warm-up runs."""
    times = []
    for index in range(repeats + 2):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if index >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def top_two_other(logits: torch.Tensor, sampled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The confidence's other token as a top two finds it: the first of the top two that is not the draft."""
    probs = torch.softmax(logits.float(), dim=-1)
    top = probs.topk(2, dim=-1)
    other = torch.where(top.indices[..., :1] == sampled[..., None], 1, 0)
    return top.indices.gather(-1, other)[..., 0], top.values.gather(-1, other)[..., 0]


def sorted_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-p by one sort of every position's whole vocabulary (as on a GPU)."""
    from handler.sampler import outside_nucleus_by_sort

    remove = outside_nucleus_by_sort(logits.softmax(dim=-1), top_p[:, None, None])
    return logits.masked_fill(remove, float("-inf"))


def scanned_sample(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling by one float64 cumulative sum of each whole row, and a scan of its vocabulary
    for the last token with mass."""
    cdf = probs.double().cumsum(dim=-1)
    token_ids = torch.searchsorted(cdf, uniforms.to(cdf)[:, None] * cdf[:, -1:], right=True).squeeze(-1)
    return torch.minimum(token_ids, probs.shape[-1] - 1 - (probs > 0).flip(-1).int().argmax(dim=-1))


def measure(vocab: int, rows_list: list[int], positions_list: list[int], dtypes, repeats: int, device) -> list[dict]:
    from handler.drafters.model import confidence_tensors
    from handler.sampler import _apply_top_p, argmax_vocab, sample_from_probs

    generator = torch.Generator().manual_seed(0)
    results = []

    def compare(op: str, reference, engine, *args, **shape) -> None:
        reference_s = seconds(functools.partial(reference, *args), repeats, device)
        engine_s = seconds(functools.partial(engine, *args), repeats, device)
        results.append(dict(op=op, **shape, torch=reference_s, engine=engine_s))

    for dtype in dtypes:
        for rows in rows_list:
            for positions in positions_list:
                logits = torch.randn((rows, positions, vocab), generator=generator).to(device=device, dtype=dtype)
                shape = dict(dtype=dtype, rows=rows, positions=positions)
                assert torch.equal(argmax_vocab(logits), logits.argmax(dim=-1))
                compare("argmax", functools.partial(torch.argmax, dim=-1), argmax_vocab, logits, **shape)
                # Top-p 0.9 over a peaked distribution (its nucleus within the prefix) and a flat one (past
                # it); in float32, as the warp takes logits (bf16's ties could order a tie differently)
                top_p = torch.full((rows,), 0.9, device=device)
                for spread in ("peaked", "flat") if dtype == torch.float32 else ():
                    scaled = logits.float() * (PEAKED_SCALE if spread == "peaked" else 1.0)
                    assert torch.equal(_apply_top_p(scaled, top_p), sorted_top_p(scaled, top_p))
                    compare(f"top-p, {spread}", sorted_top_p, _apply_top_p, scaled, top_p, **shape)
                if dtype == torch.float32:  # a draw from each position's distribution (the warp's are float32)
                    probs = logits.softmax(dim=-1).flatten(0, 1)  # [rows x positions, vocab]
                    uniforms = torch.rand(rows * positions, generator=generator, dtype=torch.float64).to(device)
                    assert torch.equal(sample_from_probs(probs, uniforms), scanned_sample(probs, uniforms))
                    compare("sample", scanned_sample, sample_from_probs, probs, uniforms, **shape)
                if positions != 1:
                    continue  # the confidence is a draft pass's: one position
                sampled = argmax_vocab(logits)
                # The same probability (a tie between the top two may name the other index)
                assert torch.equal(confidence_tensors(logits, sampled)[2], top_two_other(logits, sampled)[1])
                compare("confidence", top_two_other, confidence_tensors, logits, sampled, **shape)
    return results


def table(results: list[dict]) -> str:
    lines = [
        "| reduction | dtype | rows | positions | torch, ms | engine, ms | torch / engine |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in results:
        dtype = str(row["dtype"]).removeprefix("torch.")
        lines.append(
            f"| {row['op']} | {dtype} | {row['rows']} | {row['positions']} | {row['torch'] * 1e3:.3f} "
            f"| {row['engine'] * 1e3:.3f} | {row['torch'] / row['engine']:.1f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=151_936, help="vocabulary size (default: Qwen2.5's)")
    parser.add_argument("--rows", type=lambda text: [int(x) for x in text.split(",")], default=[1, 16])
    parser.add_argument(
        "--positions", type=lambda text: [int(x) for x in text.split(",")], default=[1, 9], help="1: a draft pass"
    )
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    from scripts.bench.common import machine_info

    device = torch.device(args.device)
    dtypes = [getattr(torch, name.strip()) for name in args.dtypes.split(",")]
    results = measure(args.vocab, args.rows, args.positions, dtypes, args.repeats, device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else machine_info()["description"]
    print(f"Reductions over a {args.vocab}-token vocabulary, random logits, medians of {args.repeats} runs")
    print(where)
    print(table(results), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
