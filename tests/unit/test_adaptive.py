"""Adaptive k: the expected-tokens formula, the choice of k, the acceptance estimate."""

from __future__ import annotations

import pytest

from handler.adaptive import (
    MIN_STEPS_BEFORE_FALLBACK,
    AcceptanceTracker,
    AdaptiveK,
    CostModel,
    best_k,
    expected_tokens,
)

# Draft costs 0.2 of a target pass; verifying extra tokens is free (the GPU-like case).
CHEAP_DRAFT = CostModel(draft_step=0.2, target_step=1.0, target_per_extra_token=0.0)


def test_expected_tokens_matches_the_geometric_series():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens(0.8, 4) == pytest.approx((1 - 0.8**5) / 0.2)


def test_best_k_grows_with_acceptance_and_drops_to_zero_when_speculation_cannot_pay():
    assert best_k(0.95, 8, CHEAP_DRAFT) == 8
    assert 1 <= best_k(0.6, 8, CHEAP_DRAFT) < best_k(0.9, 8, CHEAP_DRAFT)
    # Speedup of k=1 is (1 + a) / 1.2: below 1 for a < 0.2.
    assert best_k(0.1, 8, CHEAP_DRAFT) == 0
    expensive = CostModel(draft_step=1.0, target_step=1.0, target_per_extra_token=0.0)
    assert best_k(0.7, 8, expensive) == 0
    assert CHEAP_DRAFT.draft_target_ratio == pytest.approx(0.2)


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


def test_fallback_waits_for_evidence():
    policy = AdaptiveK(CHEAP_DRAFT)
    tracker = AcceptanceTracker()
    for _ in range(MIN_STEPS_BEFORE_FALLBACK):
        assert policy.choose(tracker, 4) >= 1
        tracker.update(0, policy.choose(tracker, 4))
    assert policy.choose(tracker, 4) == 0
