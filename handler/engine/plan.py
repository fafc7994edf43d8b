"""The step plan: what each row drafts this step, priced for the whole batch.

`handler.engine.propose` says what each row *can* draft (`RowOptions`); the `Planner` picks,
with the cost table, how many drafts each row verifies and whether the draft model drafts them
(`handler.planning.planner.plan_batch`), and returns one `StepPlan` of `RowPlan`s. Proposing then fills
in the draft model's drafts, and verifying reads the plan.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from handler.drafters import HYBRID, MODEL, NO_DRAFTS, Proposal
from handler.engine.estimates import DraftConfidences, Estimates
from handler.engine.row import PROPOSER_GRAMMAR, Row
from handler.planning.cost_table import RunningCostTable
from handler.planning.estimators import GuessRate, OutcomeCheck, batch_bucket
from handler.planning.planner import BatchPlan, ConfidenceStop, Offer, plan_batch


@dataclasses.dataclass(frozen=True)
class RowOptions:
    """What one row can draft this step (`handler.engine.propose.Proposer.options`), before the plan picks."""

    lookup: Proposal  # its best look-up, best first (NO_DRAFTS: none)
    lookup_proposer: str | None  # who proposed it (None: no look-up drafts for this row)
    lookup_curve: list[float]  # E(0..n) over its first n drafts
    chain: Proposal | None  # a tree look-up's first-choice chain, and its E(0..n); None for a chain
    chain_curve: list[float] | None
    model_curve: list[float] | None  # E(0..cap) with the draft model; None: the model does not draft for it
    guesses: GuessRate | None  # its model drafts' guess rate (guessed drafting), else None

    def offer(self) -> Offer:
        return Offer(
            lookup=self.chain_curve if self.chain is not None else self.lookup_curve,
            tree=self.lookup_curve if self.chain is not None else None,
            model=self.model_curve or (1.0,),
            passes=None if self.guesses is None else self.guesses.passes,
        )

    def pick(self, uses_model: bool, trees: bool) -> tuple[str, Proposal, list[float]]:
        """The proposer, look-up (NO_DRAFTS for the model) and E(0..n) the plan chose."""
        if uses_model or self.lookup_proposer is None:
            return MODEL, NO_DRAFTS, self.model_curve or [1.0]
        if self.chain is not None and not trees:
            return self.lookup_proposer, self.chain, self.chain_curve
        return self.lookup_proposer, self.lookup, self.lookup_curve


@dataclasses.dataclass
class RowPlan:
    """One row's part of a step. Proposing may lower `k` (the draft model stopped early) or widen a
    greedy model chain into a tree of its runners-up (`proposal` and `k`), before the verify pass."""

    proposer: str  # who drafts: a drafter, or PROPOSER_GRAMMAR
    proposal: Proposal  # a look-up's or the grammar's drafts; the runners-up tree of a model chain
    k: int  # drafts verified (a tree's nodes); 0: plain decoding for this row
    uses_model: bool  # the draft model drafts them
    curve: list[float]  # E(0..n) as planned
    planned_tree: bool = False  # a look-up's tree the plan picked (its branches are calibrated)
    # The draft model's chain, token ids [n] and the distributions they were drawn from [n, vocab].
    sample: tuple[torch.Tensor, torch.Tensor] | None = None
    confidences: DraftConfidences | None = None  # the draft's confidence in its chain, where measured


@dataclasses.dataclass
class StepPlan:
    """Every row's plan, in batch order, and the draft model's stop rule (None: it drafts the ks)."""

    rows: list[RowPlan]
    keep_drafting: Callable[[int, dict], bool] | None = None
    expected_rate: float = 0.0  # the batch's tokens per second as priced (0: no cost table)

    @property
    def ks(self) -> list[int]:
        return [row.k for row in self.rows]

    @property
    def width(self) -> int:
        """The most drafts a row verifies: the verify pass is one column wider."""
        return max((row.k for row in self.rows), default=0)

    @classmethod
    def plain(cls, num_rows: int) -> StepPlan:
        """No row drafts."""
        return cls([RowPlan(MODEL, NO_DRAFTS, 0, False, [1.0]) for _ in range(num_rows)])


class Planner:
    """Prices steps with a cost table and picks each row's drafts (`plan`)."""

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

    def guesses_for(self, row: Row) -> GuessRate | None:
        """The row's guess rate where its model drafts are guessed (a hybrid row), else None."""
        return row.guess_rate if self.draft_guesses and row.drafter == HYBRID else None

    def pass_seconds(self, batch_size: int, width: int, num_draft_passes: float, trees: bool = False) -> float:
        """The cost table's seconds for a step: a target pass over `width` drafts and the pending
        token (a tree pass at its measured premium), after `num_draft_passes` draft-model passes.

        A draft pass runs over every row the draft model holds, and its first pass also feeds the
        tokens each row committed since it last drafted: after steps without model drafts that
        pass is wider, priced by the target's cost of that width (the draft has no table of its own).
        """
        table = self.cost_table
        seconds = table.target_seconds(batch_size, width + 1)
        if trees and isinstance(table, RunningCostTable):
            seconds *= table.tree_factor
        if num_draft_passes:
            draft_rows = max(1, self.model_drafter.num_rows)
            one_pass = table.draft_seconds(draft_rows)
            catch_up = self.model_drafter.max_pending
            first_pass = one_pass * table.target_seconds(draft_rows, catch_up) / table.target_seconds(draft_rows, 1)
            seconds += first_pass + max(0.0, num_draft_passes - 1) * one_pass
        return seconds

    def step_seconds(self, batch_size: int) -> Callable[[int, bool], float] | None:
        """(k, drafts with the model) -> the cost table's seconds for a step of the batch; None without a table."""
        if self.cost_table is None:
            return None
        return lambda k, model: self.pass_seconds(batch_size, k, k if model else 0)

    def _fill_share(self, row: Row, model_curve: list[float]) -> float:
        """The seconds per step of the draft model's prefill of a row it has not drafted for (`fill`):
        priced by the target's cost of that width (the draft has no table of its own), and spread
        over the steps the row has left at its cap's expected tokens, as the prefill serves them all."""
        num_tokens = self.model_drafter.unfilled_tokens(row.request_id)
        if not num_tokens:
            return 0.0
        table = self.cost_table
        seconds = table.draft_seconds(1) * table.target_seconds(1, num_tokens) / table.target_seconds(1, 1)
        steps_left = max(1.0, row.remaining / model_curve[-1])
        return seconds / steps_left

    def plan(self, rows: list[Row], options: list[RowOptions], num_steps: int) -> StepPlan:
        """Each row's drafts this step (a tree's: its first nodes, best first), priced for the whole batch."""
        batch = self._batch_plan(rows, options, num_steps)
        plans = []
        for option, k, uses_model in zip(options, batch.ks, batch.uses_model):
            proposer, proposal, curve = option.pick(uses_model, batch.trees)
            planned_tree = option.lookup.is_tree and not uses_model
            plans.append(RowPlan(proposer, proposal.prefix(k), k, uses_model, curve, planned_tree))
        expected_rate = batch.tokens / batch.seconds if batch.seconds > 0 else 0.0
        return StepPlan(plans, self._confidence_stop(rows, plans), expected_rate)

    def _batch_plan(self, rows: list[Row], options: list[RowOptions], num_steps: int) -> BatchPlan:
        """Without a cost table every row drafts its cap: with its look-up where it found one, else the
        model. With one, `plan_batch` prices each width and number of model drafts; where the
        draft's confidence stops it (`_confidence_stop`), model rows then draft up to their cap.
        """
        if self.cost_table is None:
            uses_model = [option.lookup_proposer is None and option.model_curve is not None for option in options]
            ks = [
                len(option.model_curve) - 1 if model else len(option.lookup.token_ids)
                for option, model in zip(options, uses_model)
            ]
            return BatchPlan(tuple(ks), tuple(uses_model), True, 0.0, 0.0, 0.0)
        offers = [option.offer() for option in options]
        # Until the pool has seen a few steps of a way to draft, nothing says whether it pays: draft.
        estimated = {MODEL for option in options if option.model_curve is not None}
        estimated |= {option.lookup_proposer for option in options if option.lookup_proposer is not None}
        explore = self.estimates.exploring(estimated)
        batch_size = len(rows)

        # A row the draft model has not drafted for yet must be prefilled first: priced as a whole, with
        # the plan where such rows do not draft with the model as the alternative.
        fill = [
            self._fill_share(row, option.model_curve) if option.model_curve is not None else 0.0
            for row, option in zip(rows, options)
        ]

        priced: dict[tuple[int, float, bool], float] = {}  # the plans below ask for the same shapes

        def pass_seconds(width: int, passes: float, trees: bool) -> float:
            seconds = priced.get((width, passes, trees))
            if seconds is None:
                seconds = priced[width, passes, trees] = self.pass_seconds(batch_size, width, passes, trees)
            return seconds

        def seconds_with(fill_seconds: float) -> Callable[[int, float, bool], float]:
            return lambda width, passes, trees: pass_seconds(width, passes, trees) + (fill_seconds if passes else 0.0)

        # The same offers where a row the draft has not prefilled cannot draft with the model.
        filled_only = (
            [dataclasses.replace(offer, model=(1.0,)) if share else offer for share, offer in zip(fill, offers)]
            if any(fill)
            else offers
        )
        plan = plan_batch(offers, seconds_with(sum(fill)), explore)
        # While the pool learns the acceptance, the plan drafts, a prefill included. Where no row the
        # draft holds could draft with it, the alternative's plans are all plans above, none dearer.
        filled_model_rows = any(not share and option.model_curve is not None for share, option in zip(fill, options))
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
            gain = 1.0
            if drafting is not None and drafting.width:
                gain = drafting.tokens / drafting.seconds * pass_seconds(0, 0.0, False) / batch_size
            drafts = self.outcome_check.arm(bucket, plan.width > 0, num_steps, gain=gain)
            if drafts and not plan.width:
                plan = drafting or plan_batch(filled_only, seconds_with(0.0), explore=True)
            elif plan.width and not drafts:
                # Speculation gives way; the tokens a grammar forces are certain, and stay.
                forced = [
                    offer if option.lookup_proposer == PROPOSER_GRAMMAR else Offer()
                    for option, offer in zip(options, offers)
                ]
                return plan_batch(forced, seconds_with(0.0))
        if plan.draft_passes and self.draft_confidence:
            # The plan says whether to draft; the draft's confidence says how far (`_confidence_stop`).
            ks = [
                len(option.model_curve) - 1 if model else k
                for option, model, k in zip(options, plan.uses_model, plan.ks)
            ]
            plan = dataclasses.replace(plan, ks=tuple(ks))
        return plan

    def _confidence_stop(self, rows: list[Row], plans: list[RowPlan]) -> Callable[[int, dict], bool] | None:
        """The draft model's stop rule this step (`ConfidenceStop`), or None: it drafts its rows' ks."""
        model_slots = [slot for slot, plan in enumerate(plans) if plan.uses_model and plan.k > 0]
        if not (self.draft_confidence and self.cost_table is not None and model_slots):
            return None
        batch_size = len(rows)
        others = [slot for slot in range(batch_size) if slot not in model_slots]
        other_width = max((plans[slot].k for slot in others), default=0)

        # The batch drafts until its slowest row has its drafts: the row whose drafts are guessed least.
        rates = [self.guesses_for(rows[slot]) or GuessRate() for slot in model_slots]
        slowest = min(rates, key=lambda rate: rate.rate)

        def step_seconds(num_drafts: int) -> float:
            return self.pass_seconds(batch_size, max(num_drafts, other_width), slowest.passes(num_drafts))

        calibrations = [self.estimates.calibrations[rows[slot].request.sampling.is_greedy] for slot in model_slots]
        stop = ConfidenceStop(
            calibrations,
            [calibration.mean_acceptance for calibration in calibrations],
            max(plans[slot].k for slot in model_slots),
            expected_tokens(plans, others),
            step_seconds,
        )
        ids = [rows[slot].request_id for slot in model_slots]
        return lambda num_drafted, confidences: stop(num_drafted, [confidences[i] for i in ids])


def expected_tokens(plans: list[RowPlan], slots: list[int]) -> float:
    """The expected tokens of these rows this step, from their curves."""
    return sum(plans[slot].curve[min(plans[slot].k, len(plans[slot].curve) - 1)] for slot in slots)
