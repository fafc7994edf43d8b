"""Model runners: what stands between the step loop and a model's forward pass.

A runner owns one model's KV layout. The engine and the draft-model drafter never
call a model directly: rows are prefilled into a `handler.caches.kv_cache.RaggedCache`
(eager, any width, the prefix cache's KV copied in), and the runner `adopt`s that
cache as the running batch. The batch then takes every later pass through one
interface, `BatchCache`:

- `forward(input_ids, chunk_mask, logits_to_keep, tree)`: a chunk over every row (`chunk_mask`
  None: no row of it is padded);
- `lengths` and `rollback(lengths)`: rollback is a length;
- `keep_chunk_paths`, after a tree pass; `select_rows` and `extend`, as rows
  leave and join; `row_kv`, a row's KV for the prefix cache.

Two runners:

- `dynamic` (`DynamicRunner`): the running batch is the ragged cache itself,
  grown by concatenation and cropped on rollback. The CPU default.
- `static` (`handler.runners.static.StaticRunner`): KV preallocated per row
  slot; rollback moves a length; chunk widths, batch sizes and attended lengths
  are bucketed to a few fixed shapes, and on CUDA each shape is captured once
  as a CUDA graph.

`auto` picks one by timing both at start-up (`choose_runner`).
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Protocol, Sequence

import torch

from handler.caches.kv_cache import RaggedCache, model_name, prefill
from handler.config import RUNNER_MODES

logger = logging.getLogger(__name__)

AUTO, DYNAMIC, STATIC = RUNNER_MODES
# What an engine built without a runner named uses. The test suite runs its model tier under each
# runner by setting this (tests/conftest.py, `--runner`).
DEFAULT_RUNNER = DYNAMIC


class BatchCache(Protocol):
    """One model's KV for the running batch, row b for the engine's row b."""

    lengths: torch.Tensor  # [rows] long, CPU: valid tokens per row

    def forward(
        self,
        input_ids: torch.Tensor,
        chunk_mask: torch.Tensor | None,
        logits_to_keep: int,
        tree: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor: ...

    def rollback(self, lengths: torch.Tensor) -> None: ...

    def keep_chunk_paths(self, chunk_width: int, paths: Sequence[Sequence[int]]) -> None: ...

    def select_rows(self, rows: Sequence[int]) -> None: ...

    def extend(self, other: RaggedCache) -> None: ...

    def row_kv(self, slot: int, start: int, end: int) -> torch.Tensor: ...


class ModelRunner(Protocol):
    kind: str
    model: torch.nn.Module

    def adopt(self, prefilled: RaggedCache) -> BatchCache:
        """The running batch, starting with the rows of a freshly prefilled cache."""
        ...


class DynamicRunner:
    """Today's layout: the running batch is the ragged cache the rows were prefilled in."""

    kind = DYNAMIC

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def adopt(self, prefilled: RaggedCache) -> RaggedCache:
        return prefilled


def make_runner(kind: str, model: torch.nn.Module | None, **options) -> ModelRunner | None:
    """The runner of `kind` ("dynamic" or "static") for `model`; None for no model."""
    if model is None:
        return None
    if kind == DYNAMIC:
        return DynamicRunner(model)
    if kind == STATIC:
        from handler.runners.static import StaticRunner

        return StaticRunner(model, **options)
    raise ValueError(f"runner: {kind!r} is not one of {DYNAMIC}, {STATIC}")


def synchronize(device: torch.device) -> None:
    """Waits for the device's queued work (a no-op on the CPU), so that a wall clock times it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_batch(runner: ModelRunner, batch_size: int, context: int, generator: torch.Generator) -> BatchCache:
    """A running batch of `batch_size` rows of `context` random tokens, prefilled and adopted by `runner`."""
    vocab = runner.model.config.get_text_config().vocab_size
    prompts = torch.randint(0, vocab, (batch_size, context), generator=generator).tolist()
    return runner.adopt(prefill(runner.model, prompts, 0))


def timed_pass(batch: BatchCache, input_ids: torch.Tensor, device: torch.device) -> float:  # [rows, width]
    """Seconds of one pass of `input_ids` over every row of `batch` (its model on `device`), which is
    then rolled back."""
    lengths = batch.lengths.clone()
    synchronize(device)
    start = time.perf_counter()
    batch.forward(input_ids, torch.ones_like(input_ids), logits_to_keep=input_ids.shape[1])
    synchronize(device)
    seconds = time.perf_counter() - start
    batch.rollback(lengths)  # rollback is a length: the next pass sees the same context
    return seconds


@torch.inference_mode()
def time_runner_pass(runner: ModelRunner, batch_size: int, width: int, context: int, repeats: int) -> float:
    """Median seconds of one pass of `width` tokens over `batch_size` rows of `context` tokens,
    through `runner` (warm: its first passes, and any graph capture, are not timed)."""
    generator = torch.Generator().manual_seed(0)
    batch = random_batch(runner, batch_size, context, generator)
    vocab = runner.model.config.get_text_config().vocab_size
    input_ids = torch.randint(0, vocab, (batch_size, width), generator=generator)
    device = next(runner.model.parameters()).device
    samples = [timed_pass(batch, input_ids, device) for _ in range(repeats + 2)]
    return statistics.median(samples[2:])


def config_runner(config, models) -> str:
    """The runner a handler config names for its loaded models (`handler.runtime.loading.LoadedModels`),
    `auto` timed at the config's verify width (`num_speculative_tokens + 1`)."""
    return resolve_runner(config.runner, [models.target, models.draft], config.num_speculative_tokens + 1)


