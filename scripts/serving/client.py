"""Send one generation request to the speculative-decoding model served by TorchServe.

Prints the generated text, then one line of statistics: tokens per second
(measured here, wall clock), the acceptance rate of the draft tokens and the
mean accepted length (tokens emitted per target forward pass). With --stream
the text is printed as it arrives.

Token authorization: TorchServe writes key_file.json in the folder it was
started from; the inference key in it is sent as `Authorization: Bearer KEY`.

Usage:
    python -m scripts.serving.client "Write a Python function that reverses a string."
    python -m scripts.serving.client --stream --temperature 0.7 --seed 42 "Write quicksort in C."
    python -m scripts.serving.client --messages-json chat.json --stream
    python -m scripts.serving.client --no-auth --model tiny-spec "hello"
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import requests

from scripts.serving.torchserve import (
    DEFAULT_INFERENCE_URL,
    DEFAULT_KEY_FILE,
    DEFAULT_MODEL,
    DEFAULT_TIMEOUT_S,
    ClientError,
    auth_headers,
    connection_message,
    format_stats,
    generate,
)


def load_messages(path: str) -> list:
    """A JSON file with a list of {role, content} objects, or an object with a `messages` list; '-' is stdin."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
        value = json.loads(text)
    except (OSError, ValueError) as error:
        raise ClientError(f"--messages-json {path}: {error}") from None
    if isinstance(value, dict):
        value = value.get("messages")
    if not isinstance(value, list):
        raise ClientError(f"--messages-json {path}: expected a list of {{role, content}} objects")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("prompt", nargs="*", help="the prompt (words are joined with spaces)")
    parser.add_argument(
        "--url", default=DEFAULT_INFERENCE_URL, help=f"inference address (default {DEFAULT_INFERENCE_URL})"
    )
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"registered model name (default {DEFAULT_MODEL})")
    auth = parser.add_mutually_exclusive_group()
    auth.add_argument(
        "--key-file", type=Path, default=DEFAULT_KEY_FILE, help="TorchServe's key file (default ./key_file.json)"
    )
    auth.add_argument("--no-auth", action="store_true", help="send no key (server started with token auth off)")
    parser.add_argument("--messages-json", metavar="FILE", help="chat messages instead of a prompt ('-' = stdin)")
    parser.add_argument("--stream", action="store_true", help="print the text as it is generated")
    parser.add_argument("--max-new-tokens", type=int, help="tokens to generate (server default if unset)")
    parser.add_argument("--temperature", type=float, help="0 = greedy (server default if unset)")
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--seed", type=int, help="makes a sampled request reproducible")
    parser.add_argument("--num-speculative-tokens", type=int, help="k, draft tokens per step")
    parser.add_argument("--stop", action="append", help="stop string (repeatable)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds to wait for bytes")
    parser.add_argument("--json", action="store_true", help="print the whole answer as JSON instead")
    return parser


def build_body(args: argparse.Namespace) -> dict:
    body: dict = {}
    if args.messages_json:
        body["messages"] = load_messages(args.messages_json)
    else:
        body["prompt"] = " ".join(args.prompt)
    options = {
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "seed": args.seed,
        "num_speculative_tokens": args.num_speculative_tokens,
        "stop": args.stop,
    }
    body.update({key: value for key, value in options.items() if value is not None})
    if args.stream:
        body["stream"] = True
    return body


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if bool(args.prompt) == bool(args.messages_json):
        parser.error("give a PROMPT or --messages-json FILE (exactly one)")
    key_file = None if args.no_auth else args.key_file
    try:
        body = build_body(args)
        headers = auth_headers(key_file)
        live = args.stream and not args.json

        def print_delta(delta: str) -> None:
            sys.stdout.write(delta)
            sys.stdout.flush()

        answer = generate(
            args.url, args.model, body, headers, key_file, args.timeout, on_delta=print_delta if live else None
        )
    except ClientError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except requests.RequestException as error:
        print(f"\nerror: {connection_message(args.url, error)}", file=sys.stderr)
        return 1
    except ValueError as error:
        print(f"\nerror: the server sent a malformed stream: {error}", file=sys.stderr)
        return 1

    if args.json:
        final = {key: value for key, value in answer.final.items() if key != "text_delta"}
        print(json.dumps(dict(final, text=answer.text, token_ids=answer.token_ids), indent=2))
    elif live:
        print()
    else:
        print(answer.text)
    print(f"[{format_stats(answer)}]", file=sys.stderr)
    for problem in answer.problems:
        print(f"warning: malformed answer: {problem}", file=sys.stderr)
    return 1 if answer.problems else 0


if __name__ == "__main__":
    sys.exit(main())
