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
          counted. The tokens of the resumed engine's first step are checked against the uninterrupted
          engine's next step (common prefix; greedy rows, and seeded sampled rows: these agree when the
          resumed engine restored the drafting gate's state, as the server does, see docs/recovery.md).
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
    from dspark.runtime.recovery.engine_state import restore_engine_state
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
    done: dict = {}  # requests that finished before the kill (with a short max or a fast acceptance) are not resumed
    while not engine.idle and min(len(done[r].tokens) if r in done else len(engine.tokens_so_far(r))
                                  for r in ids.values()) < generated:
        engine.step()
        finished = engine.take_finished()
        done.update(finished)
        recorder.record(engine, finished)
    store.close()  # the process "dies" here: the journal is all that is left of its requests
    t0 = time.perf_counter()
    store = JournalStore(folder)
    recovered = store.recover()
    t1 = time.perf_counter()
    resumed = runtime.engine()
    problem = restore_engine_state(resumed, recovered.engine_state)  # as EngineService does before resuming
    if problem:
        raise click.ClickException(problem)
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
    engine.step()  # the uninterrupted engine's next step: the common prefix of the two must agree
    same = {parity: all(_agree(engine.tokens_so_far(ids[k]), resumed.tokens_so_far(new_ids[k]))
                        for k in new_ids if int(k[1:]) % 2 == parity) for parity in (0, 1)}
    prefilled = sum(len(s.spec.prompt_ids) + len(s.tokens) - 1 for s in recovered.running)
    return {"requests": requests, "resumed": len(recovered.running), "context": context,
            "read_ms": (t1 - t0) * 1e3, "resubmit_ms": (t2 - t1) * 1e3, "first_step_ms": (t3 - t2) * 1e3,
            "to_next_token_ms": (t3 - t0) * 1e3, "tokens_prefilled": prefilled, "greedy_same": same[0],
            "sampled_same": same[1]}


def _agree(a: list[int], b: list[int]) -> bool:
    n = min(len(a), len(b))
    return a[:n] == b[:n]


def tier_run(runtime, slots: int, host_tokens: int, requests: int, new_tokens: int, quantum: int) -> dict:
    """`requests` greedy requests on `slots` device slots, with a host tier of `host_tokens` positions (0: none)."""
    from dspark.runtime.kv_tiers import HostTier

    engine = runtime.engine()
    engine.tiers = HostTier(host_tokens, quantum) if host_tokens else None
    ids = [engine.submit(p, max_new_tokens=new_tokens) for p in _prompts(requests, 32, runtime.info.vocab_size, 2)]
    held, t0 = 0, time.perf_counter()
    while not engine.idle:
        engine.step()
        held = max(held, len(engine.active) + (len(engine.tiers.swapped) if engine.tiers else 0))
    seconds = time.perf_counter() - t0
    done = engine.take_finished()
    stats = engine.tiers.stats if engine.tiers else None
    return {"held": held, "seconds": seconds, "tokens": [done[i].tokens for i in ids], "stats": stats}


@click.command("recovery-bench", cls=OneLineErrors)
@click.option("--engine", "engine_dir", type=_DIR, help="Engine or export directory (default: the demo engine).")
@click.option("--requests", default="1,64", show_default=True, help="In-flight requests at the kill.")
@click.option("--context", default=1024, show_default=True, type=click.IntRange(min=16),
              help="Tokens in each request's context at the kill (prompt + generated).")
@click.option("--generated", default=32, show_default=True, type=click.IntRange(min=1),
              help="Tokens each request generates before the kill.")
@click.option("--steps", default=24, show_default=True, type=click.IntRange(min=4),
              help="Decode steps timed for the snapshot cost.")
@click.option("--tier-slots", default=16, show_default=True, type=click.IntRange(min=1),
              help="Device slots (the fixed device budget) for the two-tier KV figures.")
@click.option("--sections", default="snapshot,recovery,tiers", show_default=True, help="Which figures to measure.")
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(min=1),
              help="Recovery runs per request count (min and median shown).")
@click.option("--threads", type=click.IntRange(min=0), help="ONNX Runtime intra-op threads (0: every core; "
              "default: the engine's own count).")
