"""Load sweep: C concurrent requests through the continuous-batching runtime, per scheduler.

At every concurrency C, C requests (bounded prompt and output lengths) are submitted at once
to an engine with C slots, and the engine is stepped until all finish. Measured per run:
aggregate tokens/s (all tokens / wall time), per-request tokens/s (each request's tokens / the
time until it finished, averaged), the verification budget the scheduler chose (draft tokens
verified per request per step, and tokens B per step), the fraction of verified draft tokens
the target rejected, and the padding the batched verification paid. Schedulers: DSpark's prefix
scheduler, fixed γ, and autoregressive decoding (`off`), all on one loaded backend.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from dspark.runtime.api import Runtime, RuntimeOptions
from dspark.runtime.prefix_scheduler import SchedulerConfig


def schedulers(block_size: int, has_confidence: bool, gammas: Sequence[int] = (3, 7)) -> dict[str, SchedulerConfig]:
    configs = {"dspark scheduler": SchedulerConfig("dspark")} if has_confidence else {}
    for g in sorted({min(g, block_size) for g in gammas}):
        configs[f"fixed γ={g}"] = SchedulerConfig("fixed", fixed_length=g)
    configs["autoregressive"] = SchedulerConfig("off")
    return configs


def run_load(base: Runtime, scheduler: SchedulerConfig, prompts: Sequence[list[int]], *,
             max_new_tokens: int, stop: int) -> dict[str, Any]:
    """All prompts at once through a fresh engine with one slot per prompt."""
    need = max(len(p) for p in prompts) + max_new_tokens + base.info.block_size + 1
    options = RuntimeOptions(scheduler=scheduler, max_requests=len(prompts), max_seq_len=need)
    engine = Runtime(base.backend, base.info, options, cost_model=base.cost_model).engine()
    begin = time.perf_counter()
    ids = [engine.submit(p, max_new_tokens=max_new_tokens, stop_token_ids=(stop,)) for p in prompts]
    finished_at: dict[int, float] = {}
    while not engine.idle:
        engine.step()
        now = time.perf_counter()
        for request_id in engine.finished.keys() - finished_at.keys():
            finished_at[request_id] = now
    seconds = time.perf_counter() - begin
    results = [engine.finished[i] for i in ids]
    steps = [s for s in engine.stats.steps if s.requests]
    drafts = sum(sum(s.lengths) for s in steps)
    accepted_drafts = sum(sum(s.acceptance_lengths) - s.requests for s in steps)
    tokens = sum(len(r.tokens) for r in results)
    per_request = [len(r.tokens) / (finished_at[r.request_id] - begin) for r in results]
    summary = engine.stats.summary()
    return {
        "concurrency": len(prompts),
        "tokens": tokens,
        "seconds": round(seconds, 4),
        "aggregate_tokens_per_second": round(tokens / seconds, 2),
        "per_request_tokens_per_second": round(sum(per_request) / len(per_request), 2),
        "steps": len(steps),
        "mean_drafts_per_request_step": round(drafts / max(sum(s.requests for s in steps), 1), 3),
        "mean_verified_tokens_per_step": round(sum(s.verified_tokens for s in steps) / max(len(steps), 1), 2),
        "rejected_draft_fraction": round(1 - accepted_drafts / drafts, 4) if drafts else None,
        "mean_acceptance_length": round(summary["mean_acceptance_length"], 3),
        "padding_fraction": round(summary["padding_fraction"], 4),
        "outputs": [r.tokens for r in results],
    }


def load_sweep(base: Runtime, prompts: Sequence[list[int]], concurrency: Sequence[int], *,
               max_new_tokens: int, stop: int, progress: bool = True) -> dict[str, list[dict[str, Any]]]:
    """{scheduler name: one row per concurrency}; request i uses prompts[i % len(prompts)].
    Output token lists are dropped from the rows (they are checked, not stored): each row's
    `same_tokens_as_autoregressive` says whether every request matched the `off` run."""
    configs = schedulers(base.info.block_size, base.info.has_confidence)
    jobs = [(name, c) for c in concurrency for name in configs]
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
    outputs: dict[tuple[str, int], list[list[int]]] = {}
    bar = tqdm(jobs, desc="load sweep", unit="run", disable=not progress)
    for name, c in bar:
        bar.set_postfix_str(f"{name}, {c} requests")
        batch = [prompts[i % len(prompts)] for i in range(c)]
        row = run_load(base, configs[name], batch, max_new_tokens=max_new_tokens, stop=stop)
        outputs[name, c] = row.pop("outputs")
        rows[name].append(row)
    for name, name_rows in rows.items():
        for row, c in zip(name_rows, concurrency, strict=True):
            row["same_tokens_as_autoregressive"] = outputs[name, c] == outputs["autoregressive", c]
    return rows
