"""Tree verification on tiny random models in float32: the mask, the cache after a tree, exactness."""

from __future__ import annotations

import logging

import pytest
import torch

from handler.caches.kv_cache import RaggedCache, prefill, tree_attention_error
from handler.config import SamplingParams
from handler.drafters import Proposal
from handler.engine import GenerationRequest
from handler.planning.cost_table import CostModel
from handler.tree import ROOT, chain_with_siblings, chunk_attention

from .conftest import make_engine
from .test_engine import GREEDY, PROMPTS, SAMPLED, encode, reference_greedy


class OracleTrees:
    """A look-up that knows each request's answer and hides it among wrong branches.

    Per step: the root has a wrong child first and the true next token second; the
    true token has a wrong child first and the true continuation second, then a chain.
    A chain look-up (tree=False) proposes a wrong token, so that trees and chains differ.
    """

    name = "suffix"

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.answers: dict = {}  # prompt -> the target's greedy continuation
        self.rows: dict = {}  # request id -> (answer, tokens emitted)

    def add(self, prompts, private=()) -> None:
        for request_id, prompt_ids in prompts.items():
            self.rows[request_id] = (self.answers.get(tuple(prompt_ids), []), 0)

    def observe(self, committed) -> None:
        for request_id, tokens in committed.items():
            if request_id in self.rows:
                answer, emitted = self.rows[request_id]
                self.rows[request_id] = (answer, emitted + len(tokens))

    def remove(self, request_ids, sequences=None) -> None:
        for request_id in request_ids:
            self.rows.pop(request_id, None)

    def propose(self, rows, sampling=None, keep_drafting=None) -> list[Proposal]:
        return [self.lookup(row.request_id, row.max_tokens, tree=row.tree) for row in rows]

    def lookup(self, request_id, max_tokens: int, tree: bool = False) -> Proposal:
        answer, emitted = self.rows[request_id]
        truth = answer[emitted : emitted + max_tokens]
        if len(truth) < 2 or max_tokens < 1:
            return Proposal([])
        wrong = [(token + 1) % self.vocab_size for token in truth]
        if not tree:
            return Proposal([wrong[0], *truth[1:]][:max_tokens])
        token_ids = [wrong[0], truth[0], wrong[1], *truth[1:]]
        parents = [ROOT, ROOT, 1, 1, *range(3, len(token_ids) - 1)]
        probs = [0.9 ** (index + 1) for index in range(len(token_ids))]
        return Proposal(token_ids[:max_tokens], probs[:max_tokens], parents[:max_tokens])


@pytest.fixture
def oracle_engine(tiny_pair):
    target, draft, tokenizer = tiny_pair
    engine = make_engine(target, draft, tokenizer)
    oracle = OracleTrees(target.config.vocab_size)
    engine.drafter_map["suffix"] = oracle
    for prompt in PROMPTS:
        prompt_ids = encode(tokenizer, prompt)
        oracle.answers[prompt_ids] = reference_greedy(target, prompt_ids, 30)
    return engine, oracle


def test_the_tiny_target_accepts_a_tree_mask(tiny_pair):
    target, _, _ = tiny_pair
    assert tree_attention_error(target) is None
    assert make_engine(*tiny_pair).trees


def test_a_model_that_ignores_the_mask_is_refused_at_start(tiny_pair, monkeypatch, caplog):
    target, draft, tokenizer = tiny_pair
    real_forward = target.forward

    def without_mask(*args, **kwargs):
        kwargs["attention_mask"] = None
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(target, "forward", without_mask)
    error = tree_attention_error(target)
    assert error is not None and "does not honour a custom 4D attention mask" in error
    with caplog.at_level(logging.WARNING):
        engine = make_engine(target, draft, tokenizer)
    assert not engine.trees
    assert "verifying chains only" in caplog.text


