"""scripts.bench runs end to end on the tiny pair and writes its outputs.

No timing is asserted: benchmarks are programs, and their figures live in docs/benchmark.md.
What is checked is the shape of the report and, in float32, that every row of this
engine reproduces plain decoding token for token.
"""

from __future__ import annotations

import json

import pytest

from scripts.bench import common as bench_common
from scripts.bench import open_grounded as bench
from scripts.bench import runner as bench_runner
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.models  # loads and runs the tiny pair: not in the fast tier

FUNCTION = "def add(a, b):\n    total = a + b\n    return total\n"


def _prompt(text: str) -> dict:
    return {"messages": [{"role": "user", "content": text}]}


def test_bench_writes_json_markdown_and_plot(tiny_models_dir, tmp_path):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(
        json.dumps(
            {
                "open": {"tuning": [_prompt("Hello")], "held_out": [_prompt("Write a loop"), _prompt("Hi there")]},
                "grounded": {
                    "tuning": [_prompt("Add type hints:\n" + FUNCTION)],
                    "held_out": [_prompt("Rename total to s:\n" + FUNCTION), _prompt("Add a docstring:\n" + FUNCTION)],
                },
            }
        )
    )
    out = tmp_path / "bench"
    # the real prompt file parses and has enough held-out prompts for the default run
    sets = bench_common.load_prompt_sets(REPO_ROOT / "scripts" / "bench" / "prompts.json", 6, 1)
    assert all(len(s["held_out"]) == 6 for s in sets.values())
    bench.main(
        [
            "--target", str(tiny_models_dir / "target"),
            "--draft", str(tiny_models_dir / "draft"),
            "--config", str(REPO_ROOT / "model-config" / "model-config.yaml"),
            "--dtype", "float32",
            "--draft-quantization", "int8",
            "--prompts", str(prompts),
            "--num-prompts", "2",
            "--max-new-tokens", "6",
            "--runs", "2",
            "--sweep-ks", "1,2",
            "--sweep-max-new-tokens", "4",
            "--max-k", "3",
            "--cost-max-batch-size", "2",
            "--out-dir", str(out),
        ]
    )  # fmt: skip
    report = json.loads((out / "bench.json").read_text())
    assert report["machine"]["cpu"] and report["machine"]["torch"]
    assert report["cost_table"]["widths"] == [1, 2, 3, 4] and report["cost_table"]["batch_sizes"] == [1, 2]
    assert set(report["sets"]) == {"open", "grounded"}
    for data in report["sets"].values():
        keys = [row["key"] for row in data["rows"]]
        assert keys[:10] == [
            "hf_target_only", "hf_assisted", "hf_prompt_lookup_3", "hf_prompt_lookup_10",
            "engine_k0", "engine_fixed", "engine_planned", "engine_planned_tracker", "engine_ngram", "engine_hybrid",
        ]  # fmt: skip
        # The hybrid drafter at a fixed k has a row of its own only when the sweep preferred it; then the
        # look-up rows again with chains only.
        fixed = [] if report["sweep"]["hybrid_planned"] else ["engine_hybrid_fixed"]
        assert keys[10:] == [*fixed, "engine_ngram_chain", "engine_hybrid_chain"]
        for row in data["rows"]:
            assert len(row["runs_tokens_per_second"]) == 2
            assert row["same_outputs_every_run"]
            if row["drafter"] is not None:
                # float32: speculative greedy output is plain decoding's, token for token
                assert row["differences"]["engine k=0"] == [], row
    assert [int(k) for k in report["sweep"]["sets"]["open"]["engine_fixed"]] == [1, 2]
    table = (out / "bench.md").read_text()
    assert "| method |" in table and "Cost table" in table and "**grounded**" in table
    assert (out / "bench.png").read_bytes()[:4] == b"\x89PNG"


def test_sets_selects_the_prompt_sets_and_refuses_unknown_ones():
    assert bench.parse_args(["--sets", "grounded"]).sets == ["grounded"]
    assert bench.parse_args([]).sets == list(bench_common.PROMPT_SETS)
    with pytest.raises(SystemExit):
        bench.parse_args(["--sets", "open,closed"])


def test_an_engine_row_starts_with_empty_suffix_trees():
    """Rows share an engine: trees that learned another row's answers to the same prompts would propose
    them, so each engine row first has the engine forget them (`SpeculativeEngine.forget_suffix_history`)."""
    from types import SimpleNamespace

    forgotten = []
    engine = SimpleNamespace(forget_suffix_history=lambda: forgotten.append(True))
    runner = bench_runner.Runner(models=None, config=SimpleNamespace(draft_confidence=True), cost_table=None)
    runner.engines[True, True] = engine
    runner.run(bench_runner.engine_method("engine_hybrid", "hybrid", 4, planned=True), [], 8)
    assert forgotten == [True]


def test_the_machine_line_counts_the_cores_a_container_may_use(monkeypatch):
    # A CPU limit below the affinity mask (a container's) is what the run had: the line says so.
    from handler.runtime import host
    from scripts.bench import common as bench_common

    monkeypatch.setattr(host, "usable_cpu_cores", lambda: 1)
    info = bench_common.machine_info()
    assert info["usable_cores"] == 1
    assert "(1 usable, " in info["description"]
