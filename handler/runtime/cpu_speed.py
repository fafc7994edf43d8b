"""A faster forward pass on the CPU: linear layers on oneDNN with pre-packed weights.

Decoding on a CPU is bound by reading the weights: a verification over k + 1
tokens should cost about what one token costs, since each weight is read once
whatever the number of rows. torch's default CPU path does not get there. In
float32, `F.linear` goes to MKL, whose matrix-vector path (one row) runs near
memory speed but whose matrix-matrix path for 2..16 rows costs about twice as
much on the CPUs measured (docs/cpu-verify-cost.md). In bfloat16 it goes to
oneDNN, which re-orders the plain weight into its blocked layout on every call.

`pack_linear_layers` re-lays each linear weight once, at load time, into
oneDNN's blocked layout and runs the layer with `torch.ops.mkldnn._linear_pointwise`
(the kernel torch.compile's CPU back end uses after freezing). The weights
keep their values; only the order of the additions inside a dot product
changes, which moves float32 logits by about 1e-5 on the demo target: the same
size as the difference between MKL's one-row and many-row paths that every
verification already sees. The memory stays the same: the plain weight is
dropped once packed. A weight shared with the input embedding (a tied output
head) has to stay plain for the embedding: the head then either runs on the
plain weight (oneDNN re-lays it on every call) or on a packed copy of it, which
costs the head's bytes once more. On the demo target (bf16, a 151936 x 1536
head, 467 MB) the copy cut the head from 26.5 to 15.9 ms at 5 rows and a
5-token verify pass from about 147 to 129 ms; `copy_tied_head` asks for it.

`choose_cpu_dtype` is the rule behind `dtype: auto` on the CPU: float32 unless
bfloat16 is clearly faster on this machine, measured on one decoder layer's
linear shapes, or float32 would not fit in memory. `choose_draft_quantization`
is the rule behind `draft_quantization: auto`: the draft's decoding step timed
in its float form (packed, in the target's dtype) and as dynamic int8, the
int8 form kept only where it is clearly faster; its prefill timed in both, the
float form kept beside it for prefills where that is clearly faster.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import struct
import time

import torch

from handler.runtime.host import host_available_memory

logger = logging.getLogger(__name__)

# bfloat16 must beat float32 by this factor for `dtype: auto` to give up float32's exactness.
BF16_MIN_SPEEDUP = 1.25
# Models whose float32 weights take less than this are never worth the bf16 caveat: their
# passes are dominated by per-layer overheads, not by reading weights.
MIN_BYTES_FOR_BF16 = 256 * 2**20
# Share of the available memory that the float32 weights of both models may take.
FP32_MEMORY_FRACTION = 0.6
# A tied output head gets a packed copy of its weight while the copy takes at most this share of
# the memory available after loading (`pack_linear_layers`).
TIED_HEAD_COPY_MEMORY_FRACTION = 0.1
# An int8 draft must step this much faster than its float form for `draft_quantization: auto`
# to take it: its rounding costs some acceptance.
INT8_DRAFT_MIN_SPEEDUP = 1.2
# An int8 draft's float form must prefill this much faster than the int8 form for auto to keep it
# for the draft's prefills (`choose_draft_quantization`): it holds the float weights' memory again.
FLOAT_PREFILL_MIN_SPEEDUP = 1.2
# ... and its weights may take at most this share of the host memory still available with both forms
# loaded: kept, they are the memory a prefix cache or a longer batch would otherwise have.
FLOAT_PREFILL_MEMORY_FRACTION = 0.25
PREFILL_TIMING_TOKENS = 256  # the prefill `choose_draft_quantization` times, one row (a short one is weight-bound)


def onednn_supports(dtype: torch.dtype) -> bool:
    """Whether this torch build can run oneDNN linear layers in `dtype` on this CPU."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return False


