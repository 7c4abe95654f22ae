"""Snapshots out of a live engine: after each step, every tracked request's new tokens and rounds become
one `Progress`, and finished results one `Finished`; the store gets them in one call."""

from __future__ import annotations

from collections.abc import Mapping

from ..batch_loop import BatchEngine
from ..stats import RequestResult
from .engine_state import EngineStateWriter
from .snapshot import Finished, Progress, SnapshotStore


class StepRecorder:
    """Tracks engine request ids -> store keys and what has been recorded of each."""

    def __init__(self, store: SnapshotStore) -> None:
        self.store = store
        self._seen: dict[int, list] = {}  # engine id -> [key, tokens recorded, rounds recorded, its RunningRequest]
        self._engine_state = EngineStateWriter()
        follow = getattr(store, "follow", None)  # a store that asks us for the running state, not keeping its own
        if follow is not None:
            follow(self.recorded)

    def track(self, engine_id: int, key: str, tokens: int = 0, rounds: int = 0) -> None:
        self._seen[engine_id] = [key, tokens, rounds, None]

    def recorded(self) -> list[Progress]:
        """Every tracked request that has stepped, as recorded so far: its whole tokens and rounds from 0."""
        out = []
        for key, n, rounds, a in self._seen.values():
            if a is not None:
                r = a.result
                out.append(Progress(key, 0, r.tokens[:n], r.acceptance_lengths[:rounds], r.proposal_lengths[:rounds],
                                    a.backlog))
        return out

    def record(self, engine: BatchEngine, done: Mapping[int, RequestResult]) -> None:
        """After a step, before any client hears of it: the running rows' deltas and the finished results."""
        progress, seen_of = [], self._seen.get
        for a in engine.active:  # the hot path: 64 rows a step, run with the caches cold from the graphs
            result = a.result
            seen = seen_of(result.request_id)
            if seen is None:
                continue
            tokens, n = result.tokens, seen[1]
            if len(tokens) <= n:
                continue
            accepted, rounds = result.acceptance_lengths, seen[2]
            progress.append(Progress(seen[0], n, tokens[n:], accepted[rounds:], result.proposal_lengths[rounds:],
                                     a.pending_rows - a.fed))  # a.backlog, without the property call
            seen[1], seen[2], seen[3] = len(tokens), len(accepted), a
        finished = [self._finished(self._seen.pop(rid)[0], result)
                    for rid, result in done.items() if rid in self._seen]
        if progress or finished:
            self.store.stepped(engine.steps_run, progress, finished, self._engine_state(engine) if progress else None)

    def failed(self, engine_id: int, result: RequestResult) -> None:
        """A request that ended outside a normal step (its step raised): recorded as finished."""
        seen = self._seen.pop(engine_id, None)
        if seen is not None:
            self.store.stepped(-1, [], [self._finished(seen[0], result)])

    @staticmethod
    def _finished(key: str, result: RequestResult) -> Finished:
        return Finished(key, list(result.tokens), result.finish_reason, list(result.acceptance_lengths),
                        list(result.proposal_lengths))
