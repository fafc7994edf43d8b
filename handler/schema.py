"""The REST contract of `POST /predictions/{model}`, in one place, with no torch.

The handler (through `handler.api.native`), the scripts (client, load test, demo)
and the tests import these names; nothing else restates them. Adding a request
field, a finish reason or a `speculative` key is one line here, plus the code
that fills it.

Request: a JSON object whose keys are `REQUEST_FIELDS` (a plain-text body is
the prompt). The rules that need no tokenizer and no model config live here
too; `handler.api.native` applies the rest (defaults and limits from the config,
prompt encoding, context length).

Answer: `answer(...)`, or for a stream, NDJSON lines built by `stream_chunk`
and `final_stream_chunk` whose joined deltas equal the plain answer.
`validate_answer` and `validate_stream` check what a client received.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

# --- Request -------------------------------------------------------------------------------------

REQUEST_FIELDS = (
    "prompt",
    "messages",
    "max_new_tokens",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "seed",
    "num_speculative_tokens",
    "stop",
    "stream",
    "drafter",
    "suffix_share_across_requests",
    "speculative_tree",
    # Structured output, at most one of them (handler.constraints).
    "json_schema",
    "regex",
    "grammar",
)
CONSTRAINT_FIELDS = ("json_schema", "regex", "grammar")
# The most characters a constraint may have, serialised: enough for dozens of tool schemas.
MAX_CONSTRAINT_CHARS = 256 * 1024
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
SEED_RANGE = (0, 2**63 - 1)
# OpenAI's limit on the entries of logit_bias.
MAX_LOGIT_BIAS_TOKENS = 300
# A token id as OpenAI sends a logit_bias key: a decimal string, without sign or leading zeros
# (so that "5" and "05" cannot name the same token twice), at most 10 digits.
TOKEN_ID_KEY = re.compile(r"0|[1-9][0-9]{0,9}")
TOP_K_RANGE = (0, 2**31 - 1)

# --- Answer --------------------------------------------------------------------------------------

FINISH_LENGTH = "length"  # max_new_tokens reached
FINISH_EOS = "eos"  # the target emitted one of its EOS tokens (the last of token_ids)
FINISH_STOP = "stop"  # a stop string appeared; `text` ends just before it
FINISH_ABORT = "abort"  # the request was cancelled before it finished
FINISH_REASONS = (FINISH_LENGTH, FINISH_EOS, FINISH_STOP, FINISH_ABORT)

# The `speculative` object of an answer: key -> JSON type(s) of its value.
SPECULATIVE_FIELDS: dict[str, type | tuple[type, ...]] = {
    "num_speculative_tokens": int,
    "draft_tokens": int,
    "accepted_tokens": int,
    "acceptance_rate": (int, float),
    "target_forward_passes": int,
    "mean_accepted_length": (int, float),
    "fell_back_to_target_only": bool,
    "draft_passes": int,  # draft-model passes; below by_drafter.model.draft_tokens where guesses came true
    "drafter": str,  # the request's drafter: model, ngram, suffix or hybrid
    "by_drafter": dict,  # proposer -> {"draft_tokens", "accepted_tokens"}
    "accepted_per_position": list,  # [j]: steps whose draft j was accepted
    "tree": dict,  # steps, nodes, accepted_depth, other_branch of trees verified (docs/tree-verification.md)
}
SPECULATIVE_KEYS = frozenset(SPECULATIVE_FIELDS)
# cached_tokens: of the prompt tokens, those whose KV came from the prefix cache.
USAGE_KEYS = ("prompt_tokens", "completion_tokens", "cached_tokens")
ANSWER_KEYS = ("text", "token_ids", "finish_reason", "usage", "speculative")
STREAM_CHUNK_KEYS = ("text_delta", "token_ids")
ERROR_KEY = "error"
STREAM_CONTENT_TYPE = "application/x-ndjson"
JSON_CONTENT_TYPE = "application/json"


class RequestError(ValueError):
    """A request the client must change; `status` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


# --- Request rules that need neither a tokenizer nor a config --------------------------------------


def check_known_fields(body: Mapping) -> None:
    """Raises RequestError naming the first field that is not in REQUEST_FIELDS."""
    unknown = sorted(set(body) - set(REQUEST_FIELDS))
    if unknown:
        raise RequestError(f"{unknown[0]}: unknown field; known fields are {', '.join(REQUEST_FIELDS)}")


def integer_field(body: Mapping, key: str, default: int, minimum: int, maximum: int) -> int:
    """`body[key]` (or `default`) as an int in [minimum, maximum]; 3.0 counts as 3, true does not."""
    value = body.get(key, default)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{key}: must be an integer, got {json.dumps(value)}")
    if not minimum <= value <= maximum:
        raise RequestError(f"{key}: must be between {minimum} and {maximum}, got {value}")
    return value


