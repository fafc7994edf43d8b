#!/usr/bin/env python3
"""Register (or unregister) a model archive with a running TorchServe.

Waits for the server to answer /ping, reads the management key from the
key_file.json TorchServe writes in its working directory (token
authorization), and registers MODEL_NAME.mar from the model store with one
worker. The call is synchronous: it returns once the worker has loaded the
models, or fails with the server's own error message.

Usage:
    python scripts/register.py --model-name tiny-spec
    python scripts/register.py --model-name tiny-spec --unregister
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import requests

PING_INTERVAL_S = 1.0


class RegistrationError(Exception):
    """A failure to report to the user; the message says what happened."""


def read_keys(key_file: Path) -> dict[str, str] | None:
    """{"management": key, "inference": key}, or None without a readable key file.

    The server writes the file while it starts, so a half-written file reads
    as "not there yet".
    """
    try:
        keys = json.loads(key_file.read_text())
        return {kind: keys[kind]["key"] for kind in ("management", "inference")}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def auth_header(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def wait_for_server(inference_url: str, key_file: Path, wait_s: float) -> dict[str, str] | None:
    """Poll GET /ping until it answers 200; returns the keys used (None: no auth).

    With token authorization on, /ping itself needs the inference key, and the
    key file appears while the server starts, so it is re-read on every try.
    """
    deadline = time.monotonic() + wait_s
    last_problem = "no answer"
    while time.monotonic() < deadline:
        keys = read_keys(key_file)
        try:
            response = requests.get(
                f"{inference_url}/ping",
                headers=auth_header(keys and keys["inference"]),
                timeout=5,
            )
            if response.ok:
                return keys
            last_problem = f"HTTP {response.status_code}: {server_message(response)}"
        except requests.RequestException as error:
            last_problem = str(error)
        time.sleep(PING_INTERVAL_S)
    hint = (
        "Is it running, from this folder? Start it with `make serve`; "
        "its log is logs/ts_log.log."
    )
    if "Token Authorization failed" in last_problem:
        hint = (
            f"The keys in {key_file} do not match the server's: it was started from "
            "another folder, or the key file is stale or expired. Restart with "
            "`make stop serve`, or pass --key-file."
        )
    raise RegistrationError(
        f"TorchServe did not answer {inference_url}/ping within {wait_s:.0f} s "
        f"({last_problem}). {hint}"
    )


def server_message(response: requests.Response) -> str:
    """The message (error or status) TorchServe put in its JSON answer."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip() or response.reason
    if isinstance(body, dict):
        return str(body.get("message") or body.get("status") or body.get("error") or body)
    return str(body)


def call(method: str, url: str, headers: dict, timeout_s: float, what: str) -> requests.Response:
    try:
        response = requests.request(method, url, headers=headers, timeout=timeout_s)
    except requests.Timeout as error:
        raise RegistrationError(
            f"{what}: no answer within {timeout_s:.0f} s. The server may still be "
            "loading the models; see logs/model_log.log, or raise --timeout."
        ) from error
    except requests.RequestException as error:
        raise RegistrationError(f"{what}: cannot reach {url}: {error}") from error
    if not response.ok:
        hint = ""
        if response.status_code >= 500:
            hint = " (the worker's traceback is in logs/model_log.log)"
        raise RegistrationError(
            f"{what}: HTTP {response.status_code}: {server_message(response)}{hint}"
        )
    return response


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-name", required=True)
    parser.add_argument(
        "--url", help="archive to register, relative to the model store (default: MODEL_NAME.mar)"
    )
    parser.add_argument("--unregister", action="store_true", help="unregister instead")
    parser.add_argument("--management-url", default="http://127.0.0.1:8081")
    parser.add_argument("--inference-url", default="http://127.0.0.1:8080")
    parser.add_argument("--key-file", type=Path, default=Path("key_file.json"))
    parser.add_argument("--initial-workers", type=int, default=1)
    parser.add_argument(
        "--timeout", type=float, default=900, help="seconds to wait for the models to load"
    )
    parser.add_argument(
        "--wait", type=float, default=60, help="seconds to wait for the server to start"
    )
    args = parser.parse_args(argv)
    management_url = args.management_url.rstrip("/")
    inference_url = args.inference_url.rstrip("/")

    try:
        keys = wait_for_server(inference_url, args.key_file, args.wait)
        if keys is None:
            print(f"note: no {args.key_file}; calling without a token (token auth is off)")
        headers = auth_header(keys and keys["management"])

        if args.unregister:
            call(
                "DELETE",
                f"{management_url}/models/{args.model_name}",
                headers,
                args.timeout,
                f"unregistering {args.model_name}",
            )
            print(f"unregistered {args.model_name}")
            return 0

        url = args.url or f"{args.model_name}.mar"
        query = (
            f"url={requests.utils.quote(url, safe='')}&model_name={args.model_name}"
            f"&initial_workers={args.initial_workers}&synchronous=true"
        )
        print(f"registering {url} as {args.model_name} (waits for the models to load) ...")
        response = call(
            "POST",
            f"{management_url}/models?{query}",
            headers,
            args.timeout,
            f"registering {url}",
        )
        print(server_message(response))
    except RegistrationError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1

    auth = f' -H "Authorization: Bearer {keys["inference"]}"' if keys else ""
    print("try:")
    print(
        f"  curl -s {inference_url}/predictions/{args.model_name}{auth} "
        """-H 'Content-Type: application/json' -d '{"prompt": "Hello", "max_new_tokens": 32}'"""
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
