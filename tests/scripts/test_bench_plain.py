"""scripts.bench.plain runs end to end on the tiny pair: its table, and outputs equal in float32.

No timing is asserted: the figures live in docs/benchmark.md.
"""

from __future__ import annotations

import json
import re

import pytest

from scripts.bench import plain as bench_plain
from tests.conftest import REPO_ROOT

from .test_bench import FUNCTION, _prompt

pytestmark = pytest.mark.models  # loads and runs the tiny pair: not in the fast tier


def test_bench_plain_prints_both_rows_and_the_median_pair_ratio(tiny_models_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(
        json.dumps(
            {
                "open": {"tuning": [_prompt("Hello")], "held_out": [_prompt("Write a loop")]},
                "grounded": {"tuning": [_prompt("Hi")], "held_out": [_prompt("Rename total to s:\n" + FUNCTION)]},
            }
        )
    )
    assert (
        bench_plain.main(
            [
                "--target", str(tiny_models_dir / "target"),
                "--config", str(REPO_ROOT / "model-config" / "model-config.yaml"),
                "--dtype", "float32",
                "--prompts", str(prompts),
                "--num-prompts", "1",
                "--max-new-tokens", "8",
                "--pairs", "2",
            ]
        )
        == 0
    )  # fmt: skip
    out = capsys.readouterr().out
    assert re.search(r"\| HF `generate`, target only \| \d+\.\d\d \(\d+\.\d\d-\d+\.\d\d\) \|", out)
    assert re.search(r"\| this engine, k=0 \| \d+\.\d\d \(\d+\.\d\d-\d+\.\d\d\) \|", out)
    assert re.search(r"engine / HF per pair: median \d+\.\d{3}x .*, 4 pairs\)", out)
    assert "same greedy output on 2/2 prompts" in out  # float32: token for token


def test_bench_plain_refuses_zero_pairs():
    with pytest.raises(SystemExit):
        bench_plain.parse_args(["--pairs", "0"])
