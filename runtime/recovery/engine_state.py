"""The engine's own scheduling state that a request's draws depend on, saved beside the snapshots: the
drafting gate's pool of recent survival rows, its count of steps without drafting, and its sums of expected
and accepted drafts (after the pool; a state written before they existed restores them as zero). Restored with the
requests' backlogs (`RunningRequest.fed`), the resumed engine's gate plans the steps the dead one would
have, so a seeded sampled request takes the same draws. (A live cost model learns from timings and the
async scheduler keeps confidences of earlier steps: neither is saved; with either, sampled requests are
not reproducible by seed even without a restart.)"""

from __future__ import annotations

import struct

import numpy as np

from ..batch_loop import BatchEngine

_HEAD = struct.Struct("<4sIII")  # dtype code, skipped, rows, width
_SUMS = struct.Struct("<dd")  # the gate's expected_drafts, accepted_drafts
_DTYPE_CODES = {"<f4": b"f4\0\0", "<f8": b"f8\0\0"}


class EngineStateWriter:
    """`engine_state` of one engine after each step, or None when it is what this writer returned last (a store
    keeps the last state it got); the pool is encoded again only when it changed (the gate's `pool_version`)."""

    def __init__(self) -> None:
        self._key: tuple[int, int] | None = None
        self._pool = (b"", 0, 0, b"")  # dtype code, rows, width, bytes
        self._skipped: int | None = None

    def __call__(self, engine: BatchEngine) -> bytes | None:
        gate = engine.gate
        if gate is None:
            return None
        if self._key != (key := (id(gate), gate.pool_version)):
            self._key, self._pool, self._skipped = key, _encode_pool(gate.pool, engine.info.block_size), None
        elif self._skipped == gate.skipped:
            return None
        self._skipped = gate.skipped
        code, rows, width, data = self._pool
        return _HEAD.pack(code, gate.skipped, rows, width) + data + _SUMS.pack(gate.expected_drafts,
                                                                               gate.accepted_drafts)


def engine_state(engine: BatchEngine) -> bytes | None:
    """The gate's state as bytes (None without a gate): its skipped-step count and its pool."""
    return EngineStateWriter()(engine)


def _encode_pool(pool, width: int) -> tuple[bytes, int, int, bytes]:
    rows = np.stack(pool) if pool else np.zeros((0, width), np.float32)
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
    if dtype is None or width != engine.info.block_size or len(state) not in (end, end + _SUMS.size):
        return "the journal's drafting-gate state does not fit this engine (another model?); the gate starts afresh"
    pool = np.frombuffer(state, dtype, rows * width, _HEAD.size).reshape(rows, width)
    gate.expected_drafts, gate.accepted_drafts = _SUMS.unpack_from(state, end) if len(state) > end else (0.0, 0.0)
    gate.pool.clear()
    gate.pool.extend(row.copy() for row in pool)
    gate.skipped, gate._candidates = skipped, None
    gate.pool_version += 1
    return None
