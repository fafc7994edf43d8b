"""The engine's own time per step: the step's wall time minus its models' forwards.

The tiny pair in float32 (`scripts.model_tools.make_tiny_models`), the draft being the target itself so that
every draft is accepted, a fixed k (no cost table: every row drafts its cap), greedy rows of one
prompt. For each batch size, plain decoding (k = 0), the shipped planner where a cost table in this
machine's seconds prices every draft out (`0, planned`: a step that drafts nothing, its look-ups and
plan included, or skipped after plans that priced drafting well below plain, `handler.planning.trackers.PlainStreak`)
and drafting (k = 4, or `--k`) run in the same process, alternating over the repeats (on a GPU also plain
decoding with every step read before the next is launched, `0, read at once`: the engine's overlapped
plain steps off; there a step's wall time is the steps' from the first's start to the last's work
done, over the steps), and with the dynamic runner drafting's passes alone (`4, bare loop`: two caches
of the target, k greedy draft passes, the verify pass, one read, the roll-backs, and nothing else; the
least own time of a step of those passes, which the engine's drafting row's is above by its planning and
bookkeeping), and the table gives, per step (medians over the repeats):

- ms a step, and the forwards' ms within it;
- own ms, unsynchronised (each forward timed as its call returns) and synchronised (the device
  waited for before and after each forward: on a CPU the same, on a GPU the host's share);
- own ms per emitted token;
- the ratios of own time a step and a token against plain decoding's at the same batch size;
- the calls a step makes outside the forwards, counted in one more run of each row (untimed): torch
  calls (torch functions and tensor methods called from Python, attribute reads such as `.shape`
  included: `torch.overrides.TorchFunctionMode`) and Python calls (functions outside torch entered,
  `sys.setprofile`). Counts, not timings: they hold on a busy machine, where own time moves by a
  third, and on a CPU own time goes mostly with them (a small tensor call right after a pass takes
  several times its warm time).

The forwards are timed by wrapping the models' `forward`, which every pass calls (the runners',
the draft's, a joining row's prefill), and on CUDA `CUDAGraph.replay`, the static runner's passes;
steps that admit rows are not measured.

    python -m scripts.bench.own_time                 # batch 1 and 16, 3 repeats of 32 steps
    python -m scripts.bench.own_time --models models/tiny --batch-sizes 1 --steps 4
    python -m scripts.bench.own_time --device cuda --runner static --shapes 1.5B,7B   # on a GPU

`--shapes` takes random-weight Qwen2.5 shapes from scripts.bench.gpu_check (bf16; nothing downloaded)
instead of the tiny pair; each shape drafts for itself, as the tiny target does.

`--confidence-stop loop|mask` plans the drafting steps from a fixed cost table instead, and the
draft's confidence stops the chains: the plan drafts to the row's k and the host reads every pass
(`loop`), or the plan's priced k passes run and are read once (`mask`,
`handler.drafters.model.ModelDrafter.stop_by_mask`). `--drafter hybrid` has the drafting rows draft
as the shipped configs' requests do: the look-ups (n-gram, suffix trees) against the draft model,
whose passes carry the suffix trees' guesses where they are priced to pay (with `--confidence-stop
loop`, the shipped CPU step).

`--penalties` gives every row a logit bias and the presence, frequency and repetition penalties (greedy):
the drafting rows' chains apply them on the device (`handler.logits_processors.ChainPenalties`) and the
verify pass all rows' at once (`process_rows_logits`); no bare loop then, which applies no rules.

Benchmarks are programs: take figures on a quiet machine, never in a test.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import pathlib
import statistics
import sys
import tempfile
import time

import torch
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

PROMPT = "def fibonacci(n):\n    "
DRAFTING_K = 4
CONFIDENCE_STOPS = ("off", "loop", "mask")


class ForwardTimer:
    """Wraps a model's `forward` and adds up the seconds its calls take (`synchronised`: the device
    is waited for before and after each call, so that its queued work is counted as the model's)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.synchronised = False
        self.seconds = 0.0
        self.calls = 0
        self.depth = 0  # forwards under way (`CallCounter` counts outside them)
        self._forward = model.forward
        model.forward = self._timed  # nn.Module.__call__ reads the instance's forward
        # The static runner on CUDA replays captured graphs and never calls `forward`: time the replays.
        self._replay = None
        if self.device.type == "cuda":
            self._replay = torch.cuda.CUDAGraph.replay
            original = self._replay

            def replay(graph, *args, **kwargs):
                return self._time(original, graph, *args, **kwargs)

            torch.cuda.CUDAGraph.replay = replay

    def _sync(self) -> None:
        if self.synchronised and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _timed(self, *args, **kwargs):
        return self._time(self._forward, *args, **kwargs)

    def _time(self, call, *args, **kwargs):
        self._sync()
        start = time.perf_counter()
        self.depth += 1
        try:
            output = call(*args, **kwargs)
        finally:
            self.depth -= 1
        self._sync()
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return output

    def remove(self) -> None:
        del self.model.forward
        if self._replay is not None:
            torch.cuda.CUDAGraph.replay = self._replay