def main(engine_dir, requests, context, generated, steps, tier_slots, sections, repeats, threads) -> None:
    """Print snapshot cost per step and recovery time to the next token."""
    from dspark.runtime.api import Runtime, RuntimeOptions

    counts = [int(c) for c in requests.split(",")]
    if engine_dir is None:
        from .demo_engine import demo_engine_dir

        engine_dir = demo_engine_dir()
    t0 = time.perf_counter()
    length = max(context + generated + 96, 64 + 8 * steps + 96)
    options = RuntimeOptions(max_requests=max(64, *counts), max_seq_len=length, live_cost=False)
    with Runtime.load(engine_dir, options, threads=threads) as runtime:
        load_s = time.perf_counter() - t0
        session = getattr(runtime.backend, "options", None)  # ORT SessionOptions
        click.echo(f"engine {engine_dir}: loaded in {load_s * 1e3:.0f} ms (a restarted server pays this first)"
                   + ("" if session is None else f"; {session.intra_op_num_threads} intra-op thread(s)"))
        if "snapshot" in sections:
            _snapshots(runtime, steps)
        if "recovery" in sections:
            _recoveries(runtime, counts, context, generated, repeats)
        if "tiers" in sections:
            _tiers(runtime, options, tier_slots, max(counts))


def _snapshots(runtime, steps: int) -> None:
    click.echo("\nsnapshot cost per decode step (median over the steps; min beside it)")
    click.echo(f"{'requests':>8} {'T':>4} {'fsync':>8} {'step ms':>8} {'snap us':>8} {'min us':>7} "
               f"{'% step':>7} {'bytes/step':>10}")
    for temperature in (1.0, 0.0):
        for fsync in ("interval", "step"):
            r = snapshot_cost(runtime, 64, steps, temperature, fsync)
            click.echo(f"{r['requests']:>8} {temperature:>4} {fsync:>8} {r['step_ms']:>8.2f} "
                       f"{r['snapshot_us']:>8.0f} {r['snapshot_min_us']:>7.0f} {r['percent']:>6.2f}% "
                       f"{r['bytes_per_step']:>10.0f}")


def _recoveries(runtime, counts: list[int], context: int, generated: int, repeats: int) -> None:
    click.echo(f"\nrecovery: engine dropped with {generated} tokens generated per request, context {context}; "
               f"fresh engine from the journal (min / median of {repeats})")
    click.echo(f"{'requests':>8} {'read ms':>8} {'resubmit':>8} {'1st step':>9} {'to next token ms':>17} "
               f"{'re-prefilled':>12} {'greedy same':>11} {'sampled same':>12}")
    for count in counts:
        runs = [recovery_time(runtime, count, context, generated) for _ in range(repeats)]
        best = min(runs, key=lambda r: r["to_next_token_ms"])
        med = statistics.median(r["to_next_token_ms"] for r in runs)
        click.echo(f"{count:>8} {best['read_ms']:>8.1f} {best['resubmit_ms']:>8.1f} {best['first_step_ms']:>9.1f} "
                   f"{best['to_next_token_ms']:>8.1f} / {med:<7.1f} {best['tokens_prefilled']:>12} "
                   f"{all(r['greedy_same'] for r in runs)!s:>11} {all(r['sampled_same'] for r in runs)!s:>12}")


def _tiers(runtime, options, slots: int, requests: int, new_tokens: int = 48, quantum: int = 8) -> None:
    """Requests held at once and the cost of swapping, at a fixed device budget (`slots` slots)."""
    from dataclasses import replace

    runtime.options = replace(options, max_requests=slots, max_seq_len=32 + new_tokens + 16)
    per_request = runtime.engine().positions_needed(32, new_tokens)
    click.echo(f"\ntwo-tier KV: {requests} greedy requests (32-token prompts, {new_tokens} new tokens) on {slots} "
               f"device slots; host tier for {requests - slots} more, quantum {quantum} steps")
    plain = tier_run(runtime, slots, 0, requests, new_tokens, quantum)
    tiered = tier_run(runtime, slots, (requests - slots) * per_request, requests, new_tokens, quantum)
    st = tiered["stats"]
    swaps = st.swaps_out + st.swaps_in
    click.echo(f"  requests held at once: {plain['held']} without swapping, {tiered['held']} with")
    click.echo(f"  wall time: {plain['seconds']:.2f} s without, {tiered['seconds']:.2f} s with "
               f"({tiered['seconds'] / plain['seconds']:.2f}x)")
    click.echo(f"  swaps: {st.swaps_out} out, {st.swaps_in} in; {st.seconds / max(swaps, 1) * 1e6:.0f} us and "
               f"{st.bytes_moved / max(swaps, 1) / 1024:.0f} KiB per swap; swapping "
               f"{100 * st.seconds / tiered['seconds']:.2f}% of the run")
    click.echo(f"  outputs identical with and without swapping: {plain['tokens'] == tiered['tokens']}")


if __name__ == "__main__":
    main()
