"""PNG figures of a bench results dict (matplotlib, Agg backend, small files).

acceptance.png    position-wise conditional acceptance per drafter
single_stream.png tokens/s of every system at one request
pareto.png        aggregate tokens/s against per-request tokens/s, one curve per scheduler,
                  points labelled with the concurrency (the paper's Fig. 7)
budget.png        draft tokens verified per request per step, and the fraction of verified
                  drafts rejected, against concurrency (the paper's Fig. 8)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

PLOTS = ("acceptance.png", "single_stream.png", "pareto.png", "budget.png")
MIN_SAMPLES = 20  # fewer rounds reaching a position make its acceptance rate noise


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    _pyplot().close(fig)
    return path


def _nan(value: float | None) -> float:
    return float("nan") if value is None else value


def acceptance_plot(acceptance: dict[str, Any], path: Path) -> Path | None:
    measured = {n: a for n, a in acceptance.items() if a.get("status") == "ok"}
    if not measured:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for name, a in measured.items():
        kept = [(k + 1, r) for k, (r, n) in enumerate(zip(a["conditional_acceptance"], a["position_samples"],
                                                            strict=True)) if r is not None and n >= MIN_SAMPLES]
        ax.plot([k for k, _ in kept], [r for _, r in kept], marker="o",
                label=f"{name} (τ = {a['mean_acceptance_length']:.2f})")
    ax.set(xlabel="draft position k", ylabel="P(accept k | 1..k-1 accepted)", ylim=(0, 1.02),
           title=f"Conditional acceptance (greedy; positions with ≥ {MIN_SAMPLES} samples)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def single_stream_plot(rows: list[dict[str, Any]], path: Path) -> Path | None:
    ok = [r for r in rows if r.get("status") == "ok" and r.get("tokens_per_second")]
    if not ok:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 0.45 * len(ok) + 1.2))
    names = [r["system"] + ("" if r.get("greedy_check", {"equal": True})["equal"] else "  [MISMATCH]")
             for r in ok]
    colors = ["tab:orange" if r["system"].startswith("dspark") else "tab:gray" for r in ok]
    ax.barh(names[::-1], [r["tokens_per_second"] for r in ok][::-1], color=colors[::-1])
    ax.set(xlabel="tokens/s (one request, greedy)", title="Single stream")
    ax.tick_params(axis="y", labelsize=8)
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, path)


def pareto_plot(sweep: dict[str, list[dict[str, Any]]], path: Path) -> Path | None:
    if not sweep:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, rows in sweep.items():
        x = [r["per_request_tokens_per_second"] for r in rows]
        y = [r["aggregate_tokens_per_second"] for r in rows]
        ax.plot(x, y, marker="o", label=name)
        for r, xi, yi in zip(rows, x, y, strict=True):
            ax.annotate(str(r["concurrency"]), (xi, yi), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set(xscale="log", yscale="log", xlabel="per-request tokens/s", ylabel="aggregate tokens/s",
           title="Throughput vs per-user speed (labels: concurrent requests)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    return _save(fig, path)


def budget_plot(sweep: dict[str, list[dict[str, Any]]], path: Path) -> Path | None:
    drafting = {n: rows for n, rows in sweep.items() if n != "autoregressive"}
    if not drafting:
        return None
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(8, 3.4))
    for name, rows in drafting.items():
        c = [r["concurrency"] for r in rows]
        left.plot(c, [r["mean_drafts_per_request_step"] for r in rows], marker="o", label=name)
        right.plot(c, [_nan(r["rejected_draft_fraction"]) for r in rows], marker="o", label=name)
    left.set(xscale="log", xlabel="concurrent requests", ylabel="drafts verified / request / step",
             title="Mean verification budget")
    right.set(xscale="log", xlabel="concurrent requests", ylabel="fraction", ylim=(0, 1),
              title="Verified drafts rejected")
    left.legend(fontsize=8)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    return _save(fig, path)


def write_plots(results: dict[str, Any], out: Path) -> list[str]:
    """Every plot whose data is there; returns the file names written."""
    made = [
        acceptance_plot(results.get("acceptance", {}), out / "acceptance.png"),
        single_stream_plot(results.get("single_stream", {}).get("rows", []), out / "single_stream.png"),
        pareto_plot(results.get("load_sweep", {}), out / "pareto.png"),
        budget_plot(results.get("load_sweep", {}), out / "budget.png"),
    ]
    return [p.name for p in made if p is not None]
