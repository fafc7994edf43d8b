"""Measuring the cost table on the tiny pair, and its cache in the model dir."""

from __future__ import annotations

import json
import time

import torch

from handler.planning import cost_table, measure
from handler.planning.measure import measure_cost_table


def test_measures_every_grid_point_in_a_couple_of_seconds(tiny_pair):
    target, draft, _ = tiny_pair
    start = time.perf_counter()
    table = measure_cost_table(target, draft, max_width=9, max_batch_size=4)
    assert time.perf_counter() - start < 30  # generous: the machine is shared; typically well under 2 s
    assert table.widths == (1, 2, 3, 4, 8, 9) and table.batch_sizes == (1, 2, 4)
    for row in table.target:
        assert all(seconds > 0 for seconds in row)
        assert list(row) == sorted(row)  # never cheaper for a wider chunk
    for column in zip(*table.target):
        assert list(column) == sorted(column)  # nor for a bigger batch
    assert table.draft is not None and all(seconds > 0 for seconds in table.draft)
    assert table.target_seconds(3, 5) > 0 and table.draft_seconds(3) > 0


def test_without_a_draft_only_the_target_is_timed(tiny_pair):
    target, _, _ = tiny_pair
    table = measure_cost_table(target, None, max_width=3, max_batch_size=1, repeats=1, warmups=0)
    assert table.draft is None and table.widths == (1, 2, 3) and table.batch_sizes == (1,)


def test_the_cache_is_read_back_and_a_stale_key_re_measures(tiny_pair, tmp_path, monkeypatch):
    target, draft, _ = tiny_pair
    first = measure_cost_table(target, draft, 3, 2, repeats=1, warmups=0, cache_dir=str(tmp_path), model_identity="m/1")
    assert len(list(tmp_path.glob("cost_table-*.json"))) == 1

    calls = []
    real_time_grid = measure._time_grid

    def counting_time_grid(*args, **kwargs):
        calls.append(args[2:4])
        return real_time_grid(*args, **kwargs)

    monkeypatch.setattr(measure, "_time_grid", counting_time_grid)
    again = measure_cost_table(target, draft, 3, 2, repeats=1, warmups=0, cache_dir=str(tmp_path), model_identity="m/1")
    assert again == first and calls == []

    # Another archive, another grid, another thread count or another draft: each is measured anew.
    measure_cost_table(target, draft, 3, 2, repeats=1, warmups=0, cache_dir=str(tmp_path), model_identity="m/2")
    measure_cost_table(target, draft, 5, 2, repeats=1, warmups=0, cache_dir=str(tmp_path), model_identity="m/1")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        measure_cost_table(target, draft, 3, 2, repeats=1, warmups=0, cache_dir=str(tmp_path), model_identity="m/1")
    finally:
        torch.set_num_threads(threads)
    measure_cost_table(target, None, 3, 2, repeats=1, warmups=0, cache_dir=str(tmp_path), model_identity="m/1")
    assert len(calls) == 4
    assert len(list(tmp_path.glob("cost_table-*.json"))) == 5


def test_a_corrupt_or_foreign_cache_file_is_ignored(tiny_pair, tmp_path):
    target, _, _ = tiny_pair
    table = measure_cost_table(target, None, 2, 1, repeats=1, warmups=0, cache_dir=str(tmp_path))
    (path,) = tmp_path.glob("cost_table-*.json")
    path.write_text("{not json")
    again = measure_cost_table(target, None, 2, 1, repeats=1, warmups=0, cache_dir=str(tmp_path))
    assert again.widths == table.widths
    assert path.read_text().startswith("{")  # rewritten with a valid table
    assert cost_table.CostTable.from_json(json.loads(path.read_text())["table"]).widths == (1, 2)


def test_an_unwritable_cache_folder_only_warns(tiny_pair, tmp_path):
    target, _, _ = tiny_pair
    missing = tmp_path / "no-such-folder"
    table = measure_cost_table(target, None, 2, 1, repeats=1, warmups=0, cache_dir=str(missing))
    assert table.widths == (1, 2)
