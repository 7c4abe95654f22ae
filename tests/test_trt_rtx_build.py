"""TensorRT-RTX plans built here, ahead of time, on the CPU (no GPU is needed to build them):
every graph of the golden Qwen3 exports and of the bundled demo pair, for compute capabilities 8.0
and 8.9, checked against the graph contract (the network TensorRT parsed: input and output names,
dtypes, dims) and against the bucket table (the min/opt/max TensorRT holds for every profile).
A mismatched profile, an inconsistent one and an unsupported op each fail with a named reason
(TensorRT's own words where TensorRT refuses).

Cost: plans are built once per session and shared by content (the golden sets share one target),
with the smallest bucket table that still has a one-token bucket and a multi-row one."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest
from conftest import golden_path

from dspark.engines import trt_builder as TB
from dspark.engines.buckets import ShapeLimits, profile_shapes
from dspark.engines.export_source import BuildError
from dspark.engines.trt_contract import ContractMismatch, check_network, check_profiles
from dspark.export.manifest import graph_specs, read_manifest
from dspark.runtime.trt_flavours import TENSORRT_RTX

trt = pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX is not installed (pip install 'dspark[tensorrt-rtx]')")

CCS = ("8.0", "8.9")
BUCKETS = (1, 8)  # a one-token bucket (batch 1, tokens 1) and one with several rows and tokens
MAX_BATCH, MAX_SEQ_LEN = 4, 64
EXPORTS = {  # name -> (target dir parts, drafter dir parts, flavours)
    "qwen3-vanilla": (("qwen3-tiny-vanilla", "target"), ("qwen3-tiny-vanilla", "drafter"), ("plain", "fused")),
    "qwen3-gated": (("qwen3-tiny-gated-rnn", "target"), ("qwen3-tiny-gated-rnn", "drafter_gated"), ("plain",)),
    "qwen3-rnn": (("qwen3-tiny-gated-rnn", "target"), ("qwen3-tiny-gated-rnn", "drafter_rnn"), ("plain",)),
    "qwen3-dflash": (("dflash-tiny", "target"), ("dflash-tiny", "drafter"), ("plain",)),
    "demo": (None, None, ("plain",)),
}
BUILD_TIMES: dict[str, float] = {}


def limits_of(manifest: dict) -> ShapeLimits:
    return ShapeLimits(max_batch=MAX_BATCH, max_seq_len=MAX_SEQ_LEN, verify_width=1 + manifest["drafter"]["block_size"])


@pytest.fixture(scope="session")
def exports(tmp_path_factory):
    """name -> export dir, exported on first use."""
    from dspark.export.pipeline import export_pair
    from dspark.tools.demo_engine import DEMO_DRAFTER, DEMO_TARGET

    root, made = tmp_path_factory.mktemp("trt-rtx-exports"), {}

    def get(name: str) -> Path:
        if name not in made:
            target, drafter, flavours = EXPORTS[name]
            target = DEMO_TARGET if target is None else golden_path(*target)
            drafter = DEMO_DRAFTER if drafter is None else golden_path(*drafter)
            export_pair(target, drafter, root / name, check=False, flavours=flavours)
            made[name] = root / name
        return made[name]

    return get


@pytest.fixture(scope="session")
def rtx():
    return trt, TB.make_logger(trt)


@pytest.fixture(scope="session")
def plans(rtx):
    """(onnx file, profiles) -> (plan, what TensorRT holds), built once per content."""
    module, logger = rtx
    cache: dict[str, tuple[bytes, dict]] = {}

    def build(onnx: Path, profiles: list[dict]) -> tuple[bytes, dict]:
        key = hashlib.sha256(onnx.read_bytes() + json.dumps(profiles).encode() + str(CCS).encode()).hexdigest()
        if key not in cache:
            begin = time.perf_counter()
            cache[key] = TB.build_plan(module, logger, TENSORRT_RTX, onnx, profiles, ccs=CCS)
            BUILD_TIMES[f"{onnx.parent.name}/{onnx.stem}"] = time.perf_counter() - begin
        return cache[key]

    yield build
    print("\nTensorRT-RTX plan builds (s): " + ", ".join(f"{k} {v:.2f}" for k, v in BUILD_TIMES.items()))


@pytest.mark.parametrize("name", list(EXPORTS))
def test_every_graph_of_the_export_builds_and_matches_its_contract(name, exports, plans):
    export = exports(name)
    manifest = read_manifest(export, verify="none")
    specs, limits = graph_specs(manifest), limits_of(manifest)
    graphs = TB.buildable_graphs(manifest)
    assert {"target", "target_static", "drafter_backbone"} <= set(graphs)
    for graph in graphs:
        spec = specs[graph]
        plan, held = plans(export / manifest["graphs"][graph]["file"], TB.graph_profiles(spec, BUCKETS, limits))
        assert len(plan) > 1000, graph
        check_network(spec, held["network"])
        assert held["network"]["plugins"] == [], graph  # tree masks are inputs: no plugin library needed
        check_profiles(spec, held["profiles"], BUCKETS, limits)
        # the profiles TensorRT holds are the bucket table's, bucket by bucket
        wanted = [profile_shapes(spec, b, limits) for b in TB.graph_buckets(graph, BUCKETS)]
        assert held["profiles"] == [{k: [list(s) for s in v] for k, v in p.items()} for p in wanted], graph


def _golden(exports) -> tuple[Path, dict, dict, ShapeLimits]:
    export = exports("qwen3-vanilla")
    manifest = read_manifest(export, verify="none")
    return export, manifest, graph_specs(manifest), limits_of(manifest)


def test_a_plan_built_with_a_mismatched_profile_fails_the_check(exports, plans):
    """Bucket 8's profile with room for 4 tokens only: TensorRT builds it, the contract check refuses."""
    export, _, specs, limits = _golden(exports)
    spec = specs["drafter_head_step"]
    narrow = ShapeLimits(max_batch=2, max_seq_len=limits.max_seq_len, verify_width=limits.verify_width)
    plan, held = plans(export / "drafter_head_step.onnx", TB.graph_profiles(spec, BUCKETS, narrow))
    assert plan
    with pytest.raises(ContractMismatch, match=r"profile 0 \(bucket 8\).*hidden \(4, 64\), outside"):
        check_profiles(spec, held["profiles"], BUCKETS, limits)


