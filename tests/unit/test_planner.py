"""The planner: plan_batch (every row's drafts, priced for the whole batch by an injected cost table),
the expected-tokens formula, the confidence stop, the runners-up, and the hybrid rule."""

from __future__ import annotations

import itertools
import random

import pytest

from handler.drafters import MODEL, NGRAM, SUFFIX, Proposal
from handler.planning.cost_table import CostModel, CostTable
from handler.planning.planner import Candidate, StepPrices, choose
from handler.planning.pricing import Offer, geometric_tokens, plan_batch

# Draft costs 0.2 of a target pass; verifying extra tokens is free (the GPU-like case).
CHEAP_DRAFT = CostModel(draft_step=0.2, target_step=1.0, target_per_extra_token=0.0)
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


def step_seconds(costs: CostTable, batch_size: int, tree_factor: float = 1.0):
    """(width, draft passes, trees) -> seconds: one verify pass as wide as the widest row, and the passes."""

    def seconds(width: int, passes: float, trees: bool) -> float:
        verify = costs.target_seconds(batch_size, width + 1) * (tree_factor if trees else 1.0)
        return verify + (passes * costs.draft_seconds(batch_size) if passes else 0.0)

    return seconds


def model(acceptance: float, cap: int = 8) -> Offer:
    return Offer(model=[geometric_tokens(acceptance, k) for k in range(cap + 1)])


def lookup(acceptance: float, num: int) -> Offer:
    return Offer(lookup=[geometric_tokens(acceptance, k) for k in range(num + 1)])


def plan(offers, costs: CostTable, **options):
    return plan_batch(offers, step_seconds(costs, len(offers)), **options)


# Verification costs as much as the tokens it checks: speculation can never pay.
LINEAR = table(lambda width: 1.0 * width)
# Verification is as cheap at width 9 as at width 1 (the GPU-like case).
FLAT = table(lambda width: 1.0)


def test_width_two_at_twice_width_one_means_plain_decoding():
    assert plan([model(1.0)], LINEAR).ks == (0,)
    assert plan([model(0.9), model(0.95), model(1.0)], LINEAR).ks == (0, 0, 0)
    # Even with free drafting, a tie is not a win.
    assert plan([lookup(1.0, 8)], table(lambda width: 1.0 * width, draft=None)).ks == (0,)


def test_flat_verification_and_a_cheap_draft_give_a_large_k():
    assert plan([model(0.9)], FLAT).width >= 6
    assert plan([lookup(0.9, 8)], FLAT).ks == (8,)
    assert plan([model(1.0), model(1.0)], table(lambda width: 1.0, draft=0.01)).ks == (8, 8)


def test_k_grows_with_acceptance_and_drops_to_zero_when_drafts_are_rejected():
    ks = [plan([model(a)], FLAT).width for a in (0.2, 0.5, 0.8, 0.95)]
    assert ks == sorted(ks) and ks[0] < ks[-1]
    assert plan([model(0.05)], FLAT).width == 0
    assert plan([lookup(0.0, 8), lookup(0.0, 8)], FLAT).width == 0


def test_each_row_drafts_up_to_its_own_cap():
    assert plan([lookup(0.99, 3)], FLAT).ks == (3,)
    assert plan([Offer(), Offer()], FLAT).ks == (0, 0)
    chosen = plan([model(0.99, cap=1), model(0.99, cap=8)], table(lambda width: 1.0 + 0.05 * (width - 1), draft=0.02))
    assert chosen.ks[0] == 1 and chosen.ks[1] > 1


def test_under_load_the_plan_backs_off_where_the_same_rows_draft_alone():
    """A batch shares one read of the weights: at batch 4 a wider pass costs more, a draft pass too."""
    # Batch 1: width is nearly free (weights dominate). Batch 4: width 2 costs 1.6x width 1.
    costs = CostTable(
        widths=(1, 2, 4, 8, 9),
        batch_sizes=(1, 4),
        target=((1.0, 1.01, 1.02, 1.1, 1.12), (1.2, 1.9, 3.2, 6.0, 6.6)),
        draft=(0.3, 0.45),
    )
    assert plan([model(0.8)], costs).width > 1
    assert plan([model(0.8)] * 4, costs).ks == (0, 0, 0, 0)
    # Free look-up drafts that the target mostly takes still pay at batch 4; one row's alone do not.
    assert plan([lookup(0.9, 8)] * 4, costs).width > 0
    assert plan([lookup(0.9, 8), model(0.8), model(0.8), model(0.8)], costs).ks == (0, 0, 0, 0)


