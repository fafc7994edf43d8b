"""What the benchmarks share: the machine's description, the start-up cost table, number formats and
percentiles. Imports torch only where a function needs it, so that the HTTP load test can use it."""

from __future__ import annotations

import os
import platform

# The CPU features that decide which kernels a forward pass can use.
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


def machine_info() -> dict:
    """CPU model, cores, the CPU features that matter to the kernels, memory, library versions."""
    import torch
    import transformers

    from handler.runtime.host import cpu_model_and_flags, meminfo_total, usable_cpu_cores

    cpu, flags = platform.processor() or platform.machine(), []
    read = cpu_model_and_flags()
    if read is not None:
        cpu = read[0] or cpu
        flags = [flag for flag in CPU_FLAGS if flag in read[1]]
    mem_bytes = meminfo_total()
    mem_gib = None if mem_bytes is None else mem_bytes / 2**30
    usable = usable_cpu_cores()  # the affinity mask, bounded by a container's CPU limit
    info = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "torch_threads": torch.get_num_threads(),
        "cpu_flags": flags,
        "memory_gib": round(mem_gib, 1) if mem_gib else None,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }
    info["description"] = (
        f"{cpu}, {info['cores']} cores ({usable} usable, {info['torch_threads']} torch threads), "
        f"flags {' '.join(flags) or 'none of ' + ' '.join(CPU_FLAGS)}"
        + (f", {info['memory_gib']} GiB" if mem_gib else "")
        + (f", GPU {info['gpu']}" if info["gpu"] else "")
        + f"; torch {info['torch']}, transformers {info['transformers']}"
    )
    return info


def start_up_cost_table(models, config, max_batch_size: int, **options):
    """The cost table measured afresh, as the handler measures it at start-up, and printed
    (`handler.planning.measure.measure_for_config`; `options`: max_k, runner)."""
    from handler.planning.measure import measure_for_config

    cost_table = measure_for_config(models, config, max_batch_size, **options)
    print("Cost table, measured at start:\n" + cost_table.format(), flush=True)
    return cost_table


def fmt(value, pattern: str = "{:.2f}") -> str:
    """A table cell: the value in `pattern`, or "-" for none."""
    return "-" if value is None else pattern.format(value)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between closest ranks; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)
