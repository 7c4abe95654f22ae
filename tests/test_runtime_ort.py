"""The ONNX Runtime backend on a real `dspark-export` of the golden pair: golden traces (ids and
per-round accepted lengths, fixed γ = block size), greedy equality with mid-flight arrivals and
sampling stream for stream against the PyTorch models, through every target graph: the fused one
(keys/values appended in place), the static-cache one and the concat one."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import golden_path, load_json

from dspark.export.pipeline import export_pair
from dspark.models import load_pair
from dspark.runtime.backend import BackendError
from dspark.runtime.batch_loop import BatchEngine
from dspark.runtime.capacity import Capacity
from dspark.runtime.cost_model import StepCostModel
from dspark.runtime.model_info import ModelInfo
from dspark.runtime.ort_backend import OrtBackend
from dspark.runtime.prefix_scheduler import SchedulerConfig
from dspark.runtime.reference_decoder import autoregressive_generate
from dspark.runtime.step_batch import StepBatch

SET = "qwen3-tiny-vanilla"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("export")
    export_pair(golden_path(SET, "target"), golden_path(SET, "drafter"), out, check=False,
                flavours=("plain", "fused", "packed"))
    return OrtBackend(out, intra_op_threads=1)


def engine(backend, kv_mode, mode="fixed", capacity=None):
    capacity = capacity or Capacity(4, 4096, 256)
    return BatchEngine(backend, ModelInfo.from_manifest(backend.manifest), capacity=capacity,
                  scheduler=SchedulerConfig(mode), kv_mode=kv_mode,
                  cost_model=StepCostModel(1e-3, 2e-4, 4e-4))


KV_MODES = ["packed", "fused", "static", "concat"]


@pytest.mark.parametrize("kv_mode", KV_MODES)
def test_golden_traces_through_ort(exported, kv_mode):
    traces = load_json(golden_path(SET, "traces.json"))
    e = engine(exported, kv_mode)
    ids = [e.submit(s["prompt_ids"], max_new_tokens=65) for s in traces["samples"]]
    finished = e.run_until_done()
    for request_id, sample in zip(ids, traces["samples"], strict=True):
        assert finished[request_id].tokens[:64] == sample["generated_ids"][:64]
        assert finished[request_id].acceptance_lengths == sample["acceptance_lengths"]


@pytest.mark.parametrize("kv_mode", KV_MODES)
def test_ort_greedy_equals_target_with_mid_flight_arrivals(exported, kv_mode):
    target, _ = load_pair(golden_path(SET, "target"), golden_path(SET, "drafter"))
    e = engine(exported, kv_mode, mode="dspark", capacity=Capacity(2, 4096, 128))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 500, (n,), generator=g).tolist() for n in (3, 21, 8, 40)]
    ids = []
    for prompt in prompts:
        ids.append(e.submit(prompt, max_new_tokens=24))
        e.step()
    finished = e.run_until_done()
    for request_id, prompt in zip(ids, prompts, strict=True):
        assert finished[request_id].tokens == autoregressive_generate(target, prompt, max_new_tokens=24)


def test_the_default_engine_drives_the_fused_target_and_keeps_kv_in_place(exported):
    e = BatchEngine(exported, ModelInfo.from_manifest(exported.manifest), capacity=Capacity(2, 4096, 128),
                    scheduler=SchedulerConfig("fixed"))
    assert e.kv_mode == "fused"
    before = {g: exported.times.count(g) for g in ("target", "target_fused")}
    request = e.submit([5, 6, 7, 8, 9], max_new_tokens=20)
    tokens = e.run_until_done()[request].tokens
    assert exported.times.count("target") == before["target"]
    assert exported.times.count("target_fused") > before["target_fused"]
    # the slot's committed entries are what the target computes for prompt + output (minus the last token)
    target, _ = load_pair(golden_path(SET, "target"), golden_path(SET, "drafter"))
    assert tokens == autoregressive_generate(target, [5, 6, 7, 8, 9], max_new_tokens=20)


@pytest.mark.parametrize("kv_mode", KV_MODES)
def test_ort_sampling_follows_the_pytorch_engine_stream_for_stream(exported, kv_mode):
    """Same seeds, fixed γ: every request draws from its own stream in the same order, so the ORT
    engine samples what the PyTorch one does (logits agree to ~1e-5: a flip needs a uniform within
    that of a boundary)."""
    from dspark.runtime.torch_backend import TorchBackend

    target, drafter = load_pair(golden_path(SET, "target"), golden_path(SET, "drafter"))
    reference = BatchEngine(TorchBackend(target, drafter), ModelInfo.from_models(target, drafter),
                            capacity=Capacity(4, 4096, 256), scheduler=SchedulerConfig("fixed"), kv_mode="concat")
    ort_engine = engine(exported, kv_mode)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 500, (n,), generator=g).tolist() for n in (4, 19, 9, 33)]
    outputs = []
    for e in (reference, ort_engine):
        ids = [e.submit(p, max_new_tokens=40, temperature=0.8, seed=10 + i) for i, p in enumerate(prompts)]
        finished = e.run_until_done()
        outputs.append([finished[i].tokens for i in ids])
    assert outputs[0] == outputs[1]


def test_feeds_checked_against_export_metadata(exported):
    with pytest.raises(BackendError, match="missing feeds"):
        exported.run("target", {"input_ids": torch.zeros(1, 1, dtype=torch.int64)})
    with pytest.raises(BackendError, match="no graph"):
        exported.run("nope", {})


@pytest.mark.parametrize("kv_mode", KV_MODES)
def test_a_prefill_makes_logits_at_each_prompts_last_position_only(exported, kv_mode):
    """forward(last_only=True): [R, 1, V] logits equal to the full forward's at each row's last real token; the
    fused graph computes only those (logits_rows), and a prefill's binding is not kept."""
    e = engine(exported, kv_mode)
    batch = StepBatch.prompts([list(range(3, 43)), [7, 8, 9, 10, 11, 12, 13]])
    full = e.target.forward(batch)
    rows = np.arange(batch.rows)
    expected = np.array(full.logits[rows, batch.counts - 1])
    last = e.target.forward(batch, last_only=True)  # nothing was committed: the same rows again
    assert last.logits.shape == (2, 1, e.info.vocab_size)
    np.testing.assert_allclose(last.logits[:, 0], expected, atol=1e-5)
    if kv_mode == "fused":
        assert e.target.selects_logits and (2, batch.width, True) not in e.target._bound
        np.testing.assert_array_equal(last.greedy_ids[:, 0], expected.argmax(-1))


