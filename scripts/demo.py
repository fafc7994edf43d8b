#!/usr/bin/env python3
"""End-to-end demo: speculative decoding of Qwen2.5-Coder-1.5B-Instruct with a 0.5B draft, on TorchServe.

Run by `make demo` (after `make install-demo`). Each step is skipped when its
result is already there, so running it again is cheap:

1. fetch and convert the two models into models/ (scripts.model_tools.fetch_demo_models);
2. package them with the handler into model_store/qwen-coder-spec/, an
   unpacked archive (--archive-format no-archive: TorchServe loads the
   folder in place, with no copy or unzip of ~4 GB at each registration);
3. start TorchServe on 127.0.0.1 with token authorization on, as `make serve`
   does, after stopping the server an earlier run of this demo started;
4. register the model through the management API and wait for it to load;
5. send four requests to the native route: three open-ended ones (greedy,
   sampled with a seed, a streamed chat) and an input-grounded code edit,
   whose answer copies much of its prompt, and print the four speeds side by
   side; then one streamed chat through the official `openai` client, on the
   OpenAI-compatible route (scripts.serving.openai_demo).

The server is left running; the end of the output says how to query and
stop it. TorchServe's logs are in logs/.

Usage:
    python -m scripts.demo [--restart] [--max-new-tokens N] [--ts-config FILE]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import psutil
import requests

from scripts.model_tools import package_mar
from scripts.serving import openai_demo, torchserve

REPO_ROOT = Path(__file__).resolve().parent.parent

MODEL_NAME = "qwen-coder-spec"
DRAFT_DIR = Path("models/qwen2.5-coder-0.5b-instruct")
TARGET_DIR = Path("models/qwen2.5-coder-1.5b-instruct")
MODEL_CONFIG = Path("model-config/qwen-coder.yaml")
DEFAULT_TS_CONFIG = Path("model-config/config.properties")
MODEL_STORE = Path("model_store")
LOG_DIR = Path(os.environ.get("LOG_LOCATION", "logs"))
KEY_FILE = torchserve.DEFAULT_KEY_FILE  # TorchServe writes it in its working directory, the repository root
STATE_FILE = LOG_DIR / "demo-server.json"  # the pid of the server this demo started
FINGERPRINT_FILE = ".demo-fingerprint"  # inside the packaged folder
TS_PID_FILE = Path(tempfile.gettempdir()) / ".model_server.pid"  # where `torchserve` keeps its pid
TS_MAIN_CLASS = "org.pytorch.serve.ModelServer"
DEFAULT_GRPC_PORTS = {"grpc_inference_port": 7070, "grpc_management_port": 7071}
START_TIMEOUT_S = 120

GREEDY_REQUEST = {
    "prompt": 'def is_prime(n: int) -> bool:\n    """Return True if n is a prime number."""\n',
    "temperature": 0.0,
}
SAMPLED_REQUEST = {
    "prompt": "# Iterative Fibonacci in Python, with a docstring\ndef fibonacci(n):\n",
    "temperature": 0.7,
    "seed": 42,
}
CHAT_REQUEST = {
    "messages": [
        {"role": "system", "content": "You are a concise coding assistant."},
        {"role": "user", "content": "Write a Python function that checks whether a string is a palindrome."},
    ],
    "stream": True,
}
# Input-grounded: the answer repeats the function, which prompt look-up (drafter ngram or hybrid) drafts for free.
GROUNDED_REQUEST = {
    "messages": [
        {
            "role": "user",
            "content": """Add type hints to this function. Return the whole function.

