"""Engine pieces that need no model and no GPU: buckets and profile shapes, engine.json schema,
the cost table, export-dir errors and the TensorRT-missing message of dspark-build-engine."""

from __future__ import annotations

import copy
import json
import sys

import pytest
from click.testing import CliRunner

from dspark.engines.buckets import (
    ShapeLimits,
    dim_ranges,
    parse_buckets,
    plan_buckets,
    profile_shapes,
)
from dspark.export import contract as C
from dspark.export.artifacts import ArtifactError, sha256
from dspark.export.cost_table import CostTable
from dspark.export.engine_dir import BucketError, bucket_for, validate
from dspark.tools.build_engine_command import build_engine

LIMITS = ShapeLimits(max_batch=8, max_seq_len=256, verify_width=8)


def test_parse_buckets():
    assert parse_buckets("1,2, 4,16") == (1, 2, 4, 16)
    for bad, words in [("1,x", "integers"), ("0,2", ">= 1"), ("4,2", "increasing"), ("2,2", "increasing")]:
        with pytest.raises(BucketError, match=words):
            parse_buckets(bad)


def test_plan_buckets():
    assert plan_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert plan_buckets(48) == (1, 2, 4, 8, 16, 32, 48)
    assert plan_buckets(1) == (1,)
    assert plan_buckets(100, (3, 10, 100)) == (3, 10, 100)
    with pytest.raises(BucketError, match="exceeds --max-batch-tokens"):
        plan_buckets(16, (4, 32))
    with pytest.raises(BucketError, match=">= 1"):
        plan_buckets(0)


def test_bucket_for_picks_smallest_holding_bucket():
    buckets = (1, 2, 4, 8, 16, 32, 64)
    for tokens in range(1, 65):
        k = bucket_for(tokens, buckets)
        assert buckets[k] >= tokens and (k == 0 or buckets[k - 1] < tokens)
    with pytest.raises(BucketError, match="exceed the largest bucket 64"):
        bucket_for(65, buckets)
    with pytest.raises(BucketError, match="at least 1"):
        bucket_for(0, buckets)


