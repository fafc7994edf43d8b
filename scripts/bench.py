#!/usr/bin/env python3
"""Benchmark: plain target decoding, Hugging Face assisted generation, this engine, and TorchServe.

Everything is measured in one run on one machine, and speedups are ratios to
baselines from the same run. Outputs go to --out-dir: bench.json (every
figure), bench.md (the tables) and bench.png (tokens/s against k).

    python -m scripts.bench --target models/qwen2.5-coder-1.5b-instruct \\
        --draft models/qwen2.5-coder-0.5b-instruct --draft-quantization int8

Add --rest-url/--model/--key-file to also measure a running TorchServe
(`make demo` leaves one running), including 4 concurrent requests against 4
sent one after another.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import json
import logging
import os
import pathlib
import platform
import statistics
import sys
import time

import torch

from handler.adaptive import CostModel, expected_tokens, measure_cost_model
from handler.config import HandlerConfig, SamplingParams
from handler.engine import GenerationRequest, SpeculativeEngine
from handler.loading import load_models, quantize_draft_int8
from scripts import torchserve

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]

logger = logging.getLogger("bench")
GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=0.7, top_k=20, top_p=0.8)


@dataclasses.dataclass
class Measurement:
    """One method over a set of prompts: total tokens and seconds, plus per-prompt rates."""

    method: str
    k: int | None
    num_tokens: int
    seconds: float
    per_prompt_tokens_per_second: list[float]
    draft_tokens: int = 0
    accepted_tokens: int = 0
    rejections: int = 0
    target_passes: int = 0
    outputs: list[list[int]] = dataclasses.field(default_factory=list, repr=False)

    @property
    def tokens_per_second(self) -> float:
        return self.num_tokens / self.seconds if self.seconds else 0.0

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def per_token_acceptance(self) -> float | None:
        """Maximum-likelihood acceptance probability under the i.i.d. model of Leviathan et al."""
        trials = self.accepted_tokens + self.rejections
        return self.accepted_tokens / trials if trials else None

    @property
    def mean_accepted_length(self) -> float | None:
        return self.num_tokens / self.target_passes if self.target_passes else None

    def as_dict(self) -> dict:
        data = {k: v for k, v in dataclasses.asdict(self).items() if k != "outputs"}
        data.update(
            tokens_per_second=self.tokens_per_second,
            median_prompt_tokens_per_second=statistics.median(self.per_prompt_tokens_per_second),
            acceptance_rate=self.acceptance_rate,
            per_token_acceptance=self.per_token_acceptance,
            mean_accepted_length=self.mean_accepted_length,
        )
        return data


def timed(fn):
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


class Bench:
    def __init__(self, args) -> None:
        self.args = args
        config = HandlerConfig(
            target_model=str(pathlib.Path(args.target).resolve()),
            draft_model=str(pathlib.Path(args.draft).resolve()),
            dtype=args.dtype,
        )
        self.models = load_models(config, None)
        self.target, self.draft, self.tokenizer = self.models.target, self.models.draft, self.models.tokenizer
        # Hugging Face assisted generation gets the draft as published; the engine may get a cheaper copy.
        self.engine_draft = self.draft
        if args.draft_quantization == "int8":
            self.engine_draft = quantize_draft_int8(_copy_model(self.draft))
        self.max_new_tokens = args.max_new_tokens

    def engine(self, cost_table: CostModel | None = None) -> SpeculativeEngine:
        return SpeculativeEngine(
            self.target,
            self.engine_draft,
            self.tokenizer,
            self.models.eos_token_ids,
            self.models.pad_token_id,
            cost_table=cost_table,
        )

    def encode(self, prompts: list[dict]) -> list[tuple[int, ...]]:
        encoded = []
        for prompt in prompts:
            text = self.tokenizer.apply_chat_template(prompt["messages"], tokenize=False, add_generation_prompt=True)
            encoded.append(tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"]))
        return encoded

    def hf_generate(self, prompt_ids, max_new_tokens, assistant=None, sampling=GREEDY, seed=0):
        input_ids = torch.tensor([prompt_ids], device=self.models.device)
        kwargs = dict(
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            eos_token_id=list(self.models.eos_token_ids),
            pad_token_id=self.models.pad_token_id,
        )
        if sampling.is_greedy:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        else:
            torch.manual_seed(seed)
            kwargs.update(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
        if assistant is not None:
            kwargs["assistant_model"] = self.draft
            config = self.draft.generation_config
            config.num_assistant_tokens = assistant["num_assistant_tokens"]
            config.num_assistant_tokens_schedule = assistant["schedule"]
            config.assistant_confidence_threshold = assistant["confidence_threshold"]
            if self.draft.config.vocab_size != self.target.config.vocab_size:
                # Transformers then insists on universal assisted decoding, which needs both tokenizers.
                kwargs.update(tokenizer=self.tokenizer, assistant_tokenizer=self.tokenizer)
        with torch.inference_mode():
            output = self.target.generate(input_ids, **kwargs)
        return output[0, len(prompt_ids) :].tolist()

    def measure_hf(self, name, prompts_ids, max_new_tokens, assistant=None, sampling=GREEDY, k=None):
        self.hf_generate(prompts_ids[0], 4, assistant, sampling)  # warm-up
        num_tokens, seconds, rates, outputs = 0, 0.0, [], []
        for i, prompt_ids in enumerate(prompts_ids):
            tokens, elapsed = timed(
                lambda p=prompt_ids, seed=i: self.hf_generate(p, max_new_tokens, assistant, sampling, seed=seed)
            )
            tokens = _trim_at_eos(tokens, self.models.eos_token_ids)
            num_tokens += len(tokens)
            seconds += elapsed
            rates.append(len(tokens) / elapsed)
            outputs.append(tokens)
        return Measurement(name, k, num_tokens, seconds, rates, outputs=outputs)

    def measure_engine(self, name, prompts_ids, max_new_tokens, k, sampling=GREEDY, cost_table=None):
        engine = self.engine(cost_table)
        engine.generate([GenerationRequest(prompts_ids[0], 4, sampling, k, seed=0)])  # warm-up
        m = Measurement(name, k, 0, 0.0, [])
        for i, prompt_ids in enumerate(prompts_ids):
            request = GenerationRequest(prompt_ids, max_new_tokens, sampling, k, seed=i)
            result, elapsed = timed(lambda r=request: engine.generate([r])[0])
            stats = result.stats
            m.num_tokens += len(result.token_ids)
            m.seconds += elapsed
            m.per_prompt_tokens_per_second.append(len(result.token_ids) / elapsed)
            m.draft_tokens += stats.draft_tokens
            m.accepted_tokens += stats.accepted_tokens
            m.rejections += stats.rejections
            m.target_passes += stats.target_forward_passes
            m.outputs.append(result.token_ids)
        return m


def _copy_model(model):
    import copy

    return copy.deepcopy(model)


def _trim_at_eos(tokens: list[int], eos_token_ids) -> list[int]:
    for i, token in enumerate(tokens):
        if token in eos_token_ids:
            return tokens[: i + 1]
    return tokens


def measure_rest(args, prompts: list[dict]) -> dict:
    """Tokens/s through a running TorchServe: sequential requests, then 4 at once."""
    key_file = pathlib.Path(args.key_file) if args.key_file else None
    headers = torchserve.auth_headers(key_file)

    def post(prompt):
        body = {"messages": prompt["messages"], "max_new_tokens": args.max_new_tokens, "temperature": 0}
        answer = torchserve.generate(args.rest_url, args.model, body, headers, key_file, args.rest_timeout)
        return answer.final, answer.elapsed_s

    post(prompts[0])  # warm-up
    answers = [post(p) for p in prompts]
    tokens = sum(a["usage"]["completion_tokens"] for a, _ in answers)
    seconds = sum(t for _, t in answers)
    sequential = {
        "num_tokens": tokens,
        "seconds": seconds,
        "tokens_per_second": tokens / seconds,
        "median_prompt_tokens_per_second": statistics.median(a["usage"]["completion_tokens"] / t for a, t in answers),
        "acceptance_rate": sum(a["speculative"]["accepted_tokens"] for a, _ in answers)
        / max(1, sum(a["speculative"]["draft_tokens"] for a, _ in answers)),
        "mean_accepted_length": tokens / max(1, sum(a["speculative"]["target_forward_passes"] for a, _ in answers)),
        "outputs": [a["token_ids"] for a, _ in answers],
    }
    four = prompts[:4]
    (one_by_one, sequential_seconds) = timed(lambda: [post(p) for p in four])
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        (together, concurrent_seconds) = timed(lambda: list(pool.map(post, four)))
    batch = {
        "sequential_tokens_per_second": sum(a["usage"]["completion_tokens"] for a, _ in one_by_one)
        / sequential_seconds,
        "concurrent_tokens_per_second": sum(a["usage"]["completion_tokens"] for a, _ in together) / concurrent_seconds,
    }
    batch["ratio"] = batch["concurrent_tokens_per_second"] / batch["sequential_tokens_per_second"]
    return {"sequential": sequential, "batch_of_4": batch}


def rest_summary(rest: dict) -> str:
    sequential, batch = rest["sequential"], rest["batch_of_4"]
    return (
        f"{sequential['tokens_per_second']:.2f} tokens/s sequentially (median per prompt "
        f"{sequential['median_prompt_tokens_per_second']:.2f}, acceptance {sequential['acceptance_rate']:.2f}, "
        f"{sequential['mean_accepted_length']:.2f} tokens/pass); 4 concurrent requests with batchSize 4: "
        f"{batch['concurrent_tokens_per_second']:.2f} tokens/s aggregate vs "
        f"{batch['sequential_tokens_per_second']:.2f} one after another ({batch['ratio']:.2f}x)."
    )


def predicted_speedup(m: Measurement, c: float) -> float | None:
    """E / (k c + 1) with E from the measured per-token acceptance and k the mean drafts per step."""
    a = m.per_token_acceptance
    if a is None or not m.target_passes:
        return None
    k = m.draft_tokens / m.target_passes
    whole_k = max(1, round(k))
    return expected_tokens(a, whole_k) / (k * c + 1)


def machine_description() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} (CUDA), host {cpu}"
    return f"{cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"


def markdown(report: dict) -> str:
    lines = [
        f"Date: {report['date']}. Machine: {report['machine']}. torch {report['torch']}.",
        f"Target: {report['target']}; draft: {report['draft']} ({report['draft_quantization']} for this engine); "
        f"dtype {report['dtype']}.",
        f"{report['num_prompts']} prompts, up to {report['max_new_tokens']} new tokens, greedy unless noted. "
        "Tokens/s = all generated tokens / all seconds, one run per prompt after a warm-up; "
        "the median per-prompt rate is also given.",
        f"Draft/target cost ratio c = {report['cost']['c']:.3f} (draft pass {report['cost']['draft_ms']:.1f} ms, "
        f"target pass {report['cost']['target_ms']:.1f} ms).",
        "",
        "| method | k | tokens/s | median/prompt | vs target-only | vs HF assisted | acceptance | tokens/pass "
        "| predicted E/(kc+1) | measured/predicted |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["main"]:
        lines.append(
            "| {method} | {k} | {tps:.2f} | {med:.2f} | {vt:.2f}x | {vh} | {acc} | {mal} | {pred} | {ratio} |".format(
                method=row["method"],
                k="-" if row["k"] is None else row["k"],
                tps=row["tokens_per_second"],
                med=row["median_prompt_tokens_per_second"],
                vt=row["speedup_vs_target"],
                vh="-" if row.get("speedup_vs_hf_assisted") is None else f"{row['speedup_vs_hf_assisted']:.2f}x",
                acc="-" if row["acceptance_rate"] is None else f"{row['acceptance_rate']:.2f}",
                mal="-" if row["mean_accepted_length"] is None else f"{row['mean_accepted_length']:.2f}",
                pred="-" if row.get("predicted_speedup") is None else f"{row['predicted_speedup']:.2f}x",
                ratio="-" if row.get("measured_over_predicted") is None else f"{row['measured_over_predicted']:.2f}",
            )
        )
    if report.get("sampled"):
        s = report["sampled"]
        lines += [
            "",
            f"Sampled (temperature {SAMPLED.temperature}, top_k {SAMPLED.top_k}, top_p {SAMPLED.top_p}): "
            f"target-only {s['target_only']:.2f} tokens/s, this engine {s['engine']:.2f} tokens/s "
            f"({s['engine'] / s['target_only']:.2f}x), acceptance {s['acceptance_rate']:.2f}.",
        ]
    lines += [
        "",
        "K sweep (" + report["sweep_note"] + "):",
        "",
        "| k | this engine tokens/s | acceptance | HF assisted (constant k) tokens/s |",
        "|---|---|---|---|",
    ]
    for row in report["sweep"]:
        lines.append(
            f"| {row['k']} | {row['engine_tokens_per_second']:.2f} | {row['engine_acceptance_rate']:.2f} | "
            f"{row['hf_tokens_per_second']:.2f} |"
        )
    if report.get("rest"):
        lines += ["", "Through TorchServe over REST: " + rest_summary(report["rest"])]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = [row["k"] for row in report["sweep"]]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(ks, [row["engine_tokens_per_second"] for row in report["sweep"]], "o-", label="this engine (fixed k)")
    ax.plot(ks, [row["hf_tokens_per_second"] for row in report["sweep"]], "s-", label="HF assisted (constant k)")
    ax.axhline(report["sweep_target_only"], color="gray", linestyle="--", label="target only")
    ax.set_xlabel("k (draft tokens per step)")
    ax.set_ylabel("tokens/s")
    ax.set_title(f"{pathlib.Path(report['target']).name} + {pathlib.Path(report['draft']).name}, {report['date']}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft", required=True)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--draft-quantization", default="none", choices=["none", "int8"])
    parser.add_argument("--prompts", default=str(REPO_ROOT / "scripts" / "bench_prompts.json"))
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4, help="k for the main table's fixed-k rows")
    parser.add_argument("--sweep-ks", default="1,2,3,4,5,6,8")
    parser.add_argument("--sweep-prompts", type=int, default=3)
    parser.add_argument("--sweep-max-new-tokens", type=int, default=64)
    parser.add_argument("--skip-sampled", action="store_true")
    parser.add_argument("--rest-url", help="a running TorchServe's inference URL, e.g. http://127.0.0.1:8080")
    parser.add_argument("--model", default="qwen-coder-spec", help="the model name registered in TorchServe")
    parser.add_argument("--key-file", default="key_file.json")
    parser.add_argument("--rest-timeout", type=float, default=900)
    parser.add_argument("--rest-only", action="store_true", help="measure only the running TorchServe")
    parser.add_argument("--out-dir", default="bench_results")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    with open(args.prompts) as f:
        prompts = json.load(f)[: args.num_prompts]
    if args.rest_only:
        if not args.rest_url:
            parser.error("--rest-only needs --rest-url")
        return rest_only(args, prompts)
    bench = Bench(args)
    prompts_ids = bench.encode(prompts)
    sweep_ids = prompts_ids[: args.sweep_prompts]
    sweep_ks = [int(k) for k in args.sweep_ks.split(",")]
    cost = measure_cost_model(bench.target, bench.engine_draft, args.k)
    c = cost.draft_target_ratio
    logger.info("cost model: %s, c = %.3f", cost, c)

    # K sweep on a subset: picks HF assisted's best setting and shows the engine's curve.
    logger.info("K sweep on %d prompts x %d tokens", len(sweep_ids), args.sweep_max_new_tokens)
    sweep_target = bench.measure_hf("target-only", sweep_ids, args.sweep_max_new_tokens)
    sweep, hf_candidates = [], []
    for k in sweep_ks:
        ours = bench.measure_engine("engine", sweep_ids, args.sweep_max_new_tokens, k)
        assistant = {"num_assistant_tokens": k, "schedule": "constant", "confidence_threshold": 0.0}
        theirs = bench.measure_hf("hf", sweep_ids, args.sweep_max_new_tokens, assistant, k=k)
        hf_candidates.append((theirs.tokens_per_second, assistant))
        sweep.append(
            {
                "k": k,
                "engine_tokens_per_second": ours.tokens_per_second,
                "engine_acceptance_rate": ours.acceptance_rate or 0.0,
                "hf_tokens_per_second": theirs.tokens_per_second,
            }
        )
        logger.info(
            "k=%d engine %.2f tok/s (acc %.2f), HF %.2f tok/s",
            k,
            ours.tokens_per_second,
            ours.acceptance_rate or 0,
            theirs.tokens_per_second,
        )
    for schedule in (
        {"num_assistant_tokens": 20, "schedule": "constant", "confidence_threshold": 0.4},
        {"num_assistant_tokens": 5, "schedule": "heuristic_transient", "confidence_threshold": 0.4},
    ):
        theirs = bench.measure_hf("hf", sweep_ids, args.sweep_max_new_tokens, schedule)
        hf_candidates.append((theirs.tokens_per_second, schedule))
        logger.info("HF %s: %.2f tok/s", schedule, theirs.tokens_per_second)
    best_hf = max(hf_candidates, key=lambda item: item[0])[1]
    best_k = max(sweep, key=lambda row: row["engine_tokens_per_second"])["k"]
    logger.info("best HF assisted setting on the sweep: %s; best fixed k for the engine: %d", best_hf, best_k)

    logger.info("main table on %d prompts x %d tokens", len(prompts_ids), args.max_new_tokens)
    target_only = bench.measure_hf("HF generate, target only", prompts_ids, args.max_new_tokens)
    hf_name = (
        f"HF assisted ({best_hf['schedule']}, num_assistant_tokens={best_hf['num_assistant_tokens']}, "
        f"confidence_threshold={best_hf['confidence_threshold']})"
    )
    hf_assisted = bench.measure_hf(hf_name, prompts_ids, args.max_new_tokens, best_hf)
    engine_k0 = bench.measure_engine("this engine, k=0 (plain decoding)", prompts_ids, args.max_new_tokens, 0)
    engine_fixed = bench.measure_engine(f"this engine, fixed k={best_k}", prompts_ids, args.max_new_tokens, best_k)
    engine_adaptive = bench.measure_engine(
        f"this engine, adaptive k<={max(sweep_ks)}",
        prompts_ids,
        args.max_new_tokens,
        max(sweep_ks),
        cost_table=cost,
    )
    measurements = [target_only, hf_assisted, engine_k0, engine_fixed, engine_adaptive]
    # Greedy speculative output is the target's own output: check it here too, on the real pair.
    mismatches = sum(a != b for a, b in zip(engine_fixed.outputs, engine_k0.outputs))
    rows = []
    for m in measurements:
        row = m.as_dict()
        row["speedup_vs_target"] = m.tokens_per_second / target_only.tokens_per_second
        row["speedup_vs_hf_assisted"] = (
            m.tokens_per_second / hf_assisted.tokens_per_second if m.method.startswith("this engine") else None
        )
        if m.draft_tokens:
            predicted = predicted_speedup(m, c)
            row["predicted_speedup"] = predicted
            # Against the engine's own plain decoding, the baseline the formula assumes.
            row["measured_over_predicted"] = (m.tokens_per_second / engine_k0.tokens_per_second) / predicted
        rows.append(row)

    sampled = None
    if not args.skip_sampled:
        logger.info("sampled setting on the sweep prompts")
        s_target = bench.measure_hf("target-only sampled", sweep_ids, args.sweep_max_new_tokens, sampling=SAMPLED)
        s_engine = bench.measure_engine("engine sampled", sweep_ids, args.sweep_max_new_tokens, best_k, SAMPLED)
        sampled = {
            "target_only": s_target.tokens_per_second,
            "engine": s_engine.tokens_per_second,
            "acceptance_rate": s_engine.acceptance_rate or 0.0,
        }

    rest = measure_rest(args, prompts) if args.rest_url else None
    report = {
        "date": datetime.date.today().isoformat(),
        "machine": machine_description(),
        "torch": torch.__version__,
        "target": args.target,
        "draft": args.draft,
        "dtype": str(bench.models.dtype).replace("torch.", ""),
        "draft_quantization": args.draft_quantization,
        "num_prompts": len(prompts_ids),
        "max_new_tokens": args.max_new_tokens,
        "cost": {
            "c": c,
            "draft_ms": cost.draft_step * 1e3,
            "target_ms": cost.target_step * 1e3,
            "target_extra_token_ms": cost.target_per_extra_token * 1e3,
        },
        "greedy_outputs_differing_from_plain_decoding": mismatches,
        "main": rows,
        "sampled": sampled,
        "sweep": sweep,
        "sweep_target_only": sweep_target.tokens_per_second,
        "sweep_note": f"{len(sweep_ids)} prompts x {args.sweep_max_new_tokens} tokens; "
        f"target only {sweep_target.tokens_per_second:.2f} tokens/s",
        "best_hf_assisted": best_hf,
        "rest": rest,
    }
    out = pathlib.Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(report, indent=2))
    table = markdown(report)
    (out / "bench.md").write_text(table)
    plot(report, out / "bench.png")
    print(table)
    print(f"greedy outputs differing from plain decoding: {mismatches} of {len(prompts_ids)}")
    print(f"wrote {out / 'bench.json'}, {out / 'bench.md'}, {out / 'bench.png'}")
    return 0


def rest_only(args, prompts: list[dict]) -> int:
    rest = measure_rest(args, prompts)
    report = {
        "date": datetime.date.today().isoformat(),
        "machine": machine_description(),
        "model": args.model,
        "rest": rest,
    }
    out = pathlib.Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_rest.json").write_text(json.dumps(report, indent=2))
    print(f"TorchServe {args.model}: {rest_summary(rest)}")
    print(f"wrote {out / 'bench_rest.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
