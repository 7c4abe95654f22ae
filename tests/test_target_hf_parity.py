"""The target decoder against transformers' own Qwen3 and Llama (float32, <= 1e-5)."""

from __future__ import annotations

import pytest
import torch

from dspark.models import TargetModel, causal_mask

transformers = pytest.importorskip("transformers", reason="transformers is a test-only dependency (pip install .[dev])")

SMALL = dict(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=6,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=256, rms_norm_eps=1e-6)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 512}


def _hf_model(kind: str, tmp_path, tie: bool = False):
    torch.manual_seed(0)
    if kind == "qwen3":
        config = transformers.Qwen3Config(**SMALL, rope_theta=1e6, tie_word_embeddings=tie)
        model = transformers.Qwen3ForCausalLM(config)
    elif kind == "llama":
        config = transformers.LlamaConfig(**SMALL, rope_theta=5e5, tie_word_embeddings=tie, attention_bias=True)
        model = transformers.LlamaForCausalLM(config)
    else:  # Llama-3.1's RoPE scaling; a short original context so that all three bands hold frequencies
        config = transformers.LlamaConfig(**SMALL, tie_word_embeddings=tie, rope_parameters=LLAMA3_ROPE)
        model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # default init is too flat to separate top tokens; make logits peaked
        for p in model.parameters():
            p.mul_(4.0) if p.dim() > 1 else p.normal_(1.0, 0.1)
    model.eval()
    # A small shard size exercises the sharded-index loader.
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    return model


@pytest.mark.parametrize(("kind", "tie"), [("qwen3", False), ("qwen3", True), ("llama", False), ("llama3", False)])
@torch.no_grad()
def test_prefill_and_cached_steps_match_transformers(tmp_path, kind, tie):
    hf = _hf_model(kind, tmp_path, tie)
    assert (tmp_path / "model.safetensors.index.json").exists()
    if kind == "llama3":  # the scaling is in force: slowed, kept and blended frequencies all occur
        ours = TargetModel.from_pretrained(tmp_path)
        plain = 1.0 / 5e5 ** (torch.arange(0, 8, 2) / 8)
        ratio = plain / ours.rotary.inv_freq
        assert torch.isclose(ratio, torch.tensor(1.0)).any() and torch.isclose(ratio, torch.tensor(8.0)).any()
        assert ((ratio > 1.01) & (ratio < 7.99)).any(), ratio
    ours = TargetModel.from_pretrained(tmp_path, context_layer_ids=(-1, 0, 1))
    ids = torch.randint(0, SMALL["vocab_size"], (2, 21))
    reference = hf(ids, output_hidden_states=True)

    out = ours(ids, torch.arange(21).expand(2, 21))
    assert (out.logits - reference.logits).abs().max() <= 1e-5
    expected_features = torch.cat(reference.hidden_states[:3], dim=-1)  # embeddings, layer 0, layer 1
    assert (out.context_features - expected_features).abs().max() <= 1e-5

    # Prefill 13 tokens, then a 5-token verification chunk, then 3 single steps on the cache.
    cache, logits, done = None, [], 0
    for chunk in (13, 5, 1, 1, 1):
        step = ours(ids[:, done:done + chunk], torch.arange(done, done + chunk).expand(2, chunk),
                    causal_mask(2, chunk, done), cache)
        cache, done = step.present, done + chunk
        logits.append(step.logits)
    assert (torch.cat(logits, dim=1) - reference.logits).abs().max() <= 1e-5


@torch.no_grad()
def test_left_and_right_padding_match_unpadded_rows(tmp_path):
    _hf_model("qwen3", tmp_path)
    ours = TargetModel.from_pretrained(tmp_path)
    short, long = torch.randint(0, 96, (1, 6)), torch.randint(0, 96, (1, 10))
    expected_short = ours(short, torch.arange(6)[None]).logits
    expected_long = ours(long, torch.arange(10)[None]).logits

    # Left padding: the short row starts at column 4; pads attend to nothing real.
    ids = torch.cat((torch.cat((torch.zeros(1, 4, dtype=torch.long), short), 1), long))
    valid = torch.tensor([[False] * 4 + [True] * 6, [True] * 10])
    mask = causal_mask(2, 10, 0) & valid[:, None, None, :]
    positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
    out = ours(ids, positions, mask).logits
    assert (out[0, 4:] - expected_short[0]).abs().max() <= 1e-5
    assert (out[1] - expected_long[0]).abs().max() <= 1e-5

    # Right padding: the short row's pads sit after it and are never attended to by real tokens.
    ids = torch.cat((torch.cat((short, torch.zeros(1, 4, dtype=torch.long)), 1), long))
    valid = torch.tensor([[True] * 6 + [False] * 4, [True] * 10])
    out = ours(ids, torch.arange(10).expand(2, 10), causal_mask(2, 10, 0) & valid[:, None, None, :]).logits
    assert (out[0, :6] - expected_short[0]).abs().max() <= 1e-5
    assert torch.isfinite(out).all()


@torch.no_grad()
def test_tree_mask_nodes_match_their_root_to_node_paths(tmp_path):
    """Each node of a token tree, verified in one pass with an ancestor-only mask, gets the
    logits of its root-to-node path run as a plain causal sequence."""
    _hf_model("qwen3", tmp_path)
    ours = TargetModel.from_pretrained(tmp_path)
    prompt = torch.randint(0, 96, (1, 7))
    past = ours(prompt, torch.arange(7)[None]).present
    parents = [-1, 0, 0, 1, 1, 2, 3, 5]  # node 0 is the root (the anchor)
    tokens = torch.randint(0, 96, (1, len(parents)))
    paths = []
    for node in range(len(parents)):
        path, u = [], node
        while u >= 0:
            path.insert(0, u)
            u = parents[u]
        paths.append(path)
    n = len(parents)
    tree = torch.zeros(n, n, dtype=torch.bool)
    for node, path in enumerate(paths):
        tree[node, path] = True
    mask = torch.cat((torch.ones(n, 7, dtype=torch.bool), tree), dim=1)[None, None]
    depth = torch.tensor([len(p) - 1 for p in paths])
    out = ours(tokens, (7 + depth)[None], mask, past).logits
    for node, path in enumerate(paths):
        sequence = torch.cat((prompt, tokens[:, path]), dim=1)
        expected = ours(sequence, torch.arange(sequence.shape[1])[None]).logits[0, -1]
        assert (out[0, node] - expected).abs().max() <= 1e-5
