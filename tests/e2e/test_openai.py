"""End-to-end: the OpenAI-compatible routes through a real TorchServe, with the official `openai` client.

The client's base URL is `{inference}/predictions/{model}/{version}/v1`:
TorchServe 0.12 hands the handler what follows the version in `url_path`.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests

from handler.api.openai.requests import choice_seed

from .conftest import HTTP_TIMEOUT_S, counter

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story."}]


def complete(client, server, **fields):
    return client.completions.create(model=server.model_name, **fields)


def chat(client, server, **fields):
    return client.chat.completions.create(model=server.model_name, **fields)


def streamed_text(chunks, index: int = 0) -> str:
    parts = []
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.index == index:
                parts.append(choice.delta.content if hasattr(choice, "delta") else choice.text)
    return "".join(part or "" for part in parts)


def test_models_list_and_retrieve(client, server, base_url):
    listing = client.models.list()
    assert [model.id for model in listing.data] == [server.model_name]
    assert client.models.retrieve(server.model_name).id == server.model_name
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    # What TorchServe's frontend does with other spellings of the same route.
    for method, path in (("POST", "/models"), ("GET", "/models/"), ("GET", "/models?limit=1"), ("GET", "//models")):
        response = requests.request(method, base_url + path, timeout=HTTP_TIMEOUT_S)
        assert response.status_code == 200, (method, path, response.text)
        assert response.json()["data"][0]["id"] == server.model_name


def test_the_version_is_part_of_the_base_url(server):
    # Without it, TorchServe reads "v1" as the model version.
    response = requests.get(f"{server.inference_url}/predictions/{server.model_name}/v1/models", timeout=HTTP_TIMEOUT_S)
    assert response.status_code == 404 and "v1" in response.text


def test_greedy_completion_equals_the_native_answer(client, server):
    prompt = "def fibonacci(n):"
    native = server.predict_ok({"prompt": prompt, "max_new_tokens": 12, "temperature": 0})
    answer = complete(client, server, prompt=prompt, max_tokens=12, temperature=0)
    assert answer.object == "text_completion" and answer.model == server.model_name
    assert answer.id.startswith("cmpl-") and answer.created > 0
    assert answer.choices[0].text == native["text"]
    assert (
        answer.choices[0].finish_reason == {"eos": "stop", "stop": "stop", "length": "length"}[native["finish_reason"]]
    )
    assert answer.usage.prompt_tokens == native["usage"]["prompt_tokens"]
    assert answer.usage.completion_tokens == native["usage"]["completion_tokens"]
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens
    # The same stats, but not the same counts: the planner learns across requests (the draft's
    # calibration, the cost table corrected by the passes it times on this machine), so two identical
    # requests may draft differently. Only the text may not differ.
    speculative = answer.model_extra["speculative"]
    assert speculative.keys() == native["speculative"].keys()
    for name in ("num_speculative_tokens", "drafter", "fell_back_to_target_only"):
        assert speculative[name] == native["speculative"][name], name
    assert 0 <= speculative["accepted_tokens"] <= speculative["draft_tokens"]
    assert 1 <= speculative["target_forward_passes"] <= answer.usage.completion_tokens


def test_greedy_chat_equals_the_native_answer(client, server):
    native = server.predict_ok({"messages": CHAT, "max_new_tokens": 10})
    answer = chat(client, server, messages=CHAT, max_completion_tokens=10, temperature=0)
    assert answer.object == "chat.completion" and answer.id.startswith("chatcmpl-")
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].message.content == native["text"]
    assert answer.usage.prompt_tokens == native["usage"]["prompt_tokens"]
    assert answer.usage.completion_tokens == native["usage"]["completion_tokens"]


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_streamed_text_equals_the_plain_text(client, server, route):
    fields = {"max_tokens": 20, "temperature": 0.8, "seed": 9, "n": 2}
    if route == "chat":
        create, prompt = client.chat.completions.create, {"messages": CHAT}
    else:
        create, prompt = client.completions.create, {"prompt": "The weather today is"}
    plain = create(model=server.model_name, **prompt, **fields)
    chunks = list(
        create(model=server.model_name, **prompt, **fields, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump(exclude={"prompt_tokens_details"}) == (
        plain.usage.model_dump(exclude={"prompt_tokens_details"})
    )
    # The plain request finished first: all the prompt it prefills (all but the last token) was cached.
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == plain.usage.prompt_tokens - 1
    assert all(chunk.usage is None for chunk in chunks[:-1])
    assert len(chunks) > 3, "chunks while the rows run, not one block at the end"
    for choice in plain.choices:
        text = choice.message.content if route == "chat" else choice.text
        assert streamed_text(chunks, choice.index) == text
        finishing = [c for c in chunks[:-1] if c.choices[0].index == choice.index and c.choices[0].finish_reason]
        assert [c.choices[0].finish_reason for c in finishing] == [choice.finish_reason]
        assert finishing[0].model_extra["speculative"]["num_speculative_tokens"] == 4


@pytest.mark.parametrize("max_tokens", [1, 8], ids=["ends-in-its-first-call", "several-calls"])
def test_raw_stream_is_server_sent_events_ending_in_done(server, base_url, max_tokens):
    response = requests.post(
        f"{base_url}/completions",
        json={"prompt": "Hello!", "max_tokens": max_tokens, "stream": True},
        stream=True,
        timeout=HTTP_TIMEOUT_S,
    )
    assert response.status_code == 200
    assert response.headers["Content-Type"].startswith("text/event-stream")
    assert response.headers.get("Transfer-Encoding", "").lower() == "chunked"
    body = response.content.decode()
    blocks = [block for block in body.split("\n\n") if block]
    assert all(block.startswith("data: ") for block in blocks)
    assert blocks[-1] == "data: [DONE]" and body.endswith("\n\n")
    assert [json.loads(b[6:])["choices"][0]["finish_reason"] for b in blocks[:-1]][-1] in ("stop", "length")


def test_seeds_repeat_and_n_choices_have_their_own(client, server):
    fields = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 1.0, "seed": 21}
    once = complete(client, server, **fields)
    again = complete(client, server, **fields)
    native = server.predict_ok({"prompt": fields["prompt"], "max_new_tokens": 12, "temperature": 1.0, "seed": 21})
    assert once.choices[0].text == again.choices[0].text == native["text"]

    three = complete(client, server, **fields, n=3)
    assert [choice.index for choice in three.choices] == [0, 1, 2]
    assert three.choices[0].text == once.choices[0].text, "choice 0 keeps the request's seed"
    assert len({choice.text for choice in three.choices}) > 1, "the other choices draw their own samples"
    assert [c.text for c in complete(client, server, **fields, n=3).choices] == [c.text for c in three.choices]
    assert three.usage.prompt_tokens == once.usage.prompt_tokens
    assert three.usage.completion_tokens == sum(
        len(
            server.predict_ok({"prompt": fields["prompt"], "max_new_tokens": 12, "temperature": 1.0, "seed": seed})[
                "token_ids"
            ]
        )
        for seed in [choice_seed(21, choice) for choice in range(3)]
    )


def test_a_list_of_prompts_answers_prompt_major(client, server):
    prompts = ["def add(a, b):", "Hello!"]
    answer = complete(client, server, prompt=prompts, max_tokens=6, temperature=0, n=2)
    assert [choice.index for choice in answer.choices] == [0, 1, 2, 3]
    for index, prompt in enumerate(prompts):
        alone = server.predict_ok({"prompt": prompt, "max_new_tokens": 6})["text"]
        assert [c.text for c in answer.choices[2 * index : 2 * index + 2]] == [alone, alone]


def test_stop_strings_cut_the_answer_streamed_or_not(client, server):
    full = complete(client, server, prompt="def fibonacci(n):", max_tokens=30, temperature=0).choices[0].text
    stop = full[8:11]
    answer = complete(client, server, prompt="def fibonacci(n):", max_tokens=30, temperature=0, stop=stop)
    assert answer.choices[0].text == full[: full.index(stop)] and answer.choices[0].finish_reason == "stop"
    chunks = list(
        complete(client, server, prompt="def fibonacci(n):", max_tokens=30, temperature=0, stop=[stop], stream=True)
    )
    assert streamed_text(chunks) == answer.choices[0].text


BAD = [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"logit_bias": {"1": 101}}, "logit_bias"),
    ({"n": 9}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"seed": -3}, "seed"),
    ({"stop": [""]}, "stop"),
    ({"logprobs": 99}, "logprobs"),
    ({"extra_body": {"no_such_field": 1}}, "no_such_field"),
    ({"extra_body": {"num_speculative_tokens": 99}}, "num_speculative_tokens"),
]


@pytest.mark.parametrize("fields, param", BAD, ids=[b[1] for b in BAD])
def test_bad_fields_raise_bad_request_naming_them(client, server, fields, param):
    with pytest.raises(openai.BadRequestError) as info:
        complete(client, server, prompt="Hello", **{"max_tokens": 4, **fields})
    assert info.value.status_code == 400
    assert info.value.body["param"] == param and info.value.body["type"] == "invalid_request_error"
    assert info.value.body["message"].startswith(param)


def test_chat_errors_and_neutral_values(client, server):
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, server, messages=CHAT, tools=[{"type": "function", "function": {"name": "no spaces"}}])
    assert info.value.body["param"] == "tools[0].function.name"
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        chat(client, server, messages=CHAT, top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match="messages"):
        chat(client, server, messages=[])
    # Standard fields at their neutral values pass.
    answer = chat(
        client,
        server,
        messages=CHAT,
        max_tokens=3,
        presence_penalty=0,
        frequency_penalty=0,
        logit_bias={},
        response_format={"type": "text"},
        user="test",
    )
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_other_errors_have_their_status(client, server, base_url):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4o", prompt="Hello")
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        complete(client, server, prompt="word " * 2000, max_tokens=8)
    assert info.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model=server.model_name, input="Hello")
    # A streamed request refused up front is a plain JSON 400, not a stream.
    with pytest.raises(openai.BadRequestError):
        complete(client, server, prompt="Hello", stream=True, presence_penalty=3)
    response = requests.post(
        f"{base_url}/completions", data=b"{broken", timeout=HTTP_TIMEOUT_S, headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 400
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_a_disconnected_stream_frees_all_its_choices_rows(client, server, base_url):
    aborted_before = counter(server, "SpecAbortedRequests")
    # Three greedy choices of a long answer: the tiny pair reaches the length limit without an EOS.
    body = {"prompt": "import json", "max_tokens": 400, "n": 3, "stream": True, "temperature": 0}
    response = requests.post(f"{base_url}/completions", json=body, stream=True, timeout=HTTP_TIMEOUT_S)
    assert response.status_code == 200, response.text
    assert response.headers["Content-Type"].startswith("text/event-stream")
    first = next(line for line in response.iter_lines() if line.strip())
    assert json.loads(first[len(b"data: ") :])["choices"][0]["text"] is not None
    response.close()  # the client goes away mid-stream

    # The handler notices at its next call, which the next request starts.
    assert complete(client, server, prompt="Hello!", max_tokens=4).choices[0].text is not None
    deadline = time.monotonic() + HTTP_TIMEOUT_S
    while counter(server, "SpecAbortedRequests") == aborted_before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert counter(server, "SpecAbortedRequests") == aborted_before + 1, server.log_tail()
    assert "its 3 rows are freed" in server.log_tail(), "every choice's row is aborted"
    # No row is left: the occupancy gauge, sent when it changes, reads an idle batch once TorchServe
    # has parsed the worker's last metric lines.
    while counter(server, "SpecBatchOccupancy") != 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert counter(server, "SpecBatchOccupancy") == 0


def test_openai_and_native_requests_share_batches(client, server):
    prompts = ["The quick brown fox", "import json\n", "Hello!", "def add(a, b):"]
    alone = [server.predict_ok({"prompt": p, "max_new_tokens": 10})["text"] for p in prompts]

    def send(index: int) -> str:
        if index % 2:
            return server.predict_ok({"prompt": prompts[index], "max_new_tokens": 10})["text"]
        return complete(client, server, prompt=prompts[index], max_tokens=10, temperature=0).choices[0].text

    with ThreadPoolExecutor(len(prompts)) as pool:
        assert list(pool.map(send, range(len(prompts)))) == alone


def test_the_demo_request_goes_through_the_openai_client(server):
    import io

    from scripts.serving import openai_demo, torchserve

    out = io.StringIO()
    text = openai_demo.run(server.inference_url, server.model_name, None, max_tokens=8, out=out)
    native = server.predict_ok({"messages": openai_demo.MESSAGES, "max_new_tokens": 8})
    assert text == native["text"]
    assert "completion tokens" in out.getvalue() and "acceptance" in out.getvalue()
    with pytest.raises(torchserve.ClientError, match="HTTP 404"):
        openai_demo.run(server.inference_url, "no-such-model", None, max_tokens=8, out=io.StringIO())


def test_logprobs_equal_a_direct_forward_of_the_target(client, server, tiny_models_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = AutoModelForCausalLM.from_pretrained(tiny_models_dir / "target", dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_models_dir / "target")
    sampling = {"temperature": 0.7, "top_p": 0.9, "seed": 5}

    def reference(prompt_ids: list[int], token_ids: list[int]) -> torch.Tensor:  # [completion, vocab]
        with torch.no_grad():
            logits = target(torch.tensor([prompt_ids + token_ids])).logits[0, len(prompt_ids) - 1 : -1]
        return torch.log_softmax(logits.float(), dim=-1)

    prompt = "def fibonacci(n):"
    native = server.predict_ok({"prompt": prompt, "max_new_tokens": 12, **sampling})
    answer = complete(client, server, prompt=prompt, max_tokens=12, logprobs=2, **sampling)
    expected = reference(tokenizer(prompt)["input_ids"], native["token_ids"])
    logprobs = answer.choices[0].logprobs
    assert len(logprobs.token_logprobs) == answer.usage.completion_tokens == len(native["token_ids"])
    chosen = expected.gather(-1, torch.tensor(native["token_ids"])[:, None])[:, 0]
    assert logprobs.token_logprobs == pytest.approx(chosen.tolist(), abs=1e-4)
    assert [max(top.values()) for top in logprobs.top_logprobs] == pytest.approx(
        expected.max(dim=-1).values.tolist(), abs=1e-4
    )

    native = server.predict_ok({"messages": CHAT, "max_new_tokens": 10, **sampling})
    answer = chat(client, server, messages=CHAT, max_tokens=10, logprobs=True, top_logprobs=3, **sampling)
    rendered = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    expected = reference(tokenizer(rendered, add_special_tokens=False)["input_ids"], native["token_ids"])
    content = answer.choices[0].logprobs.content
    assert [entry.logprob for entry in content] == pytest.approx(
        expected.gather(-1, torch.tensor(native["token_ids"])[:, None])[:, 0].tolist(), abs=1e-4
    )
    for entry, row in zip(content, expected):
        assert [top.logprob for top in entry.top_logprobs] == pytest.approx(row.topk(3).values.tolist(), abs=1e-4)
    chunks = list(
        chat(client, server, messages=CHAT, max_tokens=10, logprobs=True, top_logprobs=3, stream=True, **sampling)
    )
    streamed = [entry for chunk in chunks if chunk.choices[0].logprobs for entry in chunk.choices[0].logprobs.content]
    assert [entry.token for entry in streamed] == [entry.token for entry in content]


def test_a_second_chat_turn_reuses_the_first_and_the_metrics_count_it(client, server):
    hits_before = counter(server, "prefix_cache_hits")
    messages = [
        {"role": "system", "content": "You review Python code and answer in one sentence."},
        {"role": "user", "content": "What does `sorted(values)[len(values) // 2]` return for an odd length?"},
    ]
    first = chat(client, server, messages=messages, max_tokens=8, temperature=0)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And for an even length?"},
    ]
    second = chat(client, server, messages=messages, max_tokens=8, temperature=0)
    # The first turn's prompt comes from the cache (but perhaps its last token, which the answer's
    # first token can merge with when the turn is rendered again); the new question cannot.
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < first.usage.prompt_tokens - 1 <= cached < second.usage.prompt_tokens, (first.usage, second.usage)
    # The worker's metrics reach the endpoint through its log: give the frontend a moment.
    deadline = time.monotonic() + HTTP_TIMEOUT_S
    while counter(server, "prefix_cache_hits") < hits_before + cached and time.monotonic() < deadline:
        time.sleep(0.2)
    assert counter(server, "prefix_cache_hits") >= hits_before + cached, server.log_tail()
    assert counter(server, "prefix_cache_queries") >= counter(server, "prefix_cache_hits")
    assert counter(server, "SpecPrefixCacheBytes") > 0
