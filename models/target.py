"""The target decoder (Qwen3; Llama is the same module without q/k norms; Gemma-4 adds sandwich
norms, a per-layer scalar, scaled embeddings, per-layer attention layouts (sliding-window and
global, K = V) and soft-capped logits, all switched by `DecoderConfig` fields).

Everything a step depends on is an explicit argument: token ids, position ids, a boolean
attention mask over past+new keys, and the past KV cache. The forward returns the logits, the
context features the drafter consumes, and the present KV cache (past + new tokens).

How a layer's queries meet the cache is the one step that varies between the forward and the
exported graphs, so `TargetModel.run` takes it as an argument (`AttentionStep`): the forward
passes `concat_cache_attention` (keys = past ++ new); the static-cache export graph passes one
that reads a fixed-size cache and returns only the new keys/values.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from torch import nn

from .checkpoint import load_weights, read_tensors
from .config import AttentionLayout, DecoderConfig, IncompatibleDrafterError, TargetConfig
from .layers import MLP, AttentionProjections, RMSNorm, RotaryEmbedding, attend

KV = tuple[torch.Tensor, torch.Tensor]  # key, value [B, kv_heads, S, hd]
KVCache = list[KV]  # per layer
# (q [B, heads, T, hd], new k, v [B, kvh, T, hd], mask [B, 1, T, S] bool, score scale)
#   -> (attention output [B, T, heads*hd], the layer's K/V)
LayerAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float],
                          tuple[torch.Tensor, KV]]
# The same with the layer index first: what `TargetModel.run` takes.
AttentionStep = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float],
                         tuple[torch.Tensor, KV]]


def causal_mask(batch: int, tokens: int, past: int, device: torch.device | None = None) -> torch.Tensor:
    """[batch, 1, tokens, past+tokens] bool: token t sees every past key and new keys <= t."""
    rows = torch.arange(tokens, device=device)[:, None] + past
    cols = torch.arange(past + tokens, device=device)[None, :]
    return (cols <= rows).expand(batch, 1, tokens, past + tokens)


def sliding_window_mask(mask: torch.Tensor, position_ids: torch.Tensor, window: int) -> torch.Tensor:
    """mask [B, 1, T, C+T] (C cache columns, then the T new tokens) narrowed to the keys less than
    `window` positions behind each query. Cache column j holds position j (the slot caches and the
    concat cache both keep a row's positions in order), new column t holds position_ids[:, t]."""
    cache_cols = mask.shape[-1] - position_ids.shape[1]
    cache_positions = torch.arange(cache_cols, device=mask.device).expand(position_ids.shape[0], cache_cols)
    key_positions = torch.cat((cache_positions, position_ids), dim=1)  # [B, C+T]
    behind = position_ids[:, :, None] - key_positions[:, None, :]  # [B, T, C+T]
    return mask & (behind < window)[:, None]


def empty_kv_cache(config: DecoderConfig, batch: int, dtype: torch.dtype = torch.float32) -> KVCache:
    cache = []
    for layout in config.layouts:
        shape = (batch, layout.num_key_value_heads, 0, layout.head_dim)
        cache.append((torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)))
    return cache


def crop_kv_cache(cache: KVCache, length: int) -> KVCache:
    """Keep the first `length` positions (rollback of rejected tokens)."""
    return [(k[:, :, :length], v[:, :, :length]) for k, v in cache]


def concat_cache_attention(past: KVCache) -> AttentionStep:  # per layer [B, kvh, S, hd]
    """Keys/values = past ++ new, one `attend` over them; the layer hands back past ++ new."""

    def step(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
             scale: float) -> tuple[torch.Tensor, KV]:
        k = torch.cat((past[i][0], k), dim=2)
        v = torch.cat((past[i][1], v), dim=2)
        return attend(q, k, v, mask, scale), (k, v)

    return step


