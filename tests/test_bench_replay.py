"""The loop-efficiency measurement replays exactly the calls the engine made: replaying the recorded
graph calls gives the engine's own outputs, call for call."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import golden_path

from dspark.export.pipeline import export_pair
from dspark.runtime.api import Runtime, RuntimeOptions
from dspark.runtime.backend import BoundCall
from dspark.runtime.cost_model import StepCostModel
from dspark.runtime.prefix_scheduler import SchedulerConfig
from dspark.tools.bench.replay import RecordingBackend, loop_efficiency


def runtime() -> Runtime:
    root = golden_path("qwen3-tiny-vanilla")
    options = RuntimeOptions(scheduler=SchedulerConfig("fixed"), max_requests=1, max_seq_len=128)
    return Runtime.from_checkpoints(root / "target", root / "drafter", options,
                                    cost_model=StepCostModel(1e-3, 1e-4, 1e-4))


def ort_runtime(tmp_path) -> Runtime:
    root = golden_path("qwen3-tiny-vanilla")
    export_pair(root / "target", root / "drafter", tmp_path / "export", check=False)
    options = RuntimeOptions(scheduler=SchedulerConfig("fixed"), max_requests=1, max_seq_len=128)
    return Runtime.load(tmp_path / "export", options, cost_model=StepCostModel(1e-3, 1e-4, 1e-4))


@pytest.mark.parametrize("backend", ["pytorch", "onnxruntime fused"])
def test_replayed_calls_reproduce_the_engine_outputs(backend, tmp_path):
    """Plain calls and bound calls (the fused target: K/V updated in place, outputs in the engine's
    buffers) alike: each recorded call, replayed, gives what the engine got."""
    base = runtime() if backend == "pytorch" else ort_runtime(tmp_path)
    recorder = RecordingBackend(base.backend).open()
    outputs = []
    original_run, original_bind = recorder.inner.run, recorder.inner.bind

    def keep(graph, feeds):
        out = original_run(graph, feeds)
        outputs.append({k: np.array(np.asarray(v)) for k, v in out.items()})
        return out

    def keep_bound(graph, feeds, outs):
        call = original_bind(graph, feeds, outs)

        def run():
            call.run()
            outputs.append({k: np.array(v) for k, v in outs.items() if not any(v is f for f in feeds.values())})

        return BoundCall(graph, run, recorder.inner.times)

    recorder.inner.run, recorder.inner.bind = keep, keep_bound
    recorder.recording = True
    Runtime(recorder, base.info, base.options, cost_model=base.cost_model).generate([5, 6, 7, 8], max_new_tokens=12)
    recorder.recording = False
    recorder.inner.run, recorder.inner.bind = original_run, original_bind
    assert len(recorder.calls) == len(outputs) > 3
    bound = {graph for graph, _, slots in recorder.calls if slots is not None}
    fused = backend != "pytorch"  # ONNX Runtime: both fused graphs (greedy: the backbone joined to the heads), bound
    drafting = "drafter_draft_greedy_fused" if fused else "drafter_backbone"
    assert drafting in bound and ("target_fused" in bound) == fused
    for (graph, feeds, slots), want in zip(recorder.calls, outputs, strict=True):
        if slots is None:
            got = recorder.inner.run(graph, feeds)
        else:
            got = {name: feeds[alias] if alias else np.empty(shape, dtype)
                   for name, (alias, shape, dtype) in slots.items()}
            recorder.inner.bind(graph, feeds, got).run()
        for name, value in want.items():
            np.testing.assert_allclose(np.asarray(got[name]), value, atol=1e-5, err_msg=f"{graph}.{name}")


def test_loop_efficiency_reports_each_mode():
    result = loop_efficiency(runtime(), [[5, 6, 7, 8], [9, 10, 11]], max_new_tokens=8, stop=0, max_seq_len=64,
                             modes=("fixed", "off"), repeats=1)
    assert set(result) == {"fixed", "off"}
    for row in result.values():
        assert row["replay_ms_median"] > 0 and row["engine_ms_median"] > 0
        assert row["efficiency_min"] <= row["efficiency_median"]
    assert result["off"]["graph_calls_per_request"] == 8  # prefill + one target call per further token
