"""`time_interleaved`: the calls of one profiled row share the machine's load, so their ratios hold."""

from __future__ import annotations

import pytest

from dspark.runtime import cost_model
from dspark.runtime.cost_model import time_interleaved, time_median


class DriftingMachine:
    """A fake clock whose calls cost `work × load`, where the load doubles after `calm` seconds: a
    competing process that starts partway through the profile."""

    def __init__(self, calm: float) -> None:
        self.now, self.calm, self.order = 0.0, calm, []

    def perf_counter(self) -> float:
        return self.now

    def call(self, name: str, work: float):
        def run() -> None:
            self.order.append(name)
            self.now += work * (1.0 if self.now < self.calm else 2.0)
        return run


@pytest.fixture
def machine(monkeypatch) -> DriftingMachine:
    fake = DriftingMachine(calm=20.0)
    monkeypatch.setattr(cost_model, "time", fake)
    return fake


def test_interleaved_rounds_keep_the_ratio_of_calls_a_load_change_splits(machine):
    one, four = machine.call("one", 1.0), machine.call("four", 1.5)
    seconds = time_interleaved([one, four], warmup=1, repeats=15)
    assert seconds[1] / seconds[0] == pytest.approx(1.5)
    # the control: timed one after the other, the first call sees the calm and the second the load
    machine.now = 0.0
    apart = [time_median(one, warmup=1, repeats=15), time_median(four, warmup=1, repeats=15)]
    assert apart[1] / apart[0] == pytest.approx(3.0)


def test_each_round_starts_one_call_later(machine):
    calls = [machine.call(name, 0.1) for name in "abc"]
    time_interleaved(calls, warmup=1, repeats=3)
    assert "".join(machine.order) == "abc" + "abc" + "bca" + "cab"


def test_median_per_call_and_repeats_checked(machine):
    assert time_interleaved([machine.call("a", 0.5)], warmup=0, repeats=3) == [0.5]
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        time_interleaved([machine.call("a", 0.5)], repeats=0)
