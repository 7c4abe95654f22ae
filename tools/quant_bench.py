"""Weight-only quantized engines side by side: tok/s of autoregressive and DSpark decoding on
float32, int8 and int4 ONNX Runtime engines of one pair, and τ (mean tokens per verification) of
the drafter against each quantized target, from one interleaved run.

    python -m dspark.tools.quant_bench                       # the 100M COST STAND-IN + demo drafter
    python -m dspark.tools.quant_bench --target T --drafter D --out DIR --repeats 3

Each round runs every (engine, decoding) system on the same prompts, one request at a time, in
an order rotated per round; figures are medians over rounds, with min and max. DSpark output is
checked against the same engine's autoregressive output (lossless with respect to that engine's
quantized target). Engines are built once into --out and reused.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import click

from .errors import OneLineErrors

SCHEMES = ("float32", "int8", "int4")


def build_engines(target: Path, drafter: Path, out: Path, *, threads: int, progress) -> dict[str, Path]:
    """float32/int8/int4 engines of the pair under `out` (export and builds skipped when present)."""
    from dspark.engines import build as B
    from dspark.engines.quantize import QuantizeOptions
    from dspark.export.pipeline import export_pair

    export_dir = out / "export"
    if not (export_dir / "export.json").is_file():
        progress(f"exporting {target.name} + {drafter.name}")
        export_pair(target, drafter, export_dir, check=False)
    engines = {}
    for scheme in SCHEMES:
        engine = out / f"engine-{scheme}"
        if not (engine / "engine.json").is_file():
            progress(f"building the {scheme} engine")
            quantize = None if scheme == "float32" else QuantizeOptions(scheme)
            B.build_engine(export_dir, engine, B.BuildOptions(buckets=(1, 2, 4, 8, 16), max_batch_tokens=16,
                                                              max_batch=1, threads=threads, repeats=3,
                                                              quantize=quantize), progress=progress)
        engines[scheme] = engine
    return engines


def _run(runtime, prompts: list[list[int]], max_new_tokens: int) -> tuple[float, float, list[list[int]]]:
    """tok/s, τ (tokens per verification round) and the outputs of one system over the prompts."""
    tokens, seconds, rounds, emitted, texts = 0, 0.0, 0, 0, []
    for prompt in prompts:
        start = time.perf_counter()
        result = runtime.generate(prompt, max_new_tokens=max_new_tokens)[0]
        seconds += time.perf_counter() - start
        tokens += len(result.tokens)
        rounds += len(result.acceptance_lengths)
        emitted += sum(result.acceptance_lengths)
        texts.append(result.tokens)
    return tokens / seconds, emitted / max(rounds, 1), texts


def measure(engines: dict[str, Path], prompts: list[list[int]], *, max_new_tokens: int, repeats: int,
            progress, peer=None) -> dict[str, Any]:
    """Interleaved rounds over every engine x {autoregressive, dspark}: tok/s, τ, and lossless checks.
    One engine is open at a time (each round loads it again: memory stays at one engine's graphs).
    `peer` (a bench System, e.g. onnxruntime-genai's int4 greedy) runs in every round too."""
    from dspark.runtime.api import Runtime, RuntimeOptions
    from dspark.runtime.prefix_scheduler import SchedulerConfig

    def options(mode: str, block_size: int = 0) -> RuntimeOptions:
        # "fixed": every round verifies a whole block (γ = block size), so τ measures the drafter
        # against this target; the dspark scheduler drafts only where the engine's cost table says
        # it pays, so its τ also reflects that choice.
        scheduler = SchedulerConfig("fixed", fixed_length=block_size) if mode == "fixed" else SchedulerConfig(mode)
        return RuntimeOptions(scheduler=scheduler, max_requests=1, max_seq_len=1024, live_cost=False)

    schemes = list(engines)
    modes_run = ("off", "dspark", "fixed")
    systems = [(scheme, mode) for scheme in schemes for mode in modes_run]
    rates: dict[tuple, list[float]] = {s: [] for s in systems}
    taus: dict[tuple, list[float]] = {s: [] for s in systems}
    outputs: dict[tuple, list[list[int]]] = {}
    for round_index in range(repeats):
        shift = round_index % len(schemes)
        for scheme in schemes[shift:] + schemes[:shift]:
            with Runtime.load(engines[scheme], options("dspark")) as dspark:
                block = dspark.info.block_size
                modes = {"dspark": dspark, **{m: Runtime(dspark.backend, dspark.info, options(m, block),
                                                          cost_model=dspark.cost_model) for m in ("off", "fixed")}}
                for runtime in modes.values():  # warm-up: first-call allocations out of the timings
                    runtime.generate(prompts[0][:8], max_new_tokens=8)
                for mode in (modes_run if round_index % 2 == 0 else modes_run[::-1]):
                    rate, tau, texts = _run(modes[mode], prompts, max_new_tokens)
                    rates[(scheme, mode)].append(rate)
                    taus[(scheme, mode)].append(tau)
                    outputs[(scheme, mode)] = texts
                for mode in ("off", "fixed"):
                    modes[mode].detach()  # the backend is the dspark runtime's, closed with it
        if peer is not None:
            timelines = [peer.generate(prompt, max_new_tokens) for prompt in prompts]
            rates.setdefault(("peer", "greedy"), []).append(
                sum(len(t.tokens) for t in timelines) / sum(t.seconds for t in timelines))
            outputs[("peer", "greedy")] = [t.tokens for t in timelines]
        progress(f"round {round_index + 1}/{repeats} done")
    baseline = statistics.median(rates[("float32", "off")])
    rows = []
    for scheme, mode in systems:
        r = rates[(scheme, mode)]
        decoding = {"off": "autoregressive", "dspark": "dspark", "fixed": "dspark fixed γ=block"}[mode]
        rows.append({"engine": scheme, "decoding": decoding,
                     "tok_s_median": statistics.median(r), "tok_s_min": min(r), "tok_s_max": max(r),
                     "x_float32_autoregressive": statistics.median(r) / baseline,
                     "tau": statistics.median(taus[(scheme, mode)]),
                     "lossless_vs_own_autoregressive": outputs[(scheme, mode)] == outputs[(scheme, "off")]})
    if peer is not None:
        r, int4_greedy = rates[("peer", "greedy")], outputs.get(("int4", "off"))
        rows.append({"engine": "peer", "decoding": peer.name, "runtime": peer.runtime,
                     "tok_s_median": statistics.median(r), "tok_s_min": min(r), "tok_s_max": max(r),
                     "x_float32_autoregressive": statistics.median(r) / baseline, "tau": 1.0,
                     # its kernels are not ours: how many prompts it decodes exactly as our int4 engine does
                     "same_as_dspark_int4": None if int4_greedy is None else
                     sum(a == b for a, b in zip(outputs[("peer", "greedy")], int4_greedy, strict=True))})
    return {"rows": rows, "repeats": repeats, "prompts": len(prompts), "max_new_tokens": max_new_tokens}


@click.command("quant-bench", cls=OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--target", type=click.Path(exists=True, file_okay=False), help="Target folder (default: the "
              "100M COST STAND-IN in the user cache, made by `dspark train standin --params 100M`).")
@click.option("--drafter", type=click.Path(exists=True, file_okay=False), help="Drafter (default: the demo's).")
@click.option("--out", default="quant-bench-out", show_default=True, type=click.Path(file_okay=False))
@click.option("--prompts", "count", default=4, show_default=True, type=click.IntRange(min=1))
@click.option("--prompt-len", default=64, show_default=True, type=click.IntRange(min=1))
@click.option("--max-new-tokens", default=64, show_default=True, type=click.IntRange(min=1))
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(min=1))
@click.option("--threads", default=1, show_default=True, type=click.IntRange(min=0))
@click.option("--genai/--no-genai", default=True, show_default=True,
              help="Also time onnxruntime-genai's int4 model of the target (its model builder; skipped with the "
              "reason when onnxruntime-genai is not installed).")
def main(target, drafter, out, count, prompt_len, max_new_tokens, repeats, threads, genai) -> None:
    """tok/s and τ of float32/int8/int4 engines, autoregressive and DSpark, interleaved."""
    from dspark.models import TargetConfig
    from dspark.tools.bench.subjects import demo_folders, load_prompts
    from dspark.tools.demo_engine import cache_root

    demo_target, demo_drafter, _ = demo_folders()
    target = Path(target) if target else cache_root() / "standin-100M"
    drafter = Path(drafter) if drafter else demo_drafter
    if not (target / "config.json").is_file():
        raise click.UsageError(f"{target} has no config.json: make it with `dspark train standin --params 100M`")

    def progress(message: str) -> None:
        click.echo(f"quant-bench: {message}", err=True)

    out = Path(out)
    engines = build_engines(target, drafter, out, threads=threads, progress=progress)
    tokenizer = demo_target / "tokenizer.json"
    prompts, source = load_prompts(None, tokenizer if tokenizer.is_file() else None, count=count,
                                   length=prompt_len, vocab_size=TargetConfig.from_folder(target).vocab_size,
                                   avoid=())
    peer = None
    if genai:
        from dspark.tools.bench.peers import PeerUnavailable, genai_int4_greedy

        try:
            progress("onnxruntime-genai's int4 model of the target (its model builder, once)")
            peer = genai_int4_greedy(target, out, threads=threads)
        except PeerUnavailable as exc:
            progress(f"onnxruntime-genai int4 greedy {exc}")
    results = measure(engines, prompts, max_new_tokens=max_new_tokens, repeats=repeats, progress=progress,
                      peer=peer)
    results.update(target=str(target), drafter=str(drafter), prompt_source=source,
                   engine_bytes={s: sum(g["bytes"] for g in json.loads((e / "engine.json").read_text())["graphs"]
                                        .values()) for s, e in engines.items()})
    (out / "quant_bench.json").write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    click.echo(f"{'engine':<8} {'decoding':<20} {'tok/s (median [min, max])':>28} {'x fp32 AR':>9} {'tau':>5} "
               "lossless")
    for row in results["rows"]:
        check = row.get("lossless_vs_own_autoregressive")
        if check is None:
            same = row["same_as_dspark_int4"]
            check = "" if same is None else f"(same tokens as int4 AR: {same}/{len(prompts)} prompts)"
        click.echo(f"{row['engine']:<8} {row['decoding']:<20} {row['tok_s_median']:10.1f} "
                   f"[{row['tok_s_min']:6.1f}, {row['tok_s_max']:6.1f}]   {row['x_float32_autoregressive']:8.2f}x "
                   f"{row['tau']:5.2f} {check}")
    click.echo(f"wrote {out / 'quant_bench.json'} ({results['repeats']} interleaved rounds, {len(prompts)} prompts "
               f"from {source}, {max_new_tokens} new tokens each)")


if __name__ == "__main__":
    main()