class PackedLinear(torch.nn.Module):
    """A bias-optional linear layer run by oneDNN, its weight pre-packed once (or shared and plain)."""

    def __init__(
        self,
        weight: torch.Tensor,  # [out_features, in_features]
        bias: torch.nn.Parameter | None,  # [out_features]
        pack: bool,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        weight = weight.detach()
        # An opaque oneDNN tensor: kept as a plain attribute, outside state_dict and parameters().
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, None) if pack else weight
        self.bias = bias

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., in_features]
        bias = None if self.bias is None else self.bias.detach()
        return torch.ops.mkldnn._linear_pointwise(hidden, self.packed_weight, bias, "none", [None], "")  # [..., out]

    def plain_weight(self) -> torch.Tensor:  # [out_features, in_features]
        """The weight in torch's ordinary layout (packing keeps every value)."""
        return self.packed_weight.to_dense() if self.packed_weight.is_mkldnn else self.packed_weight

    def to_linear(self) -> torch.nn.Linear:
        """An nn.Linear with the same weight and bias, e.g. for a quantizer that looks for nn.Linear."""
        weight = self.plain_weight()
        linear = torch.nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        linear.weight = torch.nn.Parameter(weight, requires_grad=False)
        if self.bias is not None:
            linear.bias = self.bias
        return linear

    def __deepcopy__(self, memo: dict) -> PackedLinear:
        # An opaque oneDNN tensor has no storage for copy.deepcopy to copy: re-pack a plain copy.
        bias = None if self.bias is None else copy.deepcopy(self.bias, memo)
        return PackedLinear(self.plain_weight().clone(), bias, pack=self.packed_weight.is_mkldnn)

    def extra_repr(self) -> str:
        packed = self.packed_weight.is_mkldnn
        return f"in_features={self.in_features}, out_features={self.out_features}, packed={packed}"


def pack_linear_layers(model: torch.nn.Module, copy_tied_head: bool = False) -> int:
    """Replaces every nn.Linear of a CPU model with a PackedLinear, in place.

    Args:
        model: a float32 or bfloat16 model on the CPU, in eval mode, used for inference only
            (oneDNN's linear has no backward).
        copy_tied_head: an output head tied to the input embedding runs on a packed copy of
            the shared weight (its bytes once more) instead of the plain weight.

    Returns:
        The number of layers replaced (0 when oneDNN cannot run the model's dtype here).
    """
    parameter = next(model.parameters())
    assert parameter.device.type == "cpu", parameter.device
    if not onednn_supports(parameter.dtype):
        logger.info("oneDNN cannot run %s linear layers here; keeping torch's default path", parameter.dtype)
        return 0
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    shared = embedding.weight if embedding is not None else None
    num_replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            # Exactly nn.Linear: subclasses (quantized or LoRA layers) compute something else.
            if type(child) is not torch.nn.Linear or child.weight.dtype != parameter.dtype:
                continue
            tied = shared is not None and child.weight is shared
            setattr(parent, name, PackedLinear(child.weight, child.bias, pack=copy_tied_head or not tied))
            num_replaced += 1
    return num_replaced


