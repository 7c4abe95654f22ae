"""The continuous-batching decode loop.

One `step()`:
  admit    : queued requests that fit (slots, token budget) are prefilled in one padded target
             call; their first token (the anchor) is sampled from the prefill logits
  draft    : one batched drafter forward for all R active requests (new context rows padded)
  heads    : the sequential head, slot by slot, each request sampling from its own stream
  schedule : lengths ℓ_r (Algorithm 1, fixed, threshold or off)
  verify   : one target forward over [R, 1 + max ℓ] (padded; masks hide padding), then the
             acceptance rule per request
  commit   : accepted KV rows written at each request's own length (rollback = not writing
             the rest), context features queued for the drafter; finished requests leave and
             free their slot between steps
Semantics per request are exactly `reference_decoder.speculative_generate`'s.

Memory stays bounded in a long-lived server: finished results wait in `finished` only until
`take_finished()` / `take_result()` hands them off, and `stats` keeps a ring of recent steps.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dspark.export import contract as C

from .backend import Array, Backend, as_torch
from .cost_model import StepCost, StepCostModel
from .drafting_gate import DraftingGate, SplitStepCost
from .kv_cache import Admission, Capacity, SlotCache
from .model_info import ModelInfo
from .monitor import Monitor
from .prefix_scheduler import Decision, SchedulerConfig, StepScheduler
from .proposer import DraftBlock, propose_rows
from .rejection import verify_chain
from .requests import find_stop, stop_set, validate_request
from .sampling import sample_rows
from .stats import EngineStats, RequestResult, StepRecord


@dataclass
class _Active:
    result: RequestResult
    max_new_tokens: int
    temperature: float
    stop: frozenset[int]
    generator: torch.Generator | None
    start: int = 0  # anchor position = committed target KV length
    anchor: int = 0
    scanned: int = 0  # output tokens already searched for a stop token
    pending_context: torch.Tensor | None = None  # [n, F] features of positions [ctx_len, start)


def _phase(seconds: dict[str, float], name: str, begin: float) -> float:
    now = time.perf_counter()
    seconds[name] = seconds.get(name, 0.0) + now - begin
    return now


KV_MODES = ("concat", "static")
DEFAULT_KV_MODE = "concat"  # "static" pays off at long pasts and large batches (runtime.benchmark)


class BatchEngine:
    """Continuous batching over a `Backend` with the export contract's graphs.

    kv_mode `concat` feeds each step's past as [R, kvh, max start, hd] (a view here, a copy
    for backends that need contiguous inputs) and the graph returns past ++ new; `static` binds
    the slot buffers themselves ([R, kvh, max_seq_len, hd], contiguous, never copied) to the
    `target_static` graph, which returns only the new rows. Either way only the accepted rows
    are written back, at each request's own length.
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
        kv_mode: str = DEFAULT_KV_MODE,
        step_history: int | None = 1024,
    ) -> None:
        if kv_mode not in KV_MODES:
            raise ValueError(f"kv_mode '{kv_mode}' is unknown; choose one of {KV_MODES}")
        graph = C.TARGET_STATIC if kv_mode == "static" else C.TARGET
        if graph not in backend.specs:
            raise ValueError(f"kv_mode '{kv_mode}' needs the '{graph}' graph, which this backend lacks")
        self.kv_mode, self._target_graph = kv_mode, graph
        self.backend, self.info, self.scheduler = backend.open(), info, scheduler  # its owner closes it
        self.cost_model, self.monitor = cost_model, monitor
        self.planner = StepScheduler(scheduler)
        self.gate = (DraftingGate(cost_model) if scheduler.mode == "dspark" and scheduler.gate_drafting
                     and isinstance(cost_model, SplitStepCost) else None)
        self.admission = Admission(capacity)
        slots, length = capacity.max_requests, capacity.max_seq_len
        self.target_kv = SlotCache(info.target_cache, slots, length)
        self.drafter_kv = SlotCache(info.drafter_cache, slots, length)
        self.queue: deque[_Active] = deque()
        self.active: list[_Active] = []  # row r of both caches belongs to active[r]
        self.finished: dict[int, RequestResult] = {}  # until handed off by take_finished / take_result
        self.stats = EngineStats(history=step_history)
        self._ids = itertools.count()
        self._step = 0

    # -- requests -----------------------------------------------------------------------------
    def submit(
        self,
        prompt_ids: Sequence[int],
        *,
        max_new_tokens: int,
        temperature: float = 0.0,
        seed: int = 0,
        stop_token_ids: Sequence[int] = (),
    ) -> int:
        """Validate and queue a request; returns its id. Invalid requests raise RequestError or
        CapacityError here and never touch the engine's state."""
        prompt = validate_request(prompt_ids, vocab_size=self.info.vocab_size, max_positions=self.info.max_positions,
                                  max_new_tokens=max_new_tokens, temperature=temperature)
        stop = stop_set(stop_token_ids, self.info.vocab_size)
        self.admission.check_servable(self.positions_needed(len(prompt), max_new_tokens))
        request_id = next(self._ids)
        generator = torch.Generator().manual_seed(seed) if temperature > 0 else None
        result = RequestResult(request_id, prompt, [], submitted_step=self._step)
        self.queue.append(_Active(result, max_new_tokens, float(temperature), stop, generator))
        return request_id

    def positions_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        """KV positions a request reserves: committed positions never exceed prompt + max_new + one
        block of overshoot. Public so the service can refuse a request before it queues."""
        return prompt_len + max_new_tokens + self.info.block_size + 1

    def tokens_so_far(self, request_id: int) -> list[int]:
        """Committed tokens of a request (finished, active, or [] while queued)."""
        if request_id in self.finished:
            return self.finished[request_id].tokens
        active = next((a for a in self.active if a.result.request_id == request_id), None)
        return [] if active is None else active.result.tokens[: active.max_new_tokens]

    @property
    def idle(self) -> bool:
        return not self.queue and not self.active

    def take_result(self, request_id: int) -> RequestResult | None:
        """The finished result of one request, handed off (the engine forgets it), or None."""
        return self.finished.pop(request_id, None)

    def take_finished(self) -> dict[int, RequestResult]:
        """Every finished result not yet handed off; the engine keeps none of them."""
        done, self.finished = self.finished, {}
        return done

    def refit_cost_model(self, last_steps: int = 64) -> StepCostModel:
        """Refit Algorithm 1's step cost model t(R, B) on the last decode steps as actually timed
        (prefill excluded), so current machine load reaches the scheduler. The drafting gate keeps
        the engine's measured table."""
        samples = [(s.requests, s.verified_tokens, s.total_seconds - s.seconds.get("prefill", 0.0))
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
        new = self._admit()
        if new:
            self._prefill(new)
        begin = _phase(seconds, "prefill", begin)
        self._retire()
        if not self.active:
            self._step += 1
            return None
        rows = len(self.active)
        block = None
        drafting = self.scheduler.needs_drafts and (self.gate is None or self.gate.should_draft(rows))
        if drafting:
            hidden, base_logits = self._draft()
            begin = _phase(seconds, "draft", begin)
            block = self._propose(hidden, base_logits)
            begin = _phase(seconds, "heads", begin)
        if drafting or not self.scheduler.needs_drafts:
            step_seconds = self.cost_model.seconds if self.cost_model else None
            decision = self.planner.decide(requests=rows, block_size=self.info.block_size,
                                confidence_logits=None if block is None else block.confidence_logits,
                                step_seconds=step_seconds)
        else:
            decision = Decision((0,) * rows, None, None, 0)
        begin = _phase(seconds, "schedule", begin)
        accepted, padded = self._verify(decision.lengths, block, seconds, begin)
        tokens = sum(1 + k for k in decision.lengths)
        if self.gate is not None:
            self.gate.record(drafted=drafting, requests=rows, expected_accepts=decision.expected_accepts,
                             verified_tokens=tokens)
        load = self.monitor.sample() if self.monitor else None
        record = StepRecord(
            step=self._step, requests=rows, admitted_new=len(new), lengths=list(decision.lengths),
            verified_tokens=tokens, padded_tokens=padded, acceptance_lengths=accepted,
            expected_accepts=decision.expected_accepts,
            predicted_seconds=self.cost_model.seconds(rows, tokens) if self.cost_model else None,
            seconds=seconds,
            cpu_percent=None if load is None else load.cpu_percent,
            gpu_percent=None if load is None else load.gpu_percent,
            confidence_logits=None if block is None else block.confidence_logits,
            drafted=drafting,
        )
        self.stats.record(record)
        observe = getattr(self.cost_model, "observe", None)
        if observe is not None:  # a live cost model learns the machine's current speed
            observe(record)
        self._retire()
        self._step += 1
        return record

    def _run(self, graph: str, feeds: dict[str, Array]) -> dict[str, torch.Tensor]:
        return {name: as_torch(value) for name, value in self.backend.run(graph, feeds).items()}

    def _admit(self) -> list[_Active]:
        new = []
        while self.queue:
            request = self.queue[0]
            need = self.positions_needed(len(request.result.prompt_ids), request.max_new_tokens)
            if not self.admission.fits(need):
                break
            self.queue.popleft()
            self.admission.admit(request.result.request_id, need)
            request.result.admitted_step = self._step
            new.append(request)
        return new

    def _prefill(self, new: list[_Active]) -> None:
        first_row = len(self.active)
        lengths = [len(a.result.prompt_ids) for a in new]
        width = max(lengths)
        ids = torch.zeros(len(new), width, dtype=torch.int64)
        for r, a in enumerate(new):
            ids[r, : lengths[r]] = torch.tensor(a.result.prompt_ids)
        valid = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]  # [P, width]
        causal = torch.ones(width, width, dtype=torch.bool).tril()
        new_mask = causal[None] & valid[:, None, :]  # [P, width, width]
        for r in range(len(new)):
            self.target_kv.clear(first_row + r)
            self.drafter_kv.clear(first_row + r)
        starts = torch.zeros(len(new), dtype=torch.int64)
        out, present, offset = self._target(first_row, ids, starts, torch.arange(width).expand(len(new), -1),
                                            new_mask)
        self.target_kv.write(present, source_offset=offset, counts=lengths, first_row=first_row)
        last = out["logits"][torch.arange(len(new)), torch.tensor(lengths) - 1]  # [P, V]
        anchors = sample_rows(last, [a.temperature for a in new], [a.generator for a in new])
        for r, a in enumerate(new):
            a.start, a.anchor = lengths[r], int(anchors[r])
            a.pending_context = out["context_features"][r, : lengths[r]]
            a.result.tokens.append(a.anchor)
            self.active.append(a)

    def _target(
        self,
        first_row: int,
        ids: torch.Tensor,  # [R, T]
        starts: torch.Tensor,  # [R] committed KV length of each row
        positions: torch.Tensor,  # [R, T]
        new_mask: torch.Tensor,  # [R, T, T] bool: which new tokens each new token sees
    ) -> tuple[dict[str, torch.Tensor], list[tuple[torch.Tensor, ...]], int]:
        """One target call on slot rows first_row.. -> outputs, new KV rows source, their column."""
        rows = ids.shape[0]
        layers = self.info.target_cache.layers
        if self.kv_mode == "static":
            cache, prefix, offset = self.target_kv.past(first_row, rows), "cache", 0
        else:
            offset = int(starts.max())
            cache, prefix = self.target_kv.past(first_row, rows, offset), "past_key_values"
        cols = torch.arange(cache[0][0].shape[2])
        past_mask = (cols[None, :] < starts[:, None])[:, None, :].expand(-1, ids.shape[1], -1)
        feeds = {"input_ids": ids, "position_ids": positions.contiguous(),
                 "attention_mask": torch.cat((past_mask, new_mask), dim=2)[:, None].contiguous()}
        feeds.update(_kv_feeds(prefix, cache))
        out = self._run(self._target_graph, feeds)
        present = _kv_outputs(out, "new" if self.kv_mode == "static" else "present", layers)
        return out, present, offset

    def _draft(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows, gamma = len(self.active), self.info.block_size
        cached = self.drafter_kv.lengths[:rows]
        pending = [a.pending_context.shape[0] for a in self.active]
        past, ctx = max(cached), max(pending)
        features = torch.zeros(rows, ctx, self.info.context_feature_size)
        for r, a in enumerate(self.active):
            features[r, : pending[r]] = a.pending_context
        starts = torch.tensor([a.start for a in self.active])
        cols = torch.arange(past + ctx + gamma)[None, :]
        visible = ((cols < torch.tensor(cached)[:, None])
                   | ((cols >= past) & (cols < past + torch.tensor(pending)[:, None]))
                   | (cols >= past + ctx))  # [R, keys]
        out = self._run(C.BACKBONE, {
            "block_ids": torch.cat((torch.tensor([[a.anchor] for a in self.active]),
                                    torch.full((rows, gamma - 1), self.info.mask_token_id)), dim=1),
            "block_position_ids": starts[:, None] + torch.arange(gamma),
            "context_features": features,
            "context_position_ids": torch.tensor(cached)[:, None] + torch.arange(ctx),
            "attention_mask": visible[:, None, None, :].expand(-1, 1, gamma, -1).contiguous(),
            **_kv_feeds("past_context", self.drafter_kv.past(0, rows, past)),
        })
        present = _kv_outputs(out, "present_context", self.info.drafter_cache.layers)
        self.drafter_kv.write(present, source_offset=past, counts=pending)
        for a in self.active:
            a.pending_context = None
        return out["block_hidden"], out.get("base_logits")

    def _propose(self, hidden: torch.Tensor, base_logits: torch.Tensor | None) -> DraftBlock:
        anchors = torch.tensor([a.anchor for a in self.active])
        temperatures = [a.temperature for a in self.active]
        if self.info.has_heads and all(t == 0.0 for t in temperatures):
            feeds = {"block_hidden": hidden, "anchor_ids": anchors}
            if self.info.lm_head_in_backbone:
                feeds["base_logits"] = base_logits
            out = self._run(C.HEAD_GREEDY, feeds)
            return DraftBlock(out["draft_ids"], out["logits"], out.get("confidence_logits"))
        return propose_rows(
            (lambda feeds: self._run(C.HEAD_STEP, feeds)) if self.info.has_heads else None,
            hidden=hidden, base_logits=base_logits, anchors=anchors,
            feed_base_logits=self.info.lm_head_in_backbone, state_size=self.info.head_state_size,
            temperatures=temperatures, generators=[a.generator for a in self.active],
        )

    def _verify(
        self, lengths: Sequence[int], block: DraftBlock | None, seconds: dict[str, float], begin: float
    ) -> tuple[list[int], int]:
        rows, width = len(self.active), 1 + max(lengths)
        ids = torch.zeros(rows, width, dtype=torch.int64)
        ids[:, 0] = torch.tensor([a.anchor for a in self.active])
        if block is not None:
            for r, k in enumerate(lengths):
                ids[r, 1 : 1 + k] = block.tokens[r, :k]
        starts = torch.tensor([a.start for a in self.active])
        col = torch.arange(width)
        n_valid = torch.tensor(lengths)[:, None, None] + 1
        new_mask = (col[None, None, :] <= col[None, :, None]) & (col[None, None, :] < n_valid)  # [R, T, T]
        out, present, offset = self._target(0, ids, starts, starts[:, None] + col, new_mask)
        begin = _phase(seconds, "verify", begin)
        accepted = []
        for r, (a, k) in enumerate(zip(self.active, lengths, strict=True)):
            verdict = verify_chain(
                target_logits=out["logits"][r, : k + 1],
                draft_tokens=ids[r, 1 : 1 + k],
                draft_logits=block.logits[r, :k] if k else out["logits"][r, :0],
                temperature=a.temperature, generator=a.generator,
            )
            n = verdict.accepted_drafts
            accepted.append(n + 1)
            if self.scheduler.needs_drafts:  # rows the drafter has not seen yet (several if it skipped)
                new_context = out["context_features"][r, : n + 1]
                a.pending_context = (new_context if a.pending_context is None
                                     else torch.cat((a.pending_context, new_context)))
            a.result.tokens += [*ids[r, 1 : 1 + n].tolist(), verdict.bonus]
            a.result.acceptance_lengths.append(n + 1)
            a.result.proposal_lengths.append(k)
            a.start += n + 1
            a.anchor = verdict.bonus
        self.target_kv.write(present, source_offset=offset, counts=accepted)
        _phase(seconds, "commit", begin)
        return accepted, rows * width

    def _retire(self) -> None:
        """Finished requests leave; the last active row moves into each freed row."""
        r = 0
        while r < len(self.active):
            a = self.active[r]
            tokens = a.result.tokens
            hit = find_stop(tokens, a.stop, a.scanned, a.max_new_tokens)
            a.scanned = min(len(tokens), a.max_new_tokens)
            if hit is None and len(tokens) < a.max_new_tokens:
                r += 1
                continue
            a.result.tokens = tokens[: a.max_new_tokens if hit is None else hit + 1]
            self._leave(r, "length" if hit is None else "stop")

    def _leave(self, row: int, reason: str) -> None:
        """Active row `row` finishes: its result is kept for hand-off, its slot is freed, and the
        last active row moves into it (the active rows stay a contiguous prefix of the caches)."""
        a = self.active[row]
        a.result.finish_reason, a.result.finished_step = reason, self._step
        self.finished[a.result.request_id] = a.result
        self.admission.release(a.result.request_id)
        last = len(self.active) - 1
        if row != last:
            self.target_kv.move(last, row)
            self.drafter_kv.move(last, row)
        self.target_kv.clear(last)
        self.drafter_kv.clear(last)
        self.active[row] = self.active[last]
        self.active.pop()

    def cancel(self, request_id: int) -> bool:
        """End a queued or running request now (between steps), finish reason "cancelled", keeping
        the tokens committed so far; its slot is free for the next step. False if it is not here."""
        for i, a in enumerate(self.queue):
            if a.result.request_id == request_id:
                del self.queue[i]
                a.result.finish_reason, a.result.finished_step = "cancelled", self._step
                self.finished[request_id] = a.result
                return True
        for row, a in enumerate(self.active):
            if a.result.request_id == request_id:
                a.result.tokens = a.result.tokens[: a.max_new_tokens]
                self._leave(row, "cancelled")
                return True
        return False


def _kv_feeds(prefix: str, cache: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    tensors = [t for kv in cache for t in kv]
    return dict(zip(C.kv_names(prefix, len(cache)), tensors, strict=True))


def _kv_outputs(out: dict[str, torch.Tensor], prefix: str, layers: int) -> list[tuple[torch.Tensor, ...]]:
    names = C.kv_names(prefix, layers)
    return [(out[names[2 * i]], out[names[2 * i + 1]]) for i in range(layers)]
