"""Adaptive k: each step's number of drafts, from the rows' running acceptance and a cost table.

With a per-token acceptance rate a, a step with k drafts emits on average
E(k) = (1 - a^(k+1)) / (1 - a) tokens (Leviathan et al. 2023, eq. 1) and costs
k draft passes plus one verification over k + 1 tokens. A request's tracker
refines E(k) with an acceptance per draft position (`AcceptanceTracker`).
`plan_batch` picks every row's k, and whether it drafts with the model or its
look-up, to maximise the whole batch's expected tokens per second, with costs
read from a measured `handler.cost_table.CostTable`; k = 0 (plain decoding,
still exact) wins whenever drafting does not beat it. Adaptation never touches
the sampler, so output stays lossless.

`CostModel` is a linear cost table (a fixed cost per pass plus one per extra
verified token), for tests and back-of-the-envelope estimates; a served model
plans with the table measured at start-up.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Callable, Sequence

# Weight of past steps in the acceptance estimate (about the last 10 steps count).
DECAY = 0.9
# Steps a request drafts before its own acceptance estimate plans it; until then, and again
# after PROBE_INTERVAL steps without drafts, it is planned with the pool's: every request's
# steps together (`POOL_DECAY`). A row whose own estimate keeps it at k = 0 then drafts once more
# where a typical row would, so that its estimate can recover, and a new row under load is not
# made to draft before the batch would gain from it.
MIN_STEPS_BEFORE_FALLBACK = 4
PROBE_INTERVAL = 32
# The pool's weight of past steps: about the last 100 row-steps of every request count.
POOL_DECAY = 0.99
# Draft positions with their own acceptance estimate (max_num_speculative_tokens is at most 32).
MAX_POSITIONS = 32
# Weight, in steps, of the overall rate in each position's estimate.
POSITION_PRIOR = 2.0


@dataclasses.dataclass(frozen=True)
class CostModel:
    """A linear cost table: the draft on one token, the target on 1 + k tokens, any batch size."""

    draft_step: float
    target_step: float
    target_per_extra_token: float

    def target_seconds(self, batch_size: int, width: int) -> float:
        """The cost-table view of this linear model (it ignores the batch size)."""
        return self.target_step + (width - 1) * self.target_per_extra_token

    def draft_seconds(self, batch_size: int) -> float:
        return self.draft_step


def expected_tokens(acceptance: float, k: int) -> float:
    """E(k): expected tokens emitted by a step with k drafts, bonus token included."""
    if acceptance >= 1.0:
        return float(k + 1)
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


@dataclasses.dataclass(frozen=True)
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

    @property
    def width(self) -> int:
        """The most drafts any row verifies: the verify pass covers them and the pending token."""
        return max(self.ks, default=0)


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
    if not explore and max(max_model, max_lookup):
        plain = _plain_if_bound(offers, max_lookup, max_model, with_trees, step_seconds)
        if plain is not None:
            return plain
    best: BatchPlan | None = None
    explored: BatchPlan | None = None
    for trees in with_trees:
        # Per row: the look-up this pass verifies (its tree, where trees are verified) and its model
        # curve, taken out of the offers once: the loops below run every step, for every row.
        rows = [
            (offer.tree, offer.model, offer.passes, True)
            if trees and offer.tree is not None
            else (offer.lookup, offer.model, offer.passes, False)
            for offer in offers
        ]
        for drafts in range(max_model + 1):
            for width in range(drafts, max(drafts, max_lookup) + 1):
                plan = _priced(rows, width, drafts, step_seconds)
                if plan.width == 0 and (width or drafts):
                    continue  # nothing to draft: the same as plain decoding
                rate = plan.tokens / plan.seconds
                # A relative margin, so that rounding never breaks a tie in favour of drafting.
                if best is None or rate > best.tokens / best.seconds * (1.0 + 1e-9):
                    best = plan
                if plan.width and (explored is None or rate > explored.tokens / explored.seconds * (1.0 + 1e-9)):
                    explored = plan
    assert best is not None
    return explored if explore and best.width == 0 and explored is not None else best


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
    if max_lookup:
        most_tokens = sum(max(offer.lookup[-1], offer.tree[-1] if offer.tree else 1.0) for offer in offers)
        least_seconds = min(step_seconds(w, 0.0, trees) for trees in with_trees for w in range(1, max_lookup + 1))
        if most_tokens / least_seconds > plain_rate:
            return None
    if max_model:
        most_tokens = sum(
            max(offer.lookup[-1], offer.model[-1], offer.tree[-1] if offer.tree else 1.0) for offer in offers
        )
        widths = range(1, max(max_lookup, max_model) + 1)
        least_seconds = min(step_seconds(w, 1.0, trees) for trees in with_trees for w in widths)
        if most_tokens / least_seconds > plain_rate:
            return None
    return BatchPlan((0,) * num_rows, (False,) * num_rows, False, 0.0, float(num_rows), plain_seconds)


# Per row, for `_priced`: the look-up's curve it verifies, its model curve, its passes, whether the look-up is a tree.
_Row = tuple[Sequence[float], Sequence[float], Callable[[int], float] | None, bool]


def _priced(rows: list[_Row], width: int, drafts: int, step_seconds: Callable[[int, float, bool], float]) -> BatchPlan:
    """The plan of width `width` and `drafts` model drafts: each row's better way, and the step's cost."""
    ks, uses_model, tokens, passes, any_tree = [], [], 0.0, 0.0, False
    for lookup, model, row_passes, is_tree in rows:
        num_lookup = min(width, len(lookup) - 1)
        num_model = min(drafts, len(model) - 1)
        if num_model and model[num_model] > lookup[num_lookup]:
            ks.append(num_model)
            uses_model.append(True)
            tokens += model[num_model]
            needed = row_passes(num_model) if row_passes else float(num_model)
            if needed > passes:
                passes = needed
        else:
            ks.append(num_lookup)
            uses_model.append(False)
            tokens += lookup[num_lookup]
            any_tree = any_tree or (is_tree and num_lookup > 0)
    seconds = step_seconds(max(ks), passes, any_tree)
    return BatchPlan(tuple(ks), tuple(uses_model), any_tree, passes, tokens, seconds)


# The realized check of drafting against plain decoding (`OutcomeCheck`): step rates per arm and
# batch size in its window, the steps each arm needs before a verdict, how often the arm the
# verdict leaves out still runs (one step in EXPLORE_CLOSE while the two arms are within
# CLOSE_MARGIN of each other, else one in EXPLORE_FAR), and how often an arm with too few steps runs.
OUTCOME_WINDOW = 32
OUTCOME_MIN_STEPS = 8
EXPLORE_CLOSE = 16
EXPLORE_FAR = 64
CLOSE_MARGIN = 0.25
EXPLORE_UNSEEN = 4
# The other arm runs in bursts of this many steps: the first drafting step after plain ones feeds
# the draft every token it missed (a wide catch-up pass) and is not a fair sample; the engine
# samples a drafting step only after one that drafted.
EXPLORE_BURST = 4


def batch_bucket(batch_size: int) -> int:
    """The power of two nearest to `batch_size` by ratio: the batch sizes `OutcomeCheck` pools."""
    return 2 ** round(math.log2(batch_size))


class OutcomeCheck:
    """Whether the steps that drafted gave more tokens per second than the plain steps, as they ran.

    The plan prices steps with a cost table, and on a busy machine the table can be off by the
    10 to 20 % that separate drafting from plain decoding under load; there the plan would draft
    at a loss it cannot see. So the engine times every step, per batch size (its nearest grid
    point) and per arm (a step that drafted, a step that did not), as tokens per second per row,
    and the medians over a window give a verdict: the plan runs where its arm is the faster, and
    the other arm runs one step in a few, enough to notice when the verdict changes. Drafting or
    not never changes the output, so neither does the check.
    """

    def __init__(self) -> None:
        self.rates: dict[tuple[int, bool], list[float]] = {}

    def observe(self, bucket: int, drafted: bool, rate: float) -> None:
        """A step of this batch-size bucket, that drafted or not, gave `rate` tokens per second per row."""
        window = self.rates.setdefault((bucket, drafted), [])
        window.append(rate)
        del window[:-OUTCOME_WINDOW]

    def ratio(self, bucket: int) -> float | None:
        """Drafting's median rate over plain decoding's at this bucket; None while either has too few steps."""
        drafted, plain = self.rates.get((bucket, True), []), self.rates.get((bucket, False), [])
        if len(drafted) < OUTCOME_MIN_STEPS or len(plain) < OUTCOME_MIN_STEPS:
            return None
        return statistics.median(drafted) / statistics.median(plain)

    def arm(self, bucket: int, planned: bool, step: int) -> bool:
        """Whether step number `step` at this bucket drafts, given whether the plan drafts."""
        ratio = self.ratio(bucket)
        if ratio is None:
            # The arm with fewer steps takes a burst in every EXPLORE_UNSEEN, the plan the others.
            unseen = len(self.rates.get((bucket, True), [])) <= len(self.rates.get((bucket, False), []))
            return unseen if _burst(step, EXPLORE_UNSEEN) else planned
        faster = ratio > 1.0  # the plan's choice gives way where it lost as it ran
        every = EXPLORE_CLOSE if abs(math.log(ratio)) < math.log(1.0 + CLOSE_MARGIN) else EXPLORE_FAR
        return (not faster) if _burst(step, every) else faster


def _burst(step: int, every: int) -> bool:
    """Whether step number `step` falls in the burst of EXPLORE_BURST steps that opens every
    `every` bursts' worth of steps: one step in `every` on average, in runs."""
    return step % (every * EXPLORE_BURST) < EXPLORE_BURST


