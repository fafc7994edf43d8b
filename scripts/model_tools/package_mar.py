#!/usr/bin/env python3
"""Package a target/draft model pair and the handler into one TorchServe archive.

The archive is self-contained; unpacked, it looks like this:

    spec_handler.py        entry point (the archiver copies --handler to the root)
    handler/               the handler package, imported as `handler.*`
    target/                the target model folder (config, weights, tokenizer)
    draft/                 the draft model folder
    model-config.yaml      the --config file (worker and handler settings)
    MAR-INF/MANIFEST.json

torch-model-archiver flattens every folder given in --extra-files into the
archive root, so two model folders given separately would overwrite each
other's config.json. Instead, one staging folder holding handler/, target/ and
draft/ (the models as symlinks, which the archiver follows) is passed as the
single extra-files entry.

The archiver copies everything into a scratch folder before zipping, so
packaging needs free space for about twice the model size under the system
temp folder (set TMPDIR to move it). For large models, --archive-format
zip-store skips the (useless) compression of the weights and is much faster.

Usage:
    python -m scripts.model_tools.package_mar --model-name tiny-spec \\
        --target models/tiny/target --draft models/tiny/draft \\
        --config model-config/model-config.yaml --export-path model_store

--target and --draft are local folders. To serve a pair without an archive (and
without copying its weights), from folders or Hub ids, use scripts.launch.
"""

from __future__ import annotations

import argparse
import logging
import re
import shutil
import sys
import tempfile
from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
HANDLER_PACKAGE = REPO_ROOT / "handler"
HANDLER_ENTRY = "spec_handler.py"
MODEL_VERSION = "1.0"

# torch-model-archiver's own rule for model names.
MODEL_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_\-.]*$")
ARCHIVE_SUFFIXES = {"default": ".mar", "zip-store": ".mar", "no-archive": ""}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")
IGNORED_IN_HANDLER = shutil.ignore_patterns("__pycache__", "*.pyc", ".*")


class PackagingError(Exception):
    """An input problem the user must fix; the message says what to change."""


def check_model_dir(path: Path, role: str, need_tokenizer: bool) -> None:
    """Raise PackagingError unless `path` looks like a save_pretrained folder."""
    if not path.is_dir():
        raise PackagingError(f"--{role}: {path} is not a folder")
    if not (path / "config.json").is_file():
        raise PackagingError(
            f"--{role}: {path} has no config.json; pass a Hugging Face model folder (the output of save_pretrained)"
        )
    if not any(any(path.glob(pattern)) for pattern in WEIGHT_PATTERNS):
        raise PackagingError(f"--{role}: {path} has no weights ({' or '.join(WEIGHT_PATTERNS)})")
    if need_tokenizer and not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise PackagingError(
            f"--{role}: {path} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
            "the handler loads the tokenizer from the target folder, so save it there "
            "with tokenizer.save_pretrained(...)"
        )


def check_config(path: Path) -> dict:
    """Read the model-config YAML and check its outline; returns the mapping."""
    if not path.is_file():
        raise PackagingError(f"--config: {path} not found (see model-config/model-config.yaml)")
    try:
        config = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as error:
        raise PackagingError(f"--config: {path} is not valid YAML: {error}") from error
    if not isinstance(config, dict) or not isinstance(config.get("handler"), dict):
        raise PackagingError(f"--config: {path} needs a `handler:` section (see model-config/model-config.yaml)")
    return config


def check_handler_section(config: dict, path: Path):
    """Parse the handler section with the handler's own parser, as the worker will.

    A typo then fails here, not minutes later when a worker starts.
    """
    from handler.config import handler_config_from_yaml_config

    try:
        return handler_config_from_yaml_config(config)
    except ValueError as error:
        raise PackagingError(f"--config: {path}: {error}") from error


def check_draft_needed(handler_config, draft: Path | None, path: Path) -> None:
    """--draft is required exactly when the config's drafter runs a draft model."""
    if handler_config.draft_model is not None and draft is None:
        raise PackagingError(
            f"--draft: {path} sets handler.drafter: {handler_config.drafter}, which needs a draft model; "
            "pass --draft, or set handler.drafter: ngram or suffix (and no draft_model) to draft without one"
        )
    if handler_config.draft_model is None and draft is not None:
        raise PackagingError(
            f"--draft: {path} sets handler.drafter: {handler_config.drafter}, which uses no draft model; drop --draft, "
            "or set handler.drafter: model or hybrid with draft_model: draft"
        )


def warn_about_model_paths(config: dict) -> None:
    """The archive holds target/ and draft/; say so if the config looks elsewhere."""
    from handler.drafters import MODEL_FREE

    for key, packed_as in (("target_model", "target"), ("draft_model", "draft")):
        if key not in config["handler"] and key == "draft_model" and config["handler"].get("drafter") in MODEL_FREE:
            continue
        value = config["handler"].get(key)
        if value != packed_as:
            print(
                f"warning: handler.{key} is {value!r}, so the handler will not load the "
                f"packed {packed_as}/ folder; set it to {packed_as!r} to use it",
                file=sys.stderr,
            )


