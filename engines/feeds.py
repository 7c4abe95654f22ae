"""Synthetic feeds for any contract graph at given symbolic dims (profiling, warm-up, comparisons).

Token ids are uniform in the vocabulary, positions continue the past, target masks are causal
over past + new tokens (padding never matters for timing), drafter masks are all True (DeepSpec
decoding), float tensors are small normals.
"""

from __future__ import annotations

import numpy as np

from dspark.export.contract import GraphSpec

_FLOATS = {"float32": np.float32, "float16": np.float16}


def resolve(dims: tuple[int | str, ...], sizes: dict[str, int]) -> tuple[int, ...]:
    missing = [d for d in dims if isinstance(d, str) and d not in sizes]
    if missing:
        raise KeyError(f"no size given for dims {missing}")
    return tuple(d if isinstance(d, int) else sizes[d] for d in dims)


def derived_sizes(sizes: dict[str, int]) -> dict[str, int]:
    """Fill the derived dims (total, capacity_plus_tokens, logit_tokens, context_total) from the rest."""
    out = dict(sizes)
    if "tokens" in out:
        out.setdefault("total", out.get("past", 0) + out["tokens"])
        out.setdefault("logit_tokens", out["tokens"])  # the fused target's logits: every position (verification)
        if "capacity" in out:
            out.setdefault("capacity_plus_tokens", out["capacity"] + out["tokens"])
    if "context_tokens" in out:
        out.setdefault("context_total", out.get("context_past", 0) + out["context_tokens"])
    return out


def random_feeds(
    spec: GraphSpec, sizes: dict[str, int], *, vocab_size: int, seed: int = 0
) -> dict[str, np.ndarray]:
    """Feeds for every input of `spec`; `sizes` names each symbolic dim (summed dims are derived)."""
    sizes = derived_sizes(sizes)
    rng = np.random.default_rng(seed)
    feeds = {}
    for t in spec.inputs:
        shape = resolve(t.dims, sizes)
        if t.name in ("seqlens_k", "total_sequence_length"):  # fused graphs: every row at `past`
            total = sizes["past"] + sizes["tokens"]
            feeds[t.name] = np.full(shape, total - 1 if t.name == "seqlens_k" else total, dtype=np.int32)
        elif t.name == "context_lengths":  # fused drafter backbone: every row's context is `past` + the new rows
            feeds[t.name] = np.full(shape, sizes["past"] + sizes["tokens"], dtype=np.int64)
        elif t.name in ("token_index", "logits_index"):  # packed target: every token real, logits everywhere
            feeds[t.name] = np.arange(shape[0], dtype=np.int64)
        elif t.name == "logits_rows":  # fused target: logits at positions 0 .. logit_tokens-1 of every row
            feeds[t.name] = np.tile(np.arange(shape[-1], dtype=np.int64), (*shape[:-1], 1))
        elif t.name.endswith("position_ids"):
            start = sizes.get("context_past", 0) if t.name.startswith("context") else sizes.get("past", 0)
            feeds[t.name] = np.broadcast_to(np.arange(start, start + shape[-1]), shape).astype(np.int64)
        elif t.dtype == "int64":
            feeds[t.name] = rng.integers(0, vocab_size, size=shape, dtype=np.int64)
        elif t.dtype == "bool":
            feeds[t.name] = _mask(shape, causal=spec.name.startswith("target"))
        elif t.dtype in _FLOATS:
            feeds[t.name] = (0.1 * rng.standard_normal(shape)).astype(_FLOATS[t.dtype])
        else:
            raise TypeError(f"graph '{spec.name}' input {t.name}: no synthetic feed for dtype {t.dtype}")
    return feeds


def _mask(shape: tuple[int, ...], *, causal: bool) -> np.ndarray:
    """[B, 1, T, K] bool: all True, or causal over the last T columns (the first K - T are the past)."""
    mask = np.ones(shape, dtype=bool)
    if causal:
        t, k = shape[-2], shape[-1]
        mask[..., k - t :] = np.tril(np.ones((t, t), dtype=bool))
    return mask
