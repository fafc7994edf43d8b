"""The test harness's split of the cores between pytest-xdist workers (tests/conftest.py)."""

from __future__ import annotations

import os

import pytest

from tests.conftest import worker_cores


@pytest.mark.parametrize(("num_cores", "count"), [(2, 2), (16, 2), (16, 16), (5, 2), (3, 4), (1, 3), (8, 3)])
def test_the_workers_split_the_cores_without_overlap_and_none_goes_without(num_cores, count):
    cores = [10 + 2 * core for core in range(num_cores)]  # any ids: an affinity mask need not start at 0
    shares = [worker_cores(cores, index, count) for index in range(count)]
    assert all(shares), shares
    assert all(set(share) <= set(cores) for share in shares)
    if count <= num_cores:
        assert sorted(core for share in shares for core in share) == cores, "each core to one worker"
        assert max(map(len, shares)) - min(map(len, shares)) <= 1, "even shares"
    else:
        assert {core for share in shares for core in share} == set(cores)


def test_a_worker_runs_on_its_own_share_of_the_cores():
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if worker is None or not hasattr(os, "sched_getaffinity"):
        pytest.skip("not in a pytest-xdist worker (make test runs one per core)")
    import torch

    affinity = sorted(os.sched_getaffinity(0))
    assert torch.get_num_threads() == len(affinity)
    if int(count) > 1:
        assert len(affinity) < os.cpu_count(), "a worker holds every core"
