"""model-config.yaml's handler section: defaults, strictness, messages that name the key."""

from __future__ import annotations

import pathlib

import pytest
import yaml

from handler.config import MAX_K, HandlerConfig, SamplingParams, handler_config_from_yaml_config

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_defaults_when_section_is_missing():
    config = handler_config_from_yaml_config({"minWorkers": 1})
    assert config == HandlerConfig()
    assert config.sampling == SamplingParams(temperature=0.0, top_k=0, top_p=1.0)


def test_shipped_model_config_parses():
    raw = yaml.safe_load((REPO_ROOT / "model-config" / "model-config.yaml").read_text())
    config = handler_config_from_yaml_config(raw)
    assert config.target_model and config.draft_model
    assert 0 <= config.num_speculative_tokens <= config.max_num_speculative_tokens <= MAX_K


def test_full_section_round_trips():
    config = HandlerConfig.from_dict(
        {
            "target_model": "/abs/target",
            "draft_model": "org/draft",
            "dtype": "bfloat16",
            "num_speculative_tokens": 6,
            "max_num_speculative_tokens": 8,
            "max_new_tokens": 64,
            "max_new_tokens_limit": 512,
            "sampling": {"temperature": 0.7, "top_k": 50, "top_p": 0.95},
        }
    )
    assert config.dtype == "bfloat16" and config.num_speculative_tokens == 6
    assert HandlerConfig.from_dict({"cpu_packed_weights": False}).cpu_packed_weights is False
    assert HandlerConfig().cpu_packed_weights is True
    assert config.sampling == SamplingParams(0.7, 50, 0.95)
    # A draft from another family: where its tokenizer is, and how its greedy rows draft.
    assert (config.draft_tokenizer, config.cross_vocab_greedy) == (None, "tli")
    other = HandlerConfig.from_dict({"draft_tokenizer": "org/draft-tokenizer", "cross_vocab_greedy": "slem"})
    assert (other.draft_tokenizer, other.cross_vocab_greedy) == ("org/draft-tokenizer", "slem")


