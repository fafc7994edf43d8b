"""Serve a target/draft pair in one command: write its config, link it into the model store, start, register.

    python -m scripts.launch --target DIR_OR_HUB_ID --draft DIR_OR_HUB_ID \\
        [--drafter model|ngram|suffix|hybrid] [--set KEY=VALUE ...] [--model-name NAME] [--port 8080]

1. `--target` and `--draft` are each a model folder or a Hugging Face Hub id. A Hub id resolves through
   huggingface_hub's cache (`snapshot_download`): offline (`--offline` or HF_HUB_OFFLINE=1) from the
   cache alone, else it downloads what is missing.
2. The config is model-config/launch.yaml with `--drafter` and each `--set` applied, checked by the
   handler's own parser. KEY is a dotted path: a TorchServe worker key (`batchSize=8`) sets that, any
   other key the handler's (`num_speculative_tokens=4`, `sampling.temperature=0.7`); VALUE is YAML.
3. The model folder MODEL_STORE/NAME is TorchServe's no-archive layout, written without copying a
   weight: the handler's code, the config and MAR-INF/MANIFEST.json, and target/ and draft/ whose
   files are symbolic links to the models' own files. TorchServe links a no-archive folder into its
   temp folder (a .mar it would extract), so the worker reads the weights where they are.
4. The pair goes through the handler's load-time checks (`handler.runtime.loading.check_pair`: the
   tokenizers, the vocabularies, the caches) on empty models, and a pair the worker would refuse
   is refused with its message before anything starts.
5. TorchServe starts unless a server answers at the inference port already (it must then serve
   from the same model store and write its keys in this folder); a model registered under NAME is
   unregistered first, so a second run with other settings replaces the first (keeping the cost
   tables the first one measured, where they still hold).
6. It prints how to call the model: curl on the native and the OpenAI routes, and the `openai` client.

The server keeps running (`python -m scripts.serving.torchserve stop`, or `make stop`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import yaml

from scripts.model_tools import package_mar
from scripts.serving import torchserve

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TEMPLATE = REPO_ROOT / "model-config" / "launch.yaml"
DEFAULT_PORT = 8080  # management on PORT + 1, metrics + 2, gRPC + 3 and + 4
MODEL_CONFIG_FILE = "model-config.yaml"
# Written in each model folder this launcher makes; a folder without it is never replaced.
LAUNCH_RECORD = "launch.json"
# TorchServe's own model-config keys; every other key of --set is the handler's.
WORKER_KEYS = frozenset(
    {
        "minWorkers",
        "maxWorkers",
        "batchSize",
        "maxBatchDelay",
        "responseTimeout",
        "startupTimeout",
        "deviceType",
        "deviceIds",
        "continuousBatching",
        "jobQueueSize",
        "parallelLevel",
        "parallelType",
        "torchrun",
    }
)
# The launcher links the models as target/ and draft/; these keys must keep pointing there.
LINKED_KEYS = {"target_model": "target", "draft_model": "draft"}
# What a Hub download fetches: configs, tokenizers, chat templates and safetensors weights.
HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
OPENAI_PATH = f"/{package_mar.MODEL_VERSION}/v1"
INFERENCE_TRY = {"prompt": "def fibonacci(n):", "max_new_tokens": 32}


class LaunchError(Exception):
    """An input problem the user must fix, or a refusal; the message says which and what to change."""


# --- Arguments and config ----------------------------------------------------------------------


def parse_set(item: str) -> tuple[list[str], Any]:
    """`KEY=VALUE` -> (the key's path in model-config.yaml, the value read as YAML).

    A worker key (`batchSize`) is a top-level key; every other key is under `handler:`, with or
    without the `handler.` prefix.
    """
    key, separator, text = item.partition("=")
    key = key.strip()
    if not separator or not key:
        raise LaunchError(f"--set {item!r}: write KEY=VALUE, e.g. --set num_speculative_tokens=4")
    parts = key.split(".")
    if any(not part for part in parts):
        raise LaunchError(f"--set {item!r}: {key!r} is not a dotted key (e.g. sampling.temperature)")
    if parts[0] != "handler" and not (len(parts) == 1 and parts[0] in WORKER_KEYS):
        parts = ["handler", *parts]
    if parts[0] == "handler" and len(parts) == 2 and parts[1] in LINKED_KEYS:
        raise LaunchError(f"--set {item!r}: give the model with --{parts[1].removesuffix('_model')} instead")
    if parts == ["handler"]:
        raise LaunchError(f"--set {item!r}: set the handler's keys one by one (handler.KEY=VALUE)")
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise LaunchError(f"--set {item!r}: the value is not YAML: {error}") from error
    return parts, value


def build_config(template: dict, drafter: str | None, settings: list[str], has_draft: bool) -> dict:
    """The template with `drafter` and the `KEY=VALUE` settings applied (the template is not changed).

    A drafter that needs no draft model, or no --draft at all, drops `draft_model`.
    """
    config = json.loads(json.dumps(template))  # a deep copy of plain YAML data
    handler = config.setdefault("handler", {})
    if drafter is not None:
        handler["drafter"] = drafter
    for item in settings:
        parts, value = parse_set(item)
        node = config
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise LaunchError(f"--set {item!r}: {part} is a value, not a section")
            node = child
        node[parts[-1]] = value
    from handler.drafters import MODEL_FREE

    if handler.get("drafter") in MODEL_FREE or not has_draft:
        handler.pop("draft_model", None)
    return config


def check_config(config: dict, has_draft: bool):
    """The handler's own parse of the config (its message for a bad key), and --draft against the drafter."""
    from handler.config import handler_config_from_yaml_config

    try:
        handler_config = handler_config_from_yaml_config(config)
    except ValueError as error:
        raise LaunchError(f"the config (template, --drafter and --set): {error}") from error
    if has_draft and handler_config.draft_model is None:
        raise LaunchError(
            f"--draft: drafter {handler_config.drafter} uses no draft model; "
            "drop --draft, or pick --drafter model or hybrid"
        )
    if not has_draft and handler_config.draft_model is not None:
        raise LaunchError(
            f"--draft: drafter {handler_config.drafter} needs a draft model; pass --draft, or --drafter ngram or suffix"
        )
    return handler_config


def default_model_name(target: str) -> str:
    """The target folder's or Hub repository's name, in TorchServe's alphabet."""
    name = Path(target.rstrip("/")).name
    name = "".join(char if char.isalnum() or char in "_-." else "-" for char in name).lstrip("_-.")
    return name or "model"


# --- Models: folders and Hub ids ----------------------------------------------------------------


def looks_like_path(spec: str) -> bool:
    """A Hub id is NAME or OWNER/NAME; anything else that is not a folder was meant as a path."""
    return spec.startswith(("/", ".", "~")) or spec.count("/") > 1 or spec.endswith("/")


def resolve_model(spec: str, flag: str, offline: bool) -> Path:
    """A model folder, or a Hub id's snapshot folder in huggingface_hub's cache (downloaded unless offline)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return path.resolve()
    if looks_like_path(spec):
        raise LaunchError(f"{flag} {spec}: no such folder")
    from huggingface_hub import snapshot_download

    try:
        folder = snapshot_download(spec, allow_patterns=HUB_FILES, local_files_only=offline)
    except Exception as error:  # huggingface_hub raises many types: the user needs the id and the cause
        where = "in the Hugging Face cache (offline)" if offline else "on the Hugging Face Hub"
        raise LaunchError(
            f"{flag} {spec}: not a folder, and not found {where}: {type(error).__name__}: {error}"
        ) from error
    return Path(folder)


def link_tree(source: Path, destination: Path) -> None:
    """`destination` as a folder of symbolic links to `source`'s files (subfolders as folders; hidden ones skipped)."""
    destination.mkdir()
    for item in sorted(source.iterdir()):
        if item.name.startswith("."):
            continue
        if item.is_dir():
            link_tree(item, destination / item.name)
        else:
            # The path as given, not resolved: a Hub snapshot's files stay links into its cache.
            (destination / item.name).symlink_to(item.absolute())


# --- The model folder ---------------------------------------------------------------------------


def manifest_json(model_name: str) -> str:
    """MAR-INF/MANIFEST.json as torch-model-archiver writes it."""
    from model_archiver.model_archiver_config import ModelArchiverConfig
    from model_archiver.model_packaging_utils import ModelExportUtils

    archiver_config = ModelArchiverConfig(
        model_name=model_name,
        handler=package_mar.HANDLER_ENTRY,
        version=package_mar.MODEL_VERSION,
        config_file=MODEL_CONFIG_FILE,
        archive_format="no-archive",
    )
    return ModelExportUtils.generate_manifest_json(archiver_config)


def write_model_folder(folder: Path, model_name: str, config: dict, target: Path, draft: Path | None) -> None:
    """The no-archive layout of scripts.model_tools.package_mar, with the models linked instead of copied."""
    shutil.copytree(package_mar.HANDLER_PACKAGE, folder / "handler", ignore=package_mar.IGNORED_IN_HANDLER)
    shutil.copy2(package_mar.HANDLER_PACKAGE / package_mar.HANDLER_ENTRY, folder / package_mar.HANDLER_ENTRY)
    (folder / MODEL_CONFIG_FILE).write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    (folder / "MAR-INF").mkdir()
    (folder / "MAR-INF" / "MANIFEST.json").write_text(manifest_json(model_name), encoding="utf-8")
    link_tree(target, folder / "target")
    if draft is not None:
        link_tree(draft, folder / "draft")
    record = {"target": str(target), "draft": None if draft is None else str(draft)}
    (folder / LAUNCH_RECORD).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


def stage_model_folder(
    model_store: Path, model_name: str, config: dict, handler_config, target: Path, draft: Path | None
) -> Path:
    """Writes the model folder beside its final place and runs the handler's load-time checks on it.

    Raises:
        LaunchError: the handler would refuse the pair; its message (the staged folder is removed).
    """
    from handler.runtime.loading import check_pair

    model_store.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(prefix=f".{model_name}-", dir=model_store))
    staged.chmod(0o755)  # mkdtemp's 0700 would hide the model from a server run by another user
    try:
        write_model_folder(staged, model_name, config, target, draft)
        check_pair(handler_config, str(staged))
    except ValueError as error:
        shutil.rmtree(staged)
        raise LaunchError(f"the handler refuses this pair: {error}") from error
    except BaseException:
        shutil.rmtree(staged)
        raise
    return staged


