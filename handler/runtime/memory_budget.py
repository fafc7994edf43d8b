"""The prefix cache's byte budget: the configured size, or a share of the memory free at start-up.

`prefix_cache_max_bytes: 0` (the default) asks for `AUTO_FRACTION` of the
memory available once the models are loaded, on the device the target sits on:

- CUDA: the device's free memory (`torch.cuda.mem_get_info`), which counts
  every process on the GPU.
- CPU (and any other device, whose memory is the host's): the smaller of the
  machine's `MemAvailable` and, in a container, its cgroup's limit minus its
  usage (`handler.runtime.host.host_available_memory`).

The file paths are arguments, so that tests can point them at fake files.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Callable

import torch

from handler.config import HandlerConfig
from handler.runtime.host import CGROUP_ROOT, MEMINFO_PATH, host_available_memory

# The automatic budget's share of the available memory. The running batch needs the rest:
# its own KV (prompt + max_new_tokens per row, which max_batch_tokens bounds), the
# activations of a verify pass, and the prefill of a long prompt, none of which may fail
# for want of memory that history holds.
AUTO_FRACTION = 0.25
MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class MemoryBudget:
    num_bytes: int
    source: str  # where the figure came from, for the start-up log


def prefix_cache_budget(
    config: HandlerConfig,
    device: torch.device,
    *,
    meminfo_path: Path = MEMINFO_PATH,
    cgroup_root: Path = CGROUP_ROOT,
    sysconf: Callable[[str], int] = os.sysconf,
) -> MemoryBudget | None:
    """The prefix cache's bytes for both models together; None when the config turns the cache off.

    Args:
        config: `prefix_cache` and `prefix_cache_max_bytes` (0: automatic).
        device: where the target sits; call after the models are loaded.
    """
    if not config.prefix_cache:
        return None
    if config.prefix_cache_max_bytes:
        return MemoryBudget(config.prefix_cache_max_bytes, "handler.prefix_cache_max_bytes")
    available, where = available_memory(device, meminfo_path=meminfo_path, cgroup_root=cgroup_root, sysconf=sysconf)
    return MemoryBudget(
        int(available * AUTO_FRACTION), f"{AUTO_FRACTION:.0%} of the {available // MIB} MiB available, {where}"
    )


def available_memory(
    device: torch.device,
    *,
    meminfo_path: Path = MEMINFO_PATH,
    cgroup_root: Path = CGROUP_ROOT,
    sysconf: Callable[[str], int] = os.sysconf,
) -> tuple[int, str]:
    """The bytes free now on `device`, and a phrase saying where the figure came from."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free, f"free memory on {device}"
    return host_available_memory(meminfo_path=meminfo_path, cgroup_root=cgroup_root, sysconf=sysconf)


def describe(budget: MemoryBudget | None) -> str:
    """The start-up log's phrase for a budget."""
    if budget is None:
        return "off (handler.prefix_cache: false)"
    return f"{budget.num_bytes / MIB:.0f} MiB ({budget.source})"
