"""Markdown tables of a bench results dict (printed at the end of a run and saved as report.md)."""

from __future__ import annotations

import statistics
from typing import Any


def _table(header: list[str], rows: list[list[Any]]) -> str:
    def cell(v: Any) -> str:
        if v is None:
            return "–"
        return f"{v:.3g}" if isinstance(v, float) and abs(v) < 10 else (f"{v:.1f}" if isinstance(v, float) else str(v))

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def acceptance_table(acceptance: dict[str, Any]) -> str:
    gamma = max((len(a["conditional_acceptance"]) for a in acceptance.values() if a.get("status") == "ok"),
                default=0)
    rows = []
    for name, a in acceptance.items():
        if a.get("status") != "ok":
            rows.append([name, a["status"], None, *([None] * gamma)])
            continue
        cells = [None if r is None else f"{r:.2f} ({n})"
                 for r, n in zip(a["conditional_acceptance"], a["position_samples"], strict=True)]
        rows.append([name, round(a["mean_acceptance_length"], 3), a["rounds"],
                     *cells, *([None] * (gamma - len(cells)))])
    return _table(["drafter", "mean accepted length τ", "rounds",
                   *(f"p{k} (n)" for k in range(1, gamma + 1))], rows)


def single_stream_table(rows: list[dict[str, Any]]) -> str:
    out, rounds = [], max((len(r.get("tokens_per_second_runs", ())) for r in rows), default=0)
    for r in rows:
        runs = r.get("tokens_per_second_runs") or []
        spread = [f"{min(runs):.0f}–{max(runs):.0f}" if runs else None] if rounds > 1 else []
        if r.get("status") != "ok":
            out.append([r["system"], r["runtime"], r["status"], *([None] * len(spread)), None, None, None, None])
            continue
        check = r.get("greedy_check")
        greedy = "n/a" if check is None else ("yes" if check["equal"] else
                                              f"MISMATCH ({len(check['mismatches'])} requests)")
        out.append([r["system"], r["runtime"], r["tokens_per_second"], *spread, r.get("decode_tokens_per_second"),
                    r["per_token_ms"], r["first_token_ms"], greedy])
    return _table(["system", "runtime", "tokens/s" + (f" (median of {rounds} rounds)" if rounds > 1 else ""),
                   *(["rounds min–max"] if rounds > 1 else []), "decode tok/s", "ms/token", "first token ms",
                   "greedy tokens"], out)


# (ours, theirs, goal): issue 13's single-stream ratios, by system name prefix
SINGLE_STREAM_RATIOS = (("dspark scheduler", "onnxruntime-genai greedy", 1.3),
                        ("dspark scheduler", "onnxruntime-genai n-gram", 1.0),
                        ("dspark autoregressive", "onnxruntime-genai greedy", 0.9))


def single_stream_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each ratio of SINGLE_STREAM_RATIOS whose systems both ran, round by round (round i of both ran in the
    same stretch of time): every round's value, their min and median, and the goal."""
    def runs(prefix: str) -> list[float] | None:
        row = next((r for r in rows if r["system"].startswith(prefix) and r.get("status") == "ok"), None)
        return None if row is None else row.get("tokens_per_second_runs") or [row["tokens_per_second"]]

    out = []
    for ours, theirs, goal in SINGLE_STREAM_RATIOS:
        a, b = runs(ours), runs(theirs)
        if a and b and len(a) == len(b):
            ratios = [x / y for x, y in zip(a, b, strict=True)]
            out.append({"ours": ours, "theirs": theirs, "goal": goal, "ratios": [round(r, 3) for r in ratios],
                        "min": round(min(ratios), 3), "median": round(statistics.median(ratios), 3)})
    return out


def ratio_lines(ratios: list[dict[str, Any]]) -> str:
    return "\n".join(f"- {r['ours']} ÷ {r['theirs']}: median {r['median']:.2f}×, min {r['min']:.2f}× over "
                     f"{len(r['ratios'])} round(s) (goal ≥ {r['goal']}×: "
                     f"{'met' if r['median'] >= r['goal'] else 'not met'} at the median)" for r in ratios)


