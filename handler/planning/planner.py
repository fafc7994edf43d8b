"""The step plan: what each row drafts this step, priced for the whole batch, decided once.

`handler.engine.propose` says what each row *can* draft (`RowOptions`: the look-ups that found
something, or the tokens its grammar forces, and the draft model's curve). `Planner.plan` then
decides, in one place, each row's drafter (the hybrid rule's choice among its look-ups, then the
look-up or the draft model as the batch's costs say), its k and whether it verifies a tree, and
returns one `RowPlan` per row. The draft loop runs the plan and reports what it actually
drafted as `Drafts` (the draft may stop early; a greedy chain may take the draft's runners-up);
verifying reads those.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from typing import Callable, Sequence

import torch

from handler.drafters import HYBRID, MODEL, NO_DRAFTS, PROPOSER_GRAMMAR, Proposal
from handler.planning.acceptance import DraftConfidences, Estimates, first_choice_chain
from handler.planning.cost_table import RunningCostTable
from handler.planning.pricing import (
    BatchPlan,
    ConfidenceStop,
    Offer,
    chain_expected_tokens,
    choose_runners_up,
    plan_batch,
)
from handler.planning.trackers import (
    LOOKUPS_ONLY,
    OUTCOME_MIN_STEPS,
    WITH_MODEL,
    GuessRate,
    OutcomeCheck,
    PlainStreak,
    PlannedRow,
    batch_bucket,
)
from handler.types import DrafterName

# Guessed drafting (`handler.drafters.model`, `GuessRate`): a draft pass carries a row's next g guessed
# drafts where the pass over 1 + g tokens costs no more than the passes they are expected to save. The
# j-th guess of a pass saves a pass where it and those before it are right: with the row's guess rate as
# each guess's chance (GUESS_PRIOR_HIT before it has guessed), g guesses save hit + hit^2 + .. + hit^g
# passes, against the wider pass's premium over one token, as the cost table prices the batch's rows.
# On 2 cores a pass over 3 tokens cost 1.07x one over 1 token at one row but 2.1x at 16 rows (the
# target's table), where guessed draft steps at k = 8 ran 2.5 to 3.7x the one-token price they were
# planned at. Without a cost table every guess rides (up to the row's k).
GUESS_PRIOR_HIT = 0.5
MAX_GUESSES = 31  # more than any row's k - 1 (`handler.config.MAX_K`)


# A step's records of each row (its candidates, options, choice, offer, plan, drafts and confidences,
# and the drafters' `Proposal` and `DraftRow`) are plain dataclasses, not frozen ones: a step builds
# several a row, and a frozen dataclass's constructor sets each field through `object.__setattr__`,
# about 3x the cost (1.0 against 0.3 us for 7 fields). Nothing changes them once built, the shared
# ones (NO_PLAN, NO_DRAFTS_TO_VERIFY) included.
@dataclasses.dataclass
class Candidate:
    """One way a row can draft from a look-up this step (or the tokens its grammar forces)."""

    drafter: DrafterName
    lookup: Proposal  # its drafts, best first
    max_k: int  # the most drafts it can verify this step
    curve: Sequence[float]  # expected tokens E(0..max_k), bonus token included


@dataclasses.dataclass
class RowOptions:
    """What one row can draft this step (`handler.engine.propose.Proposer.options`), before the plan picks."""

    candidates: tuple[Candidate, ...] = ()  # its look-ups, in order of preference (or the grammar's tokens)
    model_curve: Sequence[float] | None = None  # E(0..cap) with the draft model; None: the model does not draft
    guesses: GuessRate | None = None  # its model drafts' guess rate (guessed drafting), else None


@dataclasses.dataclass
class _Choice:
    """A row's best look-up (the hybrid rule's pick among its candidates) and its model curve."""

    lookup: Proposal  # NO_DRAFTS: none
    lookup_drafter: DrafterName | None = None  # None: no look-up drafts for this row
    lookup_curve: Sequence[float] = (1.0,)
    chain: Proposal | None = None  # a tree look-up's first-choice chain, and its E(0..n); None for a chain
    chain_curve: Sequence[float] | None = None
    model_curve: Sequence[float] | None = None
    guesses: GuessRate | None = None

    def offer(self) -> Offer:
        return Offer(
            lookup=self.chain_curve if self.chain is not None else self.lookup_curve,
            tree=self.lookup_curve if self.chain is not None else None,
            model=self.model_curve or (1.0,),
            passes=None if self.guesses is None else self.guesses.passes,
        )


@dataclasses.dataclass
class RowPlan:
    """One row's part of a step, as planned: who drafts, how many drafts at most, which look-up."""

    drafter: DrafterName  # who drafts: the look-up, the grammar or the model
    proposal: Proposal  # a look-up's or the grammar's drafts (a tree where the plan verifies one)
    k: int  # drafts planned (a tree's nodes; for the draft model, the most it drafts); 0: plain decoding
    uses_model: bool  # the draft model drafts them
    curve: Sequence[float]  # E(0..n) as planned
    planned_tree: bool = False  # a look-up's tree the plan picked (its branches are calibrated)
    guesses: bool = False  # its model drafts are guessed (`Planner.guesses_for`, asked once, at the options)


