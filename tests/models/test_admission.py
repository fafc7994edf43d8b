"""The engine's step API on tiny fp32 models: requests join and leave a running batch.

Every request's output must equal its output alone (greedy, and seeded sampled),
whatever joins, leaves or is aborted around it.
"""

from __future__ import annotations

import pytest
import torch

from handler.config import SamplingParams
from handler.drafters import Proposal
from handler.engine import EngineOptions, GenerationRequest
from handler.planning.cost_table import CostModel
from handler.planning.trackers import MIN_STEPS_BEFORE_FALLBACK, PROBE_INTERVAL

from .conftest import make_engine
from .test_engine import GREEDY, PROMPTS, encode, reference_greedy

SAMPLED = SamplingParams(temperature=0.9, top_k=20, top_p=0.95)


def run_staggered(engine, arrivals: dict[int, list[tuple[str, GenerationRequest]]], aborts: dict[int, list[str]] = {}):
    """Steps the engine, adding requests at given step numbers; returns results by id."""
    results, step_number = {}, 0
    while step_number <= max(arrivals) or engine.has_unfinished_requests():
        for request_id, request in arrivals.get(step_number, []):
            engine.add_request(request_id, request)
        for request_id in aborts.get(step_number, []):
            engine.abort_request(request_id)
        for output in engine.step():
            assert output.token_ids[-len(output.new_token_ids) or len(output.token_ids) :] == output.new_token_ids
            if output.result is not None:
                results[output.request_id] = output.result
        step_number += 1
    return results


@pytest.mark.parametrize("drafter", ["model", "ngram", "suffix", "hybrid"])
def test_staggered_arrivals_equal_solo_outputs(tiny_pair, engine, drafter):
    target, _, tokenizer = tiny_pair
    requests = {
        "long": GenerationRequest(encode(tokenizer, PROMPTS[2]), 60, GREEDY, 4, drafter=drafter),
        "short1": GenerationRequest(encode(tokenizer, PROMPTS[0]), 8, GREEDY, 3, drafter=drafter),
        "short2": GenerationRequest(encode(tokenizer, PROMPTS[4]), 8, GREEDY, 2, drafter=drafter),
        "seeded": GenerationRequest(encode(tokenizer, PROMPTS[1]), 20, SAMPLED, 4, seed=7, drafter=drafter),
        "late": GenerationRequest(encode(tokenizer, PROMPTS[3]), 12, GREEDY, 1, drafter=drafter),
    }
    solo = {name: engine.generate([request])[0] for name, request in requests.items()}
    arrivals = {
        0: [("long", requests["long"])],
        3: [("short1", requests["short1"]), ("short2", requests["short2"])],
        4: [("seeded", requests["seeded"])],
        9: [("late", requests["late"])],
    }
    results = run_staggered(engine, arrivals)
    assert set(results) == set(requests)
    for name, result in results.items():
        assert result.token_ids == solo[name].token_ids, name
        assert result.finish_reason == solo[name].finish_reason, name
    assert (
        solo["long"].token_ids
        == reference_greedy(target, requests["long"].prompt_ids, 60)[: len(solo["long"].token_ids)]
    )


@pytest.mark.parametrize("drafter", ["model", "hybrid"])
def test_each_steps_drafts_add_up_to_the_requests_counters(tiny_pair, engine, drafter):
    """The step outputs' drafts and accepted drafts (what the metrics count per step) are the final stats'."""
    _, _, tokenizer = tiny_pair
    requests = [GenerationRequest(encode(tokenizer, p), 24, GREEDY, 3, drafter=drafter) for p in PROMPTS[:3]]
    drafted: dict = {}
    for index, request in enumerate(requests):
        engine.add_request(index, request)
    results = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            counts = drafted.setdefault(output.request_id, [0, 0, 0])
            counts[0] += output.num_draft_tokens
            counts[1] += output.num_accepted_tokens
            counts[2] += int(output.num_draft_tokens > 0)
            if output.result is not None:
                results[output.request_id] = output.result
    for index, result in results.items():
        stats = result.stats
        assert drafted[index] == [stats.draft_tokens, stats.accepted_tokens, stats.num_drafts], index
    assert any(counts[0] for counts in drafted.values())


