"""The speculative decoding engine, one step at a time: draft -> verify -> accept -> roll back.

Vocabulary (draft, target, accepted, recovered, bonus) is defined in
`handler.sampler`. The engine serves a changing batch of requests:

- `add_request` queues a request; at the next `step` its prompt, all but the
  last token, is prefilled in a cache of its own and its row joins the
  running batch. `abort_request` frees a row at the next step.
- `step` runs one speculative step over every row in flight: each row's
  drafter proposes (a draft model, an n-gram look-up, or the look-up with the
  model as fallback), the target verifies all drafts in one forward pass over
  the new tokens only, the rejection sampler (for a seeded request, the
  coupling) decides, and both caches roll back to the committed length. A
  finished row leaves at once.
- After its prefill a row always has exactly one pending target token: the
  last committed one, which the target has not processed yet. The draft model
  has its own pending tokens (see `handler.drafter_model`).
- `generate(requests)` is the static batch: add all, step until done.

How many drafts a step verifies: each row has a cap (its request's k, the
tokens it may still emit, what its look-up found). With a measured cost table,
every row follows the k that maximises the batch's expected tokens per second,
which can be 0 (plain decoding) when nothing wins. A seeded sampled request is
verified by coupling (`handler.sampler.coupled_verify`): its output depends on
its seed and the target alone, so neither the plan nor the rows beside it can
change it.

Nothing here imports TorchServe.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import time
from typing import Callable, Hashable, Sequence

import torch

from handler import runners
from handler.adaptive import (
    MIN_STEPS_BEFORE_FALLBACK,
    POOL_DECAY,
    PROBE_INTERVAL,
    AcceptanceTracker,
    BatchPlan,
    BranchCalibration,
    ConfidenceCalibration,
    ConfidenceStop,
    GuessRate,
    Offer,
    OutcomeCheck,
    batch_bucket,
    chain_expected_tokens,
    choose_runners_up,
    plan_batch,
)
from handler.config import SPECULATIVE_TREE_MODES, HandlerConfig
from handler.constraints import RowGrammar, compiler_for
from handler.cost_table import RunningCostTable
from handler.drafters import DRAFTERS, HYBRID, MODEL, MODEL_FREE, NGRAM, NO_LOOKUP, SUFFIX, TLI, Lookup
from handler.drafters.cross_vocab import CrossVocabDrafter
from handler.drafters.hybrid import Candidate, choose
from handler.drafters.model import ModelDrafter, Proposal
from handler.drafters.ngram import NgramDrafter
from handler.drafters.suffix import SuffixDrafter, SuffixOptions, SuffixTreeStats
from handler.kv_cache import kv_bytes_per_token, tree_attention_error
from handler.logits_processors import process_row_logits, token_counts, token_mask
from handler.memory_budget import prefix_cache_budget
from handler.prefix_cache import PrefixCache, PrefixCacheStats, prefill_with_cache
from handler.rollback import target_lengths_after_verify
from handler.sampler import (
    coupled_verify,
    draw_step_uniforms,
    position_uniforms,
    rejection_sample,
    warp_logits_to_probs,
)
from handler.schema import FINISH_EOS, FINISH_LENGTH, FINISH_STOP
from handler.stopping import StopChecker
from handler.tree import (
    ROOT,
    chain_with_siblings,
    chunk_attention,
    depths,
    first_choice_path,
    off_first_choice,
    order_best_first,
    verify_tree,
)

# The request's types live in handler.types (torch-free); they are named here as before.
from handler.types import (  # noqa: F401 - re-exported
    GenerationRequest,
    GenerationResult,
    SpeculativeStats,
    StepOutput,
    TokenLogprob,
)

logger = logging.getLogger(__name__)

DRAFTER_MODEL, DRAFTER_NGRAM, DRAFTER_SUFFIX, DRAFTER_HYBRID = MODEL, NGRAM, SUFFIX, HYBRID
DEFAULT_SUFFIX_OPTIONS = SuffixOptions()
# How the planner estimates a suffix look-up's acceptance per position: from the tree's
# probabilities, or from the row's running acceptance tracker like the other drafters.
SUFFIX_ESTIMATES = ("tree", "tracker")
# Not a drafter a request picks: the tokens a constraint's grammar forces, proposed as drafts.
PROPOSER_GRAMMAR = "grammar"
# Step records the engine keeps for its metrics (`recent_steps`).
RECENT_STEPS = 64


@dataclasses.dataclass(frozen=True)
class _Options:
    """What one row can draft this step (`SpeculativeEngine._proposals`), before the plan picks."""

    lookup: Lookup  # its best look-up, best first (NO_LOOKUP: none)
    lookup_proposer: str | None  # who proposed it (None: no look-up drafts for this row)
    lookup_curve: list[float]  # E(0..n) over its first n drafts
    chain: Lookup | None  # a tree look-up's first-choice chain, and its E(0..n); None for a chain
    chain_curve: list[float] | None
    model_curve: list[float] | None  # E(0..cap) with the draft model; None: the model does not draft for it
    guesses: GuessRate | None  # its model drafts' guess rate (guessed drafting), else None

    def offer(self) -> Offer:
        return Offer(
            lookup=self.chain_curve if self.chain is not None else self.lookup_curve,
            tree=self.lookup_curve if self.chain is not None else None,
            model=self.model_curve or (1.0,),
            passes=None if self.guesses is None else self.guesses.passes,
        )

    def pick(self, uses_model: bool, trees: bool) -> tuple[str, Lookup, list[float]]:
        """The proposer, look-up (NO_LOOKUP for the model) and E(0..n) the plan chose."""
        if uses_model or self.lookup_proposer is None:
            return MODEL, NO_LOOKUP, self.model_curve or [1.0]
        if self.chain is not None and not trees:
            return self.lookup_proposer, self.chain, self.chain_curve
        return self.lookup_proposer, self.lookup, self.lookup_curve


@dataclasses.dataclass
class _ModelDrafts:
    """What the draft model drafted for one row this step, for the calibrations."""

    confidences: list[float]  # the draft's confidence in each draft of its chain
    # Chain position -> the runner-up's share of what the draft left to other tokens there, for the
    # positions whose runner-up joined the tree as a sibling.
    runner_up_shares: dict[int, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """What one step ran: the plan's outcome and where its time went (metrics, `scripts.bench_load`)."""

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


def unseeded_generator() -> torch.Generator:
    """The generator of an unseeded sampled request: seeded from the operating system's entropy."""
    generator = torch.Generator()
    generator.seed()
    return generator


