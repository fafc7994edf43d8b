"""scripts.bench.agentic: the trace generator alone, then the whole benchmark on the tiny pair.

No timing is asserted (benchmarks are programs). What is checked: the seeded
trace has every family, keeps each conversation's turns in order and asks the
same coding task again with other names; the same seed gives the same trace and
another seed a different one; the benchmark reports every row it ran, and in
float32 every row's greedy output is HF target-only's, token for token.
"""

from __future__ import annotations

import json
import types

import pytest

from handler.drafters.suffix import SuffixDrafter, SuffixOptions
from handler.planning.cost_table import CostTable
from scripts.bench import agentic as bench_agentic
from tests.conftest import REPO_ROOT

ENGINE_ROWS = (
    *bench_agentic.DRAFTER_ROWS,
    *bench_agentic.CHAIN_ROWS,
    bench_agentic.SHIPPED,
    *bench_agentic.CACHED_ROWS,
)
# Fits the tiny pair's 1,024-token context (its tokenizer spends about 3 tokens where Qwen's spends 1),
# and makes one tool loop and one edit session of two requests each.
NUM_TINY_REQUESTS = 8


def _signature(plan: list[bench_agentic.TraceItem]) -> list[tuple]:
    return [(item.family, item.conversation, item.turn, json.dumps(item.messages)) for item in plan]


def test_family_sizes_add_up_with_one_request_per_family_at_least():
    assert bench_agentic.family_sizes(bench_agentic.DEFAULT_REQUESTS) == bench_agentic.FAMILY_WEIGHTS
    for num in range(len(bench_agentic.FAMILIES), 40):
        sizes = bench_agentic.family_sizes(num)
        assert sum(sizes.values()) == num and min(sizes.values()) >= 1, (num, sizes)


def test_plan_has_every_family_in_order_and_repeats_coding_tasks_with_other_names():
    plan = bench_agentic.make_plan(7, bench_agentic.DEFAULT_REQUESTS)
    assert {family: sum(item.family == family for item in plan) for family in bench_agentic.FAMILIES} == {
        "sql": 4,
        "coding": 4,
        "tools": 3,
        "edit": 3,
    }
    # Interleaved: not one family after another.
    assert [item.family for item in plan] != sorted((item.family for item in plan), key=bench_agentic.FAMILIES.index)
    turns: dict[str, list[int]] = {}
    for item in plan:
        turns.setdefault(item.conversation, []).append(item.turn)
        if item.turn:  # a later turn adds a tool result or the user's next request, after the previous answer
            [message] = item.messages
            assert message["role"] == ("tool" if item.family == "tools" else "user"), item
        else:
            assert [message["role"] for message in item.messages] == ["system", "user"], item
        assert bool(item.tools) == (item.family == "tools")
    assert all(numbers == list(range(len(numbers))) for numbers in turns.values()), turns
    assert turns["tools-0"] == [0, 1, 2] and turns["edit-0"] == [0, 1, 2]
    assert len({item.messages[0]["content"] for item in plan if item.family == "sql"}) == 1  # one schema
    # Each coding question comes from a task template, asked at least twice, each time with other names.
    questions = [item.messages[1]["content"] for item in plan if item.family == "coding"]
    assert len(set(questions)) == len(questions)
    asked = [next(i for i, (text, _) in enumerate(bench_agentic.CODING_TASKS) if _fixed(text) in q) for q in questions]
    assert all(asked.count(task) >= 2 for task in asked), asked


def _fixed(template: str) -> str:
    """A template's words between its function name and its next field: the same in every ask."""
    return template.split("`{fn}`", 1)[1].split("{", 1)[0]


def test_plan_depends_on_the_seed_alone():
    plan = bench_agentic.make_plan(7, 10)
    assert _signature(plan) == _signature(bench_agentic.make_plan(7, 10))
    assert _signature(plan) != _signature(bench_agentic.make_plan(8, 10))
    # --compact shortens the schema and the tools, and draws the same requests.
    compact = bench_agentic.make_plan(7, 10, compact=True)
    assert [item.messages[1:] for item in compact] == [item.messages[1:] for item in plan]
    sql = next(i for i, item in enumerate(plan) if item.family == "sql")
    assert "CREATE TABLE order_items" in plan[sql].messages[0]["content"]
    assert "order_items(order_id, product_id, quantity, unit_price)" in compact[sql].messages[0]["content"]
    tools = next(i for i, item in enumerate(plan) if item.family == "tools")
    assert [t["function"]["name"] for t in compact[tools].tools] == [t["function"]["name"] for t in plan[tools].tools]
    assert len(json.dumps(compact[tools].tools)) < len(json.dumps(plan[tools].tools))