TORCH_DIR = str(pathlib.Path(torch.__file__).parent)  # frames from here are torch's own (also `host_syncs`)


class CallCounter(TorchFunctionMode):
    """While active, counts the torch calls and the Python calls made outside `timer`'s forwards
    (the module docstring says which)."""

    def __init__(self, timer: ForwardTimer) -> None:
        super().__init__()
        self.timer = timer
        self.torch_calls = 0
        self.python_calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not self.timer.depth:
            self.torch_calls += 1
        return func(*args, **(kwargs or {}))

    def _profile(self, frame, event, arg) -> None:
        if event == "call" and not self.timer.depth:
            filename = frame.f_code.co_filename
            if not filename.startswith(TORCH_DIR) and filename != __file__:
                self.python_calls += 1

    def __enter__(self):
        sys.setprofile(self._profile)
        return super().__enter__()

    def __exit__(self, *exc):
        sys.setprofile(None)
        return super().__exit__(*exc)


def load_tiny_target(models: pathlib.Path | None, device: str):
    """The tiny target in float32 and its tokenizer; built into a temporary folder where `models` is None."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with contextlib.ExitStack() as stack:
        if models is None:
            from scripts.model_tools import make_tiny_models

            models = pathlib.Path(stack.enter_context(tempfile.TemporaryDirectory()))
            make_tiny_models.build(models, seed=0, draft_noise=0.0)
        tokenizer = AutoTokenizer.from_pretrained(models / "target")
        target = AutoModelForCausalLM.from_pretrained(models / "target", dtype=torch.float32).eval().to(device)
    return target, tokenizer


def self_drafting_engine(
    target, tokenizer, runner: str, confidence_stop: str = "off", overlap_plain_steps: bool | None = None, **settings
):
    """The target drafting for itself, no stop token; a fixed k where `confidence_stop` is off, else planned
    from a fixed cost table with the confidence stop, by mask or by the loop (`CONFIDENCE_STOPS`).
    `overlap_plain_steps`: `handler.engine.EngineOptions`'s (None: the device's default).
    `settings`: further `handler.engine.EngineSettings` fields."""
    from handler.engine import EngineOptions, build_engine
    from handler.planning.cost_table import CostModel
    from handler.runtime.loading import LoadedModels

    assert confidence_stop in CONFIDENCE_STOPS, confidence_stop
    if confidence_stop != "off":
        # A draft pass at 0.15 of a target pass, a verified column at 0.05: the tests' costs for the stop.
        costs = CostModel(draft_step=0.15, target_step=1.0, target_per_extra_token=0.05)
        settings.update(cost_table=costs, draft_confidence=True)
    engine = build_engine(
        LoadedModels.of(target, target, tokenizer, eos_token_ids=()),
        runner=runner,
        options=EngineOptions(running_costs=False, overlap_plain_steps=overlap_plain_steps),
        **settings,
    )
    if confidence_stop != "off":
        engine.model_drafter.stop_by_mask = confidence_stop == "mask"
    return engine


def add_confidence_stop_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--confidence-stop",
        choices=CONFIDENCE_STOPS,
        default="off",
        help="off: a fixed k; loop or mask: planned, the draft's confidence stops it, read a pass or once",
    )


def penalised_sampling():
    """Greedy with a logit bias and the presence, frequency and repetition penalties (`--penalties`)."""
    from handler.config import SamplingParams

    return SamplingParams(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1, logit_bias=((5, 1.0),))


def run_steps(
    engine,
    timer: ForwardTimer,
    prompt_ids,
    batch_size: int,
    k: int,
    warmup: int,
    steps: int,
    counter: CallCounter | None = None,
    sampling=None,
) -> dict:
    """Admits `batch_size` greedy rows of k drafts (`sampling`: their settings, greedy where None), runs
    `warmup` steps, then times `steps` steps (with `counter`, counts their calls instead: `torch_calls`
    and `python_calls` a step)."""
    from handler.config import SamplingParams
    from handler.engine import GenerationRequest

    sampling = sampling or SamplingParams()
    max_new_tokens = 2 * (warmup + steps + 2) * (k + 1)  # no row finishes inside the timed steps
    for row in range(batch_size):
        engine.add_request(row, GenerationRequest(prompt_ids, max_new_tokens, sampling, k))
    engine.step()  # admission: the prefill is no step's own time
    for _ in range(warmup):
        engine.step()
    wall = forwards = 0.0
    tokens = 0
    counting = counter if counter is not None else contextlib.nullcontext()
    # On a GPU, the steps' wall time from the first's start to the last's queued work done: a step's
    # host work may run under the pass before it (the engine's overlapped plain steps), which a
    # synchronisation after every step would undo. On a CPU, each step's call.
    start = time.perf_counter()
    for _ in range(steps):
        timer.seconds = 0.0
        called = time.perf_counter()
        with counting:
            outputs = engine.step()
        wall += time.perf_counter() - called
        forwards += timer.seconds
        tokens += sum(len(output.new_token_ids) for output in outputs)
        finished = [output.result.finish_reason for output in outputs if output.result is not None]
        assert not finished, f"a row finished inside the timed steps: {finished}"
    if timer.device.type == "cuda":
        torch.cuda.synchronize(timer.device)
        wall = time.perf_counter() - start
    for row in range(batch_size):
        engine.abort_request(row)
    engine.step()  # frees the aborted rows
    return _sample(wall, forwards, tokens, steps, counter)


def _sample(wall: float, forwards: float, tokens: int, steps: int, counter: CallCounter | None) -> dict:
    """A run's figures a step: its wall and forwards' ms, its tokens, and its counted calls where counted."""
    sample = {"step_ms": wall / steps * 1e3, "forward_ms": forwards / steps * 1e3, "tokens_per_step": tokens / steps}
    if counter is not None:
        sample.update(torch_calls=counter.torch_calls / steps, python_calls=counter.python_calls / steps)
    return sample


def run_bare_steps(target, timer, prompt_ids, batch_size: int, k: int, warmup: int, steps: int, counter=None) -> dict:
    """`run_steps` for the bare loop (`FLOOR`): the drafting row's passes and nothing else. Two caches of
    the target (the draft's and the target's, `handler.caches.kv_cache.RaggedCache`), each step k greedy
    draft passes of one token a row fed to the next on the device, the verify pass over each row's pending
    token and its k drafts, the target's argmaxes read once with the accepted counts, both caches rolled
    back to the accepted tokens. No plan, no drafters, no bookkeeping: the least a step of these passes
    costs the host."""
    from handler.caches.kv_cache import RaggedCache
    from handler.sampler import argmax_vocab

    with torch.inference_mode():
        draft, verify = RaggedCache(target, batch_size), RaggedCache(target, batch_size)
        prompt = torch.tensor([list(prompt_ids)] * batch_size)
        draft.forward(prompt, None, logits_to_keep=1)
        pending = argmax_vocab(verify.forward(prompt, None, logits_to_keep=1))  # [rows, 1]
        draft_pending, draft_mask = pending, None  # [rows, w]: what the draft cache has not seen yet
        device = pending.device
        wall = forwards = 0.0
        tokens = 0
        for step in range(warmup + steps):
            measured = step >= warmup
            timer.seconds = 0.0
            counting = counter if counter is not None and measured else contextlib.nullcontext()
            called = time.perf_counter()
            with counting:
                feeds, feed_mask, drafted = draft_pending, draft_mask, []
                for _ in range(k):
                    feeds = argmax_vocab(draft.forward(feeds, feed_mask, logits_to_keep=1))  # [rows, 1]
                    feed_mask = None
                    drafted.append(feeds)
                chunk = torch.cat([pending, *drafted], dim=1)  # [rows, 1 + k]
                targets = argmax_vocab(verify.forward(chunk, None, logits_to_keep=k + 1))  # [rows, 1 + k]
                accepted = (targets[:, :k] == chunk[:, 1:]).cumprod(dim=1).sum(dim=1)  # [rows]
                read = torch.cat([accepted[:, None], targets], dim=1).tolist()  # the step's one read
                num_accepted = torch.tensor([row[0] for row in read])
                # The target keeps each row's pending token and accepted drafts; the draft, what it was fed
                # of them (it never saw its own last draft: a row that took every draft feeds it next).
                verify.rollback(verify.lengths - (k - num_accepted))
                draft.rollback(draft.lengths - (k - 1) + num_accepted.clamp(max=k - 1))
                pending = torch.tensor([[row[1 + row[0]]] for row in read], device=device)  # [rows, 1]: the bonus
                every_draft = [row[0] == k for row in read]
                draft_pending, draft_mask = pending, None
                if any(every_draft):
                    draft_pending = torch.cat([drafted[-1], pending], dim=1)
                    if not all(every_draft):  # the others' first column is left padding
                        draft_mask = torch.tensor([[int(every), 1] for every in every_draft])
            if measured:
                wall += time.perf_counter() - called
                forwards += timer.seconds
                tokens += sum(row[0] + 1 for row in read)
    return _sample(wall, forwards, tokens, steps, counter)


def load_shaped_target(shape: str, device: str):
    """A random-weight Qwen2.5 shape in bf16 (scripts.bench.gpu_check.SHAPES) and a text tokenizer."""
    from scripts.bench import gpu_check

    model = gpu_check.build_model(gpu_check.SHAPES[shape], torch.device(device), torch.bfloat16)
    return model, gpu_check.text_tokenizer()


def load_target(args, shape: str | None):
    """The target `shape` names (`load_shaped_target`), else the tiny pair's, and its tokenizer."""
    return load_tiny_target(args.models, args.device) if shape is None else load_shaped_target(shape, args.device)


