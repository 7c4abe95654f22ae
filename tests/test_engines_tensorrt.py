"""TensorRT engines (needs TensorRT, Polygraphy and an NVIDIA GPU; skipped elsewhere, saying why):
one profile per bucket in each target plan, the Polygraphy TRT-vs-ORT check passing, an SPS table."""

from __future__ import annotations

import math

import pytest
from conftest import golden_path

from dspark.export.cost_table import MIN_SECONDS

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
    # the SPS table holds real measurements (above the lookup's MIN_SECONDS clamp) at every B >= R,
    # and SPS(1, 1) is 1 / (drafting + verifying one token) as measured, not a clamped value
    raw = engine.manifest["sps"]["tables"]["target"]
    assert raw["batches"] == [1, 2, 4] and raw["buckets"] == list(buckets)
    for r, row in zip(raw["batches"], raw["verify_seconds"], strict=True):
        assert all((v is None) == (b < r) for b, v in zip(buckets, row, strict=True))
        assert all(MIN_SECONDS < v < math.inf for v in row if v is not None), row
    assert all(MIN_SECONDS < d < math.inf for d in raw["draft_seconds"])
    measured = raw["draft_seconds"][0] + raw["verify_seconds"][0][0]
    assert float(engine.cost_table("target").sps(1, 1)) == pytest.approx(1.0 / measured, rel=1e-12)
