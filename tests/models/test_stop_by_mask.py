"""The confidence stop as a mask (`ModelDrafter.stop_by_mask`): the chains run their k passes on the
device and are read once, and the stop rule is asked afterwards, on what was read.

Both ways run on the CPU. In float32 the mask's proposals (drafts, distributions, confidences,
runners-up), the drafts decided, the counts, the rule's calls and the draft cache after the proposal
and after `observe` must equal the general loop's, which reads every pass and stops there; through
the engine, greedy output stays the target's and a seeded request keeps its tokens. With the mask, a
proposal reads the device once.
"""

from __future__ import annotations

import pytest
import torch

from handler import runners
from handler.drafters import DraftRow
from handler.drafters.model import ModelDrafter
from handler.engine import GenerationRequest

from .conftest import make_engine
from .test_engine import CONFIDENT_COSTS, GREEDY, PROMPTS, SAMPLED, encode, reference_greedy
from .test_propose import sampling_batch, settings

# The rows that verify (request id -> `settings`), and the cache's rows that do not (they draft greedily
# to keep the batch rectangular).
COMPOSITIONS = {
    "greedy": ({"a": settings(0.0, 1)}, ()),
    "sampled": ({"a": settings(0.9, 2)}, ()),
    "greedy batch": ({"a": settings(0.0, 3), "c": settings(0.0, 4, k=4)}, ("e",)),
    "mixed batch": (
        {"a": settings(0.0, 5), "b": settings(0.9, 6), "c": settings(0.9, 7, k=3), "d": settings(0.7, 8)},
        ("e",),
    ),
}


class Rule:
    """A stop rule (`keep_drafting`) that keeps state, as `ConfidenceStop` does, and records its calls."""

    def __init__(self, decide) -> None:
        self.decide = decide
        self.calls: list[tuple[int, dict]] = []
        self.survival = 1.0

    def __call__(self, num_drafted: int, confidences: dict) -> bool:
        self.calls.append((num_drafted, dict(confidences)))
        self.survival *= min(confidences.values())
        return self.decide(num_drafted, self.survival)


RULES = {
    "none": None,
    "never stops": lambda num, survival: True,
    "after the first": lambda num, survival: False,
    "after three": lambda num, survival: num < 3,
    "by confidence": lambda num, survival: survival > 0.1**num,
}


def drafter_for(tiny_pair, prompts: dict, stop_by_mask: bool) -> ModelDrafter:
    target, draft, tokenizer = tiny_pair
    runner = runners.make_runner(runners.DEFAULT_RUNNER, draft)
    drafter = ModelDrafter(
        draft, target.config.vocab_size, tokenizer.pad_token_id, runner=runner, stop_by_mask=stop_by_mask
    )
    drafter.add(prompts)
    drafter.fill(list(prompts))
    return drafter


def propose(drafter: ModelDrafter, sampling: dict, rule: Rule | None) -> dict:
    """The drafter's proposals for the rows of `sampling` (request id -> `settings`), by request id."""
    ids = list(sampling)
    batch = sampling_batch(sampling, drafter.device)
    rows = [DraftRow(rid, len(sampling[rid][3]), slot, measure_confidence=True) for slot, rid in enumerate(ids)]
    return dict(zip(ids, drafter.propose(rows, batch, keep_drafting=rule)))


def assert_same_state(loop: ModelDrafter, mask: ModelDrafter) -> None:
    """The same draft cache and bookkeeping: the mask's extra passes left nothing behind."""
    assert torch.equal(mask.cache.lengths, loop.cache.lengths)
    assert (mask.pending, mask.fed, mask.fed_pending) == (loop.pending, loop.fed, loop.fed_pending)