def priced_out_engine(target, tokenizer, runner: str, plain_seconds: float):
    """The target drafting for itself through the shipped planner (hybrid drafter, the confidence stop),
    where a cost table in this machine's seconds (a plain pass of `plain_seconds`) prices every draft
    out: a draft pass at 5 target passes, a verified column at 2. Its steps draft nothing (but while the
    pool first explores, in the warm-up): a step that does not draft, against plain decoding's."""
    from handler.planning.cost_table import CostModel

    costs = CostModel(
        draft_step=5.0 * plain_seconds, target_step=plain_seconds, target_per_extra_token=2.0 * plain_seconds
    )
    return self_drafting_engine(target, tokenizer, runner, cost_table=costs, drafter="hybrid", draft_confidence=True)


# The rows of the table at each batch size: plain decoding, the planner pricing every draft out (its steps
# draft nothing), and drafting at a fixed k; on a GPU also plain decoding with each step read before the
# next is launched (`READ_AT_ONCE`: the overlap of plain steps off, `handler.engine.EngineOptions`).
# With the dynamic runner, also the drafting row's passes alone (`FLOOR`, `run_bare_steps`): the least
# own time of a step of them, the engine's bound.
# The drafting rows are labelled by their k (`--k`, DRAFTING_K by default): "4" and "4, bare loop".
PLAIN, READ_AT_ONCE, PRICED_OUT, DRAFTING, FLOOR = "0", "0, read at once", "0, planned", "k", "k, bare loop"
MODES = (PLAIN, PRICED_OUT, DRAFTING)
GPU_MODES = (PLAIN, READ_AT_ONCE, PRICED_OUT, DRAFTING)


