"""What request snapshots and recovery cost, on a real engine (default: the bundled demo engine).

    python -m dspark.tools.recovery_bench [--engine DIR] [--requests 1,64] [--context 1024] [--steps 24]

snapshot  64 requests decode together (sampled at T=1, so every row has an RNG state to record, the
          worst case; and greedy); each step is timed, then the snapshot of that step (StepRecorder into
          a JournalStore under each fsync policy): µs per step and % of the step, median and min over
          the steps of one interleaved run.
recovery  R requests with ~`context`-token contexts run, journaled, until each holds `generated` tokens;
          the engine is dropped (as if its process were killed) and a fresh one resumes from the journal
          alone: ms to read the journal, to resubmit, and for the first step (the re-prefill of
          prompt + committed tokens, then one decode step): the next token. Tokens re-prefilled are
          counted. The resumed tokens are checked against the uninterrupted engine's (greedy rows).
Process start and engine load (what a restarted server pays before this) are timed once, apart.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path

import click
import numpy as np

from .errors import OneLineErrors

_DIR = click.Path(exists=True, file_okay=False, path_type=Path)


def _prompts(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, min(vocab, 4000), size=length).tolist() for _ in range(count)]


def snapshot_cost(runtime, requests: int, steps: int, temperature: float, fsync: str) -> dict:
    from dspark.runtime.recovery.journal import JournalStore
    from dspark.runtime.recovery.recorder import StepRecorder
    from dspark.runtime.recovery.snapshot import RequestSpec

    folder = Path(tempfile.mkdtemp(prefix="dspark-journal-"))
    store = JournalStore(folder, fsync=fsync)
    store.recover()
    recorder, engine = StepRecorder(store), runtime.engine()
    for i, prompt in enumerate(_prompts(requests, 64, runtime.info.vocab_size)):
        store.submitted(RequestSpec(f"r{i}", prompt, 8 * steps, temperature, i))
        recorder.track(engine.submit(prompt, max_new_tokens=8 * steps, temperature=temperature, seed=i), f"r{i}")
    step_s, record_s = [], []
    engine.step()  # admission and prefill: not a decode step
    recorder.record(engine, engine.take_finished())
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        t1 = time.perf_counter()
        recorder.record(engine, engine.take_finished())
        t2 = time.perf_counter()
        step_s.append(t1 - t0)
        record_s.append(t2 - t1)
    size = sum(p.stat().st_size for p in folder.glob("journal-*"))
    store.close()
    shutil.rmtree(folder, ignore_errors=True)
    med_step, med_rec = statistics.median(step_s), statistics.median(record_s)
    return {"requests": requests, "temperature": temperature, "fsync": fsync, "step_ms": med_step * 1e3,
            "snapshot_us": med_rec * 1e6, "snapshot_min_us": min(record_s) * 1e6,
            "percent": 100 * med_rec / med_step, "bytes_per_step": size / (steps + 1)}


def recovery_time(runtime, requests: int, context: int, generated: int) -> dict:
    from dspark.runtime.recovery.journal import JournalStore
    from dspark.runtime.recovery.recorder import StepRecorder
    from dspark.runtime.recovery.snapshot import RequestSpec

    folder = Path(tempfile.mkdtemp(prefix="dspark-journal-"))
    store = JournalStore(folder)
    store.recover()
    recorder, engine = StepRecorder(store), runtime.engine()
    max_new = generated + 64
    ids = {}
    for i, prompt in enumerate(_prompts(requests, context - generated, runtime.info.vocab_size, seed=1)):
        temperature = 0.0 if i % 2 == 0 else 1.0
        store.submitted(RequestSpec(f"r{i}", prompt, max_new, temperature, i))
        ids[f"r{i}"] = engine.submit(prompt, max_new_tokens=max_new, temperature=temperature, seed=i)
        recorder.track(ids[f"r{i}"], f"r{i}")
    while min(len(engine.tokens_so_far(r)) for r in ids.values()) < generated:
        engine.step()
        recorder.record(engine, engine.take_finished())
    store.close()  # the process "dies" here: the journal is all that is left of its requests
    t0 = time.perf_counter()
    store = JournalStore(folder)
    recovered = store.recover()
    t1 = time.perf_counter()
    resumed = runtime.engine()
    new_ids = {}
    for snap in recovered.running:
        s = snap.spec
        new_ids[s.key] = resumed.submit(s.prompt_ids, max_new_tokens=s.max_new_tokens, temperature=s.temperature,
                                        seed=s.seed, resume_from=snap)
    t2 = time.perf_counter()
    resumed.step()
    t3 = time.perf_counter()
    store.close()
    shutil.rmtree(folder, ignore_errors=True)
    engine.step()  # the uninterrupted engine's next step, for the greedy rows' check
    same = all(engine.tokens_so_far(ids[k])[: len(resumed.tokens_so_far(new_ids[k]))]
               == resumed.tokens_so_far(new_ids[k]) for k in ids if int(k[1:]) % 2 == 0)
    prefilled = sum(len(s.spec.prompt_ids) + len(s.tokens) - 1 for s in recovered.running)
    return {"requests": requests, "resumed": len(recovered.running), "context": context,
            "read_ms": (t1 - t0) * 1e3, "resubmit_ms": (t2 - t1) * 1e3, "first_step_ms": (t3 - t2) * 1e3,
            "to_next_token_ms": (t3 - t0) * 1e3, "tokens_prefilled": prefilled, "greedy_rows_identical": same}


@click.command("recovery-bench", cls=OneLineErrors)
@click.option("--engine", "engine_dir", type=_DIR, help="Engine or export directory (default: the demo engine).")
@click.option("--requests", default="1,64", show_default=True, help="In-flight requests at the kill.")
@click.option("--context", default=1024, show_default=True, type=click.IntRange(min=16),
              help="Tokens in each request's context at the kill (prompt + generated).")
@click.option("--generated", default=32, show_default=True, type=click.IntRange(min=1),
              help="Tokens each request generates before the kill.")
@click.option("--steps", default=24, show_default=True, type=click.IntRange(min=4),
              help="Decode steps timed for the snapshot cost.")
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(min=1),
              help="Recovery runs per request count (min and median shown).")
def main(engine_dir, requests, context, generated, steps, repeats) -> None:
    """Print snapshot cost per step and recovery time to the next token."""
    from dspark.runtime.api import Runtime, RuntimeOptions

    counts = [int(c) for c in requests.split(",")]
    if engine_dir is None:
        from .demo_engine import demo_engine_dir

        engine_dir = demo_engine_dir()
    t0 = time.perf_counter()
    length = max(context + generated + 96, 64 + 8 * steps + 96)
    options = RuntimeOptions(max_requests=max(64, *counts), max_seq_len=length, live_cost=False)
    with Runtime.load(engine_dir, options) as runtime:
        load_s = time.perf_counter() - t0
        click.echo(f"engine {engine_dir}: loaded in {load_s * 1e3:.0f} ms (a restarted server pays this first)")
        click.echo("\nsnapshot cost per decode step (median over the steps; min beside it)")
        click.echo(f"{'requests':>8} {'T':>4} {'fsync':>8} {'step ms':>8} {'snap us':>8} {'min us':>7} "
                   f"{'% step':>7} {'bytes/step':>10}")
        for temperature in (1.0, 0.0):
            for fsync in ("interval", "step"):
                r = snapshot_cost(runtime, 64, steps, temperature, fsync)
                click.echo(f"{r['requests']:>8} {temperature:>4} {fsync:>8} {r['step_ms']:>8.2f} "
                           f"{r['snapshot_us']:>8.0f} {r['snapshot_min_us']:>7.0f} {r['percent']:>6.2f}% "
                           f"{r['bytes_per_step']:>10.0f}")
        click.echo(f"\nrecovery: engine dropped with {generated} tokens generated per request, context {context}; "
                   f"fresh engine from the journal (min / median of {repeats})")
        click.echo(f"{'requests':>8} {'read ms':>8} {'resubmit':>8} {'1st step':>9} {'to next token ms':>17} "
                   f"{'re-prefilled':>12} {'greedy same':>11}")
        for count in counts:
            runs = [recovery_time(runtime, count, context, generated) for _ in range(repeats)]
            best = min(runs, key=lambda r: r["to_next_token_ms"])
            med = statistics.median(r["to_next_token_ms"] for r in runs)
            click.echo(f"{count:>8} {best['read_ms']:>8.1f} {best['resubmit_ms']:>8.1f} {best['first_step_ms']:>9.1f} "
                       f"{best['to_next_token_ms']:>8.1f} / {med:<7.1f} {best['tokens_prefilled']:>12} "
                       f"{all(r['greedy_rows_identical'] for r in runs)!s:>11}")


if __name__ == "__main__":
    main()
