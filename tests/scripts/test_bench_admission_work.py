"""scripts.bench.admission_work counts the work of an admitting step on the CPU; counts, no timing."""

from __future__ import annotations

import pytest

from scripts.bench import admission_work

pytestmark = pytest.mark.models  # builds and runs models of the real pair's cache layout: not in the fast tier


def test_the_table_counts_each_runners_admissions(capsys):
    assert admission_work.main(["--rows", "2", "--prompt-tokens", "8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(index for index, line in enumerate(lines) if line.startswith("| runner | k |"))
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[header + 2 :] if line]
    assert [(row[0], row[1]) for row in rows] == [(kind, k) for kind in ("dynamic", "static") for k in ("0", "2")]
    passes = {(row[0], row[1]): row[2] for row in rows}
    for kind in ("dynamic", "static"):
        assert passes[kind, "0"] == "target 2x8, target 2x1"
        # Drafting rows: the target prefills the whole prompts (the first tokens), the draft the same
        # width (the first tokens pending), once for both rows.
        assert passes[kind, "2"] == "target 2x8, draft 2x8, draft 2x1, draft 2x1, target 2x3"
    num_layers = admission_work.LAYOUTS["target"][0]
    static_plain = next(row for row in rows if row[:2] == ["static", "0"])
    # Into the slots: one copy per layer for the keys and one for the values, and a few of the step's own.
    assert 2 * num_layers <= int(static_plain[5]) < 3 * num_layers
