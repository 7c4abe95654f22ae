"""What the drafting gate's first step and probe steps cost: one run per concurrency, as the load sweep runs.

    python -m dspark.tools.bench.gate_steps ENGINE_DIR --concurrency 16,64 --repeats 3 [--requests N]

C requests (held-out windows of 32 tokens, 32 new tokens, the engine's stop token) are submitted
at once to a fresh engine with C slots (dspark scheduler, live cost model: `Runtime`'s defaults)
and stepped until all finish; with `--requests N` (N > C), N requests with at most C in flight, the
next submitted as one finishes (the load sweep's way). One JSON line per run: the drafting (draft +
heads phases) of step 0 and of each later step where any row drafted, the rows that drafted in them,
the drafting over the whole run, the steps in which no row drafted (`declined_steps`), the run's
seconds and tokens/s. Rows that drafted are those with a finite confidence (rows a probe left out
carry −inf). A run at 4 requests warms the backend up first.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from dspark.runtime.api import Runtime, RuntimeOptions
from dspark.runtime.prefix_scheduler import SchedulerConfig
from dspark.runtime.stats import EngineStats, StepRecord

from .subjects import load_prompts, stop_token


def drafted_rows(step: StepRecord) -> int:
    logits = step.confidence_logits
    return 0 if logits is None else int(np.isfinite(logits[:, 0]).sum())


def drafting_ms(step: StepRecord) -> float:
    return 1e3 * (step.seconds.get("draft", 0.0) + step.seconds.get("heads", 0.0))


def run(base: Runtime, prompts: list[list[int]], concurrency: int, *, new_tokens: int, stop: int,
        requests: int | None = None) -> dict:
    options = RuntimeOptions(scheduler=SchedulerConfig("dspark"), max_requests=concurrency,
                             max_seq_len=max(map(len, prompts)) + new_tokens + base.info.block_size + 1)
    engine = Runtime(base.backend, base.info, options, cost_model=base.cost_model).engine()
    engine.stats = EngineStats(history=None)  # every step of the run
    total = max(requests or concurrency, concurrency)
    ids: list[int] = []

    def submit_next() -> None:
        ids.append(engine.submit(prompts[len(ids) % len(prompts)], max_new_tokens=new_tokens,
                                 stop_token_ids=(stop,)))

    begin = time.perf_counter()
    for _ in range(concurrency):
        submit_next()
    done: dict = {}
    while not engine.idle:
        engine.step()
        for request_id, result in engine.take_finished().items():
            done[request_id] = result
            if len(ids) < total:
                submit_next()
    seconds = time.perf_counter() - begin
    tokens = sum(len(done[i].tokens) for i in ids)
    steps = [s for s in engine.stats.steps if s.requests]
    later = [s for s in steps[1:] if drafted_rows(s)]
    return {"concurrency": concurrency, "step0_drafting_ms": round(drafting_ms(steps[0]), 2),
            "step0_rows": drafted_rows(steps[0]), "step0_total_ms": round(1e3 * steps[0].total_seconds, 2),
            "later_drafting_ms": [round(drafting_ms(s), 2) for s in later],
            "later_rows": [drafted_rows(s) for s in later], "later_requests": [s.requests for s in later],
            "run_drafting_ms": round(sum(map(drafting_ms, steps)), 2), "steps": len(steps),
            "declined_steps": sum(not drafted_rows(s) for s in steps), "requests": total,
            "seconds": round(seconds, 4), "tokens_per_second": round(tokens / seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine", type=Path)
    parser.add_argument("--concurrency", default="16,64")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--requests", type=int, default=None, help="Requests per run, at most C in flight.")
    args = parser.parse_args()
    base = Runtime.load(args.engine)
    tokenizer = args.engine / "tokenizer.json"
    prompts, _ = load_prompts(None, tokenizer if tokenizer.is_file() else None, count=64, length=args.prompt_len,
                              vocab_size=base.info.vocab_size, avoid=base.info.eos_token_ids)
    stop = stop_token(base.info.eos_token_ids, base.info.mask_token_id)
    run(base, prompts, 4, new_tokens=args.new_tokens, stop=stop)  # warm-up
    for _ in range(args.repeats):
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            print(json.dumps(run(base, prompts, concurrency, new_tokens=args.new_tokens, stop=stop,
                                 requests=args.requests)), flush=True)


if __name__ == "__main__":
    main()
