"""The GPU check: the CUDA tests, then the runners timed on random-weight models of real shapes.

    python -m scripts.bench.gpu_check OUT_DIR              # on a CUDA machine: Qwen2.5 0.5B / 1.5B / 7B shapes
    python -m scripts.bench.gpu_check OUT_DIR --device cpu # tiny shapes, to check the script itself

Timing does not depend on weight values, so the models are built from configs with
random weights (nothing is downloaded): a Qwen2.5-0.5B-shaped draft and 1.5B- and
7B-shaped targets, in bf16 on CUDA. It writes `gpu_check.json` and `gpu_check.md`
to OUT_DIR, section by section, so a run cut short keeps what it measured:

1. the CUDA tests (`pytest tests/cuda`), their summary line;
2. per-pass times, eager (dynamic runner) against CUDA graphs (static runner), and
   c, the draft's pass over the target's, both ways;
3. the target's verify cost by width 1..17 (batch 1) and by batch 1..16 (width 5), with graphs;
4. the engine: draft = target (every draft accepted), fixed k, against target-only
   decoding in the same engine and HF `generate`; its own time per step (step wall
   time minus the model passes) against the target's verify pass;
5. HF assisted generation on the same models (draft = target, and the 0.5B draft);
6. the predicted speedup E/(kc+1) at the acceptance the real pair shows on the CPU,
   chains against chain-with-siblings trees, from the measured verify costs;
7. (`--sections load`) the load benchmark, `scripts.bench.load`, on the 1.5B target
   and the 0.5B draft saved to a temporary folder: the shipped config (its planner
   and a cost table measured at start on this device) against plain decoding and a
   fixed k = 2, closed loop at C 1..16 and Poisson arrivals. Its load.md, load.json
   and load.png go to OUT_DIR/load. `--sections load-fp32` runs it in float32 (C 1, 4
   and 16), where every row's outputs must equal plain decoding's: OUT_DIR/load-fp32.

`--sections replay` replays the real pair's recorded acceptance (`scripts.bench.replay`): the 0.5B draft for
the 1.5B target (the recorded pair's shapes) and for the 7B, every trace set, C 1, 4 and 16, plain against
the model drafter at the trace's k, the planner and free drafts; the one section whose speedups are a
real pair's (its accept lengths, this GPU's costs).

`--sections serve` runs `scripts.serving.serve_pair` first, on its own (OUT_DIR/serve): the tiny pair in
float32 and the 0.5B -> 1.5B and 0.5B -> 7B shapes in bf16 served by a real TorchServe, every route,
workers scaled, greedy REST against `generate`, and REST's tokens/s against the same engine in-process.

Random weights make the 0.5B draft and the targets disagree, so the rows with the
0.5B draft measure how each method behaves when drafts are rejected, not a real pair's speedup
(but for `replay`, which replays a real pair's accept lengths).
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import json
import logging
import os
import pathlib
import platform
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

import torch

from handler import runners
from handler.config import SamplingParams
from handler.engine import EngineOptions, GenerationRequest, SpeculativeEngine, build_engine
from handler.planning.pricing import chain_expected_tokens
from handler.runners.static import StaticRunner
from handler.runtime.loading import LoadedModels

logger = logging.getLogger("gpu_check")

# The real demo pair's per-draft acceptance on the CPU: the model drafter at fixed k=3 on the open
# set accepted 0.64 of its drafts (docs/benchmark.md, open set, 2026-11-20 run).
CPU_ACCEPTANCE = 0.64
# Chain-with-siblings trees: the share of the rejected mass a draft's runner-up takes. The CPU runs
# did not measure it; the table gives the tree's gain for each of these.
RUNNER_UP_SHARES = (0.2, 0.4)

# The 0.5B and 1.5B vocabulary. The real 7B's is 152064 (a padded LM head, 0.08% larger); one
# vocabulary lets HF assisted generation pair any two of these without tokenizers.
QWEN_VOCAB = 151936
SHAPES: dict[str, dict[str, Any]] = {
    "0.5B": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=QWEN_VOCAB, tie_word_embeddings=True),
    "1.5B": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=QWEN_VOCAB, tie_word_embeddings=True),
    "7B": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=QWEN_VOCAB, tie_word_embeddings=False),
}  # fmt: skip
TINY_SHAPES: dict[str, dict[str, Any]] = {
    name: dict(hidden_size=64 * scale, intermediate_size=128 * scale, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=384, tie_word_embeddings=False)
    for name, scale in (("0.5B", 1), ("1.5B", 2), ("7B", 3))
}  # fmt: skip


def build_model(shape: dict[str, Any], device: torch.device, dtype: torch.dtype):
    """A Qwen2 causal LM of `shape` with random weights, on `device`."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(max_position_embeddings=32768, rope_theta=1_000_000.0, **shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def pass_seconds(model, kind: str, batch_size: int, width: int, context: int, repeats: int) -> float:
    return runners.time_runner_pass(runners.make_runner(kind, model), batch_size, width, context, repeats)


