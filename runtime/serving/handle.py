"""What the engine service hands its callers: a request's handle (tokens as they are committed, blocking or
asyncio; its result, its timings, `cancel()`), the load snapshot, and the service's errors. The loop thread
writes a handle (`_push`, `_finish`); any thread reads it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..stats import RequestResult

if TYPE_CHECKING:
    from .service import EngineService


class QueueFull(Exception):
    """More requests are waiting than the service's queue limit; retry after `retry_after` seconds."""

    def __init__(self, waiting: int, limit: int, retry_after: int = 1) -> None:
        super().__init__(f"{waiting} requests are already waiting (limit {limit}); retry in {retry_after} s")
        self.retry_after = retry_after


class ServiceClosed(RuntimeError):
    """The service was closed before this request finished."""


class RequestFailed(RuntimeError):
    """The engine step that held this request raised; the request ended there (others went on)."""


@dataclass(frozen=True)
class LoadSnapshot:
    """The service's load after a step (or while idle)."""

    time: float  # time.monotonic()
    queued: int  # submitted, not yet admitted (inbox + engine queue)
    running: int  # admitted requests (each holds a KV slot)
    slots_total: int
    kv_tokens_reserved: int  # positions reserved by admission control (worst case per request)
    kv_tokens_used: int  # target KV positions committed now
    kv_tokens_capacity: int
    steps: int  # decode steps run
    submitted: int
    finished: int  # all ends, cancelled and failed included
    cancelled: int
    failed: int
    max_queue: int


@dataclass
class RequestTimings:
    """When a request moved, on time.monotonic(): for time to first token and inter-token latency.
    Tokens arrive in deliveries (one per step that committed any); `gaps[i]` is the time between
    delivery i and i+1, and `delivered[i]` how many tokens delivery i brought."""

    submitted: float
    first_token: float | None = None
    finished: float | None = None
    gaps: list[float] = field(default_factory=list)
    delivered: list[int] = field(default_factory=list)
    _last: float | None = field(default=None, repr=False, compare=False)

    def record(self, now: float, tokens: int) -> None:
        if self.first_token is None:
            self.first_token = now
        else:
            self.gaps.append(now - self._last)
        self._last = now
        self.delivered.append(tokens)


class RequestHandle:
    """One request in the service: its tokens as they are committed, its result, and `cancel()`.
    Every method is safe from any thread; `astream` from any event loop."""

    def __init__(self, service: EngineService, handle_id: int, prompt_ids: list[int], *, max_new_tokens: int,
                 temperature: float, seed: int, stop_ids: list[int], stop_strings: tuple[str, ...]) -> None:
        self.service, self.id, self.prompt_ids = service, handle_id, prompt_ids
        self.max_new_tokens, self.temperature, self.seed = max_new_tokens, temperature, seed
        self.stop_ids, self.stop_strings = stop_ids, stop_strings
        self.timings = RequestTimings(time.monotonic())
        self.engine_id: int | None = None
        self.key: str | None = None  # its stable id in a journaled service (the HTTP response id)
        self.context: dict = {}  # the front end's fields, journaled with the request
        self._cond = threading.Condition()
        self._tokens: list[int] = []
        self._result: RequestResult | None = None
        self._error: BaseException | None = None
        self._done = self._cancel_requested = False
        self._event: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def done(self) -> bool:
        return self._done

    def tokens(self) -> list[int]:
        """The tokens committed so far (a copy)."""
        with self._cond:
            return list(self._tokens)

    def cancel(self) -> None:
        """End the request at the next step boundary (finish reason "cancelled"); its slot is freed."""
        with self._cond:
            if self._done or self._cancel_requested:
                return
            self._cancel_requested = True
        self.service._request_cancel(self)

    def stream(self, timeout: float | None = None) -> Iterator[list[int]]:
        """New tokens after every step until the request ends; raises RequestFailed / ServiceClosed when it
        failed. Leaving the loop early cancels the request."""
        sent = 0
        try:
            while True:
                with self._cond:
                    if not self._cond.wait_for(lambda n=sent: len(self._tokens) > n or self._done, timeout):
                        raise TimeoutError(f"no tokens within {timeout} s")
                    tokens, done = self._tokens[sent:], self._done
                if tokens:
                    sent += len(tokens)
                    yield tokens
                elif done:
                    break
            if self._error is not None:
                raise self._error
        finally:
            if not self._done:
                self.cancel()

    async def astream(self, start: int = 0) -> AsyncIterator[list[int]]:
        """`stream()` for an asyncio caller (an ASGI app): never blocks the event loop. Cancelling the
        task that iterates (a client that went away) cancels the request. `start`: tokens the caller
        already has (a reconnecting client); the stream begins after them."""
        event = asyncio.Event()
        with self._cond:
            self._loop, self._event = asyncio.get_running_loop(), event
        sent = start
        try:
            while True:
                with self._cond:
                    tokens, done = self._tokens[sent:], self._done
                    if not tokens and not done:
                        event.clear()  # a push after this point schedules event.set() after it
                if tokens:
                    sent += len(tokens)
                    yield tokens
                elif done:
                    break
                else:
                    await event.wait()
            if self._error is not None:
                raise self._error
        finally:
            if not self._done:
                self.cancel()

    def result(self, timeout: float | None = None) -> RequestResult:
        """Wait for the end; the result (tokens cut at max_new_tokens / stop), or RequestFailed / ServiceClosed."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._done, timeout):
                raise TimeoutError(f"request {self.id} did not finish within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._result

    async def aresult(self) -> RequestResult:
        async for _ in self.astream():
            pass
        return self.result(0)

    # -- loop thread only -----------------------------------------------------------------------
    def _push(self, tokens: list[int], now: float) -> bool:
        """Tokens committed so far; True when some are new."""
        with self._cond:
            if len(tokens) <= len(self._tokens):
                return False
            self.timings.record(now, len(tokens) - len(self._tokens))
            self._tokens = tokens
            self._cond.notify_all()
        return True

    def _finish(self, result: RequestResult, now: float, error: BaseException | None = None) -> None:
        if len(result.tokens) > len(self._tokens):
            self.timings.record(now, len(result.tokens) - len(self._tokens))
        self.timings.finished = now
        with self._cond:
            self._tokens, self._result, self._error, self._done = list(result.tokens), result, error, True
            self._cond.notify_all()


def collect_wake(woken: dict, handle: RequestHandle) -> dict:
    if handle._loop is not None and handle._event is not None:
        woken.setdefault(handle._loop, []).append(handle._event)
    return woken


def wake_loops(woken: dict[asyncio.AbstractEventLoop, list[asyncio.Event]]) -> None:
    """One call_soon_threadsafe per event loop per step, however many of its requests moved."""
    for loop, events in woken.items():
        with contextlib.suppress(RuntimeError):  # that event loop has closed: nobody is waiting there
            loop.call_soon_threadsafe(_set_all, events)


def _set_all(events: list[asyncio.Event]) -> None:
    for event in events:
        event.set()
