"""Model metrics for TorchServe's Prometheus endpoint.

Every name here must also be declared in model-config/metrics.yaml: TorchServe
silently drops metrics it does not know. The counters add up to the
per-response `speculative` stats, so dashboards can derive the acceptance rate
(accepted / draft tokens) and the mean accepted length (generated tokens /
target passes). Latencies are histograms in seconds.

The `spec_decode_*` counters carry vLLM's names and meanings, so that vLLM
dashboards work unchanged: a draft is one proposal of k > 0 tokens for one
request at one step, and `spec_decode_num_accepted_tokens_per_pos` counts the
accepted drafts at each position (label `position`, 0 = first draft token).
"""

from __future__ import annotations

import logging
from typing import Sequence

from ts.metrics.dimension import Dimension
from ts.metrics.metric_type_enum import MetricTypes

logger = logging.getLogger(__name__)

COUNTERS = {
    "SpecRequests": "requests answered with generated text (an OpenAI request: one per choice)",
    "SpecRejectedRequests": "requests answered with a 4xx or 5xx error",
    "SpecDraftTokens": "draft tokens proposed",
    "SpecAcceptedTokens": "draft tokens accepted by the target",
    "SpecGeneratedTokens": "tokens emitted (completion tokens)",
    "SpecTargetForwardPasses": "target forward passes, counted once per request in a batch",
    "SpecFallbacks": "requests whose adaptive k fell back to target-only decoding",
    "SpecAbortedRequests": "requests dropped because their client disconnected",
    "spec_decode_num_drafts": "draft proposals (one request, one step, k > 0), as vLLM counts them",
    "spec_decode_num_draft_tokens": "draft tokens proposed, as vLLM counts them",
    "spec_decode_num_accepted_tokens": "draft tokens accepted, as vLLM counts them",
    "spec_decode_num_accepted_tokens_per_pos": "draft tokens accepted at each draft position (label position)",
    "SpecDrafterDraftTokens": "draft tokens proposed, by the drafter that proposed them (label drafter)",
    "SpecDrafterAcceptedTokens": "draft tokens accepted, by the drafter that proposed them (label drafter)",
    "SpecConstrainedRequests": "requests whose output followed a constraint (json_schema, regex, grammar, tools)",
}
GAUGES = {
    "SpecBatchOccupancy": "rows in the engine's running batch at the last step (a request, or an OpenAI choice)",
}
HISTOGRAMS = {
    "SpecRequestLatencySeconds": "handler time from the request's arrival to its last token",
    "SpecTimePerOutputTokenSeconds": "request latency divided by completion tokens",
    "SpecTimeToFirstTokenSeconds": "streamed requests: arrival in the handler to the first chunk",
    "SpecQueueWaitSeconds": "time a request waited in the handler for room in the batch (max_batch_tokens)",
    "SpecGrammarMaskSecondsPerStep": "constrained requests: time in grammar masks per target pass, on average",
}
POSITION_DIMENSION = "position"
DRAFTER_DIMENSION = "drafter"
# Counters with a label of their own, passed before the ModelName and Level TorchServe appends.
LABELLED_COUNTERS = {
    "spec_decode_num_accepted_tokens_per_pos": POSITION_DIMENSION,
    "SpecDrafterDraftTokens": DRAFTER_DIMENSION,
    "SpecDrafterAcceptedTokens": DRAFTER_DIMENSION,
}
COUNT_UNIT = "Count"
SECONDS_UNIT = "Seconds"