class PassClock:
    """Sums the seconds spent in the model passes of every runner (a synchronisation around each)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds = 0.0
        self.patched: list[tuple[object, str, Callable]] = []

    def __enter__(self) -> PassClock:
        from handler.caches.kv_cache import RaggedCache

        for owner, name in ((StaticRunner, "run"), (RaggedCache, "_run")):
            original = getattr(owner, name)

            def timed(*args, _original=original, **kwargs):
                runners.synchronize(self.device)
                start = time.perf_counter()
                result = _original(*args, **kwargs)
                runners.synchronize(self.device)
                self.seconds += time.perf_counter() - start
                return result

            setattr(owner, name, timed)
            self.patched.append((owner, name, original))
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original in self.patched:
            setattr(owner, name, original)


def engine_run(engine: SpeculativeEngine, prompt_ids: list[int], max_new_tokens: int, k: int) -> dict[str, float]:
    """One request to completion, step by step: tokens/s, steps, accepted drafts per step."""
    device = engine.device
    engine.add_request("r", GenerationRequest(tuple(prompt_ids), max_new_tokens, SamplingParams(), k))
    runners.synchronize(device)
    start = time.perf_counter()
    num_steps, result = 0, None
    while result is None:
        for output in engine.step():
            result = output.result or result
        num_steps += 1
    runners.synchronize(device)
    seconds = time.perf_counter() - start
    return {
        "tokens_per_s": len(result.token_ids) / seconds,
        "steps": num_steps,
        "seconds": seconds,
        "tokens_per_step": len(result.token_ids) / num_steps,
        "acceptance": result.stats.accepted_tokens / max(1, result.stats.draft_tokens),
    }


def text_tokenizer():
    """The tiny pair's tokenizer: the engine decodes each result's text (ids it lacks decode to
    nothing), and no tokenizer of the real models can be fetched here."""
    from transformers import AutoTokenizer

    from scripts.model_tools.make_tiny_models import save_tokenizer

    folder = tempfile.mkdtemp(prefix="gpu-check-tokenizer-")
    save_tokenizer(pathlib.Path(folder))
    return AutoTokenizer.from_pretrained(folder)


def make_engine(
    target, draft, tokenizer, runner: str, vocab_map=None, cross_vocab_greedy: str = "slem", overlap: bool | None = None
) -> SpeculativeEngine:
    """Drafts its fixed k (no cost table), chains only, no stop token: every step the same shape.
    `overlap`: `EngineOptions.overlap_plain_steps` (None: the device's default, on for CUDA)."""
    models = LoadedModels.of(target, draft, tokenizer, eos_token_ids=(), pad_token_id=0, vocab_map=vocab_map)
    return build_engine(
        models,
        runner=runner,
        speculative_tree="off",
        cross_vocab_greedy=cross_vocab_greedy,
        options=EngineOptions(running_costs=False, overlap_plain_steps=overlap),
    )


def median_run(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def hf_generate(target, prompt_ids: list[int], max_new_tokens: int, assistant=None) -> float:
    """Tokens/s of HF `generate`, greedy, with `assistant` as its assistant model if given."""
    input_ids = torch.tensor([prompt_ids], device=target.device)
    options = dict(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    if assistant is not None:
        options["assistant_model"] = assistant
    runners.synchronize(target.device)
    start = time.perf_counter()
    output = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), **options)
    runners.synchronize(target.device)
    return (output.shape[1] - len(prompt_ids)) / (time.perf_counter() - start)


class Report:
    """The JSON and markdown written to OUT_DIR after every section."""

    def __init__(self, out_dir: str, header: dict[str, Any]) -> None:
        self.out_dir = out_dir
        self.data: dict[str, Any] = {"header": header}
        self.markdown: list[str] = [f"# GPU check, {header['date']}", "", f"Device: {header['device_name']}; "
                                    f"torch {header['torch']}, transformers {header['transformers']}.", ""]  # fmt: skip

    def section(self, name: str, data: Any, lines: list[str]) -> None:
        self.data[name] = data
        self.markdown += [f"## {name}", "", *lines, ""]
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, "gpu_check.json"), "w", encoding="utf-8") as file:
            json.dump(self.data, file, indent=1)
        with open(os.path.join(self.out_dir, "gpu_check.md"), "w", encoding="utf-8") as file:
            file.write("\n".join(self.markdown))
        print("\n".join([f"## {name}", *lines]), flush=True)


def table(header: list[str], rows: list[list[Any]]) -> list[str]:
    def cell(value: Any) -> str:
        return f"{value:.3f}" if isinstance(value, float) else str(value)

    return ["| " + " | ".join(str(name) for name in header) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join(cell(value) for value in row) + " |" for row in rows
    ]


def run_cuda_tests() -> tuple[dict[str, Any], list[str]]:
    started = time.perf_counter()
    command = [sys.executable, "-m", "pytest", "tests/cuda", "-q", "-ra", "-p", "no:cacheprovider"]
    repository = pathlib.Path(__file__).resolve().parents[2]
    process = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=repository)
    lines = process.stdout.strip().splitlines()
    summary = lines[-1] if lines else process.stderr.strip()[-500:]
    data = {"returncode": process.returncode, "summary": summary, "seconds": time.perf_counter() - started}
    if process.returncode != 0:
        data["tail"] = process.stdout[-4000:] + process.stderr[-2000:]
    return data, [f"`pytest tests/cuda`: {summary} (exit {process.returncode})"]


