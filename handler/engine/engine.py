"""The engine: requests in, one speculative step at a time, tokens out (`SpeculativeEngine`).

A step runs admission (`handler.engine.admission`), the drafters' options (`handler.engine.propose`),
the plan (`handler.planning.planner`), the drafts, verifying (`handler.engine.verify`), and each
row's bookkeeping; the package's docstring has the order.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Callable, Hashable, Sequence

import torch

from handler import runners
from handler.caches.prefix_cache import PrefixCache, PrefixCacheStats
from handler.drafters import DRAFTERS, MODEL, MODEL_FREE, SUFFIX, Drafter
from handler.drafters.model import ModelDrafter
from handler.drafters.suffix import SuffixDrafter, SuffixTreeStats
from handler.engine.admission import Batch
from handler.engine.propose import DraftTimes, Proposer
from handler.engine.record import StepLog
from handler.engine.row import Row
from handler.engine.verify import PlainLaunch, StepUniforms, Verified, Verifier
from handler.planning.acceptance import SUFFIX_ESTIMATES
from handler.planning.cost_table import RunningCostTable
from handler.planning.planner import NO_DRAFTS_TO_VERIFY, Planner, StepPlan
from handler.runtime.loading import LoadedModels
from handler.sampler import SamplingBatch, host_to_device
from handler.types import DrafterName, GenerationRequest, GenerationResult, StepOutput

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """Knobs that only benchmarks and tests turn; a served engine takes the defaults."""

    # Propose the tokens a constraint forces as drafts (off only to measure what they bring).
    grammar_drafts: bool = True
    # "tree": the planner takes a suffix look-up's tree probabilities as its acceptance per
    # position; "tracker": the row's running acceptance, as for n-grams.
    suffix_estimate: str = "tree"
    # On a CPU, rescale the cost table by the passes the engine times
    # (`handler.planning.cost_table.RunningCostTable`); False: the table stands as given.
    running_costs: bool = True
    # A drafting row takes its first token from the logits after its prompt, as plain decoding does
    # (`handler.engine.admission.Batch.admit`); False: its first step verifies drafts after the
    # prompt's last token, so that the first output positions come out of a speculative step (the
    # distribution tests sample those, where a request's first drafts are all its drafts).
    first_token_from_prefill: bool = True
    # Plain steps over rows without rules launch their pass and read the one before it while it runs
    # (`SpeculativeEngine.step`): the host's bookkeeping under the device's pass. None: where the
    # device runs behind the host (CUDA); on a CPU the pass is the host's own time, and nothing overlaps.
    overlap_plain_steps: bool | None = None

    def __post_init__(self) -> None:
        assert self.suffix_estimate in SUFFIX_ESTIMATES, self.suffix_estimate


@dataclasses.dataclass(frozen=True)
class EngineParts:
    """What an engine runs with, built once from its settings (`handler.engine.build`)."""

    # The pair, its tokenizer and special tokens, and the map between vocabularies of a draft from
    # another family (`handler.vocab_map`).
    models: LoadedModels
    target_runner: runners.ModelRunner
    # Every drafter by name (`handler.drafters.Drafter`); the model's only with a draft model.
    drafters: dict[str, Drafter]
    prefix_cache: PrefixCache | None  # the target's; the model drafter holds the draft's
    # Prices each step with the cost table (None: every row drafts its cap), from the estimates.
    planner: Planner
    trees: bool  # whether look-ups may propose trees: the target's attention takes their mask
    default_drafter: str  # the drafter of requests that name none
    prompt_lookup_num_tokens: int  # the most drafts one look-up proposes (0: the request's k)
    options: EngineOptions


class SpeculativeEngine:
    """Lossless speculative decoding of a target Hugging Face causal LM, with pluggable drafters.

    Built by `handler.engine.build` (`build_engine`, `engine_from_config`), which turns the config's
    settings and the loaded models into the parts (`EngineParts`); the engine wires its step from them.
    """

    def __init__(self, parts: EngineParts) -> None:
        models = parts.models
        self.target = models.target
        self.tokenizer = models.tokenizer
        self.eos_token_ids = frozenset(models.eos_token_ids)
        self.pad_token_id = models.pad_token_id
        self.device = next(self.target.parameters()).device
        self.vocab_size = self.target.config.get_text_config().vocab_size
        self.vocab_map = models.vocab_map
        self.target_runner = parts.target_runner
        self.runner_kind = parts.target_runner.kind
        self.planner = parts.planner
        self.estimates = parts.planner.estimates
        self.cost_table = parts.planner.cost_table
        # Where the engine times its passes, it also checks the plan's choice to draft against plain
        # decoding as the steps ran (`handler.planning.trackers.OutcomeCheck`).
        self.outcome_check = parts.planner.outcome_check
        self.drafter_map = parts.drafters
        self.batch = Batch(
            self.target,
            self.target_runner,
            parts.prefix_cache,
            self.pad_token_id,
            self.drafter_map,
            first_token_from_prefill=parts.options.first_token_from_prefill,
        )
        self.trees = parts.trees
        self.proposer = Proposer(
            self.drafter_map,
            self.planner,
            trees=self.trees,
            prompt_lookup_num_tokens=parts.prompt_lookup_num_tokens,
            grammar_drafts=parts.options.grammar_drafts,
        )
        self.drafters = DRAFTERS if MODEL in self.drafter_map else MODEL_FREE  # the names a request may pick
        self.default_drafter = parts.default_drafter
        assert self.default_drafter in self.drafters, (self.default_drafter, self.drafters)
        self.verifier = Verifier(
            self.batch, self.cost_table, vocab_size=self.vocab_size, pad_token_id=self.pad_token_id, device=self.device
        )
        self.steps = StepLog(self.outcome_check)
        overlap = parts.options.overlap_plain_steps
        self.overlap_plain_steps = self.device.type == "cuda" if overlap is None else overlap
        self._in_flight: _InFlight | None = None  # a plain step launched and not yet read
        self.num_overlapped_steps = 0  # plain steps launched before the one before them was read
        self._sampling_of: tuple[int, SamplingBatch] | None = None  # the batch's settings, by `Batch.version`

    @property
    def model_drafter(self) -> ModelDrafter | None:
        return self.drafter_map.get(MODEL)

    @property
    def suffix_drafter(self) -> SuffixDrafter:
        return self.drafter_map[SUFFIX]

    @property
    def prefix_cache(self):
        return self.batch.prefix_cache

    @property
    def rows(self) -> list[Row]:
        """The rows in flight, in the target cache's row order."""
        return self.batch.rows

    @property
    def target_cache(self) -> runners.BatchCache | None:
        return self.batch.cache

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        """Since start-up: prompt tokens queried and found in the target's prefix cache; both caches' size."""
        return self.batch.prefix_cache_stats()

    @property
    def suffix_tree_stats(self) -> SuffixTreeStats:
        """The size of the suffix drafter's tree of recent outputs, shared across requests."""
        self.batch.flush_observed()
        return self.suffix_drafter.stats

    @property
    def cost_scales(self) -> tuple[float, float] | None:
        """(target, draft): the passes timed while serving over the cost table's figures; None
        where the table stands as given (no table, a GPU, or `running_costs` off)."""
        if not isinstance(self.cost_table, RunningCostTable):
            return None
        return self.cost_table.target_scale, self.cost_table.draft_scale

    def forget_suffix_history(self) -> None:
        """Starts the suffix drafter's trees afresh, as at start-up (a benchmark's rows each start cold).

        What the engine learnt of the look-ups stays (the outcome check's verdicts, the suffix's
        calibrations): a benchmark that forgets the trees before its measures forgets them before its
        warm-ups too (`scripts.bench.load`), so that what it learnt there is of look-ups as cold as those
        it measures."""
        assert not self.has_unfinished_requests(), "only between requests"
        fresh = SuffixDrafter(self.suffix_drafter.options)
        if self.model_drafter is not None and self.model_drafter.guesser is self.suffix_drafter:
            self.model_drafter.guesser = fresh
        self.drafter_map[SUFFIX] = fresh

    # ----------------------------------------------------------------- requests

    def add_request(self, request_id: Hashable, request: GenerationRequest) -> None:
        """Queues a request; it is prefilled and joins the batch at the next `step`."""
        if self.batch.holds(request_id):
            raise ValueError(f"request id {request_id!r} is already in flight")
        drafter = request.drafter or self.default_drafter
        if drafter not in self.drafters:
            raise ValueError(f"drafter: {drafter!r} is not available here; choose one of {', '.join(self.drafters)}")
        drafter = DrafterName(drafter)
        if request.suffix_share_across_requests and not self.suffix_drafter.options.share_across_requests:
            raise ValueError(
                "suffix_share_across_requests: this server keeps each request's text to itself "
                "(suffix_share_across_requests: false in model-config.yaml); a request can only opt out"
            )
        assert request.prompt_ids, "a request needs at least one prompt token"
        row = Row.start(request_id, request, drafter, self.tokenizer, self.eos_token_ids, self.vocab_size, self.device)
        self.batch.queue(row)

    def abort_request(self, request_id: Hashable) -> None:
        """Frees the request's row at the next `step`; it produces no more output."""
        self.batch.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.batch.rows or self.batch.waiting)

    @property
    def num_active_requests(self) -> int:
        return len(self.batch.rows) + len(self.batch.waiting)

    # --------------------------------------------------------------------- step

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """Runs one speculative step over every request in flight.

        A plain step over rows without rules may be launched and read in the next call
        (`overlap_plain_steps`): the next plain step's pass then runs behind it, from its tokens on the
        device, while the host reads and commits it (`_step_behind`). Its tokens come out one call late.

        Returns:
            one StepOutput per request that was in the step (or in the step read now), in batch order.
        """
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None and self._continues(in_flight):
            return self._step_behind(in_flight)
        landed = self._land(in_flight) if in_flight is not None else []
        self.batch.drop_aborted()
        admitted = time.perf_counter()
        first_outputs = _joined(landed, self._admit())
        if not self.rows:
            return first_outputs
        rows = self.rows
        started = time.perf_counter()
        mask_seconds_before = sum([row.stats.mask_seconds for row in rows])
        sampling = self._batch_sampling()
        plan = self._plan(rows, sampling)
        if plan.width == 0 and _lean(rows):
            # A plain step: the target's pass and draws alone, as the plain engine's. Overlapped, it is
            # read in the next call; else now.
            pending = [[(row.token_ids or row.request.prompt_ids)[-1]] for row in rows]
            input_ids = host_to_device(torch.tensor(pending), self.device)
            launched = self._launch(rows, plan, sampling, input_ids, admitted, started, lag=0)
            # A penalised row's history is committed on the host: its step is read now, not behind the next.
            if self.overlap_plain_steps and not any([row.shapes_logits for row in rows]):
                self._in_flight = launched
                return first_outputs
            return _joined(first_outputs, self._land(launched))
        uniforms = StepUniforms.draw(rows, plan.ks)
        drafts, times = self.proposer.draft(rows, plan, sampling.with_uniforms(uniforms.draft))
        verified = self.verifier(rows, drafts, uniforms, sampling)
        outputs = self._commit(
            rows, plan, drafts, verified, times, self.verifier.seconds, mask_seconds_before, admitted, started
        )
        return _joined(first_outputs, outputs)

    def generate(
        self,
        requests: Sequence[GenerationRequest],
        on_tokens: Callable[[int, list[int], StepOutput], None] | None = None,
    ) -> list[GenerationResult]:
        """Runs the requests to completion in one batch and returns their results in order.

        Args:
            requests: the batch; each has its own k, sampling settings, seed and drafter.
            on_tokens: optional callback (request index, new token ids, step output) after
                every step that emitted tokens for that request.
        """
        assert not self.has_unfinished_requests(), "generate() needs an idle engine"
        keys = [object() for _ in requests]
        index_of = {key: index for index, key in enumerate(keys)}
        for key, request in zip(keys, requests):
            self.add_request(key, request)
        results: list[GenerationResult | None] = [None] * len(requests)
        try:
            while self.has_unfinished_requests():
                for output in self.step():
                    index = index_of[output.request_id]
                    if on_tokens is not None and output.new_token_ids:
                        on_tokens(index, output.new_token_ids, output)
                    if output.result is not None:
                        results[index] = output.result
        except BaseException:
            self.reset()
            raise
        return results

    def reset(self) -> None:
        """Drops every request in flight, e.g. after a failed step left the caches undefined."""
        self._in_flight = None
        self.batch.clear()

    # ---------------------------------------------------------------- internals

    def _commit(
        self,
        rows: list[Row],
        plan: StepPlan,
        drafts: list,
        verified: Verified,
        times: DraftTimes,
        verify_seconds: float,
        mask_seconds_before: float | None,
        admitted: float,
        started: float,
        ended: float | None = None,
        landing: bool = False,
    ) -> list[StepOutput]:
        """Each row's bookkeeping after its step's read: its tokens emitted, the estimates, the caches
        rolled back, the drafters' notes, finished rows dropped, the step's record (`mask_seconds_before`:
        the rows' time in grammar masks before the step; None: none has a grammar). A launched step's
        rows (`_land`) may have left the batch or been aborted since: they are skipped."""
        outputs, finished, committed = [], [], {}
        for slot, row in enumerate(rows):
            if landing and (row.finish_reason is not None or row.request_id in self.batch.aborted):
                continue
            row_plan, row_drafts = plan.rows[slot], drafts[slot]
            accepted, path = verified.num_accepted[slot], verified.paths[slot]
            row.stats.record(row_plan.drafter, row_drafts.k, accepted)
            row.steps_without_drafts = 0 if row_drafts.k else row.steps_without_drafts + 1
            self.estimates.learn(row, row_plan, row_drafts, accepted, path)
            output = row.emit(verified.emitted[slot][: accepted + 1], verified.row_logits(row, slot), path)
            output.num_draft_tokens, output.num_accepted_tokens = row_drafts.k, accepted
            committed[row.request_id] = output.new_token_ids
            outputs.append(output)
            if row.finish_reason is not None:
                finished.append(row)
        ks = [row_drafts.k for row_drafts in drafts]
        if not landing:  # a launched step is plain: its rows keep their whole chunk
            self.batch.rollback(ks, verified.num_accepted, verified.paths)
        self.batch.observe(committed, drafted=any(ks))
        self.batch.drop(finished)
        mask_seconds = 0.0
        if mask_seconds_before is not None:
            mask_seconds = sum([row.stats.mask_seconds for row in rows]) - mask_seconds_before
        self.steps.record(plan, ks, times, verify_seconds, mask_seconds, outputs, admitted, started, ended)
        return outputs

    def _continues(self, in_flight: _InFlight) -> bool:
        """Whether this step launches behind the one in flight: no request joined or left since its launch
        or waits to, overlap is on and every row may (`_lean`), and the step is plain without planning (no row
        drafts, or a plain streak's)."""
        batch = self.batch
        if batch.version != in_flight.version or batch.waiting or batch.aborted:
            return False
        if not self.overlap_plain_steps or not _lean(batch.rows, lag=1):
            return False
        if _never_draft(batch.rows):
            return True
        streak = self.planner.plain_streak
        return streak is not None and streak.skips(batch.version)

    def _launch(
        self,
        rows: list[Row],
        plan: StepPlan,
        sampling: SamplingBatch,
        input_ids: torch.Tensor,
        admitted: float,
        started: float,
        lag: int,
    ) -> _InFlight:
        """Launches a plain step over the rows from `input_ids` [batch, 1] (their pending tokens), to be read
        later (`_land`); `plan`: its plan, plain (the planner's, for the step's record and the
        estimates); `lag`: each row's tokens in flight before it."""
        drafts, _ = self.proposer.draft(rows, plan, sampling)  # a plain plan's: none, nothing runs
        uniforms = StepUniforms.draw(rows, plan.ks, lag=lag)
        launch = self.verifier.launch_plain(rows, uniforms, sampling, input_ids)
        return _InFlight(list(rows), self.batch.version, plan, drafts, launch, admitted, started)

    def _step_behind(self, in_flight: _InFlight) -> list[StepOutput]:
        """A plain step launched from the tokens of the one in flight, still on the device; that one is
        then read and committed while this one's pass runs. Returns the step read."""
        started = time.perf_counter()
        rows = self.rows
        sampling = self._batch_sampling()
        plan = StepPlan.plain(len(rows))  # as a plain streak's skip plans it
        launched = self._launch(rows, plan, sampling, in_flight.launch.next_ids, started, started, lag=1)
        self.num_overlapped_steps += 1
        outputs = self._land(in_flight, ended=started)
        # Where every row finished in the step read, nothing of this one is read.
        self._in_flight = launched if self.rows else None
        return outputs

    def _land(self, in_flight: _InFlight, ended: float | None = None) -> list[StepOutput]:
        """Reads a launched step and commits it (`ended`: when the step behind it began, its own end)."""
        rows, plan, drafts = in_flight.rows, in_flight.plan, in_flight.drafts
        verified = in_flight.launch.read()
        seconds = in_flight.launch.seconds
        return self._commit(
            rows,
            plan,
            drafts,
            verified,
            DraftTimes(),
            seconds,
            None,
            in_flight.admitted,
            in_flight.started,
            ended,
            landing=True,
        )

    def _batch_sampling(self) -> SamplingBatch:
        """The batch's rows' sampling settings, built again only where rows joined or left since
        (`Batch.version`): each step's were the same objects, and a sampled batch's tensors of them
        (four copies to the device) are then made once, not each step."""
        version = self.batch.version
        if self._sampling_of is None or self._sampling_of[0] != version:
            params = [row.request.sampling for row in self.batch.rows]
            self._sampling_of = (version, SamplingBatch.from_params(params, self.device))
        return self._sampling_of[1]

    def _plan(self, rows: list[Row], sampling: SamplingBatch) -> StepPlan:
        """The step's plan: from the drafters' options, or plain without asking them where the plans
        before it priced drafting well below plain decoding (`PlainStreak`): such a step is a plain step."""
        if _never_draft(rows):
            return StepPlan.plain(len(rows))  # nothing to ask or to price
        streak = self.planner.plain_streak
        if streak is not None and streak.skips(self.batch.version):
            return StepPlan.plain(len(rows))
        started = time.perf_counter()
        self.batch.flush_observed()  # the drafters see every committed token before they are asked
        plan = self.planner.plan(rows, self.proposer.options(rows, sampling), self.steps.num_steps)
        if streak is not None:
            share = (time.perf_counter() - started) / self.planner.pass_seconds(len(rows), 0, 0.0)
            # A grammar's forced tokens are certain drafts: a constrained row plans every step.
            gain = plan.drafting_gain if all(row.grammar is None for row in rows) else math.inf
            streak.planned(self.batch.version, gain, share)
        return plan

    def _admit(self) -> list[StepOutput]:
        """Admits the waiting requests (`Batch.admit`) and emits each one's first token from the logits
        after its prompt (a step with k = 0), as plain decoding does: one target pass per token for
        a row that never drafts, as `generate` makes, and a drafting row's first step then verifies
        drafts after its first token. A row that finishes on its first token leaves.

        Returns:
            one StepOutput per request admitted, its first token.
        """
        if not self.batch.waiting:
            return []
        admitted, first_logits = self.batch.admit()
        if not admitted:
            return []
        plan = StepPlan.plain(len(admitted))
        drafts = [NO_DRAFTS_TO_VERIFY] * len(admitted)
        sampling = SamplingBatch.from_params([row.request.sampling for row in admitted], self.device)
        uniforms = StepUniforms.draw(admitted, plan.ks)
        verified = self.verifier(admitted, drafts, uniforms, sampling, logits=first_logits)
        outputs, committed = [], {}
        for slot, row in enumerate(admitted):
            row.stats.record(row.drafter, 0, 0)  # the prefill was its first target pass
            output = row.emit(verified.emitted[slot][:1], verified.row_logits(row, slot), verified.paths[slot])
            outputs.append(output)
            if row.request.num_speculative_tokens > 0:
                committed[row.request_id] = output.new_token_ids
        if committed:
            self.batch.observe(committed, drafted=False)
        self.batch.drop([row for row in admitted if row.finish_reason is not None])
        return outputs


