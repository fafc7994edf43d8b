"""Look-up drafts keep sampling exact: the first sampled token follows the target's distribution.

An n-gram or suffix-tree proposal is deterministic, so its draft distribution is one-hot: the
draft token x is accepted with probability target_probs[x], and a rejection
samples from target_probs with x removed. Seeded requests are coupled instead
(`handler.sampler.coupled_targets`) and must follow the same distribution. The
same check run on a broken variant, which hands the rejection sampler a
uniform draft distribution instead of the one-hot, must fail, so the check is
known to have power.
"""

from __future__ import annotations

import pytest
import torch

import handler.engine.verify as engine_module
from handler.config import SamplingParams
from handler.engine import GenerationRequest
from handler.sampler import rejection_sample, warp_logits_to_probs

from .conftest import lookup_only_engine
from .test_sampler import BUG_P_VALUE, PASS_P_VALUE, chi_square_p_value

NUM_SAMPLES = 3000
BATCH = 150
SAMPLING = SamplingParams(temperature=0.3, top_k=0, top_p=1.0)


@pytest.fixture(scope="module")
def lookup_setup(tiny_models_dir):
    """A lookup-only engine and a prompt whose look-up proposes a likely (not certain) token."""
    engine, target = lookup_only_engine(tiny_models_dir)
    temperature = torch.tensor([SAMPLING.temperature])
    best = None
    # Prompt (a, b, x, c, a, b): the suffix (a, b) proposes x (for the suffix tree, with probability
    # 1/2: (a, b) occurs twice, once followed by x). Pick the x the target likes most.
    for x in range(10, 340):
        prompt_ids = (20, 21, x, 22, 20, 21)
        with torch.no_grad():
            logits = target(input_ids=torch.tensor([prompt_ids])).logits[:, -1:]  # [1, 1, vocab]
        probs = warp_logits_to_probs(logits, temperature, torch.tensor([0]), torch.tensor([1.0]))[0, 0]
        if best is None or probs[x] > best[2][best[1]]:
            best = (prompt_ids, x, probs)
    return engine, best


def first_tokens(setup, seeded: bool, drafter: str) -> torch.Tensor:
    engine, (prompt_ids, _, _) = setup
    tokens = []
    for start in range(0, NUM_SAMPLES, BATCH):
        requests = [
            GenerationRequest(prompt_ids, 2, SAMPLING, 1, seed=start + i if seeded else None, drafter=drafter)
            for i in range(BATCH)
        ]
        results = engine.generate(requests)
        # The drafter under test proposed the first token of every row.
        assert all(result.stats.draft_tokens_by_drafter == {drafter: 1} for result in results)
        tokens.extend(result.token_ids[0] for result in results)
    return torch.tensor(tokens)


@pytest.mark.parametrize("drafter", ["ngram", "suffix"])
@pytest.mark.parametrize("seeded", [False, True], ids=["rejection_sampling", "coupled"])
def test_lookup_samples_follow_the_target(lookup_setup, seeded, drafter, reproducible_unseeded):
    _, (_, x, probs) = lookup_setup
    assert 0.05 < float(probs[x]) < 0.95, "the proposal must be accepted sometimes and rejected sometimes"
    tokens = first_tokens(lookup_setup, seeded, drafter)
    counts = torch.bincount(tokens, minlength=probs.numel())
    assert 0 < counts[x] < NUM_SAMPLES
    assert chi_square_p_value(counts, probs) > PASS_P_VALUE


@pytest.mark.parametrize("drafter", ["ngram", "suffix"])
def test_the_check_catches_a_non_one_hot_draft_distribution(lookup_setup, drafter, monkeypatch, reproducible_unseeded):
    _, (_, _, probs) = lookup_setup

    def uniform_draft(target_probs, draft_probs, draft_token_ids, num_draft_tokens, uniforms):
        uniform = torch.full_like(draft_probs, 1.0 / draft_probs.shape[-1])
        return rejection_sample(target_probs, uniform, draft_token_ids, num_draft_tokens, uniforms)

    monkeypatch.setattr(engine_module, "rejection_sample", uniform_draft)
    tokens = first_tokens(lookup_setup, seeded=False, drafter=drafter)
    counts = torch.bincount(tokens, minlength=probs.numel())
    assert chi_square_p_value(counts, probs) < BUG_P_VALUE
