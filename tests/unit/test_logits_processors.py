"""Logit bias, penalties and min-p against Hugging Face's processors and hand-worked cases, no model."""

from __future__ import annotations

import pytest
import torch
from transformers import MinPLogitsWarper, RepetitionPenaltyLogitsProcessor

from handler.config import SamplingParams
from handler.logits_processors import (
    ChainPenalties,
    apply_logit_bias,
    apply_penalties,
    position_counts,
    position_seen,
    process_row_logits,
    process_rows_logits,
    token_counts,
    token_mask,
)
from handler.sampler import warp_logits_to_probs

VOCAB = 12


def random_logits(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3


def test_position_counts_and_seen_on_a_hand_made_step():
    base_counts = torch.tensor([0.0, 2.0, 0.0, 0.0, 1.0])  # generated so far: 1, 1, 4
    drafts = torch.tensor([3, 1, 3])
    assert position_counts(base_counts, drafts).tolist() == [
        [0, 2, 0, 0, 1],  # position 0: the committed tokens only
        [0, 2, 0, 1, 1],  # + draft 0 (token 3)
        [0, 3, 0, 1, 1],  # + draft 1 (token 1)
        [0, 3, 0, 2, 1],  # + draft 2 (token 3 again)
    ]
    base_seen = torch.tensor([True, False, False, False, False])  # the prompt holds token 0
    assert position_seen(base_seen, drafts).int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 0, 0, 1, 0],
        [1, 1, 0, 1, 0],
        [1, 1, 0, 1, 0],
    ]
    assert position_counts(base_counts, torch.tensor([], dtype=torch.long)).tolist() == [[0, 2, 0, 0, 1]]
    assert base_counts.tolist() == [0, 2, 0, 0, 1] and base_seen.sum() == 1, "inputs untouched"


def test_token_counts_and_mask_drop_ids_past_the_vocabulary():
    assert token_counts([1, 1, 3, 7], 5).tolist() == [0, 2, 0, 1, 0]
    assert token_mask([1, 1, 3, 7], 5).tolist() == [False, True, False, True, False]
    assert token_counts([], 3).tolist() == [0, 0, 0] and not token_mask([], 3).any()


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0, 10.0])
def test_repetition_penalty_matches_hugging_face(penalty):
    logits = random_logits(4, VOCAB, seed=1)  # four independent rows, one position each
    history = torch.tensor([[0, 3, 3, 7], [1, 1, 1, 1], [11, 2, 5, 0], [4, 6, 8, 10]])
    expected = RepetitionPenaltyLogitsProcessor(penalty)(history, logits.clone())
    for row in range(4):
        seen = token_mask(history[row].tolist(), VOCAB)[None]  # [1, vocab]
        got = apply_penalties(logits[row : row + 1], None, seen, 0.0, 0.0, penalty)
        torch.testing.assert_close(got, expected[row : row + 1])


def test_presence_and_frequency_penalties_by_hand():
    logits = torch.tensor([[1.0, -1.0, 0.5, 2.0]])
    counts = torch.tensor([[0.0, 1.0, 3.0, 0.0]])
    got = apply_penalties(logits, counts, None, presence=0.5, frequency=0.25, repetition=1.0)
    # Token 1: -1 - 0.5 - 0.25; token 2: 0.5 - 0.5 - 0.75; unseen tokens keep their logits.
    assert got.tolist() == [[1.0, -1.75, -0.75, 2.0]]
    # Negative penalties reward repeats instead.
    got = apply_penalties(logits, counts, None, presence=-1.0, frequency=-0.5, repetition=1.0)
    assert got.tolist() == [[1.0, 0.5, 3.0, 2.0]]


def test_logit_bias_by_hand():
    logits = torch.tensor([[1.0, float("-inf"), 0.0], [0.0, 0.0, 0.0]])
    got = apply_logit_bias(logits, [(0, -2.5), (1, 100.0), (2, 3.0), (7, 5.0)])
    # Token 1 was masked (a grammar's -inf) and stays masked; id 7 is past the vocabulary.
    assert got.tolist() == [[-1.5, float("-inf"), 3.0], [-2.5, 100.0, 3.0]]
    assert logits[0].tolist() == [1.0, float("-inf"), 0.0], "input untouched"
    assert apply_logit_bias(logits, []) is logits


def test_order_is_bias_then_repetition_then_frequency_and_presence():
    sampling = SamplingParams(
        temperature=1.0, presence_penalty=0.5, frequency_penalty=1.0, repetition_penalty=2.0, logit_bias={0: 3.0}
    )
    logits = torch.tensor([[-1.0, 4.0]])
    got = process_row_logits(logits, sampling, torch.tensor([1.0, 0.0]), torch.tensor([True, False]), [])
    # Token 0: (-1 + 3) / 2 - 1 * 1 - 0.5; token 1 is neither generated nor seen.
    assert got.tolist() == [[-0.5, 4.0]]


