"""The Python half of the dspark C API (dspark.h): what libdspark calls, with the GIL held.

Every public function returns `(status, value)`: status 0 and the value, or a dspark_status code and a
one-line message; no exception leaves this module (`_api`). Engines and requests are numbers, so a
closed engine or a released request is a status, never a dangling pointer on the C side.

Threads: each engine is a `Runtime` plus an `EngineService`, whose loop thread runs every decode step.
C threads call in through `submit` / `cancel` / `stats` / `release` / .... Every request has a C callback
(libdspark's mailbox for it, which calls the user's callback if there is one): after each step the loop
thread hands every request's new tokens to C in one call, `_invoke` (a C function libdspark hands in with
`set_invoker`), and once more when a request ends. `_lock` guards an engine's tables and is held across
`EngineService.submit`, so a finish can never slip past a request not yet registered; `_deliver` is held
while callbacks run, so `release` returns only once no callback of that request can follow.
"""

from __future__ import annotations

import functools
import itertools
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from dspark.export.artifacts import ArtifactError

from ..api import Runtime, RuntimeOptions
from ..capacity import CapacityError
from ..prefix_scheduler import SchedulerConfig, SchedulerConfigError
from ..requests import RequestError
from ..serving.service import EngineService, QueueFull, RequestFailed, ServiceClosed
from ..stats import RequestResult

# dspark_status and dspark_finish_reason of dspark.h (tests/test_capi.py checks the two agree).
STATUS = {"OK": 0, "INVALID_ARGUMENT": 1, "REQUEST": 2, "CAPACITY": 3, "ARTIFACT": 4, "QUEUE_FULL": 5,
          "CLOSED": 6, "UNKNOWN_HANDLE": 7, "REQUEST_FAILED": 8, "BUFFER_TOO_SMALL": 9, "PYTHON": 10,
          "INTERNAL": 11}
FINISH = {"": 0, "length": 1, "stop": 2, "cancelled": 3, "error": 4}


