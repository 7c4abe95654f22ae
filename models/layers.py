"""Building blocks shared by the target decoder and the drafter: norm, RoPE, MLP, attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import AttentionLayout, DecoderConfig, Llama3RopeScaling


class RMSNorm(nn.Module):
    """y = x / rms(x) * w, with w used as stored (Qwen3, Llama and Gemma-4 alike); `weighted=False`
    is Gemma-4's parameter-free value norm."""

    def __init__(self, size: int, eps: float, weighted: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size)) if weighted else None
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 as transformers does, then cast back.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return x32.to(dtype) if self.weight is None else self.weight * x32.to(dtype)


class RotaryEmbedding(nn.Module):
    """RoPE: position ids [batch, tokens] -> cos, sin [batch, 1, tokens, head_dim].

    The first `rotary_pairs` frequency pairs rotate; the rest have frequency 0 (cos 1, sin 0), which
    is Gemma-4's proportional (partial) RoPE: the exponent still divides by the full head_dim.
    """

    def __init__(self, head_dim: int, theta: float, rotary_pairs: int | None = None,
                 scaling: Llama3RopeScaling | None = None) -> None:
        super().__init__()
        pairs = head_dim // 2 if rotary_pairs is None else rotary_pairs
        inv_freq = 1.0 / theta ** (torch.arange(0, 2 * pairs, 2, dtype=torch.float32) / head_dim)
        if scaling is not None:
            inv_freq = llama3_frequencies(inv_freq, scaling)
        inv_freq = torch.cat((inv_freq, torch.zeros(head_dim // 2 - pairs)))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @classmethod
    def for_layout(cls, layout: AttentionLayout) -> RotaryEmbedding:
        return cls(layout.head_dim, layout.rope_theta, layout.rotary_pairs, layout.rope_scaling)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids.float()[..., None] * self.inv_freq  # [B, T, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B, 1, T, hd]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def llama3_frequencies(inv_freq: torch.Tensor, scaling: Llama3RopeScaling) -> torch.Tensor:
    """Llama-3.1's frequency scaling: wavelengths longer than original / low_freq_factor are slowed
    by `factor`, those shorter than original / high_freq_factor kept, the band between interpolated
    linearly in original / wavelength."""
    wavelength = 2 * torch.pi / inv_freq
    original = scaling.original_max_position_embeddings
    ramp = (original / wavelength - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - ramp) * inv_freq / scaling.factor + ramp * inv_freq
    slowed = inv_freq / scaling.factor
    long = wavelength > original / scaling.low_freq_factor
    short = wavelength < original / scaling.high_freq_factor
    return torch.where(long, slowed, torch.where(short, inv_freq, blended))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, hd]; cos/sin [B, 1, T, hd]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": _gelu_tanh}


class MLP(nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class AttentionProjections(nn.Module):
    """q/k/v/o projections plus the optional per-head q/k RMSNorms (Qwen3, Gemma-4; absent in
    Llama), Gemma-4's weightless value norm, and K = V layers without a `v_proj`."""

    def __init__(self, config: DecoderConfig, layout: AttentionLayout) -> None:
        super().__init__()
        hd, bias = layout.head_dim, config.attention_bias
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = layout.num_key_value_heads
        self.head_dim = hd
        self.scale = hd**-0.5 if config.attention_scale is None else config.attention_scale
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * hd, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * hd, bias=bias)
        self.v_proj = None if layout.keys_are_values else nn.Linear(config.hidden_size, self.num_kv_heads * hd,
                                                                     bias=bias)
        self.o_proj = nn.Linear(self.num_heads * hd, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(hd, config.rms_norm_eps) if config.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(hd, config.rms_norm_eps) if config.qk_norm else nn.Identity()
        self.v_norm = RMSNorm(hd, config.rms_norm_eps, weighted=False) if config.value_norm else nn.Identity()

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
        """x [B, T, H] -> k, v [B, kv_heads, T, hd] (k normed and rotated; v normed where the
        family norms it). K = V layers take V from the key projection before its norm."""
        k_raw = self._heads(self.k_proj(x), self.num_kv_heads)
        v_raw = k_raw if self.v_proj is None else self._heads(self.v_proj(x), self.num_kv_heads)
        k = self.k_norm(k_raw).transpose(1, 2)
        return apply_rope(k, cos, sin), self.v_norm(v_raw).transpose(1, 2)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float | None = None
) -> torch.Tensor:
    """Grouped-query attention written out (exports cleanly, no fused-kernel surprises).

    q [B, heads, T, hd]; k, v [B, kv_heads, S, hd]; mask [B, 1, T, S] bool (True = may attend)
    or None (every query sees every key); scale None = 1/sqrt(hd). Returns [B, T, heads*hd].
    """
    b, heads, t, hd = q.shape
    kv_heads = k.shape[1]
    q = q.reshape(b, kv_heads, heads // kv_heads, t, hd)  # query head h uses kv head h // groups
    scores = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2))  # [B, kvh, g, T, S]
    if scale != 1.0:  # Gemma-4's q/k norms replace the scaling: no multiply in its graphs
        scores = scores * (hd**-0.5 if scale is None else scale)
    if mask is not None:
        # A finite fill keeps fully masked rows (padding) finite instead of NaN.
        scores = scores.masked_fill(~mask.unsqueeze(1), torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    out = torch.matmul(probs, v.unsqueeze(2))  # [B, kvh, g, T, hd]
    return out.reshape(b, heads, t, hd).transpose(1, 2).reshape(b, t, heads * hd)
