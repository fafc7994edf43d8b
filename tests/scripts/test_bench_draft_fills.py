"""scripts.bench.draft_fills runs end to end on the tiny pair: its table, one row a shape, and its checks
of the command line. No timing is asserted: the figures live in docs/benchmarks/."""

from __future__ import annotations

import re

import pytest

from scripts.bench import draft_fills
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.models  # loads and runs the tiny pair: not in the fast tier


def test_bench_draft_fills_prints_a_row_a_shape(tiny_models_dir, capsys):
    argv = [
        "--target", str(tiny_models_dir / "target"),
        "--draft", str(tiny_models_dir / "draft"),
        "--config", str(REPO_ROOT / "model-config" / "model-config.yaml"),
        "--dtype", "float32",
        "--shapes", "1x8,3x12",
        "--repeats", "1",
    ]  # fmt: skip
    assert draft_fills.main(argv) == 0
    out = capsys.readouterr().out
    number, ratio = r"\d+(\.\d+)?", r"\d+\.\d\dx"
    cells = rf"{number} \| {number} \| {number} \| {number} / {number} \| {ratio} \| {ratio} / {ratio}"
    for shape in ("1 x 8", "3 x 12"):
        assert re.search(rf"\| {shape} \| {cells} \|", out), out


@pytest.mark.parametrize("shapes", ["8", "0x10", "2x1", "2xten"])
def test_bench_draft_fills_refuses_a_bad_shape(shapes):
    with pytest.raises(SystemExit):
        draft_fills.parse_args(["--shapes", shapes])
