"""Load sweep: C concurrent requests through the continuous-batching runtime, per scheduler.

At every concurrency C, max(C, `MIN_REQUESTS`) requests (bounded prompt and output lengths) go
through an engine with C slots, C at a time: the first C at once, then a new one in place of each
that finishes (between two steps), until all have finished. At 1 request a run is then 16 prompts
one after another, not one prompt's 32 tokens (~30 steps from a cold start, where a prompt the
drafter fails decided the figure). Measured per run: aggregate tokens/s (all tokens / wall time),
per-request tokens/s (each request's tokens / the time from its submission to its end, averaged),
per-request decode tokens/s (its tokens after those of its admission step, the prefill's and that step's
decode's / the time from the end of that step, when it has its first tokens, to its end, averaged: the paper's
per-user generation speed, no queueing or prefill in it),
the verification budget the scheduler chose (draft tokens
verified per request per step, and tokens B per step), the fraction of verified draft tokens
the target rejected, and the padding the batched verification paid. Schedulers: DSpark's prefix
scheduler, synchronous (Algorithm 1, `dspark`) and asynchronous (§5.2, `async`), fixed γ, and
autoregressive decoding (`off`), all on one loaded backend.

`compare` puts each concurrency's rows side by side: every row's ratio to autoregressive
(aggregate and per-request tokens/s), and whether each scheduler reached the issue's goal,
aggregate tokens/s >= max(autoregressive, best fixed γ). It reports; nothing asserts it.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from dspark.runtime.api import Runtime, RuntimeOptions
from dspark.runtime.batch_loop import BatchEngine
from dspark.runtime.prefix_scheduler import SchedulerConfig

MIN_REQUESTS = 16  # requests per run at least, whatever the concurrency
# a concurrency whose runs last under SHORT_RUN_SECONDS (the demo target up to 16 requests: ~0.1-0.3 s, where this
# machine's load moves one run by 15-40 %) runs `SHORT_RUN_REPEATS` times the repeats, so that a row's median is
# as steady as a longer run's (the 100M stand-in's runs there last ~4 s: no more of them)
SHORT_RUN_SECONDS, SHORT_RUN_REPEATS = 0.5, 3
# untimed: every scheduler once at each concurrency, requests this short, before the timed rounds. A batch shape's
# first prefills in a process ran ~2x slower (ONNX Runtime growing its memory): on the 100M stand-in, 16 prompts of
# 32 tokens took 1.41-1.59 s in the first two runs and 0.75-0.84 s after, half of a 16-request run's time, and
# landed on whichever scheduler came first
WARM_UP_TOKENS = 4
SYNC, ASYNC, AUTOREGRESSIVE = "dspark scheduler", "dspark async scheduler", "autoregressive"
SCHEDULERS = (SYNC, ASYNC)  # the systems the goal is about
FIXED = "fixed γ="  # prefix of the fixed-length systems' names
# vLLM's published figures for DSpark on a large GPU model: throughput ratio to plain decoding by
# concurrent requests. Their numbers, not ours; drawn and printed beside ours as a reference only.
VLLM_REFERENCE = {
    "note": "vLLM's published DSpark numbers on a large GPU model (not measured here)",
    "adaptive": [[1, 2.66], [16, 1.81], [256, 1.54]],  # [concurrent requests, ratio]
    "fixed k=7": [[256, 1.20]],
}


def schedulers(block_size: int, has_confidence: bool, gammas: Sequence[int] = (3, 7)) -> dict[str, SchedulerConfig]:
    configs = {SYNC: SchedulerConfig("dspark"), ASYNC: SchedulerConfig("async")} if has_confidence else {}
    for g in sorted({min(g, block_size) for g in gammas}):
        configs[f"{FIXED}{g}"] = SchedulerConfig("fixed", fixed_length=g)
    configs[AUTOREGRESSIVE] = SchedulerConfig("off")
    return configs


def run_load(base: Runtime, scheduler: SchedulerConfig, prompts: Sequence[list[int]], *, concurrency: int,
             max_new_tokens: int, stop: int) -> dict[str, Any]:
    """The prompts through a fresh engine with `concurrency` slots, at most that many in flight (module
    docstring)."""
    need = max(len(p) for p in prompts) + max_new_tokens + base.info.block_size + 1
    options = RuntimeOptions(scheduler=scheduler, max_requests=concurrency, max_seq_len=need)
    runtime = Runtime(base.backend, base.info, options, cost_model=base.cost_model)
    try:
        return _timed_run(runtime.engine(), prompts, concurrency=concurrency, max_new_tokens=max_new_tokens,
                          stop=stop)
    finally:
        runtime.detach()  # the backend is base's


def _timed_run(engine: BatchEngine, prompts: Sequence[list[int]], *, concurrency: int, max_new_tokens: int,
               stop: int) -> dict[str, Any]:
    begin = time.perf_counter()
    submitted_at: dict[int, float] = {}
    finished_at: dict[int, float] = {}
    ids: list[int] = []

    def submit_next() -> None:
        request_id = engine.submit(prompts[len(ids)], max_new_tokens=max_new_tokens, stop_token_ids=(stop,))
        ids.append(request_id)
        submitted_at[request_id] = time.perf_counter()

    for _ in range(min(concurrency, len(prompts))):
        submit_next()
    step_ended: list[float] = []  # by engine step: a request's first token came at the end of its admission step
    while not engine.idle:
        engine.step()
        now = time.perf_counter()
        step_ended.append(now)
        for request_id in engine.finished.keys() - finished_at.keys():
            finished_at[request_id] = now
            if len(ids) < len(prompts):
                submit_next()
    seconds = time.perf_counter() - begin
    results = [engine.finished[i] for i in ids]
    steps = [s for s in engine.stats.steps if s.requests]
    drafts = sum(sum(s.lengths) for s in steps)
    accepted_drafts = sum(sum(s.acceptance_lengths) - s.requests for s in steps)
    tokens = sum(len(r.tokens) for r in results)
    per_request = [len(r.tokens) / (finished_at[r.request_id] - submitted_at[r.request_id]) for r in results]
    # after its admission step a request has its prefill's token and that step's (1 + acceptance_lengths[0])
    decode = [(len(r.tokens) - 1 - r.acceptance_lengths[0]) / (finished_at[r.request_id] - step_ended[r.admitted_step])
              for r in results if r.acceptance_lengths and len(r.tokens) > 1 + r.acceptance_lengths[0]]
    summary = engine.stats.summary()
    return {
        "concurrency": concurrency,
        "requests": len(prompts),
        "tokens": tokens,
        "seconds": round(seconds, 4),
        "aggregate_tokens_per_second": round(tokens / seconds, 2),
        "per_request_tokens_per_second": round(sum(per_request) / len(per_request), 2),
        "per_request_decode_tokens_per_second": round(sum(decode) / len(decode), 2) if decode else None,
        "steps": len(steps),
        "max_requests_per_step": max((s.requests for s in steps), default=0),
        "mean_drafts_per_request_step": round(drafts / max(sum(s.requests for s in steps), 1), 3),
        "mean_verified_tokens_per_step": round(sum(s.verified_tokens for s in steps) / max(len(steps), 1), 2),
        "rejected_draft_fraction": round(1 - accepted_drafts / drafts, 4) if drafts else None,
        "mean_acceptance_length": round(summary["mean_acceptance_length"], 3),
        "padding_fraction": round(summary["padding_fraction"], 4),
        "copied_row_fraction": round(summary["copied_row_fraction"], 4),
        "outputs": [r.tokens for r in results],
    }


def load_sweep(base: Runtime, prompts: Sequence[list[int]], concurrency: Sequence[int], *,
               max_new_tokens: int, stop: int, repeats: int = 3, progress: bool = True,
               desc: str = "load sweep") -> dict[str, list[dict[str, Any]]]:
    """{scheduler name: one row per concurrency}; request i uses prompts[i % len(prompts)], max(C,
    `MIN_REQUESTS`) requests at concurrency C.
    At each concurrency every scheduler runs once untimed (`WARM_UP_TOKENS` a request), then `repeats` times
    (`SHORT_RUN_REPEATS` times that where the first repeats' median run lasted under `SHORT_RUN_SECONDS`),
    interleaved (scheduler after scheduler, repeat after repeat: a run at a few requests lasts ~0.1 s, where this
    machine's load moves one run by 15-40 %),
    in an order shuffled per repeat (seeded): in a fixed order each scheduler always
    follows the same one, which can bias its row (one full bench put the synchronous scheduler at 0.82x
    autoregressive at 4 requests, right after autoregressive runs; 7 runs alternating the order, 0.91x,
    as the asynchronous one in both);
    a row is the run of median aggregate tok/s, with every run's figure in
    `aggregate_runs`. Output token lists are dropped from the rows (they are checked, not stored):
    each row's `same_tokens_as_autoregressive` says whether every request matched the `off` run,
    in every repeat."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    configs = schedulers(base.info.block_size, base.info.has_confidence)
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    outputs: dict[tuple[str, int], list[list[list[int]]]] = {}
    bar = tqdm(total=len(concurrency) * repeats * len(configs), desc=desc, unit="run", disable=not progress)

    def batch(c: int) -> list[list[int]]:
        return [prompts[i % len(prompts)] for i in range(max(c, MIN_REQUESTS))]

    def one_round(c: int, r: int) -> None:  # every scheduler once, in this round's order
        for name in random.Random(f"{c}/{r}").sample(list(configs), len(configs)):
            bar.set_postfix_str(f"{name}, {c} requests")
            row = run_load(base, configs[name], batch(c), concurrency=c, max_new_tokens=max_new_tokens, stop=stop)
            outputs.setdefault((name, c), []).append(row.pop("outputs"))
            runs.setdefault((name, c), []).append(row)
            bar.update()

    for c in concurrency:
        bar.set_postfix_str(f"warm-up, {c} requests")
        for name in configs:
            run_load(base, configs[name], batch(c), concurrency=c, max_new_tokens=min(WARM_UP_TOKENS, max_new_tokens),
                     stop=stop)
        for r in range(repeats):
            one_round(c, r)
        if statistics.median(run["seconds"] for name in configs for run in runs[name, c]) < SHORT_RUN_SECONDS:
            bar.total += repeats * (SHORT_RUN_REPEATS - 1) * len(configs)
            for r in range(repeats, repeats * SHORT_RUN_REPEATS):
                one_round(c, r)
    bar.close()
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
    for name in configs:
        for c in concurrency:
            ordered = sorted(runs[name, c], key=lambda r: r["aggregate_tokens_per_second"])
            row = dict(ordered[(len(ordered) - 1) // 2])  # the median run (the lower one of an even count)
            row["aggregate_runs"] = [r["aggregate_tokens_per_second"] for r in runs[name, c]]
            row["same_tokens_as_autoregressive"] = all(o == outputs[AUTOREGRESSIVE, c][0] for o in outputs[name, c])
            rows[name].append(row)
    return rows


def _ratio(value: float | None, base: float | None) -> float | None:
    return round(value / base, 3) if base and value is not None else None


def compare(sweep: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One entry per concurrency (ascending): autoregressive and the best fixed γ (aggregate tok/s),
    `bar` = the larger of the two, and per scheduler its aggregate and per-request tok/s, their
    ratios to autoregressive, its ratio to the bar and `meets_goal` (aggregate >= bar).

    Also writes `ratio_to_autoregressive`, `per_request_ratio_to_autoregressive` and
    `decode_ratio_to_autoregressive` (per-request decode tok/s) into every row of `sweep` (None where the
    concurrency has no autoregressive run). A concurrency without an autoregressive or a fixed-γ run compares
    against what is there; none at all: bar None and `meets_goal` None."""
    by_c: dict[int, dict[str, dict[str, Any]]] = {}
    for name, rows in sweep.items():
        for r in rows:
            by_c.setdefault(r["concurrency"], {})[name] = r
    out = []
    for c in sorted(by_c):
        runs = by_c[c]
        plain = runs.get(AUTOREGRESSIVE)
        plain_agg = plain["aggregate_tokens_per_second"] if plain else None
        plain_user = plain["per_request_tokens_per_second"] if plain else None
        plain_decode = plain.get("per_request_decode_tokens_per_second") if plain else None
        for r in runs.values():
            r["ratio_to_autoregressive"] = _ratio(r["aggregate_tokens_per_second"], plain_agg)
            r["per_request_ratio_to_autoregressive"] = _ratio(r["per_request_tokens_per_second"], plain_user)
            r["decode_ratio_to_autoregressive"] = _ratio(r.get("per_request_decode_tokens_per_second"), plain_decode)
        fixed = {n: r["aggregate_tokens_per_second"] for n, r in runs.items() if n.startswith(FIXED)}
        best_fixed = max(fixed, key=fixed.__getitem__) if fixed else None
        candidates = [v for v in (plain_agg, fixed.get(best_fixed)) if v is not None]
        bar = max(candidates) if candidates else None
        entry: dict[str, Any] = {
            "concurrency": c, "autoregressive_tokens_per_second": plain_agg,
            "autoregressive_per_request_tokens_per_second": plain_user, "best_fixed": best_fixed,
            "best_fixed_tokens_per_second": fixed.get(best_fixed), "bar_tokens_per_second": bar, "schedulers": {}}
        for name in SCHEDULERS:
            if name not in runs:
                continue
            r = runs[name]
            value = r["aggregate_tokens_per_second"]
            entry["schedulers"][name] = {
                "aggregate_tokens_per_second": value,
                "per_request_tokens_per_second": r["per_request_tokens_per_second"],
                "ratio_to_autoregressive": r["ratio_to_autoregressive"],
                "per_request_ratio_to_autoregressive": r["per_request_ratio_to_autoregressive"],
                "per_request_decode_tokens_per_second": r.get("per_request_decode_tokens_per_second"),
                "decode_ratio_to_autoregressive": r["decode_ratio_to_autoregressive"],
                "ratio_to_bar": _ratio(value, bar),
                "meets_goal": None if bar is None else value >= bar,
            }
        out.append(entry)
    return out


def target_sweep(label: str, base: Runtime, prompts: Sequence[list[int]], concurrency: Sequence[int], *,
                 max_new_tokens: int, stop: int, repeats: int = 3, standin: dict[str, Any] | None = None,
                 progress: bool = True, confidences: str | None = None) -> dict[str, Any]:
    """The sweep of one target, labelled: {"target": label, "standin": the stand-in's record or None,
    "confidences": how its engine's confidences were calibrated, "schedulers": {name: rows},
    "comparison": compare(...)}."""
    rows = load_sweep(base, prompts, concurrency, max_new_tokens=max_new_tokens, stop=stop, repeats=repeats,
                      progress=progress, desc=f"load sweep, {label}")
    return {"target": label, "standin": standin, "confidences": confidences, "schedulers": rows,
            "comparison": compare(rows)}