@pytest.mark.parametrize(
    "section, key_in_message",
    [
        ({"num_speculative_tokenz": 4}, "handler.num_speculative_tokenz"),
        ({"sampling": {"temprature": 1.0}}, "handler.sampling.temprature"),
        ({"dtype": "fp8"}, "handler.dtype"),
        ({"num_speculative_tokens": -1}, "handler.num_speculative_tokens"),
        ({"num_speculative_tokens": "4"}, "handler.num_speculative_tokens"),
        ({"num_speculative_tokens": True}, "handler.num_speculative_tokens"),
        ({"num_speculative_tokens": 9, "max_num_speculative_tokens": 8}, "handler.num_speculative_tokens"),
        ({"max_num_speculative_tokens": MAX_K + 1}, "handler.max_num_speculative_tokens"),
        ({"max_new_tokens": 0}, "handler.max_new_tokens"),
        ({"max_new_tokens": 100, "max_new_tokens_limit": 50}, "handler.max_new_tokens"),
        ({"sampling": {"temperature": -0.1}}, "handler.sampling.temperature"),
        ({"sampling": {"temperature": float("nan")}}, "handler.sampling.temperature"),
        ({"sampling": {"top_p": 0.0}}, "handler.sampling.top_p"),
        ({"sampling": {"top_p": 1.5}}, "handler.sampling.top_p"),
        ({"sampling": {"top_k": -3}}, "handler.sampling.top_k"),
        ({"sampling": {"min_p": -0.1}}, "handler.sampling.min_p"),
        ({"sampling": {"min_p": 1.5}}, "handler.sampling.min_p"),
        ({"sampling": {"presence_penalty": 2.5}}, "handler.sampling.presence_penalty"),
        ({"sampling": {"presence_penalty": "high"}}, "handler.sampling.presence_penalty"),
        ({"sampling": {"frequency_penalty": -2.01}}, "handler.sampling.frequency_penalty"),
        ({"sampling": {"frequency_penalty": float("nan")}}, "handler.sampling.frequency_penalty"),
        ({"sampling": {"repetition_penalty": 0}}, "handler.sampling.repetition_penalty"),
        ({"sampling": {"repetition_penalty": 10.5}}, "handler.sampling.repetition_penalty"),
        ({"sampling": {"repetition_penalty": True}}, "handler.sampling.repetition_penalty"),
        # Token ids belong to a request, not to a deployment's defaults.
        ({"sampling": {"logit_bias": {"5": 1}}}, "handler.sampling.logit_bias"),
        ({"sampling": [1, 2]}, "handler.sampling"),
        ({"target_model": ""}, "handler.target_model"),
        ({"cpu_packed_weights": "yes"}, "handler.cpu_packed_weights"),
        ({"cross_vocab_greedy": "greedy"}, "handler.cross_vocab_greedy"),
        ({"draft_tokenizer": ""}, "handler.draft_tokenizer"),
        ({"drafter": "ngram", "draft_tokenizer": "tok"}, "handler.draft_tokenizer"),
        ({"metrics_latency_buckets_s": "1, 10"}, "handler.metrics_latency_buckets_s"),
        ({"metrics_latency_buckets_s": []}, "handler.metrics_latency_buckets_s"),
        ({"metrics_latency_buckets_s": [10, 1]}, "handler.metrics_latency_buckets_s"),
        ({"metrics_latency_buckets_s": [0, 1]}, "handler.metrics_latency_buckets_s"),
        ({"metrics_latency_buckets_s": [1, float("inf")]}, "handler.metrics_latency_buckets_s"),
        ({"metrics_latency_buckets_s": list(range(1, 40))}, "handler.metrics_latency_buckets_s"),
    ],
)
def test_bad_values_name_the_key(section, key_in_message):
    with pytest.raises(ValueError, match=key_in_message.replace(".", r"\.")):
        HandlerConfig.from_dict(section)


def test_latency_buckets_are_read_as_seconds():
    config = HandlerConfig.from_dict({"metrics_latency_buckets_s": [1, 2.5, 60]})
    assert config.metrics_latency_buckets_s == (1.0, 2.5, 60.0)


def test_handler_section_must_be_a_mapping():
    with pytest.raises(ValueError, match="handler section"):
        handler_config_from_yaml_config({"handler": ["target"]})


def test_every_handler_metric_is_declared_in_metrics_yaml():
    """TorchServe drops undeclared model metrics silently, so a missing declaration is a silent outage."""
    from handler.metrics import COUNTERS, GAUGES, HISTOGRAMS, LABELLED_METRICS, POSITION_DIMENSION

    declared = yaml.safe_load((REPO_ROOT / "model-config" / "metrics.yaml").read_text())["model_metrics"]
    assert {m["name"] for m in declared["counter"]} >= set(COUNTERS)
    assert {m["name"] for m in declared["gauge"]} >= set(GAUGES)
    assert {m["name"] for m in declared["histogram"]} >= set(HISTOGRAMS)
    # TorchServe matches dimension values to the declared names by position: the handler
    # passes the position first, TorchServe appends ModelName and Level.
    dimensions = {m["name"]: m["dimensions"] for kind in declared.values() for m in kind}
    assert dimensions["spec_decode_num_accepted_tokens_per_pos"] == [POSITION_DIMENSION, "ModelName", "Level"]
    for name, label in LABELLED_METRICS.items():
        assert dimensions[name] == [label, "ModelName", "Level"], name
    others = [dims for name, dims in dimensions.items() if name not in LABELLED_METRICS]
    assert all(dims == ["ModelName", "Level"] for dims in others)
    assert yaml.safe_load((REPO_ROOT / "model-config" / "metrics.yaml").read_text())["ts_metrics"]["counter"]


