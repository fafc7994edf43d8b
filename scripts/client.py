#!/usr/bin/env python3
"""Send one generation request to the speculative-decoding model served by TorchServe.

Prints the generated text, then one line of statistics: tokens per second
(measured here, wall clock), the acceptance rate of the draft tokens and the
mean accepted length (tokens emitted per target forward pass). With --stream
the text is printed as it arrives.

Token authorization: TorchServe writes key_file.json in the folder it was
started from; the inference key in it is sent as `Authorization: Bearer KEY`.

Usage:
    python scripts/client.py "Write a Python function that reverses a string."
    python scripts/client.py --stream --temperature 0.7 --seed 42 "Write quicksort in C."
    python scripts/client.py --messages-json chat.json --stream
    python scripts/client.py --no-auth --model tiny-spec "hello"

The helpers here (key reading, NDJSON stream parsing, answer validation) are
also used by scripts/loadtest.py and scripts/demo.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator

import requests

DEFAULT_URL = "http://127.0.0.1:8080"
DEFAULT_MODEL = "qwen-coder-spec"
DEFAULT_KEY_FILE = Path("key_file.json")
DEFAULT_TIMEOUT_S = 600.0
FINISH_REASONS = ("length", "eos", "stop")
SPECULATIVE_FIELDS = {
    "num_speculative_tokens": int,
    "draft_tokens": int,
    "accepted_tokens": int,
    "acceptance_rate": (int, float),
    "target_forward_passes": int,
    "mean_accepted_length": (int, float),
    "fell_back_to_target_only": bool,
    "drafter": str,
    "by_drafter": dict,
    "accepted_per_position": list,
}


class ClientError(Exception):
    """A failed request, with a message that tells the user what to do."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


# ---------------------------------------------------------------------------
# Token authorization


