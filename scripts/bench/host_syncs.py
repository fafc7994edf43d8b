"""Host reads per engine step: how often a step waits for the device to hand a value to Python.

A read is a call of `tolist`, `item`, `cpu`, `numpy`, `__bool__`, `__int__`, `__float__` or
`__index__` on a tensor that lives on the device (`HostReads`). On a GPU each one stops the host
until the device has caught up, so a step that reads once overlaps its Python with the device's
work and a step that reads per draft pass does not.

On a GPU the device is known: a read is a call on a tensor not on the CPU, and the implicit
synchronisations that are no read (a boolean mask's `nonzero`, a copy to pageable memory) are
counted apart, from `torch.cuda.set_sync_debug_mode("warn")`'s warnings. On a CPU every tensor is
a host tensor, so the counter follows where each tensor would live: the models' parameters and
buffers, what a creation function was given a `device` for, what `.to` moved to a device, and
whatever a torch function computed from any of those are device tensors; `.cpu()` and `.to("cpu")`
bring one back. The counts on a CPU are then those the same code would make on a GPU.

The engine is the tiny pair's target drafting for itself (every draft is accepted), chains only,
a fixed k (no cost table), no stop token; the table gives the reads per step for plain decoding
(k = 0) and drafting (k = 4), greedy, sampled (temperature 0.8), seeded (temperature 0.8, a
seed per row) and penalised (greedy with a logit bias and the presence, frequency and repetition
penalties: the chains apply them on the device), for each batch size.

    python -m scripts.bench.host_syncs                       # the tiny pair on the CPU
    python -m scripts.bench.host_syncs --where               # and the lines that read
    python -m scripts.bench.host_syncs --device cuda --shapes  # Qwen2.5 0.5B draft, 1.5B and 7B targets, bf16
    python -m scripts.bench.host_syncs --confidence-stop mask  # planned, the stop read once a proposal

`--confidence-stop loop|mask` (the tiny pair only) plans the steps from a fixed cost table and lets
the draft's confidence stop its chains: the host reads every pass (`loop`), or the k passes run and
are read once (`mask`); k is then the plan's: the row's cap with the loop, the priced k with the mask
(the cap too here, every draft being accepted) (`scripts.bench.own_time.self_drafting_engine`).

Counts, not timings: they hold on a busy machine.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import logging
import pathlib
import sys
import warnings

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from handler import sampler
from scripts.bench.own_time import TORCH_DIR, penalised_sampling

logger = logging.getLogger(__name__)

PROMPT = "def fibonacci(n):\n    "
DRAFTING_K = 4
READS = frozenset(("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"))
MODES = ("greedy", "sampled", "seeded", "penalised")
_ON_DEVICE = "_host_syncs_on_device"  # the attribute that marks a device tensor in a CPU run


class HostReads(TorchFunctionMode):
    """Counts device-to-host reads while active (`reads`, and by method and line in `by_method`
    and `by_line`); `syncs`: on CUDA, the synchronisations that `set_sync_debug_mode` warned of.

    Args:
        device: the models' device. On the CPU the device tensors are followed as the module
            docstring says, starting from `models`' parameters and buffers.
        models: the models whose weights are device tensors (CPU runs only).
    """

    def __init__(self, device: torch.device | str, models=()) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.emulated = self.device.type == "cpu"
        self.reads = 0
        self.syncs = 0
        self.by_method: collections.Counter[str] = collections.Counter()
        self.by_line: collections.Counter[str] = collections.Counter()
        self._warnings = None
        self._catcher = None
        if self.emulated:
            for model in models:
                for tensor in [*model.parameters(), *model.buffers()]:
                    setattr(tensor, _ON_DEVICE, True)

    def reset(self) -> None:
        self.reads = self.syncs = 0
        self.by_method.clear()
        self.by_line.clear()
        if self._warnings is not None:
            self._warnings.clear()

    def _on_device(self, value) -> bool:
        if not isinstance(value, torch.Tensor):
            return False
        if self.emulated:
            return getattr(value, _ON_DEVICE, False)
        return value.device.type != "cpu"

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        to_host = name == "cpu" or (name == "to" and ("cpu" in args[1:2] or kwargs.get("device") == "cpu"))
        if (name in READS or to_host) and args and self._on_device(args[0]):
            self.reads += 1
            self.by_method[name] += 1
            self.by_line[_caller()] += 1
        output = func(*args, **kwargs)
        if self.emulated:
            if to_host:
                if output is args[0]:  # a copy on a GPU: the host's tensor is not the device's
                    output = output.clone()
            elif name not in READS:
                if name == "to" and output is args[0] and self._follow_to(args, kwargs):
                    # On a GPU a move to the device is a new tensor: the host's stays a host tensor.
                    output = output.clone()
                self._follow(name, args, kwargs, output)
        return output

    def _follow_to(self, args, kwargs) -> bool:
        """Whether a `to` moves its tensor to the device."""
        inputs, _ = tree_flatten((args[1:], kwargs))
        return any(isinstance(value, (str, torch.device)) for value in inputs)

    def _follow(self, name: str, args, kwargs, output) -> None:
        """Marks what a torch function made on the device (CPU runs)."""
        inputs, _ = tree_flatten((args, kwargs))
        if name == "to":
            on_device = any(isinstance(value, (str, torch.device)) or self._on_device(value) for value in inputs)
        else:
            on_device = kwargs.get("device") is not None or any(self._on_device(value) for value in inputs)
        if not on_device:
            return
        outputs, _ = tree_flatten(output)
        for value in outputs:
            if isinstance(value, torch.Tensor):
                setattr(value, _ON_DEVICE, True)
        if name.endswith("_") or name == "__setitem__":
            if isinstance(args[0], torch.Tensor):  # an in-place write of device values
                setattr(args[0], _ON_DEVICE, True)

    def __enter__(self):
        if not self.emulated:
            self._catcher = warnings.catch_warnings(record=True)
            self._warnings = self._catcher.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        else:
            # A CPU's argmax through numpy (`handler.sampler.argmax_vocab`) reads the values into numpy,
            # which no device tensor can do: off while counting, the argmax is the device's.
            self._numpy_argmax = sampler.NUMPY_ARGMAX_MAX_VALUES
            sampler.NUMPY_ARGMAX_MAX_VALUES = 0
        return super().__enter__()

    def __exit__(self, *exc):
        result = super().__exit__(*exc)
        if self.emulated:
            sampler.NUMPY_ARGMAX_MAX_VALUES = self._numpy_argmax
        else:
            torch.cuda.set_sync_debug_mode(0)
            self.syncs = sum("synchroniz" in str(warning.message) for warning in self._warnings)
            self._catcher.__exit__(*exc)
        return result

    def take_syncs(self) -> int:
        """CUDA: the synchronisations warned of since the last call (0 on the CPU)."""
        if self._warnings is None:
            return 0
        num = sum("synchroniz" in str(warning.message) for warning in self._warnings)
        self._warnings.clear()
        return num


def _caller() -> str:
    """The first line outside torch on the stack: where a read was asked for."""
    frame = sys._getframe(2)
    while frame is not None and (
        frame.f_code.co_filename.startswith(TORCH_DIR) or frame.f_code.co_filename == __file__
    ):
        frame = frame.f_back
    if frame is None:
        return "?"
    path = pathlib.Path(frame.f_code.co_filename)
    parts = path.parts
    for root in ("handler", "scripts", "transformers"):
        if root in parts:
            path = pathlib.Path(*parts[parts.index(root) :])
            break
    return f"{path}:{frame.f_lineno} ({frame.f_code.co_name})"


@dataclasses.dataclass
class Count:
    """One row of the table: the reads of `steps` steps of a batch at one k and sampling mode."""

    pair: str
    batch: int
    k: int
    mode: str
    steps: int
    reads: int
    syncs: int
    by_method: dict[str, int]
    by_line: dict[str, int]

    @property
    def reads_per_step(self) -> float:
        return self.reads / self.steps

    @property
    def syncs_per_step(self) -> float:
        return self.syncs / self.steps


def count_steps(engine, counter: HostReads, prompt_ids, batch_size: int, k: int, mode: str, steps: int, warmup: int):
    """Admits `batch_size` rows of k drafts in `mode`, runs `warmup` steps, then counts the reads of
    `steps` steps (no row finishes among them)."""
    from handler.config import SamplingParams
    from handler.engine import GenerationRequest

    sampling = {
        "greedy": SamplingParams(),
        "penalised": penalised_sampling(),
    }.get(mode, SamplingParams(temperature=0.8))
    max_new_tokens = 2 * (warmup + steps + 2) * (k + 1)
    for row in range(batch_size):
        seed = 1000 + row if mode == "seeded" else None
        engine.add_request(row, GenerationRequest(tuple(prompt_ids), max_new_tokens, sampling, k, seed=seed))
    engine.step()  # admission: a prefill is no decoding step
    for _ in range(warmup):
        engine.step()
    counter.reset()
    counter.take_syncs()
    for _ in range(steps):
        outputs = engine.step()
        finished = [output.result.finish_reason for output in outputs if output.result is not None]
        assert not finished, f"a row finished inside the counted steps: {finished}"
    reads, syncs = counter.reads, counter.take_syncs()
    by_method, by_line = dict(counter.by_method), dict(counter.by_line)
    for row in range(batch_size):
        engine.abort_request(row)
    engine.step()
    return reads, syncs, by_method, by_line


def tiny_pair(device: str, runner: str, models: pathlib.Path | None, confidence_stop: str = "off"):
    """The tiny target drafting for itself."""
    from scripts.bench.own_time import load_tiny_target, self_drafting_engine

    target, tokenizer = load_tiny_target(models, device)
    engine = self_drafting_engine(target, tokenizer, runner, confidence_stop, speculative_tree="off")
    # As on a GPU, where a read waits for the device: the draft's chains stay there into the verify.
    engine.model_drafter.drafts_on_device = True
    return [("tiny, draft = target", engine, [target], tuple(tokenizer(PROMPT)["input_ids"]))]


def shaped_pairs(device: str, runner: str, models: dict | None = None, tokenizer=None):
    """The Qwen2.5 0.5B draft with the 1.5B and 7B targets, bf16, random weights (`scripts.bench.gpu_check`;
    tiny shapes in float32 on a CPU). `models`: those shapes already built, by name; `tokenizer`: the
    tiny pair's (built now where None)."""
    from scripts.bench import gpu_check

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shapes = gpu_check.SHAPES if device == "cuda" else gpu_check.TINY_SHAPES
    models = models if models is not None else {}
    build = lambda name: models.get(name) or gpu_check.build_model(shapes[name], torch.device(device), dtype)  # noqa: E731
    draft = build("0.5B")
    tokenizer = tokenizer or gpu_check.text_tokenizer()
    prompt = torch.randint(0, draft.config.vocab_size, (64,), generator=torch.Generator().manual_seed(1)).tolist()
    for name in ("1.5B", "7B"):
        target = build(name)
        yield (
            f"{name} target, 0.5B draft",
            gpu_check.make_engine(target, draft, tokenizer, runner),
            [target, draft],
            prompt,
        )
        del target


