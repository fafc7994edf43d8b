"""The cost table: grid, interpolation, JSON round trip, the cache that re-measures on a stale key,
and the running correction from the passes the engine times."""

from __future__ import annotations

import json

import pytest

from handler.planning.cost_table import MAX_SCALE, MIN_OBSERVATIONS, CostTable, RunningCostTable, sparse_grid
from handler.planning.measure import COST_TABLE_DIR_ENV, _cache_path, cost_table_cache_dir
from handler.planning.pricing import Offer, geometric_tokens, plan_batch

# Batch 1 and 4; widths 1, 2, 4: verification costs grow with width and batch.
TABLE = CostTable(
    widths=(1, 2, 4),
    batch_sizes=(1, 4),
    target=((0.10, 0.12, 0.20), (0.16, 0.24, 0.40)),
    draft=(0.02, 0.05),
)


def test_sparse_grid_keeps_the_small_widths_and_the_maximum():
    assert sparse_grid(1) == (1,)
    assert sparse_grid(4) == (1, 2, 4)
    assert sparse_grid(9, dense_up_to=4) == (1, 2, 3, 4, 8, 9)
    assert sparse_grid(17, dense_up_to=4) == (1, 2, 3, 4, 8, 16, 17)
    assert sparse_grid(3, dense_up_to=4) == (1, 2, 3)


def test_grid_points_are_exact_and_between_them_the_table_interpolates():
    assert TABLE.target_seconds(1, 1) == pytest.approx(0.10)
    assert TABLE.target_seconds(4, 4) == pytest.approx(0.40)
    assert TABLE.target_seconds(1, 3) == pytest.approx(0.16)  # halfway from width 2 to 4
    assert TABLE.target_seconds(2, 1) == pytest.approx(0.12)  # a third of the way from batch 1 to 4
    assert TABLE.target_seconds(2, 3) == pytest.approx(0.16 + (0.32 - 0.16) / 3)  # bilinear
    assert TABLE.draft_seconds(1) == pytest.approx(0.02)
    assert TABLE.draft_seconds(3) == pytest.approx(0.04)


def test_past_the_grid_the_table_extrapolates_from_its_edge():
    assert TABLE.target_seconds(1, 6) == pytest.approx(0.28)
    assert TABLE.target_seconds(7, 1) == pytest.approx(0.22)
    single = CostTable(widths=(1,), batch_sizes=(1,), target=((0.1,),), draft=None)
    assert single.target_seconds(3, 2) == pytest.approx(0.6)  # proportional to the tokens


def test_json_round_trip_and_readable_format():
    again = CostTable.from_json(json.loads(json.dumps(TABLE.to_json())))
    assert again == TABLE
    no_draft = CostTable(widths=(1, 2), batch_sizes=(1,), target=((0.1, 0.2),))
    assert CostTable.from_json(json.loads(json.dumps(no_draft.to_json()))) == no_draft
    text = TABLE.format()
    assert "100.0" in text and "400.0" in text and "2: 1.20" in text and "4: 50.0" in text
    assert "no draft model" in no_draft.format()
    with pytest.raises(AssertionError):
        no_draft.draft_seconds(1)


def test_a_malformed_table_is_refused():
    with pytest.raises(AssertionError):
        CostTable(widths=(2, 4), batch_sizes=(1,), target=((0.1, 0.2),))
    with pytest.raises(AssertionError):
        CostTable(widths=(1, 2), batch_sizes=(1, 2), target=((0.1, 0.2),))


def test_the_cache_file_name_follows_the_key(tmp_path):
    key = {"machine": {"processor": "cpu A", "threads": 2}, "widths": [1, 2]}
    other = {"machine": {"processor": "cpu A", "threads": 4}, "widths": [1, 2]}
    assert _cache_path(str(tmp_path), key) == _cache_path(str(tmp_path), dict(key))
    assert _cache_path(str(tmp_path), key) != _cache_path(str(tmp_path), other)


