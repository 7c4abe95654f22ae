"""Drafter training data from the target's own output, as DeepSpec trains drafters.

Prompts are windows cut from the training corpus; the frozen target continues each of them,
greedily and/or by sampling at T = 1, with its KV cache, a batch of prompts at a time. A drafter
trained on these rows learns what the target says rather than what the corpus says, which is
what verification accepts. The file (safetensors) holds `ids` [R, prompt + new] and
`loss_mask` [R, prompt + new] (1 from the prompt's last token on: each continuation token, and
the anchor that precedes the first), and records in its metadata the target it came from.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from dspark.models import TargetModel
from dspark.tools.training_data import step_generator


class DistillDataError(ValueError):
    """A distillation file that is missing, malformed, or made by another target."""


def target_fingerprint(target_dir: Path) -> str:
    """sha256 of the target's config, weights and tokenizer: a distillation file (or a draft model)
    belongs to one target."""
    digest = hashlib.sha256()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        if not (target_dir / name).is_file():  # a folder without a tokenizer is still a target
            continue
        with open(target_dir / name, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def corpus_prompts(stream: torch.Tensor, *, count: int, length: int, seed: int) -> torch.Tensor:
    """[count, length] windows at seeded random offsets of the training stream."""
    if stream.numel() <= length:
        raise DistillDataError(f"corpus has {stream.numel()} tokens, fewer than one prompt of {length}")
    starts = torch.randint(0, stream.numel() - length, (count,), generator=step_generator(seed, 0))
    return torch.stack([stream[s : s + length] for s in starts.tolist()])


@torch.no_grad()
def continue_prompts(
    target: TargetModel,
    prompts: torch.Tensor,  # [P, L] int64
    *,
    new_tokens: int,
    temperature: float,
    seed: int,
    batch: int = 64,
    progress: bool = True,
) -> torch.Tensor:
    """[P, L + new_tokens]: each prompt and the target's continuation (argmax at T = 0, else a
    sample at `temperature`); continuations run past an end-of-text token, as the corpus does."""
    target.eval()
    length = prompts.shape[1]
    positions = torch.arange(length + new_tokens)
    rows = []
    bar = tqdm(total=prompts.shape[0] * new_tokens, desc=f"continue T={temperature:g}", unit="tok",
               disable=not progress, dynamic_ncols=True)
    for first in range(0, prompts.shape[0], batch):
        ids = prompts[first : first + batch]
        generator = step_generator(seed, first)
        out = target(ids, positions[:length].expand_as(ids))
        for t in range(new_tokens):
            logits = out.logits[:, -1]
            if temperature == 0:
                token = logits.argmax(-1, keepdim=True)
            else:
                probs = torch.softmax(logits.double() / temperature, -1)
                token = torch.multinomial(probs, 1, generator=generator)
            ids = torch.cat([ids, token], dim=1)
            bar.update(token.shape[0])
            if t + 1 < new_tokens:
                step_positions = positions[length + t : length + t + 1].expand(token.shape[0], 1)
                out = target(token, step_positions, past_key_values=out.present)
        rows.append(ids)
    bar.close()
    return torch.cat(rows)


def build_distill_set(
    target: TargetModel,
    stream: torch.Tensor,
    *,
    prompts: int,
    prompt_len: int,
    new_tokens: int,
    temperatures: Sequence[float],
    seed: int,
    batch: int = 64,
    progress: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`prompts` corpus prompts continued once per temperature: (ids, loss_mask), each
    [prompts * len(temperatures), prompt_len + new_tokens]."""
    cut = corpus_prompts(stream, count=prompts, length=prompt_len, seed=seed)
    ids = torch.cat([
        continue_prompts(target, cut, new_tokens=new_tokens, temperature=t, seed=seed + 1 + i,
                         batch=batch, progress=progress)
        for i, t in enumerate(temperatures)
    ])
    mask = torch.zeros_like(ids, dtype=torch.float32)
    mask[:, prompt_len - 1 :] = 1.0
    return ids, mask


def save_distill_set(path: Path, ids: torch.Tensor, loss_mask: torch.Tensor, meta: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"ids": ids.contiguous(), "loss_mask": loss_mask.contiguous()}, str(path),
              metadata={"dspark_distill": json.dumps(meta, sort_keys=True)})


def load_distill_set(path: Path, target_dir: Path) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """(ids, loss_mask, meta); refuses a file made from another target or not made by us."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta_text = (f.metadata() or {}).get("dspark_distill")
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    except (OSError, ValueError, RuntimeError) as exc:
        raise DistillDataError(f"{path}: not a readable safetensors file ({exc})") from exc
    if meta_text is None or set(tensors) != {"ids", "loss_mask"}:
        raise DistillDataError(f"{path}: not a distillation file (make one with `dspark train distill-data`)")
    meta = json.loads(meta_text)
    ids, mask = tensors["ids"], tensors["loss_mask"]
    if ids.dtype != torch.int64 or ids.ndim != 2 or mask.shape != ids.shape:
        raise DistillDataError(f"{path}: ids {tuple(ids.shape)} {ids.dtype} and loss_mask {tuple(mask.shape)} "
                               "must be [rows, length] int64 and float of the same shape")
    if meta.get("target_sha256") != target_fingerprint(target_dir):
        raise DistillDataError(f"{path} was generated by another target than {target_dir}: regenerate it "
                               "with `dspark train distill-data --target` this target")
    return ids, mask.float(), meta