def test_a_target_plan_with_too_few_profiles_fails_the_check(exports, plans):
    export, _, specs, limits = _golden(exports)
    spec = specs["target"]
    _, held = plans(export / "target.onnx", TB.graph_profiles(spec, BUCKETS, limits))
    with pytest.raises(ContractMismatch, match=r"has 1 optimization profiles; buckets \[1, 8\] need 2"):
        check_profiles(spec, held["profiles"][1:], BUCKETS, limits)
    swapped = r"profile 0 \(bucket 1\): opt batch 1 x tokens 8 exceeds the bucket; .* profile 1 \(bucket 8\): a call"
    with pytest.raises(ContractMismatch, match=swapped + r" .* needs input_ids \(1, 8\)"):
        check_profiles(spec, held["profiles"][::-1], BUCKETS, limits)  # profiles swapped


def test_a_network_that_differs_from_the_contract_fails_the_check(exports, plans):
    export, _, specs, limits = _golden(exports)
    spec = specs["drafter_head_step"]
    _, held = plans(export / "drafter_head_step.onnx", TB.graph_profiles(spec, BUCKETS, limits))
    renamed = {**held["network"], "outputs": [{**held["network"]["outputs"][0], "name": "scores"},
                                              *held["network"]["outputs"][1:]]}
    with pytest.raises(ContractMismatch, match=r"outputs are \['scores', 'confidence_logit'\]"):
        check_network(spec, renamed)
    retyped = {**held["network"], "inputs": [*held["network"]["inputs"][:2],
                                             {**held["network"]["inputs"][2], "dtype": "int32"}]}
    with pytest.raises(ContractMismatch, match="input prev_ids: dtype int32, the contract says int64"):
        check_network(spec, retyped)


def test_an_inconsistent_profile_fails_with_tensorrts_message(exports, rtx):
    """opt columns of the mask != opt past + opt tokens: TensorRT refuses, and says so in the error."""
    export, _, specs, limits = _golden(exports)
    (shapes,) = TB.graph_profiles(specs["target"], (8,), limits)
    low, opt, high = shapes["attention_mask"]
    shapes = {**shapes, "attention_mask": (low, (*opt[:3], opt[3] + 5), high)}
    with pytest.raises(BuildError, match=r"TensorRT-RTX could not build .*target.onnx: .*Error Code 4.*profile 0 "
                                         r"violate shape constraints"):
        TB.build_plan(*rtx, TENSORRT_RTX, export / "target.onnx", [shapes], ccs=CCS)


def test_unsupported_ops_fail_with_tensorrts_message(exports, rtx):
    """The fused flavour's ONNX Runtime contrib op GroupQueryAttention: TensorRT's parser message."""
    export, manifest, _, _ = _golden(exports)
    assert {"target_fused", "target_fused_tree"} <= set(manifest["graphs"]) - set(TB.buildable_graphs(manifest))
    with pytest.raises(BuildError, match=r"TensorRT could not parse .*target_fused.onnx: .*GroupQueryAttention"):
        TB.build_plan(*rtx, TENSORRT_RTX, export / "target_fused.onnx", [], ccs=CCS)


def test_turing_cannot_take_a_float32_export_and_tensorrt_says_why(exports, rtx):
    """7.5 is selectable, but TensorRT-RTX has no FP32 GEMM for Turing: its message reaches the user."""
    export, _, specs, limits = _golden(exports)
    spec = specs["drafter_head_step"]
    with pytest.raises(BuildError, match=r"for Turing \(SM75\): FP32 GEMM is not supported"):
        TB.build_plan(*rtx, TENSORRT_RTX, export / "drafter_head_step.onnx", TB.graph_profiles(spec, BUCKETS, limits),
                      ccs=("7.5",))