@pytest.mark.parametrize("rule_name", RULES)
@pytest.mark.parametrize("composition", COMPOSITIONS)
@torch.inference_mode()  # as the engine drafts: the static runner's buffers are inference tensors
def test_the_mask_proposes_what_the_loop_stops_at(tiny_pair, composition, rule_name):
    tokenizer = tiny_pair[2]
    sampling, others = COMPOSITIONS[composition]
    prompts = {rid: encode(tokenizer, PROMPTS["abcde".index(rid)]) for rid in [*sampling, *others]}
    loop, mask = (drafter_for(tiny_pair, prompts, stop_by_mask) for stop_by_mask in (False, True))
    k = max(len(setting[3]) for setting in sampling.values())
    num_drafts = []
    for _ in range(2):
        rules = [Rule(RULES[rule_name]) if RULES[rule_name] else None for _ in range(2)]
        expected, actual = propose(loop, sampling, rules[0]), propose(mask, sampling, rules[1])
        if rules[0] is not None:
            assert rules[1].calls == rules[0].calls  # the same questions, the same confidences
        for rid in sampling:
            assert actual[rid].token_ids == expected[rid].token_ids, rid
            if actual[rid].draft_probs is None:  # every row greedy: one-hot at the drafts, in both
                assert expected[rid].draft_probs is None, rid
            else:
                assert torch.equal(actual[rid].draft_probs, expected[rid].draft_probs), rid
            assert actual[rid].confidences == expected[rid].confidences, rid
            assert actual[rid].runners_up == expected[rid].runners_up, rid
            assert mask.passes_needed(rid, len(actual[rid].token_ids)) == loop.passes_needed(
                rid, len(expected[rid].token_ids)
            )
        assert (mask.last_num_drafts, mask.last_draft_counts) == (loop.last_num_drafts, loop.last_draft_counts)
        # The loop ran until the stop, the mask ran all k and says so.
        assert loop.last_num_passes == loop.last_num_drafts and mask.last_num_passes == k
        num_drafts.append(loop.last_num_drafts)
        assert_same_state(loop, mask)
        committed = {rid: [*proposal.token_ids[:2], 7] for rid, proposal in expected.items()}
        loop.observe(committed)
        mask.observe(committed)
        assert_same_state(loop, mask)
    if rule_name == "after the first":
        assert num_drafts == [1, 1]
    elif rule_name == "after three":
        assert num_drafts == [3, 3]
    elif rule_name != "by confidence":
        assert num_drafts == [k, k]


@torch.inference_mode()
def test_the_confidence_rule_stops_at_different_drafts(tiny_pair):
    """The rule "by confidence" above is no fixed count: it stops between the first draft and k."""
    tokenizer = tiny_pair[2]
    stops = set()
    for index, prompt in enumerate(PROMPTS):
        drafter = drafter_for(tiny_pair, {"a": encode(tokenizer, prompt)}, True)
        for temperature in (0.0, 0.9):
            propose(drafter, {"a": settings(temperature, index)}, Rule(RULES["by confidence"]))
            stops.add(drafter.last_num_drafts)
            drafter.observe({})
    assert len(stops) > 1 and min(stops) < 6, stops


def confident_engine(tiny_pair, stop_by_mask: bool, target_drafts: bool = False):
    target, draft, tokenizer = tiny_pair
    engine = make_engine(
        target, target if target_drafts else draft, tokenizer, cost_table=CONFIDENT_COSTS, draft_confidence=True
    )
    engine.model_drafter.stop_by_mask = stop_by_mask
    return engine


def test_greedy_output_with_the_mask_is_the_targets(tiny_pair):
    target, _, tokenizer = tiny_pair
    prompts = [encode(tokenizer, prompt) for prompt in PROMPTS[:3]]
    masked, looped = confident_engine(tiny_pair, True), confident_engine(tiny_pair, False)
    # The two plan alike here (`test_with_the_mask_the_plan_keeps_its_priced_k` has how they differ), so
    # that the steps below differ by the way the stop is applied alone.
    masked.planner._stops_by_mask = lambda choices, uses_model: False
    for prompt_ids in prompts:
        result = masked.generate([GenerationRequest(prompt_ids, 40, GREEDY, 8)])[0]
        assert result.token_ids == reference_greedy(target, prompt_ids, 40)
        looped.generate([GenerationRequest(prompt_ids, 40, GREEDY, 8)])
    batch = [GenerationRequest(prompt_ids, 40, GREEDY, 8) for prompt_ids in prompts]
    batch.append(GenerationRequest(prompts[0], 40, GREEDY, 4, drafter="ngram"))
    results = masked.generate(batch)
    assert [r.token_ids for r in results[:3]] == [reference_greedy(target, p, 40) for p in prompts]
    # The same drafts as the loop's, step by step: the same stats, but for the passes that ran.
    expected = looped.generate(batch)
    assert [(r.token_ids, r.stats.draft_tokens, r.stats.accepted_tokens) for r in results] == [
        (r.token_ids, r.stats.draft_tokens, r.stats.accepted_tokens) for r in expected
    ]
    assert [r.stats.draft_passes for r in results] == [r.stats.draft_passes for r in expected]
    masked_steps, looped_steps = list(masked.steps.recent_steps), list(looped.steps.recent_steps)
    assert [s.ks for s in masked_steps] == [s.ks for s in looped_steps]
    # A step that stopped short of its cap still ran the cap's passes, and its record says so.
    assert all(m.draft_passes >= s.draft_passes for m, s in zip(masked_steps, looped_steps))
    assert any(m.draft_passes > s.draft_passes for m, s in zip(masked_steps, looped_steps))


