"""Tiny random models loaded in float32, where exactness is defined."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from handler.engine import EngineOptions, SpeculativeEngine, build_engine
from handler.runtime.loading import LoadedModels


@pytest.fixture(scope="session")
def tiny_pair(tiny_models_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_models_dir / "target")
    target = AutoModelForCausalLM.from_pretrained(tiny_models_dir / "target", dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(tiny_models_dir / "draft", dtype=torch.float32).eval()
    return target, draft, tokenizer


def make_engine(
    target,
    draft,
    tokenizer,
    eos_token_ids=None,
    vocab_map=None,
    cost_table=None,
    options=None,
    draft_prefill=None,
    **settings,
) -> SpeculativeEngine:
    """The pair's engine through the builder (`handler.engine.build_engine`); `settings`: fields of
    `handler.engine.EngineSettings` (draft_confidence, runner, prefix_cache_max_bytes, ...);
    `draft_prefill`: the form of the draft that prefills its rows (`LoadedModels.draft_prefill`).

    A hand-made cost table stands as given unless the test's `options` ask for `running_costs`: the
    tiny models' passes take milliseconds, and rescaling the table by them would plan by the
    machine's timing instead of by the costs the test chose.
    """
    models = LoadedModels.of(target, draft, tokenizer, eos_token_ids=eos_token_ids, vocab_map=vocab_map)
    models.draft_prefill = draft_prefill
    options = options or EngineOptions(running_costs=False)
    return build_engine(models, cost_table=cost_table, options=options, **settings)


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


class KVCopies(TorchDispatchMode):
    """Counts the calls that copy floating-point tensors (keys and values, not the CPU's bookkeeping of
    ids and lengths) while active: by aten name in `calls`; views are no copies and are not counted."""

    COPIES = frozenset(("copy_", "index_put_", "cat", "stack", "gather", "index", "clone", "_to_copy", "scatter"))

    def __init__(self) -> None:
        super().__init__()
        self.calls: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        output = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        written = output[0] if isinstance(output, (list, tuple)) else output
        if name in self.COPIES and isinstance(written, torch.Tensor) and written.is_floating_point():
            self.calls[name] += 1
        return output

    @property
    def total(self) -> int:
        return sum(self.calls.values())
