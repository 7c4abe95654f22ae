"""`drafter_draft_greedy_fused.onnx`: the fused backbone and the greedy heads joined into one graph.

An all-greedy step drafts in one ONNX Runtime call instead of two: the block's hidden states (and base
logits) flow from the backbone into the heads inside the graph, and the heads' corrected logits, which
greedy verification never reads, are not returned (at a 152k vocabulary that is γ × 152k floats a row).
The graph is composed from the two files the export already wrote (`onnx.compose`): nothing is traced or
built again, and weights kept as external data stay in their files (the joined graph points at them).
"""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx import compose, helper

from . import contract as C
from .lower import ExportError

HEADS_PREFIX = "greedy_heads/"  # the head graph's nodes, edges and initializers, apart from the backbone's


def check_joinable(out_dir: Path) -> None:
    """ExportError unless both graphs the joined one is made of were written (the fused backbone can be dropped
    for a model it does not fit, and a DFlash drafter has no heads)."""
    missing = [f"{name}.onnx" for name in (C.BACKBONE_FUSED, C.HEAD_GREEDY) if not (out_dir / f"{name}.onnx").is_file()]
    if missing:
        raise ExportError(f"{C.DRAFT_GREEDY_FUSED} joins graphs this export does not have: {', '.join(missing)}")


def export_draft_greedy_fused(out_dir: Path, spec: C.GraphSpec) -> list[Path]:
    """Join `drafter_backbone_fused.onnx` and `drafter_head_greedy.onnx` in `out_dir` into `spec`'s graph; returns
    the files it uses (the graph, then any external-data files it shares with the backbone)."""
    backbone = onnx.load(str(out_dir / f"{C.BACKBONE_FUSED}.onnx"), load_external_data=False)
    heads = onnx.load(str(out_dir / f"{C.HEAD_GREEDY}.onnx"), load_external_data=False)
    # the traced head graph is an older IR than the built backbone; its operators mean the same in the newer one
    backbone.ir_version = heads.ir_version = max(backbone.ir_version, heads.ir_version)
    heads = compose.add_prefix(heads, HEADS_PREFIX, rename_inputs=False, rename_outputs=False)
    head_inputs = {t.name for t in heads.graph.input}
    wires = [(t.name, t.name) for t in backbone.graph.output if t.name in head_inputs]  # block_hidden, base_logits
    graph = compose.merge_graphs(backbone.graph, heads.graph, wires, outputs=spec.output_names, name=spec.name)
    opsets: dict[str, int] = {}
    for opset in [*backbone.opset_import, *heads.opset_import]:
        opsets[opset.domain] = max(opsets.get(opset.domain, 0), opset.version)
    # not onnx.compose.merge_models: its checker does not know ONNX Runtime's fused operators
    model = helper.make_model(graph, ir_version=backbone.ir_version,
                              opset_imports=[helper.make_opsetid(d, v) for d, v in opsets.items()])
    path = out_dir / spec.file
    onnx.save_model(model, str(path))
    shared = sorted({entry.value for tensor in graph.initializer for entry in tensor.external_data
                     if entry.key == "location"})
    return [path, *(out_dir / name for name in shared)]
