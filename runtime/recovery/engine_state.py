"""The engine's own scheduling state that a request's draws depend on, saved beside the snapshots: the
drafting gate's pool of recent survival rows, its count of steps without drafting, its sums of expected
and accepted drafts and its probe interval (after the pool; a state written before they existed restores the
sums as zero and the interval as `probe_every`). Restored with the
requests' backlogs (`RunningRequest.fed`), the resumed engine's gate plans the steps the dead one would
have, so a seeded sampled request takes the same draws. (A live cost model learns from timings and the
async scheduler keeps confidences of earlier steps: neither is saved; with either, sampled requests are
not reproducible by seed even without a restart.)

While the pool stays as it was (a gate declining step after step: only its skipped count moves), the writer
sends a short state, the header with `KEEP_POOL` rows and no pool bytes, and a store merges it into the
last whole one (`merge_engine_state`): a step record stays ~1 kB at 64 requests, not ~4.5 kB."""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # snapshot stores merge states without the engine (batch_loop imports them)
    from ..batch_loop import BatchEngine
    from ..survival_pool import SurvivalPool

_HEAD = struct.Struct("<4sIII")  # dtype code, skipped, rows, width
_SUMS = struct.Struct("<ddI")  # the gate's expected_drafts, accepted_drafts, probe_interval
_OLD_SUMS = struct.Struct("<dd")  # a state written before the probe interval was saved
_DTYPE_CODES = {"<f4": b"f4\0\0", "<f8": b"f8\0\0"}
KEEP_POOL = 0xFFFFFFFF  # rows of a short state: the pool of the last whole state stands


class EngineStateWriter:
    """`engine_state` of one engine after each step, or None when it is what this writer returned last (a store
    keeps the last state it got); the pool is encoded again only when it changed (the gate's `pool_version`)."""

    def __init__(self) -> None:
        self._key: tuple[int, int] | None = None
        self._pool = (b"", 0, 0, b"")  # dtype code, rows, width, bytes
        self._skipped: tuple[int, int] | None = None  # the gate's skipped count and probe interval last sent

    def __call__(self, engine: BatchEngine) -> bytes | None:
        gate = engine.gate
        if gate is None:
            return None
        whole = self._key != (key := (id(gate), gate.pool_version))
        if whole:
            self._key, self._pool, self._skipped = key, _encode_pool(gate.pool, engine.info.block_size), None
        elif self._skipped == (gate.skipped, gate.probe_interval):
            return None
        self._skipped = (gate.skipped, gate.probe_interval)
        code, rows, width, data = self._pool
        sums = _SUMS.pack(gate.expected_drafts, gate.accepted_drafts, gate.probe_interval)
        if not whole:
            return _HEAD.pack(code, gate.skipped, KEEP_POOL, width) + sums
        return _HEAD.pack(code, gate.skipped, rows, width) + data + sums


def engine_state(engine: BatchEngine) -> bytes | None:
    """The gate's state as bytes (None without a gate): its skipped-step count and its pool."""
    return EngineStateWriter()(engine)


def is_short_state(state: bytes) -> bool:
    """Whether `state` is a short one (`KEEP_POOL`: the pool of the last whole state stands)."""
    return len(state) >= _HEAD.size and _HEAD.unpack_from(state)[2] == KEEP_POOL


def merge_engine_state(last: bytes | None, state: bytes) -> bytes:
    """The state to keep after `state` arrives, `last` the one kept before: a short state (`KEEP_POOL`) takes
    the pool of `last`; a whole one, or a short one with no whole one to merge into, stands as it is (a
    short one alone restores as a problem line and a fresh gate)."""
    if not is_short_state(state) or last is None or len(last) < _HEAD.size:
        return state
    code, skipped, _, width = _HEAD.unpack_from(state)
    last_code, _, rows, last_width = _HEAD.unpack_from(last)
    if rows == KEEP_POOL or (last_code, last_width) != (code, width):
        return state
    dtype = next((d for d, c in _DTYPE_CODES.items() if c == code), None)
    end = _HEAD.size + rows * width * int(dtype[-1]) if dtype is not None else len(last)
    return _HEAD.pack(code, skipped, rows, width) + last[_HEAD.size:end] + state[_HEAD.size:]


def _encode_pool(pool: SurvivalPool, width: int) -> tuple[bytes, int, int, bytes]:
    rows = pool.rows() if pool else np.zeros((0, width), np.float32)  # oldest first
    code = _DTYPE_CODES.get(rows.dtype.str)
    if code is None:
        rows, code = rows.astype(np.float64), _DTYPE_CODES["<f8"]
    return code, rows.shape[0], rows.shape[1], rows.tobytes()


def restore_engine_state(engine: BatchEngine, state: bytes | None) -> str | None:
    """Put a saved gate state into a fresh engine (nothing when either has no gate); a problem line when the
    state does not fit it (the gate then starts from its prior, as a fresh engine's does)."""
    gate = engine.gate
    if gate is None or not state:
        return None
    code, skipped, rows, width = _HEAD.unpack_from(state) if len(state) >= _HEAD.size else (b"", 0, 0, 0)
    dtype = next((d for d, c in _DTYPE_CODES.items() if c == code), None)
    end = _HEAD.size + rows * width * int(dtype[-1]) if dtype is not None else -1
    tails = {0: None, _OLD_SUMS.size: _OLD_SUMS, _SUMS.size: _SUMS}
    if dtype is None or width != engine.info.block_size or len(state) - end not in tails:
        return "the journal's drafting-gate state does not fit this engine (another model?); the gate starts afresh"
    pool = np.frombuffer(state, dtype, rows * width, _HEAD.size).reshape(rows, width)
    tail = tails[len(state) - end]
    expected, accepted, *interval = tail.unpack_from(state, end) if tail is not None else (0.0, 0.0)
    gate.expected_drafts, gate.accepted_drafts = expected, accepted
    gate.probe_interval = interval[0] if interval else gate.probe_every
    gate.pool.clear()
    gate.pool.extend(row.copy() for row in pool)
    gate.skipped, gate._candidates = skipped, None
    gate.pool_version += 1
    return None
