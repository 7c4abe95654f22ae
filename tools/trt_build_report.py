"""TensorRT-RTX build cost: build time and plan size per graph and bucket count, ahead of time on
this machine (no GPU), and whether every graph of every export builds.

    python -m dspark.tools.trt_build_report                       # demo pair and golden Qwen3 pair
    python -m dspark.tools.trt_build_report --pairs real-width --dtype float16

Pairs: `demo` (the bundled demo pair), `golden` (the golden Qwen3 vanilla pair; needs
$DSPARK_GOLDEN or ../shared/golden), `real-width` (a Qwen3-0.6B-width pair with random weights:
hidden 1024, 16/8 heads of 128, MLP 3072, vocab 151936, tied embeddings, `--layers` target
layers and a one-layer drafter, written into the work dir; nothing is kept unless `--work` is
given). Each export is built with bucket tables of `--bucket-counts` buckets spread over the
powers of two up to `--max-batch-tokens`; the drafter graphs have one profile whatever the table,
so they are built once. The fused graphs are tried too: TensorRT's parser message says why they
do not build. Every plan is checked against the graph contract and its buckets (trt_contract).
One process builds one graph at a time; it prints wall seconds and this process's CPU seconds
(all its threads), the figure that stays comparable when other work shares the machine.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import click

from .errors import OneLineErrors

REAL_WIDTH = {"hidden_size": 1024, "intermediate_size": 3072, "num_attention_heads": 16, "num_key_value_heads": 8,
              "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-06,
              "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}, "hidden_act": "silu",
              "model_type": "qwen3", "attention_bias": False}  # Qwen3-0.6B's config.json


@dataclass
class Row:
    pair: str
    graph: str
    buckets: int
    profiles: int
    seconds: float | None  # wall
    cpu_seconds: float | None  # this process's CPU time (all its threads): comparable on a shared machine
    plan_mb: float | None
    note: str


def bucket_table(count: int, max_batch_tokens: int) -> tuple[int, ...]:
    """`count` buckets spread over the powers of two up to max_batch_tokens (always the largest)."""
    from dspark.engines.buckets import plan_buckets

    full = plan_buckets(max_batch_tokens)
    if count >= len(full):
        return full
    if count == 1:
        return full[-1:]
    step = (len(full) - 1) / (count - 1)
    return tuple(full[round(i * step)] for i in range(count))


def write_real_width_pair(root: Path, layers: int, seed: int = 0) -> tuple[Path, Path]:
    """A Qwen3-0.6B-width target (`layers` layers) and a one-layer DSpark drafter, random weights."""
    import torch
    from safetensors.torch import save_file

    from dspark.models import DrafterConfig, DSparkDrafter, TargetConfig, TargetModel

    target_json = {**REAL_WIDTH, "architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": layers,
                   "tie_word_embeddings": True}
    drafter_json = {**REAL_WIDTH, "architectures": ["Qwen3DSparkModel"], "num_hidden_layers": 1, "block_size": 7,
                    "target_layer_ids": list(range(max(1, min(layers - 1, 2)))), "num_target_layers": layers,
                    "mask_token_id": REAL_WIDTH["vocab_size"] - 1, "markov_rank": 16, "markov_head_type": "vanilla",
                    "enable_confidence_head": True, "confidence_head_with_markov": True, "tie_word_embeddings": False}
    torch.manual_seed(seed)
    target = TargetModel(TargetConfig.from_dict(target_json), tuple(drafter_json["target_layer_ids"])).eval()
    drafter = DSparkDrafter(DrafterConfig.from_dict(drafter_json)).eval()
    with torch.no_grad():
        for module in (target, drafter):
            for p in module.parameters():
                p.normal_(0.0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    folders = []
    for name, model, config in (("target", target, target_json), ("drafter", drafter, drafter_json)):
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        state = model.state_dict()
        if name == "target":  # Hugging Face names; the tied LM head is the embedding
            state = {(k if k.startswith("lm_head") else f"model.{k}"): v for k, v in state.items()
                     if k != "lm_head.weight"}
        else:  # DeepSpec drafters share the target's embedding and LM head
            state = {k: v for k, v in state.items() if k not in ("embed_tokens.weight", "lm_head.weight")}
        (folder / "config.json").write_text(json.dumps(config, indent=1))
        save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
        folders.append(folder)
    return folders[0], folders[1]


def pair_dirs(pair: str, work: Path, layers: int) -> tuple[Path, Path]:
    if pair == "demo":
        from .demo_engine import DEMO_DRAFTER, DEMO_TARGET

        return DEMO_TARGET, DEMO_DRAFTER
    if pair == "golden":
        golden = Path(os.environ.get("DSPARK_GOLDEN", Path(__file__).resolve().parents[2] / "shared" / "golden"))
        folder = golden / "qwen3-tiny-vanilla"
        if not folder.is_dir():
            raise click.ClickException(f"{folder} not found: set DSPARK_GOLDEN")
        return folder / "target", folder / "drafter"
    return write_real_width_pair(work / "real-width-checkpoint", layers)


def build_pair(pair: str, export: Path, bucket_counts: tuple[int, ...], max_batch_tokens: int,
               ccs: tuple[str, ...], say) -> list[Row]:
    from dspark.engines import trt_builder as TB
    from dspark.engines.buckets import ShapeLimits
    from dspark.engines.export_source import BuildError
    from dspark.engines.trt_contract import TARGET_GRAPHS, check_network, check_profiles
    from dspark.export.manifest import graph_specs, read_manifest
    from dspark.runtime.trt_flavours import TENSORRT_RTX, import_flavour

    trt = import_flavour(TENSORRT_RTX)
    logger = TB.make_logger(trt)
    manifest = read_manifest(export, verify="none")
    specs = graph_specs(manifest)
    limits = ShapeLimits(max_batch=8, max_seq_len=min(1024, manifest["target"]["max_position_embeddings"]),
                         verify_width=1 + manifest["drafter"]["block_size"])
    buildable = TB.buildable_graphs(manifest)
    rows = []
    for name in manifest["graphs"]:
        counts = bucket_counts if name in TARGET_GRAPHS else bucket_counts[-1:]
        for count in counts:
            buckets = bucket_table(count, max_batch_tokens)
            shapes = TB.graph_profiles(specs[name], buckets, limits) if name in buildable else []
            say(f"{pair}: {name}, {len(shapes)} profile(s)")
            begin, cpu = time.perf_counter(), time.process_time()
            try:
                plan, held = TB.build_plan(trt, logger, TENSORRT_RTX, export / manifest["graphs"][name]["file"],
                                           shapes, ccs=ccs)
                seconds, cpu = time.perf_counter() - begin, time.process_time() - cpu
                check_network(specs[name], held["network"])
                check_profiles(specs[name], held["profiles"], buckets, limits)
                rows.append(Row(pair, name, len(buckets), len(shapes), seconds, cpu, len(plan) / 1e6, "contract ok"))
            except BuildError as exc:
                reason = str(exc).split(": ", 1)[-1][:200]
                rows.append(Row(pair, name, len(buckets), len(shapes), None, None, None, f"not built: {reason}"))
    return rows


def print_table(rows: list[Row]) -> None:
    heads = ("buckets", "profiles", "wall s", "CPU s", "plan MB")
    click.echo(f"{'pair':<11} {'graph':<20} " + " ".join(f"{h:>8}" for h in heads) + "  note")
    for r in rows:
        cells = ["-" if v is None else f"{v:.2f}" for v in (r.seconds, r.cpu_seconds, r.plan_mb)]
        click.echo(f"{r.pair:<11} {r.graph:<20} {r.buckets:>8} {r.profiles:>8} {cells[0]:>8} {cells[1]:>8} "
                   f"{cells[2]:>8}  {r.note}")


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(sorted({int(v) for v in text.split(",")}))
    except ValueError:
        raise click.BadParameter(f"{text!r}: expected comma-separated integers") from None
    if not values or values[0] < 1:
        raise click.BadParameter(f"{text!r}: counts must be >= 1")
    return values


@click.command("trt_build_report", cls=OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--pairs", default="demo,golden", show_default=True, help="Comma list of demo, golden, real-width.")
@click.option("--bucket-counts", default="1,2,4,7", show_default=True, help="Buckets per target engine to build.")
@click.option("--max-batch-tokens", default=64, show_default=True, type=int)
@click.option("--compute-capabilities", default="8.0,8.9", show_default=True)
@click.option("--dtype", default="float32", show_default=True, type=click.Choice(["float32", "float16", "bfloat16"]))
@click.option("--layers", default=2, show_default=True, type=click.IntRange(min=1), help="real-width target layers.")
@click.option("--work", type=click.Path(file_okay=False), help="Keep exports and checkpoints here (default: temp).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Also write the rows as JSON.")
def main(pairs, bucket_counts, max_batch_tokens, compute_capabilities, dtype, layers, work, json_out) -> None:
    """Build TensorRT-RTX plans ahead of time and print build time and plan size per graph."""
    from dspark.engines.trt_builder import check_ccs
    from dspark.export.pipeline import export_pair
    from dspark.runtime.trt_flavours import TENSORRT_RTX

    chosen = [p.strip() for p in pairs.split(",") if p.strip()]
    unknown = [p for p in chosen if p not in ("demo", "golden", "real-width")]
    if unknown:
        raise click.BadParameter(f"--pairs {unknown}: choose from demo, golden, real-width")
    counts = _ints(bucket_counts)
    ccs = check_ccs(TENSORRT_RTX, [c.strip() for c in compute_capabilities.split(",") if c.strip()])

    def say(message: str) -> None:
        click.echo(f"trt_build_report: {message}", err=True)

    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="trt-report-") as temp:
        root = Path(work) if work else Path(temp)
        for pair in chosen:
            target, drafter = pair_dirs(pair, root, layers)
            export = root / f"export-{pair}-{dtype}"
            say(f"{pair}: exporting ({dtype}) into {export}")
            export_pair(target, drafter, export, dtype=dtype, check=False)
            rows += build_pair(pair, export, counts, max_batch_tokens, ccs, say)
    import tensorrt_rtx

    click.echo(f"TensorRT-RTX {tensorrt_rtx.__version__}, ahead of time on {os.cpu_count()} CPUs (no GPU), "
               f"compute capabilities {','.join(ccs)}, dtype {dtype}, buckets up to {max_batch_tokens}")
    print_table(rows)
    if json_out:
        Path(json_out).write_text(json.dumps([r.__dict__ for r in rows], indent=1))


if __name__ == "__main__":
    main()
