"""What recording request snapshots into the Ray snapshot keeper costs an engine replica per step.

    python -m dspark.tools.keeper_bench [--engine DIR] [--requests 64] [--steps 24] [--temperature 1.0]

A local Ray (one CPU) runs the keeper actor; `requests` requests decode together on the engine (default:
the demo engine), in this process as in a replica. Per decode step: the step's time, and the time the loop
thread spends recording it (StepRecorder building the records, then the store's `stepped`): into a
KeeperStore that queues for its sender thread (the replica's default), one that sends from the loop thread,
and no store. Runs alternate (none, background, foreground, twice); medians over each mode's steps.
The background sender's own work (pickling, Ray's submit: "send us/batch", a batch being what queued while
it sent the last) runs beside the loop, on the same GIL: it shows in the step times, not the record times.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import click
import numpy as np

from .errors import OneLineErrors

_DIR = click.Path(exists=True, file_okay=False, path_type=Path)


def _run(runtime, store, requests: int, steps: int, temperature: float) -> tuple[list[float], list[float], float]:
    from dspark.runtime.recovery.recorder import StepRecorder
    from dspark.runtime.recovery.snapshot import RequestSpec

    rng = np.random.default_rng(0)
    engine = runtime.engine()
    recorder = StepRecorder(store) if store is not None else None
    for i in range(requests):
        prompt = rng.integers(1, min(runtime.info.vocab_size, 4000), size=64).tolist()
        rid = engine.submit(prompt, max_new_tokens=8 * steps + 16, temperature=temperature, seed=i)
        if recorder is not None:
            store.submitted(RequestSpec(f"r{i}", prompt, 8 * steps + 16, temperature, i))
            recorder.track(rid, f"r{i}")
    engine.step()  # admission and prefill: not a decode step
    step_s, record_s = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        t1 = time.perf_counter()
        done = engine.take_finished()
        if recorder is not None:
            recorder.record(engine, done)
        step_s.append(t1 - t0)
        record_s.append(time.perf_counter() - t1)
    if store is None:
        return step_s, record_s, 0.0
    store.close(drop=False)
    return step_s, record_s, store.send_seconds / max(store.sent_batches, 1)


@click.command("keeper-bench", cls=OneLineErrors)
@click.option("--engine", "engine_dir", type=_DIR, help="Engine or export directory (default: the demo engine).")
@click.option("--requests", default=64, show_default=True, type=click.IntRange(min=1))
@click.option("--steps", default=24, show_default=True, type=click.IntRange(min=4))
@click.option("--temperature", default=1.0, show_default=True, type=click.FloatRange(min=0))
def main(engine_dir, requests, steps, temperature) -> None:
    """Print the keeper's recording cost per decode step."""
    import ray

    from dspark.runtime.api import Runtime, RuntimeOptions
    from dspark.runtime.cluster.snapshot_keeper import KeeperStore, SnapshotKeeper

    if engine_dir is None:
        from .demo_engine import demo_engine_dir

        engine_dir = demo_engine_dir()
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        keeper = ray.remote(SnapshotKeeper).options(num_cpus=0).remote()
        options = RuntimeOptions(max_requests=requests, max_seq_len=64 + 8 * steps + 96, live_cost=False)
        with Runtime.load(engine_dir, options) as runtime:
            modes = {"none": lambda: None,
                     "background": lambda: KeeperStore(keeper, "bench", get=ray.get),
                     "foreground": lambda: KeeperStore(keeper, "bench", get=ray.get, background=False)}
            times: dict[str, tuple[list[float], list[float], list[float]]] = {m: ([], [], []) for m in modes}
            for mode in [*modes, *modes]:
                step_s, record_s, send_s = _run(runtime, modes[mode](), requests, steps, temperature)
                times[mode][0].extend(step_s)
                times[mode][1].extend(record_s)
                times[mode][2].append(send_s)
            stats = ray.get(keeper.stats.remote())
        click.echo(f"{requests} requests, T={temperature}, {steps} decode steps a run, 2 runs a mode; keeper: "
                   f"{stats['records']} records applied")
        click.echo(f"{'mode':>10} {'step ms':>8} {'record us':>10} {'min us':>7} {'% step':>7} {'send us/batch':>14}")
        for mode, (step_s, record_s, send_s) in times.items():
            step, record = statistics.median(step_s), statistics.median(record_s)
            click.echo(f"{mode:>10} {step * 1e3:>8.2f} {record * 1e6:>10.0f} {min(record_s) * 1e6:>7.0f} "
                       f"{100 * record / step:>6.2f}% {statistics.mean(send_s) * 1e6:>14.0f}")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
