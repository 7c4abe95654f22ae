"""A random Gemma-4 pair with a 3-token window: every draft-tree node must see exactly its own
window (its position is start + depth, not its index in the flattened tree), so trees, chains and
the batched engine all stay equal to target greedy only if the window follows `position_ids`."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import golden_path

from dspark.models import DrafterConfig, DSparkDrafter, TargetConfig, TargetModel
from dspark.runtime.batch_loop import BatchEngine
from dspark.runtime.capacity import Capacity
from dspark.runtime.cost_model import StepCostModel
from dspark.runtime.model_info import ModelInfo
from dspark.runtime.prefix_scheduler import SchedulerConfig
from dspark.runtime.reference_decoder import autoregressive_generate, speculative_generate
from dspark.runtime.torch_backend import TorchBackend
from dspark.runtime.tree_decoder import tree_generate

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB, WINDOW, NEW = 32, 3, 30


@pytest.fixture(scope="module")
def pair():
    """The golden pair's architecture (sliding/global, K = V, partial RoPE) with vocab 32, window 3,
    random weights small enough that greedy outputs vary."""
    target_json = json.loads(golden_path("gemma4-tiny", "target", "config.json").read_text())
    drafter_json = json.loads(golden_path("gemma4-tiny", "drafter", "config.json").read_text())
    for config in (target_json["text_config"], drafter_json):
        config.update(vocab_size=VOCAB, sliding_window=WINDOW)
    drafter_json["mask_token_id"] = VOCAB - 1
    drafter_config = DrafterConfig.from_dict(drafter_json)
    torch.manual_seed(0)
    target = TargetModel(TargetConfig.from_dict(target_json), drafter_config.target_layer_ids).eval()
    drafter = DSparkDrafter(drafter_config).eval()
    with torch.no_grad():
        for module in (target, drafter):
            for p in module.parameters():
                p.normal_(0.0, 0.05) if p.dim() > 1 else p.normal_(1.0, 0.1)
        drafter.embed_tokens.weight.copy_(target.embed_tokens.weight)
        drafter.lm_head.weight.copy_(target.lm_head.weight)
    prompts = [torch.randint(0, VOCAB - 2, (n,)).tolist() for n in (9, 4, 13)]
    return target, drafter, prompts, [autoregressive_generate(target, p, max_new_tokens=NEW) for p in prompts]


def test_trees_and_chains_equal_target_greedy(pair):
    target, drafter, prompts, expected = pair
    assert min(len(set(tokens)) for tokens in expected) > 5  # the outputs are not one repeated token
    for prompt, tokens in zip(prompts, expected, strict=True):
        assert tree_generate(target, drafter, prompt, max_new_tokens=NEW, num_nodes=10).tokens == tokens
        assert speculative_generate(target, drafter, prompt, max_new_tokens=NEW).tokens == tokens


@pytest.mark.parametrize("drafting", ["chain", "tree"])
def test_batched_engine_equals_target_greedy(pair, drafting):
    target, drafter, prompts, expected = pair
    engine = BatchEngine(TorchBackend(target, drafter), ModelInfo.from_models(target, drafter),
                         capacity=Capacity(4, 4096, 64), kv_mode="static",
                         scheduler=SchedulerConfig("fixed", drafting=drafting, tree_nodes=10),
                         cost_model=StepCostModel(1e-3, 2e-4, 4e-4))
    ids = [engine.submit(p, max_new_tokens=NEW) for p in prompts]
    finished = engine.run_until_done()
    assert [finished[i].tokens for i in ids] == expected