def stage(staging: Path, target: Path, draft: Path | None) -> None:
    """Lay out handler/, target/ and draft/ (when there is one) under `staging`."""
    shutil.copytree(HANDLER_PACKAGE, staging / "handler", ignore=IGNORED_IN_HANDLER)
    # Symlinks, not copies: the archiver's copytree follows them, so the model
    # files are read once, straight into the archiver's scratch folder.
    (staging / "target").symlink_to(target, target_is_directory=True)
    if draft is not None:
        (staging / "draft").symlink_to(draft, target_is_directory=True)


def package(
    model_name: str,
    target: Path,
    draft: Path | None,
    config_file: Path,
    export_path: Path,
    archive_format: str = "default",
    force: bool = False,
) -> Path:
    """Validate the inputs and write the archive. Returns the archive's path.

    Raises:
        PackagingError: an input is missing or malformed.
    """
    if not MODEL_NAME_PATTERN.match(model_name):
        raise PackagingError(
            f"--model-name {model_name!r}: use letters, digits, '_', '-' and '.', starting with a letter or digit"
        )
    if archive_format not in ARCHIVE_SUFFIXES:
        raise PackagingError(f"--archive-format must be one of {sorted(ARCHIVE_SUFFIXES)}")
    if not (HANDLER_PACKAGE / HANDLER_ENTRY).is_file():
        raise PackagingError(f"handler entry point {HANDLER_PACKAGE / HANDLER_ENTRY} not found")
    target = target.resolve()
    check_model_dir(target, "target", need_tokenizer=True)
    config = check_config(config_file)
    check_draft_needed(check_handler_section(config, config_file), draft, config_file)
    warn_about_model_paths(config)
    if draft is not None:
        draft = draft.resolve()
        check_model_dir(draft, "draft", need_tokenizer=False)

    export_path.mkdir(parents=True, exist_ok=True)
    output = export_path / f"{model_name}{ARCHIVE_SUFFIXES[archive_format]}"
    if output.exists():
        if not force:
            raise PackagingError(f"{output} already exists; pass --force to overwrite it")
        # The archiver writes no-archive output into an existing folder without
        # emptying it first, which would keep stale files; start clean.
        if output.is_dir() and not output.is_symlink():
            shutil.rmtree(output)
        else:
            output.unlink()

    # Imported here: the validation above should not wait for the archiver.
    from model_archiver.model_archiver_config import ModelArchiverConfig
    from model_archiver.model_packaging import package_model
    from model_archiver.model_packaging_utils import ModelExportUtils

    with tempfile.TemporaryDirectory(prefix=f"{model_name}-package-") as scratch:
        staging = Path(scratch) / "staging"
        staging.mkdir()
        stage(staging, target, draft)
        archiver_config = ModelArchiverConfig(
            model_name=model_name,
            handler=str(staging / "handler" / HANDLER_ENTRY),
            version=MODEL_VERSION,
            extra_files=str(staging),
            export_path=str(export_path),
            archive_format=archive_format,
            force=force,
            config_file=str(config_file),
        )
        # The archiver copies into tempfile.gettempdir()/<model name> and
        # deletes whatever is there first; point it into our own scratch
        # folder so that two packagings never share (or leak) that folder.
        saved_tempdir = tempfile.tempdir
        tempfile.tempdir = scratch
        try:
            package_model(archiver_config, manifest=ModelExportUtils.generate_manifest_json(archiver_config))
        finally:
            tempfile.tempdir = saved_tempdir
    return output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="See the module docstring for the archive layout.",
    )
    parser.add_argument("--model-name", required=True, help="archive and model name")
    parser.add_argument(
        "--target", required=True, type=Path, help="target model folder (local; scripts.launch also takes Hub ids)"
    )
    parser.add_argument("--draft", type=Path, help="draft model folder (needed unless the config's drafter is ngram)")
    parser.add_argument("--config", required=True, type=Path, help="model-config YAML")
    parser.add_argument("--export-path", required=True, type=Path, help="folder for the archive (model store)")
    parser.add_argument(
        "--archive-format",
        choices=sorted(ARCHIVE_SUFFIXES),
        default="default",
        help="default: compressed .mar; zip-store: uncompressed .mar (faster for "
        "large weights); no-archive: a plain folder",
    )
    parser.add_argument("--force", action="store_true", help="overwrite an existing archive")
    args = parser.parse_args(argv)

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s - %(message)s")
    try:
        output = package(
            args.model_name,
            args.target,
            args.draft,
            args.config,
            args.export_path,
            archive_format=args.archive_format,
            force=args.force,
        )
    except PackagingError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
