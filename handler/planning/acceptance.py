"""What the engine expects of each proposal, and what it learns from each verified one.

A row's expected tokens for its first n drafts, E(0..n), come from acceptance trackers (its
own, or the pool's of every request), a suffix look-up's own tree probabilities, and the draft
model's calibrated confidences (`handler.planning.pricing`). After each step `Estimates.learn` teaches
them what the target did with a row's `handler.planning.planner.Drafts`.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from handler.drafters import NGRAM, PROPOSERS, SUFFIX, Proposal
from handler.planning.trackers import (
    MIN_STEPS_BEFORE_FALLBACK,
    POOL_DECAY,
    PROBE_INTERVAL,
    AcceptanceTracker,
    BranchCalibration,
    ConfidenceCalibration,
    PlannedRow,
)
from handler.tree import depths, first_choice_path, off_first_choice, order_best_first

# How the planner estimates a suffix look-up's acceptance per position: from the tree's
# probabilities, or from the row's running acceptance tracker like the other drafters.
SUFFIX_ESTIMATES = ("tree", "tracker")


@dataclasses.dataclass  # not frozen, as the planner's per-row records (`handler.planning.planner`)
class DraftConfidences:
    """What the draft model drafted for one row this step, for the calibrations."""

    confidences: list[float]  # the draft's confidence in each draft of its chain
    # Chain position -> the runner-up's share of what the draft left to other tokens there, for the
    # positions whose runner-up joined the tree as a sibling.
    runner_up_shares: dict[int, float] = dataclasses.field(default_factory=dict)


class Estimates:
    """The acceptance estimates that plan each step, and their calibrations."""

    def __init__(self, suffix_estimate: str = "tree") -> None:
        assert suffix_estimate in SUFFIX_ESTIMATES, suffix_estimate
        self.suffix_estimate = suffix_estimate
        # Every request's acceptance per proposer together: the estimate of a row too new to have
        # its own, or one that has not drafted for a while (`handler.planning.pricing`, PROBE_INTERVAL).
        self.pool_trackers = {name: AcceptanceTracker(POOL_DECAY) for name in PROPOSERS}
        # The draft's confidence -> the target's acceptance, for greedy (True) and sampled rows; and for
        # greedy rows, the runner-up's share of the rest -> the chance the target takes it (`handler.tree`).
        self.calibrations = {True: ConfidenceCalibration(), False: ConfidenceCalibration()}
        self.runner_up_calibration = ConfidenceCalibration()
        # How far each look-up's branch estimates hold (`estimate`), learnt from the trees verified.
        self.branch_calibrations = {NGRAM: BranchCalibration(), SUFFIX: BranchCalibration()}
        # How far a suffix look-up's own probabilities hold along its chain: its counts say how often
        # a continuation followed, not how often the target takes it (`_calibrate_suffix`).
        self.suffix_calibration = BranchCalibration()

    def exploring(self, proposers: set[str]) -> bool:
        """Whether the pool has seen too few steps of one of these ways to draft to say if it pays."""
        if self.suffix_estimate == "tree":
            proposers = proposers - {SUFFIX}  # a suffix look-up comes with its own probabilities
        return any(self.pool_trackers[name].num_steps < MIN_STEPS_BEFORE_FALLBACK for name in proposers)

    def tracker(self, row: PlannedRow, proposer: str) -> AcceptanceTracker:
        """The acceptance estimate that plans a row: its own, or the pool's while it has drafted too
        little to have one, and again after PROBE_INTERVAL steps without drafts (a probe)."""
        own = row.trackers[proposer]
        if own.num_steps < MIN_STEPS_BEFORE_FALLBACK or row.steps_without_drafts >= PROBE_INTERVAL:
            return self.pool_trackers[proposer]
        return own

    def estimate(self, row: PlannedRow, proposer: str, lookup: Proposal) -> tuple[Proposal, list[float]]:
        """A look-up's proposal, best draft first, and E(0..n) for its first n drafts.

        Each draft's estimate is the probability that it and its ancestors are accepted:
        a suffix look-up's tree probabilities, or the row's tracker at the draft's depth
        times the draft's share of the matched occurrences (1 along a chain). A tree's
        branches, off its first-choice path, are scaled by what the engine has seen of
        this look-up's branches (`BranchCalibration`, learnt in `_calibrate_branches`).
        """
        num = len(lookup.token_ids)
        if proposer == SUFFIX and self.suffix_estimate == "tree" and lookup.probs is not None:
            factor = self.suffix_calibration.factor
            scores = [prob * factor for prob in lookup.probs]  # a tree's come best first already
        else:
            node_depths = depths(lookup.parents) if lookup.parents is not None else list(range(1, num + 1))
            tracker_curve = self.tracker(row, proposer).expected_curve(max(node_depths, default=0))
            shares = lookup.shares or _relative_probs(lookup, node_depths) or [1.0] * num
            scores = [share * (tracker_curve[d] - tracker_curve[d - 1]) for share, d in zip(shares, node_depths)]
        if lookup.is_tree:
            factor = self.branch_calibrations[proposer].factor
            off = off_first_choice(lookup.parents, scores)
            scores = [score * factor if is_off else score for score, is_off in zip(scores, off)]
            token_ids, parents, scores = order_best_first(lookup.token_ids, lookup.parents, scores)
            lookup = Proposal(token_ids, scores, parents)
        return lookup, _curve(scores)

    def learn(self, row: PlannedRow, plan, drafts, num_accepted: int, path: list[int]) -> None:
        """Teaches the trackers and calibrations what the target did with a row's drafts this step.

        `plan`: the row's `handler.planning.planner.RowPlan`; `drafts`: its `Drafts`, what it verified;
        `path`: the chunk columns of its pending token and accepted drafts.
        """
        proposer, proposal, k = plan.drafter, drafts.proposal, drafts.k
        if not k and not plan.planned_tree:
            return  # nothing verified (a plain step's row): nothing to learn, no planned tree to relax
        # Drafts reached: the accepted ones, and one more where the walk stopped at a node with children.
        reached = k
        if proposal.is_tree:
            reached = num_accepted + int(path[-1] - 1 in proposal.parents)
            first_choice = path == first_choice_path(proposal.parents, num_accepted)
            row.stats.record_tree(k, num_accepted, first_choice)
        row.trackers[proposer].update(num_accepted, reached)
        self.pool_trackers[proposer].update(num_accepted, reached)
        if proposer == SUFFIX and not proposal.is_tree and k and self.suffix_estimate == "tree":
            self._calibrate_suffix(plan.curve, k, num_accepted)
        if plan.planned_tree and proposer in self.branch_calibrations:
            self._calibrate_branches(proposer, proposal, path)
        if drafts.confidences is not None:
            self._calibrate(row, drafts.confidences, path)

    def _calibrate(self, row: PlannedRow, drafts: DraftConfidences, path: list[int]) -> None:
        """Teaches the calibrations what the target did with a row's model drafts (`path`: its walk)."""
        num_chain = len(drafts.confidences)
        # Chain draft j sits at chunk column j + 1; the runners-up come after the chain.
        on_runner_up = path[-1] > num_chain
        chain_accepted = len(path) - 1 - int(on_runner_up)
        self.calibrations[row.request.sampling.is_greedy].update(drafts.confidences, chain_accepted)
        share = drafts.runner_up_shares.get(chain_accepted)
        if share is not None:
            self.runner_up_calibration.update([share], int(on_runner_up))

    def _calibrate_suffix(self, curve: list[float], num_drafts: int, num_accepted: int) -> None:
        """Teaches the suffix calibration a verified chain: `curve`, its E(0..n) as planned (scaled by
        the factor, unchanged since `estimate`), `num_drafts` verified, `num_accepted` taken."""
        expected = (curve[num_drafts] - 1.0) / self.suffix_calibration.factor
        self.suffix_calibration.update(expected, num_accepted)

    def _calibrate_branches(self, proposer: str, lookup: Proposal, path: list[int]) -> None:
        """Teaches a look-up's branch calibration what the walk did with a tree's branches (`path`:
        its chunk columns); a tree cut to its first-choice chain by the plan only relaxes it."""
        calibration = self.branch_calibrations[proposer]
        if not lookup.is_tree:
            calibration.relax()
            return
        off = off_first_choice(lookup.parents, lookup.probs)
        # The scores were scaled by the factor (unchanged since `estimate`): the guesses are undone.
        expected = sum(score for score, is_off in zip(lookup.probs, off) if is_off) / calibration.factor
        calibration.update(expected, sum(off[column - 1] for column in path[1:]))


