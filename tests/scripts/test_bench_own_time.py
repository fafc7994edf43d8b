"""scripts.bench.own_time runs on the tiny pair and prints its table; no timing is asserted."""

from __future__ import annotations

import pytest

from scripts.bench import own_time as bench_own_time

pytestmark = pytest.mark.models  # loads and runs the tiny pair: not in the fast tier


def test_the_table_and_the_ratio_against_plain_come_out(tiny_models_dir, capsys):
    argv = ["--models", str(tiny_models_dir), "--batch-sizes", "1,2", "--steps", "2", "--warmup", "1", "--repeats", "1"]
    assert bench_own_time.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(index for index, line in enumerate(lines) if line.startswith("| batch | k |"))
    assert "own ms (unsync)" in lines[header] and "own ms (sync)" in lines[header]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[header + 2 :]]
    # plain, the planner pricing every draft out, drafting, and drafting's passes alone (the floor)
    modes = ("0", "0, planned", "4", "4, bare loop")
    assert [(row[0], row[1]) for row in rows] == [(batch, mode) for batch in ("1", "2") for mode in modes]
    for row in rows:
        assert float(row[2]) >= float(row[3]) >= 0.0  # a step holds its forwards
        assert row[8].endswith("x") and row[9].endswith("x")
    assert [row[8] for row in rows if row[1] == "0"] == ["1.00x", "1.00x"]  # plain against itself
    tokens = {(row[0], row[1]): float(row[6]) for row in rows}
    modes_taking_all = ("0", "4", "4, bare loop")
    assert [tokens[batch, mode] for batch in ("1", "2") for mode in modes_taking_all] == [1.0, 5.0, 5.0] * 2
    assert all(tokens[batch, "0, planned"] >= 1.0 for batch in ("1", "2"))  # a warm-up may explore still
    # The calls outside the forwards, counted: drafting's k passes make more than plain's one, and a
    # second row adds Python calls (per-row bookkeeping) but no torch calls (the tensors are the batch's).
    assert lines[header].endswith("| torch calls | Python calls |")
    calls = {(row[0], row[1]): (float(row[10]), float(row[11])) for row in rows}
    for batch in ("1", "2"):
        assert 0 < calls[batch, "0"][0] < calls[batch, "4"][0]
        assert 0 < calls[batch, "0"][1] < calls[batch, "4"][1]
    assert calls["2", "4"][0] == calls["1", "4"][0] and calls["2", "4"][1] > calls["1", "4"][1]
    # The bare loop makes drafting's passes with no bookkeeping: its Python calls do not grow with the rows.
    for batch in ("1", "2"):
        assert 0 < calls[batch, "4, bare loop"][1] < calls[batch, "4"][1]
    assert calls["2", "4, bare loop"] == calls["1", "4, bare loop"]


def test_the_shipped_drafting_step_is_a_row_of_its_own(tiny_models_dir, capsys):
    # The hybrid drafter planned from a cost table with the confidence stop: the shipped CPU step.
    argv = ["--models", str(tiny_models_dir), "--batch-sizes", "1", "--steps", "2", "--warmup", "1", "--repeats", "1"]
    assert bench_own_time.main([*argv, "--drafter", "hybrid", "--confidence-stop", "loop"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "hybrid drafter" in lines[0] and "the confidence stop by loop" in lines[0]
    header = next(index for index, line in enumerate(lines) if line.startswith("| batch | k |"))
    cells = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[header + 2 :]]
    rows = {row[1]: row for row in cells}
    assert float(rows["4"][6]) > 1.0  # every draft is the target's own: the drafting rows emit more than one a step


def test_the_drafting_rows_take_the_k_asked(tiny_models_dir, capsys):
    argv = ["--models", str(tiny_models_dir), "--batch-sizes", "1", "--steps", "2", "--warmup", "1", "--repeats", "1"]
    assert bench_own_time.main([*argv, "--k", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(index for index, line in enumerate(lines) if line.startswith("| batch | k |"))
    cells = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[header + 2 :]]
    tokens = {row[1]: float(row[6]) for row in cells}
    assert tokens["2"] == tokens["2, bare loop"] == 3.0  # every draft accepted: k + 1 tokens a step
    assert tokens["0"] == 1.0


def test_penalised_rows_are_a_table_of_their_own(tiny_models_dir, capsys, monkeypatch):
    """`--penalties`: every row's requests carry them, the drafting rows still take every draft, and no
    bare loop (which applies no rules) is in the table."""
    from handler.engine import SpeculativeEngine

    asked = []
    real = SpeculativeEngine.add_request

    def add_request(engine, request_id, request):
        asked.append(request.sampling.processes_logits)
        return real(engine, request_id, request)

    monkeypatch.setattr(SpeculativeEngine, "add_request", add_request)
    argv = ["--models", str(tiny_models_dir), "--batch-sizes", "1", "--steps", "2", "--warmup", "1", "--repeats", "1"]
    assert bench_own_time.main([*argv, "--penalties"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "greedy with penalties and a logit bias" in lines[0]
    header = next(index for index, line in enumerate(lines) if line.startswith("| batch | k |"))
    cells = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[header + 2 :]]
    tokens = {row[1]: float(row[6]) for row in cells}
    assert tokens == {"0": 1.0, "0, planned": tokens["0, planned"], "4": 5.0}
    assert asked and all(asked)
