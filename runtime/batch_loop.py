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
"""

from __future__ import annotations

import itertools
import operator
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .backend import Array, Backend, as_torch
from .cost_model import StepCostModel
from .kv_cache import Admission, CacheShape, Capacity, SlotCache
from .monitor import Monitor
from .prefix_scheduler import SchedulerConfig, schedule
from .proposer import DraftBlock, propose_rows
from .reference_decoder import RequestError, validate_request
from .rejection import verify_chain
from .sampling import sample_rows
from .stats import EngineStats, RequestResult, StepRecord


@dataclass(frozen=True)
class ModelInfo:
    """What the loop needs to know about the graphs (from the models or export.json)."""

    vocab_size: int
    max_positions: int
    block_size: int
    mask_token_id: int
    target_cache: CacheShape
    drafter_cache: CacheShape
    context_feature_size: int
    head_state_size: int


@dataclass
class _Active:
    result: RequestResult
    max_new_tokens: int
    temperature: float
    stop: frozenset[int]
    generator: torch.Generator | None
    start: int = 0  # anchor position = committed target KV length
    anchor: int = 0
    pending_context: torch.Tensor | None = None  # [n, F] features of positions [ctx_len, start)


def _phase(seconds: dict[str, float], name: str, begin: float) -> float:
    now = time.perf_counter()
    seconds[name] = seconds.get(name, 0.0) + now - begin
    return now


class Engine:
    """Continuous batching over a `Backend` exposing `target`, `drafter` and `draft_head`."""

    def __init__(
        self,
        backend: Backend,
        info: ModelInfo,
        *,
        capacity: Capacity,
        scheduler: SchedulerConfig,
        cost_model: StepCostModel | None = None,
        monitor: Monitor | None = None,
    ) -> None:
        self.backend, self.info, self.scheduler = backend, info, scheduler
        self.cost_model, self.monitor = cost_model, monitor
        self.admission = Admission(capacity)
        slots, length = capacity.max_requests, capacity.max_seq_len
        self.target_kv = SlotCache(info.target_cache, slots, length)
        self.drafter_kv = SlotCache(info.drafter_cache, slots, length)
        self.queue: deque[_Active] = deque()
        self.active: list[_Active] = []  # row r of both caches belongs to active[r]
        self.finished: dict[int, RequestResult] = {}
        self.stats = EngineStats()
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
        validate_request(prompt_ids, vocab_size=self.info.vocab_size, max_positions=self.info.max_positions,
                         max_new_tokens=max_new_tokens, temperature=temperature)
        stop = frozenset(operator.index(t) for t in stop_token_ids)
        if any(not 0 <= t < self.info.vocab_size for t in stop):
            raise RequestError(f"stop token ids must lie in [0, {self.info.vocab_size}): {sorted(stop)}")
        self.admission.check_servable(self._need(len(prompt_ids), max_new_tokens))
        request_id = next(self._ids)
        generator = torch.Generator().manual_seed(seed) if temperature > 0 else None
        prompt = [operator.index(t) for t in prompt_ids]
        result = RequestResult(request_id, prompt, [], submitted_step=self._step)
        self.queue.append(_Active(result, max_new_tokens, float(temperature), stop, generator))
        return request_id

    def _need(self, prompt_len: int, max_new_tokens: int) -> int:
        # committed positions never exceed prompt + max_new + one block of overshoot
        return prompt_len + max_new_tokens + self.info.block_size + 1

    @property
    def idle(self) -> bool:
        return not self.queue and not self.active

    def run_until_done(self) -> dict[int, RequestResult]:
        while not self.idle:
            self.step()
        return self.finished

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
        if self.scheduler.needs_drafts:
            hidden, base_logits = self._draft()
            begin = _phase(seconds, "draft", begin)
            block = propose_rows(
                lambda feeds: self._run("draft_head", feeds),
                hidden=hidden, base_logits=base_logits,
                anchors=torch.tensor([a.anchor for a in self.active]),
                state_size=self.info.head_state_size,
                temperatures=[a.temperature for a in self.active],
                generators=[a.generator for a in self.active],
            )
            begin = _phase(seconds, "heads", begin)
        step_seconds = self.cost_model.seconds if self.cost_model else None
        decision = schedule(self.scheduler, requests=rows, block_size=self.info.block_size,
                            confidence_logits=None if block is None else block.confidence_logits,
                            step_seconds=step_seconds)
        begin = _phase(seconds, "schedule", begin)
        accepted, padded = self._verify(decision.lengths, block, seconds, begin)
        tokens = sum(1 + k for k in decision.lengths)
        load = self.monitor.sample() if self.monitor else None
        record = StepRecord(
            step=self._step, requests=rows, admitted_new=len(new), lengths=list(decision.lengths),
            verified_tokens=tokens, padded_tokens=padded, accepted=accepted,
            expected_accepts=decision.expected_accepts,
            predicted_seconds=self.cost_model.seconds(rows, tokens) if self.cost_model else None,
            seconds=seconds,
            cpu_percent=None if load is None else load.cpu_percent,
            gpu_percent=None if load is None else load.gpu_percent,
        )
        self.stats.steps.append(record)
        self._retire()
        self._step += 1
        return record

    def _run(self, graph: str, feeds: dict[str, Array]) -> dict[str, torch.Tensor]:
        return {name: as_torch(value) for name, value in self.backend.run(graph, feeds).items()}

    def _admit(self) -> list[_Active]:
        new = []
        while self.queue:
            request = self.queue[0]
            need = self._need(len(request.result.prompt_ids), request.max_new_tokens)
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
        mask = (causal[None] & valid[:, None, :])[:, None]  # [P, 1, width, width]
        out = self._run("target", {
            "input_ids": ids, "position_ids": torch.arange(width).expand(len(new), width).contiguous(),
            "attention_mask": mask, **self._past_feeds(self.target_kv, len(new), 0, "past_key_values"),
        })
        present = self._present(out, "present", self.info.target_cache.layers)
        for r in range(len(new)):
            self.target_kv.clear(first_row + r)
            self.drafter_kv.clear(first_row + r)
        self.target_kv.write(present, source_offset=0, counts=lengths, first_row=first_row)
        last = out["logits"][torch.arange(len(new)), torch.tensor(lengths) - 1]  # [P, V]
        anchors = sample_rows(last, [a.temperature for a in new], [a.generator for a in new])
        for r, a in enumerate(new):
            a.start, a.anchor = lengths[r], int(anchors[r])
            a.pending_context = out["context_features"][r, : lengths[r]]
            a.result.tokens.append(a.anchor)
            self.active.append(a)

    def _past_feeds(self, cache: SlotCache, rows: int, upto: int, prefix: str) -> dict[str, torch.Tensor]:
        feeds = {}
        for i, (k, v) in enumerate(cache.past(rows, upto) if upto else self._empty(cache, rows)):
            feeds[f"{prefix}.{i}.key"], feeds[f"{prefix}.{i}.value"] = k, v
        return feeds

    @staticmethod
    def _empty(cache: SlotCache, rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        _, kvh, _, hd = cache.keys[0].shape
        return [(torch.zeros(rows, kvh, 0, hd), torch.zeros(rows, kvh, 0, hd)) for _ in cache.keys]

    @staticmethod
    def _present(out: dict[str, torch.Tensor], prefix: str, layers: int) -> list[tuple[torch.Tensor, ...]]:
        return [(out[f"{prefix}.{i}.key"], out[f"{prefix}.{i}.value"]) for i in range(layers)]

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
        out = self._run("drafter", {
            "block_ids": torch.cat((torch.tensor([[a.anchor] for a in self.active]),
                                    torch.full((rows, gamma - 1), self.info.mask_token_id)), dim=1),
            "block_position_ids": starts[:, None] + torch.arange(gamma),
            "context_features": features,
            "context_position_ids": torch.tensor(cached)[:, None] + torch.arange(ctx),
            "attention_mask": visible[:, None, None, :].expand(-1, 1, gamma, -1).contiguous(),
            **self._past_feeds(self.drafter_kv, rows, past, "past_context"),
        })
        present = self._present(out, "present_context", self.info.drafter_cache.layers)
        self.drafter_kv.write(present, source_offset=past, counts=pending)
        for a in self.active:
            a.pending_context = None
        return out["hidden"], out["base_logits"]

    def _verify(
        self, lengths: Sequence[int], block: DraftBlock | None, seconds: dict[str, float], begin: float
    ) -> tuple[list[int], int]:
        rows, width = len(self.active), 1 + max(lengths)
        ids = torch.zeros(rows, width, dtype=torch.int64)
        ids[:, 0] = torch.tensor([a.anchor for a in self.active])
        for r, k in enumerate(lengths):
            ids[r, 1 : 1 + k] = block.tokens[r, :k]
        starts = torch.tensor([a.start for a in self.active])
        past = int(starts.max())
        cols = torch.arange(past + width)[None, None, :]  # [1, 1, keys]
        new_col = cols - past  # index among new tokens (negative for past columns)
        row_t = torch.arange(width)[None, :, None]  # [1, T, 1]
        n_valid = torch.tensor(lengths)[:, None, None] + 1
        in_block = (new_col <= row_t) & (new_col < n_valid)
        mask = torch.where(new_col < 0, cols < starts[:, None, None], in_block)  # [R, T, keys]
        out = self._run("target", {
            "input_ids": ids, "position_ids": starts[:, None] + torch.arange(width),
            "attention_mask": mask[:, None].contiguous(),
            **self._past_feeds(self.target_kv, rows, past, "past_key_values"),
        })
        begin = _phase(seconds, "verify", begin)
        accepted = []
        for r, (a, k) in enumerate(zip(self.active, lengths, strict=True)):
            verdict = verify_chain(
                target_logits=out["logits"][r, : k + 1],
                draft_tokens=ids[r, 1 : 1 + k],
                draft_logits=block.logits[r, :k] if k else out["logits"][r, :0],
                temperature=a.temperature, generator=a.generator,
            )
            n = verdict.accepted
            accepted.append(n + 1)
            if self.scheduler.needs_drafts:
                a.pending_context = out["context_features"][r, : n + 1]
            a.result.tokens += [*ids[r, 1 : 1 + n].tolist(), verdict.bonus]
            a.result.acceptance_lengths.append(n + 1)
            a.result.proposal_lengths.append(k)
            a.start += n + 1
            a.anchor = verdict.bonus
        present = self._present(out, "present", self.info.target_cache.layers)
        self.target_kv.write(present, source_offset=past, counts=accepted)
        _phase(seconds, "commit", begin)
        return accepted, rows * width

    def _retire(self) -> None:
        """Finished requests leave; the last active row moves into each freed row."""
        r = 0
        while r < len(self.active):
            a = self.active[r]
            tokens = a.result.tokens
            hit = next((i for i, t in enumerate(tokens[: a.max_new_tokens]) if t in a.stop), None)
            if hit is None and len(tokens) < a.max_new_tokens:
                r += 1
                continue
            a.result.tokens = tokens[: a.max_new_tokens if hit is None else hit + 1]
            a.result.finish_reason = "length" if hit is None else "stop"
            a.result.finished_step = self._step
            self.finished[a.result.request_id] = a.result
            self.admission.release(a.result.request_id)
            last = len(self.active) - 1
            if r != last:
                self.target_kv.move(last, r)
                self.drafter_kv.move(last, r)
            self.target_kv.clear(last)
            self.drafter_kv.clear(last)
            self.active[r] = self.active[last]
            self.active.pop()
