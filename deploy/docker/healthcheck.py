#!/usr/bin/env python3
"""Health check of the TorchServe container, for Docker and Kubernetes.

Exits 0 when healthy and 1 otherwise, and prints one line saying why: Docker
shows it in `docker inspect`, Kubernetes in the pod's events.

Two levels:

alive (default)
    GET /ping on the inference API answers 200. TorchServe 0.12 answers 200
    while the models are still loading, and 500 only once a worker has been
    failing for longer than the model's maxRetryTimeoutInSec. So this means
    "the server runs", not "the models are loaded".
--ready
    Also, every model in MODEL_NAMES has at least minWorkers (and at least one)
    workers in state READY, as the management API describes them, and the
    container is not draining (no file at DRAIN_MARKER). This is what decides
    whether a replica should get traffic.

One action:

--drain
    Creates the drain marker, so that --ready fails from now on while the
    server keeps serving what reaches it. The Kubernetes preStop hook runs it,
    and entrypoint.sh does the same on SIGTERM; the entrypoint removes the
    marker when the container starts.

With token authorization on, TorchServe writes its keys to key_file.json in its
working directory; the check sends the inference key to /ping and the
management key to /models. With it off there is no key file and no header.
Uses the standard library only.
"""

import argparse
import datetime
import json
import os
import re
import sys
import urllib.error
import urllib.request

DEFAULT_KEY_FILE = "/home/model-server/key_file.json"
DEFAULT_MODEL_NAMES = "qwen-coder-spec"
# entrypoint.sh has the same default.
DEFAULT_DRAIN_MARKER = "/tmp/torchserve-draining"


class Unhealthy(Exception):
    """The reason why the server is not healthy."""


def read_keys(key_file):
    """Returns {"inference": (key, expiry), "management": (key, expiry)}, or {} without a key file."""
    try:
        with open(key_file, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise Unhealthy(f"cannot read key file {key_file}: {e}") from e
    keys = {}
    for kind in ("inference", "management"):
        entry = data.get(kind) or {}
        if "key" in entry:
            keys[kind] = (entry["key"], entry.get("expiration time"))
    return keys


def expired(expiry):
    """True when TorchServe's ISO-8601 expiry time (nanoseconds, 'Z') is in the past."""
    if not expiry:
        return False
    # Python before 3.11 reads neither 'Z' nor more than 6 fractional digits.
    text = re.sub(r"(\.\d{6})\d+", r"\1", expiry.replace("Z", "+00:00"))
    try:
        when = datetime.datetime.fromisoformat(text)
    except ValueError:
        return False
    return when < datetime.datetime.now(datetime.UTC)


def get_json(url, key, timeout):
    """GET url with an optional bearer key; returns (status, parsed body or None)."""
    request = urllib.request.Request(url)
    if key is not None:
        request.add_header("Authorization", f"Bearer {key[0]}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status, body = response.status, response.read()
    except urllib.error.HTTPError as e:
        status, body = e.code, e.read()
    except (urllib.error.URLError, OSError) as e:
        raise Unhealthy(f"{url} unreachable: {getattr(e, 'reason', e)}") from e
    try:
        return status, json.loads(body)
    except ValueError:
        return status, None


def rejected_key(status, body, key, kind):
    """The reason to report when TorchServe answered 400 InvalidKeyException."""
    if status == 400 and isinstance(body, dict) and body.get("type") == "InvalidKeyException":
        if key is None:
            return f"token authorization is on but there is no {kind} key in the key file"
        if expired(key[1]):
            return f"the {kind} key expired at {key[1]}; renew it with the API key: GET :8081/token?type={kind}"
        return f"the {kind} key was rejected"
    return None


def check_alive(ping_url, keys, timeout):
    key = keys.get("inference")
    status, body = get_json(ping_url, key, timeout)
    if status != 200:
        reason = rejected_key(status, body, key, "inference")
        raise Unhealthy(f"{ping_url} answered {status}: {reason or body}")


def check_ready(management_url, model_names, keys, timeout):
    key = keys.get("management")
    for name in model_names:
        url = f"{management_url}/models/{name}"
        status, body = get_json(url, key, timeout)
        if status != 200 or not isinstance(body, list) or not body:
            reason = rejected_key(status, body, key, "management")
            raise Unhealthy(f"{url} answered {status}: {reason or body}")
        # The describe API lists the model's default version first.
        model = body[0]
        num_ready = sum(w.get("status") == "READY" for w in model.get("workers", []))
        num_wanted = max(int(model.get("minWorkers", 1)), 1)
        if num_ready < num_wanted:
            raise Unhealthy(f"model {name}: {num_ready} of {num_wanted} workers READY")


def check_not_draining(drain_marker):
    # Before any HTTP call: a draining container answers at once, and opens no
    # connection that the entrypoint would count as a request in flight.
    if os.path.exists(drain_marker):
        raise Unhealthy(f"draining: the container is stopping ({drain_marker} exists)")


def mark_draining(drain_marker):
    try:
        with open(drain_marker, "a", encoding="utf-8"):
            pass
    except OSError as e:
        raise Unhealthy(f"cannot create the drain marker {drain_marker}: {e}") from e


def parse_model_names(text):
    return [name for name in re.split(r"[\s,]+", text) if name]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--ready", action="store_true", help="also require the models' workers READY, not draining")
    action.add_argument("--drain", action="store_true", help="mark the container as draining (preStop), then exit")
    parser.add_argument("--ping-url", default="http://127.0.0.1:8080/ping")
    parser.add_argument("--management-url", default="http://127.0.0.1:8081")
    parser.add_argument("--key-file", default=DEFAULT_KEY_FILE)
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds per HTTP call")
    args = parser.parse_args(argv)
    model_names = parse_model_names(os.environ.get("MODEL_NAMES", DEFAULT_MODEL_NAMES))
    drain_marker = os.environ.get("DRAIN_MARKER") or DEFAULT_DRAIN_MARKER
    try:
        if args.drain:
            mark_draining(drain_marker)
            print(f"draining: {drain_marker} created; --ready fails from now on")
            return 0
        if args.ready:
            check_not_draining(drain_marker)
        keys = read_keys(args.key_file)
        check_alive(args.ping_url, keys, args.timeout)
        if args.ready:
            check_ready(args.management_url.rstrip("/"), model_names, keys, args.timeout)
    except Unhealthy as e:
        print(f"unhealthy: {e}")
        return 1
    print("ready" if args.ready else "alive")
    return 0


if __name__ == "__main__":
    sys.exit(main())
