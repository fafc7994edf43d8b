"""package_mar: --draft is needed exactly when the config's drafter runs a draft model."""

from __future__ import annotations

import pytest
import yaml

from scripts.model_tools.package_mar import PackagingError, package


def write_config(folder, handler_section):
    path = folder / "model-config.yaml"
    path.write_text(yaml.safe_dump({"minWorkers": 1, "handler": handler_section}))
    return path


def test_ngram_archive_packs_the_target_alone(tiny_models_dir, tmp_path):
    config = write_config(tmp_path, {"target_model": "target", "drafter": "ngram"})
    output = package("lookup", tiny_models_dir / "target", None, config, tmp_path / "store", "no-archive")
    assert (output / "target" / "config.json").is_file()
    assert not (output / "draft").exists()
    assert (output / "handler" / "drafters" / "ngram.py").is_file()


def test_draft_rules_name_the_flag(tiny_models_dir, tmp_path):
    needs_draft = write_config(tmp_path, {"drafter": "hybrid"})
    with pytest.raises(PackagingError, match="--draft: .* hybrid, which needs a draft model"):
        package("m", tiny_models_dir / "target", None, needs_draft, tmp_path / "store")
    lookup = write_config(tmp_path, {"drafter": "ngram"})
    with pytest.raises(PackagingError, match="--draft: .* ngram, which uses no draft model"):
        package("m", tiny_models_dir / "target", tiny_models_dir / "draft", lookup, tmp_path / "store")
