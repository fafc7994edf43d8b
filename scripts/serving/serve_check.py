"""Serves one model folder over a real TorchServe, with no draft model, and checks it as a user would.

    python -m scripts.serving.serve_check --target models/smollm2-135m-instruct --name smollm2

1. packages the folder alone (drafter `ngram`; no draft model: the look-up drafters need none)
   with the repository's model-config.yaml, in float32, and serves it on free local ports;
2. for each prompt, greedy, through the REST API: plain decoding (k = 0), the `ngram` and the
   `suffix` drafters, each against Hugging Face `generate` on the same weights in float32,
   token for token, and their tokens/s (the handler's time, `generate`'s own);
3. through the official `openai` client: a chat, a JSON-schema answer (validated), and a forced
   tool call (in the model's own format, or written into the prompt where its chat template
   renders no tools: `handler.api.openai.tool_formats.JsonFormat`);
4. prints a table and writes it, with the details, to --out (JSON).

Timings are medians over the prompts, on this machine, one request at a time.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import yaml

from scripts.serving import torchserve

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
PROMPTS = [
    "Write a Python function that returns the sum of a list of numbers.",
    "Explain in two sentences what a hash map is.",
    "List three colors of the rainbow.",
    "Rewrite this sentence in the past tense: I walk to the store and buy bread.",
]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def write_model_config(root: pathlib.Path, max_new_tokens: int) -> pathlib.Path:
    model_config = yaml.safe_load((REPO_ROOT / "model-config" / "model-config.yaml").read_text())
    handler = model_config["handler"]
    handler.pop("draft_model", None)
    handler.update(drafter="ngram", dtype="float32", max_new_tokens=max_new_tokens, prompt_lookup_num_tokens=8)
    model_config.update(batchSize=1, continuousBatching=True)
    (root / "model-config.yaml").write_text(yaml.safe_dump(model_config, sort_keys=False))
    return root / "model-config.yaml"


def hf_reference(target: pathlib.Path, prompts: list[str], max_new_tokens: int) -> tuple[list, list, list, bool]:
    """Per prompt: the chat-templated prompt ids (the text's, without a chat template), `generate`'s greedy
    ids, and its seconds; and whether the tokenizer has a chat template."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    prompt_ids, outputs, seconds = [], [], []
    for prompt in prompts:
        if tokenizer.chat_template:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        else:  # a pretrained model without a chat template: the prompt as text, as the handler encodes it
            ids = tokenizer(prompt)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)
        seconds.append(time.perf_counter() - start)
        prompt_ids.append(ids)
        outputs.append(out[0, len(ids) :].tolist())
    return prompt_ids, outputs, seconds, bool(tokenizer.chat_template)