def speculation_lines(rows: list[dict[str, Any]]) -> str:
    """Per draft-model peer, its own statistics: rounds, drafted and accepted tokens, tokens per
    target step (emitted tokens ÷ rounds, the τ of that runtime)."""
    lines = []
    for r in rows:
        c = r.get("counters", {})
        if r.get("status") != "ok" or not c.get("draft_tokens_proposed") or not c.get("rounds"):
            continue
        lines.append(f"- {r['system']} ({r['runtime']}, its own statistics): {c['rounds']:.0f} rounds, "
                     f"{c['draft_tokens_accepted']:.0f} of {c['draft_tokens_proposed']:.0f} drafted tokens accepted "
                     f"({100 * c['draft_tokens_accepted'] / c['draft_tokens_proposed']:.1f}%), "
                     f"{c['tokens_emitted'] / c['rounds']:.2f} tokens per round")
    return "\n".join(lines)


def sweep_table(sweeps: list[dict[str, Any]]) -> str:
    """Every run of every target, each row labelled with its target."""
    out = []
    for sweep in sweeps:
        for name, rows in sweep["schedulers"].items():
            for r in rows:
                runs = r.get("aggregate_runs") or [r["aggregate_tokens_per_second"]]
                out.append([sweep["target"], name, r["concurrency"], r["aggregate_tokens_per_second"],
                            f"{min(runs):.0f}–{max(runs):.0f}" if len(runs) > 1 else "–",
                            r["per_request_tokens_per_second"], r.get("per_request_decode_tokens_per_second"),
                            r.get("ratio_to_autoregressive"), r.get("per_request_ratio_to_autoregressive"),
                            r.get("decode_ratio_to_autoregressive"), r["mean_drafts_per_request_step"],
                            r["mean_verified_tokens_per_step"], r["rejected_draft_fraction"],
                            r["mean_acceptance_length"], "yes" if r["same_tokens_as_autoregressive"] else "NO"])
    return _table(["target", "scheduler", "requests", "aggregate tok/s (median run)", "runs min–max",
                   "per-request tok/s", "per-request decode tok/s", "÷ autoregressive",
                   "per-request ÷ autoregressive", "decode ÷ autoregressive", "drafts/req/step", "verified tokens/step",
                   "rejected drafts", "τ", "= autoregressive"], out)


def _met(check: dict[str, Any] | None) -> str | None:
    if check is None or check["meets_goal"] is None:
        return None
    return "yes" if check["meets_goal"] else "no"


def goal_table(sweeps: list[dict[str, Any]]) -> str:
    """Per target and concurrency: the bar max(autoregressive, best fixed γ) and each scheduler against it."""
    from .load_sweep import SCHEDULERS

    out = []
    for sweep in sweeps:
        for e in sweep["comparison"]:
            best = None if e["best_fixed"] is None else f"{e['best_fixed_tokens_per_second']:.1f} ({e['best_fixed']})"
            cells = []
            for name in SCHEDULERS:
                check = e["schedulers"].get(name)
                cells += [None if check is None else check["aggregate_tokens_per_second"],
                          None if check is None else check["ratio_to_bar"], _met(check)]
            out.append([sweep["target"], e["concurrency"], e["autoregressive_tokens_per_second"], best, *cells])
    header = ["target", "requests", "autoregressive tok/s", "best fixed γ tok/s"]
    for name in SCHEDULERS:
        header += [f"{name} tok/s", "÷ bar", "≥ bar"]
    return _table(header, out)