@dataclasses.dataclass(frozen=True)
class _InFlight:
    """A plain step launched and not yet read (`SpeculativeEngine._launch`)."""

    rows: list[Row]  # the step's rows, in batch order at its launch
    version: int  # the batch's `version` then
    plan: StepPlan  # its plan: plain
    drafts: list  # each row's `Drafts` under it: none
    launch: PlainLaunch
    admitted: float  # when its call began
    started: float  # when its own work began


def _never_draft(rows: list[Row]) -> bool:
    """Whether every row asks k = 0: no step over them may draft."""
    return all([row.request.num_speculative_tokens == 0 for row in rows])


def _lean(rows: list[Row], lag: int = 0) -> bool:
    """Whether a plain step over `rows` may be launched and read later (`Verifier.launch_plain`), `lag`
    tokens of each row still unread: none has a grammar (its masks are the host's) or, with tokens in
    flight, a logit bias or penalties (their history is committed on the host: it would lag them), none
    reports log-probabilities (read from the logits, which would wait for the passes behind them), and
    each has room for a token more than those in flight."""
    return all(
        [
            (not row.shapes_logits or (lag == 0 and row.grammar is None))
            and row.logprobs is None
            and row.remaining > lag
            for row in rows
        ]
    )


def _joined(first: list[StepOutput], outputs: list[StepOutput]) -> list[StepOutput]:
    """A step's outputs with the first tokens of the rows admitted at its start: one output per request."""
    if not first:
        return outputs
    by_id = {output.request_id: output for output in first}
    for output in outputs:
        joined = by_id.pop(output.request_id, None)
        if joined is not None:
            output.new_token_ids = [*joined.new_token_ids, *output.new_token_ids]
    return [*by_id.values(), *outputs]  # rows that finished on their first token, then the step's
