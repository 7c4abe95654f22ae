"""Driving `target_fused.onnx` with one shared K/V buffer (`SharedKVRunner`), and the fused graph's
parity sweep against the PyTorch target (`fused_parity`, recorded in export.json).

The graph itself is built by `fused_target.py`; its docstring explains the feeding (seqlens_k,
total_sequence_length, past and present bound to one buffer) that the runner implements.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import torch

from dspark.models import TargetModel

from . import contract as C


class SharedKVRunner:
    """Drives `target_fused.onnx` as `runtime/target_runner.py` does: one K/V buffer per layer and kind,
    made once and bound as both `past_key_values.{i}.*` and `present.{i}.*` (IO binding), so the
    graph appends in place; ids, seqlens_k, total_sequence_length and the outputs are preallocated
    per step width and written in place.

    `step(ids, past_lengths)` runs `ids` [batch, tokens] on top of each row's first
    `past_lengths[b]` cached slots and returns (logits [batch, tokens, V], context_features
    [batch, tokens, F]): views that the next step of the same width overwrites. Rollback = pass a
    smaller past length next time. `kv` holds the buffers (numpy views, [batch, kvh, capacity, hd]).
    """

    def __init__(self, session, spec: C.GraphSpec, batch: int, capacity: int) -> None:
        self.session, self.batch, self.capacity = session, batch, capacity
        types = {t.name: t for t in spec.inputs}
        kv_spec = types["past_key_values.0.key"]
        if kv_spec.dtype not in ("float32", "float16"):
            raise TypeError(f"SharedKVRunner feeds float32 and float16 graphs from numpy, not {kv_spec.dtype}")
        self._float = np.dtype(kv_spec.dtype)
        shape = (batch, kv_spec.dims[1], capacity, kv_spec.dims[3])
        self.io = session.io_binding()
        self.kv: list[np.ndarray] = []
        self._keep: list = []
        layers = sum(1 for t in spec.inputs if t.name.startswith("past_key_values.")) // 2
        for past, present in zip(C.kv_names("past_key_values", layers), C.kv_names("present", layers), strict=True):
            array = np.zeros(shape, self._float)
            value = ort.OrtValue.ortvalue_from_numpy(array)
            self.io.bind_ortvalue_input(past, value)
            self.io.bind_ortvalue_output(present, value)
            self.kv.append(array)
            self._keep.append(value)
        self._seqlens = np.zeros(batch, np.int32)
        self._total = np.zeros((), np.int32)
        self._bind_input("seqlens_k", self._seqlens)
        self._bind_input("total_sequence_length", self._total)
        self.tree = "position_ids" in types
        self.packed = "token_index" in types
        self._all_rows = "logits_rows" in types  # logits at every position (exports before it had no input)
        outputs = {t.name: t for t in spec.outputs}
        self._vocab, self._features = outputs["logits"].dims[2], outputs["context_features"].dims[2]
        self._widths: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, list]] = {}
        self._bound_width = 0

    def _bind_input(self, name: str, array: np.ndarray) -> None:
        value = ort.OrtValue.ortvalue_from_numpy(array)
        self.io.bind_ortvalue_input(name, value)
        self._keep.append(value)

    def _width(self, tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if tokens not in self._widths:
            ids = np.zeros((self.batch, tokens), np.int64)
            logits = np.zeros((self.batch, tokens, self._vocab), self._float)
            features = np.zeros((self.batch, tokens, self._features), self._float)
            rows = np.tile(np.arange(tokens, dtype=np.int64), (self.batch, 1))
            values = [ort.OrtValue.ortvalue_from_numpy(a) for a in (ids, logits, features, rows)]
            self._widths[tokens] = (ids, logits, features, values)
        ids, logits, features, values = self._widths[tokens]
        if self._bound_width != tokens:
            self.io.bind_ortvalue_input("input_ids", values[0])
            self.io.bind_ortvalue_output("logits", values[1])
            self.io.bind_ortvalue_output("context_features", values[2])
            if self._all_rows:
                self.io.bind_ortvalue_input("logits_rows", values[3])
            self._bound_width = tokens
        return ids, logits, features

    def step(self, input_ids, past_lengths, position_ids=None, attention_mask=None,
             counts=None) -> tuple[np.ndarray, np.ndarray]:
        """input_ids [batch, tokens] int; past_lengths [batch] int (each row's committed slots).
        Tree graphs also take position_ids [batch, tokens] and attention_mask [batch, 1, tokens,
        max(past_lengths) + tokens] bool over absolute slots. The packed graph computes the first
        counts[b] tokens of each row (None: every token); its padding rows come back zero."""
        input_ids = np.asarray(input_ids)
        past = np.asarray(past_lengths, dtype=np.int64)
        if input_ids.shape[0] != self.batch or past.shape != (self.batch,):
            raise ValueError(f"expected {self.batch} rows, got ids {input_ids.shape} and past {past.shape}")
        tokens = input_ids.shape[1]
        if past.min() < 0 or past.max() + tokens > self.capacity:
            raise ValueError(f"past lengths {past.tolist()} + {tokens} tokens exceed the capacity {self.capacity}")
        if self.tree != (position_ids is not None and attention_mask is not None):
            raise ValueError("a tree graph needs position_ids and attention_mask; a chain graph takes neither")
        ids, logits, features = self._width(tokens)
        ids[...] = input_ids
        self._seqlens[...] = past + tokens - 1
        self._total[...] = past.max() + tokens
        if self.tree:  # kept on self: ORT reads them in place, also if `io` is run again
            self._tree_feeds = (np.ascontiguousarray(position_ids, dtype=np.int64),
                                np.ascontiguousarray(attention_mask, dtype=bool))
            self.io.bind_cpu_input("position_ids", self._tree_feeds[0])
            self.io.bind_cpu_input("attention_mask", self._tree_feeds[1])
        if self.packed:  # kept on self, as the tree feeds; logits at every real token
            real = np.full(self.batch, tokens) if counts is None else np.asarray(counts, dtype=np.int64)
            self._token_index = token_index(real, tokens)
            self._logits_index = np.arange(self._token_index.size, dtype=np.int64)
            arrays = (np.empty((1, self._token_index.size, self._vocab), self._float),
                      np.empty((1, self._token_index.size), np.int64))
            self._packed = (arrays, [ort.OrtValue.ortvalue_from_numpy(a) for a in arrays])
            self.io.bind_cpu_input("token_index", self._token_index)
            self.io.bind_cpu_input("logits_index", self._logits_index)
            self.io.bind_ortvalue_output("logits", self._packed[1][0])
            self.io.bind_ortvalue_output("greedy_ids", self._packed[1][1])
        self.session.run_with_iobinding(self.io)
        if self.packed:  # [1, T, V] -> the padded rows (padding zero)
            logits.fill(0)
            logits.reshape(-1, self._vocab)[self._token_index] = self._packed[0][0][0]
        return logits, features


def token_index(counts: np.ndarray, width: int) -> np.ndarray:
    """The packed graph's `token_index`: flat indices into [rows·width] of each row's first counts[r] tokens."""
    return np.flatnonzero(np.arange(width)[None, :] < np.asarray(counts)[:, None]).astype(np.int64)


# Parity sweep (export.json): rows of different lengths through one shared buffer, each checked
# against a cache-free PyTorch forward of the row's whole sequence.
PARITY_STEPS = (  # (label, tokens per row this step; a row's real tokens; the rest is right padding)
    ("prefill b1 t64", None),
    ("prefill b4 t40 right-padded", (40, 23, 7, 31)),
    ("decode b4", (1, 1, 1, 1)),
    ("verify b4 t8 (rows 8, 5, 8, 2 real)", (8, 5, 8, 2)),
)
# atol = rtol per graph dtype, against a float32 PyTorch reference. float32: the golden fixtures'
# tolerance. Half precision: the half graph's own rounding (golden target, float16: fused graph 0.061
# from float32 PyTorch on logits ~ +-25, float16 PyTorch 0.070; the two halves differ by 0.13, which
# is why the reference is float32); a broken graph (wrong rotary, layout or norm) is off by whole units.
TOLERANCE = {"float32": 1e-4, "float16": 1e-1, "bfloat16": 2.5e-1}


def causal_slots(past_lengths, tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """The tree graph's inputs for a plain causal step: position_ids [batch, tokens] = past_b + t and
    attention_mask [batch, 1, tokens, max(past) + tokens] = slot <= past_b + t."""
    past = np.asarray(past_lengths, dtype=np.int64)
    positions = past[:, None] + np.arange(tokens)
    mask = np.arange(past.max() + tokens)[None, None, None, :] <= positions[:, None, :, None]
    return positions, mask


def tree_slots(parents: list[list[int]], past_lengths, tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """The tree graph's inputs for one flattened tree per row (`parents[b][t]`: node t's parent,
    -1 for the root, parents first; rows with fewer nodes are right-padded causally): positions
    past_b + depth, and each node sees its row's past slots and its ancestors' slots."""
    positions, mask = causal_slots(past_lengths, tokens)
    for b, (par, past) in enumerate(zip(parents, past_lengths, strict=True)):
        mask[b, 0, : len(par), past:] = False
        for t, parent in enumerate(par):
            positions[b, t] = past if parent < 0 else positions[b, parent] + 1
            mask[b, 0, t, past + t] = True
            if parent >= 0:
                mask[b, 0, t, past: past + tokens] |= mask[b, 0, parent, past: past + tokens]
    return positions, mask


def fused_parity(session, spec: C.GraphSpec, model: TargetModel, dtype: str, seed: int = 0) -> dict:
    """Max |diff| of logits, context_features and the written K/V slots against `model` (use a
    float32 model: see TOLERANCE) over `PARITY_STEPS` (tree graphs: fed causal masks, then one
    more step of random trees, each node against its root-to-node path), and whether every element
    passed atol = rtol = TOLERANCE[dtype] (`dtype`: the graph's)."""
    g = np.random.default_rng(seed)
    vocab, tol = model.config.vocab_size, TOLERANCE[dtype]
    worst = {"logits": 0.0, "context_features": 0.0, "present": 0.0}
    passed = True

    def reference(tokens: list[int]):
        with torch.no_grad():
            return model(torch.tensor([tokens]), torch.arange(len(tokens))[None])

    def check(name: str, got: np.ndarray, want: torch.Tensor) -> None:
        nonlocal passed
        got, want = got.astype(np.float64), want.double().numpy()
        if got.size:
            worst[name] = max(worst[name], float(np.abs(got - want).max()))
            passed = passed and bool(np.all(np.abs(got - want) <= tol + tol * np.abs(want)))

    def step(runner: SharedKVRunner, rows: list[list[int]], new: list[list[int]], width: int) -> None:
        """Right-pad `new` to `width`, run it causally on `rows` and check every row."""
        ids = g.integers(0, vocab, (len(rows), width))
        for b, ran in enumerate(new):
            ids[b, : len(ran)] = ran
        pasts = [len(r) for r in rows]
        logits, features = runner.step(ids, pasts, *(causal_slots(pasts, width) if runner.tree else (None, None)),
                                       counts=[len(ran) for ran in new])
        for b, (past, ran) in enumerate(zip(rows, new, strict=True)):
            ref, n = reference(past + ran), len(ran)
            check("logits", logits[b, :n], ref.logits[0, -n:])
            check("context_features", features[b, :n], ref.context_features[0, -n:])
            for i, kv in enumerate(ref.present):
                for j in (0, 1):
                    check("present", runner.kv[2 * i + j][b, :, : len(past) + n], kv[j][0])

    one = SharedKVRunner(session, spec, 1, 64)
    step(one, [[]], [g.integers(0, vocab, 64).tolist()], 64)
    runner = SharedKVRunner(session, spec, 4, 64)
    rows: list[list[int]] = [[] for _ in range(4)]
    for _, lengths in PARITY_STEPS[1:]:
        new = [g.integers(0, vocab, n).tolist() for n in lengths]
        step(runner, rows, new, max(lengths))
        rows = [r + n for r, n in zip(rows, new, strict=True)]
    cases = [label for label, _ in PARITY_STEPS]
    if runner.tree:
        cases.append("tree b4 t8 (rows of 8, 6, 8, 3 nodes)")
        parents = [[-1] + [int(g.integers(0, t)) for t in range(1, n)] for n in (8, 6, 8, 3)]
        ids = g.integers(0, vocab, (4, 8))
        pasts = [len(r) for r in rows]
        logits, features = runner.step(ids, pasts, *tree_slots(parents, pasts, 8))
        for b, par in enumerate(parents):
            for t in range(len(par)):
                path, node = [], t
                while node >= 0:
                    path.insert(0, node)
                    node = par[node]
                ref = reference(rows[b] + ids[b, path].tolist())
                check("logits", logits[b, t], ref.logits[0, -1])
                check("context_features", features[b, t], ref.context_features[0, -1])
    dtype_name = str(model.embed_tokens.weight.dtype).removeprefix("torch.")
    return {"cases": cases, "reference": f"PyTorch {dtype_name}", "max_abs_diff": worst, "tolerance": tol,
            "passed": passed}
