"""The engine on a CUDA GPU, eager (dynamic runner) and with CUDA graphs (static runner).

fp32 greedy output equals the target's own, alone and batched, and under the
confidence stop by mask; penalised rows drafting through the device chains keep
plain decoding's tokens; seeded requests do not depend on the batch; sampled
tokens follow the target's distribution (chi-square, with the check shown to
catch a broken coupling); a bf16 run completes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from handler.config import SamplingParams
from handler.engine import GenerationRequest
from tests.models.conftest import make_engine
from tests.statistical.test_engine import SETTINGS, p_values, sample_two_tokens
from tests.statistical.test_sampler import BUG_P_VALUE, PASS_P_VALUE

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (make test-gpu)")

PROMPTS = ["def fibonacci(n):", "The quick brown fox", "x", "import torch\nclass Model(torch.nn.Module):"]
GREEDY = SamplingParams()
RUNNERS = ["dynamic", "static"]


def encode(tokenizer, prompt: str) -> tuple[int, ...]:
    return tuple(tokenizer(prompt)["input_ids"])


def reference_greedy(target, prompt_ids, max_new_tokens: int) -> list[int]:
    input_ids = torch.tensor([prompt_ids], device=target.device)
    output = target.generate(
        input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens, do_sample=False
    )
    return output[0, len(prompt_ids) :].tolist()


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_output_equals_the_targets_on_cuda(cuda_pair, runner, k):
    target, draft, tokenizer = cuda_pair
    engine = make_engine(target, draft, tokenizer, runner=runner)
    for prompt in PROMPTS:
        prompt_ids = encode(tokenizer, prompt)
        result = engine.generate([GenerationRequest(prompt_ids, 40, GREEDY, k)])[0]
        assert result.token_ids == reference_greedy(target, prompt_ids, 40), prompt
    if runner == "static":
        assert engine.target_runner.num_captures > 0 and engine.model_drafter.runner.num_captures > 0


def test_the_static_runner_captures_again_after_its_buffers_grow_under_live_outputs(cuda_pair):
    # One row steps (graphs captured for batch 1), is aborted, then 16 rows join: the buffers grow and
    # the graphs are dropped while the last step's outputs, allocated in their pool, are still held.
    target, draft, tokenizer = cuda_pair
    engine = make_engine(target, draft, tokenizer, runner="static")
    prompt_ids = encode(tokenizer, PROMPTS[0])
    engine.add_request("one", GenerationRequest(prompt_ids, 40, GREEDY, 4))
    held = [engine.step() for _ in range(3)]
    engine.abort_request("one")
    engine.step()
    for row in range(16):
        engine.add_request(row, GenerationRequest(prompt_ids, 12, GREEDY, 4))
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.result is not None:
                outputs[output.request_id] = output.result.token_ids
    assert held and len(outputs) == 16
    assert all(tokens == reference_greedy(target, prompt_ids, 12) for tokens in outputs.values())


@pytest.mark.parametrize("runner", RUNNERS)
def test_batched_greedy_equals_solo_on_cuda(cuda_pair, runner):
    target, draft, tokenizer = cuda_pair
    engine = make_engine(target, draft, tokenizer, runner=runner)
    requests = [GenerationRequest(encode(tokenizer, p), 10 + 7 * i, GREEDY, 1 + i) for i, p in enumerate(PROMPTS)]
    solo = [engine.generate([request])[0].token_ids for request in requests]
    batched = [result.token_ids for result in engine.generate(requests)]
    assert batched == solo


@pytest.mark.parametrize("runner", RUNNERS)
def test_a_seeded_request_does_not_depend_on_its_batch_on_cuda(cuda_pair, runner):
    target, draft, tokenizer = cuda_pair
    engine = make_engine(target, draft, tokenizer, runner=runner)
    sampled = SamplingParams(temperature=0.9, top_k=0, top_p=1.0)
    seeded = GenerationRequest(encode(tokenizer, PROMPTS[0]), 30, sampled, 4, seed=1234)
    alone = engine.generate([seeded])[0].token_ids
    others = [GenerationRequest(encode(tokenizer, p), 25, sampled, 2) for p in PROMPTS[1:]]
    assert engine.generate([*others, seeded])[-1].token_ids == alone
    assert engine.generate([seeded])[0].token_ids == alone


@pytest.mark.parametrize("runner", RUNNERS)
def test_the_confidence_stop_goes_by_mask_on_cuda_and_keeps_greedy_and_seeded_output(cuda_pair, runner):
    """On CUDA the draft's chains run their k passes and are read once, the stop rule asked afterwards
    (`ModelDrafter.stop_by_mask`, the default there): greedy output is the target's, and a seeded
    request does not depend on its batch, as with the loop."""
    from tests.models.test_engine import CONFIDENT_COSTS

    target, draft, tokenizer = cuda_pair
    requests = [GenerationRequest(encode(tokenizer, p), 40, GREEDY, 8) for p in PROMPTS]
    sampled = SamplingParams(temperature=0.9, top_k=0, top_p=1.0)
    seeded = GenerationRequest(encode(tokenizer, PROMPTS[1]), 24, sampled, 6, seed=3)
    for stop_by_mask in (True, False):
        engine = make_engine(target, draft, tokenizer, runner=runner, cost_table=CONFIDENT_COSTS, draft_confidence=True)
        assert engine.model_drafter.stop_by_mask
        engine.model_drafter.stop_by_mask = stop_by_mask
        for _ in range(2):  # the second round after the calibration has seen the first
            results = engine.generate(requests)
            assert [r.token_ids for r in results] == [reference_greedy(target, r.prompt_ids, 40) for r in requests]
        alone = engine.generate([seeded])[0].token_ids
        assert engine.generate([*requests[:2], seeded])[-1].token_ids == alone


@pytest.mark.parametrize("seeded", [False, True], ids=["rejection_sampling", "coupled"])
def test_sampled_tokens_follow_the_target_with_cuda_graphs(
    cpu_pair, cuda_pair, seeded, reproducible_unseeded, graph_sized_batches
):
    target, draft, tokenizer = cuda_pair
    engine = make_engine(target, draft, tokenizer, eos_token_ids=(), runner="static")
    sampling = SETTINGS[0]
    tokens = sample_two_tokens((target, tokenizer, engine), sampling, seeded)
    assert min(p_values((cpu_pair[0], tokenizer, None), sampling, tokens)) > PASS_P_VALUE


def test_the_cuda_check_catches_a_coupling_that_reuses_one_uniform(
    cpu_pair, cuda_pair, monkeypatch, graph_sized_batches
):
    import handler.engine.verify as engine_module
    from handler.sampler import position_uniforms

    monkeypatch.setattr(
        engine_module, "position_uniforms", lambda seed, first, num: position_uniforms(seed, 0, 1).repeat(num)
    )
    target, draft, tokenizer = cuda_pair
    engine = make_engine(target, draft, tokenizer, eos_token_ids=(), runner="static")
    sampling = SETTINGS[0]
    tokens = sample_two_tokens((target, tokenizer, engine), sampling, seeded=True)
    assert min(p_values((cpu_pair[0], tokenizer, None), sampling, tokens)) < BUG_P_VALUE


def test_bfloat16_with_cuda_graphs_runs(tiny_models_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_models_dir / "target")
    target = AutoModelForCausalLM.from_pretrained(tiny_models_dir / "target", dtype=torch.bfloat16).eval().cuda()
    engine = make_engine(target, target, tokenizer, eos_token_ids=(), runner="static")
    requests = [GenerationRequest(encode(tokenizer, p), 32, GREEDY, 4) for p in PROMPTS]
    results = engine.generate(requests)
    assert [len(result.token_ids) for result in results] == [32] * len(PROMPTS)
    vocab = target.config.vocab_size
    assert all(0 <= token < vocab for result in results for token in result.token_ids)
    # Draft and target are one model: nearly every draft is accepted (bf16 may flip a near-tie
    # between a width-1 and a wide pass).
    accepted = sum(result.stats.accepted_tokens for result in results)
    drafted = sum(result.stats.draft_tokens for result in results)
    assert accepted >= 0.9 * drafted > 0


@pytest.mark.parametrize("runner", RUNNERS)
def test_a_draft_from_another_family_keeps_greedy_and_seeded_output_on_cuda(tmp_path_factory, runner):
    from tests.models.conftest import cross_vocab_pair

    target, draft, tokenizer, vocab_map = cross_vocab_pair(tmp_path_factory.mktemp("cross-vocab"), "cuda")
    sampled = SamplingParams(temperature=0.9)
    plain = make_engine(target, None, tokenizer, runner=runner)
    for greedy in ("slem", "tli"):
        engine = make_engine(target, draft, tokenizer, runner=runner, vocab_map=vocab_map, cross_vocab_greedy=greedy)
        requests = [GenerationRequest(encode(tokenizer, prompt), 24, GREEDY, 4) for prompt in PROMPTS]
        results = engine.generate(requests)
        for prompt, request, result in zip(PROMPTS, requests, results):
            alone = plain.generate([dataclasses.replace(request, num_speculative_tokens=0)])[0]
            assert result.token_ids == alone.token_ids, (greedy, prompt)
        assert sum(result.stats.draft_tokens for result in results) > 0
        seeded = GenerationRequest(encode(tokenizer, PROMPTS[0]), 24, sampled, 4, seed=5)
        expected = plain.generate([dataclasses.replace(seeded, num_speculative_tokens=0)])[0].token_ids
        assert engine.generate([seeded])[0].token_ids == expected, greedy


@pytest.mark.parametrize("runner", RUNNERS)
def test_overlapped_plain_steps_on_cuda_keep_the_targets_tokens(cuda_pair, runner):
    """On CUDA plain steps overlap by default (each launched from the last one's tokens on the device,
    read from pinned memory after an event): greedy rows give the target's tokens, seeded sampled rows the
    same tokens as with the overlap off."""
    from handler.engine import EngineOptions

    target, draft, tokenizer = cuda_pair
    engine = make_engine(target, draft, tokenizer, runner=runner)
    assert engine.overlap_plain_steps
    prompts = [encode(tokenizer, prompt) for prompt in PROMPTS]
    results = engine.generate([GenerationRequest(p, 24, GREEDY, 0) for p in prompts])
    assert [r.token_ids for r in results] == [reference_greedy(target, p, 24) for p in prompts]
    assert engine.num_overlapped_steps > 0
    sampled = [GenerationRequest(p, 24, SamplingParams(temperature=0.9), 0, seed=7) for p in prompts]
    off = make_engine(
        target, draft, tokenizer, runner=runner, options=EngineOptions(running_costs=False, overlap_plain_steps=False)
    )
    assert [r.token_ids for r in engine.generate(sampled)] == [r.token_ids for r in off.generate(sampled)]


@pytest.mark.parametrize("runner", RUNNERS)
def test_penalised_rows_on_cuda_keep_plain_decodings_tokens(cuda_pair, runner):
    """Penalised rows draft through the device chains (`ChainPenalties`, drafts left on the device) and are
    verified in one batched call: greedy rows give plain decoding's tokens with the same penalties, beside an
    unpenalised row; seeded sampled rows the same tokens as with the drafts read at once."""
    target, draft, tokenizer = cuda_pair
    penalties = dict(presence_penalty=0.8, frequency_penalty=0.5, repetition_penalty=1.3, logit_bias=((30, 2.0),))
    prompts = [encode(tokenizer, prompt) for prompt in PROMPTS]
    greedy = [GenerationRequest(p, 24, SamplingParams(**penalties), 4) for p in prompts[:3]]
    greedy.append(GenerationRequest(prompts[3], 24, GREEDY, 4))
    engine = make_engine(target, draft, tokenizer, runner=runner, eos_token_ids=())
    assert engine.model_drafter.drafts_on_device
    plain = [dataclasses.replace(request, num_speculative_tokens=0) for request in greedy]
    expected = [r.token_ids for r in engine.generate(plain)]
    assert [r.token_ids for r in engine.generate(greedy)] == expected
    sampled = [GenerationRequest(p, 24, SamplingParams(temperature=0.9, **penalties), 4, seed=3) for p in prompts]
    read_at_once = make_engine(target, draft, tokenizer, runner=runner, eos_token_ids=())
    read_at_once.model_drafter.drafts_on_device = False
    assert [r.token_ids for r in engine.generate(sampled)] == [r.token_ids for r in read_at_once.generate(sampled)]
