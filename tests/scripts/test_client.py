"""scripts.serving.client's command line: the request body it builds."""

from __future__ import annotations

import json

from scripts.serving import client


def test_client_builds_the_request_body(tmp_path):
    args = client.build_parser().parse_args(["--stream", "--temperature", "0.7", "--seed", "42", "hello", "world"])
    assert client.build_body(args) == {"prompt": "hello world", "temperature": 0.7, "seed": 42, "stream": True}

    messages = [{"role": "user", "content": "hi"}]
    path = tmp_path / "chat.json"
    path.write_text(json.dumps({"messages": messages}))
    args = client.build_parser().parse_args(["--messages-json", str(path), "--max-new-tokens", "8"])
    assert client.build_body(args) == {"messages": messages, "max_new_tokens": 8}
