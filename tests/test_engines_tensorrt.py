"""TensorRT engines (needs TensorRT, Polygraphy and an NVIDIA GPU; skipped elsewhere, saying why):
one profile per bucket in each target plan, the Polygraphy TRT-vs-ORT check passing, an SPS table."""

from __future__ import annotations

import pytest
from conftest import golden_path

pytestmark = [pytest.mark.gpu, pytest.mark.tensorrt]
trt = pytest.importorskip("tensorrt", reason="TensorRT is not installed (pip install 'dspark[tensorrt]' on a GPU box)")
pytest.importorskip("polygraphy", reason="Polygraphy is not installed (pip install 'dspark[tensorrt]')")


def test_tensorrt_engine_for_the_golden_pair(tmp_path):
    from dspark.engines import build as B
    from dspark.engines.trt_builder import plugin_library_path
    from dspark.export.engine_dir import load_engine_dir
    from dspark.export.pipeline import export_pair

    if not plugin_library_path().is_file():
        pytest.skip(f"{plugin_library_path()} not built (run plugins/build.sh with TensorRT headers)")
    export = tmp_path / "export"
    export_pair(golden_path("qwen3-tiny-vanilla", "target"), golden_path("qwen3-tiny-vanilla", "drafter"), export,
                check=False)
    buckets = (1, 8, 32)
    B.build_engine(export, tmp_path / "engine", B.BuildOptions(backend="tensorrt", buckets=buckets,
                                                               max_batch_tokens=32, max_batch=4, max_seq_len=128,
                                                               warmup=1, repeats=3))
    engine = load_engine_dir(tmp_path / "engine", verify_files=True)
    section = engine.manifest["tensorrt"]
    assert [p["bucket"] for p in section["profiles"]["target"]] == list(buckets)
    assert len(section["profiles"]["drafter_backbone"]) == 1
    assert section["comparison"] and all(c["passed"] for c in section["comparison"])
    assert (tmp_path / "engine" / section["timing_cache"]).is_file()
    assert engine.sps(1, 1) > 0
