"""Which replica serves a request: pure functions over load snapshots (no Ray here, so the policies are unit
tested on plain data).

A request's expected cost is its work in decode-token units: `prefill_weight` per prompt token plus its
max_new_tokens. A replica's load is what the router itself has in flight there (requests and their remaining
work, exact and current) and what the replica last reported (queue, running rows, KV reserved, the verification
budget, its own remaining work: fresher for requests other routers sent). Policies:

    weighted       least expected work: the replica's outstanding work (the larger of the router's ledger and
                   the replica's own report) plus the request's, plus a wait when the request would not fit
                   the replica's KV or slots now (it would queue behind that replica's work); ties go to the
                   larger KV headroom
    round_robin    the next replica that can take a request, in turn
    power_of_two   two replicas drawn at random, the one with fewer requests in flight (Ray Serve's default rule)

A replica can take a request when it is up and its queue is not full; when none can, `NoReplica` (a 429).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

POLICIES = ("weighted", "round_robin", "power_of_two")
PREFILL_WEIGHT = 0.25  # a prompt token's share of a generated token's cost (one batched forward vs a decode step)


class NoReplica(Exception):
    """No replica can take the request now (all down, or every queue full)."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass(frozen=True)
class RequestCost:
    """What routing knows of a request before it runs."""

    prompt_tokens: int
    max_new_tokens: int
    kv_positions: int  # positions the engine reserves for it (prompt + new + one block)

    def work(self, prefill_weight: float = PREFILL_WEIGHT) -> float:
        return prefill_weight * self.prompt_tokens + self.max_new_tokens


@dataclass(frozen=True)
class ReplicaLoad:
    """One replica as the router sees it."""

    name: str
    up: bool
    queued: int = 0  # reported: submitted to its engine service, not yet admitted
    running: int = 0  # reported: requests in KV slots
    slots_total: int = 1
    kv_tokens_reserved: int = 0
    kv_tokens_capacity: int = 1
    max_queue: int = 1
    verification_budget: float = 0.0  # reported: tokens its target verified per step, recent mean
    reported_work: float = 0.0  # reported: expected work left in the replica's requests (all routers')
    in_flight: int = 0  # router: requests sent there and not ended
    in_flight_work: float = 0.0  # router: their expected work left

    @property
    def waiting(self) -> int:
        """Requests waiting for a slot: the report, or the router's own count past the slots when larger (the
        report lags the router's latest sends)."""
        return max(self.queued, self.in_flight - self.slots_total)

    @property
    def full(self) -> bool:
        return self.waiting >= self.max_queue

    @property
    def kv_free(self) -> int:
        return self.kv_tokens_capacity - self.kv_tokens_reserved

    def fits_now(self, cost: RequestCost) -> bool:
        """Whether the request would be admitted at once rather than queue."""
        return (max(self.running + self.queued, self.in_flight) < self.slots_total
                and cost.kv_positions <= self.kv_free)

    def work(self) -> float:
        return max(self.in_flight_work, self.reported_work)


def remaining_work(prompt_tokens: int, max_new_tokens: int, delivered: int,
                   prefill_weight: float = PREFILL_WEIGHT) -> float:
    """A request's expected work still to do: its prefill until the first token arrives, then what is left
    of its max_new_tokens."""
    prefill = prefill_weight * prompt_tokens if delivered == 0 else 0.0
    return prefill + max(max_new_tokens - delivered, 0)


def weighted_score(load: ReplicaLoad, cost: RequestCost, prefill_weight: float = PREFILL_WEIGHT) -> float:
    """The expected work the request finds on this replica, its own included (lower is better): the work it
    shares the steps with, doubled when it must first wait for a slot or KV to free up."""
    ahead = load.work()
    own = cost.work(prefill_weight)
    return ahead + own + (0.0 if load.fits_now(cost) else ahead)


class Router:
    """A policy and its state (the round-robin position, the random draws: seeded, so a run repeats)."""

    def __init__(self, policy: str = "weighted", *, seed: int = 0, prefill_weight: float = PREFILL_WEIGHT) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}; choose one of {', '.join(POLICIES)}")
        self.policy, self.prefill_weight = policy, prefill_weight
        self._next = 0
        self._rng = random.Random(seed)

    def choose(self, loads: Sequence[ReplicaLoad], cost: RequestCost, exclude: frozenset[int] = frozenset()) -> int:
        """The index in `loads` of the replica to send the request to; NoReplica when none can take it."""
        open_ = [i for i, load in enumerate(loads) if load.up and not load.full and i not in exclude]
        if not open_:
            raise NoReplica(_why_none(loads, exclude))
        if self.policy == "round_robin":
            n = len(loads)
            pick = min(open_, key=lambda i: (i - self._next) % n)
            self._next = pick + 1
            return pick
        if self.policy == "power_of_two":
            pair = self._rng.sample(open_, 2) if len(open_) > 1 else open_
            return min(pair, key=lambda i: loads[i].in_flight)
        return min(open_, key=lambda i: (weighted_score(loads[i], cost, self.prefill_weight), -loads[i].kv_free, i))


def _why_none(loads: Sequence[ReplicaLoad], exclude: frozenset[int]) -> str:
    if not loads:
        return "no engine replica is configured"
    down = [load.name for i, load in enumerate(loads) if not load.up or i in exclude]
    if len(down) == len(loads):
        return f"no engine replica is up ({', '.join(down)} down or restarting); retry shortly"
    return (f"every engine replica's queue is full ({len(loads) - len(down)} up, {len(down)} down); "
            "retry shortly")
