"""One batched-engine step with draft trees: propose trees for every request, verify them all in
one target call, keep each request's accepted path.

  propose   the drafter backbone over all requests (`DrafterRunner.draft`, as for chains), then
            `tree_batch.grow_trees`: one head call per depth for every request's nodes, Algorithm 1
            over all requests' nodes (`dspark` mode, the engine's cost model) or `tree_nodes` best
            per request (`fixed` mode)
  verify    the trees packed [R, T] (T = 1 + the most nodes), positions and masks from the
            TreeAttentionMask operator (`dspark.plugins`: the numpy reference on the host, the CUDA
            kernel where the cache is on a GPU), one call of the plain or static-cache target graph
            (the graphs with a mask input) over the slot cache
  accept    TreeAccept: greedy rows in one call, sampling rows in another, each row on its own
            random stream (on a GPU: argmax or probabilities, and the kernels, there)
            (best-first trees are a deterministic function of the drafter: the "deterministic"
            process keeps sampling exact)
  commit    each row's accepted path's keys/values, gathered into path order, written at the row's
            committed length (compaction: rejected siblings are never counted); the drafter is
            queued the same tokens' context features

The fused graph has no mask input, so a fused engine's trees verify through its plain or static
graph, over the same slot buffers (prefill stays fused).
"""

from __future__ import annotations

import time
from dataclasses import fields
from typing import TYPE_CHECKING

import numpy as np
import torch

from dspark import plugins
from dspark.export import contract as C
from dspark.plugins import TreeAcceptResult

from .backend import Array, Backend, as_numpy
from .kv_cache import SlotCache
from .model_info import ModelInfo
from .sampling import probabilities
from .stats import StepRecord
from .tree_batch import GrownTrees, TreeOptions, grow_trees
from .tree_builder import DraftTree

if TYPE_CHECKING:
    from .batch_loop import BatchEngine

PAD_PARENT = -2  # TreeAttentionMask / TreeAccept: a padding node


class TreeDraftingError(ValueError):
    """Tree drafting cannot run on this engine as configured."""


def tree_graph(backend: Backend, kv_mode: str) -> str:
    """The target graph that verifies trees: the engine's own where it has a mask input (static,
    concat); for a fused engine the static-cache graph where exported (no past copy), else the plain one."""
    preferred = {"static": (C.TARGET_STATIC,), "concat": (C.TARGET,)}.get(kv_mode, (C.TARGET_STATIC, C.TARGET))
    for graph in preferred:
        if graph in backend.specs:
            return graph
    raise TreeDraftingError(f"tree drafting needs the '{C.TARGET}' or '{C.TARGET_STATIC}' target graph (a mask "
                            f"input), which this backend lacks (has {sorted(backend.specs)}); export with "
                            "--flavours plain,fused")


class TreeVerifier:
    """One target call over packed trees, and the commit of the accepted paths."""

    def __init__(self, backend: Backend, info: ModelInfo, kv: SlotCache, kv_mode: str) -> None:
        self.backend, self.info, self.kv = backend, info, kv
        self.graph = tree_graph(backend, kv_mode)

    def forward(self, parents: np.ndarray, tokens: np.ndarray,
                starts: np.ndarray) -> tuple[Array, np.ndarray, list[tuple[Array, Array]], int]:
        """parents, tokens [R, T] (padding parent -2), starts [R] -> logits [R, T, V], context features
        [R, T, F], the new keys/values per layer and the column where they start. With the cache on a
        device, the mask is made there (the CUDA kernel on a GPU) and the logits stay there."""
        rows = parents.shape[0]
        mask = plugins.tree_attention_mask(self.kv.index(parents), starts)
        static = self.graph == C.TARGET_STATIC
        cache_cols = self.kv.max_len if static else int(starts.max())
        layers = self.kv.past(0, rows, None if static else cache_cols)
        prefix, out_prefix = ("cache", "new") if static else ("past_key_values", "present")
        feeds = {"input_ids": tokens, "position_ids": mask.position_ids,
                 "attention_mask": plugins.compose_full_mask(mask.mask, starts, cache_cols)}
        feeds.update(zip(C.kv_names(prefix, len(layers)), (t for kv in layers for t in kv), strict=True))
        out = self.backend.run(self.graph, feeds)
        names = C.kv_names(out_prefix, len(layers))
        new = [(self.kv.local(out[names[2 * i]]), self.kv.local(out[names[2 * i + 1]])) for i in range(len(layers))]
        logits = as_numpy(out["logits"]) if self.kv.device is None else self.kv.local(out["logits"])
        return logits, as_numpy(out["context_features"]), new, 0 if static else cache_cols

    def commit(self, new: list[tuple[Array, Array]], offset: int, paths: list[list[int]]) -> None:
        """Row r keeps its path's entries (tree columns offset + node), in path order, from its length on."""
        longest = max(len(p) for p in paths)
        cols = np.array([[offset + n for n in p] + [offset] * (longest - len(p)) for p in paths], dtype=np.int64)
        rows, cols = self.kv.indices(np.broadcast_to(np.arange(len(paths))[:, None], cols.shape), cols)
        gathered = [(k[rows, :, cols].swapaxes(1, 2), v[rows, :, cols].swapaxes(1, 2))
                    for k, v in new]  # [R, kvh, longest, hd]
        self.kv.write(gathered, source_offset=0, counts=[len(p) for p in paths])


