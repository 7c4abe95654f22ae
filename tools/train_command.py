"""`dspark train tokenizer|target|distill-data|drafter|evaluate`: reproduce the bundled demo
pair; `dspark train draft-model`: an autoregressive draft model for onnxruntime-genai's
speculation (a bench peer); `dspark train standin`: inflate a target into a memory-bound cost stand-in.

    dspark train tokenizer --out build/demo/tokenizer
    dspark train target --tokenizer build/demo/tokenizer/tokenizer.json --out models/demo/target
    dspark train distill-data --target models/demo/target --out build/demo/distill.safetensors
    dspark train drafter --target models/demo/target --kind dspark --data target \
        --distill-data build/demo/distill.safetensors --out models/demo/dspark
    dspark train drafter --target models/demo/target --kind dflash --data target \
        --distill-data build/demo/distill.safetensors --out models/demo/dflash
    dspark train evaluate --target models/demo/target --dspark models/demo/dspark \
        --dflash models/demo/dflash --out build/demo/eval
    dspark train standin --params 100M       # -> <cache>/standin-100M, see dspark.models.inflate

The defaults are the settings the bundled checkpoints were trained with (see
models/demo/README.md). On a shared CPU, OMP_NUM_THREADS=1 avoids thread oversubscription. An
interrupted run resumes from its checkpoint when started again with the same options.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import click
import torch
from tokenizers import Tokenizer

from dspark.models import DrafterConfig, TargetModel
from dspark.models.loss import DFLASH_WEIGHTS, DSPARK_WEIGHTS

from . import corpus, demo_eval, demo_training, distill_data, training_data
from .draft_model import draft_model_command
from .errors import OneLineErrors

_PATH = click.Path(path_type=Path)
_EXISTING = click.Path(path_type=Path, exists=True)
_RESUME = click.option("--resume/--no-resume", default=True, show_default=True,
                       help="Continue from <out>/checkpoint.pt when an interrupted run left one.")


def _training_stream(tokenizer_file: Path, limit_files: int | None) -> torch.Tensor:
    files = corpus.corpus_files("train")[:limit_files]
    return corpus.encode_corpus(Tokenizer.from_file(str(tokenizer_file)), corpus.read_documents(files))


def _heldout_streams(tokenizer: Tokenizer) -> list[torch.Tensor]:
    return [torch.tensor(tokenizer.encode(text).ids) for text in
            corpus.read_documents(corpus.corpus_files("heldout"))]


@click.group("train")
def train() -> None:
    """Train the demo tokenizer, target and drafters on Python's standard library; make a cost stand-in."""


@train.command("tokenizer")
@click.option("--out", type=_PATH, required=True, help="Folder for tokenizer.json.")
@click.option("--vocab-size", default=4096, show_default=True)
@click.option("--limit-files", type=int, default=None, help="Use only the first N training files (tests).")
def tokenizer_command(out: Path, vocab_size: int, limit_files: int | None) -> None:
    """Byte-level BPE over the training modules (special tokens <|endoftext|>, <|mask|>)."""
    documents = corpus.read_documents(corpus.corpus_files("train")[:limit_files])
    tokenizer = corpus.train_tokenizer(documents, vocab_size)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    click.echo(f"tokenizer: {tokenizer.get_vocab_size()} tokens from {len(documents)} files -> {out}")


@train.command("target")
@click.option("--tokenizer", "tokenizer_file", type=_EXISTING, required=True, help="tokenizer.json")
@click.option("--out", type=_PATH, required=True, help="Hugging Face checkpoint folder to write.")
@click.option("--hidden-size", default=256, show_default=True)
@click.option("--intermediate-size", default=768, show_default=True)
@click.option("--layers", default=4, show_default=True)
@click.option("--heads", default=4, show_default=True)
@click.option("--kv-heads", default=2, show_default=True)
@click.option("--epochs", default=1.0, show_default=True,
              help="Passes over the training modules, in shuffled non-overlapping windows.")
