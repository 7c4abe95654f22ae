"""The target decoder (Qwen3; Llama is the same module without q/k norms).

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
from .config import DecoderConfig, IncompatibleDrafterError, TargetConfig
from .layers import MLP, AttentionProjections, RMSNorm, RotaryEmbedding, attend

KV = tuple[torch.Tensor, torch.Tensor]  # key, value [B, kv_heads, S, hd]
KVCache = list[KV]  # per layer
# (q [B, heads, T, hd], new k, v [B, kvh, T, hd]) -> (attention output [B, T, heads*hd], the layer's K/V)
LayerAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, KV]]
# The same with the layer index first: what `TargetModel.run` takes.
AttentionStep = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, KV]]


def causal_mask(batch: int, tokens: int, past: int, device: torch.device | None = None) -> torch.Tensor:
    """[batch, 1, tokens, past+tokens] bool: token t sees every past key and new keys <= t."""
    rows = torch.arange(tokens, device=device)[:, None] + past
    cols = torch.arange(past + tokens, device=device)[None, :]
    return (cols <= rows).expand(batch, 1, tokens, past + tokens)


def empty_kv_cache(config: DecoderConfig, batch: int, dtype: torch.dtype = torch.float32) -> KVCache:
    shape = (batch, config.num_key_value_heads, 0, config.head_dim)
    return [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
            for _ in range(config.num_hidden_layers)]


def crop_kv_cache(cache: KVCache, length: int) -> KVCache:
    """Keep the first `length` positions (rollback of rejected tokens)."""
    return [(k[:, :, :length], v[:, :, :length]) for k, v in cache]


def concat_cache_attention(
    mask: torch.Tensor,  # [B, 1, T, S+T] bool
    past: KVCache,  # per layer [B, kvh, S, hd]
) -> AttentionStep:
    """Keys/values = past ++ new, one `attend` over them; the layer hands back past ++ new."""

    def step(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, KV]:
        k = torch.cat((past[i][0], k), dim=2)
        v = torch.cat((past[i][1], v), dim=2)
        return attend(q, k, v, mask), (k, v)

    return step


@dataclass
class TargetOutput:
    """B = batch, T = new tokens, V = vocab, F = len(context_layer_ids) * hidden."""

    logits: torch.Tensor  # [B, T, V]
    context_features: torch.Tensor  # [B, T, F]
    present: KVCache  # per layer what the attention step hands back: forward's [B, kv_heads, past+T, hd]


class DecoderLayer(nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = AttentionProjections(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,  # [B, T, H]
        cos: torch.Tensor,  # [B, 1, T, hd]
        sin: torch.Tensor,
        attention: LayerAttention,
    ) -> tuple[torch.Tensor, KV]:
        h = self.input_layernorm(x)
        q = self.self_attn.queries(h, cos, sin)
        k, v = self.self_attn.keys_values(h, cos, sin)
        out, kv = attention(q, k, v)
        x = x + self.self_attn.o_proj(out)
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, kv


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
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta)

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
        return self.run(input_ids, position_ids, concat_cache_attention(attention_mask, past_key_values))

    def run(
        self,
        input_ids: torch.Tensor,  # [B, T] int64
        position_ids: torch.Tensor,  # [B, T] int64
        attention: AttentionStep,  # how layer i's queries meet its cache
    ) -> TargetOutput:
        """The layer loop: embed, every decoder layer with `attention` as its attention step, the
        LM head, and the context features of `context_layer_ids`."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(position_ids, x.dtype)
        features = {-1: x}
        present: KVCache = []
        for i, layer in enumerate(self.layers):
            x, kv = layer(x, cos, sin, partial(attention, i))
            present.append(kv)
            features[i] = x
        logits = self.lm_head(self.norm(x))
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
        # Hugging Face names: model.embed_tokens, model.layers.*, model.norm, lm_head.
        tensors = {_strip_hf_prefix(k): v for k, v in read_tensors(folder).items()}
        optional = {"lm_head.weight"} if config.tie_word_embeddings else set()
        load_weights(model, tensors, source=str(folder), optional=optional)
        return model.to(dtype).eval()


def _strip_hf_prefix(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name
