"""A drafting gate's probe drafted on a worker thread while the engine decodes on (`overlap_probes`).

Under padded verification a probe's drafts are not verified (`drafting_gate`, probes): what the step needs
from them is nothing, and what the gate needs, the probe rows' confidences, can come a few steps later. So
the engine hands the probe to `drafter_runner.probe_worker` and goes on with plain steps; ONNX Runtime and
torch release the GIL inside a graph call, so the probe runs on a core the target's calls leave idle. It
lands (the gate records its confidences, a live cost model learns the drafter's speed from it as the worker
timed it) before anything that touches the drafter or moves rows: a step that drafts, admits or swaps, and
any row leaving (`vacate`), and otherwise at the start of the step by which its price (catch-up included)
over a plain step's verification says it is done, at most `MAX_FLIGHT_STEPS` on: at a step, not when the
worker finishes, so the gate's choices do not hang on thread timing. Until then the gate probes no more
(`DraftingGate.launched`).

Measured on the demo engine (2-core CPU, one ORT thread, 32-token requests): a probe of one row catching
up 17-93 context rows took 2.3-3.8 ms beside plain steps of 0.9 ms at 4 requests, and probes were 6.6 % of
the scheduler's time there against plain decoding (a gate that never probed: 0.967 of it, one that did:
0.901). Interleaved A/B on the bench's sweep runner (medians of 9 runs, ÷ plain decoding, the bar there):
probes in line 0.897, 0.953, 0.965 at 4, 16, 64 requests; overlapped 0.945, 0.975, 0.987.

Only where every row is greedy: a sampled row's draws depend on which steps drafted, and a resumed engine
replays the gate's choices from its saved state (`recovery.engine_state`), which has no probe in flight.

Lossless: the probe rows verify their anchor only, as a probe in line does; which step it lands in moves
only the gate's later choices, which never depend on a step's own draft tokens.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import Future
from dataclasses import dataclass, replace

import numpy as np
import torch

from .drafter_runner import probe_worker
from .gate_plan import DRAFTING, GatePlan
from .proposer import DraftBlock
from .stats import StepRecord

MAX_FLIGHT_STEPS = 8  # steps a probe may draft beside at most, whatever its price
# a probe on the worker took ~2x its price (its drafter cold after the target, the engine's host work on the other
# core): the first probe of an engine, with no time of its own yet, lands as if it would (one step landed at the
# next step's start and waited 0.4-0.75 ms for it beside 2 ms steps: demo engine, 16 requests)
WORKER_SLOWDOWN = 2.0


@dataclass
class ProbeInFlight:
    plan: GatePlan  # the probe as the gate planned it
    drafted: Future[DraftBlock]
    phases: dict[str, float]  # its drafting phases, as the worker timed them
    drafter_bindings: int  # the drafter's binding count before it (a probe that binds runs cold)
    due: int  # the step at whose start it lands at the latest
    record: StepRecord | None = None  # the step it was launched in: learned with the probe's phases once it lands
    target_bound: bool = False  # whether that step's verification bound a layout


class ProbeOverlap:
    """The probe half of `BatchEngine`: launch (`_launch_probe`), land (`_land_probe`), and rows that
    leave only once it has landed (`vacate`)."""

    _probe: ProbeInFlight | None
    _probe_took: float  # what the last probe took on the worker (0.0: none yet)

    def _launch_probe(self, plan: GatePlan, anchors: np.ndarray, starts: np.ndarray, temperatures: list[float],
                      generators: list) -> GatePlan:
        """Start drafting `plan`'s rows on the worker, to land once the plain steps since have had the time its
        price predicts, or the last probe took where that was more (on the worker a probe ran ~2x its price: 3.2-5.2
        ms against 1.6-1.8, demo engine at 4 requests), at most `MAX_FLIGHT_STEPS` on; -> the step's plan as the
        gate now has it (no row drafts)."""
        self.context_log.hand(self.active)
        contexts = [self.active[r].take_context() for r in plan.rows]  # here: the steps until it lands add rows
        phases: dict[str, float] = {}
        drafted = probe_worker().submit(self._propose, plan.rows, anchors, starts, temperatures, generators,
                                        phases, time.perf_counter(), contexts)
        step = float(self.cost_model.verify_seconds(plan.requests, plan.requests))  # a plain step's verification
        took = max(plan.price, self._probe_took or WORKER_SLOWDOWN * plan.price)
        flight = min(max(math.ceil(took / step), 1), MAX_FLIGHT_STEPS) if step > 0 else 1
        self._probe = ProbeInFlight(plan, drafted, phases, self.drafter.bindings_made, self._step + flight)
        return self.gate.launched(plan)

    def _land_probe(self, seconds: dict[str, float] | None = None) -> None:
        """Wait for the probe in flight (the wait counted as `seconds`' drafting, where given), then let the
        gate and the live cost model learn from it."""
        probe, self._probe = self._probe, None
        begin = time.perf_counter()
        try:
            block = probe.drafted.result()
        except BaseException:  # the step fails as a probe in line would; later probes may still come
            self.gate.abandoned()
            raise
        if seconds is not None:
            seconds["draft"] = seconds.get("draft", 0.0) + time.perf_counter() - begin
        self._probe_took = sum(probe.phases.get(k, 0.0) for k in DRAFTING)
        logits = block.confidence_logits  # the drafter's buffers: read before its next call
        self.gate.record(probe.plan, None if logits is None else torch.as_tensor(logits), None,
                         self.planner.survivals(logits), self._probe_took)
        if probe.record is not None:  # as if it had drafted before that step's verification
            learned = replace(probe.record, seconds={**probe.record.seconds, **probe.phases})
            self._learn(learned, probe.plan, drafter_bound=self.drafter.bindings_made != probe.drafter_bindings,
                        target_bound=probe.target_bound)

    def vacate(self, row: int) -> None:
        if self._probe is not None:  # its rows' drafter caches are being written
            self._land_probe()
        super().vacate(row)
