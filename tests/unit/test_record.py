"""The step log (`handler.engine.record.StepLog`): what it shows the outcome check of each step."""

from __future__ import annotations

import time

import pytest

from handler.drafters import MODEL, NGRAM, NO_DRAFTS, Proposal
from handler.engine.propose import DraftTimes
from handler.engine.record import StepLog
from handler.planning.planner import NO_PLAN, RowPlan, StepPlan
from handler.planning.trackers import LOOKUPS_ONLY, WITH_MODEL
from handler.types import StepOutput

DRAFTING = RowPlan(drafter=MODEL, proposal=NO_DRAFTS, k=2, uses_model=True, curve=(1.0, 1.5, 1.8))
LOOKING_UP = RowPlan(drafter=NGRAM, proposal=Proposal([5, 6]), k=2, uses_model=False, curve=(1.0, 1.5, 1.8))


class Check:
    """Keeps what the step log observes."""

    def __init__(self) -> None:
        self.observed: list[tuple[int, bool, float, float | None]] = []
        self.kinds: list[str | None] = []

    def observe(self, bucket: int, drafted: bool, seconds: float, rate: float | None, kind: str | None) -> None:
        self.observed.append((bucket, drafted, seconds, rate))
        self.kinds.append(kind)


def record(steps: StepLog, plan: StepPlan, ks: list[int], num_tokens: int, seconds: float) -> None:
    """A step of `seconds` (its own work), after an admission of as long, that emitted `num_tokens` per row."""
    started = time.perf_counter() - seconds
    outputs = [StepOutput(slot, [0] * num_tokens, [0] * num_tokens, None, None) for slot in range(len(ks))]
    steps.record(plan, ks, DraftTimes(), 0.0, 0.0, outputs, started - seconds, started)


def test_every_step_shows_its_seconds_and_a_rate():
    check = Check()
    steps = StepLog(check)
    plain, drafting = StepPlan((NO_PLAN,) * 2, expected_rate=10.0), StepPlan((DRAFTING,) * 2, expected_rate=20.0)
    record(steps, plain, [0, 0], 1, 0.1)
    record(steps, drafting, [2, 2], 3, 0.5)  # the first drafting step after a plain one: its catch-up
    record(steps, drafting, [2, 2], 3, 0.2)
    (bucket, drafted, seconds, rate), catch_up, steady = check.observed
    assert (bucket, drafted, rate) == (2, False, pytest.approx(2 / seconds / 10.0))
    # The step's own seconds: the admission before it is left out, as from its rate.
    assert 0.1 <= seconds < 0.2
    # Drafting that comes and goes pays its catch-up every time: that step is a sample too.
    assert catch_up[1] and catch_up[2] >= 0.5 and catch_up[3] == pytest.approx(6 / catch_up[2] / 20.0)
    assert steady[1] and steady[3] == pytest.approx(6 / steady[2] / 20.0)
    assert catch_up[3] < steady[3]


def test_a_steps_prefill_in_the_draft_is_not_in_its_rate():
    """The plan spread the prefill's price over the steps it serves; the step that pays it whole is
    judged without it (its seconds count all the same)."""
    check = Check()
    steps = StepLog(check)
    drafting = StepPlan((DRAFTING,) * 2, expected_rate=20.0)
    started = time.perf_counter() - 0.5
    outputs = [StepOutput(slot, [0] * 3, [0] * 3, None, None) for slot in range(2)]
    steps.record(drafting, [2, 2], DraftTimes(fill_seconds=0.3), 0.0, 0.0, outputs, started, started)
    ((_, drafted, seconds, rate),) = check.observed
    assert drafted and seconds >= 0.5
    assert rate == pytest.approx(6 / (seconds - 0.3) / 20.0)


def test_a_drafting_step_says_which_kind_of_drafting_it_was():
    """The outcome check judges the draft model's steps apart from the look-ups' (`OutcomeCheck`): a step
    in which the model drafted for some row is WITH_MODEL, one that verified look-ups only LOOKUPS_ONLY."""
    check = Check()
    steps = StepLog(check)
    record(steps, StepPlan((NO_PLAN,) * 2, expected_rate=10.0), [0, 0], 1, 0.1)
    record(steps, StepPlan((LOOKING_UP, NO_PLAN), expected_rate=10.0), [2, 0], 2, 0.1)
    record(steps, StepPlan((LOOKING_UP, DRAFTING), expected_rate=10.0), [2, 2], 2, 0.1)
    # The model's row drew no draft (its confidence stopped it at once): look-ups only, as verified.
    record(steps, StepPlan((LOOKING_UP, DRAFTING), expected_rate=10.0), [2, 0], 2, 0.1)
    assert check.kinds == [None, LOOKUPS_ONLY, WITH_MODEL, LOOKUPS_ONLY]