```python
def moving_average(values, window, skip_missing=True):
    if window <= 0:
        raise ValueError("window must be positive")
    averages = []
    total = 0.0
    count = 0
    queue = []
    for value in values:
        if value is None and skip_missing:
            continue
        queue.append(value)
        total += value
        count += 1
        if count > window:
            total -= queue.pop(0)
            count -= 1
        averages.append(total / count)
    return averages
```""",
        }
    ],
    "temperature": 0.0,
}
# (title, kind, body): the speeds are printed side by side at the end.
EXAMPLES = (
    ("greedy completion", "open-ended", GREEDY_REQUEST),
    ("sampled completion, temperature 0.7, seed 42", "open-ended", SAMPLED_REQUEST),
    ("chat messages, streamed", "open-ended", CHAT_REQUEST),
    ("add type hints to a function", "input-grounded", GROUNDED_REQUEST),
)


class DemoError(Exception):
    """A step failed; the message says what to look at."""


def step(number: int, text: str) -> None:
    print(f"\n==> [{number}/5] {text}", flush=True)


# ---------------------------------------------------------------------------
# 1. Models


def fetch_models() -> None:
    result = subprocess.run([sys.executable, "-m", "scripts.model_tools.fetch_demo_models", "--models-dir", "models"])
    if result.returncode != 0:
        raise DemoError("scripts.model_tools.fetch_demo_models failed (see its messages above)")


# ---------------------------------------------------------------------------
# 2. Package


def package_fingerprint() -> str:
    """Changes when the handler, the packaging script, the model config or a model file changes."""
    digest = hashlib.sha256()
    sources = sorted(Path("handler").rglob("*.py")) + [Path("scripts/model_tools/package_mar.py"), MODEL_CONFIG]
    for path in sources:
        digest.update(str(path).encode() + b"\0" + path.read_bytes())
    for model_dir in (TARGET_DIR, DRAFT_DIR):
        # Size and mtime stand in for the content: hashing 4 GB on every run would take a minute.
        for path in sorted(p for p in model_dir.rglob("*") if p.is_file()):
            stat = path.stat()
            digest.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    return digest.hexdigest()


def package_if_needed(fingerprint: str) -> bool:
    """Package the archive folder unless it is up to date; returns whether it packaged."""
    archive = MODEL_STORE / MODEL_NAME
    stamp = archive / FINGERPRINT_FILE
    if (archive / "MAR-INF" / "MANIFEST.json").is_file() and stamp.is_file() and stamp.read_text() == fingerprint:
        print(f"{archive}/ is up to date, nothing to do")
        return False
    print(f"packaging {TARGET_DIR} + {DRAFT_DIR} + {MODEL_CONFIG} into {archive}/ (copies ~4 GB) ...", flush=True)
    started = time.monotonic()
    try:
        package_mar.package(
            MODEL_NAME, TARGET_DIR, DRAFT_DIR, MODEL_CONFIG, MODEL_STORE, archive_format="no-archive", force=True
        )
    except package_mar.PackagingError as error:
        raise DemoError(f"packaging failed: {error}") from None
    stamp.write_text(fingerprint)
    print(f"packaged in {time.monotonic() - started:.0f} s")
    return True


# ---------------------------------------------------------------------------
# 3. Server


def server_ports(properties: dict[str, str]) -> dict[str, tuple[str, int]]:
    """(host, port) of every listener the server will open, by property name."""
    ports = {}
    for key, default in (
        ("inference_address", "http://127.0.0.1:8080"),
        ("management_address", "http://127.0.0.1:8081"),
        ("metrics_address", "http://127.0.0.1:8082"),
    ):
        url = urlparse(properties.get(key, default))
        ports[key] = (url.hostname or "127.0.0.1", url.port or 80)
    for key, default in DEFAULT_GRPC_PORTS.items():
        # TorchServe 0.12 always opens its gRPC listeners, and shuts down
        # silently when one of these ports is taken.
        ports[key] = ("127.0.0.1", int(properties.get(key, default)))
    return ports


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def torchserve_process(pid: int) -> psutil.Process | None:
    """The TorchServe frontend with this pid, or None if it is gone."""
    try:
        process = psutil.Process(pid)
        return process if TS_MAIN_CLASS in process.cmdline() else None
    except psutil.Error:
        return None


def previous_demo_server() -> psutil.Process | None:
    """The server an earlier run of this demo started, if it is still running."""
    try:
        pid = json.loads(STATE_FILE.read_text())["pid"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return torchserve_process(pid)


def stop_previous_server(process: psutil.Process) -> None:
    """Stop the server an earlier demo run started, and make sure its processes are gone."""
    print(f"stopping the TorchServe an earlier demo run started (pid {process.pid}) ...", flush=True)
    try:
        children = process.children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    torchserve.stop_server()
    _, alive = psutil.wait_procs([process, *children], timeout=10)
    for leftover in alive:
        leftover.kill()
    KEY_FILE.unlink(missing_ok=True)
    STATE_FILE.unlink(missing_ok=True)


def check_no_other_server(ts_config: Path) -> None:
    if TS_PID_FILE.is_file():
        try:
            other = torchserve_process(int(TS_PID_FILE.read_text().strip()))
        except ValueError:
            other = None
        if other is not None:
            try:
                where = f", started from {other.cwd()}"
            except psutil.Error:
                where = ""
            raise DemoError(
                f"another TorchServe is running (pid {other.pid}{where}); "
                "stop it with `make stop` in that folder, then run the demo again"
            )
    taken = [
        f"{key} {host}:{port}"
        for key, (host, port) in server_ports(torchserve.read_properties(ts_config)).items()
        if not port_is_free(host, port)
    ]
    if taken:
        raise DemoError(
            f"port(s) already in use: {', '.join(taken)}. Stop what listens there, or pass --ts-config "
            "with a copy of model-config/config.properties that sets other ports "
            "(grpc_inference_port and grpc_management_port for the gRPC ones)"
        )


def start_server(ts_config: Path, inference_url: str) -> None:
    """`make serve`: TorchServe in the background with token authorization on; waits for /ping."""
    console = LOG_DIR / "torchserve_console.log"
    print(f"starting TorchServe ({ts_config}, console output in {console}) ...", flush=True)
    server = torchserve.start_server(ts_config, MODEL_STORE, console)
    try:
        torchserve.wait_for_ping(inference_url, KEY_FILE, START_TIMEOUT_S, server)
        frontend = torchserve_process(int(TS_PID_FILE.read_text().strip()))
    except (torchserve.ClientError, OSError, ValueError) as error:
        torchserve.stop_server(server)
        raise DemoError(f"TorchServe did not start: {error}\n{torchserve.log_tail(LOG_DIR / 'ts_log.log')}") from None
    if frontend is None:
        torchserve.stop_server(server)
        raise DemoError(f"TorchServe did not start\n{server.console_tail()}")
    STATE_FILE.write_text(json.dumps({"pid": frontend.pid, "ts_config": str(ts_config)}) + "\n")
    print(f"TorchServe is up (pid {frontend.pid}); keys in {KEY_FILE}")


# ---------------------------------------------------------------------------
# 4. Register


def model_is_ready(management_url: str, headers: dict) -> bool:
    try:
        workers = torchserve.model_workers(management_url, MODEL_NAME, headers)
    except (torchserve.ClientError, requests.RequestException, ValueError, LookupError, TypeError, AttributeError):
        return False
    return any(worker.get("status") == "READY" for worker in workers)


def register(management_url: str, headers: dict, timeout_s: float) -> None:
    """Register the packaged folder synchronously, printing dots while the worker loads the models."""
    print(
        f"registering {MODEL_STORE}/{MODEL_NAME}/ as {MODEL_NAME}; loading ~4 GB on a CPU takes a "
        f"few minutes (progress in {LOG_DIR}/model_log.log)",
        flush=True,
    )
    result: dict = {}

    def call() -> None:
        try:
            # The no-archive folder model_store/MODEL_NAME/ is registered by its name.
            result["message"] = torchserve.register(management_url, MODEL_NAME, MODEL_NAME, headers, timeout_s)
        except torchserve.ClientError as error:
            result["error"] = error

    thread = threading.Thread(target=call, daemon=True)
    started = time.monotonic()
    thread.start()
    num_dots = 0
    while thread.is_alive():
        thread.join(timeout=5)
        if thread.is_alive():
            num_dots += 1
            print(".", end="", flush=True)
            if num_dots % 12 == 0:  # a minute
                print(f" {time.monotonic() - started:.0f} s", flush=True)
    print()
    if "error" in result:
        raise DemoError(f"registration failed ({result['error']})\n{torchserve.log_tail(LOG_DIR / 'model_log.log')}")
    print(f"registered in {time.monotonic() - started:.0f} s: {result['message']}")


# ---------------------------------------------------------------------------
# 5. Requests


def run_requests(inference_url: str, max_new_tokens: int) -> None:
    headers = torchserve.auth_headers(KEY_FILE)
    speeds = []
    for title, kind, body in EXAMPLES:
        body = dict(body, max_new_tokens=max_new_tokens)
        shown = body.get("prompt") or body["messages"][-1]["content"]
        print(f"\n--- {title} ---\n>>> {shown.rstrip()}\n", flush=True)

        def print_delta(delta: str) -> None:
            sys.stdout.write(delta)
            sys.stdout.flush()

        try:
            answer = torchserve.generate(
                inference_url,
                MODEL_NAME,
                body,
                headers,
                KEY_FILE,
                on_delta=print_delta if body.get("stream") else None,
            )
        except torchserve.ClientError as error:
            raise DemoError(f"{title}: {error}\n{torchserve.log_tail(LOG_DIR / 'model_log.log')}") from None
        except requests.RequestException as error:
            raise DemoError(f"{title}: {torchserve.connection_message(inference_url, error)}") from None
        if not body.get("stream"):
            print(body.get("prompt", "") + answer.text)
        print(f"\n[{torchserve.format_stats(answer)}]", flush=True)
        speeds.append((title, kind, answer))
    print_speeds(speeds)


def print_speeds(speeds: list[tuple[str, str, torchserve.Answer]]) -> None:
    """The requests' tokens/s side by side, and the input-grounded ones against the open-ended mean."""
    open_ended = [answer.tokens_per_s for _, kind, answer in speeds if kind == "open-ended"]
    baseline = sum(open_ended) / len(open_ended) if open_ended else 0.0
    print("\n--- speed ---")
    for title, kind, answer in speeds:
        speculative = answer.final.get("speculative") or {}
        line = (
            f"  {title + ' (' + kind + ')':<62} {answer.tokens_per_s:5.1f} tokens/s, "
            f"{speculative.get('mean_accepted_length', 0):.2f} tokens/target pass, "
            f"drafter {speculative.get('drafter', '?')}"
        )
        if kind != "open-ended" and baseline > 0:
            line += f" ({answer.tokens_per_s / baseline:.2f}x the open-ended mean)"
        print(line)
    print(f"  open-ended mean {baseline:.1f} tokens/s", flush=True)


