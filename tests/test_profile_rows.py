"""`time_row`: the profiler times a row's graph calls where the engine's loop runs them, in rounds."""

from __future__ import annotations

import numpy as np
import pytest

from dspark.engines import profiling
from dspark.engines.profiling import graph_call, time_row
from dspark.export import contract as C
from dspark.runtime.cost_model import time_median


class SharedCacheMachine:
    """A fake clock: a call costs `work`, 1.5x that when another graph ran just before it (its weights were
    evicted), and twice all that once the clock passes `calm` (a competing process starts)."""

    def __init__(self, calm: float = float("inf")) -> None:
        self.now, self.calm, self.order, self.last = 0.0, calm, [], None

    def perf_counter(self) -> float:
        return self.now

    def call(self, name: str, graph: str, work: float):
        def run() -> None:
            cold = 1.5 if self.last not in (None, graph) else 1.0
            self.now += work * cold * (1.0 if self.now < self.calm else 2.0)
            self.order.append(name)
            self.last = graph
        return run


def _row(machine: SharedCacheMachine):
    verifies = [machine.call("v4", "target", 1.5), machine.call("v8", "target", 2.0)]
    return machine.call("plain", "target", 1.0), verifies, machine.call("draft", "drafter", 3.0)


def test_each_call_is_timed_where_the_loop_runs_it(monkeypatch):
    machine = SharedCacheMachine()
    monkeypatch.setattr(profiling, "time", machine)
    plain, verifies, draft = _row(machine)
    assert time_row(plain, verifies, draft, warmup=0, repeats=5) == (1.0, [2.25, 3.0], 4.5)
    # the control: called back to back, every call looks as cheap as a warm cache makes it
    monkeypatch.setattr("dspark.runtime.cost_model.time", machine)
    assert time_median(draft, warmup=1, repeats=5) == 3.0 and time_median(verifies[1], warmup=1, repeats=5) == 2.0


def test_rounds_rotate_the_verifications_after_a_plain_pair(monkeypatch):
    machine = SharedCacheMachine()
    monkeypatch.setattr(profiling, "time", machine)
    plain, verifies, draft = _row(machine)
    time_row(plain, verifies, draft, warmup=1, repeats=2)
    assert machine.order == ["plain", "v4", "v8", "draft",
                             "plain", "plain", "draft", "v4", "draft", "v8",
                             "plain", "plain", "draft", "v8", "draft", "v4"]
    machine.order.clear()
    time_row(plain, [], draft, warmup=0, repeats=1)  # no longer verification fits: drafting still after a plain one
    assert machine.order == ["plain", "plain", "draft"]


def test_a_load_change_moves_a_rows_cells_together(monkeypatch):
    machine = SharedCacheMachine(calm=30.0)
    monkeypatch.setattr(profiling, "time", machine)
    plain, verifies, draft = _row(machine)
    seconds_plain, (v4, v8), seconds_draft = time_row(plain, verifies, draft, warmup=1, repeats=9)
    assert (v4 / seconds_plain, v8 / seconds_plain, seconds_draft / seconds_plain) == pytest.approx((2.25, 3.0, 4.5))


def test_repeats_checked():
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        time_row(lambda: None, [], lambda: None, warmup=0, repeats=0)


def test_graphs_the_runtime_binds_are_bound_with_their_present_kv_in_the_past_buffers():
    made = []

    def run(graph, feeds):
        made.append(("run", graph))
        present = {"present.0.key": feeds["past_key_values.0.key"] + 1} if "past_key_values.0.key" in feeds else {}
        return {"logits": np.zeros((1, 2, 5), np.float32), **present}

    def bind(graph, feeds, outputs):
        made.append(("bind", graph, feeds, outputs))
        return type("Bound", (), {"run": lambda self: made.append(("bound run", graph))})()

    past = np.zeros((1, 2, 9, 4), np.float32)[:, :, :, ::2]  # not contiguous, as a broadcast feed can be
    ids = np.zeros((1, 2), np.int64)
    call = graph_call(run, bind, C.TARGET_FUSED, {"input_ids": ids, "past_key_values.0.key": past})
    (_, _, feeds, outputs) = made[-1]
    assert outputs["present.0.key"] is feeds["past_key_values.0.key"]  # written in place, as the runtime binds
    assert feeds["past_key_values.0.key"].flags.c_contiguous and outputs["logits"].shape == (1, 2, 5)
    call()
    assert made[-1] == ("bound run", C.TARGET_FUSED)
    made.clear()
    graph_call(run, bind, C.TARGET, {"input_ids": np.zeros((1, 2), np.int64)})()  # run with fresh feeds, not bound
    graph_call(run, None, C.TARGET_FUSED, {"input_ids": np.zeros((1, 2), np.int64)})()  # no bind given
    assert made == [("run", C.TARGET), ("run", C.TARGET_FUSED)]