@dataclasses.dataclass
class Setup:
    """What every section shares."""

    models: dict[str, torch.nn.Module]
    device: torch.device
    context: int  # tokens of context under each timed pass
    k: int
    repeats: int
    max_new_tokens: int
    report: Report
    tokenizer: Any = None
    prompt_generator: torch.Generator = dataclasses.field(default_factory=lambda: torch.Generator().manual_seed(1))

    @property
    def dtype(self) -> torch.dtype:
        return next(self.models["0.5B"].parameters()).dtype

    def label(self, kind: str) -> str:
        if kind == runners.DYNAMIC:
            return "eager"
        return "graphs" if self.device.type == "cuda" else "static"

    def prompt(self, target: torch.nn.Module) -> list[int]:
        vocab = min(target.config.vocab_size, self.models["0.5B"].config.vocab_size)
        return torch.randint(0, vocab, (64,), generator=self.prompt_generator).tolist()


def pass_times(setup: Setup) -> dict[str, dict[str, float]]:
    """Section 2: per-pass times, eager against the static runner, and c."""
    k = setup.k
    passes = {
        name: {
            f"{kind}_w{width}": pass_seconds(model, kind, 1, width, setup.context, setup.repeats)
            for kind in (runners.DYNAMIC, runners.STATIC)
            for width in (1, k + 1)
        }
        for name, model in setup.models.items()
    }
    static = setup.label(runners.STATIC)
    rows = [[name, *(1e3 * times[key] for key in times)] for name, times in passes.items()]
    header = ["model", "eager w1 (ms)", f"eager w{k + 1} (ms)", f"{static} w1 (ms)", f"{static} w{k + 1} (ms)"]
    c_rows, c_data = [], {}
    for target in ("1.5B", "7B"):
        for kind in (runners.DYNAMIC, runners.STATIC):
            draft_step = passes["0.5B"][f"{kind}_w1"]
            c_step = draft_step / passes[target][f"{kind}_w1"]
            c_verify = draft_step / passes[target][f"{kind}_w{k + 1}"]
            c_data[f"{target}_{kind}"] = {"c_over_step": c_step, "c_over_verify": c_verify}
            c_rows.append([f"0.5B -> {target}", setup.label(kind), c_step, c_verify])
    c_header = ["pair", "runner", "c = draft step / target step", f"c = draft step / verify (w{k + 1})"]
    setup.report.section(
        "Pass times and c",
        {"passes": passes, "c": c_data},
        [
            f"Batch 1, {setup.context} tokens of context; medians of {setup.repeats} passes.",
            "",
            *table(header, rows),
            "",
            *table(c_header, c_rows),
        ],
    )
    return passes


def verify_sweep(setup: Setup) -> dict[str, Any]:
    """Section 3: the targets' verify cost by width and by batch, on the static runner."""
    widths, batches = list(range(1, 18)), [1, 2, 4, 8, 16]
    sweep: dict[str, Any] = {}
    lines = []
    for name in ("1.5B", "7B"):
        model = setup.models[name]
        by_width = [pass_seconds(model, runners.STATIC, 1, w, setup.context, setup.repeats) for w in widths]
        by_batch = [pass_seconds(model, runners.STATIC, b, setup.k + 1, setup.context, setup.repeats) for b in batches]
        sweep[name] = {"widths": widths, "by_width": by_width, "batches": batches, "by_batch": by_batch}
        lines += [f"{name} target, {setup.label(runners.STATIC)}, ms:", ""]
        lines += table(["width", *widths], [["ms", *(1e3 * s for s in by_width)]]) + [""]
        lines += table([f"batch (width {setup.k + 1})", *batches], [["ms", *(1e3 * s for s in by_batch)]]) + [""]
    setup.report.section("Verify cost by width and batch", sweep, lines)
    return sweep


