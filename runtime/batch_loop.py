"""The continuous-batching decode loop: Propose, Verify, Reconcile over buffers sized once.

One `step()`:
  admit     queued requests that fit (slots, token budget) are prefilled in one target call
            (`StepBatch.prompts`); their first token (the anchor) is sampled from the prefill logits
  propose   the drafter backbone over each drafting request's new context rows and its block, then
            the heads (`DrafterRunner`); the drafting gate picks which requests draft: all, a few
            (a probe) or none, where its cost table says drafting cannot pay (`drafting_gate`); where
            all draft, requests whose history repeats may copy instead (`prompt_lookup`)
  schedule  lengths ℓ_r (`StepScheduler`: Algorithm 1, fixed, threshold, off, ...)
  verify    one target call over `StepBatch.chains` (`TargetRunner`), the acceptance rule for all
            rows at once (`verify_chains`)
  reconcile the accepted KV entries are committed at each request's own length (rollback = not
            counting the rest), context features are queued for the drafter, finished requests
            leave and free their slot
Semantics per request are exactly `reference_decoder.speculative_generate`'s.

Requests between steps (submit, admission, retirement, cancellation, hand-off) are `engine_requests`'.
Memory stays bounded in a long-lived server: finished results wait in `finished` only until
`take_finished()` / `take_result()` hands them off, and `stats` keeps a ring of recent steps.
"""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import torch

from .backend import Backend, as_numpy
from .capacity import Admission, Capacity
from .cost_model import StepCost, StepCostModel
from .drafter_runner import DrafterRunner, scatter_block
from .drafting_gate import DraftingGate
from .engine_requests import EngineRequests
from .gate_plan import DRAFTING, GatePlan, SplitStepCost
from .kv_cache import SlotCache
from .kv_tiers import HostTier
from .live_cost import warm_record
from .model_info import ModelInfo
from .monitor import Monitor
from .prefix_scheduler import Decision, SchedulerConfig, StepScheduler
from .probe_overlap import ProbeOverlap
from .prompt_lookup import PromptLookup, drafted_verified, with_copies
from .proposer import DraftBlock
from .request_state import RunningRequest, within_budget
from .sampling import round_seed, sample_rows
from .stats import EngineStats, RequestResult, StepRecord
from .step_batch import StepBatch
from .step_reconcile import StepReconcile
from .target_runner import TargetRunner, kv_mode_for
from .tree_step import TreeStepper


def _phase(seconds: dict[str, float], name: str, begin: float) -> float:
    now = time.perf_counter()
    seconds[name] = seconds.get(name, 0.0) + now - begin
    return now


