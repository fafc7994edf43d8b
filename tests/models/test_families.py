"""Model families beyond Qwen2: tiny random models of each, built from `transformers` configs, float32.

For every family that serves: greedy output equal to the target's own `generate` under each
drafter (model, ngram, suffix, hybrid; trees where the model takes a tree mask) on both runners,
alone and batched; a seeded request unchanged by its drafter; the prefix cache on equal to off; a
row that joins mid-run; a JSON-schema answer that validates and equals constrained plain decoding.
Sliding-window families (Gemma 2 and 3, Mistral with a window) serve with a window shorter than
the text, so that it matters. Families whose caches cannot be rolled back by a length
(state-space and recurrent layers) are refused by `check_cache_support`, which loading calls,
naming the layers.
"""

from __future__ import annotations

import functools
import json

import jsonschema
import pytest
import torch
import transformers

from handler.config import SamplingParams
from handler.constraints import Constraint
from handler.engine import GenerationRequest
from handler.caches.kv_cache import check_cache_support
from tests.models.conftest import make_engine
from tests.models.test_engine import reference_greedy

VOCAB = 384  # the tiny tokenizer's
# Wide initial weights, as scripts.model_tools.make_tiny_models uses: with the configs' default 0.02 some
# families' tiny models repeat one token, and exactness over a repeated token proves little.
TOKENS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "initializer_range": 0.2}
LAYERS = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
GEMMA = {"head_dim": 16, "tie_word_embeddings": False}
# Family -> (config class, its fields beside the number of layers).
SERVED = {
    "llama": ("LlamaConfig", LAYERS),
    "mistral": ("MistralConfig", {**LAYERS, "sliding_window": None}),
    "mixtral": ("MixtralConfig", {**LAYERS, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}),
    "qwen2": ("Qwen2Config", LAYERS),
    "qwen3": ("Qwen3Config", {**LAYERS, "head_dim": 16}),
    "phi3": ("Phi3Config", LAYERS),
    "gpt2": ("GPT2Config", dict(vocab_size=VOCAB, n_embd=64, n_head=4, n_positions=512)),
    "gpt_neox": ("GPTNeoXConfig", dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4)),
    "starcoder2": ("Starcoder2Config", {**LAYERS, "sliding_window": None}),
    "olmo2": ("Olmo2Config", LAYERS),
    "granite": ("GraniteConfig", LAYERS),
    # Gemma ties its head to its embedding, and random tied weights repeat the prompt's last token: untied here.
    "gemma": ("GemmaConfig", {**LAYERS, "head_dim": 16, "tie_word_embeddings": False}),
    # Sliding windows of 6 tokens, shorter than every prompt and output here: the window matters.
    "gemma2": ("Gemma2Config", {**LAYERS, **GEMMA, "sliding_window": 6}),  # a sliding layer, then a global one
    # Interleaved local and global layers (two layers: one of each).
    "gemma3": ("Gemma3TextConfig", {**LAYERS, **GEMMA, "sliding_window": 6, "sliding_window_pattern": 2}),
    "mistral_sliding": ("MistralConfig", {**LAYERS, "sliding_window": 6}),  # every layer slides
}
REFUSED = {
    # State-space and hybrid recurrent caches: nothing to crop.
    "mamba": ("MambaConfig", {"vocab_size": VOCAB, "hidden_size": 64, "state_size": 8}),
    "jamba": ("JambaConfig", {**LAYERS, "num_experts": 2}),
}
PROMPTS = ["def fibonacci(n):", "x = [1, 2, 3]\nfor i in x:"]
NUM_TOKENS = 16
GREEDY = SamplingParams()


def build(config_class: str, fields: dict, num_layers: int, seed: int) -> torch.nn.Module:
    layers = {"n_layer": num_layers} if config_class == "GPT2Config" else {"num_hidden_layers": num_layers}
    config = getattr(transformers, config_class)(**fields, **layers, **TOKENS)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@functools.cache
