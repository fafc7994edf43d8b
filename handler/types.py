"""The engine's request and result types, torch-free: what the API layers, serving and the benchmarks share.

- `DrafterName`: who proposes a row's drafts;
- `SamplingParams` (and the sampling rules, `sampling_problem`), `GenerationRequest`;
- `TokenLogprob`, `SpeculativeStats` (per-request counters; `merge` adds up several),
  `GenerationResult`, `StepOutput`;
- `Engine`: what serving asks of an engine, which `handler.engine.SpeculativeEngine` and the
  tests' fake both are (a test checks).

- the drafters' names (`MODEL`, `NGRAM`, `SUFFIX`, `HYBRID`), which requests and the config name
  and `handler.drafters` implements.

Nothing here imports torch, transformers or the drafters.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Callable, Hashable, Protocol, runtime_checkable

if TYPE_CHECKING:
    from handler.constraints import Constraint


class DrafterName(enum.StrEnum):
    """Who proposes a row's drafts (`handler.drafters`). The values are the config's, the requests' and
    the metrics' strings, and a member equals its string."""

    MODEL = "model"  # the draft model
    NGRAM = "ngram"  # prompt look-up
    SUFFIX = "suffix"  # suffix trees
    HYBRID = "hybrid"  # per row and step, the most promising of the three
    GRAMMAR = "grammar"  # not a request's choice: the tokens a constraint's grammar forces


# The drafters a request or the config may name (handler.drafters implements them).
MODEL = DrafterName.MODEL
NGRAM = DrafterName.NGRAM
SUFFIX = DrafterName.SUFFIX
HYBRID = DrafterName.HYBRID
DRAFTERS = (MODEL, NGRAM, SUFFIX, HYBRID)
# The drafters that need no draft model.
MODEL_FREE = (NGRAM, SUFFIX)
# The default drafter's name.
DRAFTER_MODEL = MODEL


# OpenAI's ranges for the penalties and the logit bias; a repetition penalty (a multiplier)
# above 10 all but bans every seen token, which no one means.
PENALTY_RANGE = (-2.0, 2.0)
MAX_REPETITION_PENALTY = 10.0
LOGIT_BIAS_RANGE = (-100.0, 100.0)
# The sampling fields that are plain numbers (top_k is an int; logit_bias a mapping, per request only).
SAMPLING_NUMBER_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


