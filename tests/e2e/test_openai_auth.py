"""End-to-end: with token authorization on, the OpenAI client's api_key is TorchServe's inference key.

A second TorchServe, started the way `make serve` starts one (token auth on),
on its own free ports; stopped in teardown.
"""

from __future__ import annotations

import openai
import pytest
import requests

from scripts.serving import openai_demo, torchserve

from .conftest import HTTP_TIMEOUT_S, MODEL_NAME, REGISTER_TIMEOUT_S, STARTUP_TIMEOUT_S, free_ports, write_server_config


@pytest.fixture(scope="module")
def auth_server(java_runtime, model_archive, tmp_path_factory):
    """(inference URL, keys) of a TorchServe with token auth on and the tiny model registered."""
    root = tmp_path_factory.mktemp("torchserve-auth")
    ports = free_ports(5)
    write_server_config(root / "config.properties", model_archive.parent, ports)
    inference_url, management_url = f"http://127.0.0.1:{ports[0]}", f"http://127.0.0.1:{ports[1]}"
    (root / "tmp").mkdir()
    env = torchserve.private_env(root / "logs", root / "tmp")
    started = torchserve.start_server(
        root / "config.properties",
        model_archive.parent,
        root / "logs" / "console.log",
        cwd=root,
        env=env,
        extra_args=["--enable-model-api"],
    )
    try:
        keys = torchserve.wait_for_ping(inference_url, root / torchserve.DEFAULT_KEY_FILE, STARTUP_TIMEOUT_S, started)
        assert keys, "token auth is on: the server wrote a key file"
        management = {"Authorization": f"Bearer {keys['management']}"}
        torchserve.register(management_url, model_archive.name, MODEL_NAME, management, REGISTER_TIMEOUT_S)
        yield inference_url, keys
    except torchserve.ClientError as error:
        pytest.fail(f"{error}\n{torchserve.log_tail(root / 'logs' / 'ts_log.log')}")
    finally:
        torchserve.stop_server(started)


def test_api_key_is_the_inference_key(auth_server):
    inference_url, keys = auth_server
    base_url = openai_demo.base_url(inference_url, MODEL_NAME)
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


def test_the_demo_request_sends_the_inference_key(auth_server):
    import io

    inference_url, keys = auth_server
    out = io.StringIO()
    assert openai_demo.run(inference_url, MODEL_NAME, keys["inference"], max_tokens=6, out=out)
    assert "completion tokens" in out.getvalue()
    with pytest.raises(torchserve.ClientError, match="HTTP 400"):
        openai_demo.run(inference_url, MODEL_NAME, None, max_tokens=6, out=io.StringIO())
