"""Model metrics for TorchServe's Prometheus endpoint.

Every name here must also be declared in model-config/metrics.yaml: TorchServe
silently drops metrics it does not know. The counters add up to the
per-response `speculative` stats, so dashboards can derive the acceptance rate
(accepted / draft tokens) and the mean accepted length (generated tokens /
target passes). Latencies are histograms in seconds.

TorchServe 0.12's Prometheus exporter gives every histogram the client library's default
buckets, 5 ms to 10 s, and metrics.yaml cannot change them; a request on a CPU takes 10 to 60 s.
So the latencies that reach minutes are also counted into buckets of the config's choosing
(`metrics_latency_buckets_s`): one counter per histogram, labelled `le`, cumulative, with
`+Inf` (`BUCKET_COUNTERS`), which PromQL's `histogram_quantile` reads as it reads a histogram's
`_bucket` series.

The `spec_decode_*` and `prefix_cache_*` counters carry vLLM's names and meanings, so that vLLM
dashboards work unchanged: a draft is one proposal of k > 0 tokens for one
request at one step, and `spec_decode_num_accepted_tokens_per_pos` counts the
accepted drafts at each position (label `position`, 0 = first draft token).
`prefix_cache_queries` counts the prompt tokens of the requests that joined the
batch, `prefix_cache_hits` those of them whose KV the prefix cache held.
"""

from __future__ import annotations

import logging
import math
from typing import Sequence

from ts.metrics.dimension import Dimension
from ts.metrics.metric_type_enum import MetricTypes

from handler.config import DEFAULT_LATENCY_BUCKETS_S

logger = logging.getLogger(__name__)

