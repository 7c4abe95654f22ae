"""Which requests draft this step: the prefix scheduler's cost argument applied to the drafter.

Algorithm 1 decides how many drafted tokens to verify, but the drafter forward and the
sequential head are paid before it runs. Where verification is compute-bound (a CPU under load),
drafting can cost more than every admissible draft returns; then plain decoding through the same
loop is faster. Each step `plan` picks the rows that draft: all of them, a few (a probe), or none.

The comparison. With a cost model that prices drafting and verification apart (an engine's
measured table, or `live_cost.LiveSplitStepCost` over it), and a pool of recent survival rows
a_j = Π_{i≤j} σ(c_i / T_i) (the STS-calibrated confidences Algorithm 1 saw, last `pool_rows`
drafted rows), the gate runs Algorithm 1 as it would go over R rows like those of the pool (each
pool candidate standing for R / pool-size candidates): τ_m = R + (R/P)·Σ_{i≤m} a_(i),
B_m = R + (R/P)·m, Θ_m = τ_m / (draft + verify(R, B_m)), up to the first m where Θ drops (with
`padded` verification pricing, depth by depth: τ_d = R·(1 + Σ_{j≤d} mean_pool a_j), B_d = R·(1 + d)),
and drafts every row when

    Θ_draft = Θ_m*  >  Θ_plain = R / verify(R, R).

The prior, before any row has drafted: the table from the first step, with a pool of one row
a_j = α^j, α = `prior_acceptance` = 0.5 per slot. engine.json carries STS temperatures but no
acceptance rate, and confidences exist only once something has drafted, so the prior is a
constant; 0.5 is below what DSpark drafters accept (the demo pair: 0.72–0.89 per slot greedy,
0.65–0.79 at T = 1, models/demo/README.md), on purpose: a low prior costs at most one step in
which R − probe_rows rows verify only their anchor, a high one costs the blind full drafting of
every request that this gate exists to avoid (measured: +116 ms of a 1212 ms run at 64 requests).
Where the table says drafting pays even at α = 0.5, by the switching margin below (`SWITCH_MARGIN`: a
memory-bound target), the first step drafts every row; otherwise it probes. (Until 2026-12-07 the first step
asked for `PAYS_MARGIN`: the 100M cost stand-in's prior says 1.24x at 4 requests and 1.18x at 16, where fixed
γ = 3 runs 1.1-1.4x plain decoding, and its first step probed; drafting there took the scheduler 0.949 → 0.984
and 0.904 → 0.950 of the best other policy at 4 and 16 requests, 5 interleaved runs of 16-token requests. The
demo engine's prior says 0.46-0.88x at 1-64 requests: it probes.) A clear decision is reused for up to
`DECLINE_STEPS` steps while what it rests on stands (`_still_declined`; `_still_paying`: drafting paid by
`PAYS_MARGIN`; a narrower "pays" for `NARROW_PAYS_STEPS`, once priced every step: 1.03-1.05x at 1-4
requests, README history, 2026-12-07 evening): pricing was most of a one-request step's scheduling time. A
clear decline (Θ_draft < `CLEAR_DECLINE` × Θ_plain) stands for `CLEAR_DECLINE_STEPS`: a decline was priced
every ~6 steps at 4 and 16 requests (~120-240 µs each; now every 8-10), and the longer reuse took the scheduler
from 0.915 to 0.934,
0.919 to 0.949 and 0.962 to 0.979 of plain decoding at 4, 16 and 64 requests (demo engine, 11 interleaved runs).

Switching. Once the gate has declined, drafting every row again needs Θ_draft ≥ `SWITCH_MARGIN` × Θ_plain
(staying with drafting needs only Θ_draft > Θ_plain): the table's prices leave out what a switch costs (the
rows' backlogs caught up, verification widened for every row), and a marginal switch that does not pay costs
several plain steps, while staying declined where drafting would pay by less than the margin costs less than
that. Measured on the bench's sweep runner (scratch A/B, interleaved, 32-token requests, medians of 5 runs):
demo engine at 4 requests 0.74 → 0.88 of plain decoding's tokens/s (0.79 → 0.90 in a second run), 16 requests
0.82 → 0.835 (0.861 → 0.860 in the second);
the 100M cost stand-in (3 runs, 16-token requests) unchanged within noise at 1, 4 and 16 requests.

Probes. At the first step and after `probe_interval` steps without drafting, the `probe_rows` rows
with the smallest backlogs draft (cheapest to catch up), and never more than half of them (rounded up: at
one request the probe is that request); their confidences refresh the pool. A probe of every row would
verify their drafts too, widening every row's verification (measured at 4 requests on the demo engine: a
probe step of all 4 rows took ~8 ms against ~1 ms for a plain step, 4 such steps a quarter of a run).
By default one row probes (`probe_rows` = 1): its backlog, a whole prompt at the first step, is most of a
probe's cost, and one row's survivals start the pool as well as four's (demo engine: 0.86 → 0.88 of plain
decoding at 4 requests, 0.86 → 0.90 at 16).
When the next probe comes: `probe_spacing` (doubling intervals, each probe's cost a small share of the
plain steps to the next; one request, which probes itself, spaced by what its probe cost).
No probe where none could change the decision (`_ceiling`): where drafting every row would not pay by
`CEILING_MARGIN` (the switching margin) even were every draft accepted, τ = B at every depth, a probe's
confidences cannot start drafting, and the decline stands without one, pool or no pool, re-priced as any
decline is (the live cost model may have moved: a slowed target makes drafting cheaper beside it). The
drafter is priced there at the lesser of the live price and the table's, since only drafting or probes would
show a drafter the live model learned slow under a passing load to be fast again. The demo engine's table
says so from 16 requests on (ceiling 1.82x plain decoding at 4, 1.05x at 16), the 100M stand-in's never;
1.04-1.05x at 16 requests (README history, 2026-12-07 evening).
A decline that stands over the same rows is reused without being priced (`standing_decline`), and the
engine runs such a step as plain decoding does, keeping the drafter's context rows; those two and the spacing took the
scheduler from 0.852 to 0.894 of the best other policy (plain decoding) at 4 requests on the demo engine, 0.877
to 0.906 at 16, 0.958 to 0.969 at 64 (32-token requests, medians of 5 interleaved runs against the code before).
The other rows verify their anchor only: the engine gives them confidence −inf, survival 0, so they are
no candidate of Algorithm 1 and their length is 0. A probe whose drafts go unverified (padded pricing) may draft
on a worker thread beside the steps (`probe_overlap`): the engine says so (`launched`), and until it is recorded
the gate probes no more.
Under padded verification (the engine's [R, W] graphs) the probe rows verify their anchor only
too: their drafts would widen every row's verification to theirs (measured at 64 requests on the
demo engine: a probe step's verification took 33–35 ms at W = 4 against 10 ms at W = 1, and the
probes cost the scheduler ~10 % of its throughput against plain decoding). The price: the
drafter over ≤ probe_rows rows, against R rows before.

Catch-up. A row that skipped drafting has a backlog: the context rows it has not fed to the
drafter (its prompt if it never drafted, one row per skipped step). A normal drafting step feeds
up to γ + 1 rows per row (what the table's draft(R) covers); each row beyond that costs
`drafter_runner.CONTEXT_ROW_COST` of a row's drafting, and the runner splits calls so that a
backlog is paid by its own row, not by every row padded to it. That share, Σ_r excess_r, is paid
once and lets the rows draft on from then on, so deciding to draft all rows charges it spread
over `catch_up_steps` steps; the live cost model observes drafting normalised to a normal step
of all R rows (`observed`), so neither a catch-up nor a probe of a few rows skews what it learns
of the drafter's speed.

Realised acceptance. The pool's survivals are what the confidence head predicts, and on text unlike its
training data it can promise more than the target accepts. So the gate also keeps, over recent steps
that verified drafts, the drafts Algorithm 1 expected to be accepted and those that were (both decayed
by `ACCEPTANCE_DECAY` a step), and scales every survival of its path by their ratio, shrunk toward 1 by
`PRIOR_DRAFTS` pseudo-drafts (one unlucky step moves it little, ten consistent ones a lot). Within
`ACCEPTANCE_DEADBAND` of 1 the confidences are taken as they are: near a tie between drafting and
not, a few percent of sampling noise would otherwise flip the decision (and a declined step waits
`probe_interval` steps for the next probe). Downward the ratio always counts. Upward (the head promises
less than is accepted: on the demo pair's held-out text, 0.77/0.63/0.50 at slots 1-3 against 0.90/0.87/0.56
accepted) it counts, up to `MAX_ACCEPTANCE_SCALE` and never past a survival of 1, only while the rows are
drafting: it keeps a run of drafting going, it never starts one. Scaled up from a declined state, a 4x
slower drafter's lucky probes started runs of drafting that lost; without it at all, one request on the
demo engine declined 34-185 of ~360 steps whose drafts would have paid (measured 2026-12-05). Those sums
are of the rows that drafted: when requests join, they keep only the staying rows' share (`admitted`), so a
request is not judged by the luck of the one it replaced (one request at a time on the demo engine, where a
few requests accept little, 16 requests × 32 tokens, interleaved medians of 7-11 runs: 0.909 → 0.973 and
0.953 → 0.978 of fixed γ = 7; no change at 4 and 16 requests, which decline there).

Lossless: which rows draft depends only on committed history (backlogs, earlier steps'
confidences and timings), never on this step's draft tokens; a row that does not draft verifies
its anchor, a row that does goes through Algorithm 1 as ever, and each step's verification is
exact whatever was (or was not) drafted.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import torch

from .gate_plan import DRAFTING, DRAFTING_STEP, GatePlan, SplitStepCost, catch_up_price, without_drafting
from .prefix_scheduler import survival
from .probe_spacing import ProbeSpacing
from .stats import StepRecord
from .survival_pool import SurvivalPool

ACCEPTANCE_DECAY = 0.9  # per step that verified drafts: the realised/expected ratio follows ~10 such steps
PRIOR_DRAFTS = 16.0  # pseudo-drafts accepted as expected, added to both sums of the ratio
ACCEPTANCE_DEADBAND = 0.1  # a ratio this close to 1 is taken as 1
MAX_ACCEPTANCE_SCALE = 1.5  # confidences that promise less than is accepted are scaled up this much at most
DECLINE_STEPS = 8  # steps a "drafting does not pay" (or pays by PAYS_MARGIN) is reused while it stands
PAYS_MARGIN = 1.25  # Θ_draft ≥ this × Θ_plain: a clear "drafting pays", reused like a decline
NARROW_PAYS_STEPS = 1  # steps a narrower "drafting pays" is reused (drafting_gate's docstring)
SWITCH_MARGIN = 1.1  # from a decline to drafting every row, Θ_draft ≥ this × Θ_plain (module docstring)
CLEAR_DECLINE = 0.8  # Θ_draft < this × Θ_plain: a clear "does not pay", reused up to CLEAR_DECLINE_STEPS
CLEAR_DECLINE_STEPS = 16  # (a live cost model's cells age out over 32 steps: a longer reuse missed the moment)
CEILING_MARGIN = SWITCH_MARGIN  # a decline probes only while every draft accepted would pay by this much


class DraftingGate(ProbeSpacing):
    """Asked once a step (`plan`), told what the step saw (`record`). `padded`: Algorithm 1 prices
    verification as [R, W] rows (SchedulerConfig.pricing), so the gate predicts it depth by depth."""

    def __init__(self, cost: SplitStepCost, *, block_size: int, probe_every: int = 16, probe_rows: int = 1,
                 prior_acceptance: float = 0.5, pool_rows: int = 64, catch_up_steps: int = 16,
                 temperatures: tuple[float, ...] | None = None, padded: bool = False) -> None:
        if min(block_size, probe_every, probe_rows, pool_rows, catch_up_steps) < 1:
            raise ValueError("block_size, probe_every, probe_rows, pool_rows and catch_up_steps must be >= 1")
        if not 0.0 <= prior_acceptance < 1.0:
            raise ValueError(f"prior_acceptance must lie in [0, 1), got {prior_acceptance}")
        self.cost, self.block_size, self.temperatures, self.padded = cost, block_size, temperatures, padded
        self.probe_every, self.probe_rows, self.catch_up_steps = probe_every, probe_rows, catch_up_steps
        self.prior = prior_acceptance ** np.arange(1, block_size + 1)  # [γ] survival of the prior row
        self.pool = SurvivalPool(pool_rows, block_size)  # [γ] survival rows of recent drafted rows
        self._init_spacing()  # steps since rows last drafted, and when the next probe comes (probe_spacing)
        self.expected_drafts = 0.0  # decayed Σ drafts Algorithm 1 expected accepted, steps that verified drafts
        self.accepted_drafts = 0.0  # decayed Σ drafts accepted in those steps
        self.pool_version = 0  # bumped whenever the pool or those sums change (a snapshot re-encodes them then)
        # the pool's survivals > 0, descending (None under padded pricing, which reads depths only), and its
        # mean survival per depth [γ]; None: to build
        self._candidates: tuple[np.ndarray | None, np.ndarray] | None = None
        # the last "does not pay": (requests, pool_version, Σ excess backlog, normal draft seconds, steps it may be
        # reused: DECLINE_STEPS, CLEAR_DECLINE_STEPS where clear, hopeless: no confidence could make drafting pay,
        # `_ceiling`, so it probes no more); steps reused
        self._declined: tuple[int, int, int, float, int, bool] | None = None
        self._declined_steps = 0
        self._drafting = False  # the last plan drafted every row (a realised acceptance above promise counts)
        # the last "drafting pays": (requests, Σ excess backlog, normal draft seconds, steps it may be reused:
        # DECLINE_STEPS by PAYS_MARGIN or more, else NARROW_PAYS_STEPS)
        self._paying: tuple[int, int, float, int] | None = None
        self._paying_steps = 0
        self._last: GatePlan | None = None  # the last plan (standing_decline)
        self._in_flight = False  # a probe launched and not yet recorded (`launched`)

    # -- the decision ---------------------------------------------------------------------------
    def plan(self, backlogs: np.ndarray) -> GatePlan:  # backlogs [R] context rows each row has not fed
        """The rows that draft this step (module docstring)."""
        self._last = self._plan(backlogs)
        return self._last

    def standing_decline(self) -> GatePlan | None:
        """The last plan again, unpriced, where it drafted no row and still stands as `plan` would find it over
        the same rows (the caller's word: none joined or left since, so no backlog shrank): the pool and the
        realised acceptance unchanged, reused fewer than `DECLINE_STEPS` times, no probe due. None: call `plan`.
        A declined step's pricing was ~30 µs of host time at 16 requests (demo engine), 2 % of its step."""
        last = self._last  # (a plan that drafted rows stands no longer: it set `_declined` None or moved the pool)
        if last is None or not self._decline_stands():
            return None
        if not self._declined[5] and (not self.pool or self._probe_due(last.requests)):
            return None
        self._declined_steps += 1
        return last

    def _plan(self, backlogs: np.ndarray) -> GatePlan:
        requests = len(backlogs)
        every = np.arange(requests)
        excess = int(self._excess(backlogs).sum())
        if self._still_paying(requests, excess):
            normal = self._paying[2]
            return GatePlan(requests, every, catch_up_price(normal, excess, requests), normal, excess)
        self._paying = None
        if not self._still_declined(requests, excess):
            normal = float(self.cost.draft_seconds(requests))
            amortised = catch_up_price(normal, excess, requests, self.catch_up_steps)
            with_drafts, plain = self.throughputs(requests, amortised, drafting=self._drafting)
            # from declined to drafting every row (the first step too, on the prior): a margin
            switch = 1.0 if self._drafting else SWITCH_MARGIN
            if with_drafts > switch * plain:
                self._declined, self._drafting = None, True
                self._drafting_again()
                reuse = DECLINE_STEPS if with_drafts >= PAYS_MARGIN * plain else NARROW_PAYS_STEPS
                self._paying, self._paying_steps = (requests, excess, normal, reuse), 0
                return GatePlan(requests, every, catch_up_price(normal, excess, requests), normal, excess)
            reuse = CLEAR_DECLINE_STEPS if with_drafts < CLEAR_DECLINE * plain else DECLINE_STEPS
            hopeless = self._ceiling(requests, normal) < CEILING_MARGIN * plain
            self._declined, self._declined_steps = (requests, self.pool_version, excess, normal, reuse, hopeless), 0
        self._drafting = False
        _, _, _, normal, _, hopeless = self._declined
        if self._in_flight or hopeless or (self.pool and not self._probe_due(requests)):
            return GatePlan(requests, every[:0], 0.0, normal, declined=True)
        probe_rows = min(self.probe_rows, (requests + 1) // 2)  # fewer than R where R > 1: anchors verify alone
        rows = every if requests <= probe_rows else np.sort(np.argsort(backlogs, kind="stable")[:probe_rows])
        price = self._price(backlogs[rows])
        self._probing(requests, price, backs_off=bool(self.pool))  # (the first probe: no pool)
        return GatePlan(requests, rows, price, normal, int(self._excess(backlogs[rows]).sum()), declined=True)

    def launched(self, plan: GatePlan) -> GatePlan:
        """Probe `plan` drafts apart from the step (probe_overlap) and is recorded once it lands; no other probe
        until then. -> the step's plan: declined, no row drafting (what `standing_decline` reuses meanwhile)."""
        self._in_flight, self.skipped = True, 0
        self._last = GatePlan(plan.requests, plan.rows[:0], 0.0, plan.normal, declined=True)
        return self._last

    def abandoned(self) -> None:
        """The launched probe failed: nothing to record, and probes may come again."""
        self._in_flight = False

    def narrowed(self, plan: GatePlan, rows: np.ndarray, backlogs: np.ndarray) -> GatePlan:
        """`plan` with only `rows` of its rows drafting (the others copy their drafts: prompt_lookup), priced
        again, so that what the step's drafting teaches the cost model is normalised to the rows that drafted."""
        if len(rows) == len(plan.rows):
            return plan
        if not len(rows):
            return GatePlan(plan.requests, rows, 0.0, plan.normal, declined=plan.declined)
        return GatePlan(plan.requests, rows, self._price(backlogs[rows]), plan.normal,
                        int(self._excess(backlogs[rows]).sum()), plan.declined)

    def _still_paying(self, requests: int, excess: int) -> bool:
        """Whether the last "drafting pays" stands without pricing the step again: the same rows, backlogs no
        larger, no step since that drafted and accepted no draft, for up to `DECLINE_STEPS` steps where it paid
        by `PAYS_MARGIN` (the pool and the cost model drift by less than the margin in as many), else
        `NARROW_PAYS_STEPS`."""
        paying = self._paying
        if paying is None or paying[0] != requests or excess > paying[1] or self._paying_steps >= paying[3]:
            return False
        self._paying_steps += 1
        return True

    def _still_declined(self, requests: int, excess: int) -> bool:
        """Whether the last "drafting does not pay" stands without pricing the step again (that pricing was
        most of a one-request step's scheduling time): as many rows, the same pool and realised acceptance,
        backlogs only grown (drafting only got dearer), reused fewer times than it may be (a live cost model
        moves)."""
        if not self._decline_stands() or self._declined[0] != requests or excess < self._declined[2]:
            return False
        self._declined_steps += 1
        return True

    def _decline_stands(self) -> bool:
        """A last "does not pay" whose pool and realised acceptance have not moved, reused fewer times than it
        may be (`DECLINE_STEPS`, `CLEAR_DECLINE_STEPS`; what `_still_declined` and `standing_decline` both ask)."""
        declined = self._declined
        return declined is not None and declined[1] == self.pool_version and self._declined_steps < declined[4]

    @property
    def acceptance_scale(self) -> float:
        """Realised ÷ expected accepted drafts over recent steps, shrunk toward 1; 1.0 before any and within
        the deadband, at most `MAX_ACCEPTANCE_SCALE`."""
        ratio = (self.accepted_drafts + PRIOR_DRAFTS) / (self.expected_drafts + PRIOR_DRAFTS)
        return 1.0 if abs(ratio - 1.0) <= ACCEPTANCE_DEADBAND else min(ratio, MAX_ACCEPTANCE_SCALE)

    def throughputs(self, requests: int, draft_seconds: float, *, drafting: bool = False) -> tuple[float, float]:
        """(Θ_draft, Θ_plain) in tokens/s: Algorithm 1 over R rows like the pool's, up to its first drop; the
        realised acceptance scales survivals up only while the rows are `drafting` (module docstring)."""
        scale = self.acceptance_scale
        tau, tokens = self._path(requests, scale if drafting else min(scale, 1.0))
        verify = np.asarray(self.cost.verify_seconds(requests, tokens), dtype=np.float64).tolist()
        # a path of γ + 1 points (padded) to ~γ·P (packed): Python floats, as numpy's would be, without its
        # per-call cost (this runs every step)
        best = -math.inf
        for t, v in zip(tau.tolist(), verify, strict=True):
            theta = t / (draft_seconds + v)
            if theta <= best:
                break
            best = theta
        return best, requests / float(self.cost.verify_seconds(requests, requests))

    def _ceiling(self, requests: int, normal: float) -> float:
        """Θ_draft were every draft accepted (τ = B at every depth, the best of the γ + 1), drafting at the lesser
        of `normal` and the prior's price (a drafter the live model learned slow under a passing load may be
        fast again, and only probes would tell)."""
        prior = getattr(self.cost, "prior", None)  # (a live model's table)
        draft = normal if prior is None else min(normal, float(prior.draft_seconds(requests)))
        tokens = requests * (1 + np.arange(self.block_size + 1))
        return float(np.max(tokens / (draft + np.asarray(self.cost.verify_seconds(requests, tokens)))))

    def _path(self, requests: int, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
        """Algorithm 1's admission path over R rows like the pool's, survivals times `scale`: expected
        accepts τ [n] and verified tokens B [n], from no draft on. Packed: candidates by descending
        survival, each pool candidate standing for R / P; padded (`padded`): depth by depth, B = R·(1 + depth)."""
        if self._candidates is None:
            pool = self.pool.rows() if self.pool else self.prior[None, :]  # [P, γ], oldest first
            # sum / P: ndarray.mean's own overhead was most of this line at one request (~15 µs)
            self._candidates = (None if self.padded else -np.sort(-pool[pool > 0]), pool.sum(axis=0) / len(pool))
        ranked, depths = self._candidates
        if self.padded:  # γ depths: summed as numpy's cumsum would, in Python floats (see throughputs)
            tau, total = [requests * 1.0], 0.0
            for a in depths.tolist():
                if a <= 0.0:  # a scale keeps the nonzero depths; a survival stays <= 1
                    break
                total += a if scale == 1.0 else min(a * scale, 1.0)
                tau.append(requests * (1.0 + total))
            return np.array(tau), requests * (1 + np.arange(len(tau)))
        if scale != 1.0:  # keeps the order; a survival stays <= 1
            ranked = np.minimum(ranked * scale, 1.0)
        per = requests / (len(self.pool) or 1)  # candidates of R rows per pool candidate
        cumulative = np.concatenate(([0.0], np.cumsum(ranked)))
        if per >= 1.0:
            return requests + per * cumulative, requests + np.rint(per * np.arange(ranked.size + 1)).astype(np.int64)
        # fewer rows than the pool: a verified token stands for 1/per pool candidates, so the path goes by
        # whole tokens (stepping by pool candidates, B would stall between tokens while τ rose, and the
        # first drop of Θ would come at the first token, wherever the optimum is)
        at = np.rint(np.arange(int(ranked.size * per) + 1) / per).astype(np.int64)
        return requests + per * cumulative[at], requests + np.arange(at.size, dtype=np.int64)

    def _excess(self, backlogs: np.ndarray) -> np.ndarray:
        """Context rows beyond what a normal drafting step feeds (γ + 1 a row)."""
        return np.maximum(np.asarray(backlogs, dtype=np.int64) - (self.block_size + 1), 0)

    def _price(self, backlogs: np.ndarray) -> float:
        """Predicted seconds of drafting rows with these backlogs, catch-up included."""
        rows = len(backlogs)
        return catch_up_price(float(self.cost.draft_seconds(rows)), int(self._excess(backlogs).sum()), rows)

    # -- after the step --------------------------------------------------------------------------
    def admitted(self, new: int, rows: int) -> None:
        """`new` of the `rows` active rows just joined: the realised-acceptance sums keep the others' share."""
        if new and (self.expected_drafts or self.accepted_drafts):
            kept = 1.0 - new / rows
            self.expected_drafts *= kept
            self.accepted_drafts *= kept
            self.pool_version += 1

    def record(self, plan: GatePlan, confidence_logits: torch.Tensor | np.ndarray | None,
               verified: tuple[float, int] | None = None, survivals: np.ndarray | None = None,
               drafting_seconds: float = 0.0, step_seconds: float = 0.0) -> None:
        """confidence_logits [R, γ] of the step (rows that did not draft: anything, unread); `verified`:
        (drafts Algorithm 1 expected accepted, drafts accepted) when the step verified drafts; `survivals`:
        their survival [R, γ] at this gate's temperatures where the caller has it (not computed again);
        `drafting_seconds`, `step_seconds`: what a probe's drafting and its whole step (prefill aside) took,
        where measured (`probe_spacing`)."""
        if plan.probe:
            self._in_flight = False
        if plan.declined and len(plan.rows):  # a probe: when the next comes (probe_spacing)
            self._probed(plan, verified[0] if verified else 0.0, drafting_seconds, step_seconds)
        if verified is not None and verified[0] > 0:
            self.expected_drafts = self.expected_drafts * ACCEPTANCE_DECAY + verified[0]
            self.accepted_drafts = self.accepted_drafts * ACCEPTANCE_DECAY + verified[1]
            self.pool_version += 1
        if len(plan.rows) and (verified is None or verified[1] == 0):
            self._paying = None  # drafts that bought nothing: price the next step
        if not len(plan.rows):
            self.skipped += 1
            return
        self.skipped = 0
        if survivals is None and confidence_logits is not None:
            survivals = survival(torch.as_tensor(confidence_logits), self.temperatures).numpy()
        if survivals is not None:
            self.pool.extend(survivals[plan.rows])
            self._candidates = None
            self.pool_version += 1

    def observed(self, record: StepRecord, plan: GatePlan) -> StepRecord:
        """The step as the cost model should learn from it: drafting normalised to a normal step of
        all R rows (the backlogs' catch-up and a probe's few rows scaled out), at the measured speed.
        A catch-up that normalised still costs more than a normal step is priced from `CONTEXT_ROW_COST`,
        not measured: it tells of the drafter only that it is not slower than that, so its drafting is
        left out (the step is learned as one without drafting). Otherwise the first step of a request (its
        prompt caught up) and the probes after a decline (the skipped steps caught up) taught the model a
        drafter up to 2.4x slower than it was, and kept one request from drafting for 100+ steps (measured:
        demo engine, one request at a time, 16 requests of 32 tokens: 16 to 441 steps declined of 160-463)."""
        if not len(plan.rows) or plan.price <= 0.0 or (plan.all and plan.price == plan.normal):
            return record
        scale = plan.normal / plan.price
        seconds = {k: v * scale if k in DRAFTING else v for k, v in record.seconds.items()}
        if plan.excess and sum(seconds.get(k, 0.0) for k in DRAFTING_STEP) > plan.normal:
            return without_drafting(record)
        return replace(record, seconds=seconds, drafted=True)
