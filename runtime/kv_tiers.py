"""Two-tier KV: under slot pressure, a running request's keys and values move from the engine's slot
cache (the device tier: GPU memory, or the preallocated slot rows on CPU) to host memory, and back,
instead of the requests behind it waiting for a slot.

The device tier is the engine's `Capacity` (slots and reserved positions); the host tier holds up to
`host_tokens` positions of swapped-out requests (their reservations, as admission counts them). A
swapped-out request keeps everything else it had (tokens, sampler, the drafter's unseen context rows),
so swapping it back in and stepping it on is exactly what it would have done without the swap; only
its batch neighbours change, which no request's greedy output depends on (nor a sampled one's under a
scheduler that decides each row's length alone, e.g. `fixed`).

Policy (`rebalance`, before each step's admission): the request that has waited longest (the oldest
swapped-out one, or the queue's head if it was submitted before that one was swapped out) comes in
next. If it does not fit, running requests that have stepped at least `quantum` steps since they
last came in are swapped out, the one furthest from finishing first (most tokens left to generate:
it would hold its slot longest), until the waiting one fits or no such request is left or the host
tier is full. Requests so take turns on the device `quantum` steps at a time (round robin over more
requests than slots) and a request just brought in is never sent straight back out (no thrashing).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .request_state import RunningRequest

if TYPE_CHECKING:
    from .batch_loop import BatchEngine


@dataclass
class Swapped:
    """A request in the host tier: its engine state and copies of its committed KV prefixes."""

    request: RunningRequest
    need: int  # positions it reserves
    since: int  # the engine step it was swapped out at
    target: list[np.ndarray]  # per buffer [kvh, length, hd]
    drafter: list[np.ndarray]


@dataclass
class TierStats:
    swaps_out: int = 0
    swaps_in: int = 0
    bytes_moved: int = 0
    seconds: float = 0.0  # copying, both ways
    most_held: int = 0  # most requests held at once (device rows + host tier)


@dataclass
class HostTier:
    host_tokens: int  # positions the host tier may hold
    quantum: int = 8  # steps a request runs after coming in before it may be swapped out
    swapped: deque[Swapped] = field(default_factory=deque)
    stats: TierStats = field(default_factory=TierStats)
    _resident_since: dict[int, int] = field(default_factory=dict)  # request id -> step it came in

    def __post_init__(self) -> None:
        if self.host_tokens < 0 or self.quantum < 1:
            raise ValueError(f"host_tokens must be >= 0 and quantum >= 1, got {self.host_tokens}, {self.quantum}")

    @property
    def held_tokens(self) -> int:
        return sum(s.need for s in self.swapped)

    def requests(self) -> list[RunningRequest]:
        return [s.request for s in self.swapped]

    # -- policy ------------------------------------------------------------------------------------
    def rebalance(self, engine: BatchEngine) -> None:
        while self.swapped or engine.queue:
            queued = engine.queue[0].result.submitted_step if engine.queue else None
            head = self.swapped[0] if self.swapped and (queued is None or self.swapped[0].since < queued) else None
            need = head.need if head is not None else engine.positions_needed(
                len(engine.queue[0].result.prompt_ids), engine.queue[0].max_new_tokens)
            if not engine.admission.fits(need):
                victims = self._victims(engine, need)
                if victims is None:
                    break
                evicted = [self.swap_out(engine, row) for row in sorted(victims, reverse=True)]
            else:
                evicted = []
            if head is None:  # the queue's head: the engine admits it next
                self.swapped.extend(evicted)
                break
            self.swap_in(engine, self.swapped.popleft())
            self.swapped.extend(evicted)  # behind every request that waited before them
        self.stats.most_held = max(self.stats.most_held, len(engine.active) + len(self.swapped))

    def _victims(self, engine: BatchEngine, need: int) -> list[int] | None:
        """Rows to swap out so that `need` positions and a slot come free: resident `quantum` steps, most
        tokens left first, each with room on the host; None when no such set frees enough."""
        capacity, reserved = engine.admission.capacity, engine.admission.reserved
        slots, tokens = capacity.max_requests - len(reserved), capacity.max_tokens - sum(reserved.values())
        room, step = self.host_tokens - self.held_tokens, engine.steps_run
        eligible = sorted((len(a.result.tokens) - a.max_new_tokens, row) for row, a in enumerate(engine.active)
                          if step - self._resident_since.setdefault(a.result.request_id, step) >= self.quantum)
        chosen = []
        for _, row in eligible:
            if slots >= 1 and tokens >= need:
                break
            held = reserved[engine.active[row].result.request_id]
            if held > room:
                continue
            chosen.append(row)
            slots, tokens, room = slots + 1, tokens + held, room - held
        return chosen if slots >= 1 and tokens >= need else None

    # -- moves -------------------------------------------------------------------------------------
    def swap_out(self, engine: BatchEngine, row: int) -> Swapped:
        """Row `row`'s request to the host tier (returned; the caller queues it)."""
        begin = time.perf_counter()
        a = engine.active[row]
        rid = a.result.request_id
        target = engine.target_kv.copy_row(row)
        drafter = engine.drafter_kv.copy_row(row)
        need = engine.admission.reserved[rid]
        engine.admission.release(rid)
        engine.vacate(row)
        self._resident_since.pop(rid, None)
        self._count(target + drafter, begin, out=True)
        return Swapped(a, need, engine.steps_run, target, drafter)

    def swap_in(self, engine: BatchEngine, swapped: Swapped) -> None:
        begin = time.perf_counter()
        row = len(engine.active)
        engine.target_kv.load_row(row, swapped.target)
        engine.drafter_kv.load_row(row, swapped.drafter)
        rid = swapped.request.result.request_id
        engine.admission.admit(rid, swapped.need)
        engine.active.append(swapped.request)
        self._resident_since[rid] = engine.steps_run
        self._count(swapped.target + swapped.drafter, begin, out=False)

    def take(self, request_id: int) -> RunningRequest | None:
        """Remove a swapped-out request (cancelled) and return its engine state, or None if not here."""
        for i, s in enumerate(self.swapped):
            if s.request.result.request_id == request_id:
                del self.swapped[i]
                return s.request
        return None

    def _count(self, arrays: list[np.ndarray], begin: float, *, out: bool) -> None:
        self.stats.seconds += time.perf_counter() - begin
        self.stats.bytes_moved += sum(a.nbytes for a in arrays)
        if out:
            self.stats.swaps_out += 1
        else:
            self.stats.swaps_in += 1
