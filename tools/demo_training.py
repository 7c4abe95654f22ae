"""Training loops for the demo pair: a Qwen3 target on stdlib source, then drafters against it.

Each run is seeded, shows a tqdm progress bar, appends to `<out>/train.log` and can be resumed
after an interruption from `<out>/checkpoint.pt` (written every `checkpoint_every` steps, deleted
when the run finishes; batches depend only on the step, see `training_data.py`); the finished
folder also holds `training.json` (arguments, steps, wall time, last losses). Targets are saved
as Hugging Face folders; drafters in DeepSpec's format (config field names and parameter names
as DeepSpec's `save_pretrained` writes them) without `embed_tokens`/`lm_head`, which DeepSpec
copies from the target and keeps frozen: `DSparkDrafter.from_pretrained(folder, target=...)`
shares them from the target instead, which keeps the bundled drafters small.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from tqdm import tqdm

from dspark.models import DrafterConfig, DSparkDrafter, TargetConfig, TargetModel
from dspark.models.drafter import SHARED_WITH_TARGET
from dspark.models.loss import LossWeights, dspark_loss
from dspark.models.training import target_training_features, training_forward
from dspark.tools.corpus import EOS_TOKEN, MASK_TOKEN
from dspark.tools.training_data import Batches, step_generator


@dataclass(frozen=True)
class Schedule:
    steps: int
    batch: int
    seq_len: int
    lr: float
    warmup: int
    clip: float = 1.0
    seed: int = 0
    checkpoint_every: int = 50

    def lr_at(self, step: int) -> float:
        """Linear warmup then cosine decay to 10% of the peak."""
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        progress = (step - self.warmup) / max(1, self.steps - self.warmup)
        return self.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


# -- configs ---------------------------------------------------------------------------------
def target_config_dict(
    *,
    vocab_size: int,
    hidden_size: int,
    intermediate_size: int,
    num_hidden_layers: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    head_dim: int,
    eos_token_id: int,
    max_position_embeddings: int = 2048,
) -> dict[str, Any]:
    """A transformers-compatible Qwen3ForCausalLM config.json."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "dtype": "float32",
        "eos_token_id": eos_token_id,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": intermediate_size,
        "layer_types": ["full_attention"] * num_hidden_layers,
        "max_position_embeddings": max_position_embeddings,
        "max_window_layers": num_hidden_layers,
        "model_type": "qwen3",
        "num_attention_heads": num_attention_heads,
        "num_hidden_layers": num_hidden_layers,
        "num_key_value_heads": num_key_value_heads,
        "pad_token_id": None,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "sliding_window": None,
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": vocab_size,
    }


def drafter_config_dict(
    target: dict[str, Any],
    *,
    block_size: int,
    num_draft_layers: int,
    target_layer_ids: list[int],
    mask_token_id: int,
    num_anchors: int,
    markov_rank: int,
    markov_head_type: str = "vanilla",
    confidence_head: bool = True,
) -> dict[str, Any]:
    """A DeepSpec drafter config.json (DSpark; DFlash with markov_rank 0 and no confidence head):
    the target's decoder fields with `num_draft_layers` layers plus DeepSpec's drafter fields."""
    config = {k: v for k, v in target.items() if k not in ("eos_token_id", "layer_types")}
    config.update(
        architectures=["Qwen3DSparkModel"],
        eos_token_id=None,
        layer_types=["full_attention"] * num_draft_layers,
        num_hidden_layers=num_draft_layers,
        max_window_layers=num_draft_layers,
        num_target_layers=target["num_hidden_layers"],
        block_size=block_size,
        target_layer_ids=list(target_layer_ids),
        mask_token_id=mask_token_id,
        num_anchors=num_anchors,
        markov_rank=markov_rank,
        enable_confidence_head=confidence_head,
    )
    if markov_rank:
        config["markov_head_type"] = markov_head_type
    if confidence_head:
        config["confidence_head_with_markov"] = markov_rank > 0
    return dict(sorted(config.items()))


def init_weights(module: nn.Module, std: float = 0.02) -> None:
    """transformers' Qwen3 init: normal(0, std) weights, zero biases, unit norms."""
    for sub in module.modules():
        if isinstance(sub, nn.Linear):
            nn.init.normal_(sub.weight, std=std)
            if sub.bias is not None:
                nn.init.zeros_(sub.bias)
        elif isinstance(sub, nn.Embedding):
            nn.init.normal_(sub.weight, std=std)


