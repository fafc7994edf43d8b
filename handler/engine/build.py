"""Where the engine is built: settings and the loaded models in, a `SpeculativeEngine` out.

This is the only place that turns settings into the engine's parts (`EngineParts`): the runners, the
drafters, the prefix caches within their byte budget, the cost table and the planner. Three calls:

- `engine_settings(models, config)`: a handler config's settings, every `auto` resolved on this
  machine, once: the prefix cache's byte budget (a share of the memory free now,
  `handler.runtime.memory_budget`) and the runner (timed now, `handler.runners`).
- `engine_from_config(models, config, ...)`: what the handler calls at start-up: those settings, the
  cost table measured when `adaptive_k` asks for one, the engine.
- `build_engine(models, settings, cost_table=..., **changes)`: an engine from settings, with any of
  their fields changed by keyword. Tests and benchmarks say what they want in one call:
  `build_engine(models, drafter="ngram", runner="static")` is that pair drafting by n-gram look-up at
  each request's own k (no cost table), on the static runner. `LoadedModels.of` describes a pair
  loaded elsewhere.
"""

from __future__ import annotations

import dataclasses
import logging

from handler import runners
from handler.caches.kv_cache import tree_attention_error
from handler.config import CROSS_VOCAB_GREEDY, SPECULATIVE_TREE_MODES, TLI, HandlerConfig, SuffixOptions
from handler.drafters.ngram import NgramDrafter
from handler.drafters.suffix import SuffixDrafter
from handler.engine.admission import split_prefix_cache
from handler.engine.engine import EngineOptions, EngineParts, SpeculativeEngine
from handler.engine.propose import make_drafters
from handler.planning.acceptance import Estimates
from handler.planning.cost_table import RunningCostTable
from handler.planning.measure import measure_for_config
from handler.planning.planner import Planner
from handler.planning.trackers import OutcomeCheck
from handler.runtime.loading import LoadedModels
from handler.runtime.memory_budget import describe, prefix_cache_budget
from handler.types import MODEL, NGRAM

logger = logging.getLogger(__name__)

DEFAULT_SUFFIX_OPTIONS = SuffixOptions()


@dataclasses.dataclass(frozen=True)
class EngineSettings:
    """What an engine is built from, with nothing left to time or measure: the config keys of the same
    names (README), each `auto` resolved (`engine_settings`).

    The defaults are a bare engine's, as tests want one: each request drafts its own k (no cost
    table is given), no prefix cache, the default runner.
    """

    # The drafter of requests that name none; None: "model" with a draft model, else "ngram".
    drafter: str | None = None
    # The n-gram drafter's suffix lengths, and the most drafts one look-up proposes (0: the request's k).
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    prompt_lookup_num_tokens: int = 0
    # Both models' prefix caches together, in bytes; None: no prefix cache.
    prefix_cache_max_bytes: int | None = None
    # The suffix drafter's trees (`handler.drafters.suffix`).
    suffix: SuffixOptions = DEFAULT_SUFFIX_OPTIONS
    # "auto": trees of candidates where the target's attention takes a 4D mask with its cache
    # (checked at build); "off": chains only.
    speculative_tree: str = "auto"
    # With a cost table, the draft drafts until its calibrated confidence says one more draft does
    # not pay (`handler.planning.planner.ConfidenceStop`).
    draft_confidence: bool = False
    # A hybrid row's suffix trees guess the draft's next drafts, checked in one pass.
    draft_guesses: bool = False
    # "dynamic" or "static"; None: `handler.runners.DEFAULT_RUNNER` when the engine is built.
    runner: str | None = None
    # How a draft from another family drafts for greedy rows (`handler.drafters.cross_vocab`).
    cross_vocab_greedy: str = TLI

    def __post_init__(self) -> None:
        assert self.speculative_tree in SPECULATIVE_TREE_MODES, self.speculative_tree
        assert self.runner in (None, runners.DYNAMIC, runners.STATIC), f"runner: {self.runner!r} is not resolved"
        assert self.cross_vocab_greedy in CROSS_VOCAB_GREEDY, self.cross_vocab_greedy


def engine_settings(models: LoadedModels, config: HandlerConfig) -> EngineSettings:
    """The settings a handler config names for its loaded models. The prefix cache's budget is
    measured first, before the runner's timing or anything else takes memory; `runner: auto` is timed
    at the config's verify width (`handler.runners.config_runner`)."""
    budget = prefix_cache_budget(config, next(models.target.parameters()).device)
    logger.info("prefix cache: %s", describe(budget))
    return EngineSettings(
        drafter=config.drafter,
        prompt_lookup_min=config.prompt_lookup_min,
        prompt_lookup_max=config.prompt_lookup_max,
        prompt_lookup_num_tokens=config.prompt_lookup_num_tokens,
        prefix_cache_max_bytes=None if budget is None else budget.num_bytes,
        suffix=config.suffix_options,
        speculative_tree=config.speculative_tree,
        draft_confidence=config.draft_confidence,
        draft_guesses=config.draft_guesses,
        runner=runners.config_runner(config, models),
        cross_vocab_greedy=config.cross_vocab_greedy,
    )


