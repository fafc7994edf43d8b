"""The prefix cache on tiny fp32 models: exact, bounded, and hit by the next turn.

Cache on must give the outputs of cache off, token for token, for greedy and
seeded sampled requests, alone, batched and staggered, with every drafter.
"""

from __future__ import annotations

import random

import pytest
import torch

from handler.engine import GenerationRequest, SpeculativeEngine, build_engine
from handler.caches.kv_cache import RaggedCache
from handler.runtime.loading import LoadedModels
from handler.caches.prefix_cache import prefill_with_cache

from .test_engine import GREEDY
from .test_admission import SAMPLED, run_staggered

DRAFTERS = ["model", "ngram", "suffix", "hybrid"]
MIB = 2**20


def make(tiny_pair, max_bytes: int | None) -> SpeculativeEngine:
    target, draft, tokenizer = tiny_pair
    return build_engine(LoadedModels.of(target, draft, tokenizer), prefix_cache_max_bytes=max_bytes)


def random_tokens(rng: random.Random, length: int) -> tuple[int, ...]:
    return tuple(rng.randrange(10, 250) for _ in range(length))


def conversation_requests(drafter: str, seed: int = 0) -> list[GenerationRequest]:
    """Six requests behind one 60-token system prompt, greedy and seeded sampled."""
    rng = random.Random(seed)
    system = random_tokens(rng, 60)
    requests = []
    for index in range(6):
        sampling, request_seed = (GREEDY, None) if index % 2 == 0 else (SAMPLED, 100 + index)
        prompt = system + random_tokens(rng, rng.randrange(1, 12))
        requests.append(GenerationRequest(prompt, 24, sampling, 3, seed=request_seed, drafter=drafter))
    return requests


def token_ids(results) -> list[list[int]]:
    return [result.token_ids for result in results]


def count_prefilled_tokens(monkeypatch) -> list[int]:
    """Records the real (unpadded) tokens of every forward pass wider than one token per row."""
    counts = []
    real_forward = RaggedCache.forward

    def counting_forward(self, input_ids, chunk_mask, logits_to_keep, tree=None):
        if logits_to_keep == 1 and chunk_mask is not None and chunk_mask.shape[1] > 1:
            counts.append(int(chunk_mask.sum()))
        return real_forward(self, input_ids, chunk_mask, logits_to_keep, tree)

    monkeypatch.setattr(RaggedCache, "forward", counting_forward)
    return counts


def all_unlocked(cache) -> bool:
    stack = [cache.root]
    while stack:
        node = stack.pop()
        if node is not cache.root and node.num_locks:
            return False
        stack.extend(node.children.values())
    return True


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_cache_on_equals_cache_off_batched_alone_and_next_turn(tiny_pair, drafter):
    requests = conversation_requests(drafter)
    off, on = make(tiny_pair, None), make(tiny_pair, 64 * MIB)
    expected = token_ids(off.generate(requests))
    assert token_ids(on.generate(requests)) == expected  # cold: the shared system prompt is computed once
    again = on.generate(requests)  # warm: every prompt is cached
    assert token_ids(again) == expected
    assert [r.cached_tokens for r in again] == [len(r.prompt_ids) - 1 for r in requests]
    assert [on.generate([r])[0].token_ids for r in requests] == expected
    # The next turn: the earlier prompt and completion, then a new message.
    turns = [
        GenerationRequest(r.prompt_ids + tuple(out) + (11, 12, 13), 16, r.sampling, 3, seed=r.seed, drafter=drafter)
        for r, out in zip(requests, expected)
    ]
    results = on.generate(turns)
    assert token_ids(results) == token_ids(off.generate(turns))
    for turn, request, out, result in zip(turns, requests, expected, results):
        # Everything the first turn's caches held: its prompt and completion, but for the last token.
        assert result.cached_tokens >= len(request.prompt_ids) + len(out) - 1, (turn, result.cached_tokens)
    assert all_unlocked(on.prefix_cache)
    if on.model_drafter is not None:
        assert all_unlocked(on.model_drafter.prefix_cache)


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_cache_on_equals_cache_off_staggered_with_an_abort(tiny_pair, drafter):
    requests = conversation_requests(drafter, seed=1)
    arrivals = {0: [("a", requests[0])], 2: [("b", requests[1]), ("c", requests[2])], 5: [("d", requests[3])]}
    arrivals[7] = [("e", requests[4]), ("f", requests[5])]
    aborts = {4: ["a"]}
    off, on = make(tiny_pair, None), make(tiny_pair, 64 * MIB)
    expected = run_staggered(off, arrivals, aborts)
    for _ in range(2):  # cold, then warm
        results = run_staggered(on, arrivals, aborts)
        assert {k: r.token_ids for k, r in results.items()} == {k: r.token_ids for k, r in expected.items()}
    assert all(r.cached_tokens > 0 for r in results.values())
    assert all_unlocked(on.prefix_cache)