def measure(args, pairs=None) -> list[Count]:
    """The table's rows for `pairs` ((name, engine, models, prompt ids) each; None: those `args` name)."""
    if pairs is None:
        pairs = (
            shaped_pairs(args.device, args.runner)
            if args.shapes
            else tiny_pair(args.device, args.runner, args.models, args.confidence_stop)
        )
    counts = []
    for pair, engine, models, prompt_ids in pairs:
        counter = HostReads(args.device, models)
        with counter:
            for batch_size in args.batch_sizes:
                for k in (0, DRAFTING_K):
                    for mode in MODES:
                        reads, syncs, by_method, by_line = count_steps(
                            engine, counter, prompt_ids, batch_size, k, mode, args.steps, args.warmup
                        )
                        counts.append(Count(pair, batch_size, k, mode, args.steps, reads, syncs, by_method, by_line))
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return counts


def table(counts: list[Count], cuda: bool) -> list[str]:
    header = ["pair", "batch", "k", "sampling", "host reads a step", "by method"]
    if cuda:
        header.insert(5, "CUDA syncs a step")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for count in counts:
        methods = ", ".join(f"{name} {num / count.steps:g}" for name, num in sorted(count.by_method.items())) or "-"
        cells = [count.pair, count.batch, count.k, count.mode, f"{count.reads_per_step:g}", methods]
        if cuda:
            cells.insert(5, f"{count.syncs_per_step:g}")
        lines.append("| " + " | ".join(str(cell) for cell in cells) + " |")
    return lines


