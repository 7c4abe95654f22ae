"""Single-stream speed: every system decodes the same prompts one at a time, greedy.

Our runtime runs three ways on the same loaded graphs: the DSpark prefix scheduler, fixed draft
lengths γ, and plain autoregressive decoding (scheduler `off`). Each system first decodes one
short warm-up request (sessions created, caches allocated); then each prompt is decoded by
every system in turn, so drifting load on a shared machine hits all systems alike, in an order
shuffled prompt by prompt (seeded): a system that runs right after onnxruntime-genai's finds the
machine's caches full of its work, and in a fixed or rotated order that was always the same system
(measured: the dspark scheduler's first token took 12.5 ms there against 9.0 ms elsewhere, its
prefill 6.3 ms against 4.6, with the same graph calls). Every
lossless system must reproduce the target's greedy tokens: each is compared prompt by prompt
against the reference and mismatches are reported (first differing position), not raised.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Any

from tqdm import tqdm

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
        systems.append(System("dspark scheduler, no prompt lookup", name,
                              runner(SchedulerConfig("dspark", prompt_lookup=0))))
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


def summed_counters(timelines: Sequence[Timeline]) -> dict[str, float]:
    """Each counter a system reported, summed over its timed requests (warm-up excluded)."""
    total: dict[str, float] = {}
    for timeline in timelines:
        for key, value in timeline.counters.items():
            total[key] = total.get(key, 0) + value
    return total


def run_systems(systems: Sequence[System], prompts: Sequence[list[int]], max_new_tokens: int,
                reference: Sequence[Sequence[int]] | None, *, progress: bool = False,
                rounds: int = 1) -> list[dict[str, Any]]:
    """Warm every system up, then time prompt by prompt, each prompt on every system in turn
    (so a change in the shared machine's load hits all systems alike), `rounds` times over, then
    check greedy equality (every round's outputs). A row's speed is its median round's, with every
    round's tokens/s in `tokens_per_second_runs` (round i of every system ran in the same stretch of
    time). Unavailable peers and failures are the row's status, not the bench's end."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    rows = {s.name: {"system": s.name, "runtime": s.runtime, "lossless": s.lossless} for s in systems}
    timelines: dict[str, list[list[Timeline]]] = {s.name: [[] for _ in range(rounds)] for s in systems}
    live = list(systems)

    def attempt(system: System, prompt: list[int], new_tokens: int) -> Timeline | None:
        try:
            return system.generate(prompt, new_tokens)
        except PeerUnavailable as exc:
            rows[system.name]["status"] = str(exc)
        except Exception as exc:  # a peer's own error: reported in the results, the bench goes on
            rows[system.name]["status"] = f"failed: {type(exc).__name__}: {exc}"
        live.remove(system)
        return None

    for system in list(live):
        attempt(system, prompts[0], min(WARMUP_TOKENS, max_new_tokens))
    jobs = [(r, prompt) for r in range(rounds) for prompt in prompts]
    for j, (r, prompt) in enumerate(tqdm(jobs, desc="single stream", unit="prompt", disable=not progress)):
        for system in random.Random(j).sample(live, len(live)):  # module docstring: who follows whom
            timeline = attempt(system, prompt, max_new_tokens)
            if timeline is not None:
                timelines[system.name][r].append(timeline)
    for system in live:
        row, runs = rows[system.name], [speed(t) for t in timelines[system.name]]
        middle = sorted(range(rounds), key=lambda i: runs[i]["tokens_per_second"] or 0.0)[(rounds - 1) // 2]
        row.update(status="ok", **runs[middle], tokens_per_second_runs=[run["tokens_per_second"] for run in runs])
        row["outputs"] = [t.tokens for t in timelines[system.name][0]]
        counters = summed_counters(timelines[system.name][0])  # the first round: one pass over the prompts
        if counters:
            row["counters"] = counters
        if reference is not None and system.lossless:
            every = [t.tokens for r in range(rounds) for t in timelines[system.name][r]]
            row["greedy_check"] = greedy_check(every, [*reference] * rounds)
    return list(rows.values())


def run_system(system: System, prompts: Sequence[list[int]], max_new_tokens: int,
               reference: Sequence[Sequence[int]] | None) -> dict[str, Any]:
    return run_systems([system], prompts, max_new_tokens, reference)[0]
