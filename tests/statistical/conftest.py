"""Fixtures of the statistical tier."""

from __future__ import annotations

import itertools

import pytest
import torch


@pytest.fixture
def reproducible_unseeded(monkeypatch):
    """Unseeded sampled requests draw from generators seeded 0, 1, 2, ... so the tests are repeatable.

    Unseeded requests take the rejection sampler's path, seeded ones the coupling's
    (`handler.sampler`): the statistical tests check both.
    """
    import handler.engine.row as row_module

    seeds = itertools.count()
    monkeypatch.setattr(row_module, "unseeded_generator", lambda: torch.Generator().manual_seed(next(seeds)))


def first_drafted_engine(target, draft, tokenizer, **kwargs):
    """The engine as built for serving (`tests.models.conftest.make_engine`), but that a request's first
    tokens come out of its first speculative step: a served engine takes the first from the logits after
    the prompt, as plain decoding does (`EngineOptions.first_token_from_prefill`), which the plain rows'
    tests cover. The checks here sample the first positions, where every request drafts, through the
    same draft, verify and sampling code as any later step; `test_engine` also samples a served
    engine's first drafted position."""
    from handler.engine import EngineOptions
    from tests.models.conftest import make_engine

    options = EngineOptions(running_costs=False, first_token_from_prefill=False)
    return make_engine(target, draft, tokenizer, options=options, **kwargs)


def lookup_only_engine(tiny_models_dir):
    """An engine over the tiny target with no draft model (look-ups only), and that target, in float32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_models_dir / "target")
    target = AutoModelForCausalLM.from_pretrained(tiny_models_dir / "target", dtype=torch.float32).eval()
    return first_drafted_engine(target, None, tokenizer, eos_token_ids=()), target
