"""Self-delimiting, checksummed records in an append-only byte stream.

A frame is `MAGIC (4) | length (4, little endian) | crc32 of length+payload (4) | payload`. A reader
takes every frame whose checksum holds; where one does not (a torn write at the tail, a flipped bit in
the middle) it scans forward to the next MAGIC whose frame checks out, so one bad record costs only
itself, and a truncated tail costs only the record it cut.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

MAGIC = b"\xd5\x9a\x4b\x7e"
_HEADER = struct.Struct("<4sII")
_LENGTH = struct.Struct("<I")
HEADER_SIZE = _HEADER.size
MAX_PAYLOAD = 1 << 30  # a length beyond this is a corrupt header, not a record


def frame_header(payload: bytes) -> bytes:
    """The 12 bytes that go before `payload` in its frame."""
    size = len(payload)
    return _HEADER.pack(MAGIC, size, zlib.crc32(payload, zlib.crc32(_LENGTH.pack(size))))


def frame(payload: bytes) -> bytes:
    return frame_header(payload) + payload


@dataclass(frozen=True)
class Damage:
    """A stretch of bytes that held no whole record: where it starts, how long, and why."""

    offset: int
    length: int
    reason: str  # "truncated" (the stream ends inside a record) or "corrupt" (a checksum or header is wrong)


@dataclass
class ScanResult:
    payloads: list[bytes]
    damage: list[Damage]


def scan(data: bytes | memoryview) -> ScanResult:
    """Every whole frame's payload in order, and the damaged stretches between and after them."""
    data = memoryview(data)
    payloads: list[bytes] = []
    damage: list[Damage] = []
    bad_from = None
    for start, payload, reason in _frames(data):
        if payload is None:
            if bad_from is None:
                bad_from = start
            if reason == "truncated":
                damage.append(Damage(bad_from, len(data) - bad_from, reason))
                return ScanResult(payloads, damage)
            continue
        if bad_from is not None:
            damage.append(Damage(bad_from, start - bad_from, "corrupt"))
            bad_from = None
        payloads.append(payload)
    if bad_from is not None:
        damage.append(Damage(bad_from, len(data) - bad_from, "corrupt"))
    return ScanResult(payloads, damage)


def _frames(data: memoryview) -> Iterator[tuple[int, bytes | None, str]]:
    """(offset, payload or None, reason) for each candidate frame; after a bad one, the next MAGIC."""
    raw = data.obj if isinstance(data.obj, bytes) else bytes(data)
    pos, end = 0, len(data)
    while pos < end:
        if end - pos < HEADER_SIZE:
            yield pos, None, "truncated" if raw.startswith(MAGIC[: end - pos], pos) else "corrupt"
            return
        magic, length, crc = _HEADER.unpack_from(raw, pos)
        body = pos + HEADER_SIZE
        if magic == MAGIC and length <= MAX_PAYLOAD and body + length > end:
            nxt = raw.find(MAGIC, pos + 1)
            if nxt < 0:  # nothing after it: a torn last write
                yield pos, None, "truncated"
                return
        elif (magic == MAGIC and length <= MAX_PAYLOAD
              and zlib.crc32(raw[body : body + length], zlib.crc32(raw[pos + 4 : pos + 8])) == crc):
            yield pos, raw[body : body + length], ""
            pos = body + length
            continue
        nxt = raw.find(MAGIC, pos + 1)
        yield pos, None, "corrupt"
        if nxt < 0:
            return
        pos = nxt
