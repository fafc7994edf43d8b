"""Loading the target, the draft and the target's tokenizer, with the checks that make them a pair."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Sequence

import torch

from handler.caches.kv_cache import check_cache_support
from handler.config import HandlerConfig
from handler.runtime.host import usable_cpu_cores

logger = logging.getLogger(__name__)

DTYPE_BY_NAME = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclasses.dataclass
class LoadedModels:
    target: Any
    draft: Any  # None when the deployment drafts by n-gram look-up only
    tokenizer: Any
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    device: torch.device
    dtype: torch.dtype
    max_context: int
    # How the draft's weights are held: "int8" (dynamic quantization) or "none"; auto resolved.
    draft_quantization: str = "none"
    # The draft's float form where int8 serves its passes and the float form prefills faster (both
    # measured at start-up, `draft_quantization: auto`): it prefills the draft's rows; None: the draft does.
    draft_prefill: Any = None
    # How much faster `draft_prefill` prefilled than the draft itself at start-up (1.0 without it): the
    # draft's own wide passes are priced from the prefills' seconds a token times this.
    draft_prefill_speedup: float = 1.0
    # A draft from another family: the map between the vocabularies (`handler.vocab_map.VocabMap`);
    # None where the draft shares the target's tokenizer.
    vocab_map: Any = None

    @classmethod
    def of(
        cls,
        target,
        draft,
        tokenizer,
        *,
        eos_token_ids: Sequence[int] | None = None,
        pad_token_id: int | None = None,
        vocab_map=None,
    ) -> LoadedModels:
        """Models loaded elsewhere (a test's tiny pair, a benchmark's shapes), described as `load_models`
        describes its own; `eos_token_ids` and `pad_token_id` default to the target's."""
        if eos_token_ids is None:
            eos_token_ids = collect_eos_token_ids(tokenizer, target.generation_config)
        parameter = next(target.parameters())
        return cls(
            target=target,
            draft=draft,
            tokenizer=tokenizer,
            eos_token_ids=tuple(eos_token_ids),
            pad_token_id=default_pad_token_id(tokenizer, eos_token_ids) if pad_token_id is None else pad_token_id,
            device=parameter.device,
            dtype=parameter.dtype,
            max_context=max_context(target, draft),
            vocab_map=vocab_map,
        )


def select_device(gpu_id: Any) -> torch.device:
    """cuda:{gpu_id} when TorchServe assigned a GPU and CUDA works, else the CPU."""
    if gpu_id is not None and str(gpu_id) != "" and torch.cuda.is_available():
        return torch.device(f"cuda:{int(gpu_id)}")
    return torch.device("cpu")


def set_cpu_threads(requested: int) -> int:
    """Sets torch's CPU threads: `requested`, or every core this process may use when 0.

    torch takes its thread count from OMP_NUM_THREADS when the worker's
    environment sets it (TorchServe itself sets it only for torchrun workers),
    so a stray OMP_NUM_THREADS=1 would leave all but one core idle. One worker
    holds both models, so by default it uses every core it may: the affinity
    mask, bounded by a container's CPU limit (`usable_cpu_cores`).
    """
    threads = requested or usable_cpu_cores()
    torch.set_num_threads(threads)
    return threads


def resolve_dtype(
    name: str, device: torch.device, model_paths: tuple[str, ...] = (), max_width: int = 1
) -> torch.dtype:
    """`auto` is bfloat16 on a GPU; on the CPU, float32 unless bfloat16 measures clearly faster.

    The CPU rule is `handler.runtime.cpu_speed.choose_cpu_dtype`: float32 keeps greedy
    output token for token; bfloat16 is taken when float32 would not fit in
    memory, or when the weights are large and bfloat16 runs at least 1.25x
    faster on one decoder layer's shapes (CPUs with native bfloat16).

    Args:
        name: the config's dtype.
        device: where the models run.
        model_paths: the target's and the draft's folders (the target's first); hub ids are skipped.
        max_width: the widest verification, max_num_speculative_tokens + 1.
    """
    if name != "auto":
        return DTYPE_BY_NAME[name]
    if device.type == "cuda":
        return torch.bfloat16
    from handler.runtime.cpu_speed import checkpoint_fp32_bytes, choose_cpu_dtype, first_layer_weight_shapes

    shapes = first_layer_weight_shapes(model_paths[0]) if model_paths else []
    return choose_cpu_dtype(checkpoint_fp32_bytes(list(model_paths)), shapes, max_width)


def resolve_model_path(spec: str, model_dir: str | None, key: str) -> str:
    """A folder relative to the model dir, an absolute folder, or else a hub id."""
    if os.path.isabs(spec):
        if not os.path.isdir(spec):
            raise ValueError(f"handler.{key}: {spec} is not a folder")
        return spec
    if model_dir:
        candidate = os.path.join(model_dir, spec)
        if os.path.isdir(candidate):
            return candidate
    logger.info("handler.%s=%r is not a folder in the model dir; loading it as a hub id", key, spec)
    return spec


