"""Request snapshots that outlive a Ray replica: `SnapshotKeeper`, the body of one detached named actor
(deploy.py starts it with `lifetime="detached"`, `get_if_exists=True`), holds one `SnapshotTable` per replica
incarnation; `KeeperStore` is the `SnapshotStore` each replica's EngineService records into.

A replica incarnation's table is named once at its start (name, host, pid, a random part), so a replica that
Ray Serve restarts begins with an empty table and never resumes what the ingress has moved elsewhere. When
the ingress finds a replica dead, it `claim`s each of that replica's requests from its table (the claim
removes it: a request is resumed at most once) and the replica that takes it over records it into its own
table (`adopted`) before its first step record of it.

Consistency: the replica sends its records without waiting (one message per batch, from one thread, so the
keeper applies them in the order they were made), so when a replica dies the keeper may lack its last few
steps (those still in the dying process's send path), and a client may already have tokens the keeper has
not. Resuming from a shorter snapshot only re-decodes them: the ingress checks every re-decoded token against
the one it delivered at that index and delivers only tokens past what the client has (migration.py), so a
client sees no token twice and no gap; a re-decoded token that differs ends the request with an error,
never a wrong token. A step record the keeper got is whole (one message per batch): a snapshot is always a
prefix of what the engine committed.

Plain Python: no Ray import, so it unit-tests in process.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..recovery.snapshot import Finished, Progress, Recovered, RequestSnapshot, RequestSpec, SnapshotTable

log = logging.getLogger("dspark.cluster")
KEEPER_NAME = "dspark-snapshot-keeper"
KEEPER_NAMESPACE = "dspark"
Record = tuple[str, tuple]  # (the keeper's method name, its arguments after the table)


class SnapshotKeeper:
    """The actor body: tables of request snapshots by replica incarnation. Calls from one caller are applied
    in order (a Ray actor with one thread); calls from different callers in any order, which the claim rule
    makes safe: records of a claimed request that arrive after its claim are ignored."""

    def __init__(self, keep_finished: int = 256) -> None:
        self.keep_finished = keep_finished
        self.tables: dict[str, SnapshotTable] = {}
        self.claimed: dict[str, set[str]] = {}  # table -> keys moved out of it (late records are ignored)
        self.records = 0

    def _table(self, table: str) -> SnapshotTable:
        found = self.tables.get(table)
        if found is None:
            found = self.tables[table] = SnapshotTable(self.keep_finished)
        return found

    # -- a replica's records (fire-and-forget) -------------------------------------------------------------
    def submitted(self, table: str, spec: RequestSpec) -> None:
        if spec.key not in self.claimed.get(table, ()):
            self._table(table).submit(spec)

    def stepped(self, table: str, step: int, progress: Sequence[Progress], finished: Sequence[Finished],
                engine_state: bytes | None = None) -> None:
        claimed = self.claimed.get(table)
        if claimed:
            progress = [p for p in progress if p.key not in claimed]
            finished = [f for f in finished if f.key not in claimed]
        self._table(table).step(step, progress, finished, engine_state)

    def adopted(self, table: str, snapshot: RequestSnapshot) -> None:
        """A request this replica resumed from another's snapshot: its state so far, before its step records."""
        found = self._table(table)
        found.finished.pop(snapshot.spec.key, None)
        found.running[snapshot.spec.key] = snapshot

    def record(self, table: str, records: Sequence[Record]) -> None:
        """Several records in one message, applied in order."""
        for method, args in records:
            if method not in ("submitted", "stepped", "adopted"):
                raise ValueError(f"unknown snapshot record {method!r}")
            getattr(self, method)(table, *args)
        self.records += len(records)

    def drop(self, table: str) -> None:
        """A replica that closed cleanly: its table goes."""
        self.tables.pop(table, None)
        self.claimed.pop(table, None)

    # -- the ingress and a starting replica ------------------------------------------------------------
    def recover(self, table: str) -> Recovered:
        found = self.tables.get(table)
        return found.recovered() if found is not None else Recovered([], [], [])

    def claim(self, table: str, key: str) -> RequestSnapshot | None:
        """Take a request out of a (dead) replica's table to resume it elsewhere: its running snapshot, or its
        finished one (it ended before the replica died); None when the table never heard of it or it was
        claimed already. Either way it is not in the table afterwards, and later records of it are ignored."""
        self.claimed.setdefault(table, set()).add(key)
        found = self.tables.get(table)
        if found is None:
            return None
        snapshot = found.running.pop(key, None) or found.finished.pop(key, None)
        if snapshot is not None and snapshot.broken:
            snapshot.broken = False  # it continues from its last whole record
        return snapshot

    def stats(self) -> dict[str, Any]:
        return {"tables": len(self.tables), "records": self.records,
                "running": sum(len(t.running) for t in self.tables.values()),
                "finished": sum(len(t.finished) for t in self.tables.values())}


