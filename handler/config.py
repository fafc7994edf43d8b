"""The `handler:` section of model-config.yaml, parsed once into frozen dataclasses.

Unknown keys and bad values raise `ValueError` naming the key, so that a typo
stops the worker at registration instead of being silently ignored.
"""

from __future__ import annotations

import dataclasses
import decimal
import math
import re
from collections.abc import Mapping
from typing import Any

# The request's types live in handler.types (torch-free); they are named here as before.
from handler.types import (  # noqa: F401 - re-exported
    DRAFTERS,
    LOGIT_BIAS_RANGE,
    MAX_REPETITION_PENALTY,
    MODEL_FREE,
    PENALTY_RANGE,
    SAMPLING_NUMBER_FIELDS,
    SamplingParams,
    sampling_problem,
)

DTYPES = ("auto", "float32", "bfloat16", "float16")
# auto: on the CPU, int8 where its draft step measures clearly faster at start-up (handler.runtime.cpu_speed).
DRAFT_QUANTIZATIONS = ("none", "int8", "auto")
# handler.speculative_tree: trees of look-up candidates where the model allows ("auto"), or chains.
SPECULATIVE_TREE_MODES = ("auto", "off")
# handler.runner: how the models hold the running batch's KV and run their passes (handler.runners);
# auto times both at start-up and keeps the faster.
RUNNER_MODES = ("auto", "dynamic", "static")
# auto, then handler.api.openai.tool_formats.FORMAT_NAMES (vLLM's parser names; a unit test keeps them equal).
TOOL_CALL_PARSERS = ("auto", "hermes", "mistral", "llama3_json", "json")
# How a draft from another family drafts for greedy rows (`handler.drafters.cross_vocab`): its whole
# vocabulary with its text re-tokenized, or the shared tokens only.
SLEM = "slem"
TLI = "tli"
CROSS_VOCAB_GREEDY = (SLEM, TLI)
# Longest n-gram the look-up matches; longer suffixes rarely add matches.
MAX_PROMPT_LOOKUP = 16
# Largest K the engine supports; a config may lower it, never raise it.
MAX_K = 32
# Deepest suffix tree: a proposal never outgrows the tree's depth.
MAX_SUFFIX_DEPTH = 64
# The buckets, in seconds, of the latency histograms that the handler counts itself
# (handler.metrics.BUCKET_COUNTERS): TorchServe's exporter stops at 10 s, a CPU request takes
# 10 to 60 s and a queued one minutes. handler.metrics_latency_buckets_s replaces them.
# From 0.1 s to 10 minutes, the first seven as Prometheus' own.
_SUB_MINUTE_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 45.0)
DEFAULT_LATENCY_BUCKETS_S = _SUB_MINUTE_BUCKETS_S + (60.0, 90.0, 120.0, 180.0, 300.0, 600.0)
# Each bucket is one counter series, and an observation one worker-log line per bucket at or above it.
MAX_LATENCY_BUCKETS = 32
# The suffix drafter's defaults: vLLM's for `method: suffix`, and the bounds of the tree of recent outputs.
DEFAULT_MAX_DEPTH = 24
DEFAULT_MIN_TOKEN_PROB = 0.1
DEFAULT_MAX_CACHED_REQUESTS = 1024
DEFAULT_MAX_CACHED_TOKENS = 262_144
# The units of a byte count written as a string: SI (powers of 1000) and IEC (powers of 1024).
BYTE_UNITS = {
    "B": 1,
    "kB": 1000,
    "KB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
    "TB": 1000**4,
    "KiB": 1024,
    "MiB": 1024**2,
    "GiB": 1024**3,
    "TiB": 1024**4,
}
_BYTE_COUNT = re.compile(r"(\d+(?:\.\d+)?)\s*([A-Za-z]+)")


def _check_keys(section: str, given: Mapping[str, Any], allowed: tuple[str, ...]) -> None:
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        raise ValueError(
            f"model-config.yaml: unknown key(s) {', '.join(section + k for k in unknown)}; "
            f"allowed keys are: {', '.join(section + k for k in allowed)}"
        )