NO_PLAN = RowPlan(drafter=MODEL, proposal=NO_DRAFTS, k=0, uses_model=False, curve=(1.0,))  # plain decoding


@dataclasses.dataclass
class Drafts:
    """What one row verifies this step: its plan's look-up as planned, or the draft model's chain as the
    draft loop left it (stopped early, or widened into a tree of its runners-up)."""

    proposal: Proposal  # the drafts, a chain or a tree
    # The draft model's distributions over its chain's drafts [chain, vocab] (a tree's runners-up come
    # after the chain and are walked, never rejection-sampled); None: a look-up's, one-hot.
    probs: torch.Tensor | None = None
    confidences: DraftConfidences | None = None  # the draft's confidence in its chain, where measured

    @functools.cached_property
    def k(self) -> int:
        """Drafts verified (a tree's nodes); a step reads it several times a row."""
        return len(self.proposal.token_ids)


NO_DRAFTS_TO_VERIFY = Drafts(NO_DRAFTS)


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """Every row's plan, in batch order, and the draft model's stop rule (None: it drafts the ks)."""

    rows: tuple[RowPlan, ...]
    keep_drafting: Callable[[int, dict], bool] | None = None
    expected_rate: float = 0.0  # the batch's tokens per second as priced (0: no cost table)
    # Where no row drafts: the best drafting plan's priced rate over plain decoding's (`BatchPlan.drafting_gain`),
    # as the outcome check's verdict judges it; infinite where the plan drafts or nothing says. Well
    # below 1, the next steps may decode plainly without planning (`handler.planning.trackers.PlainStreak`).
    drafting_gain: float = math.inf

    @property
    def ks(self) -> list[int]:
        return [row.k for row in self.rows]

    @property
    def width(self) -> int:
        """The most drafts a row may verify."""
        return max((row.k for row in self.rows), default=0)

    @classmethod
    def plain(cls, num_rows: int) -> StepPlan:
        """No row drafts."""
        return cls((NO_PLAN,) * num_rows)