def test_with_the_mask_the_plan_keeps_its_priced_k(tiny_pair):
    """With the loop, a confident plan drafts up to the row's cap and the stop ends the passes; with the
    mask every planned pass runs, so the plan keeps the k it priced and the stop only cuts drafts. Each
    masked step runs as many draft passes as its plan's most model drafts; greedy output stays the target's."""
    target, _, tokenizer = tiny_pair
    prompts = [encode(tokenizer, prompt) for prompt in PROMPTS[:3]]
    planned = {}
    for stop_by_mask in (True, False):
        engine = confident_engine(tiny_pair, stop_by_mask)
        plans = planned[stop_by_mask] = []
        real = engine.planner.plan

        def recorded(*args, real=real, plans=plans, **kwargs):
            plan = real(*args, **kwargs)
            plans.append([row.k for row in plan.rows if row.uses_model])
            return plan

        engine.planner.plan = recorded
        results = engine.generate([GenerationRequest(p, 40, GREEDY, 8) for p in prompts])
        assert [r.token_ids for r in results] == [reference_greedy(target, p, 40) for p in prompts]
        steps = list(engine.steps.recent_steps)
        drafting = [(ks, step) for ks, step in zip(plans, steps) if ks]
        assert drafting
        if stop_by_mask:
            assert all(step.draft_passes == max(ks) for ks, step in drafting), drafting
    # The loop plans the cap (8, or the room left); the mask plans the priced k, below the cap at times.
    assert all(k == 8 for ks in planned[False][:5] for k in ks), planned[False][:5]
    assert any(k < 8 for ks in planned[True][:5] for k in ks), planned[True][:5]


def test_a_seeded_request_keeps_its_tokens_with_the_mask(tiny_pair):
    _, _, tokenizer = tiny_pair
    prompt_ids = encode(tokenizer, PROMPTS[1])
    others = [
        GenerationRequest(encode(tokenizer, PROMPTS[3]), 24, GREEDY, 6),
        GenerationRequest(encode(tokenizer, PROMPTS[2]), 24, SAMPLED, 4, seed=8),
    ]
    outputs = []
    for stop_by_mask in (False, True):
        engine = confident_engine(tiny_pair, stop_by_mask)
        plain = engine.generate([GenerationRequest(prompt_ids, 24, SAMPLED, 0, seed=3)])[0].token_ids
        for k in (1, 4, 8):
            request = GenerationRequest(prompt_ids, 24, SAMPLED, k, seed=3)
            outputs += [
                plain,
                engine.generate([request])[0].token_ids,
                engine.generate([*others, request])[-1].token_ids,
            ]
    assert all(tokens == outputs[0] for tokens in outputs), outputs


def test_a_masked_proposal_reads_the_device_once(tiny_pair, monkeypatch):
    """Counted as `scripts.bench.host_syncs` counts (on a CPU, the reads the same code would make on a
    GPU): with the mask, the drafter reads once in every model proposal of a planned step; the loop
    reads every pass. The runners' reads (the dynamic one's masks) are not the drafter's: left out."""
    from scripts.bench.host_syncs import HostReads

    target, _, tokenizer = tiny_pair
    prompts = [encode(tokenizer, prompt) for prompt in PROMPTS[:3]]
    for stop_by_mask in (True, False):
        # The target drafts for itself: every draft is accepted and the stop lets chains grow.
        engine = confident_engine(tiny_pair, stop_by_mask, target_drafts=True)
        drafter = engine.model_drafter
        counter = HostReads("cpu", [target])
        reads = []
        real = drafter.propose

        def counted(*args, real=real, counter=counter, reads=reads, drafter=drafter, **kwargs):
            counter.by_line.clear()
            proposals = real(*args, **kwargs)
            num_reads = sum(num for line, num in counter.by_line.items() if line.startswith("handler/drafters/"))
            reads.append((num_reads, drafter.last_num_passes))
            return proposals

        monkeypatch.setattr(drafter, "propose", counted)
        with counter:
            engine.generate([GenerationRequest(p, 30, GREEDY, 6) for p in prompts])
        assert reads
        if stop_by_mask:
            assert all(num_reads == 1 for num_reads, _ in reads), reads
        else:
            # Four a pass: the drafts, their confidences, the runners-up and their probabilities.
            assert all(num_reads == 4 * num_passes for num_reads, num_passes in reads), reads
            assert any(num_passes > 1 for _, num_passes in reads), reads
        monkeypatch.undo()