def test_the_cache_folder_is_the_environments_where_set_else_the_model_dir(tmp_path, monkeypatch):
    monkeypatch.delenv(COST_TABLE_DIR_ENV, raising=False)
    assert cost_table_cache_dir("/models/unpacked") == "/models/unpacked"
    assert cost_table_cache_dir(None) is None
    kept = tmp_path / "volume" / "cost-tables"
    monkeypatch.setenv(COST_TABLE_DIR_ENV, str(kept))
    assert cost_table_cache_dir("/models/unpacked") == str(kept)
    assert kept.is_dir(), "created on first use"
    # A folder that cannot be made falls back to the model dir, with a warning.
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv(COST_TABLE_DIR_ENV, str(tmp_path / "a-file" / "below"))
    assert cost_table_cache_dir("/models/unpacked") == "/models/unpacked"


def test_noisy_measurements_are_made_monotone_without_letting_one_spike_set_the_rest():
    from handler.planning.measure import _isotonic

    assert _isotonic([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    assert _isotonic([1.0, 5.0, 2.0, 3.0, 6.0]) == pytest.approx([1.0, 10 / 3, 10 / 3, 10 / 3, 6.0])
    assert _isotonic([3.0, 1.0]) == [2.0, 2.0]


def test_the_running_table_starts_as_measured_and_follows_the_median_of_what_it_observes():
    running = RunningCostTable(TABLE, window=9)
    for _ in range(MIN_OBSERVATIONS - 1):
        running.observe_target(1, 2, 0.24)  # twice the table's 0.12
    assert running.target_seconds(1, 2) == pytest.approx(0.12), "too few passes to overrule the table"
    running.observe_target(4, 4, 0.80)  # twice again, at another batch and width
    assert running.target_scale == pytest.approx(2.0)
    assert running.target_seconds(1, 3) == pytest.approx(0.32)  # the whole table scales
    # Until the draft's own steps are timed, it is taken to have slowed as the target did.
    assert running.draft_seconds(1) == pytest.approx(0.04)
    running.observe_target(1, 1, 5.0)  # one burst of load: the median ignores it
    assert running.target_scale == pytest.approx(2.0)
    for _ in range(9):
        running.observe_target(1, 1, 0.05)  # a lasting change: the window forgets the old passes
    assert running.target_scale == pytest.approx(0.5)
    for _ in range(MIN_OBSERVATIONS):
        running.observe_draft(1, 1, 0.02)  # the draft's own steps: as measured
    assert running.draft_scale == pytest.approx(1.0)


def planned_k(acceptance: float, max_k: int, costs, with_model: bool) -> int:
    """One row's drafts as `plan_batch` plans them on `costs`: the draft model's, or a free look-up's."""
    curve = [geometric_tokens(acceptance, k) for k in range(max_k + 1)]
    offer = Offer(model=curve) if with_model else Offer(lookup=curve)

    def seconds(width, passes, trees):
        return costs.target_seconds(1, width + 1) + (passes * costs.draft_seconds(1) if passes else 0.0)

    return plan_batch([offer], seconds).width


def test_the_running_table_times_draft_steps_per_step_and_clamps_its_scale():
    running = RunningCostTable(TABLE)
    for _ in range(MIN_OBSERVATIONS):
        running.observe_draft(4, 3, 3 * 0.05 * 1.5)  # three steps of batch 4, each 1.5x the table's
    assert running.draft_scale == pytest.approx(1.5)
    assert running.draft_seconds(4) == pytest.approx(0.075)
    running.observe_draft(1, 0, 1.0)  # no step: nothing to learn
    assert running.draft_scale == pytest.approx(1.5)
    for _ in range(64):
        running.observe_target(1, 1, 1e3)
    assert running.target_scale == MAX_SCALE


def test_a_draft_slower_than_measured_stops_the_plan_from_drafting():
    """The table measured the draft at a fast moment; the passes the engine times correct the plan."""
    table = CostTable(widths=(1, 8), batch_sizes=(1,), target=((0.10, 0.12),), draft=(0.02,))
    running = RunningCostTable(table)
    assert planned_k(0.5, 4, running, with_model=True) > 0
    for _ in range(MIN_OBSERVATIONS):
        running.observe_draft(1, 4, 4 * 0.06)  # each step took 3x the table's figure
        running.observe_target(1, 5, running.table.target_seconds(1, 5))
    assert running.draft_scale == pytest.approx(3.0)
    assert running.target_scale == pytest.approx(1.0)
    assert planned_k(0.5, 4, running, with_model=True) == 0


def test_each_width_learns_its_own_shape_and_keeps_it_when_the_machine_slows_as_a_whole():
    """Kernels can make a wider pass cheaper, which the measured table's fit never shows."""
    running = RunningCostTable(TABLE, window=9)
    truth = {1: 0.10, 2: 0.18, 4: 0.10}  # width 2 costs 1.5x the table's 0.12, width 4 half its 0.20
    for _ in range(MIN_OBSERVATIONS):
        for width, seconds in truth.items():
            running.observe_target(1, width, seconds)
    assert running.target_scale == pytest.approx(1.0)
    assert running.target_seconds(1, 2) == pytest.approx(0.12), "shapes are taken once the scale is known"
    for _ in range(MIN_OBSERVATIONS):
        for width, seconds in truth.items():
            running.observe_target(1, width, seconds)
    assert [running.target_seconds(1, width) for width in truth] == pytest.approx(list(truth.values()))
    assert planned_k(0.5, 3, running, with_model=False) == 3, "a width-4 pass is cheaper than a width-2 one"
    assert running.target_seconds(4, 2) == pytest.approx(0.24), "another batch size keeps the table's shape"
    for _ in range(3 * 9):  # the whole machine now runs at half the speed: the scale moves, the shape stays
        for width, seconds in truth.items():
            running.observe_target(1, width, 2 * seconds)
    assert running.target_scale == pytest.approx(2.0)
    assert [running.target_seconds(1, width) for width in truth] == pytest.approx([2 * s for s in truth.values()])
    assert running.target_seconds(4, 2) == pytest.approx(0.48)


def test_a_table_that_calls_a_pass_free_is_left_as_it_is():
    free = CostTable(widths=(1, 2), batch_sizes=(1,), target=((0.0, 0.0),), draft=(0.0,))
    running = RunningCostTable(free)
    for _ in range(MIN_OBSERVATIONS):
        running.observe_target(1, 2, 0.1)
        running.observe_draft(1, 3, 0.1)
    assert running.target_scale == running.draft_scale == 1.0 and running.target_seconds(1, 2) == 0.0


def test_batch_sizes_share_their_nearest_grid_points_shape():
    """Under load the batch's size keeps changing: 3 rows learn with 4."""
    running = RunningCostTable(TABLE)
    for _ in range(2 * MIN_OBSERVATIONS):  # the first ones set the scale, the next ones the shape
        running.observe_target(1, 1, 0.10)
    for _ in range(MIN_OBSERVATIONS):
        running.observe_target(3, 2, 2 * TABLE.target_seconds(3, 2))
    assert running.target_seconds(4, 2) == pytest.approx(2 * TABLE.target_seconds(4, 2))
    assert running.target_seconds(1, 2) == pytest.approx(TABLE.target_seconds(1, 2)), "batch 1 keeps its own"


def test_the_draft_step_learns_its_shape_per_batch_size():
    running = RunningCostTable(TABLE)
    for _ in range(2 * MIN_OBSERVATIONS):
        running.observe_draft(1, 2, 2 * 0.02)  # batch 1: as measured
        running.observe_draft(4, 2, 2 * 0.05 * 3)  # batch 4: guesses widen its passes, 3x the table's
    assert running.draft_seconds(1) == pytest.approx(0.02 * running.draft_scale)
    assert running.draft_seconds(4) == pytest.approx(0.15, rel=0.01)


def test_tree_passes_set_the_trees_premium_and_leave_the_chains_scale():
    running = RunningCostTable(TABLE)
    assert running.tree_factor == 1.0
    for _ in range(MIN_OBSERVATIONS):
        running.observe_target(1, 4, 0.20)
        running.observe_target(1, 4, 0.30, tree=True)
    assert running.target_scale == pytest.approx(1.0)
    assert running.tree_factor == pytest.approx(1.5)


# A machine where the target's pass costs the same up to the widest measured width: past it the
# table extrapolates flat, so a draft pass over hundreds of tokens is priced as one over one token.
FLAT = CostTable(
    widths=(1, 16, 17), batch_sizes=(1, 8), target=((0.26, 0.26, 0.26), (0.26, 0.5, 0.6)), draft=(0.04, 0.08)
)


class _Drafter:
    """What the planner asks the draft model when it prices a catch-up or a prefill."""

    def __init__(self, unfilled: int = 0, num_rows: int = 8, max_pending: int = 1, prefill_speedup: float = 1.0):
        self.unfilled, self.num_rows, self.max_pending = unfilled, num_rows, max_pending
        self.prefill_speedup = prefill_speedup

    def unfilled_tokens(self, request_id) -> int:
        return self.unfilled


def test_the_drafts_prefills_set_its_seconds_per_token():
    running = RunningCostTable(FLAT, window=3)
    assert running.draft_token_seconds is None, "no prefill timed yet"
    running.observe_fill(0, 1.0)  # nothing filled: nothing to learn
    assert running.draft_token_seconds is None
    running.observe_fill(300, 1.2)
    assert running.draft_token_seconds == pytest.approx(0.004), "one prefill of many tokens is enough"
    for seconds in (0.3, 0.6, 0.9):
        running.observe_fill(100, seconds)
    assert running.draft_token_seconds == pytest.approx(0.006), "the median of the window's last prefills"


def test_a_wide_draft_pass_costs_its_tokens_at_the_seconds_the_prefills_took():
    """Under load, prefills and catch-ups of hundreds of tokens ran 6x what the flat extrapolation
    priced; once one prefill was timed, the planner prices them at its seconds per token."""
    from handler.planning.planner import Planner

    running = RunningCostTable(FLAT)
    planner = Planner(running, estimates=None, model_drafter=_Drafter(unfilled=300, max_pending=30))
    assert planner.draft_pass_seconds(1, 300) == pytest.approx(0.04), "before: flat, one pass"
    catch_up = 0.08 * FLAT.target_seconds(8, 30) / 0.26  # the target's width, extrapolated
    assert planner.pass_seconds(8, 0, 2) == pytest.approx(0.26 + catch_up + 0.08)
    running.observe_fill(300, 1.2)
    assert planner.draft_pass_seconds(1, 300) == pytest.approx(1.2)
    assert catch_up < 8 * 30 * 0.004
    assert planner.draft_pass_seconds(8, 30) == pytest.approx(8 * 30 * 0.004), "a catch-up: its tokens"
    assert planner.pass_seconds(8, 0, 2) == pytest.approx(0.26 + 0.96 + 0.08)
    assert planner.draft_pass_seconds(8, 1) == pytest.approx(0.08), "a one-token pass: the table's"
    assert planner.draft_pass_seconds(1, 2) == pytest.approx(0.04), "a narrow pass the table prices higher"

    class Row:
        request_id, remaining = "r", 60

    # The row's prefill, spread over the 20 steps its 60 tokens take at 3 tokens a step.
    assert planner._fill_share(Row(), [1.0, 2.0, 3.0]) == pytest.approx(1.2 / 20)


def test_where_a_float_form_prefills_the_drafts_own_wide_passes_cost_its_tokens_at_the_start_up_ratio():
    """An int8 draft's float form prefills 1.9x faster: the prefills' seconds a token price the fills
    as timed, and the int8 form's own wide passes (a catch-up, guesses) at 1.9 times them."""
    from handler.planning.planner import Planner

    running = RunningCostTable(FLAT)
    running.observe_fill(300, 0.6)  # the float form's 2 ms a token
    planner = Planner(running, estimates=None, model_drafter=_Drafter(unfilled=300, prefill_speedup=1.9))
    assert planner.draft_pass_seconds(1, 300, fill=True) == pytest.approx(0.6)
    assert planner.draft_pass_seconds(8, 30) == pytest.approx(8 * 30 * 0.002 * 1.9), "a catch-up, int8"
    assert planner.draft_pass_seconds(8, 1) == pytest.approx(0.08), "a one-token pass: the table's"

    class Row:
        request_id, remaining = "r", 60

    assert planner._fill_share(Row(), [1.0, 2.0, 3.0]) == pytest.approx(0.6 / 20), "a fill: as timed"


def test_where_drafting_ran_below_its_price_a_prefill_must_pay_within_the_checks_steps():
    """A prefill serves its row only while it drafts; where the outcome check found drafting with the
    model below its price at this batch size, or has no verdict of it there yet, it may stop it within
    OUTCOME_MIN_STEPS, so the prefill is spread over those at most. Where the model's steps ran at or
    above their price (whatever the look-ups' verdict), or no check runs, over the row's steps."""
    from handler.planning.planner import Planner
    from handler.planning.trackers import LOOKUPS_ONLY, OUTCOME_MIN_STEPS, WITH_MODEL, OutcomeCheck

    running = RunningCostTable(FLAT)
    running.observe_fill(300, 1.2)
    check = OutcomeCheck()
    planner = Planner(running, estimates=None, model_drafter=_Drafter(unfilled=300), outcome_check=check)

    class Row:
        request_id, remaining = "r", 300

    curve = [1.0, 2.0, 3.0]  # 100 steps left
    assert planner._fill_steps(8) == OUTCOME_MIN_STEPS, "no verdict yet: the steps that form one"
    unchecked = Planner(running, estimates=None, model_drafter=_Drafter(unfilled=300))
    assert unchecked._fill_steps(8) == float("inf"), "no check: nothing stops the drafting"
    assert planner._fill_share(Row(), curve, unchecked._fill_steps(8)) == pytest.approx(1.2 / 100)
    for _ in range(OUTCOME_MIN_STEPS):
        check.observe(8, True, 1.0, 0.55, LOOKUPS_ONLY)
        check.observe(8, False, 1.0, 1.0)
    assert check.ratio(8) == pytest.approx(0.55)
    assert check.ratio(8, WITH_MODEL) is None
    assert planner._fill_steps(8) == OUTCOME_MIN_STEPS, (
        "look-ups below their price: the model's verdict is still to come"
    )
    for _ in range(OUTCOME_MIN_STEPS):
        check.observe(8, True, 1.0, 0.55, WITH_MODEL)
        check.observe(8, False, 1.0, 1.0)
    assert check.ratio(8, WITH_MODEL) == pytest.approx(0.55)
    assert planner._fill_steps(8) == OUTCOME_MIN_STEPS
    assert planner._fill_steps(7) == OUTCOME_MIN_STEPS, "7 rows share 8's verdict"
    assert planner._fill_share(Row(), curve, planner._fill_steps(8)) == pytest.approx(1.2 / OUTCOME_MIN_STEPS)
    assert planner._fill_steps(1) == OUTCOME_MIN_STEPS, "another batch size has its own verdict, none yet"
    for _ in range(OUTCOME_MIN_STEPS):
        check.observe(1, True, 1.0, 1.1, WITH_MODEL)
        check.observe(1, False, 1.0, 1.0)
    assert planner._fill_steps(1) == float("inf"), "drafting above its price: the row's steps"


def test_a_step_that_prefills_rows_in_the_draft_prices_its_passes_over_them_too():
    """The draft held no row; a plan that prefills 8 rows runs each draft pass over 8 rows, not one:
    priced at one row, its passes looked half their cost at 8."""
    from handler.planning.planner import Planner

    planner = Planner(RunningCostTable(FLAT), estimates=None, model_drafter=_Drafter(num_rows=0))
    assert planner.pass_seconds(8, 0, 2) == pytest.approx(0.26 + 2 * 0.04), "the draft's one row"
    assert planner.pass_seconds(8, 0, 2, joining=8) == pytest.approx(0.26 + 2 * 0.08)


def test_guessed_drafts_ride_a_draft_pass_only_as_far_as_they_save_more_than_they_cost():
    """Guessed drafting runs one draft pass over a row's guessed next drafts; the j-th guess saves a pass
    only where it and those before it are right, while its column costs every step. On 2 cores a pass
    over 3 tokens cost 1.07x one over 1 token at one row, 2.1x at 16 rows: there a pass carries none."""
    from handler.drafters import HYBRID, MODEL
    from handler.planning.planner import GUESS_PRIOR_HIT, Planner
    from handler.planning.trackers import GuessRate

    table = CostTable(
        widths=(1, 2, 4, 8),
        batch_sizes=(1, 16),
        target=((0.10, 0.10, 0.11, 0.15), (0.60, 1.00, 1.30, 3.0)),
        draft=(0.04, 0.10),
    )

    class Request:
        num_speculative_tokens = 8

    class Row:
        request_id, request, drafter, guess_rate = "r", Request, HYBRID, GuessRate()

    planner = Planner(table, estimates=None, model_drafter=_Drafter(), draft_guesses=True)
    assert GUESS_PRIOR_HIT == 0.5 and not Row.guess_rate.has_guessed
    # One row: 7 guesses (k - 1) cost 0.5 of a pass, and save 1/2 + 1/4 + .. + 1/128 of one.
    assert planner.guess_width(Row, 1) == 7
    assert planner.guesses_for(Row, 1) is Row.guess_rate
    # 16 rows: one guess costs 0.67 of a pass and saves half of one.
    assert planner.guess_width(Row, 16) == 0
    assert planner.guesses_for(Row, 16) is None, "priced as one pass a draft, and drafted so"

    confident = GuessRate()
    confident.update(8, 2)  # 6 of 7 drafts after the first came free, over a prior of 1 not free
    assert confident.has_guessed and confident.rate == pytest.approx(6 / 7.9)
    Row.request_id, Row.guess_rate = "confident", confident
    # 4 guesses cost 1.88 passes and save 2.11; a fifth would cost 2.58 and save 2.36.
    assert planner.guess_width(Row, 16) == 4
    Row.drafter = MODEL
    assert planner.guesses_for(Row, 1) is None, "only a hybrid row guesses"
    Row.drafter = HYBRID
    assert Planner(table, estimates=None, model_drafter=_Drafter()).guesses_for(Row, 1) is None, "guesses off"
    assert Planner(None, estimates=None, draft_guesses=True).guess_width(Row, 16) == 7, "no table: up to k - 1"

    # The running table moves: each step prices the widths afresh (`reprice_guesses`), once.
    Row.request_id, Row.guess_rate = "new", GuessRate()
    running = RunningCostTable(table)
    planner = Planner(running, estimates=None, model_drafter=_Drafter(), draft_guesses=True)
    assert planner.guess_width(Row, 1) == 7
    running.observe_fill(100, 100 * 0.024)  # the draft's prefills: 24 ms a token, a wide pass its tokens
    assert planner.guess_width(Row, 1) == 7, "within a step the width holds"
    planner.reprice_guesses()
    assert planner.draft_pass_seconds(1, 2) == pytest.approx(0.048)
    assert planner.guess_width(Row, 1) == 1, "2 tokens at 48 ms, 3 at 72 ms against 40 ms for 1"
