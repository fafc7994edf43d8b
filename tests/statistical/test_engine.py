"""Through the whole engine: the first and second sampled tokens follow the target's distribution.

This covers what the pure sampler test cannot: that the engine hands the sampler
exactly the distribution each draft token was drawn from, on the target's
vocabulary, after the same transforms. Both verification paths are checked:
rejection sampling (unseeded requests) and coupling (seeded ones). A broken
coupling that reuses one uniform for every position must fail the same check.
"""

from __future__ import annotations

import collections

import pytest
import torch

from handler.config import SamplingParams
from handler.engine import GenerationRequest
from handler.sampler import warp_logits_to_probs

from .test_sampler import BUG_P_VALUE, PASS_P_VALUE, chi_square_p_value

NUM_SAMPLES = 3000
BATCH = 150
PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def pair(tiny_models_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.statistical.conftest import first_drafted_engine

    tokenizer = AutoTokenizer.from_pretrained(tiny_models_dir / "target")
    target = AutoModelForCausalLM.from_pretrained(tiny_models_dir / "target", dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(tiny_models_dir / "draft", dtype=torch.float32).eval()
    return target, tokenizer, first_drafted_engine(target, draft, tokenizer, eos_token_ids=())


def sample_two_tokens(pair, sampling, seeded: bool, draft_counts: collections.Counter | None = None) -> torch.Tensor:
    """The first two tokens of NUM_SAMPLES requests: [num_samples, 2]; `draft_counts` counts their drafts."""
    _, tokenizer, engine = pair
    prompt_ids = tuple(tokenizer(PROMPT)["input_ids"])
    tokens = []
    accepted = 0
    for start in range(0, NUM_SAMPLES, BATCH):
        # max_new_tokens 3 with k 2: both tokens come out of one speculative step.
        requests = [
            GenerationRequest(prompt_ids, 3, sampling, 2, seed=start + i if seeded else None) for i in range(BATCH)
        ]
        for result in engine.generate(requests):
            tokens.append(result.token_ids[:2])
            accepted += result.stats.accepted_tokens
            if draft_counts is not None:
                draft_counts[result.stats.draft_tokens] += 1
    assert 0 < accepted < 2 * NUM_SAMPLES, "both accept and reject paths must be exercised"
    return torch.tensor(tokens)


SETTINGS = [SamplingParams(1.0, 0, 1.0), SamplingParams(0.8, 12, 0.9)]


@pytest.mark.parametrize("seeded", [False, True], ids=["rejection_sampling", "coupled"])
@pytest.mark.parametrize("sampling", SETTINGS, ids=["plain", "top_k_top_p"])
def test_engine_samples_follow_the_target(pair, sampling, seeded, reproducible_unseeded):
    assert min(p_values(pair, sampling, sample_two_tokens(pair, sampling, seeded))) > PASS_P_VALUE


def confident_pair(pair, stop_by_mask: bool):
    """`pair` with an engine whose draft model stops by its confidence (read every pass, or by mask),
    and whose every step drafts, as while the pool is learning: left to the plan, the tiny pair's
    acceptance stops drafting after the first batch, and a check would see almost no drafts."""
    from tests.models.test_engine import CONFIDENT_COSTS
    from tests.statistical.conftest import first_drafted_engine

    target, tokenizer, engine = pair
    confident = first_drafted_engine(
        target,
        engine.model_drafter.model,
        tokenizer,
        eos_token_ids=(),
        cost_table=CONFIDENT_COSTS,
        draft_confidence=True,
    )
    confident.model_drafter.stop_by_mask = stop_by_mask
    confident.estimates.exploring = lambda proposers: True
    return target, tokenizer, confident


@pytest.mark.parametrize("stop_by_mask", [False, True], ids=["loop", "mask"])
@pytest.mark.parametrize("seeded", [False, True], ids=["rejection_sampling", "coupled"])
def test_engine_samples_follow_the_target_with_the_confidence_stop(pair, seeded, stop_by_mask, reproducible_unseeded):
    """The draft model stops after one draft or goes on to two, by its own confidence, read every pass
    or after both (`ModelDrafter.stop_by_mask`): the tokens still follow the target's distribution."""
    sampling, draft_counts = SETTINGS[0], collections.Counter()
    tokens = sample_two_tokens(confident_pair(pair, stop_by_mask), sampling, seeded, draft_counts)
    # Nearly every request drafted, and the stop cut some chains after one draft (a request's count
    # adds its steps' drafts: 1 is a chain cut after its first draft that emitted all three tokens).
    assert draft_counts[0] <= NUM_SAMPLES // 10 and draft_counts[1] >= 10 and draft_counts[2] >= 300, draft_counts
    assert min(p_values(pair, sampling, tokens)) > PASS_P_VALUE


@pytest.mark.parametrize("stop_by_mask", [False, True], ids=["loop", "mask"])
def test_the_confidence_check_catches_drafts_not_drawn_from_their_distributions(pair, stop_by_mask, monkeypatch):
    """The classic bug: the draft model's drafts drawn from one distribution (uniform here) and verified
    against another (the draft's own). With every step drafting, the check above must fail."""
    import handler.drafters.model as model_module
    from handler.sampler import sample_from_probs

    monkeypatch.setattr(
        model_module, "sample_from_probs", lambda probs, uniforms: sample_from_probs(torch.ones_like(probs), uniforms)
    )
    sampling = SETTINGS[0]
    tokens = sample_two_tokens(confident_pair(pair, stop_by_mask), sampling, seeded=False)
    # The first token alone: the bug spreads it so far that no first token is frequent enough to
    # condition the second on.
    assert p_values(pair, sampling, tokens, second=False)[0] < BUG_P_VALUE


def test_the_check_catches_a_coupling_that_reuses_one_uniform(pair, monkeypatch):
    import handler.engine.verify as engine_module
    from handler.sampler import position_uniforms

    # Every position gets the first position's uniform: each token alone is right, the pair is not.
    monkeypatch.setattr(
        engine_module, "position_uniforms", lambda seed, first, num: position_uniforms(seed, 0, 1).repeat(num)
    )
    sampling = SETTINGS[0]
    assert min(p_values(pair, sampling, sample_two_tokens(pair, sampling, seeded=True))) < BUG_P_VALUE


@pytest.mark.parametrize("seeded", [False, True], ids=["rejection_sampling", "coupled"])
def test_a_served_engines_first_drafted_token_follows_the_target(tiny_models_dir, seeded, reproducible_unseeded):
    """As served, a request's first token comes from the logits after its prompt and its first step drafts
    after it: the second token (the first drafted position) follows the target's distribution mixed
    over the first, sum over t0 of p(t0) p(. | t0)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.models.conftest import make_engine

    tokenizer = AutoTokenizer.from_pretrained(tiny_models_dir / "target")
    target, draft = (
        AutoModelForCausalLM.from_pretrained(tiny_models_dir / name, dtype=torch.float32).eval()
        for name in ("target", "draft")
    )
    engine = make_engine(target, draft, tokenizer, eos_token_ids=())
    sampling = SETTINGS[0]
    prompt_ids = tuple(tokenizer(PROMPT)["input_ids"])
    second, drafted = [], 0
    for start in range(0, NUM_SAMPLES, BATCH):
        requests = [
            GenerationRequest(prompt_ids, 3, sampling, 2, seed=start + i if seeded else None) for i in range(BATCH)
        ]
        for result in engine.generate(requests):
            second.append(result.token_ids[1])
            drafted += result.stats.draft_tokens
    assert drafted >= NUM_SAMPLES, "every request drafted after its first token"

    vocab = target.config.vocab_size
    with torch.no_grad():
        first_probs = warp(target(input_ids=torch.tensor([prompt_ids])).logits[:, -1:], sampling)[0, 0]  # [vocab]
        # Every first token after the prompt: [vocab, prompt + 1].
        continued = torch.cat([torch.tensor([prompt_ids]).expand(vocab, -1), torch.arange(vocab)[:, None]], dim=1)
        second_probs = warp(target(input_ids=continued).logits[:, -1:], sampling)[:, 0]  # [vocab, vocab]
    mixed = first_probs @ second_probs  # [vocab]
    assert chi_square_p_value(torch.bincount(torch.tensor(second), minlength=vocab), mixed) > PASS_P_VALUE


def warp(logits: torch.Tensor, sampling) -> torch.Tensor:  # [rows, 1, vocab]
    rows = logits.shape[0]
    return warp_logits_to_probs(
        logits,
        torch.full((rows,), sampling.temperature),
        torch.full((rows,), sampling.top_k),
        torch.full((rows,), sampling.top_p),
    )


def p_values(pair, sampling, tokens: torch.Tensor, second: bool = True) -> list[float]:
    """Chi-square p-values of the first token, and (`second`) of the second after the most frequent first token."""
    target, tokenizer, _ = pair
    prompt_ids = tuple(tokenizer(PROMPT)["input_ids"])

    vocab = target.config.vocab_size
    with torch.no_grad():
        logits = target(input_ids=torch.tensor([prompt_ids])).logits[:, -1:]  # [1, 1, vocab]
    first_probs = warp_logits_to_probs(
        logits, torch.tensor([sampling.temperature]), torch.tensor([sampling.top_k]), torch.tensor([sampling.top_p])
    )[0, 0]
    first_counts = torch.bincount(tokens[:, 0], minlength=vocab)
    first_p_value = chi_square_p_value(first_counts, first_probs)
    if not second:
        return [first_p_value]

    # Second token, conditioned on the most frequent first token.
    most_common = int(first_counts.argmax())
    after = tokens[tokens[:, 0] == most_common, 1]
    with torch.no_grad():
        logits = target(input_ids=torch.tensor([prompt_ids + (most_common,)])).logits[:, -1:]
    second_probs = warp_logits_to_probs(
        logits, torch.tensor([sampling.temperature]), torch.tensor([sampling.top_k]), torch.tensor([sampling.top_p])
    )[0, 0]
    assert after.numel() >= 200
    return [first_p_value, chi_square_p_value(torch.bincount(after, minlength=vocab), second_probs)]
