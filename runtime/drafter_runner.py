"""The drafter's graph calls: the backbone over each request's new context rows plus its block,
then the sequential heads (one greedy-block call, or slot by slot when any request samples).

Context features reach the drafter late: the target produces them while verifying, the drafter
consumes them the next time it drafts (several steps' worth if the drafting gate skipped some).
Each request's unconsumed rows are a list of [n, F] chunks; `draft` scatters them into the
backbone's [rows, ctx, F] feed and appends their keys/values to the drafter's slot cache.

Any slot rows can draft (`rows`: the drafting gate's probes draft a few), and a backlog is paid
by its own row. The feed is padded to the longest backlog in the call, so one request catching up
(a new prompt, or context skipped while the gate kept the drafter off) would make every row of
the call pay its length. `split_calls` prices a call as rows × (1 + CONTEXT_ROW_COST · longest
backlog) plus CALL_ROWS, and runs the rows with long backlogs as a second call when that is
cheaper; both calls write into the same output buffers, so the heads still run once.
Measured on the demo pair's ORT engine (2-core CPU, min of 7): a backbone + greedy head call
costs 0.42 ms per row at 1 context row and 0.008–0.011 ms more per row and context row
(R = 16, 64; ctx 1 → 128), i.e. 0.02–0.03 of a row; a call's fixed cost is about 1.5–2 rows.

With the fused backbone (`drafter_backbone_fused.onnx`, an ONNX Runtime export's default) and host
caches, a call over contiguous slot rows whose new rows fit their slots binds the slot rows themselves
as the graph's context buffers, which it appends to in place: one binding per (first slot, rows, new
context rows, output row), made once and refilled, and no cache copied in or out. Other calls (rows
drafting apart from a gather, a device cache, slots too full for the padded new rows) take the plain
backbone.

An all-greedy batch on the fused path drafts in one call when the export has the joined graph
(`drafter_draft_greedy_fused.onnx`: the fused backbone and the greedy heads): `draft(greedy=True)` then
returns the block itself, and `propose` is not called.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from dspark.export import contract as C

from .backend import Array, Backend, BoundCall, as_numpy, as_torch
from .capacity import CapacityError
from .kv_cache import SlotCache
from .model_info import ModelInfo
from .proposer import DraftBlock, propose_rows

MAX_FUSED_BINDINGS = 256  # (first slot, rows, new context rows, output row) layouts kept bound at once
FILL_BY_ROW = 4  # up to this many rows, the fused backbone copies context chunks row by row
CONTEXT_ROW_COST = 0.025  # one context row beyond a normal step's, as a fraction of one row's drafting
CALL_ROWS = 2.0  # a backbone call's fixed cost, in rows of drafting


_probes: ThreadPoolExecutor | None = None


def _forget_probe_worker() -> None:
    global _probes
    _probes = None  # a forked child has the executor but not its thread: its first probe would wait forever


os.register_at_fork(after_in_child=_forget_probe_worker)


def probe_worker() -> ThreadPoolExecutor:
    """The process's one thread for drafting probes beside verification (`SchedulerConfig.overlap_probes`):
    ONNX Runtime and torch release the GIL inside a graph call, so a probe's drafter call runs on a core the
    target's call leaves idle. One thread: the engines of a process probe one after another."""
    global _probes
    if _probes is None:
        _probes = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dspark-probe")
    return _probes


_BLOCK_GRAPHS = (C.BACKBONE, C.HEAD_GREEDY, C.DRAFT_GREEDY_FUSED)  # graphs whose block outputs `_buffers` hold


def split_calls(counts: np.ndarray) -> list[np.ndarray]:  # counts [k] context rows per row
    """Positions 0..k-1 grouped into backbone calls, in output order: one call (positions in
    order) unless putting the rows with the longest backlogs in a second call costs less than
    padding every row to them (module docstring)."""
    k = len(counts)
    if k < 2 or counts.max() == counts.min():
        return [np.arange(k)]
    order = np.argsort(counts, kind="stable")
    padded = 1.0 + CONTEXT_ROW_COST * counts[order]  # a row's cost, padded to its own backlog
    s = np.arange(1, k)  # the first call takes order[:s]
    split = s * padded[s - 1] + (k - s) * padded[-1] + CALL_ROWS
    best = int(np.argmin(split))
    if split[best] >= k * padded[-1]:
        return [np.arange(k)]
    return [order[: best + 1], order[best + 1 :]]


