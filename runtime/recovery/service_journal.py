"""The engine service's side of recovery: its requests' snapshots go to a `SnapshotStore` every step,
and a request can be found again by its key (a reconnecting client's `Last-Event-ID`), running or
recently finished, across a restart."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING

from ..batch_loop import BatchEngine
from ..stats import RequestResult
from .recorder import StepRecorder
from .snapshot import Finished, RequestSnapshot, RequestSpec, SnapshotStore

if TYPE_CHECKING:
    from ..serving.handle import RequestHandle


class ServiceJournal:
    """Snapshots of the service's requests, and its requests by key (running, and the last
    `keep_finished` finished: what a reconnecting client may still ask for)."""

    def __init__(self, store: SnapshotStore, keep_finished: int = 256) -> None:
        self.store, self.recorder, self.keep_finished = store, StepRecorder(store), keep_finished
        self._lock = threading.Lock()  # the key registry, read by front-end threads
        self._running: dict[str, RequestHandle] = {}
        self._finished: OrderedDict[str, RequestHandle] = OrderedDict()

    def find(self, key: str) -> RequestHandle | None:
        with self._lock:
            return self._running.get(key) or self._finished.get(key)

    # -- the loop thread -----------------------------------------------------------------------------
    def submitted(self, handle: RequestHandle, snapshot: RequestSnapshot | None = None) -> None:
        """A request the engine has taken (new, or `snapshot` resumed): recorded from here on."""
        if snapshot is None:
            self.store.submitted(spec_of(handle))
            self.recorder.track(handle.engine_id, handle.key)
        else:
            self.recorder.track(handle.engine_id, handle.key, len(snapshot.tokens), len(snapshot.acceptance_lengths))
        with self._lock:
            self._running[handle.key] = handle

    def stepped(self, engine: BatchEngine, done: Mapping[int, RequestResult]) -> None:
        self.recorder.record(engine, done)

    def failed(self, engine_id: int, result: RequestResult) -> None:
        self.recorder.failed(engine_id, result)

    def unresumable(self, snapshot: RequestSnapshot) -> None:
        """A snapshot this engine cannot continue: ended as an error, so it is not tried again."""
        self.store.stepped(-1, [], [Finished(snapshot.spec.key, snapshot.tokens, "error",
                                             snapshot.acceptance_lengths, snapshot.proposal_lengths)])

    def ended(self, handle: RequestHandle) -> None:
        if handle.key is None:
            return
        with self._lock:
            self._running.pop(handle.key, None)
            self._finished[handle.key] = handle
            while len(self._finished) > self.keep_finished:
                self._finished.popitem(last=False)


def spec_of(handle: RequestHandle) -> RequestSpec:
    return RequestSpec(handle.key, list(handle.prompt_ids), handle.max_new_tokens, handle.temperature, handle.seed,
                       list(handle.stop_ids), list(handle.stop_strings), dict(handle.context))
