"""The prefix cache's budget: configured, off, or a quarter of the memory available (fake /proc and cgroup files)."""

from __future__ import annotations

import pytest
import torch

from handler.config import HandlerConfig
from handler.runtime import memory_budget
from handler.runtime.memory_budget import AUTO_FRACTION, MemoryBudget, describe, prefix_cache_budget

GIB = 2**30
MEMINFO = """MemTotal:       32000000 kB
MemFree:         1000000 kB
MemAvailable:   16777216 kB
Buffers:          100000 kB
"""  # MemAvailable: 16 GiB
V1_NO_LIMIT = "9223372036854771712"


def never_called(_name: str) -> int:
    raise AssertionError("sysconf is only the fallback when /proc/meminfo is missing")


def budget_on_cpu(tmp_path, meminfo: str | None = MEMINFO, cgroup: dict[str, str] | None = None, **kwargs):
    """The automatic budget on the CPU, with /proc/meminfo and the cgroup files written under tmp_path."""
    meminfo_path = tmp_path / "meminfo"
    if meminfo is not None:
        meminfo_path.write_text(meminfo)
    cgroup_root = tmp_path / "cgroup"
    for relative, text in (cgroup or {}).items():
        (cgroup_root / relative).parent.mkdir(parents=True, exist_ok=True)
        (cgroup_root / relative).write_text(text + "\n")
    kwargs.setdefault("sysconf", never_called)
    return prefix_cache_budget(
        HandlerConfig(), torch.device("cpu"), meminfo_path=meminfo_path, cgroup_root=cgroup_root, **kwargs
    )


def test_off_and_configured_budgets_read_no_memory(tmp_path):
    assert prefix_cache_budget(HandlerConfig(prefix_cache=False), torch.device("cpu")) is None
    configured = prefix_cache_budget(
        HandlerConfig(prefix_cache_max_bytes=512 * 2**20), torch.device("cpu"), meminfo_path=tmp_path / "absent"
    )
    assert configured == MemoryBudget(512 * 2**20, "handler.prefix_cache_max_bytes")
    assert describe(configured).startswith("512 MiB") and describe(None).startswith("off")


def test_without_a_container_limit_it_is_a_quarter_of_mem_available(tmp_path):
    budget = budget_on_cpu(tmp_path)
    assert AUTO_FRACTION == 0.25
    assert budget.num_bytes == 4 * GIB and "MemAvailable" in budget.source


@pytest.mark.parametrize(
    "cgroup",
    [
        {"memory.max": "max", "memory.current": str(GIB)},  # cgroup v2, no limit
        {"memory/memory.limit_in_bytes": V1_NO_LIMIT, "memory/memory.usage_in_bytes": str(GIB)},  # v1, no limit
        {"memory.max": str(64 * GIB), "memory.current": str(GIB)},  # more room than the machine has
    ],
)
def test_a_cgroup_without_a_binding_limit_leaves_mem_available(tmp_path, cgroup):
    budget = budget_on_cpu(tmp_path, cgroup=cgroup)
    assert budget.num_bytes == 4 * GIB and "MemAvailable" in budget.source


def test_a_cgroup_v2_limit_caps_the_budget_at_a_quarter_of_its_room(tmp_path):
    budget = budget_on_cpu(tmp_path, cgroup={"memory.max": str(10 * GIB), "memory.current": str(2 * GIB)})
    assert budget.num_bytes == 2 * GIB and "cgroup v2" in budget.source


def test_a_cgroup_v1_limit_caps_the_budget_at_a_quarter_of_its_room(tmp_path):
    cgroup = {"memory/memory.limit_in_bytes": str(6 * GIB), "memory/memory.usage_in_bytes": str(2 * GIB)}
    budget = budget_on_cpu(tmp_path, cgroup=cgroup)
    assert budget.num_bytes == GIB and "cgroup v1" in budget.source


def test_a_cgroup_over_its_limit_leaves_no_room(tmp_path):
    budget = budget_on_cpu(tmp_path, cgroup={"memory.max": str(GIB), "memory.current": str(GIB + 4096)})
    assert budget.num_bytes == 0


def test_without_proc_meminfo_it_falls_back_to_sysconf(tmp_path):
    pages = {"SC_AVPHYS_PAGES": 2 * 2**20, "SC_PAGE_SIZE": 4096}  # 8 GiB
    budget = budget_on_cpu(tmp_path, meminfo=None, sysconf=pages.__getitem__)
    assert budget.num_bytes == 2 * GIB and "sysconf" in budget.source
    no_line = budget_on_cpu(tmp_path, meminfo="MemTotal: 1 kB\n", sysconf=pages.__getitem__)
    assert no_line.num_bytes == 2 * GIB


def test_on_cuda_it_is_a_quarter_of_the_free_device_memory(monkeypatch):
    asked = []

    def mem_get_info(device):
        asked.append(device)
        return 40 * GIB, 80 * GIB  # (free, total)

    monkeypatch.setattr(memory_budget.torch.cuda, "mem_get_info", mem_get_info)
    budget = prefix_cache_budget(HandlerConfig(), torch.device("cuda:1"))
    assert asked == [torch.device("cuda:1")]
    assert budget.num_bytes == 10 * GIB and "cuda:1" in budget.source
