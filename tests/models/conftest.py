"""Tiny random models loaded in float32, where exactness is defined."""

from __future__ import annotations

import pytest
import torch

from handler.engine import EngineOptions, SpeculativeEngine
from handler.runtime.loading import collect_eos_token_ids


@pytest.fixture(scope="session")
def tiny_pair(tiny_models_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_models_dir / "target")
    target = AutoModelForCausalLM.from_pretrained(tiny_models_dir / "target", dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(tiny_models_dir / "draft", dtype=torch.float32).eval()
    return target, draft, tokenizer


def make_engine(target, draft, tokenizer, eos_token_ids=None, **arguments) -> SpeculativeEngine:
    """`arguments`: further keyword arguments of SpeculativeEngine (a cost table, draft_confidence).

    A hand-made cost table stands as given unless the test's `options` ask for `running_costs`: the
    tiny models' passes take milliseconds, and rescaling the table by them would plan by the
    machine's timing instead of by the costs the test chose.
    """
    if eos_token_ids is None:
        eos_token_ids = collect_eos_token_ids(tokenizer, target.generation_config)
    arguments.setdefault("options", EngineOptions(running_costs=False))
    return SpeculativeEngine(target, draft, tokenizer, eos_token_ids, tokenizer.pad_token_id, **arguments)


def cross_vocab_pair(out, device: str = "cpu"):
    """The tiny target and its cross draft (`scripts.model_tools.make_tiny_models --cross-vocab 20`: the draft with its
    own vocabulary), built into `out`, in float32 on `device`: (target, draft, target tokenizer, vocab map)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from handler.runtime.loading import check_vocabularies
    from tests.conftest import run_module

    run_module("scripts.model_tools.make_tiny_models", "--out", str(out), "--cross-vocab", "20", check=True)
    tokenizer = AutoTokenizer.from_pretrained(out / "target")
    target, draft = (
        AutoModelForCausalLM.from_pretrained(out / name, dtype=torch.float32).eval().to(device)
        for name in ("target", "cross-draft")
    )
    vocab_map = check_vocabularies(tokenizer, target, draft, str(out / "cross-draft"), str(out / "target"))
    assert vocab_map is not None and 0 < vocab_map.shared_share < 1
    return target, draft, tokenizer, vocab_map


@pytest.fixture(scope="session")
def engine(tiny_pair):
    return make_engine(*tiny_pair)


def fail_batches_holding(engine, monkeypatch, max_new_tokens: int) -> None:
    """Makes `engine.generate` fail for any batch holding a request with this max_new_tokens, as a kernel might."""
    real_generate = engine.generate

    def flaky_generate(requests, *args, **kwargs):
        if any(r.max_new_tokens == max_new_tokens for r in requests):
            raise RuntimeError("simulated kernel failure")
        return real_generate(requests, *args, **kwargs)

    monkeypatch.setattr(engine, "generate", flaky_generate)
