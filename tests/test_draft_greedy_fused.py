"""The joined drafting graph (`export/fused_draft_greedy.py`: the fused backbone and the greedy heads in one
graph): parity against the PyTorch drafter, refused where its parts are missing, and an engine that drafts
every all-greedy step in one call through it with the same drafts, acceptances and output as the two-call path."""

from __future__ import annotations

import copy

import numpy as np
import onnxruntime as ort
import pytest
import torch
from conftest import fixed_gamma_engine, golden_path

from dspark.export import contract as C
from dspark.export.fused_drafter_parity import fused_backbone_parity
from dspark.export.pipeline import export_pair
from dspark.models import load_pair
from dspark.runtime.drafter_runner import DrafterRunner
from dspark.runtime.kv_cache import SlotCache
from dspark.runtime.model_info import ModelInfo
from dspark.runtime.ort_backend import OrtBackend

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    made = {}
    for name, drafter in (("qwen3-tiny-vanilla", "drafter"), ("qwen3-tiny-gated-rnn", "drafter_rnn"),
                          ("dflash-tiny", "drafter")):
        out = tmp_path_factory.mktemp(name)
        made[name] = out, export_pair(golden_path(name, "target"), golden_path(name, drafter), out, check=True,
                                      show_progress=False)
    return made


@pytest.mark.parametrize("name", ["qwen3-tiny-vanilla", "qwen3-tiny-gated-rnn"])
def test_the_joined_graph_matches_the_pytorch_drafter(exports, name):
    _, manifest = exports[name]
    result = manifest["parity"][C.DRAFT_GREEDY_FUSED]
    print(f"\n{name}: {result['max_abs_diff']}")
    assert manifest["graphs"][C.DRAFT_GREEDY_FUSED]["flavour"] == "fused"
    assert result["passed"] and result["max_abs_diff"]["draft_ids_wrong"] == 0
    assert max(v for k, v in result["max_abs_diff"].items() if k != "draft_ids_wrong") <= 1e-4
    assert "logits" not in manifest["graphs"][C.DRAFT_GREEDY_FUSED]["outputs"][0]["name"]


def test_its_parity_fails_against_other_heads(exports):
    """The control: the same joined graph checked against a drafter whose Markov head moved fails, on draft ids."""
    out, _ = exports["qwen3-tiny-vanilla"]
    _, drafter = load_pair(golden_path("qwen3-tiny-vanilla", "target"), golden_path("qwen3-tiny-vanilla", "drafter"))
    moved = copy.deepcopy(drafter)
    with torch.no_grad():
        for name, weight in moved.named_parameters():
            if "markov" in name:
                weight.mul_(-3.0)
    session = ort.InferenceSession(str(out / f"{C.DRAFT_GREEDY_FUSED}.onnx"), providers=["CPUExecutionProvider"])
    spec = C.draft_greedy_fused_spec(drafter.config, C.Placement(lm_head_in_backbone=True), "float32")
    assert fused_backbone_parity(session, spec, drafter, "float32")["passed"]
    result = fused_backbone_parity(session, spec, moved, "float32")
    assert not result["passed"] and result["max_abs_diff"]["draft_ids_wrong"] > 0


def test_a_drafter_without_heads_has_no_joined_graph(exports):
    out, manifest = exports["dflash-tiny"]
    assert C.DRAFT_GREEDY_FUSED not in manifest["graphs"]
    assert "drafter_head_greedy.onnx" in manifest["dropped_graphs"][C.DRAFT_GREEDY_FUSED]["reason"]
    assert not (out / f"{C.DRAFT_GREEDY_FUSED}.onnx").exists()


def test_the_runner_drafts_what_backbone_and_heads_draft(exports):
    """Three steps of growing context over four slot rows: the joined call returns the drafts and confidences of
    the two calls, and writes the same context keys and values."""
    out, _ = exports["qwen3-tiny-vanilla"]
    rng = np.random.default_rng(3)
    with OrtBackend(out, intra_op_threads=1) as backend:
        info = ModelInfo.from_manifest(backend.manifest)
        runners = [DrafterRunner(backend, info, SlotCache(info.drafter_cache, 4, 64)) for _ in range(2)]
        runners[1].joined = False
        starts = np.zeros(4, np.int64)
        for new in ((5, 9, 3, 12), (1, 1, 1, 1), (2, 1, 3, 1)):
            contexts = [[rng.standard_normal((n, info.context_feature_size)).astype(np.float32)] for n in new]
            anchors, starts = rng.integers(2, 500, 4), starts + np.array(new)
            joined = runners[0].draft(anchors, starts, contexts, greedy=True)
            assert joined.hidden is None and joined.block is not None
            two = runners[1].draft(anchors, starts, contexts, greedy=True)
            assert two.block is None
            block = runners[1].propose(two.hidden, two.base_logits, anchors, [0.0] * 4, [None] * 4)
            assert np.array_equal(joined.block.tokens, block.tokens)
            np.testing.assert_allclose(joined.block.confidence_logits, block.confidence_logits, atol=1e-5, rtol=1e-5)
        a, b = (r.kv for r in runners)
        assert a.lengths.tolist() == b.lengths.tolist()
        for got, want in zip(a.kv, b.kv, strict=True):
            np.testing.assert_allclose(got, want, atol=1e-5)


def test_an_engine_drafts_greedy_steps_in_one_call(exports):
    """Five greedy requests through four slots, on the joined graph and on backbone + heads: every step the same
    drafts accepted and the same outputs; the joined engine never calls the heads, until a sampled request joins."""
    out, _ = exports["qwen3-tiny-vanilla"]
    rng = np.random.default_rng(0)
    requests = [(rng.integers(2, 500, n).tolist(), new) for n, new in ((3, 60), (30, 40), (7, 50), (18, 30), (11, 45))]
    with OrtBackend(out, intra_op_threads=1) as backend:
        engines = [fixed_gamma_engine(backend, joined=joined) for joined in (True, False)]
        calls = backend.times.count
        for engine in engines:
            for i, (prompt, new) in enumerate(requests):
                engine.submit(prompt, max_new_tokens=new, seed=i)
        joined_calls, heads_calls = calls(C.DRAFT_GREEDY_FUSED), calls(C.HEAD_GREEDY)
        steps = 0
        while not all(e.idle for e in engines):
            before = calls(C.HEAD_GREEDY)
            joined, plain = engines[0].step(), None
            assert calls(C.HEAD_GREEDY) == before  # the heads ran inside the joined graph
            plain = engines[1].step()
            steps += 1
            assert joined.acceptance_lengths == plain.acceptance_lengths and joined.lengths == plain.lengths
        assert calls(C.DRAFT_GREEDY_FUSED) - joined_calls >= steps - 1
        assert calls(C.HEAD_GREEDY) - heads_calls >= steps - 1  # the other engine drafted in two calls
        results = [e.take_finished() for e in engines]
        assert [r.tokens for r in results[0].values()] == [r.tokens for r in results[1].values()]
        sampled = engines[0]
        sampled.submit(requests[0][0], max_new_tokens=8, seed=1)
        sampled.submit(requests[1][0], max_new_tokens=8, temperature=1.0, seed=2)
        before = calls(C.HEAD_STEP)
        while not sampled.idle:
            sampled.step()
        assert calls(C.HEAD_STEP) > before  # a step with a sampled row drafts slot by slot
