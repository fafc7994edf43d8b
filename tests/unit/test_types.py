"""handler.types: the shared request and result types import neither torch nor transformers, and
`SpeculativeStats.merge` adds several rows' counters up as their sum."""

from __future__ import annotations

import subprocess
import sys

from handler.types import SpeculativeStats


def test_the_types_import_no_torch():
    code = "import sys, handler.types; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_merge_adds_counts_per_drafter_and_position_and_keeps_the_first_settings():
    one = SpeculativeStats(4, "hybrid", completion_tokens=10, target_forward_passes=5)
    one.record("model", 3, 2)
    one.record("ngram", 4, 4)
    two = SpeculativeStats(4, "hybrid", completion_tokens=6, target_forward_passes=3, fell_back=True)
    two.record("model", 2, 0)
    merged = SpeculativeStats.merge([one, two])
    assert (merged.num_speculative_tokens, merged.drafter, merged.fell_back) == (4, "hybrid", True)
    assert merged.draft_tokens == 9 and merged.accepted_tokens == 6 and merged.num_drafts == 3
    assert merged.draft_tokens_by_drafter == {"model": 5, "ngram": 4}
    assert merged.accepted_per_position == [2, 2, 1, 1]
    assert merged.target_forward_passes == 5 + 3 + 3 and merged.completion_tokens == 16
    assert SpeculativeStats.merge([one]).as_dict() == one.as_dict()
    assert one.draft_tokens == 7, "the rows' own counters are left as they were"
