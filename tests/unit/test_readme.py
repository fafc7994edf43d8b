"""The README stays true to the code: its REST table, its config keys, its links."""

from __future__ import annotations

import dataclasses
import re

from handler.config import HandlerConfig, SamplingParams
from handler.schema import FINISH_REASONS, REQUEST_FIELDS
from tests.conftest import REPO_ROOT

README = (REPO_ROOT / "README.md").read_text(encoding="utf-8")


def section(title: str) -> str:
    start = README.index(f"## {title}")
    end = README.find("\n## ", start + 1)
    return README[start : end if end >= 0 else None]


def test_rest_table_lists_exactly_the_request_fields():
    rows = re.findall(r"^\| `(\w+)` \|", section("REST API"), re.MULTILINE)
    assert rows == list(REQUEST_FIELDS)
    for reason in FINISH_REASONS:
        assert f"`{reason}`" in section("REST API")


def test_config_example_shows_every_handler_key():
    shown = set(re.findall(r"^ {2,4}(\w+):", section("Configuration"), re.MULTILINE))
    names = {field.name for field in dataclasses.fields(HandlerConfig)}
    # logit_bias is a request field only: a config default for it would bias every request.
    names |= {field.name for field in dataclasses.fields(SamplingParams)} - {"logit_bias"}
    assert names <= shown, names - shown


def test_relative_links_point_at_files_that_exist():
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", README):
        assert (REPO_ROOT / target).exists(), target
    for doc in ("docs/benchmark.md", "docs/operations.md"):
        text = (REPO_ROOT / doc).read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
            assert (REPO_ROOT / "docs" / target).exists(), f"{doc}: {target}"


def layout_paths() -> list[str]:
    """The paths the layout table names: a row's later entries are relative to its first one's folder
    (`handler/engine/`, `runners/` names handler/runners/)."""
    paths = []
    for cell in re.findall(r"^\| ([^|]*`[^|]*) \|", section("Layout"), re.MULTILINE):
        names = re.findall(r"`([^`]+)`", cell)
        base = names[0].rstrip("/").rpartition("/")[0]
        paths.append(names[0])
        paths += [f"{base}/{name}" if base and "/" not in name.rstrip("/") else name for name in names[1:]]
    return paths


def test_the_layout_table_matches_the_handler_tree():
    named = set(layout_paths())
    handler_paths = {path for path in named if path.startswith("handler/")}
    for path in handler_paths:
        assert (REPO_ROOT / path).exists(), path
    for entry in sorted((REPO_ROOT / "handler").iterdir()):
        if entry.name.startswith(("_", ".")):
            continue
        relative = f"handler/{entry.name}" + ("/" if entry.is_dir() else "")
        assert relative in handler_paths, f"the README's layout table does not name {relative}"
