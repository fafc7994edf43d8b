"""Plain steps launched behind the one before them and read a call later (`overlap_plain_steps`), float32.

On a GPU a plain step over rows without rules is launched from the tokens of the step before it, still
on the device, and the host reads and commits that one while the new pass runs. On a CPU the pass is
the host's own time and nothing overlaps, so the option is off there by default; these tests turn it on
and check what it must not change (every token, where each request stops, what an abort cuts) and what
it must do (launch before it reads, one read a step, leave rows with rules alone).
"""

from __future__ import annotations

import pytest
import torch

import handler.engine.engine as handler_engine
import handler.engine.row as row_module
from handler.engine import EngineOptions, GenerationRequest
from handler.engine.verify import PlainLaunch
from handler.types import SamplingParams

from .conftest import make_engine
from .test_engine import GREEDY, PROMPTS, SAMPLED, encode
from .test_plain_streak import DEAR_DRAFTS

OVERLAP = EngineOptions(running_costs=False, overlap_plain_steps=True)
PENALISED = SamplingParams(temperature=0.0, repetition_penalty=1.3)


def engine_pair(tiny_pair, cost_table=None, **settings):
    """The same engine twice: with plain steps overlapped, and without."""
    target, draft, tokenizer = tiny_pair
    engines = [
        make_engine(target, draft, tokenizer, cost_table=cost_table, options=options, **settings)
        for options in (OVERLAP, EngineOptions(running_costs=False, overlap_plain_steps=False))
    ]
    for engine in engines:
        if engine.planner.plain_streak is not None:
            engine.planner.plain_streak.min_share = 0.0  # the tiny models' plans always grant their skips
    return engines


def drive(engine, joins: dict, aborts: dict | None = None, max_calls: int = 400):
    """Runs requests through the step API: `joins` maps a call number to the (id, request) pairs added
    before it, `aborts` to the ids aborted before it. Returns each request's streamed tokens and result,
    and asserts that no output comes for a request after its abort and that a result repeats the stream."""
    aborts = aborts or {}
    streamed, results, aborted = {}, {}, set()
    call = 0
    while call <= max(joins) or engine.has_unfinished_requests():
        assert call < max_calls
        for request_id, request in joins.get(call, ()):
            engine.add_request(request_id, request)
        for request_id in aborts.get(call, ()):
            engine.abort_request(request_id)
            aborted.add(request_id)
        for output in engine.step():
            assert output.request_id not in aborted, f"output for {output.request_id} after its abort"
            streamed.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.result is not None:
                results[output.request_id] = output.result
        call += 1
    for request_id, result in results.items():
        assert result.token_ids == streamed[request_id], request_id
    return streamed, results


def workload(tokenizer, sampling, k: int, seed: int | None = None) -> dict:
    """Requests joining at three calls, of several lengths, one with a stop string, one ending on EOS
    (PROMPTS[1] ends on the tiny target's EOS after 9 greedy tokens)."""
    ids = [encode(tokenizer, prompt) for prompt in PROMPTS]
    request = lambda prompt, n, **kw: GenerationRequest(prompt, n, sampling, k, seed=seed, **kw)  # noqa: E731
    return {
        0: [("a", request(ids[0], 30)), ("b", request(ids[1], 40)), ("c", request(ids[2], 7))],
        3: [("d", request(ids[3], 25, stop=("e",))), ("e", request(ids[4], 18))],
        11: [("f", request(ids[0], 12)), ("g", request(ids[2], 1))],
    }


@pytest.mark.parametrize("k", [0, 8], ids=["plain rows", "priced-out drafting rows"])
def test_overlapped_greedy_steps_stream_the_same_tokens_and_stop_where_plain_steps_do(tiny_pair, k):
    """Rows join and leave (length, EOS, a stop string) between overlapped steps; at k = 8 under costs that
    price every draft out, the plain streak's steps overlap while planned steps read at once."""
    overlapped, plain = engine_pair(tiny_pair, DEAR_DRAFTS if k else None, drafter="hybrid")
    joins = workload(tiny_pair[2], GREEDY, k)
    streamed, results = drive(overlapped, joins)
    expected, expected_results = drive(plain, joins)
    assert streamed == expected
    assert {key: (r.finish_reason, r.text) for key, r in results.items()} == {
        key: (r.finish_reason, r.text) for key, r in expected_results.items()
    }
    assert {r.finish_reason for r in results.values()} >= {"length", "eos", "stop"}
    assert overlapped.num_overlapped_steps > 10 and plain.num_overlapped_steps == 0
    assert not overlapped.has_unfinished_requests() and overlapped._in_flight is None


@pytest.mark.parametrize("k", [0, 8], ids=["plain rows", "priced-out drafting rows"])
def test_overlapped_seeded_and_sampled_steps_draw_what_plain_steps_draw(tiny_pair, monkeypatch, k):
    """A seeded row's uniforms are keyed by its position, which counts the token still in flight; an
    unseeded row's generator draws once a step in the same order (seeded here alike in both engines)."""
    seeds = iter(range(1000))
    monkeypatch.setattr(row_module, "unseeded_generator", lambda: torch.Generator().manual_seed(next(seeds)))
    for seed in (5, None):
        overlapped, plain = engine_pair(tiny_pair, DEAR_DRAFTS if k else None, drafter="hybrid")
        joins = workload(tiny_pair[2], SAMPLED, k, seed=seed)
        seeds = iter(range(1000))
        streamed, _ = drive(overlapped, joins)
        seeds = iter(range(1000))
        assert streamed == drive(plain, joins)[0], seed
        assert overlapped.num_overlapped_steps > 10


