"""Through the whole engine: the first and second sampled tokens follow the target's distribution.

This covers what the pure sampler test cannot: that the engine hands the sampler
exactly the distribution each draft token was drawn from, on the target's
vocabulary, after the same transforms.
"""

from __future__ import annotations

import pytest
import torch

from handler.config import SamplingParams
from handler.engine import GenerationRequest
from handler.sampler import warp_logits_to_probs

from .test_distribution import PASS_P_VALUE, chi_square_p_value

NUM_SAMPLES = 3000
BATCH = 150
PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def pair(tiny_models_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.models.conftest import make_engine

    tokenizer = AutoTokenizer.from_pretrained(tiny_models_dir / "target")
    target = AutoModelForCausalLM.from_pretrained(tiny_models_dir / "target", dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(tiny_models_dir / "draft", dtype=torch.float32).eval()
    return target, tokenizer, make_engine(target, draft, tokenizer, eos_token_ids=())


@pytest.mark.parametrize(
    "sampling", [SamplingParams(1.0, 0, 1.0), SamplingParams(0.8, 12, 0.9)], ids=["plain", "top_k_top_p"]
)
def test_engine_samples_follow_the_target(pair, sampling):
    target, tokenizer, engine = pair
    prompt_ids = tuple(tokenizer(PROMPT)["input_ids"])
    tokens = []
    accepted = 0
    for start in range(0, NUM_SAMPLES, BATCH):
        # max_new_tokens 3 with k 2: both tokens come out of one speculative step.
        requests = [GenerationRequest(prompt_ids, 3, sampling, 2, seed=start + i) for i in range(BATCH)]
        for result in engine.generate(requests):
            tokens.append(result.token_ids[:2])
            accepted += result.stats.accepted_tokens
    tokens = torch.tensor(tokens)  # [num_samples, 2]
    assert 0 < accepted < 2 * NUM_SAMPLES, "both accept and reject paths must be exercised"

    vocab = target.config.vocab_size
    with torch.no_grad():
        logits = target(input_ids=torch.tensor([prompt_ids])).logits[:, -1:]  # [1, 1, vocab]
    first_probs = warp_logits_to_probs(
        logits, torch.tensor([sampling.temperature]), torch.tensor([sampling.top_k]), torch.tensor([sampling.top_p])
    )[0, 0]
    first_counts = torch.bincount(tokens[:, 0], minlength=vocab)
    assert chi_square_p_value(first_counts, first_probs) > PASS_P_VALUE

    # Second token, conditioned on the most frequent first token.
    most_common = int(first_counts.argmax())
    after = tokens[tokens[:, 0] == most_common, 1]
    with torch.no_grad():
        logits = target(input_ids=torch.tensor([prompt_ids + (most_common,)])).logits[:, -1:]
    second_probs = warp_logits_to_probs(
        logits, torch.tensor([sampling.temperature]), torch.tensor([sampling.top_k]), torch.tensor([sampling.top_p])
    )[0, 0]
    assert after.numel() >= 200
    assert chi_square_p_value(torch.bincount(after, minlength=vocab), second_probs) > PASS_P_VALUE
