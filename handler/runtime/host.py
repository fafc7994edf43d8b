"""Facts about the host this worker runs on, read from /proc and the cgroup files in one place.

Memory: the machine's `MemAvailable` and, in a container, its cgroup's limit minus its usage
(cgroup v2, else v1); without /proc, the available pages `os.sysconf` reports. Processors: the
cores this process may use (its affinity mask, bounded by a cgroup's CPU quota) and the CPU's
model and instruction-set flags. The file paths are arguments, so that tests can point them at
fake files.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Callable

MEMINFO_PATH = Path("/proc/meminfo")
CGROUP_ROOT = Path("/sys/fs/cgroup")
# cgroup v1 writes "no limit" as the largest page-aligned signed 64-bit number
# (9223372036854771712); anything from 2**60 bytes (1 EiB) up is read as no limit.
CGROUP_V1_NO_LIMIT = 1 << 60


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
    return _meminfo_field("MemAvailable", meminfo_path)


def _meminfo_field(field: str, meminfo_path: Path) -> int | None:
    try:
        text = meminfo_path.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name == field:
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


def meminfo_total(meminfo_path: Path = MEMINFO_PATH) -> int | None:
    """`MemTotal` in bytes, or None when the file or the line is missing."""
    return _meminfo_field("MemTotal", meminfo_path)


def cgroup_cpu_limit(root: str | Path = CGROUP_ROOT) -> int | None:
    """The CPU limit of this process's cgroup in whole cores (rounded up), or None when unlimited.

    A container's CPU limit (Kubernetes `resources.limits.cpu`, `docker run
    --cpus`) is a CFS quota, not an affinity mask: the process still sees every
    core of the node, and one thread per node core would be throttled to the
    quota. cgroup v2 writes it as `cpu.max` ("QUOTA PERIOD" or "max PERIOD"),
    cgroup v1 as `cpu.cfs_quota_us` and `cpu.cfs_period_us` (quota -1: none).
    """

    def read(*names: str) -> list[str] | None:
        texts = (_read(Path(root) / name) for name in names)
        return next((text.split() for text in texts if text is not None), None)

    v2 = read("cpu.max")
    if v2 is not None and len(v2) == 2:
        quota, period = v2
    else:
        v1_quota = read("cpu/cpu.cfs_quota_us", "cpu,cpuacct/cpu.cfs_quota_us")
        v1_period = read("cpu/cpu.cfs_period_us", "cpu,cpuacct/cpu.cfs_period_us")
        if not v1_quota or not v1_period:
            return None
        quota, period = v1_quota[0], v1_period[0]
    try:
        quota_us, period_us = int(quota), int(period)
    except ValueError:  # "max": no limit
        return None
    if quota_us <= 0 or period_us <= 0:
        return None
    return max(1, -(-quota_us // period_us))


def usable_cpu_cores() -> int:
    """The cores this process may use: its affinity mask, bounded by its cgroup's CPU limit."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    limit = cgroup_cpu_limit()
    return cores if limit is None else min(cores, limit)


def cpu_model_and_flags() -> tuple[str | None, list[str]] | None:
    """The CPU's model name (None if not given) and flags, from /proc/cpuinfo; None where it cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            fields = {}
            for line in cpuinfo:
                name, _, value = line.partition(":")
                fields.setdefault(name.strip(), value.strip())
                if "model name" in fields and "flags" in fields:
                    break
    except OSError:
        return None
    return fields.get("model name"), fields.get("flags", "").split()


def cpu_description() -> str:
    """The CPU's model name and instruction-set flags: the things that decide its GEMM kernels."""
    cpu = cpu_model_and_flags()
    if cpu is None:
        return f"{platform.machine()} {platform.processor()}"
    model, flags = cpu
    kernel_flags = sorted(flag for flag in flags if flag.startswith(("avx", "amx", "fma")))
    return f"{model or platform.processor()} [{' '.join(kernel_flags)}]"
