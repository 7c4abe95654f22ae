"""`dspark-build-engine` (also `dspark build-engine`): a dspark-export directory -> an engine directory
with engine.json."""

from __future__ import annotations

import click

from .errors import OneLineErrors

_PATH = str  # checked by build_engine, which reports one-line errors


def _print_table(manifest: dict) -> None:
    if manifest["sps"] is None:
        click.echo("SPS not measured: built ahead of time, without the GPU it runs on (--reprofile there)")
        return
    for graph, table in manifest["sps"]["tables"].items():
        click.echo(f"SPS ({graph}, past {manifest['sps']['past']}): steps/s = 1 / (draft(R) + verify(R, B))")
        click.echo("   R \\ B " + "".join(f"{b:>9}" for b in table["buckets"]))
        for r, row, draft in zip(table["batches"], table["verify_seconds"], table["draft_seconds"], strict=True):
            cells = "".join(f"{'-':>9}" if v is None else f"{1 / (v + draft):9.1f}" for v in row)
            click.echo(f"{r:>8} " + cells)


def _quantize_options(quantize, quantize_drafter: bool, quant_block_size: int, quant_accuracy_level: int):
    from dspark.engines.export_source import BuildError
    from dspark.engines.quantize import QuantizeOptions

    if quantize is None:
        if quantize_drafter:
            raise BuildError("--quantize-drafter needs --quantize int4 or int8")
        return None
    return QuantizeOptions(quantize, drafter=quantize_drafter, block_size=quant_block_size,
                           accuracy_level=quant_accuracy_level)


@click.command("dspark-build-engine", cls=OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("export_dir", type=_PATH)
@click.option("--out", "out_dir", required=True, type=_PATH, help="Engine directory to write (engine.json).")
@click.option("--backend", default="onnxruntime", show_default=True,
              type=click.Choice(["onnxruntime", "tensorrt", "tensorrt-rtx"]),
              help="Engine backend (tensorrt-rtx: TensorRT for RTX, built ahead of time, no GPU needed).")
@click.option("--compute-capabilities", help="tensorrt-rtx: GPUs to build for, e.g. 8.0,8.9 "
              "(default 8.0,8.6,8.9,12.0,12.1; also 7.5).")
@click.option("--buckets", help="Verified-token buckets, e.g. 1,2,4,8,16 (default: powers of two up to "
              "--max-batch-tokens). TensorRT builds one optimization profile per bucket.")
@click.option("--max-batch-tokens", default=64, show_default=True, type=int,
              help="Most tokens one step verifies (the largest bucket).")
@click.option("--max-batch", default=8, show_default=True, type=int, help="Most requests per step.")
@click.option("--max-seq-len", default=1024, show_default=True, type=int,
              help="Most cached positions per request (capped at the model's max positions).")
@click.option("--threads", default=1, show_default=True, type=click.IntRange(min=0),
              help="ONNX Runtime intra-op threads (0 = all cores).")
@click.option("--spinning/--no-spinning", default=False,
              help="With --threads != 1: ORT's worker threads busy-wait between graph calls (default: they sleep).")
@click.option("--profile-past", default=64, show_default=True, type=click.IntRange(min=0),
              help="Cached positions per request while profiling SPS.")
@click.option("--repeats", default=5, show_default=True, type=click.IntRange(min=1),
              help="Timed calls per profiling point (median kept).")
@click.option("--calibrate-data", type=_PATH, help="Held-out sequences (ids or text, .txt/.jsonl) for STS.")
@click.option("--tokenizer", type=_PATH, help="tokenizer.json for text data (copied into the engine).")
@click.option("--reprofile", is_flag=True, help="Only re-measure the SPS table of the existing engine in --out.")
@click.option("--quantize", type=click.Choice(["int4", "int8"]),
              help="Weight-only quantized target graphs (onnxruntime: MatMulNBits by ORT's quantizer).")
@click.option("--quantize-drafter", is_flag=True, help="With --quantize: the drafter's graphs too.")
@click.option("--quant-block-size", default=32, show_default=True, type=int,
              help="With --quantize: weights per scale along the input dimension.")
@click.option("--quant-accuracy-level", default=0, show_default=True, type=click.IntRange(0, 4),
              help="With --quantize: MatMulNBits accuracy_level (0: float32 activations, row-count "
              "independent; 4: int8 activations, faster, results move with the tokens per call).")
@click.option("--quiet", is_flag=True, help="No progress lines.")
def build_engine(export_dir, out_dir, backend, compute_capabilities, buckets, max_batch_tokens, max_batch,
                 max_seq_len, threads, spinning, profile_past, repeats, calibrate_data, tokenizer, reprofile, quiet,
                 **quantize_flags) -> None:
    """Build an ONNX Runtime or TensorRT engine from EXPORT_DIR, profile it, optionally calibrate it."""
    import shutil
    from dataclasses import replace
    from pathlib import Path

    from dspark.engines import build as B
    from dspark.engines.buckets import parse_buckets
    from dspark.engines.export_source import BuildError, load_export

    prog = click.get_current_context().command_path

    def progress(message: str) -> None:
        if not quiet:
            click.echo(f"{prog}: {message}", err=True)

    if reprofile:
        load_export(export_dir)
        manifest = B.reprofile(out_dir, repeats=repeats, progress=progress)
        if calibrate_data:
            manifest = B.calibrate_engine(out_dir, calibrate_data, tokenizer=tokenizer, progress=progress)
    else:
        options = B.BuildOptions(backend=backend, buckets=parse_buckets(buckets) if buckets else None,
                                 max_batch_tokens=max_batch_tokens, max_batch=max_batch, max_seq_len=max_seq_len,
                                 threads=threads, spinning=spinning, profile_past=profile_past, repeats=repeats,
                                 compute_capabilities=tuple(c.strip() for c in (compute_capabilities or "").split(",")
                                                            if c.strip()))
        options = replace(options, quantize=_quantize_options(**quantize_flags))
        if tokenizer and not Path(tokenizer).is_file():
            raise BuildError(f"--tokenizer {tokenizer} does not exist")
        manifest = B.build_engine(export_dir, out_dir, options, calibrate_data=calibrate_data,
                                  tokenizer=tokenizer, progress=progress)
        if tokenizer:
            shutil.copyfile(tokenizer, Path(out_dir) / "tokenizer.json")
    _print_table(manifest)
    cal = manifest["calibration"]
    if cal:
        click.echo(f"STS temperatures {[round(t, 3) for t in cal['temperatures']]}; mean ECE "
                   f"{cal['ece_before_mean']:.4f} -> {cal['ece_after_mean']:.4f} ({cal['samples']} rounds)")
    quantized = manifest.get("quantization")
    weights = f", {quantized['scheme']} weights" if quantized else ""
    click.echo(f"wrote {Path(out_dir) / 'engine.json'} ({manifest['backend']}{weights}, buckets {manifest['buckets']})")
