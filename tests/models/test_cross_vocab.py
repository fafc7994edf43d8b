"""A draft from another family (`handler.drafters.cross_vocab`): lossless with a vocabulary of its own.

The tiny pair's cross draft (`scripts.model_tools.make_tiny_models --cross-vocab`) is the draft with its ids
shuffled and merged tokens taken out and put in, so that each side has tokens the other lacks.
In float32, under both ways greedy rows draft (SLEM and TLI), with the model and hybrid drafters:
greedy output equal to the target's own `generate`, alone, batched and with a row joining mid-run;
the prefix cache on equal to off; a seeded request unchanged by the draft; a JSON-schema answer
equal to constrained plain decoding. Then each pairing of tokenizer families (byte-level BPE,
SentencePiece with byte fallback, WordLevel with `Fuse`) on tiny random Llama models.
"""

from __future__ import annotations

import copy
import functools
import json

import jsonschema
import pytest
import torch
import transformers

from handler.config import SamplingParams
from handler.constraints import Constraint
from handler.engine import GenerationRequest
from handler.runtime.loading import check_vocabularies
from tests.conftest import run_module
from tests.models.conftest import cross_vocab_pair, make_engine
from tests.models.test_engine import reference_greedy

PROMPTS = ["def fibonacci(n):", "x = [1, 2, 3]\nfor i in x:", "The quick brown fox"]
NUM_TOKENS = 24
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def cross_pair(tmp_path_factory):
    """(target, cross draft, target tokenizer, vocab map), in float32."""
    target, draft, tokenizer, vocab_map = cross_vocab_pair(tmp_path_factory.mktemp("cross-vocab"))
    # The engines here have no stop token: neither has the reference, which would otherwise hold its EOS back.
    target.generation_config.eos_token_id = None
    return target, draft, tokenizer, vocab_map


def engine_for(cross_pair, greedy: str = "slem", eos_token_ids=(), **options):
    target, draft, tokenizer, vocab_map = cross_pair
    return make_engine(
        target, draft, tokenizer, eos_token_ids, vocab_map=vocab_map, cross_vocab_greedy=greedy, **options
    )


def reference(target, prompt_ids, num_tokens: int = NUM_TOKENS) -> list[int]:
    return reference_greedy(target, prompt_ids, num_tokens, min_new_tokens=num_tokens, pad_token_id=0)


@pytest.mark.parametrize("greedy", ["slem", "tli"])
def test_greedy_output_is_the_targets_alone_and_batched(cross_pair, greedy):
    target, _, tokenizer, _ = cross_pair
    engine = engine_for(cross_pair, greedy)
    prompts = [tuple(tokenizer(prompt)["input_ids"]) for prompt in PROMPTS]
    expected = [reference(target, prompt) for prompt in prompts]
    stats = []
    for drafter in ("model", "hybrid"):
        for k in (1, 4):
            requests = [GenerationRequest(p, NUM_TOKENS, GREEDY, k, drafter=drafter) for p in prompts]
            alone = [engine.generate([request])[0] for request in requests]
            assert [result.token_ids for result in alone] == expected, (drafter, k)
            assert [result.token_ids for result in engine.generate(requests)] == expected, (drafter, k)
            stats += [result.stats for result in alone]
    # The draft drafted, and some of its drafts were the target's.
    assert sum(s.draft_tokens_by_drafter.get("model", 0) for s in stats) > 0
    assert sum(s.accepted_tokens_by_drafter.get("model", 0) for s in stats) > 0


def test_the_planner_and_the_confidence_stop_keep_greedy_and_seeded_output(cross_pair):
    """With a cost table, each step's k is planned and the draft stops by its own confidence, which
    the planner prices with the draft's pending tokens (what the proposal feeds first)."""
    from handler.planning.cost_table import CostTable

    target, _, tokenizer, _ = cross_pair
    widths = (1, 2, 4, 8)
    row = tuple(1.0 + 0.05 * (width - 1) for width in widths)
    costs = CostTable(widths=widths, batch_sizes=(1, 8), target=(row, row), draft=(0.1, 0.1))
    engine = engine_for(cross_pair, cost_table=costs, draft_confidence=True)
    prompts = [tuple(tokenizer(prompt)["input_ids"]) for prompt in PROMPTS]
    sampled = SamplingParams(temperature=0.8)
    requests = [GenerationRequest(p, NUM_TOKENS, GREEDY, 6, drafter=d) for p in prompts for d in ("model", "hybrid")]
    requests.append(GenerationRequest(prompts[0], NUM_TOKENS, sampled, 6, seed=4))
    results = engine.generate(requests)
    expected = [reference(target, request.prompt_ids) for request in requests[:-1]]
    assert [result.token_ids for result in results[:-1]] == expected
    plain = make_engine(target, None, tokenizer, eos_token_ids=())
    seeded = plain.generate([GenerationRequest(prompts[0], NUM_TOKENS, sampled, 0, seed=4)])[0].token_ids
    assert results[-1].token_ids == seeded
    assert sum(result.stats.draft_tokens_by_drafter.get("model", 0) for result in results) > 0


