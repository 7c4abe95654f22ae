"""What a generation request may be, and where it stops: shared by the serving loop and the
PyTorch yardsticks, so both refuse the same requests and cut outputs at the same token."""

from __future__ import annotations

import math
import operator
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .model_text import TextMethods

SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed takes


class RequestError(ValueError):
    """A generation request that cannot be served as given."""


def token_ids(values: object, what: str = "prompt") -> list[int]:
    """`values` as a list of Python ints; RequestError (not TypeError) for anything else."""
    values = as_list(values)
    if isinstance(values, str | bytes) or not isinstance(values, Sequence):
        raise RequestError(f"{what} must be a sequence of token ids (ints), got {type(values).__name__}")
    ids = []
    for value in values:
        if isinstance(value, bool):
            raise RequestError(f"{what} holds a bool ({value!r}), not a token id")
        try:
            ids.append(operator.index(value))
        except TypeError:
            raise RequestError(f"{what} holds {value!r} ({type(value).__name__}), not an integer token id") from None
    return ids


def as_list(values: object) -> object:
    """numpy arrays and torch tensors as (nested) Python lists; anything else unchanged."""
    return values.tolist() if callable(getattr(values, "tolist", None)) else values


def validate_request(
    prompt_ids: Sequence[int],
    *,
    vocab_size: int,
    max_positions: int,
    max_new_tokens: int,
    temperature: float,
) -> list[int]:
    """The prompt as ints, once every field is checked; RequestError naming the first bad one."""
    ids = token_ids(prompt_ids)
    if not ids:
        raise RequestError("prompt is empty: give at least one token id")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"prompt has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
        raise RequestError(f"max_new_tokens must be an integer, got {max_new_tokens!r}")
    if max_new_tokens < 1:
        raise RequestError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if isinstance(temperature, bool) or not isinstance(temperature, int | float):
        raise RequestError(f"temperature must be a number, got {temperature!r}")
    if not temperature >= 0.0 or math.isinf(temperature):  # also refuses NaN
        raise RequestError(f"temperature must be a finite number >= 0, got {temperature}")
    if len(ids) + max_new_tokens > max_positions:
        raise RequestError(
            f"prompt ({len(ids)}) + max_new_tokens ({max_new_tokens}) exceeds the model's "
            f"max_position_embeddings ({max_positions})"
        )
    return ids


def stop_set(stop_token_ids: object, vocab_size: int) -> frozenset[int]:
    ids = token_ids(stop_token_ids, "stop")
    bad = sorted(t for t in ids if not 0 <= t < vocab_size)
    if bad:
        raise RequestError(f"stop token ids must lie in [0, {vocab_size}): {bad[:5]}")
    return frozenset(ids)


def find_stop(tokens: Sequence[int], stop: Collection[int], begin: int, end: int) -> int | None:
    """Index of the first stop token in tokens[begin:end], or None. Callers pass the part not yet
    scanned, so a growing output is scanned once in all (not once per step)."""
    for i in range(begin, min(end, len(tokens))):
        if tokens[i] in stop:
            return i
    return None


def truncate_at_stop(tokens: list[int], stop: Collection[int], max_new_tokens: int) -> tuple[list[int], str]:
    """Generated tokens cut at max_new_tokens, or just after the first stop token before that
    point; with the finish reason "stop" or "length"."""
    hit = find_stop(tokens, stop, 0, max_new_tokens)
    return (tokens[:max_new_tokens], "length") if hit is None else (tokens[: hit + 1], "stop")


def checked_request(text: TextMethods, prompt: str | Sequence[int], *, max_new_tokens: int, temperature: float,
                    seed: int, stop: object, limit: int | None) -> tuple[list[int], list[int], tuple[str, ...]]:
    """A request's checks that need no engine (RequestError): (prompt ids, stop ids, stop strings). `limit`:
    the front end's cap on max_new_tokens."""
    if limit is not None and isinstance(max_new_tokens, int) and max_new_tokens > limit:
        raise RequestError(f"max_new_tokens {max_new_tokens} exceeds this server's limit {limit}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not SEED_RANGE[0] <= seed < SEED_RANGE[1]:
        raise RequestError(f"seed must be an integer in [-2**63, 2**64), got {seed!r:.40}")
    info = text.info
    stop_ids, strings = text.split_stop(stop)
    ids = validate_request(text.prompt_ids(prompt), vocab_size=info.vocab_size, max_positions=info.max_positions,
                           max_new_tokens=max_new_tokens, temperature=temperature)
    stop_set(stop_ids, info.vocab_size)
    return ids, stop_ids, strings
