"""How close the decode loop runs to its own graphs' speed: record every graph call of a run,
replay the very same calls back to back on the same backend, and divide.

    efficiency = replay seconds / engine seconds

1.0 means the loop adds nothing between graph calls; the rest is host glue (feed building, KV
commit, scheduling, acceptance). Both runs use the same loaded sessions and the same feeds
(recorded in a second, untimed run of the same greedy request), interleaved prompt by prompt.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dspark.runtime.api import Runtime, RuntimeOptions
from dspark.runtime.backend import Array, Backend, BoundCall, WrappedBackend, as_torch
from dspark.runtime.prefix_scheduler import SchedulerConfig

# an output of a bound call: the name of the feed it aliases (a buffer updated in place), or its shape and dtype
OutputSlot = tuple[str | None, tuple[int, ...], np.dtype]


class RecordingBackend(WrappedBackend):
    """Passes every call to `inner` and, while `recording`, keeps a copy of its feeds. Bound calls
    (`bind`) are recorded as bound calls, with which outputs alias which feeds, so the replay
    makes them the way the engine does."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)  # the inner backend belongs to its runtime, which closes it
        self.calls: list[tuple[str, dict[str, np.ndarray], dict[str, OutputSlot] | None]] = []
        self.recording = False

    def _run(self, graph: str, feeds: Mapping[str, Array]) -> dict[str, Array]:
        if self.recording:
            self.calls.append((graph, {k: as_torch(v).numpy().copy() for k, v in feeds.items()}, None))
        return self.inner.run(graph, feeds)

    def bind(self, graph: str, feeds: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> BoundCall:
        inner = self.inner.bind(graph, feeds, outputs)
        slots = {name: (next((f for f, a in feeds.items() if a is array), None), array.shape, array.dtype)
                 for name, array in outputs.items()}

        def call() -> None:
            if self.recording:  # the feeds as they are at this run (the engine refills them in place)
                self.calls.append((graph, {k: np.array(v) for k, v in feeds.items()}, slots))
            inner.run()

        return BoundCall(graph, call, self.times)

    def replay(self) -> float:
        """Seconds to run the recorded calls back to back (feeds unchecked, as the engine's are;
        bound calls bound beforehand, untimed, as the engine binds them once)."""
        check, self.inner.check_inputs = self.inner.check_inputs, False
        calls = []
        for graph, feeds, slots in self.calls:
            if slots is None:
                calls.append(lambda g=graph, f=feeds: self.inner.run(g, f))
                continue
            outputs = {name: feeds[alias] if alias else np.empty(shape, dtype)
                       for name, (alias, shape, dtype) in slots.items()}
            calls.append(self.inner.bind(graph, feeds, outputs).run)
        begin = time.perf_counter()
        for call in calls:
            call()
        seconds = time.perf_counter() - begin
        self.inner.check_inputs = check
        return seconds


def loop_efficiency(base: Runtime, prompts: Sequence[list[int]], *, max_new_tokens: int, stop: int,
                    max_seq_len: int, modes: Sequence[str] = ("dspark", "off"), repeats: int = 3) -> dict[str, Any]:
    """Per scheduler mode: engine seconds and replay seconds of the same graph calls, min and
    median over `repeats` passes of every prompt, and their ratio."""
    recorder = RecordingBackend(base.backend).open()
    out: dict[str, Any] = {}
    for mode in modes:
        options = RuntimeOptions(scheduler=SchedulerConfig(mode), max_requests=1, max_seq_len=max_seq_len,
                                 kv_mode=base.options.kv_mode)
        runtime = Runtime(recorder, base.info, options, cost_model=base.cost_model)
        ratios, engine_s, replay_s = [], [], []
        runtime.generate(prompts[0], max_new_tokens=4, stop=(stop,))  # warm-up
        for _ in range(repeats):
            for prompt in prompts:
                begin = time.perf_counter()
                runtime.generate(prompt, max_new_tokens=max_new_tokens, stop=(stop,))
                engine = time.perf_counter() - begin
                # Greedy runs repeat exactly: record the same calls in a second, untimed run, so the
                # copies the recording makes do not count against the engine.
                recorder.calls.clear()
                recorder.recording = True
                runtime.generate(prompt, max_new_tokens=max_new_tokens, stop=(stop,))
                recorder.recording = False
                replay = recorder.replay()
                engine_s.append(engine)
                replay_s.append(replay)
                ratios.append(replay / engine)
        runtime.detach()
        out[mode] = {"efficiency_min": round(float(np.min(ratios)), 3),
                     "efficiency_median": round(float(np.median(ratios)), 3),
                     "engine_ms_median": round(1e3 * float(np.median(engine_s)), 3),
                     "replay_ms_median": round(1e3 * float(np.median(replay_s)), 3),
                     "graph_calls_per_request": len(recorder.calls)}
    return out
