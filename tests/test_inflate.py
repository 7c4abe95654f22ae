"""The cost stand-in (`dspark.models.inflate`, `dspark train standin`): the inflated target computes
the original's logits and context features (<= 1e-4), so the drafter's tokens and acceptance
lengths are unchanged, while it has at least the requested parameters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import golden_path

from dspark.models import TargetConfig, TargetModel, causal_mask, load_pair
from dspark.models import inflate as inflate_module
from dspark.models.inflate import (
    STANDIN_KEY,
    InflateError,
    count_params,
    inflate_checkpoint,
    parse_params,
    plan_inflation,
    read_standin,
    standin_label,
)
from dspark.runtime.reference_decoder import speculative_generate
from dspark.tools.cli import main
from dspark.tools.demo_engine import DEMO_DRAFTER, DEMO_TARGET

TOL = 1e-4
DEMO_LAYERS = (0, 1, 2)  # the demo drafter's target_layer_ids
GOLDEN_LAYERS = (-1, 0, 1, 2)  # every feature id a 4-layer target allows, embeddings included
GOLDEN_PARAMS = 7_000_000


def _golden_target() -> Path:
    return golden_path("qwen3-tiny-vanilla", "target")


def _four_times(target_dir: Path, out: Path) -> Path:
    inflate_checkpoint(target_dir, out, 4 * count_params(TargetConfig.from_folder(target_dir)))
    return out


@pytest.fixture(scope="module")
def demo_standin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4x: 5.2M -> 21M, KV heads 2 -> 4, MLP 768 -> 5635."""
    return _four_times(DEMO_TARGET, tmp_path_factory.mktemp("standin") / "demo-4x")


@pytest.fixture(scope="module")
def golden_standin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """7M (33x): KV heads 2 -> 5, so the two KV heads get unequal numbers of copies."""
    out = tmp_path_factory.mktemp("standin") / "golden-7M"
    inflate_checkpoint(_golden_target(), out, GOLDEN_PARAMS)
    assert TargetConfig.from_folder(out).num_key_value_heads == 5
    return out


def _pairs(request: pytest.FixtureRequest, which: str) -> tuple[Path, Path, tuple[int, ...], int]:
    if which == "demo":
        return DEMO_TARGET, request.getfixturevalue("demo_standin"), DEMO_LAYERS, 4 * count_params(
            TargetConfig.from_folder(DEMO_TARGET))
    return _golden_target(), request.getfixturevalue("golden_standin"), GOLDEN_LAYERS, GOLDEN_PARAMS


