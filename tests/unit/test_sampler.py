"""Forced-branch tests of the rejection sampler with hand-built distributions, no model."""

from __future__ import annotations

import pytest
import torch

from handler.sampler import (
    SAMPLE_BLOCK,
    draw_step_uniforms,
    greedy_verify,
    rejection_sample,
    sample_from_probs,
    warp_logits_to_probs,
)
from scripts.bench.vocab_ops import scanned_sample  # the sampler before blocks, kept as the benchmark's reference

VOCAB = 4


def dist(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def run(target_rows, draft_rows, draft_ids, uniforms, num_drafts=None):
    target_probs = torch.stack(target_rows)[None]  # [1, k + 1, vocab]
    draft_probs = torch.stack(draft_rows)[None] if draft_rows else torch.zeros(1, 0, VOCAB)  # [1, k, vocab]
    k = draft_probs.shape[1]
    ids = torch.tensor([draft_ids], dtype=torch.long).reshape(1, k)
    num = torch.tensor([k if num_drafts is None else num_drafts])
    u = torch.tensor([uniforms], dtype=torch.float64)
    num_accepted, out = rejection_sample(target_probs, draft_probs, ids, num, u)
    return int(num_accepted[0]), out[0].tolist()


def test_forced_accept_when_target_likes_the_draft_more():
    # p(x) >= q(x) accepts whatever the uniform; all accepted -> bonus from the last target row.
    n, out = run(
        [dist(0, 1, 0, 0), dist(0, 0, 1, 0), dist(0, 0, 0, 1)],
        [dist(0.5, 0.5, 0, 0), dist(0, 0.5, 0.5, 0)],
        [1, 2],
        [0.999, 0.999, 0.3],
    )
    assert n == 2
    assert out == [1, 2, 3]


def test_forced_reject_when_target_gives_zero():
    # p(x) = 0 rejects at once; the recovered token comes from max(0, p - q).
    n, out = run(
        [dist(0, 0, 1, 0), dist(1, 0, 0, 0)],
        [dist(0, 1, 0, 0)],
        [1],
        [0.0, 0.5],
    )
    assert n == 0
    assert out == [2, -1]


def test_acceptance_threshold_is_p_over_q():
    # p(x)/q(x) = 0.25: u just below accepts, u just above rejects.
    target = [dist(0.1, 0.9, 0, 0), dist(0, 0, 0, 1)]
    draft = [dist(0.4, 0.6, 0, 0)]
    assert run(target, draft, [0], [0.2499, 0.5])[0] == 1
    assert run(target, draft, [0], [0.2501, 0.5])[0] == 0


def test_residual_excludes_tokens_where_draft_has_more_mass():
    # Residual = max(0, p - q) = (0, 0, 0.3, 0.1) -> normalised (0, 0, 0.75, 0.25).
    target = [dist(0.3, 0.3, 0.3, 0.1), dist(1, 0, 0, 0)]
    draft = [dist(0.6, 0.4, 0.0, 0.0)]
    # u=0.99 > p/q=0.5 for token 0: rejected. Final uniform 0.7 lands in token 2 (cdf 0.75).
    n, out = run(target, draft, [0], [0.99, 0.7])
    assert (n, out) == (0, [2, -1])
    n, out = run(target, draft, [0], [0.99, 0.8])
    assert (n, out) == (0, [3, -1])
    for u in torch.linspace(0, 0.999, 50).tolist():
        assert run(target, draft, [0], [0.99, u])[1][0] in (2, 3)


def test_bonus_token_drawn_from_target_after_last_draft():
    target = [dist(0, 1, 0, 0), dist(0.5, 0, 0, 0.5)]
    draft = [dist(0, 1, 0, 0)]
    assert run(target, draft, [1], [0.5, 0.2]) == (1, [1, 0])
    assert run(target, draft, [1], [0.5, 0.9]) == (1, [1, 3])


def test_draft_token_with_zero_draft_probability_is_rejected():
    # Cannot happen when the draft token was sampled from q, but must not divide 0/0.
    target = [dist(0, 1, 0, 0), dist(1, 0, 0, 0)]
    draft = [dist(1, 0, 0, 0)]
    n, out = run(target, draft, [1], [0.0, 0.5])
    assert n == 0 and out[0] == 1  # recovered from the residual, which is p itself here


def test_row_with_fewer_drafts_ignores_the_rest_and_takes_bonus_at_its_own_k():
    target = torch.stack([dist(0, 1, 0, 0), dist(0, 0, 1, 0), dist(0, 0, 0, 1)])[None].repeat(2, 1, 1)
    draft = torch.stack([dist(0, 1, 0, 0), dist(0, 0, 1, 0)])[None].repeat(2, 1, 1)
    ids = torch.tensor([[1, 2], [1, 2]])
    u = torch.full((2, 3), 0.5, dtype=torch.float64)
    num_accepted, out = rejection_sample(target, draft, ids, torch.tensor([2, 1]), u)
    assert num_accepted.tolist() == [2, 1]
    # Row 1 has k = 1: its bonus comes from target position 1 (token 2), not position 2.
    assert out.tolist() == [[1, 2, 3], [1, 2, -1]]


def test_zero_drafts_is_plain_target_sampling():
    target = dist(0.25, 0.25, 0.25, 0.25)[None, None]  # [1, 1, vocab]
    for u, token in [(0.1, 0), (0.3, 1), (0.6, 2), (0.9, 3)]:
        n, out = rejection_sample(
            target,
            torch.zeros(1, 0, VOCAB),
            torch.zeros(1, 0, dtype=torch.long),
            torch.tensor([0]),
            torch.tensor([[u]], dtype=torch.float64),
        )
        assert (int(n[0]), out[0].tolist()) == (0, [token])


def test_greedy_is_accept_while_draft_equals_target_argmax():
    target_logits = torch.tensor([[[0.0, 3.0, 1.0, 0.0], [0.0, 0.0, 5.0, 1.0], [9.0, 0.0, 0.0, 0.0]]])
    draft_logits = torch.tensor([[[0.0, 2.0, 1.0, 0.0], [0.0, 0.0, 0.0, 4.0]]])
    zeros = torch.zeros(1)
    target_probs = warp_logits_to_probs(target_logits, zeros, torch.zeros(1, dtype=torch.long), torch.ones(1))
    draft_probs = warp_logits_to_probs(draft_logits, zeros, torch.zeros(1, dtype=torch.long), torch.ones(1))
    ids = draft_logits.argmax(-1)  # [[1, 3]]
    for u in (0.0, 0.5, 0.999):
        n, out = rejection_sample(
            target_probs, draft_probs, ids, torch.tensor([2]), torch.full((1, 3), u, dtype=torch.float64)
        )
        # Token 1 matches the target argmax; token 3 does not, and the target's argmax 2 replaces it.
        assert (int(n[0]), out[0].tolist()) == (1, [1, 2, -1])


@pytest.mark.parametrize("seed", range(5))
def test_greedy_verify_equals_rejection_sampling_on_one_hot_distributions(seed):
    """The all-greedy verdict from the logits equals the sampler's on the one-hot distributions, for rows
    of every k, drafts right and wrong at every position, and near ties broken the same way."""
    generator = torch.Generator().manual_seed(seed)
    batch, k, vocab = 12, 5, 7
    target_logits = torch.randint(0, 3, (batch, k + 1, vocab), generator=generator).float()  # many ties
    draft_logits = torch.randint(0, 3, (batch, k, vocab), generator=generator).float()
    # Half the drafts are the target's argmax, so that runs of accepted drafts of every length occur.
    own = draft_logits.argmax(-1)
    right = torch.rand(batch, k, generator=generator) < 0.7
    draft_ids = torch.where(right, target_logits[:, :k].argmax(-1), own)  # [batch, k]
    draft_logits.scatter_(-1, draft_ids[..., None], 10.0)  # the draft's argmax is its draft
    num_drafts = torch.randint(0, k + 1, (batch,), generator=generator)
    off = (torch.zeros(batch), torch.zeros(batch, dtype=torch.long), torch.ones(batch))
    target_probs = warp_logits_to_probs(target_logits, *off)
    draft_probs = warp_logits_to_probs(draft_logits, *off)
    zeros = torch.zeros(batch, k + 1, dtype=torch.float64)  # a greedy row's uniforms
    expected = rejection_sample(target_probs, draft_probs, draft_ids, num_drafts, zeros)
    got = greedy_verify(target_logits, draft_ids.tolist(), num_drafts.tolist())
    assert got[0] == expected[0].tolist()
    assert got[1] == expected[1].tolist()
    assert sorted(set(got[0])) != [0]  # some rows accept drafts: the test compares runs


def test_top_k_and_top_p_support_is_respected():
    logits = torch.tensor([[[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]]])
    one = torch.ones(1)
    probs = warp_logits_to_probs(logits, one, torch.tensor([2]), one)
    assert (probs[0, 0, 2:] == 0).all() and torch.allclose(probs.sum(-1), torch.ones(1))
    # Softmax masses: 0.636, 0.234, 0.086, ... top_p 0.8 keeps the two tokens that reach it.
    probs = warp_logits_to_probs(logits, one, torch.tensor([0]), torch.tensor([0.8]))
    assert (probs[0, 0, :2] > 0).all() and (probs[0, 0, 2:] == 0).all()
    # top_p below the top token's mass still keeps the top token.
    probs = warp_logits_to_probs(logits, one, torch.tensor([0]), torch.tensor([0.01]))
    assert probs[0, 0].tolist() == [1.0, 0, 0, 0, 0, 0]
    # top-k then top-p compose: top_k 3 renormalises before top-p.
    probs = warp_logits_to_probs(logits, one, torch.tensor([3]), torch.tensor([0.95]))
    assert (probs[0, 0, 3:] == 0).all() and (probs[0, 0, :3] > 0).all()


def test_rejection_never_emits_a_token_outside_the_target_support():
    generator = torch.Generator().manual_seed(0)
    logits_t = torch.randn(64, 3, 10, generator=generator)
    logits_d = torch.randn(64, 2, 10, generator=generator)
    one = torch.ones(64)
    top_k = torch.full((64,), 3)
    target_probs = warp_logits_to_probs(logits_t, one, top_k, one)
    draft_probs = warp_logits_to_probs(logits_d, one, top_k, one)
    ids = torch.stack([sample_from_probs(draft_probs[:, j], torch.rand(64, generator=generator)) for j in range(2)], 1)
    u = torch.rand(64, 3, generator=generator, dtype=torch.float64)
    n, out = rejection_sample(target_probs, draft_probs, ids, torch.full((64,), 2), u)
    for row in range(64):
        for j in range(int(n[row]) + 1):
            assert target_probs[row, j, out[row, j]] > 0


def test_tiny_temperature_does_not_overflow():
    logits = torch.tensor([[[30.0, 29.0, -30.0]]])
    probs = warp_logits_to_probs(logits, torch.tensor([1e-30]), torch.zeros(1, dtype=torch.long), torch.ones(1))
    assert torch.isfinite(probs).all() and probs[0, 0].tolist() == [1.0, 0.0, 0.0]


@pytest.mark.parametrize("u", [0.0, 0.5, 1.0 - 2**-53])
def test_sample_from_probs_never_returns_a_zero_probability_token(u):
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]])
    token = int(sample_from_probs(probs, torch.tensor([u], dtype=torch.float64))[0])
    assert probs[0, token] > 0