def engine_from_config(
    models: LoadedModels,
    config: HandlerConfig,
    *,
    max_batch_size: int = 1,
    cache_dir: str | None = None,
    model_identity: str = "",
) -> SpeculativeEngine:
    """The engine a handler config describes, on models loaded by `handler.runtime.loading.load_models`.

    With `adaptive_k`, the cost table is measured now, through the runner that serves, on the device
    and dtype that serve, for up to `max_batch_size` rows (TorchServe's batchSize), and kept in
    `cache_dir` under `model_identity` (`handler.planning.measure`).
    """
    settings = engine_settings(models, config)
    cost_table = None
    if config.adaptive_k:
        cost_table = measure_for_config(
            models, config, max_batch_size, cache_dir=cache_dir, model_identity=model_identity, runner=settings.runner
        )
        logger.info("adaptive k: measured cost table\n%s", cost_table.format())
    return build_engine(models, settings, cost_table=cost_table)


def build_engine(
    models: LoadedModels,
    settings: EngineSettings | None = None,
    *,
    cost_table=None,
    options: EngineOptions | None = None,
    **changes,
) -> SpeculativeEngine:
    """An engine on `models` from `settings` (None: `EngineSettings()`), with `changes` to its fields.

    Args:
        cost_table: measured pass costs (`handler.planning.cost_table.CostTable`, or any object with
            `target_seconds(batch_size, width)` and `draft_seconds(batch_size)`): each step's k is
            planned for the batch; None: every row drafts its cap.
        options: benchmark and test knobs (`EngineOptions`); None: the defaults.
        changes: `EngineSettings` fields, e.g. `drafter="ngram", runner="static"`.
    """
    settings = dataclasses.replace(settings or EngineSettings(), **changes)
    return SpeculativeEngine(build_parts(models, settings, cost_table, options or EngineOptions()))


def build_parts(models: LoadedModels, settings: EngineSettings, cost_table, options: EngineOptions) -> EngineParts:
    """The runners, drafters, prefix caches and planner of an engine on `models` (`build_engine`)."""
    target, draft = models.target, models.draft
    runner = settings.runner or runners.DEFAULT_RUNNER
    target_runner = runners.make_runner(runner, target)
    outcome_check = None
    if cost_table is not None and options.running_costs and next(target.parameters()).device.type == "cpu":
        # On a CPU the passes the engine times rescale the table, and the plan's choice to draft is
        # checked against plain decoding as the steps ran (`handler.planning.trackers.OutcomeCheck`).
        cost_table = RunningCostTable(cost_table)
        outcome_check = OutcomeCheck()
    # The draft's prefix cache holds the KV of the form that prefills it (`LoadedModels.draft_prefill`).
    prefilling = draft if models.draft_prefill is None else models.draft_prefill
    target_prefix_cache, draft_prefix_cache = split_prefix_cache(target, prefilling, settings.prefix_cache_max_bytes)
    drafters = make_drafters(
        draft,
        NgramDrafter(settings.prompt_lookup_min, settings.prompt_lookup_max),
        SuffixDrafter(settings.suffix),
        draft_runner=runners.make_runner(runner, draft),
        vocab_size=target.config.get_text_config().vocab_size,
        pad_token_id=models.pad_token_id,
        prefix_cache=draft_prefix_cache,
        vocab_map=models.vocab_map,
        cross_vocab_greedy=settings.cross_vocab_greedy,
        draft_prefill=models.draft_prefill,
        draft_prefill_speedup=models.draft_prefill_speedup,
    )
    trees = False
    if settings.speculative_tree == "auto":
        error = tree_attention_error(target)
        if error is not None:
            logger.warning("speculative_tree: verifying chains only: %s", error)
        trees = error is None
    planner = Planner(
        cost_table,
        Estimates(options.suffix_estimate),
        drafters.get(MODEL),
        draft_confidence=settings.draft_confidence and draft is not None,
        # Guesses are the target's tokens, fed to the draft as its own: only for a shared vocabulary.
        draft_guesses=settings.draft_guesses and draft is not None and models.vocab_map is None,
        outcome_check=outcome_check,
    )
    return EngineParts(
        models=models,
        target_runner=target_runner,
        drafters=drafters,
        prefix_cache=target_prefix_cache,
        planner=planner,
        trees=trees,
        default_drafter=settings.drafter or (MODEL if draft is not None else NGRAM),
        prompt_lookup_num_tokens=settings.prompt_lookup_num_tokens,
        options=options,
    )