def engine_rows(setup: Setup, passes: dict[str, dict[str, float]]) -> None:
    """Section 4: draft = target against target-only in the engine and HF `generate`; the engine's own time."""
    k, data, rows = setup.k, {}, []
    for name in ("1.5B", "7B"):
        target = setup.models[name]
        prompt = setup.prompt(target)
        for kind in (runners.DYNAMIC, runners.STATIC):
            self_engine = make_engine(target, target, setup.tokenizer, kind)
            plain_engine = make_engine(target, None, setup.tokenizer, kind)
            # Plain steps read before the next is launched: what the overlap of plain steps saves.
            read_engine = make_engine(target, None, setup.tokenizer, kind, overlap=False)
            engine_run(self_engine, prompt, 16, k)  # warm-up: graph captures, allocator
            engine_run(plain_engine, prompt, 16, 0)
            engine_run(read_engine, prompt, 16, 0)
            spec = median_run([engine_run(self_engine, prompt, setup.max_new_tokens, k) for _ in range(3)])
            plain = median_run([engine_run(plain_engine, prompt, setup.max_new_tokens, 0) for _ in range(3)])
            read = median_run([engine_run(read_engine, prompt, setup.max_new_tokens, 0) for _ in range(3)])
            with PassClock(setup.device) as clock:
                timed = engine_run(self_engine, prompt, setup.max_new_tokens, k)
            own = (timed["seconds"] - clock.seconds) / timed["steps"]
            verify = passes[name][f"{kind}_w{k + 1}"]
            # Without the clock's synchronisations, the host's work may overlap the GPU's: the step's
            # wall time beyond its passes, each timed alone (k draft passes of one token, one verify).
            beyond = spec["seconds"] / spec["steps"] - (k * passes[name][f"{kind}_w1"] + verify)
            data[f"{name}_{kind}"] = {
                "draft_equals_target": spec,
                "target_only": plain,
                "target_only_read_at_once": read,
                # A plain token's time over a plain pass's (the width-1 verify pass timed alone).
                "plain_token_over_pass": 1 / plain["tokens_per_s"] / passes[name][f"{kind}_w1"],
                "read_at_once_token_over_pass": 1 / read["tokens_per_s"] / passes[name][f"{kind}_w1"],
                "engine_own_seconds_per_step": own,
                "model_seconds_per_step": clock.seconds / timed["steps"],
                "own_over_verify": own / verify,
                "beyond_passes_seconds_per_step": beyond,
                "beyond_over_verify": beyond / verify,
            }
            speedup = spec["tokens_per_s"] / plain["tokens_per_s"]
            rows.append(
                [name, setup.label(kind), spec["tokens_per_s"], spec["acceptance"], plain["tokens_per_s"],
                 read["tokens_per_s"], speedup, 1e3 * own, own / verify, 1e3 * beyond, beyond / verify]
            )  # fmt: skip
        hf = statistics.median(hf_generate(target, prompt, setup.max_new_tokens) for _ in range(3))
        data[f"{name}_hf_generate"] = hf
        rows.append([name, "HF generate (eager)", "-", "-", hf, "-", "-", "-", "-", "-", "-"])
    header = ["target", "runner", "draft = target tok/s", "acceptance", "target-only tok/s",
              "target-only read at once tok/s", "speedup",
              "engine's own ms/step", "own / verify pass", "beyond passes ms/step", "beyond / verify"]  # fmt: skip
    setup.report.section(
        "Engine: draft = target against target-only",
        data,
        [
            f"Greedy, 64-token prompt, {setup.max_new_tokens} new tokens, fixed k = {k}, medians of 3 runs.",
            "Engine's own time: a step's wall time minus its model passes, each timed with a synchronisation;",
            "beyond passes: the step's wall time, unsynchronised, minus k draft passes and a verify pass timed alone.",
            "Target-only: plain steps overlapped (each launched before the one before it is read, the default on",
            "CUDA); read at once: that overlap off.",
            "",
            *table(header, rows),
        ],
    )


def engine_profile(setup: Setup, out_dir: str) -> None:
    """Where the engine's own time goes: one run of the 7B target drafting for itself, profiled."""
    target = setup.models["7B"]
    engine = make_engine(target, target, setup.tokenizer, runners.STATIC)
    prompt = setup.prompt(target)
    engine_run(engine, prompt, 16, setup.k)
    profile = cProfile.Profile()
    profile.enable()
    engine_run(engine, prompt, setup.max_new_tokens, setup.k)
    profile.disable()
    stream = io.StringIO()
    pstats.Stats(profile, stream=stream).sort_stats("tottime").print_stats(40)
    with open(os.path.join(out_dir, "engine_profile.txt"), "w", encoding="utf-8") as file:
        file.write(stream.getvalue())
    setup.report.section("Engine profile", None, ["engine_profile.txt: the 40 functions with the most own time."])


def assisted_rows(setup: Setup) -> None:
    """Section 5: HF assisted generation against the engine on the same models."""
    k, data, rows = setup.k, {}, []
    for name in ("1.5B", "7B"):
        target = setup.models[name]
        prompt = setup.prompt(target)
        for draft_name in (name, "0.5B"):
            draft = setup.models[draft_name]
            hf_generate(target, prompt, 16, draft)  # warm-up
            hf = statistics.median(hf_generate(target, prompt, setup.max_new_tokens, draft) for _ in range(3))
            engine = make_engine(target, draft, setup.tokenizer, runners.STATIC)
            engine_run(engine, prompt, 16, k)
            ours = median_run([engine_run(engine, prompt, setup.max_new_tokens, k) for _ in range(3)])
            data[f"{draft_name}->{name}"] = {"hf_assisted": hf, "ours_static": ours}
            rows.append([f"{draft_name} -> {name}", hf, ours["tokens_per_s"], ours["acceptance"],
                         ours["tokens_per_s"] / hf])  # fmt: skip
    setup.report.section(
        "Against HF assisted generation",
        data,
        [
            f"Greedy, {setup.max_new_tokens} new tokens; ours: {setup.label(runners.STATIC)}, fixed k = {k}; "
            "HF: its default schedule.",
            "",
            *table(["pair", "HF assisted tok/s", "ours tok/s", "our acceptance", "ours / HF"], rows),
        ],
    )