def test_cpu_threads_zero_means_every_available_core():
    import os

    import torch

    from handler.runtime.host import usable_cpu_cores
    from handler.runtime.loading import set_cpu_threads

    before = torch.get_num_threads()
    try:
        assert set_cpu_threads(1) == 1 and torch.get_num_threads() == 1
        assert set_cpu_threads(0) == usable_cpu_cores() == torch.get_num_threads()
        assert usable_cpu_cores() <= len(os.sched_getaffinity(0))
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="handler.cpu_threads"):
        HandlerConfig.from_dict({"cpu_threads": -1})


def test_drafter_keys():
    assert HandlerConfig().drafters == ("model", "ngram", "suffix", "hybrid")
    lookup = HandlerConfig.from_dict({"drafter": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 5})
    assert lookup.draft_model is None and lookup.drafters == ("ngram", "suffix")
    assert (lookup.prompt_lookup_min, lookup.prompt_lookup_max) == (2, 5)
    assert lookup.prompt_lookup_num_tokens == 0  # the request's k
    wide = HandlerConfig.from_dict({"prompt_lookup_num_tokens": 8, "max_num_speculative_tokens": 8})
    assert wide.prompt_lookup_num_tokens == 8
    suffix = HandlerConfig.from_dict({"drafter": "suffix", "suffix_max_depth": 32, "suffix_min_token_prob": 0.2})
    assert suffix.draft_model is None and suffix.drafter == "suffix" and suffix.drafters == ("ngram", "suffix")
    assert (suffix.suffix_options.max_depth, suffix.suffix_options.min_token_prob) == (32, 0.2)
    # No room for a single answer: nothing is shared.
    assert not HandlerConfig.from_dict({"suffix_max_cached_requests": 0}).suffix_options.share_across_requests
    hybrid = HandlerConfig.from_dict({"drafter": "hybrid", "draft_model": "small"})
    assert hybrid.draft_model == "small" and "hybrid" in hybrid.drafters


@pytest.mark.parametrize(
    "raw, key",
    [
        ({"drafter": "eagle"}, "handler.drafter"),
        ({"drafter": "ngram", "draft_model": "draft"}, "handler.draft_model"),
        ({"prompt_lookup_min": 0}, "handler.prompt_lookup_min"),
        ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "handler.prompt_lookup_max"),
        # The cost table and the verify pass go no wider than max_num_speculative_tokens + 1.
        ({"prompt_lookup_num_tokens": 9, "max_num_speculative_tokens": 8}, "handler.prompt_lookup_num_tokens"),
        ({"prompt_lookup_num_tokens": -1}, "handler.prompt_lookup_num_tokens"),
        ({"drafter": "suffix", "draft_model": "draft"}, "handler.draft_model"),
        ({"suffix_max_depth": 0}, "handler.suffix_max_depth"),
        ({"suffix_max_depth": 65}, "handler.suffix_max_depth"),
        ({"suffix_min_token_prob": 1.5}, "handler.suffix_min_token_prob"),
        ({"suffix_min_token_prob": "high"}, "handler.suffix_min_token_prob"),
        ({"suffix_share_across_requests": "yes"}, "handler.suffix_share_across_requests"),
        ({"speculative_tree": "tree"}, "handler.speculative_tree"),
        ({"suffix_max_cached_requests": -1}, "handler.suffix_max_cached_requests"),
        ({"suffix_max_cached_tokens": 1.5}, "handler.suffix_max_cached_tokens"),
    ],
)
def test_bad_drafter_settings_name_the_key(raw, key):
    with pytest.raises(ValueError, match=key):
        HandlerConfig.from_dict(raw)


