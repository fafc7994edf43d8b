"""oneDNN packed linear layers keep the target's output; the dtype rule of `dtype: auto` on the CPU."""

from __future__ import annotations

import pytest
import torch

from handler.runtime import cpu_speed
from handler.config import HandlerConfig
from handler.runtime.cpu_speed import PackedLinear, checkpoint_fp32_bytes, choose_cpu_dtype, first_layer_weight_shapes, measure_bf16_speedup, pack_linear_layers
from handler.engine import GenerationRequest
from handler.runtime.loading import load_models

from .conftest import make_engine
from .test_engine import GREEDY, PROMPTS, encode, reference_greedy

pytestmark = pytest.mark.skipif(not cpu_speed.onednn_supports(torch.float32), reason="this torch has no oneDNN")


def load_tiny(tiny_models_dir, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return [
        AutoModelForCausalLM.from_pretrained(tiny_models_dir / name, dtype=dtype).eval() for name in ("target", "draft")
    ]


@pytest.fixture(scope="module")
def packed_pair(tiny_models_dir):
    target, draft = load_tiny(tiny_models_dir)
    assert pack_linear_layers(target) == pack_linear_layers(draft) == 2 * 7 + 1  # 2 layers x 7, plus the head
    return target, draft


def test_every_linear_is_replaced_and_the_tied_head_stays_shared(tiny_models_dir):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tiny_models_dir / "target", dtype=torch.float32).eval()
    tied = target.get_output_embeddings().weight is target.get_input_embeddings().weight
    num_parameters = sum(parameter.numel() for parameter in target.parameters())
    pack_linear_layers(target)
    assert not any(type(module) is torch.nn.Linear for module in target.modules())
    head = target.lm_head
    assert isinstance(head, PackedLinear)
    assert head.packed_weight.is_mkldnn is not tied  # a shared weight stays plain, no copy
    assert target.model.layers[0].mlp.up_proj.packed_weight.is_mkldnn
    # The plain weights are gone, not duplicated: only the embedding, norms and biases stay parameters.
    assert sum(parameter.numel() for parameter in target.parameters()) < num_parameters


def test_a_tied_head_may_run_on_a_packed_copy_beside_the_embedding(tiny_models_dir, monkeypatch):
    from transformers import AutoModelForCausalLM

    def tied_target():
        model = AutoModelForCausalLM.from_pretrained(tiny_models_dir / "target", dtype=torch.float32).eval()
        model.lm_head.weight = model.get_input_embeddings().weight  # the demo pair's heads are tied
        return model

    plain, packed = tied_target(), tied_target()
    assert cpu_speed.tied_head_copy_fits(packed)  # a tiny head fits in any memory
    pack_linear_layers(packed, copy_tied_head=True)
    assert packed.lm_head.packed_weight.is_mkldnn
    torch.testing.assert_close(packed.get_input_embeddings().weight, plain.get_input_embeddings().weight)
    input_ids = torch.arange(3, 20)[None]
    with torch.inference_mode():
        torch.testing.assert_close(packed(input_ids).logits, plain(input_ids).logits, rtol=1e-4, atol=1e-4)
    # Without the memory for the copy, the head stays on the shared weight.
    monkeypatch.setattr("handler.runtime.cpu_speed.host_available_memory", lambda: (1000, "a test"))
    assert not cpu_speed.tied_head_copy_fits(plain)
    untied = AutoModelForCausalLM.from_pretrained(tiny_models_dir / "target", dtype=torch.float32)
    monkeypatch.setattr("handler.runtime.cpu_speed.host_available_memory", lambda: (2**40, "a test"))
    assert not cpu_speed.tied_head_copy_fits(untied)  # nothing to copy: its head has its own weight


def test_packed_logits_match_the_plain_model(tiny_models_dir, packed_pair):
    plain, _ = load_tiny(tiny_models_dir)
    packed, _ = packed_pair
    input_ids = torch.arange(3, 40)[None]  # [1, 37]
    with torch.inference_mode():
        expected = plain(input_ids).logits
        actual = packed(input_ids).logits
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("k", [1, 4, 8])
def test_greedy_output_with_packed_layers_equals_the_plain_targets_generate(tiny_pair, packed_pair, k):
    plain_target, _, tokenizer = tiny_pair
    engine = make_engine(*packed_pair, tokenizer)
    for prompt in PROMPTS:
        prompt_ids = encode(tokenizer, prompt)
        expected = reference_greedy(plain_target, prompt_ids, 40)
        assert engine.generate([GenerationRequest(prompt_ids, 40, GREEDY, k)])[0].token_ids == expected, prompt