def tied_head_copy_fits(model: torch.nn.Module) -> bool:
    """Whether the model's output head is tied to its input embedding and a packed copy of it takes
    at most `TIED_HEAD_COPY_MEMORY_FRACTION` of the host memory available now (cgroup included)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if type(head) is not torch.nn.Linear or embedding is None or head.weight is not embedding.weight:
        return False
    head_bytes = head.weight.numel() * head.weight.element_size()
    available, where = host_available_memory()
    fits = head_bytes <= TIED_HEAD_COPY_MEMORY_FRACTION * available
    logger.info(
        "tied output head (%.0f MB): %s (%.0f MB available, %s)",
        head_bytes / 1e6,
        "a packed copy" if fits else "the shared plain weight",
        available / 1e6,
        where,
    )
    return fits


def unpack_linear_layers(model: torch.nn.Module) -> int:
    """Turns every PackedLinear of a model back into an nn.Linear, in place; returns how many."""
    num_replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, PackedLinear):
                setattr(parent, name, child.to_linear())
                num_replaced += 1
    return num_replaced


@torch.inference_mode()
def measure_bf16_speedup(weight_shapes: list[tuple[int, int]], widths: tuple[int, ...], repeats: int = 5) -> float:
    """float32 seconds / bfloat16 seconds for packed linear layers of these shapes, on this CPU.

    One pass runs every layer in turn, so that the weights together overflow
    the last-level cache as a whole model does; a layer timed alone could be
    served from the cache in bfloat16 and not in float32. The timing runs on
    one thread and keeps the fastest pass: a ratio of two memory-bound passes
    survives that, while a multi-threaded pass on a busy machine mostly times
    the other processes.

    Args:
        weight_shapes: (out_features, in_features) of the layers to time, e.g. one decoder layer's.
        widths: rows per pass (tokens in a verification); their times are summed.
        repeats: timed passes per dtype and width, alternating between the dtypes.

    Returns:
        How many times faster bfloat16 runs; 0.0 when oneDNN cannot run bfloat16 here.
    """
    if not (onednn_supports(torch.float32) and onednn_supports(torch.bfloat16)) or not weight_shapes:
        return 0.0
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(shape, generator=generator) * 0.02 for shape in weight_shapes]  # [out, in] each
    dtypes = (torch.float32, torch.bfloat16)
    layers = {dtype: [PackedLinear(weight.to(dtype), None, pack=True) for weight in weights] for dtype in dtypes}
    inputs = {
        (dtype, width): [
            torch.randn(width, in_features, generator=generator).to(dtype) for _, in_features in weight_shapes
        ]
        for dtype in dtypes
        for width in widths
    }  # each [width, in_features]
    best = {(dtype, width): float("inf") for dtype in dtypes for width in widths}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for repeat in range(repeats + 1):
            for width in widths:
                for dtype in dtypes:
                    start = time.perf_counter()
                    for layer, hidden in zip(layers[dtype], inputs[dtype, width]):
                        layer(hidden)
                    if repeat:  # the first pass creates oneDNN's kernels
                        best[dtype, width] = min(best[dtype, width], time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    seconds = {dtype: sum(best[dtype, width] for width in widths) for dtype in dtypes}
    return seconds[torch.float32] / seconds[torch.bfloat16]


def _safetensors_headers(path: str) -> list[dict]:
    headers = []
    if not os.path.isdir(path):
        return headers
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with open(os.path.join(path, name), "rb") as file:
                (header_length,) = struct.unpack("<Q", file.read(8))
                header = json.loads(file.read(header_length))
            header.pop("__metadata__", None)
            headers.append(header)
    return headers


def checkpoint_fp32_bytes(paths: list[str]) -> int:
    """The float32 size of the weights in these model folders, read from their safetensors headers."""
    return sum(
        4 * math.prod(tensor["shape"])
        for path in paths
        for header in _safetensors_headers(path)
        for tensor in header.values()
    )


def first_layer_weight_shapes(path: str) -> list[tuple[int, int]]:
    """The (out, in) shapes of the 2-D weights of decoder layer 0 in a model folder's safetensors."""
    shapes = []
    for header in _safetensors_headers(path):
        for key, tensor in header.items():
            if ".layers.0." in key and key.endswith(".weight") and len(tensor["shape"]) == 2:
                shapes.append((int(tensor["shape"][0]), int(tensor["shape"][1])))
    return sorted(shapes)