def test_sampling_penalties_and_min_p():
    section = {"min_p": 0.05, "presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.2}
    sampling = HandlerConfig.from_dict({"sampling": section}).sampling
    assert sampling == SamplingParams(min_p=0.05, presence_penalty=0.5, frequency_penalty=-1.0, repetition_penalty=1.2)
    assert sampling.needs_history and sampling.needs_output_counts and sampling.needs_seen_tokens
    assert sampling.processes_logits
    default = SamplingParams()
    assert (default.min_p, default.presence_penalty, default.frequency_penalty) == (0.0, 0.0, 0.0)
    assert (default.repetition_penalty, default.logit_bias) == (1.0, ())
    assert not default.needs_history and not default.processes_logits
    # min_p is warping, not a logits processor: it needs no history.
    assert not SamplingParams(temperature=1.0, min_p=0.5).processes_logits
    repetition = SamplingParams(repetition_penalty=0.9)
    assert repetition.needs_seen_tokens and not repetition.needs_output_counts and repetition.needs_history


def test_logit_bias_is_sorted_pairs_and_hashable():
    sampling = SamplingParams(logit_bias={7: -100, 2: 3})
    assert sampling.logit_bias == ((2, 3.0), (7, -100.0))
    assert sampling == SamplingParams(logit_bias=((7, -100.0), (2, 3.0)))
    assert hash(sampling) == hash(SamplingParams(logit_bias=[(2, 3), (7, -100)]))
    assert sampling.processes_logits and not sampling.needs_history


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"min_p": 2.0}, "min_p"),
        ({"presence_penalty": -3.0}, "presence_penalty"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"logit_bias": {5: 100.5}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"logit_bias": ((5, 1.0), (5, 2.0))}, "logit_bias"),
        ({"logit_bias": ((5,),)}, "logit_bias"),
    ],
)
def test_bad_sampling_params_name_the_field(fields, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**fields)


@pytest.mark.parametrize(
    "value, num_bytes",
    [
        (0, 0),
        (123456, 123456),
        ("512MiB", 512 * 2**20),
        ("4GiB", 4 * 2**30),
        ("2GB", 2 * 10**9),
        ("1.5 GiB", 3 * 2**29),
        ("64 kB", 64_000),
        ("0 GiB", 0),
        ("1.1 KiB", 1126),  # 1126.4 bytes: the fraction of a byte is dropped
    ],
)
def test_prefix_cache_max_bytes_takes_a_count_or_a_size_with_a_unit(value, num_bytes):
    config = HandlerConfig.from_dict({"prefix_cache_max_bytes": value})
    assert config.prefix_cache_max_bytes == num_bytes and config.prefix_cache is True


@pytest.mark.parametrize(
    "value",
    [-1, True, 1.5, None, "1024", "4 gib", "4G", "-1GiB", "1e9 B", "GiB", "1,5 GiB", "0.1 B", "4GiB of RAM"],
)
def test_a_bad_prefix_cache_size_names_the_key(value):
    with pytest.raises(ValueError, match="handler.prefix_cache_max_bytes must be a byte count"):
        HandlerConfig.from_dict({"prefix_cache_max_bytes": value})


def test_prefix_cache_is_on_by_default_and_a_boolean():
    assert HandlerConfig().prefix_cache is True and HandlerConfig().prefix_cache_max_bytes == 0
    assert HandlerConfig.from_dict({"prefix_cache": False}).prefix_cache is False
    with pytest.raises(ValueError, match="handler.prefix_cache must be true or false"):
        HandlerConfig.from_dict({"prefix_cache": "off"})
    for name in ("model-config.yaml", "qwen-coder.yaml"):
        raw = yaml.safe_load((REPO_ROOT / "model-config" / name).read_text())
        assert {"prefix_cache", "prefix_cache_max_bytes"} <= set(raw["handler"]), name


def test_speculative_tree_reads_yaml_off_and_defaults_to_auto():
    assert HandlerConfig.from_dict({}).speculative_tree == "auto"
    assert HandlerConfig.from_dict(yaml.safe_load("speculative_tree: off")).speculative_tree == "off"
    assert HandlerConfig.from_dict(yaml.safe_load("speculative_tree: auto")).speculative_tree == "auto"