def goal_summary(sweeps: list[dict[str, Any]]) -> str:
    """One line per target and scheduler: at how many concurrencies it met the bar, and its per-request speed
    and per-user decode speed ÷ autoregressive at 1 and 16 requests (the stand-in's goals: ≥ 2×, ≥ 1.3×)."""
    from .load_sweep import SCHEDULERS

    lines = []
    for sweep in sweeps:
        for name in SCHEDULERS:
            checks = [(e["concurrency"], e["schedulers"][name]) for e in sweep["comparison"] if name in e["schedulers"]]
            judged = [(c, x) for c, x in checks if x["meets_goal"] is not None]
            if not judged:
                continue
            missed = [str(c) for c, x in judged if not x["meets_goal"]]
            speeds = [_at_1_and_16(checks, key) for key in ("per_request_ratio_to_autoregressive",
                                                             "decode_ratio_to_autoregressive")]
            lines.append(f"- {sweep['target']}, {name}: ≥ max(autoregressive, best fixed γ) at "
                         f"{len(judged) - len(missed)} of {len(judged)} concurrencies"
                         + (f" (not at {', '.join(missed)} requests)" if missed else "")
                         + (f"; per-request speed ÷ autoregressive {speeds[0]}" if speeds[0] else "")
                         + (f"; per-user decode speed ÷ autoregressive {speeds[1]}" if speeds[1] else ""))
    return "\n".join(lines)


def _at_1_and_16(checks: list[tuple[int, dict[str, Any]]], key: str) -> str:
    ratios = {c: x.get(key) for c, x in checks}
    return ", ".join(f"{ratios[c]:.2f}× at {c}" for c in (1, 16) if ratios.get(c) is not None)


def vllm_reference_line(reference: dict[str, Any]) -> str:
    parts = [f"{key} " + ", ".join(f"{ratio:.2f}× at {c}" for c, ratio in reference[key])
             for key in ("adaptive", "fixed k=7") if reference.get(key)]
    return f"For reference, {reference['note']}: throughput ÷ plain decoding, {'; '.join(parts)} requests."


def markdown(results: dict[str, Any]) -> str:
    parts = []
    if results.get("acceptance"):
        parts += ["### Acceptance (reference decoder, greedy, full blocks)", acceptance_table(results["acceptance"])]
    elif results.get("acceptance_status"):
        parts += ["### Acceptance", results["acceptance_status"]]
    single = results.get("single_stream", {})
    if single.get("rows"):
        title = (f"### Single stream (greedy, {single['max_new_tokens']} new tokens, {single['prompts']} prompts; "
                 f"reference: {single['reference']})")
        parts += [title, single_stream_table(single["rows"])]
        ratios = single.get("ratios") or single_stream_ratios(single["rows"])
        if ratios:
            parts.append(ratio_lines(ratios))
        speculation = speculation_lines(single["rows"])
        if speculation:
            parts.append(speculation)
    if results.get("loop_efficiency"):
        rows = [[mode, e["efficiency_min"], e["efficiency_median"], e["engine_ms_median"], e["replay_ms_median"],
                 e["graph_calls_per_request"]] for mode, e in results["loop_efficiency"].items()]
        parts += ["### Loop efficiency (replay of the same graph calls ÷ the engine's time; 1.0 = no host glue)",
                  _table(["scheduler", "min", "median", "engine ms", "replay ms", "graph calls"], rows)]
    sweeps = results.get("load_sweeps")
    if sweeps:
        for sweep in sweeps:
            if sweep.get("standin"):
                parts += [f"**{sweep['target']}**: {sweep['standin']['label']}."]
            if sweep.get("confidences"):
                parts += [f"**{sweep['target']}**: {sweep['confidences']}."]
        parts += [f"### Load sweep ({results['config']['sweep_new_tokens']} new tokens per request)",
                  sweep_table(sweeps),
                  "### Goal: scheduler ≥ max(autoregressive, best fixed γ), aggregate tok/s (as measured)",
                  goal_table(sweeps)]
        summary = goal_summary(sweeps)
        if summary:
            parts.append(summary)
        if results.get("vllm_reference"):
            parts.append(vllm_reference_line(results["vllm_reference"]))
    return "\n\n".join(parts) + "\n"