def carry_over_measurements(old: Path, new: Path) -> None:
    """The cost tables a worker cached in the old folder go into the new one. Each is keyed by what it
    depends on (machine, architectures, dtypes, widths, batch sizes, runner), so the worker reads one
    only where it still holds, and a second run with other settings does not measure again."""
    from handler.planning.measure import CACHE_FILE_PREFIX

    for path in old.glob(f"{CACHE_FILE_PREFIX}*.json"):
        shutil.copy2(path, new / path.name)


def check_replaceable(folder: Path) -> None:
    """Only a folder this launcher wrote may be replaced."""
    if folder.exists() and not (folder / LAUNCH_RECORD).is_file():
        raise LaunchError(
            f"{folder} exists and was not written by scripts.launch; pass another --model-name or --model-store"
        )


# --- Server -------------------------------------------------------------------------------------


def is_listening(url: str) -> bool:
    """Whether something accepts connections at the URL's host and port."""
    address = urlparse(url)
    try:
        with socket.create_connection((address.hostname, address.port), timeout=2):
            return True
    except OSError:
        return False


def ensure_server(args: argparse.Namespace, inference_url: str, model_store: Path) -> dict[str, str] | None:
    """Starts TorchServe unless one answers at `inference_url`; returns its keys (None: token auth off)."""
    key_file = None if args.disable_token_auth else torchserve.DEFAULT_KEY_FILE
    if is_listening(inference_url):
        print(f"TorchServe is running at {inference_url}; registering there")
        return torchserve.wait_for_ping(inference_url, key_file, timeout_s=10)
    ts_config = args.ts_config
    if ts_config is None:
        args.log_dir.mkdir(parents=True, exist_ok=True)
        ts_config = args.log_dir / "launch.properties"
        torchserve.write_server_config(ts_config, model_store, [args.port + offset for offset in range(5)])
    log_dir = str(args.log_dir.resolve())
    server = torchserve.start_server(
        ts_config,
        model_store,
        args.log_dir / "console.log",
        env=dict(os.environ, LOG_LOCATION=log_dir, METRICS_LOCATION=log_dir),
        disable_token_auth=args.disable_token_auth,
    )
    try:
        keys = torchserve.wait_for_ping(inference_url, key_file, args.wait, server)
    except torchserve.ClientError:
        torchserve.stop_server(server)
        raise
    print(f"started TorchServe at {inference_url} (log: {args.log_dir}/ts_log.log; stop: make stop)")
    return keys