def test_the_cache_after_a_tree_equals_the_cache_of_its_accepted_path(tiny_pair):
    target, _, _ = tiny_pair
    contexts = [[5, 6, 7, 8], [9, 10]]
    # Row 0: pending 20, then 21 ─┬─ 22 ── 23   keeps columns 0, 1, 3: 20 21 24
    #                             └─ 24
    # Row 1: pending 40, then 30 and 31 ── 32 ── 33: keeps columns 0, 2, 3, 4: 40 31 32 33
    trees = [([21, 22, 24, 23], [ROOT, 0, 0, 1]), ([30, 31, 32, 33], [ROOT, ROOT, 1, 2])]
    paths = [[0, 1, 3], [0, 2, 3, 4]]
    cache = prefill(target, contexts, 0)
    ids = torch.tensor([[20, *trees[0][0]], [40, *trees[1][0]]])
    cache.forward(ids, torch.ones_like(ids), 5, tree=chunk_attention([trees[0][1], trees[1][1]], 4))
    cache.keep_chunk_paths(5, paths)
    cache.rollback(cache.lengths - 5 + torch.tensor([len(path) for path in paths]))
    after_tree = cache.forward(torch.tensor([[50], [51]]), torch.ones(2, 1, dtype=torch.long), 1)
    kept = [[20, 21, 24], [40, 31, 32, 33]]
    for row in range(2):
        alone = RaggedCache(target, 1)
        ids = torch.tensor([contexts[row] + kept[row] + [50 + row]])
        expected = alone.forward(ids, torch.ones_like(ids), 1)
        torch.testing.assert_close(after_tree[row], expected[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("k", [2, 5, 8])
def test_greedy_output_is_exact_with_trees_alone_and_batched(tiny_pair, oracle_engine, k):
    engine, oracle = oracle_engine
    _, _, tokenizer = tiny_pair
    prompts = [encode(tokenizer, p) for p in PROMPTS]
    alone = [engine.generate([GenerationRequest(p, 30, GREEDY, k, drafter="suffix")])[0] for p in prompts]
    assert [r.token_ids for r in alone] == [oracle.answers[p] for p in prompts]
    assert sum(r.stats.tree_steps for r in alone) > 0
    assert sum(r.stats.tree_other_branch for r in alone) > 0
    assert sum(r.stats.tree_accepted_depth for r in alone) > 0
    mixed = [
        GenerationRequest(prompts[0], 30, GREEDY, k, drafter="suffix"),
        GenerationRequest(prompts[1], 30, GREEDY, k, drafter="model"),
        GenerationRequest(prompts[2], 30, GREEDY, k, drafter="suffix", speculative_tree=False),
        GenerationRequest(prompts[3], 30, GREEDY, k, drafter="ngram"),
        GenerationRequest(prompts[4], 30, GREEDY, k, drafter="hybrid"),
    ]
    results = engine.generate(mixed)
    assert [r.token_ids for r in results] == [oracle.answers[p] for p in prompts]
    assert results[0].stats.tree_steps > 0 and results[2].stats.tree_steps == 0


def test_greedy_output_is_exact_with_trees_and_continuous_joins(tiny_pair, oracle_engine):
    engine, oracle = oracle_engine
    _, _, tokenizer = tiny_pair
    prompts = [encode(tokenizer, p) for p in PROMPTS]
    results = {}
    engine.add_request(0, GenerationRequest(prompts[0], 30, GREEDY, 6, drafter="suffix"))
    next_id, steps = 1, 0
    while engine.has_unfinished_requests() or next_id < len(prompts):
        steps += 1
        if next_id < len(prompts) and steps % 2 == 0:
            engine.add_request(next_id, GenerationRequest(prompts[next_id], 30, GREEDY, 6, drafter="hybrid"))
            next_id += 1
        for output in engine.step():
            if output.result is not None:
                results[output.request_id] = output.result
    assert {i: r.token_ids for i, r in results.items()} == {i: oracle.answers[p] for i, p in enumerate(prompts)}
    assert sum(r.stats.tree_steps for r in results.values()) > 0


@pytest.mark.parametrize("drafter", ["ngram", "suffix", "hybrid"])
def test_greedy_output_is_exact_with_the_real_drafters_trees(tiny_pair, drafter):
    """Prompts that end on a motif seen several times with different continuations: the look-ups branch."""
    target, draft, tokenizer = tiny_pair
    engine = make_engine(target, draft, tokenizer)
    generator = torch.Generator().manual_seed(0)
    tree_steps = 0
    for trial in range(4):
        motif = torch.randint(5, 300, (3,), generator=generator).tolist()
        prompt = []
        for _ in range(5):
            prompt += motif + torch.randint(5, 300, (2,), generator=generator).tolist()
        prompt = tuple(prompt + motif)
        for k in (3, 8):
            result = engine.generate([GenerationRequest(prompt, 24, GREEDY, k, drafter=drafter)])[0]
            assert result.token_ids == reference_greedy(target, prompt, 24), (trial, k)
            tree_steps += result.stats.tree_steps
    assert tree_steps > 0


def test_a_seeded_request_is_unchanged_by_the_tree_and_its_size(tiny_pair, oracle_engine):
    engine, oracle = oracle_engine
    _, _, tokenizer = tiny_pair
    prompt_ids = encode(tokenizer, PROMPTS[0])
    plain = engine.generate([GenerationRequest(prompt_ids, 30, SAMPLED, 0, seed=11)])[0].token_ids
    # The oracle knows the greedy answer, which sampling soon leaves; make it know the sampled one.
    oracle.answers[prompt_ids] = plain
    other = GenerationRequest(encode(tokenizer, PROMPTS[1]), 20, SAMPLED, 4, drafter="suffix")
    tree_steps = 0
    for k in (1, 2, 5, 8):
        for tree in (None, False):
            request = GenerationRequest(prompt_ids, 30, SAMPLED, k, seed=11, drafter="suffix", speculative_tree=tree)
            alone = engine.generate([request])[0]
            batched = engine.generate([other, request])[1]
            assert alone.token_ids == plain and batched.token_ids == plain, (k, tree)
            tree_steps += alone.stats.tree_steps
    assert tree_steps > 0


def test_trees_off_in_the_engine_verifies_chains(tiny_pair):
    target, draft, tokenizer = tiny_pair
    from handler.engine import build_engine
    from handler.runtime.loading import LoadedModels

    engine = build_engine(LoadedModels.of(target, draft, tokenizer, eos_token_ids=()), speculative_tree="off")
    oracle = OracleTrees(target.config.vocab_size)
    engine.drafter_map["suffix"] = oracle
    prompt_ids = encode(tokenizer, PROMPTS[0])
    oracle.answers[prompt_ids] = reference_greedy(target, prompt_ids, 20)
    result = engine.generate([GenerationRequest(prompt_ids, 20, GREEDY, 5, drafter="suffix")])[0]
    assert result.token_ids == oracle.answers[prompt_ids]
    assert result.stats.tree_steps == 0 and result.stats.draft_tokens > 0


# Verifying a wider chunk costs nothing: every runner-up with a chance joins its chain.
FREE_WIDTH = CostModel(draft_step=0.1, target_step=1.0, target_per_extra_token=0.0)


def assert_draft_cache_holds_committed_tokens(engine, tokenizer) -> None:
    """Each draft-model row caches a prefix of its committed tokens, exactly as a fresh prefill does,
    and keeps the rest pending (`handler.caches.rollback`)."""
    drafter = engine.model_drafter
    engine.batch.flush_observed()  # steps that drafted nothing leave their tokens waiting
    for row in engine.rows:
        if row.request_id not in drafter.order:
            continue  # a look-up row: the draft model does not follow it
        slot = drafter.order.index(row.request_id)
        committed = [*row.request.prompt_ids, *row.token_ids]
        length = int(drafter.cache.lengths[slot])
        assert drafter.pending[row.request_id] == committed[length:]
        fresh = prefill(drafter.model, [drafter._draft_ids(committed[:length])], tokenizer.pad_token_id)
        torch.testing.assert_close(drafter.cache.row_kv(slot, 0, length), fresh.row_kv(0, 0, length), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("confidence", [False, True], ids=["planned_k", "draft_confidence"])
def test_greedy_model_chains_take_the_drafts_runners_up_exactly(tiny_pair, confidence):
    """Runners-up join greedy model chains as siblings: exact beside look-up, seeded and sampled rows,
    with continuous joins; where the walk takes one, the draft cache still follows the committed tokens."""
    target, draft, tokenizer = tiny_pair
    engine = make_engine(
        target, draft, tokenizer, cost_table=FREE_WIDTH, draft_confidence=confidence, prompt_lookup_num_tokens=8
    )
    prompts = [encode(tokenizer, p) for p in PROMPTS]
    requests = [GenerationRequest(prompt_ids, 30, GREEDY, 4) for prompt_ids in prompts]
    requests += [
        GenerationRequest(prompts[0], 30, GREEDY, 4, drafter="ngram"),
        GenerationRequest(prompts[1], 20, SAMPLED, 3, seed=5),
        GenerationRequest(prompts[2], 20, SAMPLED, 4),  # unseeded: a chain, by rejection sampling
        GenerationRequest(prompts[3], 30, GREEDY, 4, speculative_tree=False),
    ]
    seeded_alone = engine.generate([requests[6]])[0].token_ids
    results, next_id, steps = {}, 0, 0
    while engine.has_unfinished_requests() or next_id < len(requests):
        if next_id < len(requests) and steps % 2 == 0:
            engine.add_request(next_id, requests[next_id])
            next_id += 1
        steps += 1
        for output in engine.step():
            if output.result is not None:
                results[output.request_id] = output.result
        if engine.rows:
            assert_draft_cache_holds_committed_tokens(engine, tokenizer)
    for index in (0, 1, 2, 3, 4, 5, 8):
        assert results[index].token_ids == reference_greedy(target, requests[index].prompt_ids, 30), index
    assert results[6].token_ids == seeded_alone
    model_rows = [results[index].stats for index in range(5)]
    assert sum(stats.tree_steps for stats in model_rows) > 0
    assert sum(stats.tree_other_branch for stats in model_rows) > 0  # the walk took a runner-up
    for index in (5, 6, 7, 8):  # look-up chains, sampled rows and a request that said off
        assert results[index].stats.tree_steps == 0, index


def test_runners_up_wait_for_a_cost_table_and_a_cheap_enough_column(tiny_pair):
    target, draft, tokenizer = tiny_pair
    prompt_ids = encode(tokenizer, PROMPTS[0])
    request = GenerationRequest(prompt_ids, 30, GREEDY, 4)
    unplanned = make_engine(target, draft, tokenizer, prompt_lookup_num_tokens=8)
    assert unplanned.generate([request])[0].stats.tree_steps == 0
    dear = CostModel(draft_step=0.1, target_step=1.0, target_per_extra_token=1.0)
    costly = make_engine(target, draft, tokenizer, cost_table=dear, prompt_lookup_num_tokens=8)
    result = costly.generate([request])[0]
    assert result.stats.tree_steps == 0
    assert result.token_ids == reference_greedy(target, prompt_ids, 30)


def test_without_a_cost_table_the_draft_measures_no_confidence(tiny_pair, monkeypatch):
    """Nothing reads the confidences then: the draft loop skips their softmax, and no calibration moves."""
    target, draft, tokenizer = tiny_pair
    engine = make_engine(target, draft, tokenizer, draft_confidence=True)
    calls = []
    propose = engine.model_drafter.propose

    def measured(rows, *args, **kwargs):
        calls.append(any(row.measure_confidence for row in rows))
        return propose(rows, *args, **kwargs)

    monkeypatch.setattr(engine.model_drafter, "propose", measured)
    prompt_ids = encode(tokenizer, PROMPTS[0])
    result = engine.generate([GenerationRequest(prompt_ids, 20, GREEDY, 4)])[0]
    assert result.token_ids == reference_greedy(target, prompt_ids, 20)
    assert calls and not any(calls)
    assert sum(engine.estimates.calibrations[True].verified) == 0.0


class DecoyTrees(OracleTrees):
    """A look-up whose first-choice chain is the answer, with a wrong sibling beside each of its
    nodes that its guesses rate nearly as likely: branches the target never takes."""

    def lookup(self, request_id, max_tokens: int, tree: bool = False) -> Proposal:
        answer, emitted = self.rows[request_id]
        truth = answer[emitted : emitted + max(max_tokens // 2, 1)]
        if len(truth) < 2:
            return Proposal([])
        chain_probs = [0.95 ** (index + 1) for index in range(len(truth))]
        if not tree:
            return Proposal(truth, chain_probs)
        wrong = [(token + 1) % self.vocab_size for token in truth]
        token_ids, parents = chain_with_siblings(truth, range(len(truth)), wrong)
        return Proposal(token_ids, [*chain_probs, *(0.9 * prob for prob in chain_probs)], parents)


# Each verified column costs a tenth of a pass: a branch has to earn its column.
PRICED_WIDTH = CostModel(draft_step=0.1, target_step=1.0, target_per_extra_token=0.1)


def test_branches_the_target_never_takes_are_cut_from_the_plan(tiny_pair):
    """The branch calibration learns that the guesses overrate the branches, and the plan drops
    them: trees shrink to their first-choice chains, exact all along."""
    target, draft, tokenizer = tiny_pair
    engine = make_engine(target, draft, tokenizer, cost_table=PRICED_WIDTH, prompt_lookup_num_tokens=16)
    decoy = DecoyTrees(target.config.vocab_size)
    engine.drafter_map["suffix"] = decoy
    prompt_ids = encode(tokenizer, PROMPTS[0])
    decoy.answers[prompt_ids] = reference_greedy(target, prompt_ids, 40)
    request = GenerationRequest(prompt_ids, 40, GREEDY, 16, drafter="suffix")
    calibration = engine.estimates.branch_calibrations["suffix"]
    assert calibration.factor == 1.0
    first = engine.generate([request])[0]
    assert first.token_ids == decoy.answers[prompt_ids]
    assert first.stats.tree_steps > 0 and first.stats.tree_other_branch == 0
    assert calibration.factor < 0.2
    again = engine.generate([request])[0]
    assert again.token_ids == decoy.answers[prompt_ids]
    assert again.stats.tree_steps == 0
    # The first-choice chains still run, and their columns no longer share the pass with branches.
    assert again.stats.accepted_tokens >= first.stats.accepted_tokens > 0
