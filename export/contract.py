"""The graph contract: every ONNX graph's file, input/output names, dtypes and dims, in one place.

The runtime (and `dspark-build-engine`) feed graphs by these names; `export.json` records the
same specs, so a reader never has to open the ONNX files to learn them. Symbolic dims:

    batch          requests in the batch (padded rows are masked out)
    tokens         new tokens per row (prefill, chain of drafts, or a flattened tree)
    past           cached target positions per row
    total          past + tokens (attention columns of the concat-cache target graph)
    capacity       fixed cache slots per row of the static-cache target graph
    capacity_plus_tokens  capacity + tokens (its attention columns: cache slots, then new tokens)
    context_tokens / context_past / context_total   the same for the drafter's context cache
    block_total    context_total + block (drafter attention columns: context, then the block)

Target graph (`target.onnx`, concat cache): `attention_mask[b, 0, t, j]` is True when new token t
may attend to column j, columns being the `past` cached positions followed by the `tokens` new
ones. A causal chain, a padded batch (False on padding columns) and a flattened draft tree (each
node sees its ancestors) are all just masks. `present.{i}.*` = past ++ new keys/values.

Target graph (`target_static.onnx`, static cache for in-place KV): the cache inputs
`cache.{i}.key|value` [batch, kv_heads, capacity, head_dim] are fixed-size buffers that the
runtime owns and binds (ORT IO binding / TensorRT device pointers) without copying; the graph only
reads them and returns the new tokens' keys/values `new.{i}.key|value` [batch, kv_heads, tokens,
head_dim]. The runtime writes those rows into its buffers at each row's write position (the row's
cache length, or any free slots: slot order does not matter, only the mask does — except with
sliding-window layers, below). The mask has
capacity + tokens columns: first every cache slot (True only where the slot holds a committed
position visible to this token), then the new tokens (causal or tree). No buffer is copied inside
the graph: attention scores are computed against the cache and the new keys separately and share
one softmax.

Target graph (`target_fused.onnx`, ONNX Runtime fused ops, built by `fused_target.py`): the same
logits and context features from com.microsoft GroupQueryAttention (rotary inside) and
(Skip)SimplifiedLayerNormalization. No position_ids and no mask: per row b with `past_b` committed
positions, `seqlens_k[b]` (int32) = past_b + tokens - 1 and `total_sequence_length` (int32 scalar) =
max_b(past_b) + tokens; new token t of row b sits at position past_b + t and sees slots 0 .. past_b + t
(causal). `past_key_values.{i}.*` and `present.{i}.*` are one buffer [batch, kv_heads, capacity,
head_dim] per layer and kind that the runtime binds as both (IO binding): the graph writes the new
keys/values in place at slots past_b .. past_b + tokens - 1. Rows with fewer real tokens are right-padded.
Logits (and greedy_ids) come only for the positions `logits_rows` [batch, logit_tokens] (int64) names in each
row: every position (0 .. tokens-1) to verify, each prompt's last one to prefill, so a long prompt never makes
[tokens, vocab] logits nor runs the LM head over them (exports made before this input have none: every position).
`target_fused_tree.onnx` adds `position_ids` [batch, tokens] and a bool `attention_mask` [batch, 1,
tokens, total_sequence_length] whose columns are absolute cache slots (True = may attend; the causal
rule still applies on top, so it can only hide): flattened draft trees and hidden past slots.

Attention layouts (Gemma-4 mixes sliding-window and global layers): every K/V spec carries its own
layer's dims, and export.json's `target.attention_layers` / `drafter.attention_layers` list each
layer's `num_kv_heads`, `head_dim`, `sliding_window` and `keys_are_values`. A sliding-window layer
narrows the mask inside the graph to the keys fewer than `sliding_window` positions behind the query;
a key's position is its column index for cache columns (so cache column / slot j must hold position
j, as the runtime's slot caches and the concat past do) and `position_ids` for new tokens. Its K/V
buffers still hold every position (`sliding_window_kv: "full-length"`): the window is a mask, not a
ring buffer. K = V layers have no value projection but still ship separate key and value tensors (K
normed and rotated, V normed). The fused flavour does not represent these families (plain only).

Drafter backbone (`drafter_backbone.onnx`): the new context features and their positions, the
cached projected context keys/values per draft layer, the block (anchor + mask ids) and its
positions, and a bool mask [batch, 1, block, context_total + block] (all True = DeepSpec decoding;
False hides padded context rows) -> `block_hidden`, `base_logits` when the shared LM head runs in
the backbone (see `Placement`), and `present_context.{i}.*` = cached ++ new context keys/values.

Drafter backbone, fused (`drafter_backbone_fused.onnx`, ONNX Runtime fused ops, built by
`fused_drafter.py`): the same outputs; the projected context keys/values go into one buffer per layer
and kind [batch, kv_heads, capacity, head_dim], bound as both `past_context.{i}.*` and
`present_context.{i}.*`, through GroupQueryAttention (rotary inside) at slots cached_b .. cached_b +
context_tokens - 1: `seqlens_k[b]` (int32) = cached_b + context_tokens - 1, `total_sequence_length` (int32
scalar) = max_b(cached_b) + context_tokens, as for the fused target. The block attends to slots 0 ..
`context_lengths[b]` - 1 (int64: cached_b + the row's real new rows; padding rows are written but never
seen) and to the whole block, with no mask input.

Drafting at temperature 0, fused (`drafter_draft_greedy_fused.onnx`, built by `fused_draft_greedy.py` by joining
the fused backbone to `drafter_head_greedy.onnx`): the fused backbone's inputs plus `anchor_ids` -> the greedy head's
`draft_ids` and `confidence_logits`, and the context buffers as above; the block's hidden states and base
logits stay inside the graph, and the corrected logits are not returned (greedy verification never reads
them). One call drafts an all-greedy batch.

Drafter heads: `drafter_head_step.onnx` runs one block slot (any sampling: the runtime samples
from the returned corrected logits, so draft probabilities are exact) and
`drafter_head_greedy.onnx` runs the whole block at temperature 0 in one call (argmax feeds the
next slot inside the graph). Neither exists for a DFlash drafter (no Markov head, no confidence
head): its draft logits are the backbone's base logits.
"""

