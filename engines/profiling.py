"""SPS profiling: time the target verification graph per (batch, token bucket) and drafting per batch.

For each batch size R and bucket B ≥ R the target graph runs on [R, ceil(B / R)] new tokens over
`past` cached positions (causal mask); drafting runs the backbone on [R, γ] over `past` cached
context rows with 1 + γ/2 new rows (a typical accepted prefix) plus the greedy head when the
drafter has one (the fused backbone where the engine has it: the runtime drafts with it). Each
point gets `warmup` untimed calls, then `repeats` timed calls, a row's points in rounds that run
them in the engine loop's order (`time_row`); the median is kept. The table is `CostTable` (see
cost_table.py). The machine's load while profiling (load average, CPU count) is recorded beside
it: on a shared CPU the numbers move with it.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone
from functools import partial
from statistics import median
from typing import Any

import numpy as np

from dspark.export import contract as C
from dspark.export.cost_table import CostTable
from dspark.runtime.backend import BoundCall, as_numpy

from .feeds import random_feeds

RunGraph = Callable[[str, Mapping[str, np.ndarray]], object]  # (graph, feeds) -> outputs
BindGraph = Callable[[str, Mapping[str, np.ndarray], Mapping[str, np.ndarray]], BoundCall]  # Backend.bind
# the graphs the runtime binds once and reruns, each present K/V written into its past buffer (target_runner.py,
# drafter_runner.py); the others it runs with fresh feeds and outputs
BOUND_GRAPHS = (C.TARGET_FUSED, C.TARGET_FUSED_PACKED, C.DRAFT_GREEDY_FUSED, C.BACKBONE_FUSED, C.HEAD_GREEDY)
IN_PLACE = {"present.": "past_key_values.", "present_context.": "past_context."}  # output prefix -> its input's


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
    bind: BindGraph | None = None,
) -> CostTable:
    """One `CostTable` for `target_graph` (C.TARGET, C.TARGET_STATIC, C.TARGET_FUSED or C.TARGET_FUSED_PACKED).

    A row (one R) is timed as the engine's loop runs its graphs (`time_row`): rows one after another,
    holding one row's feeds at a time."""
    verify, draft = [], []
    for r in batches:
        sizes = [b for b in buckets if b >= r]
        calls = [graph_call(run, bind, target_graph, random_feeds(
            specs[target_graph], target_sizes(target_graph, r, math.ceil(b / r), past), vocab_size=vocab_size,
            seed=r * 1000 + b)) for b in sizes]
        drafter = _draft_call(run, bind, specs, r, vocab_size, block_size, past)
        plain, verifying, drafting = time_row(calls[0], calls[1:], drafter, warmup=warmup, repeats=repeats)
        seconds = dict(zip(sizes, (plain, *verifying), strict=True))
        verify.append(tuple(seconds.get(b) for b in buckets))
        draft.append(drafting)
        if progress:
            progress(f"{target_graph} R={r}: " + ", ".join(f"B={b} {1e3 * seconds[b]:.2f} ms" for b in sizes)
                     + f", drafting {1e3 * drafting:.2f} ms")
    return CostTable(tuple(batches), tuple(buckets), tuple(verify), tuple(draft))


