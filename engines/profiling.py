"""SPS profiling: time the target verification graph per (batch, token bucket) and drafting per batch.

For each batch size R and bucket B ≥ R the target graph runs on [R, ceil(B / R)] new tokens over
`past` cached positions (causal mask); drafting runs the backbone on [R, γ] over `past` cached
context rows with 1 + γ/2 new rows (a typical accepted prefix) plus the greedy head when the
drafter has one (the fused backbone where the engine has it: the runtime drafts with it). Each
point gets `warmup` untimed calls, then `repeats` timed calls, a row's points in interleaved
rounds; the median is kept. The table is `CostTable` (see cost_table.py). The machine's load while profiling
(load average, CPU count) is recorded beside it: on a shared CPU the numbers move with it.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone
from functools import partial
from typing import Any

import numpy as np

from dspark.export import contract as C
from dspark.export.cost_table import CostTable
from dspark.runtime.cost_model import time_interleaved

from .feeds import random_feeds

RunGraph = Callable[[str, Mapping[str, np.ndarray]], object]  # (graph, feeds) -> outputs


def profile_batches(max_batch: int) -> tuple[int, ...]:
    """Powers of two up to `max_batch`, and `max_batch` itself."""
    out, r = [], 1
    while r < max_batch:
        out.append(r)
        r *= 2
    return (*out, max_batch)


def target_sizes(graph: str, batch: int, tokens: int, past: int) -> dict[str, int]:
    if graph == C.TARGET_STATIC:
        return {"batch": batch, "tokens": tokens, "capacity": past}
    if graph == C.TARGET_FUSED:  # the shared past/present buffer holds the past and the new tokens
        return {"batch": batch, "tokens": tokens, "past": past, "capacity": past + tokens}
    if graph == C.TARGET_FUSED_PACKED:  # every token real: B = R·W packed tokens, logits at each
        return {"batch": batch, "tokens": tokens, "past": past, "capacity": past + tokens,
                "packed_tokens": batch * tokens, "logit_tokens": batch * tokens}
    return {"batch": batch, "tokens": tokens, "past": past}


def drafter_sizes(batch: int, block: int, past: int) -> dict[str, int]:
    context = 1 + block // 2
    return {"batch": batch, "context_tokens": context, "context_past": past,
            "block_total": past + context + block, "tokens": context, "past": past, "capacity": past + context}


def measure_table(
    run: RunGraph,
    specs: Mapping[str, C.GraphSpec],
    *,
    target_graph: str,
    vocab_size: int,
    block_size: int,
    batches: Sequence[int],
    buckets: Sequence[int],
    past: int,
    warmup: int = 2,
    repeats: int = 5,
    progress: Callable[[str], None] | None = None,
) -> CostTable:
    """One `CostTable` for `target_graph` (C.TARGET, C.TARGET_STATIC, C.TARGET_FUSED or C.TARGET_FUSED_PACKED).

    A row (one R: every bucket's verification and the drafting) is timed in interleaved rounds
    (`time_interleaved`), so that the load of a shared machine moves its cells together: a schedule is
    chosen on their ratios. Rows are timed one after another, holding one row's feeds at a time."""
    verify, draft = [], []
    for r in batches:
        sizes = [b for b in buckets if b >= r]
        calls = [partial(run, target_graph, random_feeds(specs[target_graph],
                                                           target_sizes(target_graph, r, math.ceil(b / r), past),
                                                           vocab_size=vocab_size, seed=r * 1000 + b))
                 for b in sizes]
        calls.append(_draft_call(run, specs, r, vocab_size, block_size, past))
        seconds = dict(zip((*sizes, None), time_interleaved(calls, warmup=warmup, repeats=repeats), strict=True))
        verify.append(tuple(seconds.get(b) for b in buckets))
        draft.append(seconds[None])
        if progress:
            progress(f"{target_graph} R={r}: " + ", ".join(f"B={b} {1e3 * seconds[b]:.2f} ms" for b in sizes)
                     + f", drafting {1e3 * seconds[None]:.2f} ms")
    return CostTable(tuple(batches), tuple(buckets), tuple(verify), tuple(draft))


def _draft_call(run: RunGraph, specs: Mapping[str, C.GraphSpec], batch: int, vocab_size: int,
                block: int, past: int) -> Callable[[], None]:
    # what the runtime drafts a greedy batch with: the joined graph (one call), else the backbone and the heads
    graph = next(g for g in (C.DRAFT_GREEDY_FUSED, C.BACKBONE_FUSED, C.BACKBONE) if g in specs)
    backbone = random_feeds(specs[graph], drafter_sizes(batch, block, past), vocab_size=vocab_size)
    head = None
    if C.HEAD_GREEDY in specs and graph != C.DRAFT_GREEDY_FUSED:
        head = random_feeds(specs[C.HEAD_GREEDY], {"batch": batch}, vocab_size=vocab_size)

    def call() -> None:
        run(graph, backbone)
        if head is not None:
            run(C.HEAD_GREEDY, head)

    return call


def machine_load() -> dict[str, Any]:
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return {"cpu_count": os.cpu_count(), "loadavg_1m": round(load[0], 2), "loadavg_5m": round(load[1], 2)}


def profile_section(
    run: RunGraph,
    specs: Mapping[str, C.GraphSpec],
    *,
    vocab_size: int,
    block_size: int,
    batches: Sequence[int],
    buckets: Sequence[int],
    past: int,
    warmup: int = 2,
    repeats: int = 5,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """engine.json's `sps` section: one table per target graph present, plus how it was measured."""
    load_before = machine_load()
    begin = time.perf_counter()
    tables = {
        graph: measure_table(run, specs, target_graph=graph, vocab_size=vocab_size, block_size=block_size,
                             batches=batches, buckets=buckets, past=past, warmup=warmup, repeats=repeats,
                             progress=progress).to_dict()
        for graph in (C.TARGET, C.TARGET_STATIC, C.TARGET_FUSED, C.TARGET_FUSED_PACKED)
        if graph in specs
    }
    return {
        "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "past": past,
        "warmup": warmup,
        "repeats": repeats,
        "statistic": "median",
        "load_before": load_before,
        "load_after": machine_load(),
        "seconds": round(time.perf_counter() - begin, 2),
        "tables": tables,
    }