def test_drafting_rows_joining_together_take_one_prefill_of_each_model(tiny_pair):
    """Rows that join at once are prefilled together: one target pass over all of them, and at their
    first proposal one draft pass over all of them, not one per row; then the step's draft passes and
    its verify pass."""
    target, draft, tokenizer = tiny_pair
    engine = make_engine(target, draft, tokenizer)
    prompts = [encode(tokenizer, prompt) for prompt in PROMPTS[:4]]
    shapes = {"target": [], "draft": []}

    def note(name):
        return lambda module, args, kwargs: shapes[name].append(tuple(kwargs["input_ids"].shape))

    models = {"target": target, "draft": draft}
    hooks = [model.register_forward_pre_hook(note(name), with_kwargs=True) for name, model in models.items()]
    try:
        for index, prompt_ids in enumerate(prompts):
            engine.add_request(index, GenerationRequest(prompt_ids, 8, GREEDY, 2, drafter="model"))
        engine.step()
    finally:
        for hook in hooks:
            hook.remove()
    # The target prefills each whole prompt, whose last logits give the first token; the draft then
    # prefills the prompt, the first token pending, and the step verifies drafts after that token.
    prefill_width = max(len(prompt_ids) for prompt_ids in prompts)
    assert shapes["target"] == [(4, prefill_width), (4, 3)]
    assert shapes["draft"] == [(4, prefill_width), (4, 1), (4, 1)]


def test_abort_frees_the_row_and_leaves_the_others_untouched(engine, tiny_pair):
    _, _, tokenizer = tiny_pair
    keep = GenerationRequest(encode(tokenizer, PROMPTS[0]), 30, GREEDY, 4)
    doomed = GenerationRequest(encode(tokenizer, PROMPTS[3]), 200, GREEDY, 4)
    solo = engine.generate([keep])[0]
    results = run_staggered(engine, {0: [("keep", keep), ("doomed", doomed)]}, aborts={2: ["doomed"]})
    assert set(results) == {"keep"}
    assert results["keep"].token_ids == solo.token_ids
    assert not engine.has_unfinished_requests()
    assert engine.target_cache is None and engine.model_drafter.num_rows == 0


def test_duplicate_request_ids_and_unknown_drafters_are_refused(engine, tiny_pair):
    _, _, tokenizer = tiny_pair
    request = GenerationRequest(encode(tokenizer, PROMPTS[0]), 4, GREEDY, 2)
    engine.add_request("x", request)
    with pytest.raises(ValueError, match="already in flight"):
        engine.add_request("x", request)
    with pytest.raises(ValueError, match="drafter"):
        engine.add_request("y", GenerationRequest(request.prompt_ids, 4, GREEDY, 2, drafter="eagle"))
    engine.abort_request("x")
    assert engine.step() == []
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("drafter", ["ngram", "suffix", "hybrid"])
def test_lookup_drafters_keep_greedy_output_exact(tiny_pair, engine, drafter):
    target, _, tokenizer = tiny_pair
    for prompt in PROMPTS:
        prompt_ids = encode(tokenizer, prompt)
        expected = reference_greedy(target, prompt_ids, 40)
        result = engine.generate([GenerationRequest(prompt_ids, 40, GREEDY, 4, drafter=drafter)])[0]
        assert result.token_ids == expected, prompt
        assert result.stats.drafter == drafter