class KeeperStore:
    """A `SnapshotStore` over a keeper actor's handle, for one replica incarnation's table. `stepped` and the
    others queue the record and return; a background thread sends what has queued as one `record` call, so
    the engine loop pays an append, not a Ray call (`background=False` sends from the caller instead).
    `get` resolves a call's result (`ray.get`); with a plain object for a keeper, the identity."""

    def __init__(self, keeper: Any, table: str, *, get: Callable[[Any], Any] = lambda x: x,
                 background: bool = True) -> None:
        self.keeper, self.table, self.get = keeper, table, get
        self.sent_batches = self.sent_records = self.send_errors = 0
        self.send_seconds = 0.0  # spent handing batches to the keeper's handle (serialising, submitting)
        self._cond = threading.Condition()
        self._queue: list[Record] = []
        self._closed = False
        self._thread = None
        if background:
            self._thread = threading.Thread(target=self._send_forever, name="dspark-snapshot-sender", daemon=True)
            self._thread.start()

    def recover(self) -> Recovered:
        return self.get(self.keeper.recover.remote(self.table))

    def submitted(self, spec: RequestSpec) -> None:
        self._put(("submitted", (spec,)))

    def stepped(self, step: int, progress: Sequence[Progress], finished: Sequence[Finished],
                engine_state: bytes | None = None) -> None:
        self._put(("stepped", (step, progress, finished, engine_state)))

    def adopted(self, snapshot: RequestSnapshot) -> None:
        self._put(("adopted", (snapshot,)))

    def flush(self, timeout: float = 10.0) -> None:
        """Wait until every queued record has been handed to the keeper's handle."""
        if self._thread is None:
            return
        with self._cond:
            self._cond.wait_for(lambda: not self._queue and not self._sending, timeout)

    def close(self, drop: bool = True) -> None:
        """Send what is queued, stop the sender; `drop`: the keeper forgets this table (a clean shutdown)."""
        self.flush()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(10)
        if drop:
            try:
                self.keeper.drop.remote(self.table)
            except Exception:  # the keeper (or Ray) already gone: nothing to drop
                log.debug("snapshot keeper gone at close", exc_info=True)

    _sending = False

    def _put(self, record: Record) -> None:
        if self._thread is None:
            self._send([record])
            return
        with self._cond:
            self._queue.append(record)
            self._cond.notify()

    def _send(self, records: list[Record]) -> None:
        start = time.perf_counter()
        self.keeper.record.remote(self.table, records)  # not awaited: Ray keeps one caller's calls in order
        self.send_seconds += time.perf_counter() - start
        self.sent_batches += 1
        self.sent_records += len(records)

    def _send_forever(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                records, self._queue, self._sending = self._queue, [], True
            try:
                self._send(records)
            except Exception as exc:  # the keeper unreachable: snapshots are lost, serving goes on
                self.send_errors += 1
                if self.send_errors in (1, 100) or self.send_errors % 10000 == 0:
                    log.warning("snapshot keeper unreachable (%s: %s); %d batches lost", type(exc).__name__, exc,
                                self.send_errors)
            finally:
                with self._cond:
                    self._sending = False
                    self._cond.notify_all()
