"""`dspark generate`: speculative decoding of one prompt through the batched runtime."""

from __future__ import annotations

import json
import re
import time

import click

from .errors import OneLineErrors

_DIR = click.Path(exists=True, file_okay=False, path_type=str)


def _parse_ids(ctx: click.Context, param: click.Parameter, text: str | None) -> list[int] | None:
    """--prompt-ids as a non-empty list of ints, refused while parsing (before any model loads)."""
    if text is None:
        return None
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}") from None
    if not ids:
        raise click.BadParameter(f"expected at least one token id (e.g. 1,2,3), got {text!r}")
    return ids


def parse_device(ctx: click.Context, param: click.Parameter, text: str) -> str:
    """--device as a PyTorch device this runtime runs on: cpu, cuda or cuda:N (refused before any model loads)."""
    if not re.fullmatch(r"cpu|cuda(:\d+)?", text):
        raise click.BadParameter(f"expected cpu, cuda or cuda:N, got {text!r}")
    return text


@click.command("generate", cls=OneLineErrors)
@click.option("--engine", "engine_dir", type=_DIR,
              help="Engine or dspark-export directory (ONNX Runtime). Default: the bundled demo pair, built "
                   "into the user cache on first use.")
@click.option("--target", "target_dir", type=_DIR, help="Target checkpoint (PyTorch reference backend).")
@click.option("--drafter", "drafter_dir", type=_DIR, help="Drafter checkpoint (with --target).")
@click.option("--prompt", help="Prompt text (needs tokenizer.json in the engine or target directory).")
@click.option("--prompt-ids", callback=_parse_ids, help="Prompt token ids, comma-separated: 1,2,3.")
@click.option("--max-new-tokens", default=64, show_default=True, type=click.IntRange(min=1))
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(min=0.0))
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--scheduler", default="dspark", show_default=True,  # prefix_scheduler.MODES (no torch import here)
              type=click.Choice(["dspark", "async", "fixed", "threshold", "off"]),
              help="dspark: Algorithm 1; async: its §5.2 form, batch size from the confidences of two steps earlier.")
@click.option("--gamma", type=click.IntRange(min=0), help="Draft tokens per round for --scheduler fixed.")
@click.option("--threshold", default=0.5, show_default=True,
              help="Confidence cut-off for --scheduler threshold.")
@click.option("--prompt-lookup", default=3, show_default=True, type=click.IntRange(min=0),
              help="--scheduler dspark: requests may verify what followed their last N tokens earlier "
                   "instead of a DSpark block, where that is expected to pay; 0: off.")
@click.option("--lookup-tokens", type=click.IntRange(min=1),
              help="The longest prompt-lookup copy verified in one step (default: twice the block size).")
@click.option("--kv-mode", type=click.Choice(["concat", "static"]),
              help="Target KV mode. Default: concat, or static with --device cuda (fixed shapes: CUDA-graph replay).")
@click.option("--device", default="cpu", show_default=True, callback=parse_device,
              help="PyTorch device for --target/--drafter: cpu, or cuda (the KV cache stays on the GPU).")
@click.option("--json", "as_json", is_flag=True, help="Print ids, rounds, acceptance and speed as JSON.")
def generate(engine_dir, target_dir, drafter_dir, prompt, prompt_ids, max_new_tokens, temperature, seed,
             scheduler, gamma, threshold, prompt_lookup, lookup_tokens, kv_mode, device, as_json) -> None:
    """Generate with DSpark speculative decoding (lossless: same distribution as the target)."""
    from pathlib import Path

    from dspark.export.artifacts import read_tokenizer
    from dspark.runtime.api import Runtime, RuntimeOptions
    from dspark.runtime.prefix_scheduler import SchedulerConfig

    if engine_dir is not None and target_dir is not None:
        raise click.UsageError("give either --engine DIR or --target DIR --drafter DIR, not both")
    if target_dir is not None and drafter_dir is None:
        raise click.UsageError("--target needs --drafter")
    if device != "cpu" and target_dir is None:
        raise click.UsageError("--device runs the PyTorch backend: give --target DIR --drafter DIR (an engine's "
                               "backend is the one its engine.json names)")
    if (prompt is None) == (prompt_ids is None):
        raise click.UsageError("give exactly one of --prompt TEXT or --prompt-ids 1,2,3")
    if engine_dir is None and target_dir is None:
        from dspark.tools.demo_engine import demo_engine_dir

        engine_dir = str(demo_engine_dir())
    tokenizer = None
    if prompt is not None:
        tokenizer = read_tokenizer(Path(engine_dir or target_dir) / "tokenizer.json",
                                   "--prompt needs it; pass --prompt-ids instead")
        prompt_ids = tokenizer.encode(prompt).ids
    options = RuntimeOptions(
        scheduler=SchedulerConfig(scheduler, fixed_length=gamma, threshold=threshold, prompt_lookup=prompt_lookup,
                                  lookup_tokens=lookup_tokens),
        kv_mode=kv_mode or ("concat" if device == "cpu" else "static"),
        max_requests=1, max_seq_len=len(prompt_ids) + max_new_tokens + 64,
    )
    with (Runtime.load(engine_dir, options) if engine_dir
          else Runtime.from_checkpoints(target_dir, drafter_dir, options, device=device)) as runtime:
        begin = time.perf_counter()
        (result,) = runtime.generate(prompt_ids, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                                     stop=runtime.info.eos_token_ids)
        seconds = time.perf_counter() - begin
    tokenizer_file = Path(engine_dir or target_dir) / "tokenizer.json"
    if tokenizer is None and tokenizer_file.is_file():  # --prompt-ids: the text still helps a reader
        tokenizer = read_tokenizer(tokenizer_file, "replace or remove it")
    if as_json:
        click.echo(json.dumps({
            "output_ids": result.tokens, "text": tokenizer.decode(result.tokens) if tokenizer else None,
            "rounds": result.rounds,
            "mean_accepted_length": result.mean_acceptance_length,
            "acceptance_lengths": result.acceptance_lengths, "verified_tokens": result.verified_tokens,
            "tokens_per_second": len(result.tokens) / seconds, "finish_reason": result.finish_reason,
            "scheduler": scheduler,
        }))
    else:
        click.echo(tokenizer.decode(result.tokens) if tokenizer else ",".join(map(str, result.tokens)))
