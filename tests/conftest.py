"""Shared fixtures and the test tiers.

Tiers, one pytest marker each, given by a test's folder (a module may name its
own with `pytestmark`):

- unit: tests/unit (handler/) and tests/scripts (scripts/); fast, `make test-fast`;
- statistical: tests/statistical, chi-square tests of the output distribution;
- models: tests/models, the engine and the handler on tiny random models;
- e2e: tests/e2e, a real TorchServe on free loopback ports;
- deploy: tests/deploy, static checks of the Dockerfile and the manifests.

The one model fixture, `tiny_models_dir`, builds the tiny random target/draft
pair offline, once per session.
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
}
TIERS = frozenset(TIER_BY_FOLDER.values())


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
    """A folder with `target/` and `draft/`, made by scripts.make_tiny_models once per session."""
    out = tmp_path_factory.mktemp("tiny-models")
    subprocess.run(
        [sys.executable, "-m", "scripts.make_tiny_models", "--out", str(out)],
        cwd=REPO_ROOT,
        check=True,
        capture_output=True,
        text=True,
    )
    return out
