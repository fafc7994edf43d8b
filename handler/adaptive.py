"""Adaptive k: each request picks its number of drafts from its own running acceptance.

With a per-token acceptance rate a, a step with k drafts emits on average
E(k) = (1 - a^(k+1)) / (1 - a) tokens (Leviathan et al. 2023, eq. 1) and costs
k draft passes plus one verification. The best k maximises E(k) / cost(k);
when no k > 0 beats plain decoding, the request falls back to k = 0, which is
still exact. Adaptation never touches the sampler, so output stays lossless,
and it reads only the request's own history, so a seeded request gives the
same output in any batch.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import torch

# Weight of past steps in the acceptance estimate (about the last 10 steps count).
DECAY = 0.9
# Steps observed before a request may fall back to k = 0.
MIN_STEPS_BEFORE_FALLBACK = 4


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Seconds per forward pass: the draft on one token, the target on 1 + k tokens."""

    draft_step: float
    target_step: float
    target_per_extra_token: float

    def step_cost(self, k: int) -> float:
        return k * self.draft_step + self.target_step + k * self.target_per_extra_token

    def target_seconds(self, batch_size: int, width: int) -> float:
        """The cost-table view of this linear model (it ignores the batch size)."""
        return self.target_step + (width - 1) * self.target_per_extra_token

    def draft_seconds(self, batch_size: int) -> float:
        return self.draft_step

    @property
    def draft_target_ratio(self) -> float:
        """c in the speedup formula E / (k c + 1)."""
        return self.draft_step / self.target_step


def expected_tokens(acceptance: float, k: int) -> float:
    """E(k): expected tokens emitted by a step with k drafts, bonus token included."""
    if acceptance >= 1.0:
        return float(k + 1)
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


def best_k(acceptance: float, max_k: int, cost: CostModel) -> int:
    """The k in 0..max_k with the most expected tokens per second."""
    rates = [expected_tokens(acceptance, k) / cost.step_cost(k) for k in range(max_k + 1)]
    return max(range(max_k + 1), key=rates.__getitem__)


def plan_step_k(
    acceptances: Sequence[float],
    max_ks: Sequence[int],
    table,
    model_drafting: bool,
    batch_size: int | None = None,
) -> int:
    """The step's k that maximises the batch's expected tokens per second.

    Args:
        acceptances: each planned row's per-token acceptance estimate.
        max_ks: each planned row's cap; a row drafts min(k, cap).
        table: measured costs, `target_seconds(batch_size, width)` and `draft_seconds(batch_size)`.
        model_drafting: whether a draft model runs k passes (False for look-up drafts only).
        batch_size: rows in the forward passes, planned or not (default: the planned rows).

    Returns:
        k in 0..max(max_ks); 0 when no k beats plain decoding.
    """
    batch_size = batch_size or len(max_ks)
    best, best_rate = 0, 0.0
    for k in range(max(max_ks, default=0) + 1):
        tokens = sum(expected_tokens(a, min(k, cap)) for a, cap in zip(acceptances, max_ks))
        seconds = table.target_seconds(batch_size, k + 1)
        if model_drafting:
            seconds += k * table.draft_seconds(batch_size)
        if tokens / seconds > best_rate:
            best, best_rate = k, tokens / seconds
    return best


class AcceptanceTracker:
    """A decayed estimate of one request's per-token acceptance rate.

    A step that accepts n of k drafts is n successes and, when n < k, one
    failure: the maximum-likelihood view of a geometric run. A uniform prior
    (one success, one failure) keeps the first steps from swinging to 0 or 1.
    """

    def __init__(self) -> None:
        self.successes = 0.0
        self.failures = 0.0
        self.num_steps = 0

    def update(self, num_accepted: int, k: int) -> None:
        if k == 0:
            return
        self.successes = DECAY * self.successes + num_accepted
        self.failures = DECAY * self.failures + (1.0 if num_accepted < k else 0.0)
        self.num_steps += 1

    @property
    def acceptance(self) -> float:
        return (self.successes + 1.0) / (self.successes + self.failures + 2.0)


class AdaptiveK:
    """Chooses each step's k for a request, up to the request's own maximum."""

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost

    def choose(self, tracker: AcceptanceTracker, max_k: int) -> int:
        k = best_k(tracker.acceptance, max_k, self.cost)
        if k == 0 and tracker.num_steps < MIN_STEPS_BEFORE_FALLBACK:
            return min(1, max_k)
        return k


@torch.inference_mode()
def measure_cost_model(target, draft, max_k: int, repeats: int = 3) -> CostModel:
    """Times the draft and the target on a short cached context, at start-up."""
    from transformers import DynamicCache

    device = next(target.parameters()).device

    def seconds(model, width: int) -> float:
        prefix = torch.zeros((1, 32), dtype=torch.long, device=device)
        step = torch.zeros((1, width), dtype=torch.long, device=device)
        times = []
        for _ in range(repeats + 1):
            cache = DynamicCache(config=model.config)
            model(input_ids=prefix, past_key_values=cache, use_cache=True, logits_to_keep=1)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            model(input_ids=step, past_key_values=cache, use_cache=True, logits_to_keep=width)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        return sorted(times[1:])[len(times[1:]) // 2]  # median, after one warm-up

    draft_step = seconds(draft, 1) if draft is not None else 0.0
    target_step = seconds(target, 1)
    wide = max(max_k, 1) + 1
    target_wide = seconds(target, wide)
    per_extra = max(0.0, (target_wide - target_step) / (wide - 1))
    return CostModel(draft_step=draft_step, target_step=target_step, target_per_extra_token=per_extra)
