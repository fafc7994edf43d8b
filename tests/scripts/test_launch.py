"""scripts.launch without a server: its arguments, `--set`, the template, Hub ids from a cache, the
linked model folder, and the refusal of a pair the handler would refuse, before anything starts.

The builders here (a tiny Llama pair, a Hub cache) serve tests/e2e/test_launch.py too.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch
import transformers
import yaml

from scripts import launch
from scripts.model_tools import make_tiny_models
from scripts.serving import torchserve

LLAMA = dict(
    vocab_size=384,  # the tiny tokenizer's 350 tokens, padded
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    # Wide initial weights: with the default 0.02 a tiny random model repeats one token.
    initializer_range=0.2,
)
REVISION = "0123456789abcdef0123456789abcdef01234567"


def save_tiny(model, out: Path, tokenizer=None) -> Path:
    """`model` saved as a model folder with the tiny tokenizer (or `tokenizer`)."""
    tokenizer = tokenizer or make_tiny_models.build_tokenizer()
    make_tiny_models.save_model(model, tokenizer, tokenizer.convert_tokens_to_ids(make_tiny_models.EOS_TOKEN), out)
    return out


def tiny_llama(num_layers: int, seed: int) -> torch.nn.Module:
    eos = make_tiny_models.build_tokenizer().convert_tokens_to_ids(make_tiny_models.EOS_TOKEN)
    config = transformers.LlamaConfig(**LLAMA, num_hidden_layers=num_layers, eos_token_id=eos, pad_token_id=eos)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()


def tiny_llama_pair(out: Path) -> tuple[Path, Path]:
    """A Llama target (2 layers) and draft (1 layer), random, with the tiny tokenizer: two model folders."""
    return save_tiny(tiny_llama(2, 0), out / "target"), save_tiny(tiny_llama(1, 1), out / "draft")


def add_to_hub_cache(cache: Path, repo_id: str, folder: Path) -> Path:
    """`folder` as huggingface_hub caches a download of `repo_id`: files in blobs/ by hash,
    snapshots/REVISION/ linking to them, refs/main naming REVISION. Returns the snapshot."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for file in sorted(folder.iterdir()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    return snapshot


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory) -> tuple[Path, Path]:
    return tiny_llama_pair(tmp_path_factory.mktemp("llama"))


# --- Arguments, --set and the template ------------------------------------------------------------


def test_set_puts_worker_keys_at_the_top_and_every_other_key_under_handler():
    assert launch.parse_set("batchSize=8") == (["batchSize"], 8)
    assert launch.parse_set("num_speculative_tokens=4") == (["handler", "num_speculative_tokens"], 4)
    assert launch.parse_set("handler.dtype=float32") == (["handler", "dtype"], "float32")
    assert launch.parse_set("sampling.temperature=0.7") == (["handler", "sampling", "temperature"], 0.7)
    assert launch.parse_set("adaptive_k=false") == (["handler", "adaptive_k"], False)
    assert launch.parse_set("draft_tokenizer=null") == (["handler", "draft_tokenizer"], None)
    assert launch.parse_set("prefix_cache_max_bytes=512MiB") == (["handler", "prefix_cache_max_bytes"], "512MiB")


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("adaptive_k", "write KEY=VALUE"),
        ("=4", "write KEY=VALUE"),
        ("sampling..top_k=1", "not a dotted key"),
        ("target_model=other", "give the model with --target"),
        ("handler.draft_model=other", "give the model with --draft"),
        ("sampling={temperature", "not YAML"),
    ],
)
def test_a_malformed_set_is_refused_saying_what_to_write(item, message):
    with pytest.raises(launch.LaunchError, match=message):
        launch.parse_set(item)


def template() -> dict:
    return yaml.safe_load(launch.DEFAULT_TEMPLATE.read_text())


def test_the_template_passes_the_handlers_parser_and_points_at_the_linked_folders():
    config = template()
    handler_config = launch.check_config(config, has_draft=True)
    assert (handler_config.target_model, handler_config.draft_model) == ("target", "draft")
    assert handler_config.drafter == "hybrid" and handler_config.adaptive_k
    assert set(config) - {"handler"} <= launch.WORKER_KEYS


def test_the_template_says_what_each_setting_does():
    for line in launch.DEFAULT_TEMPLATE.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#") and ":" in line:
            key, value = line.split(":", 1)
            assert "#" in value or key.strip() in {"handler", "target_model", "prompt_lookup_max"}, line


def test_drafter_and_sets_apply_over_the_template_without_changing_it():
    original = template()
    settings = ["batchSize=2", "sampling.top_k=5", "num_speculative_tokens=3"]
    config = launch.build_config(original, "model", settings, True)
    assert config["batchSize"] == 2 and config["handler"]["drafter"] == "model"
    assert config["handler"]["sampling"] == {"temperature": 0.0, "top_k": 5}
    assert config["handler"]["num_speculative_tokens"] == 3
    assert original == template()
    assert launch.check_config(config, has_draft=True).num_speculative_tokens == 3


def test_a_drafter_without_a_draft_model_drops_it_and_refuses_a_draft():
    config = launch.build_config(template(), "ngram", [], has_draft=False)
    assert "draft_model" not in config["handler"]
    assert launch.check_config(config, has_draft=False).draft_model is None
    with pytest.raises(launch.LaunchError, match="--draft: drafter suffix uses no draft model"):
        launch.check_config(launch.build_config(template(), "suffix", [], has_draft=True), has_draft=True)
    with pytest.raises(launch.LaunchError, match="--draft: drafter hybrid needs a draft model; pass --draft"):
        launch.check_config(launch.build_config(template(), None, [], has_draft=False), has_draft=False)