@pytest.mark.parametrize("draft_confidence", [False, True])
def test_a_planned_step_measures_confidences_only_where_the_stop_or_the_runners_up_use_them(
    tiny_pair, draft_confidence
):
    """A cost table plans the steps; without the confidence stop and with no row that may take runners-up
    (trees off), the draft measures no confidences, its drafts stay on the device into the verify, and
    a drafting step reads the device once, as a plain one does. With the stop they are measured and
    read before the verify pass: two reads. Greedy output is the target's either way. The static runner,
    as on a GPU: the dynamic one's attention masks are read by transformers' own code."""
    from scripts.bench.host_syncs import HostReads

    target, draft, tokenizer = tiny_pair
    prompts = [encode(tokenizer, prompt) for prompt in PROMPTS[:3]]
    engine = make_engine(
        target,
        target,
        tokenizer,
        cost_table=CONFIDENT_COSTS,
        draft_confidence=draft_confidence,
        speculative_tree="off",
        runner="static",
    )
    engine.model_drafter.stop_by_mask = True
    engine.model_drafter.drafts_on_device = True  # as on a GPU
    counter = HostReads("cpu", [target])
    reads, measured = [], []
    real_step, real_propose = engine.step, engine.model_drafter.propose

    def step():
        counter.reset()
        outputs = real_step()
        reads.append((counter.reads, sum(output.num_draft_tokens for output in outputs)))
        return outputs

    def propose(rows, *args, **kwargs):
        measured.append(any(row.measure_confidence for row in rows))
        return real_propose(rows, *args, **kwargs)

    engine.step, engine.model_drafter.propose = step, propose
    with counter:
        results = engine.generate([GenerationRequest(p, 30, GREEDY, 6) for p in prompts])
    assert [r.token_ids for r in results] == [reference_greedy(target, p, 30) for p in prompts]
    drafting = [num_reads for num_reads, num_drafts in reads[1:] if num_drafts]  # the first step admits too
    assert drafting and measured
    assert all(measured) if draft_confidence else not any(measured)
    assert all(num_reads == (2 if draft_confidence else 1) for num_reads in drafting), reads


def fix_unseeded_generator(monkeypatch) -> None:
    """Every unseeded row draws from the same fixed generator, so that two engines draw the same uniforms."""
    from handler.engine import row as row_module

    def fixed_generator():
        generator = torch.Generator()
        generator.manual_seed(11)
        return generator

    monkeypatch.setattr(row_module, "unseeded_generator", fixed_generator)


@pytest.mark.parametrize("runner", ["dynamic", "static"])
def test_drafts_left_on_the_device_give_the_outputs_of_drafts_read_at_once(tiny_pair, runner, monkeypatch):
    """`drafts_on_device` (a GPU's default): the chains' drafts reach the host with the verdict. Greedy
    output stays the target's, and a batch of greedy, seeded (coupled) and unseeded (rejection-sampled)
    rows gives the tokens it gives where the drafts are read after the last pass; the unseeded row's
    generator is fixed here, so that both ways draw the same uniforms."""
    fix_unseeded_generator(monkeypatch)
    target, draft, tokenizer = tiny_pair
    prompts = [encode(tokenizer, prompt) for prompt in PROMPTS[:3]]
    batch = [
        GenerationRequest(prompts[0], 24, GREEDY, 4),
        GenerationRequest(prompts[1], 24, SAMPLED, 6, seed=5),
        GenerationRequest(prompts[2], 24, SAMPLED, 2),
    ]
    outputs = []
    for on_device in (True, False):
        engine = make_engine(target, draft, tokenizer, runner=runner)
        engine.model_drafter.drafts_on_device = on_device
        outputs.append([result.token_ids for result in engine.generate(batch)])
        assert outputs[-1][0] == reference_greedy(target, prompts[0], 24)
        assert engine.model_drafter.num_rows == 0
    assert outputs[0] == outputs[1]
