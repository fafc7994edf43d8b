"""Logit bias, penalties and min_p through the engine on the tiny pair, in float32.

- greedy: speculation with them equals plain decoding (`num_speculative_tokens: 0`)
  with them, for every drafter, alone and batched beside rows without them;
- the repetition penalty gives Hugging Face `generate`'s own greedy output;
- a seeded request with them depends on its seed and the target alone.
"""

from __future__ import annotations

import pytest
import torch

from handler.config import SamplingParams
from handler.constraints import Constraint
from handler.engine import GenerationRequest

PROMPTS = ["The quick brown fox", "def fibonacci(n):", "Hello! How can I help you today?"]
MAX_NEW_TOKENS = 40
SETTINGS = {
    "presence_frequency": SamplingParams(presence_penalty=1.5, frequency_penalty=0.8),
    "repetition": SamplingParams(repetition_penalty=1.4),
    "logit_bias": SamplingParams(logit_bias=((30, 8.0), (40, -100.0), (65, 3.0))),
    "all": SamplingParams(
        presence_penalty=-0.5, frequency_penalty=1.0, repetition_penalty=1.2, logit_bias=((65, 2.0),)
    ),
}


@pytest.fixture(scope="module")
def no_eos_engine(tiny_pair):
    """No end-of-sequence token: every output runs to MAX_NEW_TOKENS, so repeats are common."""
    from tests.models.conftest import make_engine

    return make_engine(*tiny_pair, eos_token_ids=())


def request(tokenizer, prompt, sampling, k=4, drafter="model", seed=None, constraint=None):
    ids = tuple(tokenizer(prompt)["input_ids"])
    return GenerationRequest(ids, MAX_NEW_TOKENS, sampling, k, seed=seed, drafter=drafter, constraint=constraint)


@pytest.mark.parametrize("name", sorted(SETTINGS))
@pytest.mark.parametrize("drafter", ["model", "ngram", "suffix", "hybrid"])
def test_greedy_speculation_with_penalties_equals_plain_decoding_with_them(tiny_pair, no_eos_engine, name, drafter):
    _, _, tokenizer = tiny_pair
    engine = no_eos_engine
    sampling = SETTINGS[name]
    plain = engine.generate([request(tokenizer, p, sampling, k=0) for p in PROMPTS])
    unpenalised = engine.generate([request(tokenizer, p, SamplingParams(), k=0) for p in PROMPTS])
    changed = [a.token_ids != b.token_ids for a, b in zip(plain, unpenalised)]
    assert any(changed), "the setting must change the output to test anything"
    for index, prompt in enumerate(PROMPTS):
        [alone] = engine.generate([request(tokenizer, prompt, sampling, drafter=drafter)])
        assert alone.token_ids == plain[index].token_ids, (prompt, drafter)
    free = request(tokenizer, PROMPTS[1], SamplingParams(), drafter=drafter)
    batched = engine.generate([request(tokenizer, p, sampling, drafter=drafter) for p in PROMPTS] + [free])
    assert [r.token_ids for r in batched[:-1]] == [r.token_ids for r in plain]
    assert batched[-1].token_ids == engine.generate([free])[0].token_ids


def test_logit_bias_forces_and_forbids_tokens(tiny_pair, no_eos_engine):
    _, _, tokenizer = tiny_pair
    engine = no_eos_engine
    [forced] = engine.generate([request(tokenizer, PROMPTS[0], SamplingParams(logit_bias=((77, 100.0),)))])
    assert set(forced.token_ids) == {77}
    [free] = engine.generate([request(tokenizer, PROMPTS[0], SamplingParams())])
    banned = free.token_ids[0]
    [without] = engine.generate([request(tokenizer, PROMPTS[0], SamplingParams(logit_bias=((banned, -100.0),)))])
    assert banned not in without.token_ids


def test_repetition_penalty_gives_hugging_face_generate_s_output(tiny_pair, no_eos_engine):
    target, _, tokenizer = tiny_pair
    engine = no_eos_engine
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            expected = target.generate(
                ids,
                max_new_tokens=MAX_NEW_TOKENS,
                do_sample=False,
                repetition_penalty=1.4,
                pad_token_id=tokenizer.pad_token_id,
            )[0, ids.shape[1] :].tolist()
        [result] = engine.generate([request(tokenizer, prompt, SETTINGS["repetition"])])
        # generate stops at the model's end-of-sequence token; this engine has none and runs on.
        assert len(expected) > 5 and result.token_ids[: len(expected)] == expected


def test_penalties_and_a_grammar_together_stay_exact(tiny_pair, engine):
    _, _, tokenizer = tiny_pair
    constraint = Constraint.regex("[a-z ]{1,40}")
    sampling = SETTINGS["all"]
    plain = engine.generate([request(tokenizer, p, sampling, k=0, constraint=constraint) for p in PROMPTS])
    for drafter in ("model", "hybrid"):
        spec = engine.generate(
            [request(tokenizer, p, sampling, drafter=drafter, constraint=constraint) for p in PROMPTS]
        )
        assert [r.token_ids for r in spec] == [r.token_ids for r in plain]


def test_a_seeded_request_with_penalties_depends_on_its_seed_alone(tiny_pair, no_eos_engine):
    _, _, tokenizer = tiny_pair
    engine = no_eos_engine
    sampling = SamplingParams(temperature=0.9, presence_penalty=1.0, repetition_penalty=1.2, min_p=0.05)
    reference = engine.generate([request(tokenizer, PROMPTS[1], sampling, k=0, seed=11)])[0].token_ids
    for drafter in ("model", "ngram", "hybrid"):
        for k in (1, 4):
            [result] = engine.generate([request(tokenizer, PROMPTS[1], sampling, k=k, drafter=drafter, seed=11)])
            assert result.token_ids == reference, (drafter, k)


def test_the_draft_model_shapes_its_drafts_for_penalised_rows_and_forgets_them_each_step(
    tiny_pair, no_eos_engine, monkeypatch
):
    """A penalised row without a grammar drafts through the chains, which penalise on the device
    (`ChainPenalties`); its history after each step counts its committed tokens alone."""
    from handler.engine import SpeculativeEngine
    from handler.logits_processors import ChainPenalties, token_counts

    _, _, tokenizer = tiny_pair
    calls, histories = [], []
    real_apply, real_step = ChainPenalties.apply, SpeculativeEngine.step

    def apply(penalties, logits):
        calls.append(logits.shape)
        return real_apply(penalties, logits)

    def step(engine):
        outputs = real_step(engine)
        for row in engine.rows:
            expected = token_counts(row.token_ids, row.output_counts.shape[0])
            histories.append((len(row.drafted), torch.equal(row.output_counts, expected)))
        return outputs

    monkeypatch.setattr(ChainPenalties, "apply", apply)
    monkeypatch.setattr(SpeculativeEngine, "step", step)
    no_eos_engine.generate([request(tokenizer, PROMPTS[0], SETTINGS["presence_frequency"])])
    assert calls, "a penalised row's drafts must be drawn from the penalised draft distribution"
    assert histories and all(entry == (0, True) for entry in histories), (
        "the drafts of one step must not count in the next"
    )
