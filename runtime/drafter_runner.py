"""The drafter's graph calls: the backbone over each request's new context rows plus its block,
then the sequential heads (one greedy-block call, or slot by slot when any request samples).

Context features reach the drafter late: the target produces them while verifying, the drafter
consumes them the next time it drafts (several steps' worth if the drafting gate skipped some).
Each request's unconsumed rows are a list of [n, F] chunks; `draft` scatters all of them into the
backbone's [R, ctx, F] feed at once and appends their keys/values to the drafter's slot cache.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from dspark.export import contract as C

from .backend import Backend, BoundCall, as_torch
from .kv_cache import SlotCache
from .model_info import ModelInfo
from .proposer import DraftBlock, propose_rows


class DrafterRunner:
    def __init__(self, backend: Backend, info: ModelInfo, kv: SlotCache) -> None:
        self.backend, self.info, self.kv = backend, info, kv
        # the block outputs of both graphs land in flat buffers sized once (max requests × γ); the
        # head reads the backbone's straight from them, nothing is copied out of ONNX Runtime
        rows, dtype = kv.lengths.shape[0], kv.keys[0].dtype
        self._buffers = {t.name: np.empty(rows * int(np.prod(t.dims[1:])), dtype if t.dtype != "int64" else np.int64)
                         for graph in (C.BACKBONE, C.HEAD_GREEDY) if graph in backend.specs
                         for t in backend.specs[graph].outputs if t.dims[0] == "batch" and "present" not in t.name}
        self._greedy_heads: dict[int, tuple[BoundCall, dict[str, np.ndarray], dict[str, np.ndarray]]] = {}

    def draft(
        self,
        anchors: np.ndarray,  # [R] last committed token of each request
        starts: np.ndarray,  # [R] anchor positions
        pending: Sequence[Sequence[np.ndarray]],  # per request: [n, F] context chunks not yet seen
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Backbone forward for rows 0..R-1 -> block_hidden [R, γ, H], base_logits [R, γ, V] (or None)."""
        rows, gamma, dtype = len(anchors), self.info.block_size, self.kv.keys[0].dtype
        counts = np.array([sum(len(c) for c in chunks) for chunks in pending], dtype=np.int64)
        cached = self.kv.lengths[:rows]
        past, ctx = int(cached.max()), int(counts.max())
        features = np.zeros((rows, ctx, self.info.context_feature_size), dtype)
        which = np.repeat(np.arange(rows), counts)
        within = np.arange(which.size) - np.repeat(np.cumsum(counts) - counts, counts)
        features[which, within] = np.concatenate([c for chunks in pending for c in chunks])
        cols = np.arange(past + ctx + gamma)[None, :]
        visible = ((cols < cached[:, None]) | ((cols >= past) & (cols < past + counts[:, None]))
                   | (cols >= past + ctx))  # [R, keys]: own cached rows, own new rows, the block
        block_ids = np.full((rows, gamma), self.info.mask_token_id, dtype=np.int64)
        block_ids[:, 0] = anchors
        feeds = {
            "block_ids": block_ids,
            "block_position_ids": starts[:, None] + np.arange(gamma),
            "context_features": features,
            "context_position_ids": cached[:, None] + np.arange(ctx),
            "attention_mask": np.ascontiguousarray(np.broadcast_to(visible[:, None, None, :],
                                                                   (rows, 1, gamma, visible.shape[1]))),
        }
        layers = [np.ascontiguousarray(t) for kv in self.kv.past(0, rows, past) for t in kv]  # [R, kvh, past, hd]
        feeds.update(zip(C.kv_names("past_context", len(layers) // 2), layers, strict=True))
        present = [np.empty((rows, t.shape[1], past + ctx, t.shape[3]), dtype) for t in layers]
        outputs = self._outputs(C.BACKBONE, rows)
        outputs.update(zip(C.kv_names("present_context", len(layers) // 2), present, strict=True))
        self.backend.run_into(C.BACKBONE, feeds, outputs)
        self.kv.write(list(zip(present[::2], present[1::2], strict=True)), source_offset=past, counts=counts)
        return outputs["block_hidden"], outputs.get("base_logits")

    def _outputs(self, graph: str, rows: int) -> dict[str, np.ndarray]:
        """[rows, ...] views of the flat buffers for `graph`'s block outputs."""
        specs = self.backend.specs[graph].outputs
        return {t.name: self._buffers[t.name][: rows * int(np.prod(t.dims[1:]))].reshape(rows, *t.dims[1:])
                for t in specs if t.name in self._buffers}

    def propose(
        self,
        hidden: np.ndarray,  # [R, γ, H]
        base_logits: np.ndarray | None,  # [R, γ, V]
        anchors: np.ndarray,  # [R]
        temperatures: Sequence[float],
        generators: Sequence[torch.Generator | None],
    ) -> DraftBlock:
        """Draft tokens through the heads: all-greedy batches in one call, else slot by slot."""
        info = self.info
        if info.has_heads and not any(temperatures):
            rows = len(anchors)
            if rows not in self._greedy_heads:  # bound once per batch size, over the backbone's buffers
                backbone = self._outputs(C.BACKBONE, rows)
                feeds = {"block_hidden": backbone["block_hidden"], "anchor_ids": np.zeros(rows, np.int64)}
                if info.lm_head_in_backbone:
                    feeds["base_logits"] = backbone["base_logits"]
                out = self._outputs(C.HEAD_GREEDY, rows)
                self._greedy_heads[rows] = (self.backend.bind(C.HEAD_GREEDY, feeds, out), feeds, out)
            call, feeds, out = self._greedy_heads[rows]
            if not np.shares_memory(hidden, feeds["block_hidden"]):
                raise ValueError("propose takes the block_hidden that this runner's draft() just returned")
            feeds["anchor_ids"][...] = anchors
            call.run()
            return DraftBlock(out["draft_ids"], out["logits"], out.get("confidence_logits"))
        return propose_rows(
            (lambda feeds: {k: as_torch(v) for k, v in self.backend.run(C.HEAD_STEP, feeds).items()})
            if info.has_heads else None,
            hidden=torch.from_numpy(hidden), base_logits=None if base_logits is None else torch.from_numpy(base_logits),
            anchors=torch.from_numpy(np.ascontiguousarray(anchors)),
            feed_base_logits=info.lm_head_in_backbone, state_size=info.head_state_size,
            temperatures=list(temperatures), generators=list(generators),
        )
