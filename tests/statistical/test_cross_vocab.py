"""A draft from another family: the first and second sampled tokens still follow the target's distribution.

The draft (the tiny pair's cross draft: its own ids, tokens the target lacks and tokens it lacks)
drafts from its distribution restricted to the shared tokens (TLI), through rejection sampling
(unseeded) and coupling (seeded). The check has power: a drafter that draws from the draft's
unrestricted distribution, while it reports the restricted one, fails it.
"""

from __future__ import annotations

import pytest
import torch

import handler.drafters.model as model_drafter_module
from handler.sampler import sample_from_probs
from tests.models.conftest import cross_vocab_pair
from tests.statistical.conftest import first_drafted_engine

from .test_engine import SETTINGS, p_values, sample_two_tokens
from .test_sampler import BUG_P_VALUE, PASS_P_VALUE


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(target, tokenizer, engine with the cross draft), in float32."""
    target, draft, tokenizer, vocab_map = cross_vocab_pair(tmp_path_factory.mktemp("cross-vocab"))
    return target, tokenizer, first_drafted_engine(target, draft, tokenizer, eos_token_ids=(), vocab_map=vocab_map)


@pytest.mark.parametrize("seeded", [False, True], ids=["rejection_sampling", "coupled"])
@pytest.mark.parametrize("sampling", SETTINGS, ids=["plain", "top_k_top_p"])
def test_samples_with_a_draft_from_another_family_follow_the_target(pair, sampling, seeded, reproducible_unseeded):
    assert min(p_values(pair, sampling, sample_two_tokens(pair, sampling, seeded))) > PASS_P_VALUE


def test_the_check_catches_drafts_drawn_from_the_unrestricted_distribution(pair, monkeypatch, reproducible_unseeded):
    _, _, engine = pair
    drafter = engine.model_drafter
    vocab_map = drafter.vocab_map
    seen = {}
    restrict = vocab_map.to_target_logits

    def keep_draft_logits(draft_logits):
        seen["logits"] = draft_logits
        return restrict(draft_logits)

    def unrestricted_draw(probs, uniforms):
        # The bug: a draw from the draft's whole distribution (temperature 1), its token carried over to
        # the target's first token of the same text, while the proposal reports the restricted one.
        draft_probs = torch.softmax(seen["logits"][:, -1].float(), dim=-1)  # [rows, draft_vocab]
        draws = sample_from_probs(draft_probs, uniforms).tolist()
        return torch.tensor([carried_over(draw) for draw in draws])

    def carried_over(draw: int) -> int:
        if vocab_map.target_id(draw) >= 0:
            return vocab_map.target_id(draw)
        text = vocab_map.retokenize([], [draw])[0]
        return text[0] if text else 0  # a padded row of the draft's head: any token will do

    monkeypatch.setattr(vocab_map, "to_target_logits", keep_draft_logits)
    monkeypatch.setattr(model_drafter_module, "sample_from_probs", unrestricted_draw)
    sampling = SETTINGS[0]
    assert min(p_values(pair, sampling, sample_two_tokens(pair, sampling, seeded=False))) < BUG_P_VALUE
