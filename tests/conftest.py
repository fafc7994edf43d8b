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
"""

from __future__ import annotations

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