class AcceptanceTracker:
    """A decayed estimate of one request's acceptance, overall and per draft position.

    Overall: a step that accepts n of k drafts is n successes and, when n < k,
    one failure: the maximum-likelihood view of a geometric run. A uniform
    prior (one success, one failure) keeps the first steps from swinging to 0
    or 1.

    Per position: the chance that draft j is accepted once drafts 1..j-1 were.
    Acceptance is not independent per token. A look-up is often wrong at its
    first token but, once right, right for a long copied run, and one rate for
    every position misjudges what a longer look-up adds. Each position's
    estimate starts at the overall rate with weight `POSITION_PRIOR` steps, so
    positions rarely reached fall back to the geometric model.
    """

    def __init__(self, decay: float = DECAY) -> None:
        """`decay`: the weight of past steps (a pool of every request's steps forgets slower)."""
        self.decay = decay
        self.successes = 0.0
        self.failures = 0.0
        self.num_steps = 0
        self.reached = [0.0] * MAX_POSITIONS  # decayed steps that verified draft j (j - 1 accepted)
        self.passed = [0.0] * MAX_POSITIONS  # ... and accepted it

    def update(self, num_accepted: int, k: int) -> None:
        if k == 0:
            return
        decay = self.decay
        self.successes = decay * self.successes + num_accepted
        self.failures = decay * self.failures + (1.0 if num_accepted < k else 0.0)
        self.num_steps += 1
        for j in range(MAX_POSITIONS):
            self.reached[j] = decay * self.reached[j] + (1.0 if j <= num_accepted and j < k else 0.0)
            self.passed[j] = decay * self.passed[j] + (1.0 if j < num_accepted else 0.0)

    @property
    def acceptance(self) -> float:
        return (self.successes + 1.0) / (self.successes + self.failures + 2.0)

    def expected_curve(self, max_k: int) -> list[float]:
        """E(0..max_k): expected tokens from a step with k drafts, bonus token included."""
        overall = self.acceptance
        curve, survive = [1.0], 1.0
        for j in range(max_k):
            if j < MAX_POSITIONS:
                survive *= (self.passed[j] + POSITION_PRIOR * overall) / (self.reached[j] + POSITION_PRIOR)
            else:
                survive *= overall
            curve.append(curve[-1] + survive)
        return curve


