"""The engine on tiny random models in float32: exactness, rollback, batching, stopping."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from handler.planning.cost_table import CostModel
from handler.config import SamplingParams
from handler.engine import EngineOptions, GenerationRequest
from handler.caches.kv_cache import COMPACT_SLACK, RaggedCache, left_pad

from .conftest import make_engine

PROMPTS = [
    "def fibonacci(n):",
    "The quick brown fox",
    "import torch\nclass Model(torch.nn.Module):\n    def forward(self, x):",
    "Once upon a time, in a land far away, there lived a",
    "x",
]
GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=0.9, top_k=0, top_p=1.0)
# Costs under which the tiny draft's confidence stop drafts sometimes one token, sometimes several.
CONFIDENT_COSTS = CostModel(draft_step=0.15, target_step=1.0, target_per_extra_token=0.05)


def encode(tokenizer, prompt: str) -> tuple[int, ...]:
    return tuple(tokenizer(prompt)["input_ids"])


def reference_greedy(target, prompt_ids, max_new_tokens, **options) -> list[int]:
    """The target's own greedy `generate`; `options` are further arguments of it (min_new_tokens)."""
    input_ids = torch.tensor([prompt_ids])
    output = target.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        **options,
    )
    return output[0, len(prompt_ids) :].tolist()


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_output_equals_target_generate(tiny_pair, engine, k):
    target, _, tokenizer = tiny_pair
    for prompt in PROMPTS:
        prompt_ids = encode(tokenizer, prompt)
        expected = reference_greedy(target, prompt_ids, 40)
        result = engine.generate([GenerationRequest(prompt_ids, 40, GREEDY, k)])[0]
        assert result.token_ids == expected, prompt
        assert result.stats.target_forward_passes <= len(expected)


def test_noisy_draft_exercises_both_accept_and_reject(tiny_pair, engine):
    _, _, tokenizer = tiny_pair
    requests = [GenerationRequest(encode(tokenizer, p), 40, GREEDY, 4) for p in PROMPTS]
    stats = [r.stats for r in engine.generate(requests)]
    accepted = sum(s.accepted_tokens for s in stats)
    proposed = sum(s.draft_tokens for s in stats)
    assert 0 < accepted < proposed


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_draft_equal_to_target_accepts_everything(tiny_pair, sampling):
    target, _, tokenizer = tiny_pair
    # No EOS, so every request runs its full length.
    same = make_engine(target, target, tokenizer, eos_token_ids=())
    results = same.generate([GenerationRequest(encode(tokenizer, p), 33, sampling, 4, seed=11) for p in PROMPTS[:3]])
    for result in results:
        assert result.stats.acceptance_rate == 1.0
        assert result.stats.draft_tokens > 0
        # The first token from the prefill's pass, then 32 in passes of k + 1 = 5: 1 + ceil(32 / 5) = 8.
        assert result.stats.target_forward_passes == 8
        assert result.stats.mean_accepted_length == pytest.approx(33 / 8)


def test_k_zero_is_plain_decoding_with_one_pass_per_token(tiny_pair, engine):
    target, _, tokenizer = tiny_pair
    prompt_ids = encode(tokenizer, PROMPTS[0])
    result = engine.generate([GenerationRequest(prompt_ids, 20, GREEDY, 0)])[0]
    assert result.token_ids == reference_greedy(target, prompt_ids, 20)
    assert result.stats.draft_tokens == 0
    assert result.stats.target_forward_passes == len(result.token_ids)