def where(counts: list[Count]) -> list[str]:
    """The lines that read, per row of the table, with their reads a step."""
    lines = []
    for count in counts:
        lines.append(f"{count.pair}, batch {count.batch}, k {count.k}, {count.mode}:")
        for line, num in sorted(count.by_line.items(), key=lambda item: -item[1]):
            lines.append(f"    {num / count.steps:g}  {line}")
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from scripts.bench.own_time import add_confidence_stop_argument, add_step_arguments

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_step_arguments(parser, steps=8, warmup=2)
    parser.add_argument("--runner", choices=("dynamic", "static"), default="dynamic")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument(
        "--shapes", action="store_true", help="the Qwen2.5 shapes of scripts.bench.gpu_check (tiny ones on a CPU)"
    )
    parser.add_argument("--where", action="store_true", help="also list the lines that read")
    add_confidence_stop_argument(parser)
    args = parser.parse_args(argv)
    if args.shapes and args.confidence_stop != "off":
        # The shapes' engines draft a fixed k (`scripts.bench.gpu_check.make_engine`).
        parser.error("--confidence-stop runs on the tiny pair only")
    return args


def report_lines(args, pairs=None) -> tuple[list[Count], list[str]]:
    """The counts and the table (`pairs`: as `measure`'s)."""
    counts = measure(args, pairs)
    cuda = args.device == "cuda"
    lines = [
        f"Host reads a step: {args.runner} runner, {args.device}, {args.steps} steps after {args.warmup}; "
        f"draft k = {DRAFTING_K} where k > 0, chains, temperature 0.8 where sampled, greedy where penalised"
        + ("" if args.confidence_stop == "off" else f"; planned, the confidence stop by {args.confidence_stop}"),
        "",
        *table(counts, cuda),
    ]
    if args.where:
        lines += ["", *where(counts)]
    return counts, lines


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING)
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here")
    _, lines = report_lines(args)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
