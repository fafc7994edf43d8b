"""Guessed drafting: a look-up guesses the draft model's next drafts, one draft pass checks them.

The guesses may change how many draft passes a step takes, never which drafts it
proposes: each draft is still drawn from the draft model's distribution with its
own uniform. In float32 the drafts, their distributions and the cache that follows
must equal drafting one pass at a time, whether the guesses are right, wrong or
absent, greedy or sampled, alone or in a batch.
"""

from __future__ import annotations

import pytest
import torch

from handler.config import SamplingParams
from handler.drafters import DraftRow, Proposal
from handler.drafters.model import ModelDrafter
from handler.engine import GenerationRequest
from handler.sampler import SamplingBatch

from .conftest import make_engine
from .test_engine import CONFIDENT_COSTS, GREEDY, PROMPTS, SAMPLED, encode, reference_greedy

K = 6


def drafter_for(tiny_pair, prompts: dict) -> ModelDrafter:
    target, draft, tokenizer = tiny_pair
    drafter = ModelDrafter(draft, target.config.vocab_size, tokenizer.pad_token_id)
    drafter.add(prompts)
    drafter.fill(list(prompts))
    return drafter


def settings(temperature: float, seed: int, k: int = K) -> tuple[float, int, float, torch.Tensor]:
    uniforms = torch.rand(k, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (temperature, 0, 1.0, uniforms)


class Guesses:
    """A guesser (`ModelDrafter.guesser`) from per-row functions f(drafts so far, most tokens)."""

    def __init__(self, by_row: dict) -> None:
        self.by_row = by_row

    def continuation(self, request_id, drafts, max_tokens: int) -> list[int]:
        return list(self.by_row[request_id](drafts, max_tokens))


def sampling_batch(sampling: dict, device) -> SamplingBatch:
    """The step's settings for the rows of `sampling` (request id -> `settings`), with their uniforms."""
    params = [SamplingParams(temperature=t, top_k=top_k, top_p=top_p) for t, top_k, top_p, _ in sampling.values()]
    uniforms = torch.zeros(len(sampling), max(len(setting[3]) for setting in sampling.values()), dtype=torch.float64)
    for slot, setting in enumerate(sampling.values()):
        uniforms[slot, : len(setting[3])] = setting[3]
    return SamplingBatch.from_params(params, device).with_uniforms(uniforms)


def propose(
    drafter: ModelDrafter,
    sampling: dict,
    guesses: dict | None = None,
    shapers: dict | None = None,
    max_guesses: int | None = None,
) -> dict:
    """The drafter's proposals for the rows of `sampling` (request id -> `settings`), by request id;
    `guesses`, `shapers`: per row, its guesses of its next drafts and its rules on the draft's logits;
    `max_guesses`: the most guesses a pass carries (None: as many as the row's drafts)."""
    ids = list(sampling)
    batch = sampling_batch(sampling, drafter.device)
    drafter.guesser = Guesses(guesses) if guesses else None
    rows = [
        DraftRow(
            rid,
            len(sampling[rid][3]),
            slot,
            shape=(shapers or {}).get(rid),
            guesses=(max_guesses or len(sampling[rid][3])) if guesses and rid in guesses else 0,
            measure_confidence=True,
        )
        for slot, rid in enumerate(ids)
    ]
    return dict(zip(ids, drafter.propose(rows, batch)))


def two_steps(drafter: ModelDrafter, sampling: dict, guesses=None, commit=2, max_guesses=None) -> list[dict]:
    """Two proposals, the first `commit` drafts of each row committed between them (and one more token)."""
    proposals = []
    for _ in range(2):
        proposal = propose(drafter, sampling, guesses=guesses(proposals) if guesses else None, max_guesses=max_guesses)
        proposals.append((proposal, drafter.last_num_passes))
        drafter.observe({rid: [*p.token_ids[:commit], 7] for rid, p in proposal.items()})
    return proposals


def assert_same_drafts(expected: dict, actual: dict) -> None:
    assert expected.keys() == actual.keys()
    for rid in expected:
        assert actual[rid].token_ids == expected[rid].token_ids, rid
        torch.testing.assert_close(actual[rid].draft_probs, expected[rid].draft_probs, rtol=1e-4, atol=1e-5)
        assert actual[rid].confidences == pytest.approx(expected[rid].confidences, rel=1e-4, abs=1e-6)
        assert [t for t, _ in actual[rid].runners_up] == [t for t, _ in expected[rid].runners_up]


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampled"])
def test_right_guesses_take_one_pass_and_change_no_draft(tiny_pair, temperature):
    tokenizer = tiny_pair[2]
    prompts = {"a": encode(tokenizer, PROMPTS[0])}
    sampling = {"a": settings(temperature, 1)}
    plain = two_steps(drafter_for(tiny_pair, prompts), sampling)
    assert [passes for _, passes in plain] == [K, K]

    def oracle(done):  # the drafts the plain drafter drew at this step
        drafts = plain[len(done)][0]["a"].token_ids
        return {"a": lambda so_far, most: drafts[len(so_far) : len(so_far) + most]}

    guessed = two_steps(drafter_for(tiny_pair, prompts), sampling, oracle)
    assert [passes for _, passes in guessed] == [1, 1]
    for (expected, _), (actual, _) in zip(plain, guessed):
        assert_same_drafts(expected, actual)


def test_a_pass_carries_at_most_the_guesses_its_row_may_take(tiny_pair, monkeypatch):
    """Where a wider draft pass costs more (`Planner.guess_width`), a pass carries fewer guesses: right
    guesses then take more passes, each no wider than its feed and those guesses, and the drafts stay."""
    tokenizer = tiny_pair[2]
    prompts = {"a": encode(tokenizer, PROMPTS[0])}
    sampling = {"a": settings(0.0, 1)}
    plain = two_steps(drafter_for(tiny_pair, prompts), sampling)

    def oracle(done):
        drafts = plain[len(done)][0]["a"].token_ids
        return {"a": lambda so_far, most: drafts[len(so_far) : len(so_far) + most]}

    widths = []
    forward = ModelDrafter._pass_ids
    monkeypatch.setattr(ModelDrafter, "_pass_ids", lambda self, ids: widths.append(ids.shape[1]) or forward(self, ids))
    drafter = drafter_for(tiny_pair, prompts)
    guessed = two_steps(drafter, sampling, oracle, max_guesses=2)
    assert [passes for _, passes in guessed] == [K // 3, K // 3], "3 drafts a pass: its feed's and 2 guesses'"
    assert widths == [1 + 2] * 4, "each pass: the one token it feeds and 2 guesses"
    for (expected, _), (actual, _) in zip(plain, guessed):
        assert_same_drafts(expected, actual)


def test_wrong_guesses_cost_passes_not_drafts(tiny_pair):
    tokenizer = tiny_pair[2]
    prompts = {"a": encode(tokenizer, PROMPTS[1])}
    sampling = {"a": settings(0.9, 2)}
    plain = two_steps(drafter_for(tiny_pair, prompts), sampling)

    def half_wrong(done):  # right up to draft 3, then a token the draft never drew there
        drafts = plain[len(done)][0]["a"].token_ids
        wrong = [*drafts[:3], drafts[3] + 1, *drafts[4:]]
        return {"a": lambda so_far, most: wrong[len(so_far) : len(so_far) + most]}

    drafter = drafter_for(tiny_pair, prompts)
    guessed = two_steps(drafter, sampling, half_wrong)
    # Pass 1 keeps drafts 1-4 (the 4th drawn after the 3 right guesses); pass 2 draws 5 and 6.
    assert [passes for _, passes in guessed] == [2, 2]
    # A row that uses fewer drafts than the step drew needed fewer passes (its draft_passes).
    assert [drafter.passes_needed("a", n) for n in range(K + 1)] == [0, 1, 1, 1, 1, 2, 2]
    for (expected, _), (actual, _) in zip(plain, guessed):
        assert_same_drafts(expected, actual)

    nonsense = two_steps(drafter_for(tiny_pair, prompts), sampling, lambda done: {"a": lambda so_far, most: [5] * most})
    for (expected, _), (actual, _) in zip(plain, nonsense):
        assert_same_drafts(expected, actual)


def test_a_batch_of_rows_running_ahead_apart_drafts_as_one_pass_at_a_time(tiny_pair):
    """Rows with right, wrong and no guesses, a row that draws fewer drafts, and a row the step
    does not verify (it drafts greedily to keep the batch rectangular): same drafts, same cache."""
    tokenizer = tiny_pair[2]
    prompts = {name: encode(tokenizer, PROMPTS[i]) for i, name in enumerate("abcde")}
    sampling = {
        "a": settings(0.0, 3),
        "b": settings(0.9, 4),
        "c": settings(0.9, 5, k=3),
        "d": settings(0.7, 6),
    }
    plain = two_steps(drafter_for(tiny_pair, prompts), sampling, commit=3)

    def mixed(done):
        drafts = {rid: p.token_ids for rid, p in plain[len(done)][0].items()}
        return {
            "a": lambda so_far, most: drafts["a"][len(so_far) : len(so_far) + most],
            "b": lambda so_far, most: [*drafts["b"][len(so_far) : len(so_far) + 2], 9, 9][:most],
            "c": lambda so_far, most: drafts["c"][len(so_far) : len(so_far) + most],
        }

    guessed = two_steps(drafter_for(tiny_pair, prompts), sampling, mixed, commit=3)
    for (expected, plain_passes), (actual, passes) in zip(plain, guessed):
        assert_same_drafts(expected, actual)
        # Row d has no guesses: the batch takes its six passes, the others run ahead meanwhile.
        assert passes == plain_passes == K


def test_a_shaped_row_takes_no_guesses_and_its_shaper_follows_its_drafts(tiny_pair):
    tokenizer = tiny_pair[2]
    prompts = {"a": encode(tokenizer, PROMPTS[2]), "b": encode(tokenizer, PROMPTS[3])}
    sampling = {"a": settings(0.9, 7), "b": settings(0.0, 8)}
    calls = {True: [], False: []}

    def shaper(record):
        def shape(logits, previous):
            calls[record].append(previous)
            shaped = logits.clone()
            shaped[..., 100:] = float("-inf")  # a grammar that allows the first 100 ids only
            return shaped

        return shape

    plain = propose(drafter_for(tiny_pair, prompts), sampling, shapers={"a": shaper(False)})
    drafts = {rid: p.token_ids for rid, p in plain.items()}
    guesses = {rid: (lambda so_far, most, rid=rid: drafts[rid][len(so_far) : len(so_far) + most]) for rid in drafts}
    guessed = propose(drafter_for(tiny_pair, prompts), sampling, guesses=guesses, shapers={"a": shaper(True)})
    assert_same_drafts(plain, guessed)
    assert max(drafts["a"]) < 100
    assert calls[True] == calls[False] == [None, *drafts["a"][:-1]]


@pytest.fixture(scope="module")
def guessing(tiny_pair):
    """The target drafts for itself: the suffix trees, which hold its outputs, then guess its drafts
    (the tiny random draft agrees with the target too rarely for them to guess its drafts)."""
    target, _, tokenizer = tiny_pair
    return make_engine(target, target, tokenizer, drafter="hybrid", draft_guesses=True)


def count_passes(engine, monkeypatch) -> list[tuple[int, int]]:
    """(draft passes, drafts) of every model proposal the engine makes from now on."""
    seen = []
    real = engine.model_drafter.propose

    def counted(*args, **kwargs):
        proposals = real(*args, **kwargs)
        seen.append((engine.model_drafter.last_num_passes, max(len(p.token_ids) for p in proposals)))
        return proposals

    monkeypatch.setattr(engine.model_drafter, "propose", counted)
    return seen


def test_hybrid_rows_with_guesses_give_the_targets_greedy_output(tiny_pair, guessing, monkeypatch):
    target, _, tokenizer = tiny_pair
    passes = count_passes(guessing, monkeypatch)
    prompts = [encode(tokenizer, prompt) for prompt in PROMPTS]
    requests = [GenerationRequest(prompt_ids, 40, GREEDY, 6) for prompt_ids in prompts]
    alone = []
    for request in requests:  # the first answers fill the suffix trees that guess the later ones
        seen_before = len(passes)
        [result] = guessing.generate([request])
        assert result.token_ids == reference_greedy(target, request.prompt_ids, 40)
        # Alone, a request's draft_passes are the passes of the proposals made for it.
        assert result.stats.draft_passes == sum(num for num, _ in passes[seen_before:])
        alone.append(result.stats)
    # Batched, the look-ups would now find every answer themselves (each row's first token, from its
    # prefill, leads into an answer the trees hold): they propose nothing, so that the draft model
    # drafts and the trees guess its drafts.
    for lookup in (guessing.suffix_drafter, guessing.drafter_map["ngram"]):
        monkeypatch.setattr(lookup, "lookup", lambda request_id, max_tokens, tree=False: Proposal([]))
    batched = guessing.generate(requests)
    assert [r.token_ids for r in batched] == [reference_greedy(target, p, 40) for p in prompts]
    # The guesses were taken: some proposals drew more drafts than they ran passes, and the
    # answers say so: fewer draft passes than model drafts.
    assert any(num_passes < num_drafts for num_passes, num_drafts in passes), passes
    for stats in alone + [r.stats for r in batched]:
        assert stats.draft_passes <= stats.draft_tokens_by_drafter.get("model", 0)
    assert any(s.draft_passes < s.draft_tokens_by_drafter.get("model", 0) for s in alone + [r.stats for r in batched])


def test_guesses_keep_a_seeded_request_on_its_seed(tiny_pair, guessing):
    _, _, tokenizer = tiny_pair
    prompt_ids = encode(tokenizer, PROMPTS[0])
    plain = guessing.generate([GenerationRequest(prompt_ids, 24, SAMPLED, 0, seed=7)])[0].token_ids
    for k in (3, 6):
        request = GenerationRequest(prompt_ids, 24, SAMPLED, k, seed=7)
        assert guessing.generate([request])[0].token_ids == plain
        batch = [GenerationRequest(encode(tokenizer, PROMPTS[3]), 24, GREEDY, 4), request]
        assert guessing.generate(batch)[1].token_ids == plain


def test_guesses_under_a_cost_table_and_the_confidence_stop(tiny_pair):
    target, draft, tokenizer = tiny_pair
    engine = make_engine(
        target, draft, tokenizer, drafter="hybrid", draft_guesses=True,
        cost_table=CONFIDENT_COSTS, draft_confidence=True,
    )  # fmt: skip
    prompts = [encode(tokenizer, prompt) for prompt in PROMPTS]
    for _ in range(2):
        results = engine.generate([GenerationRequest(p, 30, GREEDY, 8) for p in prompts])
        assert [r.token_ids for r in results] == [reference_greedy(target, p, 30) for p in prompts]
    sampled = SamplingParams(temperature=0.8)
    seeded = [engine.generate([GenerationRequest(prompts[1], 20, sampled, k, seed=3)])[0].token_ids for k in (0, 8)]
    assert seeded[0] == seeded[1]


def test_the_draft_draws_from_its_distribution_after_min_p_as_the_target_is_warped(tiny_pair):
    """One batch of settings serves the draft and the verify pass: the draft's distribution loses the
    tokens that min-p takes from the target's, and its draws come from what is left."""
    tokenizer = tiny_pair[2]
    uniforms = torch.rand(1, K, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    proposals = {}
    for min_p in (0.0, 0.9):
        drafter = drafter_for(tiny_pair, {"a": encode(tokenizer, PROMPTS[0])})
        params = [SamplingParams(temperature=1.0, min_p=min_p)]
        batch = SamplingBatch.from_params(params, drafter.device).with_uniforms(uniforms)
        [proposals[min_p]] = drafter.propose([DraftRow("a", K, 0)], batch)
    unfiltered, filtered = proposals[0.0].draft_probs, proposals[0.9].draft_probs  # [K, vocab]
    draft_vocab = tiny_pair[1].config.vocab_size  # the rest of the target's vocabulary: never drafted
    assert (unfiltered[:, :draft_vocab] > 0).all()
    kept = filtered > 0
    assert (kept.sum(dim=-1) < draft_vocab).all()
    top = filtered.amax(dim=-1, keepdim=True).expand_as(filtered)
    assert (filtered[kept] >= 0.9 * top[kept] - 1e-6).all()
    drafted = torch.tensor(proposals[0.9].token_ids)
    assert kept[torch.arange(K), drafted].all()


def test_steps_without_a_proposal_leave_the_cache_and_the_next_drafts_as_a_fresh_drafters(tiny_pair, monkeypatch):
    """A step where the model drafts for no row (a plain step) adds its tokens to the rows' pending ones
    and leaves the draft cache as it is, no roll-back; the next proposal feeds them and drafts what a
    drafter given the same tokens as prompts drafts."""
    tokenizer = tiny_pair[2]
    prompts = {"a": encode(tokenizer, PROMPTS[0]), "b": encode(tokenizer, PROMPTS[2])}
    drafter = drafter_for(tiny_pair, prompts)
    sampling = {rid: settings(0.0, seed) for seed, rid in enumerate(prompts)}
    first = propose(drafter, sampling)
    committed = {rid: [*proposal.token_ids[:2], 7] for rid, proposal in first.items()}
    drafter.observe(committed)
    rollbacks = []
    monkeypatch.setattr(drafter.cache, "rollback", rollbacks.append)
    lengths = drafter.cache.lengths.clone()
    plain_steps = [11, 12, 13]
    for token in plain_steps:
        drafter.observe({rid: [token] for rid in prompts})
    assert not rollbacks and torch.equal(drafter.cache.lengths, lengths)
    monkeypatch.undo()
    sequences = {rid: [*prompts[rid], *committed[rid], *plain_steps] for rid in prompts}
    assert_same_drafts(propose(drafter_for(tiny_pair, sequences), sampling), propose(drafter, sampling))