def test_an_abort_while_a_step_is_in_flight_stops_the_request_there(tiny_pair):
    """The aborted request gets no output after its abort (its token in flight is dropped), and the others
    keep streaming the same tokens."""
    overlapped, plain = engine_pair(tiny_pair)
    joins = workload(tiny_pair[2], GREEDY, 0)
    aborts = {6: ["a"], 14: ["f"]}
    streamed, results = drive(overlapped, joins, aborts)
    expected, _ = drive(plain, joins, aborts)
    assert "a" not in results and "f" not in results
    for request_id in ("a", "f"):
        # One call behind: the aborted stream is the plain engine's up to a token shorter.
        assert expected[request_id][: len(streamed[request_id])] == streamed[request_id]
        assert len(expected[request_id]) - len(streamed[request_id]) <= 1
    assert {key: tokens for key, tokens in streamed.items() if key not in ("a", "f")} == {
        key: tokens for key, tokens in expected.items() if key not in ("a", "f")
    }
    assert overlapped.num_overlapped_steps > 10


def test_each_plain_step_is_launched_before_the_one_before_it_is_read(tiny_pair, monkeypatch):
    """The order the device sees: the prefill, two passes, then each read follows the next pass's launch;
    one read a step."""
    target, draft, tokenizer = tiny_pair
    engine = make_engine(target, draft, tokenizer, eos_token_ids=(), options=OVERLAP)
    events = []
    forward = target.forward
    monkeypatch.setattr(target, "forward", lambda *a, **kw: events.append("pass") or forward(*a, **kw))
    read = PlainLaunch.read
    monkeypatch.setattr(PlainLaunch, "read", lambda self: events.append("read") or read(self))
    result = engine.generate([GenerationRequest(encode(tokenizer, PROMPTS[0]), 10, GREEDY, 0)])[0]
    assert len(result.token_ids) == 10
    # The prefill gives the first token; the other 9 come from launched passes, the ninth read by a drain.
    assert events == ["pass", "pass"] + ["pass", "read"] * 8 + ["read"], events
    assert engine.num_overlapped_steps == 8


@pytest.mark.parametrize(
    "request_options",
    [{"logprobs": 2}, {"sampling": PENALISED}],
    ids=["log-probabilities", "a penalty"],
)
def test_rows_whose_tokens_the_host_needs_are_never_launched_ahead(tiny_pair, monkeypatch, request_options):
    """A row reporting log-probabilities or shaping its logits by its history reads every step at once, and
    so does every step it is in. A penalised row's plain step is the lean pass and draw (its penalties
    from the history committed before it), read in the same call; a row reporting log-probabilities
    takes the verifier's."""
    target, draft, tokenizer = tiny_pair
    engine = make_engine(target, draft, tokenizer, options=OVERLAP)
    launched = []
    real_launch = engine.verifier.launch_plain
    monkeypatch.setattr(engine.verifier, "launch_plain", lambda *args: launched.append(1) or real_launch(*args))
    real_step = engine.step

    def step():
        outputs = real_step()
        assert engine._in_flight is None, "a step was left in flight"
        return outputs

    monkeypatch.setattr(engine, "step", step)
    options = {"sampling": GREEDY, **request_options}
    prompt = encode(tokenizer, PROMPTS[0])
    requests = [GenerationRequest(prompt, 12, num_speculative_tokens=0, **options), GenerationRequest(prompt, 12, GREEDY, 0)]
    results = engine.generate(requests)
    assert engine.num_overlapped_steps == 0 and engine._in_flight is None
    assert bool(launched) == ("sampling" in request_options)
    unlaunched = make_engine(target, draft, tokenizer)
    monkeypatch.setattr(unlaunched.verifier, "launch_plain", lambda *args: pytest.fail("launched"))
    monkeypatch.setattr(handler_engine, "_lean", lambda rows, lag=0: False)
    expected = unlaunched.generate(requests)
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]


@pytest.mark.parametrize("overlap", [False, True], ids=["read at once", "overlapped"])
def test_a_planned_plain_step_is_recorded_with_its_plan(tiny_pair, overlap):
    """A plain step that the planner planned keeps that plan in its record (its priced rate is what the
    outcome check weighs plain decoding's steps by) and in the rows' estimates, read at once or later."""
    target, draft, tokenizer = tiny_pair
    options = EngineOptions(running_costs=False, overlap_plain_steps=overlap)
    engine = make_engine(target, draft, tokenizer, cost_table=DEAR_DRAFTS, options=options, drafter="hybrid")
    engine.planner.plain_streak.min_share = 1.0  # every step plans
    recorded = []
    record = engine.steps.record
    engine.steps.record = lambda plan, *args: recorded.append(plan) or record(plan, *args)
    planned = []
    plan = engine.planner.plan
    engine.planner.plan = lambda *args: planned.append(plan(*args)) or planned[-1]
    engine.generate([GenerationRequest(encode(tokenizer, PROMPTS[0]), 16, GREEDY, 8)])
    # Plain plans, but for the outcome check's exploring steps (by step number), which draft.
    assert len(recorded) == len(planned) > 5 and sum(p.width == 0 for p in planned) > 5
    assert [id(p) for p in recorded] == [id(p) for p in planned]
    assert all(p.expected_rate > 0 for p in recorded)
