"""The estimators: acceptance trackers, the calibrations, the guess rate, and OutcomeCheck (drafting
against plain decoding as the steps ran, per batch size)."""

from __future__ import annotations

import random

import pytest

from handler.planning.pricing import geometric_tokens
from handler.planning.trackers import (
    EXPLORE_BURST,
    EXPLORE_CLOSE,
    EXPLORE_FAR,
    EXPLORE_UNSEEN,
    OUTCOME_MIN_STEPS,
    AcceptanceTracker,
    BranchCalibration,
    OutcomeCheck,
    batch_bucket,
)


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


@pytest.mark.parametrize("decay", [0.9, 0.99])
def test_per_position_sums_are_the_decayed_counts(decay):
    """The tracker adds a step to the positions it reached only, its decay kept as one factor: the sums
    equal every position decayed every step, past many rescalings (0.9 ** 5000 is far below 1e-100)."""
    tracker, generator = AcceptanceTracker(decay), random.Random(1)
    reached, passed = [0.0] * 32, [0.0] * 32
    for step in range(5000):
        k = generator.randint(0, 8)
        num_accepted = generator.randint(0, k)
        tracker.update(num_accepted, k)
        if k:
            reached = [decay * value + (j <= num_accepted and j < k) for j, value in enumerate(reached)]
            passed = [decay * value + (j < num_accepted) for j, value in enumerate(passed)]
        if step % 250 == 0:
            assert tracker.reached == pytest.approx(reached, rel=1e-12, abs=1e-300)
            assert tracker.passed == pytest.approx(passed, rel=1e-12, abs=1e-300)


def test_a_fresh_tracker_plans_like_the_geometric_model():
    tracker = AcceptanceTracker()
    curve = tracker.expected_curve(6)
    assert curve == pytest.approx([geometric_tokens(0.5, k) for k in range(7)])


def test_per_position_acceptance_values_long_copied_runs():
    # A look-up that is wrong at once half the time and otherwise right for all 16 drafts.
    tracker = AcceptanceTracker()
    for step in range(40):
        tracker.update(16 if step % 2 else 0, 16)
    geometric = geometric_tokens(tracker.acceptance, 16)
    curve = tracker.expected_curve(16)
    # The truth is 1 + 16 / 2 = 9 tokens per step: the per-position estimate comes close;
    # the geometric model, with the same overall rate (0.94), overshoots.
    assert curve[16] == pytest.approx(9.0, rel=0.1)
    assert abs(geometric - 9.0) > 2 * abs(curve[16] - 9.0)
    assert curve[1] == pytest.approx(1.5, rel=0.1)
    assert all(later >= earlier for earlier, later in zip(curve, curve[1:]))


def test_confidence_calibration_starts_at_its_prior_and_learns_only_judged_drafts():
    from handler.planning.trackers import CONFIDENCE_BINS, ConfidenceCalibration

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


def test_confidence_calibration_mean_acceptance_follows_every_judged_draft():
    from handler.planning.trackers import ConfidenceCalibration

    calibration = ConfidenceCalibration()
    assert calibration.mean_acceptance == 0.5
    for _ in range(100):
        calibration.update([0.1, 0.9, 0.5, 0.3], num_accepted=3)  # 3 of 4 judged drafts accepted
    assert calibration.mean_acceptance == pytest.approx(0.75, abs=0.01)


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
    from handler.planning.trackers import GuessRate

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


def steps_run(check: OutcomeCheck, bucket: int, planned: bool, num: int) -> list[bool]:
    return [check.arm(bucket, planned, step) for step in range(num)]


def test_batch_sizes_pool_at_the_nearest_power_of_two():
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 6, 7, 8, 12, 16)] == [1, 2, 4, 4, 8, 8, 8, 16, 16]


def test_an_arm_with_too_few_steps_runs_one_step_in_a_few():
    check = OutcomeCheck()
    assert check.ratio(8) is None
    arms = steps_run(check, 8, True, 4 * EXPLORE_UNSEEN)
    # Neither arm has steps yet: drafting goes first, then one step in EXPLORE_UNSEEN goes to it.
    assert arms.count(True) == len(arms)
    for _ in range(OUTCOME_MIN_STEPS):
        check.observe(8, True, 1.0)
    arms = steps_run(check, 8, True, 4 * EXPLORE_UNSEEN * EXPLORE_BURST)
    assert arms.count(False) == 4 * EXPLORE_BURST, "plain decoding, not yet timed, runs one step in EXPLORE_UNSEEN"
    assert arms[:EXPLORE_BURST] == [False] * EXPLORE_BURST, "in bursts"


def test_a_plan_that_lost_as_it_ran_gives_way_and_the_loser_is_still_sampled():
    check = OutcomeCheck()
    for _ in range(OUTCOME_MIN_STEPS):
        check.observe(8, True, 0.9)  # drafting steps: 0.9 tokens/s per row
        check.observe(8, False, 1.0)
    assert check.ratio(8) == 0.9
    arms = steps_run(check, 8, True, 4 * EXPLORE_CLOSE * EXPLORE_BURST)
    assert arms.count(True) == 4 * EXPLORE_BURST, "drafting, close behind, keeps one step in EXPLORE_CLOSE"
    check.observe(1, True, 2.0)
    for _ in range(OUTCOME_MIN_STEPS):
        check.observe(1, True, 2.0)
        check.observe(1, False, 1.0)
    arms = steps_run(check, 1, True, 2 * EXPLORE_FAR * EXPLORE_BURST)
    assert arms.count(False) == 2 * EXPLORE_BURST, "a plan far ahead samples the other arm rarely"
    assert check.arm(8, False, EXPLORE_BURST) is False and check.ratio(4) is None


def test_a_window_forgets_the_old_steps():
    check = OutcomeCheck()
    for _ in range(OUTCOME_MIN_STEPS):
        check.observe(4, True, 0.5)
        check.observe(4, False, 1.0)
    for _ in range(64):
        check.observe(4, True, 2.0)
    assert check.ratio(4) == 2.0


def test_the_verdict_discounts_the_plans_gain_instead_of_refusing_every_draft():
    """Drafting ran at half its price against plain steps: a plan expecting 1.5x plain gives way, one
    expecting 4x (certain drafts, no draft pass) still drafts; a plain plan whose best drafting plan
    expects less than plain's rate stays plain."""
    check = OutcomeCheck()
    for _ in range(OUTCOME_MIN_STEPS):
        check.observe(1, True, 0.5)
        check.observe(1, False, 1.0)
    assert check.ratio(1) == 0.5
    # Outside the bursts that run the other arm (one in EXPLORE_FAR: the arms are far apart).
    steps = [
        step for step in range(4 * EXPLORE_FAR * EXPLORE_BURST) if step % (EXPLORE_FAR * EXPLORE_BURST) >= EXPLORE_BURST
    ]
    assert not any(check.arm(1, True, step, gain=1.5) for step in steps)
    assert all(check.arm(1, True, step, gain=4.0) for step in steps)
    assert not check.arm(1, False, EXPLORE_BURST, gain=0.9)
