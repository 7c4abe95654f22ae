"""A continuous-batching engine's requests: the queue, the active rows and the finished results, and their
lifecycle (submit, admission, retirement, cancellation, hand-off). `BatchEngine` (batch_loop) is one; this
half holds what happens to requests between steps, `batch_loop` what one step does to them.

The active rows are a contiguous prefix of both slot caches: row r of the target's and the drafter's caches
belongs to `active[r]`, and a request that leaves hands its row to the last active row (`vacate`).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence

from .capacity import Admission
from .context_log import ContextLog
from .kv_cache import SlotCache
from .kv_tiers import HostTier
from .model_info import ModelInfo
from .recovery.resume import resumed_tokens
from .recovery.snapshot import RequestSnapshot
from .request_state import RunningRequest
from .requests import find_stop, stop_set, validate_request
from .sampling import round_generator
from .stats import RequestResult


class EngineRequests:
    """The requests half of `BatchEngine`, whose `__init__` sets the attributes annotated here and calls
    `_init_requests`, and whose `step` admits (`_admit`) and retires (`_retire`) through it."""

    info: ModelInfo
    admission: Admission
    target_kv: SlotCache
    drafter_kv: SlotCache
    tiers: HostTier | None  # where running requests' KV goes under slot pressure (kv_tiers); None: they wait

    def _init_requests(self) -> None:
        self.queue: deque[RunningRequest] = deque()
        self.active: list[RunningRequest] = []  # row r of both caches belongs to active[r]
        self.finished: dict[int, RequestResult] = {}  # until handed off by take_finished / take_result
        self._ids = itertools.count()
        self._step = 0
        self.context_log = ContextLog()  # plain steps' context rows over the active rows, not yet handed to them

    def submit(
        self,
        prompt_ids: Sequence[int],
        *,
        max_new_tokens: int,
        temperature: float = 0.0,
        seed: int = 0,
        stop_token_ids: Sequence[int] = (),
        resume_from: RequestSnapshot | None = None,
    ) -> int:
        """Validate and queue a request; returns its id. Invalid requests raise RequestError or
        CapacityError here and never touch the engine's state. `resume_from`: a snapshot of this request
        from an engine that is gone; it continues from its committed tokens (`recovery`)."""
        prompt = validate_request(prompt_ids, vocab_size=self.info.vocab_size, max_positions=self.info.max_positions,
                                  max_new_tokens=max_new_tokens, temperature=temperature)
        stop = stop_set(stop_token_ids, self.info.vocab_size)
        self.admission.check_servable(self.positions_needed(len(prompt), max_new_tokens))
        tokens, generator = [], round_generator(seed) if temperature > 0 else None
        rounds, fed = ([], []), 0
        if resume_from is not None:  # its sampler needs nothing more: each round seeds from (seed, tokens so far)
            tokens = resumed_tokens(resume_from, self.info.vocab_size, max_new_tokens)
            rounds = (list(resume_from.acceptance_lengths), list(resume_from.proposal_lengths))
            fed = max(len(prompt) + len(tokens) - 1 - resume_from.backlog, 0) if tokens else 0
        result = RequestResult(next(self._ids), prompt, tokens, *rounds, submitted_step=self._step)
        self.queue.append(RunningRequest(result, max_new_tokens, float(temperature), stop, generator, seed,
                                         scanned=len(tokens), fed=fed))
        return result.request_id

    def positions_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        """KV positions a request reserves: committed positions never exceed prompt + max_new + one
        block of overshoot. Public so the service can refuse a request before it queues."""
        return prompt_len + max_new_tokens + self.info.block_size + 1

    def tokens_so_far(self, request_id: int) -> list[int]:
        """Committed tokens of a request (finished, active, or [] while queued)."""
        if request_id in self.finished:
            return self.finished[request_id].tokens
        for a in self.active:  # read after every step of a stream: no list of every row built for it
            if a.result.request_id == request_id:
                return a.result.tokens[: a.max_new_tokens]
        swapped = self.tiers.requests() if self.tiers is not None else []
        active = next((a for a in swapped if a.result.request_id == request_id), None)
        return [] if active is None else active.result.tokens[: active.max_new_tokens]

    @property
    def steps_run(self) -> int:
        return self._step

    @property
    def idle(self) -> bool:
        return not self.queue and not self.active and not (self.tiers is not None and self.tiers.swapped)

    def take_result(self, request_id: int) -> RequestResult | None:
        """The finished result of one request, handed off (the engine forgets it), or None."""
        return self.finished.pop(request_id, None)

    def take_finished(self) -> dict[int, RequestResult]:
        """Every finished result not yet handed off; the engine keeps none of them."""
        done, self.finished = self.finished, {}
        return done


    def _admit(self) -> list[RunningRequest]:
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
        self.vacate(row)

    def vacate(self, row: int) -> None:
        """Active row `row` leaves the caches; the last active row moves into it."""
        self.context_log.vacate(row, self.active[row])
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
        swapped = self.tiers.take(request_id) if self.tiers is not None else None
        for i, a in enumerate(self.queue if swapped is None else [swapped]):
            if a.result.request_id == request_id:
                if swapped is None:
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
