"""plan_step_k: the batch's k from the rows' acceptance and an injected cost table."""

from __future__ import annotations

import pytest

from handler.adaptive import expected_tokens, plan_step_k
from handler.cost_table import CostTable

WIDTHS = (1, 2, 3, 4, 8, 9)


def table(per_width, draft: float | None = 0.1, batch_scale: float = 1.0) -> CostTable:
    """Target seconds per width from `per_width(width)`; batch 4 costs `batch_scale` times batch 1."""
    row = tuple(per_width(width) for width in WIDTHS)
    return CostTable(
        widths=WIDTHS,
        batch_sizes=(1, 4),
        target=(row, tuple(seconds * batch_scale for seconds in row)),
        draft=None if draft is None else (draft, draft * batch_scale),
    )


# Verification costs as much as the tokens it checks: speculation can never pay.
LINEAR = table(lambda width: 1.0 * width)
# Verification is as cheap at width 9 as at width 1 (the GPU-like case).
FLAT = table(lambda width: 1.0)


def test_width_two_at_twice_width_one_means_plain_decoding():
    assert plan_step_k([1.0], [8], LINEAR, model_max_k=8) == 0
    assert plan_step_k([0.9, 0.95, 1.0], [8, 8, 8], LINEAR, model_max_k=8) == 0
    # Even with free drafting, a tie is not a win.
    assert plan_step_k([1.0], [8], table(lambda width: 1.0 * width, draft=None), model_max_k=0) == 0


def test_flat_verification_and_a_cheap_draft_give_a_large_k():
    assert plan_step_k([0.9], [8], FLAT, model_max_k=8) >= 6
    assert plan_step_k([0.9], [8], FLAT, model_max_k=0) == 8
    assert plan_step_k([1.0, 1.0], [8, 8], table(lambda width: 1.0, draft=0.01), model_max_k=8) == 8


def test_k_grows_with_acceptance_and_drops_to_zero_when_drafts_are_rejected():
    ks = [plan_step_k([a], [8], FLAT, model_max_k=8) for a in (0.2, 0.5, 0.8, 0.95)]
    assert ks == sorted(ks) and ks[0] < ks[-1]
    assert plan_step_k([0.05], [8], FLAT, model_max_k=8) == 0
    assert plan_step_k([0.0, 0.0], [8, 8], FLAT, model_max_k=0) == 0


def test_k_is_capped_by_the_largest_row_and_rows_stop_gaining_past_their_own_max():
    assert plan_step_k([0.99], [3], FLAT, model_max_k=0) == 3
    assert plan_step_k([0.99, 0.99], [0, 0], FLAT, model_max_k=8) == 0
    # A row capped at k = 1 gains nothing past it, so the other row alone decides.
    cheap_width = table(lambda width: 1.0 + 0.05 * (width - 1), draft=0.02)
    mixed = plan_step_k([0.99, 0.99], [1, 8], cheap_width, model_max_k=8)
    alone = plan_step_k([0.99], [8], cheap_width, model_max_k=8)
    assert 1 < mixed <= alone


def test_the_batch_choice_maximises_the_sum_not_each_row():
    # A step at batch 2 costs what it costs at batch 1 plus a third (interpolated towards batch 4).
    costs = table(lambda width: 1.0 + 0.3 * (width - 1), draft=0.05, batch_scale=2.0)
    acceptances, max_ks = [0.95, 0.1], [8, 8]
    chosen = plan_step_k(acceptances, max_ks, costs, model_max_k=8)

    def rate(k):
        tokens = sum(expected_tokens(a, k) for a in acceptances)
        return tokens / (costs.target_seconds(2, k + 1) + k * costs.draft_seconds(2))

    assert chosen == max(range(9), key=rate)
    assert rate(chosen) > rate(0)


def test_bad_input_is_an_assertion():
    with pytest.raises(AssertionError):
        plan_step_k([0.5], [4, 4], FLAT, model_max_k=8)
    with pytest.raises(AssertionError):
        plan_step_k([1.5], [4], FLAT, model_max_k=8)


def test_look_up_drafts_past_the_draft_models_k_cost_only_verify_width():
    # A costly draft model: a look-up row (max_k 8) beside a draft-model row capped at k = 2.
    costly_draft = table(lambda width: 1.0 + 0.01 * (width - 1), draft=0.5)
    # The batch pays for 2 draft steps at most, so the look-up row's 8 drafts are worth verifying.
    assert plan_step_k([0.95, 0.5], [8, 2], costly_draft, model_max_k=2) == 8
    # Were every k paid in draft steps, drafting past 2 would not pay.
    assert plan_step_k([0.95, 0.5], [8, 2], costly_draft, model_max_k=8) <= 2