@pytest.mark.parametrize("forms", ["as loaded", "int8, its bf16 form prefilling"])
def test_a_row_joining_mid_run_and_the_prefix_cache_change_nothing(cross_pair, forms):
    """Also with an int8 draft whose rows its float form prefills (`LoadedModels.draft_prefill`)."""
    target, draft, tokenizer, vocab_map = cross_pair
    pair, options = cross_pair, {}
    if forms != "as loaded":
        from handler.runtime.cpu_speed import quantize_draft_int8

        pair = (target, quantize_draft_int8(copy.deepcopy(draft)), tokenizer, vocab_map)
        options["draft_prefill"] = copy.deepcopy(draft).to(torch.bfloat16)
    engine = engine_for(pair, prefix_cache_max_bytes=1 << 24, **options)
    first, second = (tuple(tokenizer(prompt)["input_ids"]) for prompt in PROMPTS[:2])
    expected = {first: reference(target, first), second: reference(target, second)}
    sampled = SamplingParams(temperature=0.8)
    engine.add_request("first", GenerationRequest(first, NUM_TOKENS, GREEDY, 4))
    engine.add_request("seeded", GenerationRequest(first, NUM_TOKENS, sampled, 4, seed=3))
    outputs = {}
    for step in range(200):
        if step == 3:  # a greedy row joins the running batch of a greedy (SLEM) and a sampled (TLI) row
            engine.add_request("second", GenerationRequest(second, NUM_TOKENS, GREEDY, 4))
        for output in engine.step():
            if output.result is not None:
                outputs[output.request_id] = output.result.token_ids
        if len(outputs) == 3:
            break
    assert outputs["first"] == expected[first] and outputs["second"] == expected[second]
    plain = make_engine(target, None, tokenizer, eos_token_ids=())
    seeded = plain.generate([GenerationRequest(first, NUM_TOKENS, sampled, 0, seed=3)])[0].token_ids
    assert outputs["seeded"] == seeded
    # Again: both prompts come from both models' prefix caches (the draft's keyed by its own ids).
    again = engine.generate([GenerationRequest(p, NUM_TOKENS, GREEDY, 4) for p in (first, second)])
    assert [result.cached_tokens > 0 for result in again] == [True, True]
    assert engine.model_drafter.prefix_cache.stats.num_bytes > 0
    assert [result.token_ids for result in again] == [expected[first], expected[second]]
    if forms != "as loaded":  # the float form prefilled: the draft's prefix cache holds its KV
        nodes, kinds = list(engine.model_drafter.prefix_cache.root.children.values()), set()
        while nodes:
            node = nodes.pop()
            kinds.add(node.kv.dtype)
            nodes += node.children.values()
        assert kinds == {torch.bfloat16}


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.9), SamplingParams(0.7, 20, 0.9)])
def test_a_seeded_request_depends_on_its_seed_and_the_target_alone(cross_pair, sampling):
    target, _, tokenizer, _ = cross_pair
    prompt = tuple(tokenizer(PROMPTS[0])["input_ids"])
    plain = make_engine(target, None, tokenizer, eos_token_ids=())
    expected = plain.generate([GenerationRequest(prompt, NUM_TOKENS, sampling, 0, seed=11)])[0].token_ids
    engine = engine_for(cross_pair)
    for k in (1, 3, 6):
        result = engine.generate([GenerationRequest(prompt, NUM_TOKENS, sampling, k, seed=11)])[0]
        assert result.token_ids == expected, k
        assert result.stats.draft_tokens > 0


SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


BOOLEAN = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}


@pytest.mark.parametrize("greedy", ["slem", "tli"])
def test_a_json_schema_answer_masks_in_the_targets_vocabulary(cross_pair, greedy):
    _, _, tokenizer, _ = cross_pair
    engine = engine_for(cross_pair, greedy, eos_token_ids=(tokenizer.eos_token_id,))
    prompt = tuple(tokenizer(PROMPTS[0])["input_ids"])
    constraint = Constraint.json_schema(SCHEMA)
    plain, speculative = (
        engine.generate([GenerationRequest(prompt, 48, GREEDY, k, constraint=constraint, drafter="model")])[0]
        for k in (0, 4)
    )
    jsonschema.validate(json.loads(plain.text), SCHEMA)
    assert speculative.token_ids == plain.token_ids
    assert speculative.stats.draft_tokens > 0


