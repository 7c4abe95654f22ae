"""The PyTorch reference backend: the `dspark.models` modules behind the named-feeds interface.

Graphs (same names and feeds as the runtime expects from exported engines):

- `target` (concat KV): input_ids, position_ids [batch, tokens] int64; attention_mask
  [batch, 1, tokens, past+tokens] bool; past_key_values.{i}.key|value [batch, kvh, past, hd]
  -> logits [batch, tokens, V], context_features [batch, tokens, F], present.{i}.key|value
  [batch, kvh, past+tokens, hd].
- `drafter`: block_ids, block_position_ids [batch, block]; context_features [batch, ctx, F];
  context_position_ids [batch, ctx]; attention_mask [batch, 1, block, past_ctx+ctx+block] bool;
  past_context.{i}.key|value [batch, kvh, past_ctx, hd] -> hidden [batch, block, H],
  base_logits [batch, block, V], present_context.{i}.key|value [batch, kvh, past_ctx+ctx, hd].
- `draft_head` (one slot of the sequential head): hidden [n, H], base_logits [n, V], prev_ids [n],
  state [n, S] (S = markov rank for the RNN head, else 0) -> logits [n, V], state [n, S], and
  confidence_logits [n] when the drafter has a confidence head.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from dspark.models import DSparkDrafter, TargetModel

from .backend import Array, Backend, GraphSpec, TensorSpec, as_torch


def head_state_size(drafter: DSparkDrafter) -> int:
    c = drafter.config
    return c.markov_rank if c.markov_head_type == "rnn" and c.has_markov_head else 0


def model_graph_specs(target: TargetModel, drafter: DSparkDrafter) -> dict[str, GraphSpec]:
    tc, dc = target.config, drafter.config
    kv = (tc.num_key_value_heads, tc.head_dim)
    dkv = (dc.num_key_value_heads, dc.head_dim)
    f32, i64 = "float32", "int64"
    target_kv_in = [TensorSpec(f"past_key_values.{i}.{kind}", f32, ("batch", *kv[:1], "past", kv[1]))
                    for i in range(tc.num_hidden_layers) for kind in ("key", "value")]
    target_kv_out = [TensorSpec(f"present.{i}.{kind}", f32, ("batch", kv[0], "total", kv[1]))
                     for i in range(tc.num_hidden_layers) for kind in ("key", "value")]
    draft_kv_in = [TensorSpec(f"past_context.{i}.{kind}", f32, ("batch", dkv[0], "past_ctx", dkv[1]))
                   for i in range(dc.num_hidden_layers) for kind in ("key", "value")]
    draft_kv_out = [TensorSpec(f"present_context.{i}.{kind}", f32, ("batch", dkv[0], "all_ctx", dkv[1]))
                    for i in range(dc.num_hidden_layers) for kind in ("key", "value")]
    state = head_state_size(drafter)
    head_out = [TensorSpec("logits", f32, ("n", dc.vocab_size)), TensorSpec("state", f32, ("n", state))]
    if drafter.confidence_head is not None:
        head_out.append(TensorSpec("confidence_logits", f32, ("n",)))
    return {
        "target": GraphSpec("target", (
            TensorSpec("input_ids", i64, ("batch", "tokens")),
            TensorSpec("position_ids", i64, ("batch", "tokens")),
            TensorSpec("attention_mask", "bool", ("batch", 1, "tokens", "total")),
            *target_kv_in,
        ), (
            TensorSpec("logits", f32, ("batch", "tokens", tc.vocab_size)),
            TensorSpec("context_features", f32, ("batch", "tokens", dc.context_feature_size)),
            *target_kv_out,
        )),
        "drafter": GraphSpec("drafter", (
            TensorSpec("block_ids", i64, ("batch", "block")),
            TensorSpec("block_position_ids", i64, ("batch", "block")),
            TensorSpec("context_features", f32, ("batch", "ctx", dc.context_feature_size)),
            TensorSpec("context_position_ids", i64, ("batch", "ctx")),
            TensorSpec("attention_mask", "bool", ("batch", 1, "block", "keys")),
            *draft_kv_in,
        ), (
            TensorSpec("hidden", f32, ("batch", "block", dc.hidden_size)),
            TensorSpec("base_logits", f32, ("batch", "block", dc.vocab_size)),
            *draft_kv_out,
        )),
        "draft_head": GraphSpec("draft_head", (
            TensorSpec("hidden", f32, ("n", dc.hidden_size)),
            TensorSpec("base_logits", f32, ("n", dc.vocab_size)),
            TensorSpec("prev_ids", i64, ("n",)),
            TensorSpec("state", f32, ("n", state)),
        ), tuple(head_out)),
    }


class TorchBackend(Backend):
    """Runs the PyTorch models; the yardstick for every other backend."""

    def __init__(self, target: TargetModel, drafter: DSparkDrafter) -> None:
        super().__init__()
        self.target = target.eval()
        self.drafter = drafter.eval()
        self._specs = model_graph_specs(target, drafter)

    @property
    def specs(self) -> dict[str, GraphSpec]:
        return self._specs

    @torch.no_grad()
    def _run(self, graph: str, feeds: Mapping[str, Array]) -> dict[str, Array]:
        f = {name: as_torch(value) for name, value in feeds.items()}
        if graph == "target":
            past = [(f[f"past_key_values.{i}.key"], f[f"past_key_values.{i}.value"])
                    for i in range(self.target.config.num_hidden_layers)]
            out = self.target(f["input_ids"], f["position_ids"], f["attention_mask"], past)
            result = {"logits": out.logits, "context_features": out.context_features}
            for i, (k, v) in enumerate(out.present):
                result[f"present.{i}.key"], result[f"present.{i}.value"] = k, v
            return result
        if graph == "drafter":
            past = [(f[f"past_context.{i}.key"], f[f"past_context.{i}.value"])
                    for i in range(self.drafter.config.num_hidden_layers)]
            out = self.drafter.forward_backbone(
                block_ids=f["block_ids"], block_position_ids=f["block_position_ids"],
                context_features=f["context_features"], context_position_ids=f["context_position_ids"],
                past_context=past, attention_mask=f["attention_mask"],
            )
            result = {"hidden": out.hidden, "base_logits": self.drafter.base_logits(out.hidden)}
            for i, (k, v) in enumerate(out.present_context):
                result[f"present_context.{i}.key"], result[f"present_context.{i}.value"] = k, v
            return result
        # draft_head
        state = f["state"] if f["state"].shape[-1] else None
        logits, confidence, state = self.drafter.head_step(
            hidden=f["hidden"], base_logits=f["base_logits"], prev_ids=f["prev_ids"], state=state
        )
        result = {"logits": logits, "state": f["state"] if state is None else state}
        if confidence is not None:
            result["confidence_logits"] = confidence
        return result
