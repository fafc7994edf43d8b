"""Measuring the cost table at start-up, through the runner that serves, and caching it on disk.

Each grid point times a chunk of `width` new tokens appended to a cached context of about
`CONTEXT_LENGTH` tokens per row, with `logits_to_keep = width`, as the engine calls the
models. A measurement that takes long is cached as JSON in a folder the caller names, keyed by
`machine_key` and `model_fingerprint` and the grid; any change re-measures.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import tempfile
import time
from typing import Any, Sequence

import torch

from handler.planning.cost_table import CostTable, sparse_grid
from handler.runtime.host import cpu_description

logger = logging.getLogger(__name__)

# Tokens already in each row's cache when a chunk is timed: a short, typical decoding context.
CONTEXT_LENGTH = 100
# Bumped whenever the measuring method changes, so that old cached tables are re-measured.
FORMAT_VERSION = 2
CACHE_FILE_PREFIX = "cost_table-"
# A writable folder that outlives the worker, in which to cache cost tables instead of the model
# dir: TorchServe unpacks a .mar into a new temporary folder at every start, and a mounted model
# store is read-only, so without it every start measures again (deploy/README.md). Tables of
# other machines or models sit beside each other there, under their own keys.
COST_TABLE_DIR_ENV = "SPEC_COST_TABLE_DIR"


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def machine_key(device: torch.device) -> dict[str, Any]:
    """What the timings depend on besides the models: the processor, the threads and torch."""
    if device.type == "cuda":
        processor = torch.cuda.get_device_name(device)
    else:
        processor = cpu_description()
    return {
        "device": device.type,
        "processor": processor,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def model_fingerprint(model: torch.nn.Module | None) -> dict[str, Any] | None:
    """The model's architecture, parameter dtypes and layer types (an int8 draft differs from a bf16 one)."""
    if model is None:
        return None
    config = model.config.to_dict()
    for volatile in ("_name_or_path", "transformers_version"):
        config.pop(volatile, None)
    layer_types = sorted({type(module).__name__ for module in model.modules()})
    dtypes = sorted({str(parameter.dtype) for parameter in model.parameters()})
    digest = hashlib.sha256(json.dumps([config, layer_types, dtypes], sort_keys=True, default=str).encode())
    return {"config_sha256": digest.hexdigest()[:16], "dtypes": dtypes}


@torch.inference_mode()
def _time_grid(
    target: torch.nn.Module,
    draft: torch.nn.Module | None,
    widths: Sequence[int],
    batch_sizes: Sequence[int],
    repeats: int,
    warmups: int,
    runner: str,
) -> tuple[list[list[float]], list[float] | None]:
    from handler.runners import make_runner, random_batch, timed_pass

    device = _device_of(target)
    generator = torch.Generator().manual_seed(0)

    def prefilled(model, batch_size: int):
        # The running batch as the engine holds it: prefilled, then adopted by the serving runner.
        return random_batch(make_runner(runner, model), batch_size, CONTEXT_LENGTH, generator)

    def timed_chunk(model, cache, batch_size: int, width: int) -> float:
        vocab = model.config.get_text_config().vocab_size
        return timed_pass(cache, torch.randint(0, vocab, (batch_size, width), generator=generator), device)

    target_caches = {batch: prefilled(target, batch) for batch in batch_sizes}
    draft_caches = {batch: prefilled(draft, batch) for batch in batch_sizes} if draft is not None else {}
    target_samples = {(batch, width): [] for batch in batch_sizes for width in widths}
    draft_samples = {batch: [] for batch in draft_caches}
    # Repeats are the outer loop: a burst of load from another process spreads over every
    # grid point instead of inflating one of them.
    for repeat in range(warmups + repeats):
        for batch in batch_sizes:
            for width in widths:
                seconds = timed_chunk(target, target_caches[batch], batch, width)
                if repeat >= warmups:
                    target_samples[batch, width].append(seconds)
            if draft is not None:
                seconds = timed_chunk(draft, draft_caches[batch], batch, 1)
                if repeat >= warmups:
                    draft_samples[batch].append(seconds)

    target_grid = [[statistics.median(target_samples[batch, width]) for width in widths] for batch in batch_sizes]
    # A wider chunk or a bigger batch never costs less: a noisy dip would make speculation look
    # free, a noisy spike would make it look hopeless. Isotonic fits along each axis pool the
    # out-of-order neighbours into their mean instead of letting one outlier set the rest.
    target_grid = [_isotonic(row) for row in target_grid]
    columns = [_isotonic(list(column)) for column in zip(*target_grid)]
    target_grid = [_running_max(list(row)) for row in zip(*columns)]
    draft_grid = None
    if draft is not None:
        draft_grid = _isotonic([statistics.median(draft_samples[batch]) for batch in batch_sizes])
    return target_grid, draft_grid


