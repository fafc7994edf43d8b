"""Steps after plans that priced drafting well below plain decoding skip planning (`PlainStreak`), float32.

Such a step skips the drafters' look-ups and the plan, as plain decoding does. Its tokens are plain
decoding's: greedy output stays the target's. Where drafting may pay, no step skips.
"""

from __future__ import annotations

import pytest

from handler.engine import GenerationRequest
from handler.planning.cost_table import CostModel

from .conftest import make_engine
from .test_engine import CONFIDENT_COSTS, GREEDY, PROMPTS, encode, reference_greedy

# A draft pass at 5 target passes and a verified column at 2: no plan can beat plain decoding.
DEAR_DRAFTS = CostModel(draft_step=5.0, target_step=1.0, target_per_extra_token=2.0)


def counted_engine(tiny_pair, costs, min_share: float):
    target, draft, tokenizer = tiny_pair
    engine = make_engine(target, draft, tokenizer, cost_table=costs, drafter="hybrid", draft_confidence=True)
    engine.planner.plain_streak.min_share = min_share
    asked = []
    real = engine.proposer.options

    def options(rows, sampling):
        asked.append(len(rows))
        return real(rows, sampling)

    engine.proposer.options = options
    return engine, asked


@pytest.mark.parametrize("min_share", [0.0, 1.0])
def test_steps_after_plain_plans_with_a_margin_skip_planning_and_keep_the_targets_output(tiny_pair, min_share):
    """With `min_share` 0 every plain plan priced well below plain decoding grants its skips; at 1 (planning never costs a whole
    plain step) none does, and every step asks the drafters."""
    target, _, tokenizer = tiny_pair
    engine, asked = counted_engine(tiny_pair, DEAR_DRAFTS, min_share)
    prompts = [encode(tokenizer, prompt) for prompt in PROMPTS[:3]]
    steps_before = engine.steps.num_steps
    results = engine.generate([GenerationRequest(p, 40, GREEDY, 8) for p in prompts])
    assert [r.token_ids for r in results] == [reference_greedy(target, p, 40) for p in prompts]
    num_steps = engine.steps.num_steps - steps_before
    if min_share:
        assert engine.planner.plain_streak.num_skipped == 0 and len(asked) == num_steps
    else:
        # 1, 2, 4, 4, ... skips after each plan: about 4 in 5 steps skip once the streak has grown.
        assert engine.planner.plain_streak.num_skipped >= num_steps // 2, (num_steps, len(asked))
        assert len(asked) + engine.planner.plain_streak.num_skipped == num_steps


def test_where_drafting_pays_no_step_skips(tiny_pair):
    target, _, tokenizer = tiny_pair
    engine, asked = counted_engine(tiny_pair, CONFIDENT_COSTS, 0.0)
    prompts = [encode(tokenizer, prompt) for prompt in PROMPTS[:3]]
    results = engine.generate([GenerationRequest(p, 40, GREEDY, 8) for p in prompts])
    assert [r.token_ids for r in results] == [reference_greedy(target, p, 40) for p in prompts]
    assert sum(r.stats.draft_tokens for r in results) > 0
    assert engine.planner.plain_streak.num_skipped == 0


def test_rows_that_join_under_a_reused_request_id_are_planned_at_once(tiny_pair):
    """The streak follows the batch's rows, not their ids: a request that reuses a finished one's id
    joins a new batch, and its first step asks the drafters."""
    _, _, tokenizer = tiny_pair
    engine, asked = counted_engine(tiny_pair, DEAR_DRAFTS, 0.0)
    prompt_ids = encode(tokenizer, PROMPTS[0])
    for _ in range(2):
        engine.add_request("same", GenerationRequest(prompt_ids, 30, GREEDY, 8))
        while engine.has_unfinished_requests():
            engine.step()
        skipped = engine.planner.plain_streak.num_skipped
        assert skipped > 0
        engine.add_request("same", GenerationRequest(prompt_ids, 30, GREEDY, 8))
        num_asked = len(asked)
        engine.step()  # admits it, and plans its first drafting step
        assert len(asked) == num_asked + 1 and engine.planner.plain_streak.num_skipped == skipped
        engine.abort_request("same")
        engine.step()


def drafter_states(engine) -> dict:
    """What each drafter knows of each row, rows in the order they came (`generate`'s ids differ from
    run to run): the suffix drafter's context, the n-gram index's tokens, the draft model's pending ones."""
    suffix, ngram, model = (engine.drafter_map[name] for name in ("suffix", "ngram", "model"))
    return {
        "suffix": [list(row.context) for row in suffix.rows.values()],
        "ngram": [list(index.tokens) for index in ngram.rows.values()],
        "model": [list(tokens) for tokens in model.pending.values()],
        "held": suffix.stats,
    }


def test_steps_that_draft_nothing_hand_their_tokens_to_the_drafters_at_the_next_plan(tiny_pair, monkeypatch):
    """A plain step's tokens wait (`Batch.observe`), and the drafters, when next asked, know what
    observing every step would have told them; a finished row's outputs reach the shared suffix tree."""
    target, _, tokenizer = tiny_pair
    prompts = [encode(tokenizer, prompt) for prompt in PROMPTS[:3]]
    seen, waited = {}, []
    for mode in ("deferred", "every step"):
        engine, _ = counted_engine(tiny_pair, DEAR_DRAFTS, 0.0)
        if mode == "every step":
            real = engine.batch.observe
            monkeypatch.setattr(engine.batch, "observe", lambda committed, drafted: real(committed, True))
        states, options = [], engine.proposer.options

        def asked(rows, sampling, engine=engine, states=states, options=options):
            states.append(drafter_states(engine))
            return options(rows, sampling)

        engine.proposer.options = asked
        requests = [GenerationRequest(p, 24 + 8 * i, GREEDY, 8) for i, p in enumerate(prompts)]
        results = engine.generate(requests, on_tokens=lambda *_, engine=engine: waited.append(bool(engine.batch.unobserved)))
        assert [r.token_ids for r in results] == [reference_greedy(target, p, 24 + 8 * i) for i, p in enumerate(prompts)]
        assert not engine.batch.unobserved
        seen[mode] = (states, engine.suffix_drafter.stats)
    assert seen["deferred"] == seen["every step"]
    assert any(waited) and len(seen["deferred"][0]) > 1  # tokens waited, over several plans
    assert seen["deferred"][1].num_requests == 3  # every finished row's outputs are held, shared