def test_the_prefill_gives_the_first_token_so_plain_decoding_calls_the_target_as_generate_does(
    tiny_pair, engine, monkeypatch
):
    """N tokens at k = 0 take N target calls (the prefill, then N - 1), as Hugging Face `generate`;
    joining beside a drafting row, whose prefill stops before its prompt's last token, changes nothing."""
    target, _, tokenizer = tiny_pair
    calls = []
    forward = target.forward
    monkeypatch.setattr(target, "forward", lambda *a, **kw: calls.append(1) or forward(*a, **kw))
    prompt_ids = encode(tokenizer, PROMPTS[1])
    result = engine.generate([GenerationRequest(prompt_ids, 12, GREEDY, 0)])[0]
    assert len(calls) == len(result.token_ids) > 4
    assert result.token_ids == reference_greedy(target, prompt_ids, 12)
    # A plain request for one token is answered by its prefill: it never joins a step.
    calls.clear()
    engine.add_request("one", GenerationRequest(prompt_ids, 1, GREEDY, 0))
    outputs = engine.step()
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in outputs] == [
        ("one", result.token_ids[:1], "length")
    ]
    assert len(calls) == 1 and not engine.has_unfinished_requests()
    other = GenerationRequest(encode(tokenizer, PROMPTS[0]), 12, GREEDY, 3)
    mixed = engine.generate([other, GenerationRequest(prompt_ids, 12, GREEDY, 0)])
    assert mixed[0].token_ids == reference_greedy(target, other.prompt_ids, 12)
    assert mixed[1].token_ids == result.token_ids
    assert mixed[1].stats.target_forward_passes == len(result.token_ids)


def test_rolled_back_cache_gives_the_logits_of_a_full_recompute(tiny_pair):
    """Ragged rollbacks, holes and compaction leave each row's cache equal to its committed tokens."""
    target, _, tokenizer = tiny_pair
    generator = torch.Generator().manual_seed(0)
    prompts = [list(encode(tokenizer, PROMPTS[0])), list(encode(tokenizer, PROMPTS[3]))]
    committed = [list(p[:-1]) for p in prompts]
    cache = RaggedCache(target, 2)
    with torch.inference_mode():
        input_ids, mask = left_pad(committed, tokenizer.pad_token_id)
        cache.forward(input_ids, mask, logits_to_keep=1)
        pending = [[p[-1]] for p in prompts]
        compacted = False
        for step in range(12):
            drafts = torch.randint(0, 300, (2, 5), generator=generator)
            input_ids, mask = left_pad(pending, tokenizer.pad_token_id)
            input_ids = torch.cat([input_ids, drafts], dim=1)
            mask = torch.cat([mask, torch.ones(2, 5, dtype=torch.long)], dim=1)
            cache.forward(input_ids, mask, logits_to_keep=6)
            # Ragged acceptance: row 0 keeps 0..5 drafts, row 1 mostly none.
            keep = [step % 6, 1 if step % 4 == 0 else 0]
            for row in range(2):
                committed[row] += pending[row] + drafts[row, : keep[row]].tolist()
            lengths = torch.tensor([len(c) for c in committed])
            columns_before = cache.num_columns
            cache.rollback(lengths)
            compacted |= cache.num_columns < columns_before - 5
            pending = [[int(torch.randint(0, 300, (1,), generator=generator))] for _ in range(2)]
        assert compacted, "the test should have crossed COMPACT_SLACK"
        assert cache.num_columns - int(cache.lengths.max()) <= COMPACT_SLACK + 6
        input_ids, mask = left_pad(pending, tokenizer.pad_token_id)
        cached_logits = cache.forward(input_ids, mask, logits_to_keep=1)[:, -1]
        for row in range(2):
            full = torch.tensor([committed[row] + pending[row]])
            fresh_logits = target(input_ids=full).logits[0, -1]
            torch.testing.assert_close(cached_logits[row], fresh_logits, atol=1e-4, rtol=1e-4)


