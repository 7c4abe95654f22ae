"""When a declined drafting gate probes next: the gate's half that spaces its probes (`drafting_gate`).

Probes are what a decline costs where drafting keeps not paying (a compute-bound target under load, text the
drafter fails), and what ends a decline where it pays again; their spacing trades the one for the other.

Probes of a few rows (two requests or more). The first comes at the first step; later ones after
`probe_interval` steps without drafting. The interval starts at `probe_every` and doubles with every probe, up
to `MAX_PROBE_BACKOFF` times `probe_every`, until the gate drafts every row again (then it is `probe_every`
anew). Not while a live cost model finds the drafter slower than its table (`draft_factor` ≥ `SLOW_DRAFTER`):
then the decline may be a passing load, and probes are what measures the drafter's speed again, so they keep
to `probe_every`. The doubling counts probes, not what they cost: a probe also waits until the plain steps
since it have cost its price over `PROBE_SHARE` (2 %; its price: the catch-up included, or what it took where
that was more), so a dear probe beside cheap plain steps (one row catching up 17-54 context rows, 2.1-2.7 ms,
beside 0.9 ms steps of 4 requests on the demo engine; priced 1.4-2.0 ms: the first call of a layout binds it,
and the drafter runs cache-cold after the target) comes no more often than that share allows.

One request probes itself: a drafting step, its drafts verified, so what it costs is its time beyond plain
decoding of the tokens Algorithm 1 expected of it (a backlog's catch-up scaled out, as the live cost model
learns drafting; what one step accepts is too noisy a price). The next probe waits until the plain steps since
have cost that over `PROBE_SHARE`, at least `FULL_PROBE_EVERY` steps, at most `MAX_FULL_PROBE_BACKOFF` times
`probe_every` (512 steps; 128 until 2026-12-08: on an AMD EPYC host, where a one-request probe took 2.3-3.4 ms
beside 0.36-0.45 ms plain steps, probes every ~75 steps were 3.7 % of a warm engine's time), without
doubling and whatever the draft factor: where drafting nearly pays, a decline that one unlucky stretch of text
caused ends within a few steps (it held for 16-128 steps before, often for whole requests); beside a far slower
drafter, probes come rarely (they came every 17 steps). Demo engine, one request at a time, 16 × 32 tokens,
interleaved with the code before, ÷ max(plain decoding, fixed γ): 0.921 → 0.979 (11 runs); with the drafter
slowed 3 ms a call, 0.747 → 0.793 (7 runs). The price of a quick probe: a drafter that recovers is seen later.
The share was 5 % until 2026-12-07: a probe costs more than its price says, since a probe drafting on the
worker beside verification slows the target's call on a shared cache (0.15-0.4 ms in each of the three steps
after the first probe, 4 requests on the demo engine), and most probes on the demo pair find drafting still not
paying. At 2 %, interleaved against 5 % (bench sweep runner, 16-token requests, medians of 11 runs, twice):
1.039x and 1.052x at 4 requests, 1.051x and 1.044x at 8, 1.037x and 1.038x at one request; the 100M cost
stand-in (5 runs) 1.07x at 4 and 1.03x at 16. (1 % was no better: 1.056x, 1.037x, 1.024x.)
While the gate's pool holds fewer than `THIN_POOL_ROWS` survival rows, one request probes at every declined
step: the prior (α = 0.5) declines the first step, and a decline resting on one probe's row is as likely one
unlucky block as the drafter (measured, demo engine, one request at a time, 32 × 32 tokens: a pool of one row,
[0.84, 0.50, 0.11, ...] against the drafter's 0.85, 0.70, 0.60, ... realised, kept drafting declined for up to
50 steps; 61 of 250 steps verified no draft, now 22-27; interleaved against the code before, 15 runs, 32-token
requests: 1.022x at one request).
"""

from __future__ import annotations

import math

from .gate_plan import GatePlan, SplitStepCost
from .survival_pool import SurvivalPool