@dataclass
class TargetOutput:
    """B = batch, T = new tokens, V = vocab, F = len(context_layer_ids) * hidden."""

    logits: torch.Tensor  # [B, T, V]
    context_features: torch.Tensor  # [B, T, F]
    present: KVCache  # per layer what the attention step hands back: forward's [B, kv_heads, past+T, hd]


class DecoderLayer(nn.Module):
    """Qwen3/Llama: x + attn(norm x), then x + mlp(post_attention_layernorm x). Gemma-4
    (`sandwich_norm`): the attention and MLP outputs are normed before they are added, the MLP
    input has its own norm, and the layer's output is multiplied by its stored `layer_scalar`."""

    def __init__(self, config: DecoderConfig, layout: AttentionLayout) -> None:
        super().__init__()
        eps, size = config.rms_norm_eps, config.hidden_size
        self.input_layernorm = RMSNorm(size, eps)
        self.self_attn = AttentionProjections(config, layout)
        self.post_attention_layernorm = RMSNorm(size, eps)
        self.mlp = MLP(config)
        self.sandwich_norm = config.sandwich_norm
        if self.sandwich_norm:
            self.pre_feedforward_layernorm = RMSNorm(size, eps)
            self.post_feedforward_layernorm = RMSNorm(size, eps)
            self.register_buffer("layer_scalar", torch.ones(1))

    def add_attention(self, x: torch.Tensor, attention_out: torch.Tensor) -> torch.Tensor:
        """x [B, T, H] + the o-projected attention output [B, T, heads*hd], then the MLP block."""
        out = self.self_attn.o_proj(attention_out)
        if not self.sandwich_norm:
            x = x + out
            return x + self.mlp(self.post_attention_layernorm(x))
        x = x + self.post_attention_layernorm(out)
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return x * self.layer_scalar

    def forward(
        self,
        x: torch.Tensor,  # [B, T, H]
        cos: torch.Tensor,  # [B, 1, T, hd]
        sin: torch.Tensor,
        attention: LayerAttention,
        mask: torch.Tensor,  # [B, 1, T, S] bool
    ) -> tuple[torch.Tensor, KV]:
        h = self.input_layernorm(x)
        q = self.self_attn.queries(h, cos, sin)
        k, v = self.self_attn.keys_values(h, cos, sin)
        out, kv = attention(q, k, v, mask, self.self_attn.scale)
        return self.add_attention(x, out), kv


