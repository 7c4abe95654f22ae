"""Start-up profiling of the step cost model: time real decode steps at several loads.

For a plain export directory (an engine directory carries its measured SPS table, which
`Runtime.load` uses instead), `profile_step_cost` runs a throw-away `BatchEngine` on the same
backend with synthetic prompts, for every (requests R, draft length ℓ) in a small grid, and
fits `StepCostModel` to the measured step times (prefill excluded) against (R, B = R·(1+ℓ)).
The steps are real: drafter, sequential head, verification, commit — so the fit includes the
per-request overheads a target-only table would miss.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .backend import Backend
from .batch_loop import BatchEngine
from .capacity import Capacity
from .cost_model import StepCostModel
from .model_info import ModelInfo
from .prefix_scheduler import SchedulerConfig


def profile_step_samples(
    backend: Backend,
    info: ModelInfo,
    *,
    kv_mode: str,
    requests: Sequence[int] = (1, 4, 16),
    draft_lengths: Sequence[int] | None = None,
    prompt_len: int = 32,
    steps: int = 3,
    seed: int = 0,
) -> list[tuple[int, int, float]]:
    """(R, B, seconds) for `steps` timed decode steps per grid point (after one warm-up step)."""
    gamma = info.block_size
    lengths = draft_lengths or sorted({1, max(gamma // 2, 1), gamma})
    g = torch.Generator().manual_seed(seed)
    need = prompt_len + steps + 2 + gamma * (steps + 2) + gamma + 1
    samples = []
    for r in requests:
        for length in lengths:
            engine = BatchEngine(backend, info, capacity=Capacity(r, r * need, need),
                            scheduler=SchedulerConfig("fixed", fixed_length=length), kv_mode=kv_mode)
            for _ in range(r):
                prompt = torch.randint(0, info.vocab_size, (prompt_len,), generator=g).tolist()
                engine.submit(prompt, max_new_tokens=need - prompt_len - gamma - 1)
            engine.step()  # prefill + warm-up
            for _ in range(steps):
                record = engine.step()
                seconds = record.total_seconds - record.seconds.get("prefill", 0.0)
                samples.append((record.requests, record.verified_tokens, seconds))
    return samples


def profile_step_cost(backend: Backend, info: ModelInfo, *, kv_mode: str, **grid) -> StepCostModel:
    return StepCostModel.fit(profile_step_samples(backend, info, kv_mode=kv_mode, **grid))