def requested_k(mode: str, k: int) -> int:
    """Each row's requested k: the planner's rows ask for a cap it prices out."""
    return {PLAIN: 0, READ_AT_ONCE: 0, PRICED_OUT: 2 * k, DRAFTING: k, FLOOR: k}[mode]


def label(mode: str, k: int) -> str:
    """A row's name in the table: the drafting rows by their k."""
    return {DRAFTING: str(k), FLOOR: f"{k}, bare loop"}.get(mode, mode)


def modes_of(device: torch.device, runner: str, penalties: bool = False) -> tuple[str, ...]:
    """The table's rows at each batch size on `device` with `runner` (`penalties`: no bare loop, which
    applies no rules)."""
    modes = GPU_MODES if device.type == "cuda" else MODES
    return modes + (FLOOR,) if runner == "dynamic" and not penalties else modes


def run_mode(mode: str, engine, target, timer, prompt_ids, batch_size: int, args, counter=None) -> dict:
    """One run of a row of the table: `run_steps` on the row's engine, or the bare loop (`FLOOR`)."""
    k = requested_k(mode, args.k)
    if mode == FLOOR:
        return run_bare_steps(target, timer, prompt_ids, batch_size, k, args.warmup, args.steps, counter)
    sampling = penalised_sampling() if args.penalties else None
    return run_steps(engine, timer, prompt_ids, batch_size, k, args.warmup, args.steps, counter, sampling)


