"""Structured output through the engine on the tiny pair, in float32.

- greedy: a constrained speculative request equals constrained plain decoding
  (`num_speculative_tokens: 0`), for every drafter, alone, batched and planned;
- a seeded constrained request depends on its seed and the target alone;
- every finished output matches its constraint (jsonschema validates the JSON);
- the grammar's forced tokens are proposed as drafts and counted.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from handler.config import SamplingParams
from handler.constraints import Constraint
from handler.engine import PROPOSER_GRAMMAR, EngineOptions, GenerationRequest, SpeculativeEngine, build_engine
from handler.planning.cost_table import CostModel
from handler.runtime.loading import LoadedModels, collect_eos_token_ids

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "active"],
    "additionalProperties": False,
}
TOOL_CALL = {
    "type": "object",
    "properties": {
        "name": {"const": "get_weather"},
        "arguments": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
DATE_REGEX = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
YES_NO_GRAMMAR = 'start: answer " because " reason\nanswer: "yes" | "no"\nreason: /[a-z ]{1,12}/'
CONSTRAINTS = {
    "person": Constraint.json_schema(PERSON),
    "tool_call": Constraint.json_schema(TOOL_CALL),
    "date": Constraint.regex(DATE_REGEX),
    "lark": Constraint.grammar(YES_NO_GRAMMAR),
}
PROMPTS = ["The quick brown fox", "def fibonacci(n):", "Hello! How can I help you today?"]
MAX_NEW_TOKENS = 120


@pytest.fixture(scope="module")
def eos_ids(tiny_pair):
    target, _, tokenizer = tiny_pair
    return collect_eos_token_ids(tokenizer, target.generation_config)


@pytest.fixture(scope="module")
def engine_for(tiny_pair, eos_ids):
    target, draft, tokenizer = tiny_pair
    engines = {}

    def get(planned: bool = False) -> SpeculativeEngine:
        if planned not in engines:
            cost_table = CostModel(draft_step=0.2, target_step=1.0, target_per_extra_token=0.05) if planned else None
            engines[planned] = build_engine(
                # The hand-made costs stand as given: planned by them, not by this machine's timing.
                LoadedModels.of(target, draft, tokenizer, eos_token_ids=eos_ids),
                cost_table=cost_table,
                options=EngineOptions(running_costs=False),
            )
        return engines[planned]

    return get


def request(tokenizer, prompt, constraint, k=4, drafter="model", sampling=SamplingParams(), seed=None):
    return GenerationRequest(
        tuple(tokenizer(prompt)["input_ids"]),
        MAX_NEW_TOKENS,
        sampling,
        k,
        seed=seed,
        drafter=drafter,
        constraint=constraint,
    )


def check_matches(constraint: Constraint, text: str) -> None:
    if constraint.kind == "json_schema":
        jsonschema.validate(json.loads(text), json.loads(constraint.source))
    elif constraint.kind == "regex":
        assert re.fullmatch(constraint.source, text), text
    else:
        assert re.fullmatch(r"(yes|no) because [a-z ]{1,12}", text), text


@pytest.mark.parametrize("name", sorted(CONSTRAINTS))
@pytest.mark.parametrize("drafter", ["model", "ngram", "suffix", "hybrid"])
def test_greedy_constrained_speculation_equals_constrained_plain_decoding(tiny_pair, engine_for, name, drafter):
    _, _, tokenizer = tiny_pair
    constraint = CONSTRAINTS[name]
    engine = engine_for()
    plain = engine.generate([request(tokenizer, p, constraint, k=0) for p in PROMPTS])
    for result in plain:
        assert result.finish_reason == "eos", result
        check_matches(constraint, result.text)
    # Alone, and batched beside each other and an unconstrained row.
    for index, prompt in enumerate(PROMPTS):
        [alone] = engine.generate([request(tokenizer, prompt, constraint, drafter=drafter)])
        assert alone.token_ids == plain[index].token_ids
    free = request(tokenizer, PROMPTS[0], None, drafter=drafter)
    batched = engine.generate([request(tokenizer, p, constraint, drafter=drafter) for p in PROMPTS] + [free])
    assert [r.token_ids for r in batched[:-1]] == [r.token_ids for r in plain]
    [free_alone] = engine.generate([free])
    assert batched[-1].token_ids == free_alone.token_ids


@pytest.mark.parametrize("drafter", ["model", "hybrid"])
def test_planned_steps_keep_constrained_output_exact(tiny_pair, engine_for, drafter):
    _, _, tokenizer = tiny_pair
    constraint = CONSTRAINTS["tool_call"]
    plain = engine_for().generate([request(tokenizer, p, constraint, k=0) for p in PROMPTS])
    planned = engine_for(planned=True).generate([request(tokenizer, p, constraint, drafter=drafter) for p in PROMPTS])
    assert [r.token_ids for r in planned] == [r.token_ids for r in plain]


def test_where_the_outcome_check_stops_speculation_the_grammars_forced_tokens_stay(tiny_pair, eos_ids, monkeypatch):
    """The check of drafting against plain decoding (a CPU's, with running costs) vetoes speculation; the
    tokens a grammar forces are certain, so they are still verified as drafts, and are no sample of it."""
    from handler.planning.cost_table import CostTable
    from handler.planning.trackers import OutcomeCheck

    target, draft, tokenizer = tiny_pair
    # About the tiny pair's own seconds, so that the running correction keeps the table's shape.
    widths = (1, 2, 4, 8)
    row = tuple(0.002 * (1.0 + 0.05 * (width - 1)) for width in widths)
    costs = CostTable(widths=widths, batch_sizes=(1, 2), target=(row, row), draft=(0.0004, 0.0004))
    engine = build_engine(LoadedModels.of(target, draft, tokenizer, eos_token_ids=eos_ids), cost_table=costs)
    assert engine.outcome_check is not None
    monkeypatch.setattr(OutcomeCheck, "arm", lambda self, bucket, planned, step, gain=1.0, kind=None: False)
    observed = []
    monkeypatch.setattr(
        OutcomeCheck,
        "observe",
        lambda self, bucket, drafted, seconds, rate, kind=None: observed.append(drafted and rate is not None),
    )
    constraint = CONSTRAINTS["tool_call"]
    [result] = engine.generate([request(tokenizer, PROMPTS[0], constraint, drafter="model")])
    plain = engine.generate([request(tokenizer, PROMPTS[0], constraint, k=0)])[0]
    assert result.token_ids == plain.token_ids
    by_drafter = result.stats.as_dict()["by_drafter"]
    assert by_drafter[PROPOSER_GRAMMAR]["draft_tokens"] > 0 and "model" not in by_drafter
    assert not any(observed)  # forced-only steps are no drafting sample


def test_continuous_joins_keep_constrained_output_exact(tiny_pair, engine_for):
    _, _, tokenizer = tiny_pair
    engine = engine_for()
    requests = [request(tokenizer, p, CONSTRAINTS[name]) for p, name in zip(PROMPTS, ["person", "date", "lark"])]
    expected = [engine.generate([r])[0].token_ids for r in requests]
    results = {}
    engine.add_request(0, requests[0])
    step = 0
    while engine.has_unfinished_requests() or step < 2:
        if step in (1, 2):
            engine.add_request(step, requests[step])
        for output in engine.step():
            if output.result is not None:
                results[output.request_id] = output.result.token_ids
        step += 1
    assert [results[i] for i in range(3)] == expected


def test_a_seeded_constrained_request_depends_on_its_seed_and_the_target_alone(tiny_pair, engine_for):
    _, _, tokenizer = tiny_pair
    engine = engine_for()
    sampling = SamplingParams(temperature=0.9, top_p=0.95)
    constraint = CONSTRAINTS["person"]

    def run(**kwargs):
        return engine.generate([request(tokenizer, PROMPTS[1], constraint, sampling=sampling, seed=7, **kwargs)])[0]

    reference = run(k=0)
    check_matches(constraint, reference.text)
    for drafter in ("model", "ngram", "suffix", "hybrid"):
        for k in (1, 4):
            assert run(k=k, drafter=drafter).token_ids == reference.token_ids, (drafter, k)


@pytest.mark.parametrize("name", sorted(CONSTRAINTS))
def test_every_sampled_constrained_output_matches(tiny_pair, engine_for, name):
    _, _, tokenizer = tiny_pair
    constraint = CONSTRAINTS[name]
    sampling = SamplingParams(temperature=0.8)
    requests = [
        request(
            tokenizer,
            PROMPTS[i % len(PROMPTS)],
            constraint,
            drafter=("model", "ngram", "hybrid")[i % 3],
            sampling=sampling,
            seed=i if i % 2 else None,
        )
        for i in range(24)
    ]
    results = engine_for().generate(requests)
    finished = [r for r in results if r.finish_reason == "eos"]
    assert len(finished) >= 20, [r.finish_reason for r in results]
    for result in finished:
        check_matches(constraint, result.text)


def test_forced_tokens_are_free_drafts(tiny_pair, engine_for):
    _, _, tokenizer = tiny_pair
    [result] = engine_for().generate([request(tokenizer, PROMPTS[0], CONSTRAINTS["tool_call"])])
    forced = result.stats.as_dict()["by_drafter"][PROPOSER_GRAMMAR]
    # '{"name": "get_weather", "arguments": {"city": "' is forced, and the target keeps it.
    assert forced["draft_tokens"] >= 10
    assert forced["accepted_tokens"] == forced["draft_tokens"]
    assert result.stats.constrained and result.stats.mask_seconds > 0
    assert engine_for().steps.last_step_mask_seconds <= engine_for().steps.last_step_seconds


def test_a_grammar_that_spells_a_special_token_literally_serves_exactly(tiny_pair, engine_for):
    # The text "<|im_start|>" is a special token, which llguidance's matcher takes only as its spelling.
    _, _, tokenizer = tiny_pair
    constraint = Constraint.grammar('start: "<|im_start|>" /[a-z]{1,6}/')
    engine = engine_for()
    plain = engine.generate([request(tokenizer, p, constraint, k=0) for p in PROMPTS])
    for drafter in ("model", "ngram", "suffix", "hybrid"):
        spec = engine.generate([request(tokenizer, p, constraint, drafter=drafter) for p in PROMPTS])
        assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    for result in plain:
        text = tokenizer.decode(result.token_ids, skip_special_tokens=False)
        assert re.fullmatch(r"<\|im_start\|>[a-z]{1,6}<\|endoftext\|>|<\|im_start\|>[a-z]{1,6}<\|im_end\|>", text), text
