"""The README stays true to the code: its REST table, its config keys, its links."""

from __future__ import annotations

import dataclasses
import re

import yaml

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


# The README marks a value that is not the default with a comment that starts so.
NOT_THE_DEFAULT = re.compile(r"#\s*not the default\b")
# TorchServe's own defaults for the worker keys the block shows (its model-config.yaml documentation);
# minWorkers and maxWorkers default to one worker per GPU or CPU core.
TORCHSERVE_DEFAULTS = {"continuousBatching": False, "batchSize": 1, "maxBatchDelay": 100, "responseTimeout": 120,
                       "startupTimeout": 120}  # fmt: skip


def config_block() -> tuple[dict, set[str]]:
    """The README's config block, parsed, and the keys (`handler.` and `handler.sampling.` prefixed for
    the handler's) whose line marks the value as not the default."""
    block = re.search(r"```yaml\n(.*?)```", section("Configuration"), re.DOTALL).group(1)
    marked, parents = set(), []
    for line in block.splitlines():
        match = re.match(r"( *)(\w+):", line)
        if not match:
            continue
        depth = len(match.group(1)) // 2
        parents = parents[:depth] + [match.group(2)]
        if NOT_THE_DEFAULT.search(line):
            marked.add(".".join(parents))
    return yaml.safe_load(block), marked


def test_config_block_values_are_the_defaults_or_marked_as_not():
    raw, marked = config_block()
    handler = dict(raw.pop("handler"))
    sampling = handler.pop("sampling")
    # Parsed as the handler parses them ("64MiB" is a byte count), then compared one by one.
    parsed = HandlerConfig.from_dict({**handler, "sampling": sampling})
    default = HandlerConfig()
    shown = [(f"handler.{key}", getattr(parsed, key), getattr(default, key)) for key in handler]
    shown += [(f"handler.sampling.{key}", getattr(parsed.sampling, key), getattr(default.sampling, key))
              for key in sampling]  # fmt: skip
    shown += [(key, value, TORCHSERVE_DEFAULTS.get(key)) for key, value in raw.items()]
    for key, value, default_value in shown:
        if key in marked:
            assert value != default_value, f"the README marks {key}: {value} as not the default, but it is"
        else:
            assert value == default_value, f"the README shows {key}: {value}; the default is {default_value}"
    assert {"minWorkers", "maxWorkers"} <= marked, "one worker per GPU or core is TorchServe's default"


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
