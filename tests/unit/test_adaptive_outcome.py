"""OutcomeCheck: drafting against plain decoding as the steps ran, per batch size."""

from __future__ import annotations

from handler.adaptive import (
    EXPLORE_BURST,
    EXPLORE_CLOSE,
    EXPLORE_FAR,
    EXPLORE_UNSEEN,
    OUTCOME_MIN_STEPS,
    OutcomeCheck,
    batch_bucket,
)


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