class StepPrices:
    """The seconds of a step of one batch verifying k drafts, with the draft model or not, each priced
    once a plan: every row's candidates ask for the same few ks. A candidate's best tokens per second
    over its ks (`best_rate`) is taken from the prices of all of them at once."""

    def __init__(self, seconds: Callable[[int, bool], float]) -> None:
        """`seconds`: (k, drafts with the model) -> the seconds of such a step."""
        self._seconds = seconds
        self._prices: dict[bool, list[float]] = {False: [], True: []}  # [k - 1]: a step of k drafts

    def up_to(self, max_k: int, model: bool) -> list[float]:
        """The seconds of a step of 1, 2, .. drafts, at least `max_k` of them."""
        prices = self._prices[model]
        while len(prices) < max_k:
            prices.append(self._seconds(len(prices) + 1, model))
        return prices

    def best_rate(self, curve: Sequence[float], max_k: int, model: bool) -> float:
        """max over k in 1..max_k of curve[k] / seconds(k, model): E(k) per second of its step."""
        return max(map(operator.truediv, curve[1 : max_k + 1], self.up_to(max_k, model)))


class Planner:
    """Prices steps with a cost table and decides each row's drafts (`plan`)."""

    def __init__(
        self,
        cost_table,
        estimates: Estimates,
        model_drafter=None,
        *,
        draft_confidence: bool = False,
        draft_guesses: bool = False,
        outcome_check: OutcomeCheck | None = None,
    ) -> None:
        self.cost_table = cost_table
        self.estimates = estimates
        self.model_drafter = model_drafter
        self.draft_confidence = draft_confidence
        self.draft_guesses = draft_guesses
        self.outcome_check = outcome_check
        # Steps after plans that priced drafting well below plain decoding skip planning; with a cost
        # table only (without one every row drafts its cap, and a look-up's next match is taken).
        self.plain_streak = PlainStreak() if cost_table is not None else None
        # This step's `guess_width` by (request id, batch size), and the premiums of wider draft passes
        # over one token's by batch size (`reprice_guesses`: the running table moves).
        self._guess_widths: dict[tuple, int] = {}
        self._guess_premiums: dict[int, list[float]] = {}

    def reprice_guesses(self) -> None:
        """Starts a step: its `guess_width`s are priced once, with the table and the rates as they
        stand, and hold for the options, the plan and the drafts alike."""
        self._guess_widths.clear()
        self._guess_premiums.clear()

    def guesses_for(self, row: PlannedRow, batch_size: int) -> GuessRate | None:
        """The row's guess rate where its model drafts are guessed this step (a hybrid row whose draft
        passes over `batch_size` rows carry guesses: `guess_width`), else None."""
        if not (self.draft_guesses and row.drafter == HYBRID) or not self.guess_width(row, batch_size):
            return None
        return row.guess_rate

    def guess_width(self, row: PlannedRow, batch_size: int) -> int:
        """The most guessed drafts a draft pass over `batch_size` rows carries for `row` beside its feed:
        as many as save more passes than their columns cost (GUESS_PRIOR_HIT), at most its k - 1;
        that many without a cost table."""
        limit = min(MAX_GUESSES, max(0, row.request.num_speculative_tokens - 1))
        if self.cost_table is None:
            return limit
        key = (row.request_id, batch_size)
        width = self._guess_widths.get(key)
        if width is not None:
            return width
        premiums = self._guess_premiums.setdefault(batch_size, [])  # [g]: a pass with g + 1 guesses
        hit = row.guess_rate.rate if row.guess_rate.has_guessed else GUESS_PRIOR_HIT
        one_token = self.draft_pass_seconds(batch_size, 1) if len(premiums) < limit else 0.0
        width, saved = 0, 0.0
        while width < limit:
            if len(premiums) <= width:
                premiums.append(self.draft_pass_seconds(batch_size, width + 2) / one_token - 1.0)
            saved += hit ** (width + 1)
            if premiums[width] > saved:
                break
            width += 1
        self._guess_widths[key] = width
        return width

    def pass_seconds(
        self, batch_size: int, width: int, num_draft_passes: float, trees: bool = False, joining: int = 0
    ) -> float:
        """The cost table's seconds for a step: a target pass over `width` drafts and the pending
        token (a tree pass at its measured premium), after `num_draft_passes` draft-model passes.

        A draft pass runs over every row the draft model holds, and the `joining` rows the step
        prefills in it first; its first pass also feeds the tokens each row committed since it last
        drafted: after steps without model drafts that pass is wider, priced by the target's cost of
        that width (the draft has no table of its own).
        """
        table = self.cost_table
        seconds = table.target_seconds(batch_size, width + 1)
        if trees and isinstance(table, RunningCostTable):
            seconds *= table.tree_factor
        if num_draft_passes:
            draft_rows = max(1, self.model_drafter.num_rows + joining)
            first_pass = self.draft_pass_seconds(draft_rows, self.model_drafter.max_pending)
            seconds += first_pass + max(0.0, num_draft_passes - 1) * table.draft_seconds(draft_rows)
        return seconds

    def draft_pass_seconds(self, num_rows: int, width: int, fill: bool = False) -> float:
        """The draft model's pass over `width` tokens for each of `num_rows` rows: a first pass that
        catches up on the tokens committed without it, a pass with guesses, or (`fill`) its prefill of
        a joining row.

        The draft has no table of its own beyond one token: its one-token pass, scaled by the target's
        cost of that width. A wider pass costs no less than its tokens at the draft's seconds per
        token in the prefills it ran (`RunningCostTable.draft_token_seconds`): under load on a CPU,
        prefills of a few hundred tokens ran 6 times that scaled price. Where another form of the draft
        prefills (an int8 draft's float form), the draft's own passes take the prefills' seconds at
        the start-up ratio of the two (`ModelDrafter.prefill_speedup`).
        """
        table = self.cost_table
        one_pass = table.draft_seconds(num_rows)
        if width <= 1:
            return one_pass
        seconds = one_pass * table.target_seconds(num_rows, width) / table.target_seconds(num_rows, 1)
        if isinstance(table, RunningCostTable) and table.draft_token_seconds is not None:
            token_seconds = table.draft_token_seconds * (1.0 if fill else self.model_drafter.prefill_speedup)
            seconds = max(seconds, num_rows * width * token_seconds)
        return seconds

    def step_seconds(self, batch_size: int) -> StepPrices | None:
        """The cost table's prices of a step of the batch by its drafts (`StepPrices`); None without a table."""
        if self.cost_table is None:
            return None
        return StepPrices(lambda k, model: self.pass_seconds(batch_size, k, k if model else 0))

    def _fill_share(self, row: PlannedRow, model_curve: Sequence[float], max_steps: float = math.inf) -> float:
        """The seconds per step of the draft model's prefill of a row it has not drafted for (`fill`):
        priced as a pass of that width (`draft_pass_seconds`), and spread over the steps the row has
        left at its cap's expected tokens, as the prefill serves them all, or over `max_steps`, where
        the row may not draft for longer (`_fill_steps`)."""
        num_tokens = self.model_drafter.unfilled_tokens(row.request_id)
        if not num_tokens:
            return 0.0
        seconds = self.draft_pass_seconds(1, num_tokens, fill=True)
        steps_left = min(max(1.0, row.remaining / model_curve[-1]), max_steps)
        return seconds / steps_left

    def _fill_steps(self, batch_size: int) -> float:
        """The most steps a prefill in the draft is spread over at this batch size.

        A prefill pays only while its row drafts. Where drafting with the model at this batch size has run
        below its price (`OutcomeCheck.ratio` of its kind < 1), the check may turn it off again within the
        steps its verdict takes (OUTCOME_MIN_STEPS): a prefill must pay within them. So too where it has no
        verdict yet: the steps that form one may end with it below its price. (Look-up steps that ran
        below theirs say nothing of the model's: under load at 4 rows their verdict, 0.74 to 0.81, kept
        the model from every row it had not prefilled.) Under load on a CPU, steps that
        prefilled 8 rows for a plan barely clearing the check ran 2.6 to 3.7 s, and drafting stopped
        at the next step: 9 % of a C = 8 run lost to plain decoding; at 16 rows, a second wave of
        requests that the model had not drafted for at that size was prefilled in the draft (2.3 s) for
        the 8 steps the verdict took, which found it below its price: 0.88x plain in that repeat.
        """
        check = self.outcome_check
        if check is None:
            return math.inf  # nothing may stop it
        ratio = check.ratio(batch_bucket(batch_size), WITH_MODEL)
        return math.inf if ratio is not None and ratio >= 1.0 else OUTCOME_MIN_STEPS

    def plan(self, rows: list[PlannedRow], options: list[RowOptions], num_steps: int) -> StepPlan:
        """Each row's drafter, k and tree this step, priced for the whole batch: the one place they are decided.

        A row's look-ups compete first (`choose`: the hybrid rule); its best then competes with the
        draft model across the batch (`_batch_plan`). Where the draft's confidence stops it, a row that
        drafts with the model plans its cap, and the stop rule (`keep_drafting`) says how far it goes.
        """
        step_seconds = self.step_seconds(len(rows))
        choices = [_choose_lookup(option, step_seconds) for option in options]
        batch = self._batch_plan(rows, choices, num_steps)
        # The plan says whether to draft; the draft's confidence says how far (`_confidence_stop`). Where
        # the stop is a mask, every planned pass runs whatever it says: the plan's k stands, and the
        # stop only cuts drafts whose verify columns do not pay.
        masked = bool(batch.draft_passes) and self.draft_confidence and self._stops_by_mask(choices, batch.uses_model)
        to_cap = bool(batch.draft_passes) and self.draft_confidence and not masked
        plans = []
        for choice, k, uses_model in zip(choices, batch.ks, batch.uses_model):
            if uses_model or choice.lookup_drafter is None:
                curve = choice.model_curve or (1.0,)
                if uses_model and to_cap:
                    k = len(curve) - 1
                guesses = choice.guesses is not None
                plans.append(
                    RowPlan(drafter=MODEL, proposal=NO_DRAFTS, k=k, uses_model=uses_model, curve=curve, guesses=guesses)
                )
                continue
            lookup, curve = choice.lookup, choice.lookup_curve
            if choice.chain is not None and not batch.trees:
                lookup, curve = choice.chain, choice.chain_curve
            plans.append(
                RowPlan(
                    drafter=choice.lookup_drafter,
                    proposal=lookup.prefix(k),
                    k=k,
                    uses_model=False,
                    curve=curve,
                    planned_tree=choice.lookup.is_tree,
                )
            )
        expected_rate = batch.tokens / batch.seconds if batch.seconds > 0 else 0.0
        gain = math.inf if batch.width else batch.drafting_gain
        if self.outcome_check is not None:
            # Drafting as it ran against its price. Without a verdict the check explores by step number
            # (`OutcomeCheck.arm`): every step plans.
            ratio = self.outcome_check.ratio(batch_bucket(len(rows)))
            gain = math.inf if ratio is None else gain * ratio
        return StepPlan(tuple(plans), self._confidence_stop(rows, choices, plans, masked), expected_rate, gain)

    def _stops_by_mask(self, choices: list[_Choice], uses_model: Sequence[bool]) -> bool:
        """Whether the draft model's proposal this step runs all its passes and applies the stop after
        them (`ModelDrafter.stop_by_mask`): it does where no row that drafts with it guesses."""
        drafter = self.model_drafter
        if drafter is None or not getattr(drafter, "stops_by_mask", False):
            return False
        return not any([choice.guesses is not None for choice, model in zip(choices, uses_model) if model])

    def _batch_plan(self, rows: list[PlannedRow], choices: list[_Choice], num_steps: int) -> BatchPlan:
        """Without a cost table every row drafts its cap: with its look-up where it found one, else the
        model. With one, `plan_batch` prices each width and number of model drafts.
        """
        if self.cost_table is None:
            uses_model = [choice.lookup_drafter is None and choice.model_curve is not None for choice in choices]
            ks = [
                len(choice.model_curve) - 1 if model else len(choice.lookup.token_ids)
                for choice, model in zip(choices, uses_model)
            ]
            return BatchPlan(
                ks=tuple(ks), uses_model=tuple(uses_model), trees=True, draft_passes=0.0, tokens=0.0, seconds=0.0
            )
        offers = [choice.offer() for choice in choices]
        # Until the pool has seen a few steps of a way to draft, nothing says whether it pays: draft.
        estimated = {MODEL for choice in choices if choice.model_curve is not None}
        estimated |= {choice.lookup_drafter for choice in choices if choice.lookup_drafter is not None}
        explore = self.estimates.exploring(estimated)
        batch_size = len(rows)

        # A row the draft model has not drafted for yet must be prefilled first: priced as a whole, with
        # the plan where such rows do not draft with the model as the alternative.
        max_steps = self._fill_steps(batch_size)
        fill = [
            self._fill_share(row, choice.model_curve, max_steps) if choice.model_curve is not None else 0.0
            for row, choice in zip(rows, choices)
        ]

        # The rows such a plan prefills: every draft pass then runs over them too.
        joining = sum(1 for share in fill if share)
        priced: dict[tuple[int, float, bool, int], float] = {}  # the plans below ask for the same shapes

        def pass_seconds(width: int, passes: float, trees: bool, joining: int = 0) -> float:
            key = (width, passes, trees, joining)
            seconds = priced.get(key)
            if seconds is None:
                seconds = priced[key] = self.pass_seconds(batch_size, width, passes, trees, joining)
            return seconds

        def seconds_with(fill_seconds: float, joining: int = 0) -> Callable[[int, float, bool], float]:
            return lambda width, passes, trees: (
                pass_seconds(width, passes, trees, joining) + (fill_seconds if passes else 0.0)
            )

        # The same offers where a row the draft has not prefilled cannot draft with the model.
        filled_only = (
            [dataclasses.replace(offer, model=(1.0,)) if share else offer for share, offer in zip(fill, offers)]
            if any(fill)
            else offers
        )
        plan = plan_batch(offers, seconds_with(sum(fill), joining), explore)
        # While the pool learns the acceptance, the plan drafts, a prefill included. Where no row the
        # draft holds could draft with it, the alternative's plans are all plans above, none dearer.
        filled_model_rows = any(not share and choice.model_curve is not None for share, choice in zip(fill, choices))
        if any(fill) and filled_model_rows and not explore:
            without = plan_batch(filled_only, seconds_with(0.0))
            if without.tokens / without.seconds > plan.tokens / plan.seconds * (1.0 + 1e-9):
                plan = without
        for row, k, offer in zip(rows, plan.ks, offers):
            if k == 0 and max(len(offer.lookup), len(offer.model)) > 1:
                row.stats.fell_back = True
        if self.outcome_check is not None:
            bucket = batch_bucket(batch_size)
            # Only rows the draft already holds: a step run to learn must not prefill the batch.
            drafting = plan if plan.width else None
            ratio = self.outcome_check.ratio(bucket)
            if drafting is None and ratio is not None and ratio > 1.0:
                # Drafting ran better than priced: a drafting plan the table turned down may win.
                drafting = plan_batch(filled_only, seconds_with(0.0), explore=True)
            gain, kind = 1.0, None
            if drafting is not None and drafting.width:
                gain = drafting.tokens / drafting.seconds * pass_seconds(0, 0.0, False) / batch_size
                kind = draft_kind(drafting.ks, drafting.uses_model)
            drafts = self.outcome_check.arm(bucket, plan.width > 0, num_steps, gain=gain, kind=kind)
            if drafts and not plan.width:
                plan = drafting or plan_batch(filled_only, seconds_with(0.0), explore=True)
            elif plan.width and not drafts:
                # Speculation gives way; the tokens a grammar forces are certain, and stay.
                forced = [
                    offer if choice.lookup_drafter == PROPOSER_GRAMMAR else Offer()
                    for choice, offer in zip(choices, offers)
                ]
                # Plain by the check's verdict, not by the bounds: the next plan may draft.
                return dataclasses.replace(plan_batch(forced, seconds_with(0.0)), drafting_gain=math.inf)
        return plan

    def _confidence_stop(
        self, rows: list[PlannedRow], choices: list[_Choice], plans: list[RowPlan], masked: bool = False
    ) -> Callable[[int, dict], bool] | None:
        """The draft model's stop rule this step (`ConfidenceStop`), or None: it drafts its rows' ks
        (`choices`: each row's, with its guess rate where it guesses). `masked`: the proposal runs all
        its passes whatever the rule says, so one more draft costs its verify column only."""
        model_slots = [slot for slot, plan in enumerate(plans) if plan.uses_model and plan.k > 0]
        if not (self.draft_confidence and self.cost_table is not None and model_slots):
            return None
        batch_size = len(rows)
        others = [slot for slot in range(batch_size) if slot not in model_slots]
        other_width = max((plans[slot].k for slot in others), default=0)

        # The batch drafts until its slowest row has its drafts: the row whose drafts are guessed least.
        # A row that does not guess takes a pass a draft, as a rate of 0 (GuessRate's prior) does.
        rates = [choices[slot].guesses for slot in model_slots]
        slowest = GuessRate() if None in rates else min(rates, key=lambda rate: rate.rate)

        max_drafts = max(plans[slot].k for slot in model_slots)

        @functools.cache  # the rule asks each pass for that number of drafts and the next
        def step_seconds(num_drafts: int) -> float:
            passes = slowest.passes(max_drafts if masked else num_drafts)
            return self.pass_seconds(batch_size, max(num_drafts, other_width), passes)

        by_kind = self.estimates.calibrations  # greedy or not: two calibrations for the batch's rows
        calibrations = [by_kind[rows[slot].request.sampling.is_greedy] for slot in model_slots]
        mean_acceptances = {greedy: calibration.mean_acceptance for greedy, calibration in by_kind.items()}
        stop = ConfidenceStop(
            calibrations,
            [mean_acceptances[rows[slot].request.sampling.is_greedy] for slot in model_slots],
            max_drafts,
            planned_tokens([plans[slot] for slot in others]),
            step_seconds,
        )
        ids = [rows[slot].request_id for slot in model_slots]
        return lambda num_drafted, confidences: stop(num_drafted, [confidences[i] for i in ids])

    def runners_up(
        self,
        rows: list[PlannedRow],
        plans: Sequence[RowPlan],
        chains: dict[int, tuple[int, Sequence[float], Sequence[tuple[int, float]]]],
        eligible: Sequence[int],
        max_nodes: Sequence[int],
    ) -> dict[int, tuple[list[int], dict[int, float]]]:
        """Where the draft's runners-up join its greedy chains as siblings (`choose_runners_up`).

        Args:
            rows, plans: the step's rows and their plans.
            chains: slot -> (drafts, their confidences, the runner-up (token, probability) at each) for
                every row the draft model drafted for.
            eligible: the slots whose chain may take runners-up; `max_nodes`: the most nodes each may have.

        Returns:
            slot -> (the chain positions that take their runner-up, position -> the runner-up's share of
            what the draft left to other tokens there), for the eligible rows that take any.
        """
        batch_size = len(rows)
        num_drafted = {slot: chain[0] for slot, chain in chains.items()}
        num_draft_passes = max(num_drafted.values())
        width = max(num_drafted.get(slot, plans[slot].k) for slot in range(batch_size))
        calibrations = self.estimates.calibrations
        # Each model row's calibrated acceptance of each of its drafts, and the step's expected tokens.
        chain_acceptances = {
            slot: calibrations[rows[slot].request.sampling.is_greedy].acceptances(confidences)
            for slot, (_, confidences, _) in chains.items()
        }
        tokens = planned_tokens([plans[slot] for slot in range(batch_size) if slot not in chains])
        tokens += sum(chain_expected_tokens(acceptances) for acceptances in chain_acceptances.values())
        runner_up_acceptances, shares = [], []
        for slot in eligible:
            _, confidences, runners_up = chains[slot]
            # The runner-up's share of what the draft left to tokens other than its draft.
            row_shares = [prob / max(1.0 - c, 1e-6) for (_, prob), c in zip(runners_up, confidences)]
            shares.append(row_shares)
            runner_up_acceptances.append(self.estimates.runner_up_calibration.acceptances(row_shares))

        def step_seconds(step_width: int) -> float:
            return self.pass_seconds(batch_size, step_width, num_draft_passes)

        acceptances = [chain_acceptances[slot] for slot in eligible]
        chosen = choose_runners_up(acceptances, runner_up_acceptances, max_nodes, width, tokens, step_seconds)
        return {
            slot: (positions, {position: row_shares[position] for position in positions})
            for slot, positions, row_shares in zip(eligible, chosen, shares)
            if positions
        }


