"""ONNX Runtime engines end to end on the golden vanilla pair: build, engine.json, SPS sanity,
--reprofile, the runtime driving an engine dir with its cost table and STS temperatures, the
bucket picked for each verification call, and STS on real draft rounds."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import golden_path, load_json

from dspark.engines import build as B
from dspark.engines import profiling
from dspark.engines.calibration_data import collect_rounds
from dspark.export import contract as C
from dspark.export.cost_table import CostTable
from dspark.export.engine_dir import EngineDir, load_engine_dir, read_engine_manifest
from dspark.export.manifest import graph_specs, read_manifest
from dspark.export.pipeline import export_pair
from dspark.runtime.api import Runtime, RuntimeOptions
from dspark.runtime.model_info import ModelInfo
from dspark.runtime.ort_backend import OrtBackend
from dspark.runtime.prefix_scheduler import SchedulerConfig
from dspark.tools.build_engine_command import build_engine as build_engine_cli
from dspark.tools.calibrate_command import calibrate as calibrate_cli

SET = "qwen3-tiny-vanilla"
BUCKETS = (1, 4, 16, 32)
OPTIONS = B.BuildOptions(buckets=BUCKETS, max_batch_tokens=32, max_batch=4, max_seq_len=256, profile_past=32,
                         warmup=1, repeats=3)


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("export")
    export_pair(golden_path(SET, "target"), golden_path(SET, "drafter"), out, check=False)
    return out


@pytest.fixture(scope="module")
def engine_dir(export_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("engine")
    B.build_engine(export_dir, out, OPTIONS)
    return out


def test_engine_dir_layout_and_manifest(engine_dir, export_dir):
    manifest = read_engine_manifest(engine_dir)  # schema-validated
    assert manifest["backend"] == "onnxruntime" and manifest["buckets"] == list(BUCKETS)
    assert manifest["limits"] == {"max_batch": 4, "max_seq_len": 256, "verify_width": 8, "max_batch_tokens": 32}
    assert set(manifest["graphs"]) == set(json.loads((export_dir / "export.json").read_text())["graphs"])
    engine = load_engine_dir(engine_dir, verify_files=True)
    assert engine.graph_path("target").is_file() and engine.contract_dir == engine_dir
    assert manifest["session"]["graph_optimization_level"] == "all" and engine.intra_op_threads == 1
    assert engine.intra_op_spinning is False  # built now: workers sleep between calls
    assert OrtBackend.for_engine(engine).options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    del manifest["session"]["intra_op_spinning"]  # an engine from before the setting ran ORT's default
    assert EngineDir(engine_dir, manifest).intra_op_spinning is True
    assert manifest["calibration"] is None and engine.confidence_temperatures is None


def test_sps_table_sanity(engine_dir):
    """What the build measured, without comparing timings (they move with the machine's load): the
    table's shape, real positive measurements where B >= R, and the lookups the scheduler makes."""
    engine = load_engine_dir(engine_dir)
    for graph in ("target", "target_static"):
        raw = engine.manifest["sps"]["tables"][graph]
        assert raw["batches"] == [1, 2, 4] and raw["buckets"] == list(BUCKETS)
        assert len(raw["draft_seconds"]) == 3 and all(0 < d < math.inf for d in raw["draft_seconds"])
        for r, row in zip(raw["batches"], raw["verify_seconds"], strict=True):
            assert all((v is None) == (b < r) for b, v in zip(BUCKETS, row, strict=True))
            assert all(0 < v < math.inf for v in row if v is not None)
        table = engine.cost_table(graph)
        assert table.to_dict() == raw
        # at each measured point: drafting plus the least measurement of the row from there on
        for draft, row, r in zip(raw["draft_seconds"], raw["verify_seconds"], raw["batches"], strict=True):
            for k, (b, v) in enumerate(zip(BUCKETS, row, strict=True)):
                if v is not None:
                    least = min(w for w in row[k:] if w is not None)
                    assert float(table.seconds(r, b)) == pytest.approx(draft + least, rel=1e-12)
        for r in (1, 2, 3, 4):
            costs = [float(table.seconds(r, b)) for b in range(r, 33)]
            assert costs == sorted(costs) and all(c > 0 for c in costs)
        assert float(table.sps(1, 1)) == pytest.approx(1 / float(table.seconds(1, 1)))


def test_profiler_records_what_it_measured(export_dir, monkeypatch):
    """The profiler with an injected timer (engines.profiling.time_row replaced): each table entry is
    the time measured for its own (graph, R, B) point, with the feeds shaped [R, ceil(B / R)]; a row's plain
    verification, its longer ones and its drafting are timed together."""
    specs = graph_specs(read_manifest(export_dir))
    calls: list[tuple[str, dict[str, tuple[int, ...]]]] = []

    def run(graph, feeds):
        calls.append((graph, {name: value.shape for name, value in feeds.items()}))

    def timer(plain, verifies, draft, *, warmup, repeats):
        assert (warmup, repeats) == (3, 4)
        seconds = []
        for call in (plain, *verifies, draft):
            first = len(calls)
            call()
            seconds.append(fake_seconds(calls[first:]))
        assert len({shapes["input_ids"][0] for graph, shapes in calls[-len(seconds):-1]}) == 1  # one R per row
        return seconds[0], seconds[1:-1], seconds[-1]

    def fake_seconds(made) -> float:
        if made[0][0] in (C.BACKBONE, C.BACKBONE_FUSED, C.DRAFT_GREEDY_FUSED):  # drafting as the runtime drafts
            assert [g for g, _ in made] == [C.DRAFT_GREEDY_FUSED]  # a greedy batch: backbone and heads in one call
            return 1e-2 * made[0][1]["block_ids"][0]
        ((graph, shapes),) = made
        rows, tokens = shapes["input_ids"]
        return (2e-3 if graph == C.TARGET_STATIC else 1e-3) * rows + 1e-4 * rows * tokens

    monkeypatch.setattr(profiling, "time_row", timer)
    section = profiling.profile_section(run, specs, vocab_size=512, block_size=7, batches=(1, 2, 4),
                                        buckets=BUCKETS, past=32, warmup=3, repeats=4)
    assert (section["warmup"], section["repeats"], section["past"]) == (3, 4, 32)
    assert set(section["tables"]) == {C.TARGET, C.TARGET_STATIC, C.TARGET_FUSED}
    for graph, raw in section["tables"].items():
        per_row = 2e-3 if graph == C.TARGET_STATIC else 1e-3
        for r, row in zip((1, 2, 4), raw["verify_seconds"], strict=True):
            want = [None if b < r else per_row * r + 1e-4 * r * math.ceil(b / r) for b in BUCKETS]
            assert row == want, (graph, r)
        assert raw["draft_seconds"] == [1e-2, 2e-2, 4e-2]
        table = CostTable.from_dict(raw)
        assert float(table.seconds(4, 16)) == pytest.approx(4e-2 + per_row * 4 + 1e-4 * 16, rel=1e-12)


def test_reprofile_rewrites_only_the_table(engine_dir, tmp_path):
    manifest = read_engine_manifest(engine_dir)
    copy = tmp_path / "engine"
    copy.mkdir()
    for path in engine_dir.rglob("*"):
        if path.is_file():
            (copy / path.relative_to(engine_dir)).parent.mkdir(parents=True, exist_ok=True)
            (copy / path.relative_to(engine_dir)).write_bytes(path.read_bytes())
    stale = json.loads((copy / "engine.json").read_text())
    stale["sps"]["tables"]["target"]["verify_seconds"][0][0] = 123.0
    stale["sps"]["measured_at"] = "stale"
    (copy / "engine.json").write_text(json.dumps(stale))
    result = CliRunner().invoke(build_engine_cli, [manifest["export"]["dir"], "--out", str(copy), "--reprofile",
                                                   "--repeats", "2", "--quiet"])
    assert result.exit_code == 0, result.output
    fresh = read_engine_manifest(copy)
    assert fresh["sps"]["measured_at"] != "stale" and fresh["sps"]["tables"]["target"]["verify_seconds"][0][0] < 1
    assert fresh["sps"]["repeats"] == 2
    assert {k: v for k, v in fresh.items() if k != "sps"} == {k: v for k, v in manifest.items() if k != "sps"}


class RecordingBackend(OrtBackend):
    """Records the [R, T] shape of every target verification call."""

    calls: list[tuple[int, int]]

    def _run(self, graph, feeds):
        if graph == "target":
            self.calls.append(tuple(feeds["input_ids"].shape))
        return super()._run(graph, feeds)


def test_runtime_on_engine_dir_is_lossless_and_each_call_has_a_bucket(engine_dir):
    engine = load_engine_dir(engine_dir)
    traces = load_json(golden_path(SET, "traces.json"))
    backend = RecordingBackend(engine.contract_dir, intra_op_threads=engine.intra_op_threads)
    backend.calls = []
    options = RuntimeOptions(scheduler=SchedulerConfig("dspark"), kv_mode="concat", max_requests=4, max_seq_len=256)
    runtime = Runtime(backend, ModelInfo.from_manifest(backend.manifest), options, engine.cost_model("concat"))
    results = runtime.generate([s["prompt_ids"] for s in traces["samples"]], max_new_tokens=64)
    for result, sample in zip(results, traces["samples"], strict=True):
        assert result.tokens == sample["generated_ids"][:64]  # the golden greedy output: lossless
    steps = [(r, t) for r, t in backend.calls if t <= 8]  # verification calls (prefill rows are longer)
    assert steps
    for r, t in steps:
        k = engine.bucket_for(r * t)
        assert BUCKETS[k] >= r * t and (k == 0 or BUCKETS[k - 1] < r * t)
    assert Runtime.load(engine_dir, options, cost_model=engine.cost_model()).generate(
        traces["samples"][1]["prompt_ids"], max_new_tokens=16)[0].tokens == traces["samples"][1]["generated_ids"][:16]


@pytest.mark.parametrize("kv_mode", ["fused", "concat"])
def test_plain_decoding_on_the_engine_is_the_targets_greedy(engine_dir, kv_mode):
    """Scheduler off, greedy (BatchEngine's plain step): every request of a batch, arriving together,
    gets the target's own greedy tokens (the golden traces' output is the target's greedy)."""
    samples = load_json(golden_path(SET, "traces.json"))["samples"]
    options = RuntimeOptions(scheduler=SchedulerConfig("off"), kv_mode=kv_mode, max_requests=4, max_seq_len=256)
    with Runtime.load(engine_dir, options) as runtime:
        results = runtime.generate([s["prompt_ids"] for s in samples], max_new_tokens=48)
        assert all(set(r.acceptance_lengths) == {1} for r in results)  # one token a step
        for result, sample in zip(results, samples, strict=True):
            assert result.tokens == sample["generated_ids"][:48]


def test_runtime_load_uses_the_engine_table_and_temperatures(engine_dir, tmp_path, monkeypatch):
    import dspark.runtime.api as api

    def no_profiling(*args, **kwargs):
        raise AssertionError("an engine dir must not be re-profiled at start-up")

    monkeypatch.setattr(api, "profile_step_cost", no_profiling)
    calibrated = tmp_path / "engine"
    shutil.copytree(engine_dir, calibrated)
    manifest = json.loads((calibrated / "engine.json").read_text())
    manifest["calibration"] = {"temperatures": [1.5] * 7, "ece_before": [0.2] * 7, "ece_after": [0.1] * 7}
    (calibrated / "engine.json").write_text(json.dumps(manifest))
    engine = load_engine_dir(calibrated)
    runtime = Runtime.load(calibrated, RuntimeOptions(max_requests=2, max_seq_len=128))
    assert engine.kv_mode == runtime.options.kv_mode == "fused"  # the ORT engine drives the fused target
    assert runtime.cost_model.to_dict() == engine.cost_model("fused").to_dict() != engine.cost_model("concat").to_dict()
    assert runtime.options.scheduler.confidence_temperatures == (1.5,) * 7
    prompt = load_json(golden_path(SET, "traces.json"))["samples"][0]
    assert runtime.generate(prompt["prompt_ids"], max_new_tokens=16)[0].tokens == prompt["generated_ids"][:16]


def trace_windows() -> list[list[int]]:
    """In-distribution prompts: 8-token windows over the golden prompts' greedy continuations."""
    samples = load_json(golden_path(SET, "traces.json"))["samples"]
    return [s["prompt_ids"][-4:] + s["generated_ids"][i : i + 4] for s in samples for i in range(0, 56, 4)]


def test_sts_on_the_golden_drafter_lowers_ece(engine_dir, export_dir, tmp_path):
    backend = OrtBackend(engine_dir, intra_op_threads=1)
    info = ModelInfo.from_manifest(backend.manifest)
    logits, accepted = collect_rounds(backend, info, trace_windows(), prompt_len=8, max_new_tokens=32)
    assert logits.shape == (accepted.shape[0], 7) and accepted.min() >= 0 and accepted.max() <= 7
    half = len(accepted) // 2
    result = B.fit_sts(logits[:half], accepted[:half])
    assert np.mean(result.ece_after) < np.mean(result.ece_before)
    held = B.evaluate(result, logits[half:], accepted[half:])
    assert held["ece_after_mean"] < held["ece_before_mean"]
    # the same through `dspark calibrate`, into engine.json and calibration.png
    data = tmp_path / "data.txt"
    data.write_text("\n".join(" ".join(map(str, p)) for p in trace_windows()))
    copy = tmp_path / "engine"
    B.build_engine(export_dir, copy, B.BuildOptions(buckets=(1, 8), max_batch_tokens=8, max_batch=2,
                                                    max_seq_len=128, warmup=0, repeats=1))
    out = CliRunner().invoke(calibrate_cli, [str(copy), str(data), "--prompt-len", "8", "--max-new-tokens", "32"])
    assert out.exit_code == 0, out.output
    cal = read_engine_manifest(copy)["calibration"]
    assert len(cal["temperatures"]) == 7 and cal["ece_after_mean"] < cal["ece_before_mean"]
    assert cal["holdout"]["samples"] > 0 and (copy / "calibration.png").is_file()
    assert load_engine_dir(copy).confidence_temperatures == tuple(cal["temperatures"])
