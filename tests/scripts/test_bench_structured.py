"""scripts.bench.structured runs end to end on the tiny pair and reports what it measured.

No timing is asserted (benchmarks are programs): what is checked is the report's
shape, and, in float32, that every method gives the constrained plain decoding's
tokens for every request.
"""

from __future__ import annotations

import json

import pytest

from scripts.bench import structured as bench_structured
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.models  # loads and runs the tiny pair: not in the fast tier


def test_bench_structured_reports_every_method_with_plain_decoding_s_output(tiny_models_dir, tmp_path, capsys):
    out = tmp_path / "structured.json"
    bench_structured.main(
        [
            *("--target", str(tiny_models_dir / "target"), "--draft", str(tiny_models_dir / "draft")),
            *("--config", str(REPO_ROOT / "model-config" / "model-config.yaml")),
            *("--runs", "1", "--validate-requests", "4"),
            *("--max-new-tokens", "60", "--out", str(out)),
        ]
    )
    report = json.loads(out.read_text())
    assert set(report["sets"]) == {"extraction", "tool call"}
    for rows in report["sets"].values():
        assert [row["speedup"] for row in rows][0] == 1.0
        for row in rows:
            assert row["same_output_as_plain"] == row["num_requests"], row
        assert rows[-1]["forced_share"] > 0  # the shipped row proposes the grammar's forced tokens
        assert rows[1]["forced_share"] == 0  # the row without them does not
    assert set(report["mask_share"]) == {"batch 1", "batch 8"}
    assert report["validation"]["requests"] == 4
    printed = capsys.readouterr().out
    assert "| constrained plain decoding (k=0) |" in printed and "Validation:" in printed
