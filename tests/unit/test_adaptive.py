"""Adaptive k: the expected-tokens formula, the choice of k, the acceptance estimate."""

from __future__ import annotations

import pytest

from handler.adaptive import AcceptanceTracker, BranchCalibration, CostModel, expected_tokens

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


def test_confidence_calibration_starts_at_its_prior_and_learns_only_judged_drafts():
    from handler.adaptive import CONFIDENCE_BINS, ConfidenceCalibration

    calibration = ConfidenceCalibration()
    # Before any draft: each bin's mean confidence.
    assert calibration.acceptance(0.93) == pytest.approx(0.95)
    assert calibration.acceptance(0.0) == pytest.approx(0.5 / CONFIDENCE_BINS)
    assert calibration.acceptance(1.0) == pytest.approx(0.95)  # the top bin holds 1.0
    for _ in range(300):
        # Confident drafts rejected, unsure ones accepted: a draft whose confidence misleads.
        calibration.update([0.15, 0.95, 0.55], num_accepted=1)
    assert calibration.acceptance(0.15) > 0.95
    assert calibration.acceptance(0.95) < 0.05
    # The draft after the first rejection was never judged: its bin keeps its prior.
    assert calibration.acceptance(0.55) == pytest.approx(0.55)
    calibration.update([0.55, 0.55], num_accepted=2)  # all accepted: both judged
    assert calibration.acceptance(0.55) > 0.55


def linear_step_seconds(draft_step: float, per_column: float):
    """n drafts -> seconds: a target pass of 1 + n columns and n draft passes."""
    return lambda num_drafts: 1.0 + per_column * num_drafts + draft_step * num_drafts


def test_confidence_stop_drafts_on_while_one_more_draft_pays():
    from handler.adaptive import ConfidenceCalibration, ConfidenceStop

    calibration = ConfidenceCalibration()  # acceptance = confidence (its prior)
    step_seconds = linear_step_seconds(draft_step=0.1, per_column=0.0)
    confident = ConfidenceStop([calibration], [0.8], 8, 0.0, step_seconds)
    assert all(confident(n, [0.99]) for n in range(1, 8))
    assert not confident(8, [0.99])  # never past max_drafts

    # An unsure draft leaves little chance that a further one is reached: stop there.
    unsure = ConfidenceStop([calibration], [0.8], 8, 0.0, step_seconds)
    assert unsure(1, [0.95])
    assert not unsure(2, [0.05])

    # The same confident drafts stop sooner where each one costs more.
    dear = ConfidenceStop([calibration], [0.8], 8, 0.0, linear_step_seconds(draft_step=0.4, per_column=0.2))
    num_drafts = 1
    while dear(num_drafts, [0.95]):
        num_drafts += 1
    assert 1 < num_drafts < 8


def test_confidence_stop_weighs_the_whole_batch():
    from handler.adaptive import ConfidenceCalibration, ConfidenceStop

    calibration = ConfidenceCalibration()
    step_seconds = linear_step_seconds(draft_step=0.1, per_column=0.0)
    # One confident row keeps the batch drafting though the other row has given up.
    mixed = ConfidenceStop([calibration, calibration], [0.8, 0.8], 8, 0.0, step_seconds)
    assert mixed(1, [0.95, 0.05])
    assert mixed(2, [0.95, 0.95])
    # Many rows that gain nothing from drafting (look-ups, plain decoding) make a draft pass dear.
    crowded = ConfidenceStop([calibration], [0.8], 8, 30.0, step_seconds)
    assert not crowded(1, [0.95])


def test_confidence_calibration_mean_acceptance_follows_every_judged_draft():
    from handler.adaptive import ConfidenceCalibration

    calibration = ConfidenceCalibration()
    assert calibration.mean_acceptance == 0.5
    for _ in range(100):
        calibration.update([0.1, 0.9, 0.5, 0.3], num_accepted=3)  # 3 of 4 judged drafts accepted
    assert calibration.mean_acceptance == pytest.approx(0.75, abs=0.01)


