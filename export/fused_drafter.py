"""The ONNX Runtime fused-op flavour of the drafter backbone (`drafter_backbone_fused.onnx`), built from weights.

Why: the plain backbone is ~120 nodes for one draft layer and its context cache grows as concatenated
past/present tensors, so every call binds new arrays and copies the cache; on the demo pair the call's
host glue cost about what the graph did. Here the projected context keys/values go into one bound
buffer per layer through GroupQueryAttention (in place, rotary inside), as the fused target's do, and
the runtime binds a call once per (rows, new context rows).

    ctx      = SimplifiedLayerNormalization(MatMul(context_features, fc))             hidden_norm(fc(·))
    x        = Gather(embed_tokens, block_ids)
    per layer i:
        k, v = MatMul(ctx, [Wk | Wv]) -> Split; k per-head normed
        GroupQueryAttention(q = k (kv_heads query heads), k, v, past/present buffer, seqlens_k, total,
                            cos, sin; do_rotary=1): writes rotated k and v at slots cached_b + t; its
                            attention output is not used (context rows have no queries)
        h    = input norm of x (the previous layer's SkipSimplifiedLayerNormalization)
        q, bk, bv = MatMul(h, [Wq | Wk | Wv]) -> Split; q, bk per-head normed; RotaryEmbedding at
                            block_position_ids
        K, V = Concat(buffer[:, :, :total], block keys/values)
        attn = Softmax(q·Kᵀ·scale + bias), bias = 0 where column < context_lengths[b] or column >= total
               (the block, bidirectional), the dtype's lowest value elsewhere; then ·V
        x    = x + o_proj(attn), then the MLP as the target's (SkipSimplifiedLayerNormalization twice)
    block_hidden = the final norm; base_logits = MatMul(block_hidden, lm_headᵀ) when it runs here

Equal to `DSparkDrafter.forward_backbone` where the plain graph's mask is DeepSpec's (each row sees its own
cached and new context rows and the whole block). What it cannot express (the plain graph stays for these):
families `fused_target.check_fusable` refuses (sliding-window layers, K = V, sandwich norms, soft-capped
logits), head_dim not a multiple of 16, embedding scales, and masks other than that one.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper

from dspark.models import DSparkDrafter

from . import contract as C
from .contract import Placement
from .lower import TWO_GB, ExportError
from .onnx_builder import (
    HEAD_DIM_MULTIPLE,
    MS_DOMAIN,
    TORCH_DTYPES,
    GraphBuilder,
    head_norm,
    linear,
    save_graph,
    value_info,
)


def check_fusable_drafter(drafter: DSparkDrafter, dtype: str) -> None:
    """Raise ExportError when the fused backbone cannot represent this drafter."""
    c = drafter.config
    if dtype not in TORCH_DTYPES:
        raise ExportError(f"fused drafter backbone: dtype {dtype!r} is not one of {tuple(TORCH_DTYPES)}")
    if (not c.uniform_attention or c.sandwich_norm or c.final_logit_softcapping is not None
            or c.embedding_scale != 1.0 or c.value_norm):
        raise ExportError("fused drafter backbone: a drafter with sliding-window or K = V layers, "
                          "sandwich or value norms, soft-capped logits, scaled embeddings) is not representable "
                          "as built here; use the plain backbone")
    if c.head_dim % HEAD_DIM_MULTIPLE:
        raise ExportError(f"fused drafter backbone: head_dim {c.head_dim} is not a multiple of {HEAD_DIM_MULTIPLE} "
                          "(ONNX Runtime's GroupQueryAttention refuses it); use the plain backbone")


def build_fused_backbone(drafter: DSparkDrafter, placement: Placement, dtype: str = "float32", *, opset: int = 17,
                         max_positions: int) -> onnx.ModelProto:
    """The fused backbone graph of `drafter` (I/O: `contract.backbone_fused_spec`), weights cast to `dtype`.
    `max_positions`: rows of the rotary cos/sin caches (the target's `max_position_embeddings`)."""
    check_fusable_drafter(drafter, dtype)
    c = drafter.config
    spec = C.backbone_fused_spec(c, placement, dtype)
    nh, kvh, hd, eps, gamma = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps, c.block_size
    groups = nh // kvh
    b = GraphBuilder(dtype)
    norm_attrs = {"epsilon": eps, "axis": -1, "stash_type": 1}

    positions = torch.arange(max_positions)[None]
    with torch.no_grad():
        cos, sin = drafter.rotary(positions, torch.float32)  # [1, 1, P, hd]
    cos_cache = b.weight("cos_cache", cos[0, 0, :, : hd // 2])
    sin_cache = b.weight("sin_cache", sin[0, 0, :, : hd // 2])
    head_shape, q_shape, k_shape = (b.const("shape/heads", [0, -1, hd]), b.const("shape/q", [0, -1, nh * hd]),
                                    b.const("shape/k", [0, -1, kvh * hd]))
    kv_split, qkv_split = b.const("split/kv", [kvh * hd, kvh * hd]), b.const("split/qkv", [nh * hd, kvh * hd, kvh * hd])
    block_heads = b.const("shape/block_heads", [0, gamma, kvh, hd])
    q_groups = b.const("shape/q_groups", [0, gamma, kvh, groups, hd])
    attn_shape = b.const("shape/attn", [0, gamma, nh * hd])
    one = b.const("one", [1])

    # GroupQueryAttention's query_seqlens = min(seqlens_k + 1, context_tokens), as the fused target passes it
    (shape,) = b.op("Shape", ["context_features"], "query_seqlens/Shape")
    (tokens,) = b.op("Slice", [shape, one, b.const("two", [2])], "query_seqlens/Slice")
    (tokens32,) = b.op("Cast", [tokens], "query_seqlens/Cast", to=TensorProto.INT32)
    (totals,) = b.op("Add", ["seqlens_k", b.const("one_i32", [1], np.int32)], "query_seqlens/Add")
    (query_seqlens,) = b.op("Min", [totals, tokens32], "query_seqlens/Min")

    # the additive mask [batch, 1, 1, 1, total + γ]: a row's own context slots, then the whole block
    (total,) = b.op("Cast", ["total_sequence_length"], "mask/total", to=TensorProto.INT64)
    (total_1d,) = b.op("Reshape", [total, one], "mask/total_1d")
    (width,) = b.op("Add", [total, b.const("gamma", gamma)], "mask/width")
    (cols,) = b.op("Range", [b.const("zero", 0), width, b.const("step", 1)], "mask/cols")
    (lengths,) = b.op("Unsqueeze", ["context_lengths", b.const("axes/last", [-1])], "mask/lengths")
    (own,) = b.op("Less", [cols, lengths], "mask/own")  # [batch, total + γ]
    (block,) = b.op("GreaterOrEqual", [cols, total], "mask/block")
    (visible,) = b.op("Or", [own, block], "mask/visible")
    lowest = b.weight("mask/hidden", torch.tensor(torch.finfo(TORCH_DTYPES[dtype]).min))
    (bias,) = b.op("Where", [visible, b.weight("mask/shown", torch.tensor(0.0)), lowest], "mask/Where")
    (bias,) = b.op("Unsqueeze", [bias, b.const("axes/mask", [1, 2, 3])], "mask/bias")

    with torch.no_grad():
        (ctx,) = b.op("MatMul", ["context_features", b.weight("fc.weight", drafter.fc.weight.T)], "fc")
        (ctx,) = b.op("SimplifiedLayerNormalization", [ctx, b.weight("hidden_norm.weight", drafter.hidden_norm.weight)],
                      "hidden_norm", **norm_attrs)
        (x,) = b.op("Gather", [b.weight("embed_tokens.weight", drafter.embed_tokens.weight), "block_ids"],
                    "embed_tokens/Gather")
        (h,) = b.op("SimplifiedLayerNormalization", [x, b.weight("layers.0.input_layernorm.weight",
                    drafter.layers[0].input_layernorm.weight)], "layers.0/input_layernorm", **norm_attrs)
        for i, layer in enumerate(drafter.layers):
            p, a = f"layers.{i}", layer.self_attn
            key, value = f"present_context.{i}.key", f"present_context.{i}.value"
            # the new context rows' keys/values, written in place (rotated) by GroupQueryAttention
            kv = linear(b, ctx, [a.k_proj.weight, a.v_proj.weight], [a.k_proj.bias, a.v_proj.bias], f"{p}/ctx_kv")
            ck, cv = b.op("Split", [kv, kv_split], f"{p}/ctx_kv_split", outputs=2, axis=-1)
            if c.qk_norm:
                ck = head_norm(b, ck, head_shape, k_shape, a.k_norm.weight, f"{p}/ctx_k_norm", norm_attrs)
            b.op("GroupQueryAttention",  # queries: the keys themselves, one head each (the output is not used)
                 [ck, ck, cv, f"past_context.{i}.key", f"past_context.{i}.value", "seqlens_k", "total_sequence_length",
                  cos_cache, sin_cache, "", "", "", "", "", "", "", query_seqlens],
                 f"{p}/ctx_append", outputs=[f"{p}/ctx_unused", key, value], domain=MS_DOMAIN, num_heads=kvh,
                 kv_num_heads=kvh, scale=hd**-0.5, do_rotary=1, rotary_interleaved=0, local_window_size=-1)
            # the block's queries, keys and values
            qkv = linear(b, h, [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight],
                         [a.q_proj.bias, a.k_proj.bias, a.v_proj.bias], f"{p}/qkv_proj")
            q, bk, bv = b.op("Split", [qkv, qkv_split], f"{p}/qkv_split", outputs=3, axis=-1)
            if c.qk_norm:
                q = head_norm(b, q, head_shape, q_shape, a.q_norm.weight, f"{p}/q_norm", norm_attrs)
                bk = head_norm(b, bk, head_shape, k_shape, a.k_norm.weight, f"{p}/k_norm", norm_attrs)
            rotary = {"domain": MS_DOMAIN, "interleaved": 0}
            (q,) = b.op("RotaryEmbedding", [q, "block_position_ids", cos_cache, sin_cache], f"{p}/q_rotary",
                        num_heads=nh, **rotary)
            (bk,) = b.op("RotaryEmbedding", [bk, "block_position_ids", cos_cache, sin_cache], f"{p}/k_rotary",
                         num_heads=kvh, **rotary)
            keys = _keys_with_block(b, key, bk, total_1d, block_heads, f"{p}/keys")  # [B, kvh, total + γ, hd]
            values = _keys_with_block(b, value, bv, total_1d, block_heads, f"{p}/values")
            # q [B, γ, nh·hd] -> [B, kvh, g, γ, hd]: query head h uses kv head h // g (models.layers.attend)
            (q,) = b.op("Reshape", [q, q_groups], f"{p}/q_groups")
            (q,) = b.op("Transpose", [q], f"{p}/q_transpose", perm=[0, 2, 3, 1, 4])
            (kt,) = b.op("Transpose", [keys], f"{p}/k_transpose", perm=[0, 1, 3, 2])
            (kt,) = b.op("Unsqueeze", [kt, b.const(f"{p}/axes/group", [2])], f"{p}/k_groups")
            (scores,) = b.op("MatMul", [q, kt], f"{p}/scores")  # [B, kvh, g, γ, total + γ]
            (scores,) = b.op("Mul", [scores, b.weight(f"{p}/scale", torch.tensor(a.scale))], f"{p}/scaled")
            (scores,) = b.op("Add", [scores, bias], f"{p}/masked")
            (probs,) = b.op("Softmax", [scores], f"{p}/softmax", axis=-1)
            (vg,) = b.op("Unsqueeze", [values, b.const(f"{p}/axes/value_group", [2])], f"{p}/v_groups")
            (attn,) = b.op("MatMul", [probs, vg], f"{p}/attend")  # [B, kvh, g, γ, hd]
            (attn,) = b.op("Transpose", [attn], f"{p}/attn_transpose", perm=[0, 3, 1, 2, 4])
            (attn,) = b.op("Reshape", [attn, attn_shape], f"{p}/attn_heads")
            o = linear(b, attn, [a.o_proj.weight], [a.o_proj.bias], f"{p}/o_proj")
            h, x = _residual_mlp(b, drafter, i, x, o, eps)
        b.op("Identity", [h], "block_hidden", outputs=["block_hidden"])
        if placement.lm_head_in_backbone:
            b.op("MatMul", ["block_hidden", b.weight("lm_head.weight", drafter.lm_head.weight.T)], "lm_head",
                 outputs=["base_logits"])

    graph = helper.make_graph(b.nodes, spec.name, [value_info(t) for t in spec.inputs],
                              [value_info(t) for t in spec.outputs], b.initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(MS_DOMAIN, 1)],
                             producer_name="dspark.export.fused_drafter")


def _keys_with_block(b: GraphBuilder, buffer: str, block: str, total: str, block_heads: str, name: str) -> str:
    """Concat(buffer[:, :, :total], block [B, γ, kvh·hd] as [B, kvh, γ, hd]) along the slots."""
    (cached,) = b.op("Slice", [buffer, b.const(f"{name}/start", [0]), total, b.const(f"{name}/axis", [2])],
                     f"{name}/cached")
    (blk,) = b.op("Reshape", [block, block_heads], f"{name}/block_heads")
    (blk,) = b.op("Transpose", [blk], f"{name}/block_transpose", perm=[0, 2, 1, 3])
    (out,) = b.op("Concat", [cached, blk], f"{name}/concat", axis=2)
    return out


def _residual_mlp(b: GraphBuilder, drafter: DSparkDrafter, i: int, x: str, o: str, eps: float) -> tuple[str, str]:
    """x + o, its post-attention norm, the MLP and the next norm (the next layer's input norm, or the final
    norm): -> (normed output, raw output)."""
    layer, p = drafter.layers[i], f"layers.{i}"
    h2, _, _, r = b.op("SkipSimplifiedLayerNormalization",
                       [x, o, b.weight(f"{p}.post_attention_layernorm.weight", layer.post_attention_layernorm.weight)],
                       f"{p}/post_attention_layernorm", outputs=[f"{p}/h2", "", "", f"{p}/residual"],
                       domain=MS_DOMAIN, epsilon=eps)
    mlp = layer.mlp
    (gate,) = b.op("MatMul", [h2, b.weight(f"{p}.mlp.gate_proj.weight", mlp.gate_proj.weight.T)], f"{p}/mlp/gate_proj")
    (up,) = b.op("MatMul", [h2, b.weight(f"{p}.mlp.up_proj.weight", mlp.up_proj.weight.T)], f"{p}/mlp/up_proj")
    (sig,) = b.op("Sigmoid", [gate], f"{p}/mlp/act/Sigmoid")
    (silu,) = b.op("Mul", [gate, sig], f"{p}/mlp/act/Mul")
    (prod,) = b.op("Mul", [silu, up], f"{p}/mlp/Mul")
    (down,) = b.op("MatMul", [prod, b.weight(f"{p}.mlp.down_proj.weight", mlp.down_proj.weight.T)],
                   f"{p}/mlp/down_proj")
    last = i == len(drafter.layers) - 1
    norm, name = (drafter.norm, "norm") if last else (drafter.layers[i + 1].input_layernorm,
                                                      f"layers.{i + 1}.input_layernorm")
    h, _, _, out = b.op("SkipSimplifiedLayerNormalization", [r, down, b.weight(f"{name}.weight", norm.weight)],
                        name.replace(".input", "/input"), outputs=[f"{name}/out", "", "", f"{p}/output"],
                        domain=MS_DOMAIN, epsilon=eps)
    return h, out


def export_fused_backbone(drafter: DSparkDrafter, placement: Placement, out_dir: str | Path, dtype: str = "float32",
                          *, max_positions: int, opset: int = 17, external_data_threshold: int = TWO_GB) -> list[Path]:
    """Build and write the fused backbone graph of `drafter` into `out_dir`; returns the written files."""
    graph = build_fused_backbone(drafter, placement, dtype, opset=opset, max_positions=max_positions)
    return save_graph(graph, Path(out_dir), external_data_threshold=external_data_threshold)
