"""The ingress's view of the engine replicas, shaped like an `EngineService` so that the OpenAI app of
runtime/serving serves it unchanged: `submit` (checked here against the replicas' limits, routed, sent),
`room`, `snapshot`, `alive`, and `runtime` (the model info and tokenizer). A poll task per replica on the ingress's
event loop keeps its load and health current; the router's own ledger (requests and remaining work in
flight per replica) moves with every send, token and end.

A replica that dies: requests it had not started on (no token delivered yet) are sent again to another
replica, so a client sees nothing. Requests it was generating move, when the fleet has a snapshot keeper
(snapshot_keeper.py): each is claimed from the dead replica's table and resumed on a live replica (KV rebuilt
by prefill of its committed tokens), and its stream goes on with the tokens past what the client has, each
re-decoded one checked against the one delivered (migration.py). Without a keeper they fail with
`RequestFailed` naming the replica (the tokens already streamed stand). The replica is routed around until a
poll finds it (or Ray Serve's restart of it) answering again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import fields
from typing import Any

from ..capacity import Admission, Capacity
from ..model_text import ModelText
from ..requests import RequestError, stop_set, validate_request
from ..serving.handle import LoadSnapshot, ServiceClosed
from .remote_request import FleetFull, RemoteRequest
from .replica import ReplicaInfo, ReplicaReport
from .routing import NoReplica, ReplicaLoad, RequestCost, Router

log = logging.getLogger("dspark.cluster")
POLL_INTERVAL = 0.05  # seconds between load polls of every replica
POLL_TIMEOUT = 2.0  # a replica that does not answer a poll within this is down


class Replica:
    """One engine replica as the ingress tracks it."""

    def __init__(self, name: str, handle: Any, info: ReplicaInfo) -> None:
        self.name, self.handle, self.info = name, handle, info
        self.report: ReplicaReport | None = None
        self.up, self.why_down = True, ""
        self.in_flight, self.in_flight_work = 0, 0.0
        self.routed = 0
        self.feed_id: int | None = None  # its stream to this ingress, once subscribed
        self.requests: dict[int, RemoteRequest] = {}  # feed key -> request

    def load(self) -> ReplicaLoad:
        i, r = self.info, self.report
        s = r.snapshot if r is not None else None
        return ReplicaLoad(
            self.name, self.up and self.feed_id is not None, queued=s.queued if s else 0, running=s.running if s else 0,
            slots_total=i.max_requests, kv_tokens_reserved=s.kv_tokens_reserved if s else 0,
            kv_tokens_capacity=i.max_tokens, max_queue=i.max_queue,
            verification_budget=r.verification_budget if r else 0.0, reported_work=r.remaining_work if r else 0.0,
            in_flight=self.in_flight, in_flight_work=self.in_flight_work)

    def mark_down(self, why: str) -> None:
        if self.up:
            log.warning("engine replica %s is down: %s", self.name, why)
        self.up, self.why_down = False, why


class Fleet:
    """The engine replicas behind one ingress. Make it with `await Fleet.start(...)` on the ingress's loop."""

    def __init__(self, replicas: list[Replica], router: Router, poll_interval: float = POLL_INTERVAL,
                 keeper: Any = None) -> None:
        """`keeper`: the snapshot keeper's handle (`claim.remote`); None: requests of a dead replica fail."""
        first = replicas[0].info
        self.replicas, self.router, self.poll_interval, self.keeper = replicas, router, poll_interval, keeper
        self.migrated = self.diverged = 0  # requests moved off a dead replica; moved ones that failed the check
        self.runtime = ModelText(first.info, first.text_dirs)  # the replicas' text folders: the same paths here
        self.max_new_tokens = first.max_new_tokens
        self.rejected = 0
        self._admission = Admission(Capacity(first.max_requests, first.max_tokens, first.max_seq_len))
        self._closed = False
        self._pollers: list[asyncio.Task] = []

    @classmethod
    async def start(cls, handles: Sequence[tuple[str, Any]], router: Router, poll_interval: float = POLL_INTERVAL,
                    keeper: Any = None) -> Fleet:
        """Ask every replica what it serves (waits for them to load), check they agree, start polling."""
        infos = await asyncio.gather(*(handle.describe.remote() for _, handle in handles))
        models = {(i.info, i.max_requests, i.max_tokens, i.max_seq_len, i.reserve_extra) for i in infos}
        if len(models) > 1:
            raise ValueError(f"the engine replicas serve different models or limits: {sorted(map(str, models))}")
        fleet = cls([Replica(name, handle, info) for (name, handle), info in zip(handles, infos, strict=True)],
                     router, poll_interval, keeper)
        loop = asyncio.get_running_loop()
        fleet._pollers = [loop.create_task(task) for r in fleet.replicas
                          for task in (fleet._poll_forever(r), fleet._read_feed(r))]
        while any(r.feed_id is None for r in fleet.replicas):
            await asyncio.sleep(0.01)
        return fleet

    # -- what the app calls ----------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], *, max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
               stop: Sequence[int | str] = ()) -> RemoteRequest:
        """Check the request as a replica would (RequestError / CapacityError: 400), route it, send it.
        FleetFull (429) when no replica can take it; ServiceClosed after close()."""
        if self._closed:
            raise ServiceClosed("the dspark cluster ingress is closed")
        info = self.runtime.info
        if self.max_new_tokens is not None and isinstance(max_new_tokens, int) and max_new_tokens > self.max_new_tokens:
            raise RequestError(f"max_new_tokens {max_new_tokens} exceeds this server's limit {self.max_new_tokens}")
        ids = validate_request(prompt_ids, vocab_size=info.vocab_size, max_positions=info.max_positions,
                               max_new_tokens=max_new_tokens, temperature=temperature)
        stop_set([s for s in stop if not isinstance(s, str)], info.vocab_size)
        need = self._positions_needed(len(ids), max_new_tokens)
        self._admission.check_servable(need)
        request = RemoteRequest(self, dict(prompt_ids=ids, max_new_tokens=max_new_tokens, temperature=temperature,
                                           seed=seed, stop=list(stop)), RequestCost(len(ids), max_new_tokens, need))
        request.dispatch(frozenset())
        return request

    def room(self, prompt_len: int) -> int:
        """As `EngineService.room`, from the replicas' limits."""
        first = self.replicas[0].info
        room = min(first.max_seq_len, first.max_tokens) - self._positions_needed(prompt_len, 0)
        room = min(room, self.runtime.info.max_positions - prompt_len)
        return room if self.max_new_tokens is None else min(room, self.max_new_tokens)

    def snapshot(self) -> LoadSnapshot:
        """The replicas' last reports summed (the replicas that are up)."""
        up = [r for r in self.replicas if r.up and r.report is not None]
        names = [f.name for f in fields(LoadSnapshot) if f.name not in ("time", "max_queue")]
        total = {name: int(sum(getattr(r.report.snapshot, name) for r in up)) for name in names}
        return LoadSnapshot(time=time.monotonic(), max_queue=sum(r.info.max_queue for r in up), **total)

    @property
    def alive(self) -> bool:
        return not self._closed and any(r.up for r in self.replicas)

    def loads(self) -> list[ReplicaLoad]:
        return [r.load() for r in self.replicas]

    def close(self) -> None:
        self._closed = True
        for poller in self._pollers:
            poller.cancel()

    # -- routing ---------------------------------------------------------------------------------
    def route(self, cost: RequestCost, exclude: frozenset[int]) -> int:
        try:
            index = self.router.choose(self.loads(), cost, exclude)
        except NoReplica as exc:
            self.rejected += 1
            raise FleetFull(str(exc), exc.retry_after) from None
        replica = self.replicas[index]
        replica.in_flight += 1
        replica.in_flight_work += cost.work(self.router.prefill_weight)
        replica.routed += 1
        return index

    def _positions_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        return prompt_len + max_new_tokens + self.replicas[0].info.reserve_extra  # the engine's rule: linear

    async def _read_feed(self, replica: Replica) -> None:
        """The replica's stream of step updates, handed to its requests; when it breaks (the replica died),
        every request on it hears so, and the stream is opened again (Ray Serve answers once it restarted
        the replica)."""
        while not self._closed:
            try:
                async for item in replica.handle.options(stream=True).subscribe.remote():
                    if isinstance(item, int):
                        replica.feed_id = item
                        continue
                    for key, update in item:
                        request = replica.requests.get(key)
                        if request is not None:
                            request.updates.put_nowait(update)
                raise ConnectionError(f"engine replica {replica.name} closed its stream")
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                replica.feed_id = None
                replica.mark_down(f"its stream broke: {type(exc).__name__}: {str(exc)[:160]}")
                for request in list(replica.requests.values()):
                    request.updates.put_nowait(exc)
                replica.requests.clear()
                await asyncio.sleep(self.poll_interval)

    async def _poll_forever(self, replica: Replica) -> None:
        """One task per replica: a dead one's timeouts do not hold back the others' reports."""
        while not self._closed:
            await self._poll(replica)
            await asyncio.sleep(self.poll_interval)

    async def _poll(self, replica: Replica) -> None:
        try:
            replica.report = await asyncio.wait_for(replica.handle.load.remote(), POLL_TIMEOUT)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # died, restarting, unreachable: route around it until it answers
            replica.mark_down(f"load poll failed: {type(exc).__name__}: {str(exc)[:160]}")
            return
        if not replica.up:  # back (Ray Serve restarted it, or it was only unreachable): where it runs now
            try:
                replica.info = await asyncio.wait_for(replica.handle.describe.remote(), POLL_TIMEOUT)
            except asyncio.CancelledError:
                raise
            except Exception:
                return
            log.warning("engine replica %s is up again (pid %d on %s)", replica.name, replica.info.pid,
                        replica.info.host)
        replica.up, replica.why_down = True, ""