class _Row:
    """One request in flight: emitted tokens, stop conditions, counters, its random stream."""

    def __init__(self, request_id: Hashable, request: GenerationRequest, drafter: str, tokenizer, eos_token_ids):
        self.request_id = request_id
        self.request = request
        self.drafter = drafter
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.token_ids: list[int] = []
        self.text = ""
        self.stop_checker = StopChecker(tokenizer, request.stop) if request.stop else None
        self.finish_reason: str | None = None
        self.logprobs: list[TokenLogprob] | None = [] if request.logprobs is not None else None
        self.trackers = {name: AcceptanceTracker() for name in (MODEL, NGRAM, SUFFIX, PROPOSER_GRAMMAR)}
        self.grammar: RowGrammar | None = None  # set by the engine for a constrained request
        # Penalties' history (set by the engine when the request has penalties): counts of the
        # generated tokens, and which tokens the prompt or the output holds.
        self.output_counts: torch.Tensor | None = None  # [vocab] float
        self.seen: torch.Tensor | None = None  # [vocab] bool
        self.drafted: list[int] = []  # the draft model's drafts so far in this step (penalties)
        self.cached_tokens = 0  # prompt tokens found in the target's prefix cache
        self.prefix_handle = None  # the target prefix-cache node this row keeps locked
        self.steps_without_drafts = 0
        self.guess_rate = GuessRate()  # its model drafts that came free (guessed drafting)
        self.stats = SpeculativeStats(
            num_speculative_tokens=request.num_speculative_tokens, drafter=drafter, constrained=bool(request.constraint)
        )
        # A seeded sampled row is coupled: each output position has its own uniform, keyed by the
        # seed (`position_uniforms`). An unseeded one draws a step's uniforms from its generator.
        self.coupled = not request.sampling.is_greedy and request.seed is not None
        self.generator = None
        if not request.sampling.is_greedy and request.seed is None:
            self.generator = unseeded_generator()

    @property
    def remaining(self) -> int:
        return self.request.max_new_tokens - len(self.token_ids)

    def cap(self) -> int:
        """The most drafts this row may verify now: its k, and never past max_new_tokens."""
        return self._within_max_new_tokens(self.request.num_speculative_tokens)

    def lookup_cap(self, lookup_num_tokens: int) -> int:
        """The most look-up drafts this row may verify now: `lookup_num_tokens` (0: its k), none when its k is 0."""
        k = self.request.num_speculative_tokens
        return self._within_max_new_tokens(lookup_num_tokens if k and lookup_num_tokens else k)

    def _within_max_new_tokens(self, num_drafts: int) -> int:
        # The verify pass emits up to num_drafts + 1 tokens and must stay inside max_new_tokens.
        return max(0, min(num_drafts, self.remaining - 1))

    def extend(self, new_token_ids: Sequence[int]) -> list[int]:
        """Appends tokens one by one until a stop condition; returns those kept."""
        kept = []
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            kept.append(token_id)
            if token_id in self.eos_token_ids:
                self.finish_reason = FINISH_EOS
            elif self.request.stop and self._hit_stop_string():
                self.finish_reason = FINISH_STOP
            elif self.remaining == 0:
                self.finish_reason = FINISH_LENGTH
            if self.finish_reason is not None:
                break
        self.stats.completion_tokens = len(self.token_ids)
        return kept

    @property
    def shapes_logits(self) -> bool:
        """Whether a rule changes this row's logits: a grammar, a logit bias or a penalty."""
        return self.grammar is not None or self.request.sampling.processes_logits

    def shape_draft_logits(self, logits: torch.Tensor, previous_draft: int | None) -> torch.Tensor:  # [vocab]
        """The draft model's logits for this row's next draft, shaped as the target's will be."""
        if previous_draft is not None:
            self.drafted.append(previous_draft)
        if self.request.sampling.processes_logits:
            counts, seen = self.output_counts, self.seen
            if self.drafted and counts is not None:
                counts = counts + token_counts(self.drafted, counts.shape[0], counts.device)
            if self.drafted and seen is not None:
                seen = seen | token_mask(self.drafted, seen.shape[0], seen.device)
            logits = process_row_logits(logits[None], self.request.sampling, counts, seen, [])[0]
        if self.grammar is not None:
            mask = self.grammar_call("draft_mask", previous_draft)  # [vocab]
            logits = logits.masked_fill(~mask.to(logits.device), float("-inf"))
        return logits

    def end_drafting(self) -> None:
        self.drafted = []
        if self.grammar is not None:
            self.grammar_call("end_drafting")

    def commit(self, kept: list[int]) -> None:
        """Moves the rules' state past the tokens this step emitted."""
        if self.grammar is not None and self.finish_reason is None:
            self.grammar_call("commit", kept)
        if self.output_counts is not None:
            self.output_counts += token_counts(kept, self.output_counts.shape[0], self.output_counts.device)
        if self.seen is not None:
            self.seen |= token_mask(kept, self.seen.shape[0], self.seen.device)

    def grammar_call(self, method: str, *args):
        """Calls the row's grammar, counting the time in its masks."""
        started = time.perf_counter()
        try:
            return getattr(self.grammar, method)(*args)
        finally:
            self.stats.mask_seconds += time.perf_counter() - started

    def _hit_stop_string(self) -> bool:
        match = self.stop_checker.add_token(self.token_ids[-1])
        if match is None:
            return False
        self.text = match.text
        return True

    def result(self) -> GenerationResult:
        assert self.finish_reason is not None
        if self.finish_reason != FINISH_STOP:
            self.text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        return GenerationResult(
            token_ids=list(self.token_ids),
            text=self.text,
            finish_reason=self.finish_reason,
            prompt_tokens=len(self.request.prompt_ids),
            stats=self.stats,
            logprobs=self.logprobs,
            cached_tokens=self.cached_tokens,
        )


