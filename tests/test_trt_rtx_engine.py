"""`dspark-build-engine --backend tensorrt-rtx`: an engine directory built here, ahead of time,
whose engine.json names the flavour, TensorRT version and compute capabilities and keeps no SPS
table (nothing measured without the GPU); engine.json's schema refuses a bad tensorrt section;
`Runtime.load` serves such an engine through the TensorRT backend where an RTX-class GPU exists
(skipped here, saying why) and refuses it in one line where none does."""

from __future__ import annotations

import copy
import json
import sys

import pytest
from click.testing import CliRunner
from conftest import golden_path

from dspark.export.artifacts import ArtifactError
from dspark.export.engine_dir import ENGINE_JSON, TRT_FLAVOURS, load_engine_dir, validate
from dspark.runtime.trt_flavours import FLAVOURS
from dspark.tools.build_engine_command import build_engine

SET = "qwen3-tiny-vanilla"
ARGS = ["--backend", "tensorrt-rtx", "--buckets", "1,8", "--max-batch-tokens", "8", "--max-batch", "4",
        "--max-seq-len", "64", "--quiet"]


def gpu_reason(ccs: tuple[str, ...] = ("8.0", "8.9")) -> str | None:
    """Why an engine built for `ccs` cannot run here, or None when it can."""
    try:
        import tensorrt_rtx  # noqa: F401
        from cuda.bindings import runtime as cudart
    except ImportError as exc:
        return f"{exc.name} is not installed (pip install 'dspark[tensorrt-rtx]')"
    error, count = cudart.cudaGetDeviceCount()
    if error != cudart.cudaError_t.cudaSuccess or not count:
        return f"no CUDA GPU here ({cudart.cudaGetErrorName(error)[1].decode()})"
    attribute = cudart.cudaDeviceAttr
    major = cudart.cudaDeviceGetAttribute(attribute.cudaDevAttrComputeCapabilityMajor, 0)[1]
    minor = cudart.cudaDeviceGetAttribute(attribute.cudaDevAttrComputeCapabilityMinor, 0)[1]
    if f"{major}.{minor}" not in ccs:
        return f"the GPU here has compute capability {major}.{minor}, not one of {ccs} (not RTX-class)"
    return None


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    from dspark.export.pipeline import export_pair

    out = tmp_path_factory.mktemp("export")
    export_pair(golden_path(SET, "target"), golden_path(SET, "drafter"), out, check=False, flavours=("plain",))
    return out


@pytest.fixture(scope="module")
def engine(export_dir, tmp_path_factory):
    pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX is not installed (pip install 'dspark[tensorrt-rtx]')")
    out = tmp_path_factory.mktemp("rtx") / "engine"
    result = CliRunner().invoke(build_engine, [str(export_dir), "--out", str(out), *ARGS,
                                               "--compute-capabilities", "8.9,8.0"])
    assert result.exit_code == 0, result.output
    assert "SPS not measured: built ahead of time" in result.output
    return out


def test_the_engine_json_names_flavour_version_and_compute_capabilities(engine):
    import tensorrt_rtx

    manifest = load_engine_dir(engine, verify_files=True).manifest
    section = manifest["tensorrt"]
    assert manifest["backend"] == "tensorrt" and section["flavour"] == "tensorrt-rtx"
    assert section["version"] == tensorrt_rtx.__version__
    assert section["compute_capabilities"] == ["8.0", "8.9"]
    assert section["ahead_of_time"] is True and section["comparison"] is None and manifest["sps"] is None
    assert section["timing_cache"] is None and not (engine / "timing.cache").exists()
    assert set(manifest["graphs"]) == {"target", "target_static", "drafter_backbone", "drafter_head_step",
                                       "drafter_head_greedy"}
    for graph, profiles in section["profiles"].items():
        assert [p["bucket"] for p in profiles] == ([1, 8] if graph.startswith("target") else [8]), graph
    assert all((engine / entry["file"]).stat().st_size == entry["bytes"] for entry in manifest["graphs"].values())


