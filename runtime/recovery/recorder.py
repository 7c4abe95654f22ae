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
        self._seen: dict[int, list] = {}  # engine id -> [key, tokens recorded, rounds recorded]
        self._engine_state = EngineStateWriter()

    def track(self, engine_id: int, key: str, tokens: int = 0, rounds: int = 0) -> None:
        self._seen[engine_id] = [key, tokens, rounds]

    def record(self, engine: BatchEngine, done: Mapping[int, RequestResult]) -> None:
        """After a step, before any client hears of it: the running rows' deltas and the finished results."""
        progress, seen_of = [], self._seen.get
        for a in engine.active:  # the hot path: 64 rows a step
            result = a.result
            seen = seen_of(result.request_id)
            if seen is None:
                continue
            key, n, rounds = seen
            tokens, accepted = result.tokens, result.acceptance_lengths
            if len(tokens) <= n:
                continue
            progress.append(Progress(key, n, tokens[n:], accepted[rounds:], result.proposal_lengths[rounds:],
                                     a.backlog))
            seen[1], seen[2] = len(tokens), len(accepted)
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
