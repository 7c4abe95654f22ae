"""Prefill bindings of the fused target (`target_runner.PREFILL_BINDING_BYTES`): a prompt width seen before reuses
its binding, the kept layouts stay under their byte budget (least recently used out first), and the output is the
target's greedy whether a binding was kept, reused or made afresh."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import golden_path

from dspark.export import contract as C
from dspark.export.pipeline import export_pair
from dspark.models import load_pair
from dspark.runtime import target_runner
from dspark.runtime.batch_loop import BatchEngine
from dspark.runtime.capacity import Capacity
from dspark.runtime.model_info import ModelInfo
from dspark.runtime.ort_backend import OrtBackend
from dspark.runtime.prefix_scheduler import SchedulerConfig
from dspark.runtime.reference_decoder import autoregressive_generate

pytestmark = pytest.mark.usefixtures("one_thread")
SET = "qwen3-tiny-vanilla"


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    out = tmp_path_factory.mktemp("export")
    export_pair(golden_path(SET, "target"), golden_path(SET, "drafter"), out, check=False, show_progress=False)
    with OrtBackend(out, intra_op_threads=1) as opened:
        yield opened


def _engine(backend: OrtBackend) -> BatchEngine:
    engine = BatchEngine(backend, ModelInfo.from_manifest(backend.manifest), capacity=Capacity(2, 2 * 64, 64),
                         scheduler=SchedulerConfig("fixed"))
    assert engine.target.kv_mode == "fused"
    return engine


def _prefill_binds(backend: OrtBackend, monkeypatch) -> list[int]:
    """The batch size of every prefill binding of the fused target made from now on."""
    made, bind = [], backend.bind

    def counting(graph, feeds, outputs):
        if graph == C.TARGET_FUSED and "logits_rows" in feeds and feeds["logits_rows"].shape[1] == 1:
            made.append(feeds["input_ids"].shape[1])
        return bind(graph, feeds, outputs)

    monkeypatch.setattr(backend, "bind", counting)
    return made


def _greedy(prompts: list[list[int]], new: int) -> list[list[int]]:
    target, _ = load_pair(golden_path(SET, "target"), golden_path(SET, "drafter"))
    return [autoregressive_generate(target, p, max_new_tokens=new) for p in prompts]


def test_a_prompt_width_seen_before_reuses_its_binding(backend, monkeypatch):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 500, n).tolist() for n in (9, 9, 12, 9)]
    made = _prefill_binds(backend, monkeypatch)
    engine, got = _engine(backend), []
    for prompt in prompts:  # one at a time: every prefill on slot row 0
        rid = engine.submit(prompt, max_new_tokens=6)
        got.append(engine.run_until_done()[rid].tokens)
    assert made == [9, 12]  # widths 9 and 12 bound once each; the second and fourth prompts reused width 9's
    assert got == _greedy(prompts, 6)


def test_kept_bindings_stay_under_their_budget(backend, monkeypatch):
    """Prompts wider than the shared buffers (16 positions here) own their features; a budget that holds one
    such layout: widths 20, 24, 20 bind three times, and one binding is kept."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(2, 500, n).tolist() for n in (20, 24, 20)]
    made = _prefill_binds(backend, monkeypatch)
    engine = _engine(backend)
    assert engine.target._max_tokens < 20
    one = engine.target._feature_buf.itemsize * 24 * engine.target._features + 24 * 8 * 2
    monkeypatch.setattr(target_runner, "PREFILL_BINDING_BYTES", one)
    got = []
    for prompt in prompts:
        rid = engine.submit(prompt, max_new_tokens=6)
        got.append(engine.run_until_done()[rid].tokens)
    assert made == [20, 24, 20]
    assert len(engine.target._prefills) == 1 and engine.target._prefill_bytes <= one
    assert got == _greedy(prompts, 6)


def test_kept_bindings_are_counted_too(backend, monkeypatch):
    """Narrow prompts own next to nothing: the count cap keeps their layouts from piling up."""
    monkeypatch.setattr(target_runner, "PREFILL_BINDINGS", 2)
    made = _prefill_binds(backend, monkeypatch)
    engine, rng = _engine(backend), np.random.default_rng(2)
    for n in (5, 6, 7, 5):
        engine.submit(rng.integers(2, 500, n).tolist(), max_new_tokens=2)
        engine.run_until_done()
    assert made == [5, 6, 7, 5] and list(engine.target._prefills) == [(1, 7, 0), (1, 5, 0)]