def test_a_hybrid_row_takes_the_look_up_or_the_model_by_the_batchs_price():
    both = Offer(lookup=[geometric_tokens(0.95, k) for k in range(9)], model=model(0.5).model)
    costly_draft = table(lambda width: 1.0 + 0.01 * (width - 1), draft=0.5)
    chosen = plan([both], costly_draft)
    assert chosen.ks == (8,) and chosen.uses_model == (False,) and chosen.draft_passes == 0
    weak_lookup = Offer(lookup=[1.0, 1.1], model=model(0.9).model)
    chosen = plan([weak_lookup], table(lambda width: 1.0, draft=0.05))
    assert chosen.uses_model == (True,) and chosen.ks[0] > 1


def test_look_up_drafts_past_the_draft_models_k_cost_only_verify_width():
    costly_draft = table(lambda width: 1.0 + 0.01 * (width - 1), draft=0.5)
    # The batch pays for 2 draft passes at most, so the look-up row's 8 drafts are worth verifying.
    chosen = plan([lookup(0.95, 8), model(0.5, cap=2)], costly_draft)
    assert chosen.ks[0] == 8 and chosen.draft_passes <= 2


def test_trees_are_verified_only_where_their_gain_beats_their_premium():
    # A tree of 4 nodes holds one more expected token than its 4-node first-choice chain.
    tree = Offer(lookup=[1.0, 1.5, 1.7, 1.8, 1.85], tree=[1.0, 1.5, 2.0, 2.4, 2.85])
    cheap = table(lambda width: 1.0 + 0.05 * (width - 1), draft=None)
    assert plan_batch([tree], step_seconds(cheap, 1, tree_factor=1.1)).trees
    chosen = plan_batch([tree], step_seconds(cheap, 1, tree_factor=2.0))
    assert not chosen.trees and chosen.width > 0


def test_explore_drafts_where_nothing_pays_yet():
    assert plan([model(0.8)], LINEAR).width == 0
    assert plan([model(0.8)], LINEAR, explore=True).width >= 1
    assert plan([Offer()], LINEAR, explore=True).width == 0


@pytest.mark.parametrize("seed", range(20))
def test_the_plan_is_the_best_of_every_assignment_of_drafts_to_rows(seed):
    """Brute force over each row's k and way to draft: nothing beats the plan's tokens per second."""
    import random

    rng = random.Random(seed)
    costs = table(lambda width: 1.0 + rng.uniform(0.0, 0.4) * (width - 1), draft=rng.uniform(0.05, 0.5))
    offers = []
    for _ in range(3):
        kind = rng.choice(("model", "lookup", "both"))
        model_curve = model(rng.random(), cap=3).model if kind != "lookup" else (1.0,)
        lookup_curve = lookup(rng.random(), rng.randint(0, 4)).lookup if kind != "model" else (1.0,)
        offers.append(Offer(lookup=lookup_curve, model=model_curve))
    seconds = step_seconds(costs, len(offers))
    chosen = plan_batch(offers, seconds)
    best = 0.0
    choices = [
        [("lookup", k) for k in range(len(offer.lookup))] + [("model", k) for k in range(1, len(offer.model))]
        for offer in offers
    ]
    for assignment in itertools.product(*choices):
        tokens = sum(getattr(offer, way)[k] for offer, (way, k) in zip(offers, assignment))
        passes = max((k for way, k in assignment if way == "model"), default=0)
        best = max(best, tokens / seconds(max(k for _, k in assignment), passes, False))
    assert chosen.tokens / chosen.seconds == pytest.approx(best)
    assert chosen.seconds == pytest.approx(seconds(chosen.width, chosen.draft_passes, False))