def test_a_bad_key_or_value_gets_the_handlers_own_message():
    for settings, message in ((["num_speculative_tokenz=4"], "unknown key"), (["dtype=float64"], "dtype")):
        with pytest.raises(launch.LaunchError, match=message) as raised:
            launch.check_config(launch.build_config(template(), None, settings, True), has_draft=True)
        from handler.config import handler_config_from_yaml_config

        with pytest.raises(ValueError) as direct:
            handler_config_from_yaml_config(launch.build_config(template(), None, settings, True))
        assert str(direct.value) in str(raised.value)


def test_the_parser_reads_every_option():
    args = launch.build_parser().parse_args(
        ["--target", "t", "--draft", "d", "--drafter", "ngram", "--set", "a=1", "--set", "b=2", "--port", "9000"]
    )
    assert (args.target, args.draft, args.drafter, args.port) == ("t", "d", "ngram", 9000)
    assert args.settings == ["a=1", "b=2"]
    assert launch.build_parser().parse_args(["--target", "t"]).settings == []
    with pytest.raises(SystemExit):
        launch.build_parser().parse_args(["--draft", "d"])  # --target is required


def test_the_default_name_is_the_targets_in_torchserves_alphabet():
    assert launch.default_model_name("meta-llama/Llama-3.1-8B-Instruct") == "Llama-3.1-8B-Instruct"
    assert launch.default_model_name("models/my target/") == "my-target"


# --- Models: folders, Hub ids, links --------------------------------------------------------------


def test_a_hub_id_resolves_offline_from_a_populated_cache(llama_pair, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snapshot = add_to_hub_cache(tmp_path, "tiny-org/llama-target", llama_pair[0])
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    assert launch.resolve_model("tiny-org/llama-target", "--target", offline=True) == snapshot
    with pytest.raises(launch.LaunchError, match="--draft tiny-org/absent: not a folder, and not found in the"):
        launch.resolve_model("tiny-org/absent", "--draft", offline=True)
    with pytest.raises(launch.LaunchError, match="--target ./absent: no such folder"):
        launch.resolve_model("./absent", "--target", offline=True)


def test_the_model_folder_links_every_model_file_and_copies_none(llama_pair, tmp_path):
    target, draft = llama_pair
    config = launch.build_config(template(), None, [], True)
    folder = tmp_path / "store" / "pair"
    folder.mkdir(parents=True)
    launch.write_model_folder(folder, "pair", config, target, draft)
    for role, source in (("target", target), ("draft", draft)):
        files = sorted((folder / role).iterdir())
        assert [file.name for file in files] == sorted(file.name for file in source.iterdir())
        assert all(file.is_symlink() and file.resolve() == (source / file.name).resolve() for file in files)
    assert yaml.safe_load((folder / "model-config.yaml").read_text()) == config
    manifest = (folder / "MAR-INF" / "MANIFEST.json").read_text()
    assert '"handler": "spec_handler.py"' in manifest and '"configFile": "model-config.yaml"' in manifest
    assert (folder / "handler" / "spec_handler.py").is_file() and (folder / "spec_handler.py").is_file()


def test_a_second_run_keeps_the_cost_tables_the_worker_cached_in_the_folder(tmp_path):
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    new.mkdir()
    from handler.planning.measure import CACHE_FILE_PREFIX

    (old / f"{CACHE_FILE_PREFIX}0123456789abcdef.json").write_text('{"key": {}, "table": {}}')
    (old / "model-config.yaml").write_text("handler: {}")
    launch.carry_over_measurements(old, new)
    assert [path.name for path in new.iterdir()] == [f"{CACHE_FILE_PREFIX}0123456789abcdef.json"]


# --- Refusals, before anything starts -------------------------------------------------------------


def refused(tmp_path: Path, capsys, *args: str) -> str:
    """Runs the launcher on a free port; checks it refused and started nothing. Returns its message."""
    port = torchserve.free_ports(1)[0]
    store, logs = tmp_path / "store", tmp_path / "logs"
    argv = [*args, "--port", str(port), "--model-store", str(store), "--log-dir", str(logs), "--model-name", "pair"]
    assert launch.main(argv) == 2
    assert not launch.is_listening(f"http://127.0.0.1:{port}")
    assert not logs.exists()
    assert not store.exists() or list(store.iterdir()) == []  # the staged folder is gone
    return capsys.readouterr().err


def test_a_state_space_target_is_refused_with_the_handlers_message(llama_pair, tmp_path, capsys):
    config = transformers.MambaConfig(vocab_size=384, hidden_size=64, state_size=8, num_hidden_layers=2)
    mamba = save_tiny(transformers.MambaForCausalLM(config), tmp_path / "mamba")
    message = refused(tmp_path, capsys, "--target", str(mamba), "--draft", str(llama_pair[1]))
    assert "the handler refuses this pair: MambaForCausalLM uses cache layers" in message
    assert "cannot be rolled back by a length" in message


def test_a_draft_whose_tokenizer_shares_no_token_is_refused_with_the_handlers_message(llama_pair, tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel({"\u4e16": 0, "\u754c": 1, "<unk>": 2}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<unk>")
    draft = tmp_path / "draft"
    tiny_llama(1, 1).save_pretrained(draft)
    tokenizer.save_pretrained(draft)
    message = refused(tmp_path, capsys, "--target", str(llama_pair[0]), "--draft", str(draft))
    assert "the handler refuses this pair: the draft's tokenizer (" in message
    assert "share no token: the draft could never propose one" in message


def test_a_bad_set_is_refused_before_anything_starts(llama_pair, tmp_path, capsys):
    target, draft = (str(path) for path in llama_pair)
    message = refused(tmp_path, capsys, "--target", target, "--draft", draft, "--set", "num_speculative_tokenz=4")
    assert "unknown key(s) handler.num_speculative_tokenz" in message
