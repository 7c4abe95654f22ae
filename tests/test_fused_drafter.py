"""The fused drafter backbone (`export/fused_drafter.py`): parity against `DSparkDrafter.forward_backbone` when
driven as the runtime drives it (one context buffer per layer and kind, appended in place over several steps of
different new-row counts per row), refusals, and an engine that drafts the same through it as through the plain
backbone, step by step."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from conftest import fixed_gamma_engine, golden_path, random_pair

from dspark.export import contract as C
from dspark.export.fused_drafter import build_fused_backbone, check_fusable_drafter
from dspark.export.fused_drafter_parity import fused_backbone_parity
from dspark.export.lower import ExportError
from dspark.export.pipeline import DEFAULT_PLACEMENT, export_pair
from dspark.models import load_pair
from dspark.runtime.drafter_runner import DrafterRunner
from dspark.runtime.kv_cache import SlotCache
from dspark.runtime.model_info import ModelInfo
from dspark.runtime.ort_backend import OrtBackend

pytestmark = pytest.mark.usefixtures("one_thread")


def _parity(drafter, max_positions: int = 512) -> dict:
    graph = build_fused_backbone(drafter, DEFAULT_PLACEMENT, max_positions=max_positions)
    session = ort.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"])
    return fused_backbone_parity(session, C.backbone_fused_spec(drafter.config, DEFAULT_PLACEMENT, "float32"),
                                 drafter, "float32")


@pytest.mark.parametrize("name", ["qwen3-tiny-vanilla/drafter", "qwen3-tiny-gated-rnn/drafter_rnn",
                                  "dflash-tiny/drafter"])
def test_golden_drafters_match_their_pytorch_backbone(name):
    folder, drafter_dir = name.split("/")
    target, drafter = load_pair(golden_path(folder, "target"), golden_path(folder, drafter_dir))
    result = _parity(drafter, target.config.max_position_embeddings)
    print(f"\n{name}: {result['max_abs_diff']}")
    assert result["passed"] and max(result["max_abs_diff"].values()) <= 1e-4


@pytest.mark.parametrize("overrides", [{}, {"model_type": "llama", "qk_norm": False, "attention_bias": True}],
                         ids=["qwen3", "llama-bias"])
def test_random_architectures_match(overrides):
    drafter_overrides = {k: v for k, v in overrides.items() if k != "model_type"}
    _, drafter = random_pair(3, target_overrides={"head_dim": 16, **overrides},
                             drafter_overrides={"head_dim": 16, "num_hidden_layers": 2, **drafter_overrides})
    result = _parity(drafter)
    assert result["passed"], result


def test_refusals():
    _, narrow = random_pair(0)  # head_dim 8
    with pytest.raises(ExportError, match="multiple of 16"):
        check_fusable_drafter(narrow, "float32")
    _, gemma = load_pair(golden_path("gemma4-tiny", "target"), golden_path("gemma4-tiny", "drafter"))
    with pytest.raises(ExportError, match="plain backbone"):
        check_fusable_drafter(gemma, "float32")


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    out = tmp_path_factory.mktemp("export")
    set_ = "qwen3-tiny-vanilla"
    manifest = export_pair(golden_path(set_, "target"), golden_path(set_, "drafter"), out, check=False)
    assert manifest["graphs"][C.BACKBONE_FUSED]["flavour"] == "fused"
    with OrtBackend(out, intra_op_threads=1) as opened:
        yield opened


def test_an_engine_drafts_the_same_through_the_fused_and_the_plain_backbone(backend):
    """Six requests through four slots (rows join, leave and move; prompts of 3..30 tokens catch up at once),
    greedy and sampled: every step proposes the same drafts and accepts the same counts on both backbones, and
    the drafter caches hold the same committed keys."""
    rng = np.random.default_rng(0)
    requests = [(rng.integers(2, 500, n).tolist(), new, t) for n, new, t in
                ((3, 80, 0.0), (30, 40, 1.0), (7, 60, 0.0), (18, 50, 0.8), (11, 30, 0.0), (24, 45, 1.0))]
    engines = [fixed_gamma_engine(backend, fused=fused) for fused in (True, False)]
    for engine in engines:
        for i, (prompt, new, temperature) in enumerate(requests):
            engine.submit(prompt, max_new_tokens=new, temperature=temperature, seed=i)
    before = backend.times.count(C.BACKBONE_FUSED)
    steps = 0
    while not all(e.idle for e in engines):
        steps += 1
        fused, plain = (e.step() for e in engines)
        assert (fused is None) == (plain is None)
        if fused is None:
            continue
        assert fused.acceptance_lengths == plain.acceptance_lengths and fused.lengths == plain.lengths
        a, b = (e.drafter_kv for e in engines)
        assert np.array_equal(a.lengths, b.lengths)
        for row in range(len(engines[0].active)):
            n = int(a.lengths[row])
            for got, want in zip(a.kv, b.kv, strict=True):
                np.testing.assert_allclose(got[row, :, :n], want[row, :, :n], atol=1e-4, rtol=1e-4)
    assert backend.times.count(C.BACKBONE_FUSED) - before >= steps - 2  # the fused engine drafted through it
    results = [e.take_finished() for e in engines]
    assert [r.tokens for r in results[0].values()] == [r.tokens for r in results[1].values()]


def test_rows_drafting_from_a_later_slot_match_the_plain_backbone(backend):
    """Slot rows 2..3 alone (as a second call of split backlogs, or a probe of the last rows): the fused call
    binds them where they are and their outputs land in the caller's output rows."""
    info = ModelInfo.from_manifest(backend.manifest)
    rng = np.random.default_rng(1)
    runners = []
    for fused in (True, False):
        runner = DrafterRunner(backend, info, SlotCache(info.drafter_cache, 4, 64))
        runner.fused = fused
        runners.append(runner)
    width = info.context_feature_size
    contexts = [[rng.standard_normal((n, width)).astype(np.float32)] for n in (5, 9, 3, 12)]
    anchors, starts = rng.integers(2, 500, 4), np.array([5, 9, 3, 12])
    later = [[rng.standard_normal((n, width)).astype(np.float32)] for n in (2, 4)]
    outputs = []
    for runner in runners:
        runner.draft(anchors, starts, contexts)
        out = runner.draft(anchors[2:], starts[2:] + np.array([2, 4]), later, np.array([2, 3]))
        outputs.append(out.hidden.copy())
    np.testing.assert_allclose(outputs[0], outputs[1], atol=1e-4, rtol=1e-4)
    a, b = (r.kv for r in runners)
    assert a.lengths.tolist() == b.lengths.tolist() == [5, 9, 5, 16]
    for row in range(4):
        for got, want in zip(a.kv, b.kv, strict=True):
            np.testing.assert_allclose(got[row, :, : a.lengths[row]], want[row, :, : a.lengths[row]], atol=1e-4)