def number_field(body: Mapping, key: str, default: float) -> float:
    """`body[key]` (or `default`) as a finite float."""
    value = body.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(f"{key}: must be a finite number, got {json.dumps(value)}")
    return float(value)


def seed_field(body: Mapping) -> int | None:
    """The request's seed, or None when it gives none."""
    if body.get("seed") is None:
        return None
    return integer_field(body, "seed", 0, *SEED_RANGE)


def logit_bias_field(body: Mapping) -> tuple[tuple[int, float], ...]:
    """`logit_bias`, {token id: bias}, as (token id, bias) pairs sorted by id; empty when absent.

    Keys are token ids as decimal strings, as OpenAI sends them ("123"), or
    ints. The bias range is `handler.config.sampling_problem`'s rule, and the
    tokenizer's vocabulary bounds the ids (`handler.api.native`).
    """
    value = body.get("logit_bias", {})
    if not isinstance(value, Mapping):
        raise RequestError(
            f'logit_bias: must be an object of token ids to biases, such as {{"50256": -100}}, '
            f"got {json.dumps(value)[:80]}"
        )
    if len(value) > MAX_LOGIT_BIAS_TOKENS:
        raise RequestError(f"logit_bias: at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(value)}")
    pairs: dict[int, float] = {}
    for key, bias in value.items():
        if isinstance(key, int) and not isinstance(key, bool) and key >= 0:
            token_id = key
        elif isinstance(key, str) and TOKEN_ID_KEY.fullmatch(key):
            token_id = int(key)
        else:
            raise RequestError(f'logit_bias: keys must be token ids such as "123", got {json.dumps(str(key))}')
        if token_id in pairs:
            raise RequestError(f"logit_bias: token {token_id} is given twice")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise RequestError(f"logit_bias: the bias of token {token_id} must be a number, got {json.dumps(bias)}")
        pairs[token_id] = float(bias)
    return tuple(sorted(pairs.items()))


def stream_field(body: Mapping) -> bool:
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(f"stream: must be true or false, got {json.dumps(stream)}")
    return stream


def optional_bool_field(body: Mapping, key: str) -> bool | None:
    """A field that is true, false, or absent (None)."""
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise RequestError(f"{key}: must be true or false, got {json.dumps(value)}")
    return value


def stop_field(body: Mapping) -> tuple[str, ...]:
    """The stop strings: at most MAX_STOP_STRINGS, each 1 to MAX_STOP_STRING_CHARS characters."""
    stop = body.get("stop", [])
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise RequestError("stop: must be a list of strings")
    if len(stop) > MAX_STOP_STRINGS:
        raise RequestError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    if any(not s or len(s) > MAX_STOP_STRING_CHARS for s in stop):
        raise RequestError(f"stop: each stop string must have 1 to {MAX_STOP_STRING_CHARS} characters")
    return tuple(stop)


def constraint_field(body: Mapping) -> tuple[str, Any] | None:
    """The request's structured-output field and value, (name, value), or None when it has none.

    `json_schema` is a JSON Schema object (`true` or `{}`: any JSON value); `regex`
    and `grammar` (a Lark grammar in llguidance's dialect) are non-empty strings.
    """
    given = [key for key in CONSTRAINT_FIELDS if body.get(key) is not None]
    if not given:
        return None
    if len(given) > 1:
        raise RequestError(f"{given[1]}: give at most one of {', '.join(CONSTRAINT_FIELDS)}, got {', '.join(given)}")
    [key] = given
    value = body[key]
    if key == "json_schema":
        if not isinstance(value, (Mapping, bool)) or value is False:
            raise RequestError(
                f"json_schema: must be a JSON Schema object (or true for any JSON), got {json.dumps(value)[:80]}"
            )
        size = len(json.dumps(value))
    else:
        if not isinstance(value, str) or not value:
            raise RequestError(f"{key}: must be a non-empty string")
        size = len(value)
    if size > MAX_CONSTRAINT_CHARS:
        raise RequestError(f"{key}: {size} characters; at most {MAX_CONSTRAINT_CHARS}")
    return key, value


def decode_body(value: Any, content_type: str | None = None) -> dict:
    """Turns what TorchServe hands over for one request into a JSON object.

    TorchServe has already parsed an `application/json` body when it could, and
    passes anything else as bytes or text. A body that is not a JSON object or
    array but is UTF-8 text is taken as the prompt.

    Raises:
        RequestError: the body is not UTF-8, not valid JSON although declared so, or not an object.
    """
    is_json = (content_type or "").split(";")[0].strip().lower() == "application/json"
    if isinstance(value, str) and is_json:
        # TorchServe parsed this JSON body already (it passes bytes when it cannot): a JSON string.
        raise RequestError("body: a JSON body must be an object, got str")
    if isinstance(value, (bytes, bytearray)):
        try:
            value = bytes(value).decode("utf-8")
        except UnicodeDecodeError as error:
            raise RequestError(f"body: not valid UTF-8 ({error.reason} at byte {error.start})") from None
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as error:
            if is_json:
                raise RequestError(
                    f"body: Content-Type is application/json but the body is not valid JSON ({error})"
                ) from None
            return {"prompt": value}
        # Plain text that happens to parse as a JSON scalar, such as "42", is still a prompt.
        if not isinstance(parsed, (dict, list)) and not is_json:
            return {"prompt": value}
        value = parsed
    if not isinstance(value, Mapping):
        raise RequestError(f"body: a JSON body must be an object, got {type(value).__name__}")
    return dict(value)


