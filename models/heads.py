"""DSpark's sequential heads: the Markov transition bias and the confidence head.

Parameter names follow DeepSpec (`markov_head.markov_w1.weight` [V, r], `markov_w2.weight`
[V, r], `gate_proj`, `joint_proj`, `confidence_head.proj`). Every head works one block slot
at a time so the sampled token of slot k can condition slot k+1.
"""

from __future__ import annotations

import torch
from torch import nn

from .config import DrafterConfig


class MarkovHead(nn.Module):
    """Vanilla head: bias_k = W2 · E[x_{k-1}], a rank-r transition bias on the base logits."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.rank = config.markov_rank
        self.markov_w1 = nn.Embedding(config.vocab_size, config.markov_rank)
        self.markov_w2 = nn.Linear(config.markov_rank, config.vocab_size, bias=False)

    def initial_state(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """State carried across block slots; hidden [B, H]. None for stateless heads."""
        return None

    def step(
        self,
        hidden: torch.Tensor,  # [B, H] backbone output of this slot
        prev_embedding: torch.Tensor,  # [B, r] = E[previous token]
        state: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> logit bias [B, V], next state."""
        return self.markov_w2(prev_embedding), state


class GatedMarkovHead(MarkovHead):
    """bias_k = W2 · (σ(gate_proj[h_k; E[x_{k-1}]]) ⊙ E[x_{k-1}])."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__(config)
        self.gate_proj = nn.Linear(config.hidden_size + config.markov_rank, config.markov_rank)

    def step(self, hidden, prev_embedding, state):
        gate = torch.sigmoid(self.gate_proj(torch.cat((hidden, prev_embedding), dim=-1)))
        return self.markov_w2(gate * prev_embedding), state


class RNNMarkovHead(MarkovHead):
    """A gated recurrent state s over the block: z = joint_proj[s; E[x_{k-1}]; h_k] -> gate, cand, out."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__(config)
        r = config.markov_rank
        self.joint_proj = nn.Linear(2 * r + config.hidden_size, 3 * r)

    def initial_state(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.new_zeros(hidden.shape[0], self.rank)

    def step(self, hidden, prev_embedding, state):
        gate, cand, out = self.joint_proj(torch.cat((state, prev_embedding, hidden), dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        state = gate * state + (1 - gate) * torch.tanh(cand)
        return self.markov_w2(torch.tanh(out)), state


MARKOV_HEADS: dict[str, type[MarkovHead]] = {
    "vanilla": MarkovHead,
    "gated": GatedMarkovHead,
    "rnn": RNNMarkovHead,
}


class ConfidenceHead(nn.Module):
    """c_k = σ(proj[h_k; E[x_{k-1}]]) (or proj(h_k) alone): P(token k survives | prefix survived).

    Returns the pre-sigmoid logit, as DeepSpec does.
    """

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.with_markov = config.confidence_head_with_markov
        width = config.hidden_size + (config.markov_rank if self.with_markov else 0)
        self.proj = nn.Linear(width, 1)

    def forward(self, hidden: torch.Tensor, prev_embedding: torch.Tensor | None) -> torch.Tensor:
        """hidden [..., H], prev_embedding [..., r] -> logits [...]."""
        if self.with_markov:
            hidden = torch.cat((hidden, prev_embedding), dim=-1)
        return self.proj(hidden).squeeze(-1)
