"""`dspark-export` (also `dspark export`): a target and its DSpark drafter -> ONNX graphs + export.json.

The option types come from the exporter (dtypes, opset range), so this module imports it at the
top; `dspark.tools.cli` imports this module only when the command runs. A --dtype typo is refused
by click before any work, an opset out of range by `export_pair` (ExportError).
"""

from __future__ import annotations

import click

from dspark.export.contract import DTYPES
from dspark.export.lower import MAX_OPSET, MIN_OPSET
from dspark.export.pipeline import DEFAULT_FLAVOURS, DEFAULT_OPSET, FLAVOURS, export_pair

from .errors import OneLineErrors

_DIR = str  # checked by export_pair, whose CheckpointError names the folder and the problem


@click.command("dspark-export", cls=OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--target", "target_dir", required=True, type=_DIR, help="Hugging Face target folder.")
@click.option(
    "--drafter", "drafter_dir", required=True, type=_DIR, help="DeepSpec DSpark/DFlash drafter folder."
)
@click.option("--out", "out_dir", required=True, type=_DIR, help="Output folder (graphs + export.json).")
@click.option("--dtype", default="float32", show_default=True, type=click.Choice(DTYPES), help="Graph precision.")
@click.option(
    "--opset",
    default=DEFAULT_OPSET,
    show_default=True,
    type=int,
    help=f"ONNX opset ({MIN_OPSET}..{MAX_OPSET}).",
)
@click.option(
    "--flavours",
    default=",".join(DEFAULT_FLAVOURS),
    show_default=True,
    help=f"Graph flavours, comma-separated, among {','.join(FLAVOURS)}: 'fused' adds the ONNX Runtime "
    "fused-op target (GroupQueryAttention, KV in place) that the ORT runtime drives where present; 'packed' "
    "(with 'fused') the target that verifies real tokens only (kv_mode 'packed').",
)
@click.option("--no-check", is_flag=True, help="Skip the ONNX Runtime parity sweep.")
@click.option("--stream-weights", is_flag=True, help="Real-size checkpoints in bounded memory: trace over "
              "placeholder weights, stream them from the shards into external data (plain graphs, no parity).")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def export(
    target_dir: str, drafter_dir: str, out_dir: str, dtype: str, opset: int, flavours: str, no_check: bool,
    quiet: bool, stream_weights: bool = False,
) -> None:
    """Export the target, drafter backbone and heads of a DSpark pair to ONNX."""
    if stream_weights:
        from dspark.export.streaming import export_pair_streaming

        manifest = export_pair_streaming(target_dir, drafter_dir, out_dir, dtype=dtype, opset=opset,
                                         progress=None if quiet else lambda m: click.echo(m, err=True))
        click.echo(f"wrote {out_dir}/export.json in {manifest['export_seconds']:.1f} s, peak RSS "
                   f"{manifest['export_peak_rss_bytes'] / 1e9:.2f} GB")
        return
    manifest = export_pair(
        target_dir,
        drafter_dir,
        out_dir,
        dtype=dtype,
        opset=opset,
        flavours=tuple(f.strip() for f in flavours.split(",") if f.strip()),
        check=not no_check,
        show_progress=not quiet,
    )
    if manifest["target"].get("standin"):
        from dspark.models.inflate import standin_label

        click.echo(standin_label(target_dir))
    for name, graph in manifest["graphs"].items():
        size = sum(f["bytes"] for f in graph["files"])
        line = f"{graph['file']:<26} {size / 2**20:9.2f} MiB  {graph['export_seconds']:6.2f} s"
        parity = (manifest["parity"] or {}).get(name)
        if parity and "max_abs_diff" in parity:
            line += f"  parity max |diff| {max(parity['max_abs_diff'].values()):.2e}"
        elif parity:
            line += f"  parity {parity['skipped']}"
        click.echo(line)
    click.echo(f"wrote {out_dir}/export.json in {manifest['export_seconds']:.1f} s")
