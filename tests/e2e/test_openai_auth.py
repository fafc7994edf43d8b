"""End-to-end: with token authorization on, the OpenAI client's api_key is TorchServe's inference key.

A second TorchServe, started the way `make serve` starts one (token auth on),
on its own free ports; stopped in teardown.
"""

from __future__ import annotations

import json
import os
import subprocess
import time

import openai
import pytest
import requests

from .conftest import (
    HTTP_TIMEOUT_S,
    MODEL_NAME,
    REGISTER_TIMEOUT_S,
    STARTUP_TIMEOUT_S,
    free_ports,
    stop_server,
    torchserve_executable,
    write_server_config,
)


def read_keys(key_file) -> dict | None:
    try:
        keys = json.loads(key_file.read_text())
        return {"inference": keys["inference"]["key"], "management": keys["management"]["key"]}
    except (OSError, ValueError, KeyError, TypeError):
        return None  # not written yet, or half-written


@pytest.fixture(scope="module")
def auth_server(java_runtime, model_archive, tmp_path_factory):
    """(inference URL, keys) of a TorchServe with token auth on and the tiny model registered."""
    root = tmp_path_factory.mktemp("torchserve-auth")
    (root / "logs").mkdir()
    (root / "tmp").mkdir()
    ports = free_ports(5)
    write_server_config(root / "config.properties", model_archive.parent, ports)
    inference_url, management_url = f"http://127.0.0.1:{ports[0]}", f"http://127.0.0.1:{ports[1]}"
    env = dict(os.environ)
    env.pop("TS_CONFIG_FILE", None)
    env.update(LOG_LOCATION=str(root / "logs"), METRICS_LOCATION=str(root / "logs"),
               TMPDIR=str(root / "tmp"), TEMP=str(root / "tmp"), TMP=str(root / "tmp"))
    console = open(root / "logs" / "console.log", "w")
    process = subprocess.Popen(
        [torchserve_executable(), "--start", "--foreground", "--ncs", "--model-store", str(model_archive.parent),
         "--ts-config", str(root / "config.properties"), "--enable-model-api"],
        cwd=root, env=env, stdout=console, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        deadline, keys = time.monotonic() + STARTUP_TIMEOUT_S, None
        while time.monotonic() < deadline and process.poll() is None:
            keys = read_keys(root / "key_file.json")
            try:
                if keys and requests.get(f"{inference_url}/ping", timeout=5,
                                         headers={"Authorization": f"Bearer {keys['inference']}"}).ok:
                    break
            except requests.RequestException:
                pass
            time.sleep(0.5)
        else:
            pytest.fail(f"the token-auth TorchServe did not start\n{(root / 'logs' / 'console.log').read_text()}")
        response = requests.post(
            f"{management_url}/models",
            params={"url": model_archive.name, "model_name": MODEL_NAME, "initial_workers": 1, "synchronous": "true"},
            headers={"Authorization": f"Bearer {keys['management']}"},
            timeout=REGISTER_TIMEOUT_S,
        )
        assert response.status_code == 200, response.text
        yield inference_url, keys
    finally:
        stop_server(process, env, root, console)
        console.close()


def test_api_key_is_the_inference_key(auth_server):
    inference_url, keys = auth_server
    base_url = f"{inference_url}/predictions/{MODEL_NAME}/1.0/v1"
    client = openai.OpenAI(base_url=base_url, api_key=keys["inference"], timeout=HTTP_TIMEOUT_S, max_retries=0)
    answer = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_completion_tokens=4
    )
    assert answer.usage.completion_tokens >= 1
    assert [model.id for model in client.models.list().data] == [MODEL_NAME]

    # TorchServe's frontend refuses a wrong key before the handler sees the
    # request, with a 400 (not a 401), which the client raises as BadRequestError.
    for wrong_key in ("not-the-key", keys["management"]):
        refused = openai.OpenAI(base_url=base_url, api_key=wrong_key, timeout=HTTP_TIMEOUT_S, max_retries=0)
        with pytest.raises(openai.BadRequestError, match="Token Authorization failed"):
            refused.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=4)
    response = requests.get(f"{base_url}/models", timeout=HTTP_TIMEOUT_S)
    assert response.status_code == 400 and "Token Authorization failed" in response.text
