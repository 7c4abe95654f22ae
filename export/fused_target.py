"""The ONNX Runtime fused-op flavour of the target graph (`target_fused.onnx`), built from weights.

No tracing: the graph is written node by node from a `TargetModel`'s parameters with
`onnx.helper`, in the shape ONNX Runtime's transformer kernels want:

    embeddings = Gather(embed_tokens, input_ids)                          feature -1
    layer 0 input norm: SimplifiedLayerNormalization(embeddings)
    per layer i:
        qkv   = MatMul(h, [Wq | Wk | Wv]) (+ packed bias)                   one packed projection
        q, k  = per-head SimplifiedLayerNormalization (Qwen3 q_norm/k_norm; Llama passes qkv packed)
        attn  = com.microsoft.GroupQueryAttention(q, k, v, past k/v, seqlens_k, total_sequence_length,
                                                  cos_cache, sin_cache, query_seqlens; do_rotary=1)
        h2, r = SkipSimplifiedLayerNormalization(x, MatMul(attn, Wo))      post-attention norm, r = x + attn
        mlp   = MatMul(Sigmoid(g) * g * up, Wdown), g = MatMul(h2, Wgate), up = MatMul(h2, Wup)
        h, x  = SkipSimplifiedLayerNormalization(r, mlp)                   next input norm (or the final
                                                                           norm), x = layer i's raw output
    logits = MatMul(GatherND(final-normed x, logits_rows), lm_head^T)    only the positions asked for
    greedy_ids = ArgMax(logits, -1)                                       what greedy verification reads
    context_features = Concat(raw outputs of the chosen layers, -1 = embeddings)

Feeding (see `contract.target_fused_spec`): per row b with `past_b` committed positions and
`tokens` new ones, `seqlens_k[b] = past_b + tokens - 1` and `total_sequence_length = max_b(past_b)
+ tokens`. Rotary positions come from seqlens_k (new token t of row b sits at `past_b + t`), so
there is no position_ids input. The past/present K/V of each layer are meant to be ONE buffer
`[batch, kv_heads, capacity, head_dim]` bound as both `past_key_values.{i}.*` and `present.{i}.*`:
GroupQueryAttention then writes the new keys/values in place at slots `past_b .. past_b+tokens-1`
and attends over slots `0 .. past_b+tokens-1` causally. Rolling back rejected tokens is just a
smaller `past_b` next time (the stale slots get overwritten). A row with fewer real tokens than
`tokens` is right-padded: its padding keys land after its real ones and are never read unless a
later step counts them; their outputs are ignored.

The graph computes `query_seqlens = min(seqlens_k + 1, tokens)` itself and passes it to
GroupQueryAttention: that is the operator's own default, spelled out, and it lifts ONNX Runtime's
"batch_size must be 1 when sequence_length > 1 and past context is given" restriction, so batched
k-token verification over rows with different pasts works on the CPU provider.

The tree variant (`tree=True`, `target_fused_tree.onnx`) adds `position_ids` [batch, tokens] and a
bool `attention_mask` [batch, 1, tokens, total_sequence_length] over absolute cache slots (True =
may attend), turned into GroupQueryAttention's `attention_bias` (0 / the dtype's lowest value). The
operator's causal rule still applies on top: new token t of row b sees at most slots
`0 .. past_b + t`, so the mask can only hide, never reveal. A flattened draft tree (nodes in
topological order, each seeing the past and its ancestors, positions past + depth) and hidden past
slots are both such masks. Its keys/values land at slots past_b + t in flattened order: after
verification the runtime moves the accepted path's slots down to past_b, past_b + 1, ... (their
rotary positions, past_b + depth, are already those of the compacted slots).

What GroupQueryAttention cannot express (use the plain `target.onnx` for these):
- the chain graph has no mask: row b's visible keys are exactly its first `past_b` slots plus the
  new tokens causally (no trees, no hidden slots: use the tree variant);
- masks that reveal a later slot to an earlier token (GroupQueryAttention is causal: `causal=0`
  refuses `query_seqlens`, and without it the CPU kernel refuses batch > 1 with a past and more
  than one new token);
- head_dim not a multiple of 16 (the CPU kernel refuses it), positions >= the cos/sin cache rows
  (`max_positions`, default `max_position_embeddings`), and RoPE other than the default;
- bfloat16 on the CPU provider (no CPU kernel; CUDA has one).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper

from dspark.models import TargetModel

from . import contract as C
from .lower import TWO_GB, ExportError
from .onnx_builder import (
    ELEM,
    HEAD_DIM_MULTIPLE,
    MS_DOMAIN,
    TORCH_DTYPES,
    GraphBuilder,
    head_norm,
    linear,
    save_graph,
    value_info,
)


def check_fusable(model: TargetModel, dtype: str) -> None:
    """Raise ExportError when the fused flavour cannot represent this target."""
    c = model.config
    if dtype not in TORCH_DTYPES:
        raise ExportError(f"fused target: dtype {dtype!r} is not one of {tuple(TORCH_DTYPES)}")
    if not c.uniform_attention or c.sandwich_norm or c.final_logit_softcapping is not None:
        raise ExportError(
            f"fused target: a '{c.model_type}' target (sliding-window and global layers, K = V, sandwich norms, "
            "soft-capped logits) is not representable with GroupQueryAttention and SkipSimplifiedLayerNormalization "
            "as built here; use the plain target graphs"
        )
    if c.head_dim % HEAD_DIM_MULTIPLE:
        raise ExportError(
            f"fused target: head_dim {c.head_dim} is not a multiple of {HEAD_DIM_MULTIPLE} "
            "(ONNX Runtime's GroupQueryAttention refuses it); use the plain target graph"
        )


def build_fused_target(model: TargetModel, dtype: str = "float32", *, opset: int = 17,
                       max_positions: int | None = None, tree: bool = False, packed: bool = False) -> onnx.ModelProto:
    """The fused target graph of `model` (I/O: `contract.target_fused_spec`), weights cast to `dtype`.

    `max_positions` is the number of rows of the rotary cos/sin caches, i.e. one more than the
    largest position the graph can be fed (default: the config's `max_position_embeddings`).
    `tree=True` builds `target_fused_tree` (see `contract.target_fused_spec`): explicit position ids
    and a bool mask over absolute cache slots, for flattened draft trees. `packed=True` builds
    `target_fused_packed`: the chain graph over the real tokens only (`Packing`).
    """
    check_fusable(model, dtype)
    if tree and packed:
        raise ExportError("fused target: the tree variant takes its nodes padded; build it without packed=True")
    c = model.config
    spec = C.target_fused_spec(c, len(model.context_layer_ids) * c.hidden_size, dtype, tree=tree, packed=packed)
    nh, kvh, hd, eps = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps
    b = GraphBuilder(dtype)
    norm_attrs = {"epsilon": eps, "axis": -1, "stash_type": 1}

    # Rotary tables: the model's own RotaryEmbedding at positions 0..max-1, first half of each row.
    positions = torch.arange(max_positions or c.max_position_embeddings)[None]
    with torch.no_grad():
        cos, sin = model.rotary(positions, torch.float32)  # [1, 1, P, hd]
    cos_cache = b.weight("cos_cache", cos[0, 0, :, : hd // 2])
    sin_cache = b.weight("sin_cache", sin[0, 0, :, : hd // 2])
    if c.qk_norm:
        head_shape = b.const("shape/heads", [0, -1, hd])
        q_shape = b.const("shape/q", [0, -1, nh * hd])
        k_shape = b.const("shape/k", [0, -1, kvh * hd])
        qkv_split = b.const("split/qkv", [nh * hd, kvh * hd, kvh * hd])

    # query_seqlens = min(seqlens_k + 1, tokens): GQA's default made explicit (allows batch > 1 with a past).
    # Shape + Slice, not Shape(start, end): those attributes need opset 15 and the export may use 14.
    (shape,) = b.op("Shape", ["input_ids"], "query_seqlens/Shape")
    (tokens,) = b.op("Slice", [shape, b.const("one", [1]), b.const("two", [2])], "query_seqlens/Slice")
    (tokens32,) = b.op("Cast", [tokens], "query_seqlens/Cast", to=TensorProto.INT32)
    (totals,) = b.op("Add", ["seqlens_k", b.const("one_i32", [1], np.int32)], "query_seqlens/Add")
    (query_seqlens,) = b.op("Min", [totals, tokens32], "query_seqlens/Min")
    tree_inputs = ["", ""]
    if tree:  # bool mask -> additive bias (0 where visible, the dtype's lowest value where hidden)
        hidden = b.weight("attention_bias/hidden", torch.tensor(torch.finfo(TORCH_DTYPES[dtype]).min))
        (bias,) = b.op("Where", ["attention_mask", b.weight("attention_bias/visible", torch.tensor(0.0)), hidden],
                       "attention_bias/Where")
        tree_inputs = ["position_ids", bias]

    packing = Packing(b) if packed else None
    with torch.no_grad():
        ids = "input_ids" if packing is None else packing.ids()
        (x,) = b.op("Gather", [b.weight("embed_tokens.weight", model.embed_tokens.weight), ids],
                    "embed_tokens/Gather")
        features = {-1: x}
        (h,) = b.op("SimplifiedLayerNormalization", [x, b.weight("layers.0.input_layernorm.weight",
                    model.layers[0].input_layernorm.weight)], "layers.0/input_layernorm", **norm_attrs)
        for i, layer in enumerate(model.layers):
            p, a = f"layers.{i}", layer.self_attn
            qkv = linear(b, h, [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight],
                          [a.q_proj.bias, a.k_proj.bias, a.v_proj.bias], f"{p}/qkv_proj")
            if packing is not None:
                qkv = packing.unpack(qkv, (nh + 2 * kvh) * hd, f"{p}/qkv_unpack")
            if c.qk_norm:
                q, k, v = b.op("Split", [qkv, qkv_split], f"{p}/qkv_split", outputs=3, axis=-1)
                q = head_norm(b, q, head_shape, q_shape, a.q_norm.weight, f"{p}/q_norm", norm_attrs)
                k = head_norm(b, k, head_shape, k_shape, a.k_norm.weight, f"{p}/k_norm", norm_attrs)
            else:
                q, k, v = qkv, "", ""  # packed QKV straight into GQA
            (attn, *_) = b.op(
                "GroupQueryAttention",
                [q, k, v, f"past_key_values.{i}.key", f"past_key_values.{i}.value", "seqlens_k",
                 "total_sequence_length", cos_cache, sin_cache, *tree_inputs, "", "", "", "", "", query_seqlens],
                f"{p}/GroupQueryAttention",
                outputs=[f"{p}/attn", f"present.{i}.key", f"present.{i}.value"],
                domain=MS_DOMAIN, num_heads=nh, kv_num_heads=kvh, scale=hd**-0.5, do_rotary=1,
                rotary_interleaved=0, local_window_size=-1,
            )
            if packing is not None:
                attn = packing.pack(attn, nh * hd, f"{p}/attn_pack")
            o = linear(b, attn, [a.o_proj.weight], [a.o_proj.bias], f"{p}/o_proj")
            h2, _, _, r = b.op("SkipSimplifiedLayerNormalization",
                               [x, o, b.weight(f"{p}.post_attention_layernorm.weight",
                                               layer.post_attention_layernorm.weight)],
                               f"{p}/post_attention_layernorm", outputs=[f"{p}/h2", "", "", f"{p}/residual"],
                               domain=MS_DOMAIN, epsilon=eps)
            mlp = layer.mlp
            (gate,) = b.op("MatMul", [h2, b.weight(f"{p}.mlp.gate_proj.weight", mlp.gate_proj.weight.T)],
                           f"{p}/mlp/gate_proj")
            (up,) = b.op("MatMul", [h2, b.weight(f"{p}.mlp.up_proj.weight", mlp.up_proj.weight.T)],
                         f"{p}/mlp/up_proj")
            (sig,) = b.op("Sigmoid", [gate], f"{p}/mlp/act/Sigmoid")
            (silu,) = b.op("Mul", [gate, sig], f"{p}/mlp/act/Mul")
            (prod,) = b.op("Mul", [silu, up], f"{p}/mlp/Mul")
            (down,) = b.op("MatMul", [prod, b.weight(f"{p}.mlp.down_proj.weight", mlp.down_proj.weight.T)],
                           f"{p}/mlp/down_proj")
            last = i == c.num_hidden_layers - 1
            norm, name = (model.norm, "norm") if last else (model.layers[i + 1].input_layernorm,
                                                             f"layers.{i + 1}.input_layernorm")
            h, _, _, x = b.op("SkipSimplifiedLayerNormalization",
                              [r, down, b.weight(f"{name}.weight", norm.weight)], name.replace(".input", "/input"),
                              outputs=[f"{name}/out", "", "", f"layers.{i}/output"], domain=MS_DOMAIN, epsilon=eps)
            features[i] = x
        if packing is not None:  # the positions logits are asked for: [1, T, H] -> [1, N, H]
            (h,) = b.op("Gather", [h, "logits_index"], "logits_index/Gather", axis=1)
        elif not tree:  # the positions logits are asked for: [B, T, H] -> [B, k, H]
            (rows,) = b.op("Unsqueeze", ["logits_rows", b.const("axes/last", [-1])], "logits_rows/Unsqueeze")
            (h,) = b.op("GatherND", [h, rows], "logits_rows/GatherND", batch_dims=1)
        b.op("MatMul", [h, b.weight("lm_head.weight", model.lm_head.weight.T)], "lm_head", outputs=["logits"])
        # greedy verification reads [batch, tokens] ids, not [batch, tokens, V] logits (first maximum, as
        # numpy and torch pick it)
        b.op("ArgMax", ["logits"], "greedy/ArgMax", outputs=["greedy_ids"], axis=-1, keepdims=0, select_last_index=0)
    if packing is None:
        _context_features(b, [features[i] for i in model.context_layer_ids], x)
    else:
        _context_features(b, [features[i] for i in model.context_layer_ids], x, "context_features/packed")
        packing.unpack("context_features/packed", spec.outputs[1].dims[2], "context_features/unpack",
                       out="context_features")

    graph = helper.make_graph(
        b.nodes, spec.name, [value_info(t) for t in spec.inputs], [value_info(t) for t in spec.outputs],
        b.initializers,
    )
    return helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(MS_DOMAIN, 1)],
        producer_name="dspark.export.fused_target",
    )


def _context_features(b: GraphBuilder, parts: list[str], any_hidden: str, out: str = "context_features") -> None:
    if len(parts) > 1:
        b.op("Concat", parts, "context_features/Concat", outputs=[out], axis=-1)
    elif parts:
        b.op("Identity", parts, "context_features/Identity", outputs=[out])
    else:  # no context layers: [B, T, 0]
        zero, axis = b.const("context_features/zero", [0]), b.const("context_features/axis", [2])
        b.op("Slice", [any_hidden, zero, zero, axis], "context_features/Slice", outputs=[out])


class Packing:
    """The packed graph's two moves between [B, W, D] rows and the [1, T, D] real tokens (`token_index`,
    flat row-major indices of the real tokens): the projections, norms and MLPs run on the T tokens, and
    GroupQueryAttention, the logits' row selection and the context features on [B, W, D] rows (padding
    rows zero). A step that verifies ℓ_r drafts on row r computes Σ(1 + ℓ_r) tokens, not B·(1 + max ℓ)
    (the paper's §5.3)."""

    def __init__(self, b: GraphBuilder) -> None:
        self.b = b
        (self.grid,) = b.op("Shape", ["input_ids"], "packing/grid")  # [B, W]
        (self.flat,) = b.op("ReduceProd", [self.grid], "packing/flat", keepdims=1)  # [B·W]
        (self.index,) = b.op("Unsqueeze", ["token_index", b.const("packing/axes_last", [-1])], "packing/index")
        self.front = b.const("packing/axes_front", [0])

    def ids(self) -> str:
        """input_ids [B, W] -> the real tokens' ids [1, T]."""
        b = self.b
        (flat,) = b.op("Reshape", ["input_ids", b.const("packing/shape_flat", [-1])], "packing/ids_flat")
        (ids,) = b.op("Gather", [flat, "token_index"], "packing/ids_gather")
        (ids,) = b.op("Unsqueeze", [ids, self.front], "packing/ids")
        return ids

    def pack(self, x: str, width: int, name: str) -> str:
        """[B, W, width] -> [1, T, width]."""
        b = self.b
        (flat,) = b.op("Reshape", [x, b.const(f"{name}/shape", [-1, width])], f"{name}/Reshape")
        (y,) = b.op("Gather", [flat, "token_index"], f"{name}/Gather")
        (y,) = b.op("Unsqueeze", [y, self.front], f"{name}/Unsqueeze")
        return y

    def unpack(self, x: str, width: int, name: str, out: str | None = None) -> str:
        """[1, T, width] -> [B, W, width], padding rows zero."""
        b = self.b
        width_dims = b.const(f"{name}/width", [width])
        (tokens,) = b.op("Reshape", [x, b.const(f"{name}/shape", [-1, width])], f"{name}/Reshape")
        (shape,) = b.op("Concat", [self.flat, width_dims], f"{name}/shape_flat", axis=0)
        zero = helper.make_tensor("value", ELEM[self.b.dtype], [1], [0.0])
        (zeros,) = b.op("ConstantOfShape", [shape], f"{name}/zeros", value=zero)
        (rows,) = b.op("ScatterND", [zeros, self.index, tokens], f"{name}/ScatterND")
        (grid,) = b.op("Concat", [self.grid, width_dims], f"{name}/shape_grid", axis=0)
        (y,) = b.op("Reshape", [rows, grid], f"{name}/Reshape_out", outputs=[out or f"{name}/out"])
        return y


def export_fused_target(model: TargetModel, out_dir: str | Path, dtype: str = "float32", *, opset: int = 17,
                        external_data_threshold: int = TWO_GB, max_positions: int | None = None,
                        tree: bool = False, packed: bool = False) -> list[Path]:
    """Build and write the fused target graph of `model` into `out_dir`; returns the written files."""
    graph = build_fused_target(model, dtype, opset=opset, max_positions=max_positions, tree=tree, packed=packed)
    return save_graph(graph, Path(out_dir), external_data_threshold=external_data_threshold)
