"""The sampler's output distribution equals the target's: chi-square with fixed seeds.

Hand-built target and draft logits over a small vocabulary, the same
temperature/top-k/top-p transform on both, many independent rows in one
batched call. A second test runs the same check on the classic bug (resample
from the target instead of the residual after a rejection) and shows it fails,
so the check is known to have power.
"""

from __future__ import annotations

import pytest
import torch

from handler.sampler import rejection_sample, sample_from_probs, warp_logits_to_probs

VOCAB = 8
K = 3
NUM_SAMPLES = 40_000
# With fixed seeds these are deterministic; the thresholds leave a wide margin both ways.
PASS_P_VALUE = 1e-3
BUG_P_VALUE = 1e-8

TARGET_LOGITS = torch.tensor(
    [
        [1.2, 0.3, -0.5, 2.0, 0.0, -1.0, 0.7, 0.1],
        [0.1, 1.5, 0.2, -0.3, 1.1, 0.0, -2.0, 0.4],
        [-0.4, 0.2, 1.9, 0.5, -0.1, 0.8, 0.3, 0.0],
        [0.9, -0.2, 0.0, 0.4, 1.6, -0.6, 0.2, 1.0],
    ]
)  # [k + 1, vocab]
# The draft is deliberately off: it favours different tokens, so rejections are frequent.
DRAFT_LOGITS = torch.tensor(
    [
        [0.2, 1.4, 0.9, 0.1, -0.5, 0.6, 0.0, 1.1],
        [1.0, 0.1, -0.2, 1.2, 0.0, 0.9, 0.5, -1.0],
        [0.3, 0.8, 0.0, -0.7, 1.5, 0.2, 1.0, 0.4],
    ]
)  # [k, vocab]

SETTINGS = {
    "temperature": (0.7, 0, 1.0),
    "top_k": (1.0, 4, 1.0),
    "top_p": (1.0, 0, 0.75),
    "top_k_and_top_p": (0.9, 6, 0.9),
}


def buggy_rejection_sample(target_probs, draft_probs, draft_token_ids, num_draft_tokens, uniforms):
    """The classic bug: after a rejection, resample from the target instead of the residual."""
    num_accepted, out = rejection_sample(target_probs, draft_probs, draft_token_ids, num_draft_tokens, uniforms)
    rows = torch.arange(out.shape[0])
    rejected = num_accepted < num_draft_tokens
    resampled = sample_from_probs(target_probs[rows, num_accepted], uniforms[:, -1])
    out[rows[rejected], num_accepted[rejected]] = resampled[rejected]
    return num_accepted, out


def warp(logits: torch.Tensor, setting: tuple[float, int, float]) -> torch.Tensor:
    temperature, top_k, top_p = setting
    return warp_logits_to_probs(
        logits[None], torch.tensor([temperature]), torch.tensor([top_k]), torch.tensor([top_p])
    )[0]


def simulate(setting, sampler, seed: int):
    """Returns (target_probs [k+1, vocab], emitted tokens [num_samples, k+1], num_accepted)."""
    generator = torch.Generator().manual_seed(seed)
    target_probs = warp(TARGET_LOGITS, setting)  # [k + 1, vocab]
    draft_probs = warp(DRAFT_LOGITS, setting)  # [k, vocab]
    batch_target = target_probs[None].expand(NUM_SAMPLES, -1, -1)
    batch_draft = draft_probs[None].expand(NUM_SAMPLES, -1, -1)
    draft_ids = torch.stack(
        [
            sample_from_probs(batch_draft[:, j], torch.rand(NUM_SAMPLES, generator=generator, dtype=torch.float64))
            for j in range(K)
        ],
        dim=1,
    )  # [num_samples, k]
    uniforms = torch.rand(NUM_SAMPLES, K + 1, generator=generator, dtype=torch.float64)
    num_accepted, out = sampler(batch_target, batch_draft, draft_ids, torch.full((NUM_SAMPLES,), K), uniforms)
    return target_probs, out, num_accepted


def chi_square_p_value(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; bins with expected count < 5 are pooled."""
    total = observed.sum()
    expected = expected_probs.double() * total
    assert observed[expected_probs == 0].sum() == 0, "a token outside the target's support was emitted"
    big = expected >= 5
    obs = torch.cat([observed[big].double(), observed[~big].double().sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    statistic = ((obs - exp) ** 2 / exp).sum()
    degrees_of_freedom = obs.numel() - 1
    # The chi-square survival function is the regularised upper incomplete gamma function.
    return float(torch.special.gammaincc(torch.tensor(degrees_of_freedom / 2.0), statistic / 2.0))


def position_p_values(target_probs, out, num_accepted) -> list[float]:
    """p-values for the first and second emitted tokens against the target's rows 0 and 1."""
    first = torch.bincount(out[:, 0], minlength=VOCAB)
    has_second = num_accepted >= 1
    second = torch.bincount(out[has_second, 1], minlength=VOCAB)
    return [chi_square_p_value(first, target_probs[0]), chi_square_p_value(second, target_probs[1])]


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_output_follows_the_target_distribution(name):
    target_probs, out, num_accepted = simulate(SETTINGS[name], rejection_sample, seed=1234)
    # The draft is far enough off that rejection and acceptance both carry real weight.
    assert (num_accepted == 0).float().mean() > 0.2
    assert (num_accepted >= 1).float().mean() > 0.05
    p_values = position_p_values(target_probs, out, num_accepted)
    assert min(p_values) > PASS_P_VALUE, p_values


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_check_catches_resampling_from_the_target_instead_of_the_residual(name):
    target_probs, out, num_accepted = simulate(SETTINGS[name], buggy_rejection_sample, seed=1234)
    p_values = position_p_values(target_probs, out, num_accepted)
    assert p_values[0] < BUG_P_VALUE, p_values


def test_check_catches_a_draft_distribution_that_ignores_top_k():
    """Another classic: q taken before the transforms, so it is not what the draft sampled from."""
    setting = SETTINGS["top_k"]

    def wrong_q_sampler(target_probs, draft_probs, draft_token_ids, num_draft_tokens, uniforms):
        raw_q = torch.softmax(DRAFT_LOGITS, dim=-1)[None].expand_as(draft_probs)
        return rejection_sample(target_probs, raw_q, draft_token_ids, num_draft_tokens, uniforms)

    target_probs, out, num_accepted = simulate(setting, wrong_q_sampler, seed=1234)
    p_values = position_p_values(target_probs, out, num_accepted)
    assert p_values[0] < BUG_P_VALUE, p_values