def choose_cpu_dtype(fp32_bytes: int, weight_shapes: list[tuple[int, int]], max_width: int) -> torch.dtype:
    """The dtype `dtype: auto` picks on the CPU.

    float32 (exact greedy output, token for token) unless both: the weights are
    big enough for their reading to dominate a pass, and bfloat16 measures at
    least BF16_MIN_SPEEDUP times faster on these layer shapes at widths 1 and
    max_width. bfloat16 regardless when float32 weights would take more than
    FP32_MEMORY_FRACTION of the available memory.

    Args:
        fp32_bytes: float32 size of both models' weights (checkpoint_fp32_bytes).
        weight_shapes: (out_features, in_features) of one decoder layer's linear layers.
        max_width: the widest verification, max_num_speculative_tokens + 1.

    Returns:
        torch.float32 or torch.bfloat16.
    """
    available, _ = host_available_memory()
    if available is not None and fp32_bytes > FP32_MEMORY_FRACTION * available and onednn_supports(torch.bfloat16):
        logger.info(
            "dtype auto: bfloat16, float32 weights (%.1f GB) exceed %.0f%% of the available memory (%.1f GB)",
            fp32_bytes / 1e9,
            100 * FP32_MEMORY_FRACTION,
            available / 1e9,
        )
        return torch.bfloat16
    if fp32_bytes < MIN_BYTES_FOR_BF16 or not weight_shapes:
        logger.info("dtype auto: float32 (%.0f MB of weights: too small for bfloat16 to pay)", fp32_bytes / 2**20)
        return torch.float32
    if not onednn_supports(torch.bfloat16):
        logger.info("dtype auto: float32 (oneDNN has no bfloat16 kernels on this CPU: bfloat16 would be slower)")
        return torch.float32
    speedup = measure_bf16_speedup(weight_shapes, widths=tuple(sorted({1, max(1, max_width)})))
    dtype = torch.bfloat16 if speedup >= BF16_MIN_SPEEDUP else torch.float32
    logger.info(
        "dtype auto: %s (bfloat16 measured %.2fx float32's speed on one decoder layer; needs %.2fx)",
        str(dtype).removeprefix("torch."),
        speedup,
        BF16_MIN_SPEEDUP,
    )
    return dtype


def decode_step_seconds(model: torch.nn.Module, context: int = 64, repeats: int = 5) -> float:
    """The median seconds of one decoding step: one row, one new token after `context` cached ones.

    Timed through the engine's own cache (`handler.caches.kv_cache`), on random token ids.
    """
    from handler.caches.kv_cache import prefill

    token_ids = _random_token_ids(model, context + repeats + 1)
    one = torch.ones((1, 1), dtype=torch.long)
    seconds = []
    with torch.inference_mode():
        cache = prefill(model, [token_ids[:context]], 0)
        for index in range(context, context + repeats + 1):
            start = time.perf_counter()
            cache.forward(torch.tensor([[token_ids[index]]]), one, logits_to_keep=1)
            seconds.append(time.perf_counter() - start)
    return _median_after_first(seconds)


def prefill_token_seconds(model: torch.nn.Module, num_tokens: int = PREFILL_TIMING_TOKENS, repeats: int = 3) -> float:
    """The median seconds a token of one row's prefill of `num_tokens` random ids (after one untimed),
    through the engine's own cache (`handler.caches.kv_cache`)."""
    from handler.caches.kv_cache import prefill

    token_ids = _random_token_ids(model, num_tokens)
    seconds = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            start = time.perf_counter()
            prefill(model, [token_ids], 0)
            seconds.append(time.perf_counter() - start)
    return _median_after_first(seconds) / num_tokens


def _random_token_ids(model: torch.nn.Module, count: int) -> list[int]:
    """`count` token ids of the model's vocabulary, the same for every model of that vocabulary (seed 0)."""
    vocab_size = model.config.get_text_config().vocab_size
    return torch.randint(0, vocab_size, (count,), generator=torch.Generator().manual_seed(0)).tolist()


