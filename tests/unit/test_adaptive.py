"""Adaptive k: the expected-tokens formula, the choice of k, the acceptance estimate."""

from __future__ import annotations

import pytest

from handler.adaptive import AcceptanceTracker, CostModel, expected_tokens

# Draft costs 0.2 of a target pass; verifying extra tokens is free (the GPU-like case).
CHEAP_DRAFT = CostModel(draft_step=0.2, target_step=1.0, target_per_extra_token=0.0)


def test_expected_tokens_matches_the_geometric_series():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens(0.8, 4) == pytest.approx((1 - 0.8**5) / 0.2)


def test_linear_cost_model_as_a_cost_table():
    assert CHEAP_DRAFT.target_seconds(4, 5) == CHEAP_DRAFT.target_seconds(1, 1) == 1.0
    assert CHEAP_DRAFT.draft_seconds(2) == 0.2
    assert CostModel(0.1, 1.0, 0.25).target_seconds(1, 3) == pytest.approx(1.5)


def test_tracker_estimates_acceptance_from_runs():
    tracker = AcceptanceTracker()
    assert tracker.acceptance == 0.5
    for _ in range(30):
        tracker.update(4, 4)  # all accepted: successes only
    assert tracker.acceptance > 0.95
    for _ in range(60):
        tracker.update(0, 4)  # immediate rejections; old successes decay away
    assert tracker.acceptance < 0.12
    steps = tracker.num_steps
    tracker.update(0, 0)  # a step without drafts says nothing
    assert tracker.num_steps == steps


def test_a_fresh_tracker_plans_like_the_geometric_model():
    tracker = AcceptanceTracker()
    curve = tracker.expected_curve(6)
    assert curve == pytest.approx([expected_tokens(0.5, k) for k in range(7)])


def test_per_position_acceptance_values_long_copied_runs():
    # A look-up that is wrong at once half the time and otherwise right for all 16 drafts.
    tracker = AcceptanceTracker()
    for step in range(40):
        tracker.update(16 if step % 2 else 0, 16)
    geometric = expected_tokens(tracker.acceptance, 16)
    curve = tracker.expected_curve(16)
    # The truth is 1 + 16 / 2 = 9 tokens per step: the per-position estimate comes close;
    # the geometric model, with the same overall rate (0.94), overshoots.
    assert curve[16] == pytest.approx(9.0, rel=0.1)
    assert abs(geometric - 9.0) > 2 * abs(curve[16] - 9.0)
    assert curve[1] == pytest.approx(1.5, rel=0.1)
    assert all(later >= earlier for earlier, later in zip(curve, curve[1:]))
