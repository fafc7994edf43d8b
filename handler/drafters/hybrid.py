"""The hybrid rule: per row and step, the proposal that promises the most tokens per second.

The candidates are the look-ups that found something (suffix trees, n-gram)
and the draft model. Each comes with its expected tokens per step, E(0..max_k)
(`handler.planning.planner`): a look-up's from its tree probabilities or its
acceptance tracker, the model's from its tracker. With a cost table, a
candidate's worth is its best E(k) / seconds(k) over k, where a look-up's
step costs one verification of width k + 1 and the model's adds k draft
passes. Without one, the look-up with the most expected accepted drafts wins
and the model drafts only where no look-up found anything.

The choice looks at drafts and estimates, never at the target's draws, so
the output stays the target's distribution whichever candidate wins.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from handler.drafters import MODEL, Proposal


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One drafter's offer for a row this step."""

    proposer: str
    lookup: Proposal  # the look-up's drafts; empty for the model, which drafts during the step
    max_k: int  # the most drafts it can verify this step
    curve: Sequence[float]  # expected tokens E(0..max_k), bonus token included


def choose(candidates: Sequence[Candidate], step_seconds: Callable[[int, bool], float] | None) -> Candidate:
    """The candidate with the most expected tokens per second (ties: the earlier one).

    Args:
        candidates: in order of preference; candidates with max_k 0 never win over others.
        step_seconds: (k, drafts with the model) -> seconds of a step verifying k drafts;
            None when no cost table was measured.
    """
    assert candidates
    live = [c for c in candidates if c.max_k > 0] or list(candidates)
    if step_seconds is None:
        lookups = [c for c in live if c.proposer != MODEL]
        if lookups:
            return max(lookups, key=lambda c: c.curve[c.max_k] - 1.0)
        return live[0]

    def rate(candidate: Candidate) -> float:
        model = candidate.proposer == MODEL
        return max(candidate.curve[k] / step_seconds(k, model) for k in range(1, candidate.max_k + 1))

    return max(live, key=rate) if live[0].max_k > 0 else live[0]