def rest_rows(
    inference_url: str, name: str, prompts: list[str], reference: list, max_new_tokens: int, chat: bool
) -> dict:
    rows = {}
    for label, extra in (("plain (k=0)", {"num_speculative_tokens": 0}), ("ngram", {"drafter": "ngram"}),
                         ("suffix", {"drafter": "suffix"})):  # fmt: skip
        same, rates, stats = 0, [], []
        for prompt, expected in zip(prompts, reference):
            text = {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
            body = {**text, "max_new_tokens": max_new_tokens, "temperature": 0, **extra}
            answer = torchserve.generate(inference_url, name, body, {})
            same += list(answer.token_ids) == expected  # both end with the EOS id, when they stop on it
            rates.append(answer.tokens_per_s)
            stats.append(answer.final.get("speculative", {}))
        rows[label] = {
            "same_as_generate": same,
            "requests": len(prompts),
            "tokens_per_s": statistics.median(rates),
            "acceptance_rate": statistics.median(s.get("acceptance_rate", 0.0) for s in stats),
        }
    return rows


def openai_checks(inference_url: str, name: str, chat: bool) -> dict:
    """A chat, a JSON-schema answer and a forced tool call through the `openai` client; without a chat
    template, a completion, a JSON-schema answer over REST, and the chat route's 400."""
    import jsonschema
    import openai

    client = openai.OpenAI(base_url=f"{inference_url}/predictions/{name}/1.0/v1", api_key="unused", max_retries=0)
    ask = [{"role": "user", "content": "Say hello."}]
    if not chat:
        return no_template_checks(client, inference_url, name, ask)
    checks = {}
    chat = client.chat.completions.create(model=name, messages=ask, max_completion_tokens=24)
    checks["chat"] = {"ok": bool(chat.choices[0].message.content), "content": chat.choices[0].message.content}
    person = [{"role": "user", "content": "Describe a person as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    answer = client.chat.completions.create(model=name, messages=person, response_format=fmt, max_completion_tokens=80)
    try:
        jsonschema.validate(json.loads(answer.choices[0].message.content), PERSON)
        checks["json_schema"] = {"ok": True, "content": answer.choices[0].message.content}
    except (ValueError, jsonschema.ValidationError) as error:
        checks["json_schema"] = {"ok": False, "error": str(error)[:200]}
    try:
        call = client.chat.completions.create(model=name, messages=ask, tools=[WEATHER], tool_choice="required",
                                              max_completion_tokens=80)  # fmt: skip
        calls = call.choices[0].message.tool_calls or []
        checks["tool_call"] = {"ok": bool(calls), "calls": [c.function.model_dump() for c in calls]}
    except openai.BadRequestError as error:
        checks["tool_call"] = {"ok": False, "refused": error.body.get("message") if error.body else str(error)}
    return checks


def no_template_checks(client, inference_url: str, name: str, ask: list) -> dict:
    import jsonschema
    import openai

    checks = {}
    completion = client.completions.create(model=name, prompt="The capital of France is", max_tokens=16)
    checks["completion"] = {"ok": bool(completion.choices[0].text), "content": completion.choices[0].text}
    body = {"prompt": "A person, as JSON:", "json_schema": PERSON, "max_new_tokens": 120, "temperature": 0}
    answer = torchserve.generate(inference_url, name, body, {})
    try:
        jsonschema.validate(json.loads(answer.text), PERSON)
        checks["json_schema (REST)"] = {"ok": True, "content": answer.text}
    except (ValueError, jsonschema.ValidationError) as error:
        checks["json_schema (REST)"] = {"ok": False, "error": str(error)[:200]}
    try:
        client.chat.completions.create(model=name, messages=ask, max_completion_tokens=8)
        checks["chat refused"] = {"ok": False, "error": "the chat route answered without a chat template"}
    except openai.BadRequestError as error:
        message = error.body.get("message") if isinstance(error.body, dict) else str(error)
        checks["chat refused"] = {"ok": "chat template" in str(message), "message": message}
    return checks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, type=pathlib.Path, help="the model folder")
    parser.add_argument("--name", required=True, help="the name to serve it under")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench_results/serve_check.json"))
    args = parser.parse_args(argv)
    prompt_ids, reference, hf_seconds, chat = hf_reference(args.target, PROMPTS, args.max_new_tokens)
    hf_rate = statistics.median(len(out) / s for out, s in zip(reference, hf_seconds))
    root = pathlib.Path(tempfile.mkdtemp(prefix="serve-check-"))
    model_store = root / "model_store"
    model_store.mkdir()
    model_config = write_model_config(root, args.max_new_tokens)
    package = [
        sys.executable, "-m", "scripts.model_tools.package_mar", "--model-name", args.name,
        "--target", str(args.target.resolve()), "--config", str(model_config), "--export-path", str(model_store),
    ]  # fmt: skip
    subprocess.run(package, check=True, cwd=REPO_ROOT)
    with torchserve.private_server(root / "server", model_store, token_auth=False) as server:
        torchserve.register(server.management_url, f"{args.name}.mar", args.name, {})
        rows = rest_rows(server.inference_url, args.name, PROMPTS, reference, args.max_new_tokens, chat)
        checks = openai_checks(server.inference_url, args.name, chat)
    kind = "chat prompts" if chat else "text prompts (no chat template)"
    head = f"{args.target.name}, float32, greedy, {len(PROMPTS)} {kind}, up to {args.max_new_tokens} tokens"
    lines = [
        f"{head}; HF generate: {hf_rate:.1f} tok/s",
        "",
        "| REST row | same tokens as generate | tok/s | x generate | acceptance |",
        "|---|---|---|---|---|",
    ]
    for label, row in rows.items():
        lines.append(f"| {label} | {row['same_as_generate']} of {row['requests']} | {row['tokens_per_s']:.1f} | "
                     f"{row['tokens_per_s'] / hf_rate:.2f}x | {row['acceptance_rate']:.2f} |")  # fmt: skip
    lines += ["", *(f"- openai {name}: {json.dumps(check)[:160]}" for name, check in checks.items())]
    print("\n".join(lines))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows, "openai": checks, "hf_tokens_per_s": hf_rate}, indent=1))
    return 0 if all(row["same_as_generate"] == row["requests"] for row in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
