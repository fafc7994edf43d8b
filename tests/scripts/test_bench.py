"""scripts.bench runs end to end on the tiny pair and writes its three outputs.

No timing is asserted: benchmarks are programs, and their figures live in docs/benchmark.md.
"""

from __future__ import annotations

import json

import pytest

from scripts import bench

pytestmark = pytest.mark.models  # loads and runs the tiny pair: not in the fast tier


def test_bench_writes_json_markdown_and_plot(tiny_models_dir, tmp_path):

    out = tmp_path / "bench"
    bench.main(
        [
            "--target",
            str(tiny_models_dir / "target"),
            "--draft",
            str(tiny_models_dir / "draft"),
            "--dtype",
            "float32",
            "--draft-quantization",
            "int8",
            "--num-prompts",
            "2",
            "--max-new-tokens",
            "6",
            "--sweep-ks",
            "1,2",
            "--sweep-prompts",
            "1",
            "--sweep-max-new-tokens",
            "4",
            "--out-dir",
            str(out),
        ]
    )
    report = json.loads((out / "bench.json").read_text())
    assert [row["k"] for row in report["sweep"]] == [1, 2]
    assert report["greedy_outputs_differing_from_plain_decoding"] == 0
    methods = [row["method"] for row in report["main"]]
    assert methods[0].startswith("HF generate") and any(m.startswith("this engine, fixed") for m in methods)
    assert "| method |" in (out / "bench.md").read_text()
    assert (out / "bench.png").read_bytes()[:4] == b"\x89PNG"
