"""Shared fixtures: a tiny random target/draft pair built on the fly, offline."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


@pytest.fixture(scope="session")
def tiny_models_dir(tmp_path_factory) -> pathlib.Path:
    """A folder with `target/` and `draft/`, made by scripts/make_tiny_models.py once per session."""
    out = tmp_path_factory.mktemp("tiny-models")
    subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "make_tiny_models.py"), "--out", str(out)],
        check=True,
        capture_output=True,
        text=True,
    )
    return out