# -- saving ----------------------------------------------------------------------------------
def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def _write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file(tensors, str(path), metadata={"format": "pt"})
    path.chmod(0o644)  # safetensors writes 0600; the demo weights ship in the wheel


def save_target(model: TargetModel, folder: Path, config: dict[str, Any], tokenizer_file: Path) -> None:
    """A Hugging Face checkpoint folder: config, `model.`-prefixed safetensors, tokenizer."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {
        (k if k.startswith("lm_head.") else f"model.{k}"): v.detach().contiguous()
        for k, v in model.state_dict().items()
    }
    _write_safetensors(folder / "model.safetensors", tensors)
    _write_json(folder / "config.json", config)
    generation = {"eos_token_id": config["eos_token_id"], "do_sample": False}
    _write_json(folder / "generation_config.json", generation)
    if tokenizer_file.resolve() != (folder / "tokenizer.json").resolve():
        shutil.copyfile(tokenizer_file, folder / "tokenizer.json")
    _write_json(
        folder / "tokenizer_config.json",
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS_TOKEN, "mask_token": MASK_TOKEN},
    )


def save_drafter(model: DSparkDrafter, folder: Path, config: dict[str, Any]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {
        k: v.detach().contiguous() for k, v in model.state_dict().items() if k not in SHARED_WITH_TARGET
    }
    _write_safetensors(folder / "model.safetensors", tensors)
    _write_json(folder / "config.json", config)


# -- the loop --------------------------------------------------------------------------------
CHECKPOINT = "checkpoint.pt"


class ResumeError(RuntimeError):
    """A checkpoint in the output folder belongs to a different run."""


def _logger(folder: Path) -> logging.Logger:
    folder.mkdir(parents=True, exist_ok=True)
    logger = logging.getLogger(f"dspark.train.{folder.resolve()}")
    logger.setLevel(logging.INFO)
    if not logger.handlers:
        handler = logging.FileHandler(folder / "train.log", encoding="utf-8")
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        logger.addHandler(handler)
    return logger


def _run_key(schedule: Schedule, desc: str) -> dict[str, Any]:
    """What a checkpoint must match to be resumed (how often it is written may change)."""
    key = asdict(schedule)
    key.pop("checkpoint_every")
    return {"desc": desc, "schedule": key}


def _save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    partial = path.with_suffix(".partial")
    torch.save(state, partial)
    os.replace(partial, path)  # a kill mid-write leaves the previous checkpoint intact


def run_steps(
    params: list[nn.Parameter],
    step_loss: Callable[[int], dict[str, torch.Tensor]],
    schedule: Schedule,
    *,
    folder: Path,
    desc: str,
    progress: bool = True,
    resume: bool = True,
    log_every: int = 10,
) -> dict[str, Any]:
    """AdamW(0.9, 0.95) with warmup + cosine and gradient clipping. `step_loss(step)` returns
    named losses; "total" is minimised. Every `schedule.checkpoint_every` steps the parameters,
    the optimizer and the loss record go to `<folder>/checkpoint.pt`; a later call with the same
    schedule resumes from it (`resume=False` starts over), and the finished run deletes it.
    Returns the run summary written to training.json."""
    logger = _logger(folder)
    optimizer = torch.optim.AdamW(params, lr=schedule.lr, betas=(0.9, 0.95), weight_decay=0.0)
    checkpoint = folder / CHECKPOINT
    key = _run_key(schedule, desc)
    start, first, recent, spent = 0, {}, {}, 0.0
    if resume and checkpoint.is_file():
        state = torch.load(checkpoint, weights_only=True)
        if state["key"] != key:
            raise ResumeError(f"{checkpoint} is from another run ({state['key']}, not {key}): delete it, "
                              "or pass --no-resume to start over")
        with torch.no_grad():
            for param, saved in zip(params, state["params"], strict=True):
                param.copy_(saved)
        optimizer.load_state_dict(state["optimizer"])
        start, first, recent, spent = state["step"], state["first"], state["recent"], state["seconds"]
        logger.info("resume %s at step %d", desc, start)
    else:
        logger.info("start %s: %s", desc, json.dumps(asdict(schedule)))
    began = time.perf_counter() - spent
    bar = tqdm(range(start, schedule.steps), desc=desc, disable=not progress, dynamic_ncols=True,
               initial=start, total=schedule.steps)
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = schedule.lr_at(step)
        losses = step_loss(step)
        optimizer.zero_grad(set_to_none=True)
        losses["total"].backward()
        torch.nn.utils.clip_grad_norm_(params, schedule.clip)
        optimizer.step()
        values = {k: float(v.detach()) for k, v in losses.items()}
        first = first or values
        recent = {k: 0.9 * recent.get(k, v) + 0.1 * v for k, v in values.items()} if recent else values
        bar.set_postfix(loss=f"{recent['total']:.3f}")
        if step % log_every == 0 or step == schedule.steps - 1:
            logger.info(
                "step %d/%d lr %.2e %s elapsed %.0fs", step + 1, schedule.steps, schedule.lr_at(step),
                " ".join(f"{k} {v:.4f}" for k, v in values.items()), time.perf_counter() - began,
            )
        if (step + 1) % schedule.checkpoint_every == 0 and step + 1 < schedule.steps:
            _save_checkpoint(checkpoint, {
                "key": key, "step": step + 1, "params": [p.detach().clone() for p in params],
                "optimizer": optimizer.state_dict(), "first": first, "recent": recent,
                "seconds": time.perf_counter() - began,
            })
    seconds = time.perf_counter() - began
    logger.info("done %s in %.1fs", desc, seconds)
    checkpoint.unlink(missing_ok=True)
    return {
        "schedule": asdict(schedule),
        "wall_seconds": round(seconds, 1),
        "first_losses": first,
        "final_losses_ema": recent,
        "torch_threads": torch.get_num_threads(),
    }


def train_target(
    batches: Batches,
    config: dict[str, Any],
    schedule: Schedule,
    *,
    folder: Path,
    tokenizer_file: Path,
    progress: bool = True,
    resume: bool = True,
) -> dict[str, Any]:
    torch.manual_seed(schedule.seed)
    model = TargetModel(TargetConfig.from_dict(config))
    init_weights(model)
    model.train()

    def step_loss(step: int) -> dict[str, torch.Tensor]:
        ids, _ = batches(step)
        positions = torch.arange(ids.shape[1]).expand_as(ids)
        logits = model(ids[:, :-1], positions[:, :-1]).logits
        return {"total": F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())}

    params = list(model.parameters())
    summary = run_steps(params, step_loss, schedule, folder=folder, desc="target", progress=progress,
                        resume=resume)
    summary["parameters"] = sum(p.numel() for p in params)
    save_target(model.eval(), folder, config, tokenizer_file)
    _write_json(folder / "training.json", summary)
    return summary


def train_drafter(
    batches: Batches,
    target: TargetModel,
    config: dict[str, Any],
    weights: LossWeights,
    schedule: Schedule,
    *,
    folder: Path,
    progress: bool = True,
    resume: bool = True,
) -> dict[str, Any]:
    """Train against the frozen target; embeddings and LM head are the target's, frozen.
    Anchors go where a token and its successor are in the batch's loss mask."""
    torch.manual_seed(schedule.seed)
    drafter = DSparkDrafter(DrafterConfig.from_dict(config))
    init_weights(drafter)
    if drafter.markov_head is not None:
        nn.init.zeros_(drafter.markov_head.markov_w2.weight)  # the Markov bias starts at zero
    drafter.embed_tokens.weight = target.embed_tokens.weight
    drafter.lm_head.weight = target.lm_head.weight
    target.requires_grad_(False).eval()
    drafter.train()

    def step_loss(step: int) -> dict[str, torch.Tensor]:
        ids, loss_mask = batches(step)
        features, last_hidden = target_training_features(target, ids)
        out = training_forward(
            drafter,
            input_ids=ids,
            context_features=features,
            target_last_hidden=last_hidden,
            loss_mask=loss_mask,
            generator=step_generator(schedule.seed + 1, step),
        )
        loss = dspark_loss(out, weights)
        return {"total": loss.total, "ce": loss.ce, "tv": loss.tv, "confidence": loss.confidence}

    params = [p for p in drafter.parameters() if p.requires_grad]
    summary = run_steps(params, step_loss, schedule, folder=folder, desc=folder.name, progress=progress,
                        resume=resume)
    summary["trainable_parameters"] = sum(p.numel() for p in params)
    summary["loss_weights"] = asdict(weights)
    save_drafter(drafter.eval(), folder, config)
    _write_json(folder / "training.json", summary)
    return summary
