"""Array-facing API of the custom operators: numpy or torch in, the same kind out.

The numpy references under plugins/<op>/reference.py define the semantics; these wrappers convert
torch tensors (any device) to numpy and the results back, so the runtime can call them. Inputs on a
GPU run the CUDA kernels there instead (`plugins.cuda`, where plugins/build.sh has built them:
TreeAttentionMask, and TreeAccept when its target tokens or probabilities are on the GPU), with
nothing copied to the host.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch

from . import cuda as _cuda
from .tree_accept import draft_probs as _draft
from .tree_accept import reference as _accept
from .tree_attention_mask import reference as _mask

Array = np.ndarray | torch.Tensor


@dataclass(frozen=True)
class TreeMask:
    """Outputs of TreeAttentionMask.

    mask:         [batch, 1, N, N] bool, node i may attend node j iff j is i or an ancestor of i
    position_ids: [batch, N] int64, past length + depth
    packed_mask:  [batch, N, ceil(N / 32)] int32, mask rows packed 32 columns per word
    """

    mask: Array
    position_ids: Array
    packed_mask: Array


def _numpy(x: Array) -> np.ndarray:
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def _like(value: np.ndarray, reference: Any) -> Array:
    if isinstance(reference, torch.Tensor):
        return torch.from_numpy(np.ascontiguousarray(value)).to(reference.device)
    return value


def tree_attention_mask(parents: Array, past_lengths: Array) -> TreeMask:
    """parents [batch, N] (root -1, padding -2), past_lengths [batch] -> TreeMask."""
    if _cuda.on_device_available(parents):
        return TreeMask(*_cuda.on_device_tree_attention_mask(parents, torch.as_tensor(past_lengths)))
    mask, position_ids, packed = _mask.tree_attention_mask(_numpy(parents), _numpy(past_lengths))
    return TreeMask(*(_like(v, parents) for v in (mask, position_ids, packed)))


def compose_full_mask(tree_mask: Array, past_lengths: Array, past_capacity: int) -> Array:
    """[batch, 1, N, N] tree mask -> [batch, 1, N, past_capacity + N] with the cache columns in front."""
    if isinstance(tree_mask, torch.Tensor):  # composed where the mask is (a GPU's tree mask stays there)
        batch, _, n, _ = tree_mask.shape
        past = torch.as_tensor(past_lengths).to(tree_mask.device)
        cached = torch.arange(past_capacity, device=tree_mask.device)[None, :] < past[:, None]
        return torch.cat((cached[:, None, None, :].expand(batch, 1, n, past_capacity), tree_mask), dim=-1)
    full = _mask.compose_full_mask(_numpy(tree_mask), _numpy(past_lengths), past_capacity)
    return _like(full, tree_mask)


def _convert(result: _accept.TreeAcceptResult, reference: Any) -> _accept.TreeAcceptResult:
    return _accept.TreeAcceptResult(**{f.name: _like(getattr(result, f.name), reference) for f in fields(result)})


def tree_accept_greedy(
    *, parents: Array, draft_tokens: Array, past_lengths: Array, target_tokens: Array, max_depth: int
) -> _accept.TreeAcceptResult:
    """Greedy tree verification; shapes as in plugins/tree_accept/reference.py."""
    if _cuda.on_device_available(target_tokens):
        return _cuda.on_device_tree_accept_greedy(*(torch.as_tensor(a) for a in (parents, draft_tokens, past_lengths,
                                                                                  target_tokens)), max_depth)
    result = _accept.tree_accept_greedy(
        _numpy(parents), _numpy(draft_tokens), _numpy(past_lengths), _numpy(target_tokens), max_depth
    )
    return _convert(result, parents)


def tree_accept_sampling(
    *,
    parents: Array,
    draft_tokens: Array,
    past_lengths: Array,
    target_probs: Array,
    draft_probs: Array,
    uniforms: Array,
    max_depth: int,
) -> _accept.TreeAcceptResult:
    """Lossless tree verification by recursive rejection sampling; see plugins/tree_accept/README.md."""
    if _cuda.on_device_available(target_probs):
        return _cuda.on_device_tree_accept_sampling(
            *(torch.as_tensor(a) for a in (parents, draft_tokens, past_lengths, target_probs, draft_probs, uniforms)),
            max_depth)
    result = _accept.tree_accept_sampling(
        _numpy(parents),
        _numpy(draft_tokens),
        _numpy(past_lengths),
        _numpy(target_probs),
        _numpy(draft_probs),
        _numpy(uniforms),
        max_depth,
    )
    return _convert(result, parents)


def child_draft_probs(
    *, parents: Array, draft_tokens: Array, parent_probs: Array, process: _draft.DraftProcess
) -> Array:
    """Per-child draft distributions for a draft process; see plugins/tree_accept/draft_probs.py."""
    if process == "deterministic" and isinstance(parent_probs, torch.Tensor):
        # one-hot rows of the children's tokens, made where parent_probs is (its values are not read)
        parents, tokens = (torch.as_tensor(a).to(parent_probs.device) for a in (parents, draft_tokens))
        out = torch.zeros(parent_probs.shape, dtype=parent_probs.dtype, device=parent_probs.device)
        batch, node = (parents >= 0).nonzero(as_tuple=True)  # every node with a parent: not the root, not padding
        out[batch, node, tokens[batch, node]] = 1.0
        return out
    out = _draft.child_draft_probs(_numpy(parents), _numpy(draft_tokens), _numpy(parent_probs), process)
    if isinstance(parent_probs, torch.Tensor):
        return torch.from_numpy(out).to(device=parent_probs.device, dtype=parent_probs.dtype)
    return out