def plain_decoding_logits(logits_row, sampling, prompt, generated):
    """Hugging Face's repetition penalty and vLLM's presence/frequency, as plain decoding applies them."""
    if sampling.repetition_penalty != 1.0:
        history = torch.tensor([prompt + generated])
        logits_row = RepetitionPenaltyLogitsProcessor(sampling.repetition_penalty)(history, logits_row[None].clone())[0]
    counts = token_counts(generated, logits_row.shape[-1])
    return logits_row - sampling.frequency_penalty * counts - sampling.presence_penalty * (counts > 0).float()


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(temperature=1.0, repetition_penalty=1.7),
        SamplingParams(temperature=0.7, presence_penalty=0.8, frequency_penalty=-0.4),
        SamplingParams(presence_penalty=1.5, frequency_penalty=0.6, repetition_penalty=0.8),
    ],
    ids=["repetition", "presence-frequency", "all-greedy"],
)
def test_each_verify_position_sees_the_drafts_before_it(sampling):
    """Lossless: position j of a step gets the logits plain decoding would, after drafts 0..j-1."""
    prompt, generated, drafts = [5, 1, 9], [1, 4, 4], [4, 2, 1, 11]
    logits = random_logits(len(drafts) + 1, VOCAB, seed=2)  # [k + 1, vocab]
    got = process_row_logits(
        logits, sampling, token_counts(generated, VOCAB), token_mask(prompt + generated, VOCAB), drafts
    )
    for j in range(len(drafts) + 1):
        expected = plain_decoding_logits(logits[j], sampling, prompt, generated + drafts[:j])
        torch.testing.assert_close(got[j], expected)
        # One position at a time, with the drafts already committed, gives the same.
        alone = process_row_logits(
            logits[j : j + 1],
            sampling,
            token_counts(generated + drafts[:j], VOCAB),
            token_mask(prompt + generated + drafts[:j], VOCAB),
            [],
        )
        torch.testing.assert_close(alone[0], got[j])


