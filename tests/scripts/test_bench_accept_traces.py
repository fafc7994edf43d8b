"""scripts.bench.accept_traces on the tiny pair: the trace file's structure, and each request's
passes adding up to its tokens, checked against the engine's own statistics.

The invariant: a pass emits its accepted drafts and one target token, so the sum of
(accepted + 1) over a request's passes is its token count, except where it stopped inside its
last pass (an EOS among the accepted drafts). The noisy tiny pair exercises accepts between 0 and
k; a pair whose draft is the target (every draft accepted) with a chosen token as its EOS
exercises the stop inside a pass, where the last pass's tokens after the EOS are dropped.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from handler.drafters import MODEL
from handler.engine import GenerationRequest, build_engine
from handler.runtime.loading import LoadedModels
from handler.schema import FINISH_EOS, FINISH_LENGTH, FINISH_STOP
from scripts.bench import accept_traces
from scripts.bench.runner import GREEDY
from tests.conftest import REPO_ROOT

from .test_bench import FUNCTION, _prompt

pytestmark = pytest.mark.models  # loads and runs the tiny pair: not in the fast tier

K = 3
MAX_NEW_TOKENS = 12


def check_passes(trace: dict, k: int, max_new_tokens: int) -> int:
    """Asserts the trace's pass invariants; returns how many of its last pass's tokens were dropped."""
    drafted, accepted, num_tokens = trace["drafted"], trace["accepted"], trace["num_tokens"]
    assert len(drafted) == len(accepted) >= 1
    # Tokens emitted before each pass: the first token, from the prefill, then accepted + 1 a pass.
    emitted_before = 1
    for index, (num_drafts, num_accepted) in enumerate(zip(drafted, accepted)):
        assert 0 <= num_accepted <= num_drafts <= k, trace
        # A fixed k: every pass drafts k, fewer only where its tokens would pass max_new_tokens.
        assert num_drafts == min(k, max_new_tokens - emitted_before - 1), (index, trace)
        if index < len(drafted) - 1:
            emitted_before += num_accepted + 1
    assert emitted_before < num_tokens, trace  # the last pass emitted at least one token
    dropped = emitted_before + accepted[-1] + 1 - num_tokens
    assert dropped >= 0, trace
    if trace["finish_reason"] == FINISH_LENGTH:  # drafts are cut to fit: the last pass drops nothing
        assert num_tokens == max_new_tokens and dropped == 0, trace
    else:
        assert trace["finish_reason"] in (FINISH_EOS, FINISH_STOP), trace
    return dropped


def test_traces_of_every_set_add_up_to_their_tokens(tiny_models_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(
        json.dumps(
            {
                "open": {"tuning": [_prompt("Hello")], "held_out": [_prompt("Write a loop")]},
                "grounded": {"tuning": [], "held_out": [_prompt("Rename total to s:\n" + FUNCTION)]},
            }
        )
    )
    out = tmp_path / "traces" / "tiny.json"
    argv = [
        *("--target", str(tiny_models_dir / "target"), "--draft", str(tiny_models_dir / "draft")),
        *("--config", str(REPO_ROOT / "model-config" / "model-config.yaml"), "--prompts", str(prompts)),
        *("--k", str(K), "--max-new-tokens", str(MAX_NEW_TOKENS), "--num-prompts", "2", "--compact"),
        *("--out", str(out)),
    ]
    assert accept_traces.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["k"] == K and report["dtype"] == "float32" and report["drafter"] == MODEL
    assert list(report["sets"]) == list(accept_traces.SETS)
    requests = report["requests"]
    assert [(r["set"], r["index"]) for r in requests] == [
        ("open", 0),
        ("open", 1),
        ("grounded", 0),
        ("agentic", 0),
        ("agentic", 1),
    ]
    for trace in requests:
        check_passes(trace, K, MAX_NEW_TOKENS)
    # The noisy draft is neither always right nor always wrong.
    counts = {count for trace in requests for count in trace["accepted"]}
    assert len(counts) > 1, counts
    for name, row in report["summary"].items():
        chosen = [trace for trace in requests if trace["set"] == name]
        assert row["passes"] == sum(len(trace["accepted"]) for trace in chosen)
        assert row["tokens"] == sum(trace["num_tokens"] for trace in chosen)
        assert row["tokens_per_pass"] == pytest.approx(row["tokens"] / (row["passes"] + row["requests"]))
    table = capsys.readouterr().out
    assert all(f"| {name} | " in table for name in accept_traces.SETS)


def _engine(tiny_models_dir, eos_token_ids):
    tokenizer = AutoTokenizer.from_pretrained(tiny_models_dir / "target")
    target = AutoModelForCausalLM.from_pretrained(tiny_models_dir / "target", dtype=torch.float32).eval()
    # The draft is the target itself: every draft is accepted, so the passes fall at known places.
    models = LoadedModels.of(target, target, tokenizer, eos_token_ids=eos_token_ids)
    engine = accept_traces.TracingEngine(build_engine(models, drafter=MODEL, runner="dynamic"))
    return engine, tokenizer


def test_a_stop_inside_the_last_pass_drops_its_later_tokens_and_the_counts_match_the_stats(tiny_models_dir):
    engine, tokenizer = _engine(tiny_models_dir, ())
    prompt_ids = tuple(tokenizer("def add(a, b):")["input_ids"])
    # The first token from the prefill, then passes of K + 1: the fourth has room for K - 1 drafts and its own.
    max_new_tokens = 1 + 4 * (K + 1) - 1
    request = GenerationRequest(prompt_ids, max_new_tokens, GREEDY, K, drafter=MODEL)
    [result] = engine.generate([request])
    [trace] = engine.traces
    assert trace.accepted == [K] * 3 + [K - 1]  # every draft taken; the last pass drafted one fewer
    tokens = result.token_ids
    assert len(tokens) == max_new_tokens

    # A token first emitted as a draft inside a pass (not the pass's own last token) becomes the EOS.
    position = next(
        index
        for index, token in enumerate(tokens[: 1 + 3 * (K + 1)])
        if index and (index - 1) % (K + 1) < K and token not in tokens[:index]
    )
    eos_engine, _ = _engine(tiny_models_dir, (tokens[position],))
    [stopped] = eos_engine.generate([request])
    [stopped_trace] = eos_engine.traces
    assert stopped.token_ids == tokens[: position + 1] and stopped.finish_reason == FINISH_EOS
    dropped = check_passes(dataclasses.asdict(stopped_trace), K, max_new_tokens)
    # The rest of that pass: its later drafts and the target's token.
    assert dropped == K - (position - 1) % (K + 1)

    for run, run_trace in ((result, trace), (stopped, stopped_trace)):
        stats = run.stats
        assert len(run_trace.accepted) + 1 == stats.target_forward_passes  # and the prefill's
        assert sum(run_trace.drafted) == stats.draft_tokens
        assert sum(run_trace.accepted) == stats.accepted_tokens