def measure(args, target, tokenizer) -> list[dict]:
    # The draft is the target itself: every draft is accepted, and the step is all the machinery.
    engine = self_drafting_engine(target, tokenizer, args.runner, args.confidence_stop, drafter=args.drafter)
    modes = modes_of(target.device, args.runner, args.penalties)
    engines = {mode: engine for mode in modes}
    if READ_AT_ONCE in modes:
        engines[READ_AT_ONCE] = self_drafting_engine(target, tokenizer, args.runner, overlap_plain_steps=False)
    priced_out: dict[int, object] = {}  # by batch size, built after its first plain run

    def engine_of(mode: str, batch_size: int):
        return priced_out[batch_size] if mode == PRICED_OUT else engines[mode]

    timer = ForwardTimer(target)
    prompt_ids = tuple(tokenizer(PROMPT)["input_ids"])
    samples: dict[tuple[int, str, bool], list[dict]] = {}
    try:
        for _ in range(args.repeats):
            for batch_size in args.batch_sizes:
                for mode in modes:  # alternating, so that a burst of load falls on all
                    if mode == PRICED_OUT and batch_size not in priced_out:
                        plain_seconds = samples[batch_size, PLAIN, False][0]["forward_ms"] / 1e3
                        priced_out[batch_size] = priced_out_engine(target, tokenizer, args.runner, plain_seconds)
                    for synchronised in (False, True):
                        timer.synchronised = synchronised
                        sample = run_mode(
                            mode, engine_of(mode, batch_size), target, timer, prompt_ids, batch_size, args
                        )
                        samples.setdefault((batch_size, mode, synchronised), []).append(sample)
        for batch_size in args.batch_sizes:
            for mode in modes:
                samples[batch_size, mode, "counted"] = run_mode(
                    mode, engine_of(mode, batch_size), target, timer, prompt_ids, batch_size, args, CallCounter(timer)
                )
    finally:
        timer.remove()
    rows = []
    for batch_size in args.batch_sizes:
        for mode in modes:
            row = {"batch": batch_size, "k": label(mode, args.k)}
            for synchronised, tag in ((False, "unsync"), (True, "sync")):
                runs = samples[batch_size, mode, synchronised]
                step_ms = statistics.median(run["step_ms"] for run in runs)
                own_ms = statistics.median(run["step_ms"] - run["forward_ms"] for run in runs)
                tokens = statistics.median(run["tokens_per_step"] for run in runs)
                row[f"step_ms_{tag}"] = step_ms
                row[f"forward_ms_{tag}"] = statistics.median(run["forward_ms"] for run in runs)
                row[f"own_ms_{tag}"] = own_ms
                row[f"own_ms_per_token_{tag}"] = own_ms / tokens  # tokens: every row's, a step
                row["tokens_per_row_step"] = tokens / batch_size
            counted = samples[batch_size, mode, "counted"]
            row["torch_calls"], row["python_calls"] = counted["torch_calls"], counted["python_calls"]
            rows.append(row)
    for row in rows:
        plain = next(other for other in rows if other["batch"] == row["batch"] and other["k"] == PLAIN)
        row["own_ratio"] = row["own_ms_unsync"] / plain["own_ms_unsync"]
        row["own_per_token_ratio"] = row["own_ms_per_token_unsync"] / plain["own_ms_per_token_unsync"]
    return rows


