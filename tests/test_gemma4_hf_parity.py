"""The Gemma-4 target against transformers' own Gemma4ForConditionalGeneration on layouts the golden
set does not have: K = V off as well as on, half-rotary global layers, a 5-token window, and the
per-layer config newer transformers save (float32, <= 1e-4 on logits that reach ~|20|)."""

from __future__ import annotations

import pytest
import torch

from dspark.models import TargetModel, causal_mask

transformers = pytest.importorskip("transformers", reason="transformers is a test-only dependency (pip install .[dev])")
if not hasattr(transformers, "Gemma4ForConditionalGeneration"):
    pytest.skip(f"transformers {transformers.__version__} has no Gemma-4", allow_module_level=True)

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB, TOKENS = 96, 21


def _save_hf_model(tmp_path, k_eq_v: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    text = dict(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=12, global_head_dim=24, num_global_key_value_heads=1,
        attention_k_eq_v=k_eq_v, sliding_window=5, final_logit_softcapping=20.0,
        hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                                            "rope_theta": 1e6}},
        hidden_size_per_layer_input=0, num_kv_shared_layers=0, enable_moe_block=False, use_double_wide_mlp=False,
        tie_word_embeddings=True, max_position_embeddings=256,
    )
    config = transformers.Gemma4Config(text_config=text, vision_config=None, audio_config=None)
    model = transformers.Gemma4ForConditionalGeneration(config)
    with torch.no_grad():  # peaked logits, norms and layer scalars away from 1
        for p in model.parameters():
            p.mul_(4.0) if p.dim() > 1 else p.normal_(1.0, 0.1)
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.uniform_(0.8, 1.2)
    model.eval().save_pretrained(tmp_path)
    return model


@pytest.mark.parametrize("k_eq_v", [True, False], ids=["k_eq_v", "separate_v"])
@torch.no_grad()
def test_prefill_and_cached_steps_match_transformers(tmp_path, k_eq_v):
    hf = _save_hf_model(tmp_path, k_eq_v)
    ours = TargetModel.from_pretrained(tmp_path, context_layer_ids=(-1, 0, 1))
    assert [lay.keys_are_values for lay in ours.config.layouts] == [False, k_eq_v, False, k_eq_v]
    assert [lay.head_dim for lay in ours.config.layouts] == [12, 24, 12, 24]
    ids = torch.randint(0, VOCAB, (2, TOKENS))
    reference = hf(input_ids=ids, output_hidden_states=True)
    out = ours(ids, torch.arange(TOKENS).expand(2, TOKENS))
    torch.testing.assert_close(out.logits, reference.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.context_features, torch.cat(reference.hidden_states[:3], dim=-1),
                               atol=1e-4, rtol=1e-4)
    # Prefill 9 tokens, a 5-token verification chunk, then single steps: the window crosses the cache.
    cache, logits, done = None, [], 0
    for chunk in (9, 5, 1, 1, 1, 4):
        step = ours(ids[:, done:done + chunk], torch.arange(done, done + chunk).expand(2, chunk),
                    causal_mask(2, chunk, done), cache)
        cache, done = step.present, done + chunk
        logits.append(step.logits)
    torch.testing.assert_close(torch.cat(logits, dim=1), reference.logits, atol=1e-4, rtol=1e-4)