def test_columns_of_ones_appended_unwritten_are_the_mask_s_when_it_is_read(tiny_pair):
    """Passes without padding over rows without holes only count their columns
    (`RaggedCache._append_columns`); whatever reads the mask next (a read outside a step, a ragged
    pass, a rollback) sees them written, before the columns after them, and the cache still gives each
    row the logits of a full recompute."""
    target, _, tokenizer = tiny_pair
    generator = torch.Generator().manual_seed(1)
    prompt = list(encode(tokenizer, PROMPTS[1]))
    committed = [list(prompt), list(prompt[::-1])]  # equal lengths: no holes
    cache = RaggedCache(target, 2)

    def unpadded_passes(widths):
        counted = cache._ones
        with torch.inference_mode():
            for width in widths:
                chunk = torch.randint(0, 300, (2, width), generator=generator)
                cache.forward(chunk, None, logits_to_keep=1)
                for row in range(2):
                    committed[row] += chunk[row].tolist()
        assert cache._ones == counted + sum(widths)  # counted, not written
        return torch.ones((2, sum(widths)), dtype=torch.long)

    with torch.inference_mode():
        cache.forward(torch.tensor(committed), None, logits_to_keep=1)
    expected = torch.ones((2, len(prompt) + 5), dtype=torch.long)
    unpadded_passes([1, 2])
    with torch.inference_mode():
        assert cache.mask.all()  # a read in a step: written into room made there, an inference tensor
    unpadded_passes([2])
    assert cache.num_columns == expected.shape[1]
    assert torch.equal(cache.mask, expected)  # read outside a step: written there, into that room
    expected = torch.cat([expected, unpadded_passes([3, 1])], dim=1)
    with torch.inference_mode():  # a ragged pass: row 1 pads
        cache.forward(torch.tensor([[11], [tokenizer.pad_token_id]]), torch.tensor([[1], [0]]), logits_to_keep=1)
    committed[0].append(11)
    expected = torch.cat([expected, torch.tensor([[1], [0]])], dim=1)
    assert torch.equal(cache.mask, expected)  # the counted ones, then the ragged column
    with torch.inference_mode():
        cache.rollback(torch.tensor([len(c) - 1 for c in committed]))  # each row drops its last token
        for row in range(2):
            committed[row].pop()
        pending = torch.tensor([[5], [7]])
        cached_logits = cache.forward(pending, None, logits_to_keep=1)[:, -1]
        for row in range(2):
            fresh_logits = target(input_ids=torch.tensor([committed[row] + [int(pending[row])]])).logits[0, -1]
            torch.testing.assert_close(cached_logits[row], fresh_logits, atol=1e-4, rtol=1e-4)


def test_batched_greedy_equals_solo_with_ragged_lengths_k_and_finishers(tiny_pair, engine):
    _, _, tokenizer = tiny_pair
    requests = [
        GenerationRequest(encode(tokenizer, PROMPTS[0]), 30, GREEDY, 4),
        GenerationRequest(encode(tokenizer, PROMPTS[1]), 7, GREEDY, 8),  # finishes early
        GenerationRequest(encode(tokenizer, PROMPTS[2]), 25, GREEDY, 0),  # plain decoding in the same batch
        GenerationRequest(encode(tokenizer, PROMPTS[3]), 40, GREEDY, 1),
        GenerationRequest(encode(tokenizer, PROMPTS[4]), 16, GREEDY, 3),
    ]
    solo = [engine.generate([r])[0] for r in requests]
    batched = engine.generate(requests)
    for alone, together in zip(solo, batched):
        assert together.token_ids == alone.token_ids
        assert together.finish_reason == alone.finish_reason
        assert together.stats == alone.stats


def test_seeded_sampling_is_deterministic_and_independent_of_the_batch(tiny_pair, engine):
    _, _, tokenizer = tiny_pair
    requests = [
        GenerationRequest(encode(tokenizer, p), 24, SAMPLED, k, seed=100 + i)
        for i, (p, k) in enumerate(zip(PROMPTS, [4, 2, 0, 6, 3]))
    ]
    solo = [engine.generate([r])[0].token_ids for r in requests]
    again = [engine.generate([r])[0].token_ids for r in requests]
    batched = [r.token_ids for r in engine.generate(requests)]
    reversed_batch = [r.token_ids for r in engine.generate(requests[::-1])][::-1]
    assert solo == again == batched == reversed_batch
    other_seed = engine.generate([dataclasses.replace(requests[0], seed=999)])[0].token_ids
    assert other_seed != solo[0]