def test_bfloat16_layers_pack_too(tiny_models_dir):
    if not cpu_speed.onednn_supports(torch.bfloat16):
        pytest.skip("oneDNN has no bfloat16 on this CPU")
    plain, _ = load_tiny(tiny_models_dir, torch.bfloat16)
    packed, _ = load_tiny(tiny_models_dir, torch.bfloat16)
    assert pack_linear_layers(packed) == 15
    input_ids = torch.arange(3, 20)[None]
    with torch.inference_mode():
        # bf16 F.linear already runs on oneDNN: packing only saves the per-call re-layout.
        torch.testing.assert_close(packed(input_ids).logits, plain(input_ids).logits, rtol=0, atol=0)


def test_load_models_packs_on_the_cpu_unless_the_config_says_no(tiny_models_dir):
    on = load_models(HandlerConfig(dtype="float32"), str(tiny_models_dir))
    assert isinstance(on.target.lm_head, PackedLinear) and isinstance(on.draft.lm_head, PackedLinear)
    off = load_models(HandlerConfig(dtype="float32", cpu_packed_weights=False), str(tiny_models_dir))
    assert type(off.target.lm_head) is torch.nn.Linear


def test_checkpoint_sizes_and_shapes_come_from_the_safetensors_headers(tiny_models_dir, tiny_pair):
    target, draft, _ = tiny_pair
    expected = 4 * sum(
        p.numel() for model in (target, draft) for p in model.state_dict().values() if p.is_floating_point()
    )
    # Tied heads are stored once; the state dict lists them twice.
    tied = sum(model.lm_head.weight.numel() for model in (target, draft) if model.config.tie_word_embeddings)
    assert (
        checkpoint_fp32_bytes([str(tiny_models_dir / "target"), str(tiny_models_dir / "draft")]) == expected - 4 * tied
    )
    config = target.config
    hidden, inter = config.hidden_size, config.intermediate_size
    shapes = first_layer_weight_shapes(str(tiny_models_dir / "target"))
    assert (inter, hidden) in shapes and (hidden, inter) in shapes and len(shapes) == 7
    assert first_layer_weight_shapes(str(tiny_models_dir / "no-such-folder")) == []


def test_auto_dtype_rule(monkeypatch):
    shapes = [(64, 32), (32, 64)]
    big = 4 * 2**30
    monkeypatch.setattr(cpu_speed, "host_available_memory", lambda: (64 * 2**30, "a test"))
    # Small models stay float32 without measuring.
    monkeypatch.setattr(cpu_speed, "measure_bf16_speedup", lambda *a, **k: pytest.fail("measured a tiny model"))
    assert choose_cpu_dtype(10 * 2**20, shapes, 5) == torch.float32
    # No bf16 kernels in oneDNN: float32, without measuring.
    monkeypatch.setattr(cpu_speed, "onednn_supports", lambda dtype: dtype == torch.float32)
    assert choose_cpu_dtype(4 * 2**30, shapes, 5) == torch.float32
    # Large models: bf16 only when it measures at least BF16_MIN_SPEEDUP faster.
    monkeypatch.setattr(cpu_speed, "onednn_supports", lambda dtype: True)
    monkeypatch.setattr(cpu_speed, "measure_bf16_speedup", lambda *a, **k: 2.0)
    assert choose_cpu_dtype(big, shapes, 5) == torch.bfloat16
    monkeypatch.setattr(cpu_speed, "measure_bf16_speedup", lambda *a, **k: 1.1)
    assert choose_cpu_dtype(big, shapes, 5) == torch.float32
    # float32 that would not fit in memory: bf16 whatever the speed, where oneDNN runs bf16 on this CPU.
    monkeypatch.setattr(cpu_speed, "host_available_memory", lambda: (5 * 2**30, "a test"))
    monkeypatch.setattr(cpu_speed, "onednn_supports", lambda dtype: True)
    assert choose_cpu_dtype(big, shapes, 5) == torch.bfloat16
    # Where it does not, the measured speed decides, as for models that fit.
    monkeypatch.setattr(cpu_speed, "onednn_supports", lambda dtype: dtype == torch.float32)
    assert choose_cpu_dtype(big, shapes, 5) == torch.float32


def test_the_bf16_speedup_is_measured_on_real_layers():
    speedup = measure_bf16_speedup([(256, 128), (128, 256)], widths=(1, 4), repeats=2)
    assert speedup > 0.0 if cpu_speed.onednn_supports(torch.bfloat16) else speedup == 0.0


def test_a_packed_model_deep_copies_and_unpacks_for_the_int8_quantizer(tiny_models_dir, tiny_pair):
    import copy

    from handler.runtime.cpu_speed import quantize_draft_int8

    _, plain_draft, _ = tiny_pair
    packed, _ = load_tiny(tiny_models_dir)
    pack_linear_layers(packed)
    clone = copy.deepcopy(packed)
    input_ids = torch.arange(3, 20)[None]
    with torch.inference_mode():
        torch.testing.assert_close(clone(input_ids).logits, packed(input_ids).logits, rtol=0, atol=0)
    quantized = quantize_draft_int8(clone)
    assert not any(isinstance(module, PackedLinear) for module in quantized.modules())
    # Every linear became a dynamically quantized one, as for a draft that was never packed.
    kinds = {type(module).__name__ for module in quantized.modules()}
    plain_kinds = {type(module).__name__ for module in quantize_draft_int8(copy.deepcopy(plain_draft)).modules()}
    assert kinds == plain_kinds
    assert not any(type(module) is torch.nn.Linear for module in quantized.modules())