def is_registered(management_url: str, model_name: str, headers: dict[str, str]) -> bool:
    try:
        torchserve.model_workers(management_url, model_name, headers)
    except torchserve.ClientError as error:
        if error.status == 404:
            return False
        raise
    return True


def usage(inference_url: str, model_name: str, keys: dict[str, str] | None) -> str:
    """How to call the served model: curl on both routes, and the `openai` client."""
    auth = f' -H "Authorization: Bearer {keys["inference"]}"' if keys else ""
    api_key = keys["inference"] if keys else "unused"
    base_url = f"{inference_url}/predictions/{model_name}{OPENAI_PATH}"
    chat = {"model": model_name, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 32}
    return "\n".join(
        [
            f"served {model_name}. Native route:",
            f"  curl -s {inference_url}/predictions/{model_name}{auth} -H 'Content-Type: application/json' "
            f"-d '{json.dumps(INFERENCE_TRY)}'",
            "OpenAI routes:",
            f"  curl -s {base_url}/chat/completions{auth} -H 'Content-Type: application/json' -d '{json.dumps(chat)}'",
            "with the openai client:",
            "  from openai import OpenAI",
            f'  client = OpenAI(base_url="{base_url}", api_key="{api_key}")',
            f'  answer = client.chat.completions.create(model="{model_name}", messages={json.dumps(chat["messages"])})',
            "  print(answer.choices[0].message.content)",
        ]
        + ([f"(keys: {torchserve.DEFAULT_KEY_FILE.resolve()}; they expire, see docs/operations.md)"] if keys else [])
    )