class MetricsRecorder:
    """Adds one request's figures to TorchServe's metrics cache; never fails a request."""

    def __init__(self, metrics_cache) -> None:
        self.metrics = metrics_cache

    def _add(self, name: str, value: float, unit: str, metric_type: MetricTypes, dimensions: Sequence = ()) -> None:
        if self.metrics is None:
            return
        try:
            # A fresh dimensions list each call: TorchServe appends the defaults to it.
            self.metrics.add_metric(name, value, unit, dimensions=list(dimensions), metric_type=metric_type)
        except Exception:  # metrics must never cost a request its answer
            logger.exception("could not record metric %s", name)

    def record_result(self, stats, latency_seconds: float, first_token_seconds: float | None = None) -> None:
        counter, histogram = MetricTypes.COUNTER, MetricTypes.HISTOGRAM
        self._add("SpecRequests", 1, COUNT_UNIT, counter)
        self._add("SpecDraftTokens", stats.draft_tokens, COUNT_UNIT, counter)
        self._add("SpecAcceptedTokens", stats.accepted_tokens, COUNT_UNIT, counter)
        self._add("SpecGeneratedTokens", stats.completion_tokens, COUNT_UNIT, counter)
        self._add("SpecTargetForwardPasses", stats.target_forward_passes, COUNT_UNIT, counter)
        if stats.fell_back:
            self._add("SpecFallbacks", 1, COUNT_UNIT, counter)
        for drafter, num_drafted in stats.draft_tokens_by_drafter.items():
            label = [Dimension(DRAFTER_DIMENSION, drafter)]
            self._add("SpecDrafterDraftTokens", num_drafted, COUNT_UNIT, counter, label)
            num_accepted = stats.accepted_tokens_by_drafter.get(drafter, 0)
            self._add("SpecDrafterAcceptedTokens", num_accepted, COUNT_UNIT, counter, label)
        self._add("SpecRequestLatencySeconds", latency_seconds, SECONDS_UNIT, histogram)
        if stats.completion_tokens:
            self._add(
                "SpecTimePerOutputTokenSeconds", latency_seconds / stats.completion_tokens, SECONDS_UNIT, histogram
            )
        if first_token_seconds is not None:
            self._add("SpecTimeToFirstTokenSeconds", first_token_seconds, SECONDS_UNIT, histogram)
        if getattr(stats, "constrained", False):
            # Forced-token drafts are SpecDrafterDraftTokens{drafter="grammar"}.
            self._add("SpecConstrainedRequests", 1, COUNT_UNIT, counter)
            if stats.target_forward_passes:
                per_step = stats.mask_seconds / stats.target_forward_passes
                self._add("SpecGrammarMaskSecondsPerStep", per_step, SECONDS_UNIT, histogram)

    def record_rejected(self) -> None:
        self._add("SpecRejectedRequests", 1, COUNT_UNIT, MetricTypes.COUNTER)

    def record_aborted(self) -> None:
        self._add("SpecAbortedRequests", 1, COUNT_UNIT, MetricTypes.COUNTER)

    def record_batch_occupancy(self, num_requests: int) -> None:
        self._add("SpecBatchOccupancy", num_requests, COUNT_UNIT, MetricTypes.GAUGE)

    def record_queue_wait(self, seconds: float) -> None:
        self._add("SpecQueueWaitSeconds", seconds, SECONDS_UNIT, MetricTypes.HISTOGRAM)

    def record_drafts(
        self,
        num_drafts: int | None,
        num_draft_tokens: int,
        num_accepted_tokens: int,
        accepted_per_position: Sequence[int] = (),
    ) -> None:
        """vLLM's speculative-decoding counters for a set of steps.

        Args:
            num_drafts: proposals with k > 0 (one per request per step); None when unknown.
            num_draft_tokens: draft tokens proposed in them.
            num_accepted_tokens: draft tokens the target accepted.
            accepted_per_position: accepted drafts at positions 0, 1, ...; empty when unknown.
        """
        assert not accepted_per_position or sum(accepted_per_position) == num_accepted_tokens
        counter = MetricTypes.COUNTER
        for name, value in (
            ("spec_decode_num_drafts", num_drafts or 0),
            ("spec_decode_num_draft_tokens", num_draft_tokens),
            ("spec_decode_num_accepted_tokens", num_accepted_tokens),
        ):
            if value:
                self._add(name, value, COUNT_UNIT, counter)
        for position, count in enumerate(accepted_per_position):
            if count:
                dimension = Dimension(POSITION_DIMENSION, str(position))
                self._add("spec_decode_num_accepted_tokens_per_pos", count, COUNT_UNIT, counter, [dimension])