def test_a_new_prefix_shared_by_joining_rows_is_computed_once(tiny_pair, monkeypatch):
    requests = conversation_requests("model")[:4]
    engine = make(tiny_pair, 64 * MIB)
    counts = count_prefilled_tokens(monkeypatch)
    engine.add_request("warm-up", GenerationRequest((5, 6, 7), 1, GREEDY, 0))
    engine.step()
    counts.clear()
    for index, request in enumerate(requests):
        engine.add_request(index, request)
    engine.step()
    suffixes = sum(len(r.prompt_ids) - 60 for r in requests)
    # Per model (target, then draft): the 60 shared tokens once, then each row's own suffix (the draft's
    # with the first token pending, as the target's whole prompt gave it).
    assert counts == [60, suffixes, 60, suffixes]
    assert all(row.cached_tokens == 0 for row in engine.rows)  # computed in this step: not a hit


def test_a_prompt_wholly_cached_still_computes_its_last_token_for_its_logits(tiny_pair):
    target, _, tokenizer = tiny_pair
    prompt = random_tokens(random.Random(3), 30)
    prefix_cache = make(tiny_pair, 64 * MIB).prefix_cache
    cold = prefill_with_cache(target, prefix_cache, [prompt], tokenizer.pad_token_id, last_logits=True)
    prefix_cache.unlock(cold.handles[0])
    warm = prefill_with_cache(target, prefix_cache, [prompt, prompt[:20]], tokenizer.pad_token_id, last_logits=True)
    assert warm.num_cached == [29, 19]  # all but the last token came from the cache
    torch.testing.assert_close(warm.logits[0], cold.logits[0], atol=1e-4, rtol=1e-4)
    short = prefill_with_cache(target, None, [prompt[:20]], tokenizer.pad_token_id, last_logits=True)
    torch.testing.assert_close(warm.logits[1], short.logits[0], atol=1e-4, rtol=1e-4)
    for handle in warm.handles:
        prefix_cache.unlock(handle)
    assert all_unlocked(prefix_cache)


def test_plain_requests_take_their_first_token_from_a_cached_prompt_exactly(tiny_pair):
    rng = random.Random(4)
    prompt = random_tokens(rng, 40)
    off, on = make(tiny_pair, None), make(tiny_pair, 64 * MIB)
    requests = [GenerationRequest(prompt, 8, GREEDY, 0), GenerationRequest(prompt + (7,), 8, SAMPLED, 0, seed=3)]
    expected = token_ids(off.generate(requests))
    for _ in range(2):  # cold, then warm: the second time the first prompt is found whole
        assert token_ids(on.generate(requests)) == expected
    assert all_unlocked(on.prefix_cache)


def test_n_choices_of_one_prompt_share_one_prefill(tiny_pair, monkeypatch):
    prompt = random_tokens(random.Random(2), 40)
    engine = make(tiny_pair, 64 * MIB)
    counts = count_prefilled_tokens(monkeypatch)
    results = engine.generate([GenerationRequest(prompt, 8, SAMPLED, 3, seed=seed) for seed in range(3)])
    assert counts[:2] == [40, 40]  # target, draft: the whole prompt, once each (the first tokens pending)
    off = make(tiny_pair, None).generate([GenerationRequest(prompt, 8, SAMPLED, 3, seed=seed) for seed in range(3)])
    assert token_ids(results) == token_ids(off)


def test_the_longest_common_prefix_hits_where_a_prompt_diverges(tiny_pair):
    rng = random.Random(3)
    first = random_tokens(rng, 50)
    engine = make(tiny_pair, 64 * MIB)
    engine.generate([GenerationRequest(first, 4, GREEDY, 3)])
    diverging = first[:30] + random_tokens(rng, 20)
    result = engine.generate([GenerationRequest(diverging, 4, GREEDY, 3)])[0]
    assert result.cached_tokens == 30
    assert result.token_ids == make(tiny_pair, None).generate([GenerationRequest(diverging, 4, GREEDY, 3)])[0].token_ids