def predicted_speedups(setup: Setup, passes: dict[str, dict[str, float]], sweep: dict[str, Any]) -> None:
    """Section 6: E/(kc+1) at the real pair's CPU acceptance, chains and chain-with-siblings trees."""
    data: dict[str, Any] = {}
    lines = [f"Acceptance per draft {CPU_ACCEPTANCE} (the real pair on the CPU); the static runner's costs.", ""]
    for name in ("1.5B", "7B"):
        by_width = sweep[name]["by_width"]  # by_width[i]: a pass of width i + 1
        step = passes[name]["static_w1"]
        draft_step = passes["0.5B"]["static_w1"]
        rows = []
        for num_drafts in range(1, 9):
            chain = chain_expected_tokens([CPU_ACCEPTANCE] * num_drafts)
            row = [num_drafts, chain, chain * step / (num_drafts * draft_step + by_width[num_drafts])]
            for share in RUNNER_UP_SHARES:
                # A sibling per draft: where the chain's draft is rejected, its runner-up is accepted
                # with this share, and the walk gains that token (`handler.tree`).
                tree = chain + share * (1 - CPU_ACCEPTANCE**num_drafts)
                tree_cost = num_drafts * draft_step + by_width[min(2 * num_drafts, len(by_width) - 1)]
                row.append(tree * step / tree_cost)
            rows.append(row)
        data[name] = rows
        header = ["k", "E (chain)", "chain speedup", *(f"tree speedup, runner-up share {s}" for s in RUNNER_UP_SHARES)]
        lines += [f"0.5B -> {name}:", "", *table(header, rows), ""]
    setup.report.section("Predicted speedup E/(kc+1)", data, lines)


def compiled_passes(setup: Setup, passes: dict[str, dict[str, float]]) -> None:
    """Optional: the static runner's passes through `torch.compile` (kernels fused), still captured as graphs."""
    data, rows = {}, []
    for name, widths in (("0.5B", (1,)), ("7B", (1, setup.k + 1))):
        runner = StaticRunner(setup.models[name])
        started = time.perf_counter()
        runner._pass = torch.compile(runner._pass, dynamic=False)
        for width in widths:
            seconds = runners.time_runner_pass(runner, 1, width, setup.context, setup.repeats)
            data[f"{name}_w{width}"] = {"compiled": seconds, "graphs": passes[name][f"static_w{width}"]}
            rows.append([name, width, 1e3 * passes[name][f"static_w{width}"], 1e3 * seconds])
        data[f"{name}_compile_seconds"] = time.perf_counter() - started
    c_compiled = data["0.5B_w1"]["compiled"] / data["7B_w1"]["compiled"]
    c_verify = data["0.5B_w1"]["compiled"] / data[f"7B_w{setup.k + 1}"]["compiled"]
    data["c_compiled"], data["c_compiled_over_verify"] = c_compiled, c_verify
    setup.report.section(
        "torch.compile of the static runner's passes",
        data,
        [
            f"Batch 1; compiling took {data['0.5B_compile_seconds']:.0f} s (0.5B) and "
            f"{data['7B_compile_seconds']:.0f} s (7B).",
            "",
            *table(["model", "width", "graphs (ms)", "compiled + graphs (ms)"], rows),
            "",
            f"c = 0.5B step / 7B step, compiled: {c_compiled:.3f}; over the 7B verify (w{setup.k + 1}): {c_verify:.3f}",
        ],
    )


def load_rows(setup: Setup, out_dir: str, max_new_tokens: int, exactness: bool = False) -> None:
    """Section 7: `scripts.bench.load` on the 1.5B target and the 0.5B draft, served on this device.

    exactness: in float32 (models built afresh), where every row's outputs must equal plain
    decoding's under continuous batching; else in the setup's dtype (bf16 on a GPU), for speed.
    """
    from scripts.bench import load as bench_load

    folder = pathlib.Path(tempfile.mkdtemp(prefix="gpu-check-load-"))
    on_gpu = setup.device.type == "cuda"
    dtype = torch.float32 if exactness or not on_gpu else torch.bfloat16
    shapes = SHAPES if on_gpu else TINY_SHAPES
    for name, role in (("1.5B", "target"), ("0.5B", "draft")):
        model = (
            setup.models[name] if dtype == setup.models[name].dtype else build_model(shapes[name], setup.device, dtype)
        )
        model.save_pretrained(folder / role)
        setup.tokenizer.save_pretrained(folder / role)
        del model
    name = "load-fp32" if exactness else "load"
    argv = [
        "--target", str(folder / "target"), "--draft", str(folder / "draft"),
        "--dtype", str(dtype).replace("torch.", ""), "--draft-quantization", "none",
        "--rows", "shipped,plain,k2", "--max-new-tokens", str(max_new_tokens), "--out-dir", os.path.join(out_dir, name),
    ]  # fmt: skip
    try:
        import arctic_inference  # noqa: F401 - the hybrid drafter's suffix trees
    except ImportError:
        argv += ["--drafter", "model"]  # the shipped hybrid drafts from suffix trees it cannot build here
    if on_gpu:
        argv += ["--gpu-id", str(setup.device.index or 0), "--concurrency", "1,4,16" if exactness else "1,4,8,16"]
    else:
        argv += ["--concurrency", "1,2", "--open-requests", "4", "--warm-tokens", "4"]
    argv += ["--rates", ""] if exactness else ([] if on_gpu else ["--rates", "20"])
    bench_load.main(argv)
    with open(os.path.join(out_dir, name, "load.md"), encoding="utf-8") as file:
        lines = file.read().splitlines()
    setup.report.section(f"Load ({name}, scripts.bench.load)", {"argv": argv}, lines)


# SmolLM2-135M's shape: a Llama with another vocabulary, the cross-family draft of
# docs/heterogeneous-drafts.md; 39237 of its 49152 tokens are in Qwen2.5's vocabulary.
SMOLLM2_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True)  # fmt: skip
SMOLLM2_SHARED = 39237


