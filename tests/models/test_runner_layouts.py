"""The runners take each model's KV layout from the model, and a runner that cannot hold a model
never reaches a request.

GPT-BigCode, Falcon, OPT and GPT-J configs may carry a `num_key_value_heads` key that their
modeling code ignores: GPT-BigCode and Falcon (multi-query) cache one KV head, OPT and GPT-J every
head. Tiny random models of each, built here with that stray key, float32:

- the static runner's layout is the one a prefill's cache holds, not the config's;
- `runner: auto` serves them with greedy output equal to the target's own `generate`;
- `runner: static` serves them as exactly, or refuses at load naming the model and the reason;
- where the static runner fails, `auto` falls back to `dynamic`, and says so in the log.
"""

from __future__ import annotations

import functools
import logging

import pytest
import torch

from handler import runners
from handler.caches import kv_cache
from handler.caches.kv_cache import kv_layout, prefill
from handler.config import SamplingParams
from handler.engine import GenerationRequest
from tests.models.conftest import make_engine
from tests.models.test_families import PROMPTS, VOCAB, build, reference

STRAY = {"num_key_value_heads": 2}  # 4 attention heads below: a layout none of these models keeps
FAMILIES = {
    "gpt_bigcode": ("GPTBigCodeConfig", dict(vocab_size=VOCAB, n_embd=64, n_head=4, n_positions=512, **STRAY)),
    "falcon": ("FalconConfig", dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, **STRAY)),
    "opt": (
        "OPTConfig",
        dict(vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_attention_heads=4, word_embed_proj_dim=64, **STRAY),
    ),
    "gptj": ("GPTJConfig", dict(vocab_size=VOCAB, n_embd=64, n_head=4, rotary_dim=8, n_positions=512, **STRAY)),
}
NUM_TOKENS = 16
GREEDY = SamplingParams()


def family(name: str, num_layers: int, seed: int) -> torch.nn.Module:
    config_class, fields = FAMILIES[name]
    return build(config_class, fields, num_layers, seed)


@functools.cache
def pair(name: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A family's target (2 layers) and draft (1 layer), built once per test session."""
    return family(name, 2, 0), family(name, 1, 1)


def prompt_ids(tokenizer) -> list[tuple[int, ...]]:
    return [tuple(tokenizer(prompt)["input_ids"]) for prompt in PROMPTS]


def assert_serves_exactly(target, draft, tokenizer, runner: str) -> None:
    """Greedy output, alone and batched, under the model and suffix drafters, equals `generate`'s."""
    engine = make_engine(target, draft, tokenizer, eos_token_ids=(), runner=runner)
    prompts = prompt_ids(tokenizer)
    expected = [reference(target, prompt) for prompt in prompts]
    for drafter in ("model", "suffix"):
        requests = [GenerationRequest(prompt, NUM_TOKENS, GREEDY, 4, drafter=drafter) for prompt in prompts]
        assert [engine.generate([request])[0].token_ids for request in requests] == expected, (runner, drafter)
        assert [result.token_ids for result in engine.generate(requests)] == expected, (runner, drafter)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_layout_is_the_one_a_prefill_caches_not_the_configs(name):
    target, _ = pair(name)
    with torch.inference_mode():
        layer = prefill(target, [[5, 6, 7, 8]], 0).cache.layers[0]  # keys: [1, kv_heads, 4, head_dim]
    assert target.config.num_key_value_heads == 2
    assert kv_layout(target) == (2, layer.keys.shape[1], layer.keys.shape[3])
    assert layer.keys.shape[1] != 2  # the stray key says 2: one head (multi-query) or all 4


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_auto_serves_them_exactly(name, tiny_tokenizer):
    target, draft = pair(name)
    runner = runners.resolve_runner("auto", [target, draft], 5)
    assert_serves_exactly(target, draft, tiny_tokenizer, runner)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_static_serves_them_exactly_or_refuses_at_load(name, tiny_tokenizer):
    target, draft = pair(name)
    try:
        runner = runners.resolve_runner("static", [target, draft], 5)
    except ValueError as error:
        assert str(error).startswith(f"runner: static cannot hold {type(target).__name__}"), error
        return
    assert runner == runners.STATIC
    assert_serves_exactly(target, draft, tiny_tokenizer, runner)


def config_layout(model) -> tuple[int, int, int]:
    """The layout as it was read from the config, which these families' caches do not follow."""
    config = model.config.get_text_config()
    heads = config.num_attention_heads
    return config.num_hidden_layers, getattr(config, "num_key_value_heads", None) or heads, config.hidden_size // heads


@pytest.mark.parametrize("name", ["falcon", "opt"])
def test_where_static_fails_auto_falls_back_and_static_refuses_naming_the_model(name, monkeypatch, caplog):
    """The static runner given the config's layout: the tensor-size error it met mid-request before."""
    from handler.runners import static

    target, draft = pair(name)
    monkeypatch.setattr(static, "kv_layout", config_layout)
    with caplog.at_level(logging.WARNING, logger="handler.runners"):
        assert runners.resolve_runner("auto", [target, draft], 5) == runners.DYNAMIC
    assert f"runner: auto chose dynamic: static cannot hold {type(target).__name__}" in caplog.text
    refusal = rf"runner: static cannot hold {type(target).__name__}: RuntimeError: .*(size|shape)"
    with pytest.raises(ValueError, match=refusal):
        runners.resolve_runner("static", [target, draft], 5)


def test_a_layout_that_fits_no_slots_is_refused_before_any_pass():
    """Layers of different KV shapes (as a prefill left them): no slot layout holds them."""
    model = family("opt", 2, 0)
    kv_cache._LAYOUTS[model] = ((4, 16, 4, 16, 3), (2, 16, 2, 16, 3))
    with pytest.raises(ValueError, match="OPTForCausalLM caches KV in no one layout"):
        kv_layout(model)
    with pytest.raises(ValueError, match="runner: static cannot hold OPTForCausalLM: ValueError: .* no one layout"):
        runners.resolve_runner("static", [model], 5)
    assert runners.resolve_runner("auto", [model], 5) == runners.DYNAMIC