@pytest.mark.parametrize("which", ["demo", "golden"])
@torch.no_grad()
def test_logits_and_context_features_equal_the_originals(request, which):
    source, standin, layers, requested = _pairs(request, which)
    original = TargetModel.from_pretrained(source, layers)
    inflated = TargetModel.from_pretrained(standin, layers)
    assert sum(p.numel() for p in inflated.parameters()) == read_standin(standin)["params"] >= requested
    ids = torch.randint(0, original.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(24).expand(2, 24)
    ours, theirs = inflated(ids, positions), original(ids, positions)
    assert (ours.logits - theirs.logits).abs().max() <= TOL
    assert (ours.context_features - theirs.context_features).abs().max() <= TOL

    # Prefill 16, then a 5-token verification chunk and 3 single decode steps on each model's own cache.
    cache: dict[str, list | None] = {"ours": None, "theirs": None}
    done = 0
    for chunk in (16, 5, 1, 1, 1):
        step = {}
        for name, model in (("ours", inflated), ("theirs", original)):
            step[name] = model(ids[:, done:done + chunk], positions[:, done:done + chunk],
                               causal_mask(2, chunk, done), cache[name])
            cache[name] = step[name].present
        assert (step["ours"].logits - step["theirs"].logits).abs().max() <= TOL
        assert (step["ours"].context_features - step["theirs"].context_features).abs().max() <= TOL
        done += chunk


def test_parameter_count_reaches_the_request():
    config = TargetConfig.from_folder(DEMO_TARGET)
    assert count_params(config) == 5_245_696  # the demo README's figure
    for text in ("100M", "1.5B", "4x", "5.3M"):
        wanted = parse_params(text, count_params(config))
        plan = plan_inflation(config, wanted)
        assert wanted <= plan.params < wanted + 3 * config.hidden_size * config.num_hidden_layers
        assert plan.num_attention_heads % plan.num_key_value_heads == 0
        assert plan.num_attention_heads // plan.num_key_value_heads == 2  # group size kept
    big = plan_inflation(config, parse_params("1.5B"))
    # The KV cache per token per parameter stays that of Qwen3-0.6B, within one KV head of rounding.
    kv_per_token = config.num_hidden_layers * 2 * big.num_key_value_heads * config.head_dim
    assert abs(kv_per_token / big.params - inflate_module.KV_PER_PARAM) < 2 * 2 * 4 * 64 / big.params


def test_parse_params_units():
    assert parse_params("100M") == 100_000_000
    assert parse_params("1.5B") == 1_500_000_000
    assert parse_params("250k") == 250_000
    assert parse_params("123456") == 123_456
    assert parse_params("4x", 1000) == 4000
    for bad in ("", "12Q", "-5M", "M", "0"):
        with pytest.raises(InflateError):
            parse_params(bad, 1000)


def test_speculative_decoding_is_unchanged(demo_standin):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(DEMO_TARGET / "tokenizer.json"))
    prompts = ["def parse_args(argv=None):\n    parser = argparse.", "class Queue:\n    def __init__(self"]
    original = load_pair(DEMO_TARGET, DEMO_DRAFTER)
    inflated = load_pair(demo_standin, DEMO_DRAFTER)
    for prompt in prompts:
        ids = tokenizer.encode(prompt).ids
        for temperature in (0.0, 1.0):
            runs = [speculative_generate(*pair, ids, max_new_tokens=24, temperature=temperature, seed=3)
                    for pair in (original, inflated)]
            assert runs[0].tokens == runs[1].tokens
            lengths = [[r.acceptance_length for r in run.rounds] for run in runs]
            assert lengths[0] == lengths[1]
            assert max(lengths[0]) > 1  # the drafter does get tokens accepted here


def test_huggingface_loads_the_standin_and_it_is_labelled(golden_standin):
    transformers = pytest.importorskip("transformers")
    hf = transformers.Qwen3ForCausalLM.from_pretrained(golden_standin, dtype=torch.float32).eval()
    original = TargetModel.from_pretrained(_golden_target())
    ids = torch.arange(40)[None] % original.config.vocab_size
    with torch.no_grad():
        assert (hf(ids).logits - original(ids, torch.arange(40)[None]).logits).abs().max() <= TOL
    section = read_standin(golden_standin)
    assert section["params"] >= GOLDEN_PARAMS and len(section["transforms"]) == 2
    assert json.loads((golden_standin / "config.json").read_text())[STANDIN_KEY] == section
    assert "COST STAND-IN" in (golden_standin / "README.md").read_text()
    assert standin_label(golden_standin).startswith("COST STAND-IN")
    assert standin_label(_golden_target()) is None


@pytest.mark.parametrize("kind", ["llama-bias", "qwen3-tied"])
@torch.no_grad()
def test_attention_biases_llama_and_tied_heads(tmp_path, kind):
    """Biases are copied with their heads (o_proj's stays), Llama has no q/k norms, a tied LM head
    stays tied."""
    transformers = pytest.importorskip("transformers")
    small = dict(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=6,
                 num_key_value_heads=2, head_dim=8, max_position_embeddings=256)
    torch.manual_seed(0)
    if kind == "llama-bias":
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**small, attention_bias=True))
    else:
        hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**small, tie_word_embeddings=True))
    for p in hf.parameters():
        p.normal_(0.0, 0.3) if p.dim() > 1 else p.normal_(1.0, 0.1)
    hf.save_pretrained(tmp_path / "source")
    inflate_checkpoint(tmp_path / "source", tmp_path / "standin", 3_000_000)
    config = TargetConfig.from_folder(tmp_path / "standin")
    assert config.num_key_value_heads > 2 and config.intermediate_size > 80
    layers = (-1, 0, 1)
    ids, positions = torch.arange(30)[None] % 96, torch.arange(30)[None]
    original = TargetModel.from_pretrained(tmp_path / "source", layers)(ids, positions)
    inflated_model = TargetModel.from_pretrained(tmp_path / "standin", layers)
    inflated = inflated_model(ids, positions)
    assert sum(p.numel() for p in inflated_model.parameters()) == read_standin(tmp_path / "standin")["params"]
    assert (inflated.logits - original.logits).abs().max() <= TOL
    assert (inflated.context_features - original.context_features).abs().max() <= TOL


