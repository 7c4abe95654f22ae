"""`dspark train draft-model`: a small autoregressive Qwen3 draft model for a target, for the
draft-model speculative decoding other runtimes offer (onnxruntime-genai's `model.type:
"speculative"`, run as a `dspark bench` peer).

    dspark train draft-model                      # the bundled demo target -> <cache>/draft-model-<key>
    dspark train draft-model --target T --layers 2 --steps 900 --out DIR

The draft model is the target's architecture cut to 1 or 2 layers (same widths, heads and
vocabulary; the target's tokenizer.json is copied), trained from scratch with next-token CE on
the same standard-library corpus by `demo_training.train_target`. Its folder is a Hugging Face
Qwen3 checkpoint; `draft_model.json` names the target it was made for (a digest of the target's
config, weights and tokenizer), and `training.json` holds the held-out loss and perplexity.
A draft model never changes what a lossless runtime outputs, only how many drafts it accepts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from .errors import OneLineErrors

RECORD = "draft_model.json"
DEFAULT_STEPS = 900  # about 10 minutes on one shared CPU thread for a 1-layer model of the demo target


def target_key(target_dir: Path) -> str:
    """Short digest of the target (config, weights, tokenizer): a draft model belongs to one target."""
    from .distill_data import target_fingerprint

    return target_fingerprint(target_dir)[:16]


def default_folder(target_dir: Path) -> Path:
    from .demo_engine import cache_root

    return cache_root() / f"draft-model-{target_key(target_dir)}"


def find_draft_model(target_dir: Path) -> Path | None:
    """The draft model made for this target in the user cache, if `dspark train draft-model` made one."""
    if not all((target_dir / name).is_file() for name in ("config.json", "model.safetensors", "tokenizer.json")):
        return None
    folder = default_folder(target_dir)
    return folder if _record_matches(folder, target_key(target_dir)) else None


def _record_matches(folder: Path, key: str, **settings: Any) -> bool:
    path = folder / RECORD
    if not (path.is_file() and (folder / "model.safetensors").is_file()):
        return False
    record = json.loads(path.read_text(encoding="utf-8"))
    return record.get("target_key") == key and all(record.get(k) == v for k, v in settings.items())


def draft_config(target: dict[str, Any], layers: int) -> dict[str, Any]:
    """The target's Qwen3 config.json with `layers` decoder layers."""
    from .demo_training import target_config_dict

    return target_config_dict(
        vocab_size=target["vocab_size"], hidden_size=target["hidden_size"],
        intermediate_size=target["intermediate_size"], num_hidden_layers=layers,
        num_attention_heads=target["num_attention_heads"], num_key_value_heads=target["num_key_value_heads"],
        head_dim=target.get("head_dim") or target["hidden_size"] // target["num_attention_heads"],
        eos_token_id=target["eos_token_id"], max_position_embeddings=target["max_position_embeddings"],
    )


def train_draft_model(target_dir: Path, out: Path, *, layers: int, steps: int, batch: int, seq_len: int,
                      lr: float, warmup: int, seed: int, limit_files: int | None = None, progress: bool = True,
                      resume: bool = True) -> dict[str, Any]:
    """Train, save and evaluate a draft model of `target_dir` into `out`; returns training.json.
    `draft_model.json` records the target's key and these settings."""
    settings = dict(layers=layers, steps=steps, batch=batch, seq_len=seq_len, lr=lr, warmup=warmup, seed=seed,
                    limit_files=limit_files)
    import torch
    from tokenizers import Tokenizer

    from dspark.models import TargetModel

    from . import corpus, demo_eval, demo_training, training_data

    tokenizer_file = target_dir / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    target = json.loads((target_dir / "config.json").read_text(encoding="utf-8"))
    config = draft_config(target, layers)
    stream = corpus.encode_corpus(tokenizer, corpus.read_documents(corpus.corpus_files("train")[:limit_files]))
    batches = training_data.EpochWindows(stream, batch, seq_len, seed)
    schedule = demo_training.Schedule(steps=steps, batch=batch, seq_len=seq_len, lr=lr, warmup=warmup, seed=seed)
    summary = demo_training.train_target(batches, config, schedule, folder=out, tokenizer_file=tokenizer_file,
                                         progress=progress, resume=resume)
    summary["epochs"] = round(steps / batches.steps_per_epoch, 3)
    heldout = [torch.tensor(tokenizer.encode(text).ids)
               for text in corpus.read_documents(corpus.corpus_files("heldout")[:limit_files])]
    with torch.no_grad():
        summary["heldout"] = demo_eval.heldout_loss(TargetModel.from_pretrained(out), heldout)
    (out / "training.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    record = {"target": str(target_dir.resolve()), "target_key": target_key(target_dir), **settings}
    (out / RECORD).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return summary


@click.command("draft-model", cls=OneLineErrors)
@click.option("--target", "target_dir", type=click.Path(path_type=Path), default=None,
              help="Target checkpoint folder (with tokenizer.json). [default: the bundled demo target]")
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="Folder to write. [default: <cache>/draft-model-<target key>, where `dspark bench` finds it]")
@click.option("--layers", default=1, show_default=True, type=click.IntRange(1, 2), help="Decoder layers.")
@click.option("--steps", default=DEFAULT_STEPS, show_default=True, type=click.IntRange(min=1))
@click.option("--batch", default=8, show_default=True, type=click.IntRange(min=1))
@click.option("--seq-len", default=256, show_default=True, type=click.IntRange(min=2))
@click.option("--lr", default=3e-3, show_default=True)
@click.option("--warmup", default=30, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--limit-files", type=click.IntRange(min=1), default=None,
              help="Use only the first N training and held-out files (tests).")
@click.option("--force", is_flag=True, help="Train again even if --out holds this draft model already.")
@click.option("--resume/--no-resume", default=True, show_default=True,
              help="Continue from <out>/checkpoint.pt when an interrupted run left one.")
@click.option("--progress/--no-progress", default=True)
def draft_model_command(target_dir: Path | None, out: Path | None, layers: int, steps: int, batch: int, seq_len: int,
                        lr: float, warmup: int, seed: int, limit_files: int | None, force: bool, resume: bool,
                        progress: bool) -> None:
    """A 1-2 layer autoregressive Qwen3 draft model of the target, on the same tokenizer and corpus."""
    from .demo_engine import DEMO_TARGET

    target_dir = DEMO_TARGET if target_dir is None else target_dir
    missing = [n for n in ("config.json", "model.safetensors", "tokenizer.json") if not (target_dir / n).is_file()]
    if missing:
        raise click.BadParameter(f"{target_dir} is not a target checkpoint with a tokenizer (no {', '.join(missing)})",
                                 param_hint="--target")
    out = default_folder(target_dir) if out is None else out
    settings = dict(layers=layers, steps=steps, batch=batch, seq_len=seq_len, lr=lr, warmup=warmup, seed=seed,
                    limit_files=limit_files)
    if not force and _record_matches(out, target_key(target_dir), **settings):
        click.echo(f"up to date: {out}")
        return
    summary = train_draft_model(target_dir, out, **settings, progress=progress, resume=resume)
    heldout = summary["heldout"]
    click.echo(f"draft model: {layers} layer(s), {summary['parameters']:,} parameters, {steps} steps "
               f"({summary['epochs']} epochs) in {summary['wall_seconds']}s, held-out loss {heldout['loss']:.3f} "
               f"(perplexity {heldout['perplexity']:.1f}) -> {out}")
