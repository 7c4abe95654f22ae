"""Random tiny pairs (Qwen3 and Llama deltas, every head type) exported with the parity sweep;
external data, half precision, and the CLI's errors."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict

import pytest
from click.testing import CliRunner
from conftest import golden_path, random_pair
from safetensors.torch import save_file

from dspark.export.manifest import read_manifest
from dspark.export.parity import session
from dspark.export.pipeline import export_pair
from dspark.tools.export_command import export as export_command

ATOL = 1e-4


def save_pair(folder, seed: int, model_type: str = "qwen3", **drafter_overrides):
    """Write a random pair as a HF target folder and a DeepSpec drafter folder (sharing the
    target's embedding and LM head, so the drafter checkpoint omits them)."""
    qk = {"qk_norm": model_type == "qwen3"}
    target, drafter = random_pair(seed, qk, {**qk, **drafter_overrides}, scale=4.0)
    paths = []
    for name, model in (("target", target), ("drafter", drafter)):
        path = folder / name
        path.mkdir()
        config = {k: v for k, v in asdict(model.config).items() if k not in ("qk_norm", "eos_token_ids")}
        config["model_type"] = model_type
        state = model.state_dict()
        if name == "target":
            state = {(k if k.startswith("lm_head") else f"model.{k}"): v for k, v in state.items()}
        else:
            state = {k: v for k, v in state.items() if k not in ("embed_tokens.weight", "lm_head.weight")}
        (path / "config.json").write_text(json.dumps(config))
        save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
        paths.append(path)
    return paths


@pytest.mark.parametrize(
    "model_type, overrides",
    [
        ("qwen3", {"markov_head_type": "gated"}),
        ("llama", {"markov_head_type": "rnn", "confidence_head_with_markov": False}),
        ("llama", {"markov_rank": 0, "enable_confidence_head": False, "confidence_head_with_markov": False}),
    ],
    ids=["qwen3-gated", "llama-rnn", "llama-dflash"],
)
def test_random_pairs_match_pytorch(tmp_path, model_type, overrides):
    target_dir, drafter_dir = save_pair(tmp_path, 3, model_type, **overrides)
    out = tmp_path / "out"
    manifest = export_pair(target_dir, drafter_dir, out)
    assert read_manifest(out) == json.loads(json.dumps(manifest))
    expected = {"target", "target_static", "drafter_backbone"}
    if overrides.get("markov_rank", 4) or overrides.get("enable_confidence_head", True):
        expected |= {"drafter_head_step", "drafter_head_greedy"}
    assert set(manifest["graphs"]) == expected == set(manifest["parity"])
    for name, result in manifest["parity"].items():
        assert set(result["max_abs_diff"]) == {o["name"] for o in manifest["graphs"][name]["outputs"]}
        worst = max(result["max_abs_diff"].values())
        assert worst <= ATOL, f"{name}: {result}"
    cases = " ".join(manifest["parity"]["target"]["cases"])
    assert all(kind in cases for kind in ("causal", "tree", "padded", "b4", "t64", "p256"))


def test_external_data_and_float16(tmp_path):
    target_dir, drafter_dir = save_pair(tmp_path, 4)
    out = tmp_path / "out"
    manifest = export_pair(target_dir, drafter_dir, out, dtype="float16", external_data_threshold=10_000)
    target = manifest["graphs"]["target"]
    assert [f["path"] for f in target["files"]] == ["target.onnx", "target.onnx.data"]
    assert (out / "target.onnx.data").stat().st_size > 10_000  # the weights moved out
    assert all(i["dtype"] == "float16" for i in target["inputs"] if i["name"].startswith("past"))
    sess = session(out / "target.onnx")  # loads the external weights
    assert sess.get_outputs()[0].type == "tensor(float16)"
    for result in manifest["parity"].values():  # half precision vs PyTorch in half precision
        assert max(result["max_abs_diff"].values()) < 0.05


def test_bfloat16_graphs_are_valid_and_typed(tmp_path):
    target_dir, drafter_dir = save_pair(tmp_path, 5)
    manifest = export_pair(target_dir, drafter_dir, tmp_path / "out", dtype="bfloat16")
    logits = manifest["graphs"]["target"]["outputs"][0]
    assert logits == {"name": "logits", "dtype": "bfloat16", "dims": ["batch", "tokens", 32]}
    # ONNX Runtime's CPU provider has no bfloat16 MatMul: the sweep says so instead of failing.
    assert all("skipped" in r or "max_abs_diff" in r for r in manifest["parity"].values())


def _cli(*args: str):
    return CliRunner().invoke(export_command, ["--quiet", *args])


def test_cli_exports_and_reports(tmp_path):
    target_dir, drafter_dir = save_pair(tmp_path, 6)
    result = _cli(
        "--target", str(target_dir), "--drafter", str(drafter_dir), "--out", str(tmp_path / "o"), "--no-check"
    )
    assert result.exit_code == 0, result.output
    assert "target_static.onnx" in result.output
    assert read_manifest(tmp_path / "o")["parity"] is None


def _assert_user_error(result, *fragments: str) -> None:
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dspark-export: error:"), result.output
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in lines[0]


def test_cli_user_errors(tmp_path):
    target_dir, drafter_dir = save_pair(tmp_path, 7)
    ok = ["--target", str(target_dir), "--drafter", str(drafter_dir), "--out", str(tmp_path / "o")]
    _assert_user_error(_cli(*ok, "--dtype", "int8"), "int8", "float16")
    _assert_user_error(_cli(*ok, "--opset", "9"), "opset 9")
    _assert_user_error(_cli("--target", str(tmp_path / "nope"), *ok[2:]), "does not exist")

    (tmp_path / "empty").mkdir()
    _assert_user_error(_cli("--target", str(tmp_path / "empty"), *ok[2:]), "config.json")

    gemma = tmp_path / "gemma"
    shutil.copytree(target_dir, gemma)
    config = json.loads((gemma / "config.json").read_text())
    (gemma / "config.json").write_text(json.dumps({**config, "model_type": "gemma3"}))
    _assert_user_error(_cli("--target", str(gemma), *ok[2:]), "gemma3", "not supported")

    corrupt = tmp_path / "corrupt"
    shutil.copytree(target_dir, corrupt)
    (corrupt / "model.safetensors").write_bytes(b"\x00not a safetensors file")
    _assert_user_error(_cli("--target", str(corrupt), *ok[2:]), "safetensors")

    no_weights = tmp_path / "no_weights"
    shutil.copytree(drafter_dir, no_weights)
    (no_weights / "model.safetensors").unlink()
    _assert_user_error(_cli(*ok[:2], "--drafter", str(no_weights), *ok[4:]), "no *.safetensors")

    (tmp_path / "file").write_text("x")
    _assert_user_error(_cli(*ok[:4], "--out", str(tmp_path / "file")), "not a directory")


def test_cli_refuses_a_drafter_made_for_another_target(tmp_path):
    _, drafter_dir = save_pair(tmp_path, 8)  # hidden 32, vocab 32: not the golden target's
    golden_target = golden_path("qwen3-tiny-vanilla", "target")
    result = _cli("--target", str(golden_target), "--drafter", str(drafter_dir), "--out", str(tmp_path / "o"))
    _assert_user_error(result, "does not fit the target", "vocab_size")
