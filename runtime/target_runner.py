"""The target's graph calls over the slot cache: one forward for prefill or verification, then a
commit of the accepted entries.

Four ways to hold the target's keys and values, one per graph flavour (engine.json's `kv_mode`):

    packed  `target_fused_packed.onnx`: `fused`, with the projections, MLPs and LM head run on the real
            tokens only (`token_index`): a step verifying ℓ_r drafts per row computes Σ(1 + ℓ_r) tokens,
            not R·(1 + max ℓ) (the paper's §5.3). Its logits come packed; rows of different widths are
            laid out [R, W, V] by one copy of the real tokens' logits. A call whose rows are all equally
            wide runs `target_fused` on the same slot rows (its gathers would be pure cost).
    fused   `target_fused.onnx` (GroupQueryAttention): the slot rows themselves are bound as past
            AND present, so the call appends its keys/values in place at each row's own length and
            attends over exactly its valid entries; logits and features land in buffers made once.
            Commit = advance the lengths. Nothing is copied.
    static  `target_static.onnx`: the slot rows are bound whole as the cache (no copy), the graph
            attends over the whole capacity under a mask and returns only the new rows, which the
            commit writes at each row's length.
    concat  `target.onnx`: the past is fed as [R, kvh, max start, hd] (a copy of the slot prefix),
            the graph returns past ++ new, the commit writes the accepted new rows.

Rolling back rejected tokens is the same in all three: their entries are not counted, and the next
call overwrites them.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from dspark.export import contract as C
from dspark.export.fused_parity import token_index

from .backend import Backend, BoundCall, as_numpy
from .capacity import CapacityError
from .kv_cache import SlotCache
from .model_info import ModelInfo
from .step_batch import StepBatch

GRAPHS = C.KV_MODE_GRAPHS
KV_MODES = tuple(GRAPHS)
# prefill layouts (rows, prompt width, first row) kept bound, least recently used out first, while the arrays
# they own beyond the shared buffers (ids, features of prompts wider than those) stay under this many bytes:
# binding a prefill was most of its host time (0.4 ms of 0.57 a request, demo engine, one request at a time)
PREFILL_BINDING_BYTES = 32 << 20
PREFILL_BINDINGS = 64  # and at most this many (a binding holds ONNX Runtime objects of its own)
# the packed graph's decode layouts (rows, width, real tokens) kept bound, at most (then all let go): up to R·W
# token counts per (rows, width), where the fused graph has one layout
PACKED_BINDINGS = 512


@dataclass
class TargetOutput:
    logits: np.ndarray  # [R, W, V]; [R, 1, V] (each row's last real position) from forward(last_only=True)
    context_features: np.ndarray  # [R, W, F]
    greedy_ids: np.ndarray | None = None  # argmax of logits, shaped as they are, where the graph computes it


@dataclass
class _FusedCall:
    call: BoundCall
    feeds: dict[str, np.ndarray]  # refilled in place before each run
    output: TargetOutput  # views of the runner's output buffers


def kv_mode_for(backend: Backend, requested: str | None) -> str:
    """`requested`, checked against the graphs the backend has; None = `fused` where the backend has
    it, else `static` where the backend keeps the cache on a device (the slot rows are bound in
    place, and its feed shapes are fixed per (requests, tokens), what CUDA-graph replay needs), else
    `concat` (`static` attends over the whole capacity: on the host it only pays at long pasts and
    large batches). `packed` is asked for by name (its gathers cost 1-3 % of a step where every row is
    as wide as the widest: demo engine, 4-16 requests, plain decoding)."""
    if requested is None:
        if GRAPHS["fused"] in backend.specs:
            return "fused"
        return "static" if backend.kv_device is not None and GRAPHS["static"] in backend.specs else "concat"
    if requested not in KV_MODES:
        raise ValueError(f"kv_mode '{requested}' is unknown; choose one of {KV_MODES}")
    if GRAPHS[requested] not in backend.specs:
        raise ValueError(f"kv_mode '{requested}' needs the '{GRAPHS[requested]}' graph, which this backend "
                         f"lacks (has {sorted(backend.specs)}); export with --flavours plain,fused for 'fused'")
    return requested


class TargetRunner:
    def __init__(self, backend: Backend, info: ModelInfo, kv: SlotCache, kv_mode: str, *, max_width: int,
                 long_width: int | None = None) -> None:
        self.backend, self.kv, self.kv_mode = backend, kv, kv_mode
        self.graph = GRAPHS[kv_mode]
        self.packs = kv_mode == "packed"  # computes each row's real tokens only (`computed_tokens`)
        # packed: a call whose rows are all as wide as the widest (plain decoding, fixed γ) runs the fused chain
        # graph where the engine has it, over the same slot rows: the packed graph's gathers are pure cost there
        self._chain = GRAPHS["fused"] if kv_mode == "fused" or (self.packs and GRAPHS["fused"] in backend.specs) \
            else None
        self._in_place = kv_mode in ("packed", "fused")  # the slot rows bound as past and present
        slots = kv.lengths.shape[0]
        outputs = {t.name: t for t in backend.specs[self.graph].outputs}
        self._vocab, self._features = outputs["logits"].dims[2], outputs["context_features"].dims[2]
        dtype = kv.dtype
        # flat buffers: the first R·W·V elements are a contiguous [R, W, V] for any R, W that fit: every row
        # `max_width` wide, or one row `long_width` wide (a long prompt-lookup copy)
        self._max_width = max(max_width, long_width or 0)
        self._max_tokens = max(slots * max_width, self._max_width)
        self._logits = np.empty(self._max_tokens * self._vocab, dtype)
        self._greedy = np.empty(self._max_tokens, np.int64) if "greedy_ids" in outputs else None
        # packed: the real tokens' logits and ids laid out [R, W, ...] when rows differ in width
        self._rows_logits = np.empty(self._max_tokens * self._vocab, dtype) if self.packs else None
        self._rows_greedy = np.zeros(self._max_tokens, np.int64) if self.packs else None
        self._feature_buf = np.empty(self._max_tokens * self._features, dtype)
        # decode steps' (rows, width), packed: (rows, width, real tokens)
        self._bound: dict[tuple[int, ...], _FusedCall] = {}
        # prefills' (rows, width, first row), packed: (..., real tokens) -> (call, bytes)
        self._prefills: OrderedDict[tuple[int, ...], tuple[_FusedCall, int]] = OrderedDict()
        self._prefill_bytes = 0
        # True for fused graphs from exports since `logits_rows`: logits only where asked (a prefill: its last
        # positions); False: the graph makes them everywhere and forward(last_only=True) picks them out
        self.selects_logits: bool = self._chain is not None and any(
            t.name == "logits_rows" for t in backend.specs[self._chain].inputs)
        self._new: tuple[list[tuple[np.ndarray, np.ndarray]], int, int] | None = None  # plain graphs' present
        self.bindings_made = 0  # decode layouts bound and kept: the call binding one runs cold (live_cost.warm_record)

    def forward(self, batch: StepBatch, first_row: int = 0, last_only: bool = False) -> TargetOutput:
        """Run `batch` on slot rows first_row .. first_row + R - 1 (their committed lengths must be
        batch.starts). `last_only` (a prefill): logits for each row's last real token only, [R, 1, V]; a
        fused graph with `logits_rows` then skips the LM head everywhere else."""
        rows, width = batch.rows, batch.width
        longest = int(batch.starts.max())
        if longest + width > self.kv.max_len:
            raise CapacityError(f"KV slot overflow: {longest} + {width} > slot length {self.kv.max_len}")
        if self.packs and (self._chain is None or batch.tokens < rows * width):
            return self._packed(batch, first_row, last_only, longest)
        if self._in_place:
            if last_only and not self.selects_logits:
                return _last(self._fused(batch, first_row, False, longest), batch)
            return self._fused(batch, first_row, last_only, longest)
        feeds = {"input_ids": batch.ids, "position_ids": batch.positions, "attention_mask": None}
        layers = self.kv.past(first_row, rows, None if self.kv_mode == "static" else longest)
        if self.kv_mode == "static":
            cache_cols = self.kv.max_len
            prefix, out_prefix, offset = "cache", "new", 0
        else:
            cache_cols = longest
            prefix, out_prefix, offset = "past_key_values", "present", cache_cols
        mask = np.zeros((rows, 1, width, cache_cols + width), dtype=bool)
        plain = batch.attention_mask()  # [R, 1, W, max start + W]
        mask[..., :longest] = plain[..., :longest]
        mask[..., cache_cols:] = plain[..., longest:]
        feeds["attention_mask"] = mask
        feeds.update(zip(C.kv_names(prefix, len(layers)), (t for kv in layers for t in kv), strict=True))
        out = self.backend.run(self.graph, feeds)
        names = C.kv_names(out_prefix, len(layers))
        self._new = ([(out[names[2 * i]], out[names[2 * i + 1]]) for i in range(len(layers))], offset, first_row)
        logits = out["logits"]
        if last_only:  # picked where the logits are (a device's: only these rows cross the bus)
            rows_at, last_at = np.arange(rows), batch.counts - 1
            if isinstance(logits, torch.Tensor):
                rows_at, last_at = (torch.from_numpy(a).to(logits.device) for a in (rows_at, last_at))
            logits = logits[rows_at, last_at][:, None]
        return TargetOutput(as_numpy(logits), as_numpy(out["context_features"]))

    def _fused(self, batch: StepBatch, first_row: int, last_only: bool, longest: int) -> TargetOutput:
        """Decode steps (rows 0..R-1, width W) reuse one binding per (R, W), made the first time; prefills,
        whose widths are the prompts', reuse theirs while they fit `PREFILL_BINDING_BYTES`; steps too wide for
        the buffers bind afresh. `longest`: max(batch.starts), as `forward` has it."""
        if last_only:
            call = self._prefill_call(batch.rows, batch.width, first_row)
            call.feeds["logits_rows"][:, 0] = batch.counts - 1
        else:
            key = (batch.rows, batch.width)
            call = self._bound.get(key) if first_row == 0 else None
            if call is None:
                call = self._bind_fused(batch.rows, batch.width, first_row, False)
                if first_row == 0 and batch.width <= self._max_width and batch.rows * batch.width <= self._max_tokens:
                    self._bound[key] = call
                    self.bindings_made += 1  # once: a layout bound afresh every time is its steady cost
        call.feeds["input_ids"][...] = batch.ids
        call.feeds["seqlens_k"][...] = batch.starts + batch.width - 1
        call.feeds["total_sequence_length"][...] = longest + batch.width
        call.call.run()
        return call.output

    def _packed(self, batch: StepBatch, first_row: int, last_only: bool, longest: int) -> TargetOutput:
        """`_fused` for the packed graph: bindings per (rows, width, real tokens); logits at every real token,
        or (`last_only`) at each row's last. Returns them [R, W, V] ([R, 1, V]), a view where every row is
        `width` wide or one token is asked per row, else laid out by one copy."""
        rows, width, tokens = batch.rows, batch.width, batch.tokens
        if last_only:
            call = self._prefill_call(rows, width, first_row, tokens)
            call.feeds["logits_index"][...] = batch.cu_counts[1:] - 1
        else:
            key = (rows, width, tokens)
            call = self._bound.get(key) if first_row == 0 else None
            if call is None:
                call = self._bind_fused(rows, width, first_row, False, tokens)
                if first_row == 0 and width <= self._max_width and rows * width <= self._max_tokens:
                    if len(self._bound) >= PACKED_BINDINGS:
                        self._bound.clear()
                    self._bound[key] = call
                    self.bindings_made += 1
        full = tokens == rows * width  # a binding's token_index starts as every token (`_bind_fused`)
        index = call.feeds["token_index"]
        if not full:
            np.copyto(index, token_index(batch.counts, width))
        call.feeds["input_ids"][...] = batch.ids
        call.feeds["seqlens_k"][...] = batch.starts + width - 1
        call.feeds["total_sequence_length"][...] = longest + width
        call.call.run()
        out = call.output
        if last_only or full:
            k = 1 if last_only else width
            greedy = None if out.greedy_ids is None else out.greedy_ids.reshape(rows, k)
            return TargetOutput(out.logits.reshape(rows, k, self._vocab), out.context_features, greedy)
        logits = _view(self._rows_logits, (rows, width, self._vocab))
        logits.reshape(-1, self._vocab)[index] = out.logits[0]
        greedy = None
        if out.greedy_ids is not None:
            greedy = _view(self._rows_greedy, (rows, width))
            greedy.reshape(-1)[index] = out.greedy_ids[0]
        return TargetOutput(logits, out.context_features, greedy)

    def computed_tokens(self, batch: StepBatch) -> int:
        """The tokens the graph computes for `batch`: what a step's cost is measured in (the cost table's B)."""
        return batch.tokens if self.packs else batch.padded_tokens

    def _prefill_call(self, rows: int, width: int, first_row: int, tokens: int | None = None) -> _FusedCall:
        """A prefill's binding over slot rows first_row.. at this prompt width (packed: and real tokens): kept, or
        made and kept (least recently used ones dropped to stay under PREFILL_BINDING_BYTES and PREFILL_BINDINGS);
        made and not kept when it alone is over the bytes."""
        key = (rows, width, first_row) if tokens is None else (rows, width, first_row, tokens)
        kept = self._prefills.get(key)
        if kept is not None:
            self._prefills.move_to_end(key)
            return kept[0]
        call = self._bind_fused(rows, width, first_row, True, tokens)
        shared = [b for b in (self._logits, self._feature_buf, self._greedy, *self.kv.kv) if b is not None]
        owned = sum(a.nbytes for a in (*call.feeds.values(), *vars(call.output).values())
                    if a is not None and not any(np.may_share_memory(a, b) for b in shared))
        if owned > PREFILL_BINDING_BYTES:
            return call
        while self._prefills and (self._prefill_bytes + owned > PREFILL_BINDING_BYTES
                                  or len(self._prefills) >= PREFILL_BINDINGS):
            self._prefill_bytes -= self._prefills.popitem(last=False)[1][1]
        self._prefills[key], self._prefill_bytes = (call, owned), self._prefill_bytes + owned
        return call

    def _bind_fused(self, rows: int, width: int, first_row: int, last_only: bool,
                    tokens: int | None = None) -> _FusedCall:
        """A binding of the fused graph at [rows, width], or of the packed graph (`tokens` real ones)."""
        k = 1 if last_only else width  # logits per row
        # the first elements: contiguous [R, k, V]; packed: [1, N, V] at N = R (last_only) or every real token
        logits_shape = (rows, k) if tokens is None else (1, rows if last_only else tokens)
        logits = _view(self._logits, (*logits_shape, self._vocab))
        features = _view(self._feature_buf, (rows, width, self._features))
        greedy = None if self._greedy is None else _view(self._greedy, logits_shape)
        kv = [buf[first_row : first_row + rows] for buf in self.kv.kv]  # contiguous slot rows
        feeds = {"input_ids": np.zeros((rows, width), np.int64), "seqlens_k": np.zeros(rows, np.int32),
                 "total_sequence_length": np.zeros((), np.int32)}
        if tokens is not None:  # which tokens are real (set per call), where logits are asked (last_only: per call)
            feeds["token_index"] = np.arange(tokens, dtype=np.int64)
            feeds["logits_index"] = np.arange(logits_shape[1], dtype=np.int64)
        elif self.selects_logits:  # every position (verification), or each row's last (set per call)
            feeds["logits_rows"] = np.tile(np.arange(k, dtype=np.int64), (rows, 1))
        feeds.update(zip(C.kv_names("past_key_values", len(kv) // 2), kv, strict=True))
        outputs = {"logits": logits, "context_features": features}
        if greedy is not None:
            outputs["greedy_ids"] = greedy
        outputs.update(zip(C.kv_names("present", len(kv) // 2), kv, strict=True))
        graph = self.graph if tokens is not None else self._chain
        return _FusedCall(self.backend.bind(graph, feeds, outputs), feeds,
                          TargetOutput(logits, features, greedy))

    def commit(self, counts: np.ndarray, first_row: int = 0) -> None:
        """Keep the first counts[r] new entries of each row of the last forward."""
        if self._in_place:
            self.kv.advance(counts, first_row)
            return
        present, offset, row = self._new
        self.kv.write(present, source_offset=offset, counts=counts, first_row=row)
        self._new = None


def _view(flat: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """The first prod(shape) elements of a buffer made once, as `shape`; a fresh array when they do not fit."""
    size = int(np.prod(shape))
    return flat[:size].reshape(shape) if size <= flat.size else np.empty(shape, flat.dtype)


def _last(out: TargetOutput, batch: StepBatch) -> TargetOutput:
    """Logits [R, 1, V] at each row's last real token, from a graph that made them everywhere."""
    rows = np.arange(batch.rows)
    greedy = None if out.greedy_ids is None else out.greedy_ids[rows, batch.counts - 1][:, None]
    return TargetOutput(out.logits[rows, batch.counts - 1][:, None], out.context_features, greedy)
