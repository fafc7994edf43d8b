"""Pricing: what a step's drafts are worth in tokens per second, as pure functions of curves and costs.

With a per-token acceptance rate a, a step with k drafts emits on average
E(k) = (1 - a^(k+1)) / (1 - a) tokens (Leviathan et al. 2023, eq. 1) and costs
k draft passes plus one verification over k + 1 tokens. A request's tracker
refines E(k) with an acceptance per draft position (`AcceptanceTracker`).
`plan_batch` picks every row's k, and whether it drafts with the model or its
look-up, to maximise the whole batch's expected tokens per second, with costs
read from a measured `handler.planning.cost_table.CostTable`; k = 0 (plain decoding,
still exact) wins whenever drafting does not beat it. Adaptation never touches
the sampler, so output stays lossless.

The curves it prices come from `handler.planning.acceptance` (over the trackers of
`handler.planning.trackers`); `ConfidenceStop` and `choose_runners_up` price the draft model's
stop and its runners-up the same way. `handler.planning.planner` calls them.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Callable, Sequence

import numpy

from handler.planning.trackers import ConfidenceCalibration, confidence_bins


def geometric_tokens(acceptance: float, k: int) -> float:
    """E(k) at one acceptance rate for every draft (the geometric series): expected tokens emitted by
    a step with k drafts, bonus token included."""
    if acceptance >= 1.0:
        return float(k + 1)
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


@dataclasses.dataclass  # not frozen, as the planner's per-row records (`handler.planning.planner`)
class Offer:
    """What one row can verify this step, for `plan_batch`: expected tokens E(0..n) per way to draft.

    Attributes:
        lookup: E over the first n drafts of its look-up, a chain (free drafts: only the verify
            pass widens); (1.0,) when it has none.
        tree: E over the first n nodes of its look-up's tree, best first, when the look-up is a
            tree (a tree pass may cost more than a chain's); None otherwise.
        model: E over n draft-model drafts; (1.0,) when the draft model does not draft for it.
        passes: n -> the draft passes its first n model drafts take (fewer than n where its
            drafts are guessed); None: one pass per draft.
    """

    lookup: Sequence[float] = (1.0,)
    tree: Sequence[float] | None = None
    model: Sequence[float] = (1.0,)
    passes: Callable[[int], float] | None = None


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """`plan_batch`'s choice: each row's drafts and who drafts them, and what the step should give."""

    ks: tuple[int, ...]  # drafts (a tree's nodes) each row verifies
    uses_model: tuple[bool, ...]  # the row drafts with the draft model (else its look-up, if ks > 0)
    trees: bool  # look-up rows verify their trees (else their first-choice chains)
    draft_passes: float  # draft-model passes the step needs
    tokens: float  # expected tokens, bonus tokens included
    seconds: float  # the cost table's seconds for the step
    # The best plan that drafts, its priced tokens per second over plain decoding's: 0 where nothing can
    # draft, at most the bound's where `_plain_if_bound` decided (an upper bound then). How the plan was
    # decided, not what it is: plans compare without it.
    drafting_gain: float = dataclasses.field(default=math.inf, compare=False)

    @property
    def width(self) -> int:
        """The most drafts any row verifies: the verify pass covers them and the pending token."""
        return max(self.ks, default=0)

    @classmethod
    def plain(cls, num_rows: int, seconds: float, drafting_gain: float) -> BatchPlan:
        """Plain decoding for every row: one token each in a plain step's `seconds`."""
        return cls((0,) * num_rows, (False,) * num_rows, False, 0.0, float(num_rows), seconds, drafting_gain)


def plan_batch(
    offers: Sequence[Offer],
    step_seconds: Callable[[int, float, bool], float],
    explore: bool = False,
) -> BatchPlan:
    """Each row's drafts this step: the plan with the most expected tokens per second for the batch.

    A step costs one verify pass as wide as its widest row (every row pays that width: the runner
    pads to it) and, where any row drafts with the model, the draft passes of its most drafts (each
    pass runs over every row the draft model holds). So the plan is a width w and a number of model
    drafts d <= w: a row then verifies its look-up's first w drafts or d model drafts, whichever
    promises more, and the step costs step_seconds(widest row, draft passes, trees). Every (w, d) is
    priced, and k = 0 for every row (plain decoding) wins unless speculation is strictly faster:
    under load, where a batch already shares one read of the weights, the planner backs off.

    Args:
        offers: per row, what it can draft.
        step_seconds: (width, draft passes, trees) -> seconds of the step, from the cost table;
            trees: whether any row verifies a tree (a custom attention mask).
        explore: draft even where it does not pay (w >= 1), to learn the acceptance.
    """
    assert offers
    max_model = max(len(offer.model) - 1 for offer in offers)
    max_lookup = max(max(len(offer.lookup), len(offer.tree or ())) - 1 for offer in offers)
    with_trees = (False, True) if any(offer.tree is not None for offer in offers) else (False,)
    if not max(max_model, max_lookup):
        return BatchPlan.plain(len(offers), step_seconds(0, 0.0, False), 0.0)
    if not explore:
        plain = _plain_if_bound(offers, max_lookup, max_model, with_trees, step_seconds)
        if plain is not None:
            return plain
    # Every (drafts, width) plan is priced at once, over arrays [drafts, widths, rows] (`_Plans`).
    model = _ModelSide(offers, max_model)
    best: tuple[_Plans, int, int, float] | None = None
    explored: tuple[_Plans, int, int, float] | None = None
    best_rate = explored_rate = 0.0
    for trees in with_trees:
        plans = _Plans(offers, model, trees, max(max_model, max_lookup))
        for drafts in range(max_model + 1):
            for width in range(drafts, max(drafts, max_lookup) + 1):
                plan_width = plans.widths[drafts][width]
                if plan_width == 0 and (width or drafts):
                    continue  # nothing to draft: the same as plain decoding
                seconds = step_seconds(plan_width, plans.passes[drafts][width], plans.trees[drafts][width])
                rate = plans.tokens[drafts][width] / seconds
                # A relative margin, so that rounding never breaks a tie in favour of drafting.
                if best is None or rate > best_rate * (1.0 + 1e-9):
                    best, best_rate = (plans, drafts, width, seconds), rate
                if plan_width and (explored is None or rate > explored_rate * (1.0 + 1e-9)):
                    explored, explored_rate = (plans, drafts, width, seconds), rate
    assert best is not None
    best_plans, best_drafts, best_width, _ = best
    if explore and best_plans.widths[best_drafts][best_width] == 0 and explored is not None:
        best = explored
    plain_rate = len(offers) / step_seconds(0, 0.0, False)
    return best[0].plan(*best[1:], drafting_gain=explored_rate / plain_rate if explored is not None else 0.0)


class _ModelSide:
    """The draft model's side of every plan, per number of model drafts d and row: the drafts a row
    takes (min(d, its cap)), their expected tokens and the draft passes they need; [drafts, rows] each."""

    def __init__(self, offers: Sequence[Offer], max_model: int) -> None:
        self.num, self.tokens = _padded([offer.model for offer in offers], max_model)
        needed = [
            [offer.passes(n) for n in column] if offer.passes is not None else column
            for offer, column in zip(offers, self.num.T.tolist())
        ]
        self.passes = numpy.array(needed, dtype=numpy.float64).T  # [drafts, rows]


class _Plans:
    """Every plan of `plan_batch` for one choice of trees, priced at once over arrays [drafts, widths, rows].

    In the plan of d model drafts and width w, a row verifies min(d, its cap) model drafts where
    it has some and they promise more than its look-up's first min(w, its most) drafts, else
    those look-up drafts. Each plan's tokens are summed over the rows in order (a cumulative
    sum, as a loop over the rows adds them), so the rates, and the plan chosen, are the same to
    the bit as a plan priced row by row. The per-plan figures are lists: the caller reads them one
    by one, and a list is read faster than an array.
    """

    def __init__(self, offers: Sequence[Offer], model: _ModelSide, trees: bool, max_width: int) -> None:
        lookups = [offer.tree if trees and offer.tree is not None else offer.lookup for offer in offers]
        is_tree = numpy.array([trees and offer.tree is not None for offer in offers])  # [rows]
        num_lookup, lookup_tokens = _padded(lookups, max_width)  # [widths, rows] each
        self.uses_model = (model.num[:, None] > 0) & (model.tokens[:, None] > lookup_tokens[None])  # [d, w, rows]
        self.ks = numpy.where(self.uses_model, model.num[:, None], num_lookup[None])  # [drafts, widths, rows]
        tokens = numpy.where(self.uses_model, model.tokens[:, None], lookup_tokens[None])  # [drafts, widths, rows]
        passes = numpy.where(self.uses_model, model.passes[:, None], 0.0)  # [drafts, widths, rows]
        any_tree = ~self.uses_model & is_tree & (num_lookup[None] > 0)  # [drafts, widths, rows]
        self.widths = self.ks.max(axis=-1).tolist()  # [drafts][widths]
        self.tokens = tokens.cumsum(axis=-1)[..., -1].tolist()
        self.passes = passes.max(axis=-1).tolist()
        self.trees = any_tree.any(axis=-1).tolist()

    def plan(self, drafts: int, width: int, seconds: float, drafting_gain: float = math.inf) -> BatchPlan:
        return BatchPlan(
            ks=tuple(self.ks[drafts, width].tolist()),
            uses_model=tuple(self.uses_model[drafts, width].tolist()),
            trees=self.trees[drafts][width],
            draft_passes=self.passes[drafts][width],
            tokens=self.tokens[drafts][width],
            seconds=seconds,
            drafting_gain=drafting_gain,
        )


def _padded(curves: Sequence[Sequence[float]], max_n: int) -> tuple[numpy.ndarray, numpy.ndarray]:
    """Per n in 0..max_n and row: the drafts the row verifies out of n (min(n, its curve's most)), and
    their expected tokens (its curve there); [max_n + 1, rows] each."""
    num = numpy.minimum(numpy.arange(max_n + 1)[:, None], numpy.array([len(curve) - 1 for curve in curves]))
    tokens = [[curve[n] for n in column] for curve, column in zip(curves, num.T.tolist())]
    return num, numpy.array(tokens, dtype=numpy.float64).T


def _plain_if_bound(
    offers: Sequence[Offer],
    max_lookup: int,
    max_model: int,
    with_trees: tuple[bool, ...],
    step_seconds: Callable[[int, float, bool], float],
) -> BatchPlan | None:
    """Plain decoding where no plan can beat it, checked from bounds, else None.

    A plan that drafts gives at most each row's best expected tokens (its look-up's alone where no
    row drafts with the model), and costs at least the cheapest verify pass of a width it can have,
    with one draft pass where a row drafts with the model (`step_seconds` never takes seconds off
    for more passes, and a model draft takes at least one). Where both bounds are no faster than
    plain decoding, neither is any plan: a batch that has stopped drafting under load plans in
    O(rows + widths) rather than O(rows x plans), and a step's own time matters most where the
    passes are fast, on a GPU.
    """
    num_rows = len(offers)
    plain_seconds = step_seconds(0, 0.0, False)
    plain_rate = num_rows / plain_seconds * (1.0 + 1e-9)
    best_rate = 0.0  # the bounds' best rate of a plan that drafts
    if max_lookup:
        most_tokens = sum(max(offer.lookup[-1], offer.tree[-1] if offer.tree else 1.0) for offer in offers)
        least_seconds = min(step_seconds(w, 0.0, trees) for trees in with_trees for w in range(1, max_lookup + 1))
        best_rate = most_tokens / least_seconds
        if best_rate > plain_rate:
            return None
    if max_model:
        most_tokens = sum(
            max(offer.lookup[-1], offer.model[-1], offer.tree[-1] if offer.tree else 1.0) for offer in offers
        )
        widths = range(1, max(max_lookup, max_model) + 1)
        least_seconds = min(step_seconds(w, 1.0, trees) for trees in with_trees for w in widths)
        best_rate = max(best_rate, most_tokens / least_seconds)
        if best_rate > plain_rate:
            return None
    return BatchPlan.plain(num_rows, plain_seconds, best_rate * plain_seconds / num_rows)


class ConfidenceStop:
    """Decides, draft by draft, whether the draft model drafts one more token for the batch.

    After each draft pass, each drafting row's survival (the chance that all its drafts
    so far are accepted) is multiplied by its calibrated acceptance of the token just
    drafted, and the expected tokens of the step grow by that survival. One more draft
    pays when it raises the step's expected tokens per second:

        gain / extra_seconds > tokens / seconds,

    where gain is the sum over rows of survival x the row's acceptance of a draft not yet
    seen, and extra_seconds is one more draft pass and one more verified column. The
    decision looks at the drafts only, never at the target, so the output stays the
    target's whatever it decides.
    """

    def __init__(
        self,
        calibrations: Sequence[ConfidenceCalibration],
        next_acceptances: Sequence[float],
        max_drafts: int,
        other_tokens: float,
        step_seconds: Callable[[int], float],
    ) -> None:
        """
        Args:
            calibrations: per drafting row, the calibration of its kind of request.
            next_acceptances: per drafting row, its acceptance of a draft whose confidence is unknown.
            max_drafts: the most drafts any row may take this step.
            other_tokens: the expected tokens of the step's other rows (look-ups, plain decoding).
            step_seconds: n -> seconds of the step when the draft model drafts n tokens.
        """
        assert len(calibrations) == len(next_acceptances) and max_drafts >= 1
        self.calibrations = calibrations
        self.next_acceptances = next_acceptances
        self.max_drafts = max_drafts
        self.step_seconds = step_seconds
        self.survival = [1.0] * len(calibrations)
        # Each drafting row emits at least one token (the recovered or bonus one).
        self.tokens = other_tokens + len(calibrations)

    def __call__(self, num_drafted: int, confidences: Sequence[float]) -> bool:
        """Takes the confidences of the rows' latest drafts; True: draft one more token."""
        assert len(confidences) == len(self.survival), (len(confidences), len(self.survival))
        bins = confidence_bins(confidences)
        for row, (calibration, index) in enumerate(zip(self.calibrations, bins)):
            self.survival[row] *= calibration.table[index]
            self.tokens += self.survival[row]
        if num_drafted >= self.max_drafts:
            return False
        gain = sum(map(operator.mul, self.survival, self.next_acceptances))
        seconds = self.step_seconds(num_drafted)
        extra = self.step_seconds(num_drafted + 1) - seconds
        return gain * seconds > self.tokens * extra


def chain_expected_tokens(acceptances: Sequence[float]) -> float:
    """A chain's expected tokens from each draft's acceptance: 1 + the chance of reaching past each draft."""
    tokens, survival = 1.0, 1.0
    for acceptance in acceptances:
        survival *= acceptance
        tokens += survival
    return tokens


def choose_runners_up(
    acceptances: Sequence[Sequence[float]],
    runner_up_acceptances: Sequence[Sequence[float]],
    max_nodes: Sequence[int],
    width: int,
    tokens: float,
    step_seconds: Callable[[int], float],
) -> list[list[int]]:
    """Where the draft model's runner-up joins its chain as a sibling leaf (`handler.tree`).

    A runner-up at chain position j is reached when drafts 0..j-1 are accepted and draft j
    is not; the target then takes it with its own chance, and the step emits one more
    token (the runner-up, then the target's token after it). Runners-up are added best
    first while each raises the step's expected tokens per second: gain / extra_seconds >
    tokens / seconds, where only a wider pass costs more.

    Args:
        acceptances: per row, the estimated acceptance of each chain draft.
        runner_up_acceptances: per row and position, the chance that the target takes the
            runner-up there once it has refused the draft.
        max_nodes: per row, the most nodes its tree may hold (chain included).
        width: the step's widest row in drafts, before any runner-up.
        tokens: the step's expected tokens without runners-up.
        step_seconds: width in drafts -> seconds of the step.

    Returns:
        per row, the chain positions that take their runner-up, in increasing order.
    """
    gains = []
    for row, (chain, runners_up) in enumerate(zip(acceptances, runner_up_acceptances)):
        reach = 1.0
        for position, (acceptance, runner_up) in enumerate(zip(chain, runners_up)):
            gains.append((reach * (1.0 - acceptance) * runner_up, row, position))
            reach *= acceptance
    nodes = [len(chain) for chain in acceptances]
    chosen: list[list[int]] = [[] for _ in acceptances]
    for gain, row, position in sorted(gains, reverse=True):
        if gain <= 0.0 or nodes[row] >= max_nodes[row]:
            continue
        new_width = max(width, nodes[row] + 1)
        seconds = step_seconds(width)
        if gain * seconds <= tokens * (step_seconds(new_width) - seconds):
            continue
        chosen[row].append(position)
        nodes[row] += 1
        tokens += gain
        width = new_width
    return [sorted(positions) for positions in chosen]
