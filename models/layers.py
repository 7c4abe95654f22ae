"""Building blocks shared by the target decoder and the drafter: norm, RoPE, MLP, attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import DecoderConfig


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 as transformers does, then cast back.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class RotaryEmbedding(nn.Module):
    """Plain RoPE: position ids [batch, tokens] -> cos, sin [batch, 1, tokens, head_dim]."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids.float()[..., None] * self.inv_freq  # [B, T, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B, 1, T, hd]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, hd]; cos/sin [B, 1, T, hd]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class MLP(nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class AttentionProjections(nn.Module):
    """q/k/v/o projections plus the optional per-head q/k RMSNorms (Qwen3; absent in Llama)."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        hd, bias = config.head_dim, config.attention_bias
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = hd
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * hd, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * hd, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(hd, config.rms_norm_eps) if config.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(hd, config.rms_norm_eps) if config.qk_norm else nn.Identity()

    def _heads(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, heads, self.head_dim)

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, T, H] -> q [B, heads, T, hd] (normed, rotated)."""
        q = self.q_norm(self._heads(self.q_proj(x), self.num_heads)).transpose(1, 2)
        return apply_rope(q, cos, sin)

    def keys_values(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, H] -> k, v [B, kv_heads, T, hd] (k normed and rotated)."""
        k = self.k_norm(self._heads(self.k_proj(x), self.num_kv_heads)).transpose(1, 2)
        v = self._heads(self.v_proj(x), self.num_kv_heads).transpose(1, 2)
        return apply_rope(k, cos, sin), v


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """Grouped-query attention written out (exports cleanly, no fused-kernel surprises).

    q [B, heads, T, hd]; k, v [B, kv_heads, S, hd]; mask [B, 1, T, S] bool (True = may attend)
    or None (every query sees every key). Returns [B, T, heads*hd].
    """
    b, heads, t, hd = q.shape
    kv_heads = k.shape[1]
    q = q.reshape(b, kv_heads, heads // kv_heads, t, hd)  # query head h uses kv head h // groups
    scores = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * hd**-0.5  # [B, kvh, g, T, S]
    if mask is not None:
        # A finite fill keeps fully masked rows (padding) finite instead of NaN.
        scores = scores.masked_fill(~mask.unsqueeze(1), torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    out = torch.matmul(probs, v.unsqueeze(2))  # [B, kvh, g, T, hd]
    return out.reshape(b, heads, t, hd).transpose(1, 2).reshape(b, t, heads * hd)
