"""Constrained sampling follows the target's distribution restricted to the grammar, through the engine.

The grammar is the regex `[the]{0,3}`: a short output over t, h, e, which the
tiny tokenizer spells with tokens of one to three letters (`the`, `th` + `e`,
`t` + `he`, ...), ended by an end-of-sequence token. The exact probability of
every output text is computed by walking the tree of allowed tokens with the
target alone: at each prefix, the target's distribution masked to the
grammar's tokens and renormalised. Speculative samples (the draft model
proposes three tokens under the same masks) must fit it, by rejection
sampling and by coupling. A matcher that is not rolled back after a rejection
must fail the same check.
"""

from __future__ import annotations

import collections

import pytest
import torch

from handler import constraints
from handler.config import SamplingParams
from handler.constraints import Constraint, RowGrammar
from handler.engine import GenerationRequest
from handler.runtime.loading import collect_eos_token_ids
from handler.sampler import warp_logits_to_probs

from .test_sampler import BUG_P_VALUE, PASS_P_VALUE, chi_square_p_value

REGEX = "[the]{0,3}"
PROMPT = "the theme of the"
NUM_SAMPLES = 3000
BATCH = 150
SAMPLING = SamplingParams(temperature=1.0)


@pytest.fixture(scope="module")
def setup(tiny_models_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.statistical.conftest import first_drafted_engine

    tokenizer = AutoTokenizer.from_pretrained(tiny_models_dir / "target")
    target = AutoModelForCausalLM.from_pretrained(tiny_models_dir / "target", dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(tiny_models_dir / "draft", dtype=torch.float32).eval()
    eos_ids = collect_eos_token_ids(tokenizer, target.generation_config)
    engine = first_drafted_engine(target, draft, tokenizer, eos_token_ids=eos_ids)
    return target, tokenizer, engine, eos_ids


def exact_distribution(setup) -> dict[str, float]:
    """P(output text) under the target restricted to the grammar, summed over the tokenizations."""
    target, tokenizer, engine, eos_ids = setup
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    compiler = constraints.compiler_for(tokenizer)
    vocab_size = engine.vocab_size
    probabilities: dict[str, float] = collections.defaultdict(float)

    def walk(prefix: list[int], mass: float) -> None:
        row = compiler.row(Constraint.regex(REGEX), vocab_size, eos_ids)
        row.commit(prefix)
        allowed = row.mask()
        with torch.no_grad():
            logits = target(input_ids=torch.tensor([prompt_ids + prefix])).logits[:, -1:, :vocab_size]
        logits = logits.masked_fill(~allowed, float("-inf"))
        probs = warp_logits_to_probs(logits, torch.tensor([1.0]), torch.tensor([0]), torch.tensor([1.0]))[0, 0]
        for token_id in probs.nonzero().flatten().tolist():
            p = mass * float(probs[token_id])
            if token_id in eos_ids:
                probabilities[tokenizer.decode(prefix)] += p
            else:
                walk(prefix + [token_id], p)

    walk([], 1.0)
    return dict(probabilities)


def sample_texts(setup, seeded: bool) -> collections.Counter:
    _, tokenizer, engine, _ = setup
    prompt_ids = tuple(tokenizer(PROMPT)["input_ids"])
    texts: collections.Counter = collections.Counter()
    rejections = 0
    for start in range(0, NUM_SAMPLES, BATCH):
        requests = [
            GenerationRequest(
                prompt_ids, 8, SAMPLING, 3, seed=start + i if seeded else None, constraint=Constraint.regex(REGEX)
            )
            for i in range(BATCH)
        ]
        for result in engine.generate(requests):
            texts[result.text] += 1
            rejections += result.stats.rejections
    assert rejections > 100, "the reject path must carry real weight"
    return texts


def p_value(expected: dict[str, float], observed: collections.Counter) -> float:
    outcomes = sorted(set(expected) | set(observed))
    probs = torch.tensor([expected.get(text, 0.0) for text in outcomes], dtype=torch.float64)
    counts = torch.tensor([observed.get(text, 0) for text in outcomes], dtype=torch.float64)
    assert abs(float(probs.sum()) - 1.0) < 1e-6
    if counts[probs == 0].sum() > 0:
        return 0.0  # a text the target cannot produce under the grammar
    return chi_square_p_value(counts, probs)


@pytest.mark.parametrize("seeded", [False, True], ids=["rejection_sampling", "coupled"])
def test_constrained_samples_follow_the_masked_target(setup, seeded, reproducible_unseeded):
    expected = exact_distribution(setup)
    assert len(expected) > 20  # many texts, several of them spelled more than one way
    assert p_value(expected, sample_texts(setup, seeded)) > PASS_P_VALUE


def test_the_check_catches_a_matcher_not_rolled_back_after_a_rejection(setup, monkeypatch, reproducible_unseeded):
    expected = exact_distribution(setup)

    def masks_without_rollback(self, draft_token_ids):
        # The bug: the matcher walks through the drafts and stays there, rejected ones included.
        masks = torch.ones((len(draft_token_ids) + 1, self.vocab_size), dtype=torch.bool)
        for j, token_id in enumerate(draft_token_ids):
            masks[j] = self.mask()
            self.matcher.consume_token(int(token_id))
        masks[len(draft_token_ids)] = self.mask()
        return masks

    def lenient_commit(self, token_ids):
        # What such a matcher then accepts of the emitted tokens (no check, as a buggy engine would).
        self.matcher.try_consume_tokens([t for t in token_ids if t not in self.eos_set])

    def lenient_draft_mask(self, previous_draft):
        if previous_draft is not None and previous_draft not in self.eos_set:
            self.num_drafted += self.matcher.try_consume_tokens([int(previous_draft)])
        return self.mask()

    monkeypatch.setattr(RowGrammar, "masks", masks_without_rollback)
    monkeypatch.setattr(RowGrammar, "commit", lenient_commit)
    monkeypatch.setattr(RowGrammar, "draft_mask", lenient_draft_mask)
    observed = sample_texts(setup, seeded=False)
    # Every text is one the grammar allows (measured: none outside it); their frequencies are off.
    assert p_value(expected, observed) < BUG_P_VALUE
