"""PNG figures of a bench results dict (matplotlib, Agg backend, small files).

acceptance.png    position-wise conditional acceptance per drafter
single_stream.png tokens/s of every system at one request
pareto.png        aggregate tokens/s against per-user decode tokens/s, one curve per scheduler,
                  points labelled with the concurrency (the paper's Fig. 7); one panel per target
budget.png        tokens verified per step, draft tokens verified per request per step, and the
                  fraction of verified drafts rejected, against concurrency (the paper's Fig. 8);
                  one row per target
ratio.png         aggregate tokens/s ÷ autoregressive against concurrency, one panel per target,
                  with vLLM's published DSpark figures (their GPU numbers, not ours) in gray

Every panel is titled with its target's label: a stand-in's says "COST STAND-IN target (<params>)".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

PLOTS = ("acceptance.png", "single_stream.png", "pareto.png", "budget.png", "ratio.png")
MIN_SAMPLES = 20  # fewer rounds reaching a position make its acceptance rate noise


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path, rect: tuple[float, float, float, float] = (0, 0, 1, 1)) -> Path:
    fig.tight_layout(rect=rect)
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


def _panels(plt, rows: int, cols: int, width: float, height: float):
    """A figure and its [rows][cols] axes, each panel width x height inches."""
    return plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False)


def pareto_plot(sweeps: list[dict[str, Any]], path: Path) -> Path | None:
    """One panel per target: aggregate tokens/s against per-user decode tokens/s (the paper's per-user generation
    speed; per-request tokens/s from submission where a run has none), points labelled with C."""
    sweeps = [s for s in sweeps if s.get("schedulers")]
    if not sweeps:
        return None
    plt = _pyplot()
    fig, axes = _panels(plt, 1, len(sweeps), 6, 4.2)
    for ax, sweep in zip(axes[0], sweeps, strict=True):
        for name, rows in sweep["schedulers"].items():
            x = [r.get("per_request_decode_tokens_per_second") or r["per_request_tokens_per_second"] for r in rows]
            y = [r["aggregate_tokens_per_second"] for r in rows]
            ax.plot(x, y, marker="o", label=name)
            for r, xi, yi in zip(rows, x, y, strict=True):
                ax.annotate(str(r["concurrency"]), (xi, yi), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set(xscale="log", yscale="log", xlabel="per-user decode tokens/s (first token to last)",
               ylabel="aggregate tokens/s",
               title=f"{sweep['target']}\nthroughput vs per-user speed (labels: requests)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, which="both")
    return _save(fig, path)


def budget_plot(sweeps: list[dict[str, Any]], path: Path) -> Path | None:
    """One row per target: verified tokens per step, drafts verified per request per step, and
    the fraction of verified drafts rejected, against concurrency (the paper's Fig. 8)."""
    sweeps = [s for s in sweeps if any(n != "autoregressive" for n in s.get("schedulers", {}))]
    if not sweeps:
        return None
    plt = _pyplot()
    fig, axes = _panels(plt, len(sweeps), 3, 4, 3.4)
    for (tokens, drafts, rejected), sweep in zip(axes, sweeps, strict=True):
        for name, rows in sweep["schedulers"].items():
            c = [r["concurrency"] for r in rows]
            tokens.plot(c, [r["mean_verified_tokens_per_step"] for r in rows], marker="o", label=name)
            if name != "autoregressive":
                drafts.plot(c, [r["mean_drafts_per_request_step"] for r in rows], marker="o", label=name)
                rejected.plot(c, [_nan(r["rejected_draft_fraction"]) for r in rows], marker="o", label=name)
        tokens.set(xscale="log", yscale="log", xlabel="concurrent requests", ylabel="tokens verified / step",
                   title=f"{sweep['target']}\nverification budget B")
        drafts.set(xscale="log", xlabel="concurrent requests", ylabel="drafts verified / request / step",
                   title="drafts per request")
        rejected.set(xscale="log", xlabel="concurrent requests", ylabel="fraction", ylim=(0, 1),
                     title="verified drafts rejected")
        tokens.legend(fontsize=7)
        for ax in (tokens, drafts, rejected):
            ax.grid(alpha=0.3)
    return _save(fig, path)


def ratio_plot(sweeps: list[dict[str, Any]], path: Path, reference: dict[str, Any] | None = None) -> Path | None:
    """One panel per target: each drafting system's aggregate tokens/s ÷ autoregressive's against
    concurrency, with vLLM's published DSpark figures drawn beside ours as a labelled reference."""
    sweeps = [s for s in sweeps if "autoregressive" in s.get("schedulers", {})]
    if not sweeps:
        return None
    plt = _pyplot()
    fig, axes = _panels(plt, 1, len(sweeps), 6, 4.4)
    for ax, sweep in zip(axes[0], sweeps, strict=True):
        ax.axhline(1.0, color="black", linewidth=1, label="autoregressive (1.0)")
        for name, rows in sweep["schedulers"].items():
            if name == "autoregressive":
                continue
            ax.plot([r["concurrency"] for r in rows], [_nan(r.get("ratio_to_autoregressive")) for r in rows],
                    marker="o", label=name)
        for key, style in (("adaptive", dict(marker="x", linestyle="--")), ("fixed k=7", dict(marker="s"))):
            points = sorted((reference or {}).get(key, []))
            if points:
                ax.plot([c for c, _ in points], [v for _, v in points], color="gray", markersize=7,
                        label=f"vLLM published, {key} (large GPU model; not ours)", **style)
        ax.set(xscale="log", xlabel="concurrent requests", ylabel="aggregate tok/s ÷ autoregressive",
               title=f"{sweep['target']}\nratio to autoregressive")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3, which="both")
    if reference:
        fig.text(0.01, 0.005, f"gray: {reference['note']}", fontsize=7, color="gray")
    return _save(fig, path, rect=(0, 0.03, 1, 1))


def write_plots(results: dict[str, Any], out: Path) -> list[str]:
    """Every plot whose data is there; returns the file names written."""
    made = [
        acceptance_plot(results.get("acceptance", {}), out / "acceptance.png"),
        single_stream_plot(results.get("single_stream", {}).get("rows", []), out / "single_stream.png"),
        pareto_plot(results.get("load_sweeps", []), out / "pareto.png"),
        budget_plot(results.get("load_sweeps", []), out / "budget.png"),
        ratio_plot(results.get("load_sweeps", []), out / "ratio.png", results.get("vllm_reference")),
    ]
    return [p.name for p in made if p is not None]