def test_draft_quantization_auto_keeps_the_form_whose_step_is_faster(tiny_models_dir, monkeypatch, caplog):
    """auto times the packed float draft against its int8 form and keeps int8 only where it is clearly
    faster; beside an int8 draft, the float form where it prefills clearly faster."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicInt8Linear

    seconds, prefill = {}, {}

    def form(model) -> str:
        return "int8" if any(isinstance(module, DynamicInt8Linear) for module in model.modules()) else "float"

    monkeypatch.setattr(cpu_speed, "decode_step_seconds", lambda model, *a, **k: seconds[form(model)])
    monkeypatch.setattr(cpu_speed, "prefill_token_seconds", lambda model, *a, **k: prefill[form(model)])
    config = HandlerConfig(dtype="float32", draft_quantization="auto")
    seconds.update(float=0.030, int8=0.020)  # 1.5x: int8
    prefill.update(float=0.0007, int8=0.0013)  # the float form prefills 1.9x faster: it stays for that
    with caplog.at_level("INFO", logger="handler.runtime.cpu_speed"):
        chosen = load_models(config, str(tiny_models_dir))
    assert chosen.draft_quantization == "int8"
    assert any(isinstance(module, DynamicInt8Linear) for module in chosen.draft.modules())
    assert any(isinstance(module, PackedLinear) for module in chosen.draft_prefill.modules())
    assert chosen.draft_prefill_speedup == pytest.approx(0.0013 / 0.0007)
    assert "30.0 ms as it loaded, 20.0 ms in int8 -> int8" in caplog.text
    assert "0.70 ms a token as it loaded, 1.30 ms in int8 -> the float32 form prefills (both held)" in caplog.text
    weights = sum(tensor.numel() * tensor.element_size() for tensor in chosen.draft_prefill.parameters())
    assert cpu_speed.float_weight_bytes(chosen.draft_prefill) > weights  # its packed layers' copies count
    # Where the float weights would take more than a quarter of the memory left, int8 prefills too.
    monkeypatch.setattr(
        cpu_speed, "host_available_memory", lambda: (cpu_speed.float_weight_bytes(chosen.draft_prefill) * 3, "a test")
    )
    with caplog.at_level("INFO", logger="handler.runtime.cpu_speed"):
        assert load_models(config, str(tiny_models_dir)).draft_prefill is None
    assert "-> int8 prefills: no room for both forms" in caplog.text
    monkeypatch.undo()
    monkeypatch.setattr(cpu_speed, "decode_step_seconds", lambda model, *a, **k: seconds[form(model)])
    monkeypatch.setattr(cpu_speed, "prefill_token_seconds", lambda model, *a, **k: prefill[form(model)])
    prefill.update(float=0.0012, int8=0.0013)  # 1.1x: not worth the float weights' memory
    assert load_models(config, str(tiny_models_dir)).draft_prefill is None
    seconds.update(float=0.030, int8=0.027)  # 1.1x: not worth its rounding
    kept = load_models(config, str(tiny_models_dir))
    assert kept.draft_quantization == "none" and kept.draft_prefill is None and kept.draft_prefill_speedup == 1.0
    assert any(isinstance(module, PackedLinear) for module in kept.draft.modules())
    # An explicit setting is never measured.
    monkeypatch.setattr(cpu_speed, "decode_step_seconds", lambda *a, **k: pytest.fail("measured"))
    monkeypatch.setattr(cpu_speed, "prefill_token_seconds", lambda *a, **k: pytest.fail("measured"))
    explicit = load_models(HandlerConfig(dtype="float32", draft_quantization="int8"), str(tiny_models_dir))
    assert explicit.draft_quantization == "int8" and explicit.draft_prefill is None
    assert load_models(HandlerConfig(dtype="float32", draft_quantization="none"), str(tiny_models_dir)).draft_quantization == "none"


def test_prefill_token_seconds_times_the_engine_cache(tiny_pair):
    target, _, _ = tiny_pair
    seconds = cpu_speed.prefill_token_seconds(target, num_tokens=16, repeats=1)
    assert 0.0 < seconds < 1.0


def test_decode_step_seconds_times_the_engine_cache(tiny_pair):
    target, _, _ = tiny_pair
    seconds = cpu_speed.decode_step_seconds(target, context=8, repeats=3)
    assert 0.0 < seconds < 5.0