@click.option("--steps", type=int, default=None, help="Train this many steps instead of --epochs.")
@click.option("--batch", default=8, show_default=True)
@click.option("--seq-len", default=256, show_default=True)
@click.option("--lr", default=3e-3, show_default=True)
@click.option("--warmup", default=30, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--limit-files", type=int, default=None, help="Use only the first N training files (tests).")
@_RESUME
@click.option("--progress/--no-progress", default=True)
def target_command(
    tokenizer_file: Path, out: Path, hidden_size: int, intermediate_size: int, layers: int, heads: int,
    kv_heads: int, epochs: float, steps: int | None, batch: int, seq_len: int, lr: float, warmup: int,
    seed: int, limit_files: int | None, resume: bool, progress: bool,
) -> None:
    """A Qwen3 target trained with next-token CE on the training modules; held-out loss and
    perplexity go to training.json."""
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    if hidden_size % heads:
        raise click.BadParameter(f"--hidden-size {hidden_size} is not a multiple of --heads {heads}")
    config = demo_training.target_config_dict(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden_size // heads,
        eos_token_id=corpus.special_token_id(tokenizer, corpus.EOS_TOKEN),
    )
    batches = training_data.EpochWindows(_training_stream(tokenizer_file, limit_files), batch, seq_len, seed)
    steps = steps or math.ceil(epochs * batches.steps_per_epoch)
    schedule = demo_training.Schedule(
        steps=steps, batch=batch, seq_len=seq_len, lr=lr, warmup=warmup, seed=seed
    )
    summary = demo_training.train_target(
        batches, config, schedule, folder=out, tokenizer_file=tokenizer_file, progress=progress, resume=resume
    )
    summary["epochs"] = round(steps / batches.steps_per_epoch, 3)
    summary["heldout"] = demo_eval.heldout_loss(TargetModel.from_pretrained(out), _heldout_streams(tokenizer))
    (out / "training.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    click.echo(
        f"target: {summary['parameters']:,} parameters, {steps} steps ({summary['epochs']} epochs) in "
        f"{summary['wall_seconds']}s, loss {summary['first_losses']['total']:.3f} -> "
        f"{summary['final_losses_ema']['total']:.3f}, held-out loss {summary['heldout']['loss']} "
        f"(perplexity {summary['heldout']['perplexity']}) -> {out}"
    )


@train.command("drafter")
@click.option("--target", "target_dir", type=_EXISTING, required=True, help="Target checkpoint folder.")
@click.option("--out", type=_PATH, required=True, help="DeepSpec drafter folder to write.")
@click.option("--kind", type=click.Choice(["dspark", "dflash"]), default="dspark", show_default=True,
              help="dspark: Markov head + confidence head, paper loss; dflash: neither, CE only.")
@click.option("--objective", type=click.Choice(["paper", "ce"]), default=None,
              help="paper: 0.1·CE + 0.9·TV (+ confidence BCE); ce: CE only, DeepSpec's DFlash setting. "
                   "Default: paper for dspark, ce for dflash.")
@click.option("--block-size", default=7, show_default=True)
@click.option("--draft-layers", default=2, show_default=True)
@click.option("--target-layer-ids", default=None, help="Comma-separated; default: every non-final layer.")
@click.option("--markov-rank", default=32, show_default=True, help="Ignored for --kind dflash.")
@click.option("--num-anchors", default=16, show_default=True)
@click.option("--data", type=click.Choice(["raw", "target", "mixed"]), default="raw", show_default=True,
              help="raw: corpus windows; target: the target's own continuations (--distill-data); "
                   "mixed: half of each batch from either (windows as long as the distilled rows).")
@click.option("--distill-data", type=_EXISTING, default=None,
              help="File from `dspark train distill-data` for this target (--data target|mixed).")
@click.option("--steps", default=3600, show_default=True)
@click.option("--batch", default=8, show_default=True)
@click.option("--seq-len", default=256, show_default=True, help="Corpus window length (--data raw).")
@click.option("--lr", default=3e-3, show_default=True)
@click.option("--warmup", default=60, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--limit-files", type=int, default=None, help="Use only the first N training files (tests).")
@_RESUME
@click.option("--progress/--no-progress", default=True)
def drafter_command(
    target_dir: Path, out: Path, kind: str, objective: str | None, block_size: int, draft_layers: int,
    target_layer_ids: str | None, markov_rank: int, num_anchors: int, data: str, distill_data: Path | None,
    steps: int, batch: int, seq_len: int, lr: float, warmup: int, seed: int, limit_files: int | None,
    resume: bool, progress: bool,
) -> None:
    """A DSpark (or DFlash baseline) drafter trained against the frozen target."""
    if (data == "raw") != (distill_data is None):
        raise click.UsageError("--distill-data goes with --data target or mixed, and only with them")
    target_json = json.loads((target_dir / "config.json").read_text(encoding="utf-8"))
    layers = target_json["num_hidden_layers"]
    ids = [int(i) for i in target_layer_ids.split(",")] if target_layer_ids else list(range(layers - 1))
    tokenizer = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    mask_id = corpus.special_token_id(tokenizer, corpus.MASK_TOKEN)
    dspark = kind == "dspark"
    config = demo_training.drafter_config_dict(
        target_json,
        block_size=block_size,
        num_draft_layers=draft_layers,
        target_layer_ids=ids,
        mask_token_id=mask_id,
        num_anchors=num_anchors,
        markov_rank=markov_rank if dspark else 0,
        confidence_head=dspark,
    )
    DrafterConfig.from_dict(config, source="drafter options")  # refuse bad options before training
    batches = _drafter_batches(target_dir, data, distill_data, batch, seq_len, seed, limit_files)
    target = TargetModel.from_pretrained(target_dir, tuple(ids))
    schedule = demo_training.Schedule(
        steps=steps, batch=batch, seq_len=seq_len, lr=lr, warmup=warmup, seed=seed
    )
    objective = objective or ("paper" if dspark else "ce")
    weights = DSPARK_WEIGHTS if objective == "paper" else DFLASH_WEIGHTS
    summary = demo_training.train_drafter(
        batches, target, config, weights, schedule, folder=out, progress=progress, resume=resume
    )
    summary["data"] = {"kind": data, "distill_data": str(distill_data) if distill_data else None}
    (out / "training.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    click.echo(
        f"{kind} drafter: {summary['trainable_parameters']:,} trained parameters, {steps} steps in "
        f"{summary['wall_seconds']}s, loss {summary['first_losses']['total']:.3f} -> "
        f"{summary['final_losses_ema']['total']:.3f} -> {out}"
    )


def _drafter_batches(
    target_dir: Path, data: str, distill_path: Path | None, batch: int, seq_len: int, seed: int,
    limit_files: int | None,
) -> training_data.Batches:
    if distill_path is None:
        return training_data.RandomWindows(_training_stream(target_dir / "tokenizer.json", limit_files),
                                           batch, seq_len, seed)
    try:
        ids, mask, _ = distill_data.load_distill_set(distill_path, target_dir)
    except distill_data.DistillDataError as exc:
        raise click.BadParameter(str(exc), param_hint="--distill-data") from exc
    if data == "target":
        return training_data.DistilledRows(ids, mask, batch, seed)
    if batch < 2:
        raise click.BadParameter("--data mixed needs --batch of at least 2", param_hint="--batch")
    stream = _training_stream(target_dir / "tokenizer.json", limit_files)
    return training_data.MixedBatches((training_data.DistilledRows(ids, mask, batch - batch // 2, seed),
                                       training_data.RandomWindows(stream, batch // 2, ids.shape[1], seed + 1)))


@train.command("distill-data")
@click.option("--target", "target_dir", type=_EXISTING, required=True, help="Target checkpoint folder.")
@click.option("--out", type=_PATH, required=True, help="safetensors file to write.")
@click.option("--prompts", default=3072, show_default=True, help="Corpus prompts (each continued per temperature).")
@click.option("--prompt-len", default=64, show_default=True)
@click.option("--new-tokens", default=128, show_default=True)
@click.option("--temperatures", default="0,1", show_default=True, help="Comma-separated; 0 = greedy.")
@click.option("--batch", default=256, show_default=True, help="Prompts continued together.")
@click.option("--seed", default=0, show_default=True)
@click.option("--limit-files", type=int, default=None, help="Use only the first N training files (tests).")
@click.option("--progress/--no-progress", default=True)
def distill_data_command(
    target_dir: Path, out: Path, prompts: int, prompt_len: int, new_tokens: int, temperatures: str,
    batch: int, seed: int, limit_files: int | None, progress: bool,
) -> None:
    """Drafter training rows from the target's own continuations of corpus prompts."""
    try:
        temps = [float(t) for t in temperatures.split(",")]
    except ValueError as exc:
        raise click.BadParameter(f"{temperatures!r} is not a comma-separated list of numbers",
                                 param_hint="--temperatures") from exc
    if any(t < 0 for t in temps) or prompts < 1 or prompt_len < 1 or new_tokens < 1:
        raise click.UsageError("temperatures must be >= 0; --prompts, --prompt-len, --new-tokens >= 1")
    target = TargetModel.from_pretrained(target_dir)
    stream = _training_stream(target_dir / "tokenizer.json", limit_files)
    ids, mask = distill_data.build_distill_set(
        target, stream, prompts=prompts, prompt_len=prompt_len, new_tokens=new_tokens, temperatures=temps,
        seed=seed, batch=batch, progress=progress,
    )
    meta = {"target": str(target_dir), "target_sha256": distill_data.target_fingerprint(target_dir),
            "prompts": prompts, "prompt_len": prompt_len, "new_tokens": new_tokens, "temperatures": temps,
            "seed": seed, "limit_files": limit_files}
    distill_data.save_distill_set(out, ids, mask, meta)
    click.echo(f"distill data: {ids.shape[0]} rows x {ids.shape[1]} tokens "
               f"({int(mask.sum()):,} trained positions) -> {out}")


@train.command("evaluate")
@click.option("--target", "target_dir", type=_EXISTING, required=True, help="Target checkpoint folder.")
@click.option("--dspark", "dspark_dir", type=_EXISTING, required=True, help="DSpark drafter folder.")
@click.option("--dflash", "dflash_dir", type=_EXISTING, required=True, help="DFlash drafter folder.")
@click.option("--out", type=_PATH, required=True, help="Folder for eval.json and acceptance.png.")
@click.option("--per-module", default=4, show_default=True, help="Prompts per held-out module.")
@click.option("--prompt-len", default=64, show_default=True)
@click.option("--new-tokens", default=64, show_default=True)
@click.option("--seed", default=0, show_default=True)
def evaluate_command(
    target_dir: Path, dspark_dir: Path, dflash_dir: Path, out: Path, per_module: int, prompt_len: int,
    new_tokens: int, seed: int,
) -> None:
    """Accepted length, conditional acceptance, confidence AUC/ECE on the held-out modules."""
    from dspark.models import DSparkDrafter

    tokenizer = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    streams = _heldout_streams(tokenizer)
    prompts = demo_eval.heldout_prompts(streams, per_module, prompt_len)
    drafters = {name: DrafterConfig.from_folder(folder) for name, folder in
                (("dspark", dspark_dir), ("dflash", dflash_dir))}
    layer_ids = drafters["dspark"].target_layer_ids
    if drafters["dflash"].target_layer_ids != layer_ids:
        raise click.UsageError("the two drafters must read the same target layers to share one target")
    target = TargetModel.from_pretrained(target_dir, layer_ids)
    results: dict = {"target_heldout": demo_eval.heldout_loss(target, streams),
                     "prompts": len(prompts), "prompt_len": prompt_len, "new_tokens": new_tokens,
                     "heldout_modules": list(corpus.HELD_OUT_MODULES),
                     "decoder": "dspark.runtime.reference_decoder",
                     "torch_threads": torch.get_num_threads(), "runs": {}, "autoregressive": {}}
    for temperature in (0.0, 1.0):
        tag = "greedy" if temperature == 0 else "t1"
        for name, folder in (("dspark", dspark_dir), ("dflash", dflash_dir)):
            drafter = DSparkDrafter.from_pretrained(folder, target=target)
            run = demo_eval.evaluate_drafter(target, drafter, prompts, temperature=temperature,
                                             new_tokens=new_tokens, seed=seed)
            results["runs"][f"{name}_{tag}"] = run
            click.echo(f"{name} {tag}: mean accepted length {run['mean_acceptance_length']:.3f} "
                       f"({run['rounds']} rounds, {run['tokens_per_second']} tok/s)")
        results["autoregressive"][tag] = demo_eval.evaluate_autoregressive(
            target, prompts, temperature=temperature, new_tokens=new_tokens, seed=seed)
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    demo_eval.plot(results, out / "acceptance.png")
    click.echo(f"wrote {out / 'eval.json'} and {out / 'acceptance.png'}")


@train.command("standin", cls=OneLineErrors)
@click.option("--target", "target_dir", type=_PATH, default=None,
              help="Target checkpoint folder to inflate. [default: the bundled demo target]")
@click.option("--params", "params_text", default="100M", show_default=True,
              help="Size to reach: 100M, 1.5B, 250k, a plain count, or a multiple of the target (4x).")
@click.option("--out", type=_PATH, default=None, help="Folder to write. [default: <cache>/standin-<params>]")
@click.option("--force", is_flag=True, help="Rewrite the stand-in even if an identical one is there.")
@click.option("--progress/--no-progress", default=True)
def standin_command(target_dir: Path | None, params_text: str, out: Path | None, force: bool, progress: bool) -> None:
    """A COST STAND-IN: the target widened by function-preserving transforms to >= --params
    parameters, so its drafter's acceptance stays while each step costs what that size costs."""
    from tqdm import tqdm

    from dspark.models import TargetConfig
    from dspark.models.inflate import (
        KV_PER_PARAM,
        InflateError,
        count_params,
        format_params,
        inflate_checkpoint,
        is_current,
        parse_params,
        plan_inflation,
        standin_label,
    )

    from .demo_engine import DEMO_TARGET, cache_root

    demo = target_dir is None
    target_dir = DEMO_TARGET if demo else target_dir
    if not target_dir.is_dir():
        raise click.BadParameter(f"{target_dir} is not a folder", param_hint="--target")
    try:
        config = TargetConfig.from_folder(target_dir)
        params = parse_params(params_text, count_params(config))
        plan_inflation(config, params)  # refuse a bad size before any output
        if out is None:
            name = format_params(params) if demo else f"{target_dir.resolve().name}-{format_params(params)}"
            out = cache_root() / f"standin-{name}"
        if not force and is_current(out, target_dir, params, KV_PER_PARAM):
            click.echo(f"up to date: {out}")
            click.echo(standin_label(out))
            return
        with tqdm(total=1 + config.num_hidden_layers, desc="dspark standin", unit="group",
                  disable=not progress) as bar:
            def step(what: str) -> None:
                bar.set_postfix_str(what)
                bar.update()

            section = inflate_checkpoint(target_dir, out, params, progress=step)
    except InflateError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"stand-in: {section['source_params']:,} -> {section['params']:,} parameters -> {out}")
    for transform in section["transforms"]:
        click.echo(f"  {transform}")
    click.echo(standin_label(out))


train.add_command(draft_model_command)
