"""`ProcessService`: the engine service with its decode loop in a process of its own (process_engine.py),
shaped like `EngineService` for the OpenAI app and for Python callers: `submit` (checked here, so a bad
request raises in the caller's thread), the handles' `stream` / `astream` / `result` / `cancel`, `room`,
`snapshot`, the step and finish listeners (run here, on the thread that reads the engine's messages), `alive`,
`close`. Same seed, same tokens as `Runtime.generate`.

The front end holds no sessions: the model info and the tokenizer (`ModelText`) and its own ledger of the
requests in flight. If the engine process dies (a crash, the OOM killer), the requests that had tokens fail with
RequestFailed naming its exit code, and a fresh engine process (up to `max_restarts` times) takes the ones that
had none, so their clients see nothing; meanwhile `alive` is False (the server's /health answers 503, new
requests get ServiceClosed). Out of restarts, everything in flight fails and the service stays down.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import multiprocessing
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ..capacity import Admission, Capacity
from ..model_text import ModelText, Stop
from ..requests import checked_request
from ..stats import RequestResult, StepRecord
from .handle import LoadSnapshot, QueueFull, RequestFailed, RequestHandle, ServiceClosed, collect_wake, wake_loops
from .process_engine import EngineLimits, run_engine_process

if TYPE_CHECKING:  # no torch in the front end: the engine process has it
    from ..api import Runtime
    from .service import FinishListener, StepListener

log = logging.getLogger("dspark.serving")


class EngineProcessFailed(RuntimeError):
    """The engine process could not open its runtime (the message is its error), or it did not come up."""


@dataclass(frozen=True)
class _Scheduler:
    confidence_temperatures: tuple[float, ...] | None


class _Options:
    """What the app and the metrics read of `runtime.options`: the scheduler's STS temperatures."""

    def __init__(self, limits: EngineLimits) -> None:
        self.scheduler, self.max_requests = _Scheduler(limits.confidence_temperatures), limits.max_requests