def _int(key: str, value: Any, minimum: int, maximum: int | None = None) -> int:
    # bool is an int subclass; `true` is never a meaningful count.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"model-config.yaml: {key} must be an integer, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        upper = f" and <= {maximum}" if maximum is not None else ""
        raise ValueError(f"model-config.yaml: {key} must be >= {minimum}{upper}, got {value}")
    return value


def _float(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"model-config.yaml: {key} must be a finite number, got {value!r}")
    return float(value)


def _str(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"model-config.yaml: {key} must be a non-empty string, got {value!r}")
    return value


def _bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"model-config.yaml: {key} must be true or false, got {value!r}")
    return value


def _bytes(key: str, value: Any) -> int:
    """A byte count: an integer >= 0, or a string with a unit ("512MiB", "4GiB", "2GB", "1.5 GiB")."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str):
        match = _BYTE_COUNT.fullmatch(value.strip())
        if match and match.group(2) in BYTE_UNITS:
            # Exact decimal arithmetic: "1.5 GiB" is 1610612736 bytes, not a float's rounding of it.
            # A fraction of a byte is dropped; an amount that leaves none would read as 0 (automatic).
            amount = decimal.Decimal(match.group(1)) * BYTE_UNITS[match.group(2)]
            if amount == 0 or amount >= 1:
                return int(amount)
    raise ValueError(
        f"model-config.yaml: {key} must be a byte count, 0 for automatic: an integer >= 0 or a number "
        f"with a unit ({', '.join(BYTE_UNITS)}) such as 512MiB, 4GiB or 2GB; got {value!r}"
    )


def _latency_buckets(key: str, value: Any) -> tuple[float, ...]:
    """Bucket upper bounds: 1 to MAX_LATENCY_BUCKETS finite numbers > 0, increasing (+Inf is always added)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise ValueError(f"model-config.yaml: {key} must be a list of seconds, e.g. [1, 10, 60, 300], got {value!r}")
    bounds = tuple(_float(key, bound) for bound in value)
    if not 1 <= len(bounds) <= MAX_LATENCY_BUCKETS:
        raise ValueError(f"model-config.yaml: {key} must hold 1 to {MAX_LATENCY_BUCKETS} bounds, got {len(bounds)}")
    if bounds[0] <= 0 or any(later <= earlier for earlier, later in zip(bounds, bounds[1:])):
        raise ValueError(f"model-config.yaml: {key} must be increasing seconds > 0, got {list(bounds)}")
    return bounds


def sampling_params_from_dict(raw: Any, section: str = "handler.sampling.") -> SamplingParams:
    """The `sampling:` section: the defaults for requests, every field but logit_bias (token ids belong
    to a request, not a deployment)."""
    if not isinstance(raw, Mapping):
        raise ValueError(f"model-config.yaml: {section.rstrip('.')} must be a mapping")
    _check_keys(section, raw, ("top_k", *SAMPLING_NUMBER_FIELDS))
    default = SamplingParams()
    values: dict[str, Any] = {
        key: _float(section + key, raw.get(key, getattr(default, key))) for key in SAMPLING_NUMBER_FIELDS
    }
    values["top_k"] = _int(section + "top_k", raw.get("top_k", default.top_k), 0)
    problem = sampling_problem(**values)
    if problem:
        raise ValueError(f"model-config.yaml: {section}{problem}")
    return SamplingParams(**values)


@dataclasses.dataclass(frozen=True)
class SuffixOptions:
    """The suffix drafter's settings (model-config.yaml's `suffix_*` keys, `handler.drafters.suffix`)."""

    max_depth: int = DEFAULT_MAX_DEPTH
    min_token_prob: float = DEFAULT_MIN_TOKEN_PROB
    share_across_requests: bool = True
    max_cached_requests: int = DEFAULT_MAX_CACHED_REQUESTS
    max_cached_tokens: int = DEFAULT_MAX_CACHED_TOKENS