def table(rows: list[dict]) -> str:
    header = (
        "| batch | k | ms a step | forwards, ms | own ms (unsync) | own ms (sync) | tokens a row-step "
        "| own ms a token | own vs plain, a step | own vs plain, a token | torch calls | Python calls |"
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for row in rows:
        lines.append(
            f"| {row['batch']} | {row['k']} | {row['step_ms_unsync']:.2f} | {row['forward_ms_unsync']:.2f} "
            f"| {row['own_ms_unsync']:.2f} | {row['own_ms_sync']:.2f} | {row['tokens_per_row_step']:.2f} "
            f"| {row['own_ms_per_token_unsync']:.3f} | {row['own_ratio']:.2f}x | {row['own_per_token_ratio']:.2f}x "
            f"| {row['torch_calls']:.1f} | {row['python_calls']:.0f} |"
        )
    return "\n".join(lines)


def add_step_arguments(parser: argparse.ArgumentParser, steps: int, warmup: int) -> None:
    """The options this benchmark shares with scripts.bench.host_syncs: the pair, batch sizes, steps."""
    parser.add_argument("--models", type=pathlib.Path, default=None, help="the tiny pair's folder (default: built now)")
    parser.add_argument(
        "--batch-sizes", type=lambda text: [int(x) for x in text.split(",")], default=[1, 16], help="e.g. 1,16"
    )
    parser.add_argument("--steps", type=int, default=steps, help="measured steps per run")
    parser.add_argument("--warmup", type=int, default=warmup, help="steps before the measured ones")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_step_arguments(parser, steps=32, warmup=4)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each row, alternating")
    parser.add_argument("--runner", choices=("dynamic", "static"), default="dynamic")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shapes", default="", help="comma-separated gpu_check shapes, e.g. 1.5B,7B (bf16)")
    add_confidence_stop_argument(parser)
    parser.add_argument("--k", type=int, default=DRAFTING_K, help="the drafting rows' k")
    parser.add_argument(
        "--drafter",
        choices=("model", "hybrid"),
        default="model",
        help="the drafting rows' drafter: hybrid is the shipped configs' (look-ups, guessed model drafts)",
    )
    parser.add_argument(
        "--penalties",
        action="store_true",
        help="every row greedy with a logit bias and the presence, frequency and repetition penalties",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING)
    args = parse_args(argv)
    from scripts.bench.common import machine_info

    shapes = [shape.strip() for shape in args.shapes.split(",") if shape.strip()] or [None]
    for shape in shapes:
        rows = measure(args, *load_target(args, shape))
        what = "the tiny pair, float32" if shape is None else f"the {shape} shape, random weights, bf16"
        stop = "" if args.confidence_stop == "off" else f", the confidence stop by {args.confidence_stop}"
        setup = f"{args.drafter} drafter, {args.runner} runner, {args.device}{stop}"
        greedy = "greedy with penalties and a logit bias" if args.penalties else "greedy"
        print(f"Own time: {what}, draft == target, {greedy}, {setup}")
        device = torch.cuda.get_device_name() if args.device.startswith("cuda") else machine_info()["description"]
        print(device)
        print(f"medians of {args.repeats} runs of {args.steps} steps after {args.warmup}; ratios against k = 0 here")
        print(table(rows), flush=True)
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
