"""Parity of `drafter_backbone_fused.onnx` against `DSparkDrafter.forward_backbone`, driven as the runtime drives it,
and of `drafter_draft_greedy_fused.onnx` against the same backbone followed by the greedy heads.

Three rows share one context buffer per layer and kind (bound as past and present): each step feeds every row
its new context rows (right-padded to the step's widest) and its block, then checks each row's outputs
(block_hidden and base_logits, or draft_ids and confidence_logits) and context slots against the PyTorch
drafter run on that row's whole context so far. Draft ids must be equal.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import torch

from dspark.models import DSparkDrafter

from . import contract as C
from .drafter_graphs import HeadGreedyGraph
from .fused_parity import TOLERANCE

NEW_ROWS = ((12, 5, 9), (3, 1, 8), (1, 2, 1))  # new context rows per row and step: a prompt, then decode steps
CAPACITY = 64


def fused_backbone_parity(session: ort.InferenceSession, spec: C.GraphSpec, drafter: DSparkDrafter, dtype: str,
                          seed: int = 0) -> dict:
    """Max |diff| of the graph's float outputs and the written context slots, and whether every element passed
    atol = rtol = TOLERANCE[dtype] and every draft id is the PyTorch heads' (`drafter`: a float32 model)."""
    c, tol, rng = drafter.config, TOLERANCE[dtype], np.random.default_rng(seed)
    float_type = np.float32 if dtype == "float32" else np.float16
    rows, gamma = len(NEW_ROWS[0]), c.block_size
    outputs = {t.name: t for t in spec.outputs}
    buffers = [np.zeros((rows, c.num_key_value_heads, CAPACITY, c.head_dim), float_type)
               for _ in C.kv_names("past_context", len(drafter.layers))]
    binding, keep = session.io_binding(), []
    for name, buf in zip(C.kv_names("past_context", len(drafter.layers)), buffers, strict=True):
        value = ort.OrtValue.ortvalue_from_numpy(buf)
        keep.append(value)
        binding.bind_ortvalue_input(name, value)
        binding.bind_ortvalue_output(name.replace("past_", "present_"), value)
    got = {name: np.zeros((rows, *outputs[name].dims[1:]), np.int64 if name == "draft_ids" else float_type)
           for name in ("block_hidden", "base_logits", "draft_ids", "confidence_logits") if name in outputs}
    heads = HeadGreedyGraph(drafter, C.Placement(lm_head_in_backbone=True)) if "draft_ids" in outputs else None
    for name, array in got.items():
        value = ort.OrtValue.ortvalue_from_numpy(array)
        keep.append(value)
        binding.bind_ortvalue_output(name, value)
    worst = {**dict.fromkeys((name for name in got if name != "draft_ids"), 0.0), "present_context": 0.0}
    wrong_ids = 0
    passed = True

    def check(name: str, got: np.ndarray, want: torch.Tensor) -> None:
        nonlocal passed
        got64, want64 = got.astype(np.float64), want.double().numpy()
        worst[name] = max(worst[name], float(np.abs(got64 - want64).max()))
        passed = passed and bool(np.all(np.abs(got64 - want64) <= tol + tol * np.abs(want64)))

    features: list[np.ndarray] = [np.zeros((0, c.context_feature_size), np.float32) for _ in range(rows)]
    for counts in NEW_ROWS:
        cached = np.array([len(f) for f in features])
        width = max(counts)
        new = [rng.standard_normal((n, c.context_feature_size)).astype(np.float32) for n in counts]
        padded = np.zeros((rows, width, c.context_feature_size), float_type)
        for r, rows_new in enumerate(new):
            padded[r, : len(rows_new)] = rows_new
        features = [np.concatenate([f, n]) for f, n in zip(features, new, strict=True)]
        lengths = np.array([len(f) for f in features])
        block = np.full((rows, gamma), c.mask_token_id, np.int64)
        block[:, 0] = rng.integers(2, c.vocab_size, rows)
        positions = lengths[:, None] + np.arange(gamma)  # the anchor sits after the context rows
        feeds = {"block_ids": block, "block_position_ids": positions.astype(np.int64), "context_features": padded,
                 "seqlens_k": (cached + width - 1).astype(np.int32),
                 "total_sequence_length": np.array(cached.max() + width, np.int32),
                 "context_lengths": lengths.astype(np.int64)}
        if heads is not None:
            feeds["anchor_ids"] = block[:, 0].copy()
        for name, value in feeds.items():
            binding.bind_cpu_input(name, value)
        session.run_with_iobinding(binding)
        for r in range(rows):
            with torch.no_grad():
                ref = drafter.forward_backbone(block_ids=torch.from_numpy(block[r : r + 1]),
                                               block_position_ids=torch.from_numpy(positions[r : r + 1]),
                                               context_features=torch.from_numpy(features[r])[None],
                                               context_position_ids=torch.arange(lengths[r])[None])
                if heads is None:
                    check("block_hidden", got["block_hidden"][r], ref.hidden[0])
                if "base_logits" in outputs:
                    check("base_logits", got["base_logits"][r], drafter.base_logits(ref.hidden)[0])
                if heads is not None:
                    _, ids, *confidence = heads(ref.hidden, drafter.base_logits(ref.hidden),
                                                torch.from_numpy(block[r : r + 1, 0]))
                    wrong_ids += int((got["draft_ids"][r] != ids[0].numpy()).sum())
                    if confidence:
                        check("confidence_logits", got["confidence_logits"][r], confidence[0][0])
            for i, (key, value) in enumerate(ref.present_context):
                check("present_context", buffers[2 * i][r, :, : lengths[r]], key[0])
                check("present_context", buffers[2 * i + 1][r, :, : lengths[r]], value[0])
    if heads is not None:
        worst["draft_ids_wrong"] = wrong_ids
    return {"max_abs_diff": worst, "tolerance": tol, "passed": passed and not wrong_ids,
            "cases": [f"rows {rows}, new context rows {list(counts)}" for counts in NEW_ROWS]}
