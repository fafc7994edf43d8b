"""scripts.bench.replay: the trace read per position, the replay drafters making the engine accept
exactly the recorded lengths with the target's own output, and the benchmark's table on the tiny pair.

The engine tests build a small synthetic trace (`synthetic_trace`: accept lengths as a fixed-k run
would record them, the last pass cut to max_new_tokens), replay it on the tiny pair in float32, and
compare every step's `num_accepted_tokens` with the trace. No timing is asserted.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from handler.drafters import MODEL
from handler.engine import build_engine
from handler.runtime.loading import LoadedModels
from scripts.bench import accept_traces, replay

K = 4


def synthetic_trace(set_name: str, index: int, wanted: list[int], num_tokens: int, prompt_tokens: int) -> dict:
    """A request's trace as a run at k = K records it: the first token from the prefill, then each pass
    drafts K, fewer only where max_new_tokens is near, and accepts what `wanted` says (at most its
    drafts); passes without a wish accept none."""
    drafted, accepted, emitted = [], [], 1
    wishes = iter(wanted)
    while emitted < num_tokens:
        num_drafts = min(K, num_tokens - emitted - 1)
        num_accepted = min(next(wishes, 0), num_drafts)
        drafted.append(num_drafts)
        accepted.append(num_accepted)
        emitted += num_accepted + 1
    return dict(set=set_name, index=index, prompt_tokens=prompt_tokens, num_tokens=num_tokens,
                finish_reason="length", drafted=drafted, accepted=accepted)  # fmt: skip


TRACES = [
    synthetic_trace("grounded", 0, [0, 4, 2, 4, 1, 3], 16, 9),
    synthetic_trace("grounded", 1, [4, 4, 0, 1, 4], 14, 13),
    synthetic_trace("grounded", 2, [2, 0, 0, 4, 3], 12, 6),
]


def replay_fixed_k(trace: dict, k: int) -> list[int]:
    """The accept lengths a replay of `trace` at a fixed k gives: after the first token, from the
    prefill, each pass drafts k (fewer near the end) and accepts the run of right positions from where
    it starts."""
    matches, accepted, emitted = replay.matches_of(trace["drafted"], trace["accepted"]), [], 1
    script = replay.Script(matches, [])
    while emitted < trace["num_tokens"]:
        num_drafts, num_right = min(k, trace["num_tokens"] - emitted - 1), 0
        while num_right < num_drafts and script.match(emitted + num_right) is True:
            num_right += 1
        accepted.append(num_right)
        emitted += num_right + 1
    return accepted


def test_positions_read_from_a_trace():
    # The first token is the prefill's; then a pass that accepted n < k: n right, then one wrong; all k:
    # the position after them is unknown.
    matches = replay.matches_of([4, 4, 2, 0], [1, 4, 2, 0])
    assert matches == [None] + [True, False] + [True] * 4 + [None] + [True] * 2 + [None] * 2


def test_the_recorded_trace_replays_at_its_k_pass_for_pass():
    """Read per position, every request of the shipped trace replays its recorded accept lengths at the
    trace's k; only a request that stopped on an EOS inside its last pass drafts less there (the replay
    runs to its token count, so that pass has no room for drafts), in as many passes."""
    report = json.loads(accept_traces.DEFAULT_OUT.read_text(encoding="utf-8"))
    for trace in report["requests"]:
        replayed = replay_fixed_k(trace, report["k"])
        assert len(replayed) == len(trace["accepted"]), trace
        last = -1 if trace["finish_reason"] != "length" else None
        assert replayed[:last] == trace["accepted"][:last], trace


def test_replay_drafts_are_right_where_the_real_draft_was_and_wrong_after():
    state = replay.Replay(vocab_size=100)
    continuation = [9, 10, 11, 12, 13, 14, 15, 16, 99]
    state.begin({"r": replay.Script(replay.matches_of([4, 3], [1, 3]), continuation)})
    state.start(["r"], MODEL)
    state.follow({"r": [9]}, MODEL)  # the first token, from the prefill: no pass
    assert state.drafts("r", 4) == [10, 12, 13, 14]  # position 1 was wrong: 11 + 1
    state.follow({"r": [10, 11]}, MODEL)  # the target's token after the accepted draft
    assert state.drafts("r", 3) == [12, 13, 14]  # the second pass: three right
    state.follow({"r": [12, 13, 14, 15]}, MODEL)
    assert state.drafts("r", 2) == [17, 0]  # after all-accepted: unknown, proposed wrong
    state.follow({"r": [17, 98]}, MODEL)  # the target took the wrong draft: its text left the continuation
    counts = state.counts
    assert (counts.passes, counts.as_recorded, counts.unknown, counts.diverged) == (3, 2, 1, 1)


@pytest.fixture(scope="module")
def tiny_pair(tiny_models_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_models_dir / "target")
    target, draft = (
        AutoModelForCausalLM.from_pretrained(tiny_models_dir / role, dtype=torch.float32).eval()
        for role in ("target", "draft")
    )
    return LoadedModels.of(target, draft, tokenizer, eos_token_ids=())


@pytest.mark.models
@pytest.mark.parametrize("row", [replay.FIXED, replay.FREE])
def test_the_engine_accepts_exactly_the_recorded_lengths_and_emits_the_target_greedy_output(tiny_pair, row):
    """The three requests run together (rows join and leave the draft's batch), each step's accepted
    drafts are the trace's, and every output is the target's plain greedy output."""
    instances = replay.workload(TRACES, 1, 1, vocab=300, seed=3)
    plain = build_engine(tiny_pair, runner="dynamic")
    plain_outputs = [
        result.token_ids for result in plain.generate([instance.request(0, MODEL) for instance in instances])
    ]
    state = replay.Replay(tiny_pair.target.config.vocab_size)
    engine = replay.replay_engine(tiny_pair, state, "dynamic")
    state.begin({index: instance.script(plain_outputs[index]) for index, instance in enumerate(instances)})
    drafter = replay.ROW_REQUESTS[row][1]
    for index, instance in enumerate(instances):
        engine.add_request(index, instance.request(K, drafter))
    drafted, accepted, outputs = ([[] for _ in instances] for _ in range(3))
    while engine.has_unfinished_requests():
        for output in engine.step():
            drafted[output.request_id].append(output.num_draft_tokens)
            accepted[output.request_id].append(output.num_accepted_tokens)
            if output.result is not None:
                outputs[output.request_id] = output.result.token_ids
    assert accepted == [trace["accepted"] for trace in TRACES]
    assert drafted == [trace["drafted"] for trace in TRACES]
    assert outputs == plain_outputs
    counts = state.counts
    assert counts.passes == counts.as_recorded == sum(sum(d > 0 for d in trace["drafted"]) for trace in TRACES)
    assert (counts.unknown, counts.diverged) == (0, 0)
    # The model drafter's passes still ran; the look-up's drafts cost none.
    draft_passes = sum(step.draft_passes for step in engine.steps.recent_steps)
    assert draft_passes > 0 if row == replay.FIXED else draft_passes == 0


@pytest.mark.models
def test_the_benchmark_prints_its_table_on_the_tiny_pair(tiny_models_dir, tmp_path, capsys):
    """Every row at C = 1 and 2 on one set of two requests: the table, labelled, with the replayed rows'
    tokens a pass equal to the trace's and every pass as recorded (float32: nothing diverges)."""
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"date": "2026-01-01", "target": "t", "draft": "d", "k": K, "dtype": "float32",
                                 "sampling": "greedy", "max_new_tokens": 16, "requests": TRACES[:2]}))  # fmt: skip
    argv = ["--models", str(tiny_models_dir), "--trace", str(trace), "--sets", "grounded",
            "--concurrency", "1,2", "--repeats", "1", "--settle-rounds", "1", "--pass-repeats", "1"]  # fmt: skip
    assert replay.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(index for index, line in enumerate(lines) if line.startswith("| set | C |"))
    assert "replayed acceptance" in lines[header] and lines[header - 2].startswith("Replayed acceptance")
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[header + 2 :] if line]
    labels = [replay.ROW_LABELS[row] for row in replay.ROWS]
    assert [(row[0], row[1], row[2]) for row in rows] == [
        ("grounded", str(c), label) for c in (1, 2) for label in labels
    ]
    for row in rows:
        assert float(row[3]) > 0
        if row[2] in (replay.ROW_LABELS[replay.FIXED], replay.ROW_LABELS[replay.FREE]):
            assert row[5] == row[6]  # tokens a pass: the trace's
            passes, of = row[12].split("/")
            assert passes == of and row[14] == "0"  # every pass as recorded, nothing diverged
