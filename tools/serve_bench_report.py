"""serve_bench's rows: a phase's figures, the median round of several, the Markdown table and the plot
(each system's tokens/s over the direct engine's against the client count, every round a dot)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

GOAL = 0.9  # issue 15: the server's overhead at most 10 % of the direct engine's throughput


@dataclass
class Phase:
    system: str
    clients: int
    requests: int
    tokens: int
    seconds: float
    ttft: list[float]
    cpu_seconds: float = 0.0  # this process (the direct engine, the service, or the HTTP clients)
    server_cpu_seconds: float | None = None  # the `dspark serve` process (http rows)
    ratio: float = float("nan")  # tok/s over the direct engine's in the same repeat
    min_ratio: float = float("nan")  # the lowest ratio over the repeats
    rounds: list[float] = field(default_factory=list)  # every repeat's ratio, ascending
    # tok/s over the engine service's in the same repeat (median): what HTTP and the server's processes cost
    # over the same closed-loop clients of the engine API, turnover included in both
    service_ratio: float = float("nan")

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def row(self) -> dict:
        return {"system": self.system, "clients": self.clients, "requests": self.requests, "tokens": self.tokens,
                "seconds": round(self.seconds, 3), "tokens_per_second": round(self.tokens_per_second, 1),
                "ttft_p50_ms": round(1e3 * _quantile(self.ttft, 0.5), 2),
                "ttft_p99_ms": round(1e3 * _quantile(self.ttft, 0.99), 2), "cpu_seconds": round(self.cpu_seconds, 3),
                "server_cpu_seconds": None if self.server_cpu_seconds is None else round(self.server_cpu_seconds, 3),
                "vs_direct": round(self.ratio, 3), "vs_direct_min": round(self.min_ratio, 3),
                "vs_direct_rounds": [round(r, 3) for r in self.rounds], "vs_service": round(self.service_ratio, 3)}


def _quantile(values: Sequence[float], q: float) -> float:
    """Nearest-rank quantile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)] if ordered else float("nan")


def summarise(repeats: list[list[Phase]]) -> list[Phase]:
    """Per system, the repeat with the median ratio to that repeat's direct engine, with the min ratio (the
    direct engine itself: its median tok/s), and the median ratio to the repeat's engine service (the second
    system of every repeat)."""
    rows = []
    for i in range(len(repeats[0])):
        runs = [(r[i].tokens_per_second / r[0].tokens_per_second, r[i]) for r in repeats]
        if i == 0:
            runs = [(r[0].tokens_per_second, r[0]) for r in repeats]
        ratios = sorted(ratio for ratio, _ in runs)
        median = statistics.median_low(ratios)
        phase = next(p for ratio, p in runs if ratio == median)
        phase.ratio, phase.min_ratio = (1.0, 1.0) if i == 0 else (median, ratios[0])
        phase.rounds = [1.0] * len(ratios) if i == 0 else ratios
        if i >= 1:
            phase.service_ratio = statistics.median_low([r[i].tokens_per_second / r[1].tokens_per_second
                                                         for r in repeats])
        rows.append(phase)
    return rows


def table(phases: list[Phase]) -> str:
    lines = ["| clients | system | requests | TTFT p50 ms | TTFT p99 ms | tok/s | vs direct | min vs direct "
             "| vs service | CPU s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for p in phases:
        row = p.row()
        cpu = f"{p.cpu_seconds:.2f}"
        if p.server_cpu_seconds is not None:
            cpu = f"{p.server_cpu_seconds:.2f} + {cpu}"
        lines.append(f"| {p.clients} | {p.system} | {p.requests} | {row['ttft_p50_ms']:.1f} | {row['ttft_p99_ms']:.1f} "
                     f"| {row['tokens_per_second']:.0f} | {p.ratio:.2f} | {p.min_ratio:.2f} "
                     f"| {'—' if math.isnan(p.service_ratio) else f'{p.service_ratio:.2f}'} | {cpu} |")
    return "\n".join(lines)


def plot(phases: list[Phase], path: Path, title: str) -> Path:
    """Ratio to the direct engine against clients (one line through each system's medians, its rounds as
    dots) beside TTFT p50, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = sorted({p.clients for p in phases})
    systems = list(dict.fromkeys(p.system for p in phases if p.system != "direct"))
    colour = {system: f"C{i}" for i, system in enumerate(["direct", *systems])}
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for k, system in enumerate(systems):
        rows = {p.clients: p for p in phases if p.system == system}
        xs = [i for i, c in enumerate(counts) if c in rows]
        left.plot(xs, [rows[counts[i]].ratio for i in xs], marker="o", label=system, color=colour[system])
        for i in xs:
            rounds = rows[counts[i]].rounds
            left.scatter([i + 0.04 * (k - len(systems) / 2)] * len(rounds), rounds, s=10, alpha=0.5,
                         color=colour[system])
    left.axhline(GOAL, color="grey", linestyle="--", linewidth=1, label=f"goal {GOAL}")
    left.axhline(1.0, color="black", linewidth=0.5)
    left.set(xticks=range(len(counts)), xticklabels=[str(c) for c in counts], xlabel="concurrent clients",
             ylabel="tok/s ÷ the direct engine's (median; dots: rounds)")
    left.legend(fontsize=8)
    for system in ["direct", *systems]:
        rows = {p.clients: p for p in phases if p.system == system}
        xs = [i for i, c in enumerate(counts) if c in rows]
        right.plot(xs, [1e3 * _quantile(rows[counts[i]].ttft, 0.5) for i in xs], marker="o", label=system,
                   color=colour[system])
    right.set(xticks=range(len(counts)), xticklabels=[str(c) for c in counts], xlabel="concurrent clients",
              ylabel="time to first token p50 (ms)", yscale="log")
    right.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