def sampling_problem(
    temperature: float,
    top_k: int,
    top_p: float,
    *,
    min_p: float = 0.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    repetition_penalty: float = 1.0,
    logit_bias: Sequence[tuple[int, float]] = (),
) -> str | None:
    """The sampling rules, shared by the config and the REST request: a message naming the field, or None."""
    if not (math.isfinite(temperature) and temperature >= 0):
        return f"temperature: must be a finite number >= 0 (0 means greedy), got {temperature}"
    if top_k < 0:
        return f"top_k: must be >= 0, got {top_k}"
    if not 0.0 < top_p <= 1.0:
        return f"top_p: must be in (0, 1], got {top_p}"
    # The comparisons below are False for NaN, so NaN is refused too.
    if not 0.0 <= min_p <= 1.0:
        return f"min_p: must be in [0, 1] (0 means off), got {min_p}"
    low, high = PENALTY_RANGE
    for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if not low <= value <= high:
            return f"{name}: must be in [{low:g}, {high:g}] (0 means off), got {value}"
    if not 0.0 < repetition_penalty <= MAX_REPETITION_PENALTY:
        return f"repetition_penalty: must be in (0, {MAX_REPETITION_PENALTY:g}] (1 means off), got {repetition_penalty}"
    low, high = LOGIT_BIAS_RANGE
    token_ids = set()
    for token_id, bias in logit_bias:
        if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
            return f"logit_bias: token ids must be integers >= 0, got {token_id!r}"
        if token_id in token_ids:
            return f"logit_bias: token {token_id} is given twice"
        token_ids.add(token_id)
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not low <= bias <= high:
            return f"logit_bias: the bias of token {token_id} must be in [{low:g}, {high:g}], got {bias!r}"
    return None


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Temperature 0 means greedy; top_k 0, top_p 1.0 and min_p 0 mean no filtering.

    The penalties and the logit bias change the logits before the warping
    (`handler.logits_processors`): presence and frequency 0, repetition 1.0 and
    no bias mean off. `logit_bias` holds (token id, bias) pairs sorted by id, a
    tuple so that the params stay hashable; a mapping given here is turned into
    one.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        pairs = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        pairs = tuple(tuple(pair) for pair in pairs)
        if any(len(pair) != 2 for pair in pairs):
            raise ValueError(f"logit_bias: must be (token id, bias) pairs, got {self.logit_bias!r}")
        problem = sampling_problem(
            self.temperature,
            self.top_k,
            self.top_p,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=pairs,
        )
        if problem:
            raise ValueError(problem)
        object.__setattr__(self, "logit_bias", tuple(sorted((token_id, float(bias)) for token_id, bias in pairs)))

    @functools.cached_property
    def is_greedy(self) -> bool:  # cached: read for every row, several times a planned step
        return self.temperature == 0.0

    # Cached: the settings are frozen, and the step asks for these per row, several times a step.
    @functools.cached_property
    def needs_history(self) -> bool:
        """Whether a penalty is on, so that the engine must keep the row's token counts."""
        return self.needs_output_counts or self.needs_seen_tokens

    @property
    def needs_output_counts(self) -> bool:
        """Presence or frequency penalty: counts of the generated tokens (not the prompt's)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def needs_seen_tokens(self) -> bool:
        """Repetition penalty: which tokens the prompt or the output holds."""
        return self.repetition_penalty != 1.0

    @functools.cached_property
    def processes_logits(self) -> bool:
        """Whether `handler.logits_processors.process_row_logits` changes this row's logits."""
        return self.needs_history or bool(self.logit_bias)


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    num_speculative_tokens: int = 4
    seed: int | None = None
    stop: tuple[str, ...] = ()
    # "model" | "ngram" | "suffix" | "hybrid"; None means the engine's default drafter.
    drafter: str | None = None
    # False: the suffix drafter neither adds this request's output to the tree it shares
    # across requests nor drafts from that tree. None: the server's setting, which a request
    # can only narrow.
    suffix_share_across_requests: bool | None = None
    # None: no log-probabilities; N >= 0: each emitted token's, plus the top N.
    logprobs: int | None = None
    # What the output must match (handler.constraints); None: free text.
    constraint: Constraint | None = None
    # False: this request's look-ups propose chains only. None: the server's speculative_tree.
    speculative_tree: bool | None = None


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """The target's log-probability of an emitted token, from its raw logits (before any warping)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


def count_accepted_prefix(per_position: list[int], num_accepted: int) -> None:
    """Counts one step's accepted drafts by position: they are a prefix, so positions 0 to
    `num_accepted` - 1 each gain one (the list grows as needed)."""
    per_position.extend([0] * (num_accepted - len(per_position)))
    for position in range(num_accepted):
        per_position[position] += 1


@dataclasses.dataclass
class SpeculativeStats:
    """Per-request counters. One verification of a batch counts once for each row in it."""

    num_speculative_tokens: int
    drafter: str = DRAFTER_MODEL
    draft_tokens: int = 0
    accepted_tokens: int = 0
    target_forward_passes: int = 0
    completion_tokens: int = 0
    # Steps that ended on a rejected draft; accepted / (accepted + rejections) estimates
    # the per-token acceptance probability of Leviathan et al.'s model.
    rejections: int = 0
    # Steps that verified at least one draft (vLLM's num_drafts).
    num_drafts: int = 0
    # The cost table found plain decoding faster for some steps and drafted nothing.
    fell_back: bool = False
    # Proposed and accepted drafts per drafter that proposed them ("model", "ngram", "suffix", "grammar").
    draft_tokens_by_drafter: dict[str, int] = dataclasses.field(default_factory=dict)
    accepted_tokens_by_drafter: dict[str, int] = dataclasses.field(default_factory=dict)
    # accepted_per_position[j]: steps whose draft j was accepted.
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)
    # Structured output: whether a constraint applied, and the seconds spent on its masks.
    constrained: bool = False
    mask_seconds: float = 0.0
    # Tree verification (`handler.tree`): steps that verified a tree with a branch, their nodes,
    # their accepted depth, and the steps whose accepted path left the first-choice branch.
    tree_steps: int = 0
    tree_nodes: int = 0
    tree_accepted_depth: int = 0
    tree_other_branch: int = 0
    # Draft-model passes that drafted for this request, counted once per request in a batch: fewer
    # than its model drafts where guessed drafting (draft_guesses) drafted several in one pass.
    draft_passes: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per target forward pass."""
        return self.completion_tokens / self.target_forward_passes if self.target_forward_passes else 0.0

    def record(self, proposer: str, num_drafts: int, num_accepted: int) -> None:
        """Counts one verification of `num_drafts` drafts from `proposer`, `num_accepted` of them kept."""
        self.target_forward_passes += 1
        if num_drafts == 0:
            return
        self.num_drafts += 1
        self.draft_tokens += num_drafts
        self.accepted_tokens += num_accepted
        self.rejections += int(num_accepted < num_drafts)
        self.draft_tokens_by_drafter[proposer] = self.draft_tokens_by_drafter.get(proposer, 0) + num_drafts
        self.accepted_tokens_by_drafter[proposer] = self.accepted_tokens_by_drafter.get(proposer, 0) + num_accepted
        count_accepted_prefix(self.accepted_per_position, num_accepted)

    def record_tree(self, num_nodes: int, depth: int, first_choice: bool) -> None:
        """Counts one verified tree of `num_nodes` nodes whose accepted path is `depth` drafts deep."""
        self.tree_steps += 1
        self.tree_nodes += num_nodes
        self.tree_accepted_depth += depth
        self.tree_other_branch += int(not first_choice)

    @classmethod
    def merge(cls, stats: Sequence[SpeculativeStats]) -> SpeculativeStats:
        """Several rows' counters added up (the choices of one OpenAI request, a benchmark's run).

        Counts add, per drafter and per draft position too; `fell_back` and `constrained` are any
        one's; the settings (`num_speculative_tokens`, `drafter`) are the first's. The rates follow
        from the sums.
        """
        assert stats, "nothing to merge"
        merged = cls(stats[0].num_speculative_tokens, stats[0].drafter)
        for one in stats:
            for field in dataclasses.fields(cls):
                value = getattr(one, field.name)
                if field.name in ("num_speculative_tokens", "drafter"):
                    continue
                if isinstance(value, bool):
                    setattr(merged, field.name, getattr(merged, field.name) or value)
                elif isinstance(value, (int, float)):
                    setattr(merged, field.name, getattr(merged, field.name) + value)
                elif isinstance(value, dict):
                    total = getattr(merged, field.name)
                    for key, count in value.items():
                        total[key] = total.get(key, 0) + count
                elif isinstance(value, list):
                    total = getattr(merged, field.name)
                    total.extend([0] * (len(value) - len(total)))
                    for position, count in enumerate(value):
                        total[position] += count
        return merged

    def as_dict(self) -> dict:
        proposers = sorted(self.draft_tokens_by_drafter)
        return {
            "num_speculative_tokens": self.num_speculative_tokens,
            "drafter": self.drafter,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "target_forward_passes": self.target_forward_passes,
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "fell_back_to_target_only": self.fell_back,
            "draft_passes": self.draft_passes,
            "by_drafter": {
                name: {
                    "draft_tokens": self.draft_tokens_by_drafter[name],
                    "accepted_tokens": self.accepted_tokens_by_drafter[name],
                }
                for name in proposers
            },
            "accepted_per_position": list(self.accepted_per_position),
            "tree": {
                "steps": self.tree_steps,
                "nodes": self.tree_nodes,
                "accepted_depth": self.tree_accepted_depth,
                "other_branch": self.tree_other_branch,
            },
        }