def test_ngram_only_engine_needs_no_draft_model(tiny_pair):
    target, _, tokenizer = tiny_pair
    lookup_only = make_engine(target, None, tokenizer)
    assert lookup_only.drafters == ("ngram", "suffix") and lookup_only.default_drafter == "ngram"
    # The greedy continuation copied into the prompt: look-up drafts get accepted.
    prompt_ids = encode(tokenizer, PROMPTS[0])
    continuation = reference_greedy(target, prompt_ids, 24)
    grounded = prompt_ids + tuple(continuation) + prompt_ids
    expected = reference_greedy(target, grounded, 24)
    result = lookup_only.generate([GenerationRequest(grounded, 24, GREEDY, 6)])[0]
    assert result.token_ids == expected
    stats = result.stats.as_dict()
    assert stats["by_drafter"]["ngram"]["accepted_tokens"] > 0
    assert stats["accepted_per_position"][0] >= stats["accepted_per_position"][-1] > 0
    assert result.stats.target_forward_passes < 24


def test_hybrid_uses_the_lookup_where_it_matches_and_the_model_elsewhere(tiny_pair, engine):
    target, _, tokenizer = tiny_pair
    prompt_ids = encode(tokenizer, PROMPTS[2])
    grounded = prompt_ids + tuple(reference_greedy(target, prompt_ids, 16)) + prompt_ids
    result = engine.generate([GenerationRequest(grounded, 40, GREEDY, 4, drafter="hybrid")])[0]
    by_drafter = result.stats.as_dict()["by_drafter"]
    # The session's engine may have learnt this prompt's answer already: then its suffix trees match too.
    looked_up = sum(by_drafter.get(name, {}).get("draft_tokens", 0) for name in ("ngram", "suffix"))
    assert looked_up > 0 and by_drafter["model"]["draft_tokens"] > 0
    assert result.token_ids == reference_greedy(target, grounded, 40)


@pytest.mark.parametrize("drafter", ["ngram", "suffix", "hybrid"])
def test_look_ups_propose_up_to_their_own_cap_and_stay_exact(tiny_pair, drafter, monkeypatch):
    target, draft, tokenizer = tiny_pair
    engine = make_engine(target, draft, tokenizer, prompt_lookup_num_tokens=6)
    prompt_ids = encode(tokenizer, PROMPTS[0])
    expected = reference_greedy(target, prompt_ids, 24)

    # A random tiny model never copies its prompt, so the look-up is an oracle that
    # knows the greedy continuation: every step then verifies as many drafts as allowed.
    caps, model_ks, fed_rows = [], [], []

    def oracle(request_id, cap, tree=False):
        caps.append(cap)
        done = len(next(row for row in engine.rows if row.request_id == request_id).token_ids)
        return Proposal(list(expected[done : done + cap]))

    # The suffix drafter is the oracle where it is the row's drafter; under hybrid it finds nothing.
    lookup = engine.suffix_drafter if drafter == "suffix" else engine.drafter_map["ngram"]
    propose, add, index = engine.model_drafter.propose, engine.model_drafter.add, lookup.add
    indexed_rows = []
    monkeypatch.setattr(lookup, "lookup", oracle)
    monkeypatch.setattr(lookup, "add", lambda prompts, **kw: indexed_rows.extend(prompts) or index(prompts, **kw))
    if drafter == "hybrid":
        monkeypatch.setattr(engine.suffix_drafter, "lookup", lambda request_id, cap, tree=False: Proposal([]))
    monkeypatch.setattr(
        engine.model_drafter, "propose", lambda rows, *a, **kw: model_ks.append(rows) or propose(rows, *a, **kw)
    )
    monkeypatch.setattr(
        engine.model_drafter, "add", lambda prompts, **kw: fed_rows.extend(prompts) or add(prompts, **kw)
    )
    result = engine.generate([GenerationRequest(prompt_ids, 24, GREEDY, 2, drafter=drafter)])[0]
    assert result.token_ids == expected
    # 6 drafts per pass although the request's k is 2; the cap shrinks as max_new_tokens nears.
    # The first token comes from the prefill; every draft is accepted: 3 passes of 6 drafts + the bonus
    # (22 tokens), then 1 draft + the bonus.
    assert caps == [6, 6, 6, 1]
    assert result.stats.accepted_per_position == [4, 3, 3, 3, 3, 3]
    assert model_ks == []  # the look-up always matched, so hybrid never ran the draft model
    assert bool(fed_rows) == (drafter == "hybrid")  # but hybrid kept it ready
    # k = 0 turns every drafter off, the look-up included, and no drafter reads the prompt.
    caps.clear(), fed_rows.clear(), indexed_rows.clear()
    plain = engine.generate([GenerationRequest(prompt_ids, 24, GREEDY, 0, drafter=drafter)])[0]
    assert plain.token_ids == expected and plain.stats.draft_tokens == 0
    assert fed_rows == [] and indexed_rows == [] and set(caps) <= {0}