# --- Command line -------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog="See the module docstring for what each step does."
    )
    parser.add_argument("--target", required=True, help="target model: a folder or a Hugging Face Hub id")
    parser.add_argument("--draft", help="draft model: a folder or a Hub id (none with --drafter ngram or suffix)")
    parser.add_argument("--drafter", choices=["model", "ngram", "suffix", "hybrid"], help="default: the template's")
    parser.add_argument(
        "--set",
        dest="settings",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config value over the template (repeatable): num_speculative_tokens=4, batchSize=8, dtype=float32",
    )
    parser.add_argument("--model-name", help="the name it serves under (default: the target's folder or repository)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="inference port; management PORT+1, metrics +2")
    parser.add_argument("--template", type=Path, default=DEFAULT_TEMPLATE, help="the config template")
    parser.add_argument("--model-store", type=Path, default=torchserve.DEFAULT_MODEL_STORE)
    parser.add_argument("--log-dir", type=Path, default=torchserve.DEFAULT_LOG_DIR)
    parser.add_argument("--ts-config", type=Path, help="a config.properties to start TorchServe with (not --port)")
    parser.add_argument("--disable-token-auth", action="store_true", help="token authorization OFF (local only)")
    parser.add_argument("--offline", action="store_true", help="Hub ids from the local cache only (HF_HUB_OFFLINE=1)")
    parser.add_argument("--wait", type=float, default=torchserve.PING_TIMEOUT_S, help="seconds to wait for /ping")
    parser.add_argument("--timeout", type=float, default=torchserve.REGISTER_TIMEOUT_S, help="seconds to register")
    return parser


def launch(args: argparse.Namespace) -> int:
    from huggingface_hub import constants

    if args.ts_config is not None and args.port != DEFAULT_PORT:
        raise LaunchError("--port and --ts-config: give one (the ports are in the config.properties)")
    model_name = args.model_name or default_model_name(args.target)
    if not package_mar.MODEL_NAME_PATTERN.match(model_name):
        raise LaunchError(f"--model-name {model_name!r}: use letters, digits, '_', '-' and '.'")
    offline = args.offline or constants.HF_HUB_OFFLINE
    target = resolve_model(args.target, "--target", offline)
    draft = None if args.draft is None else resolve_model(args.draft, "--draft", offline)
    try:
        package_mar.check_model_dir(target, "target", need_tokenizer=True)
        if draft is not None:
            package_mar.check_model_dir(draft, "draft", need_tokenizer=False)
    except package_mar.PackagingError as error:
        raise LaunchError(str(error)) from error
    template = yaml.safe_load(args.template.read_text(encoding="utf-8"))
    config = build_config(template, args.drafter, args.settings, draft is not None)
    handler_config = check_config(config, draft is not None)
    model_store = args.model_store.resolve()
    folder = model_store / model_name
    check_replaceable(folder)
    staged = stage_model_folder(model_store, model_name, config, handler_config, target, draft)
    try:
        if args.ts_config is not None:
            inference_url, management_url = torchserve.server_urls(args.ts_config)
        else:
            inference_url, management_url = f"http://127.0.0.1:{args.port}", f"http://127.0.0.1:{args.port + 1}"
        keys = ensure_server(args, inference_url, model_store)
        headers = {"Authorization": f"Bearer {keys['management']}"} if keys else {}
        if is_registered(management_url, model_name, headers):
            print(f"unregistering the running {model_name}")
            torchserve.unregister(management_url, model_name, headers)
        if folder.exists():
            carry_over_measurements(folder, staged)
            shutil.rmtree(folder)
        staged.rename(folder)
    finally:
        if staged.exists():
            shutil.rmtree(staged)
    print(f"registering {folder} as {model_name} (waits for the models to load) ...", flush=True)
    print(torchserve.register(management_url, model_name, model_name, headers, args.timeout))
    print(usage(inference_url, model_name, keys))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return launch(args)
    except (LaunchError, torchserve.ClientError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2 if isinstance(error, LaunchError) else 1


if __name__ == "__main__":
    sys.exit(main())