def synthetic_vocab_map(target_vocab: int, draft_vocab: int, num_shared: int):
    """A map between two made-up vocabularies with `num_shared` tokens in common, in shuffled ids:
    the map's work per step is the real one's (its sizes are), its tokens are not."""
    from handler.vocab_map import VocabMap

    generator = torch.Generator().manual_seed(2)
    target_tokens = [b"t%d " % i for i in range(target_vocab)]
    shared = torch.randperm(target_vocab, generator=generator)[:num_shared].tolist()
    draft_tokens = [target_tokens[i] for i in shared] + [b"d%d " % i for i in range(draft_vocab - num_shared)]
    order = torch.randperm(draft_vocab, generator=generator).tolist()
    return VocabMap(target_tokens, [], [draft_tokens[i] for i in order], [], target_vocab)


def cross_vocab_rows(setup: Setup) -> None:
    """Section 8: a draft from another family, SmolLM2-135M's shape, drafting for the 1.5B target.

    Its passes against the 0.5B's, c against the 1.5B's verify, and the engine's tokens/s with a
    vocabulary map of the real one's sizes (SLEM and TLI greedy) against the 0.5B draft at the same k.
    Random weights: no draft is accepted, so every engine row runs the same steps and the row's
    speed is its step's cost.
    """
    from transformers import AutoModelForCausalLM, LlamaConfig

    shape = SMOLLM2_SHAPE if setup.device.type == "cuda" else dict(TINY_SHAPES["0.5B"], vocab_size=300)
    torch.manual_seed(0)
    with torch.device(setup.device):
        draft = AutoModelForCausalLM.from_config(LlamaConfig(max_position_embeddings=8192, **shape), dtype=setup.dtype)
    draft.eval()
    target, same = setup.models["1.5B"], setup.models["0.5B"]
    k, lines, data = setup.k, [], {}
    rows = []
    for kind in (runners.DYNAMIC, runners.STATIC):
        small = pass_seconds(draft, kind, 1, 1, setup.context, setup.repeats)
        half = pass_seconds(same, kind, 1, 1, setup.context, setup.repeats)
        verify = pass_seconds(target, kind, 1, k + 1, setup.context, setup.repeats)
        data[kind] = {"135M": small, "0.5B": half, "1.5B_verify": verify}
        rows.append([setup.label(kind), 1e3 * small, 1e3 * half, 1e3 * verify, small / verify, half / verify])
    lines += table(["runner", "135M (ms)", "0.5B (ms)", f"1.5B w{k + 1} (ms)", "c 135M", "c 0.5B"], rows) + [""]
    num_shared = SMOLLM2_SHARED if setup.device.type == "cuda" else 200
    vocab_map = synthetic_vocab_map(target.config.vocab_size, draft.config.vocab_size, num_shared)
    prompt = setup.prompt(target)
    rows = []
    for kind in (runners.DYNAMIC, runners.STATIC):
        engines = {
            "0.5B, same vocabulary": make_engine(target, same, setup.tokenizer, kind),
            "135M, other vocabulary, SLEM": make_engine(target, draft, setup.tokenizer, kind, vocab_map, "slem"),
            "135M, other vocabulary, TLI": make_engine(target, draft, setup.tokenizer, kind, vocab_map, "tli"),
        }
        for name, engine in engines.items():
            engine_run(engine, prompt, 16, k)  # warm-up: graph captures, allocator
            run = median_run([engine_run(engine, prompt, setup.max_new_tokens, k) for _ in range(3)])
            data[f"{kind} {name}"] = run
            rows.append([setup.label(kind), name, run["tokens_per_s"], 1e3 * run["seconds"] / run["steps"]])
    lines += table(["runner", "draft", "tokens/s", "ms per step"], rows)
    setup.report.section("A draft from another family (135M shape)", data, lines)


