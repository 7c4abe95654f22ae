"""Real-width checkpoints (tools/checkpoint_fixtures.py) exported in bounded memory (export/streaming.py):
the model cards' configs, sharded bf16 fixtures that load, streamed float32 graphs at parity with
PyTorch (<= 1e-4) through ONNX Runtime, float16/bfloat16 graphs valid for ONNX's checker and shape
inference (and run where ORT's CPU kernels exist), and one-line refusals before any work.

The fixture is Qwen3-0.6B's widths with 2 target layers and a 1-layer drafter: ~0.56 GB of bf16
weights (the 151,936 x 1,024 embedding is 0.31 GB of it), written in 0.1 GiB shards."""

from __future__ import annotations

import json
import shutil
from collections import namedtuple

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from click.testing import CliRunner

from dspark.export import feeds as F
from dspark.export import parity as P
from dspark.export.lower import ExportError
from dspark.export.pipeline import graph_jobs
from dspark.export.streaming import export_pair_streaming, index_checkpoint
from dspark.models import TargetConfig, load_pair
from dspark.tools import checkpoint_fixtures as fixtures
from dspark.tools.export_command import export as export_cli

SMALL = dict(model="qwen3-0.6b", layers=2, drafter_layers=1, shard_bytes=2**30 // 10)


@pytest.fixture(scope="module")
def pair_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen3-0.6b-2layers")
    fixtures.make_pair(SMALL["model"], out, layers=SMALL["layers"], drafter_layers=SMALL["drafter_layers"],
                       shard_bytes=SMALL["shard_bytes"])
    return out


# One graph per weight source: the target (tied embedding/LM head), the drafter backbone (its own
# layers plus the target's LM head), a head graph (the Markov head). target_static and the greedy
# head are traced and streamed the same way; leaving them out halves the test's time.
CI_GRAPHS = ("target", "drafter_backbone", "drafter_head_step")


@pytest.fixture(scope="module")
def float32_export(pair_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("export-fp32")
    return out, export_pair_streaming(pair_dir / "target", pair_dir / "drafter", out, dtype="float32",
                                      graphs_only=CI_GRAPHS)


def test_configs_are_the_model_cards():
    """The widths that make a fixture real-shaped (values of the public config.json files)."""
    card = {  # hidden, intermediate, layers, heads, kv heads, vocab, tied
        "qwen3-0.6b": (1024, 3072, 28, 16, 8, 151936, True),
        "qwen3-1.7b": (2048, 6144, 28, 16, 8, 151936, True),
        "qwen3-4b": (2560, 9728, 36, 32, 8, 151936, True),
        "qwen3-8b": (4096, 12288, 36, 32, 8, 151936, False),
        "llama-3.1-8b": (4096, 14336, 32, 32, 8, 128256, False),
    }
    for model, values in card.items():
        c = fixtures.MODELS[model]
        assert (c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["num_attention_heads"],
                c["num_key_value_heads"], c["vocab_size"], c["tie_word_embeddings"]) == values
    drafter = fixtures.drafter_config(fixtures.target_config("qwen3-8b"))
    assert drafter["target_layer_ids"] == [1, 9, 17, 25, 33]  # DeepSpec's spacing over [1, L-3]
    assert (drafter["block_size"], drafter["markov_rank"], drafter["markov_head_type"]) == (7, 256, "vanilla")
    assert drafter["num_hidden_layers"] == 5 and drafter["hidden_size"] == 4096


def test_fixture_is_sharded_bf16_and_loads(pair_dir):
    index = json.loads((pair_dir / "target" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((pair_dir / "target" / s).is_file() for s in shards)
    located = index_checkpoint(pair_dir / "target")
    assert {t.dtype for t in located.values()} == {torch.bfloat16}
    assert index["metadata"]["total_size"] == sum(2 * int(np.prod(t.shape)) for t in located.values())
    assert "lm_head.weight" not in located  # tied, as Qwen3-0.6B's checkpoint
    target, drafter = load_pair(pair_dir / "target", pair_dir / "drafter")
    assert target.config.hidden_size == 1024 and target.config.num_hidden_layers == 2
    assert drafter.config.target_layer_ids == (0,) and drafter.config.markov_rank == 256
    assert 0.01 < float(target.layers[0].mlp.up_proj.weight.detach().float().std()) < 0.03  # random, not zeros


def test_streamed_float32_graphs_match_pytorch(pair_dir, float32_export, monkeypatch):
    out, manifest = float32_export
    assert set(manifest["graphs"]) == set(CI_GRAPHS)
    # fewer, shorter cases than the export's default sweep (each mask kind still covered): the
    # PyTorch side of a 64-token case over a 152k vocabulary is what costs here
    monkeypatch.setattr(P, "TARGET_CASES", (F.Case(1, 9, 0), F.Case(2, 3, 17, "tree"), F.Case(2, 4, 6, "padded")))
    monkeypatch.setattr(P, "BACKBONE_CASES", (F.Case(1, 7, 0), F.Case(2, 3, 11, "padded")))
    target, drafter = load_pair(pair_dir / "target", pair_dir / "drafter")
    for job in graph_jobs(target, drafter, "float32"):
        if job.spec.name not in CI_GRAPHS:
            continue
        files = manifest["graphs"][job.spec.name]["files"]
        assert files[1]["path"].endswith(".onnx.data")  # weights in external data
        with torch.no_grad():
            result = job.parity(P.session(out / job.spec.file), job.spec)
        worst = max(result["max_abs_diff"].values())
        assert worst <= 1e-4, (job.spec.name, result["max_abs_diff"])


HalfCase = namedtuple("HalfCase", "dtype tolerance")


@pytest.mark.parametrize("case", [HalfCase("float16", 2e-2), HalfCase("bfloat16", 1e-1)], ids=lambda c: c.dtype)
def test_half_precision_graphs_check_and_run_where_ort_can(pair_dir, tmp_path, case):
    """The target graph in half precision: ONNX checker with full shape inference, then ORT CPU; where
    it has the kernels, logits near PyTorch's at the same precision."""
    out = tmp_path / case.dtype
    manifest = export_pair_streaming(pair_dir / "target", pair_dir / "drafter", out, dtype=case.dtype,
                                     graphs_only=("target",))
    path = out / "target.onnx"
    onnx.checker.check_model(str(path), full_check=True)
    inferred = onnx.shape_inference.infer_shapes(onnx.load(str(path), load_external_data=False), strict_mode=True)
    elem = {"float16": onnx.TensorProto.FLOAT16, "bfloat16": onnx.TensorProto.BFLOAT16}[case.dtype]
    assert inferred.graph.output[0].type.tensor_type.elem_type == elem
    assert manifest["dtype"] == case.dtype
    try:
        session = P.session(path)
    except (ort.capi.onnxruntime_pybind11_state.NotImplemented, ort.capi.onnxruntime_pybind11_state.Fail) as exc:
        pytest.skip(f"onnxruntime CPU cannot load a {case.dtype} graph: {str(exc).splitlines()[0][:160]}")
    target, drafter = load_pair(pair_dir / "target", pair_dir / "drafter", dtype=getattr(torch, case.dtype))
    job = graph_jobs(target, drafter, case.dtype)[0]
    ids = torch.tensor([[1, 2, 3, 4]])
    feeds = (ids, torch.arange(4)[None], torch.ones(1, 1, 4, 4, dtype=torch.bool).tril(),
             *[torch.zeros(1, 8, 0, 128, dtype=getattr(torch, case.dtype)) for _ in range(4)])
    try:
        got = P.run(session, job.spec, feeds)[0]
    except ort.capi.onnxruntime_pybind11_state.NotImplemented as exc:
        pytest.skip(f"onnxruntime CPU has no {case.dtype} kernel here: {str(exc).splitlines()[0][:160]}")
    with torch.no_grad():
        reference = job.module(*feeds)[0].float().numpy()
    if got.dtype == np.uint16:  # bfloat16 comes back as its bits
        got = torch.from_numpy(got).view(torch.bfloat16).float().numpy()
    got = got.astype(np.float32)
    assert np.abs(got - reference).max() <= case.tolerance


def _one_line_error(args) -> str:
    result = CliRunner().invoke(export_cli, args)
    assert result.exit_code == 2, result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    return result.output


def test_refusals_come_first_in_one_line(pair_dir, tmp_path, monkeypatch):
    base = ["--target", str(pair_dir / "target"), "--drafter", str(pair_dir / "drafter"), "--stream-weights"]
    # an architecture the loader does not implement: YaRN RoPE scaling (Qwen3's long-context recipe)
    yarn = tmp_path / "yarn"
    yarn.mkdir()
    config = {**fixtures.target_config("qwen3-8b", layers=2),
              "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
    (yarn / "config.json").write_text(json.dumps(config))
    output = _one_line_error(["--target", str(yarn), *base[2:], "--out", str(tmp_path / "a")])
    assert "rope_type 'yarn' is not supported" in output
    # a drafter made for another width / layer count
    other = tmp_path / "other"
    shutil.copytree(pair_dir / "drafter", other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "hidden_size": 2048, "num_target_layers": 28}))
    output = _one_line_error([*base[:2], "--drafter", str(other), "--stream-weights", "--out", str(tmp_path / "b")])
    assert "hidden_size 2048 != target's 1024" in output and "num_target_layers 28" in output
    # a disk too small for the weights
    monkeypatch.setattr(shutil, "disk_usage", lambda path: namedtuple("Usage", "total used free")(1, 1, 10**8))
    output = _one_line_error([*base, "--out", str(tmp_path / "c")])
    assert "need" in output and "0.1 GB free" in output
    assert not list((tmp_path / "c").glob("*.onnx*"))  # refused before writing a graph
    with pytest.raises(ExportError, match="--dtype"):
        export_pair_streaming(pair_dir / "target", pair_dir / "drafter", tmp_path / "d", dtype="int8")
    assert TargetConfig.from_folder(pair_dir / "target").vocab_size == 151936


def test_a_streamed_target_is_quantized_weight_by_weight(pair_dir, float32_export, tmp_path):
    """The streamed graph's MatMul(x, Transpose(W)) are folded and every one quantized (loading the whole
    graph, ORT's quantizer saw none of them); the int4 graph's logits follow the float32 graph's."""
    from dspark.engines.quantize import QuantizeOptions, quantize_graph

    out, manifest = float32_export
    name = manifest["graphs"]["target"]["file"]
    source = onnx.load(str(out / name), load_external_data=False)
    matmuls = sum(n.op_type == "MatMul" for n in source.graph.node)
    report = quantize_graph(out / name, tmp_path / name, QuantizeOptions("int4"))
    assert report["matmuls"] == report["quantized"] > 0 and report["left_float"] == 0
    quantized = onnx.load(str(tmp_path / name), load_external_data=False)
    assert sum(n.op_type == "MatMulNBits" for n in quantized.graph.node) == report["quantized"]
    assert sum(n.op_type == "MatMul" for n in quantized.graph.node) == matmuls - report["quantized"]
    target, _ = load_pair(pair_dir / "target", pair_dir / "drafter")
    feeds = F.target_feeds(target.config, F.Case(1, 5, 3), torch.float32, torch.Generator().manual_seed(0))
    logits = []
    for path in (out / name, tmp_path / name):
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        inputs = {i.name: feed.numpy() for i, feed in zip(session.get_inputs(), feeds, strict=True)}
        logits.append(session.run(["logits"], inputs)[0].reshape(-1).astype(np.float64))
    cosine = logits[0] @ logits[1] / np.linalg.norm(logits[0]) / np.linalg.norm(logits[1])
    assert cosine > 0.95, cosine  # a weight turned the wrong way (k/v projections are square here) breaks it
