"""scripts.bench.vocab_ops on a small vocabulary: every reduction timed against torch's own, checked equal."""

from __future__ import annotations

from scripts.bench import vocab_ops


def test_the_table_times_every_reduction_against_torch_s_own(capsys):
    assert vocab_ops.main(["--vocab", "3000", "--rows", "1,3", "--positions", "1,4", "--repeats", "1"]) == 0
    table = capsys.readouterr().out
    for op in ("argmax", "top-p, peaked", "top-p, flat", "sample", "confidence"):
        assert f"| {op} |" in table, op
    # A draw is timed for every shape, in float32 only (the warp's dtype).
    assert sum(line.startswith("| sample | float32 |") for line in table.splitlines()) == 4
