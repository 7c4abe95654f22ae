"""`dspark-export`: a target and its DSpark drafter -> ONNX graphs + export.json."""

from __future__ import annotations

import click

from dspark.export.contract import DTYPES
from dspark.export.lower import MAX_OPSET, MIN_OPSET, ExportError
from dspark.export.pipeline import DEFAULT_OPSET
from dspark.models import CheckpointError, IncompatibleDrafterError

_DIR = str  # checked by export_pair, which reports one-line errors


@click.command("dspark-export", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--target", "target_dir", required=True, type=_DIR, help="Hugging Face target folder.")
@click.option(
    "--drafter", "drafter_dir", required=True, type=_DIR, help="DeepSpec DSpark/DFlash drafter folder."
)
@click.option("--out", "out_dir", required=True, type=_DIR, help="Output folder (graphs + export.json).")
@click.option("--dtype", default="float32", show_default=True, help=f"Graph precision: {', '.join(DTYPES)}.")
@click.option(
    "--opset",
    default=DEFAULT_OPSET,
    show_default=True,
    type=int,
    help=f"ONNX opset ({MIN_OPSET}..{MAX_OPSET}).",
)
@click.option("--no-check", is_flag=True, help="Skip the ONNX Runtime parity sweep.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def export(
    target_dir: str, drafter_dir: str, out_dir: str, dtype: str, opset: int, no_check: bool, quiet: bool
) -> None:
    """Export the target, drafter backbone and heads of a DSpark pair to ONNX."""
    from dspark.export.pipeline import export_pair  # torch/onnx import only when running

    try:
        manifest = export_pair(
            target_dir,
            drafter_dir,
            out_dir,
            dtype=dtype,
            opset=opset,
            check=not no_check,
            show_progress=not quiet,
        )
    except (CheckpointError, IncompatibleDrafterError, ExportError) as exc:
        click.echo(f"dspark-export: error: {exc}", err=True)
        raise SystemExit(2) from None
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