@dataclass
class Drafted:
    """The backbone's block outputs for the rows drafted, k = rows, in `order`; or, from the joined graph, the
    drafted block itself (hidden and base logits stayed inside it)."""

    hidden: np.ndarray | None  # [k, γ, H]
    base_logits: np.ndarray | None  # [k, γ, V]
    order: np.ndarray  # [k] output row i is the caller's row order[i] (identity unless calls were split)
    block: DraftBlock | None = None  # the greedy draft, when the heads ran in the backbone's call


class DrafterRunner:
    def __init__(self, backend: Backend, info: ModelInfo, kv: SlotCache) -> None:
        self.backend, self.info, self.kv = backend, info, kv
        # the block outputs of both graphs land in flat buffers sized once (max requests × γ); the
        # head reads the backbone's straight from them, nothing is copied out of ONNX Runtime
        rows, dtype = kv.lengths.shape[0], kv.dtype
        # one buffer per output name: the joined graph's draft ids and confidences land where the heads' do
        block_outputs = {t.name: t for graph in _BLOCK_GRAPHS if graph in backend.specs
                         for t in backend.specs[graph].outputs if t.dims[0] == "batch" and "present" not in t.name}
        self._buffers = {name: np.empty(rows * int(np.prod(t.dims[1:])), dtype if t.dtype != "int64" else np.int64)
                         for name, t in block_outputs.items()}
        self._greedy_heads: dict[int, tuple[BoundCall, dict[str, np.ndarray], dict[str, np.ndarray]]] = {}
        # graph -> (name, elements per row, row shape) of each block output held in `_buffers`
        self._views = {graph: [(t.name, int(np.prod(t.dims[1:])), tuple(t.dims[1:]))
                               for t in backend.specs[graph].outputs if t.name in self._buffers]
                       for graph in _BLOCK_GRAPHS if graph in backend.specs}
        self.fused = C.BACKBONE_FUSED in backend.specs and kv.device is None
        self.joined = C.DRAFT_GREEDY_FUSED in backend.specs and info.has_heads  # on the fused path only
        self._fused_calls: dict[tuple[int, int, int, int, bool], tuple[BoundCall, dict[str, np.ndarray]]] = {}
        self.bindings_made = 0  # graph layouts bound so far: a call that binds one runs cold (live_cost.warm_record)

    def draft(
        self,
        anchors: np.ndarray,  # [k] last committed token of each request
        starts: np.ndarray,  # [k] anchor positions
        pending: Sequence[Sequence[np.ndarray]],  # per request: [n, F] context chunks not yet seen
        rows: np.ndarray | None = None,  # [k] their slot rows (None: 0..k-1)
        greedy: bool = False,  # every row drafts at temperature 0: the joined graph may draft in this call
    ) -> Drafted:
        """Backbone forward for the given slot rows -> block_hidden [k, γ, H], base_logits [k, γ, V]
        (or None), in `order` (the caller's order unless rows with long backlogs ran apart); or the greedy
        block itself (`Drafted.block`) when the joined graph drafted it."""
        k = len(anchors)
        slots = np.arange(k) if rows is None else np.asarray(rows, dtype=np.int64)
        counts = np.array([sum(len(c) for c in chunks) for chunks in pending], dtype=np.int64)
        calls = split_calls(counts)
        joined = greedy and self.joined and len(calls) == 1
        first = 0
        for call in calls:
            joined = self._backbone(anchors[call], starts[call], [pending[i] for i in call], counts[call],
                                    slots[call], first, joined)
            first += len(call)
        order = calls[0] if len(calls) == 1 else np.concatenate(calls)
        if joined:
            heads = self._outputs(C.DRAFT_GREEDY_FUSED, k)
            return Drafted(None, None, order, DraftBlock(heads["draft_ids"], None, heads.get("confidence_logits")))
        outputs = self._outputs(C.BACKBONE, k)
        return Drafted(outputs["block_hidden"], outputs.get("base_logits"), order)

    def _backbone(self, anchors: np.ndarray, starts: np.ndarray, pending: Sequence[Sequence[np.ndarray]],
                  counts: np.ndarray, slots: np.ndarray, first: int, joined: bool = False) -> bool:
        """One backbone call over slot rows `slots`; its block outputs land in rows first.. of the buffers.
        `joined`: draft through the joined graph if this call takes the fused path; returns whether it did."""
        rows, gamma, dtype = len(anchors), self.info.block_size, self.kv.dtype
        contiguous = rows == 1 or bool(slots[-1] - slots[0] == rows - 1 and (np.diff(slots) == 1).all())
        cached = self.kv.lengths[slots]
        width = max(int(counts.max()), 1)  # new context rows, padded: every row's are written, only its own count
        if self.fused and contiguous and int(cached.max()) + width <= self.kv.max_len:
            self._backbone_fused(anchors, starts, pending, counts, int(slots[0]), first, cached, width, joined)
            return joined
        past, ctx = int(cached.max()), int(counts.max())
        features = np.zeros((rows, ctx, self.info.context_feature_size), dtype)
        which = np.repeat(np.arange(rows), counts)
        within = np.arange(which.size) - np.repeat(np.cumsum(counts) - counts, counts)
        features[which, within] = np.concatenate([c for chunks in pending for c in chunks])
        cols = np.arange(past + ctx + gamma)[None, :]
        visible = ((cols < cached[:, None]) | ((cols >= past) & (cols < past + counts[:, None]))
                   | (cols >= past + ctx))  # [rows, keys]: own cached rows, own new rows, the block
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
        if contiguous:  # [rows, kvh, past, hd]
            layers = [_contiguous(t) for kv in self.kv.past(int(slots[0]), rows, past) for t in kv]
        else:  # a gather: a copy, contiguous
            layers = [buf[self.kv.index(slots), :, :past] for buf in self.kv.kv]
        feeds.update(zip(C.kv_names("past_context", len(layers) // 2), layers, strict=True))
        outputs = self._outputs(C.BACKBONE, rows, first)
        names = C.kv_names("present_context", len(layers) // 2)
        if self.kv.device is None:  # host buffers: the graph writes its new cache into arrays made here
            present = [np.empty((rows, t.shape[1], past + ctx, t.shape[3]), dtype) for t in layers]
            outputs.update(zip(names, present, strict=True))
            self.backend.run_into(C.BACKBONE, feeds, outputs)
        else:  # a device cache: the new cache stays where the backend made it, block outputs come back
            out = self.backend.run(C.BACKBONE, feeds)
            for name, view in outputs.items():
                np.copyto(view, as_numpy(out[name]))
            present = [self.kv.local(out[name]) for name in names]
        pairs = list(zip(present[::2], present[1::2], strict=True))
        if contiguous:
            self.kv.write(pairs, source_offset=past, counts=counts, first_row=int(slots[0]))
        else:
            self._write_slots(pairs, past, counts, slots)
        return False

    def _backbone_fused(self, anchors: np.ndarray, starts: np.ndarray, pending: Sequence[Sequence[np.ndarray]],
                        counts: np.ndarray, slot: int, first: int, cached: np.ndarray, width: int,
                        joined: bool) -> None:
        """The fused backbone over slot rows slot .. slot + k - 1 (module docstring); their new keys/values
        land in their slots at cached .. cached + width - 1, of which the first counts[r] are counted. `joined`:
        the joined graph, whose greedy block lands in the heads' buffers."""
        rows, gamma = len(anchors), self.info.block_size
        key = (slot, rows, width, first, joined)
        bound = self._fused_calls.get(key)
        if bound is None:
            if len(self._fused_calls) >= MAX_FUSED_BINDINGS:
                self._fused_calls.clear()
            feeds = {"block_ids": np.full((rows, gamma), self.info.mask_token_id, np.int64),
                     "block_position_ids": np.zeros((rows, gamma), np.int64),
                     "context_features": np.zeros((rows, width, self.info.context_feature_size), self.kv.dtype),
                     "seqlens_k": np.zeros(rows, np.int32), "total_sequence_length": np.zeros((), np.int32),
                     "context_lengths": np.zeros(rows, np.int64)}
            if joined:
                feeds["anchor_ids"] = np.zeros(rows, np.int64)
            layers = [buf[slot : slot + rows] for buf in self.kv.kv]  # contiguous slot rows, bound in place
            feeds.update(zip(C.kv_names("past_context", len(layers) // 2), layers, strict=True))
            # (graph, whose block outputs it writes): the fused backbone writes the plain backbone's
            graph, written = (C.DRAFT_GREEDY_FUSED,) * 2 if joined else (C.BACKBONE_FUSED, C.BACKBONE)
            outputs = self._outputs(written, rows, first)
            outputs.update(zip(C.kv_names("present_context", len(layers) // 2), layers, strict=True))
            bound = self._fused_calls[key] = (self.backend.bind(graph, feeds, outputs), feeds)
            self.bindings_made += 1
        call, feeds = bound
        feeds["block_ids"][:, 0] = anchors
        if joined:
            feeds["anchor_ids"][...] = anchors
        feeds["block_position_ids"][...] = starts[:, None] + np.arange(gamma)
        features = feeds["context_features"]
        if rows <= FILL_BY_ROW:  # a few rows: slice copies beat building the scatter's indices
            for row, chunks in zip(features, pending, strict=True):
                at = 0
                for chunk in chunks:
                    row[at : at + len(chunk)] = chunk
                    at += len(chunk)
        else:
            which = np.repeat(np.arange(rows), counts)
            within = np.arange(which.size) - np.repeat(np.cumsum(counts) - counts, counts)
            if which.size:
                features[which, within] = np.concatenate([c for chunks in pending for c in chunks])
        feeds["seqlens_k"][...] = cached + width - 1
        feeds["total_sequence_length"][...] = int(cached.max()) + width
        feeds["context_lengths"][...] = cached + counts
        call.run()
        self.kv.advance(counts, slot)

    def _write_slots(self, present: list[tuple[Array, Array]], past: int, counts: np.ndarray,
                     slots: np.ndarray) -> None:
        """SlotCache.write for slot rows that are not one contiguous range."""
        row = np.repeat(np.arange(len(counts)), counts)
        if not row.size:
            return
        within = np.arange(row.size) - np.repeat(np.cumsum(counts) - counts, counts)
        dst = self.kv.lengths[slots][row] + within
        if dst.max() >= self.kv.max_len:
            raise CapacityError(f"KV slot overflow: position {int(dst.max())} >= slot length {self.kv.max_len}")
        at, row, dst, src = self.kv.indices(slots[row], row, dst, past + within)
        for (k, v), buf_k, buf_v in zip(present, self.kv.keys, self.kv.values, strict=True):
            buf_k[at, :, dst] = k[row, :, src]
            buf_v[at, :, dst] = v[row, :, src]
        self.kv.lengths[slots] += counts

    def _outputs(self, graph: str, rows: int, first: int = 0) -> dict[str, np.ndarray]:
        """[rows, ...] views of the flat buffers for `graph`'s block outputs, from buffer row `first`."""
        buffers = self._buffers
        return {name: buffers[name][first * size : (first + rows) * size].reshape(rows, *shape)
                for name, size, shape in self._views[graph]}

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
                self.bindings_made += 1
            call, feeds, out = self._greedy_heads[rows]
            if not np.may_share_memory(hidden, feeds["block_hidden"]):  # bounds only: the exact test is dear
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


def _contiguous(view: Array) -> Array:
    return view.contiguous() if isinstance(view, torch.Tensor) else np.ascontiguousarray(view)


def scatter_block(block: DraftBlock, order: np.ndarray, rows: int, temperatures: Sequence[float]) -> DraftBlock:
    """A block drafted for some active rows (`order` [k]: the active row of each drafted row) over all R rows:
    rows that did not draft have no drafts and confidence −inf (survival 0: Algorithm 1 gives them length 0);
    the draft logits are kept for sampling rows only (greedy verification never reads them)."""
    gamma = block.tokens.shape[1]
    tokens = np.zeros((rows, gamma), np.int64)  # [R, γ]
    tokens[order] = np.asarray(block.tokens)
    confidence = None
    if block.confidence_logits is not None:  # host numpy: torch calls between graph calls are dear (batch_loop)
        confidence = np.full((rows, gamma), -np.inf, np.float32)  # [R, γ]
        confidence[order] = as_numpy(block.confidence_logits)
    logits = None  # [R, γ, V]
    sampled = [i for i, r in enumerate(order) if temperatures[r] > 0]
    if sampled:
        source = torch.as_tensor(block.logits)
        logits = torch.zeros((rows, *source.shape[1:]), dtype=source.dtype)
        logits[torch.from_numpy(order[sampled])] = source[sampled]
    return DraftBlock(tokens, logits, confidence)
