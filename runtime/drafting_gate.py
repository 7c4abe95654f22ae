"""Whether a step should draft at all: the prefix scheduler's cost argument applied to the drafter.

Algorithm 1 decides how many drafted tokens to verify, but the drafter forward and the
sequential head are paid before it runs. Where verification is compute-bound (a CPU under load),
drafting can cost more than every admissible draft returns; then plain decoding through the same
loop is faster. With a cost model that prices drafting and verification separately (an engine's
measured table), the gate compares

    Θ_draft = R·(1 + g) / (draft(R) + verify(R, R·(1 + d)))    and    Θ_plain = R / verify(R, R)

where g and d are the expected accepted and verified drafts per request of recent drafting steps
(exponential averages of Algorithm 1's own τ* and B*). It drafts when Θ_draft > Θ_plain, when it
has no estimate yet, and once every `probe_every` skipped steps to refresh g and d.

Lossless: the decision uses only steps already committed, never this step's draft tokens, and each
step's verification is exact whatever was (or was not) drafted.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class SplitStepCost(Protocol):
    """A step cost model that prices the drafter and the target separately."""

    def draft_seconds(self, requests: int) -> float: ...

    def verify_seconds(self, requests: int, tokens: int) -> float: ...


class DraftingGate:
    def __init__(self, cost: SplitStepCost, *, probe_every: int = 16, smoothing: float = 0.3) -> None:
        self.cost, self.probe_every, self.smoothing = cost, probe_every, smoothing
        self.accepted_per_request: float | None = None  # g: expected accepted drafts per request
        self.verified_per_request: float | None = None  # d: drafts sent to verification per request
        self.skipped = 0

    def should_draft(self, requests: int) -> bool:
        if self.accepted_per_request is None or self.skipped >= self.probe_every:
            return True
        g, d = self.accepted_per_request, self.verified_per_request
        drafting = requests * (1 + g) / (
            self.cost.draft_seconds(requests) + self.cost.verify_seconds(requests, round(requests * (1 + d))))
        plain = requests / self.cost.verify_seconds(requests, requests)
        return drafting > plain

    def record(self, *, drafted: bool, requests: int, expected_accepts: float | None, verified_tokens: int) -> None:
        """After a step: Algorithm 1's τ* (expected accepted tokens, bonus included) and B*."""
        if not drafted or expected_accepts is None:
            self.skipped += 1
            return
        self.skipped = 0
        g = (expected_accepts - requests) / requests
        d = (verified_tokens - requests) / requests
        if self.accepted_per_request is None:
            self.accepted_per_request, self.verified_per_request = g, d
        else:
            a = self.smoothing
            self.accepted_per_request += a * (g - self.accepted_per_request)
            self.verified_per_request += a * (d - self.verified_per_request)