def seeded_outputs(tiny_pair, engine) -> dict[str, list[int]]:
    """One seeded request under every k, drafter, draft, plan and batch this engine offers."""
    import copy

    from handler.planning.cost_table import CostModel
    from handler.runtime.cpu_speed import quantize_draft_int8

    target, draft, tokenizer = tiny_pair
    int8_draft = quantize_draft_int8(copy.deepcopy(draft))
    int8_engine = make_engine(target, int8_draft, tokenizer)
    # The int8 draft's rows prefilled by its float form, in bfloat16 (their KV cast to the int8 form's).
    float_fills = make_engine(target, int8_draft, tokenizer, draft_prefill=copy.deepcopy(draft).to(torch.bfloat16))
    costs = CostModel(draft_step=0.3, target_step=1.0, target_per_extra_token=0.3)
    planned = make_engine(target, draft, tokenizer, cost_table=costs)
    confident = make_engine(target, draft, tokenizer, cost_table=CONFIDENT_COSTS, draft_confidence=True)
    prompt_ids = encode(tokenizer, PROMPTS[0])
    others = [
        GenerationRequest(encode(tokenizer, PROMPTS[3]), 24, GREEDY, 4),
        GenerationRequest(encode(tokenizer, PROMPTS[4]), 24, SAMPLED, 4),  # unseeded
        GenerationRequest(encode(tokenizer, PROMPTS[2]), 24, SAMPLED, 2, seed=8),
    ]
    outputs = {"plain": engine.generate([GenerationRequest(prompt_ids, 24, SAMPLED, 0, seed=7)])[0].token_ids}
    engines = (
        ("float draft", engine),
        ("int8 draft", int8_engine),
        ("int8 draft, float fills", float_fills),
        ("planned", planned),
        ("confidence", confident),
    )
    for name, each in engines:
        for k in (1, 3, 6):
            for drafter in ("model", "ngram", "suffix", "hybrid"):
                request = GenerationRequest(prompt_ids, 24, SAMPLED, k, seed=7, drafter=drafter)
                outputs[f"{name}, k={k}, {drafter}"] = each.generate([request])[0].token_ids
            request = GenerationRequest(prompt_ids, 24, SAMPLED, k, seed=7)
            outputs[f"{name}, k={k}, batched"] = each.generate([*others, request])[-1].token_ids
    return outputs


def test_a_seeded_request_depends_on_its_seed_and_the_target_alone(tiny_pair, engine):
    """Coupled verification: the same tokens as plain decoding with the seed, however it was drafted."""
    outputs = seeded_outputs(tiny_pair, engine)
    assert all(tokens == outputs["plain"] for tokens in outputs.values()), outputs


def test_the_seed_check_catches_uniforms_keyed_by_step_instead_of_position(tiny_pair, engine, monkeypatch):
    import handler.engine.verify as engine_module
    from handler.sampler import position_uniforms

    # The bug: each step restarts the positions at 0, so the tokens depend on where steps begin.
    monkeypatch.setattr(engine_module, "position_uniforms", lambda seed, first, num: position_uniforms(seed, 0, num))
    outputs = seeded_outputs(tiny_pair, engine)
    assert any(tokens != outputs["plain"] for tokens in outputs.values())


def test_greedy_and_sampled_requests_share_a_batch(tiny_pair, engine):
    _, _, tokenizer = tiny_pair
    greedy = GenerationRequest(encode(tokenizer, PROMPTS[0]), 20, GREEDY, 4)
    sampled = GenerationRequest(encode(tokenizer, PROMPTS[1]), 20, SamplingParams(0.7, 20, 0.9), 4, seed=5)
    alone = [engine.generate([greedy])[0].token_ids, engine.generate([sampled])[0].token_ids]
    together = [r.token_ids for r in engine.generate([greedy, sampled])]
    assert together == alone


