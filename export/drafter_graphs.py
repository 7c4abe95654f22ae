"""Flat-I/O wrappers around `DSparkDrafter` for export: backbone, one head step, greedy block.

All three call the drafter's own methods (`forward_backbone`, `base_logits`, `head_step`), so
the exported maths is exactly the PyTorch model's.
"""

from __future__ import annotations

import torch
from torch import nn

from dspark.models import DSparkDrafter

from .contract import Placement


class BackboneGraph(nn.Module):
    """(block_ids, block_position_ids, context_features, context_position_ids, attention_mask,
    *past_context k/v) -> (block_hidden, [base_logits], *present_context k/v)."""

    def __init__(self, drafter: DSparkDrafter, placement: Placement) -> None:
        super().__init__()
        self.drafter = drafter
        self.lm_head_in_backbone = placement.lm_head_in_backbone

    def forward(
        self,
        block_ids: torch.Tensor,  # [B, γ] int64
        block_position_ids: torch.Tensor,  # [B, γ] int64
        context_features: torch.Tensor,  # [B, Tc, F]
        context_position_ids: torch.Tensor,  # [B, Tc] int64
        attention_mask: torch.Tensor,  # [B, 1, γ, Pc+Tc+γ] bool
        *past_context: torch.Tensor,  # per draft layer key, value [B, kvh, Pc, hd]
    ) -> tuple[torch.Tensor, ...]:
        out = self.drafter.forward_backbone(
            block_ids=block_ids,
            block_position_ids=block_position_ids,
            context_features=context_features,
            context_position_ids=context_position_ids,
            past_context=list(zip(past_context[0::2], past_context[1::2], strict=True)),
            attention_mask=attention_mask,
        )
        heads = (self.drafter.base_logits(out.hidden),) if self.lm_head_in_backbone else ()
        return (out.hidden, *heads, *(t for kv in out.present_context for t in kv))


class _HeadGraph(nn.Module):
    def __init__(self, drafter: DSparkDrafter, placement: Placement) -> None:
        super().__init__()
        self.drafter = drafter
        self.lm_head_in_backbone = placement.lm_head_in_backbone
        c = drafter.config
        self.has_state = c.has_markov_head and c.markov_head_type == "rnn"
        self.has_confidence = c.enable_confidence_head


class HeadStepGraph(_HeadGraph):
    """(hidden, [base_logits], prev_ids, [state]) -> (logits, [confidence_logit], [next_state]).

    Feeds follow `contract.head_step_spec`: base_logits only when the LM head runs in the
    backbone, state only for the RNN head (zeros before slot 0).
    """

    def forward(self, hidden: torch.Tensor, *rest: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # hidden [N, H]; rest = ([base_logits [N, V]], prev_ids [N], [state [N, r]])
        rest_list = list(rest)
        base = rest_list.pop(0) if self.lm_head_in_backbone else self.drafter.base_logits(hidden)
        prev_ids = rest_list.pop(0)
        state = rest_list.pop(0) if self.has_state else None
        logits, confidence, state = self.drafter.head_step(
            hidden=hidden, base_logits=base, prev_ids=prev_ids, state=state
        )
        outputs = [logits]
        if self.has_confidence:
            outputs.append(confidence)
        if self.has_state:
            outputs.append(state)
        return tuple(outputs)


class HeadGreedyGraph(_HeadGraph):
    """(block_hidden, [base_logits], anchor_ids) -> (logits, draft_ids, [confidence_logits]) at
    temperature 0: slot k's argmax (first maximum, as torch and ONNX ArgMax agree) is the previous
    token of slot k+1. The confidences need no slot's order once the tokens are known: one batched call after
    the loop (slot by slot they were 5 graph nodes a slot, 35 of the joined drafting graph's 179)."""

    def forward(self, block_hidden: torch.Tensor, *rest: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # block_hidden [B, γ, H]; rest = ([base_logits [B, γ, V]], anchor_ids [B])
        base = rest[0] if self.lm_head_in_backbone else self.drafter.base_logits(block_hidden)
        anchor_ids = prev_ids = rest[-1]
        state = self.drafter.initial_head_state(block_hidden[:, 0])
        logits, tokens = [], []
        for k in range(self.drafter.config.block_size):
            step_logits, _, state = self.drafter.head_step(
                hidden=block_hidden[:, k], base_logits=base[:, k], prev_ids=prev_ids, state=state, confidence=False
            )
            prev_ids = torch.argmax(step_logits, dim=-1)
            logits.append(step_logits)
            tokens.append(prev_ids)
        draft_ids = torch.stack(tokens, dim=1)
        outputs = [torch.stack(logits, dim=1), draft_ids]
        if self.has_confidence:
            previous = torch.cat((anchor_ids[:, None], draft_ids[:, :-1]), dim=1)  # [B, γ] each slot's previous token
            outputs.append(self.drafter.block_confidence(block_hidden, previous))
        return tuple(outputs)
