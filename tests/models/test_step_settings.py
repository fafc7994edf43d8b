"""A step's sampling settings: built once from a join or a leave of rows to the next (`Batch.version`), float32."""

from __future__ import annotations

import dataclasses

from handler.engine import EngineOptions
from handler.sampler import SamplingBatch

from .conftest import make_engine
from .test_engine import GREEDY, SAMPLED
from .test_overlapped_steps import drive, workload


def test_a_batchs_sampling_settings_are_rebuilt_only_when_rows_join_or_leave(tiny_pair, monkeypatch):
    """Greedy and seeded sampled rows join and leave: every step's settings are its rows' own, in order, one
    object from a join or a leave to the next, and the streams are those of settings built at every step."""
    target, draft, tokenizer = tiny_pair
    joins = workload(tokenizer, SAMPLED, 3, seed=5)
    joins[3] = [(request_id, dataclasses.replace(request, sampling=GREEDY)) for request_id, request in joins[3]]
    engine = make_engine(target, draft, tokenizer, options=EngineOptions(running_costs=False))
    seen = []
    plan = engine._plan

    def checked_plan(rows, sampling):
        assert sampling.params == tuple(row.request.sampling for row in rows)
        seen.append((engine.batch.version, id(sampling)))
        return plan(rows, sampling)

    monkeypatch.setattr(engine, "_plan", checked_plan)
    streamed, _ = drive(engine, joins)
    assert len({version for version, _ in seen}) == len(set(seen)) < len(seen)  # one object a version
    # The same streams where every step builds its own settings.
    rebuilt = make_engine(target, draft, tokenizer, options=EngineOptions(running_costs=False))
    monkeypatch.setattr(type(rebuilt), "_batch_sampling", _fresh_sampling)
    assert drive(rebuilt, joins)[0] == streamed


def _fresh_sampling(engine):
    return SamplingBatch.from_params([row.request.sampling for row in engine.batch.rows], engine.device)
