"""The work of the step that admits a batch of requests, plain (k = 0) against drafting (k = 2), counted.

A step that admits requests prefills them and then runs a step over the batch: for plain rows one
target pass, for drafting rows the draft's prefill too, its passes and a verify pass. On a GPU the
host sets the pace of such a step, so the table counts what the host does, not how long it takes:

- each model's passes, as rows x width;
- the copies of keys and values: the caches' own appends inside the passes, and every copy outside
  them (calls and megabytes): the admission's adoption of the prefilled rows, the prefix cache's;
- the torch calls outside the passes: on a GPU each one is an indexing call or a kernel launch.

The models have random weights and the cache layout of the Qwen2.5 pair in `scripts.bench.gpu_check`
(the 1.5B target's 28 layers, the 0.5B draft's 24, two KV heads of 128 each), the rest small, in
float32 on the CPU: the counts are those of the real pair, and the passes cost little.

    python -m scripts.bench.admission_work                  # 16 rows of 256 tokens, both runners
    python -m scripts.bench.admission_work --prefix-cache   # a prefix cache that misses (new prompts)
    python -m scripts.bench.admission_work --rows 4 --prompt-tokens 32 --where

Counts, not timings: they hold on a busy machine.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import logging
import pathlib
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.cache_utils import CacheLayerMixin

# (layers, KV heads, head dim) of the Qwen2.5 pair's caches; the hidden size is the heads' and no more.
LAYOUTS = {"target": (28, 2, 128), "draft": (24, 2, 128)}
VOCAB = 384
DRAFTING_K = 2
# The aten calls that copy a tensor's elements (views are no copies); of those that write into a
# tensor in place, the argument whose elements they copy.
COPIES = frozenset(("cat", "stack", "gather", "index", "clone", "_to_copy", "scatter"))
SOURCE_ARGUMENT = {"copy_": 1, "index_put_": 2, "scatter_": 3, "index_copy_": 3}
_HANDLER_DIR = str(pathlib.Path(__file__).resolve().parents[2] / "handler")


class Work(TorchDispatchMode):
    """Counts, while active, each model's passes and the copies of keys and values, in and out of the
    passes, and the torch calls outside them (by handler line in `where`)."""

    def __init__(self, models: dict[str, torch.nn.Module]) -> None:
        super().__init__()
        self.passes: list[tuple[str, int, int]] = []  # (model, rows, width)
        self.appends = self.append_bytes = 0  # the caches' appends inside the passes
        self.copies = self.copy_bytes = 0  # copies of floating-point tensors outside the passes
        self.calls = 0  # torch calls outside the passes
        self.where: collections.Counter[str] = collections.Counter()
        self._depth = 0
        self._hooks = []
        for name, model in models.items():
            self._hooks.append(model.register_forward_pre_hook(self._entered(name), with_kwargs=True))
            self._hooks.append(model.register_forward_hook(self._left, with_kwargs=True))

    def _entered(self, name: str):
        def hook(module, args, kwargs):
            rows, width = kwargs["input_ids"].shape
            self.passes.append((name, rows, width))
            self._depth += 1

        return hook

    def _left(self, module, args, kwargs, output):
        self._depth -= 1

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        output = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if not self._depth:
            self.calls += 1
            self.where[_caller()] += 1
        if name in COPIES or name in SOURCE_ARGUMENT:
            written = output[0] if isinstance(output, (list, tuple)) else output
            source = args[SOURCE_ARGUMENT[name]] if name in SOURCE_ARGUMENT else written
            if not isinstance(source, torch.Tensor):  # a scalar scattered: as many elements as its index
                source = args[2]
            if isinstance(written, torch.Tensor) and written.is_floating_point():
                num_bytes = source.numel() * written.element_size()
                if not self._depth:
                    self.copies += 1
                    self.copy_bytes += num_bytes
                elif _in_cache_update():
                    self.appends += 1
                    self.append_bytes += num_bytes
        return output


def _in_cache_update() -> bool:
    """Whether a cache layer's `update` is on the stack: a pass appending its keys and values."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "update" and isinstance(frame.f_locals.get("self"), CacheLayerMixin):
            return True
        frame = frame.f_back
    return False


def _caller() -> str:
    """The innermost handler line on the stack."""
    frame = sys._getframe(2)
    while frame is not None and not frame.f_code.co_filename.startswith(_HANDLER_DIR):
        frame = frame.f_back
    if frame is None:
        return "?"
    path = pathlib.Path(frame.f_code.co_filename).relative_to(pathlib.Path(_HANDLER_DIR).parent)
    return f"{path}:{frame.f_lineno} ({frame.f_code.co_name})"