def test_the_bound_that_skips_planning_never_changes_the_plan(monkeypatch):
    """A batch that cannot gain is planned plain from a bound: the same plan as pricing every
    (width, drafts) pair, over random batches where plain decoding wins and where it loses."""
    import random

    from handler.planning import pricing

    rng = random.Random(7)
    cases = []
    for _ in range(400):
        per_token = rng.uniform(0.0, 0.3)  # from GPU-like (flat verify) to CPU-like under load
        costs = table(lambda width, s=per_token: 1.0 + s * (width - 1), draft=rng.uniform(0.02, 0.6))
        offers = []
        for _ in range(rng.randint(1, 6)):
            acceptance = rng.uniform(0.0, 0.95) ** rng.choice((1, 2))  # often low: a batch that stopped drafting
            kind = rng.choice(("model", "lookup", "both", "tree", "none"))
            model_curve = model(acceptance, cap=rng.randint(1, 6)).model if kind in ("model", "both") else (1.0,)
            lookup_curve = lookup(acceptance, rng.randint(0, 5)).lookup if kind in ("lookup", "both") else (1.0,)
            tree_curve = lookup(min(1.0, acceptance * 1.5), 6).lookup if kind == "tree" else None
            offers.append(Offer(lookup=lookup_curve, tree=tree_curve, model=model_curve))
        cases.append((offers, step_seconds(costs, len(offers), tree_factor=rng.uniform(0.9, 1.5))))

    fired = []
    original = pricing._plain_if_bound

    def counted(*args):
        plan = original(*args)
        fired.append(plan is not None)
        return plan

    monkeypatch.setattr(pricing, "_plain_if_bound", counted)
    bounded = [plan_batch(offers, seconds) for offers, seconds in cases]
    monkeypatch.setattr(pricing, "_plain_if_bound", lambda *args: None)
    priced = [plan_batch(offers, seconds) for offers, seconds in cases]
    assert [(p.ks, p.uses_model, p.trees) for p in bounded] == [(p.ks, p.uses_model, p.trees) for p in priced]
    assert 20 <= sum(fired) <= len(fired) - 20, sum(fired)  # both kinds of batch occurred
    # The bound's gain bounds the priced one's from above, and says plain where it decided.
    for with_bound, without in zip(bounded, priced):
        assert with_bound.drafting_gain >= without.drafting_gain * (1.0 - 1e-9)
        assert without.width or without.drafting_gain <= 1.0 + 1e-9
    assert any(p.width for p in priced)


def test_a_plain_plan_says_how_far_below_plain_decoding_the_best_drafting_plan_was_priced():
    """`BatchPlan.drafting_gain`: 0 where nothing can draft, the bound's where the bounds decided, the
    best drafting plan's rate over plain decoding's where the pricing did; the next steps may skip
    planning where it is well below 1."""
    assert plan([Offer(), Offer()], LINEAR).drafting_gain == 0.0  # nothing to draft
    rejected = plan([lookup(0.0, 4), model(0.0, 4)], LINEAR)
    assert not rejected.width and rejected.drafting_gain <= 0.6
    good = plan([lookup(0.9, 4), model(0.9, 4)], FLAT)
    assert good.width and good.drafting_gain > 1.0
    costs = step_seconds(LINEAR, 1)
    priced = plan_batch([lookup(0.6, 4)], costs)
    best = max(geometric_tokens(0.6, n) / costs(n, 0.0, False) for n in range(1, 5)) * costs(0, 0.0, False)
    assert not priced.width and priced.drafting_gain == pytest.approx(best)


