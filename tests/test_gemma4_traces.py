"""DeepSpec's Gemma-4 decoding traces (gemma4-tiny), token- and round-identical through the
reference decoder, the batched loop (PyTorch backend) and ONNX Runtime after `dspark-export`
(plain flavour: the fused one does not represent Gemma-4 and is dropped with its reason)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import golden_path, load_json
from safetensors.torch import load_file

from dspark.export.parity import session
from dspark.export.pipeline import export_pair
from dspark.models import causal_mask, load_pair
from dspark.runtime.batch_loop import BatchEngine
from dspark.runtime.capacity import Capacity
from dspark.runtime.cost_model import StepCostModel
from dspark.runtime.model_info import ModelInfo
from dspark.runtime.ort_backend import OrtBackend
from dspark.runtime.prefix_scheduler import SchedulerConfig
from dspark.runtime.reference_decoder import autoregressive_generate, speculative_generate
from dspark.runtime.torch_backend import TorchBackend
from dspark.runtime.tree_decoder import tree_generate

SET = "gemma4-tiny"
TRACES = {"traces.json": "fixed", "traces_threshold_0.5.json": "threshold"}
TOL = dict(atol=1e-4, rtol=1e-4)
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pair():
    return load_pair(golden_path(SET, "target"), golden_path(SET, "drafter"))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("gemma4-export")
    export_pair(golden_path(SET, "target"), golden_path(SET, "drafter"), out, check=False)
    return out


@pytest.mark.parametrize("trace_file", TRACES)
def test_reference_decoder_rounds(pair, trace_file):
    target, drafter = pair
    trace = load_json(golden_path(SET, trace_file))
    for sample in trace["samples"]:
        result = speculative_generate(target, drafter, sample["prompt_ids"],
                                      max_new_tokens=trace["max_new_tokens"] + 1,
                                      confidence_threshold=trace["confidence_threshold"])
        assert result.tokens[: trace["max_new_tokens"]] == sample["generated_ids"]
        assert [r.acceptance_length for r in result.rounds] == sample["acceptance_lengths"]
        assert [r.accepted_drafts for r in result.rounds] == sample["accepted_draft_lengths"]
        assert [r.proposal_length for r in result.rounds] == sample["proposal_lengths"]
        for ours, golden in zip(result.rounds, sample["rounds"], strict=True):
            assert (ours.start, ours.anchor, ours.draft_tokens) \
                == (golden["start"], golden["anchor_token"], golden["draft_tokens_full"])
            torch.testing.assert_close(torch.tensor(ours.confidence_logits),
                                       torch.tensor(golden["confidence_logits_full"]), **TOL)


def test_target_only_greedy(pair):
    target, _ = pair
    trace = load_json(golden_path(SET, "traces.json"))
    for sample in trace["samples"]:
        ours = autoregressive_generate(target, sample["prompt_ids"], max_new_tokens=trace["max_new_tokens"])
        assert ours == sample["target_only_greedy_generated_ids"]


def test_round_tensors(pair):
    """The first three rounds of prompt 0, KV-cached on both sides."""
    target, drafter = pair
    golden = load_file(str(golden_path(SET, "trace_tensors.safetensors")))
    prompt = load_json(golden_path(SET, "traces.json"))["samples"][0]["prompt_ids"]
    seen = []
    speculative_generate(target, drafter, prompt, max_new_tokens=20,
                         observer=lambda stats, tensors: seen.append((stats, tensors)))
    for r, (stats, t) in enumerate(seen[:3]):
        torch.testing.assert_close(t.new_context_features, golden[f"round{r}_new_context_features"], **TOL)
        torch.testing.assert_close(t.block_hidden, golden[f"round{r}_draft_block_hidden"], **TOL)
        torch.testing.assert_close(drafter.base_logits(t.block_hidden), golden[f"round{r}_draft_base_logits"], **TOL)
        torch.testing.assert_close(t.draft_logits, golden[f"round{r}_draft_corrected_logits"], **TOL)
        assert stats.draft_tokens == golden[f"round{r}_draft_tokens"][0].tolist()
        assert torch.equal(t.verify_input_ids, golden[f"round{r}_verify_input_ids"])
        torch.testing.assert_close(t.verify_logits, golden[f"round{r}_target_verify_logits"], **TOL)


def _check_engine(backend, info: ModelInfo, trace_file: str, kv_mode: str) -> None:
    trace = load_json(golden_path(SET, trace_file))
    engine = BatchEngine(backend, info, capacity=Capacity(8, 4096, 256), kv_mode=kv_mode,
                         scheduler=SchedulerConfig(TRACES[trace_file]), cost_model=StepCostModel(1e-3, 2e-4, 4e-4))
    ids = [engine.submit(s["prompt_ids"], max_new_tokens=trace["max_new_tokens"] + 1) for s in trace["samples"]]
    finished = engine.run_until_done()  # the four prompts decode as one batch
    for request_id, sample in zip(ids, trace["samples"], strict=True):
        result = finished[request_id]
        assert result.tokens[: trace["max_new_tokens"]] == sample["generated_ids"]
        assert result.acceptance_lengths == sample["acceptance_lengths"]
        assert result.proposal_lengths == sample["proposal_lengths"]


@pytest.mark.parametrize("kv_mode", ["concat", "static"])
@pytest.mark.parametrize("trace_file", TRACES)
def test_batched_loop_pytorch(pair, trace_file, kv_mode):
    target, drafter = pair
    _check_engine(TorchBackend(target, drafter), ModelInfo.from_models(target, drafter), trace_file, kv_mode)


@pytest.mark.parametrize("kv_mode", ["concat", "static"])
@pytest.mark.parametrize("trace_file", TRACES)
def test_batched_loop_onnxruntime(exported, trace_file, kv_mode):
    backend = OrtBackend(exported, intra_op_threads=1)
    _check_engine(backend, ModelInfo.from_manifest(backend.manifest), trace_file, kv_mode)


def test_export_json_describes_the_layouts(exported):
    manifest = json.loads((exported / "export.json").read_text())
    target = manifest["target"]
    assert [lay["sliding_window"] for lay in target["attention_layers"]] == [16, 16, None, 16, 16, None]
    assert [(lay["num_kv_heads"], lay["head_dim"]) for lay in target["attention_layers"]][1:3] == [(2, 16), (1, 32)]
    assert target["sliding_window_kv"] == "full-length"
    assert {(lay["num_kv_heads"], lay["head_dim"]) for lay in manifest["drafter"]["attention_layers"]} == {(1, 32)}
    dims = {t["name"]: t["dims"] for t in manifest["graphs"]["target"]["inputs"]}
    assert dims["past_key_values.1.key"] == ["batch", 2, "past", 16]
    assert dims["past_key_values.2.value"] == ["batch", 1, "past", 32]
    assert set(manifest["dropped_graphs"]) == {"target_fused", "target_fused_tree", "drafter_backbone_fused",
                                               "drafter_draft_greedy_fused"}  # it joins the dropped backbone
    assert "plain backbone" in manifest["dropped_graphs"]["drafter_backbone_fused"]["reason"]
    assert "not representable" in manifest["dropped_graphs"]["target_fused"]["reason"]


def test_greedy_equals_target_past_the_window_with_mid_flight_arrivals(pair):
    """Prompts and generations past the 16-token window, requests joining mid-flight into 3 slots
    (rows move when one leaves), the DSpark scheduler and the static cache; and tree drafting."""
    target, drafter = pair
    engine = BatchEngine(TorchBackend(target, drafter), ModelInfo.from_models(target, drafter),
                         capacity=Capacity(3, 4096, 128), kv_mode="static", scheduler=SchedulerConfig("dspark"),
                         cost_model=StepCostModel(1e-3, 2e-4, 4e-4))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 500, (n,), generator=g).tolist() for n in (5, 40, 2, 19, 33)]
    prompts[1][20:] = load_json(golden_path(SET, "traces.json"))["samples"][2]["prompt_ids"][:20]  # in-distribution
    budgets = [30, 20, 40, 25, 12]
    ids = {}
    for i, (prompt, budget) in enumerate(zip(prompts, budgets, strict=True)):
        ids[engine.submit(prompt, max_new_tokens=budget)] = i
        engine.step()
    finished = engine.run_until_done()
    for request_id, i in ids.items():
        expected = autoregressive_generate(target, prompts[i], max_new_tokens=budgets[i])
        assert finished[request_id].tokens == expected, f"prompt {i}"
        tree = tree_generate(target, drafter, prompts[i], max_new_tokens=budgets[i], num_nodes=10)
        assert tree.tokens == expected, f"tree, prompt {i}"


def test_exported_graphs_reproduce_golden_tensors(exported):
    """ONNX Runtime on the plain graphs: the single forward (concat and static cache, the latter
    with hidden garbage slots) and round 0's draft block equal DeepSpec's tensors."""
    spec = json.loads((exported / "export.json").read_text())["graphs"]
    g = {k: v.numpy() for k, v in load_file(str(golden_path(SET, "tensors.safetensors"))).items()}

    def run(graph: str, feeds: dict, kv_prefix: str | None = None, slots: int = 0) -> dict:
        for t in spec[graph]["inputs"]:
            if kv_prefix and t["name"].startswith(kv_prefix):  # each layer's own dims
                feeds[t["name"]] = np.random.default_rng(0).standard_normal(
                    (1, t["dims"][1], slots, t["dims"][3])).astype(np.float32)
        names = [o["name"] for o in spec[graph]["outputs"]]
        return dict(zip(names, session(exported / spec[graph]["file"]).run(names, feeds), strict=True))

    ids, n = g["prompt_ids"], g["prompt_ids"].shape[1]
    mask = causal_mask(1, n, 0).numpy()
    base = {"input_ids": ids, "position_ids": np.arange(n)[None]}
    spare = 5
    for graph, prefix, feeds in (
        ("target", "past_key_values.", {**base, "attention_mask": mask}),
        ("target_static", "cache.", {**base, "attention_mask": np.concatenate((np.zeros((1, 1, n, spare), bool), mask),
                                                                              axis=-1)}),
    ):
        out = run(graph, feeds, prefix, 0 if graph == "target" else spare)
        np.testing.assert_allclose(out["logits"], g["target_logits"], **TOL)
        np.testing.assert_allclose(out["context_features"], g["context_features"], **TOL)
    positions, block = g["draft_position_ids"], g["draft_input_ids"].shape[1]
    out = run("drafter_backbone", {
        "block_ids": g["draft_input_ids"], "block_position_ids": positions[:, n:],
        "context_features": g["context_features"], "context_position_ids": positions[:, :n],
        "attention_mask": np.ones((1, 1, block, n + block), bool)}, "past_context.", 0)
    np.testing.assert_allclose(out["block_hidden"], g["draft_block_hidden"], **TOL)
    np.testing.assert_allclose(out["base_logits"], g["draft_base_logits"], **TOL)
    for i in range(2):
        np.testing.assert_allclose(out[f"present_context.{i}.key"], g[f"draft_cache_k_layer{i}"], **TOL)
        np.testing.assert_allclose(out[f"present_context.{i}.value"], g[f"draft_cache_v_layer{i}"], **TOL)
    heads = run("drafter_head_greedy", {"block_hidden": g["draft_block_hidden"], "base_logits": g["draft_base_logits"],
                                        "anchor_ids": g["draft_anchor_token"]})
    np.testing.assert_allclose(heads["logits"], g["draft_corrected_logits"], **TOL)
    np.testing.assert_array_equal(heads["draft_ids"], g["draft_tokens"])
    np.testing.assert_allclose(heads["confidence_logits"], g["confidence_logits"], **TOL)


def test_sampling_matches_reference_decoder_stream_for_stream(pair):
    """Fixed γ at temperature 0.8: each request consumes its own seeded stream in the reference
    order, so the batched loop reproduces `speculative_generate` token for token."""
    target, drafter = pair
    engine = BatchEngine(TorchBackend(target, drafter), ModelInfo.from_models(target, drafter),
                         capacity=Capacity(4, 4096, 128), kv_mode="concat", scheduler=SchedulerConfig("fixed"),
                         cost_model=StepCostModel(1e-3, 2e-4, 4e-4))
    prompts = [s["prompt_ids"] for s in load_json(golden_path(SET, "traces.json"))["samples"]]
    ids = [engine.submit(p, max_new_tokens=30, temperature=0.8, seed=10 + i) for i, p in enumerate(prompts)]
    finished = engine.run_until_done()
    for i, request_id in enumerate(ids):
        ref = speculative_generate(target, drafter, prompts[i], max_new_tokens=30, temperature=0.8, seed=10 + i)
        assert finished[request_id].tokens == ref.tokens
        assert finished[request_id].acceptance_lengths == [r.acceptance_length for r in ref.rounds]
