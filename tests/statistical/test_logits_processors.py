"""Through the engine: with penalties, logit bias and min_p, the first two sampled tokens follow the target.

The second token is the one that matters: when it is verified after a draft,
its penalties must count that draft as generated, exactly as plain decoding
would count the first token. A version that scores every verify position
with the committed history alone must fail the same check.
"""

from __future__ import annotations

import pytest
import torch

from handler.config import SamplingParams
from handler.logits_processors import process_row_logits, process_rows_logits, token_counts, token_mask
from handler.sampler import warp_logits_to_probs

from .test_engine import PROMPT, pair, sample_two_tokens  # noqa: F401 (pair is a fixture)
from .test_sampler import BUG_P_VALUE, PASS_P_VALUE, chi_square_p_value

SAMPLING = SamplingParams(
    temperature=1.0,
    min_p=0.02,
    presence_penalty=2.0,
    frequency_penalty=1.0,
    repetition_penalty=1.5,
    logit_bias=((30, 2.0), (65, -3.0)),
)


def expected_probs(target, prompt_ids, generated, vocab) -> torch.Tensor:  # [vocab]
    with torch.no_grad():
        logits = target(input_ids=torch.tensor([prompt_ids + tuple(generated)])).logits[0, -1:]  # [1, vocab]
    counts = token_counts(generated, vocab)
    seen = token_mask(prompt_ids + tuple(generated), vocab)
    processed = process_row_logits(logits, SAMPLING, counts, seen, [])  # [1, vocab]
    s = SAMPLING
    return warp_logits_to_probs(
        processed[None],
        torch.tensor([s.temperature]),
        torch.tensor([s.top_k]),
        torch.tensor([s.top_p]),
        torch.tensor([s.min_p]),
    )[0, 0]


def p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    if counts[probs == 0].sum() > 0:
        return 0.0  # a token the penalised target cannot produce
    return chi_square_p_value(counts, probs)


def p_values(pair, tokens: torch.Tensor) -> list[float]:  # noqa: F811
    target, tokenizer, _ = pair
    prompt_ids = tuple(tokenizer(PROMPT)["input_ids"])
    vocab = target.config.vocab_size
    first_counts = torch.bincount(tokens[:, 0], minlength=vocab)
    first = p_value(first_counts, expected_probs(target, prompt_ids, [], vocab))
    most_common = int(first_counts.argmax())
    after = tokens[tokens[:, 0] == most_common, 1]
    assert after.numel() >= 200
    second_probs = expected_probs(target, prompt_ids, [most_common], vocab)
    return [first, p_value(torch.bincount(after, minlength=vocab), second_probs)]


@pytest.mark.parametrize("seeded", [False, True], ids=["rejection_sampling", "coupled"])
def test_penalised_samples_follow_the_penalised_target(pair, seeded, reproducible_unseeded):  # noqa: F811
    assert min(p_values(pair, sample_two_tokens(pair, SAMPLING, seeded))) > PASS_P_VALUE


def test_the_check_catches_penalties_that_ignore_the_drafts_before_a_position(pair, monkeypatch, reproducible_unseeded):  # noqa: F811
    import handler.engine.verify as engine_module

    def without_drafts(logits, params, base_counts, seen, draft_token_ids, num_drafts):
        # The bug: every position is scored with the committed history only.
        none = [0] * len(params)
        return torch.cat(
            [
                process_rows_logits(logits[:, j : j + 1], params, base_counts, seen, draft_token_ids[:, :0], none)
                for j in range(logits.shape[1])
            ],
            dim=1,
        )

    monkeypatch.setattr(engine_module, "process_rows_logits", without_drafts)
    first, second = p_values(pair, sample_two_tokens(pair, SAMPLING, seeded=False))
    assert first > PASS_P_VALUE and second < BUG_P_VALUE  # the first token has no draft before it