CHAIN_ROWS = [  # a chain's rows (None: a row without rules, outside the penalised slots)
    SamplingParams(repetition_penalty=1.7),
    None,
    SamplingParams(temperature=0.7, presence_penalty=0.8, frequency_penalty=-0.4),
    SamplingParams(logit_bias=((3, 4.0), (7, -2.5), (VOCAB + 5, 1.0))),
    SamplingParams(presence_penalty=1.5, frequency_penalty=0.6, repetition_penalty=0.8, logit_bias=((1, 1.5),)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chain_penalties_equal_each_rows_process_row_logits_pass_by_pass(dtype):
    """A chain's pass j: each penalised row's logits are bit for bit `process_row_logits` of its own, its
    drafts 0..j-1 counted as generated (rounded to the logits' dtype, as the draft loop writes them back);
    the others are untouched; the rows' histories stay as they were."""
    prompt, generated = [5, 1, 9], [1, 4, 4]
    slots = [slot for slot, params in enumerate(CHAIN_ROWS) if params is not None]
    params = [CHAIN_ROWS[slot] for slot in slots]
    counts = [token_counts(generated, VOCAB) if p.needs_output_counts else None for p in params]
    seen = [token_mask(prompt + generated, VOCAB) if p.needs_seen_tokens else None for p in params]
    kept = [None if t is None else t.clone() for t in counts + seen]
    chain = ChainPenalties(slots, params, counts, seen, VOCAB, torch.device("cpu"))
    drafted = {slot: [] for slot in slots}
    for number in range(4):
        logits = random_logits(len(CHAIN_ROWS), 1, VOCAB, seed=10 + number).to(dtype)  # [rows, 1, vocab]
        shaped = chain.apply(logits)
        assert shaped.dtype == dtype and not torch.equal(shaped, logits)
        for slot, p, row_counts, row_seen in zip(slots, params, counts, seen):
            history = drafted[slot]
            expected = process_row_logits(
                logits[slot],
                p,
                None if row_counts is None else row_counts + token_counts(history, VOCAB),
                None if row_seen is None else row_seen | token_mask(history, VOCAB),
                [],
            )
            assert torch.equal(shaped[slot], expected.to(dtype)), (slot, number)
        assert torch.equal(shaped[1], logits[1])
        drafts = torch.tensor([[(3 * slot + number) % 4] for slot in range(len(CHAIN_ROWS))])  # repeats some
        chain.add(drafts)
        for slot in slots:
            drafted[slot].append(int(drafts[slot, 0]))
    for before, after in zip(kept, counts + seen):
        assert (before is None and after is None) or torch.equal(before, after)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_process_rows_logits_equals_each_rows_process_row_logits(dtype):
    """A step's rows in one go: row i's positions 0..num_drafts[i] bit for bit its own `process_row_logits`
    (its drafts past them, padding, counted nowhere), the positions past them as they came, in float32;
    the inputs untouched."""
    prompt, generated = [5, 1, 9], [1, 4, 4]
    params = [p for p in CHAIN_ROWS if p is not None]
    counts = [token_counts(generated, VOCAB) if p.needs_output_counts else None for p in params]
    seen = [token_mask(prompt + generated, VOCAB) if p.needs_seen_tokens else None for p in params]
    drafts = torch.tensor([[4, 2, 4, 11], [1, 1, 3, 0], [9, 4, 0, 0], [2, 2, 2, 2]])  # [rows, k]: padded past each num
    num_drafts = [4, 2, 0, 3]
    logits = random_logits(len(params), 5, VOCAB, seed=4).to(dtype)  # [rows, k + 1, vocab]
    kept = logits.clone()
    got = process_rows_logits(logits, params, counts, seen, drafts, num_drafts)
    assert got.dtype == torch.float32 and torch.equal(logits, kept)
    for row, (p, num) in enumerate(zip(params, num_drafts)):
        expected = process_row_logits(logits[row, : num + 1], p, counts[row], seen[row], drafts[row, :num].tolist())
        assert torch.equal(got[row, : num + 1], expected), row
        assert torch.equal(got[row, num + 1 :], logits[row, num + 1 :].float()), row


def test_process_row_logits_is_pure_and_checks_its_inputs():
    logits = random_logits(3, VOCAB, seed=3)
    before = logits.clone()
    counts, seen = token_counts([2], VOCAB), token_mask([2, 3], VOCAB)
    sampling = SamplingParams(presence_penalty=1.0, repetition_penalty=1.5, logit_bias={4: 1.0})
    assert not torch.equal(process_row_logits(logits, sampling, counts, seen, [2, 3]), logits)
    assert torch.equal(logits, before) and counts.tolist() == token_counts([2], VOCAB).tolist()
    assert seen.tolist() == token_mask([2, 3], VOCAB).tolist()
    # Nothing asked: the logits as they are, in float32.
    assert process_row_logits(logits, SamplingParams(top_k=3, min_p=0.5), None, None, [2, 3]) is logits
    assert process_row_logits(logits.half(), SamplingParams(), None, None, [2, 3]).dtype == torch.float32
    # The drafts a row's positions follow are its positions - 1; its history must come with a penalty.
    with pytest.raises(AssertionError):
        process_row_logits(logits, sampling, counts, seen, [2])
    with pytest.raises(AssertionError):
        process_row_logits(logits, SamplingParams(frequency_penalty=0.5), None, seen, [2, 3])
    with pytest.raises(AssertionError):
        process_row_logits(logits, SamplingParams(repetition_penalty=1.2), counts, None, [2, 3])
    # A bias alone needs no history.
    biased = process_row_logits(logits, SamplingParams(logit_bias={0: -100}), None, None, torch.tensor([2, 3]))
    torch.testing.assert_close(biased[:, 0], logits[:, 0] - 100)


@pytest.mark.parametrize("temperature, min_p", [(1.0, 0.05), (0.7, 0.2), (1.5, 0.5), (1.0, 1.0)])
def test_min_p_matches_hugging_face(temperature, min_p):
    logits = random_logits(2, 3, VOCAB, seed=4)  # [batch, positions, vocab]
    probs = warp_logits_to_probs(
        logits,
        torch.full((2,), temperature),
        torch.zeros(2, dtype=torch.long),
        torch.ones(2),
        torch.full((2,), min_p),
    )
    warped = MinPLogitsWarper(min_p)(None, (logits / temperature).reshape(-1, VOCAB))
    torch.testing.assert_close(probs, warped.softmax(dim=-1).reshape(2, 3, VOCAB))


def test_min_p_cuts_below_the_threshold_and_leaves_greedy_rows_alone():
    logits = torch.tensor([[[2.0, 1.0, 0.0, -3.0]], [[0.0, 3.0, 1.0, 2.0]]])  # [2, 1, 4]
    temperature = torch.tensor([1.0, 0.0])
    no_filter = (torch.zeros(2, dtype=torch.long), torch.ones(2))
    probs = warp_logits_to_probs(logits, temperature, *no_filter, torch.tensor([0.3, 0.9]))
    # Softmax of row 0: 0.6439, 0.2369, 0.0871, 0.0032; the cut is 0.3 * 0.6439 = 0.193.
    assert (probs[0, 0, 2:] == 0).all() and (probs[0, 0, :2] > 0).all()
    torch.testing.assert_close(probs[0, 0, :2], logits[0, 0, :2].softmax(dim=-1))
    assert probs[1, 0].tolist() == [0.0, 1.0, 0.0, 0.0], "greedy: the argmax, whatever min_p"
    # min_p 0 or left out is the old transform.
    unchanged = warp_logits_to_probs(logits, temperature, *no_filter)
    assert torch.equal(warp_logits_to_probs(logits, temperature, *no_filter, torch.zeros(2)), unchanged)
    # min_p then top-k: min_p 0.05 keeps three tokens, top_k 2 keeps two of them.
    probs = warp_logits_to_probs(logits[:1], torch.ones(1), torch.tensor([2]), torch.ones(1), torch.tensor([0.05]))
    assert (probs[0, 0, 2:] == 0).all() and torch.isclose(probs.sum(), torch.tensor(1.0))