def test_logprobs_equal_a_direct_forward_of_the_target(tiny_pair, engine):
    target, _, tokenizer = tiny_pair
    prompt_ids = encode(tokenizer, PROMPTS[0])
    for sampling, seed in ((GREEDY, None), (SAMPLED, 3)):
        result = engine.generate([GenerationRequest(prompt_ids, 20, sampling, 4, seed=seed, logprobs=3)])[0]
        assert [lp.token_id for lp in result.logprobs] == result.token_ids
        sequence = torch.tensor([prompt_ids + tuple(result.token_ids)])
        with torch.no_grad():
            logits = target(input_ids=sequence).logits[0, len(prompt_ids) - 1 : -1]  # [completion, vocab]
        expected = torch.log_softmax(logits.float(), dim=-1)
        for position, token_logprob in enumerate(result.logprobs):
            assert token_logprob.logprob == pytest.approx(float(expected[position, token_logprob.token_id]), abs=1e-4)
            top = expected[position].topk(3)
            assert [t for t, _ in token_logprob.top] == top.indices.tolist()
            assert [v for _, v in token_logprob.top] == pytest.approx(top.values.tolist(), abs=1e-4)
    plain = engine.generate([GenerationRequest(prompt_ids, 5, GREEDY, 4)])[0]
    assert plain.logprobs is None


def test_a_table_where_drafting_never_pays_gives_plain_decoding(tiny_pair):
    target, draft, tokenizer = tiny_pair
    # Width 2 costs twice width 1: no acceptance rate can pay for a draft.
    table = CostModel(draft_step=0.05, target_step=1.0, target_per_extra_token=1.0)
    planned = make_engine(target, draft, tokenizer, cost_table=table)
    prompt_ids = encode(tokenizer, PROMPTS[1])
    result = planned.generate([GenerationRequest(prompt_ids, 30, GREEDY, 4)])[0]
    assert result.token_ids == reference_greedy(target, prompt_ids, 30)
    assert result.stats.fell_back
    # Drafting stops once the warm-up is over (a few k=1 steps to estimate acceptance).
    assert result.stats.draft_tokens <= 4
    assert result.stats.target_forward_passes >= len(result.token_ids) - 4


def test_batch_plan_never_changes_a_seeded_request(tiny_pair):
    target, draft, tokenizer = tiny_pair
    costs = CostModel(draft_step=0.3, target_step=1.0, target_per_extra_token=0.3)
    planned = make_engine(target, draft, tokenizer, eos_token_ids=(), cost_table=costs)
    seeded = GenerationRequest(encode(tokenizer, PROMPTS[0]), 25, SAMPLED, 3, seed=123)
    alone = planned.generate([seeded])[0]
    others = [GenerationRequest(encode(tokenizer, p), 30, GREEDY, 8) for p in PROMPTS[1:4]]
    together = planned.generate([*others, seeded])[-1]
    assert together.token_ids == alone.token_ids