# Draft confidence: the draft model's own probability of each token it drafts (softmax of its
# logits, before any warping). Hugging Face's assisted generation stops drafting below a fixed
# cut-off; here a calibration maps confidence to the chance that the target accepts the draft,
# and the cost table decides whether one more draft pays (`ConfidenceStop`).
CONFIDENCE_BINS = 10
# Per draft observed in a bin: about the last 200 drafts of each bin count.
CONFIDENCE_DECAY = 0.995
# Weight, in drafts, of each bin's prior: acceptance equal to the bin's mean confidence.
CONFIDENCE_PRIOR = 4.0


class ConfidenceCalibration:
    """How often the target accepts a draft of a given confidence, from the drafts verified so far.

    Confidence is cut into `CONFIDENCE_BINS` equal bins; each keeps decayed counts of
    the drafts verified in it and of those accepted. A bin starts at its own mean
    confidence (a calibrated draft whose argmax is the target's), with the weight of
    `CONFIDENCE_PRIOR` drafts, so that empty bins stay sensible.
    """

    def __init__(self) -> None:
        self.verified = [0.0] * CONFIDENCE_BINS
        self.accepted = [0.0] * CONFIDENCE_BINS

    @staticmethod
    def _bin(confidence: float) -> int:
        return min(max(int(confidence * CONFIDENCE_BINS), 0), CONFIDENCE_BINS - 1)

    def acceptance(self, confidence: float) -> float:
        """The estimated chance that the target accepts a draft of this confidence."""
        index = self._bin(confidence)
        prior = (index + 0.5) / CONFIDENCE_BINS
        return (self.accepted[index] + CONFIDENCE_PRIOR * prior) / (self.verified[index] + CONFIDENCE_PRIOR)

    @property
    def mean_acceptance(self) -> float:
        """The chance that the target accepts a draft whose confidence is not known yet: over every
        draft judged so far, with the weight of `CONFIDENCE_PRIOR` drafts at one half."""
        return (sum(self.accepted) + CONFIDENCE_PRIOR * 0.5) / (sum(self.verified) + CONFIDENCE_PRIOR)

    def update(self, confidences: Sequence[float], num_accepted: int) -> None:
        """Takes one verified chain: drafts 0..num_accepted-1 accepted, the next one (if any) rejected.

        Drafts after the first rejection were never judged and are left out.
        """
        assert 0 <= num_accepted <= len(confidences), (num_accepted, len(confidences))
        for position, confidence in enumerate(confidences[: num_accepted + 1]):
            index = self._bin(confidence)
            self.verified[index] = CONFIDENCE_DECAY * self.verified[index] + 1.0
            self.accepted[index] = CONFIDENCE_DECAY * self.accepted[index] + float(position < num_accepted)


