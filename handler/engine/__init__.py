"""The speculative decoding engine, one step at a time: draft -> verify -> accept -> roll back.

Vocabulary (draft, target, accepted, recovered, bonus) is defined in `handler.sampler`, and the
engine's own (row, drafter, proposal, plan, drafts, runner) in docs/architecture.md. The
engine serves a changing batch of requests:

- `add_request` queues a request; at the next `step` its prompt is prefilled in a cache of its
  own, the logits after it give its first token, as plain decoding takes it, and its row joins
  the running batch (`admission`), drafting from its second token on.
  `abort_request` frees a row at the next step.
- `step` runs one speculative step over every row in flight (`engine`), with the rows' sampling
  settings as one batch of tensors (`handler.sampler.SamplingBatch`) for the draft and the target:
  1. each row's drafters say what it can draft (`propose.Proposer.options`, every drafter through
     `propose`): the tokens its grammar forces, a look-up's chain or tree, or the draft model;
  2. the planner prices the batch's choices with the cost table and decides each row's drafter,
     k and tree once (`handler.planning.planner.Planner.plan`, one `RowPlan` per row),
     which can be none (plain decoding);
  3. the draft model drafts for the rows the plan gives it (`propose.Proposer.draft`); each row
     then has its `Drafts`, what it verifies;
  4. the target verifies all drafts in one forward pass over the new tokens only, and the
     rejection sampler (for a seeded request, the coupling; for a tree, its walk) decides
     (`verify.Verifier`);
  5. each row emits its tokens, the estimates learn from the outcome
     (`handler.planning.acceptance`), and both caches roll back to the committed length. A
     finished row leaves at once.
  On a GPU a plain step (no row drafts) over rows whose rules need no tokens on the host is launched
  and read in the next call, after the next plain step's pass is launched from its tokens still on
  the device (`SpeculativeEngine.step`, `EngineOptions.overlap_plain_steps`): the host reads and
  commits one step while the device runs the next. Its tokens come out one call later.
- After its prefill a row always has exactly one pending target token: the last committed
  one, which the target has not processed yet. The draft model has its own pending tokens
  (see `handler.drafters.model`).
- `generate(requests)` is the static batch: add all, step until done.

The engine is built in one place, `build` (`build_engine`, `engine_from_config`): the runners, the
drafters, the prefix caches, the cost table and the planner, from a handler config or a test's
keywords; `SpeculativeEngine` receives them built (`EngineParts`).

A seeded sampled request is verified by coupling (`handler.sampler.coupled_targets`): its output
depends on its seed and the target alone, so neither the plan nor the rows beside it can change it.

Nothing here imports TorchServe.
"""

from handler.drafters import PROPOSER_GRAMMAR
from handler.engine.build import EngineSettings, build_engine, engine_from_config, engine_settings
from handler.engine.engine import EngineOptions, EngineParts, SpeculativeEngine
from handler.engine.record import StepRecord
from handler.types import GenerationRequest, GenerationResult, SpeculativeStats, StepOutput, TokenLogprob

__all__ = [
    "PROPOSER_GRAMMAR",
    "EngineOptions",
    "EngineParts",
    "EngineSettings",
    "GenerationRequest",
    "GenerationResult",
    "SpeculativeEngine",
    "SpeculativeStats",
    "StepOutput",
    "StepRecord",
    "TokenLogprob",
    "build_engine",
    "engine_from_config",
    "engine_settings",
]
