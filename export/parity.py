"""Parity of exported graphs against the PyTorch models, measured with ONNX Runtime (CPU).

Each check runs a sweep of cases through ORT and through PyTorch and keeps, per output, the
largest absolute difference over all cases. The default sweep covers batch 1-4, tokens 1-64,
past 0-256 with causal, tree and padded masks and takes a few seconds on the golden models.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from dspark.models import DrafterConfig, TargetConfig, TargetModel

from . import feeds as F
from .contract import GraphSpec, Placement

TARGET_CASES = (
    F.Case(1, 64, 0),
    F.Case(4, 1, 256),
    F.Case(2, 8, 100),
    F.Case(3, 12, 37, "tree"),
    F.Case(4, 5, 19, "padded"),
)
BACKBONE_CASES = (F.Case(1, 24, 0), F.Case(4, 3, 256), F.Case(2, 64, 100), F.Case(3, 5, 40, "padded"))
HEAD_BATCHES = (1, 4)
STATIC_SPARE_SLOTS = 3

Outputs = Sequence[torch.Tensor]


def session(path: Path, threads: int = 0) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def run(sess: ort.InferenceSession, spec: GraphSpec, feeds: Sequence[torch.Tensor]) -> list[np.ndarray]:
    return sess.run(spec.output_names, {n: t.numpy() for n, t in zip(spec.input_names, feeds, strict=True)})


def max_abs_diff(
    sess: ort.InferenceSession, spec: GraphSpec, feeds: Sequence[torch.Tensor], reference: Outputs
) -> dict[str, float]:
    got = run(sess, spec, feeds)
    return {
        name: float(np.abs(g.astype(np.float64) - r.double().numpy()).max()) if g.size else 0.0
        for name, g, r in zip(spec.output_names, got, reference, strict=True)
    }


def _sweep(
    sess: ort.InferenceSession,
    spec: GraphSpec,
    cases: Sequence[tuple[str, Sequence[torch.Tensor], Callable[[], Outputs]]],
) -> dict:
    worst = dict.fromkeys(spec.output_names, 0.0)
    for _, feeds, reference in cases:
        with torch.no_grad():
            ref = reference()
        for name, diff in max_abs_diff(sess, spec, feeds, ref).items():
            worst[name] = max(worst[name], diff)
    return {"cases": [label for label, _, _ in cases], "max_abs_diff": worst}


def target_parity(
    sess, spec, module: torch.nn.Module, config: TargetConfig, dtype: torch.dtype, seed: int = 0
):
    g = torch.Generator().manual_seed(seed)
    cases = []
    for case in TARGET_CASES:
        feeds = F.target_feeds(config, case, dtype, g)
        cases.append((case.label, feeds, lambda f=feeds: module(*f)))
    return _sweep(sess, spec, cases)


def static_parity(sess, spec, model: TargetModel, dtype: torch.dtype, seed: int = 0):
    """The static graph against the *concat-cache model*: same logits and features, and its new
    keys/values equal the tail of the model's present cache."""
    g = torch.Generator().manual_seed(seed)
    cases = []
    for case in TARGET_CASES:
        concat = F.target_feeds(model.config, case, dtype, g)
        feeds = F.static_feeds(concat, STATIC_SPARE_SLOTS, g)

        def reference(f=concat, past=case.past):
            out = model(f[0], f[1], f[2], list(zip(f[3::2], f[4::2], strict=True)))
            return (out.logits, out.context_features, *(t[:, :, past:] for kv in out.present for t in kv))

        cases.append((f"{case.label} +{STATIC_SPARE_SLOTS} spare", feeds, reference))
    return _sweep(sess, spec, cases)


def backbone_parity(sess, spec, module, config: DrafterConfig, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    cases = []
    for case in BACKBONE_CASES:
        feeds = F.backbone_feeds(config, case, dtype, g)
        cases.append(
            (
                f"{case.mask} b{case.batch} context {case.tokens} on {case.past}",
                feeds,
                lambda f=feeds: module(*f),
            )
        )
    return _sweep(sess, spec, cases)


def head_parity(
    sess,
    spec,
    module,
    config: DrafterConfig,
    placement: Placement,
    dtype: torch.dtype,
    greedy: bool,
    seed: int = 0,
):
    g = torch.Generator().manual_seed(seed)
    make = F.head_greedy_feeds if greedy else F.head_step_feeds
    cases = []
    for batch in HEAD_BATCHES:
        feeds = make(config, batch, placement.lm_head_in_backbone, dtype, g)
        cases.append((f"b{batch}", feeds, lambda f=feeds: module(*f)))
    return _sweep(sess, spec, cases)
