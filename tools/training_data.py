"""Batches for the demo trainings, each a pure function of the step number.

A batch depends only on (seed, step), never on how many batches were drawn before it, so a run
resumed from a checkpoint sees exactly the batches an uninterrupted run would have seen.
Every source returns `(ids [B, n] int64, loss_mask [B, n] float32)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from dspark.tools.corpus import CorpusError, sample_windows


class Batches(Protocol):
    batch: int

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]: ...


def step_generator(seed: int, step: int) -> torch.Generator:
    """The generator that draws step `step`'s batch (and anchors) of a run seeded `seed`."""
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


@dataclass(frozen=True)
class RandomWindows:
    """Windows at uniform random offsets of a token stream; every token is trained on."""

    stream: torch.Tensor  # [N] int64
    batch: int
    length: int
    seed: int

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = sample_windows(self.stream, batch=self.batch, length=self.length,
                             generator=step_generator(self.seed, step))
        return ids, torch.ones_like(ids, dtype=torch.float32)


@dataclass(frozen=True)
class EpochWindows:
    """Non-overlapping windows of a token stream, shuffled afresh each epoch: one epoch shows
    every window once (the last partial batch of an epoch is dropped)."""

    stream: torch.Tensor  # [N] int64
    batch: int
    length: int
    seed: int

    def __post_init__(self) -> None:
        if self.windows < self.batch:
            raise CorpusError(f"corpus has {self.stream.numel()} tokens, fewer than one batch of "
                              f"{self.batch} windows of {self.length}")

    @property
    def windows(self) -> int:
        return self.stream.numel() // self.length

    @property
    def steps_per_epoch(self) -> int:
        return self.windows // self.batch

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        epoch, index = divmod(step, self.steps_per_epoch)
        order = torch.randperm(self.windows, generator=step_generator(self.seed, -1 - epoch))
        starts = order[index * self.batch : (index + 1) * self.batch] * self.length
        ids = torch.stack([self.stream[s : s + self.length] for s in starts.tolist()])
        return ids, torch.ones_like(ids, dtype=torch.float32)


@dataclass(frozen=True)
class DistilledRows:
    """Rows of target-generated data (`tools/distill_data.py`): a corpus prompt and the target's
    continuation, trained on from the prompt's last token on (its loss mask)."""

    ids: torch.Tensor  # [R, n] int64
    loss_mask: torch.Tensor  # [R, n] float32
    batch: int
    seed: int

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.randint(0, self.ids.shape[0], (self.batch,), generator=step_generator(self.seed, step))
        return self.ids[rows], self.loss_mask[rows]


@dataclass(frozen=True)
class MixedBatches:
    """Several sources' batches stacked into one (their rows must have one length)."""

    sources: tuple[Batches, ...]

    @property
    def batch(self) -> int:
        return sum(source.batch for source in self.sources)

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [source(step) for source in self.sources]
        return torch.cat([ids for ids, _ in parts]), torch.cat([mask for _, mask in parts])