class SpeculativeEngine:
    """Lossless speculative decoding of a target Hugging Face causal LM, with pluggable drafters."""

    def __init__(
        self,
        target,
        draft,
        tokenizer,
        eos_token_ids: Sequence[int],
        pad_token_id: int = 0,
        *,
        default_drafter: str | None = None,
        cost_table=None,
        prompt_lookup_min: int = 1,
        prompt_lookup_max: int = 4,
        prompt_lookup_num_tokens: int = 0,
        grammar_drafts: bool = True,
        prefix_cache_max_bytes: int | None = None,
        suffix: SuffixOptions = DEFAULT_SUFFIX_OPTIONS,
        suffix_estimate: str = "tree",
        speculative_tree: str = "auto",
        draft_confidence: bool = False,
        draft_guesses: bool = False,
        running_costs: bool = True,
        runner: str | None = None,
        vocab_map=None,
        cross_vocab_greedy: str = TLI,
    ) -> None:
        """
        Args:
            target: the model whose output distribution is kept.
            draft: the draft model, or None when only the n-gram drafter is served.
            default_drafter: the drafter of requests that name none; "model" when a draft
                model is given, else "ngram".
            cost_table: measured forward-pass costs (`handler.cost_table.CostTable`, or any
                object with `target_seconds(batch_size, width)` and `draft_seconds(batch_size)`).
                When given, each step's k is planned for the batch; else every row drafts its cap.
            prompt_lookup_min, prompt_lookup_max: the n-gram drafter's suffix lengths.
            prompt_lookup_num_tokens: the most drafts one look-up proposes; 0 = the request's k.
                A look-up costs no draft pass, only verify width, so it may exceed k.
            grammar_drafts: propose the tokens a constraint forces as drafts (off only to
                measure what they bring).
            prefix_cache_max_bytes: keep the KV of earlier prompts and completions, up to this
                many bytes for both models together (`handler.prefix_cache`); None: no prefix cache.
            suffix: the suffix drafter's trees (`handler.drafters.suffix`).
            suffix_estimate: "tree": the planner takes a suffix look-up's tree probabilities as
                its acceptance per position; "tracker": the row's running acceptance, as for n-grams.
            speculative_tree: "auto": look-ups propose trees of candidates (`handler.tree`) where
                the target accepts a custom 4D attention mask with its cache, checked here; "off":
                chains only.
            draft_confidence: with a cost table, the draft model drafts up to its rows' k and stops
                where the draft's calibrated confidence says one more draft does not pay
                (`handler.adaptive.ConfidenceStop`); False: it drafts the planned k.
            draft_guesses: where a hybrid row drafts with the model, its suffix trees guess the
                draft model's next drafts, and one draft pass checks them all (`handler.drafters`,
                guessed drafting); the drafts stay the draft model's own.
            running_costs: on a CPU, rescale the cost table by the passes the engine times
                (`handler.cost_table.RunningCostTable`); False: the table stands as given.
            runner: "dynamic" or "static", how both models hold the running batch's KV and run
                their passes (`handler.runners`); None: `handler.runners.DEFAULT_RUNNER`.
            vocab_map: for a draft from another family, the map between its vocabulary and the
                target's (`handler.vocab_map.VocabMap`); None: the draft shares the target's.
            cross_vocab_greedy: with `vocab_map`, how greedy rows draft ("slem" or "tli",
                `handler.drafters.cross_vocab`).
        """
        assert suffix_estimate in SUFFIX_ESTIMATES, suffix_estimate
        assert speculative_tree in SPECULATIVE_TREE_MODES, speculative_tree
        self.target = target
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.device = next(target.parameters()).device
        self.vocab_size = target.config.get_text_config().vocab_size
        self.runner_kind = runner or runners.DEFAULT_RUNNER  # make_runner refuses any other kind
        self.target_runner = runners.make_runner(self.runner_kind, target)
        self.cost_table = cost_table
        # Where the engine times its passes, it also checks the plan's choice to draft against plain
        # decoding as the steps ran (`handler.adaptive.OutcomeCheck`).
        self.outcome_check: OutcomeCheck | None = None
        if cost_table is not None and running_costs and self.device.type == "cpu":
            self.cost_table = RunningCostTable(cost_table)
            self.outcome_check = OutcomeCheck()
        self.prefix_cache, draft_prefix_cache = None, None
        if prefix_cache_max_bytes is not None:
            # Split in proportion to each model's KV bytes per token: both then hold about as many tokens.
            target_share = kv_bytes_per_token(target)
            draft_share = kv_bytes_per_token(draft) if draft is not None else 0
            target_bytes = prefix_cache_max_bytes * target_share // (target_share + draft_share)
            self.prefix_cache = PrefixCache(target_bytes)
            if draft is not None:
                draft_prefix_cache = PrefixCache(prefix_cache_max_bytes - target_bytes)
        self.model_drafter = None
        self.vocab_map = vocab_map
        if draft is not None and vocab_map is not None:
            self.model_drafter = CrossVocabDrafter(
                draft,
                vocab_map,
                vocab_map.draft_pad_token_id,
                draft_prefix_cache,
                runners.make_runner(self.runner_kind, draft),
                greedy=cross_vocab_greedy,
            )
        elif draft is not None:
            self.model_drafter = ModelDrafter(
                draft, self.vocab_size, pad_token_id, draft_prefix_cache, runners.make_runner(self.runner_kind, draft)
            )
        self.ngram_drafter = NgramDrafter(prompt_lookup_min, prompt_lookup_max)
        self.suffix_drafter = SuffixDrafter(suffix)
        self.suffix_estimate = suffix_estimate
        self.trees = False
        if speculative_tree == "auto":
            error = tree_attention_error(target)
            if error is not None:
                logger.warning("speculative_tree: verifying chains only: %s", error)
            self.trees = error is None
        self.prompt_lookup_num_tokens = prompt_lookup_num_tokens
        self.grammar_drafts = grammar_drafts
        self.draft_confidence = draft_confidence and draft is not None
        # Guesses are the target's tokens, fed to the draft as its own: only for a shared vocabulary.
        self.draft_guesses = draft_guesses and draft is not None and vocab_map is None
        # The draft's confidence -> the target's acceptance, for greedy (True) and sampled rows; and for
        # greedy rows, the runner-up's share of the rest -> the chance the target takes it (`handler.tree`).
        self.calibrations = {True: ConfidenceCalibration(), False: ConfidenceCalibration()}
        self.runner_up_calibration = ConfidenceCalibration()
        # How far each look-up's branch estimates hold (`_estimate`), learnt from the trees verified.
        self.branch_calibrations = {NGRAM: BranchCalibration(), SUFFIX: BranchCalibration()}
        # How far a suffix look-up's own probabilities hold along its chain: its counts say how often
        # a continuation followed, not how often the target takes it (`_calibrate_suffix`).
        self.suffix_calibration = BranchCalibration()
        self.drafters = DRAFTERS if draft is not None else MODEL_FREE
        self.default_drafter = default_drafter or (MODEL if draft is not None else NGRAM)
        assert self.default_drafter in self.drafters, (self.default_drafter, self.drafters)
        self.target_cache: runners.BatchCache | None = None
        self.rows: list[_Row] = []  # in target cache row order
        self.waiting: list[_Row] = []
        self.aborted: set[Hashable] = set()
        # The last step's duration and the part of it spent on grammar masks (structured output).
        self.last_step_seconds = 0.0
        self.last_step_mask_seconds = 0.0
        # Every request's acceptance per proposer together: the estimate of a row too new to have
        # its own, or one that has not drafted for a while (`handler.adaptive`, PROBE_INTERVAL).
        self.pool_trackers = {name: AcceptanceTracker(POOL_DECAY) for name in (MODEL, NGRAM, SUFFIX, PROPOSER_GRAMMAR)}
        # The recent steps' plans and timings, the last one last, and the steps run since start-up.
        self.recent_steps: collections.deque[StepRecord] = collections.deque(maxlen=RECENT_STEPS)
        self.num_steps = 0
        self._draft_seconds = self._verify_seconds = self._fill_seconds = 0.0
        self._draft_passes = 0
        # Prompt tokens admitted, and those of them whose target KV came from the prefix cache.
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0

    @classmethod
    def from_config(cls, models, config: HandlerConfig, cost_table=None, **options) -> SpeculativeEngine:
        """The engine that a handler config describes, on models loaded by `handler.loading.load_models`.

        `options` are further keyword arguments of the constructor (a benchmark's `grammar_drafts`).
        The prefix cache's budget comes from the config (`handler.memory_budget`) unless `options`
        give `prefix_cache_max_bytes`; the runner is the config's (`auto` timed now,
        `handler.runners.config_runner`) unless `options` give `runner`.
        """
        if options.get("runner") is None:
            options["runner"] = runners.config_runner(config, models)
        if "prefix_cache_max_bytes" not in options:
            budget = prefix_cache_budget(config, next(models.target.parameters()).device)
            options["prefix_cache_max_bytes"] = None if budget is None else budget.num_bytes
        return cls(
            models.target,
            models.draft,
            models.tokenizer,
            models.eos_token_ids,
            models.pad_token_id,
            default_drafter=config.drafter,
            cost_table=cost_table,
            prompt_lookup_min=config.prompt_lookup_min,
            prompt_lookup_max=config.prompt_lookup_max,
            prompt_lookup_num_tokens=config.prompt_lookup_num_tokens,
            suffix=config.suffix_options,
            speculative_tree=config.speculative_tree,
            draft_confidence=config.draft_confidence,
            draft_guesses=config.draft_guesses,
            vocab_map=models.vocab_map,
            cross_vocab_greedy=config.cross_vocab_greedy,
            **options,
        )

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        """Since start-up: prompt tokens queried and found in the target's cache (vLLM's
        prefix_cache_queries and prefix_cache_hits); bytes, tokens and evictions of both models' caches."""
        if self.prefix_cache is None:
            return None
        total = dataclasses.replace(
            self.prefix_cache.stats, queries=self.num_prompt_tokens, hits=self.num_cached_tokens
        )
        if self.model_drafter is not None and self.model_drafter.prefix_cache is not None:
            draft = self.model_drafter.prefix_cache.stats
            total.num_bytes += draft.num_bytes
            total.evictions += draft.evictions
            total.evicted_tokens += draft.evicted_tokens
        return total

    @property
    def suffix_tree_stats(self) -> SuffixTreeStats:
        """The size of the suffix drafter's tree of recent outputs, shared across requests."""
        return self.suffix_drafter.stats

    @property
    def cost_scales(self) -> tuple[float, float] | None:
        """(target, draft): the passes timed while serving over the cost table's figures; None
        where the table stands as given (no table, a GPU, or `running_costs` off)."""
        if not isinstance(self.cost_table, RunningCostTable):
            return None
        return self.cost_table.target_scale, self.cost_table.draft_scale

    @property
    def draft(self):
        return None if self.model_drafter is None else self.model_drafter.model

    # ----------------------------------------------------------------- requests

    def add_request(self, request_id: Hashable, request: GenerationRequest) -> None:
        """Queues a request; it is prefilled and joins the batch at the next `step`."""
        if any(row.request_id == request_id for row in (*self.rows, *self.waiting)):
            raise ValueError(f"request id {request_id!r} is already in flight")
        drafter = request.drafter or self.default_drafter
        if drafter not in self.drafters:
            raise ValueError(f"drafter: {drafter!r} is not available here; choose one of {', '.join(self.drafters)}")
        if request.suffix_share_across_requests and not self.suffix_drafter.options.share_across_requests:
            raise ValueError(
                "suffix_share_across_requests: this server keeps each request's text to itself "
                "(suffix_share_across_requests: false in model-config.yaml); a request can only opt out"
            )
        assert request.prompt_ids, "a request needs at least one prompt token"
        row = _Row(request_id, request, drafter, self.tokenizer, self.eos_token_ids)
        if request.constraint is not None:
            assert self.eos_token_ids, "a constrained request needs an end-of-sequence token to end on"
            # Compiled (and cached) when the request was parsed: this is a copy of the start state.
            row.grammar = compiler_for(self.tokenizer).row(request.constraint, self.vocab_size, self.eos_token_ids)
        if request.sampling.needs_output_counts:
            row.output_counts = token_counts([], self.vocab_size, self.device)
        if request.sampling.needs_seen_tokens:
            row.seen = token_mask(request.prompt_ids, self.vocab_size, self.device)
        self.aborted.discard(request_id)
        self.waiting.append(row)

    def abort_request(self, request_id: Hashable) -> None:
        """Frees the request's row at the next `step`; it produces no more output."""
        self.aborted.add(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.rows or self.waiting)

    @property
    def num_active_requests(self) -> int:
        return len(self.rows) + len(self.waiting)

    # --------------------------------------------------------------------- step

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """Runs one speculative step over every request in flight.

        Returns:
            one StepOutput per request that was in the step, in batch order.
        """
        self._drop([row for row in self.rows if row.request_id in self.aborted])
        self.waiting = [row for row in self.waiting if row.request_id not in self.aborted]
        self.aborted.clear()
        admitted = time.perf_counter()
        first_outputs = self._admit()
        if not self.rows:
            return first_outputs
        rows = self.rows
        started = time.perf_counter()
        self._draft_seconds = self._verify_seconds = self._fill_seconds = 0.0
        self._draft_passes = 0
        mask_seconds_before = sum(row.stats.mask_seconds for row in rows)
        options = self._proposals(rows)
        plan = self._plan(rows, options)
        step_ks, uses_model = list(plan.ks), list(plan.uses_model)
        picks = [option.pick(model, plan.trees) for option, model in zip(options, uses_model)]
        proposers = [proposer for proposer, _, _ in picks]
        curves = [curve for _, _, curve in picks]
        planned_trees = [option.lookup.is_tree and not model for option, model in zip(options, uses_model)]
        lookups = [lookup.prefix(step_k) for (_, lookup, _), step_k in zip(picks, step_ks)]
        keep_drafting = self._confidence_stop(rows, step_ks, uses_model, curves)
        num_accepted, emitted, logits, paths, model_drafts = self._verify(
            rows, step_ks, lookups, uses_model, keep_drafting, curves
        )

        outputs, finished, committed = [], [], {}
        for slot, row in enumerate(rows):
            accepted, path, lookup = num_accepted[slot], paths[slot], lookups[slot]
            new_tokens = emitted[slot][: accepted + 1]
            proposer = proposers[slot]
            row.stats.record(proposer, step_ks[slot], accepted)
            row.steps_without_drafts = 0 if step_ks[slot] else row.steps_without_drafts + 1
            # Drafts reached: the accepted ones, and one more where the walk stopped at a node with children.
            reached = step_ks[slot]
            if lookup.is_tree:
                reached = accepted + int(path[-1] - 1 in lookup.parents)
                first_choice = path == first_choice_path(lookup.parents, accepted)
                row.stats.record_tree(step_ks[slot], accepted, first_choice)
            row.trackers[proposer].update(accepted, reached)
            self.pool_trackers[proposer].update(accepted, reached)
            if proposer == SUFFIX and not lookup.is_tree and step_ks[slot] and self.suffix_estimate == "tree":
                self._calibrate_suffix(curves[slot], step_ks[slot], accepted)
            if planned_trees[slot] and proposer in self.branch_calibrations:
                self._calibrate_branches(proposer, lookup, path)
            if slot in model_drafts:
                self._calibrate(row, model_drafts[slot], path)
            output = self._emit(row, new_tokens, logits[slot], path)
            output.num_draft_tokens, output.num_accepted_tokens = step_ks[slot], accepted
            committed[row.request_id] = output.new_token_ids
            outputs.append(output)
            if row.finish_reason is not None:
                finished.append(row)
        # Roll back: the target keeps its pending token and the accepted drafts (a tree's
        # accepted path first moves to the front of the chunk).
        if any(path != list(range(len(path))) for path in paths):
            self.target_cache.keep_chunk_paths(max(step_ks) + 1, paths)
        kept_lengths = target_lengths_after_verify(self.target_cache.lengths.tolist(), step_ks, num_accepted)
        self.target_cache.rollback(torch.tensor(kept_lengths, dtype=torch.long))
        for drafter in self._all_drafters():
            drafter.observe(committed)
        self._drop(finished)
        ended = time.perf_counter()
        self.last_step_seconds = ended - started
        record = StepRecord(
            len(rows),
            tuple(step_ks),
            self._draft_passes,
            ended - admitted,
            started - admitted + self._fill_seconds,
            self._draft_seconds,
            self._verify_seconds,
        )
        drafted = max(step_ks) > 0
        # A drafting step right after plain ones paid the draft's catch-up (`EXPLORE_BURST`): no sample.
        # Nor is one that verified only the tokens a grammar forced: they are certain, not speculation.
        previous = self.recent_steps[-1] if self.recent_steps else None
        speculated = any(k and proposer != PROPOSER_GRAMMAR for k, proposer in zip(step_ks, proposers))
        fair = not drafted or (speculated and previous is not None and previous.width > 1)
        if self.outcome_check is not None and ended > started and fair:
            tokens = sum(len(output.new_token_ids) for output in outputs)
            rate = tokens / (ended - started) / len(rows)
            self.outcome_check.observe(batch_bucket(len(rows)), drafted, rate)
        self.recent_steps.append(record)
        self.num_steps += 1
        self.last_step_mask_seconds = sum(row.stats.mask_seconds for row in rows) - mask_seconds_before
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
        self.waiting = []
        self.aborted.clear()
        self._drop(list(self.rows), consistent=False)

    # ---------------------------------------------------------------- internals

    def _admit(self) -> list[StepOutput]:
        """Prefills the waiting requests, appends their rows to the batch, and draws the first
        token of those that never draft.

        A row whose k is 0 is prefilled over its whole prompt, and the logits after the last
        prompt token give its first token (a step with k = 0, `_verify`): plain decoding then
        makes one target pass per token, as `generate` does. A drafting row is prefilled up to
        the prompt's last token, which its first step verifies together with the drafts that
        follow it. The two kinds are prefilled apart where both join at once. A row that
        finishes on its first token leaves.

        Returns:
            one StepOutput per plain row admitted, its first token.
        """
        if not self.waiting:
            return []
        new_rows, self.waiting = self.waiting, []
        plain = [row for row in new_rows if row.request.num_speculative_tokens == 0]
        drafting = [row for row in new_rows if row.request.num_speculative_tokens > 0]
        first_logits = None
        for group, whole in ((plain, True), (drafting, False)):
            if not group:
                continue
            filled = prefill_with_cache(
                self.target,
                self.prefix_cache,
                [row.request.prompt_ids if whole else row.request.prompt_ids[:-1] for row in group],
                self.pad_token_id,
                last_logits=whole,
            )
            if whole:
                first_logits = filled.logits[:, None]  # [plain rows, 1, vocab]
            for row, num_cached, handle in zip(group, filled.num_cached, filled.handles):
                row.cached_tokens, row.prefix_handle = num_cached, handle
                self.num_prompt_tokens += len(row.request.prompt_ids)
                self.num_cached_tokens += num_cached
            if self.target_cache is None:
                self.target_cache = self.target_runner.adopt(filled.cache)
            else:
                self.target_cache.extend(filled.cache)
            self.rows.extend(group)

        # A row whose k is 0 never drafts: no drafter needs to read its prompt.
        def prompts(*drafters: str) -> dict:
            return {r.request_id: r.request.prompt_ids for r in drafting if r.drafter in drafters}

        self.ngram_drafter.add(prompts(NGRAM, HYBRID))
        private = [r.request_id for r in drafting if r.request.suffix_share_across_requests is False]
        self.suffix_drafter.add(prompts(SUFFIX, HYBRID), private=private)
        if self.model_drafter is not None:
            self.model_drafter.add(prompts(MODEL, HYBRID))
        if not plain:
            return []
        num = len(plain)
        _, emitted, logits, paths, _ = self._verify(
            plain, [0] * num, [NO_LOOKUP] * num, [False] * num, logits=first_logits
        )
        outputs = []
        for slot, row in enumerate(plain):
            row.stats.record(row.drafter, 0, 0)  # the prefill was its first target pass
            outputs.append(self._emit(row, emitted[slot][:1], logits[slot], paths[slot]))
        # No drafter follows a plain row: nothing to observe.
        self._drop([row for row in plain if row.finish_reason is not None])
        return outputs

    def _emit(self, row: _Row, new_tokens: list[int], logits: torch.Tensor, path: list[int]) -> StepOutput:
        """Appends a row's emitted tokens up to its first stop, and reports them (`logits`: the row's
        raw logits at the step's columns, [columns, vocab]; `path`: the columns of the emitted tokens)."""
        kept = row.extend(new_tokens)
        row.commit(kept)
        if row.logprobs is not None and kept:
            row.logprobs.extend(self._logprobs(logits[path[: len(kept)]], kept, row.request.logprobs))
        finished = row.finish_reason is not None
        return StepOutput(row.request_id, kept, row.token_ids, row.finish_reason, row.result() if finished else None)

    def _drop(self, rows: list[_Row], consistent: bool = True) -> None:
        """Removes rows from the batch and from every drafter.

        `consistent`: the caches hold what the rows committed (between steps), so their
        prompts and completions go into the prefix caches; False after a failed step.
        """
        if not rows:
            return
        gone = {row.request_id for row in rows}
        sequences = {row.request_id: (*row.request.prompt_ids, *row.token_ids) for row in rows} if consistent else None
        if self.prefix_cache is not None:
            self._release_prefixes(rows, sequences)
        keep = [slot for slot, row in enumerate(self.rows) if row.request_id not in gone]
        self.rows = [self.rows[slot] for slot in keep]
        if not self.rows:
            self.target_cache = None  # an empty batch restarts from a fresh cache
        elif len(keep) < self.target_cache.lengths.shape[0]:
            self.target_cache.select_rows(keep)
        for drafter in self._all_drafters():
            drafter.remove(list(gone), sequences)

    def _all_drafters(self) -> list:
        drafters = [self.ngram_drafter, self.suffix_drafter]
        return drafters if self.model_drafter is None else [*drafters, self.model_drafter]

    def _release_prefixes(self, rows: list[_Row], sequences: dict | None) -> None:
        """Caches what the target cache holds of the leaving rows' sequences, and unlocks their prompts."""
        slot_of = {row.request_id: slot for slot, row in enumerate(self.rows)}
        for row in rows:
            slot = slot_of.get(row.request_id)
            if sequences is not None and slot is not None:
                # The target cache holds the sequence but for the pending last token (and, after an
                # early stop, perhaps accepted drafts beyond it).
                tokens = sequences[row.request_id]
                num_cached = min(int(self.target_cache.lengths[slot]), len(tokens) - 1)
                if num_cached > 0:
                    self.prefix_cache.insert(
                        tokens[:num_cached], lambda start, end, slot=slot: self.target_cache.row_kv(slot, start, end)
                    )
            if row.prefix_handle is not None:
                self.prefix_cache.unlock(row.prefix_handle)
                row.prefix_handle = None

    def _proposals(self, rows: list[_Row]) -> list[_Options]:
        """What each row can draft this step: its best look-up and, where it may, the draft model.

        A constrained row first takes the tokens its grammar forces (free one-hot drafts);
        otherwise its look-ups are cut at the first token the grammar refuses. A hybrid
        row offers its most promising look-up (`handler.drafters.hybrid`) and the draft
        model; the plan picks between them with the batch's costs (`_plan`). A row whose
        logits no rule shapes may take a tree of look-up candidates (`handler.tree`).
        """
        options = []
        batch_size = len(rows)
        for row in rows:
            cap = row.lookup_cap(self.prompt_lookup_num_tokens)
            forced = []
            if row.grammar is not None and cap and self.grammar_drafts:
                forced = row.grammar_call("forced_tokens", cap)
            model_curve = None
            if row.drafter in (MODEL, HYBRID) and not forced:
                model_curve = self._tracker(row, MODEL).expected_curve(row.cap())
            if forced:
                curve = self._tracker(row, PROPOSER_GRAMMAR).expected_curve(len(forced))
                options.append(_Options(Lookup(forced), PROPOSER_GRAMMAR, curve, None, None, None, None))
                continue
            tree = self.trees and row.request.speculative_tree is not False and not row.shapes_logits
            candidates = []
            for name, drafter in ((SUFFIX, self.suffix_drafter), (NGRAM, self.ngram_drafter)):
                if row.drafter not in (name, HYBRID):
                    continue
                lookup = drafter.lookup(row.request_id, cap, tree=tree)
                if lookup.token_ids and row.grammar is not None:
                    lookup = lookup.prefix(row.grammar_call("num_valid", lookup.token_ids))
                if row.drafter == name or lookup.token_ids:
                    lookup, curve = self._estimate(row, name, lookup)
                    candidates.append(Candidate(name, lookup, len(lookup.token_ids), curve))
            guesses = self._guesses_for(row)
            if not candidates:
                options.append(_Options(NO_LOOKUP, None, [1.0], None, None, model_curve, guesses))
                continue
            best = choose(candidates, self._step_seconds(batch_size))
            chain, chain_curve = None, None
            if best.lookup.is_tree:
                chain, chain_curve = _first_choice_chain(best.lookup, best.curve)
            options.append(
                _Options(best.lookup, best.proposer, list(best.curve), chain, chain_curve, model_curve, guesses)
            )
        return options

    def _tracker(self, row: _Row, proposer: str) -> AcceptanceTracker:
        """The acceptance estimate that plans a row: its own, or the pool's while it has drafted too
        little to have one, and again after PROBE_INTERVAL steps without drafts (a probe)."""
        own = row.trackers[proposer]
        if own.num_steps < MIN_STEPS_BEFORE_FALLBACK or row.steps_without_drafts >= PROBE_INTERVAL:
            return self.pool_trackers[proposer]
        return own

    def _estimate(self, row: _Row, proposer: str, lookup: Lookup) -> tuple[Lookup, list[float]]:
        """A look-up's proposal, best draft first, and E(0..n) for its first n drafts.

        Each draft's estimate is the probability that it and its ancestors are accepted:
        a suffix look-up's tree probabilities, or the row's tracker at the draft's depth
        times the draft's share of the matched occurrences (1 along a chain). A tree's
        branches, off its first-choice path, are scaled by what the engine has seen of
        this look-up's branches (`BranchCalibration`, learnt in `_calibrate_branches`).
        """
        num = len(lookup.token_ids)
        if proposer == SUFFIX and self.suffix_estimate == "tree" and lookup.probs is not None:
            factor = self.suffix_calibration.factor
            scores = [prob * factor for prob in lookup.probs]  # a tree's come best first already
        else:
            node_depths = depths(lookup.parents) if lookup.parents is not None else list(range(1, num + 1))
            tracker_curve = self._tracker(row, proposer).expected_curve(max(node_depths, default=0))
            shares = lookup.shares or _relative_probs(lookup, node_depths) or [1.0] * num
            scores = [share * (tracker_curve[d] - tracker_curve[d - 1]) for share, d in zip(shares, node_depths)]
        if lookup.is_tree:
            factor = self.branch_calibrations[proposer].factor
            off = off_first_choice(lookup.parents, scores)
            scores = [score * factor if is_off else score for score, is_off in zip(scores, off)]
            token_ids, parents, scores = order_best_first(lookup.token_ids, lookup.parents, scores)
            lookup = Lookup(token_ids, scores, parents)
        curve = [1.0]
        for score in scores:
            curve.append(curve[-1] + score)
        return lookup, curve

    def _fill_share(self, row: _Row, model_curve: list[float]) -> float:
        """The seconds per step of the draft model's prefill of a row it has not drafted for (`fill`):
        priced by the target's cost of that width (the draft has no table of its own), and spread
        over the steps the row has left at its cap's expected tokens, as the prefill serves them all."""
        num_tokens = self.model_drafter.unfilled_tokens(row.request_id)
        if not num_tokens:
            return 0.0
        table = self.cost_table
        seconds = table.draft_seconds(1) * table.target_seconds(1, num_tokens) / table.target_seconds(1, 1)
        steps_left = max(1.0, row.remaining / model_curve[-1])
        return seconds / steps_left

    def _pass_seconds(self, batch_size: int, width: int, num_draft_passes: float, trees: bool = False) -> float:
        """The cost table's seconds for a step: a target pass over `width` drafts and the pending
        token (a tree pass at its measured premium), after `num_draft_passes` draft-model passes.

        A draft pass runs over every row the draft model holds, and its first pass also feeds the
        tokens each row committed since it last drafted: after steps without model drafts that
        pass is wider, priced by the target's cost of that width (the draft has no table of its own).
        """
        table = self.cost_table
        seconds = table.target_seconds(batch_size, width + 1)
        if trees and isinstance(table, RunningCostTable):
            seconds *= table.tree_factor
        if num_draft_passes:
            draft_rows = max(1, self.model_drafter.num_rows)
            one_pass = table.draft_seconds(draft_rows)
            catch_up = self.model_drafter.max_pending
            first_pass = one_pass * table.target_seconds(draft_rows, catch_up) / table.target_seconds(draft_rows, 1)
            seconds += first_pass + max(0.0, num_draft_passes - 1) * one_pass
        return seconds

    def _guesses_for(self, row: _Row) -> GuessRate | None:
        """The row's guess rate where its model drafts are guessed (a hybrid row), else None."""
        return row.guess_rate if self.draft_guesses and row.drafter == HYBRID else None

    def _step_seconds(self, batch_size: int) -> Callable[[int, bool], float] | None:
        """(k, drafts with the model) -> the cost table's seconds for a step of the batch; None without a table."""
        if self.cost_table is None:
            return None
        return lambda k, model: self._pass_seconds(batch_size, k, k if model else 0)

    def _plan(self, rows: list[_Row], options: list[_Options]) -> BatchPlan:
        """Each row's drafts this step (a tree's: its first nodes, best first), priced for the whole batch.

        Without a cost table every row drafts its cap: with its look-up where it found one, else the
        model. With one, `plan_batch` prices each width and number of model drafts; where the
        draft's confidence stops it (`_confidence_stop`), model rows then draft up to their cap.
        """
        if self.cost_table is None:
            uses_model = [option.lookup_proposer is None and option.model_curve is not None for option in options]
            ks = [
                len(option.model_curve) - 1 if model else len(option.lookup.token_ids)
                for option, model in zip(options, uses_model)
            ]
            return BatchPlan(tuple(ks), tuple(uses_model), True, 0.0, 0.0, 0.0)
        offers = [option.offer() for option in options]
        # Until the pool has seen a few steps of a way to draft, nothing says whether it pays: draft.
        estimated = {MODEL for option in options if option.model_curve is not None}
        estimated |= {option.lookup_proposer for option in options if option.lookup_proposer is not None}
        if self.suffix_estimate == "tree":
            estimated.discard(SUFFIX)  # a suffix look-up comes with its own probabilities
        explore = any(self.pool_trackers[name].num_steps < MIN_STEPS_BEFORE_FALLBACK for name in estimated)
        batch_size = len(rows)

        # A row the draft model has not drafted for yet must be prefilled first: priced as a whole, with
        # the plan where such rows do not draft with the model as the alternative.
        fill = [
            self._fill_share(row, option.model_curve) if option.model_curve is not None else 0.0
            for row, option in zip(rows, options)
        ]

        priced: dict[tuple[int, float, bool], float] = {}  # the plans below ask for the same shapes

        def pass_seconds(width: int, passes: float, trees: bool) -> float:
            seconds = priced.get((width, passes, trees))
            if seconds is None:
                seconds = priced[width, passes, trees] = self._pass_seconds(batch_size, width, passes, trees)
            return seconds

        def seconds_with(fill_seconds: float) -> Callable[[int, float, bool], float]:
            return lambda width, passes, trees: pass_seconds(width, passes, trees) + (fill_seconds if passes else 0.0)

        # The same offers where a row the draft has not prefilled cannot draft with the model.
        filled_only = (
            [dataclasses.replace(offer, model=(1.0,)) if share else offer for share, offer in zip(fill, offers)]
            if any(fill)
            else offers
        )
        plan = plan_batch(offers, seconds_with(sum(fill)), explore)
        # While the pool learns the acceptance, the plan drafts, a prefill included. Where no row the
        # draft holds could draft with it, the alternative's plans are all plans above, none dearer.
        filled_model_rows = any(not share and option.model_curve is not None for share, option in zip(fill, options))
        if any(fill) and filled_model_rows and not explore:
            without = plan_batch(filled_only, seconds_with(0.0))
            if without.tokens / without.seconds > plan.tokens / plan.seconds * (1.0 + 1e-9):
                plan = without
        for row, k, offer in zip(rows, plan.ks, offers):
            if k == 0 and max(len(offer.lookup), len(offer.model)) > 1:
                row.stats.fell_back = True
        if self.outcome_check is not None:
            drafts = self.outcome_check.arm(batch_bucket(batch_size), plan.width > 0, self.num_steps)
            if drafts and not plan.width:
                # Only rows the draft already holds: a step run to learn must not prefill the batch.
                plan = plan_batch(filled_only, seconds_with(0.0), explore=True)
            elif plan.width and not drafts:
                # Speculation gives way; the tokens a grammar forces are certain, and stay.
                forced = [
                    offer if option.lookup_proposer == PROPOSER_GRAMMAR else Offer()
                    for option, offer in zip(options, offers)
                ]
                return plan_batch(forced, seconds_with(0.0))
        if plan.draft_passes and self.draft_confidence:
            # The plan says whether to draft; the draft's confidence says how far (`_confidence_stop`).
            ks = [
                len(option.model_curve) - 1 if model else k
                for option, model, k in zip(options, plan.uses_model, plan.ks)
            ]
            plan = dataclasses.replace(plan, ks=tuple(ks))
        return plan

    def _calibrate(self, row: _Row, drafts: _ModelDrafts, path: list[int]) -> None:
        """Teaches the calibrations what the target did with a row's model drafts (`path`: its walk)."""
        num_chain = len(drafts.confidences)
        # Chain draft j sits at chunk column j + 1; the runners-up come after the chain.
        on_runner_up = path[-1] > num_chain
        chain_accepted = len(path) - 1 - int(on_runner_up)
        self.calibrations[row.request.sampling.is_greedy].update(drafts.confidences, chain_accepted)
        share = drafts.runner_up_shares.get(chain_accepted)
        if share is not None:
            self.runner_up_calibration.update([share], int(on_runner_up))

    def _calibrate_suffix(self, curve: list[float], num_drafts: int, num_accepted: int) -> None:
        """Teaches the suffix calibration a verified chain: `curve`, its E(0..n) as planned (scaled by
        the factor, unchanged since `_estimate`), `num_drafts` verified, `num_accepted` taken."""
        expected = (curve[num_drafts] - 1.0) / self.suffix_calibration.factor
        self.suffix_calibration.update(expected, num_accepted)

    def _calibrate_branches(self, proposer: str, lookup: Lookup, path: list[int]) -> None:
        """Teaches a look-up's branch calibration what the walk did with a tree's branches (`path`:
        its chunk columns); a tree cut to its first-choice chain by the plan only relaxes it."""
        calibration = self.branch_calibrations[proposer]
        if not lookup.is_tree:
            calibration.relax()
            return
        off = off_first_choice(lookup.parents, lookup.probs)
        # The scores were scaled by the factor (unchanged since `_estimate`): the guesses are undone.
        expected = sum(score for score, is_off in zip(lookup.probs, off) if is_off) / calibration.factor
        calibration.update(expected, sum(off[column - 1] for column in path[1:]))

    @staticmethod
    def _other_tokens(step_ks: list[int], curves: list[list[float]], slots: list[int]) -> float:
        """The expected tokens of these rows this step, from their curves."""
        return sum(curves[slot][min(step_ks[slot], len(curves[slot]) - 1)] for slot in slots)

    def _confidence_stop(
        self, rows: list[_Row], step_ks: list[int], uses_model: list[bool], curves: list[list[float]]
    ) -> Callable[[int, dict], bool] | None:
        """The draft model's stop rule this step (`ConfidenceStop`), or None: it drafts its rows' step_ks."""
        model_slots = [slot for slot, uses in enumerate(uses_model) if uses and step_ks[slot] > 0]
        if not (self.draft_confidence and self.cost_table is not None and model_slots):
            return None
        batch_size = len(rows)
        others = [slot for slot in range(batch_size) if slot not in model_slots]
        other_width = max((step_ks[slot] for slot in others), default=0)

        # The batch drafts until its slowest row has its drafts: the row whose drafts are guessed least.
        rates = [self._guesses_for(rows[slot]) or GuessRate() for slot in model_slots]
        slowest = min(rates, key=lambda rate: rate.rate)

        def step_seconds(num_drafts: int) -> float:
            return self._pass_seconds(batch_size, max(num_drafts, other_width), slowest.passes(num_drafts))

        calibrations = [self.calibrations[rows[slot].request.sampling.is_greedy] for slot in model_slots]
        stop = ConfidenceStop(
            calibrations,
            [calibration.mean_acceptance for calibration in calibrations],
            max(step_ks[slot] for slot in model_slots),
            self._other_tokens(step_ks, curves, others),
            step_seconds,
        )
        ids = [rows[slot].request_id for slot in model_slots]
        return lambda num_drafted, confidences: stop(num_drafted, [confidences[i] for i in ids])

    def _draft_guesses(self, rows: list[_Row], model_slots: list[int]) -> dict[Hashable, Callable]:
        """Per hybrid row drafting with the model: its suffix trees' guess of the draft model's next drafts."""
        return {
            rows[slot].request_id: functools.partial(self.suffix_drafter.continuation, rows[slot].request_id)
            for slot in model_slots
            if self._guesses_for(rows[slot]) is not None
        }

    def _takes_runners_up(self, row: _Row) -> bool:
        """Whether a greedy model row's chain may take the draft's runners-up as siblings (`handler.tree`).

        Greedy only: for a sampled row, rejection sampling of the chain accepts more than a
        walk of the tree could (it accepts min(p, q) summed over the vocabulary).
        """
        return (
            self.trees
            and self.cost_table is not None
            and row.request.sampling.is_greedy
            and row.request.speculative_tree is not False
            and not row.shapes_logits
        )

    def _add_runners_up(
        self,
        rows: list[_Row],
        step_ks: list[int],
        lookups: list[Lookup],
        proposals: dict[int, Proposal],
        model_drafts: dict[int, _ModelDrafts],
        curves: list[list[float]] | None,
    ) -> None:
        """Turns greedy model chains into trees where the draft's runners-up pay (`choose_runners_up`).

        A chosen row's `lookups` entry becomes its tree and its `step_ks` entry the tree's size.
        """
        slots = [slot for slot in proposals if self._takes_runners_up(rows[slot]) and proposals[slot].runners_up]
        if not slots or curves is None:
            return
        batch_size = len(rows)
        num_draft_passes = max(step_ks[slot] for slot in proposals)
        # Each model row's calibrated acceptance of each of its drafts, and the step's expected tokens.
        chain_acceptances = {
            slot: [
                self.calibrations[rows[slot].request.sampling.is_greedy].acceptance(confidence)
                for confidence in model_drafts[slot].confidences
            ]
            for slot in proposals
        }
        tokens = self._other_tokens(step_ks, curves, [slot for slot in range(batch_size) if slot not in proposals])
        tokens += sum(chain_expected_tokens(acceptances) for acceptances in chain_acceptances.values())
        runner_up_acceptances, shares = [], []
        for slot in slots:
            # The runner-up's share of what the draft left to tokens other than its draft.
            row_shares = [
                prob / max(1.0 - c, 1e-6)
                for (_, prob), c in zip(proposals[slot].runners_up, model_drafts[slot].confidences)
            ]
            shares.append(row_shares)
            runner_up_acceptances.append([self.runner_up_calibration.acceptance(share) for share in row_shares])

        def step_seconds(width: int) -> float:
            return self._pass_seconds(batch_size, width, num_draft_passes)

        max_nodes = [max(step_ks[slot], rows[slot].lookup_cap(self.prompt_lookup_num_tokens)) for slot in slots]
        acceptances = [chain_acceptances[slot] for slot in slots]
        chosen = choose_runners_up(acceptances, runner_up_acceptances, max_nodes, max(step_ks), tokens, step_seconds)
        for slot, positions, row_shares in zip(slots, chosen, shares):
            if not positions:
                continue
            runners_up = proposals[slot].runners_up
            token_ids, parents = chain_with_siblings(
                proposals[slot].token_ids[: step_ks[slot]].tolist(),
                positions,
                [runners_up[position][0] for position in positions],
            )
            lookups[slot] = Lookup(token_ids, parents=parents)
            step_ks[slot] = len(token_ids)
            model_drafts[slot].runner_up_shares = {position: row_shares[position] for position in positions}

    def _verify(
        self,
        rows: list[_Row],
        step_ks: list[int],
        lookups: list[Lookup],
        uses_model: list[bool],
        keep_drafting: Callable[[int, dict], bool] | None = None,
        curves: list[list[float]] | None = None,
        logits: torch.Tensor | None = None,
    ) -> tuple[list[int], list[list[int]], torch.Tensor, list[list[int]], dict[int, _ModelDrafts]]:
        """Drafts and verifies one step.

        `lookups` are the rows' drafts this step, `step_ks` long; where one is a tree, the
        pass gives every draft its own ancestors only, and that row is verified by walking
        the tree (`handler.tree.verify_tree`). `keep_drafting` may stop the draft model
        before its rows' step_ks: their entries in `step_ks` are then lowered in place to
        the drafts drawn. A greedy model row's chain may take the draft's runners-up as
        siblings (`_add_runners_up`, with `curves`, the rows' E(0..n)): its `lookups` entry
        becomes that tree and its `step_ks` entry the tree's size, in place. `logits`: for a step
        without drafts, the target's logits after each row's pending token, already computed
        ([batch, 1, vocab], a prefill's): no target pass then, and the cache is left as it is.

        Returns:
            num_accepted per row, emitted tokens per row ([k + 1], -1 padded), the target's
            raw logits [batch, k + 1, vocab] at the verified chunk columns, per row the
            chunk columns of its pending token and accepted drafts (0, 1, ... for a chain),
            and per draft-model row (by slot) what it drafted, for the calibrations.
        """
        batch_size, k = len(rows), max(step_ks)
        tree_slots = [slot for slot in range(batch_size) if not uses_model[slot] and lookups[slot].is_tree]
        # An unseeded row draws for its own k only (`draw_step_uniforms`). A coupled row takes
        # each position's own uniform, for its draft there and for the target's token there.
        draft_uniforms, verify_uniforms = draw_step_uniforms([row.generator for row in rows], step_ks, k)
        coupled = [slot for slot, row in enumerate(rows) if row.coupled]
        position_u = torch.zeros(len(coupled), k + 1, dtype=torch.float64)  # [coupled rows, k + 1]
        for index, slot in enumerate(coupled):
            row = rows[slot]
            position_u[index, : step_ks[slot] + 1] = position_uniforms(
                row.request.seed, len(row.token_ids), step_ks[slot] + 1
            )
            draft_uniforms[slot] = position_u[index, :k]
        sampling = [row.request.sampling for row in rows]
        temperature = torch.tensor([s.temperature for s in sampling], device=self.device)
        top_k = torch.tensor([s.top_k for s in sampling], device=self.device)
        top_p = torch.tensor([s.top_p for s in sampling], device=self.device)
        min_p = torch.tensor([s.min_p for s in sampling], device=self.device)

        model_slots = [slot for slot in range(batch_size) if uses_model[slot] and step_ks[slot] > 0]
        drafted, model_drafts = {}, {}
        if model_slots:
            started = time.perf_counter()
            self.model_drafter.fill([rows[slot].request_id for slot in model_slots])
            self._fill_seconds = time.perf_counter() - started
            started = time.perf_counter()
            proposals = self.model_drafter.propose(
                {
                    rows[slot].request_id: (
                        sampling[slot].temperature,
                        sampling[slot].top_k,
                        sampling[slot].top_p,
                        draft_uniforms[slot, : step_ks[slot]],
                    )
                    for slot in model_slots
                },
                shapers={
                    rows[slot].request_id: rows[slot].shape_draft_logits
                    for slot in model_slots
                    if rows[slot].shapes_logits
                },
                keep_drafting=keep_drafting,
                # Confidences serve the stop rule and the runners-up, both planned from a cost table.
                with_confidence=self.cost_table is not None,
                guesses=self._draft_guesses(rows, model_slots),
            )
            by_slot = {slot: proposals[rows[slot].request_id] for slot in model_slots}
            self._draft_seconds = time.perf_counter() - started
            self._draft_passes = self.model_drafter.last_num_passes
            if isinstance(self.cost_table, RunningCostTable):
                # Every row of the draft's batch takes part in every pass.
                self.cost_table.observe_draft(self.model_drafter.num_rows, self._draft_passes, self._draft_seconds)
            for slot, proposal in by_slot.items():
                row = rows[slot]
                if self._guesses_for(row) is not None:
                    passes_needed = self.model_drafter.passes_needed(row.request_id, len(proposal.token_ids))
                    row.guess_rate.update(len(proposal.token_ids), passes_needed)
                row.end_drafting()
                step_ks[slot] = num = min(step_ks[slot], len(proposal.token_ids))
                row.stats.draft_passes += self.model_drafter.passes_needed(row.request_id, num)
                drafted[slot] = proposal.token_ids[:num], proposal.probs[:num]
                if proposal.confidences:
                    model_drafts[slot] = _ModelDrafts(proposal.confidences[:num])
            self._add_runners_up(rows, step_ks, lookups, by_slot, model_drafts, curves)
            tree_slots += [slot for slot in model_slots if lookups[slot].is_tree]
            if max(step_ks) != k:
                # The draft stopped early, or runners-up widened a tree. A row's uniforms stay its own,
                # the last column (recovered or bonus token) included; a coupled row's are per position.
                new_k = max(step_ks)
                extra = torch.zeros(batch_size, max(0, new_k - k), dtype=torch.float64)
                verify_uniforms = torch.cat([verify_uniforms[:, : min(k, new_k)], extra, verify_uniforms[:, k:]], dim=1)
                position_u = torch.cat([position_u[:, : min(k, new_k) + 1], extra[: len(coupled)]], dim=1)
                k = new_k
        draft_token_ids = torch.full((batch_size, k), self.pad_token_id, dtype=torch.long)  # [batch, k]
        draft_probs = torch.zeros((batch_size, k, self.vocab_size), device=self.device)  # [batch, k, vocab]
        for slot, (token_ids, probs) in drafted.items():
            draft_token_ids[slot, : len(token_ids)] = token_ids.cpu()
            draft_probs[slot, : len(token_ids)] = probs
        for slot in tree_slots:
            if uses_model[slot]:  # the chain is in place; its runners-up follow it (verified by the walk)
                draft_token_ids[slot, : step_ks[slot]] = torch.tensor(lookups[slot].token_ids, dtype=torch.long)
        for slot in range(batch_size):
            if not uses_model[slot] and step_ks[slot] > 0:
                # A look-up is deterministic: its draft distribution is one-hot.
                proposal = torch.tensor(lookups[slot].token_ids[: step_ks[slot]], dtype=torch.long)
                draft_token_ids[slot, : len(proposal)] = proposal
                draft_probs[slot, torch.arange(len(proposal)), proposal.to(self.device)] = 1.0
        draft_lists = draft_token_ids.tolist()
        draft_token_ids = draft_token_ids.to(self.device)

        pending = torch.tensor([[row.token_ids[-1] if row.token_ids else row.request.prompt_ids[-1]] for row in rows])
        input_ids = torch.cat([pending.to(self.device), draft_token_ids], dim=1)  # [batch, 1 + k]
        chunk_mask = torch.ones((batch_size, 1 + k), dtype=torch.long)
        tree = None
        if tree_slots:
            parents = [
                lookups[slot].parents if slot in tree_slots else list(range(ROOT, step_ks[slot] - 1))
                for slot in range(batch_size)
            ]
            tree = chunk_attention(parents, k)
        if logits is None:
            started = time.perf_counter()
            logits = self.target_cache.forward(input_ids, chunk_mask, logits_to_keep=k + 1, tree=tree)  # [b, k+1, v']
            self._verify_seconds = time.perf_counter() - started
            if isinstance(self.cost_table, RunningCostTable):
                self.cost_table.observe_target(batch_size, k + 1, self._verify_seconds, tree=tree is not None)
        else:
            assert k == 0 and logits.shape[:2] == (batch_size, 1), (k, logits.shape)
        logits = logits[..., : self.vocab_size]
        shaped = self._shape_target_logits(rows, logits, draft_lists, step_ks)
        target_probs = warp_logits_to_probs(shaped, temperature, top_k, top_p, min_p)

        num_draft_tokens = torch.tensor(step_ks, device=self.device)
        num_accepted, output_token_ids = rejection_sample(
            target_probs, draft_probs, draft_token_ids, num_draft_tokens, verify_uniforms.to(self.device)
        )
        if coupled:
            index = torch.tensor(coupled, device=self.device)
            num_accepted[index], output_token_ids[index] = coupled_verify(
                target_probs[index], draft_token_ids[index], num_draft_tokens[index], position_u.to(self.device)
            )
        # The step's one synchronisation point: the bookkeeping after it is plain Python.
        num_accepted, output_token_ids = num_accepted.tolist(), output_token_ids.tolist()
        paths = [list(range(accepted + 1)) for accepted in num_accepted]
        for slot in tree_slots:
            paths[slot], emitted = verify_tree(
                target_probs[slot], lookups[slot].token_ids, lookups[slot].parents, self._tree_uniforms(rows[slot], k)
            )
            num_accepted[slot] = len(emitted) - 1
            output_token_ids[slot] = emitted + [-1] * (k + 1 - len(emitted))
        return num_accepted, output_token_ids, logits, paths, model_drafts

    @staticmethod
    def _tree_uniforms(row: _Row, k: int) -> list[float]:
        """A tree row's uniform per depth 0..k: zeros (greedy), its seed's per position, or fresh draws."""
        if row.coupled:
            return position_uniforms(row.request.seed, len(row.token_ids), k + 1).tolist()
        if row.generator is not None:
            return torch.rand(k + 1, generator=row.generator, dtype=torch.float64).tolist()
        return [0.0] * (k + 1)

    def _shape_target_logits(
        self,
        rows: list[_Row],
        logits: torch.Tensor,  # [batch, k + 1, vocab]
        draft_lists: list[list[int]],
        step_ks: list[int],
    ) -> torch.Tensor:  # [batch, k + 1, vocab]
        """The logits the rows' rules leave, at each row's verify positions.

        Position j of a row follows its committed tokens and drafts 0..j-1: its logit
        bias and penalties count those drafts as generated (`process_row_logits`), and
        its grammar masks what may follow them. The raw logits stay untouched
        (log-probabilities are reported from them).
        """
        shaping = [slot for slot, row in enumerate(rows) if row.shapes_logits]
        if not shaping:
            return logits
        shaped = logits.float()  # a copy for bf16 logits; float32 keeps small penalties exact
        if shaped is logits:
            shaped = logits.clone()
        for slot in shaping:
            row, num = rows[slot], step_ks[slot]
            if row.request.sampling.processes_logits:
                shaped[slot, : num + 1] = process_row_logits(
                    shaped[slot, : num + 1], row.request.sampling, row.output_counts, row.seen, draft_lists[slot][:num]
                )
            if row.grammar is not None:
                masks = row.grammar_call("masks", draft_lists[slot][:num])  # [num + 1, vocab]
                shaped[slot, : num + 1].masked_fill_(~masks.to(self.device), float("-inf"))
        return shaped

    @staticmethod
    def _logprobs(logits: torch.Tensor, token_ids: list[int], num_top: int) -> list[TokenLogprob]:  # [n, vocab]
        """The emitted tokens' log-probabilities under the target's raw logits, and the top `num_top`."""
        logprobs = torch.log_softmax(logits.float(), dim=-1)  # [n, vocab]
        chosen = logprobs.gather(-1, torch.tensor(token_ids, device=logits.device)[:, None])[:, 0].tolist()
        if num_top == 0:
            return [TokenLogprob(t, lp) for t, lp in zip(token_ids, chosen)]
        top = logprobs.topk(num_top, dim=-1)
        top_ids, top_values = top.indices.tolist(), top.values.tolist()
        return [
            TokenLogprob(t, lp, tuple(zip(ids, values)))
            for t, lp, ids, values in zip(token_ids, chosen, top_ids, top_values)
        ]


def _first_choice_chain(lookup: Lookup, curve: Sequence[float]) -> tuple[Lookup, list[float]]:
    """A tree look-up's first-choice chain (the best child of each node down from the root) and its
    E(0..n), from the tree's scores (each node's chance that it and its ancestors are accepted)."""
    off = off_first_choice(lookup.parents, lookup.probs)
    nodes = [index for index, is_off in enumerate(off) if not is_off]
    scores = [curve[index + 1] - curve[index] for index in nodes]
    chain_curve = [1.0]
    for score in scores:
        chain_curve.append(chain_curve[-1] + score)
    return Lookup([lookup.token_ids[index] for index in nodes], scores), chain_curve


def _relative_probs(lookup: Lookup, node_depths: list[int]) -> list[float] | None:
    """A suffix tree's probabilities relative to the likeliest draft at each depth (its branches' shares)."""
    if lookup.probs is None or not lookup.is_tree:
        return None
    best: dict[int, float] = {}
    for prob, depth in zip(lookup.probs, node_depths):
        best[depth] = max(best.get(depth, 0.0), prob)
    return [prob / best[depth] if best[depth] > 0 else 0.0 for prob, depth in zip(lookup.probs, node_depths)]


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
