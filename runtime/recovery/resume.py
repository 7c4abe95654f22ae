"""Snapshots back into an engine: the committed tokens a resumed request starts from, checked."""

from __future__ import annotations

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