class BatchEngine(ProbeOverlap, StepReconcile, EngineRequests):
    """Continuous batching over a `Backend` with the export contract's graphs.

    `kv_mode` picks the target graph and how its keys/values are held (`target_runner`): `packed` or
    `fused` (in place, the default wherever the export has the fused graphs), `static` or `concat`; None
    takes the best the backend has. Only accepted entries are ever counted as committed.
    """

    def __init__(
        self,
        backend: Backend,
        info: ModelInfo,
        *,
        capacity: Capacity,
        scheduler: SchedulerConfig,
        cost_model: StepCost | None = None,
        monitor: Monitor | None = None,
        kv_mode: str | None = None,
        step_history: int | None = 1024,
        host_tier: HostTier | None = None,
    ) -> None:
        self.kv_mode = kv_mode_for(backend, kv_mode)
        if scheduler.pricing is None:  # priced as the target computes: the packed graph its real tokens only
            scheduler = replace(scheduler, pricing="packed" if self.kv_mode == "packed" else "padded")
        self.backend, self.info, self.scheduler = backend.open(), info, scheduler  # its owner closes it
        self.cost_model, self.monitor = cost_model, monitor
        self.planner = StepScheduler(scheduler)
        self.gate = (DraftingGate(cost_model, block_size=info.block_size,
                                  temperatures=scheduler.confidence_temperatures,
                                  padded=scheduler.padded)
                     if scheduler.mode in ("dspark", "async") and scheduler.gate_drafting
                     and isinstance(cost_model, SplitStepCost)
                     else None)
        self._gated: list[RunningRequest] = []  # the active rows of the gate's last plan
        self._probe, self._probe_took = None, 0.0  # a probe drafting on the worker, the last one's time (probe_overlap)
        self.admission = Admission(capacity)
        slots, length = capacity.max_requests, capacity.max_seq_len
        self.target_kv = SlotCache(info.target_cache, slots, length, device=backend.kv_device)
        self.drafter_kv = SlotCache(info.drafter_cache, slots, length, device=backend.kv_device)
        self.lookup = (PromptLookup(scheduler.prompt_lookup, info.block_size, cost_model,
                                    max_tokens=scheduler.lookup_tokens)
                       if scheduler.copies_prompts else None)  # copied drafts beside DSpark's (prompt_lookup)
        self.target = TargetRunner(backend, info, self.target_kv, self.kv_mode, max_width=info.block_size + 1,
                                   long_width=1 + (info.block_size if self.lookup is None else self.lookup.width))
        self.drafter = DrafterRunner(backend, info, self.drafter_kv)
        self.trees = TreeStepper(self) if scheduler.drafting == "tree" else None  # draft trees (tree_step)
        self.tiers = host_tier  # where running requests' KV goes under slot pressure (kv_tiers); None: they wait
        self.stats = EngineStats(history=step_history)
        self._init_requests()  # queue, active rows, finished results (engine_requests)

    def refit_cost_model(self, last_steps: int = 64) -> StepCostModel:
        """Refit Algorithm 1's step cost model t(R, B) on the last decode steps as actually timed
        (prefill excluded), so current machine load reaches the scheduler. The drafting gate keeps
        the engine's measured table."""
        samples = [(s.requests, s.padded_tokens, s.total_seconds - s.seconds.get("prefill", 0.0))
                   for s in self.stats.recent(last_steps) if s.requests and s.drafted]
        self.cost_model = StepCostModel.fit(samples)
        return self.cost_model

    def run_until_done(self) -> dict[int, RequestResult]:
        """Step until idle; hands off every finished result."""
        while not self.idle:
            self.step()
        return self.take_finished()

    # -- one step -----------------------------------------------------------------------------
    def step(self) -> StepRecord | None:
        seconds: dict[str, float] = {}
        begin = time.perf_counter()
        # a probe in flight lands when due (at a step, not when it is done: the gate's choices stay reproducible)
        # and before rows may swap
        if self._probe is not None and (self._step >= self._probe.due or self.tiers is not None):
            self._land_probe(seconds)
            begin = time.perf_counter()
        if self.tiers is not None:
            self.context_log.hand(self.active)  # (rows may swap in)
            self.tiers.rebalance(self)
        new = self._admit()
        if new:
            if self._probe is not None:  # (its wait counted as the step's prefill)
                self._land_probe()
            self.context_log.hand(self.active)  # (rows join)
            self._prefill(new)
            if self.gate is not None:
                self.gate.admitted(len(new), len(self.active))
        begin = _phase(seconds, "prefill", begin)
        bindings = self.drafter.bindings_made, self.target.bindings_made  # this step's calls: cold if they bind
        if new:  # (a prefill's first token may end a request; every other row was scanned when its step ended)
            self._retire()
        if not self.active:
            self._step += 1
            return None
        greedy = not any(a.temperature > 0 for a in self.active)
        if not greedy:
            for a in self.active:
                if a.generator is not None:
                    a.generator.manual_seed(round_seed(a.seed, len(a.result.tokens)))
        if self.trees is not None:  # draft trees: propose, verify and commit over tree nodes (tree_step)
            record = self.trees.step(len(new), seconds, begin)
            self.stats.record(record)
            self._retire()
            self._step += 1
            return record
        if not self.scheduler.needs_drafts and greedy:
            record = self._plain_step(len(new), seconds, begin)
            self.stats.record(record)
            self._retire()
            self._step += 1
            return record
        # the same rows as the gate's last step (a list compared by identity): a decline may stand unpriced, and
        # where every row is greedy the step is plain decoding, before any of the general step's work
        standing = self.gate.standing_decline() if self.gate is not None and self.active == self._gated else None
        if standing is not None and greedy:
            return self._declined_step(standing, len(new), seconds, begin, bindings)
        rows, active = len(self.active), self.active
        anchors = np.fromiter((a.anchor for a in active), np.int64, rows)
        starts = np.fromiter((a.start for a in active), np.int64, rows)
        temperatures = [a.temperature for a in active]
        generators = [a.generator for a in active]
        block, plan, backlogs = None, standing, None
        drafting = np.arange(rows) if self.scheduler.needs_drafts else np.arange(0)  # rows that draft
        if self.gate is not None:
            if plan is None:
                backlogs = np.fromiter((a.backlog for a in active), np.int64, rows)
                plan = self.gate.plan(backlogs)
                self._gated = list(active)
            drafting = plan.rows
            # a probe whose drafts go unverified drafts on the worker while the steps go on (probe_overlap); every
            # row greedy: a sampled row's draws follow the gate's choices, which a restart replays (recovery)
            if plan.probe and self._probe is None and self.scheduler.overlaps_probes and greedy:
                plan = self._launch_probe(plan, anchors, starts, temperatures, generators)
                drafting = plan.rows
            elif len(drafting) and self._probe is not None:
                self._land_probe(seconds)
            if not len(drafting) and greedy:  # declined, every row greedy: plain decoding
                return self._declined_step(plan, len(new), seconds, begin, bindings)
        # rows that copy instead, where every row drafts because it pays: a copy replaces a block worth drafting
        copies = (self.lookup.propose(active, self.target_kv.max_len - 1 - int(starts.max()))
                  if self.lookup is not None and len(drafting) == rows and (plan is None or not plan.declined)
                  else None)
        # a probe under padded verification verifies anchors only: it is there for the drafted rows'
        # confidences (the gate's pool), and their drafts would pad every row to their width
        probe_only = plan is not None and plan.probe and self.scheduler.padded
        if copies is not None:
            drafting = np.delete(drafting, copies.rows)  # every row drafted: row r is drafting[r]
            if plan is not None:
                plan = self.gate.narrowed(plan, drafting, backlogs)
        if len(drafting):
            block = self._propose(drafting, anchors, starts, temperatures, generators, seconds, begin)
            begin = time.perf_counter()
        # host numpy, never a torch tensor: a torch call after a graph call cost ~15-30 µs (as_tensor and the
        # record's clone were ~57 µs of a ~2.6 ms one-request step, demo engine)
        confidence = None if block is None or block.confidence_logits is None else as_numpy(block.confidence_logits)
        survivals = self.planner.survivals(confidence)  # read by Algorithm 1 and the gate alike
        candidates = survivals  # Algorithm 1's: the DSpark rows', and the copying rows' below
        if copies is not None:
            block, candidates = with_copies(copies, block, None if probe_only else survivals, temperatures,
                                            self.info.vocab_size)
        if candidates is not None and self.scheduler.token_budget:  # no draft past a row's token budget
            candidates = within_budget(candidates, active)
        if (block is not None and not probe_only) or not self.scheduler.needs_drafts or copies is not None:
            decision = self.planner.decide(requests=rows, block_size=self.info.block_size,
                                           confidence_logits=confidence, survivals=candidates,
                                           step_seconds=self.cost_model.seconds if self.cost_model else None)
            verifying = drafting if copies is None else np.sort(np.concatenate((drafting, copies.rows)))
            if len(verifying) < rows and self.scheduler.needs_drafts:  # rows that did not draft verify their anchor
                lengths = np.zeros(rows, np.int64)
                lengths[verifying] = np.asarray(decision.lengths, dtype=np.int64)[verifying]
                decision = replace(decision, lengths=tuple(lengths.tolist()))
        else:
            decision = Decision((0,) * rows, None, None, 0)
        begin = _phase(seconds, "schedule", begin)
        batch = StepBatch.chains(anchors, None if block is None else np.asarray(block.tokens),
                                 np.asarray(decision.lengths, dtype=np.int64), starts)
        out = self.target.forward(batch)
        begin = _phase(seconds, "verify", begin)
        accepted = self._reconcile(batch, out, block, temperatures, generators)
        _phase(seconds, "commit", begin)
        if self.lookup is not None:
            self.lookup.record(active, copies, drafting, survivals, batch.counts - 1, accepted)
        if plan is not None:
            drafts = batch.tokens - rows  # drafts verified this step (0: anchors only)
            verified = (decision.expected_accepts - rows, sum(accepted) - rows) \
                if drafts and decision.expected_accepts is not None else None
            if copies is not None:  # the gate learns of DSpark's drafts only
                verified = drafted_verified(drafting, candidates, batch.counts - 1, accepted)
            self.gate.record(plan, confidence, verified, survivals,
                             sum(seconds.get(k, 0.0) for k in DRAFTING) if plan.declined else 0.0,
                             sum(seconds.values()) - seconds.get("prefill", 0.0) if plan.declined and plan.all else 0.0)
        load = self.monitor.sample() if self.monitor else None
        computed = self.target.computed_tokens(batch)
        record = StepRecord(
            step=self._step, requests=rows, admitted_new=len(new), lengths=list(decision.lengths),
            verified_tokens=batch.tokens, padded_tokens=computed, acceptance_lengths=accepted,
            expected_accepts=decision.expected_accepts,
            # priced where Algorithm 1 priced the step: a step without drafts would price it for the record alone
            predicted_seconds=self.cost_model.seconds(rows, computed) if self.cost_model and len(drafting) else None,
            seconds=seconds,
            cpu_percent=None if load is None else load.cpu_percent,
            gpu_percent=None if load is None else load.gpu_percent,
            confidence_logits=None if confidence is None else confidence.copy(),  # the heads' buffer is reused
            drafted=self.scheduler.needs_drafts and len(drafting) == rows,  # a probe's few rows: False
            copied_rows=() if copies is None else tuple(copies.rows.tolist()),
        )
        return self._finish(record, plan, bindings)

    def _declined_step(self, plan: GatePlan, admitted: int, seconds: dict[str, float], begin: float,
                       bindings: tuple[int, int]) -> StepRecord:
        """A step the gate declined, every row greedy: plain decoding, the drafter's context rows kept."""
        begin = _phase(seconds, "schedule", begin)  # (the gate's time: a plain step's overhead, not its verify)
        record = self._plain_step(admitted, seconds, begin)
        self.gate.record(plan, None)
        return self._finish(record, plan, bindings)

    def _finish(self, record: StepRecord, plan: GatePlan | None, bindings: tuple[int, int]) -> StepRecord:
        """Record the step, let a live cost model learn from it (warm calls only: `bindings`, the runners'
        binding counts before it; the step a probe was launched in, once the probe lands), retire finished rows."""
        self.stats.record(record)
        target_bound = self.target.bindings_made != bindings[1]
        if self._probe is not None and self._probe.record is None:
            self._probe.record, self._probe.target_bound = record, target_bound
        else:
            self._learn(record, plan, drafter_bound=self.drafter.bindings_made != bindings[0],
                        target_bound=target_bound)
        self._retire()
        self._step += 1
        return record

    def _learn(self, record: StepRecord, plan: GatePlan | None, *, drafter_bound: bool, target_bound: bool) -> None:
        """A live cost model learns the machine's current speed from the step, where its calls ran warm."""
        observe = getattr(self.cost_model, "observe", None)
        if observe is not None:
            learned = warm_record(record if plan is None else self.gate.observed(record, plan),
                                  drafter_bound=drafter_bound, target_bound=target_bound)
            if learned is not None:
                observe(learned)

    def _plain_step(self, admitted: int, seconds: dict[str, float], begin: float) -> StepRecord:
        """Plain greedy decoding (scheduler `off`, or a step the drafting gate declined; no row sampling): each
        row's anchor in, the target's argmax out. The general step's tokens without its scheduling, chains and
        verifier: ~20 µs less host work a step, 2-3 % of a demo-target step (a sampling row takes the general
        step)."""
        active, rows = self.active, len(self.active)
        batch = StepBatch.anchors(np.fromiter((a.anchor for a in active), np.int64, rows),
                                  np.fromiter((a.start for a in active), np.int64, rows))
        out = self.target.forward(batch)
        begin = _phase(seconds, "verify", begin)
        self._commit_anchors(batch, out)
        _phase(seconds, "commit", begin)
        load = self.monitor.sample() if self.monitor else None
        return StepRecord(step=self._step, requests=rows, admitted_new=admitted, lengths=[0] * rows,
                          verified_tokens=rows, padded_tokens=rows, acceptance_lengths=[1] * rows,
                          expected_accepts=None, predicted_seconds=None, seconds=seconds,
                          cpu_percent=None if load is None else load.cpu_percent,
                          gpu_percent=None if load is None else load.gpu_percent, drafted=False)

    def _propose(self, drafting: np.ndarray, anchors: np.ndarray, starts: np.ndarray, temperatures: list[float],
                 generators: list[torch.Generator | None], seconds: dict[str, float], begin: float,
                 contexts: list[list[np.ndarray]] | None = None) -> DraftBlock:
        """Draft for active rows `drafting` [k] -> a block over all R rows: rows that did not draft
        have confidence −inf (survival 0: Algorithm 1 gives them length 0) and no drafts. `contexts`: their
        pending context rows, where already taken."""
        active, rows = self.active, len(self.active)
        every = len(drafting) == rows
        if contexts is None:
            self.context_log.hand(self.active)
            contexts = [active[r].take_context() for r in drafting]
        out = self.drafter.draft(anchors[drafting], starts[drafting], contexts,
                                 None if every else drafting, greedy=not any(temperatures[r] for r in drafting))
        begin = _phase(seconds, "draft", begin)
        order = drafting[out.order]  # the active row of each drafted row
        block = out.block  # drafted in the backbone's call (the joined graph), else by the heads now
        if block is None:
            block = self.drafter.propose(out.hidden, out.base_logits, anchors[order], [temperatures[r] for r in order],
                                         [generators[r] for r in order])
            _phase(seconds, "heads", begin)
        if every and (order == drafting).all():
            return block
        return scatter_block(block, order, rows, temperatures)

    def _prefill(self, new: list[RunningRequest]) -> None:
        first_row = len(self.active)
        # a resumed request's KV is rebuilt from prompt + committed tokens; its last token is its anchor
        batch = StepBatch.prompts([a.result.prompt_ids + a.result.tokens[:-1] for a in new])
        for r in range(len(new)):
            self.target_kv.clear(first_row + r)
            self.drafter_kv.clear(first_row + r)
        out = self.target.forward(batch, first_row, last_only=True)
        self.target.commit(batch.counts, first_row)
        last = torch.from_numpy(np.ascontiguousarray(out.logits[:, 0]))  # [P, V]: each prompt's last position
        fresh = [not a.result.tokens for a in new]  # a resumed request draws nothing here
        anchors = sample_rows(last, [a.temperature if f else 0.0 for a, f in zip(new, fresh, strict=True)],
                              [a.generator if f else None for a, f in zip(new, fresh, strict=True)]).tolist()
        context = batch.gather(out.context_features, batch.counts)
        for r, a in enumerate(new):
            if fresh[r]:
                a.result.tokens.append(anchors[r])
            a.start, a.anchor = int(batch.counts[r]), a.result.tokens[-1]
            a.pending, a.pending_rows = [], 0  # `fed` stays: a resumed request's drafter had seen those rows
            a.add_context(context[batch.cu_counts[r] : batch.cu_counts[r + 1]])
            self.active.append(a)