def test_max_new_tokens_is_exact_even_with_a_large_k(tiny_pair):
    target, draft, tokenizer = tiny_pair
    no_eos = make_engine(target, draft, tokenizer, eos_token_ids=())
    for max_new_tokens in (1, 2, 3, 9):
        result = no_eos.generate([GenerationRequest(encode(tokenizer, PROMPTS[0]), max_new_tokens, GREEDY, 8)])[0]
        assert len(result.token_ids) == max_new_tokens
        assert result.finish_reason == "length"


def test_eos_stops_and_is_reported(tiny_pair):
    target, draft, tokenizer = tiny_pair
    prompt_ids = encode(tokenizer, PROMPTS[2])
    reference = reference_greedy(target, prompt_ids, 30)
    eos = reference[9]  # pretend this token is the end of sequence
    result = make_engine(target, draft, tokenizer, eos_token_ids=[eos]).generate(
        [GenerationRequest(prompt_ids, 30, GREEDY, 4)]
    )[0]
    assert result.finish_reason == "eos"
    assert result.token_ids == reference[: reference.index(eos) + 1]


def test_stop_string_truncates_text_and_reports_stop(tiny_pair):
    target, draft, tokenizer = tiny_pair
    no_eos = make_engine(target, draft, tokenizer, eos_token_ids=())
    prompt_ids = encode(tokenizer, PROMPTS[0])
    full = no_eos.generate([GenerationRequest(prompt_ids, 40, GREEDY, 4)])[0]
    stop = full.text[12:15]
    assert len(stop) == 3 and stop.strip()
    cut = full.text.index(stop)
    result = no_eos.generate([GenerationRequest(prompt_ids, 40, GREEDY, 4, stop=(stop,))])[0]
    assert result.finish_reason == "stop"
    assert result.text == full.text[:cut]
    # Token ids run up to the token that completed the stop string, and not beyond.
    assert result.token_ids == full.token_ids[: len(result.token_ids)]
    assert stop in tokenizer.decode(result.token_ids, skip_special_tokens=True)
    assert stop not in tokenizer.decode(result.token_ids[:-1], skip_special_tokens=True)


def test_adaptive_k_is_still_exact_and_falls_back_when_the_draft_is_useless(tiny_pair):
    from handler.planning.cost_table import CostModel

    target, draft, tokenizer = tiny_pair
    policy = CostModel(draft_step=0.3, target_step=1.0, target_per_extra_token=0.05)
    adaptive = make_engine(target, draft, tokenizer, cost_table=policy)
    for prompt in PROMPTS[:3]:
        prompt_ids = encode(tokenizer, prompt)
        result = adaptive.generate([GenerationRequest(prompt_ids, 40, GREEDY, 8)])[0]
        assert result.token_ids == reference_greedy(target, prompt_ids, 40)

    # A draft that never agrees: after a few steps the request stops drafting.
    useless = CostModel(draft_step=1.0, target_step=1.0, target_per_extra_token=0.0)
    hopeless = make_engine(target, draft, tokenizer, eos_token_ids=(), cost_table=useless)
    result = hopeless.generate([GenerationRequest(encode(tokenizer, PROMPTS[0]), 40, GREEDY, 4)])[0]
    assert result.stats.fell_back
    assert result.stats.draft_tokens < 40

    # A perfect draft keeps the full k.
    same = make_engine(target, target, tokenizer, eos_token_ids=(), cost_table=policy)
    result = same.generate([GenerationRequest(encode(tokenizer, PROMPTS[0]), 41, GREEDY, 4)])[0]
    assert not result.stats.fell_back
    assert result.stats.target_forward_passes <= 41 // 5 + 3


