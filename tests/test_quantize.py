"""Weight-only int4/int8 ONNX Runtime engines (engines/quantize.py): which graphs ORT's quantizer
rewrites, what engine.json records, refusals, and decoding lossless with respect to the quantized
target: greedy equals the quantized graph's own greedy, sampling follows its law (chi-square, with
controls that fail)."""

from __future__ import annotations

import json
from dataclasses import asdict
from types import SimpleNamespace

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from click.testing import CliRunner
from conftest import golden_path, load_json
from safetensors.torch import save_file
from sampling_law import PROMPT, exact_law_of_tokens_2_and_3, pooled_pvalue, small_pair

from dspark.engines import build as B
from dspark.engines.export_source import BuildError
from dspark.engines.quantize import QuantizeOptions
from dspark.export import contract as C
from dspark.export.artifacts import ArtifactError
from dspark.export.engine_dir import load_engine_dir, validate
from dspark.export.feeds import causal_mask
from dspark.export.pipeline import export_pair
from dspark.models import load_pair
from dspark.runtime.api import Runtime, RuntimeOptions
from dspark.runtime.batch_loop import BatchEngine
from dspark.runtime.capacity import Capacity
from dspark.runtime.model_info import ModelInfo
from dspark.runtime.ort_backend import OrtBackend
from dspark.runtime.prefix_scheduler import SchedulerConfig
from dspark.tools.build_engine_command import build_engine as build_engine_cli

SET = "qwen3-tiny-vanilla"
OPTIONS = dict(buckets=(1, 8, 32), max_batch_tokens=32, max_batch=4, max_seq_len=256, profile_past=16,
               warmup=1, repeats=1)


def _build(export_dir, out, scheme: str, **quantize) -> dict:
    options = B.BuildOptions(**OPTIONS, quantize=QuantizeOptions(scheme, **quantize))
    return B.build_engine(export_dir, out, options)


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("export")
    export_pair(golden_path(SET, "target"), golden_path(SET, "drafter"), out, check=False)
    return out


