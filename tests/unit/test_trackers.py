"""The estimators: acceptance trackers, the calibrations, the guess rate, and OutcomeCheck (drafting
against plain decoding as the steps ran, per batch size)."""

from __future__ import annotations

import math
import random

import pytest

from handler.planning.pricing import geometric_tokens
from handler.planning.trackers import (
    BURST_OVERRUN,
    EXPLORE_BURST,
    EXPLORE_SHARE,
    EXPLORE_UNSEEN,
    LOOKUPS_ONLY,
    OUTCOME_MIN_STEPS,
    OUTCOME_WINDOW,
    PAIR_SPAN,
    WITH_MODEL,
    AcceptanceTracker,
    BranchCalibration,
    OutcomeCheck,
    PlainStreak,
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


def test_confidence_calibration_table_follows_its_counts():
    import random

    from handler.planning.trackers import CONFIDENCE_BINS, CONFIDENCE_PRIOR, ConfidenceCalibration

    def from_counts(calibration, confidence):  # the estimate from the counts, as defined
        index = min(max(int(confidence * CONFIDENCE_BINS), 0), CONFIDENCE_BINS - 1)
        prior = (index + 0.5) / CONFIDENCE_BINS
        verified, accepted = calibration.verified[index], calibration.accepted[index]
        return (accepted + CONFIDENCE_PRIOR * prior) / (verified + CONFIDENCE_PRIOR)

    rng = random.Random(0)
    calibration = ConfidenceCalibration()
    probes = [0.0, 0.05, 0.5, 0.99, 1.0, -0.1, 1.5]
    for _ in range(200):
        # Chains with several drafts in one bin: each counts, and the bin's estimate follows them all.
        chain = [rng.choice([0.91, 0.97, rng.random()]) for _ in range(rng.randint(1, 6))]
        calibration.update(chain, num_accepted=rng.randint(0, len(chain)))
        probes.append(rng.random())
        assert calibration.acceptances(probes) == [from_counts(calibration, c) for c in probes]
        assert calibration.acceptance(probes[-1]) == from_counts(calibration, probes[-1])


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
        check.observe(8, True, 1.0, 1.0)
    arms = steps_run(check, 8, True, 4 * EXPLORE_UNSEEN * EXPLORE_BURST)
    assert arms.count(False) == 4 * EXPLORE_BURST, "plain decoding, not yet timed, runs one step in EXPLORE_UNSEEN"
    assert arms[:EXPLORE_BURST] == [False] * EXPLORE_BURST, "in bursts"


# Seconds of the synthetic steps below: a drafting step costs 5 plain ones, and the first of a burst,
# which feeds the draft what it missed, 10.
PLAIN_SECONDS, DRAFT_SECONDS, CATCH_UP_SECONDS = 1.0, 5.0, 10.0


class Steps:
    """Runs synthetic steps through a check as the engine does (`arm`, then `observe` with the step's
    seconds), and sums the seconds of those that ran against the verdict."""

    def __init__(self, check: OutcomeCheck, bucket: int = 8) -> None:
        self.check, self.bucket = check, bucket
        self.drafted = False  # the last step's arm
        self.seconds = self.exploring = 0.0
        self.arms: list[bool] = []

    def learn(self, draft_rate: float, num_bursts: int = OUTCOME_WINDOW // EXPLORE_BURST) -> None:
        """Steps before the test, outside any budget: drafting in bursts at `draft_rate`, plain at 1."""
        for _ in range(num_bursts):
            self.check.observe(self.bucket, True, CATCH_UP_SECONDS, None)  # a catch-up is no sample
            for _ in range(EXPLORE_BURST - 1):
                self.check.observe(self.bucket, True, DRAFT_SECONDS, draft_rate)
            for _ in range(EXPLORE_BURST):
                self.check.observe(self.bucket, False, PLAIN_SECONDS, 1.0)

    def run(self, num_steps: int, draft_rate: float, cost: float | None = None) -> None:
        """`num_steps` steps whose plans do not draft; drafting ones run at `draft_rate` (plain at 1)
        and cost `cost` seconds each where given."""
        for _ in range(num_steps):
            verdict = (self.check.ratio(self.bucket) or 0.0) > 1.0
            drafted = self.check.arm(self.bucket, False, len(self.arms))
            if not drafted:
                seconds, rate = PLAIN_SECONDS, 1.0
            elif not self.drafted:
                seconds, rate = cost or CATCH_UP_SECONDS, None
            else:
                seconds, rate = cost or DRAFT_SECONDS, draft_rate
            self.check.observe(self.bucket, drafted, seconds, rate)
            self.seconds += seconds
            self.exploring += seconds if drafted != verdict else 0.0
            self.drafted = drafted
            self.arms.append(drafted)

    def bursts(self, verdict: bool = False) -> list[int]:
        """The lengths of the runs of steps against `verdict`."""
        runs = "".join("x" if drafted != verdict else "." for drafted in self.arms).split(".")
        return [len(run) for run in runs if run]


def test_exploring_a_dear_arm_takes_at_most_its_share_of_the_time():
    """Drafting lost (half its price), and its steps cost 5 plain ones, the catch-up 10: the bursts that
    still draft take at most EXPLORE_SHARE of the seconds, at every step, catch-ups included."""
    check = OutcomeCheck()
    steps = Steps(check)
    steps.learn(draft_rate=0.5)
    assert check.ratio(8) == 0.5
    for _ in range(5000):
        steps.run(1, draft_rate=0.5)
        assert steps.exploring <= EXPLORE_SHARE * steps.seconds
    assert steps.bursts() and set(steps.bursts()) == {EXPLORE_BURST}, "whole bursts, still"
    # A burst's seconds over what the share earns per second: the steps between two bursts.
    burst = CATCH_UP_SECONDS + (EXPLORE_BURST - 1) * DRAFT_SECONDS
    assert len(steps.bursts()) == pytest.approx(steps.seconds * EXPLORE_SHARE / burst, abs=1)


def test_exploring_a_cheap_arm_takes_at_most_its_share_of_the_time_too():
    """Drafting won (twice its price): plain decoding, a fifth of a drafting step's cost, still runs
    in bursts that take at most EXPLORE_SHARE of the seconds, and more often for being cheap."""
    check = OutcomeCheck()
    steps = Steps(check)
    steps.learn(draft_rate=2.0)
    for _ in range(2000):
        steps.run(1, draft_rate=2.0)
        assert steps.exploring <= EXPLORE_SHARE * steps.seconds
    assert set(steps.bursts(verdict=True)) == {EXPLORE_BURST}
    burst = EXPLORE_BURST * PLAIN_SECONDS
    assert len(steps.bursts(verdict=True)) == pytest.approx(steps.seconds * EXPLORE_SHARE / burst, abs=1)


def test_a_burst_whose_steps_turn_dear_stops_early_and_is_repaid():
    """The drafting steps turn 20 times dearer than the last burst's: the next burst stops once it took
    BURST_OVERRUN times its grant, the one after is granted what the dear steps took, and no burst
    starts before the credit has repaid what the first overran."""
    check = OutcomeCheck()
    steps = Steps(check)
    steps.learn(draft_rate=0.5)
    dear = 20 * DRAFT_SECONDS
    for _ in range(50000):
        exploring, seconds = steps.exploring, steps.seconds
        steps.run(1, draft_rate=0.5, cost=dear)
        if check.budgets[8].steps_left == EXPLORE_BURST - 1:  # a burst started
            assert exploring <= EXPLORE_SHARE * seconds
    first, *later = steps.bursts()
    assert first * dear > BURST_OVERRUN * (CATCH_UP_SECONDS + (EXPLORE_BURST - 1) * DRAFT_SECONDS)
    assert first < EXPLORE_BURST and later[-1] == EXPLORE_BURST, "whole bursts again once the grant is right"
    assert steps.exploring <= EXPLORE_SHARE * steps.seconds


def test_where_the_verdict_flips_exploring_notices_within_a_bounded_time():
    """Drafting lost, then its steps start to give 3 times their price: the bursts' samples turn the
    verdict once they hold half the window, within that many bursts' worth of earned seconds."""
    check = OutcomeCheck()
    steps = Steps(check)
    steps.learn(draft_rate=0.5)
    burst = CATCH_UP_SECONDS + (EXPLORE_BURST - 1) * DRAFT_SECONDS
    # Each burst gives EXPLORE_BURST - 1 samples (the catch-up is none); the median turns at half the window.
    num_bursts = -(-(OUTCOME_WINDOW // 2) // (EXPLORE_BURST - 1))
    bound = num_bursts * (burst / EXPLORE_SHARE / PLAIN_SECONDS + EXPLORE_BURST)
    while check.ratio(8) <= 1.0:
        steps.run(1, draft_rate=3.0)
        assert steps.exploring <= EXPLORE_SHARE * steps.seconds
        assert len(steps.arms) <= bound
    steps.run(10, draft_rate=3.0)
    assert steps.arms[-10:].count(True) >= 10 - EXPLORE_BURST, "drafting then runs"


def test_a_window_forgets_the_old_steps():
    check = OutcomeCheck()
    for _ in range(OUTCOME_MIN_STEPS):
        check.observe(4, True, 1.0, 0.5)
        check.observe(4, False, 1.0, 1.0)
    for _ in range(OUTCOME_WINDOW):
        check.observe(4, True, 1.0, 2.0)
        check.observe(4, False, 1.0, 1.0)
    assert check.ratio(4) == 2.0


def test_the_verdict_pairs_steps_close_in_time_so_that_drift_cancels():
    """The machine (and the price that follows it) drifts: plain steps ran at 2.0 their price while
    drafting was tried, and at 0.5 since. Drafting ran at 0.8 of the plain steps beside it every time:
    that is the verdict, not 1.6 / 0.5 from the arms' samples taken minutes apart."""
    check = OutcomeCheck()
    for _ in range(OUTCOME_MIN_STEPS):  # bursts of each arm while plain steps ran at 2.0
        for _ in range(EXPLORE_BURST):
            check.observe(16, False, 1.0, 2.0)
        for _ in range(EXPLORE_BURST):
            check.observe(16, True, 1.0, 1.6)
    for _ in range(4 * OUTCOME_WINDOW):  # then the machine got faster than its price: plain alone
        check.observe(16, False, 1.0, 0.5)
    assert check.ratio(16) == pytest.approx(0.8)
    assert not check.arm(16, False, 0, gain=1.0) and not check.arm(16, True, 1, gain=1.2)
    assert check.arm(16, True, 2, gain=1.3)


def test_samples_with_no_step_of_the_other_arm_near_them_make_no_pair():
    check = OutcomeCheck()
    for _ in range(OUTCOME_MIN_STEPS):
        check.observe(2, True, 1.0, 1.0)
    for _ in range(PAIR_SPAN):
        check.observe(2, True, 1.0, None)  # steps without a sample still count as time apart
    for _ in range(OUTCOME_MIN_STEPS):
        check.observe(2, False, 1.0, 1.0)
    assert check.pairs.get((2, None)) is None and check.ratio(2) is None


def test_steps_without_a_sample_count_their_seconds_only():
    check = OutcomeCheck()
    for _ in range(OUTCOME_MIN_STEPS):
        check.observe(4, True, 2.0, None)
        check.observe(4, False, 1.0, 1.0)
    assert check.ratio(4) is None
    assert check.burst_seconds(4, True) == EXPLORE_BURST * 2.0


def test_the_verdict_discounts_the_plans_gain_instead_of_refusing_every_draft():
    """Drafting ran at half its price against plain steps: a plan expecting 1.5x plain gives way, one
    expecting 4x (certain drafts, no draft pass) still drafts; a plain plan whose best drafting plan
    expects less than plain's rate stays plain."""
    check = OutcomeCheck()
    for _ in range(OUTCOME_MIN_STEPS):
        check.observe(1, True, 1.0, 0.5)
        check.observe(1, False, 1.0, 1.0)
    assert check.ratio(1) == 0.5
    # No step has earned exploring time yet: every step follows the verdict.
    assert not any(check.arm(1, True, step, gain=1.5) for step in range(64))
    assert all(check.arm(1, True, step, gain=4.0) for step in range(64))
    assert not check.arm(1, False, EXPLORE_BURST, gain=0.9)


def test_each_kind_of_drafting_has_its_own_verdict_beside_the_verdict_of_all():
    """Look-up steps ran at half their price, the draft model's at 1.2x theirs, both beside the same
    plain steps: each kind is judged by its own steps, and a plan of one kind by its kind's verdict.
    Under load at 4 rows, look-up steps at 0.74 to 0.81 of their price had refused the draft model."""
    check = OutcomeCheck()
    for _ in range(OUTCOME_MIN_STEPS):
        check.observe(4, True, 1.0, 0.5, LOOKUPS_ONLY)
        check.observe(4, False, 1.0, 1.0)
        check.observe(4, True, 1.0, 1.2, WITH_MODEL)
        check.observe(4, False, 1.0, 1.0)
    assert check.ratio(4, LOOKUPS_ONLY) == pytest.approx(0.5)
    assert check.ratio(4, WITH_MODEL) == pytest.approx(1.2)
    assert 0.5 < check.ratio(4) < 1.2  # every drafting step's
    assert all(check.arm(4, True, step, gain=1.1, kind=WITH_MODEL) for step in range(64))
    assert not any(check.arm(4, True, step, gain=1.5, kind=LOOKUPS_ONLY) for step in range(64))


def test_a_kind_that_never_ran_is_not_judged_by_the_others_steps():
    """The look-ups' verdict says drafting loses; the draft model has not drafted at this batch size: a
    plan with it runs (and so gives its kind samples) instead of taking the look-ups' verdict."""
    check = OutcomeCheck()
    for _ in range(OUTCOME_MIN_STEPS):
        check.observe(8, True, 1.0, 0.5, LOOKUPS_ONLY)
        check.observe(8, False, 1.0, 1.0)
    assert check.ratio(8, WITH_MODEL) is None and check.ratio(8) == pytest.approx(0.5)
    assert not check.arm(8, True, 0, gain=1.3)  # the verdict of all kinds refuses it
    assert all(check.arm(8, True, step, gain=1.3, kind=WITH_MODEL) for step in range(64))


def test_a_kind_that_first_drafts_after_a_long_plain_run_still_gets_its_verdict():
    """Plain steps ran long before the draft model first drafted, look-up steps between: their samples
    are too old to pair with its steps. Once it has its samples, plain steps run beside it in bursts, and
    the pairs come (where the arm with fewer samples took the bursts, the model drafted every step
    until it had more samples than plain decoding, 160 here)."""
    check = OutcomeCheck()
    for _ in range(20 * OUTCOME_MIN_STEPS):
        check.observe(8, False, 1.0, 1.0)
    for _ in range(2 * PAIR_SPAN):
        check.observe(8, True, 1.0, 0.9, LOOKUPS_ONLY)
    for step in range(256):
        drafts = check.arm(8, True, step, gain=1.5, kind=WITH_MODEL)
        check.observe(8, drafts, 1.0, 0.5 if drafts else 1.0, WITH_MODEL if drafts else None)
        if check.ratio(8, WITH_MODEL) is not None:
            break
    assert check.ratio(8, WITH_MODEL) == pytest.approx(0.5)
    assert step < 8 * EXPLORE_UNSEEN * EXPLORE_BURST


def test_a_plain_streak_skips_planning_for_1_2_4_then_4_steps_after_each_plain_plan_with_a_margin():
    streak = PlainStreak(max_skip=4, min_share=0.01)
    rows = 7  # the batch's rows (`Batch.version`)
    skipped_runs, run = [], 0
    for _ in range(30):
        if streak.skips(rows):
            run += 1
            continue
        if run:
            skipped_runs.append(run)
        run = 0
        streak.planned(rows, drafting_gain=0.5, share=0.05)
    assert skipped_runs[:5] == [1, 2, 4, 4, 4]
    assert streak.num_skipped == sum(skipped_runs) + run


def test_a_plain_streak_grows_past_its_max_skip_where_planning_costs_more_than_its_budget_of_the_steps():
    def runs(share: float) -> list[int]:
        streak = PlainStreak(max_skip=4, min_share=0.01, budget=0.02, longest=16)
        skipped_runs, run = [], 0
        for _ in range(120):
            if streak.skips(1):
                run += 1
                continue
            if run:
                skipped_runs.append(run)
            run = 0
            streak.planned(1, drafting_gain=0.5, share=share)
        return skipped_runs[:7]

    assert runs(0.05) == [1, 2, 4, 4, 4, 4, 4]  # 0.05 / 5 steps is 1 %: within the budget at 4
    assert runs(0.2) == [1, 2, 4, 8, 9, 9, 9]  # one plan in 10 steps costs them 2 %
    assert runs(1.0) == [1, 2, 4, 8, 16, 16, 16]  # at most `longest`


def test_a_plain_streak_ends_at_a_plan_that_drafts_or_cheap_planning_and_plans_a_change_of_rows():
    streak = PlainStreak(max_skip=4, min_share=0.01)
    for _ in range(3):
        streak.planned(1, drafting_gain=0.5, share=0.05)
        while streak.skips(1):
            pass
    streak.planned(1, drafting_gain=math.inf, share=0.05)  # it drafted
    assert not streak.skips(1)
    streak.planned(1, drafting_gain=0.95, share=0.05)  # plain, but drafting priced near it
    assert not streak.skips(1)
    streak.planned(1, drafting_gain=0.5, share=0.05)
    assert streak.skips(1)  # one skip again: the streak started afresh
    assert not streak.skips(1)
    streak.planned(1, drafting_gain=0.5, share=0.05)
    assert streak.skips(1)  # the streak grew to 2: one of them taken
    assert not streak.skips(2)  # a row joined before the skips ran out: plan now
    streak.planned(2, drafting_gain=0.5, share=0.05)
    assert [streak.skips(2) for _ in range(5)] == [True] * 4 + [False]  # and the streak goes on, at 4
    streak.planned(2, drafting_gain=0.5, share=0.005)  # planning costs little: never skip
    assert not streak.skips(2)
    never = PlainStreak(max_skip=0)
    never.planned(1, drafting_gain=0.5, share=1.0)
    assert not never.skips(1)