def test_the_engine_rescales_its_cost_table_by_the_passes_it_times(tiny_pair):
    """A table that says a target pass takes a second: the tiny models' passes pull its scale down."""
    from handler.planning.cost_table import MAX_SCALE, MIN_OBSERVATIONS, CostTable, RunningCostTable

    target, draft, tokenizer = tiny_pair
    # The draft looks cheap enough to draft at every step.
    slow = CostTable(widths=(1, 8), batch_sizes=(1, 2), target=((1.0, 1.0), (1.0, 1.0)), draft=(0.01, 0.01))
    engine = make_engine(target, draft, tokenizer, cost_table=slow, options=EngineOptions(running_costs=True))
    assert isinstance(engine.cost_table, RunningCostTable) and engine.cost_table.table is slow
    requests = [GenerationRequest(encode(tokenizer, prompt), 30, GREEDY, 4) for prompt in PROMPTS[:2]]
    results = engine.generate(requests)
    for request, result in zip(requests, results):
        assert result.token_ids == reference_greedy(target, request.prompt_ids, 30)
    assert len(engine.cost_table.ratios["target"]) >= MIN_OBSERVATIONS
    assert len(engine.cost_table.ratios["draft"]) >= MIN_OBSERVATIONS
    assert engine.cost_table.target_scale == 1.0 / MAX_SCALE
    assert engine.cost_table.target_seconds(1, 1) == pytest.approx(1.0 / MAX_SCALE)
    assert engine.cost_scales == (engine.cost_table.target_scale, engine.cost_table.draft_scale)

    fixed = make_engine(target, draft, tokenizer, cost_table=slow, options=EngineOptions(running_costs=False))
    fixed.generate(requests)
    assert fixed.cost_table is slow and fixed.cost_scales is None


def test_the_confidence_stop_is_exact_and_drafts_as_far_as_confidence_pays(tiny_pair):
    """The draft model stops where its calibrated confidence says so: greedy output unchanged, alone and
    beside look-ups and seeded rows, and chains of several lengths under one cap."""
    target, draft, tokenizer = tiny_pair
    confident = make_engine(target, draft, tokenizer, cost_table=CONFIDENT_COSTS, draft_confidence=True)
    prompts = [encode(tokenizer, prompt) for prompt in PROMPTS[:3]]
    for prompt_ids in prompts:
        result = confident.generate([GenerationRequest(prompt_ids, 40, GREEDY, 8)])[0]
        assert result.token_ids == reference_greedy(target, prompt_ids, 40)
    lengths = set()
    for _ in range(3):
        batch = [GenerationRequest(prompt_ids, 40, GREEDY, 8) for prompt_ids in prompts]
        batch += [
            GenerationRequest(prompts[0], 40, GREEDY, 4, drafter="ngram"),
            GenerationRequest(prompts[1], 24, SAMPLED, 6, seed=3),
        ]
        results = confident.generate(batch)
        for prompt_ids, result in zip(prompts * 2, results[:4]):
            assert result.token_ids == reference_greedy(target, prompt_ids, 40)
        alone = confident.generate([batch[-1]])[0]
        assert results[-1].token_ids == alone.token_ids
        lengths |= {len(result.stats.accepted_per_position) for result in results[:3]}
        lengths |= {result.stats.draft_tokens / result.stats.num_drafts for result in results[:3]}
    # Some steps stopped short of the cap of 8, and rows drafted different lengths.
    assert any(length < 8 for length in lengths) and len(lengths) > 2

    # A draft equal to the target: once the calibration has seen it, it drafts to the cap.
    same = make_engine(target, target, tokenizer, eos_token_ids=(), cost_table=CONFIDENT_COSTS, draft_confidence=True)
    for _ in range(3):
        result = same.generate([GenerationRequest(prompts[0], 45, GREEDY, 8)])[0]
    assert result.stats.acceptance_rate == 1.0
    assert result.stats.target_forward_passes <= 45 // 9 + 2
