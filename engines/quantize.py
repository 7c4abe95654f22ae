"""Weight-only int4/int8 graphs for ONNX Runtime engines, by ONNX Runtime's own quantizer.

`quantize_export` rewrites the export's graphs into a staging directory before ORT optimizes them:
every MatMul whose weight is a constant initializer becomes a `com.microsoft.MatMulNBits` node
(`onnxruntime.quantization.matmul_nbits_quantizer.MatMulNBitsQuantizer`, block-wise along K, one
scale per block and output column, symmetric). Activations stay float32, so the graphs keep the
export's I/O contract and the runtime drives them unchanged.

Every target graph (concat, static, fused, fused tree) is quantized, never some: the runtime may
verify with one flavour and prefill with another, and lossless decoding is defined against one
quantized target. Because each output column is quantized on its own, the fused graph's
concatenated q/k/v projection gets exactly the weights of the plain graph's three projections.
Drafter graphs are quantized only when asked (`drafter=True`); they never change what is emitted.

Quantization happens before optimization because ORT's level-`all` fusions rewrite plain MatMuls
(FusedMatMul, Gemm) that the quantizer then no longer sees; ORT optimizes MatMulNBits itself.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx
import onnxruntime as ort

from dspark.export import contract as C
from dspark.export.engine_dir import QUANT_SCHEMES
from dspark.export.lower import EXTERNAL_SUFFIX, TWO_GB
from dspark.export.manifest import file_entries, write_manifest

from .export_source import BuildError
from .external_weights import SPILL_BYTES, WeightStream, is_external

SCHEMES = QUANT_SCHEMES  # {"int4": 4, "int8": 8}, as engine.json's schema checks it
QUANTIZER = "onnxruntime.quantization.matmul_nbits_quantizer.MatMulNBitsQuantizer"
TARGET_GRAPHS = (C.TARGET, C.TARGET_STATIC, C.TARGET_FUSED, C.TARGET_FUSED_TREE, C.TARGET_FUSED_PACKED)
# MatMulNBits' accuracy_level 0 keeps float32 activations: a 1-token call and a 64-token call of the
# same quantized graph then agree to ~1e-5, as float32 graphs do. Level 4 (int8 activations, the fast
# CPU path onnxruntime-genai's builder picks) takes other kernels for other row counts: measured
# max |logit difference| 2.6e-3 (int8) and 1.6e-2 (int4) between the two on the 100M stand-in, enough
# to flip a near-tie between verification (many rows) and autoregressive decoding (one row).
DEFAULT_ACCURACY_LEVEL = 0
DEFAULT_BLOCK_SIZE = 32


@dataclass(frozen=True)
class QuantizeOptions:
    scheme: str  # "int4" | "int8"
    drafter: bool = False  # also the drafter's graphs
    block_size: int = DEFAULT_BLOCK_SIZE
    accuracy_level: int = DEFAULT_ACCURACY_LEVEL

    def check(self) -> None:
        """BuildError naming the bad option (called before any long work)."""
        if self.scheme not in SCHEMES:
            raise BuildError(f"--quantize {self.scheme!r} is not one of {sorted(SCHEMES)}")
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise BuildError(f"--quant-block-size {self.block_size} must be a power of two >= 16 (MatMulNBits)")
        if self.accuracy_level not in (0, 1, 2, 3, 4):
            raise BuildError(f"--quant-accuracy-level {self.accuracy_level} must be 0..4 (MatMulNBits)")


def _weight_matmuls(model: onnx.ModelProto) -> int:
    """MatMuls whose second input is a constant initializer: the ones the quantizer can rewrite."""
    weights = {t.name for t in model.graph.initializer}
    return sum(1 for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in weights)


def quantize_graph(source: Path, target: Path, options: QuantizeOptions) -> dict[str, Any]:
    """Quantize one ONNX file into `target` (+ external data when large); returns what changed. A graph whose
    weights are in external data (a `--stream-weights` export) is rewritten weight by weight: each MatMul's
    weight is read just before ORT's quantizer takes that node and let go after, its quantized tensors go to
    the target's data file at once (`external_weights.WeightStream`), so memory holds about one weight."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    model = onnx.load(str(source), load_external_data=False)
    target.parent.mkdir(parents=True, exist_ok=True)
    data = target.with_name(target.name + EXTERNAL_SUFFIX)
    data.unlink(missing_ok=True)
    stream = WeightStream(source.parent, data) if any(map(is_external, model.graph.initializer)) else None
    if stream is not None:
        stream.fold_transposes(model.graph)
    before = _weight_matmuls(model)
    quantizer_log = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")
    level = quantizer_log.level
    quantizer_log.setLevel(logging.WARNING)  # it logs one INFO line per node it skips
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(quantizer_log.setLevel, level)
        if stream is not None:
            cleanup.callback(stream.close)
        quantizer = MatMulNBitsQuantizer(model, bits=SCHEMES[options.scheme], block_size=options.block_size,
                                         is_symmetric=True, accuracy_level=options.accuracy_level)
        if stream is not None:
            _stream_weights(quantizer, model.graph, stream)
        quantizer.process()
        quantized = quantizer.model.model
        ops = Counter(n.op_type for n in quantized.graph.node)
        left = _weight_matmuls(quantized)
        if ops["MatMulNBits"] == 0 and before:
            raise BuildError(f"{source.name}: onnxruntime's quantizer rewrote none of its {before} weight MatMuls")
        if stream is not None:
            stream.finish(quantized.graph)
            onnx.save_model(quantized, str(target))  # the graph alone: its tensors are in `data` already
        elif sum(t.ByteSize() for t in quantized.graph.initializer) > TWO_GB:
            onnx.save_model(quantized, str(target), save_as_external_data=True, all_tensors_to_one_file=True,
                            location=data.name, size_threshold=SPILL_BYTES)
        else:
            onnx.save_model(quantized, str(target))
    return {"matmuls": before, "quantized": ops["MatMulNBits"], "left_float": left}


