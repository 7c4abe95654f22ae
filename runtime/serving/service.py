"""The engine service: one `BatchEngine` driven by one background thread for the server's lifetime, so
every client shares continuous batching; a thread-safe submit / stream / cancel API in front of it.

Threads: only the loop thread touches the engine. `submit` validates in the caller's thread (so a bad
request raises there, never reaching the loop) and drops the request into an inbox; the loop takes the
inbox and pending cancellations between steps, runs one step, then hands each request its new tokens
(`RequestHandle.stream()` blocks on a condition, `astream()` is woken once per step per event loop).

The loop survives anything a request does: an exception inside a step fails the requests that were in
that step (logged, `RequestFailed`), and queued requests go on. Memory stays bounded over a long run:
finished results are handed off every step, handles are dropped once finished, step stats are a ring.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import replace

from ..api import Runtime, finish_at_stop_strings
from ..batch_loop import BatchEngine
from ..model_text import Stop
from ..recovery.engine_state import restore_engine_state
from ..recovery.resume import resumed_tokens
from ..recovery.service_journal import ServiceJournal
from ..recovery.snapshot import RequestSnapshot, SnapshotStore
from ..requests import RequestError, checked_request, stop_set, validate_request
from ..stats import RequestResult, StepRecord
from ..text import StopWatch
from .handle import (
    LoadSnapshot,
    QueueFull,
    RequestFailed,
    RequestHandle,
    RequestTimings,
    ServiceClosed,
    collect_wake,
    wake_loops,
)

__all__ = ["EngineService", "LoadSnapshot", "QueueFull", "RequestFailed", "RequestHandle", "RequestTimings",
           "ServiceClosed"]

log = logging.getLogger("dspark.serving")
StepListener = Callable[[StepRecord, LoadSnapshot], None]
FinishListener = Callable[[RequestResult, RequestTimings], None]
TurnListener = Callable[[StepRecord | None, LoadSnapshot, list[RequestHandle], list[RequestHandle]], None]


class EngineService:
    """One decode loop for every client of a Runtime. Close it (or use `with`) to stop the loop; the
    Runtime stays open (its owner closes it)."""

    def __init__(self, runtime: Runtime, *, max_queue: int = 1024, max_new_tokens: int | None = None,
                 engine: BatchEngine | None = None, idle_wait: float = 0.5, store: SnapshotStore | None = None) -> None:
        """`store`: where every request's snapshot goes each step (`dspark.runtime.recovery`); its requests
        from an earlier run are resumed before the loop starts (`self.recovered` says what came back)."""
        self.runtime = runtime
        self.engine = engine or runtime.engine()
        self.journal = ServiceJournal(store) if store is not None else None
        self.max_queue, self.max_new_tokens, self.idle_wait = max_queue, max_new_tokens, idle_wait
        self._lock = threading.Lock()  # inbox, cancels, counters read by other threads
        self._wake = threading.Event()
        self._inbox: deque[RequestHandle] = deque()
        self._cancels: deque[RequestHandle] = deque()
        self._handles: dict[int, RequestHandle] = {}  # engine request id -> handle (loop thread)
        self._resuming: dict[int, RequestSnapshot] = {}  # handle id -> snapshot, for `resume`d handles in the inbox
        self._watches: dict[int, StopWatch] = {}
        self._step_listeners: list[StepListener] = []
        self._finish_listeners: list[FinishListener] = []
        self._turn_listeners: list[TurnListener] = []
        self._moved: list[RequestHandle] = []  # this turn's handles that got tokens / ended (turn listeners only)
        self._ended: list[RequestHandle] = []
        self._listener_errors = 0
        self._ids = itertools.count()
        self._counts = dict.fromkeys(("submitted", "finished", "cancelled", "failed", "steps"), 0)
        self._engine_queued = 0
        self.recovered = self.journal.store.recover() if self.journal is not None else None
        for snapshot in [*self.recovered.finished, *self.recovered.running] if self.recovered is not None else ():
            self._resume(snapshot)
        if self.recovered is not None and (problem := restore_engine_state(self.engine, self.recovered.engine_state)):
            self.recovered.problems.append(problem)
        self._snapshot = self._measure()
        self._stop = threading.Event()
        self._closed_because = "the engine service is closed"
        self._thread = threading.Thread(target=self._run, name="dspark-engine-loop", daemon=True)
        self._thread.start()

    # -- any thread -------------------------------------------------------------------------------
    def submit(self, prompt: str | list[int], *, max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
               stop: Stop = (), key: str | None = None, context: dict | None = None) -> RequestHandle:
        """Validate and queue one request (token ids or text; `stop` token ids and/or strings). Raises
        RequestError / CapacityError for a request the engine cannot serve, QueueFull past the queue limit,
        ServiceClosed after close(). Same seed, same output as `Runtime.generate`."""
        ids, stop_ids, strings = checked_request(self.runtime, prompt, max_new_tokens=max_new_tokens,
                                                 temperature=temperature, seed=seed, stop=stop,
                                                 limit=self.max_new_tokens)
        engine = self.engine
        engine.admission.check_servable(engine.positions_needed(len(ids), max_new_tokens))
        with self._lock:
            if self._stop.is_set():
                raise ServiceClosed(self._closed_because)
            waiting = len(self._inbox) + self._engine_queued
            if waiting >= self.max_queue:
                raise QueueFull(waiting, self.max_queue)
            handle = RequestHandle(self, next(self._ids), ids, max_new_tokens=max_new_tokens,
                                   temperature=float(temperature), seed=seed, stop_ids=stop_ids, stop_strings=strings)
            if self.journal is not None:  # `key`: the front end's id for it (unique); `context`: its fields
                handle.key, handle.context = key or f"req-{uuid.uuid4().hex}", dict(context or {})
            self._inbox.append(handle)
            self._counts["submitted"] += 1
        self._wake.set()
        return handle

    def resume(self, snapshot: RequestSnapshot) -> RequestHandle:
        """Continue another engine's request from its snapshot (same key): its committed tokens are prefilled,
        then it decodes on as it would have there. Thread-safe, checked in the caller's thread like `submit`
        (RequestError / CapacityError, QueueFull, ServiceClosed). The handle's tokens start with the snapshot's.
        With a store, the request is recorded from its snapshot on (the store's `adopted`, when it has one)."""
        spec = snapshot.spec
        if snapshot.finish_reason is not None:
            raise RequestError(f"snapshot of {spec.key}: it had finished ({snapshot.finish_reason})")
        engine, info = self.engine, self.runtime.info
        ids = validate_request(spec.prompt_ids, vocab_size=info.vocab_size, max_positions=info.max_positions,
                               max_new_tokens=spec.max_new_tokens, temperature=spec.temperature)
        stop_set(spec.stop_ids, info.vocab_size)
        tokens = resumed_tokens(snapshot, info.vocab_size, spec.max_new_tokens)
        engine.admission.check_servable(engine.positions_needed(len(ids), spec.max_new_tokens))
        with self._lock:
            if self._stop.is_set():
                raise ServiceClosed(self._closed_because)
            waiting = len(self._inbox) + self._engine_queued
            if waiting >= self.max_queue:
                raise QueueFull(waiting, self.max_queue)
            handle = RequestHandle(self, next(self._ids), ids, max_new_tokens=spec.max_new_tokens,
                                   temperature=float(spec.temperature), seed=spec.seed, stop_ids=list(spec.stop_ids),
                                   stop_strings=tuple(spec.stop_strings))
            handle.key, handle.context, handle._tokens = spec.key, dict(spec.context), tokens
            self._resuming[handle.id] = snapshot
            self._inbox.append(handle)
            self._counts["submitted"] += 1
        self._wake.set()
        return handle

    def room(self, prompt_len: int) -> int:
        """The most new tokens a prompt of this length can ask for (slot length, KV budget, position limit
        and the service's cap); < 1 when the prompt alone is too long."""
        engine, capacity = self.engine, self.engine.admission.capacity
        room = min(capacity.max_seq_len, capacity.max_tokens) - engine.positions_needed(prompt_len, 0)
        room = min(room, self.runtime.info.max_positions - prompt_len)
        return room if self.max_new_tokens is None else min(room, self.max_new_tokens)

    def snapshot(self) -> LoadSnapshot:
        """The engine's load as of the last step (or idle moment); the queue and the counters as of now."""
        with self._lock:
            c = self._counts
            return replace(self._snapshot, queued=len(self._inbox) + self._engine_queued, submitted=c["submitted"],
                           finished=c["finished"], cancelled=c["cancelled"], failed=c["failed"])

    def add_step_listener(self, fn: StepListener) -> None:
        """fn(record, snapshot) on the loop thread after every step; keep it short, it delays the next step."""
        self._step_listeners.append(fn)

    def add_finish_listener(self, fn: FinishListener) -> None:
        """fn(result, timings) on the loop thread when a request ends (finish reason "error" when it failed)."""
        self._finish_listeners.append(fn)

    def add_turn_listener(self, fn: TurnListener) -> None:
        """fn(record or None, snapshot, moved, ended) on the loop thread after every turn of the loop in which a
        step ran or a request got tokens or ended: the handles that got new tokens (`_tokens`) and those that
        ended (`_result`, `_error`), each once. What a relay to another process sends (process_engine.py)."""
        self._turn_listeners.append(fn)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout: float = 10.0) -> None:
        """Stop the loop; requests not finished end with ServiceClosed."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    def __enter__(self) -> EngineService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request_cancel(self, handle: RequestHandle) -> None:
        with self._lock:
            self._cancels.append(handle)
        self._wake.set()

    # -- the loop thread --------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._wake.clear()  # before taking the inbox: a submit after this sets it again
                self._take_inbox()
                record = None
                if not self.engine.idle:
                    record = self._step()
                    self._counts["steps"] += record is not None
                self._deliver()
                self._snapshot = self._measure()
                if record is not None:
                    self._notify(self._step_listeners, record, self._snapshot)
                if self._turn_listeners and (record is not None or self._moved or self._ended):
                    moved, ended, self._moved, self._ended = self._moved, self._ended, [], []
                    self._notify(self._turn_listeners, record, self._snapshot, moved, ended)
                if self.engine.idle and not self._inbox and not self._cancels:
                    self._wake.wait(self.idle_wait)
        except BaseException as exc:  # a bug in the service itself: say so, then fail everyone rather than hang
            log.exception("dspark engine loop stopped")
            with self._lock:  # from now on submit refuses: nobody would take a request from the inbox
                self._closed_because = f"the engine loop stopped ({type(exc).__name__}: {str(exc)[:200]})"
                self._stop.set()
        finally:
            self._fail_all(ServiceClosed(self._closed_because))

    def _resume(self, snapshot: RequestSnapshot) -> None:
        """Before the loop starts: an earlier run's request continues from its snapshot (same key)."""
        spec = snapshot.spec
        handle = RequestHandle(self, next(self._ids), list(spec.prompt_ids), max_new_tokens=spec.max_new_tokens,
                               temperature=spec.temperature, seed=spec.seed, stop_ids=list(spec.stop_ids),
                               stop_strings=tuple(spec.stop_strings))
        handle.key, handle.context, handle._tokens = spec.key, dict(spec.context), list(snapshot.tokens)
        if snapshot.finish_reason is not None:  # kept for a client that reconnects to read its end
            handle._finish(RequestResult(-1, handle.prompt_ids, list(snapshot.tokens), snapshot.acceptance_lengths,
                                         snapshot.proposal_lengths, snapshot.finish_reason), time.monotonic())
            self.journal.ended(handle)
            return
        try:
            handle.engine_id = self.engine.submit(spec.prompt_ids, max_new_tokens=spec.max_new_tokens,
                                                  temperature=spec.temperature, seed=spec.seed,
                                                  stop_token_ids=spec.stop_ids, resume_from=snapshot)
        except Exception as exc:  # a snapshot this engine cannot take (another model, a smaller capacity)
            self.recovered.problems.append(f"request {spec.key} cannot resume here: {exc}")
            self.journal.unresumable(snapshot)
            return
        self._handles[handle.engine_id] = handle
        if handle.stop_strings:
            self._watches[handle.engine_id] = StopWatch(self.runtime.tokenizer, handle.stop_strings)
        self.journal.submitted(handle, snapshot)
        self._counts["submitted"] += 1

    def _take_inbox(self) -> None:
        with self._lock:
            new, self._inbox = self._inbox, deque()
            cancels, self._cancels = self._cancels, deque()
            self._engine_queued += len(new)  # still waiting, now for the engine: keeps the queue limit exact
        now = time.monotonic()
        for handle in new:
            with self._lock:
                snapshot = self._resuming.pop(handle.id, None)
            if handle._cancel_requested:
                self._end(handle, RequestResult(-1, handle.prompt_ids, handle.tokens(), finish_reason="cancelled"), now)
                continue
            try:
                handle.engine_id = self.engine.submit(handle.prompt_ids, max_new_tokens=handle.max_new_tokens,
                                                      temperature=handle.temperature, seed=handle.seed,
                                                      stop_token_ids=handle.stop_ids, resume_from=snapshot)
            except Exception as exc:  # validated in submit() / resume(); only a changed engine rule gets here
                failed = RequestResult(-1, handle.prompt_ids, handle.tokens(), finish_reason="error")
                self._end(handle, failed, now, exc)
                continue
            self._handles[handle.engine_id] = handle
            if handle.stop_strings:
                self._watches[handle.engine_id] = StopWatch(self.runtime.tokenizer, handle.stop_strings)
            if self.journal is not None:
                if snapshot is not None and (adopted := getattr(self.journal.store, "adopted", None)) is not None:
                    adopted(snapshot)  # the store learns the request before its first step record
                self.journal.submitted(handle, snapshot)
        for handle in cancels:
            if handle.engine_id is not None and handle.engine_id in self._handles:
                self.engine.cancel(handle.engine_id)

    def _step(self) -> StepRecord | None:
        before = set(running_ids(self.engine))
        try:
            return self.engine.step()
        except Exception as exc:
            self._fail_step(exc, before)
            return None

    def _fail_step(self, exc: Exception, before: set[int]) -> None:
        """End the requests a failed step involved with RequestFailed; queued ones stay queued. A failure
        inside prefill (some admitted request is in no row) involves only this step's newcomers: the rows
        already running were not touched yet. Any later failure involves every running request. If the
        engine cannot even end them, a fresh engine takes over (everything in flight fails)."""
        error = RequestFailed(f"the decode step failed: {type(exc).__name__}: {str(exc)[:200]}")
        now, engine = time.monotonic(), self.engine
        try:
            active = running_ids(engine)
            lost = [r for r in engine.admission.reserved if r not in set(active)]  # admitted, lost in prefill
            involved = [r for r in active if r not in before] if lost else active
            log.error("engine step failed (%s: %s); ending the %d requests in it", type(exc).__name__, exc,
                      len(involved) + len(lost), exc_info=exc)
            for request_id in involved:
                engine.cancel(request_id)
                self._fail(request_id, engine.take_result(request_id), error, now)
            for request_id in lost:
                engine.admission.release(request_id)
                self._fail(request_id, None, error, now)
        except Exception:
            log.exception("engine state unrecoverable after a failed step; starting a fresh engine")
            for request_id in list(self._handles):
                self._fail(request_id, None, error, now)
            self.engine = self.runtime.engine()

    def _fail(self, request_id: int, result: RequestResult | None, error: BaseException, now: float) -> None:
        handle = self._handles.pop(request_id, None)
        self._watches.pop(request_id, None)
        if handle is not None:
            result = result or RequestResult(request_id, handle.prompt_ids, handle.tokens())
            result.finish_reason = "error"
            if self.journal is not None:
                self.journal.failed(request_id, result)
            self._end(handle, result, now, error)

    def _deliver(self) -> None:
        """Hand finished results off and give every running request its new tokens; wake async readers
        once per event loop."""
        with self._lock:  # before anyone hears of this step: a client answered now must see the queue as it is
            self._engine_queued = len(self.engine.queue)
        done = finish_at_stop_strings(self.engine, self._watches)
        if self.journal is not None:  # before any client hears of this step
            self.journal.stepped(self.engine, done)
        now = time.monotonic()
        woken: dict[asyncio.AbstractEventLoop, list[asyncio.Event]] = {}
        for request_id, tokens in running_tokens(self.engine):
            handle = self._handles.get(request_id)
            if handle is not None and handle._push(tokens, now):
                collect_wake(woken, handle)
                if self._turn_listeners:
                    self._moved.append(handle)
        for request_id, result in done.items():
            handle = self._handles.pop(request_id, None)
            if handle is not None:
                self._end(handle, result, now, woken=woken)
        wake_loops(woken)

    def _end(self, handle: RequestHandle, result: RequestResult, now: float, error: BaseException | None = None,
             woken: dict | None = None) -> None:
        handle._finish(result, now, error)
        if self._turn_listeners:
            self._ended.append(handle)
        if self.journal is not None:
            self.journal.ended(handle)
        with self._lock:
            self._counts["finished"] += 1
            self._counts["cancelled"] += result.finish_reason == "cancelled"
            self._counts["failed"] += error is not None
        if woken is None:
            wake_loops(collect_wake({}, handle))
        else:
            collect_wake(woken, handle)
        self._notify(self._finish_listeners, result, handle.timings)

    def _notify(self, listeners: list, *args: object) -> None:
        for fn in listeners:
            try:
                fn(*args)
            except Exception:
                self._listener_errors += 1
                if self._listener_errors in (1, 10, 100) or self._listener_errors % 1000 == 0:
                    log.exception("serving listener %r raised (%d times so far)", fn, self._listener_errors)

    def _measure(self) -> LoadSnapshot:
        engine, c = self.engine, self._counts
        capacity, rows = engine.admission.capacity, len(engine.active)
        return LoadSnapshot(
            time=time.monotonic(), queued=len(self._inbox) + len(engine.queue), running=rows,
            slots_total=capacity.max_requests, kv_tokens_reserved=sum(engine.admission.reserved.values()),
            kv_tokens_used=int(engine.target_kv.lengths[:rows].sum()), kv_tokens_capacity=capacity.max_tokens,
            steps=c["steps"], submitted=c["submitted"], finished=c["finished"], cancelled=c["cancelled"],
            failed=c["failed"], max_queue=self.max_queue,
        )

    def _fail_all(self, error: BaseException) -> None:
        now = time.monotonic()
        with self._lock:
            pending, self._inbox = list(self._inbox), deque()
        for handle in [*pending, *self._handles.values()]:
            if not handle.done:
                self._end(handle, RequestResult(-1, handle.prompt_ids, handle.tokens(), finish_reason="error"),
                          now, error)
        self._handles.clear()
        self._watches.clear()


# The engine's rows, read in one pass: the only place the service looks inside `BatchEngine.active`.
def running_ids(engine: BatchEngine) -> list[int]:
    """The ids of the requests in the engine's rows (admitted, not yet retired)."""
    return [a.result.request_id for a in engine.active]


def running_tokens(engine: BatchEngine) -> Iterator[tuple[int, list[int]]]:
    """(request id, committed tokens cut at its max_new_tokens) of every row: `engine.tokens_so_far` for all
    running requests in one pass instead of one search per request."""
    for a in engine.active:
        yield a.result.request_id, a.result.tokens[: a.max_new_tokens]
