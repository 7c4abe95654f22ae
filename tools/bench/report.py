"""Markdown tables of a bench results dict (printed at the end of a run and saved as report.md)."""

from __future__ import annotations

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
    out = []
    for r in rows:
        if r.get("status") != "ok":
            out.append([r["system"], r["runtime"], r["status"], None, None, None, None])
            continue
        check = r.get("greedy_check")
        greedy = "n/a" if check is None else ("yes" if check["equal"] else
                                              f"MISMATCH ({len(check['mismatches'])} prompts)")
        out.append([r["system"], r["runtime"], r["tokens_per_second"], r.get("decode_tokens_per_second"),
                    r["per_token_ms"], r["first_token_ms"], greedy])
    return _table(["system", "runtime", "tokens/s", "decode tok/s", "ms/token", "first token ms", "greedy tokens"],
                  out)


def sweep_table(sweep: dict[str, list[dict[str, Any]]]) -> str:
    out = []
    for name, rows in sweep.items():
        for r in rows:
            out.append([name, r["concurrency"], r["aggregate_tokens_per_second"], r["per_request_tokens_per_second"],
                        r["mean_drafts_per_request_step"], r["rejected_draft_fraction"], r["mean_acceptance_length"],
                        "yes" if r["same_tokens_as_autoregressive"] else "NO"])
    return _table(["scheduler", "requests", "aggregate tok/s", "per-request tok/s", "drafts/req/step",
                   "rejected drafts", "τ", "= autoregressive"], out)


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
    if results.get("loop_efficiency"):
        rows = [[mode, e["efficiency_min"], e["efficiency_median"], e["engine_ms_median"], e["replay_ms_median"],
                 e["graph_calls_per_request"]] for mode, e in results["loop_efficiency"].items()]
        parts += ["### Loop efficiency (replay of the same graph calls ÷ the engine's time; 1.0 = no host glue)",
                  _table(["scheduler", "min", "median", "engine ms", "replay ms", "graph calls"], rows)]
    if results.get("load_sweep"):
        parts += [f"### Load sweep ({results['config']['sweep_new_tokens']} new tokens per request)",
                  sweep_table(results["load_sweep"])]
    return "\n\n".join(parts) + "\n"