def _load_causal_lm(path: str, key: str, dtype: torch.dtype, device: torch.device, allow_pickle: bool):
    from transformers import AutoModelForCausalLM

    # Pickled .bin weights can run code when loaded: only safetensors unless the config allows them.
    # trust_remote_code stays off: a model folder never brings its own Python.
    use_safetensors = None if allow_pickle else True
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, use_safetensors=use_safetensors, trust_remote_code=False
        )
    except Exception as error:  # transformers raises many types; the user needs the path and the cause
        hint = "" if allow_pickle else " (only safetensors weights load unless handler.allow_pickle_weights is true)"
        raise ValueError(f"handler.{key}: cannot load a causal LM from {path!r}{hint}: {error}") from error
    return model.to(device).eval()


def collect_eos_token_ids(tokenizer, generation_config) -> tuple[int, ...]:
    """The tokenizer's EOS plus the generation config's (an int or a list)."""
    ids: list[int] = []
    candidates = [tokenizer.eos_token_id, getattr(generation_config, "eos_token_id", None)]
    for value in candidates:
        for token_id in value if isinstance(value, (list, tuple)) else [value]:
            if token_id is not None and token_id not in ids:
                ids.append(int(token_id))
    return tuple(ids)


def default_pad_token_id(tokenizer, eos_token_ids: Sequence[int]) -> int:
    """The tokenizer's padding token, else the first EOS token, else 0 (padding is masked out anyway)."""
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    return eos_token_ids[0] if eos_token_ids else 0


def max_context(target, draft) -> int:
    """The longest context both models take (their `max_position_embeddings`, where they say)."""
    return min(
        getattr(model.config.get_text_config(), "max_position_embeddings", None) or 2**31 - 1
        for model in (target, draft)
        if model is not None
    )


def check_vocabularies(
    tokenizer, target, draft, draft_path: str, target_path: str = "the target", draft_tokenizer_path: str | None = None
):
    """Returns None where the draft shares the target's tokenizer, and the map between the two
    vocabularies (`handler.vocab_map.VocabMap`) for a draft from another family; refuses a pair
    whose vocabularies cannot work together, naming both."""
    from transformers import AutoTokenizer

    num_tokens = len(tokenizer)
    target_vocab = target.config.get_text_config().vocab_size
    draft_vocab = draft.config.get_text_config().vocab_size
    if num_tokens > target_vocab:
        raise ValueError(
            f"the target tokenizer ({target_path}) has {num_tokens} tokens, "
            f"but the target's vocab_size is {target_vocab}"
        )
    try:
        draft_tokenizer = AutoTokenizer.from_pretrained(draft_tokenizer_path or draft_path)
    except (OSError, ValueError) as error:
        if draft_tokenizer_path is not None:
            raise ValueError(
                f"handler.draft_tokenizer: cannot load a tokenizer from {draft_tokenizer_path!r}: {error}"
            ) from error
        draft_tokenizer = None
    if draft_tokenizer is None or draft_tokenizer.get_vocab() == tokenizer.get_vocab():
        if num_tokens > draft_vocab:
            raise ValueError(
                f"the draft's vocab_size ({draft_vocab}, {draft_path}) is smaller than the target tokenizer's "
                f"({num_tokens} tokens, {target_path}): a draft without a tokenizer of its own must share the "
                "target's (give its own with handler.draft_tokenizer)"
            )
        if draft_tokenizer is None:
            logger.info("the draft folder has no tokenizer; assuming it shares the target's")
        return None
    if len(draft_tokenizer) > draft_vocab:
        raise ValueError(
            f"the draft's tokenizer ({draft_tokenizer_path or draft_path}) has {len(draft_tokenizer)} tokens, "
            f"but the draft's vocab_size is {draft_vocab}"
        )
    from handler.vocab_map import VocabMap

    try:
        vocab_map = VocabMap.from_tokenizers(tokenizer, draft_tokenizer, target_vocab)
    except ValueError as error:
        raise ValueError(
            f"the draft's tokenizer ({draft_path}: {len(draft_tokenizer)} tokens) differs from the target's "
            f"({target_path}: {num_tokens} tokens), and {error}"
        ) from error
    logger.info(
        "the draft (%s, %d tokens) has another vocabulary than the target (%s, %d tokens): %d tokens "
        "(%.1f%% of the draft's) are shared; it drafts across vocabularies (docs/heterogeneous-drafts.md)",
        draft_path,
        len(draft_tokenizer),
        target_path,
        num_tokens,
        vocab_map.num_shared,
        100 * vocab_map.shared_share,
    )
    if vocab_map.num_shared == 0:
        raise ValueError(
            f"the draft's tokenizer ({draft_path}) and the target's ({target_path}) share no token: "
            "the draft could never propose one"
        )
    return vocab_map


def resolve_model_paths(config: HandlerConfig, model_dir: str | None) -> tuple[str, str | None]:
    """The target's and the draft's folder or hub id (None: no draft model)."""
    target_path = resolve_model_path(config.target_model, model_dir, "target_model")
    if config.draft_model is None:
        return target_path, None
    return target_path, resolve_model_path(config.draft_model, model_dir, "draft_model")


