"""Model metrics for TorchServe's Prometheus endpoint.

Every name here must also be declared in model-config/metrics.yaml: TorchServe
silently drops metrics it does not know. The counters add up to the
per-response `speculative` stats, so dashboards can derive the acceptance rate
(accepted / draft tokens) and the mean accepted length (generated tokens /
target passes). Latencies are histograms in seconds.
"""

from __future__ import annotations

import logging

from ts.metrics.metric_type_enum import MetricTypes

logger = logging.getLogger(__name__)

COUNTERS = {
    "SpecRequests": "requests answered with generated text",
    "SpecRejectedRequests": "requests answered with a 4xx or 5xx error",
    "SpecDraftTokens": "draft tokens proposed",
    "SpecAcceptedTokens": "draft tokens accepted by the target",
    "SpecGeneratedTokens": "tokens emitted (completion tokens)",
    "SpecTargetForwardPasses": "target forward passes, counted once per request in a batch",
    "SpecFallbacks": "requests whose adaptive k fell back to target-only decoding",
}
HISTOGRAMS = {
    "SpecRequestLatencySeconds": "handler time from batch start to a request's last token",
    "SpecTimePerOutputTokenSeconds": "request latency divided by completion tokens",
    "SpecTimeToFirstTokenSeconds": "streamed requests: batch start to the first chunk",
}
COUNT_UNIT = "Count"
SECONDS_UNIT = "Seconds"


class MetricsRecorder:
    """Adds one request's figures to TorchServe's metrics cache; never fails a request."""

    def __init__(self, metrics_cache) -> None:
        self.metrics = metrics_cache

    def _add(self, name: str, value: float, unit: str, metric_type: MetricTypes) -> None:
        if self.metrics is None:
            return
        try:
            # A fresh dimensions list each call: TorchServe appends the defaults to it.
            self.metrics.add_metric(name, value, unit, dimensions=[], metric_type=metric_type)
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
        self._add("SpecRequestLatencySeconds", latency_seconds, SECONDS_UNIT, histogram)
        if stats.completion_tokens:
            self._add(
                "SpecTimePerOutputTokenSeconds", latency_seconds / stats.completion_tokens, SECONDS_UNIT, histogram
            )
        if first_token_seconds is not None:
            self._add("SpecTimeToFirstTokenSeconds", first_token_seconds, SECONDS_UNIT, histogram)

    def record_rejected(self) -> None:
        self._add("SpecRejectedRequests", 1, COUNT_UNIT, MetricTypes.COUNTER)