from __future__ import annotations

from dataclasses import dataclass

from dspark.models import DrafterConfig, TargetConfig
from dspark.models.config import DecoderConfig

TARGET = "target"
TARGET_STATIC = "target_static"
TARGET_FUSED = "target_fused"
TARGET_FUSED_TREE = "target_fused_tree"
TARGET_FUSED_PACKED = "target_fused_packed"
BACKBONE = "drafter_backbone"
BACKBONE_FUSED = "drafter_backbone_fused"
HEAD_STEP = "drafter_head_step"
HEAD_GREEDY = "drafter_head_greedy"
DRAFT_GREEDY_FUSED = "drafter_draft_greedy_fused"
# how the runtime holds the target's keys/values -> the target graph that mode drives
KV_MODE_GRAPHS = {"packed": TARGET_FUSED_PACKED, "fused": TARGET_FUSED, "static": TARGET_STATIC, "concat": TARGET}

DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # "int64", "int32", "bool" or the float dtype of the export
    dims: tuple[int | str, ...]  # ints are fixed, strings are symbolic

    def to_json(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "dims": list(self.dims)}


@dataclass(frozen=True)
class GraphSpec:
    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    @property
    def file(self) -> str:
        return f"{self.name}.onnx"

    @property
    def input_names(self) -> list[str]:
        return [t.name for t in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [t.name for t in self.outputs]

    def dynamic_axes(self) -> dict[str, dict[int, str]]:
        """{tensor name: {axis: symbol}} for every symbolic dim (torch.onnx.export's format)."""
        return {
            t.name: {axis: dim for axis, dim in enumerate(t.dims) if isinstance(dim, str)}
            for t in (*self.inputs, *self.outputs)
            if any(isinstance(dim, str) for dim in t.dims)
        }

    def to_json(self) -> dict:
        return {
            "file": self.file,
            "inputs": [t.to_json() for t in self.inputs],
            "outputs": [t.to_json() for t in self.outputs],
        }


def kv_names(prefix: str, layers: int) -> list[str]:
    """`{prefix}.{i}.key`, `{prefix}.{i}.value` for every layer, in feed order."""
    return [f"{prefix}.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]


def kv_dims(config: DecoderConfig) -> list[tuple[int, int]]:
    """(kv_heads, head_dim) of every layer's key and value buffers: one pair for all layers, except in
    families that mix attention layouts (Gemma-4: sliding-window and global layers)."""
    return [(lay.num_key_value_heads, lay.head_dim) for lay in config.layouts]


def _kv(prefix: str, config: DecoderConfig, length: str, dtype: str) -> list[TensorSpec]:
    dims = kv_dims(config)
    return [TensorSpec(name, dtype, ("batch", dims[i // 2][0], length, dims[i // 2][1]))
            for i, name in enumerate(kv_names(prefix, len(dims)))]


def target_spec(config: TargetConfig, feature_size: int, dtype: str) -> GraphSpec:
    return GraphSpec(
        TARGET,
        inputs=(
            TensorSpec("input_ids", "int64", ("batch", "tokens")),
            TensorSpec("position_ids", "int64", ("batch", "tokens")),
            TensorSpec("attention_mask", "bool", ("batch", 1, "tokens", "total")),
            *_kv("past_key_values", config, "past", dtype),
        ),
        outputs=(
            TensorSpec("logits", dtype, ("batch", "tokens", config.vocab_size)),
            TensorSpec("context_features", dtype, ("batch", "tokens", feature_size)),
            *_kv("present", config, "total", dtype),
        ),
    )


def target_static_spec(config: TargetConfig, feature_size: int, dtype: str) -> GraphSpec:
    return GraphSpec(
        TARGET_STATIC,
        inputs=(
            TensorSpec("input_ids", "int64", ("batch", "tokens")),
            TensorSpec("position_ids", "int64", ("batch", "tokens")),
            TensorSpec("attention_mask", "bool", ("batch", 1, "tokens", "capacity_plus_tokens")),
            *_kv("cache", config, "capacity", dtype),
        ),
        outputs=(
            TensorSpec("logits", dtype, ("batch", "tokens", config.vocab_size)),
            TensorSpec("context_features", dtype, ("batch", "tokens", feature_size)),
            *_kv("new", config, "tokens", dtype),
        ),
    )


def target_fused_spec(config: TargetConfig, feature_size: int, dtype: str, tree: bool = False,
                      packed: bool = False) -> GraphSpec:
    """`target_fused.onnx` (`target_fused_tree.onnx` with `tree`, `target_fused_packed.onnx` with `packed`):
    past and present K/V are the same bound buffer (`capacity` slots). The packed graph also takes
    `token_index` [T], the flat indices into [batch·tokens] of the real tokens (row-major, ascending):
    its projections, MLPs and LM head run on those T tokens only. Its logits and greedy ids are packed,
    [1, N, V] and [1, N] at `logits_index` [N] (indices into the T tokens); its context features and
    K/V are the chain graph's."""
    tree_inputs = (
        TensorSpec("position_ids", "int64", ("batch", "tokens")),
        TensorSpec("attention_mask", "bool", ("batch", 1, "tokens", "total_sequence_length")),
    ) if tree else ()
    logit_tokens = "tokens" if tree else "logit_tokens"
    # the packed graph's logits: at `logits_index` [N] (indices into the T packed tokens), [1, N, V]
    logits_in = TensorSpec("logits_index", "int64", (logit_tokens,)) if packed else \
        TensorSpec("logits_rows", "int64", ("batch", logit_tokens))
    logits_rows = (1, logit_tokens) if packed else ("batch", logit_tokens)
    return GraphSpec(
        TARGET_FUSED_TREE if tree else TARGET_FUSED_PACKED if packed else TARGET_FUSED,
        inputs=(
            TensorSpec("input_ids", "int64", ("batch", "tokens")),
            *((TensorSpec("token_index", "int64", ("packed_tokens",)),) if packed else ()),
            TensorSpec("seqlens_k", "int32", ("batch",)),
            TensorSpec("total_sequence_length", "int32", ()),
            *tree_inputs,
            *_kv("past_key_values", config, "capacity", dtype),
            *(() if tree else (logits_in,)),
        ),
        outputs=(
            TensorSpec("logits", dtype, (*logits_rows, config.vocab_size)),
            TensorSpec("context_features", dtype, ("batch", "tokens", feature_size)),
            TensorSpec("greedy_ids", "int64", logits_rows),
            *_kv("present", config, "capacity", dtype),
        ),
    )


@dataclass(frozen=True)
class Placement:
    """Where the shared LM head runs: in the backbone (one [batch·block, H] x [H, V] matmul, the
    base logits become a graph output) or in the head graphs (per slot)."""

    lm_head_in_backbone: bool


def backbone_spec(config: DrafterConfig, placement: Placement, dtype: str) -> GraphSpec:
    c = config
    block = c.block_size
    outputs = [TensorSpec("block_hidden", dtype, ("batch", block, c.hidden_size))]
    if placement.lm_head_in_backbone:
        outputs.append(TensorSpec("base_logits", dtype, ("batch", block, c.vocab_size)))
    return GraphSpec(
        BACKBONE,
        inputs=(
            TensorSpec("block_ids", "int64", ("batch", block)),
            TensorSpec("block_position_ids", "int64", ("batch", block)),
            TensorSpec("context_features", dtype, ("batch", "context_tokens", c.context_feature_size)),
            TensorSpec("context_position_ids", "int64", ("batch", "context_tokens")),
            TensorSpec("attention_mask", "bool", ("batch", 1, block, "block_total")),
            *_kv("past_context", config, "context_past", dtype),
        ),
        outputs=(*outputs, *_kv("present_context", config, "context_total", dtype)),
    )


def backbone_fused_spec(config: DrafterConfig, placement: Placement, dtype: str) -> GraphSpec:
    """`drafter_backbone_fused.onnx`: the context cache is one bound buffer (`capacity` slots) per layer and kind."""
    c = config
    block = c.block_size
    outputs = [TensorSpec("block_hidden", dtype, ("batch", block, c.hidden_size))]
    if placement.lm_head_in_backbone:
        outputs.append(TensorSpec("base_logits", dtype, ("batch", block, c.vocab_size)))
    return GraphSpec(
        BACKBONE_FUSED,
        inputs=(
            TensorSpec("block_ids", "int64", ("batch", block)),
            TensorSpec("block_position_ids", "int64", ("batch", block)),
            TensorSpec("context_features", dtype, ("batch", "context_tokens", c.context_feature_size)),
            TensorSpec("seqlens_k", "int32", ("batch",)),
            TensorSpec("total_sequence_length", "int32", ()),
            TensorSpec("context_lengths", "int64", ("batch",)),
            *_kv("past_context", config, "capacity", dtype),
        ),
        outputs=(*outputs, *_kv("present_context", config, "capacity", dtype)),
    )


def draft_greedy_fused_spec(config: DrafterConfig, placement: Placement, dtype: str) -> GraphSpec:
    """`drafter_draft_greedy_fused.onnx`: the fused backbone and the greedy heads in one graph."""
    backbone, heads = backbone_fused_spec(config, placement, dtype), head_greedy_spec(config, placement, dtype)
    return GraphSpec(
        DRAFT_GREEDY_FUSED,
        inputs=(*backbone.inputs, *(t for t in heads.inputs if t.name == "anchor_ids")),
        outputs=(*(t for t in heads.outputs if t.name != "logits"),
                 *(t for t in backbone.outputs if t.name.startswith("present_context"))),
    )


def has_head_graphs(config: DrafterConfig) -> bool:
    """DFlash drafters (no Markov, no confidence head) draft straight from the base logits."""
    return config.has_markov_head or config.enable_confidence_head


def head_step_spec(config: DrafterConfig, placement: Placement, dtype: str) -> GraphSpec:
    c = config
    inputs = [TensorSpec("hidden", dtype, ("batch", c.hidden_size))]
    if placement.lm_head_in_backbone:
        inputs.append(TensorSpec("base_logits", dtype, ("batch", c.vocab_size)))
    inputs.append(TensorSpec("prev_ids", "int64", ("batch",)))
    outputs = [TensorSpec("logits", dtype, ("batch", c.vocab_size))]
    if c.enable_confidence_head:
        outputs.append(TensorSpec("confidence_logit", dtype, ("batch",)))
    if c.markov_head_type == "rnn" and c.has_markov_head:
        inputs.append(TensorSpec("state", dtype, ("batch", c.markov_rank)))
        outputs.append(TensorSpec("next_state", dtype, ("batch", c.markov_rank)))
    return GraphSpec(HEAD_STEP, inputs=tuple(inputs), outputs=tuple(outputs))


def head_greedy_spec(config: DrafterConfig, placement: Placement, dtype: str) -> GraphSpec:
    c = config
    block = c.block_size
    inputs = [TensorSpec("block_hidden", dtype, ("batch", block, c.hidden_size))]
    if placement.lm_head_in_backbone:
        inputs.append(TensorSpec("base_logits", dtype, ("batch", block, c.vocab_size)))
    inputs.append(TensorSpec("anchor_ids", "int64", ("batch",)))
    outputs = [
        TensorSpec("logits", dtype, ("batch", block, c.vocab_size)),
        TensorSpec("draft_ids", "int64", ("batch", block)),
    ]
    if c.enable_confidence_head:
        outputs.append(TensorSpec("confidence_logits", dtype, ("batch", block)))
    return GraphSpec(HEAD_GREEDY, inputs=tuple(inputs), outputs=tuple(outputs))
