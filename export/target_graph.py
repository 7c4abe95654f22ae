"""Flat-I/O wrappers around `TargetModel` for export: the concat-cache graph and the static one.

Both run the model's own layer loop (`TargetModel.run`), so their weights and numerics are the
model's; the static variant only changes the attention step (`static_cache_attention`).
"""

from __future__ import annotations

import torch
from torch import nn

from dspark.models import TargetModel
from dspark.models.target import KV, AttentionStep


class TargetGraph(nn.Module):
    """(input_ids, position_ids, attention_mask, *past k/v) -> (logits, context_features, *present)."""

    def __init__(self, model: TargetModel) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T] int64
        position_ids: torch.Tensor,  # [B, T] int64
        attention_mask: torch.Tensor,  # [B, 1, T, P+T] bool
        *past: torch.Tensor,  # per layer key, value [B, kvh, P, hd]
    ) -> tuple[torch.Tensor, ...]:
        cache = list(zip(past[0::2], past[1::2], strict=True))
        out = self.model(input_ids, position_ids, attention_mask, cache)
        return (out.logits, out.context_features, *(t for kv in out.present for t in kv))


def attend_static(
    q: torch.Tensor,  # [B, heads, T, hd]
    cache_k: torch.Tensor,  # [B, kvh, C, hd] fixed-capacity buffer
    cache_v: torch.Tensor,  # [B, kvh, C, hd]
    k: torch.Tensor,  # [B, kvh, T, hd] new keys
    v: torch.Tensor,  # [B, kvh, T, hd]
    mask: torch.Tensor,  # [B, 1, T, C+T] bool: cache slots, then new tokens
    scale: float | None = None,  # None = 1/sqrt(hd)
) -> torch.Tensor:
    """Same maths as `models.layers.attend` over keys cache ++ new, without materialising the
    concatenation: scores against both parts share one softmax. Returns [B, T, heads*hd]."""
    b, heads, t, hd = q.shape
    kvh = k.shape[1]
    q = q.reshape(b, kvh, heads // kvh, t, hd)
    scores = torch.cat(
        (
            torch.matmul(q, cache_k.unsqueeze(2).transpose(-1, -2)),
            torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)),
        ),
        dim=-1,
    )  # [B, kvh, g, T, C+T]
    if scale != 1.0:  # as `attend`: no multiply where q/k norms replace the scaling
        scores = scores * (hd**-0.5 if scale is None else scale)
    scores = scores.masked_fill(~mask.unsqueeze(1), torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    capacity = cache_k.shape[2]
    out = torch.matmul(probs[..., :capacity], cache_v.unsqueeze(2)) + torch.matmul(
        probs[..., capacity:], v.unsqueeze(2)
    )  # [B, kvh, g, T, hd]
    return out.reshape(b, heads, t, hd).transpose(1, 2).reshape(b, t, heads * hd)


def static_cache_attention(
    cache: tuple[torch.Tensor, ...],  # per layer key, value [B, kvh, C, hd]
) -> AttentionStep:
    """`attend_static` over layer i's cache buffers; the layer hands back only its new K/V."""

    def step(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
             scale: float) -> tuple[torch.Tensor, KV]:
        return attend_static(q, cache[2 * i], cache[2 * i + 1], k, v, mask, scale), (k, v)

    return step


class StaticCacheTargetGraph(nn.Module):
    """(input_ids, position_ids, attention_mask, *cache k/v) -> (logits, context_features, *new k/v).

    The caches are read-only inputs of fixed capacity; only the new tokens' keys/values come out,
    for the runtime to write in place into the buffers it bound.
    """

    def __init__(self, model: TargetModel) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T] int64
        position_ids: torch.Tensor,  # [B, T] int64
        attention_mask: torch.Tensor,  # [B, 1, T, C+T] bool
        *cache: torch.Tensor,  # per layer key, value [B, kvh, C, hd]
    ) -> tuple[torch.Tensor, ...]:
        out = self.model.run(input_ids, position_ids, attention_mask, static_cache_attention(cache))
        return (out.logits, out.context_features, *(t for kv in out.present for t in kv))