@pytest.mark.parametrize("bucket", [1, 2, 7, 8, 16, 64, 512])
def test_dim_ranges_are_ordered_and_cover_every_call_of_the_bucket(bucket):
    r = dim_ranges(bucket, LIMITS)
    for name, (low, opt, high) in r.items():
        assert low <= opt <= high, name
    for batch in range(1, LIMITS.max_batch + 1):
        for tokens in range(1, min(bucket // batch, LIMITS.max_seq_len) + 1):
            assert r["batch"][0] <= batch <= r["batch"][2]
            assert r["tokens"][0] <= tokens <= r["tokens"][2]
    assert r["batch"][2] == min(bucket, LIMITS.max_batch)
    assert r["tokens"][1] == min(bucket, LIMITS.verify_width)  # opt: one verification block per row
    assert r["total"][2] == r["past"][2] + r["tokens"][2]
    assert r["capacity"] == (256, 256, 256)


def _target_spec():
    from dspark.export.contract import TensorSpec

    return C.GraphSpec("target", (TensorSpec("input_ids", "int64", ("batch", "tokens")),
                                  TensorSpec("attention_mask", "bool", ("batch", 1, "tokens", "total")),
                                  TensorSpec("past_key_values.0.key", "float32", ("batch", 2, "past", 16))), ())


def test_profile_shapes_min_opt_max():
    shapes = profile_shapes(_target_spec(), 16, LIMITS)
    assert shapes["input_ids"] == ((1, 1), (2, 8), (8, 16))
    assert shapes["attention_mask"] == ((1, 1, 1, 1), (2, 1, 8, 128 + 8), (8, 1, 16, 256 + 16))
    assert shapes["past_key_values.0.key"] == ((1, 2, 0, 16), (2, 2, 128, 16), (8, 2, 256, 16))
    bad = C.GraphSpec("x", (C.TensorSpec("a", "int64", ("batch", "mystery")),), ())
    with pytest.raises(BucketError, match="mystery"):
        profile_shapes(bad, 4, LIMITS)


def _manifest() -> dict:
    table = {"batches": [1, 2], "buckets": [1, 4, 16], "verify_seconds": [[1e-3, 2e-3, 4e-3], [None, 2.5e-3, 5e-3]],
             "draft_seconds": [1e-3, 1.5e-3]}
    return {
        "format_version": 1, "kind": "dspark-engine", "backend": "onnxruntime",
        "export": {"dir": "/x"}, "graphs": {"target": {"file": "graphs/target.onnx", "bytes": 1, "sha256": "0"}},
        "limits": {"max_batch": 2, "max_seq_len": 64, "verify_width": 4, "max_batch_tokens": 16},
        "buckets": [1, 4, 16], "sps": {"tables": {"target": table}}, "calibration": None,
        "built_with": {}, "build_seconds": 1.0,
    }


def test_manifest_schema_accepts_a_good_manifest_and_names_each_bad_field():
    assert validate(_manifest())["backend"] == "onnxruntime"
    good_cal = {"temperatures": [1.0, 0.5, 2.0], "ece_before": [0.1] * 3, "ece_after": [0.05] * 3}
    assert validate({**_manifest(), "calibration": good_cal})
    cases = [
        (lambda m: m.pop("sps"), "missing fields"),
        (lambda m: m.update(format_version=2), "format_version"),
        (lambda m: m.update(backend="tvm"), "backend"),
        (lambda m: m.update(buckets=[4, 2]), "strictly increasing"),
        (lambda m: m.update(buckets=[1, 32]), "exceeds limits.max_batch_tokens"),
        (lambda m: m["limits"].update(max_batch=0), "limits.max_batch"),
        (lambda m: m["graphs"]["target"].pop("sha256"), "graphs.target"),
        (lambda m: m["sps"]["tables"]["target"]["verify_seconds"].pop(), "verify_seconds must be a 2 x 3"),
        (lambda m: m["sps"]["tables"]["target"]["verify_seconds"][0].__setitem__(0, -1.0), "positive seconds"),
        (lambda m: m["sps"]["tables"]["target"].update(draft_seconds=[1.0]), "draft_seconds"),
        (lambda m: m.update(calibration={**good_cal, "temperatures": [1.0]}), "one value per block slot"),
        (lambda m: m.update(calibration={**good_cal, "temperatures": [1.0, 0.0, 1.0]}), "> 0"),
    ]
    for mutate, words in cases:
        m = copy.deepcopy(_manifest())
        mutate(m)
        with pytest.raises(ArtifactError, match=words):
            validate(m)


def test_cost_table_interpolates_and_never_gets_cheaper_with_more_tokens():
    t = CostTable.from_dict(_manifest()["sps"]["tables"]["target"])
    assert t.seconds(1, 1) == pytest.approx(2e-3)
    assert t.seconds(1, 4) == pytest.approx(3e-3)
    assert t.verify_seconds(1, 10) == pytest.approx(3e-3)  # halfway between buckets 4 and 16
    assert t.verify_seconds(1, 28) == pytest.approx(6e-3)  # the last segment's slope, extrapolated
    assert t.draft_seconds(3) == pytest.approx(1.5 * t.draft_seconds(2))  # past R_max: the work scaled
    # past R_max a wider step never costs less, and more rows never cost less
    wide = [float(t.seconds(r, r * w)) for r in (2, 4, 64) for w in range(1, 9)]
    for r in range(3):
        assert wide[8 * r : 8 * r + 8] == sorted(wide[8 * r : 8 * r + 8])
    assert wide[0::8] == sorted(wide[0::8])
    # past R_max: R_max's cost along B, plus the median per-row difference of the last two rows (0.5, 1 ms)
    assert t.verify_seconds(64, 64) == pytest.approx(t.verify_seconds(2, 64) + 62 * 0.75e-3)
    one = CostTable((2,), (2, 4), ((2e-3, 3e-3),), (1e-3,))  # one batch: no row cost to read, copies of it
    assert one.verify_seconds(4, 8) == pytest.approx(2 * one.verify_seconds(2, 4))
    assert t.sps(2, 4) == pytest.approx(1 / (1.5e-3 + 2.5e-3))
    noisy = CostTable((1,), (1, 2, 4), ((2e-3, 1e-3, 3e-3),), (0.0,))  # bucket 1 measured slower than 2
    assert noisy.verify_seconds(1, 1) == pytest.approx(1e-3)  # its cost is at most bucket 2's
    assert noisy.verify_seconds(1, 2) == pytest.approx(1e-3)
    assert noisy.verify_seconds(1, 3) == pytest.approx(2e-3)
    assert [noisy.seconds(1, b) for b in range(1, 9)] == sorted(noisy.seconds(1, b) for b in range(1, 9))
    with pytest.raises(ValueError, match="no measured bucket"):
        CostTable((1, 2), (1,), ((1e-3,), (None,)), (0.0, 0.0))


def _fake_export(tmp_path, corrupt: str | None = None):
    root = tmp_path / "export"
    root.mkdir()
    (root / "target.onnx").write_bytes(b"onnx bytes")
    files = [{"path": "target.onnx", "bytes": 10, "sha256": sha256(root / "target.onnx")}]
    io = [{"name": "input_ids", "dtype": "int64", "dims": ["batch", "tokens"]}]
    entry = {"file": "target.onnx", "files": files, "inputs": io, "outputs": io}
    target = {"vocab_size": 8, "hidden_size": 4, "num_layers": 1, "num_kv_heads": 1, "head_dim": 4,
              "max_position_embeddings": 64, "context_feature_size": 4, "eos_token_ids": [0]}
    drafter = {"block_size": 4, "mask_token_id": 7, "num_layers": 1, "num_kv_heads": 1, "head_dim": 4,
               "markov_rank": 0, "markov_head_type": None, "enable_confidence_head": False}
    manifest = {"format_version": 1, "dtype": "float32", "target": target, "drafter": drafter,
                "lm_head_in_backbone": True, "graphs": {"target": entry, "drafter_backbone": entry}}
    text = json.dumps(manifest)
    if corrupt == "fields":
        text = text.replace('"vocab_size": 8', '"vocab_size": "8"')
    if corrupt == "json":
        text = text[:40]
    if corrupt == "sha":
        (root / "target.onnx").write_bytes(b"tampered!!")
    (root / "export.json").write_text(text)
    return root


def _run(args):
    result = CliRunner().invoke(build_engine, args)
    return result.exit_code, result.output.strip()


@pytest.mark.parametrize("case,words", [
    ("missing", "is not a directory"),
    ("json", "export.json: is not valid JSON"),
    ("sha", "target.onnx: does not match the sha256"),
    ("buckets", "strictly increasing"),
    ("fields", "target.vocab_size must be a non-negative integer"),
])
def test_build_engine_user_errors_exit_2_with_one_line(tmp_path, case, words):
    export = tmp_path / "nowhere" if case == "missing" else _fake_export(tmp_path, case if case != "buckets" else None)
    args = [str(export), "--out", str(tmp_path / "engine")]
    if case == "buckets":
        args += ["--buckets", "8,4"]
    code, output = _run(args)
    assert code == 2, output
    assert len(output.splitlines()) == 1 and words in output and "Traceback" not in output
    assert output.startswith("dspark-build-engine: error: ")


def test_tensorrt_missing_exits_2_naming_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # `import tensorrt` raises ImportError
    code, output = _run([str(_fake_export(tmp_path)), "--out", str(tmp_path / "engine"), "--backend", "tensorrt"])
    assert code == 2
    assert output.splitlines() == [output]
    assert 'pip install "dspark[tensorrt]"' in output and "NVIDIA GPU" in output
    assert not (tmp_path / "engine").exists()  # refused before anything was written