# Tokenizer families of the tokenizer tier, each pair of them as (target, draft).
FAMILIES = ["byte_level_bpe", "sentencepiece_bpe", "word_level_fuse"]
PAIRINGS = [(target, draft) for target in FAMILIES for draft in FAMILIES if target != draft]


@functools.cache
def family_model(family: str, num_layers: int, seed: int):
    from tests.unit.test_tokenizer_families import build

    tokenizer = build(family)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer) + 3,  # padded, as checkpoints are
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=num_layers,
        initializer_range=0.2,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # no stop token, as the engines here
    return model, tokenizer


@pytest.mark.parametrize("target_family, draft_family", PAIRINGS)
def test_each_pairing_of_tokenizer_families_gives_the_targets_greedy_output(target_family, draft_family):
    from handler.vocab_map import VocabMap

    target, tokenizer = family_model(target_family, 2, 0)
    draft, draft_tokenizer = family_model(draft_family, 1, 1)
    vocab_map = VocabMap.from_tokenizers(tokenizer, draft_tokenizer, target.config.vocab_size)
    assert vocab_map.num_shared > 20
    prompts = [tuple(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in ("hello world", "the café")]
    expected = [reference(target, prompt, 16) for prompt in prompts]
    for greedy in ("slem", "tli"):
        engine = make_engine(target, draft, tokenizer, eos_token_ids=(), vocab_map=vocab_map, cross_vocab_greedy=greedy)
        requests = [GenerationRequest(prompt, 16, GREEDY, 3) for prompt in prompts]
        results = engine.generate(requests)
        assert [result.token_ids for result in results] == expected, greedy
        assert sum(result.stats.draft_tokens for result in results) > 0


def test_the_handler_serves_a_draft_from_another_family_on_every_route(cross_pair, tmp_path, monkeypatch):
    """Through TorchServe's Context, no server: native (plain and streamed) and OpenAI chat with a
    JSON schema; the shared share is on the metrics."""
    from ts.context import Context, RequestProcessor

    import handler.spec_handler as spec_handler_module
    from handler.spec_handler import SpeculativeHandler
    from tests.models.test_spec_handler import HANDLER_SECTION, RecordingMetrics

    target, draft, tokenizer, vocab_map = cross_pair
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    draft.save_pretrained(tmp_path / "draft")
    vocab_map.draft_tokenizer.save_pretrained(tmp_path / "draft")

    def context_for(url_paths):
        context = Context(
            "tiny", str(tmp_path), {"model": {"modelName": "tiny"}}, 4, None, "0.12.0",
            model_yaml_config={"batchSize": 4, "handler": dict(HANDLER_SECTION)},
        )  # fmt: skip
        context.request_processor = [
            RequestProcessor({"body": {"content-type": "application/json"}, "url_path": path}) for path in url_paths
        ]
        context.request_ids = {i: f"r{i}" for i in range(len(url_paths))}
        context.metrics = RecordingMetrics()
        return context

    handler = SpeculativeHandler()
    handler.initialize(context_for([]))
    assert handler.engine.vocab_map is not None
    sent = []
    monkeypatch.setattr(
        spec_handler_module,
        "send_intermediate_predict_response",
        lambda ret, req_id_map, message, code, context: sent.append(dict(ret)),
    )
    chat = {
        "messages": [{"role": "user", "content": "Say ok"}],
        "max_completion_tokens": 48,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": BOOLEAN}},
    }
    requests = [
        ("", {"prompt": "def add(a, b):", "max_new_tokens": 16, "num_speculative_tokens": 0}),
        ("", {"prompt": "def add(a, b):", "max_new_tokens": 16, "num_speculative_tokens": 4}),
        ("", {"prompt": "def add(a, b):", "max_new_tokens": 16, "num_speculative_tokens": 4, "stream": True}),
        ("v1/chat/completions", chat),
    ]
    context = context_for([path for path, _ in requests])
    answers = handler.handle([{"body": body} for _, body in requests], context)
    assert [context.get_response_status(i)[0] for i in range(len(requests))] == [200] * 4
    plain, speculative, streamed, chat_answer = answers
    assert speculative["token_ids"] == plain["token_ids"] and speculative["speculative"]["draft_tokens"] > 0
    chunks = [json.loads(ret[2]) for ret in sent if 2 in ret]
    final = json.loads(streamed)
    assert "".join(chunk["text_delta"] for chunk in chunks) + final["text_delta"] == plain["text"]
    jsonschema.validate(json.loads(chat_answer["choices"][0]["message"]["content"]), BOOLEAN)
    recorded = context.metrics.values["SpecDraftSharedVocabularyPercent"]
    assert recorded == [round(100 * vocab_map.shared_share, 1)]
