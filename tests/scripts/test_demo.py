"""scripts.demo's request list and its side-by-side speed summary, without a server."""

from __future__ import annotations

from scripts import demo
from scripts.serving.torchserve import Answer


def _answer(tokens: int, seconds: float, drafter: str) -> Answer:
    final = {"usage": {"completion_tokens": tokens}, "speculative": {"mean_accepted_length": 2.5, "drafter": drafter}}
    return Answer(text="", token_ids=[], final=final, elapsed_s=seconds)


def test_demo_sends_open_ended_and_input_grounded_requests():
    kinds = [kind for _, kind, _ in demo.EXAMPLES]
    assert kinds.count("open-ended") == 3 and kinds.count("input-grounded") == 1
    grounded = next(body for _, kind, body in demo.EXAMPLES if kind == "input-grounded")
    assert "def moving_average" in grounded["messages"][-1]["content"]


def test_print_speeds_compares_the_grounded_request_with_the_open_ended_mean(capsys):
    demo.print_speeds(
        [
            ("greedy", "open-ended", _answer(40, 10.0, "hybrid")),  # 4 tokens/s
            ("chat", "open-ended", _answer(60, 10.0, "hybrid")),  # 6 tokens/s
            ("type hints", "input-grounded", _answer(100, 10.0, "hybrid")),  # 10 tokens/s
        ]
    )
    out = capsys.readouterr().out
    assert "type hints (input-grounded)" in out and "10.0 tokens/s" in out
    assert "(2.00x the open-ended mean)" in out
    assert "open-ended mean 5.0 tokens/s" in out


def test_the_closing_words_say_when_the_keys_expire(capsys):
    """The demo leaves its server running; its keys stop working after token_expiration_min."""
    import re

    from scripts.serving.torchserve import DEFAULT_TS_CONFIG
    from tests.conftest import REPO_ROOT

    [minutes] = re.findall(r"^token_expiration_min=(\d+)$", (REPO_ROOT / DEFAULT_TS_CONFIG).read_text(), re.M)
    demo.print_next_steps("http://127.0.0.1:8080")
    out = " ".join(capsys.readouterr().out.split())
    assert f"expire {minutes} minutes after the server started" in out
    assert "make stop" in out
