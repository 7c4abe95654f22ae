"""`dspark train draft-model` on a tiny corpus slice, and onnxruntime-genai's draft-model
speculation peer: its availability lines, and its output against the target's greedy tokens."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from dspark.models import TargetModel
from dspark.runtime.reference_decoder import autoregressive_generate
from dspark.tools import corpus, draft_model
from dspark.tools.bench import peers, report, single_stream
from dspark.tools.demo_training import Schedule, target_config_dict, train_target
from dspark.tools.training_data import RandomWindows

TINY = ["--batch", "2", "--seq-len", "32", "--limit-files", "3", "--steps", "4", "--warmup", "1", "--no-progress"]


def _invoke(*args: str) -> str:
    result = CliRunner().invoke(draft_model.draft_model_command, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-layer target (head size 16, the least onnxruntime-genai's attention takes) with a
    300-token tokenizer, trained a few steps on three corpus files."""
    root = tmp_path_factory.mktemp("draft-model")
    tokenizer = corpus.train_tokenizer(corpus.read_documents(corpus.corpus_files("train")[:3]), 300)
    tokenizer.save(str(root / "tokenizer.json"))
    stream = corpus.encode_corpus(tokenizer, corpus.read_documents(corpus.corpus_files("train")[:3]))
    config = target_config_dict(vocab_size=tokenizer.get_vocab_size(), hidden_size=64, intermediate_size=64,
                                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                eos_token_id=0)
    train_target(RandomWindows(stream, 2, 32, 0), config, Schedule(steps=3, batch=2, seq_len=32, lr=3e-3, warmup=1),
                 folder=root / "target", tokenizer_file=root / "tokenizer.json", progress=False)
    return root / "target"


@pytest.fixture(scope="module")
def tiny_draft(tiny_target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = tmp_path_factory.mktemp("user-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DSPARK_CACHE", str(cache))
        output = _invoke("--target", str(tiny_target), *TINY)
        assert "held-out loss" in output
        out = draft_model.find_draft_model(tiny_target)
        assert out is not None and out.parent == cache
        assert "up to date" in _invoke("--target", str(tiny_target), *TINY)
        assert draft_model.find_draft_model(tiny_target.parent) is None  # no checkpoint there
    return out


def test_draft_model_is_a_smaller_qwen3_of_the_target(tiny_target: Path, tiny_draft: Path) -> None:
    target = json.loads((tiny_target / "config.json").read_text())
    config = json.loads((tiny_draft / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["architectures"] == ["Qwen3ForCausalLM"]
    for key in ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "eos_token_id"):
        assert config[key] == target[key], key
    assert (tiny_draft / "tokenizer.json").read_bytes() == (tiny_target / "tokenizer.json").read_bytes()
    record = json.loads((tiny_draft / draft_model.RECORD).read_text())
    assert record["target_key"] == draft_model.target_key(tiny_target) and record["steps"] == 4
    training = json.loads((tiny_draft / "training.json").read_text())
    assert training["heldout"]["tokens"] > 100 and 0 < training["heldout"]["loss"] < 20
    model = TargetModel.from_pretrained(tiny_draft)
    with torch.no_grad():
        logits = model(torch.tensor([[5, 6, 7]]), torch.arange(3)[None]).logits
    assert logits.shape == (1, 3, target["vocab_size"])


def test_draft_model_loads_in_transformers(tiny_draft: Path) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.Qwen3ForCausalLM.from_pretrained(str(tiny_draft), dtype=torch.float32).eval()
    ours = TargetModel.from_pretrained(tiny_draft)
    ids = torch.tensor([[3, 9, 27, 81]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids, torch.arange(4)[None]).logits, hf(ids).logits, atol=1e-4, rtol=1e-4)


def test_two_layers_and_bad_target(tiny_target: Path, tmp_path: Path) -> None:
    _invoke("--target", str(tiny_target), "--out", str(tmp_path / "two"), "--layers", "2", *TINY)
    assert json.loads((tmp_path / "two" / "config.json").read_text())["num_hidden_layers"] == 2
    result = CliRunner().invoke(draft_model.draft_model_command, ["--target", str(tmp_path), "--out", str(tmp_path)])
    assert result.exit_code != 0 and "not a target checkpoint with a tokenizer" in result.output
    result = CliRunner().invoke(draft_model.draft_model_command, ["--target", str(tiny_target), "--layers", "3"])
    assert result.exit_code != 0


def test_peer_availability_lines(monkeypatch, tiny_target: Path, tmp_path: Path) -> None:
    name = peers.draft_model_name(4)
    with monkeypatch.context() as patch:
        patch.setitem(sys.modules, "onnxruntime_genai", None)  # import fails
        with pytest.raises(peers.PeerUnavailable, match=r"skipped: pip install") as missing:
            peers.genai_draft_systems(tiny_target, tmp_path, tmp_path, stop=0, threads=1)
    assert missing.value.system == name
    pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (the bench extra)")
    with pytest.raises(peers.PeerUnavailable, match=r"no draft model for this target.*dspark train draft-model"):
        peers.genai_draft_systems(tiny_target, None, tmp_path, stop=0, threads=1)


def test_genai_draft_model_speculation_is_greedy(tiny_target: Path, tiny_draft: Path, tmp_path: Path) -> None:
    og = pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (the bench extra)")
    [system] = peers.genai_draft_systems(tiny_target, tiny_draft, tmp_path, stop=0, threads=1, draft_tokens=3)
    assert system.name == "onnxruntime-genai draft model (k=3)" and og.__version__ in system.runtime
    builds = [peers.build_genai_model(folder, tmp_path, stop=0, threads=1) for folder in (tiny_target, tiny_draft)]
    overlay = peers.speculative_overlay(*builds, 3)
    assert overlay["model"]["type"] == "speculative" and overlay["speculative"] == {"max_draft_tokens": 3}
    assert (builds[0] / overlay["model"]["draft"]["filename"]).resolve() == (builds[1] / "model.onnx").resolve()
    target = TargetModel.from_pretrained(tiny_target)
    prompts = [[5, 17, 33, 2, 40], [100, 101, 102, 103, 104, 105, 7]]
    reference = [autoregressive_generate(target, p, max_new_tokens=24, stop_token_ids=(0,)) for p in prompts]
    row = single_stream.run_system(system, prompts, 24, reference)
    assert row["status"] == "ok" and row["greedy_check"] == {"equal": True, "mismatches": []}
    counters = row["counters"]
    assert counters["tokens_emitted"] == sum(len(r) for r in reference)
    assert counters["rounds"] > 0 and counters["draft_tokens_proposed"] >= counters["draft_tokens_accepted"]
    line = report.speculation_lines([row])
    assert line.startswith("- onnxruntime-genai draft model (k=3)") and "drafted tokens accepted" in line