class CapiError(Exception):
    """An error the C API names by its own status (closed engine, unknown handle, bad argument)."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(message)
        self.status = STATUS[status]


# Most specific first: NoTokenizerError is both a RequestError and an ArtifactError (a request problem here).
_STATUS_OF: tuple[tuple[type[BaseException], int], ...] = (
    (ServiceClosed, STATUS["CLOSED"]), (QueueFull, STATUS["QUEUE_FULL"]), (RequestFailed, STATUS["REQUEST_FAILED"]),
    (CapacityError, STATUS["CAPACITY"]), (RequestError, STATUS["REQUEST"]), (ArtifactError, STATUS["ARTIFACT"]),
    (SchedulerConfigError, STATUS["INVALID_ARGUMENT"]),
)


def status_of(exc: BaseException) -> tuple[int, str]:
    """(dspark_status, one-line message) for an exception."""
    if isinstance(exc, CapiError):
        return exc.status, str(exc)
    for kind, status in _STATUS_OF:
        if isinstance(exc, kind):
            return status, " ".join(str(exc).split()) or type(exc).__name__
    return STATUS["INTERNAL"], " ".join(f"{type(exc).__name__}: {exc}".split())


def _api(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def guarded(*args: object) -> tuple[int, object]:
        try:
            return 0, fn(*args)
        except Exception as exc:
            return status_of(exc)
    return guarded


_invoke: Callable | None = None  # invoke([(fn, user_data, request, tokens, finished, reason), ...]), from libdspark
_delivering = threading.local()  # .engine: the engine whose callback this thread is running


def set_invoker(fn: Callable) -> None:
    global _invoke
    _invoke = fn


@dataclass(eq=False)
class _Request:
    id: int
    handle: object  # serving.RequestHandle
    callback: tuple[int, int] | None  # (C function pointer, user_data) or None
    polled: int = 0  # tokens handed out by poll/wait
    pushed: int = 0  # tokens handed out by the callback
    result: RequestResult | None = None  # once finished


class _Engine:
    def __init__(self, engine_id: int, runtime: Runtime, service: EngineService) -> None:
        self.id, self.runtime, self.service = engine_id, runtime, service
        self.closed = False
        self._ids = itertools.count(1)
        self._requests: dict[int, _Request] = {}
        self._running: dict[int, _Request] = {}  # id(handle.timings) -> request, until its finish listener ran
        self._lock = threading.Lock()
        self._deliver = threading.RLock()
        service.add_step_listener(self._on_step)
        service.add_finish_listener(self._on_finish)

    def request(self, request_id: int) -> _Request:
        if self.closed:
            raise CapiError("CLOSED", f"engine {self.id} is closed")
        req = self._requests.get(request_id)
        if req is None:
            raise CapiError("UNKNOWN_HANDLE", f"engine {self.id} has no request {request_id} (never submitted, "
                                              "or released)")
        return req

    def submit(self, prompt: list[int] | str, callback: tuple[int, int] | None, **kwargs: object) -> int:
        if isinstance(prompt, str):
            prompt = self.runtime.encode(prompt)  # outside the lock: tokenizing may take a while
        with self._lock:
            if self.closed:
                raise CapiError("CLOSED", f"engine {self.id} is closed")
            handle = self.service.submit(prompt, **kwargs)
            request_id = next(self._ids)
            self._requests[request_id] = self._running[id(handle.timings)] = _Request(request_id, handle, callback)
        return request_id

    def poll(self, req: _Request, cap: int) -> tuple[list[int], bool, str | None]:
        """Tokens not polled yet (at most cap), without waiting. libdspark polls its own copy (mailbox.c) and
        comes here only for a request it has none of, which is mostly one that does not exist (any more)."""
        handle = req.handle
        with self._lock:
            done = handle.done  # first: once done, tokens() is final
            tokens = handle.tokens()
            chunk = tokens[req.polled: req.polled + cap]
            req.polled += len(chunk)
        finished = done and req.polled >= len(tokens)
        failed = finished and req.result is not None and req.result.finish_reason == "error"
        return chunk, finished, f"request {req.id} failed: {_error_text(handle)}" if failed else None

    def release(self, request_id: int) -> None:
        with self._deliver, self._lock:
            req = self.request(request_id)
            del self._requests[request_id]
            self._running.pop(id(req.handle.timings), None)
        req.handle.cancel()  # a no-op once finished

    def close(self) -> None:
        if getattr(_delivering, "engine", None) == self.id:
            raise CapiError("INVALID_ARGUMENT", "dspark_close cannot be called from a callback of the same engine "
                                                "(it runs on the engine's loop thread)")
        with self._lock:
            if self.closed:
                raise CapiError("CLOSED", f"engine {self.id} is already closed")
            self.closed = True
        self.service.close(timeout=None)  # unfinished requests end; their callbacks run before this returns
        self.runtime.close()
        with self._deliver, self._lock:
            self._requests.clear()
            self._running.clear()

    # -- the loop thread ----------------------------------------------------------------------------
    def _on_step(self, record: object, snapshot: object) -> None:
        with self._deliver:
            with self._lock:
                pushes = [(req, self._take_pushed(req)) for req in self._running.values() if req.callback]
            self._call([(req, tokens, False, "") for req, tokens in pushes if tokens])

    def _on_finish(self, result: RequestResult, timings: object) -> None:
        with self._deliver:
            with self._lock:
                req = self._running.pop(id(timings), None)
                if req is not None:
                    req.result = result
                    tokens = self._take_pushed(req) if req.callback else []
            if req is not None and req.callback:
                self._call([(req, tokens, True, result.finish_reason)])

    @staticmethod
    def _take_pushed(req: _Request) -> list[int]:
        tokens = req.handle.tokens()[req.pushed:]
        req.pushed += len(tokens)
        return tokens

    def _call(self, events: list[tuple[_Request, list[int], bool, str]]) -> None:
        """Run callbacks (one C call, one GIL release for all of them)."""
        if not events:
            return
        batch = [(*req.callback, req.id, tokens, int(finished), FINISH.get(reason, FINISH["error"]))
                 for req, tokens, finished, reason in events]
        _delivering.engine = self.id
        try:
            _invoke(batch)
        finally:
            _delivering.engine = None


def _error_text(handle: object) -> str:
    try:
        handle.result(0)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "unknown error"


_engines: dict[int, _Engine] = {}
_engine_ids = itertools.count(1)
_engines_lock = threading.Lock()


def _engine(engine_id: int) -> _Engine:
    engine = _engines.get(engine_id)
    if engine is None:
        raise CapiError("UNKNOWN_HANDLE", f"no engine {engine_id} (never opened)")
    if engine.closed:
        raise CapiError("CLOSED", f"engine {engine_id} is closed")
    return engine


def _text(data: bytes, what: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestError(f"{what} is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None


def _count(name: str, value: int) -> int | None:
    if value < 0:
        raise CapiError("INVALID_ARGUMENT", f"options.{name} must be >= 0 (0: the default), got {value}")
    return value or None


@_api
def open_engine(path: bytes, max_requests: int, max_seq_len: int, max_tokens: int, max_queue: int,
                scheduler: bytes | None) -> int:
    counts = {name: _count(name, value) for name, value in (("max_requests", max_requests), ("max_seq_len",
              max_seq_len), ("max_tokens", max_tokens), ("max_queue", max_queue))}
    mode = _text(scheduler, "options.scheduler") if scheduler else "dspark"
    options = RuntimeOptions(scheduler=SchedulerConfig(mode=mode), max_requests=counts["max_requests"] or 64,
                             max_seq_len=counts["max_seq_len"] or 1024, max_tokens=counts["max_tokens"])
    runtime = Runtime.load(os.fsdecode(path), options)
    try:
        service = EngineService(runtime, max_queue=counts["max_queue"] or 1024)
    except BaseException:
        runtime.close()
        raise
    with _engines_lock:
        engine_id = next(_engine_ids)
        _engines[engine_id] = _Engine(engine_id, runtime, service)
    return engine_id


@_api
def close(engine_id: int) -> None:
    _engine(engine_id).close()


@_api
def info(engine_id: int) -> tuple[int, ...]:
    engine = _engine(engine_id)
    i, o = engine.runtime.info, engine.runtime.options
    eos = tuple(i.eos_token_ids)[:8]
    return (i.vocab_size, i.max_positions, i.block_size, o.max_requests, o.max_seq_len, len(eos), *eos)


@_api
def submit(engine_id: int, prompt_ids: list[int] | None, prompt_text: bytes | None, max_new_tokens: int,
           temperature: float, seed: int, stop_ids: list[int], stop_strings: list[bytes], fn: int,
           user_data: int) -> int:
    engine = _engine(engine_id)
    prompt = prompt_ids if prompt_ids is not None else _text(prompt_text, "prompt_text")
    stop = [*stop_ids, *(_text(s, "a stop string") for s in stop_strings)]
    return engine.submit(prompt, (fn, user_data) if fn else None, max_new_tokens=max_new_tokens,
                         temperature=temperature, seed=seed, stop=stop)


@_api
def poll(engine_id: int, request_id: int, cap: int) -> tuple[list[int], bool, str | None]:
    engine = _engine(engine_id)
    return engine.poll(engine.request(request_id), cap)


@_api
def error(engine_id: int, request_id: int) -> str | None:
    """Why a finished request failed (None if it did not)."""
    engine = _engine(engine_id)
    req = engine.request(request_id)
    if req.result is None or req.result.finish_reason != "error":
        return None
    return f"request {req.id} failed: {_error_text(req.handle)}"


@_api
def cancel(engine_id: int, request_id: int) -> None:
    engine = _engine(engine_id)
    engine.request(request_id).handle.cancel()


@_api
def stats(engine_id: int, request_id: int) -> tuple:
    req = _engine(engine_id).request(request_id)
    handle, result = req.handle, req.result
    t = handle.timings
    done = result is not None
    end = t.finished if done and t.finished is not None else time.monotonic()
    ttft = -1.0 if t.first_token is None else t.first_token - t.submitted
    generated = len(result.tokens) if done else len(handle.tokens())
    rounds = result.rounds if done else 0
    accepted = result.mean_acceptance_length if done and rounds else 0.0
    verified = result.verified_tokens if done else 0
    reason = FINISH.get(result.finish_reason, FINISH["error"]) if done else 0
    return (int(done), reason, len(handle.prompt_ids), generated, rounds, verified, accepted, ttft, end - t.submitted)


@_api
def release(engine_id: int, request_id: int) -> None:
    _engine(engine_id).release(request_id)


@_api
def tokenize(engine_id: int, text: bytes) -> list[int]:
    return _engine(engine_id).runtime.encode(_text(text, "text"))


@_api
def detokenize(engine_id: int, ids: list[int]) -> bytes:
    engine = _engine(engine_id)
    vocab = engine.runtime.info.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise RequestError(f"token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
    return engine.runtime.decode(ids).encode("utf-8")