def pack(trees: list[DraftTree]) -> tuple[np.ndarray, np.ndarray]:
    """-> parents, tokens [R, T]: each tree's nodes, then padding nodes (parent -2, token 0)."""
    width = 1 + max(t.num_nodes for t in trees)
    parents = np.full((len(trees), width), PAD_PARENT, dtype=np.int64)
    tokens = np.zeros((len(trees), width), dtype=np.int64)
    for r, tree in enumerate(trees):
        parents[r, : tree.num_nodes + 1] = tree.parents
        tokens[r, : tree.num_nodes + 1] = tree.tokens
    return parents, tokens


def accept(trees: list[DraftTree], parents: np.ndarray, tokens: np.ndarray, logits: Array,
           temperatures: list[float], generators: list[torch.Generator | None],
           max_depth: int) -> tuple[list[list[int]], list[int]]:
    """TreeAccept over every row -> accepted paths (root first) and bonus tokens: greedy rows in one
    call, sampling rows in another (uniforms drawn as `tree_verifier.accept_tree` draws them)."""
    paths: list[list[int]] = [[] for _ in trees]
    bonus = [0] * len(trees)
    greedy = [r for r, t in enumerate(temperatures) if t == 0.0]
    if greedy:  # logits on a GPU: argmax and TreeAccept there, only the paths come back
        target_tokens = (logits[greedy].argmax(dim=-1) if isinstance(logits, torch.Tensor)
                         else logits[greedy].argmax(axis=-1))
        result = plugins.tree_accept_greedy(parents=parents[greedy], draft_tokens=tokens[greedy],
                                            past_lengths=np.zeros(len(greedy), np.int64),
                                            target_tokens=target_tokens, max_depth=max_depth)
        result = _on_host(result)
        for i, r in enumerate(greedy):
            paths[r] = result.accepted_path[i, : int(result.accept_length[i])].tolist()
            bonus[r] = int(result.bonus_token[i])
    sampled = [r for r, t in enumerate(temperatures) if t > 0.0]
    if sampled:  # best-first trees: TreeAccept's "deterministic" draft process, each row its own uniforms
        # on a GPU: probabilities there in float32 and the kernel (the host reference works in float64)
        on_device = isinstance(logits, torch.Tensor) and logits.is_cuda
        rows_logits = logits[sampled] if on_device else torch.from_numpy(as_numpy(logits[sampled]))
        target_probs = torch.stack([probabilities(rows_logits[i], temperatures[r]) for i, r in enumerate(sampled)])
        target_probs = target_probs if on_device else target_probs.double()  # [S, T, V]
        uniforms = torch.zeros(len(sampled), parents.shape[1], dtype=torch.float64)
        for i, r in enumerate(sampled):
            uniforms[i, : trees[r].num_nodes + 1] = torch.rand(1, trees[r].num_nodes + 1, generator=generators[r],
                                                               dtype=torch.float64)[0]
        probs = target_probs if on_device else target_probs.numpy()
        draft_probs = plugins.child_draft_probs(parents=parents[sampled], draft_tokens=tokens[sampled],
                                                parent_probs=probs, process="deterministic")
        result = plugins.tree_accept_sampling(parents=parents[sampled], draft_tokens=tokens[sampled],
                                              past_lengths=np.zeros(len(sampled), np.int64),
                                              target_probs=probs, draft_probs=draft_probs,
                                              uniforms=uniforms.to(target_probs.device) if on_device
                                              else uniforms.numpy(), max_depth=max_depth)
        result = _on_host(result)
        for i, r in enumerate(sampled):
            paths[r] = result.accepted_path[i, : int(result.accept_length[i])].tolist()
            bonus[r] = int(result.bonus_token[i])
    return paths, bonus