@pytest.fixture(scope="module")
def int4_engine(export_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("int4")
    _build(export_dir, out, "int4")
    return out


def _ops(path) -> dict[str, int]:
    ops: dict[str, int] = {}
    for node in onnx.load(str(path), load_external_data=False).graph.node:
        ops[node.op_type] = ops.get(node.op_type, 0) + 1
    return ops


class GraphTarget:
    """The quantized concat target graph, called like the PyTorch target on whole prefixes (no cache):
    the quantized target's own logits, independent of the runtime's decoding loop."""

    def __init__(self, engine_dir, vocab_size: int) -> None:
        self.session = ort.InferenceSession(str(load_engine_dir(engine_dir).graph_path(C.TARGET)),
                                            providers=["CPUExecutionProvider"])
        self.config = SimpleNamespace(vocab_size=vocab_size)

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor) -> SimpleNamespace:
        batch, tokens = ids.shape
        feeds = {"input_ids": ids.numpy(), "position_ids": positions.contiguous().numpy(),
                 "attention_mask": causal_mask(batch, tokens, 0).contiguous().numpy()}
        for spec in self.session.get_inputs():
            if spec.name not in feeds:  # empty past keys/values
                feeds[spec.name] = np.zeros((batch, spec.shape[1], 0, spec.shape[3]), dtype=np.float32)
        logits = self.session.run(["logits"], feeds)[0]
        return SimpleNamespace(logits=torch.from_numpy(logits))

    def greedy(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        ids = list(prompt)
        for _ in range(max_new_tokens):
            x = torch.tensor([ids])
            ids.append(int(self(x, torch.arange(len(ids))[None]).logits[0, -1].argmax()))
        return ids[len(prompt):]


@pytest.mark.parametrize("scheme", ["int4", "int8"])
def test_weights_in_external_data_are_quantized_one_at_a_time_into_the_same_graph(export_dir, tmp_path, scheme,
                                                                                  monkeypatch):
    """A graph whose weights live in external data (a --stream-weights export) gets exactly the graph the
    in-memory quantizer makes, with at most one weight read at a time, its tensors in its own data file."""
    from onnx import numpy_helper

    from dspark.engines import external_weights
    from dspark.engines.quantize import quantize_graph
    from dspark.export.manifest import read_manifest

    name = read_manifest(export_dir)["graphs"][C.TARGET_FUSED]["file"]
    outside = tmp_path / "outside" / name
    outside.parent.mkdir()
    onnx.save_model(onnx.load(str(export_dir / name)), str(outside), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="weights.bin", size_threshold=0)
    loads = []
    load = external_weights.WeightStream.load
    monkeypatch.setattr(external_weights.WeightStream, "load", lambda stream, tensor: (loads.append(tensor.name),
                                                                                        load(stream, tensor)))
    options = QuantizeOptions(scheme)
    whole = quantize_graph(export_dir / name, tmp_path / "whole" / name, options)
    streamed = quantize_graph(outside, tmp_path / "streamed" / name, options)
    assert streamed == whole and whole["quantized"] > 0 and len(loads) == whole["quantized"]  # one read each
    graph = onnx.load(str(tmp_path / "streamed" / name), load_external_data=False).graph
    big = [t for t in graph.initializer if external_weights.is_external(t)]
    assert big and {e.value for t in big for e in t.external_data if e.key == "location"} == {name + ".data"}
    assert all(len(t.raw_data) < external_weights.SPILL_BYTES for t in graph.initializer)  # the rest went out
    want, got = (onnx.load(str(tmp_path / kind / name)).graph for kind in ("whole", "streamed"))
    assert [(n.op_type, list(n.input)) for n in got.node] == [(n.op_type, list(n.input)) for n in want.node]
    tensors = {t.name: numpy_helper.to_array(t) for t in want.initializer}
    assert sorted(tensors) == sorted(t.name for t in got.initializer)
    assert all(np.array_equal(numpy_helper.to_array(t), tensors[t.name]) for t in got.initializer)
    ort.InferenceSession(str(tmp_path / "streamed" / name), providers=["CPUExecutionProvider"])


def test_weights_cut_short_are_refused_in_one_line(export_dir, tmp_path):
    from dspark.engines.quantize import quantize_graph
    from dspark.export.manifest import read_manifest

    name = read_manifest(export_dir)["graphs"][C.TARGET_FUSED]["file"]
    outside = tmp_path / "outside" / name
    outside.parent.mkdir()
    onnx.save_model(onnx.load(str(export_dir / name)), str(outside), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="weights.bin", size_threshold=0)
    data = outside.with_name("weights.bin")
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(BuildError, match="weights.bin ends inside .*cut short"):
        quantize_graph(outside, tmp_path / "q" / name, QuantizeOptions("int4"))


def test_every_target_graph_is_quantized_and_recorded(int4_engine, export_dir):
    engine = load_engine_dir(int4_engine, verify_files=True)
    section = engine.manifest["quantization"]
    assert (section["scheme"], section["bits"], section["drafter"]) == ("int4", 4, False)
    assert set(section["graphs"]) == {g for g in engine.manifest["graphs"] if g.startswith("target")}
    for name, entry in section["graphs"].items():
        assert entry["quantized"] == entry["matmuls"] > 0 and entry["left_float"] == 0
        assert _ops(engine.graph_path(name)).get("MatMulNBits", 0) >= entry["matmuls"]
    for name in (C.BACKBONE, C.HEAD_GREEDY):  # drafter graphs untouched without quantize-drafter
        assert "MatMulNBits" not in _ops(engine.graph_path(name))
    # the cost table was measured on the quantized graphs of this engine, for each target flavour
    assert set(engine.manifest["sps"]["tables"]) == {C.TARGET, C.TARGET_STATIC, C.TARGET_FUSED}
    assert json.loads((int4_engine / "export.json").read_text())["derived_from"]["export_dir"] == str(
        export_dir.resolve())
    assert not list(int4_engine.glob(".quantizing-*"))  # the staging copy is gone
    bad = json.loads(json.dumps(engine.manifest))
    bad["quantization"]["bits"] = 8
    with pytest.raises(ArtifactError, match="quantization.scheme/bits"):
        validate(bad)
    bad["quantization"] = {**section, "graphs": {"nope": {}}}
    with pytest.raises(ArtifactError, match="quantization.graphs"):
        validate(bad)


@pytest.mark.parametrize("kv_mode", ["fused", "concat"])
def test_greedy_dspark_equals_the_quantized_targets_own_greedy(int4_engine, kv_mode):
    traces = load_json(golden_path(SET, "traces.json"))
    prompts = [s["prompt_ids"] for s in traces["samples"][:3]]
    reference = GraphTarget(int4_engine, load_json(golden_path(SET, "target", "config.json"))["vocab_size"])
    expected = [reference.greedy(p, 24) for p in prompts]
    target, _ = load_pair(golden_path(SET, "target"), golden_path(SET, "drafter"))
    ids = torch.tensor([prompts[0]])
    positions = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        moved = (reference(ids, positions).logits - target(ids, positions).logits).abs().max()
    assert moved > 1e-3  # the reference is the quantized target (its greedy tokens match float32's here)
    # every step drafts (no drafting gate): the cost model is profiled at load, and on a loaded machine the gate
    # found drafting not to pay and verified no draft in these 24 tokens; Algorithm 1 still picks the lengths
    scheduler = SchedulerConfig("dspark", gate_drafting=False)
    options = RuntimeOptions(scheduler=scheduler, kv_mode=kv_mode, max_requests=4, max_seq_len=256)
    with Runtime.load(int4_engine, options) as runtime:
        results = runtime.generate(prompts, max_new_tokens=24)
        assert [r.tokens for r in results] == expected
        assert sum(sum(r.acceptance_lengths) - len(r.acceptance_lengths) for r in results) > 0  # drafts accepted


def test_cli_int8_with_drafter_and_refusals(export_dir, tmp_path):
    out = tmp_path / "int8"
    args = [str(export_dir), "--out", str(out), "--quantize", "int8", "--quantize-drafter", "--buckets", "1,8",
            "--max-batch-tokens", "8", "--max-batch", "2", "--repeats", "1", "--quiet"]
    result = CliRunner().invoke(build_engine_cli, args)
    assert result.exit_code == 0, result.output
    assert "int8 weights" in result.output
    engine = load_engine_dir(out, verify_files=True)
    assert engine.manifest["quantization"]["drafter"] is True
    assert set(engine.manifest["quantization"]["graphs"]) == set(engine.manifest["graphs"])
    assert "MatMulNBits" in _ops(engine.graph_path(C.BACKBONE))
    for bad, message in ((["--quantize-drafter"], "--quantize-drafter needs --quantize"),
                         (["--quantize", "int4", "--quant-block-size", "24"], "power of two >= 16"),
                         (["--quantize", "int4", "--backend", "tensorrt"], "cannot run them")):
        result = CliRunner().invoke(build_engine_cli, [str(export_dir), "--out", str(tmp_path / "bad"), *bad])
        assert result.exit_code == 2 and message in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1
        assert not (tmp_path / "bad").exists()  # refused before any work


def _save(folder, target, drafter):
    """The pair as a HF target folder and a DeepSpec drafter folder (tied embedding/LM head omitted)."""
    paths = []
    for name, model in (("target", target), ("drafter", drafter)):
        path = folder / name
        path.mkdir()
        config = {k: v for k, v in asdict(model.config).items() if k not in ("qk_norm", "eos_token_ids")}
        config["model_type"] = "qwen3"
        state = model.state_dict()
        if name == "target":
            state = {(k if k.startswith("lm_head") else f"model.{k}"): v for k, v in state.items()}
        else:
            state = {k: v for k, v in state.items() if k not in ("embed_tokens.weight", "lm_head.weight")}
        (path / "config.json").write_text(json.dumps(config))
        save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
        paths.append(path)
    return paths


def test_sampling_follows_the_quantized_targets_law(tmp_path):
    """Seeded requests through the int4 engine (static-cache target, one draft per step): tokens 2-3 follow the
    law enumerated from the quantized graph, not the float32 target's, nor the law at 1/T."""
    target, drafter = small_pair()
    target_dir, drafter_dir = _save(tmp_path, target, drafter)
    export_pair(target_dir, drafter_dir, tmp_path / "export", check=False)
    engine_dir = tmp_path / "engine"
    _build(tmp_path / "export", engine_dir, "int4", block_size=16)
    quantized = GraphTarget(engine_dir, target.config.vocab_size)
    temperature = 0.7
    law = exact_law_of_tokens_2_and_3(quantized, temperature)
    backend = OrtBackend(engine_dir, intra_op_threads=1, of_engine=True)
    engine = BatchEngine(backend, ModelInfo.from_manifest(backend.manifest), capacity=Capacity(128, 128 * 16, 16),
                         scheduler=SchedulerConfig("fixed", fixed_length=1), kv_mode="static",
                         cost_model=load_engine_dir(engine_dir).cost_model("static"))
    ids = [engine.submit(PROMPT, max_new_tokens=3, temperature=temperature, seed=s) for s in range(2048)]
    finished = engine.run_until_done()
    counts = torch.zeros_like(law)
    for i in ids:
        counts[finished[i].tokens[1], finished[i].tokens[2]] += 1
    assert sum(finished[i].acceptance_lengths[0] == 2 for i in ids) > 0  # drafts accepted, bonus drawn
    assert pooled_pvalue(counts, law) > 1e-3
    assert pooled_pvalue(counts, exact_law_of_tokens_2_and_3(quantized, 1.0 / temperature)) < 1e-6
    float_law = exact_law_of_tokens_2_and_3(target, temperature)
    assert pooled_pvalue(counts, float_law) < 1e-6  # int4 moved the law: the float32 target's is rejected


def test_quantize_refuses_a_half_precision_export():
    with pytest.raises(BuildError, match="starts from a float32 export"):
        B._check_quantize(B.BuildOptions(quantize=QuantizeOptions("int4")), {"dtype": "float16"})