def test_runners_up_join_best_first_while_a_wider_pass_pays():
    from handler.adaptive import choose_runners_up

    # Row 0: a sure first draft, an unsure second; row 1: an unsure first draft.
    acceptances = [[0.9, 0.3, 0.8], [0.2, 0.9]]
    runner_up = [[0.5, 0.6, 0.5], [0.7, 0.5]]

    def free(width):
        return 1.0

    # Free width: every runner-up with a gain joins, up to each row's node budget.
    assert choose_runners_up(acceptances, runner_up, [6, 4], 3, 3.0, free) == [[0, 1, 2], [0, 1]]
    # A budget of one more node: the best gain of the row. Row 0: 0.1 * 0.5 at 0, 0.9 * 0.7 * 0.6 at 1.
    assert choose_runners_up(acceptances, runner_up, [4, 3], 3, 3.0, free) == [[1], [0]]
    # A budget no larger than the chain: nothing joins.
    assert choose_runners_up(acceptances, runner_up, [3, 2], 3, 3.0, free) == [[], []]

    def linear(width):
        return 1.0 + 0.1 * width

    # A column costs 0.1: a runner-up that widens the pass must bring tokens/seconds x 0.1 (about 0.3).
    # Gains: row 1 position 0 0.56 (within the width: free), row 0 position 1 0.378 (widens), row 0
    # position 0 0.05 (would widen: left out), row 1 position 1 0.01 (within the new width: free).
    chosen = choose_runners_up(acceptances, runner_up, [6, 4], 3, 3.0, linear)
    assert chosen == [[1], [0, 1]]
    # Rows narrower than the widest add no cost until they pass it.
    assert choose_runners_up([[0.5]], [[0.01]], [2], 5, 3.0, linear) == [[0]]
    assert choose_runners_up([[0.5]], [[0.01]], [2], 1, 3.0, linear) == [[]]


def test_chain_expected_tokens_is_the_geometric_series_for_one_rate():
    from handler.adaptive import chain_expected_tokens

    assert chain_expected_tokens([]) == 1.0
    assert chain_expected_tokens([0.8] * 4) == pytest.approx(expected_tokens(0.8, 4))
    assert chain_expected_tokens([0.5, 1.0, 0.0, 1.0]) == pytest.approx(1 + 0.5 + 0.5)


def test_branch_calibration_scales_by_what_was_seen_and_relaxes_without_evidence():
    calibration = BranchCalibration()
    assert calibration.factor == 1.0  # the prior: the guesses hold
    for _ in range(5):
        calibration.update(expected=2.0, accepted=0)
    low = calibration.factor
    assert 0.05 < low < 0.15
    calibration.update(expected=1.0, accepted=3)  # a run of luck never lifts it past 1
    assert low < calibration.factor <= 1.0
    for _ in range(30):
        calibration.update(expected=1.0, accepted=5)
    assert calibration.factor == 1.0
    starved = BranchCalibration()
    for _ in range(5):
        starved.update(expected=2.0, accepted=0)
    before = starved.factor
    for _ in range(100):
        starved.relax()  # trees whose branches the plan cut: back toward the prior
    assert before < 0.15 and starved.factor > 2 * before


def test_guess_rate_starts_at_one_pass_per_draft_and_follows_the_free_drafts():
    from handler.adaptive import GuessRate

    rate = GuessRate()
    assert rate.passes(0) == 0 and rate.passes(1) == 1 and rate.passes(6) == pytest.approx(6)
    for _ in range(200):
        rate.update(6, 2)  # 6 drafts in 2 passes: 4 of the 5 later drafts came free
        rate.update(1, 1)  # a single draft teaches nothing
    assert rate.rate == pytest.approx(0.8, abs=0.01)
    assert rate.passes(6) == pytest.approx(2.0, abs=0.05)
    for _ in range(200):
        rate.update(4, 4)
    assert rate.passes(4) == pytest.approx(4.0, abs=0.01)