def test_unknown_rows_and_too_few_requests_are_refused():
    with pytest.raises(SystemExit):
        bench_agentic.parse_args(["--methods", "hf_target_only,eagle"])
    with pytest.raises(SystemExit):
        bench_agentic.parse_args(["--requests", "3"])
    assert bench_agentic.parse_args([]).methods == list(bench_agentic.ROWS)


def test_the_draft_skew_multiplies_the_draft_step_alone():
    table = CostTable(widths=(1, 2), batch_sizes=(1, 2), target=((0.1, 0.12), (0.15, 0.2)), draft=(0.02, 0.03))
    skewed = bench_agentic.skew_draft(table, 2.5)
    assert skewed.target == table.target and skewed.draft == pytest.approx((0.05, 0.075))
    lookups_only = CostTable(widths=(1,), batch_sizes=(1,), target=((0.1,),))
    assert bench_agentic.skew_draft(lookups_only, 2.5) is lookups_only


def test_a_warm_up_feeds_its_answers_to_the_shared_suffix_tree_unless_the_config_keeps_them_private():
    answers = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    requests = [types.SimpleNamespace(prompt_ids=[1, 2, 3]), types.SimpleNamespace(prompt_ids=[4])]
    warm = bench_agentic.Trace(items=[], requests=requests, reference=answers, answers=[], reference_seconds=0.0)
    engine = types.SimpleNamespace(suffix_drafter=SuffixDrafter())
    bench_agentic.warm_suffix_trees(engine, warm)
    drafter = engine.suffix_drafter
    assert (drafter.stats.num_requests, drafter.stats.num_tokens) == (2, 9)
    assert not drafter.rows  # the warm-up's own trees are gone, as when its requests ended
    # A later request whose text reaches an earlier answer is proposed that answer's continuation.
    drafter.add({"later": [42, 5, 6, 7]})
    assert drafter.lookup("later", 3).token_ids == [8, 9, 10]
    private = types.SimpleNamespace(suffix_drafter=SuffixDrafter(SuffixOptions(share_across_requests=False)))
    bench_agentic.warm_suffix_trees(private, warm)
    assert private.suffix_drafter.stats.num_requests == 0


def _run(tiny_models_dir, out, *args: str) -> dict:
    bench_agentic.main(
        [
            *("--target", str(tiny_models_dir / "target"), "--draft", str(tiny_models_dir / "draft")),
            *("--config", str(REPO_ROOT / "model-config" / "model-config.yaml"), "--dtype", "float32"),
            *("--compact", "--requests", str(NUM_TINY_REQUESTS), "--max-new-tokens", "6", "--runs", "1"),
            *("--out-dir", str(out), *args),
        ]
    )
    return json.loads((out / "agentic.json").read_text())


