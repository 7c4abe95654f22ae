"""The replica's side of its stream to an ingress: after every engine step, the new tokens and the ends of
all the requests that ingress started on the replica, as one message. One message per step, not one per
request per step: each Ray message costs CPU in both processes (tools/cluster_bench's per-process figures).
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from ..serving.handle import RequestFailed, RequestHandle, ServiceClosed
from .routing import PREFILL_WEIGHT, remaining_work

_IDS = itertools.count(1)
Update = tuple[int, Any]  # (request key, new tokens | RequestResult | Refusal)


class ReplicaFeed:
    """One ingress's requests on this replica (read on the replica's event loop; `poke` from any thread)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.id, self.loop = next(_IDS), loop
        self.wake = asyncio.Event()
        self._handles: dict[int, tuple[RequestHandle, int]] = {}  # key -> (handle, tokens sent)
        self._cancelled: set[int] = set()  # cancels that overtook their start (two Ray calls, no order)

    def wanted(self, key: int) -> bool:
        """False for a request cancelled before it started (then it is not started)."""
        if key in self._cancelled:
            self._cancelled.discard(key)
            return False
        return True

    def add(self, key: int, handle: RequestHandle) -> None:
        self._handles[key] = (handle, 0)
        self.poke()

    def cancel(self, key: int) -> None:
        entry = self._handles.get(key)
        if entry is None:
            self._cancelled.add(key)
        else:
            entry[0].cancel()  # its end is collected (and ignored by the ingress, which dropped the key)

    def cancel_all(self) -> None:
        for handle, _ in list(self._handles.values()):
            handle.cancel()

    def poke(self) -> None:
        """Something moved (a step, an end): collect at the loop's next turn."""
        self.loop.call_soon_threadsafe(self.wake.set)

    def collect(self, replica: str, refusal: type) -> list[Update]:
        """Every request's tokens since the last collect, and the results of those that ended."""
        out: list[Update] = []
        for key, (handle, sent) in list(self._handles.items()):
            done = handle.done  # before the tokens: once done, tokens() is final
            tokens = handle.tokens()
            if len(tokens) > sent:
                out.append((key, tokens[sent:]))
                self._handles[key] = (handle, len(tokens))
            if done:
                del self._handles[key]
                try:
                    out.append((key, handle.result(0)))
                except (RequestFailed, ServiceClosed) as exc:
                    out.append((key, refusal(500, f"{replica}: {exc}")))
        return out

    def remaining_work(self) -> float:
        return sum(remaining_work(len(h.prompt_ids), h.max_new_tokens, sent, PREFILL_WEIGHT)
                   for h, sent in list(self._handles.values()))