@dataclasses.dataclass(frozen=True)
class HandlerConfig:
    target_model: str = "target"
    draft_model: str | None = "draft"
    drafter: str = "model"
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    # Most drafts one look-up proposes; 0 = the request's k. A look-up costs no draft
    # pass, only verify width, so it may usefully exceed the draft model's k.
    prompt_lookup_num_tokens: int = 0
    dtype: str = "auto"
    num_speculative_tokens: int = 4
    max_num_speculative_tokens: int = 16
    max_new_tokens: int = 128
    max_new_tokens_limit: int = 2048
    # Plan each step's k from a cost table measured at start-up (handler.planning): on by default, as
    # shipped, since the planner is what keeps speculation from running slower than plain decoding.
    adaptive_k: bool = True
    # With adaptive_k, the draft model drafts up to the request's k and stops where its own
    # calibrated confidence says one more draft does not pay (handler.planning.pricing.ConfidenceStop).
    draft_confidence: bool = True
    # With the hybrid drafter: the suffix trees guess the draft model's next drafts, and one
    # draft pass checks them all (handler.drafters, guessed drafting); the drafts are unchanged.
    draft_guesses: bool = True
    draft_quantization: str = "none"
    # Where the draft's tokenizer is, when not in its folder. A draft whose tokenizer differs from
    # the target's drafts across vocabularies (docs/heterogeneous-drafts.md).
    draft_tokenizer: str | None = None
    # How such a draft drafts for greedy rows: tli (only the tokens both vocabularies share, as for
    # sampled rows; measured faster under the planner) or slem (its whole vocabulary, its text
    # re-tokenized by the target's tokenizer).
    cross_vocab_greedy: str = "tli"
    allow_pickle_weights: bool = False
    cpu_threads: int = 0
    # Memory bound of the running batch: prompt + max_new_tokens summed over the requests
    # decoding together. 0 = no bound beyond TorchServe's batchSize.
    max_batch_tokens: int = 0
    # Continuous batching: a handler call runs engine steps until TorchServe's turnaround between
    # calls (measured as the server runs) is at most 5% of the call, for at most this many ms, or
    # until a request finishes. It is also the most a new request waits to join. 0 = one step a call.
    max_call_ms: float = 50.0
    cpu_packed_weights: bool = True
    # The most seconds one structured-output constraint may take to compile; a request
    # over it gets a 400 (compiling runs while the batch waits).
    grammar_compile_timeout_s: float = 2.0
    # Keep the KV of earlier prompts and completions for the requests that share their
    # prefix (handler.caches.prefix_cache, docs/prefix-caching.md).
    prefix_cache: bool = True
    # Bytes the prefix cache holds, both models together. 0 = automatic: a quarter of the
    # memory available at start-up (handler.runtime.memory_budget). YAML may write "4GiB" or "2GB".
    prefix_cache_max_bytes: int = 0
    # The Responses route's store of responses (previous_response_id): in memory, least recently
    # used out first, bounded in responses and in bytes (their conversations' JSON). 0 responses: none kept.
    responses_store_max_entries: int = 1024
    responses_store_max_bytes: int = 64 * 2**20
    # The suffix drafter (handler.drafters.suffix): tree depth, the lowest estimated probability a
    # proposal keeps, whether one request's output may be proposed for another's, and the bounds of
    # the tree of recent outputs (0 requests: no such tree).
    suffix_max_depth: int = SuffixOptions.max_depth
    suffix_min_token_prob: float = SuffixOptions.min_token_prob
    suffix_share_across_requests: bool = SuffixOptions.share_across_requests
    suffix_max_cached_requests: int = SuffixOptions.max_cached_requests
    suffix_max_cached_tokens: int = SuffixOptions.max_cached_tokens
    # auto: look-ups propose trees of candidates, verified in one pass, and the planner sizes them
    # from the cost table (handler.tree); off: chains only. A request may say off for itself.
    speculative_tree: str = "auto"
    # dynamic: the KV grows and is cropped (the CPU's usual winner); static: preallocated KV in row
    # slots with fixed shapes, captured as CUDA graphs on a GPU; auto: whichever passes run faster here.
    runner: str = "auto"
    # The chat template's tool-call format: auto (recognised from the template) or one of vLLM's
    # parser names (handler.api.openai.tool_formats.FORMATS), for a template that renders tools its own way.
    tool_call_parser: str = "auto"
    # The upper bounds, in seconds, of the latency histograms' buckets on /metrics (handler.metrics).
    metrics_latency_buckets_s: tuple[float, ...] = DEFAULT_LATENCY_BUCKETS_S
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)

    @property
    def drafters(self) -> tuple[str, ...]:
        """The drafters this deployment can run: all with a draft model, else the look-ups only."""
        return DRAFTERS if self.draft_model is not None else MODEL_FREE

    @property
    def suffix_options(self) -> SuffixOptions:
        return SuffixOptions(
            max_depth=self.suffix_max_depth,
            min_token_prob=self.suffix_min_token_prob,
            share_across_requests=self.suffix_share_across_requests and self.suffix_max_cached_requests > 0,
            max_cached_requests=self.suffix_max_cached_requests,
            max_cached_tokens=self.suffix_max_cached_tokens,
        )

    @classmethod
    def from_dict(cls, raw: Any) -> HandlerConfig:
        """Builds the config from the `handler` mapping; raises ValueError naming the bad key."""
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            raise ValueError("model-config.yaml: the handler section must be a mapping")
        names = tuple(f.name for f in dataclasses.fields(cls))
        _check_keys("handler.", raw, names)
        default = cls()
        values: dict[str, Any] = {}
        values["target_model"] = _str("handler.target_model", raw.get("target_model", default.target_model))
        drafter = raw.get("drafter", default.drafter)
        if drafter not in DRAFTERS:
            raise ValueError(
                f"model-config.yaml: handler.drafter must be one of {', '.join(DRAFTERS)}, got {drafter!r}"
            )
        values["drafter"] = drafter
        if drafter in MODEL_FREE:
            if raw.get("draft_model") is not None:
                raise ValueError(
                    f"model-config.yaml: handler.draft_model is set but handler.drafter is {drafter}, which uses "
                    "no draft model; remove draft_model or choose drafter: model or hybrid"
                )
            values["draft_model"] = None
        else:
            values["draft_model"] = _str("handler.draft_model", raw.get("draft_model", default.draft_model))
        draft_tokenizer = raw.get("draft_tokenizer", default.draft_tokenizer)
        values["draft_tokenizer"] = (
            None if draft_tokenizer is None else _str("handler.draft_tokenizer", draft_tokenizer)
        )
        if values["draft_tokenizer"] is not None and values["draft_model"] is None:
            raise ValueError("model-config.yaml: handler.draft_tokenizer is set, but there is no draft_model")
        values["prompt_lookup_min"] = _int(
            "handler.prompt_lookup_min", raw.get("prompt_lookup_min", default.prompt_lookup_min), 1, MAX_PROMPT_LOOKUP
        )
        values["prompt_lookup_max"] = _int(
            "handler.prompt_lookup_max",
            raw.get("prompt_lookup_max", default.prompt_lookup_max),
            values["prompt_lookup_min"],
            MAX_PROMPT_LOOKUP,
        )
        dtype = raw.get("dtype", default.dtype)
        if dtype not in DTYPES:
            raise ValueError(f"model-config.yaml: handler.dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        values["dtype"] = dtype
        values["max_num_speculative_tokens"] = _int(
            "handler.max_num_speculative_tokens",
            raw.get("max_num_speculative_tokens", default.max_num_speculative_tokens),
            0,
            MAX_K,
        )
        values["num_speculative_tokens"] = _int(
            "handler.num_speculative_tokens",
            raw.get("num_speculative_tokens", default.num_speculative_tokens),
            0,
            values["max_num_speculative_tokens"],
        )
        values["prompt_lookup_num_tokens"] = _int(
            "handler.prompt_lookup_num_tokens",
            raw.get("prompt_lookup_num_tokens", default.prompt_lookup_num_tokens),
            0,
            values["max_num_speculative_tokens"],
        )
        values["max_new_tokens_limit"] = _int(
            "handler.max_new_tokens_limit", raw.get("max_new_tokens_limit", default.max_new_tokens_limit), 1
        )
        values["max_new_tokens"] = _int(
            "handler.max_new_tokens",
            raw.get("max_new_tokens", default.max_new_tokens),
            1,
            values["max_new_tokens_limit"],
        )
        for key in (
            "adaptive_k",
            "draft_confidence",
            "draft_guesses",
            "allow_pickle_weights",
            "cpu_packed_weights",
            "prefix_cache",
            "suffix_share_across_requests",
        ):
            values[key] = _bool(f"handler.{key}", raw.get(key, getattr(default, key)))
        values["cpu_threads"] = _int("handler.cpu_threads", raw.get("cpu_threads", default.cpu_threads), 0, 1024)
        values["max_batch_tokens"] = _int(
            "handler.max_batch_tokens", raw.get("max_batch_tokens", default.max_batch_tokens), 0
        )
        values["max_call_ms"] = _float("handler.max_call_ms", raw.get("max_call_ms", default.max_call_ms))
        if not 0 <= values["max_call_ms"] <= 10_000:
            raise ValueError(f"handler.max_call_ms must be between 0 and 10000, got {values['max_call_ms']}")
        timeout = _float(
            "handler.grammar_compile_timeout_s", raw.get("grammar_compile_timeout_s", default.grammar_compile_timeout_s)
        )
        if not 0 < timeout <= 60:
            raise ValueError(f"model-config.yaml: handler.grammar_compile_timeout_s must be in (0, 60], got {timeout}")
        values["grammar_compile_timeout_s"] = timeout
        values["prefix_cache_max_bytes"] = _bytes(
            "handler.prefix_cache_max_bytes", raw.get("prefix_cache_max_bytes", default.prefix_cache_max_bytes)
        )
        values["responses_store_max_entries"] = _int(
            "handler.responses_store_max_entries",
            raw.get("responses_store_max_entries", default.responses_store_max_entries),
            0,
        )
        values["responses_store_max_bytes"] = _bytes(
            "handler.responses_store_max_bytes",
            raw.get("responses_store_max_bytes", default.responses_store_max_bytes),
        )
        values["suffix_max_depth"] = _int(
            "handler.suffix_max_depth", raw.get("suffix_max_depth", default.suffix_max_depth), 1, MAX_SUFFIX_DEPTH
        )
        prob = _float("handler.suffix_min_token_prob", raw.get("suffix_min_token_prob", default.suffix_min_token_prob))
        if not 0.0 <= prob <= 1.0:
            raise ValueError(f"model-config.yaml: handler.suffix_min_token_prob must be in [0, 1], got {prob}")
        values["suffix_min_token_prob"] = prob
        for key in ("suffix_max_cached_requests", "suffix_max_cached_tokens"):
            values[key] = _int(f"handler.{key}", raw.get(key, getattr(default, key)), 0)
        tree = raw.get("speculative_tree", default.speculative_tree)
        if isinstance(tree, bool):  # YAML 1.1 reads an unquoted off (or on) as a boolean
            raw = {**raw, "speculative_tree": "auto" if tree else "off"}
        for key, choices in (
            ("draft_quantization", DRAFT_QUANTIZATIONS),
            ("speculative_tree", SPECULATIVE_TREE_MODES),
            ("runner", RUNNER_MODES),
            ("tool_call_parser", TOOL_CALL_PARSERS),
            ("cross_vocab_greedy", CROSS_VOCAB_GREEDY),
        ):
            value = raw.get(key, getattr(default, key))
            if value not in choices:
                raise ValueError(f"model-config.yaml: handler.{key} must be one of {', '.join(choices)}, got {value!r}")
            values[key] = value
        values["metrics_latency_buckets_s"] = _latency_buckets(
            "handler.metrics_latency_buckets_s", raw.get("metrics_latency_buckets_s", default.metrics_latency_buckets_s)
        )
        values["sampling"] = sampling_params_from_dict(raw.get("sampling", {}))
        return cls(**values)


def handler_config_from_yaml_config(model_yaml_config: Any) -> HandlerConfig:
    """Takes TorchServe's parsed model-config.yaml (worker keys + `handler`) and returns the handler part."""
    if model_yaml_config is None:
        model_yaml_config = {}
    if not isinstance(model_yaml_config, Mapping):
        raise ValueError("model-config.yaml must be a mapping")
    return HandlerConfig.from_dict(model_yaml_config.get("handler"))