def resolve_runner(mode: str, models: Sequence[torch.nn.Module | None], width: int) -> str:
    """The runner a `runner:` setting names: itself, or for `auto` the one `choose_runner` times faster.

    Raises ValueError, naming the model and the reason, where `static` is named and cannot hold one
    of the models (`static_error`): at load, not in a request.
    """
    if mode == AUTO:
        return choose_runner(models, width)
    assert mode in (DYNAMIC, STATIC), mode
    if mode == STATIC:
        for model in models:
            error = None if model is None else static_error(model, width)
            if error is not None:
                raise ValueError(
                    f"runner: static cannot hold {model_name(model)}: {error}; use runner: dynamic (or auto)"
                )
    return mode


def static_error(model: torch.nn.Module, width: int) -> str | None:
    """Why the static runner cannot serve `model`, or None where it can.

    The runner takes its KV layout from a prefill's cache (`handler.caches.kv_cache.kv_layout`); then
    two rows of different lengths take a padded chunk of `width` tokens and a dense one-token pass
    through it and through the dynamic runner, whose logits must agree. A model whose layout fits no
    slots, or that ignores the positions or the mask the static pass gives it, fails here.
    """
    vocab = model.config.get_text_config().vocab_size
    prompts = [[token % vocab for token in range(3, 9)], [9 % vocab, 10 % vocab]]
    chunks = [
        (torch.arange(11, 11 + 2 * width).view(2, width) % vocab, torch.ones((2, width), dtype=torch.long)),
        (torch.tensor([[5 % vocab], [6 % vocab]]), torch.ones((2, 1), dtype=torch.long)),
    ]
    chunks[0][1][1, : width - 1] = 0  # the second row's chunk is one token, left-padded
    try:
        with torch.inference_mode():
            batches = [make_runner(kind, model).adopt(prefill(model, prompts, 0)) for kind in (DYNAMIC, STATIC)]
            for input_ids, chunk_mask in chunks:
                expected, logits = (
                    batch.forward(input_ids, chunk_mask, logits_to_keep=input_ids.shape[1]).float() for batch in batches
                )
                real = chunk_mask[:, :, None].bool().to(logits.device)  # padding columns' logits are nobody's
                scale = float(expected.abs().max()) or 1.0
                error = float(((logits - expected).abs() * real).max()) / scale
                # Float32 differs by rounding only; half precision by a few ulps of the logits' scale.
                if error > (1e-4 if model.dtype == torch.float32 else 5e-2):
                    return f"its static passes' logits differ from the dynamic runner's by {error:.2g} of their scale"
    except Exception as error:  # noqa: BLE001 - whatever fails here would fail a request
        return f"{type(error).__name__}: {error}"
    return None


def choose_runner(models: Sequence[torch.nn.Module | None], width: int, rounds: int = 3, repeats: int = 3) -> str:
    """`auto`: the runner whose passes are faster on this machine, timed now.

    Each round times every model at batch 1, for one token (a draft step, a plain decoding step)
    and for `width` tokens (a verify pass), under each runner in turn; the runner with the smaller
    median round total wins, and a tie keeps `dynamic`. Rounds alternate the runners, so that a
    burst of load from another process does not fall on one of them alone. Where the static runner
    cannot serve a model (`static_error`), or fails while timed, `dynamic` serves, and the log says why.
    """
    for model in models:
        error = None if model is None else static_error(model, width)
        if error is not None:
            logger.warning("runner: auto chose dynamic: static cannot hold %s: %s", model_name(model), error)
            return DYNAMIC
    totals: dict[str, list[float]] = {DYNAMIC: [], STATIC: []}
    built = {kind: [make_runner(kind, model) for model in models if model is not None] for kind in totals}
    try:
        for _ in range(rounds):
            for kind, kind_runners in built.items():
                totals[kind].append(
                    sum(
                        time_runner_pass(runner, 1, 1, 64, repeats) + time_runner_pass(runner, 1, width, 64, repeats)
                        for runner in kind_runners
                    )
                )
    except Exception as error:  # noqa: BLE001 - static passed its check; dynamic serves, as it would without auto
        logger.warning("runner: auto chose dynamic: timing the runners failed: %s: %s", type(error).__name__, error)
        return DYNAMIC
    medians = {kind: statistics.median(seconds) for kind, seconds in totals.items()}
    choice = STATIC if medians[STATIC] < medians[DYNAMIC] else DYNAMIC
    logger.info(
        "runner: auto chose %s (per round, dynamic %.1f ms, static %.1f ms)",
        choice,
        medians[DYNAMIC] * 1e3,
        medians[STATIC] * 1e3,
    )
    return choice
