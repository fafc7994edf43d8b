"""Chat through the official OpenAI client, against the served model: a streamed answer, a tool call, JSON.

`run` streams one chat answer; `run_structured` sends one tool call
(`tools` with `tool_choice: "required"`: the output is constrained to a call
whose arguments validate against the function's parameters) and one
`response_format: json_schema` request, and prints what came back;
`run_responses` sends one Responses API call and continues it with
`previous_response_id`.

The OpenAI-compatible routes live under
`{inference_url}/predictions/{model}/{version}/v1`; with token authorization
on, the client's api_key is TorchServe's inference key (sent as
`Authorization: Bearer ...`).

`scripts.demo` calls `run()`; on its own, against a running server:

    python -m scripts.serving.openai_demo [--url http://127.0.0.1:8080] [--model qwen-coder-spec] \\
        [--key-file key_file.json]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import TextIO

from scripts.model_tools import package_mar
from scripts.serving import torchserve

MESSAGES = [
    {"role": "system", "content": "You are a concise coding assistant."},
    {"role": "user", "content": "Write a Python function that reverses the order of the words in a sentence."},
]


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CONTACT_FORMAT = {
    "type": "json_schema",
    "json_schema": {
        "name": "contact",
        "strict": True,
        "schema": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "email": {"type": "string"}, "company": {"type": "string"}},
            "required": ["name", "email", "company"],
            "additionalProperties": False,
        },
    },
}


def base_url(inference_url: str, model_name: str, version: str = package_mar.MODEL_VERSION) -> str:
    """The OpenAI base URL of a model served by TorchServe; the version is part of it."""
    return f"{inference_url.rstrip('/')}/predictions/{model_name}/{version}/v1"


def run(
    inference_url: str,
    model_name: str,
    api_key: str | None,
    max_tokens: int = 96,
    out: TextIO = sys.stdout,
) -> str:
    """Streams one greedy chat answer to `out` through the openai client and returns its text.

    Args:
        inference_url: TorchServe's inference address, e.g. http://127.0.0.1:8080.
        model_name: the registered model.
        api_key: the inference key from key_file.json; None when token auth is off.
        max_tokens: the answer's token budget.
        out: where the question, the answer and its statistics are written.
    Returns:
        The answer's text.
    Raises:
        torchserve.ClientError: the server refused the request or could not be reached.
    """
    client = _client(inference_url, model_name, api_key)
    out.write(f">>> {MESSAGES[-1]['content']}\n\n")
    parts, usage, speculative = [], None, None
    with _client_errors(client):
        stream = client.chat.completions.create(
            model=model_name,
            messages=MESSAGES,
            max_completion_tokens=max_tokens,
            temperature=0,  # the target's own greedy answer; left out, the model's generation config decides
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            for choice in chunk.choices:
                if choice.delta.content:
                    parts.append(choice.delta.content)
                    out.write(choice.delta.content)
                    out.flush()
            speculative = (chunk.model_extra or {}).get("speculative", speculative)
            usage = chunk.usage or usage
    summary = [f"{usage.prompt_tokens} prompt + {usage.completion_tokens} completion tokens"] if usage else []
    if speculative:
        summary.append(f"acceptance {speculative['acceptance_rate']:.0%}")
        summary.append(f"{speculative['mean_accepted_length']:.2f} tokens per target pass")
    out.write(f"\n\n[openai client, {client.base_url}: {', '.join(summary)}]\n")
    return "".join(parts)


def _client(inference_url: str, model_name: str, api_key: str | None):
    import openai

    return openai.OpenAI(
        base_url=base_url(inference_url, model_name),
        api_key=api_key or "no-key",  # the client insists on one; a server without token auth ignores it
        max_retries=0,
        timeout=torchserve.DEFAULT_TIMEOUT_S,
    )


@contextlib.contextmanager
def _client_errors(client):
    """The openai client's errors as torchserve.ClientError, as the other scripts report them."""
    import openai

    try:
        yield
    except openai.APIStatusError as error:
        raise torchserve.ClientError(
            f"{client.base_url}: HTTP {error.status_code}: {error.message}", error.status_code
        ) from None
    except openai.APIError as error:
        raise torchserve.ClientError(f"no answer from {client.base_url}: {error}") from None


def run_structured(inference_url: str, model_name: str, api_key: str | None, out: TextIO = sys.stdout) -> tuple:
    """One tool call and one JSON-schema answer through the openai client; returns (tool_calls, parsed JSON).

    Raises:
        torchserve.ClientError: the server refused a request or could not be reached.
    """
    import json

    client = _client(inference_url, model_name, api_key)
    with _client_errors(client):
        question = "What's the weather in Lisbon right now, in celsius?"
        out.write(f">>> {question}  [tools: get_weather, tool_choice: required, one call]\n")
        # One call: with parallel calls allowed, the demo target (which writes its calls as ```json
        # blocks when free) goes on calling after the first.
        answer = client.chat.completions.create(
            model=model_name,
            messages=[{"role": "user", "content": question}],
            tools=[WEATHER_TOOL],
            tool_choice="required",
            parallel_tool_calls=False,
            max_completion_tokens=96,
        )
        calls = answer.choices[0].message.tool_calls or []
        for call in calls:
            out.write(f"tool call: {call.function.name}({call.function.arguments})\n")
        out.write(f"[finish_reason {answer.choices[0].finish_reason}]\n\n")
        text = "Hi, I'm Maria Gonzalez from Northwind Traders; write to maria.g@northwind.example."
        out.write(f">>> {text}  [response_format: json_schema contact]\n")
        answer = client.chat.completions.create(
            model=model_name,
            messages=[{"role": "system", "content": "Extract the contact as JSON."}, {"role": "user", "content": text}],
            response_format=CONTACT_FORMAT,
            max_completion_tokens=96,
        )
        record = json.loads(answer.choices[0].message.content)
        out.write(f"{json.dumps(record)}\n")
    return calls, record


def run_responses(
    inference_url: str, model_name: str, api_key: str | None, max_tokens: int = 48, out: TextIO = sys.stdout
) -> tuple:
    """One Responses API call, then one that continues it with previous_response_id; returns both responses.

    Raises:
        torchserve.ClientError: the server refused a request or could not be reached.
    """
    client = _client(inference_url, model_name, api_key)
    with _client_errors(client):
        question = "Name one Python web framework."
        out.write(f">>> {question}  [the Responses API, then previous_response_id]\n")
        first = client.responses.create(
            model=model_name, instructions="Answer in one sentence.", input=question, max_output_tokens=max_tokens
        )
        out.write(f"{first.output_text}\n")
        second = client.responses.create(
            model=model_name, input="And one more.", previous_response_id=first.id, max_output_tokens=max_tokens
        )
        usage = second.usage
        out.write(f"{second.output_text}\n")
        out.write(
            f"[{usage.input_tokens_details.cached_tokens} of {usage.input_tokens} input tokens from the prefix cache]\n"
        )
    return first, second


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=torchserve.DEFAULT_INFERENCE_URL, help="TorchServe inference address")
    parser.add_argument("--model", default=torchserve.DEFAULT_MODEL, help="registered model name")
    parser.add_argument(
        "--key-file",
        type=Path,
        default=torchserve.DEFAULT_KEY_FILE,
        help="TorchServe's key file (no key is sent when it does not exist: token auth off)",
    )
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args(argv)
    try:
        key = torchserve.read_key(args.key_file)
        run(args.url, args.model, key, args.max_tokens)
        print()
        run_structured(args.url, args.model, key)
        print()
        run_responses(args.url, args.model, key)
    except torchserve.ClientError as error:
        print(f"openai demo failed: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