@pytest.mark.models  # loads and runs the tiny pair: not in the fast tier
def test_bench_agentic_reports_every_row_with_the_target_only_output(tiny_models_dir, tmp_path, capsys):
    report = _run(tiny_models_dir, tmp_path / "all")
    rows, trace = report["rows"], report["trace"]
    assert list(rows) == list(bench_agentic.ROWS)
    assert trace["num_requests"] == NUM_TINY_REQUESTS and min(trace["families"].values()) >= 1
    requests = trace["requests"]
    assert all(request["prompt_tokens"] > 0 for request in requests)
    # The later turns carry the earlier ones: a tool result and an edit request after the previous answer.
    later = {request["family"]: request for request in requests if request["turn"] > 0}
    assert set(later) == {"tools", "edit"}
    assert later["tools"]["new_messages"][0]["role"] == "tool"
    first_turns = {request["conversation"]: request for request in requests if request["turn"] == 0}
    for request in later.values():
        assert request["prompt_tokens"] > first_turns[request["conversation"]]["prompt_tokens"]
    for key, row in rows.items():
        [run] = row["runs"]
        assert run["num_tokens"] > 0 and run["seconds"] > 0, key
        # float32, greedy: every row, speculative or not, is HF target-only's output and the reference pass's.
        assert row["same_output"] == NUM_TINY_REQUESTS and row["differences"] == [], (key, row["differences"])
        assert row["same_as_reference"] == NUM_TINY_REQUESTS, key
        if key in ENGINE_ROWS:
            assert run["target_passes"] > 0 and isinstance(run["by_drafter"], dict), key
            if key in bench_agentic.CHAIN_ROWS:
                assert run["trees"]["steps"] == 0, key
            assert row["tokens_per_pass"] >= 1
            # Only the last three rows have a prefix cache; the trace's requests share their system prompts.
            if key in bench_agentic.CACHED_ROWS:
                assert 0 < run["prefix_cache"]["cached_tokens"] < run["prefix_cache"]["prompt_tokens"], run
            else:
                assert run["prefix_cache"] is None, key
            # The config plans from a cost table, which every engine but one corrects as it runs.
            if key == bench_agentic.SHIPPED_FIXED:
                assert run["cost_scales"] is None
            else:
                assert len(run["cost_scales"]) == 2 and min(run["cost_scales"]) > 0, (key, run["cost_scales"])
        else:
            assert run["target_passes"] == 0 and row["tokens_per_pass"] is None, key
    assert rows["hf_target_only"]["vs_target_only"] == 1.0
    assert report["shipped_vs_best"]["best"] in bench_agentic.SHIPPED_ALTERNATIVES
    table = (tmp_path / "all" / "agentic.md").read_text()
    assert "| row | tokens/s (median) | x target-only |" in table and "shipped / best of" in table
    assert "came from the prefix cache" in table
    assert f"{bench_agentic.SHIPPED_CACHED} / {bench_agentic.MODEL_CACHED} (the same prefix cache)" in table
    assert report["warm_up"] is None and "Warm server" not in table
    assert f"{bench_agentic.SHIPPED_CACHED} / {bench_agentic.SHIPPED_FIXED} (the running cost correction)" in table
    for key in bench_agentic.ROWS:
        assert f"| {key}: " in table, key
    assert table in capsys.readouterr().out

    # The same seed builds the same trace, prompts and reference answers; another seed another one.
    again = _run(tiny_models_dir, tmp_path / "again", "--methods", "hf_target_only")
    assert again["trace"]["requests"] == requests
    assert list(again["rows"]) == ["hf_target_only"] and again["shipped_vs_best"] is None
    other = _run(tiny_models_dir, tmp_path / "other", "--methods", "ngram", "--seed", "8", "--draft-cost-skew", "2")
    assert other["settings"]["draft_cost_skew"] == 2.0
    assert "draft step was multiplied by 2" in (tmp_path / "other" / "agentic.md").read_text()
    assert [r["new_messages"] for r in other["trace"]["requests"]] != [r["new_messages"] for r in requests]
    # A warm server: the timed trace is the same; every engine's suffix trees first learn another seed's answers.
    warm = _run(tiny_models_dir, tmp_path / "warm", "--methods", "suffix", "--warm-requests", "4")
    assert warm["trace"]["requests"] == requests
    assert warm["settings"]["warm_seed"] == 7 + bench_agentic.WARM_SEED_OFFSET
    assert warm["warm_up"]["num_requests"] == 4 and warm["warm_up"]["reference_completion_tokens"] > 0
    assert warm["rows"]["suffix"]["same_as_reference"] == NUM_TINY_REQUESTS
    assert "Warm server: before each engine run" in (tmp_path / "warm" / "agentic.md").read_text()
    # Without the HF baseline, outputs are compared with the reference pass.
    assert other["rows"]["ngram"]["same_output"] == NUM_TINY_REQUESTS
    assert other["rows"]["ngram"]["vs_target_only"] is None
    assert "same output as the reference pass" in (tmp_path / "other" / "agentic.md").read_text()
