"""scripts.serving.torchserve without a server: keys and their hints, answers' messages, NDJSON, config addresses."""

from __future__ import annotations

import json

import pytest

from scripts.serving import torchserve


class FakeResponse:
    """Just what server_message and raise_for_status read of a requests.Response."""

    def __init__(self, status_code: int, body) -> None:
        self.status_code = status_code
        self.ok = status_code < 400
        self.reason = "Reason"
        self.text = body if isinstance(body, str) else json.dumps(body)

    def json(self):
        return json.loads(self.text)


def ndjson(lines: list[dict]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


LINES = [{"text_delta": "a", "token_ids": [1]}, {"text_delta": "b", "token_ids": [2], "finish_reason": "eos"}]


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 1000])
def test_iter_ndjson_parses_lines_split_across_chunks(chunk_size):
    body = ndjson(LINES) + b"\n"  # a blank line is skipped
    chunks = [body[i : i + chunk_size] for i in range(0, len(body), chunk_size)]

    assert list(torchserve.iter_ndjson(chunks)) == LINES


def test_iter_ndjson_keeps_a_last_line_without_newline_and_rejects_garbage():
    assert list(torchserve.iter_ndjson([b'{"a": 1}\n{"b"', b": 2}"])) == [{"a": 1}, {"b": 2}]
    with pytest.raises(ValueError):
        list(torchserve.iter_ndjson([b"not json\n"]))
    with pytest.raises(ValueError):
        list(torchserve.iter_ndjson([b"[1, 2]\n"]))


def test_unauthorized_message_points_at_the_key_file(tmp_path):
    missing = tmp_path / "key_file.json"
    assert str(missing) in torchserve.unauthorized_message(missing, "refused")
    assert "--no-auth" in torchserve.unauthorized_message(None, "refused")

    expired = tmp_path / "expired.json"
    expired.write_text(json.dumps({"inference": {"key": "k", "expiration time": "2020-01-01T00:00:00.123456789Z"}}))
    assert "expired" in torchserve.unauthorized_message(expired, "refused")
    assert torchserve.key_expiry(expired).year == 2020
    assert torchserve.read_key(expired) == "k"
    assert torchserve.auth_headers(expired) == {"Authorization": "Bearer k"}
    assert torchserve.auth_headers(None) == {}

    malformed = tmp_path / "malformed.json"
    malformed.write_text("{}")
    with pytest.raises(torchserve.ClientError, match="no inference key"):
        torchserve.read_key(malformed)


def test_read_keys_takes_a_half_written_file_as_not_there_yet(tmp_path):
    key_file = tmp_path / "key_file.json"
    assert torchserve.read_keys(key_file) is None
    key_file.write_text('{"inference": {"key": "i"}, "manage')
    assert torchserve.read_keys(key_file) is None
    key_file.write_text(json.dumps({"inference": {"key": "i"}, "management": {"key": "m"}, "API": {"key": "a"}}))
    assert torchserve.read_keys(key_file) == {"inference": "i", "management": "m"}
    assert torchserve.auth_headers(key_file, "management") == {"Authorization": "Bearer m"}


def test_server_message_prefers_the_handlers_error_then_torchserves_message():
    assert torchserve.server_message(FakeResponse(400, {"error": "top_p: bad", "message": "x"})) == "top_p: bad"
    assert (
        torchserve.server_message(FakeResponse(404, {"code": 404, "message": "Model not found"})) == "Model not found"
    )
    assert torchserve.server_message(FakeResponse(200, {"status": "Model registered"})) == "Model registered"
    assert torchserve.server_message(FakeResponse(502, "  Bad gateway \n")) == "Bad gateway"


def test_raise_for_status_tells_what_to_do(tmp_path):
    torchserve.raise_for_status(FakeResponse(200, {}), None)
    with pytest.raises(torchserve.ClientError, match="Is the model registered") as error:
        torchserve.raise_for_status(FakeResponse(404, {"message": "Model not found"}), None)
    assert error.value.status == 404
    refused = FakeResponse(400, {"code": 400, "type": "InvalidKeyException", "message": "Token Authorization failed"})
    with pytest.raises(torchserve.ClientError, match="--no-auth"):
        torchserve.raise_for_status(refused, None)
    with pytest.raises(torchserve.ClientError, match="model_log.log"):
        torchserve.raise_for_status(FakeResponse(507, {"message": "Worker died."}), tmp_path / "key_file.json")


def test_server_urls_come_from_config_properties(tmp_path):
    config = tmp_path / "config.properties"
    config.write_text("# comment\ninference_address=http://127.0.0.1:9080/\nmanagement_address = http://0.0.0.0:9081\n")
    assert torchserve.server_urls(config) == ("http://127.0.0.1:9080", "http://0.0.0.0:9081")
    config.write_text("model_store=model_store\n")
    assert torchserve.server_urls(config) == (torchserve.DEFAULT_INFERENCE_URL, torchserve.DEFAULT_MANAGEMENT_URL)


def test_wait_for_ping_names_the_address_when_nothing_answers():
    with pytest.raises(torchserve.ClientError, match=r"did not answer http://127\.0\.0\.1:9/ping"):
        torchserve.wait_for_ping("http://127.0.0.1:9", None, timeout_s=0.3)


def _fake_management(monkeypatch, described: list[list[str]]):
    """requests.request answering the scaling PUT, then each describe with the next states in `described`."""
    calls = []

    def request(method, url, headers=None, timeout=None, **kwargs):
        calls.append(method)
        if method == "PUT":
            return FakeResponse(200, {"status": "Processing worker updates..."})
        states = described[min(len(calls) - 2, len(described) - 1)]
        return FakeResponse(200, [{"workers": [{"id": str(9000 + i), "status": s} for i, s in enumerate(states)]}])

    monkeypatch.setattr(torchserve.requests, "request", request)
    monkeypatch.setattr(torchserve, "SCALE_POLL_S", 0.0)
    return calls


def test_scaling_waits_until_every_worker_is_ready(monkeypatch):
    # TorchServe's synchronous scaling answered once with the new worker still starting (seen under load).
    calls = _fake_management(monkeypatch, [["READY", "UNLOADING"], ["READY", "LOADING"], ["READY", "READY"]])
    torchserve.scale_workers("http://m", "pair", 2, {})
    assert calls == ["PUT", "GET", "GET", "GET"]


def test_scaling_down_waits_until_the_extra_workers_are_gone(monkeypatch):
    calls = _fake_management(monkeypatch, [["READY", "UNLOADING"], ["READY"]])
    torchserve.scale_workers("http://m", "pair", 1, {})
    assert calls == ["PUT", "GET", "GET"]


def test_scaling_that_never_gets_ready_fails_naming_the_states(monkeypatch):
    _fake_management(monkeypatch, [["READY", "UNLOADING"]])
    with pytest.raises(torchserve.ClientError, match=r"2 worker\(s\).*\['READY', 'UNLOADING'\]"):
        torchserve.scale_workers("http://m", "pair", 2, {}, timeout_s=0.05)
