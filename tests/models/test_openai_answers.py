"""OpenAI logprobs through the handler equal a direct forward of the target (float32, tiny models).

The reference is the target's log-softmax of its raw logits at each emitted
position, from one plain forward over prompt + completion: what plain target
decoding reports, whatever temperature, top-k and top-p the request sampled with.
"""

from __future__ import annotations

import json

import pytest
import torch

from handler.api.openai.answers import TokenTexts
from handler.api.openai.requests import choice_seed

from .test_openai_routes import CHAT, COMPLETIONS, call, native_answer, sse_events

ATOL = 1e-4  # float32; batched and cached versus one plain forward
MESSAGES = [{"role": "user", "content": "Tell me a story."}]


@pytest.fixture(scope="module")
def handler(tiny_models_dir):
    from handler.spec_handler import SpeculativeHandler

    from .test_openai_routes import make_context

    handler = SpeculativeHandler()
    handler.initialize(make_context(tiny_models_dir, []))
    return handler


@pytest.fixture(scope="module")
def target(tiny_models_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_models_dir / "target", dtype=torch.float32).eval()


def reference_logprobs(target, prompt_ids: list[int], token_ids: list[int]) -> torch.Tensor:  # [completion, vocab]
    ids = torch.tensor([prompt_ids + token_ids])  # [1, prompt + completion]
    with torch.no_grad():
        logits = target(ids).logits[0, len(prompt_ids) - 1 : -1]  # [completion, vocab]
    return torch.log_softmax(logits.float(), dim=-1)


def prompt_ids_of(handler, body: dict) -> list[int]:
    from handler.api.native import parse_request

    parsed = parse_request(body, handler.config, handler.models.tokenizer, handler.models.max_context)
    return list(parsed.generation.prompt_ids)


SAMPLED = {"temperature": 0.8, "top_k": 20, "top_p": 0.9, "seed": 13}


@pytest.mark.parametrize("sampling", [{"temperature": 0}, SAMPLED], ids=["greedy", "sampled"])
def test_completion_logprobs_equal_a_direct_forward(handler, target, tiny_models_dir, sampling):
    prompt = "def fibonacci(n):"
    body = {"prompt": prompt, "max_tokens": 16, "logprobs": 3, "n": 2, **sampling}
    (answer,), statuses, _ = call(handler, tiny_models_dir, [(COMPLETIONS, body)])
    assert statuses == [200], answer
    prompt_ids = prompt_ids_of(handler, {"prompt": prompt})
    texts = TokenTexts(handler.models.tokenizer)  # id -> text, as tests/unit check it
    for choice in answer["choices"]:
        seed = choice_seed(sampling.get("seed"), choice["index"])
        native = {"prompt": prompt, "max_new_tokens": 16, **sampling, "seed": seed}
        if seed is None:
            del native["seed"]
        token_ids = native_answer(handler, tiny_models_dir, native)["token_ids"]
        reference = reference_logprobs(target, prompt_ids, token_ids)
        logprobs = choice["logprobs"]
        assert logprobs["tokens"] == [texts(t) for t in token_ids]
        expected = reference.gather(-1, torch.tensor(token_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(logprobs["token_logprobs"]), expected, atol=ATOL)
        for position, top in enumerate(logprobs["top_logprobs"]):
            # The top 3 and the emitted token, by text.
            candidates = reference[position].topk(3).indices.tolist() + [token_ids[position]]
            assert max(top.values()) == pytest.approx(reference[position].max().item(), abs=ATOL)
            for text, value in top.items():
                assert any(
                    texts(i) == text and abs(reference[position, i].item() - value) < ATOL for i in candidates
                ), (position, text, value)


def test_chat_logprobs_streamed_or_not_equal_a_direct_forward(handler, target, tiny_models_dir, monkeypatch):
    import handler.spec_handler as spec_handler_module

    body = {"messages": MESSAGES, "max_tokens": 12, "logprobs": True, "top_logprobs": 2, **SAMPLED}
    (answer,), _, _ = call(handler, tiny_models_dir, [(CHAT, body)])
    (content,) = [choice["logprobs"]["content"] for choice in answer["choices"]]
    token_ids = native_answer(handler, tiny_models_dir, {"messages": MESSAGES, "max_new_tokens": 12, **SAMPLED})[
        "token_ids"
    ]
    reference = reference_logprobs(target, prompt_ids_of(handler, {"messages": MESSAGES}), token_ids)
    texts = TokenTexts(handler.models.tokenizer)
    assert len(content) == len(token_ids) == answer["usage"]["completion_tokens"]
    for position, (entry, token_id) in enumerate(zip(content, token_ids)):
        assert entry["token"] == texts(token_id)
        assert entry["logprob"] == pytest.approx(reference[position, token_id].item(), abs=ATOL)
        top = reference[position].topk(2)
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(top.values.tolist(), abs=ATOL)
        assert [t["token"] for t in entry["top_logprobs"]] == [texts(i) for i in top.indices.tolist()]

    sent = []
    monkeypatch.setattr(
        spec_handler_module, "send_intermediate_predict_response", lambda ret, *args: sent.extend(ret.values())
    )
    (final,), _, _ = call(handler, tiny_models_dir, [(CHAT, {**body, "stream": True})])
    chunks = [json.loads(event) for event in sse_events("".join(sent) + final)[:-1]]
    streamed = sum(((c["choices"][0]["logprobs"] or {}).get("content", []) for c in chunks), [])
    assert [e["token"] for e in streamed] == [e["token"] for e in content]
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in content], abs=ATOL)