COUNTERS = {
    "SpecRequests": "requests answered with generated text (an OpenAI request: one per choice)",
    "SpecRejectedRequests": "requests answered with a 4xx or 5xx error",
    "SpecDraftTokens": "draft tokens proposed",
    "SpecAcceptedTokens": "draft tokens accepted by the target",
    "SpecGeneratedTokens": "tokens emitted (completion tokens)",
    "SpecTargetForwardPasses": "target forward passes, counted once per request in a batch",
    "SpecDraftPasses": "draft-model passes, counted once per request in a batch (fewer than its drafts: guesses)",
    "SpecFallbacks": "requests whose adaptive k fell back to target-only decoding",
    "SpecAbortedRequests": "requests dropped because their client disconnected",
    "spec_decode_num_drafts": "draft proposals (one request, one step, k > 0), as vLLM counts them",
    "spec_decode_num_draft_tokens": "draft tokens proposed, as vLLM counts them",
    "spec_decode_num_accepted_tokens": "draft tokens accepted, as vLLM counts them",
    "spec_decode_num_accepted_tokens_per_pos": "draft tokens accepted at each draft position (label position)",
    "SpecDrafterDraftTokens": "draft tokens proposed, by the drafter that proposed them (label drafter)",
    "SpecDrafterAcceptedTokens": "draft tokens accepted, by the drafter that proposed them (label drafter)",
    "SpecConstrainedRequests": "requests whose output followed a constraint (json_schema, regex, grammar, tools)",
    "prefix_cache_queries": "prompt tokens looked up in the prefix cache, as vLLM counts them",
    "prefix_cache_hits": "prompt tokens whose KV came from the prefix cache, as vLLM counts them",
    "SpecPrefixCacheEvictions": "cached token runs evicted from the prefix cache (both models)",
    "SpecTreeSteps": "steps that verified a tree of look-up candidates with a branch (speculative_tree)",
    "SpecTreeNodes": "draft tokens those trees held, all branches counted",
    "SpecTreeAcceptedDepth": "draft tokens those trees' accepted paths held",
    "SpecTreeOtherBranch": "tree steps whose accepted path left the first-choice branch",
    "SpecResponsesEvicted": "stored responses evicted from the Responses store (least recently used first)",
    "SpecRequestLatencySecondsBucket": "SpecRequestLatencySeconds in metrics_latency_buckets_s (label le)",
    "SpecTimeToFirstTokenSecondsBucket": "SpecTimeToFirstTokenSeconds in metrics_latency_buckets_s (label le)",
    "SpecQueueWaitSecondsBucket": "SpecQueueWaitSeconds in metrics_latency_buckets_s (label le)",
}
GAUGES = {
    "SpecBatchOccupancy": "rows in the engine's running batch at the last step (a request, or an OpenAI choice)",
    "SpecPrefixCacheBytes": "KV bytes the prefix cache holds (both models)",
    "SpecSuffixTreeRequests": "completions held in the suffix drafter's tree shared across requests",
    "SpecSuffixTreeTokens": "tokens of the completions held in the suffix drafter's shared tree",
    "SpecTargetCostPercent": "a target pass's time as a percent of the start-up cost table's (CPU; 100: as measured)",
    "SpecDraftCostPercent": "a draft step's time as a percent of the start-up cost table's (CPU; 100: as measured)",
    "SpecDraftingRowsPercent": "rows that drafted, as a percent of the rows of the steps since the last value",
    "SpecResponsesStored": "responses held in the Responses store (previous_response_id)",
    "SpecResponsesStoreBytes": "bytes of the conversations the Responses store holds",
    "SpecDraftSharedVocabularyPercent": "a draft from another family: its tokens the target shares, as a percent",
}
HISTOGRAMS = {
    "SpecRequestLatencySeconds": "handler time from the request's arrival to its last token",
    "SpecTimePerOutputTokenSeconds": "request latency divided by completion tokens",
    "SpecTimeToFirstTokenSeconds": "arrival in the handler to the first step that emitted a token, once per request",
    "SpecQueueWaitSeconds": "time a request waited in the handler for room in the batch (max_batch_tokens)",
    "SpecGrammarMaskSecondsPerStep": "constrained requests: time in grammar masks per target pass, on average",
    "SpecPlannedDraftsPerRow": "drafts per row the planner gave a step (label batch_size: rows in the step); "
    "one step in PLAN_SAMPLE_EVERY",
}
# The histograms also counted into the config's buckets, and the counter that holds each one's.
BUCKET_COUNTERS = {
    "SpecRequestLatencySeconds": "SpecRequestLatencySecondsBucket",
    "SpecTimeToFirstTokenSeconds": "SpecTimeToFirstTokenSecondsBucket",
    "SpecQueueWaitSeconds": "SpecQueueWaitSecondsBucket",
}
LE_DIMENSION = "le"
POSITION_DIMENSION = "position"
BATCH_SIZE_DIMENSION = "batch_size"
DRAFTER_DIMENSION = "drafter"
# Metrics with a label of their own, passed before the ModelName and Level TorchServe appends.
LABELLED_METRICS = {
    "spec_decode_num_accepted_tokens_per_pos": POSITION_DIMENSION,
    "SpecDrafterDraftTokens": DRAFTER_DIMENSION,
    "SpecDrafterAcceptedTokens": DRAFTER_DIMENSION,
    "SpecPlannedDraftsPerRow": BATCH_SIZE_DIMENSION,
    **{bucket_counter: LE_DIMENSION for bucket_counter in BUCKET_COUNTERS.values()},
}
COUNT_UNIT = "Count"
SECONDS_UNIT = "Seconds"
BYTES_UNIT = "Bytes"
PERCENT_UNIT = "Percent"
# The cost gauges go out when either moved by this many points since they last went out.
COST_PERCENT_STEP = 5.0
# The planner's histogram takes one step in this many (a metric is one worker-log line: not every
# step); the drafting gauge goes out when it moved by DRAFTING_PERCENT_STEP points.
PLAN_SAMPLE_EVERY = 8
DRAFTING_PERCENT_STEP = 5.0