@torch.no_grad()
def test_sharded_output_loads_the_same(tmp_path, monkeypatch):
    monkeypatch.setattr(inflate_module, "SHARD_BYTES", 200_000)
    out = _four_times(_golden_target(), tmp_path / "sharded")
    assert (out / "model.safetensors.index.json").is_file() and not (out / "model.safetensors").exists()
    layers = GOLDEN_LAYERS
    ids, positions = torch.arange(12)[None], torch.arange(12)[None]
    sharded = TargetModel.from_pretrained(out, layers)(ids, positions)
    original = TargetModel.from_pretrained(_golden_target(), layers)(ids, positions)
    assert (sharded.logits - original.logits).abs().max() <= TOL


def test_refuses_to_overwrite_a_real_checkpoint_or_inflate_a_standin(tmp_path, golden_standin):
    real = tmp_path / "real"
    real.mkdir()
    (real / "config.json").write_text("{}")
    with pytest.raises(InflateError, match="not a previous stand-in"):
        inflate_checkpoint(_golden_target(), real, 10**6)
    with pytest.raises(InflateError, match="already a cost stand-in"):
        inflate_checkpoint(golden_standin, tmp_path / "again", 10**7)


def test_command_writes_then_finds_it_up_to_date(tmp_path):
    args = ["train", "standin", "--target", str(_golden_target()), "--params", "2x", "--out", str(tmp_path / "s"),
            "--no-progress"]
    first = CliRunner().invoke(main, args, catch_exceptions=False)
    assert first.exit_code == 0, first.output
    assert "COST STAND-IN" in first.output and (tmp_path / "s" / "config.json").is_file()
    again = CliRunner().invoke(main, args, catch_exceptions=False)
    assert again.exit_code == 0 and again.output.startswith("up to date")


def test_default_output_is_in_the_user_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path))
    result = CliRunner().invoke(main, ["train", "standin", "--target", str(_golden_target()), "--params", "300k",
                                       "--no-progress"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    folder = tmp_path / f"standin-{_golden_target().resolve().name}-300k"
    assert read_standin(folder)["requested_params"] == 300_000


@pytest.mark.parametrize(("args", "fragment"), [
    (["--params", "12Q"], "is not a size"),
    (["--params", "1k"], "nothing to inflate"),
    (["--target", "{missing}"], "is not a folder"),
])
def test_bad_requests_are_one_line_exit_2(tmp_path, args, fragment):
    args = [a.format(missing=tmp_path / "nope") for a in args]
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["train", "standin", *args, "--out", str(out), "--no-progress"])
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dspark train standin: error: ") and fragment in lines[0]
    assert not out.exists()


@pytest.mark.slow
def test_dspark_export_exports_the_standin(tmp_path, golden_standin):
    from dspark.export.pipeline import export_pair

    manifest = export_pair(golden_standin, golden_path("qwen3-tiny-vanilla", "drafter"), tmp_path / "export",
                           check=False)
    assert (tmp_path / "export" / "target.onnx").is_file()
    assert manifest["target"]["num_kv_heads"] == TargetConfig.from_folder(golden_standin).num_key_value_heads
    assert manifest["target"]["standin"]["params"] >= 0 and "transforms" in manifest["target"]["standin"]
