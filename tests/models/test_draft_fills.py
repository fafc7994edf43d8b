"""A draft whose rows another form of its weights prefills (`LoadedModels.draft_prefill`: an int8
draft's float form, whose prefills are faster on CPUs with bf16 matrix units)."""

from __future__ import annotations

import copy

import pytest
import torch

from handler.drafters import MODEL
from handler.runtime.cpu_speed import quantize_draft_int8
from handler.types import GenerationRequest, SamplingParams
from tests.models.conftest import make_engine

GREEDY = SamplingParams()
PROMPTS = ["def fibonacci(n):", "x = [1, 2, 3]\nfor i in x:", "The quick brown fox"]


class Widths:
    """Records the number of tokens each forward of a model was given, per row."""

    def __init__(self, model, monkeypatch) -> None:
        self.widths: list[int] = []
        forward = model.forward

        def recorded(*args, **kwargs):
            input_ids = kwargs.get("input_ids", args[0] if args else None)
            self.widths.append(input_ids.shape[1])
            return forward(*args, **kwargs)

        monkeypatch.setattr(model, "forward", recorded)


@pytest.fixture
def forms(tiny_pair):
    """The tiny target, the draft in int8 and its float form in bfloat16 (another dtype than the int8
    form's float32 activations, so that the KV must be cast), and the tokenizer."""
    target, draft, tokenizer = tiny_pair
    return target, quantize_draft_int8(copy.deepcopy(draft)), copy.deepcopy(draft).to(torch.bfloat16), tokenizer


def requests(tokenizer, k: int, drafter: str = MODEL) -> list[GenerationRequest]:
    return [
        GenerationRequest(tuple(tokenizer(prompt)["input_ids"]), 16, GREEDY, k, drafter=drafter) for prompt in PROMPTS
    ]


@pytest.mark.parametrize("runner", ["dynamic", "static"])
@pytest.mark.parametrize("drafter", [MODEL, "hybrid"])
def test_the_float_form_prefills_and_the_outputs_stay_the_targets(forms, monkeypatch, runner, drafter):
    """Every fill goes through the float form; the int8 form's cache and passes take its KV, cast; greedy
    outputs are the target's, and the draft's prefix cache serves a prompt sent again."""
    target, int8_draft, float_draft, tokenizer = forms
    plain = [r.token_ids for r in make_engine(target, None, tokenizer).generate(requests(tokenizer, 0, "ngram"))]
    engine = make_engine(
        target, int8_draft, tokenizer, draft_prefill=float_draft, runner=runner, prefix_cache_max_bytes=1 << 24
    )
    fills, passes = Widths(float_draft, monkeypatch), Widths(int8_draft, monkeypatch)
    for _ in range(2):  # the second time, the draft's prefix cache holds each prompt
        engine.forget_suffix_history()  # (else hybrid drafts the answers from its trees, not the model)
        assert [r.token_ids for r in engine.generate(requests(tokenizer, 3, drafter))] == plain
    lengths = [len(tokenizer(prompt)["input_ids"]) for prompt in PROMPTS]
    # The float form prefilled the rows, each prompt at least but its last token (the second round's found in
    # the prefix cache), and the int8 form never did: its passes are one token a row, or the tokens
    # a row committed since it last drafted.
    assert fills.widths and max(fills.widths) >= max(lengths) - 1
    assert passes.widths and max(passes.widths) < min(lengths) - 1
    prefix_cache = engine.drafter_map[MODEL].prefix_cache
    assert prefix_cache.stats.hits > 0
    stored = [node.kv.dtype for node in _nodes(prefix_cache.root)]
    assert stored and set(stored) == {torch.bfloat16}, "the prefix cache serves the float form's prefills"


def _nodes(node):
    for child in node.children.values():
        yield child
        yield from _nodes(child)


def test_a_fill_hands_its_kv_to_the_int8_form(forms):
    """After a fill, the draft's running cache is the int8 form's: its KV in float32, its passes the int8
    form's. Without the cast the next pass fails on the mixed dtypes."""
    target, int8_draft, float_draft, tokenizer = forms
    engine = make_engine(target, int8_draft, tokenizer, draft_prefill=float_draft)
    engine.add_request("a", requests(tokenizer, 2)[0])
    engine.step()
    cache = engine.drafter_map[MODEL].cache
    assert cache is not None and cache.model is int8_draft
    layers = [layer for layer in cache.cache.layers if layer.is_initialized]
    assert layers and {layer.keys.dtype for layer in layers} == {layer.values.dtype for layer in layers} == {torch.float32}


def test_the_prefix_caches_split_by_the_kv_the_drafts_prefix_cache_holds(forms):
    """The draft's prefix cache holds its float form's KV (bf16 here: half the int8 form's float32), and
    the two caches' bytes are split so that both hold about as many tokens."""
    from handler.caches.kv_cache import kv_bytes_per_token

    target, int8_draft, float_draft, tokenizer = forms
    budget = 1 << 20
    engine = make_engine(target, int8_draft, tokenizer, draft_prefill=float_draft, prefix_cache_max_bytes=budget)
    target_share, draft_share = kv_bytes_per_token(target), kv_bytes_per_token(float_draft)
    assert draft_share * 2 == kv_bytes_per_token(int8_draft)
    assert engine.drafter_map[MODEL].prefix_cache.max_bytes == budget - budget * target_share // (
        target_share + draft_share
    )


def test_the_drafter_takes_the_start_up_ratio_of_the_two_forms(forms):
    """`LoadedModels.draft_prefill_speedup` reaches the model drafter, whose wide passes the planner prices by it."""
    import dataclasses

    from handler.engine import EngineOptions, build_engine
    from handler.runtime.loading import LoadedModels

    target, int8_draft, float_draft, tokenizer = forms
    models = LoadedModels.of(target, int8_draft, tokenizer)
    models = dataclasses.replace(models, draft_prefill=float_draft, draft_prefill_speedup=1.9)
    engine = build_engine(models, options=EngineOptions(running_costs=False))
    drafter = engine.drafter_map[MODEL]
    assert drafter.prefill_model is float_draft and drafter.prefill_speedup == 1.9
    assert engine.planner.model_drafter is drafter