def first_choice_chain(lookup: Proposal, curve: Sequence[float]) -> tuple[Proposal, list[float]]:
    """A tree look-up's first-choice chain (the best child of each node down from the root) and its
    E(0..n), from the tree's scores (each node's chance that it and its ancestors are accepted)."""
    off = off_first_choice(lookup.parents, lookup.probs)
    nodes = [index for index, is_off in enumerate(off) if not is_off]
    scores = [curve[index + 1] - curve[index] for index in nodes]
    return Proposal([lookup.token_ids[index] for index in nodes], scores), _curve(scores)


def _curve(scores: Sequence[float]) -> list[float]:
    """E(0..n) from each draft's chance that it and its ancestors are accepted."""
    curve = [1.0]
    for score in scores:
        curve.append(curve[-1] + score)
    return curve


def _relative_probs(lookup: Proposal, node_depths: list[int]) -> list[float] | None:
    """A suffix tree's probabilities relative to the likeliest draft at each depth (its branches' shares)."""
    if lookup.probs is None or not lookup.is_tree:
        return None
    best: dict[int, float] = {}
    for prob, depth in zip(lookup.probs, node_depths):
        best[depth] = max(best.get(depth, 0.0), prob)
    return [prob / best[depth] if best[depth] > 0 else 0.0 for prob, depth in zip(lookup.probs, node_depths)]