class MetricsRecorder:
    """Adds one request's figures to TorchServe's metrics cache; never fails a request."""

    def __init__(self, metrics_cache, latency_buckets_s: Sequence[float] = DEFAULT_LATENCY_BUCKETS_S) -> None:
        """Args: latency_buckets_s: the increasing upper bounds of `BUCKET_COUNTERS`' buckets; +Inf is added."""
        self.metrics = metrics_cache
        self.latency_buckets = [(bound, f"{bound:g}") for bound in latency_buckets_s] + [(math.inf, "+Inf")]

    def _add(self, name: str, value: float, unit: str, metric_type: MetricTypes, dimensions: Sequence = ()) -> None:
        if self.metrics is None:
            return
        try:
            # A fresh dimensions list each call: TorchServe appends the defaults to it.
            self.metrics.add_metric(name, value, unit, dimensions=list(dimensions), metric_type=metric_type)
        except Exception:  # metrics must never cost a request its answer
            logger.exception("could not record metric %s", name)

    def _observe(self, name: str, seconds: float) -> None:
        """One latency: into TorchServe's histogram, and into every bucket of `BUCKET_COUNTERS` it falls in."""
        self._add(name, seconds, SECONDS_UNIT, MetricTypes.HISTOGRAM)
        for bound, label in self.latency_buckets:
            if seconds <= bound:
                # Cumulative, as Prometheus' buckets are: le="60" counts every latency up to 60 s.
                self._add(BUCKET_COUNTERS[name], 1, COUNT_UNIT, MetricTypes.COUNTER, [Dimension(LE_DIMENSION, label)])

    def record_result(self, stats, latency_seconds: float) -> None:
        """One finished row's figures (a request, or one choice of an OpenAI request)."""
        counter, histogram = MetricTypes.COUNTER, MetricTypes.HISTOGRAM
        self._add("SpecRequests", 1, COUNT_UNIT, counter)
        self._add("SpecDraftTokens", stats.draft_tokens, COUNT_UNIT, counter)
        self._add("SpecAcceptedTokens", stats.accepted_tokens, COUNT_UNIT, counter)
        self._add("SpecGeneratedTokens", stats.completion_tokens, COUNT_UNIT, counter)
        self._add("SpecTargetForwardPasses", stats.target_forward_passes, COUNT_UNIT, counter)
        self._add("SpecDraftPasses", stats.draft_passes, COUNT_UNIT, counter)
        if stats.fell_back:
            self._add("SpecFallbacks", 1, COUNT_UNIT, counter)
        for drafter, num_drafted in stats.draft_tokens_by_drafter.items():
            label = [Dimension(DRAFTER_DIMENSION, drafter)]
            self._add("SpecDrafterDraftTokens", num_drafted, COUNT_UNIT, counter, label)
            num_accepted = stats.accepted_tokens_by_drafter.get(drafter, 0)
            self._add("SpecDrafterAcceptedTokens", num_accepted, COUNT_UNIT, counter, label)
        if stats.tree_steps:
            for name, value in (
                ("SpecTreeSteps", stats.tree_steps),
                ("SpecTreeNodes", stats.tree_nodes),
                ("SpecTreeAcceptedDepth", stats.tree_accepted_depth),
                ("SpecTreeOtherBranch", stats.tree_other_branch),
            ):
                self._add(name, value, COUNT_UNIT, counter)
        self._observe("SpecRequestLatencySeconds", latency_seconds)
        if stats.completion_tokens:
            self._add(
                "SpecTimePerOutputTokenSeconds", latency_seconds / stats.completion_tokens, SECONDS_UNIT, histogram
            )
        if stats.constrained:
            # Forced-token drafts are SpecDrafterDraftTokens{drafter="grammar"}.
            self._add("SpecConstrainedRequests", 1, COUNT_UNIT, counter)
            if stats.target_forward_passes:
                per_step = stats.mask_seconds / stats.target_forward_passes
                self._add("SpecGrammarMaskSecondsPerStep", per_step, SECONDS_UNIT, histogram)

    def record_time_to_first_token(self, seconds: float) -> None:
        """Once per request, all its choices together: arrival to the first step that emitted a token."""
        self._observe("SpecTimeToFirstTokenSeconds", seconds)

    def record_rejected(self) -> None:
        self._add("SpecRejectedRequests", 1, COUNT_UNIT, MetricTypes.COUNTER)

    def record_aborted(self) -> None:
        self._add("SpecAbortedRequests", 1, COUNT_UNIT, MetricTypes.COUNTER)

    def record_prefix_cache(self, num_queries: int, num_hits: int, num_evictions: int, num_bytes: int | None) -> None:
        """The prefix cache's figures since the last recording (`PrefixCacheTally`).

        Args:
            num_queries, num_hits: prompt tokens looked up, and found cached.
            num_evictions: cached token runs evicted.
            num_bytes: the bytes it holds now; None when unchanged.
        """
        for name, value in (
            ("prefix_cache_queries", num_queries),
            ("prefix_cache_hits", num_hits),
            ("SpecPrefixCacheEvictions", num_evictions),
        ):
            if value > 0:
                self._add(name, value, COUNT_UNIT, MetricTypes.COUNTER)
        if num_bytes is not None:
            self._add("SpecPrefixCacheBytes", num_bytes, BYTES_UNIT, MetricTypes.GAUGE)

    def record_response_store(self, num_responses: int, num_bytes: int, num_evictions: int) -> None:
        """The Responses store: the responses and bytes it holds, and its evictions since the last recording."""
        self._add("SpecResponsesStored", num_responses, COUNT_UNIT, MetricTypes.GAUGE)
        self._add("SpecResponsesStoreBytes", num_bytes, BYTES_UNIT, MetricTypes.GAUGE)
        if num_evictions > 0:
            self._add("SpecResponsesEvicted", num_evictions, COUNT_UNIT, MetricTypes.COUNTER)

    def record_suffix_tree(self, num_requests: int, num_tokens: int) -> None:
        """The suffix drafter's shared tree: the completions it holds, and their tokens."""
        self._add("SpecSuffixTreeRequests", num_requests, COUNT_UNIT, MetricTypes.GAUGE)
        self._add("SpecSuffixTreeTokens", num_tokens, COUNT_UNIT, MetricTypes.GAUGE)

    def record_cost_scales(self, target_percent: float, draft_percent: float) -> None:
        """The planner's running correction of its cost table (`handler.planning.cost_table.RunningCostTable`)."""
        self._add("SpecTargetCostPercent", round(target_percent, 1), PERCENT_UNIT, MetricTypes.GAUGE)
        self._add("SpecDraftCostPercent", round(draft_percent, 1), PERCENT_UNIT, MetricTypes.GAUGE)

    def record_plan(self, batch_size: int, drafts_per_row: float) -> None:
        """One step's plan: the drafts per row it verified, labelled by the step's batch size."""
        label = [Dimension(BATCH_SIZE_DIMENSION, str(batch_size))]
        self._add("SpecPlannedDraftsPerRow", round(drafts_per_row, 3), COUNT_UNIT, MetricTypes.HISTOGRAM, label)

    def record_drafting_rows(self, percent: float) -> None:
        self._add("SpecDraftingRowsPercent", round(percent, 1), PERCENT_UNIT, MetricTypes.GAUGE)

    def record_shared_vocabulary(self, percent: float) -> None:
        """A draft from another family: the share of its vocabulary that it can propose (`handler.vocab_map`)."""
        self._add("SpecDraftSharedVocabularyPercent", round(percent, 1), PERCENT_UNIT, MetricTypes.GAUGE)

    def record_batch_occupancy(self, num_requests: int) -> None:
        self._add("SpecBatchOccupancy", num_requests, COUNT_UNIT, MetricTypes.GAUGE)

    def record_queue_wait(self, seconds: float) -> None:
        self._observe("SpecQueueWaitSeconds", seconds)

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


