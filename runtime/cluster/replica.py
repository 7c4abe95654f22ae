"""One engine replica: a Runtime and its EngineService (one decode loop) in a Ray Serve replica's process, with
the calls the ingress makes: `describe` (model, limits, where the tokenizer is), `load` (what the router
weighs), `subscribe` (the ingress's stream of every step's updates, feed.py), `start` and `cancel` (a request
on that stream), `adopt` (a request another replica was generating, from its snapshot: migration.py),
`metrics_text` (its `dspark:` exposition). With a `store` factory, every step's snapshots go to a store of its
own (snapshot_keeper.py: a detached actor's table that outlives this process).
Plain Python: deploy.py wraps it with `serve.deployment`, so this module needs no Ray to import or test.
"""

from __future__ import annotations

import asyncio
import os
import socket
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..api import Runtime, RuntimeOptions
from ..capacity import CapacityError
from ..cost_model import StepCost
from ..model_info import ModelInfo
from ..recovery.snapshot import RequestSnapshot, SnapshotStore
from ..requests import RequestError
from ..serving.handle import LoadSnapshot, QueueFull, RequestHandle, ServiceClosed
from ..serving.metrics import ServingMetrics
from ..serving.service import EngineService
from ..stats import RequestResult, StepRecord
from .feed import ReplicaFeed, Update

BUDGET_DECAY = 0.9  # the verification budget's moving average keeps 90% of its value per step


@dataclass(frozen=True)
class EngineSpec:
    """How a replica opens its Runtime: an engine or export directory (`Runtime.load`), or a target and drafter
    checkpoint (`Runtime.from_checkpoints`). The paths must exist on every node that runs a replica."""

    engine_dir: str | None = None
    target_dir: str | None = None
    drafter_dir: str | None = None
    options: RuntimeOptions = field(default_factory=RuntimeOptions)
    cost_model: StepCost | None = None
    threads: int | None = None  # intra-op threads per replica (ORT's, torch's for checkpoints); None: the
    # engine's own count (the one its SPS table was measured with), 1 for exports and checkpoints

    def __post_init__(self) -> None:
        if (self.engine_dir is None) == (self.target_dir is None or self.drafter_dir is None):
            raise ValueError("EngineSpec needs either engine_dir, or target_dir and drafter_dir")

    def open(self) -> Runtime:
        if self.engine_dir is not None:
            return Runtime.load(self.engine_dir, self.options, threads=self.threads, cost_model=self.cost_model)
        import torch

        torch.set_num_threads(self.threads or 1)
        return Runtime.from_checkpoints(self.target_dir, self.drafter_dir, self.options, cost_model=self.cost_model)


@dataclass(frozen=True)
class ReplicaInfo:
    """What the ingress needs once: the model, the engine's limits, where text lives, where the replica runs."""

    name: str
    info: ModelInfo
    max_requests: int
    max_tokens: int  # KV positions in all
    max_seq_len: int
    max_queue: int
    max_new_tokens: int | None
    reserve_extra: int  # positions the engine reserves beyond prompt + new tokens (its lookahead block)
    text_dirs: tuple[str, ...]
    host: str
    pid: int
    table: str | None = None  # its snapshot table in the keeper (None: no store)


@dataclass(frozen=True)
class ReplicaReport:
    """A replica's load for the router: the service's snapshot, its verification budget, its remaining work."""

    snapshot: LoadSnapshot
    verification_budget: float
    remaining_work: float


@dataclass(frozen=True)
class Refusal:
    """A request the replica did not take (the ingress retries elsewhere or answers with `status`)."""

    status: int  # 400 bad request, 429 queue full, 503 closed, 500 failed
    message: str
    retry_after: int = 1


