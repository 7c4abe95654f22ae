"""A system under test, per-token timestamps of one generation, and the speeds derived from them.

Every system reports the same thing: the wall-clock start, and after each chunk of tokens it
delivers (one token for a plain loop, several for a speculative round) the time and the count
so far. From that: tokens/s over the whole request (prefill included), time to first token,
and the mean latency between tokens after the first.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Timeline:
    start: float = field(default_factory=time.perf_counter)
    times: list[float] = field(default_factory=list)  # when each chunk arrived
    counts: list[int] = field(default_factory=list)  # tokens delivered so far, after each chunk
    tokens: list[int] = field(default_factory=list)
    counters: dict[str, float] = field(default_factory=dict)  # what the system itself reports (drafts accepted)

    def deliver(self, new_tokens: list[int]) -> None:
        if new_tokens:
            self.tokens += new_tokens
            self.times.append(time.perf_counter())
            self.counts.append(len(self.tokens))

    @property
    def seconds(self) -> float:
        return self.times[-1] - self.start if self.times else 0.0

    @property
    def first_token_seconds(self) -> float:
        return self.times[0] - self.start if self.times else 0.0

    @property
    def inter_token_seconds(self) -> float | None:
        """Mean seconds per token after the first chunk (None with a single chunk)."""
        later = self.counts[-1] - self.counts[0] if self.counts else 0
        return (self.times[-1] - self.times[0]) / later if later else None


def speed(timelines: list[Timeline]) -> dict[str, float | None]:
    """Aggregate over requests run one after another: total tokens / total seconds, and means."""
    tokens = sum(len(t.tokens) for t in timelines)
    seconds = sum(t.seconds for t in timelines)
    inter = [t.inter_token_seconds for t in timelines if t.inter_token_seconds is not None]
    decode_tokens = sum(t.counts[-1] - t.counts[0] for t in timelines if t.counts)
    decode_seconds = sum(t.times[-1] - t.times[0] for t in timelines if t.times)
    return {
        "tokens": tokens,
        "seconds": round(seconds, 4),
        "tokens_per_second": round(tokens / seconds, 2) if seconds else None,
        "first_token_ms": round(1e3 * sum(t.first_token_seconds for t in timelines) / len(timelines), 3),
        "per_token_ms": round(1e3 * sum(inter) / len(inter), 3) if inter else None,
        # decode alone: tokens after each request's first chunk over the time after it (prefill and
        # per-request set-up, such as creating a generator, are in first_token_ms)
        "decode_tokens_per_second": round(decode_tokens / decode_seconds, 2) if decode_seconds else None,
    }


@dataclass(frozen=True)
class System:
    """One way to decode a prompt: `generate(prompt_ids, max_new_tokens)` -> its Timeline."""

    name: str
    runtime: str  # what runs it, with its version: "dspark 0.1.0", "transformers 5.2.0", ...
    generate: Callable[[list[int], int], Timeline]
    lossless: bool = True  # must reproduce the target's greedy tokens
