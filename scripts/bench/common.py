"""What the benchmarks share: the demo pair's paths, the prompt sets, the machine's description, the
start-up cost table, number formats, percentiles and the report writer. Imports torch only where a
function needs it, so that the HTTP load test can use it. The in-process runner that the engine
benchmarks share is `scripts.bench.runner`."""

from __future__ import annotations

import json
import os
import pathlib
import platform

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
DEFAULT_TARGET = REPO_ROOT / "models" / "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = REPO_ROOT / "models" / "qwen2.5-coder-0.5b-instruct"
DEFAULT_CONFIG = REPO_ROOT / "model-config" / "qwen-coder.yaml"
PROMPT_SETS = ("open", "grounded")
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


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where two outputs differ, or None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def describe_cost_table(table) -> dict:
    """The measured grid in milliseconds: target by batch size and width, draft step by batch size."""
    return {
        "widths": list(table.widths),
        "batch_sizes": list(table.batch_sizes),
        "target_ms": [[1e3 * seconds for seconds in row] for row in table.target],
        "draft_ms": None if table.draft is None else [1e3 * seconds for seconds in table.draft],
    }


def shown(path: str) -> str:
    """A model path as the report shows it: relative to the repository when inside it."""
    try:
        return str(pathlib.Path(path).resolve().relative_to(REPO_ROOT))
    except ValueError:
        return path


def load_prompt_sets(path: pathlib.Path, num_prompts: int, sweep_prompts: int) -> dict:
    """The prompt sets, each cut to its first `sweep_prompts` tuning and `num_prompts` held-out prompts."""
    raw = json.loads(path.read_text(encoding="utf-8"))
    sets = {}
    for name in PROMPT_SETS:
        if name not in raw:
            raise ValueError(f"{path}: no prompt set {name!r}")
        tuning, held_out = raw[name]["tuning"][:sweep_prompts], raw[name]["held_out"][:num_prompts]
        if not tuning or not held_out:
            raise ValueError(f"{path}: the {name!r} set needs tuning and held_out prompts")
        sets[name] = {"description": raw[name].get("description", name), "tuning": tuning, "held_out": held_out}
    return sets


def write_report(out: pathlib.Path, stem: str, report: dict, to_markdown, to_plot=None, indent: int = 2) -> None:
    """Writes `stem`.json, .md and (with `to_plot`) .png into `out`, and prints the table."""
    written = [write_json(out / f"{stem}.json", report, indent), out / f"{stem}.md"]
    table = to_markdown(report)
    written[1].write_text(table)
    if to_plot is not None:
        written.append(out / f"{stem}.png")
        to_plot(report, written[-1])
    print(table)
    print(f"wrote {', '.join(str(path) for path in written)}")


def write_json(path: pathlib.Path, report: dict, indent: int = 2) -> pathlib.Path:
    """Writes the report as JSON at `path`, its folder made as needed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=indent))
    return path