class PrefixCacheTally:
    """Turns the engine's prefix-cache figures since start-up into what changed since the last recording.

    TorchServe's counters add what they are given, so each recording sends the
    increase of `queries`, `hits` and `evictions`; the gauge goes out when the
    bytes held changed (one worker-log line per metric: not every step).
    Nothing is sent while the cache is off.
    """

    def __init__(self) -> None:
        self.queries = self.hits = self.evictions = 0
        self.num_bytes: int | None = None

    def record(self, metrics: MetricsRecorder, stats) -> None:
        """Args: stats: `SpeculativeEngine.prefix_cache_stats`, a `PrefixCacheStats` or None (cache off)."""
        if stats is None:
            return
        metrics.record_prefix_cache(
            stats.queries - self.queries,
            stats.hits - self.hits,
            stats.evictions - self.evictions,
            None if stats.num_bytes == self.num_bytes else stats.num_bytes,
        )
        self.queries, self.hits = stats.queries, stats.hits
        self.evictions, self.num_bytes = stats.evictions, stats.num_bytes


class SuffixTreeTally:
    """Sends the suffix drafter's shared-tree size when it changed since the last recording."""

    def __init__(self) -> None:
        self.last = None

    def record(self, metrics: MetricsRecorder, stats) -> None:
        """Args: stats: `SpeculativeEngine.suffix_tree_stats`, a `SuffixTreeStats`."""
        if stats != self.last:
            metrics.record_suffix_tree(stats.num_requests, stats.num_tokens)
            self.last = stats


