"""What each step ran, kept for the metrics and the benchmarks (`StepLog`)."""

from __future__ import annotations

import collections
import dataclasses
import time

from handler.drafters import PROPOSER_GRAMMAR
from handler.engine.propose import DraftTimes
from handler.planning.planner import StepPlan, draft_kind
from handler.planning.trackers import OutcomeCheck, batch_bucket
from handler.types import StepOutput

# Step records the engine keeps for its metrics (`StepLog.recent_steps`).
RECENT_STEPS = 64


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """What one step ran: the plan's outcome and where its time went (metrics, `scripts.bench.load`)."""

    batch_size: int  # rows in the step
    ks: tuple[int, ...]  # drafts each row verified (a tree's nodes), in batch order
    draft_passes: int  # draft-model passes over the batch
    seconds: float  # the whole step, joining requests' prefill included
    prefill_seconds: float  # joining requests' prefill, and the draft model's of rows drafting first
    draft_seconds: float  # the draft model's passes, with their warping and sampling
    verify_seconds: float  # the target's verify pass (its forward only)

    @property
    def width(self) -> int:
        """The verify pass's width: the widest row's drafts and its pending token."""
        return max(self.ks, default=0) + 1


class StepLog:
    """The recent steps' records, the last one last, and the steps run since start-up.

    Where the engine times its passes, each step also shows the outcome check how drafting
    ran against plain decoding (`handler.planning.trackers.OutcomeCheck`).
    """

    def __init__(self, outcome_check: OutcomeCheck | None = None) -> None:
        self.outcome_check = outcome_check
        self.recent_steps: collections.deque[StepRecord] = collections.deque(maxlen=RECENT_STEPS)
        self.num_steps = 0
        # The last step's duration and the part of it spent on grammar masks (structured output).
        self.last_step_seconds = 0.0
        self.last_step_mask_seconds = 0.0

    def record(
        self,
        plan: StepPlan,
        ks: list[int],
        times: DraftTimes,
        verify_seconds: float,
        mask_seconds: float,
        outputs: list[StepOutput],
        admitted: float,
        started: float,
        ended: float | None = None,
    ) -> None:
        """Keeps a step's record (`ks`: the drafts each row verified; `mask_seconds`: its grammar masks'
        part; `admitted`, `started`: when its admission and its own work began; `ended`: when it ended,
        None: now; a launched step read later ends where the step behind it began)."""
        ended = time.perf_counter() if ended is None else ended
        self.last_step_seconds = ended - started
        self.last_step_mask_seconds = mask_seconds
        record = StepRecord(
            len(ks),
            tuple(ks),
            times.num_passes,
            ended - admitted,
            started - admitted + times.fill_seconds,
            times.draft_seconds,
            verify_seconds,
        )
        drafted = max(ks) > 0
        # A step that verified only the tokens a grammar forced is no sample: they are certain, not
        # speculation. A drafting step right after plain ones, which fed the draft the tokens it missed
        # (its catch-up), is one: drafting that comes and goes pays that every time. Under load on a CPU,
        # while such steps were left out, the samples kept put drafting at 0.8 to 1.3 of its price at 16
        # rows, and the steps left out ran 1.8 to 5.9 s for their few tokens. Its prefill of joining rows
        # is not in a step's rate: the plan spread its price over the steps it serves (`Planner._fill_share`),
        # and the step that pays it whole would turn the verdict against the drafting it was paid for.
        speculated = any(k and row.drafter != PROPOSER_GRAMMAR for row, k in zip(plan.rows, ks))
        fair = not drafted or speculated
        if self.outcome_check is not None and ended > started:
            rate = None
            seconds = ended - started - times.fill_seconds
            if fair and plan.expected_rate > 0 and seconds > 0:
                tokens = sum(len(output.new_token_ids) for output in outputs)
                # As it ran over as priced: drafts of every kind then weigh alike (`OutcomeCheck`).
                rate = tokens / seconds / plan.expected_rate
            # Every step's own seconds, a catch-up's too: the other arm's time is budgeted. Like its rate,
            # they leave out the admission before it (the joining rows' prefill, the same in either arm).
            kind = draft_kind(ks, [row.uses_model for row in plan.rows]) if drafted else None
            self.outcome_check.observe(batch_bucket(len(ks)), drafted, ended - started, rate, kind)
        self.recent_steps.append(record)
        self.num_steps += 1