class GuessRate:
    """The share of a row's model drafts that came free, for guessed drafting (`handler.drafters`).

    A step's first draft always takes a draft pass; each later one is free when the look-up
    guessed the drafts before it, so that an earlier pass of the step already gave its logits.
    Decayed counts, as `AcceptanceTracker`'s; the prior (one draft that was not free) keeps a
    row that has not drafted with guesses yet at one pass per draft.
    """

    def __init__(self) -> None:
        self.free = 0.0
        self.chances = 1.0

    @property
    def rate(self) -> float:
        return self.free / self.chances

    def update(self, num_drafts: int, num_passes: int) -> None:
        """Takes one step's drafts and the draft passes they needed."""
        if num_drafts <= 1:
            return
        self.free = DECAY * self.free + (num_drafts - num_passes)
        self.chances = DECAY * self.chances + (num_drafts - 1)

    def passes(self, num_drafts: int) -> float:
        """The expected draft passes of `num_drafts` drafts."""
        return 0.0 if num_drafts <= 0 else 1.0 + (num_drafts - 1) * (1.0 - self.rate)


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
        for row, (calibration, confidence) in enumerate(zip(self.calibrations, confidences)):
            self.survival[row] *= calibration.acceptance(confidence)
            self.tokens += self.survival[row]
        if num_drafted >= self.max_drafts:
            return False
        gain = sum(s * a for s, a in zip(self.survival, self.next_acceptances))
        seconds = self.step_seconds(num_drafted)
        extra = self.step_seconds(num_drafted + 1) - seconds
        return gain * seconds > self.tokens * extra


# A look-up tree's branches (its nodes off the first-choice path, `handler.tree`) are scored by
# guesses: an n-gram continuation's share of the matched occurrences, or a suffix tree's counts,
# times the row's acceptance at that depth. On code edits these guesses ran about 8x too high (8.5
# accepted branch nodes expected, 1 seen, over 16 trees), so each step a tree paid for columns that
# were almost never taken. `BranchCalibration` scales them by what was seen. The engine keeps one
# more for a suffix look-up's own chain probabilities (its counts, not the target's acceptance).
# Per tree step that verified branches: about the last 50 such steps count.
BRANCH_DECAY = 0.98
# Weight, in expected accepted nodes, of the prior belief that the guesses are right.
BRANCH_PRIOR = 1.0


class BranchCalibration:
    """The ratio of branch nodes accepted to branch nodes expected, for one kind of look-up.

    Both counts decay; the prior (`BRANCH_PRIOR` expected and accepted) starts the factor at 1.
    The factor is capped at 1, so a branch never outranks its first-choice sibling. A step whose
    plan cut every branch verifies none, and would teach the factor nothing: `relax` decays the
    counts toward the prior instead, so that branches are tried again after a while (about 100
    such steps bring a factor of 0.1 back to 0.3).
    """

    def __init__(self) -> None:
        self.expected = 0.0
        self.accepted = 0.0

    @property
    def factor(self) -> float:
        return min(1.0, (self.accepted + BRANCH_PRIOR) / (self.expected + BRANCH_PRIOR))

    def update(self, expected: float, accepted: int) -> None:
        """Takes one verified tree: the uncalibrated estimates of its branch nodes summed, and how
        many of those nodes the walk accepted."""
        assert expected >= 0.0 and accepted >= 0, (expected, accepted)
        self.expected = BRANCH_DECAY * self.expected + expected
        self.accepted = BRANCH_DECAY * self.accepted + accepted

    def relax(self) -> None:
        """A tree whose branches were all cut: no evidence, a step back toward the prior."""
        self.expected *= BRANCH_DECAY
        self.accepted *= BRANCH_DECAY


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
    for row, (chain, seconds) in enumerate(zip(acceptances, runner_up_acceptances)):
        reach = 1.0
        for position, (acceptance, runner_up) in enumerate(zip(chain, seconds)):
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
