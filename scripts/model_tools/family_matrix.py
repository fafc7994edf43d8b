"""Writes docs/models.md's family x feature matrix from a run of the family tier (tests/models/test_families.py).

    python -m scripts.model_tools.family_matrix            # runs the tier (about a minute), rewrites the matrix
    python -m scripts.model_tools.family_matrix --check    # exits 1 where docs/models.md's matrix is not this run's

Each served family's row says, per check, whether its test passed in this run; each refused
family's row gives the reason loading gives. The matrix sits between two marker lines in
docs/models.md; the text around it is written by hand.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
DOC = REPO_ROOT / "docs" / "models.md"
TIER = "tests/models/test_families.py"
BEGIN, END = "<!-- family matrix: begin -->", "<!-- family matrix: end -->"
# Test function -> the column it fills (a test parametrized by runner fills one column per runner).
COLUMNS = {
    "test_greedy_output_is_the_targets_with_each_drafter_alone_and_batched": "greedy = `generate`, 4 drafters ({})",
    "test_a_seeded_request_does_not_depend_on_its_drafter": "seeded: drafter-independent",
    "test_the_prefix_cache_and_a_row_joining_mid_run_change_nothing": "prefix cache, joining row",
    "test_a_json_schema_answer_validates_and_speculation_does_not_change_it": "JSON schema",
}
RUNNERS = ("dynamic", "static")


class Outcomes:
    """A pytest plugin: each test's outcome by its node id."""

    def __init__(self) -> None:
        self.outcomes: dict[str, str] = {}

    def pytest_runtest_logreport(self, report) -> None:
        if report.when == "call" or report.outcome != "passed":
            self.outcomes[report.nodeid] = report.outcome


def run_tier() -> dict[str, str]:
    import pytest

    plugin = Outcomes()
    pytest.main([str(REPO_ROOT / TIER), "-q", "-p", "no:cacheprovider"], plugins=[plugin])
    return plugin.outcomes


def columns() -> list[str]:
    names = []
    for column in COLUMNS.values():
        names += [column.format(runner) for runner in RUNNERS] if "{}" in column else [column]
    return names


def cell(outcomes: dict[str, str], test: str, params: str) -> str:
    """Whether the test passed for these parameters (its id's brackets) in this run."""
    matches = [outcome for nodeid, outcome in outcomes.items() if nodeid.endswith(f"::{test}[{params}]")]
    if not matches:
        return "not run"
    return "yes" if all(outcome == "passed" for outcome in matches) else "**no**"


def matrix(outcomes: dict[str, str]) -> str:
    from handler.caches.kv_cache import check_cache_support
    from tests.models import test_families

    header = ["family", "config", *columns()]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for family in sorted(test_families.SERVED):
        cells = []
        for test, column in COLUMNS.items():
            runners = RUNNERS if "{}" in column else (None,)
            for runner in runners:
                cells.append(cell(outcomes, test, f"{family}-{runner}" if runner else family))
        lines.append(f"| {family} | `{test_families.SERVED[family][0]}` | " + " | ".join(cells) + " |")
    lines += ["", "Refused at load, with the reason loading gives:", ""]
    lines += ["| family | config | reason |", "|---|---|---|"]
    for family in sorted(test_families.REFUSED):
        config_class, fields = test_families.REFUSED[family]
        try:
            check_cache_support(test_families.build(config_class, fields, 2, 0))
            reason = "**served** (the tier expects a refusal)"
        except ValueError as error:
            reason = str(error).replace("|", "\\|")
        lines.append(f"| {family} | `{config_class}` | {reason} |")
    return "\n".join(lines)


def rewritten(doc: str, table: str) -> str:
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args(argv)
    table = matrix(run_tier())
    doc = DOC.read_text(encoding="utf-8")
    new = rewritten(doc, table)
    if args.check:
        if new != doc:
            print("docs/models.md's matrix differs from this run's; run python -m scripts.model_tools.family_matrix")
            return 1
        return 0
    DOC.write_text(new, encoding="utf-8")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
