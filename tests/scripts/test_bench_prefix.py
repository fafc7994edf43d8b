"""scripts.bench.prefix runs end to end on the tiny pair and reports what it measured.

No timing is asserted (benchmarks are programs): what is checked is that both
tables print, that with the cache on every turn after the first finds the
conversation's earlier turns cached, and, in float32, that every greedy output
is the same with the cache on and off.
"""

from __future__ import annotations

import json

import pytest

from scripts.bench import prefix as bench_prefix
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.models  # loads and runs the tiny pair: not in the fast tier


def test_bench_prefix_prints_both_tables_with_hits_and_the_same_output(tiny_models_dir, tmp_path, capsys):
    out = tmp_path / "prefix.json"
    # Sizes for the tiny pair's 1,024-token context: its tokenizer spends about 3 tokens where Qwen's spends 1.
    bench_prefix.main(
        [
            *("--target", str(tiny_models_dir / "target"), "--draft", str(tiny_models_dir / "draft")),
            *("--config", str(REPO_ROOT / "model-config" / "model-config.yaml"), "--dtype", "float32"),
            *("--system-tokens", "120", "--num-tools", "1", "--turns", "3", "--turn-tokens", "8"),
            *("--users", "4", "--shared-tokens", "100", "--load-tokens", "8", "--rate", "50"),
            *("--repeats", "2", "--out", str(out)),
        ]
    )
    report = json.loads(out.read_text())
    turns = report["multi_turn"]["turns"]
    assert [turn["turn"] for turn in turns] == [1, 2, 3]
    assert all(turn["cached_tokens"] > 0 for turn in turns[1:]), turns
    # Each turn finds at least the whole previous prompt: the system prompt, tools and earlier turns.
    assert all(turn["cached_tokens"] >= previous["prompt_tokens"] - 1 for previous, turn in zip(turns, turns[1:]))
    assert report["multi_turn"]["identical"]
    assert report["multi_turn"]["prefix_cache_stats"]["hits"] > 0
    assert report["differences"] == {"num_outputs": 3 + 4, "num_differ": 0, "median_first_difference": None}
    load = report["shared_prompt"]
    assert load["off"]["cached_tokens"] == 0 and load["on"]["prompt_tokens"] == load["off"]["prompt_tokens"]
    assert load["on"]["cached_tokens"] > 0  # the first user arrives alone; the others find the system prompt
    assert all(len(runs) == 2 for runs in load["runs"].values())
    printed = capsys.readouterr().out
    assert "**Multi-turn chat**" in printed and "| turn | prompt tokens | cached tokens |" in printed
    assert "**Shared system prompt under load**" in printed and "| on/off |" in printed
    assert "Greedy outputs, cache on vs off (float32): 0 of 7 differ" in printed
