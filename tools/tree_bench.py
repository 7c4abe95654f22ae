"""Trees vs chains, and Markov-conditioned trees vs trees from per-position marginals.

    python -m dspark.tools.tree_bench --out build/tree_bench

For each temperature (0 and 1 by default) and node budget N (8, 16, 32, 64 draft nodes verified
per round) it decodes the same prompts with the single-request PyTorch decoders and reports the
mean accepted length (bonus included) and wall-clock tokens/s of:

- `chain`: DSpark chain drafting (reference decoder), min(N, γ) drafts: a chain cannot be longer
  than the drafter's block;
- `markov`: best-first trees whose children are conditioned on their parent token;
- `marginals`: best-first trees over the per-position distributions of the greedy chain;
- `sampled-markov`, `sampled-marginals` (temperature > 0 only): the best-first tree's shape with
  its tokens drawn without replacement (`sample_tree`), children conditioned on the sampled parent
  (markov) or not (marginals);
- `markov+sched`: Markov trees with per-round budgets from the node scheduler (at most the
  largest N), with SPS(B) from the round times of the fixed-budget Markov runs at temperature 0;
- `autoregressive`: target-only decoding.

Prints a table and writes tree_bench.json and tree_bench.png under --out. Models: the bundled
demo pair (models/demo/target + models/demo/dspark) with held-out stdlib prompts; if the demo
pair is not there, the golden qwen3-tiny-vanilla pair with its four trace prompts (said in the
output). Every run is checked against target-only greedy decoding at temperature 0.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import click
import numpy as np
import torch

from dspark.models import DSparkDrafter, TargetModel, load_pair
from dspark.runtime.reference_decoder import autoregressive_generate, speculative_generate
from dspark.runtime.tree_decoder import tree_generate

DEMO = Path(str(resources.files("dspark.models") / "demo"))
GOLDEN = Path(__file__).resolve().parents[2] / "shared" / "golden" / "qwen3-tiny-vanilla"
SHIPPED = ("config.json", "model.safetensors")


def pick_pair(target_dir: Path | None, drafter_dir: Path | None) -> tuple[str, Path, Path]:
    """(description, target folder, drafter folder): the given pair, else the demo, else golden."""
    if target_dir is not None and drafter_dir is not None:
        return f"given pair {target_dir} + {drafter_dir}", target_dir, drafter_dir
    demo_t, demo_d = DEMO / "target", DEMO / "dspark"
    if all((folder / f).is_file() for folder in (demo_t, demo_d) for f in SHIPPED):
        return "bundled demo pair (models/demo/target + models/demo/dspark)", demo_t, demo_d
    if not (GOLDEN / "target" / "config.json").is_file():
        raise click.ClickException(f"neither the demo pair under {DEMO} nor the golden pair under {GOLDEN} exists")
    return ("golden qwen3-tiny-vanilla pair: THE DEMO PAIR WAS NOT AVAILABLE", GOLDEN / "target",
            GOLDEN / "drafter")


def pick_prompts(target_dir: Path, count: int, length: int) -> list[list[int]]:
    """Held-out stdlib windows for a folder with tokenizer.json; else the golden trace prompts."""
    tokenizer_file = target_dir / "tokenizer.json"
    if tokenizer_file.is_file():
        from tokenizers import Tokenizer

        from dspark.tools import corpus, demo_eval

        tokenizer = Tokenizer.from_file(str(tokenizer_file))
        streams = [corpus.encode_corpus(tokenizer, [doc]) for doc in
                   corpus.read_documents(corpus.corpus_files("heldout"))]
        prompts = demo_eval.heldout_prompts(streams, per_module=max(1, -(-count // len(streams))),
                                            prompt_len=length)
        return prompts[:count]
    traces = json.loads((GOLDEN / "traces.json").read_text())
    return [s["prompt_ids"] for s in traces["samples"]][:count]


def run_method(
    decode: Callable[[list[int], int], Any], prompts: Sequence[list[int]], greedy_reference: list[list[int]] | None
) -> dict[str, Any]:
    """decode(prompt, seed) -> result with .tokens/.rounds (or a token list); time and summarise."""
    acceptance, nodes, expected, tokens, rounds = [], [], [], 0, 0
    began = time.perf_counter()
    for i, prompt in enumerate(prompts):
        result = decode(prompt, i)
        out = result if isinstance(result, list) else result.tokens
        if greedy_reference is not None and out != greedy_reference[i]:
            raise click.ClickException(f"prompt {i}: greedy speculative output differs from target greedy")
        tokens += len(out)
        for r in getattr(result, "rounds", []):
            acceptance.append(r.acceptance_length)
            nodes.append(getattr(r, "tree_nodes", getattr(r, "proposal_length", 0)))
            if hasattr(r, "expected_acceptance"):
                expected.append(r.expected_acceptance)
        rounds += len(getattr(result, "rounds", []))
    seconds = time.perf_counter() - began
    summary = {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_second": round(tokens / seconds, 1)}
    if rounds:
        summary.update(rounds=rounds, mean_acceptance_length=round(float(np.mean(acceptance)), 3),
                       mean_draft_nodes=round(float(np.mean(nodes)), 2),
                       seconds_per_round=seconds / rounds)
    if expected:  # the builder's own estimate 1 + Σ node scores, to compare with the measured τ
        summary["mean_expected_acceptance"] = round(float(np.mean(expected)), 3)
    return summary


def sps_from_rounds(rounds_seconds: dict[int, float]) -> Callable[[int], float]:
    """Steps/s at B verified tokens, interpolating measured seconds per round over B = N + 1."""
    sizes = sorted(rounds_seconds)
    xs = np.array([n + 1 for n in sizes], dtype=np.float64)
    ys = np.array([rounds_seconds[n] for n in sizes])
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])

    def sps(tokens: int) -> float:
        seconds = np.interp(tokens, xs, ys) if tokens <= xs[-1] else ys[-1] + slope * (tokens - xs[-1])
        return 1.0 / max(float(seconds), 1e-9)

    return sps


def bench(
    target: TargetModel, drafter: DSparkDrafter, prompts: list[list[int]], *, budgets: Sequence[int],
    temperatures: Sequence[float], new_tokens: int,
) -> dict[str, Any]:
    gamma = drafter.config.block_size
    results: dict[str, Any] = {}
    sps = None
    for temperature in temperatures:
        reference = None
        if temperature == 0.0:
            reference = [autoregressive_generate(target, p, max_new_tokens=new_tokens) for p in prompts]
        row: dict[str, Any] = {"autoregressive": run_method(
            lambda p, s, t=temperature: autoregressive_generate(target, p, max_new_tokens=new_tokens,
                                                                temperature=t, seed=s), prompts, reference)}
        for n in budgets:
            row[f"chain/{n}"] = run_method(
                lambda p, s, t=temperature, n=n: speculative_generate(
                    target, drafter, p, max_new_tokens=new_tokens, temperature=t, seed=s, block_size=min(n, gamma)),
                prompts, reference)
            for mode in ("markov", "marginals"):
                row[f"{mode}/{n}"] = run_method(
                    lambda p, s, t=temperature, n=n, m=mode: tree_generate(
                        target, drafter, p, max_new_tokens=new_tokens, num_nodes=n, mode=m, temperature=t, seed=s),
                    prompts, reference)
            if temperature > 0.0:
                for mode in ("markov", "marginals"):
                    row[f"sampled-{mode}/{n}"] = run_method(
                        lambda p, s, t=temperature, n=n, m=mode: tree_generate(
                            target, drafter, p, max_new_tokens=new_tokens, num_nodes=n, mode=m, draw="sampled",
                            temperature=t, seed=s),
                        prompts, reference)
            click.echo(f"  T={temperature} N={n}: chain {row[f'chain/{n}']['mean_acceptance_length']}, "
                       f"markov {row[f'markov/{n}']['mean_acceptance_length']}, "
                       f"marginals {row[f'marginals/{n}']['mean_acceptance_length']}")
        if sps is None:
            row["markov/0"] = run_method(
                lambda p, s, t=temperature: tree_generate(target, drafter, p, max_new_tokens=new_tokens,
                                                          num_nodes=0, temperature=t, seed=s), prompts, reference)
            costs = {0: row["markov/0"]["seconds_per_round"]}
            costs.update({n: row[f"markov/{n}"]["seconds_per_round"] for n in budgets})
            sps = sps_from_rounds(costs)
            results["cost_table_seconds_per_round"] = {str(n + 1): round(c, 5) for n, c in sorted(costs.items())}
        row["markov+sched"] = run_method(
            lambda p, s, t=temperature, f=sps: tree_generate(target, drafter, p, max_new_tokens=new_tokens,
                                                             num_nodes=max(budgets), temperature=t, seed=s, sps=f),
            prompts, reference)
        results[f"T={temperature:g}"] = row
    return results


def table(results: dict[str, Any], budgets: Sequence[int]) -> str:
    lines = []
    for key, row in results.items():
        if not key.startswith("T="):
            continue
        ar = row["autoregressive"]["tokens_per_second"]
        lines.append(f"\n{key}   (autoregressive: {ar} tok/s)")
        lines.append(f"{'N':>4} | {'chain τ':>8} {'tok/s':>7} | {'markov τ':>9} {'tok/s':>7} | "
                     f"{'marginal τ':>10} {'tok/s':>7}")
        for n in budgets:
            cells = [row[f"{m}/{n}"] for m in ("chain", "markov", "marginals")]
            lines.append(f"{n:>4} | {cells[0]['mean_acceptance_length']:>8.3f} {cells[0]['tokens_per_second']:>7.1f} | "
                         f"{cells[1]['mean_acceptance_length']:>9.3f} {cells[1]['tokens_per_second']:>7.1f} | "
                         f"{cells[2]['mean_acceptance_length']:>10.3f} {cells[2]['tokens_per_second']:>7.1f}")
        if f"sampled-markov/{budgets[0]}" in row:
            lines.append("sampled trees (best-first shape, tokens drawn without replacement):")
            for n in budgets:
                a, b = row[f"sampled-markov/{n}"], row[f"sampled-marginals/{n}"]
                lines.append(f"{n:>4} | markov τ {a['mean_acceptance_length']:.3f} {a['tokens_per_second']:>7.1f} tok/s"
                             f" | marginals τ {b['mean_acceptance_length']:.3f} {b['tokens_per_second']:>7.1f} tok/s")
        s = row["markov+sched"]
        lines.append(f"markov+sched (≤{max(budgets)} nodes, mean {s['mean_draft_nodes']}): "
                     f"τ {s['mean_acceptance_length']:.3f}, {s['tokens_per_second']} tok/s")
    return "\n".join(lines)


def plot(results: dict[str, Any], budgets: Sequence[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    rows = [k for k in results if k.startswith("T=")]
    fig, axes = plt.subplots(len(rows), 2, figsize=(11, 4 * len(rows)), squeeze=False)
    for (left, right), key in zip(axes, rows, strict=True):
        row = results[key]
        methods = [("chain", "s--"), ("markov", "o-"), ("marginals", "^-")]
        methods += [(m, st) for m, st in (("sampled-markov", "o:"), ("sampled-marginals", "^:"))
                    if f"{m}/{budgets[0]}" in row]
        for method, style in methods:
            left.plot(budgets, [row[f"{method}/{n}"]["mean_acceptance_length"] for n in budgets], style, label=method)
            right.plot(budgets, [row[f"{method}/{n}"]["tokens_per_second"] for n in budgets], style, label=method)
        right.axhline(row["autoregressive"]["tokens_per_second"], color="grey", linestyle=":", label="autoregressive")
        sched = row["markov+sched"]
        for ax, field in ((left, "mean_acceptance_length"), (right, "tokens_per_second")):
            ax.plot([sched["mean_draft_nodes"]], [sched[field]], "k*", markersize=11, label="markov+sched")
            ax.set_xscale("log", base=2)
            ax.set_xticks(list(budgets), [str(n) for n in budgets])
            ax.legend(fontsize=8)
        left.set(xlabel="draft nodes per round", ylabel="mean accepted length (bonus incl.)", title=key)
        right.set(xlabel="draft nodes per round", ylabel="tokens/s (wall clock)", title=key)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@click.command()
@click.option("--target", "target_dir", type=click.Path(path_type=Path, file_okay=False), default=None)
@click.option("--drafter", "drafter_dir", type=click.Path(path_type=Path, file_okay=False), default=None)
@click.option("--out", type=click.Path(path_type=Path, file_okay=False), default=Path("build/tree_bench"))
@click.option("--prompts", "num_prompts", type=int, default=8, show_default=True)
@click.option("--prompt-len", type=int, default=64, show_default=True)
@click.option("--new-tokens", type=int, default=64, show_default=True)
@click.option("--budgets", default="8,16,32,64", show_default=True)
@click.option("--temperatures", default="0,1", show_default=True)
@click.option("--threads", type=int, default=1, show_default=True, help="torch intra-op threads")
def main(target_dir, drafter_dir, out, num_prompts, prompt_len, new_tokens, budgets, temperatures, threads) -> None:
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _run(target_dir, drafter_dir, out, num_prompts, prompt_len, new_tokens, budgets, temperatures, threads)
    finally:
        torch.set_num_threads(previous_threads)


def _run(target_dir, drafter_dir, out, num_prompts, prompt_len, new_tokens, budgets, temperatures, threads) -> None:
    budget_list = [int(b) for b in budgets.split(",")]
    temperature_list = [float(t) for t in temperatures.split(",")]
    description, target_path, drafter_path = pick_pair(target_dir, drafter_dir)
    click.echo(f"models: {description}")
    target, drafter = load_pair(target_path, drafter_path)
    prompts = pick_prompts(target_path, num_prompts, prompt_len)
    click.echo(f"{len(prompts)} prompts, {new_tokens} new tokens each, block size γ={drafter.config.block_size}, "
               f"{threads} thread(s)")
    results = bench(target, drafter, prompts, budgets=budget_list, temperatures=temperature_list,
                    new_tokens=new_tokens)
    results["setup"] = {"models": description, "target": str(target_path), "drafter": str(drafter_path),
                        "prompts": len(prompts), "prompt_lengths": [len(p) for p in prompts],
                        "new_tokens": new_tokens, "block_size": drafter.config.block_size, "threads": threads,
                        "budgets": budget_list}
    click.echo(table(results, budget_list))
    out.mkdir(parents=True, exist_ok=True)
    (out / "tree_bench.json").write_text(json.dumps(results, indent=2))
    plot(results, budget_list, out / "tree_bench.png")
    click.echo(f"wrote {out / 'tree_bench.json'} and {out / 'tree_bench.png'}")


if __name__ == "__main__":
    main()