class ProcessService:
    """An engine service whose loop runs in a spawned process. `open_runtime` is called there (picklable:
    e.g. `functools.partial(Runtime.load, engine_dir, options, threads=1)`). Close it (or use `with`)."""

    def __init__(self, open_runtime: Callable[[], Runtime], *, max_queue: int = 1024,
                 max_new_tokens: int | None = None, start_timeout: float = 600.0, max_restarts: int = 3) -> None:
        """`max_restarts`: how many times an engine process that died is replaced by a fresh one (the requests
        that had no token yet go to it; those that had fail). 0: the service ends with its first engine."""
        self.max_queue, self.max_new_tokens, self.max_restarts = max_queue, max_new_tokens, max_restarts
        self.journal = self.recovered = None  # the request journal runs with the in-process EngineService only
        self._open_runtime, self._start_timeout = open_runtime, start_timeout
        self.restarts = 0
        self.limits = self._spawn()
        limits = self.limits
        self.runtime = ModelText(limits.info, limits.text_dirs, _Options(limits))
        self._admission = Admission(Capacity(limits.max_requests, limits.max_tokens, limits.max_seq_len))
        self._lock = threading.Lock()  # the ledger, the counters, the commands pipe
        self._handles: dict[int, RequestHandle] = {}  # front id -> handle, until its end arrives
        self._fields: dict[int, dict] = {}  # front id -> what was sent (sent again to a restarted engine)
        self._ids = itertools.count()
        self._closed = self._restarting = False
        self._accepted = 0  # requests taken by submit, over every engine process
        # counters of engine processes that died, and ends made here: the snapshot's totals go on over restarts
        self._carried = dict(steps=0, finished=0, cancelled=0, failed=0)
        self._fresh_snapshot()
        self._step_listeners: list[StepListener] = []
        self._finish_listeners: list[FinishListener] = []
        self._reader = threading.Thread(target=self._read, name="dspark-engine-reader", daemon=True)
        self._reader.start()

    @property
    def engine_pid(self) -> int | None:
        """The engine process's pid (the metrics count its CPU and memory with the front end's)."""
        return self._process.pid

    # -- any thread -------------------------------------------------------------------------------
    def submit(self, prompt: str | list[int], *, max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
               stop: Stop = ()) -> RequestHandle:
        """As `EngineService.submit`: RequestError / CapacityError, QueueFull, ServiceClosed in this thread."""
        ids, stop_ids, strings = checked_request(self.runtime, prompt, max_new_tokens=max_new_tokens,
                                                 temperature=temperature, seed=seed, stop=stop,
                                                 limit=self.max_new_tokens)
        self._admission.check_servable(len(ids) + max_new_tokens + self.limits.reserve_extra)
        with self._lock:
            if self._closed or not self.alive:
                raise ServiceClosed("the engine service is closed" if self._closed else
                                    "the engine process is restarting; retry shortly" if self._restarting else
                                    f"the engine process exited (code {self._process.exitcode})")
            waiting = self._waiting()
            if waiting >= self.max_queue:
                raise QueueFull(waiting, self.max_queue)
            front_id = next(self._ids)
            handle = RequestHandle(self, front_id, ids, max_new_tokens=max_new_tokens, temperature=float(temperature),
                                   seed=seed, stop_ids=stop_ids, stop_strings=strings)
            fields = dict(prompt=ids, max_new_tokens=max_new_tokens, temperature=float(temperature), seed=seed,
                          stop=[*stop_ids, *strings])
            try:
                self._commands.send(("submit", front_id, fields))
            except OSError:  # the engine process is gone (the reader is about to say so)
                raise ServiceClosed(f"the engine process exited (code {self._process.exitcode})") from None
            self._handles[front_id], self._fields[front_id] = handle, fields
            self._submitted += 1
            self._accepted += 1
        return handle

    def room(self, prompt_len: int) -> int:
        """As `EngineService.room`, from the engine's limits."""
        limits = self.limits
        room = min(limits.max_seq_len, limits.max_tokens) - (prompt_len + limits.reserve_extra)
        room = min(room, limits.info.max_positions - prompt_len)
        return room if self.max_new_tokens is None else min(room, self.max_new_tokens)

    def snapshot(self) -> LoadSnapshot:
        """The engine's load as of its last turn; the queue counts what is in the pipe too, and the totals
        (steps, submitted, ends) count every engine process this service ran."""
        with self._lock:
            return self._totals(self._snapshot)

    def add_step_listener(self, fn: StepListener) -> None:
        """fn(record, snapshot) after every engine step, on this side's reader thread."""
        self._step_listeners.append(fn)

    def add_finish_listener(self, fn: FinishListener) -> None:
        """fn(result, timings) when a request ends (timings as seen here), on the reader thread."""
        self._finish_listeners.append(fn)

    @property
    def alive(self) -> bool:
        return not self._restarting and self._reader.is_alive() and self._process.is_alive()

    def close(self, timeout: float = 10.0) -> None:
        """Stop the engine process; requests not finished end with ServiceClosed."""
        with self._lock:
            self._closed = True
            with contextlib.suppress(OSError):  # already gone
                self._commands.send(("close",))
        self._process.join(timeout)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(timeout)
        self._reader.join(timeout)

    def __enter__(self) -> ProcessService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request_cancel(self, handle: RequestHandle) -> None:
        with self._lock:
            if handle.id not in self._handles or self._closed:
                return
            if not self._restarting:
                with contextlib.suppress(OSError):  # the engine is gone; the reader fails or resends the request
                    self._commands.send(("cancel", handle.id))
                return
        self._fail([handle.id], None, "cancelled")  # not sent again to the fresh engine

    def _totals(self, snapshot: LoadSnapshot) -> LoadSnapshot:
        carried = self._carried
        return replace(snapshot, queued=self._waiting(), submitted=self._accepted,
                       steps=snapshot.steps + carried["steps"], finished=snapshot.finished + carried["finished"],
                       cancelled=snapshot.cancelled + carried["cancelled"], failed=snapshot.failed + carried["failed"])

    def _waiting(self) -> int:
        """Queued in the engine at its last turn, plus submitted since (still in the pipe or its inbox)."""
        return self._snapshot.queued + self._submitted - self._snapshot.submitted

    # -- start-up, the reader thread, restarts -------------------------------------------------------
    def _spawn(self) -> EngineLimits:
        """Start an engine process and wait until it is ready; its pipes become ours."""
        context = multiprocessing.get_context("spawn")  # forking a process with ORT / torch threads is unsafe
        commands_in, commands = context.Pipe(duplex=False)
        messages, messages_out = context.Pipe(duplex=False)
        # The engine's queue limit is ours: our count (its last queue + what we sent since) is never below its own.
        self._process = context.Process(target=run_engine_process, name="dspark-engine", daemon=True,
                                        args=(self._open_runtime, commands_in, messages_out, self.max_queue,
                                              self.max_new_tokens))
        self._process.start()
        commands_in.close()
        messages_out.close()
        self._commands, self._messages = commands, messages
        return self._await_ready(self._start_timeout)

    def _fresh_snapshot(self) -> None:
        """The load before an engine's first turn (a new engine counts from 0)."""
        limits = self.limits
        self._submitted = 0
        self._snapshot = LoadSnapshot(time=time.monotonic(), queued=0, running=0, slots_total=limits.max_requests,
                                      kv_tokens_reserved=0, kv_tokens_used=0, kv_tokens_capacity=limits.max_tokens,
                                      steps=0, submitted=0, finished=0, cancelled=0, failed=0,
                                      max_queue=self.max_queue)

    def _await_ready(self, timeout: float) -> EngineLimits:
        deadline = time.monotonic() + timeout
        while not self._messages.poll(0.1):
            if not self._process.is_alive():
                raise EngineProcessFailed(f"the engine process exited (code {self._process.exitcode}) before it "
                                          "was ready")
            if time.monotonic() > deadline:
                self._process.terminate()
                raise EngineProcessFailed(f"the engine process was not ready within {timeout:.0f} s")
        try:
            message = self._messages.recv()
        except EOFError:
            self._process.join(10)
            raise EngineProcessFailed(f"the engine process exited (code {self._process.exitcode}) before it was "
                                      "ready (a script that starts one needs `if __name__ == '__main__':`)") from None
        if message[0] != "ready":
            self._process.join(10)
            raise EngineProcessFailed(message[1])
        return message[1]

    def _read(self) -> None:
        while True:
            self._pump()
            try:
                if not self._recover():
                    return
            finally:
                self._restarting = False

    def _pump(self) -> None:
        """Hand the engine's messages on until its pipe closes (it exited, or was closed)."""
        try:
            while True:
                message = self._messages.recv()
                if message[0] == "turn":
                    self._turn(*message[1:])
                elif message[0] == "refused":
                    self._refused(message[1], message[2])
        except (EOFError, OSError):
            pass
        except Exception:  # a bug here: stop that engine rather than leave its requests hanging
            log.exception("reading the engine process's messages failed")
            self._process.terminate()

    def _recover(self) -> bool:
        """After the engine's pipe closed: False when the service is over (closed, or out of restarts; every
        request in flight ends), True once a fresh engine runs the requests that had no token yet."""
        with self._lock:
            self._restarting = True
            closed = self._closed
        self._process.join(5)  # the pipe closes a moment before the exit code is there
        code = self._process.exitcode
        if closed:
            self._fail(list(self._handles), ServiceClosed("the engine service is closed"))
            return False
        if self.restarts >= self.max_restarts:
            log.error("the dspark engine process exited (code %s); %d requests in flight failed", code,
                      len(self._handles))
            self._fail(list(self._handles), RequestFailed(f"the engine process exited (code {code})"))
            return False
        with self._lock:
            started = [front_id for front_id, handle in self._handles.items() if handle._tokens]
        self._fail(started, RequestFailed(f"the engine process exited (code {code}) while generating this "
                                          "request"))
        self.restarts += 1
        log.error("the dspark engine process exited (code %s): %d requests that had tokens failed; starting a "
                  "fresh one (restart %d of %d) for the %d that had none", code, len(started), self.restarts,
                  self.max_restarts, len(self._handles))
        try:
            self._spawn()
        except EngineProcessFailed as exc:
            log.error("the fresh engine process failed: %s", exc)
            self._fail(list(self._handles), RequestFailed(f"the engine process exited (code {code}) and could "
                                                          f"not be restarted: {exc}"))
            return False
        with self._lock:
            for name in ("steps", "finished", "cancelled", "failed"):  # the dead engine's totals go on
                self._carried[name] += getattr(self._snapshot, name)
            self._fresh_snapshot()
            for front_id, fields in self._fields.items():
                self._commands.send(("submit", front_id, fields))
                self._submitted += 1
        return True

    def _turn(self, record: StepRecord | None, snapshot: LoadSnapshot, tokens: list, ends: list) -> None:
        now, woken = time.monotonic(), {}
        with self._lock:
            self._snapshot = snapshot
            totals = self._totals(snapshot)
            moved = [(self._handles.get(front_id), new) for front_id, new in tokens]
            done = [(self._handles.pop(front_id, None), result, error) for front_id, result, error in ends]
            for front_id, _, _ in ends:
                self._fields.pop(front_id, None)
        for handle, result, error in done:  # ends woken first: a closed-loop client's next request comes sooner
            if handle is not None:
                handle._finish(result, now, error)
                collect_wake(woken, handle)
        for handle, new in moved:
            if handle is not None and handle._push(handle._tokens + new, now):
                collect_wake(woken, handle)
        wake_loops(woken)  # before the listeners: the metrics can wait, the clients should not
        for handle, result, _ in done:
            if handle is not None:
                self._notify(self._finish_listeners, result, handle.timings)
        if record is not None:  # its confidence logits are numpy here (process_engine._wire)
            self._notify(self._step_listeners, record, totals)

    def _refused(self, front_id: int, error: BaseException) -> None:
        with self._lock:
            handle = self._handles.pop(front_id, None)
            self._fields.pop(front_id, None)
        if handle is not None:  # our queue count let it through, the engine's did not: a race at the limit
            self._end(handle, RequestFailed(f"the engine refused the request: {error}"))

    def _fail(self, front_ids: list[int], error: BaseException | None, reason: str = "error") -> None:
        """End these requests here (error None: a plain end with `reason`)."""
        with self._lock:
            handles = [self._handles.pop(i) for i in front_ids if i in self._handles]
            for i in front_ids:
                self._fields.pop(i, None)
        for handle in handles:
            self._end(handle, error, reason)

    def _end(self, handle: RequestHandle, error: BaseException | None, reason: str = "error") -> None:
        with self._lock:  # an end no engine counted
            self._carried["finished"] += 1
            self._carried["failed" if error is not None else "cancelled"] += 1  # error None: a cancel here
        result = RequestResult(-1, handle.prompt_ids, handle.tokens(), finish_reason=reason)
        handle._finish(result, time.monotonic(), error)
        wake_loops(collect_wake({}, handle))
        self._notify(self._finish_listeners, result, handle.timings)

    def _notify(self, listeners: list, *args: object) -> None:
        for fn in listeners:
            try:
                fn(*args)
            except Exception:
                log.exception("serving listener %r raised", fn)
