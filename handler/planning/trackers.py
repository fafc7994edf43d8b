"""What the planner learns while serving: acceptance trackers, calibrations, the outcome check.

- `AcceptanceTracker`: a request's (or the pool's) decayed acceptance, overall and per draft
  position, and from it E(0..n), the expected tokens of a step with n drafts.
- `ConfidenceCalibration`: the draft model's confidence in a draft -> the chance the target
  accepts it (`handler.planning.pricing.ConfidenceStop` prices one more draft with it).
- `BranchCalibration`: how far a look-up tree's guesses about its branches hold.
- `GuessRate`: the share of a row's model drafts that came free (guessed drafting).
- `OutcomeCheck`: drafting against plain decoding, as the steps actually ran.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics
from typing import Hashable, Protocol, Sequence

from handler.types import GenerationRequest, SpeculativeStats

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


# The realized check of drafting against plain decoding (`OutcomeCheck`): the pairs of step rates per
# batch size in its window, and the samples each arm (and the pairs) need before a verdict.
OUTCOME_WINDOW = 32
OUTCOME_MIN_STEPS = 8
# Until both arms have OUTCOME_MIN_STEPS, the arm with fewer steps runs one step in EXPLORE_UNSEEN
# (in bursts): a cold server must learn, whatever that costs.
EXPLORE_UNSEEN = 4
# Once there is a verdict, the arm it leaves out runs only in bursts whose seconds, each step of the
# burst counted, stay at most this share of the bucket's seconds. What exploring costs throughput,
# share x (1 - slower / faster), is then at most this share however dear the other arm's steps run,
# which a count of steps did not see.
EXPLORE_SHARE = 0.02
# The other arm runs in bursts of this many steps: the first drafting step after plain ones feeds
# the draft every token it missed (a wide catch-up pass), which steady drafting does not pay. It is
# a sample all the same (drafting that comes and goes pays it every time), and counts against the budget.
EXPLORE_BURST = 4
# A sample is paired with the other arm's samples of this many steps before it, in its bucket: a
# burst's with the steps the verdict ran just before it, and the verdict's first steps after a burst
# with the burst's.
PAIR_SPAN = 2 * EXPLORE_BURST
# The kinds of drafting step `OutcomeCheck` also judges apart: those in which the draft model drafted
# for some row, and those that verified look-ups only. Each kind's verdict pairs its own samples with
# the plain steps near them; every drafting step also counts toward the verdict of all kinds (kind None).
WITH_MODEL = "model"
LOOKUPS_ONLY = "lookups"
DRAFT_KINDS = (WITH_MODEL, LOOKUPS_ONLY)
PLAIN = "plain"  # `OutcomeCheck`'s arm of the steps that did not draft
# A burst runs its steps unless they have taken this many times the seconds it was granted (its
# arm's steps turned dearer than before); a burst a little over is repaid before the next one.
BURST_OVERRUN = 2.0
# After a plain plan whose best drafting alternative was priced at PLAIN_SKIP_GAIN of plain decoding
# or less, the steps that decode plainly without asking the drafters or planning (`PlainStreak`): 1,
# 2, 4, ... after each such plan in a row, at most PLAIN_SKIP_MAX, so that the planner still looks at
# least once in PLAIN_SKIP_MAX + 1 steps; and only where the look-ups and the plan cost
# PLAIN_SKIP_SHARE of a plain step or more (a GPU's steps, a CPU's full batches): below it the drafts
# a skipped step might have found are worth more than the time it saves.
PLAIN_SKIP_GAIN = 0.9
PLAIN_SKIP_MAX = 4
PLAIN_SKIP_SHARE = 0.005
# Where the look-ups and the plan cost a large share of a plain step (a CPU's tiny models at 16 rows:
# about 0.6; a GPU's steps, whose pass is short), the streak grows on past PLAIN_SKIP_MAX until
# planning costs at most PLAIN_SKIP_BUDGET of the plain steps it spans, and at most PLAIN_SKIP_LONGEST
# steps: a prompt that turns repetitive mid-answer drafts at most that many steps late.
PLAIN_SKIP_BUDGET = 0.02
PLAIN_SKIP_LONGEST = 16


def batch_bucket(batch_size: int) -> int:
    """The power of two nearest to `batch_size` by ratio: the batch sizes `OutcomeCheck` pools."""
    return 2 ** round(math.log2(batch_size))


@dataclasses.dataclass
class ExploreBudget:
    """One bucket's time for the arm its verdict leaves out (`OutcomeCheck`): credit earned at
    EXPLORE_SHARE of every second under a verdict, spent by the bursts that run the other arm.

    A burst starts only when the credit covers its expected seconds, so that the exploring seconds
    stay within EXPLORE_SHARE of the bucket's (to one burst's misjudgement, which the credit then
    owes). A burst runs its arm to its end, the verdict may turn meanwhile, and each of its steps
    is charged. The steps before a verdict neither earn nor spend: the budget is the verdict's.
    """

    credit: float = 0.0  # EXPLORE_SHARE x the seconds of the steps under a verdict, less the bursts'
    steps_left: int = 0  # in the burst under way
    drafts: bool = False  # the burst's arm: drafting or plain decoding
    granted: float = 0.0  # the seconds the burst was expected to take
    spent: float = 0.0  # ... and those it took so far
    # The step `OutcomeCheck.arm` decided last, until observed: True a burst's, False the verdict's,
    # None before a verdict (or no step decided).
    in_flight: bool | None = None

    def burst_arm(self, other: bool, burst_seconds: float) -> bool | None:
        """The arm the next step runs in a burst: the burst's under way, or the arm `other` the verdict
        leaves out where the credit now covers a burst of it (`burst_seconds`: its expected seconds).
        None: the step follows the verdict."""
        if not self.steps_left and self.credit >= burst_seconds:
            self.steps_left, self.drafts, self.granted, self.spent = EXPLORE_BURST, other, burst_seconds, 0.0
        self.in_flight = self.steps_left > 0
        if not self.in_flight:
            return None
        self.steps_left -= 1
        return self.drafts

    def charge(self, seconds: float) -> None:
        """The step decided last took `seconds`."""
        explored, self.in_flight = self.in_flight, None
        if explored is None:
            return
        self.credit += EXPLORE_SHARE * seconds
        if explored:
            self.credit -= seconds
            self.spent += seconds
            if self.spent > BURST_OVERRUN * self.granted:
                self.steps_left = 0


class OutcomeCheck:
    """Whether the steps that drafted gave more tokens per second than the plain steps, as they ran.

    The plan prices steps with a cost table, and on a busy machine the table can be off by the
    10 to 20 % that separate drafting from plain decoding under load; there the plan would draft
    at a loss it cannot see. So the engine times every step, per batch size (its nearest grid
    point) and per arm (a step that drafted, a step that did not), as its tokens per second over
    those its plan expected. A verdict compares the arms: how drafting steps held up against their
    price, relative to plain ones. A plan runs drafting where its expected gain over plain
    decoding, discounted by that verdict, is above 1, and the other arm runs in bursts that take
    at most EXPLORE_SHARE of the bucket's seconds (`ExploreBudget`), enough to notice when the
    verdict changes.

    The rates are relative to each plan's own expectation because the drafts differ from step to
    step: a verdict formed on steps whose drafts were rarely taken (a look-up's guesses on a new
    prompt) says little about a step whose drafts are near certain (the same look-up on a repeated
    answer), while how far the table and the estimates fall short carries over. Drafting or not
    never changes the output, so neither does the check.

    Each kind of drafting step (the draft model's for some row, or look-ups only: `DRAFT_KINDS`) also
    has a verdict of its own, and a plan of that kind is judged by it, the verdict of every kind
    standing in for a plan of no known kind (a plain plan with no drafting one priced). They fall
    short of their price for different reasons (a look-up's guesses on a new prompt, the draft's passes
    and catch-ups), and under load at 4 rows on a CPU look-up steps at 0.74 to 0.81 of theirs had kept
    the draft model out of every step, in runs whose repeats with the model drafting ran 1.04 to 1.67x plain.

    The verdict pairs steps close in time: each sample is set against the other arm's samples of
    the last PAIR_SPAN steps of its bucket, and the verdict is the median of those pairs. The arms
    run at different times (the one left out only in bursts), and a shared CPU's speed, with the
    running table's price that follows it some steps behind, moves within a minute: on 2 cores under
    load at 16 rows, plain steps ran 0.18 to 0.36 s within one run, and their rate over a price
    still learning it moved from 2.2 to 0.9. A median of each arm's samples compared minutes apart
    read drafting at 0.4 to 1.5 of plain from that drift alone, and the check then drafted plans the
    table priced at 0.84 of plain.

    The budget is of time, not of steps: the first drafting step after plain ones feeds the draft
    every token it missed, and under load on a CPU its draft part ran up to 4 or 5 times the
    table's draft pass, so that a burst in every 16 had cost more than a sixteenth of the time.
    Where the two arms are close, the other arm loses less per second, and a larger share would
    still lose under EXPLORE_SHARE; it is not taken, because that loss would be judged from the
    verdict's medians, which a burst's one catch-up step, most of its cost, hardly moves.
    """

    def __init__(self) -> None:
        # Per (bucket, kind): drafting's rate over plain decoding's, of samples close in time; the latest.
        # Kind None: every drafting step's, whatever drafted.
        self.pairs: dict[tuple[int, str | None], list[float]] = {}
        # Per (bucket, arm): its latest samples with their step number in the bucket, and how many it had.
        # The arm: PLAIN, None (drafting of any kind), or one of DRAFT_KINDS.
        self.recent: dict[tuple[int, str | None], collections.deque[tuple[int, float]]] = {}
        self.num_samples: collections.Counter[tuple[int, str | None]] = collections.Counter()
        self.num_steps: collections.Counter[int] = collections.Counter()
        # The seconds of each arm's last steps, fair samples or not: a burst's expected seconds.
        self.seconds: dict[tuple[int, bool], collections.deque[float]] = {}
        self.budgets: dict[int, ExploreBudget] = {}

    def observe(self, bucket: int, drafted: bool, seconds: float, rate: float | None, kind: str | None = None) -> None:
        """A step of this batch-size bucket, that drafted (`kind`: which kind of drafting, where known) or
        not, took `seconds` and gave `rate` times the tokens per second its plan expected (None: no fair
        sample, its seconds count all the same).

        Follows the bucket's `arm` for the same step, whose budget it charges."""
        self.num_steps[bucket] += 1
        step = self.num_steps[bucket]
        self.seconds.setdefault((bucket, drafted), collections.deque(maxlen=EXPLORE_BURST)).append(seconds)
        if rate is not None:
            if drafted:
                arms = (None,) if kind is None else (None, kind)  # every kind's, and its own where known
            else:
                arms = (PLAIN,)
            for arm in arms:
                self.num_samples[bucket, arm] += 1
                self.recent.setdefault((bucket, arm), collections.deque(maxlen=PAIR_SPAN)).append((step, rate))
            # A drafting sample pairs with the plain steps near it; a plain one with each kind's near it.
            for judged in arms if drafted else (None, *DRAFT_KINDS):
                other = PLAIN if drafted else judged
                near = [sample for at, sample in self.recent.get((bucket, other), ()) if step - at <= PAIR_SPAN]
                if near:
                    reference = statistics.median(near)
                    window = self.pairs.setdefault((bucket, judged), [])
                    window.append(rate / reference if drafted else reference / rate)
                    del window[:-OUTCOME_WINDOW]
        budget = self.budgets.get(bucket)
        if budget is not None:
            budget.charge(seconds)

    def ratio(self, bucket: int, kind: str | None = None) -> float | None:
        """Drafting's rate (as it ran over as planned; `kind`: of that kind only) over plain decoding's
        at this bucket, the median of steps paired in time; None while either arm or the pairs have too few."""
        pairs = self.pairs.get((bucket, kind), [])
        fewest_samples = min(self.num_samples[bucket, kind], self.num_samples[bucket, PLAIN])
        if len(pairs) < OUTCOME_MIN_STEPS or fewest_samples < OUTCOME_MIN_STEPS:
            return None
        return statistics.median(pairs)

    def arm(self, bucket: int, planned: bool, step: int, gain: float = 1.0, kind: str | None = None) -> bool:
        """Whether step number `step` at this bucket drafts, given whether the plan drafts.

        `gain`: the priced tokens per second of the drafting plan in question over plain decoding's
        (the plan's own where it drafts; the best drafting plan's where it does not, at most 1), and
        `kind` its kind, where known: the verdict of that kind judges it. So look-up steps that ran
        below their price do not refuse the draft model, nor the draft model's the look-ups.
        """
        budget = self.budgets.setdefault(bucket, ExploreBudget())
        ratio = self.ratio(bucket, kind)
        if ratio is None:
            # The arm with fewer samples takes a burst in every EXPLORE_UNSEEN, the plan the others. Where
            # both have enough but the pairs lack (a kind that first drafts after a long plain run, whose
            # plain samples are too old to pair), the arm the plan does not run takes the bursts.
            budget.in_flight = None
            drafted, plain = self.num_samples[bucket, kind], self.num_samples[bucket, PLAIN]
            unseen = drafted <= plain if min(drafted, plain) < OUTCOME_MIN_STEPS else not planned
            return unseen if _burst(step, EXPLORE_UNSEEN) else planned
        # The gain as drafting steps have run against their price: where it is lost, plain decoding runs.
        faster = gain * ratio > 1.0
        burst = budget.burst_arm(not faster, self.burst_seconds(bucket, not faster))
        return faster if burst is None else burst

    def burst_seconds(self, bucket: int, drafted: bool) -> float:
        """A burst's expected seconds at this bucket for the arm that drafts or not: its last EXPLORE_BURST
        steps'. Where that arm runs only in bursts, they are the last burst's, its catch-up included."""
        window = self.seconds.get((bucket, drafted))
        return EXPLORE_BURST * statistics.fmean(window) if window else 0.0


class PlainStreak:
    """Which steps decode plainly without planning: those after plain plans whose best drafting
    alternative was priced well below plain decoding (`handler.planning.planner.StepPlan.drafting_gain`
    <= `max_gain`), while the batch holds the same rows.

    Such a step skips the drafters' look-ups and the plan, as plain decoding does; its tokens are the
    same (a plain step is exact). The skips after each such plan in a row double, 1, 2, 4, up to
    `max_skip`, or further, up to `longest`, where planning costs more than `budget` of the steps
    `max_skip` would span; a plan that drafts or prices drafting near plain, or planning that costs less
    than `min_share` of a plain step, ends the streak. A row that joins or leaves is planned at once.
    """

    def __init__(
        self,
        max_skip: int = PLAIN_SKIP_MAX,
        min_share: float = PLAIN_SKIP_SHARE,
        max_gain: float = PLAIN_SKIP_GAIN,
        budget: float = PLAIN_SKIP_BUDGET,
        longest: int = PLAIN_SKIP_LONGEST,
    ) -> None:
        self.max_skip, self.min_share, self.max_gain = max_skip, min_share, max_gain
        self.budget, self.longest = budget, longest
        self.num_skipped = 0  # steps that skipped planning
        self._batch: int | None = None  # the batch's rows when it last planned (`Batch.version`)
        self._length = 0  # the skips granted after the last plan
        self._left = 0

    def skips(self, batch: int) -> bool:
        """Whether this step skips planning; `batch` names the batch's rows (the same number, the same
        rows). Rows that joined or left are planned at once (a joining row may hold free drafts, a
        smaller batch prices drafting anew); the streak's length stands, for the plans that follow."""
        if self._left and batch == self._batch:
            self._left -= 1
            self.num_skipped += 1
            return True
        self._left = 0
        return False

    def planned(self, batch: int, drafting_gain: float, share: float) -> None:
        """Takes a step that planned over the rows `batch` names: its best drafting plan's priced rate
        over plain decoding's where it planned plain (infinite where it drafted), and what its look-ups
        and plan cost over a plain step's seconds."""
        if drafting_gain <= self.max_gain and share >= self.min_share and self.max_skip:
            # The skips after which one plan costs `budget` of the steps: share / (skips + 1) = budget.
            within_budget = min(self.longest, math.ceil(share / self.budget) - 1)
            self._length = min(max(self.max_skip, within_budget), max(1, 2 * self._length))
        else:
            self._length = 0
        self._batch, self._left = batch, self._length


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
        # Per position, decayed steps that verified draft j (j - 1 accepted) and that accepted it, each
        # kept divided by `_scale`, the decay since the last rescaling: a step then adds to the
        # positions it reached only, instead of decaying all MAX_POSITIONS of them (`reached`, `passed`).
        self._reached = [0.0] * MAX_POSITIONS
        self._passed = [0.0] * MAX_POSITIONS
        self._scale = 1.0

    @property
    def reached(self) -> list[float]:
        return [value * self._scale for value in self._reached]

    @property
    def passed(self) -> list[float]:
        return [value * self._scale for value in self._passed]

    def update(self, num_accepted: int, k: int) -> None:
        if k == 0:
            return
        decay = self.decay
        self.successes = decay * self.successes + num_accepted
        self.failures = decay * self.failures + (1.0 if num_accepted < k else 0.0)
        self.num_steps += 1
        self._scale *= decay
        if self._scale < _RESCALE_BELOW:
            self._reached = [value * self._scale for value in self._reached]
            self._passed = [value * self._scale for value in self._passed]
            self._scale = 1.0
        weight = 1.0 / self._scale
        for j in range(min(num_accepted + 1, k, MAX_POSITIONS)):
            self._reached[j] += weight
        for j in range(min(num_accepted, MAX_POSITIONS)):
            self._passed[j] += weight

    @property
    def acceptance(self) -> float:
        return (self.successes + 1.0) / (self.successes + self.failures + 2.0)

    def expected_curve(self, max_k: int) -> list[float]:
        """E(0..max_k): expected tokens from a step with k drafts, bonus token included."""
        overall = self.acceptance
        curve, survive = [1.0], 1.0
        scale, reached, passed = self._scale, self._reached, self._passed
        for j in range(max_k):
            if j < MAX_POSITIONS:
                survive *= (passed[j] * scale + POSITION_PRIOR * overall) / (reached[j] * scale + POSITION_PRIOR)
            else:
                survive *= overall
            curve.append(curve[-1] + survive)
        return curve


# `AcceptanceTracker` folds its decay into its per-position sums below this factor (1 / it stays finite).
_RESCALE_BELOW = 1e-100

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
        # Each bin's estimate, kept as its counts move: a step reads it for every draft of every row
        # (the stop rule at each pass, the runners-up), and takes far fewer updates.
        self.table = [self._estimate(index) for index in range(CONFIDENCE_BINS)]

    def _estimate(self, index: int) -> float:
        prior = (index + 0.5) / CONFIDENCE_BINS
        return (self.accepted[index] + CONFIDENCE_PRIOR * prior) / (self.verified[index] + CONFIDENCE_PRIOR)

    def acceptance(self, confidence: float) -> float:
        """The estimated chance that the target accepts a draft of this confidence."""
        return self.acceptances((confidence,))[0]

    def acceptances(self, confidences: Sequence[float]) -> list[float]:
        """`acceptance` of each confidence, in one call (a chain's, a batch's)."""
        return list(map(self.table.__getitem__, confidence_bins(confidences)))

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
        bins = confidence_bins(confidences[: num_accepted + 1])
        for position, index in enumerate(bins):
            self.verified[index] = CONFIDENCE_DECAY * self.verified[index] + 1.0
            self.accepted[index] = CONFIDENCE_DECAY * self.accepted[index] + float(position < num_accepted)
        for index in set(bins):
            self.table[index] = self._estimate(index)


def confidence_bins(confidences: Sequence[float]) -> list[int]:
    """Each confidence's bin of a `ConfidenceCalibration` (1.0 falls in the top one)."""
    top = CONFIDENCE_BINS - 1
    return [min(max(int(confidence * CONFIDENCE_BINS), 0), top) for confidence in confidences]


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

    @property
    def has_guessed(self) -> bool:
        """Whether a step of several drafts updated it: the rate is then the row's, not the prior."""
        return self.chances > 1.0

    def update(self, num_drafts: int, num_passes: int) -> None:
        """Takes one step's drafts and the draft passes they needed."""
        if num_drafts <= 1:
            return
        self.free = DECAY * self.free + (num_drafts - num_passes)
        self.chances = DECAY * self.chances + (num_drafts - 1)

    def passes(self, num_drafts: int) -> float:
        """The expected draft passes of `num_drafts` drafts."""
        return 0.0 if num_drafts <= 0 else 1.0 + (num_drafts - 1) * (1.0 - self.rate)


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


class PlannedRow(Protocol):
    """What the planner and the estimates read of a row in flight (`handler.engine.row.Row`), so that
    planning needs nothing from the engine above it."""

    request_id: Hashable
    request: GenerationRequest
    drafter: str
    trackers: dict[str, AcceptanceTracker]  # by proposer
    steps_without_drafts: int
    guess_rate: GuessRate
    stats: SpeculativeStats

    @property
    def remaining(self) -> int:
        """How many tokens the row may still emit."""