def pair(name: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A family's target (2 layers) and draft (1 layer), built once per test session."""
    config_class, fields = SERVED[name]
    return build(config_class, fields, 2, 0), build(config_class, fields, 1, 1)


def reference(target, prompt_ids) -> list[int]:
    """The target's own greedy output, never stopped early: the engines here have no stop token."""
    return reference_greedy(target, prompt_ids, NUM_TOKENS, min_new_tokens=NUM_TOKENS, pad_token_id=0)


@pytest.mark.parametrize("name", sorted(SERVED))
def test_the_tiny_targets_do_not_repeat_one_token(name, tiny_tokenizer):
    """Exactness over one repeated token would prove little (Gemma's tied weights did that)."""
    target, _ = pair(name)
    for prompt in PROMPTS:
        assert len(set(reference(target, tuple(tiny_tokenizer(prompt)["input_ids"])))) >= NUM_TOKENS // 4, prompt


@pytest.mark.parametrize("runner", ["dynamic", "static"])
@pytest.mark.parametrize("name", sorted(SERVED))
def test_greedy_output_is_the_targets_with_each_drafter_alone_and_batched(name, runner, tiny_tokenizer):
    target, draft = pair(name)
    engine = make_engine(target, draft, tiny_tokenizer, eos_token_ids=(), runner=runner)
    prompts = [tuple(tiny_tokenizer(prompt)["input_ids"]) for prompt in PROMPTS]
    expected = [reference(target, prompt) for prompt in prompts]
    for drafter in ("model", "ngram", "suffix", "hybrid"):
        requests = [GenerationRequest(p, NUM_TOKENS, GREEDY, 4, drafter=drafter) for p in prompts]
        alone = [engine.generate([request])[0].token_ids for request in requests]
        assert alone == expected, drafter
        assert [result.token_ids for result in engine.generate(requests)] == expected, drafter


@pytest.mark.parametrize("name", sorted(SERVED))
def test_a_seeded_request_does_not_depend_on_its_drafter(name, tiny_tokenizer):
    target, draft = pair(name)
    engine = make_engine(target, draft, tiny_tokenizer, eos_token_ids=())
    prompt = tuple(tiny_tokenizer(PROMPTS[0])["input_ids"])
    sampled = SamplingParams(temperature=0.9)
    outputs = [
        engine.generate([GenerationRequest(prompt, NUM_TOKENS, sampled, k, seed=7, drafter=drafter)])[0].token_ids
        for k, drafter in ((0, "model"), (4, "model"), (4, "ngram"))
    ]
    assert outputs[0] == outputs[1] == outputs[2]


@pytest.mark.parametrize("name", sorted(SERVED))
def test_the_prefix_cache_and_a_row_joining_mid_run_change_nothing(name, tiny_tokenizer):
    target, draft = pair(name)
    engine = make_engine(target, draft, tiny_tokenizer, eos_token_ids=(), prefix_cache_max_bytes=1 << 24)
    first, second = (tuple(tiny_tokenizer(prompt)["input_ids"]) for prompt in PROMPTS)
    expected = {prompt: reference(target, prompt) for prompt in (first, second)}
    engine.add_request("first", GenerationRequest(first, NUM_TOKENS, GREEDY, 4))
    outputs = {}
    for step in range(100):
        if step == 3:  # the second row joins the running batch
            engine.add_request("second", GenerationRequest(second, NUM_TOKENS, GREEDY, 4))
        for output in engine.step():
            if output.result is not None:
                outputs[output.request_id] = output.result.token_ids
        if len(outputs) == 2:
            break
    assert outputs == {"first": expected[first], "second": expected[second]}
    # Again: both prompts now come from the prefix cache.
    again = engine.generate([GenerationRequest(p, NUM_TOKENS, GREEDY, 4) for p in (first, second)])
    assert [result.cached_tokens > 0 for result in again] == [True, True]
    assert [result.token_ids for result in again] == [expected[first], expected[second]]


SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("name", sorted(SERVED))
def test_a_json_schema_answer_validates_and_speculation_does_not_change_it(name, tiny_tokenizer):
    target, draft = pair(name)
    engine = make_engine(target, draft, tiny_tokenizer)
    prompt = tuple(tiny_tokenizer(PROMPTS[0])["input_ids"])
    constraint = Constraint.json_schema(SCHEMA)
    plain, speculative = (
        engine.generate([GenerationRequest(prompt, 32, GREEDY, k, constraint=constraint)])[0] for k in (0, 4)
    )
    assert plain.finish_reason == "eos", plain
    jsonschema.validate(json.loads(plain.text), SCHEMA)
    assert speculative.token_ids == plain.token_ids


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_families_whose_caches_cannot_be_cropped_are_refused_naming_their_cache_layers(name):
    config_class, fields = REFUSED[name]
    with pytest.raises(ValueError, match=r"uses cache layers \[.*(Mamba|LinearAttention).*cannot be rolled back"):
        check_cache_support(build(config_class, fields, 2, 0))
