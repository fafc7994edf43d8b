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


def lookup_only_engine(tiny_models_dir):
    """An engine over the tiny target with no draft model (look-ups only), and that target, in float32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.models.conftest import make_engine

    tokenizer = AutoTokenizer.from_pretrained(tiny_models_dir / "target")
    target = AutoModelForCausalLM.from_pretrained(tiny_models_dir / "target", dtype=torch.float32).eval()
    return make_engine(target, None, tokenizer, eos_token_ids=()), target