def test_a_threshold_at_the_total_mass_takes_the_last_token_with_mass():
    # u * total can round up to the total: no cdf passes it, and the last token with mass is sampled.
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0]])
    assert sample_from_probs(probs, torch.ones(3, dtype=torch.float64)).tolist() == [3, 3, 0]


@pytest.mark.parametrize("vocab", [50, SAMPLE_BLOCK, SAMPLE_BLOCK + 1, 384, 5 * SAMPLE_BLOCK, 151_936])
def test_sampling_from_probs_matches_one_cumulative_sum_of_the_whole_row(vocab):
    """The same tokens as one float64 cumulative sum of the whole row, in blocks or not, with zeros
    inside rows, at their ends, over whole blocks, and mass only in a short last block."""
    generator = torch.Generator().manual_seed(vocab)
    rows = 256 if vocab < 10_000 else 24
    probs = torch.rand(rows, vocab, generator=generator) ** 4
    probs[torch.rand(rows, vocab, generator=generator) < 0.5] = 0.0
    probs[:, 0] += 1e-3  # every row has some mass
    probs[1, : vocab // 2] = 0.0  # whole blocks without mass
    probs[2, :-1] = 0.0  # all of it in the last token (a short last block where the vocabulary is not whole blocks)
    probs[2, -1] = 1.0
    probs /= probs.sum(-1, keepdim=True)
    uniforms = torch.rand(rows, generator=generator, dtype=torch.float64)
    uniforms[:8] = torch.tensor([0.0, 1.0 - 2**-53, 1.0, 1.0, 0.5, 1e-12, 0.999999, 1.0], dtype=torch.float64)
    sampled = sample_from_probs(probs, uniforms)
    assert torch.equal(sampled, scanned_sample(probs, uniforms))
    assert (probs.gather(1, sampled[:, None]) > 0).all()


def test_uniforms_depend_only_on_each_requests_own_generator_and_k():
    def draws(seed_and_k, k):
        gens = [torch.Generator().manual_seed(s) if s is not None else None for s, _ in seed_and_k]
        return draw_step_uniforms(gens, [kb for _, kb in seed_and_k], k)

    alone_d, alone_v = draws([(7, 2)], 2)
    batch_d, batch_v = draws([(3, 4), (7, 2), (None, 1)], 4)
    assert torch.equal(batch_d[1, :2], alone_d[0])
    assert torch.equal(batch_v[1, :2], alone_v[0, :2])
    assert batch_v[1, 4] == alone_v[0, 2]  # the recovered/bonus uniform sits in the last column
    assert (batch_d[2] == 0).all() and (batch_v[2] == 0).all()


def test_position_uniforms_depend_on_the_seed_and_the_position_alone():
    from handler.sampler import position_uniforms

    run = position_uniforms(7, 3, 5)  # positions 3..7
    assert run.dtype == torch.float64 and bool(((run >= 0) & (run < 1)).all())
    pieces = torch.cat([position_uniforms(7, 3, 2), position_uniforms(7, 5, 3)])
    assert torch.equal(run, pieces)
    assert torch.equal(run, position_uniforms(7, 3, 5))
    assert not torch.equal(run, position_uniforms(8, 3, 5))
    assert len(set(position_uniforms(0, 0, 64).tolist())) == 64


def coupled_verify(target_probs, drafts, num_drafts, uniforms):
    """Coupling as the engine verifies a seeded row: the target's own samples, read, matched."""
    from handler.sampler import coupled_targets, match_drafts

    return match_drafts(coupled_targets(target_probs, uniforms).tolist(), drafts, num_drafts)


def test_coupled_verify_accepts_drafts_while_they_equal_the_target_samples():

    # One-hot targets: the target's token at each position is 1, 2, 3 whatever the uniform.
    target = torch.stack([dist(0, 1, 0, 0), dist(0, 0, 1, 0), dist(0, 0, 0, 1)])[None].expand(3, -1, -1)
    drafts = torch.tensor([[1, 2], [1, 0], [3, 2]])
    uniforms = torch.full((3, 3), 0.5, dtype=torch.float64)
    num_accepted, out = coupled_verify(target, drafts.tolist(), [2, 2, 2], uniforms)
    assert num_accepted == [2, 1, 0]
    assert out == [[1, 2, 3], [1, 2, -1], [1, -1, -1]]
    # A row verifies only its own drafts: with one draft, the second one is never looked at.
    num_accepted, out = coupled_verify(target[:1], drafts[:1].tolist(), [1], uniforms[:1])
    assert num_accepted == [1] and out == [[1, 2, -1]]


def test_coupled_verify_emits_the_targets_own_samples_whatever_was_drafted():
    generator = torch.Generator().manual_seed(3)
    target = torch.softmax(torch.randn(64, 4, VOCAB, generator=generator), dim=-1)  # [batch, k + 1, vocab]
    uniforms = torch.rand(64, 4, generator=generator, dtype=torch.float64)
    own = sample_from_probs(target.reshape(-1, VOCAB), uniforms.reshape(-1)).reshape(64, 4)
    drafts = torch.randint(0, VOCAB, (64, 3), generator=generator)
    num_accepted, out = coupled_verify(target, drafts.tolist(), [3] * 64, uniforms)
    for row in range(64):
        n = num_accepted[row]
        assert out[row][: n + 1] == own[row, : n + 1].tolist() and out[row][n + 1 :] == [-1] * (3 - n)
        assert drafts[row, :n].tolist() == own[row, :n].tolist()
        assert n == 3 or int(drafts[row, n]) != int(own[row, n])


@pytest.mark.parametrize(
    "settings",
    [
        [(0.0, 0, 1.0, 0.0), (0.0, 5, 0.9, 0.1)],  # all greedy: the sampled path is skipped
        [(0.8, 0, 1.0, 0.0), (1.2, 0, 1.0, 0.0)],  # all sampled, no filter: one-hot, min-p, top-k, top-p skipped
        [(0.8, 7, 1.0, 0.0), (1.0, 0, 0.8, 0.0)],  # top-k and top-p, no min-p
        [(0.0, 3, 1.0, 0.2), (0.7, 0, 1.0, 0.05), (1.0, 4, 0.9, 0.0)],  # mixed, every filter
    ],
)
def test_what_the_host_knows_spares_work_never_a_rows_result(settings):
    from handler.config import SamplingParams
    from handler.sampler import SamplingBatch

    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m) for t, k, p, m in settings]
    batch = SamplingBatch.from_params(params, torch.device("cpu"))
    logits = torch.randn(len(params), 3, 50, generator=torch.Generator().manual_seed(0))
    unknown = warp_logits_to_probs(logits, batch.temperature, batch.top_k, batch.top_p, batch.min_p)
    assert torch.equal(batch.warp(logits), unknown)
    # The draft's order of rows, with a row of no slot (greedy): the summary still bounds it.
    selected = batch.select([None, *range(len(params))], [0] * (len(params) + 1), 1)
    assert selected.in_use.greedy
    expected = warp_logits_to_probs(
        torch.cat([logits[:1], logits]), selected.temperature, selected.top_k, selected.top_p, selected.min_p
    )
    assert torch.equal(selected.warp(torch.cat([logits[:1], logits])), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [7, 384, 4096, 4096 + 384, 151_936])
