"""`dspark bench`: our speed side by side with what users would otherwise run, with plots.

    dspark bench --quick --out bench-out          # the bundled demo pair, a few minutes
    dspark bench --out bench-out                  # the full sweep (1 → 1024 concurrent requests)
    dspark bench --quick --standin --out bench-out  # + the sweep on a 100M COST STAND-IN target
    dspark bench --engine DIR --target T --drafter D --dflash F --out bench-out

Writes results.json, report.md (the tables) and PNG plots into --out. See dspark.tools.bench.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import click

from .errors import OneLineErrors

_DIR = click.Path(exists=True, file_okay=False, path_type=Path)
SCHEMA_VERSION = 2  # 2: load_sweeps, one labelled entry per target
SWEEP_DISTINCT_PROMPTS = 64  # the sweep's request i uses prompt i % 64


@dataclass(frozen=True)
class Sizes:
    prompts: int
    prompt_len: int
    new_tokens: int  # single stream and acceptance
    concurrency: tuple[int, ...]
    sweep_prompt_len: int
    sweep_new_tokens: int
    sweep_repeats: int = 3  # interleaved runs per (scheduler, concurrency); rows are the median run
    single_stream_repeats: int = 3  # interleaved rounds over the prompts; rows are each system's median round


QUICK = Sizes(prompts=8, prompt_len=64, new_tokens=64, concurrency=(1, 4, 16, 64, 256), sweep_prompt_len=32,
              sweep_new_tokens=16, single_stream_repeats=1)
FULL = Sizes(prompts=8, prompt_len=64, new_tokens=128, concurrency=(1, 4, 16, 64, 256, 1024), sweep_prompt_len=32,
             sweep_new_tokens=32)


def _concurrency(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError as exc:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}") from exc
    if not values or min(values) < 1:
        raise click.BadParameter(f"concurrency values must be >= 1, got {text!r}")
    return values


@click.command("bench", cls=OneLineErrors)
@click.option("--out", "out", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Output directory: results.json, report.md, PNG plots, cache/.")
@click.option("--quick", is_flag=True, help="Fewer tokens, sweep up to 256 requests (a few minutes on a laptop CPU).")
@click.option("--engine", "engine", type=_DIR, help="Engine or dspark-export directory for our runtime.")
@click.option("--target", "target", type=_DIR, help="Target checkpoint (default: the bundled demo pair).")
@click.option("--drafter", "drafter", type=_DIR, help="DSpark drafter checkpoint (with --target).")
@click.option("--dflash", "dflash", type=_DIR, help="DFlash drafter checkpoint for the acceptance study.")
@click.option("--prompts", "prompts_file", type=click.Path(dir_okay=False, path_type=Path),
              help="Prompts: JSON lines {\"ids\": [...]} / {\"text\": ...}, or text, one per line.")
@click.option("--threads", default=1, show_default=True, type=click.IntRange(min=1),
              help="Intra-op threads for every system.")
@click.option("--num-prompts", type=click.IntRange(min=1), help="Override the prompt count.")
@click.option("--prompt-len", type=click.IntRange(min=1), help="Override the default prompts' length.")
@click.option("--new-tokens", type=click.IntRange(min=1), help="Override single-stream new tokens.")
@click.option("--concurrency", help="Override the sweep's concurrent requests: 1,4,16.")
@click.option("--sweep-new-tokens", type=click.IntRange(min=1), help="Override new tokens per sweep request.")
@click.option("--no-peers", is_flag=True, help="Skip Hugging Face transformers and onnxruntime-genai.")
@click.option("--draft-model", "draft_model", type=_DIR,
              help="Autoregressive draft model for onnxruntime-genai's draft-model speculation peer "
                   "(default: the one `dspark train draft-model` made for the target, if any).")
@click.option("--standin", is_flag=True,
              help="Also sweep a COST STAND-IN target: the target inflated to --standin-params (made into the "
                   "user cache once, as `dspark train standin`), with the same drafter.")
@click.option("--standin-params", default="100M", show_default=True,
              help="The stand-in's size: 100M, 1.5B, 250k, or a multiple of the target (4x).")
@click.option("--sweep-only", is_flag=True, help="Only the load sweep(s): no acceptance, single stream, peers.")
@click.option("--sweep-repeats", default=3, show_default=True, type=click.IntRange(min=1),
              help="Interleaved runs per scheduler and concurrency in the sweep, three times that where runs "
                   "last under 0.5 s (rows: the median run).")
@click.option("--single-stream-repeats", type=click.IntRange(min=1),
              help="Interleaved rounds of the single-stream prompts (rows: each system's median round; the ratios "
                   "to onnxruntime-genai with their min and median over the rounds). Default: 3, 1 with --quick.")
def bench(out, quick, engine, target, drafter, dflash, prompts_file, threads, num_prompts, prompt_len, new_tokens,
          concurrency, sweep_new_tokens, no_peers, draft_model, standin, standin_params, sweep_only,
          sweep_repeats, single_stream_repeats) -> None:
    """Acceptance, single-stream speed against peers, and a concurrency sweep, with plots."""
    from .bench.subjects import BenchSetupError

    base = QUICK if quick else FULL
    sizes = Sizes(num_prompts or base.prompts, prompt_len or base.prompt_len, new_tokens or base.new_tokens,
                  _concurrency(concurrency) or base.concurrency, min(prompt_len or base.sweep_prompt_len,
                                                                     base.sweep_prompt_len),
                  sweep_new_tokens or base.sweep_new_tokens, sweep_repeats,
                  single_stream_repeats or base.single_stream_repeats)
    out.mkdir(parents=True, exist_ok=True)
    try:
        results = run_bench(out, sizes, engine=engine, target=target, drafter=drafter, dflash=dflash,
                            prompts_file=prompts_file, threads=threads, peers=not no_peers, draft_model=draft_model,
                            standin_params=standin_params if standin else None, sweep_only=sweep_only)
    except BenchSetupError as exc:
        raise click.UsageError(str(exc)) from exc
    results["command"] = " ".join(["dspark", *sys.argv[1:]]) if sys.argv[0].endswith("dspark") else None
    from .bench.plots import write_plots
    from .bench.report import markdown

    results["plots"] = write_plots(results, out)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    (out / "report.md").write_text(markdown(results), encoding="utf-8")
    click.echo(markdown(results))
    click.echo(f"wrote {out / 'results.json'}, {out / 'report.md'}, {', '.join(results['plots'])} "
               f"in {results['seconds']:.0f} s")


def run_bench(out: Path, sizes: Sizes, *, engine: Path | None, target: Path | None, drafter: Path | None,
              dflash: Path | None, prompts_file: Path | None, threads: int, peers: bool,
              draft_model: Path | None = None, standin_params: str | None = None, sweep_only: bool = False) -> dict:
    import torch
    from tqdm import tqdm

    from .bench import load_sweep, single_stream, subjects

    began = time.perf_counter()
    torch.set_num_threads(threads)
    load_before = os.getloadavg()
    cache = out / "cache"
    tqdm.write("dspark bench: preparing the runtime (export, cost-model profiling)")
    chosen = subjects.resolve(engine, target, drafter, dflash, cache, threads)
    standin = None
    if standin_params is not None:
        tqdm.write(f"dspark bench: the COST STAND-IN target ({standin_params}): inflate, export, build (once)")
        standin = subjects.resolve_standin(chosen, standin_params, cache, threads=threads)
    runtime = single_stream.load_runtime(chosen.runtime_dir, threads=threads)
    info = runtime.info
    stop = subjects.stop_token(info.eos_token_ids, info.mask_token_id)
    prompts, prompt_source = subjects.load_prompts(
        prompts_file, chosen.tokenizer_path, count=sizes.prompts, length=sizes.prompt_len,
        vocab_size=info.vocab_size, avoid=(stop, info.mask_token_id))
    longest = max(len(p) for p in prompts)
    if longest + sizes.new_tokens > info.max_positions:
        raise subjects.BenchSetupError(f"prompts up to {longest} tokens + {sizes.new_tokens} new tokens exceed "
                                       f"the model's {info.max_positions} positions")
    results: dict = {
        "schema_version": SCHEMA_VERSION,
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "cpus": os.cpu_count(), "threads": threads, "load_average_before": load_before},
        "config": {"prompts": len(prompts), "prompt_source": prompt_source, "new_tokens": sizes.new_tokens,
                   "concurrency": list(sizes.concurrency), "sweep_prompt_len": sizes.sweep_prompt_len,
                   "sweep_new_tokens": sizes.sweep_new_tokens, "sweep_repeats": sizes.sweep_repeats,
                   "single_stream_repeats": sizes.single_stream_repeats,
                   "sweep_distinct_prompts": SWEEP_DISTINCT_PROMPTS,
                   "stop_token": stop,
                   "block_size": info.block_size},
        "subjects": {"source": chosen.source, **{k: None if v is None else str(v) for k, v in {
            "runtime_dir": chosen.runtime_dir, "target_dir": chosen.target_dir, "dspark_dir": chosen.dspark_dir,
            "dflash_dir": chosen.dflash_dir}.items()}},
    }
    if standin is not None:
        results["subjects"]["standin"] = standin.record
    if sweep_only:
        results["acceptance_status"] = "skipped: --sweep-only"
    else:
        _single_stream(results, runtime, chosen, prompts, sizes, stop=stop, longest=longest, cache=cache,
                       threads=threads, peers=peers, draft_model=draft_model)

    sweep_prompts, _ = subjects.load_prompts(
        prompts_file, chosen.tokenizer_path, count=min(max(sizes.concurrency), SWEEP_DISTINCT_PROMPTS),
        length=sizes.sweep_prompt_len, vocab_size=info.vocab_size, avoid=(stop, info.mask_token_id), seed=1)
    sweep_prompts = [p[: sizes.sweep_prompt_len] for p in sweep_prompts]
    sweep = dict(concurrency=sizes.concurrency, max_new_tokens=sizes.sweep_new_tokens, stop=stop,
                 repeats=sizes.sweep_repeats)
    results["vllm_reference"] = load_sweep.VLLM_REFERENCE
    results["load_sweeps"] = [load_sweep.target_sweep(subjects.target_label(chosen), runtime, sweep_prompts,
                                                      confidences=subjects.confidence_note(chosen.runtime_dir),
                                                      **sweep)]
    results["cost_model_ms"] = runtime.cost_model.to_dict() if runtime.cost_model else None
    if standin is not None:
        standin_runtime = single_stream.load_runtime(standin.runtime_dir, threads=threads)
        results["load_sweeps"].append(load_sweep.target_sweep(
            standin.label, standin_runtime, sweep_prompts, standin=standin.record,
            confidences=subjects.confidence_note(standin.runtime_dir), **sweep))
    results["machine"]["load_average_after"] = os.getloadavg()
    results["seconds"] = round(time.perf_counter() - began, 1)
    return results


def _single_stream(results: dict, runtime, chosen, prompts: list[list[int]], sizes: Sizes, *, stop: int,
                   longest: int, cache: Path, threads: int, peers: bool, draft_model: Path | None = None) -> None:
    """Acceptance (with checkpoints), single stream against the peers, and loop efficiency, into `results`."""
    from tqdm import tqdm

    from dspark.models import load_pair
    from dspark.runtime.reference_decoder import autoregressive_generate

    from .bench import acceptance, replay, single_stream
    from .bench import peers as peer_systems
    from .bench.report import single_stream_ratios

    ours = single_stream.runtime_systems(runtime, stop=stop, max_seq_len=longest + sizes.new_tokens + 64)

    reference, reference_name = None, "dspark autoregressive (no checkpoint to compare against)"
    if chosen.target_dir is not None:
        tqdm.write("dspark bench: acceptance of the drafters (reference decoder)")
        target_model, dspark_model = load_pair(chosen.target_dir, chosen.dspark_dir)
        results["acceptance"] = acceptance.acceptance_study(
            chosen.target_dir, target_model, dspark_model, chosen.dflash_dir, prompts,
            max_new_tokens=sizes.new_tokens, stop=stop)
        reference = [autoregressive_generate(target_model, p, max_new_tokens=sizes.new_tokens,
                                             stop_token_ids=(stop,)) for p in prompts]
        reference_name = "PyTorch target, greedy (dspark.runtime.reference_decoder)"
    else:
        results["acceptance_status"] = "skipped: needs --target and --drafter checkpoint folders"

    systems, rows = list(ours), []
    if peers and chosen.target_dir is not None:
        from .draft_model import find_draft_model

        draft_model = draft_model or find_draft_model(chosen.target_dir)
        for build in (lambda: peer_systems.transformers_systems(chosen.target_dir, stop=stop, threads=threads),
                      lambda: peer_systems.genai_systems(chosen.target_dir, cache, stop=stop, threads=threads),
                      lambda: peer_systems.genai_draft_systems(chosen.target_dir, draft_model, cache, stop=stop,
                                                               threads=threads)):
            try:
                systems += build()
            except peer_systems.PeerUnavailable as exc:
                rows.append({"system": exc.system or str(exc).split(":")[0], "runtime": "", "lossless": True,
                             "status": str(exc)})
    tqdm.write(f"dspark bench: single stream, {len(systems)} systems: {', '.join(s.name for s in systems)}")
    rows += single_stream.run_systems(systems, prompts, sizes.new_tokens, reference, progress=True,
                                      rounds=sizes.single_stream_repeats)
    if reference is None:
        plain = next(r for r in rows if r["system"] == "dspark autoregressive")
        reference = plain["outputs"]
        for r in rows:
            if r.get("status") == "ok" and r["lossless"]:
                r["greedy_check"] = single_stream.greedy_check(r["outputs"], reference)
    for r in rows:
        r.pop("outputs", None)
    results["single_stream"] = {"reference": reference_name, "prompts": len(prompts),
                                "max_new_tokens": sizes.new_tokens, "rounds": sizes.single_stream_repeats,
                                "rows": rows, "ratios": single_stream_ratios(rows)}
    tqdm.write("dspark bench: loop efficiency (the engine against a replay of its own graph calls)")
    results["loop_efficiency"] = replay.loop_efficiency(
        runtime, prompts[:4], max_new_tokens=sizes.new_tokens, stop=stop,
        max_seq_len=longest + sizes.new_tokens + 64)