class ResponseStoreTally:
    """Sends the Responses store's size when it changed since the last recording, and its new evictions."""

    def __init__(self) -> None:
        self.last: tuple[int, int] | None = None
        self.evictions = 0

    def record(self, metrics: MetricsRecorder, store) -> None:
        """Args: store: a `handler.api.openai.responses.ResponseStore`."""
        size = (len(store), store.num_bytes)
        if size != self.last or store.num_evictions != self.evictions:
            metrics.record_response_store(*size, store.num_evictions - self.evictions)
            self.last, self.evictions = size, store.num_evictions


class CostScaleTally:
    """Sends the planner's cost correction when it moved by `COST_PERCENT_STEP` points or more.

    Where the table stands as measured (no table, or a GPU), nothing is sent.
    """

    def __init__(self) -> None:
        self.last: tuple[float, float] | None = None

    def record(self, metrics: MetricsRecorder, scales: tuple[float, float] | None) -> None:
        """Args: scales: `SpeculativeEngine.cost_scales`, (target, draft) observed / measured, or None."""
        if scales is None:
            return
        percents = (100.0 * scales[0], 100.0 * scales[1])
        if self.last is None or max(abs(new - old) for new, old in zip(percents, self.last)) >= COST_PERCENT_STEP:
            metrics.record_cost_scales(*percents)
            self.last = percents


class PlanTally:
    """Sends what the planner chose in the steps since the last recording, so that operators see it
    back off under load: a sample of the steps' drafts per row by batch size (a histogram), and the
    share of rows that drafted (a gauge, when it moved by `DRAFTING_PERCENT_STEP` points)."""

    def __init__(self) -> None:
        self.num_steps = 0
        self.percent: float | None = None

    def record(self, metrics: MetricsRecorder, num_steps: int, recent_steps: Sequence) -> None:
        """Args: num_steps: the engine's steps since start-up; recent_steps: its latest `StepRecord`s."""
        new = min(num_steps - self.num_steps, len(recent_steps))
        if new <= 0:
            return
        steps = list(recent_steps)[-new:]
        for number, step in enumerate(steps, num_steps - new):
            if number % PLAN_SAMPLE_EVERY == 0:
                metrics.record_plan(step.batch_size, sum(step.ks) / step.batch_size)
        drafting = sum(sum(k > 0 for k in step.ks) for step in steps)
        percent = 100.0 * drafting / sum(step.batch_size for step in steps)
        if self.percent is None or abs(percent - self.percent) >= DRAFTING_PERCENT_STEP:
            metrics.record_drafting_rows(percent)
            self.percent = percent
        self.num_steps = num_steps
