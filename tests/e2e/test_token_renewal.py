"""End-to-end: renewing a key through TorchServe 0.12's token API, as the docs say to.

The frontend answers `/token?type=...` on the management port with the API key, whatever the
HTTP method: it checks the path only (`TokenAuthorizationHandler`). The docs show GET, as
TorchServe's own do; POST is tested too, since older instructions used it. A TorchServe with
token auth on and no model, on its own free ports; stopped in teardown.
"""

from __future__ import annotations

import json

import pytest
import requests

from scripts.serving import torchserve

from .conftest import HTTP_TIMEOUT_S, STARTUP_TIMEOUT_S, free_ports, write_server_config


@pytest.fixture(scope="module")
def keyed_server(java_runtime, tmp_path_factory):
    """(inference URL, management URL, key file) of a TorchServe with token auth on."""
    root = tmp_path_factory.mktemp("torchserve-keys")
    (root / "model_store").mkdir()
    ports = free_ports(5)
    write_server_config(root / "config.properties", root / "model_store", ports)
    (root / "tmp").mkdir()
    env = torchserve.private_env(root / "logs", root / "tmp")
    started = torchserve.start_server(
        root / "config.properties", root / "model_store", root / "logs" / "console.log", cwd=root, env=env
    )
    key_file = root / torchserve.DEFAULT_KEY_FILE
    try:
        assert torchserve.wait_for_ping(f"http://127.0.0.1:{ports[0]}", key_file, STARTUP_TIMEOUT_S, started)
        yield f"http://127.0.0.1:{ports[0]}", f"http://127.0.0.1:{ports[1]}", key_file
    except torchserve.ClientError as error:
        pytest.fail(f"{error}\n{torchserve.log_tail(root / 'logs' / 'ts_log.log')}")
    finally:
        torchserve.stop_server(started)


def ping(inference_url: str, key: str) -> int:
    return requests.get(f"{inference_url}/ping", headers={"Authorization": f"Bearer {key}"}, timeout=30).status_code


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_the_api_key_renews_the_inference_key(keyed_server, method):
    inference_url, management_url, key_file = keyed_server
    before = json.loads(key_file.read_text())
    old_key, api_key = before["inference"]["key"], before["API"]["key"]
    assert ping(inference_url, old_key) == 200

    response = requests.request(
        method,
        f"{management_url}/token",
        params={"type": "inference"},
        headers={"Authorization": f"Bearer {api_key}"},
        timeout=HTTP_TIMEOUT_S,
    )
    assert response.status_code == 200, response.text

    # The file holds the new key, which works; the old one no longer does; the API key stays.
    after = json.loads(key_file.read_text())
    new_key = after["inference"]["key"]
    assert new_key != old_key and after["API"]["key"] == api_key
    assert ping(inference_url, new_key) == 200
    assert ping(inference_url, old_key) == 400


def test_renewal_needs_the_api_key(keyed_server):
    _, management_url, key_file = keyed_server
    keys = json.loads(key_file.read_text())
    response = requests.get(
        f"{management_url}/token",
        params={"type": "inference"},
        headers={"Authorization": f"Bearer {keys['management']['key']}"},
        timeout=HTTP_TIMEOUT_S,
    )
    assert response.status_code == 400, response.text
    assert json.loads(key_file.read_text())["inference"]["key"] == keys["inference"]["key"]
