"""Snapshots back into an engine: the committed tokens and sampler a resumed request starts from, checked."""

from __future__ import annotations

import numpy as np
import torch

from ..requests import RequestError
from .snapshot import RequestSnapshot


def resumed_tokens(snapshot: RequestSnapshot, vocab_size: int, max_new_tokens: int) -> list[int]:
    """The committed tokens to continue from; RequestError when they cannot belong to this request."""
    tokens = [int(t) for t in snapshot.tokens]
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"snapshot of {snapshot.spec.key}: token ids outside the vocabulary [0, {vocab_size}): "
                           f"{bad[:5]} (a journal from another model?)")
    if len(tokens) >= max_new_tokens:
        raise RequestError(f"snapshot of {snapshot.spec.key}: {len(tokens)} committed tokens, max_new_tokens is "
                           f"{max_new_tokens}: it had finished")
    return tokens


def resumed_generator(snapshot: RequestSnapshot, temperature: float, seed: int) -> torch.Generator | None:
    """The request's sampler: at the snapshot's RNG state, or at its seed when it never drew (no tokens)."""
    if temperature <= 0:
        return None
    generator = torch.Generator().manual_seed(seed)
    if snapshot.rng_state is None:
        if snapshot.tokens:
            raise RequestError(f"snapshot of {snapshot.spec.key}: a sampled request with tokens but no RNG state")
        return generator
    state = torch.from_numpy(np.frombuffer(snapshot.rng_state, dtype=np.uint8).copy())
    try:
        generator.set_state(state)
    except RuntimeError as exc:
        raise RequestError(f"snapshot of {snapshot.spec.key}: unusable RNG state ({exc})") from None
    return generator
