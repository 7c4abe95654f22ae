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
        # engine id -> [key, tokens recorded, rounds recorded, its RunningRequest, the store's id of it]
        self._seen: dict[int, list] = {}
        self._engine_state = EngineStateWriter()
        follow = getattr(store, "follow", None)  # a store that asks us for the running state, not keeping its own
        if follow is not None:
            follow(self.recorded)
        # such a store may take the running rows packed (`JournalStore.stepped_rows`): no Progress per row
        self._rows = getattr(store, "stepped_rows", None) if follow is not None else None

    def track(self, engine_id: int, key: str, tokens: int = 0, rounds: int = 0) -> None:
        """Record engine request `engine_id` as `key` (submitted to the store first), `tokens` and `rounds`
        of it already recorded."""
        self._seen[engine_id] = [key, tokens, rounds, None, None if self._rows is None else self.store.journal_id(key)]

    def recorded(self) -> list[Progress]:
        """Every tracked request that has stepped, as recorded so far: its whole tokens and rounds from 0."""
        out = []
        for key, n, rounds, a, _ in self._seen.values():
            if a is not None:
                r = a.result
                out.append(Progress(key, 0, r.tokens[:n], r.acceptance_lengths[:rounds], r.proposal_lengths[:rounds],
                                    a.backlog))
        return out

    def record(self, engine: BatchEngine, done: Mapping[int, RequestResult]) -> None:
        """After a step, before any client hears of it: the running rows' deltas and the finished results."""
        if self._rows is not None:
            self._record_rows(engine, done)
            return
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
                                     a.backlog))
            seen[1], seen[2], seen[3] = len(tokens), len(accepted), a
        finished = [self._finished(self._seen.pop(rid)[0], result)
                    for rid, result in done.items() if rid in self._seen]
        if progress or finished:
            self.store.stepped(engine.steps_run, progress, finished, self._engine_state(engine) if progress else None)

    def _record_rows(self, engine: BatchEngine, done: Mapping[int, RequestResult]) -> None:
        """`record` into a store that takes the rows packed: the same deltas, in one pass."""
        rows, values, count, seen_of = [], [], 0, self._seen.get
        append = values.append
        for a in engine.active:  # the hot path: 64 rows a step, run with the caches cold from the graphs
            result = a.result
            seen = seen_of(result.request_id)
            if seen is None:
                continue
            tokens, n = result.tokens, seen[1]
            total = len(tokens)
            if total <= n:
                continue
            accepted, rounds = result.acceptance_lengths, seen[2]
            done_rounds = len(accepted)
            rows += (seen[4], n, total - n, done_rounds - rounds, a.backlog)
            values += tokens[n:]
            if done_rounds == rounds + 1:  # one round a step (every chain step): two appends, not two slices
                append(accepted[rounds])
                append(result.proposal_lengths[rounds])
            else:
                values += accepted[rounds:]
                values += result.proposal_lengths[rounds:]
            seen[1], seen[2], seen[3] = total, done_rounds, a
            count += 1
        finished = [self._finished(self._seen.pop(rid)[0], result)
                    for rid, result in done.items() if rid in self._seen]
        if count or finished:
            self._rows(engine.steps_run, count, rows, values, finished, self._engine_state(engine) if count else None)

    def failed(self, engine_id: int, result: RequestResult) -> None:
        """A request that ended outside a normal step (its step raised): recorded as finished."""
        seen = self._seen.pop(engine_id, None)
        if seen is not None:
            self.store.stepped(-1, [], [self._finished(seen[0], result)])

    @staticmethod
    def _finished(key: str, result: RequestResult) -> Finished:
        return Finished(key, list(result.tokens), result.finish_reason, list(result.acceptance_lengths),
                        list(result.proposal_lengths))