def _on_host(result: TreeAcceptResult) -> TreeAcceptResult:
    """TreeAccept's result as host arrays (a GPU's kernels return device tensors): one copy per field."""
    return TreeAcceptResult(*(as_numpy(getattr(result, f.name)) for f in fields(result)))

class TreeStepper:
    """The engine's step with trees (`SchedulerConfig(drafting="tree")`): everything between
    admission and retirement, as `BatchEngine.step` does it for chains."""

    def __init__(self, engine: BatchEngine) -> None:
        config = engine.scheduler
        if config.mode not in ("dspark", "fixed"):
            raise TreeDraftingError(f"tree drafting runs with scheduler mode 'dspark' (Algorithm 1 over nodes) or "
                                    f"'fixed' (tree_nodes per request), not '{config.mode}'")
        if config.mode == "dspark" and engine.cost_model is None:
            raise TreeDraftingError("tree drafting in mode 'dspark' needs a step cost model (Algorithm 1 prices "
                                    "nodes with it); pass cost_model= or use mode 'fixed'")
        self.engine = engine
        self.options = TreeOptions(config.tree_nodes, config.tree_top_k)
        self.verifier = TreeVerifier(engine.backend, engine.info, engine.target_kv, engine.kv_mode)
        self.last: GrownTrees | None = None  # the last step's trees (benchmarks read them)

    def _head(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.engine.backend.run(C.HEAD_STEP, feeds)

    def step(self, admitted_new: int, seconds: dict[str, float], begin: float) -> StepRecord:
        engine, info = self.engine, self.engine.info
        active, rows = engine.active, len(engine.active)
        anchors = np.fromiter((a.anchor for a in active), np.int64, rows)
        starts = np.fromiter((a.start for a in active), np.int64, rows)
        temperatures = [a.temperature for a in active]
        out = engine.drafter.draft(anchors, starts, [a.take_context() for a in active])
        order = out.order
        begin = _phase(seconds, "draft", begin)
        cost = engine.cost_model if engine.scheduler.mode == "dspark" else None
        grown = grow_trees(self._head if info.has_heads else None, out.hidden, out.base_logits, anchors[order],
                           self.options, feed_base_logits=info.lm_head_in_backbone, state_size=info.head_state_size,
                           throughput=None if cost is None else lambda tau, b: tau / cost.seconds(rows, b))
        trees = [None] * rows
        for i, r in enumerate(order):  # back to active-row order
            trees[r] = grown.trees[i]
        self.last = grown
        begin = _phase(seconds, "heads", begin)
        parents, tokens = pack(trees)
        logits, features, new, offset = self.verifier.forward(parents, tokens, starts)
        begin = _phase(seconds, "verify", begin)
        paths, bonus = accept(trees, parents, tokens, logits, temperatures, [a.generator for a in active],
                              info.block_size)
        self.verifier.commit(new, offset, paths)
        for r, (a, tree, path, b) in enumerate(zip(active, trees, paths, bonus, strict=True)):
            a.add_context(features[r, path])
            a.result.tokens += [tree.tokens[n] for n in path[1:]] + [b]
            a.result.acceptance_lengths.append(len(path))
            a.result.proposal_lengths.append(tree.num_nodes)
            a.start += len(path)
            a.anchor = b
        _phase(seconds, "commit", begin)
        nodes = [t.num_nodes for t in trees]
        verified = rows + sum(nodes)
        return StepRecord(
            step=engine.steps_run, requests=rows, admitted_new=admitted_new, lengths=nodes,
            verified_tokens=verified, padded_tokens=int(parents.size), acceptance_lengths=[len(p) for p in paths],
            expected_accepts=grown.expected_accepts,
            predicted_seconds=None if cost is None else float(cost.seconds(rows, np.array([verified]))[0]),
            seconds=seconds)


def _phase(seconds: dict[str, float], name: str, begin: float) -> float:
    now = time.perf_counter()
    seconds[name] = seconds.get(name, 0.0) + now - begin
    return now