def test_a_row_that_fell_back_probes_every_interval_where_a_typical_row_would_draft(tiny_pair, monkeypatch):
    target, draft, tokenizer = tiny_pair
    prompt_ids = encode(tokenizer, PROMPTS[1])
    expected = make_engine(target, draft, tokenizer, eos_token_ids=()).generate(
        [GenerationRequest(prompt_ids, 120, GREEDY, 0)]
    )[0].token_ids
    # A look-up's draft pays where the target takes it more than 3 times in 10.
    costs = CostModel(draft_step=1.0, target_step=1.0, target_per_extra_token=0.3)
    planned = make_engine(target, draft, tokenizer, eos_token_ids=(), cost_table=costs)
    # The pool has seen other requests' look-ups taken every time; this request's are always wrong.
    for _ in range(50):
        planned.estimates.pool_trackers["ngram"].update(1, 1)

    def wrong(request_id, cap, tree=False):
        done = len(planned.rows[0].token_ids)
        return Proposal([(expected[done] + 1) % tokenizer.vocab_size] if cap and done < len(expected) else [])

    monkeypatch.setattr(planned.drafter_map["ngram"], "lookup", wrong)
    result = planned.generate([GenerationRequest(prompt_ids, 120, GREEDY, 1, drafter="ngram")])[0]
    assert result.token_ids == expected
    assert result.stats.fell_back and result.stats.accepted_tokens == 0
    num_probes = result.stats.num_drafts - MIN_STEPS_BEFORE_FALLBACK
    assert 1 <= num_probes <= 120 // PROBE_INTERVAL


def test_where_drafting_never_pays_no_row_probes(tiny_pair):
    target, draft, tokenizer = tiny_pair
    # Width 2 costs twice width 1: no acceptance pays for a draft, and a probe would only cost.
    costs = CostModel(draft_step=0.05, target_step=1.0, target_per_extra_token=1.0)
    planned = make_engine(target, draft, tokenizer, eos_token_ids=(), cost_table=costs)
    result = planned.generate([GenerationRequest(encode(tokenizer, PROMPTS[1]), 120, GREEDY, 4)])[0]
    # The first steps draft (the pool knows nothing yet), one token each; then never again.
    assert result.stats.num_drafts == MIN_STEPS_BEFORE_FALLBACK
    assert result.stats.draft_tokens == result.stats.num_drafts


def test_forgetting_the_suffix_history_keeps_what_the_engine_learnt_of_the_look_ups(tiny_pair):
    """Only the trees go: the benchmarks forget them before their warm-ups too, so the verdicts and
    calibrations learnt there are of look-ups as cold as those they measure (`scripts.bench.load`)."""
    from handler.planning.trackers import LOOKUPS_ONLY, OUTCOME_MIN_STEPS

    target, draft, tokenizer = tiny_pair
    costs = CostModel(draft_step=0.05, target_step=1.0, target_per_extra_token=0.05)
    engine = make_engine(target, draft, tokenizer, cost_table=costs, options=EngineOptions(running_costs=True))
    check = engine.outcome_check
    assert check is not None
    for _ in range(OUTCOME_MIN_STEPS):
        check.observe(8, True, 1.0, 0.8, LOOKUPS_ONLY)
        check.observe(8, False, 1.0, 1.0)
    engine.estimates.suffix_calibration.update(4.0, 1)
    factor = engine.estimates.suffix_calibration.factor
    assert factor < 1.0
    engine.forget_suffix_history()
    assert check.ratio(8, LOOKUPS_ONLY) == pytest.approx(0.8)
    assert engine.estimates.suffix_calibration.factor == factor


def test_forgetting_the_suffix_history_starts_the_trees_afresh(tiny_pair):
    target, draft, tokenizer = tiny_pair
    engine = make_engine(target, draft, tokenizer)
    prompt_ids = encode(tokenizer, PROMPTS[0])
    engine.generate([GenerationRequest(prompt_ids, 12, GREEDY, 2, drafter="suffix")])
    options = engine.suffix_drafter.options
    assert engine.suffix_drafter.stats.num_requests == 1  # the finished request's text stays, shared
    engine.forget_suffix_history()
    assert engine.suffix_drafter.stats.num_requests == 0 and engine.suffix_drafter.options is options
    result = engine.generate([GenerationRequest(prompt_ids, 12, GREEDY, 2, drafter="suffix")])[0]
    assert result.token_ids == reference_greedy(target, prompt_ids, 12)
    engine.add_request("in flight", GenerationRequest(prompt_ids, 12, GREEDY, 2))
    with pytest.raises(AssertionError, match="between requests"):
        engine.forget_suffix_history()