def _stream_weights(quantizer: Any, graph: onnx.GraphProto, stream: WeightStream) -> None:
    """Wrap ORT's per-node quantizer: a MatMul's weight is read into a scratch graph of its own (freed after
    the node: see `WeightStream.load`), and what the quantizer makes there is spilled, then added to `graph`."""
    quantize_node = quantizer.node_quantizer.quantize

    def quantize(node: onnx.NodeProto, graph_stack: list[onnx.GraphProto]) -> list[onnx.NodeProto]:
        name = node.input[1] if node.op_type == "MatMul" and len(node.input) > 1 else None
        weight = next((t for t in graph.initializer if t.name == name), None) if name else None
        if weight is None:
            return quantize_node(node, graph_stack)
        scratch = onnx.GraphProto()
        scratch.initializer.add().CopyFrom(weight)  # the reference; its bytes come into the scratch graph
        stream.load(scratch.initializer[0])
        nodes = quantize_node(node, [scratch])
        for tensor in scratch.initializer[1:]:
            stream.spill(tensor)
            graph.initializer.add().CopyFrom(tensor)
        return nodes

    quantizer.node_quantizer.quantize = quantize


def quantized_graphs(export_manifest: dict[str, Any], options: QuantizeOptions) -> list[str]:
    """Names of the export's graphs `options` quantizes: every target graph, the drafter's by option."""
    return [name for name in export_manifest["graphs"] if name in TARGET_GRAPHS or options.drafter]


def quantize_export(export_dir: Path, export_manifest: dict[str, Any], staging: Path, options: QuantizeOptions,
                    progress: Callable[[str], None] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Write the quantized export into `staging` (graphs not quantized are copied as they are) ->
    (its export manifest, engine.json's `quantization` section)."""
    options.check()
    derived = dict(export_manifest)
    derived["graphs"] = {}
    chosen = quantized_graphs(export_manifest, options)
    report: dict[str, Any] = {}
    for name, entry in export_manifest["graphs"].items():
        source = export_dir / entry["file"]
        target = staging / entry["file"]
        if name in chosen:
            if progress:
                progress(f"quantizing {name} ({options.scheme}, block {options.block_size})")
            report[name] = quantize_graph(source, target, options)
            files = [target] + [p for p in (target.with_name(target.name + EXTERNAL_SUFFIX),) if p.is_file()]
        else:
            files = []
            for item in entry["files"]:
                copy = staging / item["path"]
                copy.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(export_dir / item["path"], copy)
                files.append(copy)
        derived["graphs"][name] = {**entry, "files": file_entries(files, staging)}
    write_manifest(staging, derived)
    section = {"scheme": options.scheme, "bits": SCHEMES[options.scheme], "block_size": options.block_size,
               "symmetric": True, "accuracy_level": options.accuracy_level, "drafter": options.drafter,
               "quantizer": QUANTIZER, "onnxruntime": ort.__version__, "graphs": report}
    return derived, section


@contextmanager
def quantized_source(export_dir: Path, export_manifest: dict[str, Any], out_dir: Path,
                     options: QuantizeOptions | None, progress: Callable[[str], None] | None = None,
                     ) -> Iterator[tuple[Path, dict[str, Any], dict[str, Any] | None]]:
    """(graph dir, its export manifest, engine.json's `quantization`) for the ORT builder to optimize:
    the export itself without `options`, else its quantized copy in a staging dir under `out_dir`
    (removed afterwards: the engine keeps only the optimized graphs)."""
    if options is None:
        yield export_dir, export_manifest, None
        return
    with tempfile.TemporaryDirectory(prefix=".quantizing-", dir=out_dir) as staging:
        derived, section = quantize_export(export_dir, export_manifest, Path(staging), options, progress)
        yield Path(staging), derived, section


__all__ = ("DEFAULT_ACCURACY_LEVEL", "DEFAULT_BLOCK_SIZE", "SCHEMES", "QuantizeOptions", "quantize_export",
           "quantize_graph", "quantized_graphs", "quantized_source")