def _choose_lookup(option: RowOptions, step_seconds: StepPrices | None) -> _Choice:
    """A row's best look-up (`choose`) with its first-choice chain where it is a tree."""
    if not option.candidates:
        return _Choice(lookup=NO_DRAFTS, model_curve=option.model_curve, guesses=option.guesses)
    best = choose(option.candidates, step_seconds)
    chain, chain_curve = None, None
    if best.lookup.is_tree:
        chain, chain_curve = first_choice_chain(best.lookup, best.curve)
    return _Choice(
        lookup=best.lookup,
        lookup_drafter=best.drafter,
        lookup_curve=list(best.curve),
        chain=chain,
        chain_curve=chain_curve,
        model_curve=option.model_curve,
        guesses=option.guesses,
    )


def choose(candidates: Sequence[Candidate], step_seconds: StepPrices | None) -> Candidate:
    """The hybrid rule: the candidate with the most expected tokens per second (ties: the earlier one).

    With a cost table, a candidate's worth is its best E(k) / seconds(k) over k, where a look-up's step
    costs one verification of width k + 1 and the model's adds k draft passes. Without one, the
    look-up with the most expected accepted drafts wins. The choice looks at drafts and estimates,
    never at the target's draws, so the output stays the target's whichever candidate wins.

    Args:
        candidates: in order of preference; candidates with max_k 0 never win over others.
        step_seconds: the seconds of a step verifying k drafts, with the model or not (`StepPrices`);
            None when no cost table was measured.
    """
    assert candidates
    live = [c for c in candidates if c.max_k > 0] or list(candidates)
    if step_seconds is None:
        lookups = [c for c in live if c.drafter != MODEL]
        if lookups:
            return max(lookups, key=lambda c: c.curve[c.max_k] - 1.0)
        return live[0]

    def rate(candidate: Candidate) -> float:
        return step_seconds.best_rate(candidate.curve, candidate.max_k, candidate.drafter == MODEL)

    return max(live, key=rate) if live[0].max_k > 0 else live[0]


def draft_kind(ks: Sequence[int], uses_model: Sequence[bool]) -> str:
    """A drafting step's kind for the outcome check: WITH_MODEL where the draft model drafts for a row."""
    return WITH_MODEL if any(k and model for k, model in zip(ks, uses_model)) else LOOKUPS_ONLY


def planned_tokens(plans: Sequence[RowPlan]) -> float:
    """The expected tokens of these rows this step, from their curves at their planned k."""
    return sum(plan.curve[min(plan.k, len(plan.curve) - 1)] for plan in plans)
