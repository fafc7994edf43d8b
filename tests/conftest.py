"""Shared fixtures and the test tiers.

Tiers, one pytest marker each, given by a test's folder (a module may name its
own with `pytestmark`):

- unit: tests/unit (handler/) and tests/scripts (scripts/); fast, `make test-fast`;
- statistical: tests/statistical, chi-square tests of the output distribution;
- models: tests/models, the engine and the handler on tiny random models;
- e2e: tests/e2e, a real TorchServe on free loopback ports;
- deploy: tests/deploy, static checks of the Dockerfile and the manifests;
- cuda: tests/cuda, the engine on a GPU; skipped without one (`make test-gpu`).

`--runner static` runs every engine the tests build without naming a runner on
the static runner (`handler.runners`) instead of the dynamic one; `make test`
runs the engine's exactness and distribution tests under both, `make test-static`
the whole model and statistical tiers on the static runner. The tests in tests/cuda need a
GPU and are skipped without one (`make test-gpu` runs them).

The one model fixture, `tiny_models_dir`, builds the tiny random target/draft
pair offline, once per session; `tiny_tokenizer` is the pair's tokenizer alone,
for the unit tier, without building the models.

`make test` spreads the tests over one pytest-xdist worker per usable core
(`-n auto`). Each worker is pinned to its own share of the cores and runs
torch on that many threads, as do the servers and scripts it starts: two
processes each spinning torch's threads over every core slow each other down
many times. Session fixtures (the tiny pair, the e2e TorchServe) are built once
per worker. `-n 0` runs everything in one process.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
TESTS_DIR = REPO_ROOT / "tests"
TIER_BY_FOLDER = {
    "unit": "unit",
    "scripts": "unit",
    "statistical": "statistical",
    "models": "models",
    "e2e": "e2e",
    "deploy": "deploy",
    "cuda": "cuda",
}
TIERS = frozenset(TIER_BY_FOLDER.values())


def run_module(module: str, *args: str, timeout_s: float = 300, check: bool = False) -> subprocess.CompletedProcess:
    """`python -m module args` from the repository root, as the Makefile runs the scripts; output captured."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=check,
    )


def pytest_addoption(parser):
    parser.addoption(
        "--runner",
        choices=("dynamic", "static"),
        default="dynamic",
        help="the runner of engines built without one named (handler.runners)",
    )


def pytest_configure(config):
    from handler import runners

    runners.DEFAULT_RUNNER = config.getoption("--runner")
    _pin_xdist_worker()


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto`: one worker per core this process may use (affinity and a container's CPU limit)."""
    from handler.runtime.host import usable_cpu_cores

    return usable_cpu_cores()


def _pin_xdist_worker() -> None:
    """In a pytest-xdist worker: this worker's share of the usable cores, and torch's threads to match.

    Processes the worker starts (scripts, TorchServe and its model workers) inherit the affinity,
    and `handler.runtime.host.usable_cpu_cores` counts it, so a server's `cpu_threads: 0` takes the
    worker's share too.
    """
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if worker is None or count is None or not hasattr(os, "sched_setaffinity"):
        return
    import torch

    from handler.runtime.host import usable_cpu_cores

    share = worker_cores(
        sorted(os.sched_getaffinity(0))[: usable_cpu_cores()], int(worker.removeprefix("gw")), int(count)
    )
    os.sched_setaffinity(0, share)
    torch.set_num_threads(len(share))


def worker_cores(cores: list[int], index: int, count: int) -> list[int]:
    """Worker `index` of `count`'s share of `cores`: a contiguous slice, never empty (workers share
    a core only where there are more workers than cores)."""
    return cores[index * len(cores) // count : (index + 1) * len(cores) // count] or [cores[index % len(cores)]]


def pytest_collection_modifyitems(config, items):
    for item in items:
        if TIERS & {marker.name for marker in item.iter_markers()}:
            continue
        folder = pathlib.Path(item.path).relative_to(TESTS_DIR).parts[0]
        assert folder in TIER_BY_FOLDER, (
            f"{item.nodeid}: put the test in one of the tier folders {sorted(TIER_BY_FOLDER)}"
        )
        item.add_marker(TIER_BY_FOLDER[folder])


@pytest.fixture(scope="session")
def tiny_models_dir(tmp_path_factory) -> pathlib.Path:
    """A folder with `target/` and `draft/`, made by scripts.model_tools.make_tiny_models once per session."""
    out = tmp_path_factory.mktemp("tiny-models")
    run_module("scripts.model_tools.make_tiny_models", "--out", str(out), check=True)
    return out


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory):
    """The tiny pair's tokenizer, loaded as the handler loads the target's."""
    from transformers import AutoTokenizer

    from scripts.model_tools import make_tiny_models

    out = tmp_path_factory.mktemp("tiny-tokenizer")
    make_tiny_models.save_tokenizer(out)
    return AutoTokenizer.from_pretrained(out)
