"""Single-stream speed: every system decodes the same prompts one at a time, greedy.

Our runtime runs three ways on the same loaded graphs: the DSpark prefix scheduler, fixed draft
lengths γ, and plain autoregressive decoding (scheduler `off`). Each system first decodes one
short warm-up request (sessions created, caches allocated), then every prompt is timed. Every
lossless system must reproduce the target's greedy tokens: each is compared prompt by prompt
against the reference and mismatches are reported (first differing position), not raised.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Any

from dspark.runtime.api import Runtime, RuntimeOptions
from dspark.runtime.prefix_scheduler import SchedulerConfig

from .peers import PeerUnavailable
from .timeline import System, Timeline, speed

WARMUP_TOKENS = 8


def load_runtime(runtime_dir: Path, *, threads: int) -> Runtime:
    """The loaded graphs and the scheduler's cost model (profiled at load), shared by every run."""
    return Runtime.load(runtime_dir, RuntimeOptions(max_requests=1), threads=threads)


def runtime_systems(base: Runtime, *, stop: int, max_seq_len: int,
                    fixed_gammas: Sequence[int] = (3, 7)) -> list[System]:
    """Scheduler, fixed γ and autoregressive systems on `base`'s backend and cost model."""
    name = f"dspark {version('dspark')}"

    def runner(config: SchedulerConfig) -> Callable[[list[int], int], Timeline]:
        options = RuntimeOptions(scheduler=config, max_requests=1, max_seq_len=max_seq_len)
        runtime = Runtime(base.backend, base.info, options, cost_model=base.cost_model)

        def generate(prompt: list[int], max_new_tokens: int) -> Timeline:
            timeline = Timeline()
            for chunk in runtime.stream(prompt, max_new_tokens=max_new_tokens, stop=(stop,)):
                timeline.deliver(chunk)
            return timeline

        return generate

    gamma = base.info.block_size
    systems = []
    if base.info.has_confidence:
        systems.append(System("dspark scheduler", name, runner(SchedulerConfig("dspark"))))
    for g in sorted({min(g, gamma) for g in fixed_gammas}):
        systems.append(System(f"dspark fixed γ={g}", name, runner(SchedulerConfig("fixed", fixed_length=g))))
    systems.append(System("dspark autoregressive", name, runner(SchedulerConfig("off"))))
    return systems


def first_difference(got: Sequence[int], want: Sequence[int]) -> int | None:
    """Index of the first differing token (or the shorter length), None when equal."""
    for i, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            return i
    return None if len(got) == len(want) else min(len(got), len(want))


def greedy_check(outputs: Sequence[Sequence[int]], reference: Sequence[Sequence[int]]) -> dict[str, Any]:
    """Per prompt: equal to the reference greedy tokens, or where it first differs."""
    mismatches = []
    for i, (got, want) in enumerate(zip(outputs, reference, strict=True)):
        at = first_difference(got, want)
        if at is not None:
            mismatches.append({"prompt": i, "first_difference": at, "got": list(got[at:at + 4]),
                               "expected": list(want[at:at + 4])})
    return {"equal": not mismatches, "mismatches": mismatches}


def run_system(system: System, prompts: Sequence[list[int]], max_new_tokens: int,
               reference: Sequence[Sequence[int]] | None) -> dict[str, Any]:
    """Warm up, time every prompt, check greedy equality. Unavailable peers and failures are
    recorded as the row's status instead of stopping the bench."""
    row: dict[str, Any] = {"system": system.name, "runtime": system.runtime, "lossless": system.lossless}
    try:
        system.generate(prompts[0], min(WARMUP_TOKENS, max_new_tokens))
        timelines = [system.generate(p, max_new_tokens) for p in prompts]
    except PeerUnavailable as exc:
        return {**row, "status": str(exc)}
    except Exception as exc:  # a peer's own error: reported in the results, the bench goes on
        return {**row, "status": f"failed: {type(exc).__name__}: {exc}"}
    row.update(status="ok", **speed(timelines))
    row["outputs"] = [t.tokens for t in timelines]
    if reference is not None and system.lossless:
        row["greedy_check"] = greedy_check(row["outputs"], reference)
    return row
