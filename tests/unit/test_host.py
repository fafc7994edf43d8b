"""The host's facts, read from fake /proc and cgroup files: memory, CPU limits, the CPU's flags."""

from __future__ import annotations

import pytest

from handler.runtime.host import (
    cgroup_cpu_limit,
    cpu_description,
    cpu_model_and_flags,
    meminfo_available,
    meminfo_total,
)

MEMINFO = """MemTotal:       32000000 kB
MemFree:         1000000 kB
MemAvailable:   16777216 kB
"""


def test_meminfo_fields_are_read_in_bytes(tmp_path):
    path = tmp_path / "meminfo"
    path.write_text(MEMINFO)
    assert meminfo_total(path) == 32000000 * 1024
    assert meminfo_available(path) == 16777216 * 1024
    assert meminfo_total(tmp_path / "absent") is None and meminfo_available(tmp_path / "absent") is None
    path.write_text("MemTotal: many kB\n")
    assert meminfo_total(path) is None


def test_the_cpu_description_names_the_kernel_flags_or_the_platform():
    read = cpu_model_and_flags()
    description = cpu_description()
    assert description
    if read is not None and any(flag.startswith("avx") for flag in read[1]):
        assert "avx" in description


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"cpu.max": "800000 100000\n"}, 8),  # cgroup v2: limits.cpu "8"
        ({"cpu.max": "150000 100000\n"}, 2),  # 1.5 cores: rounded up
        ({"cpu.max": "max 100000\n"}, None),
        ({"cpu/cpu.cfs_quota_us": "400000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 4),  # cgroup v1
        ({"cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"}, None),
        ({}, None),  # no cgroup files: no limit known
    ],
)
def test_a_containers_cpu_limit_bounds_the_threads(tmp_path, files, expected):
    # A pod limited to 8 cores on a 64-core node still has all 64 in its affinity mask.
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cgroup_cpu_limit(str(tmp_path)) == expected
