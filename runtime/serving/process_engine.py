"""The engine's side of `ProcessService` (process_service.py): a spawned process that opens the Runtime, runs
one `EngineService` (its decode loop thread) and talks to the front end over two pipes.

Why a process: in one interpreter the server's event loop (HTTP parsing, SSE writes, metrics) and the engine
loop's Python between graph calls take turns on one lock; in their own processes they run on two cores.

Commands (front -> engine), one pickled tuple each: ("submit", id, fields), ("cancel", id), ("close",).
Messages (engine -> front):
  ("ready", EngineLimits)                     once the engine is loaded (or ("failed", "Type: message"))
  ("turn", record, snapshot, tokens, ends)     after every turn of the loop that moved anything: the step's
                                               StepRecord (None without a step; its confidences are numpy),
                                               the LoadSnapshot, [(id, new tokens)], [(id, RequestResult, error)]
  ("refused", id, error)                       a submit the engine did not take (QueueFull, RequestError, ...)
A service loop that stops on an error (a bug outside any step: logged) takes the process with it, exit code
`LOOP_DIED`, so the front end restarts it as it does any dead engine; left running, the process would take
requests that nobody steps.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..model_info import ModelInfo
from ..stats import StepRecord
from .handle import LoadSnapshot, RequestHandle

if TYPE_CHECKING:  # the front end imports this module for EngineLimits and must not import torch
    from ..api import Runtime
    from .service import EngineService


LOOP_DIED = 70  # the engine process's exit code when its service loop stopped on an error
LOOP_CHECK_SECONDS = 0.5  # how often the command loop looks whether the service loop still runs


@dataclass(frozen=True)
class EngineLimits:
    """What the front end needs once: the model, the engine's limits, where its text lives."""

    info: ModelInfo
    max_requests: int
    max_tokens: int  # KV positions in all
    max_seq_len: int
    reserve_extra: int  # positions the engine reserves beyond prompt + new tokens (`positions_needed(0, 0)`)
    text_dirs: tuple[str, ...]
    confidence_temperatures: tuple[float, ...] | None  # the scheduler's STS temperatures (the metrics' ECE)
    pid: int


class TurnRelay:
    """The engine service's turns as messages to the front end; the front end's request ids by handle."""

    def __init__(self, service: EngineService, out: Connection) -> None:
        self.service, self.out = service, out
        self._lock = threading.Lock()  # ids and sent counts (main thread adds, loop thread reads); the pipe
        self._ids: dict[int, int] = {}  # service handle id -> front id
        self._sent: dict[int, int] = {}  # front id -> tokens sent
        self._handles: dict[int, RequestHandle] = {}  # front id -> handle
        service.add_turn_listener(self.on_turn)

    def submit(self, front_id: int, fields: dict) -> None:
        """Submit under the lock, so the loop's first turn with this request finds its front id."""
        with self._lock:
            try:
                handle = self.service.submit(**fields)
            except Exception as exc:  # QueueFull, RequestError, CapacityError, ServiceClosed: the front's to answer
                self.out.send(("refused", front_id, exc))
                return
            self._ids[handle.id], self._sent[front_id], self._handles[front_id] = front_id, 0, handle

    def cancel(self, front_id: int) -> None:
        with self._lock:
            handle = self._handles.get(front_id)
        if handle is not None:  # else it ended already (its end is on its way to the front end)
            handle.cancel()

    def on_turn(self, record: StepRecord | None, snapshot: LoadSnapshot, moved: list[RequestHandle],
                ended: list[RequestHandle]) -> None:
        with self._lock:
            tokens, ends = [], []
            for handle in moved:
                front_id = self._ids.get(handle.id)
                if front_id is not None:
                    sent = self._sent[front_id]
                    tokens.append((front_id, handle._tokens[sent:]))
                    self._sent[front_id] = len(handle._tokens)
            for handle in ended:
                front_id = self._ids.pop(handle.id, None)
                if front_id is not None:
                    del self._sent[front_id], self._handles[front_id]
                    ends.append((front_id, handle._result, handle._error))
            self.out.send(("turn", record, snapshot, tokens, ends))


def load_runtime(engine_dir: str, threads: int | None = None, *, scheduler: str = "dspark", prompt_lookup: int = 3,
                 **options: Any) -> Runtime:
    """`Runtime.load(engine_dir, RuntimeOptions(scheduler=SchedulerConfig(scheduler, prompt_lookup=prompt_lookup),
    **options), threads=threads)`, as an opener the front end can pickle (`functools.partial(load_runtime, ...)`)
    without importing torch."""
    from ..api import Runtime, RuntimeOptions
    from ..prefix_scheduler import SchedulerConfig

    config = SchedulerConfig(scheduler, prompt_lookup=prompt_lookup)
    return Runtime.load(engine_dir, RuntimeOptions(scheduler=config, **options), threads=threads)


def run_engine_process(open_runtime: Callable[[], Runtime], commands: Connection, out: Connection, max_queue: int,
                       max_new_tokens: int | None) -> None:
    """The spawned process's body: open, announce, serve commands until ("close",) or the front end is gone."""
    import torch

    from .service import EngineService

    # Ctrl-C reaches the whole process group: the front end stops us (("close",), or its pipe closing), not the key
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    # torch's small ops between graph calls (sampling, masks) on all but one core: that one is the front end's
    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    try:
        runtime = open_runtime()
        service = EngineService(runtime, max_queue=max_queue, max_new_tokens=max_new_tokens)
    except Exception as exc:
        out.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    relay = TurnRelay(service, out)
    capacity = service.engine.admission.capacity
    out.send(("ready", EngineLimits(runtime.info, capacity.max_requests, capacity.max_tokens, capacity.max_seq_len,
                                    service.engine.positions_needed(0, 0),
                                    tuple(str(Path(d).resolve()) for d in runtime.text_dirs),
                                    service.engine.scheduler.confidence_temperatures, os.getpid())))
    try:
        while True:
            if not service.alive:  # its loop died (a bug, logged): exit, so the front end starts a fresh engine
                raise SystemExit(LOOP_DIED)
            try:
                if not commands.poll(LOOP_CHECK_SECONDS):
                    continue
                command = commands.recv()
            except EOFError:  # the front end is gone: nobody reads what we would make
                break
            if command[0] == "submit":
                relay.submit(command[1], command[2])
            elif command[0] == "cancel":
                relay.cancel(command[1])
            elif command[0] == "close":
                break
    finally:
        service.close()
        runtime.close()