def _isotonic(values: list[float]) -> list[float]:
    """The non-decreasing sequence closest to `values` in least squares (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [sum, count] of each pooled block
    for value in values:
        blocks.append([value, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(int(count))]


def _running_max(values: list[float]) -> list[float]:
    return [max(values[: i + 1]) for i in range(len(values))]


def cost_table_cache_dir(model_dir: str | None) -> str | None:
    """The folder to cache the cost table in: $SPEC_COST_TABLE_DIR when set (created if missing), else model_dir."""
    folder = os.environ.get(COST_TABLE_DIR_ENV, "").strip()
    if not folder:
        return model_dir
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as error:
        logger.warning(
            "%s=%s cannot be created (%s); caching the cost table in the model dir", COST_TABLE_DIR_ENV, folder, error
        )
        return model_dir
    return folder


def _cache_path(cache_dir: str, key: dict[str, Any]) -> str:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(cache_dir, f"{CACHE_FILE_PREFIX}{digest}.json")


def _read_cached(path: str, key: dict[str, Any]) -> CostTable | None:
    try:
        with open(path, encoding="utf-8") as file:
            cached = json.load(file)
        if cached.get("key") != key:
            return None
        return CostTable.from_json(cached["table"])
    except (OSError, ValueError, KeyError, TypeError, AssertionError) as error:
        if not isinstance(error, FileNotFoundError):
            logger.warning("ignoring the cached cost table %s: %s", path, error)
        return None


def _write_cached(path: str, key: dict[str, Any], table: CostTable) -> None:
    # Written to a temporary file and renamed, so a worker never reads half a table.
    try:
        folder = os.path.dirname(path)
        with tempfile.NamedTemporaryFile("w", dir=folder, suffix=".tmp", delete=False, encoding="utf-8") as file:
            json.dump({"key": key, "table": table.to_json()}, file, indent=1)
        os.replace(file.name, path)
    except OSError as error:
        logger.warning("cannot cache the cost table in %s (%s); it will be measured again next start", path, error)


def measure_cost_table(
    target: torch.nn.Module,
    draft: torch.nn.Module | None,
    max_width: int,
    max_batch_size: int,
    *,
    repeats: int = 3,
    warmups: int = 1,
    cache_dir: str | None = None,
    model_identity: str = "",
    runner: str = "dynamic",
) -> CostTable:
    """Times the target and the draft on their real device and dtype, or reads a cached table.

    Args:
        target: the target causal LM, in eval mode, on its device.
        draft: the draft causal LM, or None when no draft model drafts (n-gram look-up).
        max_width: the widest verification, max_num_speculative_tokens + 1.
        max_batch_size: the most rows decoded together (TorchServe's batchSize).
        repeats: timed runs per grid point; the table holds their median.
        warmups: untimed runs over the whole grid first (allocator, kernel choice, caches).
        cache_dir: a folder (the model dir) in which to cache the table as JSON; None never caches.
        model_identity: names the archive (model name and version), part of the cache key.
        runner: the runner that serves ("dynamic" or "static", `handler.runners`): passes are
            timed through it, as the engine will run them.

    Returns:
        The CostTable over widths sparse_grid(max_width) and batch sizes sparse_grid(max_batch_size).
    """
    assert max_width >= 1 and max_batch_size >= 1 and repeats >= 1, (max_width, max_batch_size, repeats)
    widths = sparse_grid(max_width, dense_up_to=4)
    batch_sizes = sparse_grid(max_batch_size)
    device = _device_of(target)
    key = {
        "format": FORMAT_VERSION,
        "machine": machine_key(device),
        "model_identity": model_identity,
        "target": model_fingerprint(target),
        "draft": model_fingerprint(draft),
        "widths": list(widths),
        "batch_sizes": list(batch_sizes),
        "context_length": CONTEXT_LENGTH,
        "runner": runner,
    }
    path = _cache_path(cache_dir, key) if cache_dir else None
    if path is not None:
        cached = _read_cached(path, key)
        if cached is not None:
            logger.info("cost table read from %s", path)
            return cached
    start = time.perf_counter()
    target_grid, draft_grid = _time_grid(target, draft, widths, batch_sizes, repeats, warmups, runner)
    table = CostTable(
        widths=widths,
        batch_sizes=batch_sizes,
        target=tuple(tuple(row) for row in target_grid),
        draft=None if draft_grid is None else tuple(draft_grid),
    )
    logger.info("cost table measured in %.1f s", time.perf_counter() - start)
    if path is not None:
        _write_cached(path, key, table)
    return table


def measure_for_config(models, config, max_batch_size: int, *, max_k: int | None = None, **options) -> CostTable:
    """The cost table a handler config needs for its loaded models (`handler.runtime.loading.LoadedModels`):
    as wide as the draft model's largest k (`max_k`; None: the config's cap) or the longest look-up,
    plus the pending token. `options` go to `measure_cost_table` (cache_dir, model_identity, runner)."""
    max_drafts = config.max_num_speculative_tokens if max_k is None else max_k
    return measure_cost_table(
        models.target,
        models.draft,
        max_width=max(max_drafts, config.prompt_lookup_num_tokens) + 1,
        max_batch_size=max_batch_size,
        **options,
    )
