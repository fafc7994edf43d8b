"""The CUDA tier: the engine on a GPU, under both runners. Skipped where CUDA is not available."""

from __future__ import annotations

import pytest
import torch

from tests.statistical.conftest import reproducible_unseeded  # noqa: F401 - a fixture of this tier too


@pytest.fixture(scope="session")
def cpu_pair(tiny_models_dir):
    """The tiny pair in float32 on the CPU: the reference distributions of the chi-square checks."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_models_dir / "target")
    target = AutoModelForCausalLM.from_pretrained(tiny_models_dir / "target", dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(tiny_models_dir / "draft", dtype=torch.float32).eval()
    return target, draft, tokenizer


@pytest.fixture(scope="session")
def cuda_pair(tiny_models_dir):
    """The tiny pair in float32 on the GPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_models_dir / "target")
    target = AutoModelForCausalLM.from_pretrained(tiny_models_dir / "target", dtype=torch.float32).eval().cuda()
    draft = AutoModelForCausalLM.from_pretrained(tiny_models_dir / "draft", dtype=torch.float32).eval().cuda()
    return target, draft, tokenizer


@pytest.fixture
def graph_sized_batches(monkeypatch):
    """The chi-square checks in batches the static runner captures as graphs (`MAX_GRAPH_BATCH`)."""
    from handler.runners.static import MAX_GRAPH_BATCH
    from tests.statistical import test_engine as statistical_engine

    monkeypatch.setattr(statistical_engine, "BATCH", MAX_GRAPH_BATCH - 4)