# --- Answer builders -----------------------------------------------------------------------------


def answer(
    text: str,
    token_ids: Sequence[int],
    finish_reason: str,
    prompt_tokens: int,
    speculative: Mapping,
    cached_tokens: int = 0,
) -> dict:
    """The JSON answer of a finished request (also the fields of a stream's last line).

    `cached_tokens`: the prompt tokens whose KV came from the prefix cache.
    """
    assert finish_reason in FINISH_REASONS, finish_reason
    assert 0 <= cached_tokens <= prompt_tokens, (cached_tokens, prompt_tokens)
    return {
        "text": text,
        "token_ids": list(token_ids),
        "finish_reason": finish_reason,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(token_ids), "cached_tokens": cached_tokens},
        "speculative": dict(speculative),
    }


def error_answer(message: str) -> dict:
    return {ERROR_KEY: message}


def stream_chunk(text_delta: str, token_ids: Sequence[int]) -> dict:
    """One NDJSON line of a stream before the last: new stable text and the new token ids."""
    return {"text_delta": text_delta, "token_ids": list(token_ids)}


def final_stream_chunk(full_answer: Mapping, text_delta: str, token_ids: Sequence[int]) -> dict:
    """A stream's last line: the rest of the text and ids, then the answer's other fields."""
    rest = {key: value for key, value in full_answer.items() if key not in ("text", "token_ids")}
    return {**stream_chunk(text_delta, token_ids), **rest}


def join_stream(lines: Sequence[Mapping]) -> dict:
    """The plain answer a stream stands for: its last line, with the deltas and ids of all lines joined."""
    joined = {key: value for key, value in (lines[-1] if lines else {}).items() if key != "text_delta"}
    joined["text"] = "".join(line["text_delta"] for line in lines if isinstance(line.get("text_delta"), str))
    joined["token_ids"] = [t for line in lines if isinstance(line.get("token_ids"), list) for t in line["token_ids"]]
    return joined


# --- Answer validators ---------------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def validate_answer(answer: object) -> list[str]:
    """Problems with a non-streamed answer (or a stream's joined lines); empty when well-formed."""
    if not isinstance(answer, dict):
        return [f"answer is a {type(answer).__name__}, not an object"]
    problems = []
    for key, kind in (("text", str), ("token_ids", list), ("finish_reason", str), ("usage", dict)):
        if not isinstance(answer.get(key), kind):
            problems.append(f"{key}: missing or not a {kind.__name__}")
    if isinstance(answer.get("token_ids"), list) and not all(_is_int(t) for t in answer["token_ids"]):
        problems.append("token_ids: not all integers")
    if isinstance(answer.get("finish_reason"), str) and answer["finish_reason"] not in FINISH_REASONS:
        problems.append(f"finish_reason: {answer['finish_reason']!r} is not one of {FINISH_REASONS}")
    usage = answer.get("usage")
    if isinstance(usage, dict):
        for key in USAGE_KEYS:
            if not isinstance(usage.get(key), int):
                problems.append(f"usage.{key}: missing or not an integer")
    speculative = answer.get("speculative")
    if not isinstance(speculative, dict):
        problems.append("speculative: missing or not an object")
    else:
        for key, kind in SPECULATIVE_FIELDS.items():
            value = speculative.get(key)
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                problems.append(f"speculative.{key}: missing or wrong type ({value!r})")
    return problems


def validate_stream(lines: Sequence[Mapping]) -> list[str]:
    """Problems with the parsed lines of a streamed answer; empty when well-formed."""
    if not lines:
        return ["stream: no lines"]
    problems = []
    for index, line in enumerate(lines):
        if not isinstance(line.get("text_delta"), str):
            problems.append(f"stream line {index}: text_delta missing or not a str")
        ids = line.get("token_ids")
        if not isinstance(ids, list) or not all(_is_int(t) for t in ids):
            problems.append(f"stream line {index}: token_ids missing or not a list of ints")
        if index < len(lines) - 1 and "finish_reason" in line:
            problems.append(f"stream line {index}: finish_reason before the last line")
    if "finish_reason" not in lines[-1]:
        problems.append("stream: the last line has no finish_reason (stream cut short?)")
    else:
        # The per-line checks above already cover text and token_ids.
        problems += [p for p in validate_answer(join_stream(lines)) if not p.startswith(("text:", "token_ids:"))]
    return problems
