"""A request as the ingress holds it (`RemoteRequest`): sent to one replica, its stream of updates read and
handed to the app; sent again when the replica refused it or died before its first token, and moved to a live
replica from its snapshot when the replica died while generating it (migration.py). fleet.py routes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ..serving.handle import QueueFull, RequestFailed
from ..stats import RequestResult
from .migration import Diverged, finished_result, fresh_snapshot, splice
from .replica import Refusal
from .routing import RequestCost, remaining_work

if TYPE_CHECKING:
    from .fleet import Fleet

log = logging.getLogger("dspark.cluster")
CLAIM_TIMEOUT = 10.0  # the keeper's answer to a claim (else the request resumes from what the ingress has)
_KEYS = itertools.count(1)  # request keys on the replicas' streams


class FleetFull(QueueFull):
    """No replica can take the request (all down, or all queues full): the app's 429."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        Exception.__init__(self, message)
        self.retry_after = retry_after


class RemoteRequest:
    """A request sent to a replica, with the RequestHandle calls and fields the app uses: `astream`, `aresult`,
    `result(0)`, `tokens`, `cancel`, `done`, `key` (None: the fleet keeps no journal). `uid` is its key in the
    replicas' snapshot tables; `migrations` counts the replicas it was moved off."""

    key: str | None = None

    def __init__(self, fleet: Fleet, payload: dict[str, Any], cost: RequestCost) -> None:
        self.fleet, self.payload, self.cost = fleet, payload, cost
        self.prompt_ids, self.seed, self.context = payload["prompt_ids"], payload["seed"], {}
        self.uid = uuid.uuid4().hex
        self.index, self.feed_key, self.feed_id, self.table = -1, 0, 0, None
        self.delivered = self.migrations = 0
        self.updates: asyncio.Queue = asyncio.Queue()  # from the replica's stream: tokens, result, refusal, error
        self._tokens: list[int] = []
        self._received = 0  # tokens of the current replica's stream (it restarts at 0 on a resumed request)
        self._snapshot = None  # what the request resumes from on its next replica (None: it starts afresh)
        self._started: Any = None  # the replica's answer to `start` / `adopt`: None (taken) or a Refusal
        self._replayed = False  # its stream is the keeper's finished snapshot (the replica died after its end)
        self._work, self._held = 0.0, False
        self._result: RequestResult | None = None
        self._error: BaseException | None = None
        self._done = False

    @property
    def done(self) -> bool:
        return self._done

    @property
    def replica(self) -> str:
        return self.fleet.replicas[self.index].name

    def dispatch(self, exclude: frozenset[int]) -> None:
        self.index = self.fleet.route(self.cost, exclude)
        self._work, self._held = self.cost.work(self.fleet.router.prefill_weight), True
        replica = self.fleet.replicas[self.index]
        self.feed_key, self.feed_id, self.table = next(_KEYS), replica.feed_id, replica.info.table
        self.updates, self._received = asyncio.Queue(), 0
        replica.requests[self.feed_key] = self
        if self._snapshot is None:
            self._started = replica.handle.start.remote(self.feed_id, self.feed_key, uid=self.uid, **self.payload)
        else:
            self._started = replica.handle.adopt.remote(self.feed_id, self.feed_key, self._snapshot)

    def tokens(self) -> list[int]:
        """The tokens delivered so far (a copy)."""
        return list(self._tokens)

    async def astream(self, start: int = 0) -> AsyncIterator[list[int]]:
        """New tokens as the replica commits them (after the first `start`); RequestFailed when the replica
        failed the request, or died while generating it and it could not be moved. Leaving early cancels it."""
        if self._done:  # read again after its end (as a RequestHandle can be): what it delivered
            if self._tokens[start:]:
                yield self._tokens[start:]
            if self._error is not None:
                raise self._error
            return
        tried: set[int] = set()
        try:
            while not self._done:
                try:
                    if self._started is not None:
                        started, self._started = self._started, None
                        refusal = await started
                        if refusal is not None:
                            self._refused(refusal)
                        continue
                    item = await self.updates.get()
                    if isinstance(item, list):
                        fresh = self._progress(item)
                        if fresh and self.delivered > start:
                            yield fresh[max(start - self.delivered + len(fresh), 0):]
                    elif isinstance(item, Refusal):
                        self._refused(item)
                    elif isinstance(item, BaseException):
                        raise item
                    else:
                        self._ended(item)
                except _Retry:
                    tried.add(self.index)
                    self._redispatch(tried)
                except Diverged as exc:
                    self.fleet.diverged += 1
                    source = (f"its end as the snapshot keeper recorded it (engine replica {self.replica} died)"
                              if self._replayed else f"request moved to engine replica {self.replica} after its "
                              "replica died")
                    self._finish(error=RequestFailed(
                        f"{source}: {exc}; it stops after the {self.delivered} tokens sent, none of them wrong: "
                        "send it again"))
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # Ray's: the replica's process died or is unreachable
                    self.fleet.replicas[self.index].mark_down(f"{type(exc).__name__} during a request")
                    tried.add(self.index)
                    if self.delivered == 0 and self._snapshot is None:
                        self._redispatch(tried)
                    elif self.fleet.keeper is not None:
                        await self._migrate(tried)
                    else:
                        self._finish(error=RequestFailed(
                            f"engine replica {self.replica} died during this request ({type(exc).__name__}) after "
                            f"{self.delivered} tokens; the request is lost: send it again (no snapshot keeper)"))
            if self._error is not None:
                raise self._error
        finally:
            if not self._done:
                self.cancel()

    def result(self, timeout: float | None = None) -> RequestResult:
        if not self._done:
            raise TimeoutError("the request has not finished")
        if self._error is not None:
            raise self._error
        return self._result

    async def aresult(self) -> RequestResult:
        async for _ in self.astream():
            pass
        return self.result(0)

    def cancel(self) -> None:
        if self._done:
            return
        self._finish(result=RequestResult(-1, self.payload["prompt_ids"], [], finish_reason="cancelled"))
        with contextlib.suppress(Exception):  # the replica gone: nothing left to cancel
            self.fleet.replicas[self.index].handle.cancel.remote(self.feed_id, self.feed_key)

    # -- pieces ---------------------------------------------------------------------------------------
    def _progress(self, tokens: list[int]) -> list[int]:
        """The replica's next tokens, laid at their index (migration.splice): those new to the client."""
        fresh = splice(self._tokens, self._received, tokens)
        self._received += len(tokens)
        self._tokens += fresh
        self.delivered = len(self._tokens)
        left = remaining_work(self.cost.prompt_tokens, self.cost.max_new_tokens, self.delivered,
                              self.fleet.router.prefill_weight)
        self.fleet.replicas[self.index].in_flight_work -= self._work - left
        self._work = left
        return fresh

    def _ended(self, result: RequestResult) -> None:
        if self.migrations and (result.tokens != self._tokens or result.finish_reason == "error"):
            if result.finish_reason == "error":
                raise Diverged(f"it ended in an error on {self.replica}")
            raise Diverged(f"its final {len(result.tokens)} tokens differ from the {self.delivered} streamed")
        self._finish(result=result)

    async def _migrate(self, tried: set[int]) -> None:
        """Claim the request's snapshot from the dead replica's table and resume it on another replica (its
        finished snapshot: replay its end); without one, from the last snapshot sent or from nothing."""
        self._release()
        dead = self.replica
        try:
            found = await asyncio.wait_for(self.fleet.keeper.claim.remote(self.table, self.uid), CLAIM_TIMEOUT)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the keeper unreachable: the request is decoded again from what is known
            log.warning("snapshot keeper did not answer a claim (%s: %s)", type(exc).__name__, exc)
            found = None
        self.migrations += 1
        self.fleet.migrated += 1
        if found is not None and found.finish_reason == "cancelled":
            # the replica cancelled it when its stream to this ingress closed (replica.subscribe), not the client
            # (a request the client cancels is done here and never moves): resume it. Replayed as its end, the
            # stream ended short without an error (seen in 2 of 45 fresh runs of the kill test under load)
            found = replace(found, finish_reason=None)
        if found is not None and found.finish_reason is not None:
            self._replayed = True
            self.updates, self._received = asyncio.Queue(), 0
            self.updates.put_nowait(list(found.tokens))
            self.updates.put_nowait(finished_result(found))
            return
        known = [s for s in (found, self._snapshot) if s is not None]
        self._snapshot = max(known, key=lambda s: len(s.tokens)) if known else fresh_snapshot(self.uid, self.payload)
        log.warning("request %s: engine replica %s died after %d tokens; resuming from %d committed tokens",
                    self.uid, dead, self.delivered, len(self._snapshot.tokens))
        self._redispatch(tried)

    def _refused(self, refusal: Refusal) -> None:
        if refusal.status in (429, 503) and self._received == 0:
            raise _Retry
        self._finish(error=RequestFailed(refusal.message))

    def _redispatch(self, tried: set[int]) -> None:
        """Send the request (no token delivered yet, or resumed from a snapshot) to a replica it has not tried;
        it fails when none is left."""
        self._release()
        try:
            self.dispatch(frozenset(tried))
        except FleetFull as exc:
            self._finish(error=RequestFailed(f"no engine replica could take this request: {exc}"))

    def _release(self) -> None:
        if self._held:
            replica = self.fleet.replicas[self.index]
            replica.in_flight -= 1
            replica.in_flight_work -= self._work
            replica.requests.pop(self.feed_key, None)
            self._work, self._held = 0.0, False

    def _finish(self, *, result: RequestResult | None = None, error: BaseException | None = None) -> None:
        if self._done:
            return
        self._done, self._result, self._error = True, result, error
        self._release()


class _Retry(Exception):
    """The replica refused a request it had not started: send it to another."""
