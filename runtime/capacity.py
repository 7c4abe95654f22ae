"""What an engine can hold: the KV caches' shape, its capacity (slots, positions), and admission control,
which reserves each request's worst-case length against `max_tokens` (a request that does not fit waits in
the queue). No torch here: the serving front end (runtime/serving/process_service.py) checks requests with it.
"""

from __future__ import annotations

from dataclasses import dataclass


class CapacityError(ValueError):
    """A request that can never fit the engine's capacity (too long for a slot or the budget)."""


@dataclass(frozen=True)
class CacheShape:
    layers: int
    kv_heads: int
    head_dim: int
    # (kv_heads, head_dim) of each layer where layers differ (Gemma-4's sliding and global layers);
    # () = every layer is (kv_heads, head_dim)
    per_layer: tuple[tuple[int, int], ...] = ()

    def layer(self, i: int) -> tuple[int, int]:
        return self.per_layer[i] if self.per_layer else (self.kv_heads, self.head_dim)


@dataclass(frozen=True)
class Capacity:
    max_requests: int  # concurrent requests (slots)
    max_tokens: int  # sum over active requests of reserved positions
    max_seq_len: int  # positions per slot (prompt + new tokens + one block of lookahead)


class Admission:
    """Reservation bookkeeping: which requests are active, and whether a new one fits now."""

    def __init__(self, capacity: Capacity) -> None:
        self.capacity = capacity
        self.reserved: dict[int, int] = {}

    def check_servable(self, need: int) -> None:
        c = self.capacity
        if need > c.max_seq_len:
            raise CapacityError(f"request needs {need} positions but a slot holds {c.max_seq_len}; "
                                "shorten the prompt or max_new_tokens, or raise max_seq_len")
        if need > c.max_tokens:
            raise CapacityError(f"request needs {need} positions but max_tokens is {c.max_tokens}")

    def fits(self, need: int) -> bool:
        c = self.capacity
        return len(self.reserved) < c.max_requests and sum(self.reserved.values()) + need <= c.max_tokens

    def admit(self, request_id: int, need: int) -> None:
        self.reserved[request_id] = need

    def release(self, request_id: int) -> None:
        self.reserved.pop(request_id)