def load_tokenizer(target_path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(target_path)
    except Exception as error:
        raise ValueError(f"handler.target_model: cannot load a tokenizer from {target_path!r}: {error}") from error


def check_models(config: HandlerConfig, tokenizer, target, draft, target_path: str, draft_path: str | None):
    """The checks that make two models a pair: their vocabularies (`check_vocabularies`, whose map it
    returns) and caches that roll back by a length (`check_cache_support`). They read the models'
    configs and classes only, so they pass or fail alike on empty models (`check_pair`)."""
    vocab_map = None
    if draft is not None:
        vocab_map = check_vocabularies(tokenizer, target, draft, draft_path, target_path, config.draft_tokenizer)
        check_cache_support(draft)
    check_cache_support(target)
    return vocab_map


def _empty_causal_lm(path: str, key: str):
    """The model's class built from its config on the meta device: no weight is read or allocated."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        model_config = AutoConfig.from_pretrained(path, trust_remote_code=False)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(model_config, trust_remote_code=False)
    except Exception as error:  # as in _load_causal_lm: the user needs the path and the cause
        raise ValueError(f"handler.{key}: cannot load a causal LM from {path!r}: {error}") from error


def check_pair(config: HandlerConfig, model_dir: str | None) -> None:
    """The load-time checks of `load_models` on the pair a config names, without loading a weight, so
    that a pair the worker would refuse is refused before a server starts, with the worker's message.

    Raises:
        ValueError: what `load_models` would raise for this pair (tokenizer, vocabularies, caches).
    """
    target_path, draft_path = resolve_model_paths(config, model_dir)
    tokenizer = load_tokenizer(target_path)
    target = _empty_causal_lm(target_path, "target_model")
    draft = None if draft_path is None else _empty_causal_lm(draft_path, "draft_model")
    check_models(config, tokenizer, target, draft, target_path, draft_path)


def load_models(config: HandlerConfig, model_dir: str | None, gpu_id: Any = None) -> LoadedModels:
    """Loads both models on one device and checks they can work as a pair (`check_models`)."""
    device = select_device(gpu_id)
    if device.type == "cpu":
        logger.info("using %d CPU threads", set_cpu_threads(config.cpu_threads))
    target_path, draft_path = resolve_model_paths(config, model_dir)
    model_paths = (target_path, draft_path) if draft_path is not None else (target_path,)
    dtype = resolve_dtype(config.dtype, device, model_paths, config.max_num_speculative_tokens + 1)
    logger.info(
        "loading target %s and draft %s on %s as %s", target_path, draft_path or "(none: n-gram look-up)", device, dtype
    )
    tokenizer = load_tokenizer(target_path)
    target = _load_causal_lm(target_path, "target_model", dtype, device, config.allow_pickle_weights)
    draft = None
    if draft_path is not None:
        draft = _load_causal_lm(draft_path, "draft_model", dtype, device, config.allow_pickle_weights)
    vocab_map = check_models(config, tokenizer, target, draft, target_path, draft_path)
    if draft is not None:
        if config.draft_quantization == "int8":
            if device.type != "cpu":
                raise ValueError("handler.draft_quantization: int8 runs on the CPU only; use none on a GPU")
            from handler.runtime.cpu_speed import quantize_draft_int8

            draft = quantize_draft_int8(draft)
    if device.type == "cpu" and config.cpu_packed_weights:
        from handler.runtime.cpu_speed import pack_linear_layers, tied_head_copy_fits

        # After quantization: an int8 draft's layers are not nn.Linear and stay as they are.
        num_target = pack_linear_layers(target, copy_tied_head=tied_head_copy_fits(target))
        num_draft = 0 if draft is None else pack_linear_layers(draft, copy_tied_head=tied_head_copy_fits(draft))
        logger.info("oneDNN packed linear layers: %d in the target, %d in the draft", num_target, num_draft)
    draft_quantization = "int8" if config.draft_quantization == "int8" else "none"
    draft_prefill, draft_prefill_speedup = None, 1.0
    if draft is not None and config.draft_quantization == "auto" and device.type == "cpu":
        from handler.runtime.cpu_speed import choose_draft_quantization

        # Timed as it will serve: the float draft packed, against its int8 form.
        draft, draft_quantization, draft_prefill, draft_prefill_speedup = choose_draft_quantization(draft)

    eos_token_ids = collect_eos_token_ids(tokenizer, target.generation_config)
    if not eos_token_ids:
        logger.warning("the target has no EOS token; requests stop only at max_new_tokens or a stop string")
    return LoadedModels(
        target=target,
        draft=draft,
        tokenizer=tokenizer,
        eos_token_ids=eos_token_ids,
        pad_token_id=default_pad_token_id(tokenizer, eos_token_ids),
        device=device,
        dtype=dtype,
        max_context=max_context(target, draft),
        draft_quantization=draft_quantization,
        draft_prefill=draft_prefill,
        draft_prefill_speedup=draft_prefill_speedup,
        vocab_map=vocab_map,
    )
