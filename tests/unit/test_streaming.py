"""Streaming deltas: UTF-8 characters and stop strings are held back until they are settled."""

from __future__ import annotations

from handler.streaming import DeltaTracker, held_back_stop_prefix


class ByteTokenizer:
    """Each token is one byte; decoding shows incomplete UTF-8 as U+FFFD, like byte-level BPE."""

    def decode(self, token_ids, skip_special_tokens=True):
        return bytes(token_ids).decode("utf-8", errors="replace")


def stream(text: str, stop=(), final_text=None) -> list[str]:
    tracker = DeltaTracker(ByteTokenizer(), stop)
    data = list(text.encode())
    deltas = [tracker.next_delta(data[: i + 1]) for i in range(len(data))]
    deltas.append(tracker.final_delta(text if final_text is None else final_text))
    return deltas


def test_multibyte_characters_are_never_split():
    text = "naïve 🚀 done"
    deltas = stream(text)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    # The 4-byte rocket arrives whole, in the delta of its last byte.
    assert "🚀" in deltas


def test_stop_string_never_leaks():
    text = "print(1)\n###\nmore"
    final = text[: text.index("###")]  # what the engine reports for stop=("###",)
    deltas = stream(text[: text.index("###") + 3], stop=("###",), final_text=final)
    assert "".join(deltas) == final
    assert not any("#" in d for d in deltas)


def test_a_false_start_of_a_stop_string_is_released_later():
    deltas = stream("a#b##c", stop=("###",))
    assert "".join(deltas) == "a#b##c"
    assert deltas[1] == ""  # "#" could start "###": held back
    assert deltas[2] == "#b"


def test_held_back_prefix_length():
    assert held_back_stop_prefix("abc##", ["###"]) == 2
    assert held_back_stop_prefix("abc", ["###"]) == 0
    assert held_back_stop_prefix("x<|e", ["<|end|>", "<"]) == 3