def read_key(key_file: Path, kind: str = "inference") -> str | None:
    """The `kind` key ("inference" or "management") from key_file.json, or None if there is no file."""
    if not key_file.is_file():
        return None
    try:
        return json.loads(key_file.read_text(encoding="utf-8"))[kind]["key"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ClientError(f"{key_file.resolve()}: no {kind} key in it ({type(error).__name__}: {error})") from None


def key_expiry(key_file: Path, kind: str = "inference") -> datetime.datetime | None:
    """When the key expires, as TorchServe wrote it in the key file; None if unknown."""
    try:
        stamp = json.loads(key_file.read_text(encoding="utf-8"))[kind]["expiration time"]
        # TorchServe writes nanoseconds ("...:51.760283667Z"); keep what fromisoformat reads.
        stamp = stamp.rstrip("Z")
        if "." in stamp:
            seconds, fraction = stamp.split(".", 1)
            stamp = f"{seconds}.{fraction[:6]}"
        return datetime.datetime.fromisoformat(stamp).replace(tzinfo=datetime.timezone.utc)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def auth_headers(key_file: Path | None) -> dict[str, str]:
    """The Authorization header for `key_file`; none for None (--no-auth) or a missing file."""
    if key_file is None:
        return {}
    key = read_key(key_file)
    return {"Authorization": f"Bearer {key}"} if key else {}


def unauthorized_message(key_file: Path | None, server_said: str) -> str:
    """Why the token was refused and how to fix it, given where the key was (or was not) read from."""
    if key_file is None:
        return (
            f"token refused ({server_said}). The server has token authorization on, but --no-auth sent no key. "
            "Drop --no-auth to read key_file.json, or pass --key-file PATH."
        )
    where = key_file.resolve()
    if not key_file.is_file():
        return (
            f"token refused ({server_said}). No key file at {where}: TorchServe writes key_file.json in the "
            "folder it was started from; run this from that folder or pass --key-file PATH."
        )
    expiry = key_expiry(key_file)
    if expiry is not None and expiry < datetime.datetime.now(datetime.timezone.utc):
        return (
            f"token refused ({server_said}). The inference key in {where} expired at {expiry:%Y-%m-%d %H:%M:%S} UTC "
            "(token_expiration_min in config.properties). Get a new one from the management address:\n"
            '  curl -X POST "http://127.0.0.1:8081/token?type=inference" -H "Authorization: Bearer <API key>"\n'
            f"(the API key is in {where}; TorchServe then rewrites the file) or restart the server."
        )
    return (
        f"token refused ({server_said}). The server refused the inference key from {where}: the file may belong to "
        "another (earlier) TorchServe run. Pass --key-file with the key_file.json of the running server."
    )


# ---------------------------------------------------------------------------
# Responses


def server_message(response: requests.Response) -> str:
    """The text of a response: the handler's `error`, TorchServe's own `message`, or a `status`."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:500] or response.reason or "no message"
    if isinstance(body, dict):
        return str(body.get("error") or body.get("message") or body.get("status") or body)
    return str(body)[:500]


def is_auth_failure(response: requests.Response) -> bool:
    """TorchServe 0.12 refuses a missing or wrong token with HTTP 400 and type InvalidKeyException."""
    if response.status_code == 401:
        return True
    try:
        body = response.json()
    except ValueError:
        return False
    return isinstance(body, dict) and body.get("type") == "InvalidKeyException"


def raise_for_status(response: requests.Response, key_file: Path | None) -> None:
    """Raise ClientError with a helpful message unless the response is a 2xx."""
    status = response.status_code
    if response.ok:
        return
    said = server_message(response).rstrip(".")
    if is_auth_failure(response):
        raise ClientError(unauthorized_message(key_file, said), status)
    if status == 404:
        raise ClientError(
            f"HTTP 404: {said}. Is the model registered? GET /models on the management address "
            "lists the registered ones; pass --model NAME to pick one.",
            status,
        )
    if status < 500:
        raise ClientError(f"HTTP {status}: {said}", status)
    raise ClientError(f"HTTP {status} (server error): {said}. The worker's log is logs/model_log.log.", status)


def iter_ndjson(chunks: Iterable[bytes]) -> Iterator[dict]:
    """Parse newline-delimited JSON from byte chunks whose boundaries need not align with lines.

    Raises:
        ValueError: a line is not a JSON object.
    """
    buffer = b""
    for chunk in chunks:
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if line.strip():
                yield _json_object(line)
    if buffer.strip():
        yield _json_object(buffer)


def _json_object(line: bytes) -> dict:
    value = json.loads(line)
    if not isinstance(value, dict):
        raise ValueError(f"stream line is not a JSON object: {line[:200]!r}")
    return value


def validate_answer(answer: object) -> list[str]:
    """Problems with a non-streamed answer (or a stream's final line); empty when well-formed."""
    if not isinstance(answer, dict):
        return [f"answer is a {type(answer).__name__}, not an object"]
    problems = []
    for key, kind in (("text", str), ("token_ids", list), ("finish_reason", str), ("usage", dict)):
        if not isinstance(answer.get(key), kind):
            problems.append(f"{key}: missing or not a {kind.__name__}")
    if isinstance(answer.get("token_ids"), list) and not all(
        isinstance(t, int) and not isinstance(t, bool) for t in answer["token_ids"]
    ):
        problems.append("token_ids: not all integers")
    if isinstance(answer.get("finish_reason"), str) and answer["finish_reason"] not in FINISH_REASONS:
        problems.append(f"finish_reason: {answer['finish_reason']!r} is not one of {FINISH_REASONS}")
    usage = answer.get("usage")
    if isinstance(usage, dict):
        for key in ("prompt_tokens", "completion_tokens"):
            if not isinstance(usage.get(key), int):
                problems.append(f"usage.{key}: missing or not an integer")
    speculative = answer.get("speculative")
    if not isinstance(speculative, dict):
        problems.append("speculative: missing or not an object")
    else:
        for key, kind in SPECULATIVE_FIELDS.items():
            value = speculative.get(key)
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                problems.append(f"speculative.{key}: missing or wrong type ({value!r})")
    return problems


def validate_stream(lines: list[dict]) -> list[str]:
    """Problems with the parsed lines of a streamed answer; empty when well-formed."""
    if not lines:
        return ["stream: no lines"]
    problems = []
    for index, line in enumerate(lines):
        if not isinstance(line.get("text_delta"), str):
            problems.append(f"stream line {index}: text_delta missing or not a str")
        ids = line.get("token_ids")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            problems.append(f"stream line {index}: token_ids missing or not a list of ints")
        if index < len(lines) - 1 and "finish_reason" in line:
            problems.append(f"stream line {index}: finish_reason before the last line")
    final = lines[-1]
    if "finish_reason" not in final:
        problems.append("stream: the last line has no finish_reason (stream cut short?)")
    else:
        merged = dict(final, text="".join(str(line.get("text_delta", "")) for line in lines))
        merged["token_ids"] = [t for line in lines for t in (line.get("token_ids") or [])]
        problems += [p for p in validate_answer(merged) if not p.startswith(("text:", "token_ids:"))]
    return problems


# ---------------------------------------------------------------------------
# One request


@dataclasses.dataclass
class Answer:
    """A finished request: the (joined) text and token ids, the final fields, client-side timings."""

    text: str
    token_ids: list[int]
    final: dict  # finish_reason, usage, speculative
    elapsed_s: float
    first_chunk_s: float | None = None  # streams only: time to the first line
    num_lines: int = 1
    problems: list[str] = dataclasses.field(default_factory=list)

    @property
    def completion_tokens(self) -> int:
        usage = self.final.get("usage") or {}
        return int(usage.get("completion_tokens", len(self.token_ids)))

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0


def generate(
    url: str,
    model: str,
    body: dict,
    headers: dict[str, str],
    key_file: Path | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    on_delta: Callable[[str], None] | None = None,
    session: requests.Session | None = None,
) -> Answer:
    """POST one request; streams when body["stream"] is true, calling on_delta with each text delta.

    Raises:
        ClientError: a non-2xx answer (message from the server).
        requests.RequestException: no answer (connection refused or reset, timeout, stream cut).
        ValueError: a stream line that is not JSON.
    """
    poster = session or requests
    endpoint = f"{url.rstrip('/')}/predictions/{model}"
    stream = bool(body.get("stream"))
    start = time.perf_counter()
    # (connect, read) timeouts: the read timeout bounds each wait for the next bytes.
    response = poster.post(endpoint, json=body, headers=headers, timeout=(10, timeout_s), stream=stream)
    try:
        raise_for_status(response, key_file)
        if not stream:
            answer = response.json()
            elapsed = time.perf_counter() - start
            return Answer(
                text=answer.get("text", "") if isinstance(answer, dict) else "",
                token_ids=answer.get("token_ids", []) if isinstance(answer, dict) else [],
                final=answer if isinstance(answer, dict) else {},
                elapsed_s=elapsed,
                problems=validate_answer(answer),
            )
        lines: list[dict] = []
        first_chunk_s = None
        for line in iter_ndjson(response.iter_content(chunk_size=None)):
            if first_chunk_s is None:
                first_chunk_s = time.perf_counter() - start
            lines.append(line)
            if on_delta is not None and isinstance(line.get("text_delta"), str):
                on_delta(line["text_delta"])
        elapsed = time.perf_counter() - start
        return Answer(
            text="".join(line.get("text_delta", "") for line in lines if isinstance(line.get("text_delta"), str)),
            token_ids=[t for line in lines for t in (line.get("token_ids") or [])],
            final=lines[-1] if lines else {},
            elapsed_s=elapsed,
            first_chunk_s=first_chunk_s,
            num_lines=len(lines),
            problems=validate_stream(lines),
        )
    finally:
        response.close()


def format_stats(answer: Answer) -> str:
    """One line: tokens/s, finish reason, acceptance rate, mean accepted length, k."""
    final = answer.final
    speculative = final.get("speculative") or {}
    parts = [
        f"{answer.completion_tokens} tokens in {answer.elapsed_s:.2f} s = {answer.tokens_per_s:.1f} tokens/s",
        f"finish_reason {final.get('finish_reason', '?')}",
    ]
    if answer.first_chunk_s is not None:
        parts.append(f"first chunk after {answer.first_chunk_s:.2f} s")
    if speculative:
        parts.append(
            f"acceptance {100 * speculative.get('acceptance_rate', 0):.1f}% "
            f"({speculative.get('accepted_tokens', 0)}/{speculative.get('draft_tokens', 0)} draft tokens)"
        )
        parts.append(f"mean accepted length {speculative.get('mean_accepted_length', 0):.2f} tokens/target pass")
        parts.append(f"k={speculative.get('num_speculative_tokens', '?')}")
        if speculative.get("fell_back_to_target_only"):
            parts.append("fell back to target-only decoding")
    return " | ".join(parts)


def connection_message(url: str, error: requests.RequestException) -> str:
    if isinstance(error, requests.Timeout):
        return f"no answer from {url} in time ({type(error).__name__}); raise --timeout, or see logs/model_log.log"
    if isinstance(error, requests.ConnectionError) and "refused" in str(error).lower():
        return f"cannot connect to {url}: connection refused. Is TorchServe running? Start it with `make serve` (or `make demo`)."
    return f"request to {url} failed: {type(error).__name__}: {error}"


# ---------------------------------------------------------------------------
# CLI


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
    parser.add_argument("--url", default=DEFAULT_URL, help=f"inference address (default {DEFAULT_URL})")
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
