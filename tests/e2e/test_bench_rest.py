"""scripts.bench --rest-only against the real TorchServe of conftest.py (tiny pair).

It measures the archive's config against target-only decoding through the same
server (`num_speculative_tokens: 0`), alternating the two, and writes both.
"""

from __future__ import annotations

import json

from tests.conftest import run_module


def test_rest_bench_measures_the_config_against_target_only_through_the_same_server(server, tmp_path):
    result = run_module(
        "scripts.bench",
        *("--rest-only", "--rest-url", server.inference_url, "--model", server.model_name, "--key-file", ""),
        *("--num-prompts", "2", "--runs", "2", "--max-new-tokens", "6", "--out-dir", str(tmp_path)),
    )
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}\n{server.log_tail()}"
    rest = json.loads((tmp_path / "bench_rest.json").read_text())["rest"]
    sequential = rest["sequential"]
    assert len(sequential["runs"]["shipped"]) == len(sequential["runs"]["target_only"]) == 2
    assert min(sequential["runs"]["shipped"] + sequential["runs"]["target_only"]) > 0
    assert sequential["ratio"] == sequential["tokens_per_second"] / sequential["target_only_tokens_per_second"]
    assert 0 < sequential["acceptance_rate"] <= 1
    assert rest["batch_of_4"]["concurrent_tokens_per_second"] > 0
    assert "target-only through the same server" in result.stdout
