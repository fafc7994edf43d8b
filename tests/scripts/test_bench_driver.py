"""The load driver's clocks (`scripts.bench.runner.Driver`, `drive`, `drive_interleaved`).

Engines stepped in turn must each be timed by their own steps only, and an open loop's idle
wait must move the clock without sleeping. The fake engines here advance a fake
`time.perf_counter` by a fixed cost a step, so the clocks are checked exactly, not timed.
"""

from __future__ import annotations

import pytest

from handler.engine.record import StepLog, StepRecord
from handler.types import GenerationRequest
from scripts.bench import runner as bench_runner
from tests.unit.fake_engine import FakeEngine


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


class CostlyEngine(FakeEngine):
    """The fake engine, with a step log, whose every step costs `step_seconds` on `clock`."""

    def __init__(self, clock: FakeClock, step_seconds: float, tokens_per_step: int) -> None:
        super().__init__(tokens_per_step=tokens_per_step)
        self.clock, self.step_seconds, self.steps = clock, step_seconds, StepLog()

    def step(self):
        self.clock.now += self.step_seconds
        outputs = super().step()
        self.steps.num_steps += 1
        self.steps.recent_steps.append(StepRecord(len(outputs), (0,) * len(outputs), 0, self.step_seconds, 0, 0, 0))
        return outputs


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(bench_runner.time, "perf_counter", fake.perf_counter)
    monkeypatch.setattr(bench_runner.time, "sleep", lambda seconds: pytest.fail("the driver slept"))
    return fake


def _requests(num: int, max_new_tokens: int) -> list[GenerationRequest]:
    return [GenerationRequest((i + 1,), max_new_tokens) for i in range(num)]


def test_interleaved_engines_each_count_only_their_own_steps(clock):
    slow = CostlyEngine(clock, step_seconds=3.0, tokens_per_step=1)
    fast = CostlyEngine(clock, step_seconds=1.0, tokens_per_step=2)
    order = []
    slow.step = _logged(slow.step, order, "slow")
    fast.step = _logged(fast.step, order, "fast")
    drivers = [bench_runner.Driver(engine, _requests(4, 4), None, 2) for engine in (slow, fast)]
    slow_traffic, fast_traffic = bench_runner.drive_interleaved(drivers)
    # Closed loop at 2 in flight, 4 requests of 4 tokens: the slow engine (1 token a step) takes 8
    # steps, the fast one (2 a step) 4; they alternate while both have work.
    assert order == ["slow", "fast"] * 4 + ["slow"] * 4
    assert slow_traffic.done_at == [12.0, 12.0, 24.0, 24.0]
    assert fast_traffic.done_at == [2.0, 2.0, 4.0, 4.0]
    assert fast_traffic.sent == [0.0, 0.0, 2.0, 2.0] and fast_traffic.first_at == [1.0, 1.0, 3.0, 3.0]
    assert [len(result.token_ids) for result in slow_traffic.results] == [4] * 4
    assert len(slow_traffic.steps) == 8 and len(fast_traffic.steps) == 4
    assert slow_traffic.emitted[:3] == [(3.0, 2), (6.0, 2), (9.0, 2)]
    assert fast_traffic.step_tokens == [4, 4, 4, 4]
    # Both clients' last requests end in the same step: the load held to the end.
    assert slow_traffic.steady_tokens_per_s() == 16 / 24.0
    assert fast_traffic.steady_tokens_per_s() == 16 / 4.0


def test_held_load_ends_where_the_first_client_is_left_without_a_request(clock):
    engine = CostlyEngine(clock, step_seconds=1.0, tokens_per_step=1)
    requests = [GenerationRequest((1,), 2), GenerationRequest((2,), 6), GenerationRequest((3,), 2)]
    traffic = bench_runner.drive(engine, requests, None, 2)
    # Request 2 is sent at 2 s, when request 0 ends, and ends at 4 s; request 1 then drains alone.
    assert traffic.sent == [0.0, 0.0, 2.0] and traffic.done_at == [2.0, 6.0, 4.0]
    assert engine.rows_per_step == [2, 2, 2, 2, 1, 1]
    assert traffic.steady_tokens_per_s() == 8 / 4.0  # against 10 / 6.0 over the makespan


def test_an_idle_wait_moves_the_clock_to_the_next_arrival_without_sleeping(clock):
    engine = CostlyEngine(clock, step_seconds=1.0, tokens_per_step=1)
    traffic = bench_runner.drive(engine, _requests(2, 2), [0.0, 50.0], 4)
    assert traffic.sent == [0.0, 50.0]
    assert traffic.done_at == [2.0, 52.0]
    assert traffic.ttft() == [1.0, 1.0]


def test_a_request_arriving_mid_step_joins_at_the_next_boundary(clock):
    engine = CostlyEngine(clock, step_seconds=1.0, tokens_per_step=1)
    traffic = bench_runner.drive(engine, _requests(2, 3), [0.0, 0.5], 4)
    assert engine.rows_per_step == [1, 2, 2, 1]
    assert traffic.first_at == [1.0, 2.0] and traffic.done_at == [3.0, 4.0]


def _logged(step, order: list[str], name: str):
    def logged_step():
        order.append(name)
        return step()

    return logged_step