@pytest.mark.parametrize("rows", [2, 6])
def test_backlogs_of_several_chunks_match_the_plain_backbone(backend, rows):
    """Rows that skipped drafting hold their context in several chunks: the fused call copies them in order,
    row by row for a few rows and by one scatter for more (both fill paths), as the plain backbone reads them."""
    info = ModelInfo.from_manifest(backend.manifest)
    rng = np.random.default_rng(2)
    width = info.context_feature_size
    contexts = [[rng.standard_normal((int(n), width)).astype(np.float32) for n in rng.integers(1, 6, 3)]
                for _ in range(rows)]
    counts = np.array([sum(len(c) for c in chunks) for chunks in contexts])
    anchors, starts = rng.integers(2, 500, rows), counts.copy()
    runners, outputs, calls = [], [], backend.times.count(C.BACKBONE_FUSED)
    for fused in (True, False):
        runner = DrafterRunner(backend, info, SlotCache(info.drafter_cache, 8, 64))
        runner.fused = fused
        outputs.append(runner.draft(anchors, starts, contexts).hidden.copy())
        runners.append(runner)
    assert backend.times.count(C.BACKBONE_FUSED) == calls + 1  # the fused runner went through it
    np.testing.assert_allclose(outputs[0], outputs[1], atol=1e-4, rtol=1e-4)
    a, b = (r.kv for r in runners)
    assert a.lengths.tolist() == b.lengths.tolist() == [*counts.tolist(), *[0] * (8 - rows)]
    for row in range(rows):
        for got, want in zip(a.kv, b.kv, strict=True):
            np.testing.assert_allclose(got[row, :, : a.lengths[row]], want[row, :, : a.lengths[row]], atol=1e-4)


def test_the_greedy_heads_take_only_the_block_this_runner_drafted(backend):
    """The heads are bound over the backbone's output buffers: a block_hidden from elsewhere is refused."""
    info = ModelInfo.from_manifest(backend.manifest)
    runner = DrafterRunner(backend, info, SlotCache(info.drafter_cache, 2, 64))
    context = [[np.zeros((3, info.context_feature_size), np.float32)]]
    drafted = runner.draft(np.array([5]), np.array([3]), context)
    block = runner.propose(drafted.hidden, drafted.base_logits, np.array([5]), [0.0], [None])
    assert np.asarray(block.tokens).shape == (1, info.block_size)
    with pytest.raises(ValueError, match="just returned"):
        runner.propose(drafted.hidden.copy(), drafted.base_logits, np.array([5]), [0.0], [None])