@pytest.mark.parametrize("change,words", [
    (lambda m: m["tensorrt"].update(flavour="tensorrt-lite"), "tensorrt.flavour 'tensorrt-lite' is not one of"),
    (lambda m: m["tensorrt"].update(compute_capabilities=[]), "a tensorrt-rtx engine names the GPUs"),
    (lambda m: m["tensorrt"].update(compute_capabilities=["sm89"]), "must list versions such as '8.9'"),
    (lambda m: m["tensorrt"].pop("version"), "tensorrt.version must name"),
    (lambda m: m["tensorrt"].update(ahead_of_time=False), "sps.tables must hold at least one measured table"),
    (lambda m: m.update(backend="onnxruntime"), "only in an engine whose backend is tensorrt"),
])
def test_the_schema_refuses_a_bad_tensorrt_section(engine, change, words):
    manifest = json.loads((engine / ENGINE_JSON).read_text())
    validate(copy.deepcopy(manifest))
    change(manifest)
    with pytest.raises(ArtifactError, match=words):
        validate(manifest)


def test_the_flavour_names_agree_between_schema_and_runtime():
    assert tuple(FLAVOURS) == TRT_FLAVOURS


def test_an_engine_built_ahead_of_time_asks_for_reprofile_before_it_serves(engine):
    from dspark.runtime.api import Runtime

    with pytest.raises(ArtifactError, match=r"has no SPS table \(built ahead of time.*--reprofile on that GPU"):
        Runtime.load(engine)


def test_without_a_gpu_the_runtime_refuses_in_one_line(engine, export_dir):
    reason = gpu_reason()
    if reason is None:
        pytest.skip("an RTX-class GPU is here: test_serves_the_golden_trace_on_an_rtx_gpu runs instead")
    print(f"TensorRT-RTX engines cannot run here: {reason}")
    from dspark.export.cost_table import CostTable
    from dspark.runtime.api import Runtime
    from dspark.runtime.backend import BackendUnavailable

    table = CostTable.from_dict({"batches": [1], "buckets": [1, 8], "verify_seconds": [[1e-3, 2e-3]],
                                 "draft_seconds": [1e-3]})
    with pytest.raises(BackendUnavailable, match="TensorRT-RTX engines need an NVIDIA GPU with its driver"):
        Runtime.load(engine, cost_model=table)
    result = CliRunner().invoke(build_engine, [str(export_dir), "--out", str(engine), "--reprofile"])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert "need an NVIDIA GPU" in result.output and "Traceback" not in result.output


def test_serves_the_golden_trace_on_an_rtx_gpu(engine, export_dir, tmp_path):
    """Where an RTX-class GPU exists: --reprofile measures the SPS table, then the engine decodes
    the golden greedy trace through the TensorRT backend (never run here: no such GPU)."""
    reason = gpu_reason()
    if reason is not None:
        print(f"skipped: {reason}")
        pytest.skip(f"needs an RTX-class GPU: {reason}")
    import shutil

    from dspark.runtime.api import Runtime
    from dspark.runtime.trt_backend import TrtBackend

    served = tmp_path / "engine"
    shutil.copytree(engine, served)
    result = CliRunner().invoke(build_engine, [str(export_dir), "--out", str(served), "--reprofile", "--repeats", "2"])
    assert result.exit_code == 0, result.output
    sample = json.loads(golden_path(SET, "traces.json").read_text())["samples"][0]
    with Runtime.load(served) as runtime:
        assert isinstance(runtime.backend, TrtBackend) and runtime.backend.flavour.name == "tensorrt-rtx"
        tokens = runtime.generate(sample["prompt_ids"], max_new_tokens=32)[0].tokens
    assert tokens == sample["generated_ids"][:32]
    assert any((served / "runtime_cache").glob("*.cache"))


def test_bad_compute_capability_exits_2_in_one_line(export_dir, tmp_path):
    pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX is not installed (pip install 'dspark[tensorrt-rtx]')")
    result = CliRunner().invoke(build_engine, [str(export_dir), "--out", str(tmp_path / "e"), *ARGS,
                                               "--compute-capabilities", "9.0"])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert "--compute-capabilities 9.0: TensorRT-RTX builds for 7.5,8.0,8.6,8.9,12.0,12.1" in result.output


def test_tensorrt_rtx_missing_exits_2_naming_what_to_install(export_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt_rtx", None)  # `import tensorrt_rtx` raises ImportError
    result = CliRunner().invoke(build_engine, [str(export_dir), "--out", str(tmp_path / "e"), *ARGS])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert 'TensorRT-RTX is not installed: pip install "dspark[tensorrt-rtx]"' in result.output
    assert not (tmp_path / "e").exists()  # refused before anything was written