def print_next_steps(inference_url: str) -> None:
    read_key = """$(python3 -c 'import json; print(json.load(open("key_file.json"))["inference"]["key"])')"""
    print(f"""
TorchServe is still running, with {MODEL_NAME} registered. From this folder:

  curl -s {inference_url}/predictions/{MODEL_NAME} \\
    -H "Authorization: Bearer {read_key}" \\
    -H 'Content-Type: application/json' \\
    -d '{{"prompt": "def quicksort(xs):", "max_new_tokens": 64}}'

  .venv/bin/python -m scripts.serving.client --url {inference_url} --stream "Merge two sorted lists in Python."

  .venv/bin/python -m scripts.serving.openai_demo --url {inference_url}

  .venv/bin/python -m scripts.serving.loadtest --url {inference_url} --requests 8 --concurrency 4

The keys in key_file.json expire 60 minutes after the server started
(token_expiration_min in config.properties); after that, requests with them get
HTTP 400. scripts.serving.client says how to get fresh ones, or run make demo again
(it restarts this server). Logs are in {LOG_DIR}/.
Stop the server with: make stop""")


# ---------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--restart", action="store_true", help="restart the server even when the one from an earlier run is up to date"
    )
    parser.add_argument("--max-new-tokens", type=int, default=96, help="per demo request (default 96)")
    parser.add_argument("--register-timeout", type=float, default=1200, help="seconds to wait for the models to load")
    parser.add_argument(
        "--ts-config",
        type=Path,
        default=DEFAULT_TS_CONFIG,
        help="TorchServe config (default model-config/config.properties)",
    )
    args = parser.parse_args(argv)
    os.chdir(REPO_ROOT)
    inference_url, management_url = torchserve.server_urls(args.ts_config)

    try:
        step(1, "Fetching the demo models (Qwen2.5-Coder 0.5B draft, 1.5B target)")
        fetch_models()

        step(2, f"Packaging {MODEL_STORE}/{MODEL_NAME}/")
        fingerprint = package_fingerprint()
        previous = previous_demo_server()
        archive_is_current = (MODEL_STORE / MODEL_NAME / FINGERPRINT_FILE).is_file() and (
            (MODEL_STORE / MODEL_NAME / FINGERPRINT_FILE).read_text() == fingerprint
        )
        if previous is not None and not archive_is_current:
            stop_previous_server(previous)  # it may be serving the folder about to be replaced
            previous = None
        package_if_needed(fingerprint)

        step(3, "Starting TorchServe (token authorization on)")
        reuse = False
        if previous is not None and not args.restart:
            management_headers = torchserve.auth_headers(KEY_FILE, "management")
            reuse = model_is_ready(management_url, management_headers)
            if reuse:
                print(
                    f"the server from an earlier run (pid {previous.pid}) serves the current archive; "
                    "reusing it (--restart to start afresh)"
                )
        if not reuse:
            if previous is not None:
                stop_previous_server(previous)
            check_no_other_server(args.ts_config)
            start_server(args.ts_config, inference_url)

        step(4, f"Registering {MODEL_NAME}")
        management_headers = torchserve.auth_headers(KEY_FILE, "management")
        if reuse:
            print(f"{MODEL_NAME} is already registered and READY")
        else:
            register(management_url, management_headers, args.register_timeout)

        step(5, "Sending four requests (three open-ended, one input-grounded), then five through the openai client")
        run_requests(inference_url, args.max_new_tokens)
        print("\n--- chat through the openai client (OpenAI-compatible API) ---", flush=True)
        openai_demo.run(inference_url, MODEL_NAME, torchserve.read_key(KEY_FILE), args.max_new_tokens)
        print("\n--- a tool call and a JSON-schema answer through the openai client ---", flush=True)
        openai_demo.run_structured(inference_url, MODEL_NAME, torchserve.read_key(KEY_FILE))
        print("\n--- the Responses API, continued with previous_response_id ---", flush=True)
        openai_demo.run_responses(inference_url, MODEL_NAME, torchserve.read_key(KEY_FILE))
    except (DemoError, torchserve.ClientError) as error:
        print(f"\ndemo failed: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted; a server this demo started keeps running (make stop)", file=sys.stderr)
        return 130
    print_next_steps(inference_url)
    return 0


if __name__ == "__main__":
    sys.exit(main())
