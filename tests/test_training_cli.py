"""`dspark train` end to end on tiny settings: tokenizer, target, drafters, and their folders."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from dspark.models import DSparkDrafter, TargetModel, load_pair
from dspark.tools import corpus
from dspark.tools.cli import main
from dspark.tools.demo_training import Schedule, target_config_dict, train_target
from dspark.tools.training_data import RandomWindows

_DEFAULT_GOLDEN = Path(__file__).resolve().parents[1].parent / "shared" / "golden"
GOLDEN = Path(os.environ.get("DSPARK_GOLDEN", _DEFAULT_GOLDEN))
TINY_TARGET = ["--hidden-size", "32", "--intermediate-size", "64", "--layers", "3", "--heads", "4",
               "--kv-heads", "2", "--batch", "2", "--seq-len", "32", "--limit-files", "3", "--no-progress"]
TINY_DRAFTER = ["--draft-layers", "1", "--markov-rank", "8", "--num-anchors", "3", "--batch", "2",
                "--seq-len", "32", "--limit-files", "3", "--no-progress", "--steps", "3"]


def _invoke(*args: str) -> str:
    result = CliRunner().invoke(main, ["train", *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("train")
    _invoke("tokenizer", "--out", str(root / "tok"), "--vocab-size", "300", "--limit-files", "3")
    _invoke("target", "--tokenizer", str(root / "tok" / "tokenizer.json"), "--out", str(root / "target"),
            "--steps", "3", *TINY_TARGET)
    return root / "target"


def test_heldout_modules_are_never_trained_on() -> None:
    train = {p.relative_to(corpus.stdlib_root()).as_posix() for p in corpus.corpus_files("train")}
    heldout = corpus.corpus_files("heldout")
    assert len(heldout) == len(corpus.HELD_OUT_MODULES)
    assert not train & set(corpus.HELD_OUT_MODULES)
    assert not any(p.startswith("test/") for p in train)


def test_target_training_lowers_loss(tmp_path: Path) -> None:
    stream = torch.arange(2000) % 17  # a periodic corpus: learnable in a few steps
    config = target_config_dict(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=8, eos_token_id=0)
    schedule = Schedule(steps=12, batch=4, seq_len=32, lr=1e-2, warmup=1)
    tokenizer_file = tmp_path / "tokenizer.json"
    tokenizer_file.write_text("{}")
    train_target(RandomWindows(stream, 4, 32, 0), config, schedule, folder=tmp_path / "target",
                 tokenizer_file=tokenizer_file, progress=False)
    model = TargetModel.from_pretrained(tmp_path / "target")
    ids = stream[:33][None]
    with torch.no_grad():
        logits = model(ids[:, :-1], torch.arange(32)[None]).logits
    loss = F.cross_entropy(logits[0], ids[0, 1:])
    assert loss < math.log(32) - 1.0  # the freshly initialised model scores about log(V)


def test_target_folder_is_a_transformers_qwen3_checkpoint(tiny_target: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = json.loads((tiny_target / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["eos_token_id"] == 0
    hf = transformers.Qwen3ForCausalLM.from_pretrained(str(tiny_target), dtype=torch.float32).eval()
    ours = TargetModel.from_pretrained(tiny_target)
    ids = torch.randint(0, config["vocab_size"], (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(ids).logits
        got = ours(ids, torch.arange(20)[None]).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(str(tiny_target))
    assert tokenizer.convert_tokens_to_ids(corpus.MASK_TOKEN) == 1


@pytest.mark.parametrize("kind, golden", [("dspark", "qwen3-tiny-vanilla"), ("dflash", "dflash-tiny")])
def test_drafter_folder_round_trips(tiny_target: Path, tmp_path: Path, kind: str, golden: str) -> None:
    out = tmp_path / kind
    _invoke("drafter", "--target", str(tiny_target), "--out", str(out), "--kind", kind, *TINY_DRAFTER)
    config = json.loads((out / "config.json").read_text())
    golden_config = GOLDEN / golden / "drafter" / "config.json"
    if golden_config.is_file():  # same DeepSpec field names as a drafter DeepSpec saved itself
        expected = set(json.loads(golden_config.read_text())) - {"transformers_version"}
        assert set(config) == expected
    target, drafter = load_pair(tiny_target, out)
    assert drafter.embed_tokens.weight is target.embed_tokens.weight  # shared, not stored
    assert (drafter.markov_head is not None) == (kind == "dspark")
    assert (drafter.confidence_head is not None) == (kind == "dspark")
    with pytest.raises(ValueError, match="target="):
        DSparkDrafter.from_pretrained(out)
    assert (out / "train.log").read_text().count("step") >= 2
