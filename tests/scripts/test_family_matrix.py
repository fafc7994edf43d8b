"""scripts.model_tools.family_matrix: the matrix in docs/models.md covers every family of the tier, and is rendered
from the tier's outcomes (a failing check shows as **no**, a check that did not run as "not run")."""

from __future__ import annotations

import pytest

from scripts.model_tools import family_matrix
from tests.models import test_families

pytestmark = pytest.mark.models  # builds the refused families' models


def test_the_doc_lists_every_family_the_tier_serves_or_refuses():
    doc = family_matrix.DOC.read_text(encoding="utf-8")
    table = doc.split(family_matrix.BEGIN, 1)[1].split(family_matrix.END, 1)[0]
    rows = {line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| ") and "| `" in line}
    assert rows == set(test_families.SERVED) | set(test_families.REFUSED)
    assert "**no**" not in table and "not run" not in table


def test_outcomes_become_cells():
    test = "test_a_seeded_request_does_not_depend_on_its_drafter"
    greedy = "test_greedy_output_is_the_targets_with_each_drafter_alone_and_batched"
    outcomes = {
        f"tests/models/test_families.py::{test}[llama]": "passed",
        f"tests/models/test_families.py::{test}[gpt2]": "failed",
        f"tests/models/test_families.py::{greedy}[llama-static]": "passed",
    }
    table = family_matrix.matrix(outcomes)
    llama = next(line for line in table.splitlines() if line.startswith("| llama |"))
    gpt2 = next(line for line in table.splitlines() if line.startswith("| gpt2 |"))
    assert llama.split(" | ")[2:5] == ["not run", "yes", "yes"]  # greedy dynamic, greedy static, seeded
    assert gpt2.split(" | ")[4] == "**no**"
    assert "cannot be rolled back" in table  # the refused families' reasons