def test_a_tiny_budget_evicts_but_never_the_prefix_of_a_row_in_flight(tiny_pair):
    rng = random.Random(4)
    engine = make(tiny_pair, 0)
    # A budget of about 80 tokens for each model.
    engine.prefix_cache.max_bytes = 80 * _bytes_per_token(engine)
    engine.model_drafter.prefix_cache.max_bytes = 80 * _bytes_per_token(engine, draft=True)
    long_prompt = random_tokens(rng, 40)
    engine.add_request("long", GenerationRequest(long_prompt, 60, GREEDY, 3))
    engine.step()
    step = 0
    while engine.has_unfinished_requests():
        if step < 15:
            engine.add_request(f"flood{step}", GenerationRequest(random_tokens(rng, 30), 2, GREEDY, 3))
        outputs = engine.step()
        for cache in (engine.prefix_cache, engine.model_drafter.prefix_cache):
            assert cache.stats.num_bytes <= cache.max_bytes
        if any(o.request_id == "long" and o.result is None for o in outputs):
            assert engine.prefix_cache.match(long_prompt[:-1]).num_tokens == len(long_prompt) - 1
            assert engine.model_drafter.prefix_cache.match(long_prompt[:-1]).num_tokens == len(long_prompt) - 1
        step += 1
    assert engine.prefix_cache.stats.evictions > 0
    assert all_unlocked(engine.prefix_cache) and all_unlocked(engine.model_drafter.prefix_cache)


def _bytes_per_token(engine, draft: bool = False) -> int:
    from handler.caches.kv_cache import kv_bytes_per_token

    return kv_bytes_per_token(engine.model_drafter.model if draft else engine.target)


def test_a_flood_of_unique_long_prompts_never_passes_the_budget(tiny_pair):
    rng = random.Random(5)
    budget = 200 * (_bytes_per_token(make(tiny_pair, None)) + _bytes_per_token(make(tiny_pair, None), draft=True))
    engine = make(tiny_pair, budget)
    for index in range(12):
        engine.add_request(index, GenerationRequest(random_tokens(rng, 120), 4, GREEDY, 3))
        engine.add_request(f"{index}b", GenerationRequest(random_tokens(rng, 90), 4, GREEDY, 3))
        engine.step()
        assert engine.prefix_cache_stats.num_bytes <= budget
    while engine.has_unfinished_requests():
        engine.step()
        assert engine.prefix_cache_stats.num_bytes <= budget
    stats = engine.prefix_cache_stats
    assert stats.evictions > 0 and stats.num_bytes <= budget
    assert stats.queries == 12 * (120 + 90)


def test_a_failed_step_releases_every_lock_and_caches_nothing_of_it(tiny_pair):
    engine = make(tiny_pair, 64 * MIB)
    prompt = random_tokens(random.Random(6), 30)
    engine.add_request("x", GenerationRequest(prompt, 20, GREEDY, 3))
    engine.step()
    cached_before = len(engine.prefix_cache)
    engine.reset()
    assert all_unlocked(engine.prefix_cache) and all_unlocked(engine.model_drafter.prefix_cache)
    assert len(engine.prefix_cache) == cached_before  # the prompt, cached at admission; nothing after


def cached_sequences(cache) -> list[tuple[int, ...]]:
    """The token sequence of every leaf of the tree."""
    sequences, stack = [], [(cache.root, ())]
    while stack:
        node, tokens = stack.pop()
        tokens = tokens + node.tokens
        if not node.children and node is not cache.root:
            sequences.append(tokens)
        stack.extend((child, tokens) for child in node.children.values())
    return sequences


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_every_cached_prefix_holds_the_kv_a_fresh_prefill_computes(tiny_pair, drafter):
    """Greedy outputs of tiny random models barely depend on distant context, so the KV is checked directly."""
    from handler.caches.kv_cache import prefill

    engine = make(tiny_pair, 64 * MIB)
    requests = conversation_requests(drafter, seed=7)
    arrivals = {0: [("a", requests[0]), ("b", requests[1])], 3: [("c", requests[2])], 4: [("d", requests[3])]}
    first = run_staggered(engine, arrivals)
    turns = {
        key: GenerationRequest(
            r.prompt_ids + tuple(first[key].token_ids) + (11, 12), 12, r.sampling, 3, seed=r.seed, drafter=drafter
        )
        for key, r in zip("abcd", requests)
    }
    run_staggered(engine, {0: [("a2", turns["a"])], 2: [("b2", turns["b"]), ("c2", turns["c"])]})
    caches = [(engine.target, engine.prefix_cache)]
    if drafter in ("ngram", "suffix"):  # no row used the draft model
        assert len(engine.model_drafter.prefix_cache) == 0
    else:
        caches.append((engine.model_drafter.model, engine.model_drafter.prefix_cache))
    for model, cache in caches:
        sequences = cached_sequences(cache)
        assert len(sequences) >= 2  # the system prompt branches
        for tokens in sequences:
            fresh = prefill(model, [tokens], engine.pad_token_id).row_kv(0, 0, len(tokens))
            cached = cache.match(tokens)
            assert cached.num_tokens == len(tokens)
            assert (cached.kv - fresh).abs().max() < 1e-4, tokens