class EngineReplica:
    """The body of the engine deployment (one per Ray Serve replica)."""

    def __init__(self, spec: EngineSpec, name: str, max_queue: int = 1024, max_new_tokens: int | None = None,
                 store: Callable[[str], SnapshotStore] | None = None) -> None:
        """`store(table)`: the snapshot store of this incarnation (a table name no earlier one used, so a
        restarted replica resumes nothing the ingress has moved elsewhere)."""
        self.name, self.spec = name, spec
        self.runtime = spec.open()
        # The router holds each replica to `max_queue` waiting requests by its own count; the service's limit is
        # one batch larger, since the router may send a whole batch before the loop admits any of it.
        self.max_queue = max_queue
        self.table = f"{name}@{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}" if store else None
        self.store = store(self.table) if store is not None else None
        self.service = EngineService(self.runtime, max_queue=max_queue + spec.options.max_requests,
                                     max_new_tokens=max_new_tokens, store=self.store)
        self.metrics = ServingMetrics(self.service)
        self._budget = 0.0
        self._closed = False
        self._feeds: dict[int, ReplicaFeed] = {}
        self.service.add_step_listener(self._on_step)
        self.service.add_finish_listener(self._on_finish)

    def describe(self) -> ReplicaInfo:
        capacity = self.service.engine.admission.capacity
        return ReplicaInfo(self.name, self.runtime.info, capacity.max_requests, capacity.max_tokens,
                           capacity.max_seq_len, self.max_queue, self.service.max_new_tokens,
                           self.service.engine.positions_needed(0, 0),
                           tuple(str(Path(d).resolve()) for d in self.runtime.text_dirs), socket.gethostname(),
                           os.getpid(), self.table)

    def load(self) -> ReplicaReport:
        work = sum(feed.remaining_work() for feed in list(self._feeds.values()))
        return ReplicaReport(self.service.snapshot(), self._budget, work)

    async def subscribe(self) -> AsyncIterator[int | list[Update]]:
        """An ingress's stream: first its feed id (for `start` and `cancel`), then after every engine step the
        updates of the requests it started: (key, new tokens), (key, RequestResult) at the end, (key, Refusal)
        when the engine failed it. Its requests are cancelled when the stream closes (the ingress went away)."""
        feed = ReplicaFeed(asyncio.get_running_loop())
        self._feeds[feed.id] = feed
        try:
            yield feed.id
            while True:
                await feed.wake.wait()
                feed.wake.clear()
                updates = feed.collect(self.name, Refusal)
                if updates:
                    yield updates
        finally:
            del self._feeds[feed.id]
            feed.cancel_all()

    async def start(self, feed_id: int, key: int, prompt_ids: list[int], max_new_tokens: int, temperature: float,
                    seed: int, stop: list[int | str], uid: str | None = None) -> Refusal | None:
        """Submit a request whose updates go to that feed; a Refusal when it is not taken. `uid`: its key in the
        snapshot store (the ingress claims it by that key if this replica dies)."""
        return self._take(feed_id, key, lambda: self.service.submit(
            prompt_ids, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, stop=stop, key=uid))

    async def adopt(self, feed_id: int, key: int, snapshot: RequestSnapshot) -> Refusal | None:
        """Continue a request another replica was generating, from its snapshot; its updates go to that feed
        from token 0 (the snapshot's tokens first). A Refusal when it is not taken."""
        return self._take(feed_id, key, lambda: self.service.resume(snapshot))

    def _take(self, feed_id: int, key: int, submit: Callable[[], RequestHandle]) -> Refusal | None:
        feed = self._feeds.get(feed_id)
        if feed is None:
            return Refusal(503, f"{self.name}: feed {feed_id} is closed")
        if not feed.wanted(key):
            return None
        try:
            handle = submit()
        except QueueFull as exc:
            return Refusal(429, str(exc), exc.retry_after)
        except (RequestError, CapacityError) as exc:
            return Refusal(400, str(exc))
        except ServiceClosed as exc:
            return Refusal(503, str(exc))
        feed.add(key, handle)
        return None

    def cancel(self, feed_id: int, key: int) -> None:
        feed = self._feeds.get(feed_id)
        if feed is not None:
            feed.cancel(key)

    def metrics_text(self) -> bytes:
        return self.metrics.render()[0]

    def pid(self) -> int:
        return os.getpid()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.service.close()
            if self.store is not None:
                self.store.close()
            self.runtime.close()

    def __del__(self) -> None:
        self.close()

    def _on_step(self, record: StepRecord, snapshot: LoadSnapshot) -> None:
        self._budget = BUDGET_DECAY * self._budget + (1 - BUDGET_DECAY) * float(record.verified_tokens)
        self._poke()

    def _on_finish(self, result: RequestResult, timings: object) -> None:
        self._poke()  # an end without a step (a cancel, a refused prompt)

    def _poke(self) -> None:
        for feed in list(self._feeds.values()):
            feed.poke()