def priced_row_by_row(offers, step_seconds, explore=False):
    """`plan_batch` as a loop over (trees, drafts, width) and then over rows, pricing one plan at a
    time: the definition its arrays must reproduce."""
    from handler.planning.pricing import BatchPlan

    max_model = max(len(offer.model) - 1 for offer in offers)
    max_lookup = max(max(len(offer.lookup), len(offer.tree or ())) - 1 for offer in offers)
    best = explored = None
    for trees in (False, True) if any(offer.tree is not None for offer in offers) else (False,):
        for drafts in range(max_model + 1):
            for width in range(drafts, max(drafts, max_lookup) + 1):
                ks, uses_model, tokens, passes, any_tree = [], [], 0.0, 0.0, False
                for offer in offers:
                    is_tree = trees and offer.tree is not None
                    curve = offer.tree if is_tree else offer.lookup
                    num_lookup, num_model = min(width, len(curve) - 1), min(drafts, len(offer.model) - 1)
                    if num_model and offer.model[num_model] > curve[num_lookup]:
                        ks.append(num_model)
                        uses_model.append(True)
                        tokens += offer.model[num_model]
                        passes = max(passes, offer.passes(num_model) if offer.passes else float(num_model))
                    else:
                        ks.append(num_lookup)
                        uses_model.append(False)
                        tokens += curve[num_lookup]
                        any_tree = any_tree or (is_tree and num_lookup > 0)
                seconds = step_seconds(max(ks), passes, any_tree)
                plan = BatchPlan(tuple(ks), tuple(uses_model), any_tree, passes, tokens, seconds)
                if plan.width == 0 and (width or drafts):
                    continue
                rate = tokens / seconds
                if best is None or rate > best.tokens / best.seconds * (1.0 + 1e-9):
                    best = plan
                if plan.width and (explored is None or rate > explored.tokens / explored.seconds * (1.0 + 1e-9)):
                    explored = plan
    return explored if explore and best.width == 0 and explored is not None else best


def test_every_plan_priced_at_once_is_the_plan_priced_row_by_row(monkeypatch):
    """`plan_batch` prices all its plans over arrays: over random batches (model, look-up, tree and
    guessed rows, cheap and dear drafts, with and without exploring) it returns the plan a row-by-row
    loop returns, its tokens and seconds to the bit."""
    import random

    from handler.planning import pricing

    monkeypatch.setattr(pricing, "_plain_if_bound", lambda *args: None)
    rng = random.Random(11)
    drafting = 0
    for case in range(600):
        per_token = rng.uniform(0.0, 0.3)
        costs = table(lambda width, s=per_token: 1.0 + s * (width - 1), draft=rng.uniform(0.02, 0.6))
        offers = []
        for _ in range(rng.randint(1, 16)):
            acceptance = rng.uniform(0.0, 1.0) ** rng.choice((1, 2, 4))
            kind = rng.choice(("model", "lookup", "both", "tree", "guessed", "none"))
            cap = rng.randint(1, 8)
            model_curve = model(acceptance, cap).model if kind in ("model", "both", "guessed") else (1.0,)
            lookup_curve = lookup(acceptance, rng.randint(0, 16)).lookup if kind in ("lookup", "both") else (1.0,)
            tree_curve = lookup(min(1.0, acceptance * 1.3), rng.randint(1, 16)).lookup if kind == "tree" else None
            guess_rate = rng.random()
            passes = (
                (lambda n, r=guess_rate: 0.0 if n <= 0 else 1.0 + (n - 1) * (1.0 - r)) if kind == "guessed" else None
            )
            offers.append(Offer(lookup=lookup_curve, tree=tree_curve, model=model_curve, passes=passes))
        seconds = step_seconds(costs, len(offers), tree_factor=rng.uniform(0.9, 1.5))
        explore = case % 5 == 0
        assert plan_batch(offers, seconds, explore=explore) == priced_row_by_row(offers, seconds, explore), case
        drafting += plan_batch(offers, seconds).width > 0
    assert 100 <= drafting <= 500, drafting  # both kinds of batch occurred


def test_expected_tokens_matches_the_geometric_series():
    assert geometric_tokens(0.0, 4) == 1.0
    assert geometric_tokens(1.0, 4) == 5.0
    assert geometric_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert geometric_tokens(0.8, 4) == pytest.approx((1 - 0.8**5) / 0.2)


def test_linear_cost_model_as_a_cost_table():
    assert CHEAP_DRAFT.target_seconds(4, 5) == CHEAP_DRAFT.target_seconds(1, 1) == 1.0
    assert CHEAP_DRAFT.draft_seconds(2) == 0.2
    assert CostModel(0.1, 1.0, 0.25).target_seconds(1, 3) == pytest.approx(1.5)


def linear_step_seconds(draft_step: float, per_column: float):
    """n drafts -> seconds: a target pass of 1 + n columns and n draft passes."""
    return lambda num_drafts: 1.0 + per_column * num_drafts + draft_step * num_drafts