def admission_rows(setup: Setup, out_dir: str) -> None:
    """Section 9: the step that admits 16 requests with 256-token prompts, in the setup's dtype, 1.5B
    target and 0.5B draft: plain (k = 0) against drafting (k = 2), on both runners. The admitting
    step and the one after, timed with synchronisations (median of 3), and the top CUDA kernels of
    one admitting step of each, profiled (admission_profile.txt)."""
    target, draft = setup.models["1.5B"], setup.models["0.5B"]
    batch, prompt_tokens = (16, 256) if setup.device.type == "cuda" else (4, 32)
    generator = torch.Generator().manual_seed(3)
    vocab = min(target.config.vocab_size, draft.config.vocab_size)
    prompts = [tuple(torch.randint(0, vocab, (prompt_tokens,), generator=generator).tolist()) for _ in range(batch)]
    rows, data, profiles = [], {}, []

    def admit(engine, k: int, tag: str) -> tuple[float, float]:
        for index, prompt in enumerate(prompts):
            engine.add_request((tag, index), GenerationRequest(prompt, 8, SamplingParams(), k))
        runners.synchronize(setup.device)
        num_steps = engine.steps.num_steps
        started = time.perf_counter()
        engine.step()
        runners.synchronize(setup.device)
        admitted = time.perf_counter()
        engine.step()
        runners.synchronize(setup.device)
        after = time.perf_counter()
        # The admitting step's record: the first kept after it began (an overlapped plain step is
        # recorded when it is read, in the call after it).
        record = list(engine.steps.recent_steps)[num_steps - engine.steps.num_steps]
        for index in range(len(prompts)):
            engine.abort_request((tag, index))
        engine.step()
        # The admitting step's parts, as the engine's host clock saw them (no synchronisation between).
        parts = (record.prefill_seconds, record.draft_seconds, record.verify_seconds, record.draft_passes)
        return admitted - started, after - admitted, *parts

    for kind in (runners.DYNAMIC, runners.STATIC):
        for k in (0, 2):
            engine = make_engine(target, draft, setup.tokenizer, kind)
            admit(engine, k, "warm")
            times = [admit(engine, k, f"run{n}") for n in range(3)]
            first, second, prefill, drafting, verify, passes = (
                statistics.median(t[n] for t in times) for n in range(6)
            )
            data[f"{kind} k{k}"] = {
                "admit": first, "next": second, "prefill": prefill, "draft": drafting, "verify": verify,
                "draft_passes": passes,
            }  # fmt: skip
            rows.append([setup.label(kind), k, 1e3 * first, 1e3 * prefill, 1e3 * drafting, 1e3 * verify, 1e3 * second])
            if setup.device.type == "cuda":
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    admit(engine, k, "profiled")
                profiles.append(f"### {setup.label(kind)}, k = {k}\n")
                profiles.append(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
    with open(os.path.join(out_dir, "admission_profile.txt"), "w", encoding="utf-8") as file:
        file.write("\n".join(profiles))
    header = ["runner", "k", "admitting step (ms)", "its prefills", "its draft passes", "its verify", "next step (ms)"]
    lines = table(header, rows)
    lines += [
        "",
        "The admitting step's parts are the engine's host clock (`StepRecord`), not synchronised between parts;"
        " its prefills are the target's and, for drafting rows, the draft's.",
        "admission_profile.txt: the top kernels of one admitting step (and its next) of each.",
    ]
    setup.report.section(f"Admitting {batch} requests ({setup.dtype})", data, lines)


def serve_rows(report: Report, out_dir: str, device: torch.device, max_new_tokens: int) -> None:
    """The `serve` section: `scripts.serving.serve_pair` (its serve.md and serve.json in OUT_DIR/serve). On the
    CPU, the tiny pair alone, with tiny sizes: a check of the script."""
    from scripts.serving import serve_pair

    argv = [os.path.join(out_dir, "serve")]
    if device.type == "cuda":
        argv += ["--pairs", ",".join(serve_pair.PAIRS), "--gpu-id", str(device.index or 0)]
        argv += ["--max-new-tokens", str(min(max_new_tokens, 64))]
    else:
        argv += ["--concurrency", "1,4", "--max-new-tokens", "8", "--set", "cpu_threads=1", "--set", "adaptive_k=false"]
    args = serve_pair.parse_args(argv)
    data, lines = serve_pair.run(args.out_dir, args.pairs, args)
    report.section("Serve (scripts.serving.serve_pair)", data, lines)


def own_time_rows(setup: Setup) -> None:
    """The engine's own time a step (`scripts.bench.own_time`): each target shape drafting for itself
    with the static runner, batch 1 and 16: plain, the planner pricing every draft out, and k = 4; then
    the first shape's rows again with a logit bias and penalties (`--penalties`: the chains and the
    verify apply them on the device)."""
    from scripts.bench import own_time

    argv = ["--device", setup.device.type, "--runner", runners.STATIC, "--steps", "16"]
    if setup.device.type != "cuda":
        argv += ["--repeats", "1", "--steps", "4", "--warmup", "2"]  # a dry run of the section
    data, lines = {}, []
    shapes = ("1.5B", "7B") if setup.device.type == "cuda" else (None,)
    # On a GPU the check's own models; on a CPU the tiny pair (its tiny shapes step slowly).
    runs = [(shape, False) for shape in shapes] + [(shapes[0], True)]
    for shape, penalties in runs:
        args = own_time.parse_args(argv + (["--penalties"] if penalties else []))
        target, tokenizer = (setup.models[shape], setup.tokenizer) if shape else own_time.load_target(args, None)
        rows = own_time.measure(args, target, tokenizer)
        name = (shape or "the tiny pair") + (", penalised" if penalties else "")
        data[name] = rows
        lines += [f"{name}:", "", own_time.table(rows), ""]
    setup.report.section("Own time a step (scripts.bench.own_time)", data, lines)


def syncs_rows(setup: Setup) -> None:
    """The host reads a step (`scripts.bench.host_syncs`) on the check's pairs, with the CUDA syncs
    `torch.cuda.set_sync_debug_mode` warns of."""
    from scripts.bench import host_syncs

    args = host_syncs.parse_args(["--device", setup.device.type, "--shapes", "--runner", runners.STATIC, "--where"])
    pairs = host_syncs.shaped_pairs(args.device, args.runner, setup.models, setup.tokenizer)
    counts, lines = host_syncs.report_lines(args, pairs)
    data = [dataclasses.asdict(count) for count in counts]
    setup.report.section("Host reads a step (scripts.bench.host_syncs)", data, lines)


def replay_rows(setup: Setup) -> None:
    """The real pair's recorded acceptance replayed (`scripts.bench.replay`) on the check's models: the
    0.5B draft for the 1.5B target and for the 7B, static runner. Fewer runs than the script's own
    defaults, so that the section fits a few minutes; on a CPU, the tiny shapes on two requests of one
    set at C = 1."""
    from scripts.bench import replay

    argv = ["--device", setup.device.type, "--runner", runners.STATIC]
    if setup.device.type == "cuda":
        argv += ["--repeats", "2", "--settle-rounds", "2", "--pass-repeats", "5"]
    else:
        argv += ["--sets", "grounded", "--requests-per-set", "2", "--concurrency", "1", "--repeats", "1"]
        argv += ["--settle-rounds", "1", "--pass-repeats", "1"]
    args = replay.parse_args(argv)
    data, lines = {}, []
    for shape in ("1.5B", "7B"):
        report = replay.measure(args, setup.models[shape], setup.models["0.5B"], setup.tokenizer)
        data[shape] = report
        lines += [f"0.5B -> {shape}, random weights, {setup.dtype}:", "", replay.table(report), ""]
        if setup.device.type == "cuda":
            torch.cuda.empty_cache()  # the section's engines and their graphs are gone
    setup.report.section("Replayed acceptance (scripts.bench.replay)", data, lines)


def guarded(report: Report, name: str, section: Callable[[], Any]) -> Any:
    """Runs a section; a failure is written to the report and the next section still runs."""
    try:
        return section()
    except Exception as error:  # noqa: BLE001 - a benchmark section's failure is reported, not fatal
        report.section(f"{name}: FAILED", {"error": repr(error), "traceback": traceback.format_exc()}, [repr(error)])
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="folder for gpu_check.json and gpu_check.md")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: tiny shapes, a dry run")
    parser.add_argument("--skip-tests", action="store_true", help="do not run tests/cuda")
    parser.add_argument(
        "--sections",
        default="sweep,engine,profile,assisted",
        help="comma-separated, after the pass times: sweep (and the predicted speedups), engine, profile, "
        "assisted, compile (torch.compile of the static passes; minutes of compiling), "
        "load (scripts.bench.load on the 1.5B target and 0.5B draft, bf16), load-fp32 (the same in float32: "
        "outputs equal plain decoding's), cross (a draft from another family, SmolLM2-135M's shape), admission "
        "(the step that admits 16 requests, plain against drafting, timed and profiled), "
        "syncs (scripts.bench.host_syncs: host reads and CUDA syncs a step), "
        "own (scripts.bench.own_time: the step's own time, batch 1 and 16, plain against k = 4, and penalised), "
        "replay (scripts.bench.replay: the real pair's recorded acceptance on the 1.5B and 7B shapes), "
        "serve (scripts.serving.serve_pair: the pairs through a real TorchServe; alone, no model is built here)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4, help="drafts per step of the engine rows")
    parser.add_argument("--repeats", type=int, default=10, help="timed passes per point (median)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here; --device cpu checks the script with tiny shapes")
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    import transformers

    header = {
        "date": time.strftime("%Y-%m-%d"),
        "device_name": torch.cuda.get_device_name(device) if on_gpu else platform.processor() or "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "dtype": str(dtype),
        "k": args.k,
    }
    report = Report(args.out_dir, header)
    if not args.skip_tests:
        report.section("CUDA tests", *run_cuda_tests())
    sections = set(args.sections.split(","))
    if "serve" in sections:
        # Before this process builds its models: the server's workers and the in-process engine need the memory.
        guarded(report, "Serve", lambda: serve_rows(report, args.out_dir, device, args.max_new_tokens))
        if sections == {"serve"}:
            return 0
    shapes = SHAPES if on_gpu else TINY_SHAPES
    setup = Setup(
        models={name: build_model(shape, device, dtype) for name, shape in shapes.items()},
        device=device,
        context=512 if on_gpu else 64,
        k=args.k,
        repeats=args.repeats,
        max_new_tokens=args.max_new_tokens,
        report=report,
        tokenizer=text_tokenizer(),
    )
    passes = pass_times(setup)
    sweep = verify_sweep(setup) if "sweep" in sections else None
    if "engine" in sections:
        guarded(report, "Engine", lambda: engine_rows(setup, passes))
    if "profile" in sections:
        guarded(report, "Engine profile", lambda: engine_profile(setup, args.out_dir))
    if "assisted" in sections:
        guarded(report, "HF assisted", lambda: assisted_rows(setup))
    if sweep is not None:
        predicted_speedups(setup, passes, sweep)
    if "compile" in sections:
        guarded(report, "Compile", lambda: compiled_passes(setup, passes))
    if "load" in sections:
        guarded(report, "Load", lambda: load_rows(setup, args.out_dir, min(args.max_new_tokens, 64)))
    if "cross" in sections:
        guarded(report, "cross", lambda: cross_vocab_rows(setup))
    if "admission" in sections:
        guarded(report, "admission", lambda: admission_rows(setup, args.out_dir))
    if "syncs" in sections:
        guarded(report, "syncs", lambda: syncs_rows(setup))
    if "own" in sections:
        guarded(report, "own", lambda: own_time_rows(setup))
    if "replay" in sections:
        guarded(report, "replay", lambda: replay_rows(setup))
    if "load-fp32" in sections:
        guarded(report, "Load fp32", lambda: load_rows(setup, args.out_dir, 48, exactness=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
