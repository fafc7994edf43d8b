"""scripts.bench.load runs end to end on the tiny pair and reports what it measured.

No timing is asserted (benchmarks are programs): what is checked is that every
load and row is measured and printed, that every step's plan and timings are
recorded, that the plot is written, and, in float32, that every greedy output
equals plain decoding's whatever the load.
"""

from __future__ import annotations

import json

import pytest

from scripts.bench import load as bench_load
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.models  # loads and runs the tiny pair: not in the fast tier


def test_bench_load_measures_every_load_and_row_with_the_plain_rows_outputs(tiny_models_dir, tmp_path, capsys):
    bench_load.main(
        [
            *("--target", str(tiny_models_dir / "target"), "--draft", str(tiny_models_dir / "draft")),
            *("--config", str(REPO_ROOT / "model-config" / "qwen-coder.yaml"), "--dtype", "float32"),
            *("--draft-quantization", "none", "--rows", "shipped,plain,k2,ngram", "--concurrency", "1,3"),
            *("--rates", "40", "--open-requests", "4", "--max-new-tokens", "8", "--warm-tokens", "4"),
            *("--out-dir", str(tmp_path)),
        ]
    )
    report = json.loads((tmp_path / "load.json").read_text())
    assert list(report["loads"]) == ["C=1", "C=3", "40 req/s"]
    for name, cells in report["loads"].items():
        assert list(cells) == ["shipped", "plain", "k2", "ngram"]
        assert cells["plain"]["vs_plain"] == 1.0 and cells["plain"]["mean_k"] == 0.0
        assert all(cell["outputs_differ"] == 0 for cell in cells.values()), "float32: every output is plain's"
        assert cells["k2"]["mean_width"] > 1.0
        assert all(0.0 <= cell["drafting_share"] <= 1.0 for cell in cells.values())
        if name.startswith("C="):  # a closed loop holds C in flight until its last request is sent
            assert all(cell["steady_tokens_per_s"] > 0 for cell in cells.values())
            assert cells["plain"]["steady_vs_plain"] == 1.0
    steps = report["raw"]["C=3"]["shipped"][0]
    assert max(step["batch_size"] for step in steps) == 3
    assert all(len(step["ks"]) == step["batch_size"] for step in steps)
    assert all(step["tokens"] >= step["batch_size"] for step in steps), "every row emits a token a step"
    assert (tmp_path / "load.png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert "| C=3 | plain decoding (k=0) |" in printed and "Where the time goes" in printed


def test_each_warm_up_starts_with_empty_suffix_trees_as_each_measure_does(monkeypatch):
    """The warm-ups at each concurrency serve the same first prompts: with the trees kept, the look-ups
    the engine judges there would have the answers, and its verdicts would be a warm server's, while
    the measures start with empty trees."""
    from types import SimpleNamespace

    events = []
    engine = SimpleNamespace(forget_suffix_history=lambda: events.append("forget"))
    monkeypatch.setattr(bench_load, "build_engine", lambda *args, **kwargs: engine)
    monkeypatch.setattr(
        bench_load, "drive", lambda _engine, requests, _arrivals, concurrency: events.append(("serve", concurrency))
    )
    bench = object.__new__(bench_load.Bench)
    bench.models, bench.settings, bench.cost_table, bench.engines = None, None, None, {}
    bench.warm_concurrency, bench.warm_tokens, bench.max_new_tokens = [1, 4, 8], 4, 8
    bench.sampling = bench_load.GREEDY
    row = bench_load.Row("shipped", "as shipped", bench_load.HYBRID, 8, True)
    assert bench.engine(row, [(1, 2, 3)] * 16) is engine
    assert events == ["forget", ("serve", 1), "forget", ("serve", 4), "forget", ("serve", 8)]