def test_confidence_stop_drafts_on_while_one_more_draft_pays():
    from handler.planning.pricing import ConfidenceStop
    from handler.planning.trackers import ConfidenceCalibration

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
    from handler.planning.pricing import ConfidenceStop
    from handler.planning.trackers import ConfidenceCalibration

    calibration = ConfidenceCalibration()
    step_seconds = linear_step_seconds(draft_step=0.1, per_column=0.0)
    # One confident row keeps the batch drafting though the other row has given up.
    mixed = ConfidenceStop([calibration, calibration], [0.8, 0.8], 8, 0.0, step_seconds)
    assert mixed(1, [0.95, 0.05])
    assert mixed(2, [0.95, 0.95])
    # Many rows that gain nothing from drafting (look-ups, plain decoding) make a draft pass dear.
    crowded = ConfidenceStop([calibration], [0.8], 8, 30.0, step_seconds)
    assert not crowded(1, [0.95])


def test_runners_up_join_best_first_while_a_wider_pass_pays():
    from handler.planning.pricing import choose_runners_up

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
    from handler.planning.pricing import chain_expected_tokens

    assert chain_expected_tokens([]) == 1.0
    assert chain_expected_tokens([0.8] * 4) == pytest.approx(geometric_tokens(0.8, 4))
    assert chain_expected_tokens([0.5, 1.0, 0.0, 1.0]) == pytest.approx(1 + 0.5 + 0.5)


# --------------------------------------------------------------------------- the hybrid rule


def candidate(drafter: str, curve: list[float]) -> Candidate:
    max_k = len(curve) - 1
    lookup = Proposal([]) if drafter == MODEL else Proposal(list(range(max_k)))
    return Candidate(drafter, lookup, max_k, curve)


def test_without_a_cost_table_the_look_up_expecting_most_wins_and_the_model_drafts_elsewhere():
    suffix, ngram = candidate(SUFFIX, [1, 1.5, 1.7]), candidate(NGRAM, [1, 1.9, 2.7])
    model = candidate(MODEL, [1, 2, 3])
    assert choose([suffix, ngram, model], None) is ngram
    assert choose([suffix, model], None) is suffix
    assert choose([candidate(SUFFIX, [1]), model], None) is model  # nothing found: the model
    assert choose([candidate(SUFFIX, [1])], None).max_k == 0


def test_with_a_cost_table_the_most_tokens_per_second_wins():
    def seconds(k: int, model: bool) -> float:
        return 1.0 + 0.05 * k + (0.3 * k if model else 0.0)

    look_up = candidate(SUFFIX, [1, 1.6, 2.0, 2.2])
    strong_model = candidate(MODEL, [1, 1.95, 2.85, 3.7])
    # look-up: best 2.0 / 1.1 = 1.82 tokens/s; model: best 1.95 / 1.35 = 1.44.
    assert choose([look_up, strong_model], StepPrices(seconds)) is look_up
    cheap_draft = lambda k, model: 1.0 + 0.05 * k + (0.02 * k if model else 0.0)  # noqa: E731
    assert choose([look_up, strong_model], StepPrices(cheap_draft)) is strong_model


def test_step_prices_price_each_k_once_and_rate_a_candidate_at_its_best_k():
    asked = []

    def seconds(k: int, model: bool) -> float:
        asked.append((k, model))
        return 1.0 + 0.05 * k + (0.3 * k if model else 0.0)

    prices = StepPrices(seconds)
    rng = random.Random(3)
    for _ in range(50):
        max_k, model = rng.randint(1, 12), rng.random() < 0.5
        curve = [1.0]
        for _ in range(max_k + rng.randint(0, 3)):  # a curve may run past the candidate's max_k
            curve.append(curve[-1] + rng.random())
        expected = max(curve[k] / seconds(k, model) for k in range(1, max_k + 1))
        assert prices.best_rate(curve, max_k, model) == expected
        assert prices.up_to(max_k, model)[max_k - 1] == seconds(max_k, model)
    asked.clear()
    prices = StepPrices(seconds)
    for max_k in (3, 7, 2, 7):
        prices.best_rate([1.0] * 8, max_k, True)
    assert asked == [(k, True) for k in range(1, 8)]  # each k once, however many rows ask
