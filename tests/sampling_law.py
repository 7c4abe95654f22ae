"""Helpers for the distribution tests: exact laws enumerated from the target with an independent
softmax(logits / T), many seeded requests through one batched engine, and a pooled chi-square."""

from __future__ import annotations

import numpy as np
import torch
from conftest import random_pair
from scipy.stats import chisquare

from dspark.runtime.batch_loop import BatchEngine
from dspark.runtime.capacity import Capacity
from dspark.runtime.model_info import ModelInfo
from dspark.runtime.prefix_scheduler import SchedulerConfig
from dspark.runtime.torch_backend import TorchBackend

VOCAB = 8
PROMPT = [1, 2, 3]


def small_pair():
    """An 8-token pair with peaked distributions whose drafts are often (not always) accepted."""
    return random_pair(
        3,
        target_overrides=dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=8),
        drafter_overrides=dict(intermediate_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                               block_size=3, target_layer_ids=(-1, 0), markov_rank=2),
        scale=40.0,
    )


def softmax_at(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / T) in float64, written out here rather than taken from dspark.runtime.sampling."""
    z = logits.double() / temperature
    z = z - z.max(dim=-1, keepdim=True).values
    e = torch.exp(z)
    return e / e.sum(dim=-1, keepdim=True)


@torch.no_grad()
def exact_law_of_tokens_2_and_3(target, temperature: float, prompt: list[int] = PROMPT) -> torch.Tensor:
    """P(t2, t3 | prompt) = Σ_t1 p(t1) p(t2 | t1) p(t3 | t1, t2) under the target at `temperature`, [V, V]."""
    vocab = target.config.vocab_size

    def next_probs(prefixes: list[list[int]]) -> torch.Tensor:
        ids = torch.tensor([prompt + p for p in prefixes])
        logits = target(ids, torch.arange(ids.shape[1]).expand_as(ids)).logits[:, -1]
        return softmax_at(logits, temperature)

    p1 = next_probs([[]])[0]
    p2 = next_probs([[a] for a in range(vocab)])  # [t1, t2]
    p3 = next_probs([[a, b] for a in range(vocab) for b in range(vocab)]).view(vocab, vocab, vocab)
    return (p1[:, None, None] * p2[:, :, None] * p3).sum(dim=0)


def engine_runs(target, drafter, *, temperature: float, requests: int, drafts: int = 1,
                prompt: list[int] = PROMPT) -> tuple[torch.Tensor, int]:
    """`requests` seeded requests of 3 new tokens through one batched engine verifying `drafts` drafts
    per step -> counts of (t2, t3) [V, V] and how many requests had every draft of their first
    verification step accepted (their third token is the bonus drawn after a full block)."""
    vocab = target.config.vocab_size
    engine = BatchEngine(TorchBackend(target, drafter), ModelInfo.from_models(target, drafter),
                         capacity=Capacity(128, 128 * 16, 16), scheduler=SchedulerConfig("fixed", fixed_length=drafts))
    ids = [engine.submit(prompt, max_new_tokens=3, temperature=temperature, seed=s) for s in range(requests)]
    finished = engine.run_until_done()
    counts = torch.zeros(vocab, vocab, dtype=torch.float64)
    full = 0
    for i in ids:
        result = finished[i]
        counts[result.tokens[1], result.tokens[2]] += 1
        full += result.acceptance_lengths[0] == drafts + 1
    return counts, full


def pooled_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square p-value of `counts` against `probs`, cells expecting fewer than 5 pooled into one."""
    observed = counts.flatten().double()
    expected = probs.flatten().double() * observed.sum()
    keep = expected >= 5
    obs = torch.cat((observed[keep], observed[~keep].sum()[None]))
    exp = torch.cat((expected[keep], expected[~keep].sum()[None]))
    if float(exp[-1]) == 0.0 and float(obs[-1]) == 0.0:  # nothing to pool
        obs, exp = obs[:-1], exp[:-1]
    exp = exp * obs.sum() / exp.sum()
    return float(chisquare(obs.numpy(), np.asarray(exp.numpy())).pvalue)