def test_argmax_vocab_is_argmax_with_ties_infinities_and_nans(dtype, vocab):
    """The blocked argmax returns torch's argmax, index for index: ties (the first wins), rows of -inf,
    +inf, NaNs (the first NaN wins), the largest in the tail block or in the vocabulary's last entry,
    and a sliced, non-contiguous view as the verifier passes it."""
    from handler.sampler import argmax_vocab

    generator = torch.Generator().manual_seed(vocab)
    rows = 24
    values = torch.randn((rows, 3, vocab + 5), generator=generator).to(dtype)  # sliced to vocab below
    few = torch.randint(0, 4, (rows, 3, vocab + 5), generator=generator).to(dtype)  # many ties
    values[:4] = few[:4]
    values[4] = float("-inf")
    values[5, :, vocab // 2] = float("inf")
    values[5, 1, vocab // 3] = float("inf")  # two +inf: the first
    values[6, :, vocab - 1] = 100.0  # the last entry
    values[7, :, (vocab // 512) * 512 :] = 50.0  # ties across the whole tail block
    values[8, 0, vocab // 2] = float("nan")
    values[8, 1, [vocab - 1, vocab // 4]] = float("nan")
    values[9, :, 0] = 100.0  # the first entry
    values[10, 2] = 1.0  # one value everywhere
    sliced = values[..., :vocab]  # [rows, 3, vocab], not contiguous
    assert torch.equal(argmax_vocab(sliced), sliced.argmax(dim=-1))
    assert torch.equal(argmax_vocab(sliced[:, 0]), sliced[:, 0].argmax(dim=-1))  # [rows, vocab]
    assert torch.equal(argmax_vocab(sliced.contiguous()), sliced.argmax(dim=-1))
    for row in (sliced[8, 1], sliced[8, :1], sliced[4, 0]):  # one row alone: NaNs, -infs
        assert torch.equal(argmax_vocab(row), row.argmax(dim=-1))


def test_argmax_vocab_random_rows_against_argmax():
    """Hundreds of random rows on a real vocabulary's size, and on a small one, ties drawn often."""
    from handler.sampler import argmax_vocab

    generator = torch.Generator().manual_seed(0)
    for _ in range(2):
        values = torch.randint(0, 50, (128, 151_936), generator=generator).float()
        assert torch.equal(argmax_vocab(values), values.argmax(dim=-1))
    # A small vocabulary (`max`'s indices): a few values, so ties everywhere, and a NaN now and then.
    for _ in range(20):
        values = torch.randint(0, 3, (16, 5, 384), generator=generator).float()
        values[torch.rand(values.shape, generator=generator) < 1e-3] = float("nan")
        assert torch.equal(argmax_vocab(values), values.argmax(dim=-1))


def test_argmax_vocab_either_side_of_numpy_s_share_is_argmax(monkeypatch):
    """Up to NUMPY_ARGMAX_MAX_VALUES float32 values numpy's argmax answers, past it torch's blocks or
    `max` do: the same index either side, ties and NaNs included, whichever path a size takes."""
    import handler.sampler as sampler

    generator = torch.Generator().manual_seed(1)
    for vocab in (384, 151_936):
        values = torch.randint(0, 3, (12, vocab), generator=generator).float()
        values[3, vocab // 2] = float("nan")
        expected = values.argmax(dim=-1)
        for limit in (0, values.numel() - 1, values.numel()):  # torch, torch, numpy
            monkeypatch.setattr(sampler, "NUMPY_ARGMAX_MAX_VALUES", limit)
            assert torch.equal(sampler.argmax_vocab(values), expected), (vocab, limit)
            assert sampler.argmax_vocab(values).dtype == torch.long


@pytest.mark.parametrize("vocab", [384, 151_936])
def test_confidence_tensors_are_the_top_two_of_the_draft_probabilities(vocab):
    """The draft's probability of its draft, and its likeliest other token with that token's probability:
    the top two of the softmax, the second where the draft is the first, whether the draft is the
    argmax (a greedy draw) or another token (a sampled one)."""
    from handler.drafters.model import confidence_tensors

    generator = torch.Generator().manual_seed(vocab)
    logits = 3 * torch.randn((6, 2, vocab), generator=generator)  # [rows, n, vocab]
    probs = torch.softmax(logits, dim=-1)
    top = probs.topk(2, dim=-1)
    sampled = top.indices[..., 0].clone()  # [rows, n]: the argmax, then others below
    sampled[3:] = torch.randint(0, vocab, (3, 2), generator=generator)
    sampled[5, 0] = top.indices[5, 0, 1]  # the second likeliest: the other is the first
    confidence, other_ids, other_probs = confidence_tensors(logits, sampled)
    assert torch.equal(confidence, probs.gather(-1, sampled[..., None])[..., 0])
    is_top = sampled == top.indices[..., 0]
    expected_ids = torch.where(is_top, top.indices[..., 1], top.indices[..., 0])
    assert torch.equal(other_ids, expected_ids)
    assert torch.equal(other_probs, probs.gather(-1, expected_ids[..., None])[..., 0])
    assert not bool(is_top[5, 0]) and other_ids[5, 0] == top.indices[5, 0, 0]


@pytest.mark.parametrize("vocab", [1000, 151_936])
def test_top_p_by_its_prefix_keeps_what_the_whole_sort_keeps(vocab, monkeypatch):
    """On a CPU, top-p reads the likeliest TOP_P_PREFIX tokens first and sorts whole only the positions
    whose nucleus reaches past them: the same tokens kept as sorting every position, for peaked
    positions (the nucleus inside the prefix), flat ones (past it) and rows without top-p, side by side."""
    import handler.sampler as sampler

    generator = torch.Generator().manual_seed(vocab)
    rows, positions = 8, 3
    scale = torch.tensor([8.0, 8.0, 0.05, 3.0, 8.0, 0.05, 1.0, 8.0])[:, None, None]  # peaked .. flat
    logits = scale * torch.randn((rows, positions, vocab), generator=generator)
    top_p = torch.tensor([0.9, 0.5, 0.9, 0.999, 1.0, 0.3, 0.95, 0.99])
    by_prefix = sampler._apply_top_p(logits, top_p)
    kept = (by_prefix > float("-inf")).sum(dim=-1)  # [rows, positions]
    assert kept.max() > sampler.TOP_P_PREFIX and kept.min() < sampler.TOP_P_PREFIX // 4  # both paths ran
    assert (kept[4] == vocab).all()  # no top-p: everything
    # One position alone, as plain decoding would see it (a flat one, a peaked one): the same tokens.
    for row in (2, 0):
        assert torch.equal(
            by_prefix[row : row + 1, 1:2], sampler._apply_top_p(logits[row : row + 1, 1:2], top_p[row : row + 1])
        )
    monkeypatch.setattr(sampler, "TOP_P_PREFIX", vocab)  # every position sorted whole
    assert torch.equal(by_prefix, sampler._apply_top_p(logits, top_p))


def test_greedy_rows_share_zero_uniforms_and_a_sampled_row_draws_its_own():
    from types import SimpleNamespace

    from handler.engine.verify import StepUniforms

    greedy = [SimpleNamespace(generator=None, coupled=False) for _ in range(3)]
    first, again = StepUniforms.draw(greedy, [2, 0, 2]), StepUniforms.draw(greedy, [1, 2, 2])
    assert first is again  # one per shape, not a few tensors a step
    assert (first.draft.shape, first.acceptance.shape, first.last.shape) == ((3, 2), (3, 2), (3,))
    assert first.coupled == [] and first.position.shape == (0, 3)
    verify, position = first.for_verify(3)
    assert verify.shape == (3, 4) and position.shape == (0, 4)
    assert not any(tensor.any() for tensor in (first.draft, first.acceptance, first.last, verify))
    # A sampled row among them draws from its generator, into tensors of the step's own.
    sampled = greedy[:2] + [SimpleNamespace(generator=torch.Generator().manual_seed(0), coupled=False)]
    drawn = StepUniforms.draw(sampled, [2, 0, 2])
    expected = torch.rand(5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert torch.equal(drawn.draft[2], expected[:2]) and torch.equal(drawn.acceptance[2], expected[2:4])
    assert drawn.last[2] == expected[4] and not drawn.draft[:2].any()
    assert not any(tensor.any() for tensor in (first.draft, first.acceptance, first.last))  # still zeros