def _median_after_first(seconds: list[float]) -> float:
    """The median of timings after the first, which warms up (the upper one of an even count)."""
    rest = sorted(seconds[1:])
    return rest[len(rest) // 2]


def choose_draft_quantization(draft: torch.nn.Module) -> tuple[torch.nn.Module, str, torch.nn.Module | None, float]:
    """The draft in the form whose decoding step is faster on this CPU: as given, or dynamic int8;
    and the form that prefills its rows.

    `draft` is the float draft as it will serve (packed, in the target's dtype). Its int8
    form is taken only where it steps at least `INT8_DRAFT_MIN_SPEEDUP` times faster.
    Both forms are held in memory while they are timed. A prefill is bound by arithmetic, not by
    reading the weights: on a CPU with bf16 matrix units the int8 form's dynamic quantization
    prefills at half the float form's speed (1.3 against 0.7 ms a token, the demo draft, 2 cores).
    Where int8 steps and the float form prefills at least `FLOAT_PREFILL_MIN_SPEEDUP` times faster,
    both forms stay: the float one prefills the rows the draft joins (its KV cast to the int8 form's),
    which costs the float weights' memory once more, held only where they take at most
    `FLOAT_PREFILL_MEMORY_FRACTION` of the memory still available.

    Returns:
        the chosen draft, "int8" or "none", its float form where that prefills (else None), and then
        how much faster it prefilled than the int8 form (else 1.0): the planner prices the int8 form's
        own wide passes (a catch-up, a pass with guesses) from the float form's prefills by it.
    """

    int8 = quantize_draft_int8(copy.deepcopy(draft))
    float_seconds, int8_seconds = decode_step_seconds(draft), decode_step_seconds(int8)
    choice = "int8" if float_seconds >= INT8_DRAFT_MIN_SPEEDUP * int8_seconds else "none"
    logger.info(
        "draft_quantization auto: a draft step takes %.1f ms as it loaded, %.1f ms in int8 -> %s",
        float_seconds * 1e3,
        int8_seconds * 1e3,
        choice,
    )
    if choice == "none":
        return draft, choice, None, 1.0
    float_prefill, int8_prefill = prefill_token_seconds(draft), prefill_token_seconds(int8)
    faster = float_prefill * FLOAT_PREFILL_MIN_SPEEDUP <= int8_prefill
    weight_bytes, (available, where) = float_weight_bytes(draft), host_available_memory()
    fits = weight_bytes <= FLOAT_PREFILL_MEMORY_FRACTION * available
    held = f"the {str(draft.dtype).removeprefix('torch.')} form prefills (both held)"
    logger.info(
        "draft prefill: %.2f ms a token as it loaded, %.2f ms in int8 -> %s (float weights %.0f MB, %.0f MB free, %s)",
        float_prefill * 1e3,
        int8_prefill * 1e3,
        held if faster and fits else "int8 prefills" + ("" if fits else ": no room for both forms"),
        weight_bytes / 1e6,
        available / 1e6,
        where,
    )
    if not (faster and fits):
        return int8, choice, None, 1.0
    return int8, choice, draft, int8_prefill / float_prefill


def float_weight_bytes(model: torch.nn.Module) -> int:
    """The bytes of a float model's weights: its parameters, and the packed copies of its linear layers'
    (`PackedLinear`: outside `parameters()`), each tensor once."""
    tensors = {tensor.data_ptr(): tensor for tensor in model.parameters()}
    total = sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
    element_size = torch.empty((), dtype=model.dtype).element_size()
    for module in model.modules():
        if isinstance(module, PackedLinear) and module.packed_weight.is_mkldnn:
            total += module.out_features * module.in_features * element_size
    return total


def quantize_draft_int8(draft):
    """Dynamic int8 quantization of the draft's linear layers, on the CPU.

    Weights are int8; activations are quantized at each forward pass with one
    scale for the whole input, so over the whole batch. Only the draft
    changes: greedy output stays the target's and sampled output keeps the
    target's distribution; a cheaper draft costs some acceptance, which the
    benchmark measures. Because the scale is shared, a row's proposals depend
    on the rows beside it; outputs do not: greedy ones are the target's, and a
    seeded sampled one depends on its seed and the target alone
    (`handler.sampler.coupled_targets`).
    """
    from torch.ao.quantization import quantize_dynamic

    # The quantizer looks for nn.Linear: layers already packed for oneDNN go back first.
    unpack_linear_layers(draft)
    return quantize_dynamic(draft.float(), {torch.nn.Linear}, dtype=torch.qint8)
