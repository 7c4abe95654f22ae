"""Request snapshots: what a request needs to continue after its engine is gone, and the stores that
keep them.

Per step, a running request's snapshot is its committed tokens (as a delta since the last record) and
the step reached; settings go once, at submission (`RequestSpec`). No KV: a resumed request's KV is
rebuilt by one prefill of prompt + committed tokens, and its next anchor is its last committed token.
No RNG state either: a sampler is re-seeded every round from the request's seed and its committed
tokens (`sampling.round_seed`), so the resumed engine draws exactly what the dead one would have.

`SnapshotStore` is the interface a store implements (the journal file of `dspark serve --journal`;
a store that outlives a replica, such as a detached actor, fits the same four calls), and
`SnapshotTable` the in-memory state every store rebuilds its records into.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from .engine_state import is_short_state, merge_engine_state


@dataclass(frozen=True)
class RequestSpec:
    """A request as submitted: enough to start it again from nothing."""

    key: str  # the front end's stable id (the HTTP response id); unique per store
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float
    seed: int
    stop_ids: list[int] = field(default_factory=list)
    stop_strings: list[str] = field(default_factory=list)
    context: dict[str, Any] = field(default_factory=dict)  # the front end's own fields, JSON-able


@dataclass(slots=True)  # made 64 times a step: slots, not frozen (a frozen init costs ~3x)
class Progress:
    """One request's change over one step: tokens first.. and its rounds."""

    key: str
    first: int  # tokens recorded before this delta
    tokens: list[int]
    acceptance_lengths: list[int]  # rounds since the last record
    proposal_lengths: list[int]
    backlog: int = 0  # context rows its drafter has not seen (the drafting gate prices them)


@dataclass(slots=True)
class Finished:
    key: str
    tokens: list[int]  # the final output
    reason: str  # "length", "stop", "cancelled" or "error"
    acceptance_lengths: list[int]
    proposal_lengths: list[int]


@dataclass
class RequestSnapshot:
    """Where a request stands: running (finish_reason None) or finished."""

    spec: RequestSpec
    tokens: list[int] = field(default_factory=list)
    acceptance_lengths: list[int] = field(default_factory=list)
    proposal_lengths: list[int] = field(default_factory=list)
    step: int = -1  # the engine step of the last record (-1: never stepped)
    backlog: int = 0
    finish_reason: str | None = None
    broken: bool = False  # a record of it was lost: it continues from the last whole one


@dataclass
class Recovered:
    running: list[RequestSnapshot]  # to resume, in submission order
    finished: list[RequestSnapshot]  # kept so a reconnecting client can read its stream's end
    problems: list[str]  # one line per damaged stretch or lost record (empty: all whole)
    engine_state: bytes | None = None  # the engine's own scheduling state after the last step (`engine_state`)


class SnapshotStore(Protocol):
    """Where snapshots go. Calls come from one thread (the engine loop); `stepped` once per step, before
    any client sees that step's tokens, so a store never holds less than a client has read."""

    def recover(self) -> Recovered: ...

    def submitted(self, spec: RequestSpec) -> None: ...

    def stepped(self, step: int, progress: Sequence[Progress], finished: Sequence[Finished],
                engine_state: bytes | None = None) -> None: ...

    def close(self) -> None: ...


class SnapshotTable:
    """Snapshots rebuilt from records, in submission order; the last `keep_finished` finished ones kept."""

    def __init__(self, keep_finished: int = 256) -> None:
        self.running: dict[str, RequestSnapshot] = {}
        self.finished: OrderedDict[str, RequestSnapshot] = OrderedDict()
        self.keep_finished = keep_finished
        self.problems: list[str] = []
        self._whole_state: bytes | None = None  # the last whole engine state, and a short one after it
        self._short_state: bytes | None = None

    def submit(self, spec: RequestSpec) -> None:
        self.finished.pop(spec.key, None)
        self.running[spec.key] = RequestSnapshot(spec)

    def _irregular(self, p: Progress) -> None:
        """A step record that does not extend its request's snapshot: ignored, or the gap noted."""
        snap = self.running.get(p.key)
        if snap is None or snap.broken:
            return  # its submission was lost, or an earlier step of it was: resumes from before the gap
        snap.broken = True
        self.problems.append(f"request {p.key}: a step record is missing (have {len(snap.tokens)} tokens, next "
                             f"record starts at {p.first}); it resumes from token {len(snap.tokens)}")

    def finish(self, step: int, f: Finished) -> None:
        snap = self.running.pop(f.key, None)
        if snap is None:
            return
        snap.tokens, snap.finish_reason, snap.step = list(f.tokens), f.reason, step
        snap.acceptance_lengths, snap.proposal_lengths = list(f.acceptance_lengths), list(f.proposal_lengths)
        snap.broken = False
        self.finished[f.key] = snap
        while len(self.finished) > self.keep_finished:
            self.finished.popitem(last=False)

    def step(self, step: int, progress: Sequence[Progress], finished: Sequence[Finished],
             engine_state: bytes | None = None) -> None:
        """One engine step's records."""
        if engine_state is not None:  # merged when read: a short state comes every step a gate declines
            if is_short_state(engine_state):
                self._short_state = engine_state
            else:
                self._whole_state, self._short_state = engine_state, None
        running = self.running
        for p in progress:  # inline: 64 rows a step
            snap = running.get(p.key)
            if snap is not None and not snap.broken and p.first == len(snap.tokens):
                snap.tokens += p.tokens
                snap.acceptance_lengths += p.acceptance_lengths
                snap.proposal_lengths += p.proposal_lengths
                snap.step, snap.backlog = step, p.backlog
            else:
                self._irregular(p)
        for f in finished:
            self.finish(step, f)

    @property
    def engine_state(self) -> bytes | None:
        """The engine's scheduling state after the last step recorded (`engine_state`)."""
        if self._short_state is None:
            return self._whole_state
        return merge_engine_state(self._whole_state, self._short_state)

    def recovered(self) -> Recovered:
        return Recovered(list(self.running.values()), list(self.finished.values()), list(self.problems),
                         self.engine_state if self.running else None)


class MemoryStore:
    """A SnapshotStore in this process's memory: outlives an engine, not the process (tests, and an engine
    restarted in place)."""

    def __init__(self, keep_finished: int = 256) -> None:
        self.table = SnapshotTable(keep_finished)

    def recover(self) -> Recovered:
        return self.table.recovered()

    def submitted(self, spec: RequestSpec) -> None:
        self.table.submit(spec)

    def stepped(self, step: int, progress: Sequence[Progress], finished: Sequence[Finished],
                engine_state: bytes | None = None) -> None:
        self.table.step(step, progress, finished, engine_state)

    def close(self) -> None:
        pass