MAX_PROBE_BACKOFF = 8  # probes that keep finding drafting unprofitable come at most this many times rarer
MAX_FULL_PROBE_BACKOFF = 4 * MAX_PROBE_BACKOFF  # the same where one request probes itself, spaced by its net cost
SLOW_DRAFTER = 1.5  # a live draft factor from which probes do not back off (a slowed drafter may recover)
PROBE_SHARE = 0.02  # a probe: what it costs beyond plain decoding, at most this share of the plain steps to the next
FULL_PROBE_EVERY = 4  # one request's probe: no sooner than this many steps after the last
THIN_POOL_ROWS = 8  # one request probes at once while the gate's pool holds fewer survival rows than this


class ProbeSpacing:
    """Mixed into `DraftingGate` (its `cost` and `probe_every`): `skipped` steps without drafting, the interval
    and the waits of the module docstring."""

    cost: SplitStepCost
    probe_every: int
    pool: SurvivalPool

    def _init_spacing(self) -> None:
        self.skipped = 0  # steps since rows last drafted
        self.probe_interval = self.probe_every  # steps without drafting before the next probe of a few rows
        self._probe_seconds = 0.0  # what the last probe of a few rows took to draft (0.0: none yet)
        self._probe_after: int | None = None  # steps without drafting before the next probe (None: to price)
        self._full_after = FULL_PROBE_EVERY  # the same where one request probes itself (`_probed`)

    def _drafting_again(self) -> None:
        """Every row drafts again: a later decline probes as soon as a first one does."""
        self.probe_interval, self._full_after = self.probe_every, FULL_PROBE_EVERY

    def _probing(self, requests: int, price: float, *, backs_off: bool) -> None:
        """A probe of R requests priced `price` is planned; `backs_off`: not the first (which finds no pool)."""
        if requests == 1:  # spaced by its net cost once recorded (`_probed`)
            return
        if backs_off and getattr(self.cost, "draft_factor", 1.0) < SLOW_DRAFTER:
            self.probe_interval = min(2 * self.probe_interval, MAX_PROBE_BACKOFF * self.probe_every)
        self._probe_seconds, self._probe_after = price, None

    def _probed(self, plan: GatePlan, expected: float, drafting_seconds: float, step_seconds: float) -> None:
        """A probe's step was recorded: `expected` drafts accepted by Algorithm 1's reckoning, what its drafting
        and the whole step took (0.0: not measured)."""
        if plan.probe and drafting_seconds > self._probe_seconds:  # dearer than its price: spaced by what it took
            self._probe_seconds, self._probe_after = drafting_seconds, None
        if plan.all and step_seconds > 0.0:
            plain = float(self.cost.verify_seconds(1, 1))
            if plan.price > plan.normal:  # the backlog's catch-up is the backlog's, not drafting's
                step_seconds -= drafting_seconds * (1.0 - plan.normal / plan.price)
            net = step_seconds - (1.0 + expected) * plain
            self._full_after = min(max(math.ceil(net / (PROBE_SHARE * plain)), FULL_PROBE_EVERY),
                                   MAX_FULL_PROBE_BACKOFF * self.probe_every)

    def _probe_due(self, requests: int) -> bool:
        """Whether a declined step probes (module docstring). The wait after a probe of a few rows is priced once
        a wait: the prices move little in as many steps."""
        if requests == 1:  # (a decline resting on a row or two: as likely one unlucky block as the drafter)
            return len(self.pool) < THIN_POOL_ROWS or self.skipped >= self._full_after
        if self.skipped < self.probe_interval:
            return False
        if self._probe_after is None:
            self._probe_after = 0
            if self._probe_seconds and getattr(self.cost, "draft_factor", 1.0) < SLOW_DRAFTER:
                plain = float(self.cost.verify_seconds(requests, requests))
                self._probe_after = min(math.ceil(self._probe_seconds / (PROBE_SHARE * plain)),
                                        MAX_PROBE_BACKOFF * self.probe_every)
        return self.skipped >= self._probe_after
