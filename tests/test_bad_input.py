"""Bad checkpoints, mismatched pairs and malformed requests get specific errors."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import golden_path

from dspark.models import (
    CheckpointError,
    DSparkDrafter,
    IncompatibleDrafterError,
    TargetModel,
    load_pair,
)
from dspark.runtime.reference_decoder import autoregressive_generate, speculative_generate
from dspark.runtime.requests import RequestError


@pytest.fixture()
def folders(tmp_path):
    root = golden_path("qwen3-tiny-vanilla")
    shutil.copytree(root / "target", tmp_path / "target")
    shutil.copytree(root / "drafter", tmp_path / "drafter")
    return tmp_path / "target", tmp_path / "drafter"


def _edit_config(folder, **changes):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_missing_folder_and_config(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        TargetModel.from_pretrained(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="config.json is missing"):
        TargetModel.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        TargetModel.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(vocab_size=None), "'vocab_size' is missing"),
        (dict(hidden_size=-4), "'hidden_size' must be a positive integer"),
        (dict(model_type="mamba"), "model_type 'mamba' is not supported"),
        (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}), "rope_type 'yarn' is not supported"),
        (dict(rope_parameters={"rope_type": "llama3", "factor": 8.0}), "llama3 RoPE scaling needs numeric low_freq"),
        (dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
                               "original_max_position_embeddings": 8192}), "llama3 RoPE scaling .* is not valid"),
        (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
        (dict(num_key_value_heads=3), "not a multiple of num_key_value_heads"),
    ],
)
def test_bad_target_configs(folders, changes, message):
    target, _ = folders
    _edit_config(target, **changes)
    with pytest.raises(CheckpointError, match=message):
        TargetModel.from_pretrained(target)


def test_weights_missing_corrupt_or_misshapen(folders):
    target, _ = folders
    weights = target / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        TargetModel.from_pretrained(target)
    weights.unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors weights"):
        TargetModel.from_pretrained(target)
    weights.write_bytes(data)
    _edit_config(target, intermediate_size=96)
    with pytest.raises(CheckpointError, match="wrong shapes .*mlp"):
        TargetModel.from_pretrained(target)
    _edit_config(target, intermediate_size=128, num_hidden_layers=5)
    with pytest.raises(CheckpointError, match="missing .*layers.4"):
        TargetModel.from_pretrained(target)


def test_sharded_index_naming_a_missing_shard(folders):
    target, _ = folders
    (target / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}})
    )
    with pytest.raises(CheckpointError, match="shard files that are missing"):
        TargetModel.from_pretrained(target)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(vocab_size=1024, mask_token_id=1000), "vocab_size 1024 != target's 512"),
        (dict(target_layer_ids=[0, 3]), "the final layer 3 is post-norm"),
        (dict(num_target_layers=6), "num_target_layers 6 != target's num_hidden_layers 4"),
    ],
)
def test_drafter_not_made_for_this_target(folders, changes, message):
    target, drafter = folders
    _edit_config(drafter, **changes)
    with pytest.raises(IncompatibleDrafterError, match=message):
        load_pair(target, drafter)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(markov_head_type="lstm"), "markov_head_type 'lstm' is unknown"),
        (dict(mask_token_id=512), "mask_token_id 512 is not a token id"),
        (dict(target_layer_ids=[]), "'target_layer_ids' must be a non-empty list"),
        (dict(markov_rank=0), "confidence_head_with_markov needs markov_rank > 0"),
    ],
)
def test_bad_drafter_configs(folders, changes, message):
    _, drafter = folders
    _edit_config(drafter, **changes)
    with pytest.raises(CheckpointError, match=message):
        DSparkDrafter.from_pretrained(drafter)


def test_drafter_weights_that_do_not_fit_its_config(folders):
    _, drafter = folders
    _edit_config(drafter, markov_rank=8)
    with pytest.raises(CheckpointError, match="wrong shapes .*markov_w1"):
        DSparkDrafter.from_pretrained(drafter)


@pytest.mark.parametrize(
    ("prompt", "kwargs", "message"),
    [
        ([], {}, "prompt is empty"),
        ([1, 512], {}, "outside the vocabulary"),
        ([1, 2.5], {}, "not an integer token id"),
        ([1, 2], dict(max_new_tokens=0), "max_new_tokens must be >= 1"),
        ([1, 2], dict(temperature=-1.0), "temperature must be a finite number >= 0"),
        ([1, 2], dict(temperature=float("nan")), "temperature must be a finite number >= 0"),
        ([1] * 1000, dict(max_new_tokens=100), "exceeds the model's max_position_embeddings"),
        ([1, 2], dict(confidence_threshold=1.5), "confidence_threshold must lie in"),
        ([1, 2], dict(block_size=0), "block_size must be >= 1"),
    ],
)
def test_malformed_requests(prompt, kwargs, message):
    root = golden_path("qwen3-tiny-vanilla")
    target, drafter = load_pair(root / "target", root / "drafter")
    kwargs = {"max_new_tokens": 4, **kwargs}
    with pytest.raises(RequestError, match=message):
        speculative_generate(target, drafter, prompt, **kwargs)
    if "confidence_threshold" not in kwargs and "block_size" not in kwargs:
        with pytest.raises(RequestError, match=message):
            autoregressive_generate(target, prompt, **kwargs)


def test_threshold_without_confidence_head():
    root = golden_path("dflash-tiny")
    target, drafter = load_pair(root / "target", root / "drafter")
    with pytest.raises(RequestError, match="needs a drafter with a confidence head"):
        speculative_generate(target, drafter, [1, 2], max_new_tokens=4, confidence_threshold=0.5)