def time_row(plain: Callable[[], object], verifies: Sequence[Callable[[], object]], draft: Callable[[], object], *,
             warmup: int, repeats: int) -> tuple[float, list[float], float]:
    """Median seconds of one R's calls, each timed where the engine's loop runs it: a plain step's
    verification (`plain`, B = R) right after another, each longer verification right after a drafting
    call, and each drafting call right after a verification. Returns (plain, [verifies], drafting).

    Why in place: a graph's time depends on what ran before it. A drafter called back to back keeps its
    weights in the CPU's cache; in the loop a target step has evicted them. Demo engine, 2-core VM (32 MB
    L3 shared): the joined drafting graph took 0.55-0.63 ms called back to back and 0.91 ms in the
    engine's drafting steps, its 8-token verification 0.79-0.95 ms against 1.04; a plain step, which
    follows a plain step, 0.31-0.41 ms against 0.36-0.39. Timed apart, drafting looked ~1.3x cheaper than
    it was. Why in rounds: every round runs each call once, each starting the verifications one later,
    so a shared machine's load (which moves by 15-40 % here) moves a row's cells together, and a
    schedule is chosen on their ratios."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for call in (plain, *verifies, draft):
        for _ in range(warmup):
            call()

    def timed(call: Callable[[], object], into: list[float]) -> None:
        begin = time.perf_counter()
        call()
        into.append(time.perf_counter() - begin)

    plain_times: list[float] = []
    verify_times: list[list[float]] = [[] for _ in verifies]
    draft_times: list[float] = []
    for round_ in range(repeats):
        plain()  # a plain step follows a plain step
        timed(plain, plain_times)
        for k in range(len(verifies)):
            i = (k + round_) % len(verifies)
            timed(draft, draft_times)
            timed(verifies[i], verify_times[i])
        if not verifies:  # R at the largest bucket: no drafts fit, but drafting still follows a verification
            timed(draft, draft_times)
    return median(plain_times), [median(t) for t in verify_times], median(draft_times)


def graph_call(run: RunGraph, bind: BindGraph | None, graph: str, feeds: Mapping[str, np.ndarray]
               ) -> Callable[[], object]:
    """One graph on fixed feeds, called as the runtime calls it: a bound graph (`BOUND_GRAPHS`, given `bind`)
    once bound, its outputs in arrays made once and its present K/V written into its past buffers; else
    `run` with the feeds, its outputs allocated and copied out each call (on the demo engine at one
    request, 0.43-0.92 ms against 0.31-0.80 bound in place)."""
    if bind is None or graph not in BOUND_GRAPHS:
        return partial(run, graph, feeds)
    feeds = {name: np.ascontiguousarray(value) for name, value in feeds.items()}  # bound memory: one buffer each
    outputs = {}
    for name, value in run(graph, feeds).items():
        prefix = next((p for p in IN_PLACE if name.startswith(p)), None)
        outputs[name] = (feeds[IN_PLACE[prefix] + name[len(prefix):]] if prefix is not None
                         else np.empty_like(as_numpy(value)))
    return bind(graph, feeds, outputs).run


def _draft_call(run: RunGraph, bind: BindGraph | None, specs: Mapping[str, C.GraphSpec], batch: int,
                vocab_size: int, block: int, past: int) -> Callable[[], None]:
    # what the runtime drafts a greedy batch with: the joined graph (one call), else the backbone and the heads
    graph = next(g for g in (C.DRAFT_GREEDY_FUSED, C.BACKBONE_FUSED, C.BACKBONE) if g in specs)
    backbone = graph_call(run, bind, graph, random_feeds(specs[graph], drafter_sizes(batch, block, past),
                                                         vocab_size=vocab_size))
    head = None
    if C.HEAD_GREEDY in specs and graph != C.DRAFT_GREEDY_FUSED:
        head = graph_call(run, bind, C.HEAD_GREEDY, random_feeds(specs[C.HEAD_GREEDY], {"batch": batch},
                                                                 vocab_size=vocab_size))

    def call() -> None:
        backbone()
        if head is not None:
            head()

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
    bind: BindGraph | None = None,
) -> dict[str, Any]:
    """engine.json's `sps` section: one table per target graph present, plus how it was measured."""
    load_before = machine_load()
    begin = time.perf_counter()
    tables = {
        graph: measure_table(run, specs, target_graph=graph, vocab_size=vocab_size, block_size=block_size,
                             batches=batches, buckets=buckets, past=past, warmup=warmup, repeats=repeats,
                             progress=progress, bind=bind).to_dict()
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