@dataclasses.dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str
    prompt_tokens: int
    stats: SpeculativeStats
    logprobs: list[TokenLogprob] | None = None
    # Prompt tokens whose target KV came from the prefix cache (OpenAI's cached_tokens).
    cached_tokens: int = 0


@dataclasses.dataclass
class StepOutput:
    """What one step produced for one request."""

    request_id: Hashable
    new_token_ids: list[int]  # emitted this step, possibly none
    token_ids: list[int]  # everything emitted so far; do not mutate
    finish_reason: str | None  # set when the request finished this step
    result: GenerationResult | None  # set when the request finished this step
    # The drafts this step verified for the request (a tree's nodes) and how many it accepted, as
    # its `SpeculativeStats` counts them; 0 and 0 for a first token from the prefill.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@runtime_checkable
class Engine(Protocol):
    """What `handler.serving` asks of an engine: the step API, and `generate` for a whole batch."""

    def add_request(self, request_id: Hashable, request: GenerationRequest) -> None: ...

    def abort_request(self, request_id: Hashable) -> None: ...

    def has_unfinished_requests(self) -> bool: ...

    def num_active_requests(self) -> int: ...

    def step(self) -> list[StepOutput]: ...

    def generate(
        self,
        requests: Sequence[GenerationRequest],
        on_tokens: Callable[[int, list[int], StepOutput], None] | None = None,
    ) -> list[GenerationResult]: ...

    def reset(self) -> None: ...
