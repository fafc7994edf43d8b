"""The prefix cache's byte budget: the configured size, or a share of the memory free at start-up.

`prefix_cache_max_bytes: 0` (the default) asks for `AUTO_FRACTION` of the
memory available once the models are loaded, on the device the target sits on:

- CUDA: the device's free memory (`torch.cuda.mem_get_info`), which counts
  every process on the GPU.
- CPU (and any other device, whose memory is the host's): the smaller of the
  machine's `MemAvailable` and, in a container, its cgroup's limit minus its
  usage (cgroup v2, else v1). Without /proc, the available pages `os.sysconf`
  reports.

The file paths are arguments, so that tests can point them at fake files.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Callable

import torch

from handler.config import HandlerConfig

# The automatic budget's share of the available memory. The running batch needs the rest:
# its own KV (prompt + max_new_tokens per row, which max_batch_tokens bounds), the
# activations of a verify pass, and the prefill of a long prompt, none of which may fail
# for want of memory that history holds.
AUTO_FRACTION = 0.25
MEMINFO_PATH = Path("/proc/meminfo")
CGROUP_ROOT = Path("/sys/fs/cgroup")
# cgroup v1 writes "no limit" as the largest page-aligned signed 64-bit number
# (9223372036854771712); anything from 2**60 bytes (1 EiB) up is read as no limit.
CGROUP_V1_NO_LIMIT = 1 << 60
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


def host_available_memory(
    *,
    meminfo_path: Path = MEMINFO_PATH,
    cgroup_root: Path = CGROUP_ROOT,
    sysconf: Callable[[str], int] = os.sysconf,
) -> tuple[int, str]:
    """The host memory this process may still take: MemAvailable, capped by its cgroup's room."""
    available = meminfo_available(meminfo_path)
    where = f"MemAvailable in {meminfo_path}"
    if available is None:
        available = sysconf("SC_AVPHYS_PAGES") * sysconf("SC_PAGE_SIZE")
        where = "available pages (sysconf)"
    room = cgroup_room(cgroup_root)
    if room is not None and room[0] < available:
        return room
    return available, where


def meminfo_available(meminfo_path: Path = MEMINFO_PATH) -> int | None:
    """`MemAvailable` in bytes, or None when the file or the line is missing."""
    try:
        text = meminfo_path.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name == "MemAvailable":
            fields = value.split()  # e.g. "16302412 kB"
            if fields and fields[0].isdigit():
                return int(fields[0]) * (1024 if fields[1:] == ["kB"] else 1)
    return None


def cgroup_room(cgroup_root: Path = CGROUP_ROOT) -> tuple[int, str] | None:
    """The container's memory limit minus its usage, in bytes; None when there is no limit.

    cgroup v2 keeps `memory.max` and `memory.current` in its root; v1 keeps
    `memory.limit_in_bytes` and `memory.usage_in_bytes` under `memory/`.
    """
    v2_limit = _read(cgroup_root / "memory.max")
    if v2_limit is not None:
        usage = _read(cgroup_root / "memory.current")
        if v2_limit == "max" or not v2_limit.isdigit() or usage is None or not usage.isdigit():
            return None
        return max(0, int(v2_limit) - int(usage)), "cgroup v2 memory.max minus memory.current"
    v1 = cgroup_root / "memory"
    v1_limit, usage = _read(v1 / "memory.limit_in_bytes"), _read(v1 / "memory.usage_in_bytes")
    if v1_limit is None or usage is None or not v1_limit.isdigit() or not usage.isdigit():
        return None
    if int(v1_limit) >= CGROUP_V1_NO_LIMIT:
        return None
    return max(0, int(v1_limit) - int(usage)), "cgroup v1 memory.limit_in_bytes minus memory.usage_in_bytes"


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def describe(budget: MemoryBudget | None) -> str:
    """The start-up log's phrase for a budget."""
    if budget is None:
        return "off (handler.prefix_cache: false)"
    return f"{budget.num_bytes / MIB:.0f} MiB ({budget.source})"