def test_the_packed_target_computes_and_prices_real_tokens_only(exported):
    """kv_mode `packed`: a step's cost is counted in its real tokens (Σ(1 + ℓ_r), what the graph computes) and the
    scheduler prices verification packed unless told otherwise; the fused graph computes the padded R·W."""
    batch = StepBatch.chains(np.array([5, 6]), np.array([[1, 2, 3], [4, 5, 6]]), np.array([3, 0]), np.array([0, 0]))
    packed, fused = engine(exported, "packed", mode="dspark"), engine(exported, "fused", mode="dspark")
    assert (packed.scheduler.pricing, packed.target.computed_tokens(batch)) == ("packed", 5)
    assert (fused.scheduler.pricing, fused.target.computed_tokens(batch)) == ("padded", 8)
    told = BatchEngine(exported, ModelInfo.from_manifest(exported.manifest), capacity=Capacity(2, 4096, 128),
                       scheduler=SchedulerConfig("dspark", pricing="padded"), kv_mode="packed")
    assert told.scheduler.pricing == "padded"


def test_the_packed_engine_runs_ragged_rows_packed_and_even_rows_on_the_chain_graph(exported):
    """Rows of different widths go through `target_fused_packed`; rows all as wide as the widest (plain decoding,
    fixed γ) through `target_fused` over the same slot rows, where the packed graph's gathers would be pure cost."""
    e = engine(exported, "packed")
    calls = {g: exported.times.count(g) for g in ("target_fused", "target_fused_packed")}
    ragged = StepBatch.chains(np.array([5, 6]), np.array([[1, 2, 3], [4, 5, 6]]), np.array([3, 0]), np.array([0, 0]))
    even = StepBatch.chains(np.array([5, 6]), np.array([[1, 2, 3], [4, 5, 6]]), np.array([2, 2]), np.array([0, 0]))
    ragged_ids = e.target.forward(ragged).greedy_ids.copy()
    assert exported.times.count("target_fused_packed") == calls["target_fused_packed"] + 1
    even_ids = e.target.forward(even).greedy_ids
    assert exported.times.count("target_fused") == calls["target_fused"] + 1
    # the same tokens at the same positions give the same argmax, whichever graph ran them
    assert ragged_ids[0, :3].tolist() == even_ids[0].tolist() and ragged_ids[1, 0] == even_ids[1, 0]


def test_the_packed_engines_decode_bindings_are_bounded(exported, monkeypatch):
    """A packed layout is (rows, width, real tokens): up to R·W of them per (rows, width), so the kept bindings
    are capped (all let go past PACKED_BINDINGS) and a call past the cap still computes what it did."""
    from dspark.runtime import target_runner

    monkeypatch.setattr(target_runner, "PACKED_BINDINGS", 2)
    e = engine(exported, "packed")
    drafts = np.array([[1, 2, 3], [4, 5, 6]])
    first = e.target.forward(StepBatch.chains(np.array([5, 6]), drafts, np.array([3, 0]), np.array([0, 0])))
    first = first.greedy_ids.copy()
    for lengths in ([2, 0], [1, 0], [3, 1], [3, 0]):
        out = e.target.forward(StepBatch.chains(np.array([5, 6]), drafts, np.array(lengths), np.array([0, 0])))
        assert len(e.target._bound) <= 2
    assert out.greedy_ids[0, :4].tolist() == first[0, :4].tolist() and out.greedy_ids[1, 0] == first[1, 0]