class TargetModel(nn.Module):
    """A causal LM whose forward also returns DeepSpec's context features.

    `context_layer_ids` follow DeepSpec: -1 is the embedding output, i is the raw output of
    decoder layer i (before the final norm). The final layer is refused since DeepSpec's
    features for it would be post-norm.
    """

    def __init__(self, config: TargetConfig, context_layer_ids: tuple[int, ...] = ()) -> None:
        super().__init__()
        last = config.num_hidden_layers - 1
        bad = [i for i in context_layer_ids if not -1 <= i < last]
        if bad:
            raise IncompatibleDrafterError(
                f"context layer ids {bad} are out of range for a {config.num_hidden_layers}-layer target "
                f"(allowed: -1 .. {last - 1})"
            )
        self.config = config
        self.context_layer_ids = tuple(context_layer_ids)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        layouts = config.layouts
        self.layers = nn.ModuleList(DecoderLayer(config, layout) for layout in layouts)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # One RoPE table per distinct layout (Gemma-4: sliding and global); `rotary` is layer 0's.
        rope_keys = [(lay.head_dim, lay.rope_theta, lay.rotary_pairs, lay.rope_scaling) for lay in layouts]
        distinct = list(dict.fromkeys(rope_keys))
        self.rotaries = nn.ModuleList(RotaryEmbedding(*key) for key in distinct)
        self.rotary_of_layer = [distinct.index(key) for key in rope_keys]
        self.rotary = self.rotaries[0]
        self.windows = [lay.sliding_window for lay in layouts]

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T] int64
        position_ids: torch.Tensor,  # [B, T] int64
        attention_mask: torch.Tensor | None = None,  # [B, 1, T, S+T] bool; None = causal
        past_key_values: KVCache | None = None,  # per layer [B, kvh, S, hd]
    ) -> TargetOutput:
        batch, tokens = input_ids.shape
        if past_key_values is None:
            past_key_values = empty_kv_cache(self.config, batch, self.embed_tokens.weight.dtype)
        if attention_mask is None:
            past = past_key_values[0][0].shape[2]
            attention_mask = causal_mask(batch, tokens, past, input_ids.device)
        return self.run(input_ids, position_ids, attention_mask, concat_cache_attention(past_key_values))

    def run(
        self,
        input_ids: torch.Tensor,  # [B, T] int64
        position_ids: torch.Tensor,  # [B, T] int64
        attention_mask: torch.Tensor,  # [B, 1, T, C+T] bool: C cache columns, then the new tokens
        attention: AttentionStep,  # how layer i's queries meet its cache
    ) -> TargetOutput:
        """The layer loop: embed, every decoder layer with `attention` as its attention step (under
        the mask, narrowed to the window on sliding-window layers), the LM head, and the context
        features of `context_layer_ids`."""
        x = self.embed_tokens(input_ids)
        if self.config.embedding_scale != 1.0:
            x = x * self.config.embedding_scale
        ropes = [rotary(position_ids, x.dtype) for rotary in self.rotaries]
        windowed = {w: sliding_window_mask(attention_mask, position_ids, w) for w in set(self.windows) if w}
        features = {-1: x}
        present: KVCache = []
        for i, layer in enumerate(self.layers):
            cos, sin = ropes[self.rotary_of_layer[i]]
            mask = windowed[self.windows[i]] if self.windows[i] else attention_mask
            x, kv = layer(x, cos, sin, partial(attention, i), mask)
            present.append(kv)
            features[i] = x
        logits = softcap(self.lm_head(self.norm(x)), self.config.final_logit_softcapping)
        return TargetOutput(logits=logits, context_features=self.context_features(features), present=present)

    def context_features(self, features: dict[int, torch.Tensor]) -> torch.Tensor:
        """{layer id: [B, T, H]} (-1 = embedding output) -> [B, T, F]: DeepSpec's concatenation
        of `context_layer_ids` ([B, T, 0] when there are none)."""
        if not self.context_layer_ids:
            x = features[-1]
            return x.new_zeros(x.shape[0], x.shape[1], 0)
        return torch.cat([features[i] for i in self.context_layer_ids], dim=-1)

    @classmethod
    def from_pretrained(
        cls, folder: str | Path, context_layer_ids: tuple[int, ...] = (), dtype: torch.dtype = torch.float32
    ) -> TargetModel:
        config = TargetConfig.from_folder(folder)
        model = cls(config, context_layer_ids)
        # Hugging Face names: model.embed_tokens, model.layers.*, model.norm, lm_head; Gemma-4's
        # Gemma4ForConditionalGeneration nests the text decoder under model.language_model.
        tensors = {_strip_hf_prefix(k): v for k, v in read_tensors(folder).items()}
        optional = {"lm_head.weight"} if config.tie_word_embeddings else set()
        load_weights(model, tensors, source=str(folder), optional=optional)
        return model.to(dtype).eval()


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Gemma's final-logit soft-cap, cap * tanh(logits / cap); None = logits unchanged."""
    return logits if cap is None else torch.tanh(logits / cap) * cap


# Hugging Face's names for the decoder's weights: Gemma4ForConditionalGeneration nests it under the first
# (its model.language_model), Qwen3ForCausalLM / LlamaForCausalLM keep it under the second.
HF_PREFIXES = ("model.language_model.", "model.")


def _strip_hf_prefix(name: str) -> str:
    for prefix in HF_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name