def build_model(role: str):
    """A random-weight model with the cache layout of the pair's `role` (`LAYOUTS`), float32 on the CPU."""
    from scripts.bench import gpu_check

    num_layers, num_kv_heads, head_dim = LAYOUTS[role]
    hidden = num_kv_heads * head_dim
    shape = {
        "hidden_size": hidden,
        "intermediate_size": hidden,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_kv_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "vocab_size": VOCAB,
    }
    return gpu_check.build_model(shape, torch.device("cpu"), torch.float32)


@dataclasses.dataclass
class Count:
    runner: str
    k: int
    passes: list[tuple[str, int, int]]
    appends: int
    append_bytes: int
    copies: int
    copy_bytes: int
    calls: int
    where: dict[str, int]


def count_admissions(args, target, draft, tokenizer) -> list[Count]:
    """Per runner, the admitting step of `args.rows` plain rows, then of as many drafting rows."""
    from handler.config import SamplingParams
    from handler.engine import EngineOptions, GenerationRequest, build_engine
    from handler.runtime.loading import LoadedModels

    counts = []
    generator = torch.Generator().manual_seed(3)
    # Each prompt starts with a token no other starts with: a prefix cache finds none of it.
    first_tokens = iter(range(VOCAB))
    for runner in args.runners:
        engine = build_engine(
            LoadedModels.of(target, draft, tokenizer, eos_token_ids=(), pad_token_id=0),
            runner=runner,
            speculative_tree="off",
            prefix_cache_max_bytes=1 << 34 if args.prefix_cache else None,
            options=EngineOptions(running_costs=False),
        )
        # A warm-up of each kind first; every admission has new prompts, which a prefix cache misses.
        for tag, k, counted in (("warm", 0, False), ("warm", DRAFTING_K, False), ("", 0, True), ("", DRAFTING_K, True)):
            for row in range(args.rows):
                prompt = [
                    next(first_tokens),
                    *torch.randint(0, VOCAB, (args.prompt_tokens - 1,), generator=generator).tolist(),
                ]
                engine.add_request((tag, k, row), GenerationRequest(tuple(prompt), 8, SamplingParams(), k))
            work = Work({"target": target, "draft": draft})
            try:
                with work:
                    engine.step()
            finally:
                work.remove()
            if counted:
                totals = (work.appends, work.append_bytes, work.copies, work.copy_bytes, work.calls)
                counts.append(Count(runner, k, work.passes, *totals, dict(work.where)))
            for row in range(args.rows):
                engine.abort_request((tag, k, row))
            engine.step()
    return counts


def table(counts: list[Count]) -> list[str]:
    header = [
        "runner", "k", "passes (rows x width)", "appends in passes", "MB", "copies outside passes", "MB",
        "torch calls outside passes",
    ]  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for count in counts:
        passes = ", ".join(f"{name} {rows}x{width}" for name, rows, width in count.passes)
        cells = [
            count.runner, count.k, passes, count.appends, f"{count.append_bytes / 1e6:.1f}", count.copies,
            f"{count.copy_bytes / 1e6:.1f}", count.calls,
        ]  # fmt: skip
        lines.append("| " + " | ".join(str(cell) for cell in cells) + " |")
    return lines


def where(counts: list[Count], top: int = 12) -> list[str]:
    lines = []
    for count in counts:
        lines.append(f"{count.runner}, k {count.k}: torch calls outside the passes, by line")
        for line, num in sorted(count.where.items(), key=lambda item: -item[1])[:top]:
            lines.append(f"    {num:6d}  {line}")
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=16, help="at most 48: every prompt starts with its own token")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--runners", type=lambda text: text.split(","), default=["dynamic", "static"])
    parser.add_argument("--prefix-cache", action="store_true", help="with a prefix cache (every prompt new)")
    parser.add_argument("--where", action="store_true", help="also list the lines that make the torch calls")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from scripts.bench import gpu_check

    logging.basicConfig(level=logging.WARNING)
    args = parse_args(argv)
    target, draft = build_model("target"), build_model("draft")
    counts = count_admissions(args, target, draft, gpu_check.text_tokenizer())
    lines = [
        f"The step that admits {args.rows} requests of {args.prompt_tokens} tokens, plain (k = 0) against "
        f"drafting (k = {DRAFTING_K}); the Qwen2.5 pair's cache layout, float32, "
        f"{'a prefix cache that misses' if args.prefix_cache else 'no prefix cache'}",
        "",
        *table(counts),
    ]
    if args.where:
        lines += ["", *where(counts)]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
